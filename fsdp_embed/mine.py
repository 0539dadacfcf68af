"""Mine hard negatives for (anchor, positive) pairs with an embedding model, the corpus sharded
across ranks: sentence-transformers' `mine_hard_negatives`, by processes.

    python -m fsdp_embed.mine --data pairs.jsonl --output mined.jsonl          # one process
    torchrun --nproc_per_node=4 -m fsdp_embed.mine --data pairs.jsonl --output mined.jsonl \\
        --corpus corpus.jsonl --num-negatives 5 --relative-margin 0.05 --output-format grouped
    python -m fsdp_embed.mine --help                                           # every flag

What it does (every rank runs the same code, all ranks participate; gloo on CPU, NCCL on CUDA):
  1. Every rank reads the same rows and checks them, then loads the same whole model
     (embedding_model.load_model: a SentenceTransformer folder's pooling, max length, casing and
     prompts kept). The queries are the distinct anchors; the corpus is the distinct texts of
     (--corpus, then the positives), in that order, as sentence-transformers builds it.
  2. Every rank encodes its share of the queries and of the corpus (eval_dist.encode /
     encode_local). The query embeddings are summed onto every rank; the corpus stays sharded:
     a rank keeps only the embeddings it encoded.
  3. eval_dist.top_k_sharded scores --chunk-size queries at a time against the rank's shard (in
     blocks of rows), keeps each query's best K = range_max + max_positives and merges the
     ranks' offers with one all_reduce per chunk: no rank ever holds a queries x corpus score
     matrix, nor a chunk x shard one. Exact score ties go to the lower corpus index.
  4. Rank 0 then applies mine_hard_negatives' rules exactly: positives masked, --absolute-margin
     / --relative-margin against the query's lowest positive score, --max-score, --min-score,
     the best range_max survivors, the first range_min skipped, then `top` or `random` (with
     random.Random(seed), drawn per query in sentence-transformers' order: the negatives equal
     theirs after random.seed(seed)). It writes n-tuple, triplet or grouped rows atomically
     (a temporary file in the same folder, renamed) and prints sentence-transformers' statistics.
Bad input (flags, rows, an existing --output; then the model) stops every rank before any heavy
work, with one `error:` line from rank 0 and exit code 2; nothing is written.

Left out on purpose: models that do not fit on one device (every rank holds the whole model:
inference needs no FSDP), cross-encoder rescoring, the labeled-pair and labeled-list formats,
FAISS, embedding caches, a BEIR corpus's titles (only its `text` column is read).

Needs torch, transformers, datasets, and fsdp_embed/config.py, fsdp_embed/training_data.py,
fsdp_embed/embedding_model.py (`ModelSpec`, `load_model`: the model as the trainer loads it),
eval_dist.py, fsdp_utils.py and fsdp_embed/startup_checks.py (`agree_on_error`).
Its whole copy set (what it needs, directly or through another): eval_dist.py, fsdp_utils.py,
fsdp_embed/checkpoint_warnings.py, fsdp_embed/checkpoints.py, fsdp_embed/config.py,
fsdp_embed/embedding_model.py, fsdp_embed/faults.py, fsdp_embed/inference_free.py, fsdp_embed/lora.py,
fsdp_embed/random_state.py,
fsdp_embed/shard_loading.py, fsdp_embed/splade.py, fsdp_embed/st_folder.py,
fsdp_embed/startup_checks.py, fsdp_embed/training_data.py.
"""

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F

import eval_dist
import fsdp_utils
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import startup_checks
from fsdp_embed import training_data

OUTPUT_FORMATS = ("triplet", "n-tuple", "grouped")


