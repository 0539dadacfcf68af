"""Embedding losses as pure functions of embeddings: no model reference, nothing to wrap.

Why pure functions: a loss that holds the model (as sentence-transformers' losses do) breaks
as soon as the model is wrapped by FSDP, because the loss then calls the *unwrapped* module,
whose parameters are flat shards ("'weight' must be 2-D"). Here the training loop runs every
forward through the wrapped model and hands the resulting tensors to these functions.

Shape legend (suffixes on tensor names):
    B  batch size (rows of one micro-batch on one rank)
    D  embedding dimension
    N  number of candidates for MNRL: B * (1 + number of hard-negative columns)
    G  a query's group for listwise distillation: its positive and hard negatives
    C  number of classes (Softmax loss)

Each function returns a scalar: the mean over the batch (CoSENT: one log-sum-exp over all
pairs of the batch), matching sentence-transformers' MultipleNegativesRankingLoss, CoSENTLoss,
SoftmaxLoss, MarginMSELoss, DistillKLDivLoss and MatryoshkaLoss on the same embeddings, values and gradients.

Usage (one process, CPU is fine):
    import losses
    loss = losses.mnrl_loss(emb_anchor_BD, [emb_positive_BD, emb_negative_BD])

Cross-device negatives (`mnrl_loss(..., gather=True)`): under torchrun every rank's
candidates become negatives for every rank's anchors; works on any wrapper (DDP, FSDP1, FSDP2)
because it only sees embeddings. A collective hidden in a loss (all ranks participate): an
all_gather in the forward, a reduce-scatter in the backward, so every rank computes the loss.
GradCache is not here: it re-runs the model, so it lives in the training loop (train.py,
`cached_backward`), and serves every loss below unchanged.

Left out on purpose: similarity functions other than cosine.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cosine_scores(emb_a_BD, emb_b_ND):
    """Cosine similarity of every row of `emb_a_BD` with every row of `emb_b_ND` -> (B, N)."""
    return F.normalize(emb_a_BD, p=2, dim=-1) @ F.normalize(emb_b_ND, p=2, dim=-1).T


# torch 2.13 renamed the two collectives below (the old names still work, with a warning);
# requirements.txt allows torch 2.6, which has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherWithGrad(torch.autograd.Function):
    """Forward: an all_gather of every rank's (B, D) rows. Backward: a reduce-scatter (sum) of
    the gradient. Every rank runs both, in the same order, because every rank computes the loss
    and calls backward on it. Both collectives are synchronous: nothing is left in flight."""

    @staticmethod
    def forward(ctx, emb_BD):
        """The all_gather (all ranks participate)."""
        gathered = emb_BD.new_empty((dist.get_world_size() * emb_BD.shape[0], *emb_BD.shape[1:]))
        _all_gather(gathered, emb_BD.contiguous())  # (all ranks participate)
        return gathered

    @staticmethod
    def backward(ctx, grad_gathered):
        """The reduce-scatter (all ranks participate): every rank calls backward on its loss."""
        grad_BD = grad_gathered.new_empty(
            (grad_gathered.shape[0] // dist.get_world_size(), *grad_gathered.shape[1:])
        )
        _reduce_scatter(grad_BD, grad_gathered.contiguous(), op=dist.ReduceOp.SUM)  # (all ranks participate)
        return grad_BD


def gather_with_grad(emb_BD):
    """Every rank's rows, in rank order -> (world * B, D), with the gradient of each row
    flowing back to the rank that produced it. A collective (all ranks participate), with the
    same B: an all_gather of unequal sizes aborts one rank and hands the others garbage rows.

    Backward is a reduce-scatter (sum): rank r receives the sum, over all ranks' losses, of
    their gradients with respect to r's rows. DDP/FSDP then average over ranks, so the result
    is exactly the gradient of the single-process loss over the global batch, with no extra
    factor of the world size (several public trainers are off by exactly that factor)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return emb_BD
    return _GatherWithGrad.apply(emb_BD)  # (all ranks participate)


