"""Benchmark: what Matryoshka training buys. all-MiniLM-L6-v2 (384 dimensions) fine-tuned with
CoSENT on STS-B train, once plainly and once with --matryoshka-dims 384,128,64,32 (the same seed,
data, steps and hyper-parameters), and the base model untouched; each scored on the held-out STS-B
dev set (Spearman x 100 of cosine similarity) at 384, 128, 64 and 32 dimensions (the first d
dimensions of each embedding), through the full trainer itself (`python -m fsdp_embed`;
--eval-only for the base model).

Run (CPU, one process; about 22 minutes on 2 cores):
    python bench/bench_matryoshka.py
    python bench/bench_matryoshka.py --max-steps 60     # shorter
Results are also written to bench/results/matryoshka.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_DIR, "data")
DIMS = [384, 128, 64, 32]


def run(args, out):
    subprocess.run(
        [sys.executable, "-m", "fsdp_embed", *map(str, args), "--output-dir", out],
        cwd=REPO_DIR,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def scores(model, dev, out):
    """stsb-dev Spearman of `model` at each size, by the same --eval-only run for every model."""
    run(
        ["--model", model, "--eval-only", "--eval-data", dev, "--matryoshka-dims", ",".join(map(str, DIMS))],
        out,
    )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        evaluation = [json.loads(line)["eval"] for line in f if '"eval"' in line][-1]
    return {d: round(evaluation[f"stsb-dev/spearman@{d}"], 2) for d in DIMS}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=180,
        help="optimizer steps of batch 32 (180: one epoch of STS-B train)",
    )
    args = parser.parse_args()
    dev = os.path.join(DATA_DIR, "stsb-dev.jsonl")
    common = [
        "--loss",
        "cosent",
        "--train-data",
        os.path.join(DATA_DIR, "stsb-train.jsonl"),
        "--max-steps",
        args.max_steps,
        "--per-device-batch-size",
        32,
        "--lr",
        2e-5,
        "--seed",
        12,
    ]
    results = {
        "model": "all-MiniLM-L6-v2",
        "loss": "cosent",
        "train": "stsb-train",
        "steps": args.max_steps,
        "batch": 32,
        "metric": "stsb-dev spearman x 100 at the first d dimensions",
        "machine": platform.processor() or platform.machine(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        results["base model"] = scores("all-MiniLM-L6-v2", dev, os.path.join(tmp, "base"))
        print("base model", results["base model"], flush=True)
        run(common, os.path.join(tmp, "plain"))
        results["fine-tuned"] = scores(
            os.path.join(tmp, "plain", "final"), dev, os.path.join(tmp, "plain-eval")
        )
        print("fine-tuned", results["fine-tuned"], flush=True)
        run([*common, "--matryoshka-dims", ",".join(map(str, DIMS))], os.path.join(tmp, "matryoshka"))
        results["fine-tuned with Matryoshka"] = scores(
            os.path.join(tmp, "matryoshka", "final"), dev, os.path.join(tmp, "matryoshka-eval")
        )
        print("fine-tuned with Matryoshka", results["fine-tuned with Matryoshka"], flush=True)
    print("\n| model | " + " | ".join(f"{d} dims" for d in DIMS) + " |\n|---|" + "---|" * len(DIMS))
    for name in ("base model", "fine-tuned", "fine-tuned with Matryoshka"):
        print(f"| {name} | " + " | ".join(f"{results[name][d]:.2f}" for d in DIMS) + " |")
    os.makedirs(os.path.join(REPO_DIR, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO_DIR, "bench", "results", "matryoshka.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