def main(argv=None):
    """Mine, write the output on rank 0, and return the exit code: 0, or 2 for bad input (after
    one `error:` line from rank 0). Every rank runs it (all ranks participate); `argv`:
    sys.argv[1:] when None."""
    try:
        args, bad_flags = parse_args(argv), None
    except BadFlags as e:  # every rank parses the same flags: all stop at `agreed` below
        args, bad_flags = None, str(e)
    rank, world_size, device = fsdp_utils.setup_dist(args.dist_timeout_minutes if args else 30.0)
    if rank != 0:
        datasets.disable_progress_bars()  # one "Generating train split" bar per file, not per rank
    try:
        try:
            # both: the cheap checks first, so a bad flag or file stops
            # every rank before any of them loads the model.
            plan = agreed(rank, device, make_plan, args, rank, bad_flags)
            plan.loaded = agreed(rank, device, load_model, args, device)
        except Refused as e:
            fsdp_utils.print0(f"error: {e}", file=sys.stderr)
            # all agreed on the error; rank 0 has printed before any
            # exits, as torchrun stops the other ranks as soon as one leaves with an error.
            if dist.is_initialized():
                dist.barrier()  # (all ranks participate)
            return 2
        started = time.perf_counter()
        describe(plan, args, world_size)
        candidates = find_candidates(plan, args)  # encoding and top k
        if rank == 0:
            mined = select_negatives(plan, args, *candidates)
            written = output_rows(plan, args, mined)
            write_atomically(args.output, written.rows)
            print_statistics(args, mined, written)
            fsdp_utils.print0(
                f"wrote {len(written.rows):,} rows to {args.output} ({args.output_format}) "
                f"in {time.perf_counter() - started:.1f}s at world size {world_size}"
            )
        return 0
    finally:
        fsdp_utils.cleanup_dist()


class Refused(ValueError):
    """Bad input that every rank found, or was told of."""


def agreed(rank, device, function, *args):
    """function(*args) on every rank, then one verdict for all: its result, or Refused with the
    first failing rank's message on every rank, so no rank walks on into a collective that would
    hang. Two collectives (all ranks participate): startup_checks.agree_on_error."""
    result, error = None, None
    try:
        result = function(*args)
    except (ValueError, OSError) as e:  # OSError: a model folder transformers cannot read
        error = str(e)
    error = startup_checks.agree_on_error(error, rank, device)
    if error is not None:
        raise Refused(error)
    return result


# ----------------------------------------------------------------------------------------------
# The command line


