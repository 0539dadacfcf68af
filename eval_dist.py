"""Distributed evaluation of a sentence-embedding model: every rank encodes a share of the texts,
the shares are summed into one tensor, and every rank computes the same metrics from it.

Evaluators (each returns a flat dict of python floats, identical on every rank):
  - `evaluate_sts`        Spearman and Pearson (x 100) of cosine similarity vs gold scores
  - `evaluate_retrieval`  MRR@k, NDCG@k, Recall@k, MAP@k (as sentence-transformers'
                          InformationRetrievalEvaluator; nDCG also with graded relevance), the
                          corpus sharded across ranks, the queries scored in chunks; by cosine,
                          or with similarity="dot" by dot product for sparse (SPLADE) models,
                          then with SparseInformationRetrievalEvaluator's active dimensions,
                          sparsity ratios and avg_flops (`sparsity_metrics`)
  - `evaluate_nli`        accuracy (x 100) of a classification head over (u, v, |u - v|)
  - `evaluate_loss`       the training loss on held-out rows, in world-size-independent batches
and the pieces they share: `encode`, `encode_local`, `shard_bounds`, `retrieval_from_pairs`;
`top_k_sharded` (each query's best k corpus rows when the corpus is sharded, in chunks of
queries) serves hard-negative mining (mine.py).

Shape legend (suffixes on tensor names):
    N  texts (or pairs) in the whole evaluation set      D  embedding dimension
    R  rows this rank encoded (its shard of N)           B  rows of one batch
    Q  queries    K  hits kept per query (k)             W  world size    U  distinct texts
    C  candidates per query after the merge (W * K)      S  rows of this rank's slice
    H  queries of one chunk (top_k_sharded)              L  corpus rows of one block of the shard
    V  entries of a sparse (SPLADE) embedding: the vocabulary size, its D

Use it (one process, or every rank under torchrun; gloo on CPU, NCCL on CUDA):
    import eval_dist
    def tokenize(texts):  # texts -> token batch; use the very function your training uses
        return tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    metrics = eval_dist.evaluate_sts(model, tokenize, dev["sentence1"], dev["sentence2"], dev["score"],
                                     batch_size=32)
    # -> {"spearman": ..., "pearson": ...} (x 100), the same dict on every rank; print from rank 0

`model` is the module the training loop calls: the DDP/FSDP1/FSDP2-wrapped one, so that FSDP can
gather its parameters. It is called as `model(**tokenize(texts))` -> (B, D) embeddings. Texts
reach it only through the caller's `tokenize`, so evaluation reads texts (casing, truncation,
prompts) exactly as training does. Every function here that encodes or
merges is called by all ranks (all ranks participate), the same number of times, in the same
order: an FSDP forward is a collective, and a rank that runs one forward fewer, or one that
skips a function, leaves the others waiting forever. With no
process group (one process), the same code runs and no collective is made.

Two rules keep every rank in step and the numbers independent of the world size:
  1. Texts are sorted longest first (as sentence-transformers does, so batches carry little
     padding) and cut into GLOBAL batches of `batch_size`; rank r encodes batches r, r + world,
     ... . Every rank runs ceil(num_batches / world) forwards; a rank with no batch left runs a
     one-row dummy forward (texts[0]) and drops the result. A text therefore lands in the same
     batch, with the same padding, at any world size (measured on CPU, one thread per process:
     bit-identical embeddings at world 1 and 3). Strided, not contiguous slices of the sorted
     order: those would give rank 0 all the long texts and make the others wait for it.
  2. Results are assembled by ONE `all_reduce(SUM)` of a fixed-size zero buffer in which each
     rank fills only its own rows (x + 0 + 0 = x exactly): no all_gather_object, no pickling.

Evaluation runs in eval mode under `torch.no_grad()` and inside `torch.random.fork_rng`, and the
model's train/eval mode is put back afterwards (also on exceptions): a run that evaluates
trains exactly like one that does not.

This file imports only the standard library and torch, never the rest of this project, so it
can be copied alone. Left out on purpose: similarity functions other than cosine (and, in
evaluate_retrieval, the dot product, which sparse models such as SPLADE are scored by); sparse
tensors (a sparse embedding is held dense, (N, V), as the model returns it) and
sentence-transformers' top-k `max_active_dims`; caching embeddings between evaluations, writing
CSV files.
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Distributed basics


def rank_and_world():
    """(rank, world_size); (0, 1) when no process group is initialised (one process)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_bounds(num_rows, rank, world_size):
    """Rank `rank`'s contiguous slice [start, end) of `num_rows` rows: slices of
    ceil(num_rows / world_size) rows, the last ones shorter or empty (7 rows, 3 ranks: 3, 3, 1;
    1 row, 3 ranks: 1, 0, 0)."""
    per_rank = math.ceil(num_rows / world_size)
    start = min(rank * per_rank, num_rows)
    return start, min(start + per_rank, num_rows)