def gather_ids(ids_B):
    """Every rank's text ids, in rank order -> (world * B,); integers, so no gradient.
    A collective (all ranks participate), with the same B."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ids_B
    gathered = ids_B.new_empty(dist.get_world_size() * ids_B.shape[0])
    _all_gather(gathered, ids_B.contiguous())  # (all ranks participate)
    return gathered


def duplicate_mask(query_ids_B, pair_ids_B, candidate_ids_N, pair_index_B):
    """(B, N) True where candidate j is the same text as row i's query or as the other text of
    its pair, candidate pair_index[i] (but not at j = pair_index[i] itself): such a candidate is
    no negative for row i."""
    same_BN = (candidate_ids_N[None, :] == query_ids_B[:, None]) | (
        candidate_ids_N[None, :] == pair_ids_B[:, None]
    )
    same_BN[torch.arange(len(pair_index_B), device=pair_index_B.device), pair_index_B] = False
    return same_BN


MNRL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def mnrl_loss(
    emb_anchor_BD,
    emb_candidates,
    scale=20.0,
    gather=False,
    symmetric=False,
    text_ids=None,
    directions=("query_to_doc",),
    partition="joint",
):
    """MultipleNegativesRankingLoss (InfoNCE with in-batch negatives).

    `emb_candidates`: (B, D) tensors, the positives, then any hard-negative columns. Row i's positive
    is candidate i; every other candidate (other rows' positives, all negatives) is a negative:

        scores_BN = scale * cos(a_i, c_j)    with c = concat(positives, negatives...)
        loss      = mean_i  -log( exp(scores[i, i]) / sum_j exp(scores[i, j]) )

    gather=True (all ranks participate), cross-device negatives: the candidates (and, for `symmetric`,
    the anchors) of all W ranks are gathered, N = W * B * (1 + negatives); anchors stay local, row i's
    positive at rank * B + i: with the sampler's contiguous slices, the single-process batch of W * B rows.

    symmetric=True (sentence-transformers' MultipleNegativesSymmetricRankingLoss) averages it
    with the positive -> anchors direction: ( CE(a_i -> all candidates) + CE(p_i -> all anchors) ) / 2

    text_ids (duplicate-safe negatives): one (B,) integer tensor per column, equal where the texts are
    (a hash): a candidate with row i's anchor's or positive's text is no negative for row i (-inf).

    directions, partition: more negatives per pair (`_mnrl_directions`); not with `symmetric` or `text_ids`.
    """
    if tuple(directions) != ("query_to_doc",):
        assert not symmetric and text_ids is None, "mnrl_loss: directions, not with symmetric or text_ids"
        # (all ranks participate) when gather, as below
        return _mnrl_directions(emb_anchor_BD, emb_candidates, scale, gather, directions, partition)
    num_rows = emb_anchor_BD.shape[0]
    offset = dist.get_rank() * num_rows if gather and dist.is_initialized() else 0
    # (all ranks participate) when gather: every column, in the same order on every rank
    emb_candidates = [gather_with_grad(emb) for emb in emb_candidates] if gather else emb_candidates
    labels_B = torch.arange(offset, offset + num_rows, device=emb_anchor_BD.device)
    emb_cand_ND = torch.cat(emb_candidates, dim=0)
    scores_BN = scale * cosine_scores(emb_anchor_BD, emb_cand_ND)
    if text_ids is not None:
        anchor_ids_B = text_ids[0]
        # (all ranks participate) when gather: each column's ids, in the same order on every rank
        cand_ids_N = torch.cat([gather_ids(ids) if gather else ids for ids in text_ids[1:]])
        scores_BN = scores_BN.masked_fill(
            duplicate_mask(anchor_ids_B, cand_ids_N[labels_B], cand_ids_N, labels_B), float("-inf")
        )
    loss = F.cross_entropy(scores_BN, labels_B)
    if not symmetric:
        return loss
    all_anchors_MD = gather_with_grad(emb_anchor_BD) if gather else emb_anchor_BD  # (all ranks participate)
    emb_local_positive_BD = emb_candidates[0][offset : offset + num_rows]
    scores_BM = scale * cosine_scores(emb_local_positive_BD, all_anchors_MD)
    if text_ids is not None:
        all_anchor_ids_M = gather_ids(anchor_ids_B) if gather else anchor_ids_B  # (all ranks participate)
        scores_BM = scores_BM.masked_fill(
            duplicate_mask(cand_ids_N[labels_B], anchor_ids_B, all_anchor_ids_M, labels_B), float("-inf")
        )
    return (loss + F.cross_entropy(scores_BM, labels_B)) / 2


def _mnrl_directions(emb_anchor_BD, emb_candidates, scale, gather, directions, partition):
    """mnrl_loss with more directions than query_to_doc; -inf marks what is no negative. With
    `gather`, the gathers of mnrl_loss (all ranks participate).

    directions (sentence-transformers' `directions`; GTE's "improved contrastive loss" is all
    four): more negatives for row i's positive pair, all at `scale`, from
        query_to_doc    a_i against every candidate (always on)
        query_to_query  a_i against every other anchor
        doc_to_query    p_i against every anchor
        doc_to_doc      p_i against every candidate but row i's own (its positive and negatives)
    partition "joint": one softmax over all of them; "per_direction": one normaliser per
    direction, their log-sum-exps averaged: only with query_to_doc and doc_to_query, the
    directions whose candidates hold the positive pair.
    """
    num_rows = emb_anchor_BD.shape[0]
    offset = dist.get_rank() * num_rows if gather and dist.is_initialized() else 0
    # (all ranks participate) when gather: every column, in the same order on every rank
    all_candidates = [gather_with_grad(emb) for emb in emb_candidates] if gather else emb_candidates
    uses_anchors = "query_to_query" in directions or "doc_to_query" in directions
    # The anchors of every rank, where a direction ranks against them: the same directions on
    # every rank, so the same gathers (all ranks participate).
    all_anchors_MD = gather_with_grad(emb_anchor_BD) if gather and uses_anchors else emb_anchor_BD
    cand_ND, rows_B = torch.cat(all_candidates), torch.arange(num_rows, device=emb_anchor_BD.device)
    place_B = rows_B + offset  # row i's place among the gathered rows of one column
    positive_BD = all_candidates[0][place_B]
    scores = {"query_to_doc": cosine_scores(emb_anchor_BD, cand_ND)}
    if "query_to_query" in directions:
        same_anchor_BM = F.one_hot(place_B, all_anchors_MD.shape[0]).bool()
        scores["query_to_query"] = cosine_scores(emb_anchor_BD, all_anchors_MD).masked_fill(
            same_anchor_BM, float("-inf")
        )
    if "doc_to_query" in directions:
        scores["doc_to_query"] = cosine_scores(positive_BD, all_anchors_MD)
    if "doc_to_doc" in directions:
        row_docs_BN = F.one_hot(place_B, all_candidates[0].shape[0]).bool().repeat(1, len(all_candidates))
        scores["doc_to_doc"] = cosine_scores(positive_BD, cand_ND).masked_fill(row_docs_BN, float("-inf"))
    scores = {name: scale * s for name, s in scores.items()}
    positive_B = scores["query_to_doc"][rows_B, place_B]
    if partition == "joint":
        log_z_B = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
    else:
        log_z_B = torch.stack([torch.logsumexp(s, dim=1) for s in scores.values()]).mean(0)
    return (log_z_B - positive_B).mean()


def own_negatives_loss(emb_anchor_BD, emb_candidates, scale=20.0):
    """MNRL against each row's own texts only: anchor i is ranked against its positive and its
    own hard negatives (the columns of `emb_candidates`, positive first), never against other
    rows' texts. For data where other rows are no negatives (classes, clusters: another row of
    the same class would be pushed away).

        s_ig = scale * cos(a_i, c_ig)        loss = mean_i -log softmax_g(s_i)[positive]
    """
    scores_BG = scale * torch.stack(
        [F.cosine_similarity(emb_anchor_BD, c, dim=-1) for c in emb_candidates], 1
    )
    return F.cross_entropy(scores_BG, scores_BG.new_zeros(len(scores_BG), dtype=torch.long))


def cosent_loss(emb_a_BD, emb_b_BD, scores_B, scale=20.0):
    """CoSENTLoss (Su, 2022): rank the pairs' cosine similarities like their gold scores.

        s_i  = scale * cos(a_i, b_i)
        loss = log( 1 + sum_{(i, j): score_i > score_j} exp(s_j - s_i) )

    Every pair whose gold order is i above j is penalised when its predicted order disagrees.
    """
    sims_B = scale * F.cosine_similarity(emb_a_BD, emb_b_BD, dim=-1)
    diffs_BB = sims_B[None, :] - sims_B[:, None]  # diffs[i, j] = s_j - s_i
    # Keep only the pairs with gold score_i > score_j; the others get -inf (exp(-inf) = 0).
    is_ordered_BB = scores_B[:, None] > scores_B[None, :]
    diffs_BB = diffs_BB.masked_fill(~is_ordered_BB, float("-inf"))
    # The leading zero is the "1 +" inside the log: log(exp(0) + sum exp(...)).
    logits = torch.cat([diffs_BB.new_zeros(1), diffs_BB.flatten()])
    return torch.logsumexp(logits, dim=0)


def margin_mse_loss(emb_query_BD, emb_positive_BD, emb_negative_BD, margins_B):
    """MarginMSELoss (Hofstätter et al., 2020): distil a teacher's score margins.

    margin_i = q_i . p_i - q_i . n_i          (dot products, as sentence-transformers)
    loss     = mean_i (margin_i - teacher_margin_i)^2
    """
    predicted_B = (emb_query_BD * emb_positive_BD).sum(-1) - (emb_query_BD * emb_negative_BD).sum(-1)
    return F.mse_loss(predicted_B, margins_B.to(predicted_B.dtype))


def distill_kl_loss(emb_query_BD, emb_group, teacher_BG, student_temperature=1.0, teacher_temperature=1.0):
    """DistillKLDivLoss (Lin et al., 2020): listwise distillation. The student's score
    distribution over each query's group (its positive and hard negatives, `emb_group`: G
    columns of (B, D)) is matched to a teacher's scores over the same texts (`teacher_BG`).

        s_ig = q_i . d_ig / T_student          (dot products, as sentence-transformers)
        p_i  = softmax_g(teacher_ig / T_teacher)
        loss = T_student^2 * mean_i KL(p_i || softmax_g(s_i))

    T_student^2 keeps the gradient's size comparable across temperatures (Hinton et al.). Each
    row sees its own group only, so the loss is a mean of per-row terms: no negatives from
    other rows or ranks."""
    student_BG = torch.stack([(emb_query_BD * emb_BD).sum(-1) for emb_BD in emb_group], dim=1)
    teacher_probs_BG = torch.softmax(teacher_BG.to(student_BG.dtype) / teacher_temperature, dim=1)
    log_probs_BG = torch.log_softmax(student_BG / student_temperature, dim=1)
    kl = F.kl_div(log_probs_BG, teacher_probs_BG, reduction="batchmean")
    return kl * student_temperature**2


def matryoshka_loss(loss_of, embs, dims, weights):
    """Matryoshka representation learning (Kusupati et al., 2022): the loss at several
    embedding sizes, so that the first d dimensions of an embedding are an embedding too.

        loss = sum_d  w_d * loss_of([normalize(e[:, :d]) for e in embs])

    `loss_of` maps the list of column embeddings to a scalar (any loss above, with its labels
    bound). Truncated embeddings are L2-normalised, as sentence-transformers' MatryoshkaLoss
    does (it changes nothing for the cosine losses, and is what MarginMSE's dot products see).
    Dimensions are taken largest first, as there."""
    total = 0.0
    for dim, weight in sorted(zip(dims, weights), key=lambda dw: -dw[0]):
        total = total + weight * loss_of([F.normalize(emb[..., :dim], p=2, dim=-1) for emb in embs])
    return total


def softmax_features(emb_a_BD, emb_b_BD):
    """The classifier input of SoftmaxLoss (Reimers & Gurevych, 2019): (u, v, |u - v|) -> (B, 3D)."""
    return torch.cat([emb_a_BD, emb_b_BD, (emb_a_BD - emb_b_BD).abs()], dim=-1)


def softmax_loss(emb_a_BD, emb_b_BD, labels_B, classifier):
    """SoftmaxLoss: a linear classifier over (u, v, |u - v|), trained with cross-entropy.

        logits_BC = classifier([u; v; |u - v|])
        loss      = mean_i  -log softmax(logits_BC[i])[label_i]

    `classifier` is any callable (B, 3D) -> (B, C). Under DDP/FSDP pass a function that runs
    the head through the *wrapped* model (train.py does), so FSDP gathers its parameters.
    """
    logits_BC = classifier(softmax_features(emb_a_BD, emb_b_BD))
    return F.cross_entropy(logits_BC, labels_B)