# The flags, in --help's order: (section, flag, argparse keyword arguments). Each name is
# mine_hard_negatives' argument with dashes (--range-max: range_max), except where docs/mining.md
# says otherwise.
FLAGS = [
    (
        "data and output",
        "--data",
        dict(required=True, help="(anchor, positive) rows: .jsonl/.json/.csv/.parquet"),
    ),
    ("data and output", "--output", dict(required=True, help="the .jsonl file to write (by rank 0)")),
    ("data and output", "--overwrite", dict(action="store_true", help="replace an existing --output")),
    ("data and output", "--anchor-column", dict(default="", help="the anchor column; empty: the first")),
    ("data and output", "--positive-column", dict(default="", help="the positive column; empty: the second")),
    (
        "data and output",
        "--corpus",
        dict(
            default="",
            help="more candidate texts: a file with a `text` column (of a BEIR corpus.jsonl only `text` is "
            "read, not `title`); the positives are candidates too",
        ),
    ),
    (
        "data and output",
        "--output-format",
        dict(
            default="triplet",
            choices=OUTPUT_FORMATS,
            help="triplet: (anchor, positive, negative), a row per negative found; n-tuple: (anchor, "
            "positive, negative_1..negative_n), only rows with all n found; grouped: a row per query "
            "{query, pos: [...], neg: [...]}, queries with at least one negative (python -m fsdp_embed "
            "reads it, with --group-size)",
        ),
    ),
    (
        "data and output",
        "--output-scores",
        dict(
            action="store_true",
            help="also write the cosine scores: `scores` [positive, negatives...] (triplet, n-tuple); "
            "`pos_scores`, `neg_scores` (grouped)",
        ),
    ),
    (
        "which negatives",
        "--num-negatives",
        dict(type=int, default=3, help="negatives per query"),
    ),
    (
        "which negatives",
        "--range-min",
        dict(type=int, default=0, help="skip this many of the best candidates"),
    ),
    (
        "which negatives",
        "--range-max",
        dict(
            type=int,
            default=None,
            help="consider only the best this many candidates; unset: range_min + num_negatives + "
            "max_positives, or range_min + 10 x num_negatives + max_positives with a margin or --max-score "
            "(max_positives: the most rows an anchor has)",
        ),
    ),
    (
        "which negatives",
        "--max-score",
        dict(type=float, default=None, help="drop candidates scoring above this"),
    ),
    (
        "which negatives",
        "--min-score",
        dict(type=float, default=None, help="drop candidates scoring below this"),
    ),
    (
        "which negatives",
        "--absolute-margin",
        dict(
            type=float,
            default=None,
            help="drop candidates whose score + margin > p, p the query's lowest positive score",
        ),
    ),
    (
        "which negatives",
        "--relative-margin",
        dict(type=float, default=None, help="drop candidates scoring above p - |p| x margin (p: as above)"),
    ),
    (
        "which negatives",
        "--sampling-strategy",
        dict(
            default="top",
            choices=("top", "random"),
            help="top: the best candidates left; random: drawn among them from --seed",
        ),
    ),
    (
        "which negatives",
        "--include-positives",
        dict(
            action="store_true",
            help="leave the positives among the candidates (a full ranking, for evaluating rerankers); "
            "with --output-format n-tuple",
        ),
    ),
    ("which negatives", "--seed", dict(type=int, default=12, help="seeds --sampling-strategy random")),
    (
        "model and encoding",
        "--model",
        dict(default="all-MiniLM-L6-v2", help="SentenceTransformer or HF folder"),
    ),
    (
        "model and encoding",
        "--max-seq-length",
        dict(type=int, default=0, help="truncate texts to this many tokens; 0: the model's"),
    ),
    (
        "model and encoding",
        "--pooling",
        dict(default="", choices=("", *config.POOLING_MODES), help="token pooling; empty: the model's"),
    ),
    ("model and encoding", "--append-eos", dict(action="store_true", help="end every text with EOS")),
    ("model and encoding", "--trust-remote-code", dict(action="store_true", help="run a hub model's code")),
    (
        "model and encoding",
        "--query-prompt",
        dict(default=None, help="prefix of every query; unset: the model's `query` prompt, if any"),
    ),
    (
        "model and encoding",
        "--corpus-prompt",
        dict(default=None, help="prefix of every corpus text; unset: the model's `document` prompt, if any"),
    ),
    ("model and encoding", "--batch-size", dict(type=int, default=32, help="texts per forward, per rank")),
    (
        "model and encoding",
        "--chunk-size",
        dict(
            type=int,
            default=1024,
            help="queries scored at a time against each rank's corpus shard: memory, not results "
            "(sentence-transformers' faiss_batch_size)",
        ),
    ),
    (
        "model and encoding",
        "--dist-timeout-minutes",
        dict(type=float, default=30.0, help="how long a collective waits for the other ranks"),
    ),
]


class BadFlags(ValueError):
    pass


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default after its help."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # Not argparse's exit from every rank: bad flags go the way of any bad input (main).
        raise BadFlags(f"{message}; see python -m fsdp_embed.mine --help")


def parse_args(argv):
    parser = Parser(prog="python -m fsdp_embed.mine", description=__doc__, formatter_class=HelpFormatter)
    groups = {}
    for section, flag, kwargs in FLAGS:
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        groups[section].add_argument(flag, **kwargs)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# The plan: inputs read and checked the same way on every rank, before any collective