@contextlib.contextmanager
def evaluating(model):
    """Eval mode (dropout off), no autograd graph, and the RNG state forked: the caller's random
    stream is the same after evaluation as before, even if a callback (batch_loss, classify)
    draws random numbers. The model's previous train/eval mode comes back, also on exceptions."""
    was_training = model.training
    # fork_rng saves and restores the CPU generator and the listed CUDA devices' generators.
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
            model.eval()
            yield
    finally:
        model.train(was_training)


def model_device(model):
    # FSDP2 parameters are DTensors; their .device is the local shard's device, which is the one
    # the inputs must be on.
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------
# Encoding: each rank embeds its share of global batches


def encode_local(
    model, tokenize, texts, batch_size=32, device=None, columns=None, autocast=contextlib.nullcontext
):
    """Embed this rank's share of `texts`. Returns (rows_R, emb_RD): the indices of the texts this
    rank encoded (ascending) and their float32 embeddings. Under FSDP each forward is a
    collective (all ranks participate): each rank runs ceil(ceil(N / batch_size) / world)
    forwards, whatever its share (rule 1 of the docstring).
    `tokenize(list of texts) -> dict of (B, T) tensors`, padded; `device=None`: the model's.
    `columns`: one name per text, which tokenize then gets too, `tokenize(texts, columns)`, for a
    tokenizer that treats columns differently (truncating queries shorter than passages)."""
    if len(texts) == 0:
        raise ValueError("nothing to encode: the list of texts is empty")
    rank, world_size = rank_and_world()
    device = device if device is not None else model_device(model)
    # Longest first (ties keep their input order: sorted() is stable), so the batches, and with
    # them every embedding, are a function of the texts alone, not of the world size.
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    num_steps = math.ceil(len(batches) / world_size)
    rows = [row for batch in batches[rank::world_size] for row in batch]  # in the order encoded
    emb_RD = None
    with evaluating(model):
        for step in range(num_steps):
            batch_index = step * world_size + rank  # global batches r, r + world, r + 2 world, ...
            is_dummy = batch_index >= len(batches)
            batch_rows = [0] if is_dummy else batches[batch_index]
            batch_columns = [[columns[i] for i in batch_rows]] if columns else []
            tokens = tokenize([texts[i] for i in batch_rows], *batch_columns)
            # num_steps times: under FSDP the forward all-gathers
            # parameters, a collective that hangs if one rank skips it. A dummy's result is dropped.
            with autocast():  # the caller's mixed precision (train.py's, or fsdp_embed/embedding_model.py's)
                emb_BD = model(**{k: v.to(device) for k, v in tokens.items()}).float()
            if emb_RD is None:
                # One buffer for all the rank's rows, filled batch by batch. Keeping each batch's
                # small output alive instead, among the next batches' freed activations,
                # fragments glibc's heap (docs/evaluation.md).
                emb_RD = emb_BD.new_empty(len(rows), emb_BD.shape[1])
            if not is_dummy:
                start = step * batch_size  # the rank's earlier batches are full ones
                emb_RD[start : start + len(batch_rows)] = emb_BD
    # every rank ran at least one forward (len(texts) >= 1), so emb_RD exists
    rows_R, order_R = torch.tensor(rows, dtype=torch.long, device=device).sort()
    return rows_R, emb_RD[order_R]


def encode(model, tokenize, texts, batch_size=32, device=None, columns=None, autocast=contextlib.nullcontext):
    """Embed all `texts` -> float32 (N, D), identical on every rank (all ranks participate)."""
    rank, world_size = rank_and_world()
    # the forwards, the same number on every rank
    rows_R, emb_RD = encode_local(model, tokenize, texts, batch_size, device, columns, autocast)
    emb_ND = emb_RD.new_zeros(len(texts), emb_RD.shape[1])
    emb_ND[rows_R] = emb_RD
    if world_size > 1:
        # (all ranks participate): every row was written by exactly one rank, so the sum IS that
        # row (x + 0).
        dist.all_reduce(emb_ND, op=dist.ReduceOp.SUM)
    return emb_ND


# ----------------------------------------------------------------------------------------------
# Top k over a sharded corpus, in chunks of queries


