"""Benchmark: peak memory and throughput of plain vs GradCache (--cache-chunk-size) MNRL batches.

all-MiniLM-L6-v2, MNRL on data/sick-pairs-train.jsonl (rows repeated to fill the large
batches), one process, fp32, through the full trainer itself: every configuration is a fresh
`python -m fsdp_embed ...` process, whose peak RSS (ru_maxrss, the whole run: imports, model,
optimizer, training and the final export) and training samples/s (metrics.jsonl summary) are
reported. Plain batches 32, 128, 512; cached (chunk 32) batches 32, 128, 512, 2048, 8192.

Targets: cached peak RSS at 8192 <= 1.5 x plain at 32; cached samples/s >= 1/1.5 of
plain at the same batch where plain fits (sentence-transformers documents 2-2.4x slower).

Run (CPU; about 12 minutes on 2 cores, most of it the batch-8192 step):
    python bench/bench_large_batch.py
    python bench/bench_large_batch.py --quick          # batches up to 512 only
Results are also written to bench/results/large_batch.json.
"""

import argparse
import json
import os
import resource
import runpy
import subprocess
import sys
import tempfile

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO_DIR, "data", "sick-pairs-train.jsonl")
PLAIN = [32, 128, 512]
CACHED = [32, 128, 512, 2048, 8192]


def child(train_args):
    """Run the full trainer in this process (as `python -m fsdp_embed` does), then report this
    process's peak RSS."""
    sys.argv = [os.path.join(REPO_DIR, "fsdp_embed", "__main__.py"), *train_args]
    sys.path.insert(0, REPO_DIR)
    try:
        runpy.run_module("fsdp_embed", run_name="__main__", alter_sys=True)
    finally:
        print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)


def repeated_data(folder, min_rows):
    """sick-pairs rows repeated until there are at least `min_rows` (duplicates are harmless
    for a throughput and memory measurement)."""
    with open(DATA) as f:
        rows = f.readlines()
    path = os.path.join(folder, "pairs.jsonl")
    with open(path, "w") as f:
        for i in range(max(1, -(-min_rows // len(rows)))):
            f.writelines(rows)
    return path


def measure(data, batch, chunk, steps, out_dir):
    args = [
        "--loss",
        "mnrl",
        "--train-data",
        data,
        "--per-device-batch-size",
        batch,
        "--max-steps",
        steps,
        "--max-seq-length",
        64,
        "--log-steps",
        steps,
        "--output-dir",
        out_dir,
        "--overwrite",
        "--warmup-ratio",
        0,
    ]
    if chunk:
        args += ["--cache-chunk-size", chunk]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR)
    peak = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_KB")]
    if proc.returncode != 0 or not peak:
        return {"batch": batch, "chunk": chunk, "error": proc.stderr.strip().splitlines()[-1:]}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        summary = [json.loads(line) for line in f][-1]
    return {
        "batch": batch,
        "chunk": chunk,
        "steps": steps,
        "peak_rss_mb": peak[0] / 1024,
        "samples_per_s": summary["samples_per_s"],
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="batches up to 512 only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        return child(rest[1:] if rest[:1] == ["--"] else rest)

    cached = [b for b in CACHED if not args.quick or b <= 512]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = repeated_data(tmp, 2 * max(cached))
        print("| mode | batch | steps | peak RSS (MB) | samples/s |")
        print("|---|---|---|---|---|")
        for chunk, batches in [(0, PLAIN), (32, cached)]:
            for batch in batches:
                # enough steps for a stable rate (at least 3, at least ~1000 rows); one step of the
                # huge batches already holds 2048 or 8192 rows
                steps = max(3, 1024 // batch) if batch <= 512 else 1
                r = measure(data, batch, chunk, steps, os.path.join(tmp, f"run-{chunk}-{batch}"))
                results.append(r)
                mode = f"cached (chunk {chunk})" if chunk else "plain"
                if "error" in r:
                    print(f"| {mode} | {batch} | {steps} | failed: {r['error']} | |", flush=True)
                else:
                    print(
                        f"| {mode} | {batch} | {steps} | {r['peak_rss_mb']:.0f} | {r['samples_per_s']:.1f} |",
                        flush=True,
                    )

    def find(batch, chunk):
        return next(
            (r for r in results if r["batch"] == batch and r["chunk"] == chunk and "error" not in r), None
        )

    base, largest = find(32, 0), find(max(cached), 32)
    if base and largest:
        print(
            f"\ncached peak RSS at {max(cached)} / plain at 32: "
            f"{largest['peak_rss_mb'] / base['peak_rss_mb']:.2f} (target <= 1.5)"
        )
    for batch in PLAIN:
        plain, cache = find(batch, 0), find(batch, 32)
        if plain and cache:
            print(
                f"batch {batch}: cached / plain samples/s = "
                f"{cache['samples_per_s'] / plain['samples_per_s']:.2f} (target >= 0.67)"
            )
    os.makedirs(os.path.join(REPO_DIR, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO_DIR, "bench", "results", "large_batch.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
