"""Benchmark: what a training set's size costs the full trainer before and during training, per
rank.

Synthetic pairs (anchor 8 words, positive 12, every row distinct), written here as Parquet (no
download), at each --rows size; `python -m fsdp_embed` on all-MiniLM-L6-v2, `--max-steps 3
--per-device-batch-size 32 --max-seq-length 32`, in one process and under torchrun at world 2. For
each worker process, sampled every 0.1 s from /proc: the peak anonymous memory (RssAnon: the Arrow
table is memory-mapped, file-backed, the kernel's to reclaim, and not counted) and the peak
resident set (VmHWM, which counts the mapped pages the run touched). Start-up: the run's wall time
less what the trainer's summary counts (training, evaluation, checkpoints, export), and the
summary's own `startup_seconds` (from the start of fsdp_embed.__main__.main to the first step,
without the interpreter's start and imports), each with a cold cache (the data set's Arrow cache
there, every token file of `--tokenize once` removed) and a warm one (the run after it); the first
run's wall time and peak anonymous memory, which include converting the Parquet file once into
that cache (datasets' own work), are reported beside them. The runs use a data set cache of their
own (HF_DATASETS_CACHE in the work folder). samples/s: the trainer's own summary. Growth: per row
between the smallest and each larger size (bytes/row), and start-up seconds more, cold and warm.

Run (a quiet machine; ~20 minutes on 2 CPU cores at the default sizes, ~4 GB of disk per 10M rows):
    python bench/bench_data_scale.py                          # 1M and 8M rows, world 1 and 2
    python bench/bench_data_scale.py --rows 1000000,8000000,30000000
    python bench/bench_data_scale.py --extra=--tokenize=once   # any further trainer flags
"""

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
WORDS = (
    "the a man woman child dog cat bird runs walks sits jumps on in under over park street river "
    "house car tree red blue green small large quickly slowly happily near far old young music "
    "plays reads writes food eats drinks water ball field city night day sun rain snow"
).split()