def top_k_sharded(query_QD, local_RD, rows_R, k, chunk_size=1024, block_size=16384):
    """Each query's k best corpus rows by the score query . row (normalise both for cosine), when
    the corpus is sharded: this rank holds the rows rows_R (global indices, ascending; as
    encode_local returns them) as local_RD, the other ranks the rest. Returns (scores_QK,
    rows_QK), the same on every rank: scores descending, EXACT ties broken by the lower corpus
    index (so the answer does not depend on the world size), padded with score -inf and row -1
    when the whole corpus has fewer than k rows.

    Memory: `chunk_size` queries at a time are scored against `block_size` rows of the shard at
    a time, keeping a running top k, so no rank ever holds more than a chunk x block score
    matrix (beside the Q x k answer), however large the corpus. Every chunk ends in one
    all_reduce (all ranks participate), with the same Q, k and chunk_size on every rank:
    ceil(Q / chunk_size) of them."""
    rank, world_size = rank_and_world()
    device = query_QD.device
    scores, rows = [], []
    for start in range(0, query_QD.shape[0], chunk_size):
        chunk_HD = query_QD[start : start + chunk_size]
        offer_scores_HK, offer_rows_HK = _local_top_k(chunk_HD, local_RD, rows_R, k, block_size)
        # A fixed-size (world, H, k, 2) buffer, zero except this rank's slot; float64 holds the
        # float32 scores and the row indices (< 2^53) exactly, so ONE collective carries both.
        offers_WHK2 = torch.zeros(world_size, len(chunk_HD), k, 2, dtype=torch.float64, device=device)
        offers_WHK2[rank, :, :, 0] = offer_scores_HK
        offers_WHK2[rank, :, :, 1] = offer_rows_HK
        if world_size > 1:
            # (all ranks participate), once per chunk (the same number of chunks everywhere): slot
            # r holds rank r's offer and zeros elsewhere, so the SUM is every offer, exactly
            # (-inf + 0 = -inf).
            dist.all_reduce(offers_WHK2, op=dist.ReduceOp.SUM)
        cand_HC2 = offers_WHK2.permute(1, 0, 2, 3).reshape(len(chunk_HD), world_size * k, 2)
        best_scores_HK, best_rows_HK = _best_k(cand_HC2[..., 0], cand_HC2[..., 1].long(), k)
        scores.append(best_scores_HK.to(query_QD.dtype))
        rows.append(best_rows_HK)
    if not scores:
        return query_QD.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long, device=device)
    return torch.cat(scores), torch.cat(rows)


def _local_top_k(chunk_HD, local_RD, rows_R, k, block_size):
    """The best k of this rank's rows for each query of the chunk, as (scores_HK, rows_HK) in
    _best_k's order; -inf and -1 where the shard has fewer than k rows. No collective."""
    best_scores_HK = chunk_HD.new_full((len(chunk_HD), k), float("-inf"))
    best_rows_HK = torch.full((len(chunk_HD), k), -1, dtype=torch.long, device=chunk_HD.device)
    for start in range(0, len(rows_R), block_size):
        scores_HL = chunk_HD @ local_RD[start : start + block_size].T
        top_scores_HK, top_pos_HK = _stable_top_k(scores_HL, k)
        best_scores_HK, best_rows_HK = _best_k(
            torch.cat([best_scores_HK, top_scores_HK], 1),
            torch.cat([best_rows_HK, rows_R[start + top_pos_HK]], 1),
            k,
        )
    return best_scores_HK, best_rows_HK


def _stable_top_k(scores_HL, k):
    """The best min(k, L) columns of each row, as torch.topk, except that where the k-th score
    ties with one left out, the lower column wins (torch.topk picks among ties arbitrarily):
    such rows, rare, get a stable full sort. A tie at the cut shows as a (k+1)-th score equal
    to the k-th, so one topk of k + 1 finds them (a pass comparing every score to the k-th
    cost as much as the topk itself)."""
    if k >= scores_HL.shape[1]:  # every column is kept
        return torch.sort(scores_HL, dim=1, descending=True, stable=True)
    top_scores_HK, top_pos_HK = torch.topk(scores_HL, k + 1, dim=1)
    tied_H = top_scores_HK[:, k] == top_scores_HK[:, k - 1]
    top_scores_HK, top_pos_HK = top_scores_HK[:, :k], top_pos_HK[:, :k]
    if tied_H.any():
        sorted_scores, sorted_pos = torch.sort(scores_HL[tied_H], dim=1, descending=True, stable=True)
        top_scores_HK[tied_H], top_pos_HK[tied_H] = sorted_scores[:, :k], sorted_pos[:, :k]
    return top_scores_HK, top_pos_HK


