"""Retrieval evaluation of a multi-vector (ColBERT) model: each query's best corpus entries by MaxSim,
scored with eval_dist's retrieval metrics (MRR@k, nDCG@k, Recall@k, MAP@k), the numbers
sentence-transformers 6's MultiVectorInformationRetrievalEvaluator reports for the same model.

    scores = evaluate_retrieval(model, loaded, queries, corpus, relevant, batch_size=32, device=device,
                                autocast=autocast, metrics=("mrr@10", "ndcg@10"))  # (all ranks participate)
    # -> {"mrr@10": ..., "ndcg@10": ...}, the same dict on every rank

`model` is the wrapped module the training loop calls (FSDP: each forward is a collective); it
returns every text's token vectors, (B, T, dim), normalised (embedding_model.EmbeddingModel with
`multivector` settings). `loaded` (embedding_model.LoadedModel) gives the tokenizer (`tokenize`), the
skiplist (multivector.mask_settings) and the similarity: MaxSim, or MeanMaxSim (divided by the
query's token count) where the model's settings say "meanmaxsim". Queries are scored as the "query"
task, corpus texts as the "document" task: each side's scoring mask (multivector.scoring_masks) is
the attention mask, less the skiplist's tokens on the sides `skiplist_tasks` names (documents by
default), as MultiVectorEncoder's encode_query and encode_document keep them.

How the work is shared (eval_dist's rule 1: the same global batches at any world size, every rank
the same number of forwards, dummy rows where it has none left):
  - the queries: each rank encodes its share of the batches, and one all_reduce assembles every
    query's token matrix on every rank (eval_dist.encode);
  - the corpus: its distinct texts in global chunks of `corpus_chunk`; each rank encodes its share of
    a chunk (eval_dist.encode_local), scores all queries against it (multivector.maxsim), keeps each
    query's best `k` corpus rows so far and drops the chunk's token matrices. Memory: one chunk's
    share of token matrices and a (queries, share) score matrix at a time, not the whole corpus;
  - at the end, one all_reduce gathers every rank's best k rows and every rank merges them the same
    way (score descending, then corpus index ascending, as eval_dist does), so ties and duplicates
    rank as there and the result does not depend on the world size.
eval_dist's encoders expect one vector per text: they get the model through `TokenRows`, which pads
each text's token matrix to one width and appends its scoring mask as a last channel, flattened.

Left out: Matryoshka sizes (refused for multi-vector models at start-up), query expansion and
per-task lengths (refused when the model is read), XTR scoring.

Needs torch, the root's eval_dist.py, and fsdp_embed/multivector.py (which needs the root's losses.py).

Shape legend (suffixes): Q queries, T query tokens, D token dimension, N corpus rows, U distinct
corpus texts, L texts of one chunk this rank encoded, S their tokens, R corpus rows of those texts,
K best rows kept per query, W world size, X a flattened row (tokens x (D + 1))."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import eval_dist
from fsdp_embed import multivector

# Distinct corpus texts a chunk: each rank holds the token matrices of its share of one chunk at a
# time (sentence-transformers' evaluator encodes its corpus 5000 texts at a time).
CORPUS_CHUNK = 8192


class TokenRows(torch.nn.Module):
    """The multi-vector model as eval_dist's encoders call a model, model(**tokens) -> (B, X): one
    row per text, its token vectors padded to `width` tokens, each followed by its scoring mask
    (1.0 or 0.0) for `task`, flattened. One width for every batch of a call lets eval_dist fill one
    buffer of rows (and sum the ranks' buffers); the mask in the row travels with the vectors
    through the same all_reduce. The train/eval mode is the model's: eval_dist switches both."""

    def __init__(self, model, width, task, skip_ids_K, skip_tasks, expansion_id=None):
        super().__init__()
        self.model, self.width, self.task = model, width, task
        self.skip_ids_K, self.skip_tasks, self.expansion_id = skip_ids_K, skip_tasks, expansion_id
        # Not self.train(...): that would set every submodule's mode, not just read the model's.
        self.training = model.training

    def forward(self, **tokens):
        emb_BTD = self.model(**tokens).float()
        mask_BT = scoring_mask(tokens, self.task, self.skip_ids_K, self.skip_tasks, self.expansion_id)
        rows_BTX = torch.cat([emb_BTD, mask_BT[..., None].to(emb_BTD.dtype)], dim=-1)
        return F.pad(rows_BTX, (0, 0, 0, self.width - rows_BTX.shape[1])).flatten(1)


def scoring_mask(tokens, task, skip_ids_K, skip_tasks, expansion_id=None):
    """(B, T) bool: the tokens MaxSim counts in texts of `task` ("query" or "document"), by
    multivector.scoring_masks' rule. Its column 0 is the query side: a single column whose task is
    listed is handed the skiplist as a listed query column; the expansion's tokens count in queries."""
    pool = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
    skip = ("query",) if task in skip_tasks else ()
    return multivector.scoring_masks(pool, 1, skip_ids_K, skip, expansion_id if task == "query" else None)[0]


def unflatten(rows_BX, width):
    """TokenRows' rows back to (token vectors (B, width, D), scoring mask (B, width) bool)."""
    rows_BTX = rows_BX.view(len(rows_BX), width, -1)
    return rows_BTX[..., :-1], rows_BTX[..., -1] > 0.5


def token_matrices(encoder, model, loaded, texts, task, names, batch_size, device, autocast):
    """`encoder` (eval_dist.encode or encode_local) run on `texts` through TokenRows: what it
    returns, its rows unflattened: (vectors, mask) or (rows, vectors, mask). (all ranks participate)
    Every rank tokenizes all of `texts` once to find their longest, the one width of all rows."""

    def tokenize(texts, names=None):  # every text of `task` (a ColBERT query's expansion)
        return loaded.tokenize(texts, names, tasks=[task] * len(texts))

    width = tokenize(texts, names)["input_ids"].shape[1]
    rows = TokenRows(model, width, task, *multivector.mask_settings(loaded))
    out = encoder(rows, tokenize, texts, batch_size, device, names, autocast)  # (all ranks participate)
    return (*out[:-1], *unflatten(out[-1], width)) if isinstance(out, tuple) else unflatten(out, width)


def evaluate_retrieval(
    model,
    loaded,
    queries,
    corpus,
    relevant,
    *,
    batch_size=32,
    device=None,
    autocast=contextlib.nullcontext,
    metrics=None,
    columns=None,
    k=10,
    corpus_chunk=CORPUS_CHUNK,
    dims=(),
    similarity=None,
):
    """Retrieve each query's best corpus entries by MaxSim (MeanMaxSim for a "meanmaxsim" model) and
    score them: `metrics` NAME@K with NAME mrr, ndcg, recall or map (default mrr@k, ndcg@k, recall@1,
    recall@k), `relevant[q]` a set of corpus indices or {index: graded relevance}, exactly as
    eval_dist.evaluate_retrieval (whose functions compute them). `columns`: the queries' and the
    corpus' column names, for tokenize. The same dict on every rank. (all ranks participate)
    `dims` and `similarity` are eval_dist.evaluate_retrieval's, taken so that one call serves both:
    a token matrix has no Matryoshka sizes (ValueError), and the similarity is the model's own,
    whatever `similarity` says (a dense model's cosine)."""
    if dims:
        raise ValueError(f"Matryoshka sizes {list(dims)}: a multi-vector model's token vectors have none")
    names = metrics or (f"mrr@{k}", f"ndcg@{k}", "recall@1", f"recall@{k}")
    gains = eval_dist.relevance_grades(queries, corpus, relevant)
    top = max(int(name.split("@")[1]) for name in names)
    meanmaxsim = loaded.model.multivector["similarity"] == "meanmaxsim"
    options = (batch_size, device, autocast)
    query_names = [columns[0]] * len(queries) if columns else None
    # every query's token matrix on every rank (all ranks participate)
    q_QTD, q_mask_QT = token_matrices(
        eval_dist.encode, model, loaded, queries, "query", query_names, *options
    )
    distinct = {}  # text -> its index among the distinct texts, in first-seen order
    distinct_of_row_N = torch.tensor(
        [distinct.setdefault(text, len(distinct)) for text in corpus], device=q_QTD.device
    )
    texts_U = list(distinct)
    best_scores_QK = torch.full((len(queries), top), float("-inf"), dtype=torch.float64, device=q_QTD.device)
    best_rows_QK = torch.full((len(queries), top), -1, dtype=torch.long, device=q_QTD.device)
    for start in range(0, len(texts_U), corpus_chunk):  # the same chunks on every rank
        texts = texts_U[start : start + corpus_chunk]
        doc_names = [columns[1]] * len(texts) if columns else None
        local_L, d_LSD, d_mask_LS = token_matrices(
            eval_dist.encode_local, model, loaded, texts, "document", doc_names, *options
        )  # (all ranks participate)
        if len(local_L) == 0:  # every forward of this rank was a dummy; scoring is no collective
            continue
        scores_QL = multivector.maxsim(q_QTD, q_mask_QT, d_LSD, d_mask_LS, meanmaxsim).double()
        best_scores_QK, best_rows_QK = keep_best(
            best_scores_QK, best_rows_QK, scores_QL, start + local_L, distinct_of_row_N, len(texts_U)
        )
    hits = merge_ranks(best_scores_QK, best_rows_QK)  # (all ranks participate)
    return eval_dist.retrieval_metrics(hits, gains, names)


def keep_best(best_scores_QK, best_rows_QK, scores_QL, distinct_L, distinct_of_row_N, num_distinct):
    """Each query's best K corpus rows among those kept so far and the rows of this chunk's texts
    (distinct_L: their indices among the distinct texts, scores_QL their scores): every copy of a
    text takes that text's score, so duplicates tie exactly. No collective."""
    column_of_distinct_U = torch.full((num_distinct,), -1, dtype=torch.long, device=scores_QL.device)
    column_of_distinct_U[distinct_L] = torch.arange(len(distinct_L), device=scores_QL.device)
    rows_R = (column_of_distinct_U[distinct_of_row_N] >= 0).nonzero().squeeze(1)  # ascending
    scores_QR = scores_QL[:, column_of_distinct_U[distinct_of_row_N[rows_R]]]
    # eval_dist's order: score descending, then corpus row ascending (world-size independent ties)
    return eval_dist._best_k(
        torch.cat([best_scores_QK, scores_QR], 1),
        torch.cat([best_rows_QK, rows_R.expand(len(scores_QR), -1)], 1),
        best_scores_QK.shape[1],
    )


def merge_ranks(best_scores_QK, best_rows_QK):
    """Every query's best K rows of the whole corpus, as a list per query (-1 where the corpus has
    fewer), the same on every rank, from each rank's best K of its own rows. (all ranks participate)"""
    rank, world_size = eval_dist.rank_and_world()
    num_queries, k = best_scores_QK.shape
    # A fixed-size (W, Q, K, 2) buffer, zero but for this rank's slot; float64 holds the float32
    # scores and the row indices (< 2^53) exactly, so one collective carries both.
    offers_WQK2 = best_scores_QK.new_zeros(world_size, num_queries, k, 2)
    offers_WQK2[rank, :, :, 0], offers_WQK2[rank, :, :, 1] = best_scores_QK, best_rows_QK.double()
    if world_size > 1:
        # Slot r holds rank r's offer and zeros elsewhere: the SUM is every offer (-inf + 0 = -inf).
        dist.all_reduce(offers_WQK2, op=dist.ReduceOp.SUM)  # (all ranks participate)
    cand_QC2 = offers_WQK2.permute(1, 0, 2, 3).reshape(num_queries, world_size * k, 2)
    _, rows_QK = eval_dist._best_k(cand_QC2[..., 0], cand_QC2[..., 1].long(), k)
    return rows_QK.tolist()
