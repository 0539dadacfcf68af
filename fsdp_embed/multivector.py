"""Multi-vector (ColBERT) embeddings: one vector per token, queries and documents scored by MaxSim
(the sum over a query's tokens of each one's best similarity among the document's tokens), as
sentence-transformers 6's MultiVectorEncoder computes them.

The model (embedding_model.EmbeddingModel with `multivector` settings) returns every text's token
vectors, (B, T, dim): the transformer's states through a bias-free Dense projection (hidden -> 128)
and normalised per token. Which of them count is the scoring mask (`scoring_masks`): the
attention mask, less the skiplist's tokens on the `skiplist_tasks` side (documents by default).
Column 0 of a row is the query; the other columns are documents.

    scores_QN = maxsim(q_QTD, q_mask_QT, d_NSD, d_mask_NS)     # bounded memory, forward and backward
    loss = mnrl_loss(q, q_mask, docs, doc_masks, scale=1.0, gather=True)   # (all ranks participate)

Memory: the similarities of every query token with every document token, (Q, N, T, S), outgrow
memory long before the model does. `maxsim` computes them a block of queries and documents at a
time, each block under activation checkpointing, so the backward recomputes one block at a time
too: no pass ever holds more than `chunk_elements` of them.

Cross-device negatives (`gather=True`): each document column's token matrices are padded to the
longest on any rank and all-gathered with their gradients (the masks without), as
sentence-transformers does; anchors stay local and the labels are offset by rank * B. The loss is
then the mean over the local queries, as in sentence-transformers; PyLate multiplies it by the world
size (docs/multivector.md says how to train with its numbers).

Left out (refused at start-up with one error: line, st_folder.multi_vector_config): token pooling,
keep_only_token_ids, *ForRetrieval models, XTR scoring.

Needs torch, and the root's losses.py (gather_with_grad, gather_no_grad)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import losses

# Similarities held at once by maxsim, in forward and in backward: 2^24 float32 numbers, 64 MiB.
CHUNK_ELEMENTS = 2**24


def skip_ids(tokenizer, words):
    """The token ids of the skiplist's words, as MultiVectorMask resolves them: a word the
    tokenizer does not hold as one token (it would read as [UNK]) is dropped."""
    ids = []
    for word in words:
        token_id = tokenizer.convert_tokens_to_ids(word)
        if token_id != tokenizer.unk_token_id or word == tokenizer.unk_token:
            ids.append(token_id)
    return torch.tensor(ids, dtype=torch.long)


def scoring_masks(pool, num_columns, skip_ids_K, skip_tasks, expansion_id=None):
    """Each column's scoring mask (B, T) from the pooled columns' tokens (batches.pool_columns): the
    attention mask, with the query expansion's tokens (`expansion_id`, LoadedModel.expand) in
    column 0 (the queries) whether attended to or not, less the skiplist's tokens in the columns
    whose task is in `skip_tasks` (column 0 is "query", the others "document")."""
    masks = []
    for column, (ids_BT, mask_BT) in enumerate(
        zip(pool["input_ids"].chunk(num_columns), pool["attention_mask"].chunk(num_columns))
    ):
        keep_BT = mask_BT.bool()
        if column == 0 and expansion_id is not None:
            keep_BT = keep_BT | (ids_BT == expansion_id)
        if ("query" if column == 0 else "document") in skip_tasks and len(skip_ids_K):
            keep_BT = keep_BT & ~torch.isin(ids_BT, skip_ids_K.to(ids_BT.device))
        masks.append(keep_BT)
    return masks


def _maxsim_block(q_QTD, q_mask_QT, d_NSD, d_mask_NS):
    """MaxSim of every query with every document of one block: (Q, N), in the inputs' dtype (the
    trainer's losses get fp32 embeddings: embed_columns)."""
    sims_QNTS = torch.einsum("qtd,nsd->qnts", q_QTD, d_NSD)
    # Masked document tokens are sent to the lowest value, never to 0: a padding token must not win
    # the max over a real, negative similarity. Query tokens are summed: masked ones count 0.
    sims_QNTS = sims_QNTS.masked_fill(~d_mask_NS[None, :, None, :], torch.finfo(sims_QNTS.dtype).min)
    return (sims_QNTS.max(-1).values * q_mask_QT[:, None, :]).sum(-1)