def _best_k(scores_HC, rows_HC, k):
    """The first k candidates by score descending, then corpus row ascending: sort by row first,
    then a stable sort by score keeps that order among equal scores (as _top_rows merges)."""
    by_row_HC = rows_HC.argsort(dim=1, stable=True)
    scores_HC, rows_HC = scores_HC.gather(1, by_row_HC), rows_HC.gather(1, by_row_HC)
    by_score_HC = scores_HC.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores_HC.gather(1, by_score_HC), rows_HC.gather(1, by_score_HC)


# ----------------------------------------------------------------------------------------------
# Correlations, in float64, from tensors that every rank holds in full


def average_ranks(x_N):
    """1-based ranks; tied values share the mean of the ranks they span (scipy.stats.rankdata's
    default 'average', which scipy.stats.spearmanr uses)."""
    sorted_N, order_N = torch.sort(x_N, stable=True)
    starts_group_N = torch.ones_like(sorted_N, dtype=torch.bool)
    starts_group_N[1:] = sorted_N[1:] != sorted_N[:-1]
    group_N = torch.cumsum(starts_group_N, 0) - 1  # group id of each sorted value
    position_N = torch.arange(1, len(x_N) + 1, dtype=torch.float64, device=x_N.device)
    num_groups = int(group_N[-1]) + 1
    group_sum = torch.zeros(num_groups, dtype=torch.float64, device=x_N.device).index_add_(
        0, group_N, position_N
    )
    group_size = torch.bincount(group_N, minlength=num_groups)
    ranks_N = torch.empty_like(position_N)
    ranks_N[order_N] = (group_sum / group_size)[group_N]
    return ranks_N


def pearson(x_N, y_N):
    """Pearson correlation of two float64 vectors (nan if either is constant, as scipy)."""
    x_N, y_N = x_N - x_N.mean(), y_N - y_N.mean()
    return ((x_N * y_N).sum() / torch.sqrt((x_N * x_N).sum() * (y_N * y_N).sum())).item()


def spearman(x_N, y_N):
    """Spearman correlation = Pearson correlation of the average ranks."""
    return pearson(average_ranks(x_N), average_ranks(y_N))


# ----------------------------------------------------------------------------------------------
# Evaluators: every rank calls each one (all ranks participate); each returns the same dict on
# every rank


def evaluate_sts(
    model,
    tokenize,
    sentences1,
    sentences2,
    scores,
    *,
    batch_size=32,
    device=None,
    dims=(),
    columns=None,
    autocast=contextlib.nullcontext,
):
    """Semantic textual similarity: Spearman and Pearson (x 100) of cos(u_i, v_i) vs scores[i],
    as sentence-transformers' EmbeddingSimilarityEvaluator (its "spearman_cosine" /
    "pearson_cosine", which are not x 100). `dims` (Matryoshka): also "spearman@d" and
    "pearson@d" for the embeddings truncated to their first d dimensions, from the same encoding.
    `columns`: the two columns' names, for tokenize (encode_local). Its encoding is collective
    (all ranks participate)."""
    num_pairs = len(sentences1)
    if num_pairs != len(sentences2) or num_pairs != len(scores):
        raise ValueError(
            f"evaluate_sts: {num_pairs} sentences1, {len(sentences2)} sentences2 and {len(scores)} scores; "
            "they must be equally long"
        )
    names = [columns[0]] * num_pairs + [columns[1]] * num_pairs if columns else None
    # One encode for both columns: one set of forwards, fuller batches
    emb_2ND = encode(
        model, tokenize, list(sentences1) + list(sentences2), batch_size, device, names, autocast
    )
    emb_2ND = emb_2ND.double()
    gold_N = torch.tensor(scores, dtype=torch.float64, device=emb_2ND.device)
    metrics = {}
    for suffix, dim in [("", emb_2ND.shape[-1])] + [(f"@{d}", d) for d in dims]:
        u_ND, v_ND = (
            F.normalize(emb_2ND[:num_pairs, :dim], dim=-1),
            F.normalize(emb_2ND[num_pairs:, :dim], dim=-1),
        )
        cosine_N = (u_ND * v_ND).sum(-1)
        metrics.update(
            {
                f"spearman{suffix}": 100 * spearman(cosine_N, gold_N),
                f"pearson{suffix}": 100 * pearson(cosine_N, gold_N),
            }
        )
    return metrics