def write_pairs(path, num_rows, seed=0):
    """num_rows distinct (anchor, positive) pairs as Parquet, a million rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    base = [(" ".join(rng.choices(WORDS, k=8)), " ".join(rng.choices(WORDS, k=12))) for _ in range(100_000)]
    with pq.ParquetWriter(path, pa.schema([("anchor", pa.string()), ("positive", pa.string())])) as writer:
        for start in range(0, num_rows, 1_000_000):
            rows = range(start, min(num_rows, start + 1_000_000))
            anchors = [f"{base[i % len(base)][0]} {i}" for i in rows]
            positives = [f"{base[i % len(base)][1]} number {i}" for i in rows]
            writer.write_table(pa.table({"anchor": anchors, "positive": positives}))


def children(pid):
    """Every process below `pid` (torchrun's agent, its workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            found += [kid, *children(kid)]
    return found


def status_kb(pid, key):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def is_worker(pid):
    """A process of the full trainer itself, `python [-u] -m fsdp_embed ...`, not torchrun's agent
    (`python -m torch.distributed.run ... -m fsdp_embed ...`, whose command line names it too)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"-m" in command and command[command.index(b"-m") + 1] == b"fsdp_embed"


def run(data_file, world_size, out_dir, extra):
    """One run of the full trainer: (wall seconds, its summary, {pid: (peak RssAnon, peak VmHWM)}
    in bytes)."""
    flags = ["--train-data", str(data_file), "--max-steps", "3", "--per-device-batch-size", "32"]
    flags += ["--max-seq-length", "32", "--output-dir", str(out_dir), "--overwrite", *extra]
    if world_size == 1:
        command = [sys.executable, "-m", "fsdp_embed", *flags]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}"]
        command += [f"--master_port={port}", "-m", "fsdp_embed", *flags]
    started = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peaks = {}
    output = []
    import threading

    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        for pid in [proc.pid, *children(proc.pid)]:
            if not is_worker(pid):
                continue
            anon, hwm = status_kb(pid, "RssAnon"), status_kb(pid, "VmHWM")
            if anon is not None:
                old = peaks.get(pid, (0, 0))
                peaks[pid] = (max(old[0], anon * 1024), max(old[1], (hwm or 0) * 1024))
        time.sleep(0.1)
    wall = time.perf_counter() - started
    reader.join()
    text = "".join(output)
    if proc.returncode != 0:
        raise RuntimeError(f"fsdp_embed failed ({proc.returncode}):\n{text[-3000:]}")
    summary = next(
        json.loads(line) for line in reversed(text.splitlines()) if line.startswith('{"final_loss"')
    )
    return wall, summary, peaks


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1000000,8000000", help="comma-separated data set sizes")
    parser.add_argument("--worlds", default="1,2", help="comma-separated numbers of processes")
    parser.add_argument("--work-dir", default=None, help="where the data and runs go (default: a temp dir)")
    parser.add_argument("--extra", default="", help="further flags of the full trainer, space-separated")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "cache")  # the runs' data set cache, token files too
    extra = args.extra.split()
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "runs": []}
    for num_rows in [int(r) for r in args.rows.split(",")]:
        data_file = work / f"pairs-{num_rows}.parquet"
        if not data_file.exists():
            started = time.perf_counter()
            write_pairs(data_file, num_rows)
            print(f"{num_rows} rows written in {time.perf_counter() - started:.0f} s", flush=True)
        for world_size in [int(w) for w in args.worlds.split(",")]:
            first_wall, _, first_peaks = run(
                data_file, world_size, work / "out", extra
            )  # converts it to Arrow
            for token_file in Path(os.environ["HF_DATASETS_CACHE"]).rglob("tokens-*"):
                token_file.unlink()  # a cold cache: converted, no token file (--tokenize once writes one)
            cold_wall, cold, _ = run(data_file, world_size, work / "out", extra)
            wall, summary, peaks = run(data_file, world_size, work / "out", extra)  # warm
            counted = sum(summary.get(k, 0) for k in ("train_seconds", "eval_seconds", "checkpoint_seconds"))
            cold_counted = sum(
                cold.get(k, 0) for k in ("train_seconds", "eval_seconds", "checkpoint_seconds")
            )
            row = {
                "rows": num_rows,
                "world_size": world_size,
                "first_run_s": round(first_wall, 1),
                "first_run_peak_anon_mb": [round(anon / 2**20) for anon, _ in first_peaks.values()],
                "cold_startup_s": round(cold_wall - cold_counted - cold.get("export_seconds", 0), 1),
                "cold_startup_seconds_summary": round(cold["startup_seconds"], 1),
                "startup_s": round(wall - counted - summary.get("export_seconds", 0), 1),
                "startup_seconds_summary": round(summary["startup_seconds"], 1),
                "samples_per_s": round(summary["samples_per_s"], 1),
                "peak_anon_mb": [round(anon / 2**20) for anon, _ in peaks.values()],
                "peak_rss_mb": [round(hwm / 2**20) for _, hwm in peaks.values()],
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    by = {(r["rows"], r["world_size"]): r for r in results["runs"]}
    smallest = min(r["rows"] for r in results["runs"])
    for (rows, world), r in sorted(by.items()):
        if rows == smallest:
            continue
        base = by[smallest, world]
        r["anon_bytes_per_row"] = round(
            (max(r["peak_anon_mb"]) - max(base["peak_anon_mb"])) * 2**20 / (rows - smallest), 1
        )
        r["startup_s_more"] = round(r["startup_s"] - base["startup_s"], 1)
        r["cold_startup_s_more"] = round(r["cold_startup_s"] - base["cold_startup_s"], 1)
        print(
            f"{smallest} -> {rows} rows, world {world}: "
            f"RssAnon {r['anon_bytes_per_row']} bytes/row per rank, "
            f"start-up +{r['cold_startup_s_more']} s cold, +{r['startup_s_more']} s warm",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