@dataclasses.dataclass
class Plan:
    anchor_column: str
    positive_column: str
    queries: list  # the distinct anchors, first-seen order
    corpus: list  # the distinct texts of (--corpus, then the positives)
    positive_rows: list  # per query: its distinct positives' corpus indices, first-seen order
    rows_per_query: list  # per query: its rows in --data (duplicate pairs counted)
    max_positives: int
    range_max: int
    loaded: object = None  # embedding_model.LoadedModel, once every rank has checked the rest

    def positive_counts(self):
        return [len(rows) for rows in self.positive_rows]

    def prompts(self, args):
        """(query prefix, corpus prefix): the flags, else the model's "query" / "document" prompts,
        as sentence-transformers' encode_query / encode_document take them."""
        named = self.loaded.named_prompts
        query = args.query_prompt if args.query_prompt is not None else named.get("query")
        corpus = args.corpus_prompt if args.corpus_prompt is not None else named.get("document")
        return query or "", corpus or ""


def make_plan(args, rank, bad_flags=None):
    """Read and check everything; raises ValueError naming the culprit and the fix."""
    if bad_flags:
        raise ValueError(bad_flags)
    check_flags(args)
    if rank == 0:  # the writer's disk decides; agree_on_error tells the other ranks
        check_output(args)
    anchors, positives, anchor_column, positive_column = read_pairs(args)
    rows_per_query = collections.Counter(anchors)
    max_positives = max(rows_per_query.values())
    range_max = check_range(args, max_positives)
    external = read_corpus(args.corpus) if args.corpus else positives
    corpus = list(dict.fromkeys(external + positives))
    corpus_index = {text: i for i, text in enumerate(corpus)}
    queries = list(dict.fromkeys(anchors))
    query_index = {text: i for i, text in enumerate(queries)}
    positive_rows = [[] for _ in queries]
    for anchor, positive in zip(anchors, positives):
        rows = positive_rows[query_index[anchor]]
        if corpus_index[positive] not in rows:
            rows.append(corpus_index[positive])
    return Plan(
        anchor_column,
        positive_column,
        queries,
        corpus,
        positive_rows,
        [rows_per_query[q] for q in queries],
        max_positives,
        range_max,
    )


def load_model(args, device):
    """The model as the trainer (__main__.py) loads it (embedding_model.load_model), for inference
    on `device`."""
    spec = embedding_model.ModelSpec(
        path=args.model,
        max_seq_length=args.max_seq_length,
        pooling=args.pooling,
        append_eos=args.append_eos,
        trust_remote_code=args.trust_remote_code,
    )
    loaded = embedding_model.load_model(spec)
    loaded.model.to(device)
    return loaded