def retrieval_from_pairs(anchors, positives):
    """(anchor, positive) pairs -> (queries, corpus, relevant): the unique anchors are the queries,
    the unique positives the corpus (first-seen order), and relevant[i] is the set of corpus
    indices paired with query i; every other corpus entry is a distractor for it."""
    if len(anchors) != len(positives):
        raise ValueError(f"retrieval_from_pairs: {len(anchors)} anchors but {len(positives)} positives")
    query_index, corpus_index, relevant = {}, {}, []
    for anchor, positive in zip(anchors, positives):
        if anchor not in query_index:
            query_index[anchor] = len(query_index)
            relevant.append(set())
        if positive not in corpus_index:
            corpus_index[positive] = len(corpus_index)
        relevant[query_index[anchor]].add(corpus_index[positive])
    return list(query_index), list(corpus_index), relevant


def evaluate_retrieval(
    model,
    tokenize,
    queries,
    corpus,
    relevant,
    *,
    batch_size=32,
    device=None,
    k=10,
    dims=(),
    columns=None,
    metrics=None,
    query_chunk=1024,
    autocast=contextlib.nullcontext,
    similarity="cosine",
):
    """Retrieve each query's best corpus entries by `similarity`, "cosine" or "dot" (the raw
    embeddings' dot product, as SparseInformationRetrievalEvaluator scores SPLADE vectors; adds
    `sparsity_metrics`), and score them. `metrics`: NAME@K with NAME one of mrr, ndcg, recall, map
    (default: mrr@k, ndcg@k, recall@1, recall@k; fractions in [0, 1]), with exactly the definitions of
    sentence-transformers' InformationRetrievalEvaluator: recall = relevant hits / all relevant; MAP@k
    divides by min(k, #relevant); ideal DCG from the best possible top k. `relevant[q]` is a set of
    corpus indices (relevance 1) or a dict {index: graded relevance > 0}: nDCG then gains each hit's
    grade (as BEIR's trec_eval does; sentence-transformers has binary relevance only), the other
    metrics count any grade as relevant. Equal scores rank the lower corpus index first, so the result
    does not depend on the world size.

    The corpus is sharded: each rank keeps only the embeddings it encoded, scores `query_chunk`
    queries at a time against them (a chunk x shard matrix at most), and offers its local top K; one
    all_reduce per chunk merges the offers (all ranks participate). Each distinct corpus text is
    encoded and scored once and every copy takes that score, so duplicates tie exactly wherever they
    sit (one text need not give bitwise-equal floats on two ranks, or at two positions of one matrix
    product). `dims` (Matryoshka): also every metric at each truncated size d ("mrr@10@64", ...), from
    the same encoding. `columns`: the queries' and the corpus' column names, for tokenize."""
    if similarity not in ("cosine", "dot"):
        raise ValueError(f"evaluate_retrieval: similarity {similarity!r}: use 'cosine', or 'dot' for SPLADE")
    names = metrics or (f"mrr@{k}", f"ndcg@{k}", "recall@1", f"recall@{k}")
    gains = relevance_grades(queries, corpus, relevant)
    top = max(int(name.split("@")[1]) for name in names)
    query_names = [columns[0]] * len(queries) if columns else None
    # the queries on every rank, then each rank's share of the corpus
    full_query_QD = encode(model, tokenize, queries, batch_size, device, query_names, autocast).double()
    distinct = {}  # text -> its index among the distinct texts, in first-seen order
    distinct_of_row_N = torch.tensor(
        [distinct.setdefault(text, len(distinct)) for text in corpus], device=full_query_QD.device
    )
    distinct_names = [columns[1]] * len(distinct) if columns else None
    local_U, full_corpus_UD = encode_local(
        model, tokenize, list(distinct), batch_size, device, distinct_names, autocast
    )
    results = {}
    for suffix, dim in [("", full_query_QD.shape[-1])] + [(f"@{d}", d) for d in dims]:
        query_QD = _as_scored(full_query_QD[:, :dim], similarity)
        corpus_UD = _as_scored(full_corpus_UD[:, :dim].double(), similarity)
        hits = _ranked_hits(query_QD, corpus_UD, local_U, distinct_of_row_N, len(distinct), top, query_chunk)
        results.update({name + suffix: v for name, v in retrieval_metrics(hits, gains, names).items()})
    if similarity == "dot":  # of the whole embeddings, whatever `dims`
        results.update(sparsity_metrics(full_query_QD, full_corpus_UD, local_U, distinct_of_row_N))
    return results