def maxsim(q_QTD, q_mask_QT, d_NSD, d_mask_NS, length_normalize=False, chunk_elements=CHUNK_ELEMENTS):
    """scores (Q, N): MaxSim of each query with each document (MeanMaxSim with `length_normalize`:
    divided by the query's token count), as sentence-transformers' maxsim. At most `chunk_elements`
    similarities at a time: blocks of queries x documents, each one checkpointed when a gradient is
    wanted, so the backward recomputes them one block at a time."""
    Q, T, _ = q_QTD.shape
    N, S, _ = d_NSD.shape
    q_mask_QT, d_mask_NS = q_mask_QT.bool(), d_mask_NS.bool()
    rows = max(1, min(Q, chunk_elements // max(1, T * S)))  # queries a block
    cols = max(1, chunk_elements // max(1, rows * T * S))  # documents a block
    grad = torch.is_grad_enabled() and (q_QTD.requires_grad or d_NSD.requires_grad)
    block = (lambda *a: checkpoint(_maxsim_block, *a, use_reentrant=False)) if grad else _maxsim_block
    scores_QN = torch.cat(
        [
            torch.cat(
                [
                    block(
                        q_QTD[i : i + rows],
                        q_mask_QT[i : i + rows],
                        d_NSD[j : j + cols],
                        d_mask_NS[j : j + cols],
                    )
                    for j in range(0, N, cols)
                ],
                dim=1,
            )
            for i in range(0, Q, rows)
        ]
    )
    if length_normalize:
        scores_QN = scores_QN / q_mask_QT.sum(1, keepdim=True).clamp(min=1)
    return scores_QN


def pairwise_maxsim(q_BTD, q_mask_BT, d_BSD, d_mask_BS, length_normalize=False):
    """scores (B,): MaxSim of query i with document i alone."""
    sims_BTS = torch.einsum("btd,bsd->bts", q_BTD, d_BSD)
    sims_BTS = sims_BTS.masked_fill(~d_mask_BS.bool()[:, None, :], torch.finfo(sims_BTS.dtype).min)
    scores_B = (sims_BTS.max(-1).values * q_mask_BT).sum(-1)
    return scores_B / q_mask_BT.sum(1).clamp(min=1) if length_normalize else scores_B


def gather_tokens(emb_BTD, mask_BT):
    """Every rank's token matrices and masks, in rank order: (W * B, T_max, D), (W * B, T_max), each
    padded to the longest on any rank first (an all_gather needs one shape everywhere). The
    embeddings keep their gradients (losses.gather_with_grad: a reduce-scatter in backward).
    (all ranks participate) with equal B on every rank."""
    width = torch.tensor([emb_BTD.shape[1]], device=emb_BTD.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)  # (all ranks participate)
    pad = int(width) - emb_BTD.shape[1]
    emb_BTD, mask_BT = F.pad(emb_BTD, (0, 0, 0, pad)), F.pad(mask_BT, (0, pad))
    return losses.gather_with_grad(emb_BTD), losses.gather_no_grad(mask_BT)  # (all ranks participate)


def padded_cat(embs, masks):
    """Token matrices of several columns as one (sum B, max T, D) batch, with their masks."""
    width = max(e.shape[1] for e in embs)
    return (
        torch.cat([F.pad(e, (0, 0, 0, width - e.shape[1])) for e in embs]),
        torch.cat([F.pad(m, (0, width - m.shape[1])) for m in masks]),
    )


def mnrl_loss(q_BTD, q_mask_BT, docs, doc_masks, scale=1.0, gather=False, length_normalize=False):
    """sentence-transformers' MultiVectorMultipleNegativesRankingLoss: cross-entropy of
    scale * MaxSim(q_i, every document of the batch), the positive docs[0][i] the target; the
    other columns (hard negatives) and every other row's documents are the negatives. With
    `gather` (all ranks participate), every rank's documents, and row i's target is its place
    among them."""
    offset = 0
    if gather and dist.is_initialized() and dist.get_world_size() > 1:
        offset = dist.get_rank() * len(q_BTD)
        gathered = [gather_tokens(e, m) for e, m in zip(docs, doc_masks)]  # (all ranks participate)
        docs, doc_masks = [e for e, _ in gathered], [m for _, m in gathered]
    d_NSD, d_mask_NS = padded_cat(docs, doc_masks)
    scores_BN = maxsim(q_BTD, q_mask_BT, d_NSD, d_mask_NS, length_normalize)
    labels_B = torch.arange(len(q_BTD), device=q_BTD.device) + offset
    return F.cross_entropy(scores_BN * scale, labels_B)


def listwise_scores(q_BTD, q_mask_BT, docs, doc_masks, length_normalize=False):
    """(B, columns): each query's MaxSim with its own row's documents, column by column."""
    return torch.stack(
        [pairwise_maxsim(q_BTD, q_mask_BT, d, m, length_normalize) for d, m in zip(docs, doc_masks)], dim=1
    )


def distill_kl_loss(
    q_BTD, q_mask_BT, docs, doc_masks, teacher_BC, temperatures=(1.0, 1.0), length_normalize=False
):
    """sentence-transformers' MultiVectorDistillKLDivLoss: KL(teacher || student) of the softmax over
    each row's documents, student scores / its temperature, teacher scores / its, times the
    student temperature squared."""
    student_t, teacher_t = temperatures
    scores_BC = listwise_scores(q_BTD, q_mask_BT, docs, doc_masks, length_normalize)
    student_BC = F.log_softmax(scores_BC / student_t, dim=-1)
    teacher_BC = F.log_softmax(teacher_BC.detach().float() / teacher_t, dim=-1)
    return F.kl_div(student_BC, teacher_BC, reduction="batchmean", log_target=True) * student_t**2


def margin_mse_loss(q_BTD, q_mask_BT, docs, doc_masks, labels, length_normalize=False):
    """sentence-transformers' MultiVectorMarginMSELoss: the mean squared error between the student's
    margins MaxSim(q, positive) - MaxSim(q, negative k) and the teacher's (`labels`: (B,) for one
    negative, (B, K) margins, or (B, K + 1) raw scores, positive first)."""
    scores_BC = listwise_scores(q_BTD, q_mask_BT, docs, doc_masks, length_normalize)
    margins_BK = scores_BC[:, :1] - scores_BC[:, 1:]
    labels = labels.float().reshape(len(q_BTD), -1)
    if labels.shape[1] == margins_BK.shape[1] + 1:  # raw scores: their margins
        labels = labels[:, :1] - labels[:, 1:]
    return F.mse_loss(margins_BK, labels.detach())


def mask_settings(loaded):
    """(the skiplist's token ids, the tasks it drops them from, the query expansion's token id or
    None) of a multi-vector LoadedModel (embedding_model.py), for scoring_masks; () for any other."""
    settings = loaded.model.multivector
    if settings is None:
        return ()
    expansion_id = loaded.expansion["token_id"] if loaded.expansion else None
    return (
        skip_ids(loaded.tokenizer, settings["skiplist_words"]),
        tuple(settings["skiplist_tasks"]),
        expansion_id,
    )


def loss_of(loss, embs, masks, labels):
    """One micro-batch's loss from its column token matrices `embs` and scoring `masks`, as its
    LossPlan `loss` (run_plan.py) says: column 0 the queries, the others documents. (all ranks
    participate) with loss.gather (MNRL)."""
    meanmaxsim = loss.multi_vector == "meanmaxsim"
    q, q_mask, docs, doc_masks = embs[0], masks[0], embs[1:], masks[1:]
    if loss.name == "mnrl" and loss.own_negatives:  # each query against its own row's documents alone
        scores_BC = listwise_scores(q, q_mask, docs, doc_masks, meanmaxsim)
        return F.cross_entropy(scores_BC * loss.scale, torch.zeros(len(q), dtype=torch.long, device=q.device))
    if loss.name == "mnrl":
        return mnrl_loss(q, q_mask, docs, doc_masks, loss.scale, loss.gather, meanmaxsim)
    if loss.name == "margin_mse":
        return margin_mse_loss(q, q_mask, docs, doc_masks, labels, meanmaxsim)
    return distill_kl_loss(q, q_mask, docs, doc_masks, labels, loss.temperatures, meanmaxsim)