def check_flags(args):
    for flag, value in (("--batch-size", args.batch_size), ("--chunk-size", args.chunk_size)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.max_seq_length < 0:
        raise ValueError(f"--max-seq-length {args.max_seq_length}: must be 0 (the model's) or more")
    if args.include_positives and args.output_format != "n-tuple":
        # sentence-transformers switches to n-tuple (with a warning): the ranking keeps its order.
        raise ValueError(
            f"--include-positives writes ranked n-tuple rows; pass --output-format n-tuple "
            f"(not {args.output_format})"
        )


def check_output(args):
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.exists(args.output) and not args.overwrite:
        raise ValueError(f"--output {args.output} already exists; pass --overwrite to replace it")
    if not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output {args.output}: cannot write in {folder}")


def read_pairs(args):
    """(anchors, positives, anchor column, positive column) from --data."""
    ds = training_data.load_data(args.data, "train", flag="--data")
    columns = ds.column_names
    if len(ds) == 0:
        raise ValueError(f"--data {args.data}: the file holds no rows")
    if len(columns) < 2 and not (args.anchor_column and args.positive_column):
        raise ValueError(
            f"--data {args.data}: one column {columns}; it needs an anchor and a positive column"
        )
    # sentence-transformers falls back to the first two columns when a name is not found; a
    # misspelt name here is an error instead, so a run never mines from the wrong column.
    named = []
    for flag, name, default in (
        ("--anchor-column", args.anchor_column, columns[0]),
        ("--positive-column", args.positive_column, columns[min(1, len(columns) - 1)]),
    ):
        if name and name not in columns:
            raise ValueError(
                f"{flag} {name}: no such column in {args.data} (it has {columns}); pass one of them"
            )
        named.append(name or default)
    if named[0] == named[1]:
        raise ValueError(f"--anchor-column and --positive-column are both {named[0]}; name two columns")
    anchors, positives = (checked_texts(ds[c][:], f"--data {args.data} column {c}") for c in named)
    return anchors, positives, named[0], named[1]


def read_corpus(path):
    ds = training_data.load_data(path, "train", flag="--corpus")
    if "text" not in ds.column_names:
        raise ValueError(
            f"--corpus {path}: no `text` column (it has {ds.column_names}); one text per row under `text`"
        )
    return checked_texts(ds["text"][:], f"--corpus {path} column text")


def checked_texts(values, where):
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value.strip():
            what = "no text" if value is None else "an empty text" if isinstance(value, str) else f"{value!r}"
            raise ValueError(f"{where}: row {i} has {what}; remove or fill it")
    return list(values)


def check_range(args, max_positives):
    """range_max, derived as sentence-transformers derives it, and its checks (its messages, in
    the flags' words)."""
    if args.num_negatives < 1:
        raise ValueError(f"--num-negatives must be at least 1, got {args.num_negatives}")
    range_max, range_min = args.range_max, args.range_min
    if range_max is None:
        filters = (args.absolute_margin, args.relative_margin, args.max_score)
        # room for filtered candidates (10 per negative), the positives, and range_min skipped
        per_negative = 10 if any(f is not None for f in filters) else 1
        range_max = range_min + args.num_negatives * per_negative + max_positives
    if range_min < 0:
        raise ValueError(f"--range-min must be non-negative, got {range_min}")
    if range_min >= range_max:
        raise ValueError(f"--range-min must be smaller than --range-max, got {range_min} and {range_max}")
    if args.num_negatives > range_max - range_min:
        raise ValueError(
            f"cannot mine {args.num_negatives} negatives per query: only {range_max - range_min} "
            f"candidates remain after skipping the first --range-min {range_min} of --range-max "
            f"{range_max}; decrease --num-negatives or --range-min, or increase --range-max"
        )
    return range_max


# ----------------------------------------------------------------------------------------------
# Candidates: encoding and the sharded top-k (all ranks participate)


def find_candidates(plan, args):
    """(scores_QK, rows_QK, positive_scores_P) on every rank: each query's best K corpus rows
    (K = range_max + max_positives, as sentence-transformers retrieves) and the score of every
    (query, positive) pair, queries in order, each query's positives in order. Encoding and the
    top k are collective (all ranks participate)."""
    loaded = plan.loaded
    query_prompt, corpus_prompt = plan.prompts(args)

    def tokenizer(prompt):
        # as batches.with_prompt; the prompt's tokens left out of pooling under include_prompt False
        return lambda texts: loaded.tokenize([prompt + text for text in texts], prompts=[prompt] * len(texts))

    # both calls (forwards and collectives inside): the queries on
    # every rank, the corpus sharded (rows_R are the corpus rows this rank encoded).
    query_QD = eval_dist.encode(loaded.model, tokenizer(query_prompt), plan.queries, args.batch_size)
    rows_R, corpus_RD = eval_dist.encode_local(
        loaded.model, tokenizer(corpus_prompt), plan.corpus, args.batch_size
    )
    query_QD, corpus_RD = F.normalize(query_QD, dim=-1), F.normalize(corpus_RD, dim=-1)  # cosine
    k = plan.range_max + plan.max_positives
    # ceil(Q / chunk_size) all_reduces, the same on every rank.
    scores_QK, rows_QK = eval_dist.top_k_sharded(query_QD, corpus_RD, rows_R, k, args.chunk_size)
    positive_P = positive_scores(plan, query_QD, rows_R, corpus_RD)
    return scores_QK.cpu(), rows_QK.cpu(), positive_P.cpu()


def positive_scores(plan, query_QD, rows_R, corpus_RD):
    """The cosine of every (query, positive) pair, as a flat vector over the queries' positive
    lists. The rank holding the positive's embedding scores it; one all_reduce (all ranks participate)."""
    query_P = [q for q, rows in enumerate(plan.positive_rows) for _ in rows]
    row_P = torch.tensor([r for rows in plan.positive_rows for r in rows], device=query_QD.device)
    column_of_row = torch.full((len(plan.corpus),), -1, dtype=torch.long, device=query_QD.device)
    column_of_row[rows_R] = torch.arange(len(rows_R), device=query_QD.device)
    local_P = (column_of_row[row_P] >= 0).nonzero().squeeze(1)  # the pairs whose positive is here
    scores_P = torch.zeros(len(row_P), dtype=torch.float64, device=query_QD.device)
    query_rows = torch.tensor(query_P, device=query_QD.device)[local_P]
    scores_P[local_P] = (query_QD[query_rows] * corpus_RD[column_of_row[row_P[local_P]]]).sum(-1).double()
    if dist.is_initialized():
        # (all ranks participate): each pair was scored by exactly one rank, so the sum IS its
        # score (x + 0).
        dist.all_reduce(scores_P, op=dist.ReduceOp.SUM)
    return scores_P.float()


# ----------------------------------------------------------------------------------------------
# Negatives: mine_hard_negatives' rules, on rank 0 (no collective from here on)


@dataclasses.dataclass
class Mined:
    negative_scores_QN: torch.Tensor  # -inf: no negative found in that slot
    negative_rows_QN: torch.Tensor
    positive_scores_P: torch.Tensor
    skipped: dict  # filter name -> (candidates it removed, their share of those left before it)


def select_negatives(plan, args, scores_QK, rows_QK, positive_scores_P):
    """Each query's negatives from its K candidates, exactly as sentence-transformers' (from
    `scores[indices == -1] = -inf` to the sampling), stable sorts instead of torch.topk."""
    scores_QK = scores_QK.clone()
    scores_QK[rows_QK == -1] = float("-inf")
    if not args.include_positives:
        positives_QP = torch.full((len(plan.queries), plan.max_positives), -2, dtype=torch.long)
        for q, rows in enumerate(plan.positive_rows):
            positives_QP[q, : len(rows)] = torch.tensor(rows)
        is_positive_QK = (rows_QK.unsqueeze(-1) == positives_QP.unsqueeze(1)).any(-1)
        scores_QK[is_positive_QK] = float("-inf")
    skipped = apply_filters(plan, args, scores_QK, positive_scores_P)
    # The best range_max (stable: equal scores keep the lower corpus index first), range_min skipped.
    order_QK = scores_QK.argsort(dim=1, descending=True, stable=True)[:, : plan.range_max]
    scores_QN = scores_QK.gather(1, order_QK)[:, args.range_min :]
    rows_QN = rows_QK.gather(1, order_QK)[:, args.range_min :]
    if args.sampling_strategy == "top":
        scores_QN, rows_QN = scores_QN[:, : args.num_negatives], rows_QN[:, : args.num_negatives]
    else:
        # As sentence-transformers: draw among the finite candidates where there are enough
        # (else some -inf slots are drawn: not found), one query after the other, then re-sort.
        num_options_Q = (scores_QN.shape[1] - scores_QN.isinf().sum(1)).clamp(min=args.num_negatives)
        rng = random.Random(args.seed)
        drawn_QN = torch.tensor(
            [rng.sample(range(options), k=args.num_negatives) for options in num_options_Q.tolist()],
            dtype=torch.long,
        ).reshape(len(plan.queries), args.num_negatives)
        scores_QN, rows_QN = scores_QN.gather(1, drawn_QN), rows_QN.gather(1, drawn_QN)
        by_score_QN = scores_QN.argsort(dim=1, descending=True, stable=True)
        scores_QN, rows_QN = scores_QN.gather(1, by_score_QN), rows_QN.gather(1, by_score_QN)
    return Mined(scores_QN, rows_QN, positive_scores_P, skipped)


def apply_filters(plan, args, scores_QK, positive_scores_P):
    """Set to -inf (in place) the candidates the margins and score bounds remove; returns
    {filter: (removed, share of the candidates left before it)}. As sentence-transformers', except
    that --min-score counts only candidates still in (theirs also counts the ones already out)."""
    skipped, num_candidates = {}, scores_QK.numel()
    if args.absolute_margin is not None or args.relative_margin is not None:
        # Several positives: the margin is taken from the lowest-scoring one (the hardest).
        per_query = positive_scores_P.split(plan.positive_counts())
        lowest_Q1 = torch.stack([scores.min() for scores in per_query]).unsqueeze(1)
        if args.absolute_margin is not None:
            removed_QK = scores_QK + args.absolute_margin > lowest_Q1
            num_candidates = remove(scores_QK, removed_QK, "absolute_margin", skipped, num_candidates)
        if args.relative_margin is not None:
            # p - |p| x margin, not p x (1 - margin): the same for a negative p (sentence-transformers #3819).
            removed_QK = scores_QK > lowest_Q1 - lowest_Q1.abs() * args.relative_margin
            num_candidates = remove(scores_QK, removed_QK, "relative_margin", skipped, num_candidates)
    if args.max_score is not None:
        remove(scores_QK, scores_QK > args.max_score, "max_score", skipped, num_candidates)
    if args.min_score is not None:
        below_QK = (scores_QK < args.min_score) & scores_QK.isfinite()
        remove(scores_QK, below_QK, "min_score", skipped, num_candidates)
    return skipped


def remove(scores_QK, removed_QK, name, skipped, num_candidates):
    num_removed = int(removed_QK.sum())
    scores_QK[removed_QK] = float("-inf")
    if num_removed:
        skipped[name] = (num_removed, num_removed / num_candidates)
    return num_candidates - num_removed


# ----------------------------------------------------------------------------------------------
# Output (rank 0)


@dataclasses.dataclass
class Written:
    rows: list  # the JSON objects to write, in order
    # sentence-transformers' statistics: score vectors, and how many rows (or negatives) could
    # have been written and how many could not
    positive: torch.Tensor
    negative: torch.Tensor
    difference: torch.Tensor
    possible: int
    missing: int


def output_rows(plan, args, mined):
    """The rows of --output-format, in sentence-transformers' order: queries first-seen, each
    with its positives in order (and, for triplets, each of their negatives)."""
    anchor, positive = plan.anchor_column, plan.positive_column
    scores_QN, rows_QN = mined.negative_scores_QN.tolist(), mined.negative_rows_QN.tolist()
    positive_P = mined.positive_scores_P.tolist()
    per_query = positive_P_by_query(plan, positive_P)
    rows, negative, difference = [], [], []
    for q, query in enumerate(plan.queries):
        found = [(s, plan.corpus[r]) for s, r in zip(scores_QN[q], rows_QN[q]) if s != float("-inf")]
        if args.output_format == "grouped":
            if found:
                row = {"query": query, "pos": [plan.corpus[r] for r in plan.positive_rows[q]]}
                row["neg"] = [text for _, text in found]
                if args.output_scores:
                    row.update(pos_scores=per_query[q], neg_scores=[s for s, _ in found])
                rows.append(row)
            negative += [s for s, _ in found]
            difference += [p - s for p in per_query[q] for s, _ in found]
            continue
        for r, p in zip(plan.positive_rows[q], per_query[q]):
            if args.output_format == "triplet":
                for s, text in found:
                    rows.append({anchor: query, positive: plan.corpus[r], "negative": text})
                    rows[-1].update({"scores": [p, s]} if args.output_scores else {})
            elif len(found) == args.num_negatives:  # n-tuple: only complete rows
                rows.append({anchor: query, positive: plan.corpus[r]})
                rows[-1].update({f"negative_{i}": text for i, (_, text) in enumerate(found, start=1)})
                rows[-1].update({"scores": [p] + [s for s, _ in found]} if args.output_scores else {})
            else:
                continue
            negative += [s for s, _ in found]
            difference += [p - s for s, _ in found]
    return finish_written(plan, args, rows, mined.positive_scores_P, negative, difference)


def positive_P_by_query(plan, positive_P):
    per_query, start = [], 0
    for count in plan.positive_counts():
        per_query.append(positive_P[start : start + count])
        start += count
    return per_query


def finish_written(plan, args, rows, positive_P, negative, difference):
    """Written, with what could have been written: a row per (query, positive) for n-tuple, a
    negative per (query, positive) slot for triplet, a negative per query slot for grouped."""
    if args.output_format == "n-tuple":
        possible, written = len(positive_P), len(rows)
    elif args.output_format == "triplet":
        possible, written = len(positive_P) * args.num_negatives, len(rows)
    else:
        possible, written = len(plan.queries) * args.num_negatives, len(negative)
    return Written(
        rows,
        positive_P,
        torch.tensor(negative, dtype=torch.float32),
        torch.tensor(difference, dtype=torch.float32),
        possible,
        possible - written,
    )


def write_atomically(path, rows):
    """Write `rows` as JSON Lines to a temporary file beside `path`, then rename it to `path`:
    a reader finds the whole file or none, never a partial one (rename is atomic in a folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it private (0600); as open() would
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def describe(plan, args, world_size):
    """What sentence-transformers says before mining, and how the work is split."""
    p = fsdp_utils.print0
    num_rows = sum(plan.rows_per_query)
    if len(plan.queries) != num_rows:
        p(f"Found {len(plan.queries):,} unique queries out of {num_rows:,} total queries.")
    if plan.max_positives > 1:
        p(f"Found an average of {num_rows / len(plan.queries):.3f} positives per query.")
    if args.range_max is None:
        p(f"Setting range_max to {plan.range_max} based on the provided parameters.")
    p(
        f"{len(plan.queries):,} queries and {len(plan.corpus):,} corpus texts over {world_size} rank(s); "
        f"each query keeps its best {plan.range_max + plan.max_positives} candidates, "
        f"{args.chunk_size} queries at a time"
    )


def print_statistics(args, mined, written):
    """sentence-transformers' table and notes, for the rows written."""
    line = "{:<6} {:>14} {:>14} {:>14}"
    p = fsdp_utils.print0
    p(line.format("Metric", "Positive", "Negative", "Difference"))
    p(line.format("Count", f"{len(written.positive):,}", f"{len(written.negative):,}", ""))
    for name, function in STATISTICS:
        values = [
            f"{function(v):.4f}" if v.numel() else "-"
            for v in (written.positive, written.negative, written.difference)
        ]
        p(line.format(name, *values))
    values = {n: getattr(args, n) for n in ("absolute_margin", "relative_margin", "max_score", "min_score")}
    for name, (num_skipped, share) in mined.skipped.items():
        p(f"Skipped {num_skipped:,} potential negatives ({share:.2%}) due to the {name} of {values[name]}.")
    if written.missing > 0:
        unit = "negatives" if args.output_format == "grouped" else "samples"
        p(
            f"Could not find enough negatives for {written.missing:,} {unit} "
            f"({written.missing / written.possible:.2%}) of {written.possible:,}; consider changing "
            "--range-max, --range-min, the margins or the score bounds to find more."
        )
    num_left_out = len(mined.negative_scores_QN) - len(written.rows)
    if args.output_format == "grouped" and num_left_out:
        p(f"{num_left_out:,} queries found no negative and were left out.")


STATISTICS = [
    ("Mean", lambda v: v.mean().item()),
    ("Median", lambda v: v.median().item()),
    ("Std", lambda v: v.std().item()),
    ("Min", lambda v: v.min().item()),
    ("25%", lambda v: v.quantile(0.25).item()),
    ("50%", lambda v: v.quantile(0.5).item()),
    ("75%", lambda v: v.quantile(0.75).item()),
    ("Max", lambda v: v.max().item()),
]


if __name__ == "__main__":
    sys.exit(main())