def _as_scored(emb_ND, similarity):
    """The embeddings as `similarity` scores them by a matrix product: unit rows for cosine, raw for dot."""
    return F.normalize(emb_ND, dim=-1) if similarity == "cosine" else emb_ND


def _ranked_hits(query_QD, corpus_UD, local_U, distinct_of_row_N, num_distinct, k, query_chunk):
    """Each query's k best corpus rows (_top_rows), scored by query . corpus row, `query_chunk`
    queries at a time: the same chunks on every rank, two all_reduces each."""
    rank, world_size = rank_and_world()
    hits = []
    for start in range(0, len(query_QD), query_chunk):
        scores_QU = query_QD[start : start + query_chunk] @ corpus_UD.T
        hits += _top_rows(scores_QU, local_U, num_distinct, distinct_of_row_N, k, rank, world_size)
    return hits


def sparsity_metrics(query_QV, local_UV, local_U, distinct_of_row_N):
    """The sparsity numbers of sentence-transformers' SparseInformationRetrievalEvaluator, from the
    queries' embeddings (all of them, on every rank) and this rank's distinct corpus texts (local_U,
    their embeddings local_UV; distinct_of_row_N maps each corpus row to its text):
      query_active_dims, corpus_active_dims   the mean over rows of a row's non-zero entries
      query_sparsity_ratio, ...               1 - active_dims / V
      avg_flops                               sum_v q_v c_v, with q_v and c_v the fractions of the
                                              queries and of the corpus rows non-zero at entry v
    (avg_flops: the expected number of entries a query and a document share, the work of an
    inverted index per pair). The corpus counts every row, each copy of a text, as there (it
    encodes every corpus id): each distinct text's counts weigh its number of copies. Each rank
    counts its own texts; one all_reduce sums the counts (all ranks participate); divided once."""
    _, world_size = rank_and_world()
    num_queries, num_rows, num_entries = len(query_QV), len(distinct_of_row_N), query_QV.shape[1]
    copies_R = torch.bincount(distinct_of_row_N)[local_U].double()  # copies of each local text
    corpus_count_V = query_QV.new_zeros(num_entries, dtype=torch.float64)
    for start in range(0, len(local_U), 256):  # a (256, V) mask at a time, not one of the shard
        corpus_count_V += copies_R[start : start + 256] @ (local_UV[start : start + 256] != 0).double()
    if world_size > 1:
        # Whole numbers (< 2^53) in float64: the sum over ranks is exact, in any order.
        dist.all_reduce(corpus_count_V, op=dist.ReduceOp.SUM)  # (all ranks participate)
    query_count_V = (query_QV != 0).sum(0).double()  # every rank holds all the queries
    query_dims, corpus_dims = query_count_V.sum().item() / num_queries, corpus_count_V.sum().item() / num_rows
    return {
        "query_active_dims": query_dims,
        "query_sparsity_ratio": 1 - query_dims / num_entries,
        "corpus_active_dims": corpus_dims,
        "corpus_sparsity_ratio": 1 - corpus_dims / num_entries,
        "avg_flops": ((query_count_V / num_queries) @ (corpus_count_V / num_rows)).item(),
    }


def relevance_grades(queries, corpus, relevant):
    """`relevant` (per query, a set of corpus indices or {index: grade}) as {index: grade},
    after checking it fits the queries and the corpus."""
    if len(relevant) != len(queries):
        raise ValueError(
            f"evaluate_retrieval: {len(queries)} queries but {len(relevant)} relevant sets; "
            "give one set per query"
        )
    if any(not rel for rel in relevant):
        raise ValueError(
            "evaluate_retrieval: a query has no relevant corpus entry; "
            "drop it (sentence-transformers skips such queries)"
        )
    if any(not 0 <= i < len(corpus) for rel in relevant for i in rel):
        raise ValueError(f"evaluate_retrieval: relevant indices must lie in 0..{len(corpus) - 1}")
    return [rel if isinstance(rel, dict) else dict.fromkeys(rel, 1.0) for rel in relevant]


def _top_rows(scores_QU, local_U, num_distinct, distinct_of_row_N, k, rank, world_size):
    """Each query's k best corpus rows (a list per query, -1 where the corpus has fewer), from
    this rank's scores against the distinct texts it encoded (local_U, of num_distinct;
    distinct_of_row_N maps each corpus row to its distinct text). Two all_reduces (all ranks participate)."""
    num_queries, device = scores_QU.shape[0], scores_QU.device
    # This rank's corpus rows: every copy of the distinct texts it encoded (ascending), each
    # taking its text's column of scores.
    column_of_distinct = torch.full((num_distinct,), -1, dtype=torch.long, device=device)
    column_of_distinct[local_U] = torch.arange(len(local_U), device=device)
    rows_R = (column_of_distinct[distinct_of_row_N] >= 0).nonzero().squeeze(1)
    scores_QR = scores_QU[:, column_of_distinct[distinct_of_row_N[rows_R]]]
    # Local top k. A stable sort, not torch.topk (which breaks ties arbitrarily): rows_R is
    # ascending, so among equal scores the lower corpus index stays first.
    num_local = min(k, len(rows_R))
    sorted_scores_QR, sorted_pos_QR = torch.sort(scores_QR, dim=1, descending=True, stable=True)
    # Fixed-size buffers (world, Q, k), zero except this rank's slot; a short slot is padded
    # with score -inf and index -1 ("no hit"). The sum over ranks is then every rank's offer.
    offer_scores_WQK = torch.zeros(world_size, num_queries, k, dtype=torch.float64, device=device)
    offer_rows_WQK = torch.zeros(world_size, num_queries, k, dtype=torch.long, device=device)
    offer_scores_WQK[rank] = float("-inf")
    offer_rows_WQK[rank] = -1
    offer_scores_WQK[rank, :, :num_local] = sorted_scores_QR[:, :num_local]
    offer_rows_WQK[rank, :, :num_local] = rows_R[sorted_pos_QR[:, :num_local]]
    if world_size > 1:
        # Once each per buffer: slot r holds rank r's offer, zeros elsewhere, so the SUM
        # assembles all offers exactly (-inf + 0 = -inf, -1 + 0 = -1).
        dist.all_reduce(offer_scores_WQK, op=dist.ReduceOp.SUM)  # (all ranks participate)
        dist.all_reduce(offer_rows_WQK, op=dist.ReduceOp.SUM)  # (all ranks participate)
    # Merge: order by score descending, then corpus index ascending. Sort by index first; the
    # stable sort by score keeps that order among equal scores. The global top k is among the
    # union of every rank's local top k.
    cand_scores_QC = offer_scores_WQK.permute(1, 0, 2).reshape(num_queries, world_size * k)
    cand_rows_QC = offer_rows_WQK.permute(1, 0, 2).reshape(num_queries, world_size * k)
    by_row_QC = cand_rows_QC.argsort(dim=1, stable=True)
    cand_scores_QC, cand_rows_QC = cand_scores_QC.gather(1, by_row_QC), cand_rows_QC.gather(1, by_row_QC)
    by_score_QC = cand_scores_QC.argsort(dim=1, descending=True, stable=True)
    return cand_rows_QC.gather(1, by_score_QC)[:, :k].tolist()


def retrieval_metrics(hits, gains, names):
    """The mean over queries of each metric in `names` (NAME@K), from each query's ranked hits
    and its {corpus index: graded relevance}. No collective: every rank holds all hits."""
    num_hits = max(len(h) for h in hits)
    discount_K = 1.0 / torch.log2(torch.arange(num_hits, dtype=torch.float64) + 2)  # 1-based positions
    grade_QK = torch.tensor(
        [[g.get(row, 0.0) for row in h] for h, g in zip(hits, gains)], dtype=torch.float64
    )
    is_relevant_QK = (grade_QK > 0).double()
    num_relevant_Q = torch.tensor([len(g) for g in gains], dtype=torch.float64)
    ideal_QK = torch.zeros_like(grade_QK)  # each query's grades, best first: the ideal ranking
    for q, g in enumerate(gains):
        best = sorted(g.values(), reverse=True)[:num_hits]
        ideal_QK[q, : len(best)] = torch.tensor(best, dtype=torch.float64)
    position_K = torch.arange(1, num_hits + 1, dtype=torch.float64)
    results = {}
    for name in names:
        metric, k = name.split("@")[0], int(name.split("@")[1])
        relevant_QK = is_relevant_QK[:, :k]
        if metric == "mrr":
            first_Q = relevant_QK.argmax(1)  # the first relevant hit's position (when there is one)
            value_Q = torch.where(relevant_QK.sum(1) > 0, 1.0 / (first_Q + 1).double(), 0.0)
        elif metric == "ndcg":
            dcg_Q = (grade_QK[:, :k] * discount_K[:k]).sum(1)
            value_Q = dcg_Q / (ideal_QK[:, :k] * discount_K[:k]).sum(1)
        elif metric == "recall":
            value_Q = relevant_QK.sum(1) / num_relevant_Q
        elif metric == "map":
            precision_QK = relevant_QK.cumsum(1) / position_K[:k]
            value_Q = (precision_QK * relevant_QK).sum(1) / num_relevant_Q.clamp(max=k)
        else:
            raise ValueError(f"unknown retrieval metric {name!r}; use mrr, ndcg, recall or map @K")
        results[name] = value_Q.mean().item()
    return results


def evaluate_nli(
    model,
    tokenize,
    premises,
    hypotheses,
    labels,
    classify,
    *,
    batch_size=32,
    device=None,
    columns=None,
    autocast=contextlib.nullcontext,
):
    """Accuracy (x 100) of a classification head: argmax classify(u, v) vs labels, with u, v the
    embeddings of premise and hypothesis. `classify(u_BD, v_BD) -> logits_BC` is supplied by the
    caller and must run the head through the wrapped model (train.py builds the head input with
    losses.softmax_features and calls model(head_input=...)).

    Every rank calls `classify` exactly ONCE, on its own contiguous slice of the rows (possibly
    empty), and the correct counts are summed. Why not all rows on every rank: that is world
    times the compute and memory for the same answer; why not in batches: under FSDP each head
    forward all-gathers the root's parameters (with the word embeddings), one gather is enough
    for a linear head over N / world rows. Encoding, `classify` and the sum are collective
    (all ranks participate)."""
    num_rows = len(premises)
    if num_rows != len(hypotheses) or num_rows != len(labels):
        raise ValueError(
            f"evaluate_nli: {num_rows} premises, {len(hypotheses)} hypotheses and {len(labels)} labels; "
            "they must be equally long"
        )
    rank, world_size = rank_and_world()
    names = [columns[0]] * num_rows + [columns[1]] * num_rows if columns else None
    # both columns in one encode
    emb_2ND = encode(model, tokenize, list(premises) + list(hypotheses), batch_size, device, names, autocast)
    start, end = shard_bounds(num_rows, rank, world_size)
    with evaluating(model):
        # once each, even with an empty slice: under FSDP the head
        # forward is a collective.
        logits_SC = classify(emb_2ND[start:end], emb_2ND[num_rows + start : num_rows + end])
    labels_S = torch.tensor(list(labels[start:end]), dtype=torch.long, device=logits_SC.device)
    num_correct = (logits_SC.argmax(-1) == labels_S).sum().to(torch.float64)
    if world_size > 1:
        # (all ranks participate): sum the correct counts of the slices; divide once.
        dist.all_reduce(num_correct, op=dist.ReduceOp.SUM)
    return {"accuracy": 100 * num_correct.item() / num_rows}


def evaluate_loss(model, num_rows, batch_size, batch_loss):
    """Validation loss: the training loss on `num_rows` held-out rows, as a row-weighted mean.

    The rows are cut into GLOBAL batches of `batch_size` consecutive rows (the last one may be
    shorter), the same at any world size, so in-batch negatives (MNRL) and CoSENT's pairs are
    the same too; rank r takes batches r, r + world, ... . `batch_loss(indices) -> mean loss
    (scalar tensor)` is supplied by the caller and runs the forwards through the wrapped model.
    `model` is only put in eval mode (dropout off) and back. Returns {"loss": ...}. Its forwards
    and the sum are collective (all ranks participate)."""
    if num_rows <= 0:
        raise ValueError("evaluate_loss: no rows to evaluate")
    rank, world_size = rank_and_world()
    batches = [list(range(s, min(s + batch_size, num_rows))) for s in range(0, num_rows, batch_size)]
    num_steps = math.ceil(len(batches) / world_size)
    totals = None  # [sum of loss x rows, rows] on this rank, on the loss's device
    with evaluating(model):
        for step in range(num_steps):
            batch_index = step * world_size + rank
            is_dummy = batch_index >= len(batches)
            indices = batches[0] if is_dummy else batches[batch_index]
            # num_steps times: batch_loss's forwards are collectives under
            # FSDP. A dummy (a real batch, so any loss accepts it) is computed and dropped.
            loss = batch_loss(indices).detach().to(torch.float64)
            if totals is None:
                totals = torch.zeros(2, dtype=torch.float64, device=loss.device)
            if not is_dummy:
                totals += torch.stack([loss * len(indices), loss.new_tensor(len(indices))])
    if world_size > 1:
        # (all ranks participate): sums and counts are added across ranks, divided once.
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return {"loss": (totals[0] / totals[1]).item()}
