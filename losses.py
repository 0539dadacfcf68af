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
pairs of the batch), matching sentence-transformers' MultipleNegativesRankingLoss (its hardness
weighting too), CoSENTLoss, SoftmaxLoss, MarginMSELoss, DistillKLDivLoss, MSELoss and MatryoshkaLoss
on the same embeddings, values and gradients, GISTEmbedLoss on the same models' embeddings, and for
sparse (SPLADE) embeddings SpladeLoss around SparseMultipleNegativesRankingLoss, SparseMarginMSELoss or
SparseDistillKLDivLoss, and FlopsLoss.

Usage (one process, CPU is fine):
    import losses
    loss = losses.mnrl_loss(emb_anchor_BD, [emb_positive_BD, emb_negative_BD])
    # GISTEmbed: in-batch negatives the guide model rates as close as the positive are dropped
    loss = losses.mnrl_loss(emb_anchor_BD, [emb_positive_BD], guide=(guide_anchor_BD, [guide_positive_BD]),
                            false_negatives=("absolute", 0.0))

Cross-device negatives (`mnrl_loss(..., gather=True)`): under torchrun every rank's
candidates become negatives for every rank's anchors; works on any wrapper (DDP, FSDP1, FSDP2)
because it only sees embeddings. A collective hidden in a loss (all ranks participate): an
all_gather in the forward, a reduce-scatter in the backward, so every rank computes the loss.
GradCache is not here: it re-runs the model, so it lives beside the training step
(fsdp_embed/gradcache.py, `cached_backward`, called by the full trainer's forward_backward),
and serves every loss below unchanged.

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
    return _GatherWithGrad.apply(emb_BD)


def gather_no_grad(rows_B):
    """Every rank's rows (any trailing shape), in rank order -> (world * B, ...), without gradient:
    text ids, a guide model's embeddings. A collective (all ranks participate), with the same B."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows_B
    gathered = rows_B.new_empty((dist.get_world_size() * rows_B.shape[0], *rows_B.shape[1:]))
    _all_gather(gathered, rows_B.contiguous())  # (all ranks participate)
    return gathered


def gather_ids(ids_B):
    """Every rank's text ids, in rank order -> (world * B,): gather_no_grad (all ranks participate)."""
    return gather_no_grad(ids_B)


def duplicate_mask(query_ids_B, pair_ids_B, candidate_ids_N, pair_index_B):
    """(B, N) True where candidate j is the same text as row i's query or as the other text of
    its pair, candidate pair_index[i] (but not at j = pair_index[i] itself): such a candidate is
    no negative for row i."""
    same_BN = (candidate_ids_N[None, :] == query_ids_B[:, None]) | (
        candidate_ids_N[None, :] == pair_ids_B[:, None]
    )
    same_BN[torch.arange(len(pair_index_B), device=pair_index_B.device), pair_index_B] = False
    return same_BN


MNRL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc", "positive_to_positive")
FALSE_NEGATIVE_STRATEGIES = ("absolute", "relative")
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")


def mnrl_loss(
    emb_anchor_BD,
    emb_candidates,
    scale=20.0,
    gather=False,
    symmetric=False,
    text_ids=None,
    directions=("query_to_doc",),
    partition="joint",
    guide=None,
    false_negatives=None,
    hardness=None,
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

    false_negatives=(strategy, margin), guide=(guide_anchor_BD, [guide_candidate_BD, ...]): GISTEmbed's
    guided masking in every direction ranked (`false_negative_mask`); without a guide the student's own
    similarities, detached, are the guide. The guide's rows are gathered as the student's (all ranks
    participate). hardness=(mode, strength): sentence-transformers' hardness weighting (`hardness_penalty`).
    """
    options = {"guide": guide, "false_negatives": false_negatives, "hardness": hardness}
    if tuple(directions) != ("query_to_doc",):
        assert not symmetric and text_ids is None, "mnrl_loss: directions, not with symmetric or text_ids"
        return _mnrl_directions(
            emb_anchor_BD, emb_candidates, scale, gather, directions, partition, **options
        )
    return _mnrl_query_to_doc(emb_anchor_BD, emb_candidates, scale, gather, symmetric, text_ids, **options)


def _mnrl_query_to_doc(
    emb_anchor_BD, emb_candidates, scale, gather, symmetric, text_ids, guide, false_negatives, hardness
):
    """mnrl_loss with the query_to_doc direction alone (and `symmetric`'s positive -> anchors).
    With `gather`, the gathers of mnrl_loss (all ranks participate)."""
    num_rows = emb_anchor_BD.shape[0]
    offset = dist.get_rank() * num_rows if gather and dist.is_initialized() else 0
    # when gather: every column, in the same order on every rank
    emb_candidates = [gather_with_grad(emb) for emb in emb_candidates] if gather else emb_candidates
    labels_B = torch.arange(offset, offset + num_rows, device=emb_anchor_BD.device)
    cos_BN = cosine_scores(emb_anchor_BD, torch.cat(emb_candidates, dim=0))
    scores = {"query_to_doc": scale * cos_BN}
    if hardness is not None:
        penalty_BN = hardness_penalty(cos_BN, labels_B, len(emb_candidates), *hardness)
        scores["query_to_doc"] = scores["query_to_doc"] + penalty_BN
    all_anchors_MD = emb_anchor_BD
    if symmetric:  # the positive -> anchors direction: doc_to_query's pairs, with a softmax of its own
        all_anchors_MD = gather_with_grad(emb_anchor_BD) if gather else emb_anchor_BD
        scores["doc_to_query"] = scale * cosine_scores(emb_candidates[0][labels_B], all_anchors_MD)
    if text_ids is not None:
        scores = _mask_duplicates(scores, text_ids, labels_B, gather)
    if false_negatives is not None:
        scores = _mask_false_negatives(
            scores, false_negatives, guide, emb_anchor_BD, all_anchors_MD, emb_candidates, labels_B, gather
        )
    loss = F.cross_entropy(scores["query_to_doc"], labels_B)
    if not symmetric:
        return loss
    return (loss + F.cross_entropy(scores["doc_to_query"], labels_B)) / 2


def _mask_duplicates(scores, text_ids, place_B, gather):
    """mnrl_loss's text_ids: -inf where a candidate has the text of row i's anchor or positive
    (query_to_doc), and where an anchor has (doc_to_query: `symmetric`'s positive -> anchors).
    With `gather`, the ids' gathers (all ranks participate)."""
    anchor_ids_B = text_ids[0]
    # when gather: each column's ids, in the same order on every rank
    cand_ids_N = torch.cat([gather_ids(ids) if gather else ids for ids in text_ids[1:]])
    positive_ids_B = cand_ids_N[place_B]
    same_BN = duplicate_mask(anchor_ids_B, positive_ids_B, cand_ids_N, place_B)
    masked = {"query_to_doc": scores["query_to_doc"].masked_fill(same_BN, float("-inf"))}
    if "doc_to_query" in scores:
        all_anchor_ids_M = gather_ids(anchor_ids_B) if gather else anchor_ids_B
        same_BM = duplicate_mask(positive_ids_B, anchor_ids_B, all_anchor_ids_M, place_B)
        masked["doc_to_query"] = scores["doc_to_query"].masked_fill(same_BM, float("-inf"))
    return masked


def at_place(place_B, width):
    """(B, width) booleans, row i True at column place_B[i]: one_hot's, without the range check
    that reads the indices back from the device (a GPU wait)."""
    return place_B[:, None] == torch.arange(width, device=place_B.device)


def _mnrl_directions(
    emb_anchor_BD, emb_candidates, scale, gather, directions, partition, guide, false_negatives, hardness
):
    """mnrl_loss with more directions than query_to_doc; -inf marks what is no negative. With
    `gather`, the gathers of mnrl_loss (all ranks participate).

    directions (sentence-transformers' `directions`; GTE's "improved contrastive loss" is all
    four): more negatives for row i's positive pair, all at `scale`, from
        query_to_doc    a_i against every candidate (always on)
        query_to_query  a_i against every other anchor
        doc_to_query    p_i against every anchor
        doc_to_doc      p_i against every candidate but row i's own (its positive and negatives)
        positive_to_positive  p_i against every other positive (GISTEmbedLoss's positive-positive
                        block, its contrast_positives)
    partition "joint": one softmax over all of them; "per_direction": one normaliser per
    direction, their log-sum-exps averaged: only with query_to_doc and doc_to_query, the
    directions whose candidates hold the positive pair. guide, false_negatives, hardness: mnrl_loss's.
    """
    num_rows = emb_anchor_BD.shape[0]
    offset = dist.get_rank() * num_rows if gather and dist.is_initialized() else 0
    # when gather: every column, in the same order on every rank
    all_candidates = [gather_with_grad(emb) for emb in emb_candidates] if gather else emb_candidates
    uses_anchors = "query_to_query" in directions or "doc_to_query" in directions
    # The anchors of every rank, where a direction ranks against them: the same directions on
    # every rank, so the same gathers
    all_anchors_MD = gather_with_grad(emb_anchor_BD) if gather and uses_anchors else emb_anchor_BD
    cand_ND, rows_B = torch.cat(all_candidates), torch.arange(num_rows, device=emb_anchor_BD.device)
    place_B = rows_B + offset  # row i's place among the gathered rows of one column
    positive_BD = all_candidates[0][place_B]
    scores = {"query_to_doc": cosine_scores(emb_anchor_BD, cand_ND)}
    if "query_to_query" in directions:
        same_anchor_BM = at_place(place_B, all_anchors_MD.shape[0])
        scores["query_to_query"] = cosine_scores(emb_anchor_BD, all_anchors_MD).masked_fill(
            same_anchor_BM, float("-inf")
        )
    if "doc_to_query" in directions:
        scores["doc_to_query"] = cosine_scores(positive_BD, all_anchors_MD)
    if "doc_to_doc" in directions:
        row_docs_BN = at_place(place_B, all_candidates[0].shape[0]).repeat(1, len(all_candidates))
        scores["doc_to_doc"] = cosine_scores(positive_BD, cand_ND).masked_fill(row_docs_BN, float("-inf"))
    if "positive_to_positive" in directions:
        same_positive_BP = at_place(place_B, all_candidates[0].shape[0])
        scores["positive_to_positive"] = cosine_scores(positive_BD, all_candidates[0]).masked_fill(
            same_positive_BP, float("-inf")
        )
    cos_BN = scores["query_to_doc"]
    scores = {name: scale * s for name, s in scores.items()}
    if hardness is not None:
        penalty_BN = hardness_penalty(cos_BN, place_B, len(all_candidates), *hardness)
        scores["query_to_doc"] = scores["query_to_doc"] + penalty_BN
    if false_negatives is not None:
        scores = _mask_false_negatives(
            scores, false_negatives, guide, emb_anchor_BD, all_anchors_MD, all_candidates, place_B, gather
        )
    positive_B = scores["query_to_doc"][rows_B, place_B]
    if partition == "joint":
        log_z_B = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
    else:
        log_z_B = torch.stack([torch.logsumexp(s, dim=1) for s in scores.values()]).mean(0)
    return (log_z_B - positive_B).mean()


def false_negative_mask(guide_scores_BN, guide_positive_B, strategy, margin, positive_place_B=None):
    """(B, N) True where candidate j is, by the guide's similarities g, too close to row i to be
    its negative (GISTEmbed, Solatorio 2024; sentence-transformers' GISTEmbedLoss margin_strategy):

        absolute   g_ij > g_i+ - margin
        relative   g_ij > g_i+ - |g_i+| * margin

    g_i+ (`guide_positive_B`): the guide's similarity of row i's anchor and its own positive, the
    threshold of every direction. Qwen3-Embedding's s_ij > s_i+ + 0.1 is ("absolute", -0.1).
    `positive_place_B`: the column of row i's positive pair in this direction, never masked."""
    if strategy not in FALSE_NEGATIVE_STRATEGIES:
        raise ValueError(f"false-negative strategy {strategy!r}: use one of {FALSE_NEGATIVE_STRATEGIES}")
    slack_B = margin if strategy == "absolute" else guide_positive_B.abs() * margin
    mask_BN = guide_scores_BN > (guide_positive_B - slack_B)[:, None]
    if positive_place_B is not None:
        mask_BN[torch.arange(len(mask_BN), device=mask_BN.device), positive_place_B] = False
    return mask_BN


def _guide_embeddings(guide, emb_anchor_BD, all_anchors_MD, all_candidates, gather, needs_anchors):
    """The guide's (anchors of this rank, anchors of every rank, candidate columns of every rank),
    without gradient: `guide`'s rows gathered as the student's are (all ranks participate) when
    gather, the anchors where a direction ranks against them; without a guide, the student's own."""
    if guide is None:
        return emb_anchor_BD.detach(), all_anchors_MD.detach(), [c.detach() for c in all_candidates]
    guide_anchor_BD, guide_candidates = guide[0].detach(), [c.detach() for c in guide[1]]
    if not gather:
        return guide_anchor_BD, guide_anchor_BD, guide_candidates
    # the same columns, in the same order on every rank, as the student's
    guide_candidates = [gather_no_grad(c) for c in guide_candidates]
    # where needs_anchors: the same directions on every rank
    guide_anchors_MD = gather_no_grad(guide_anchor_BD) if needs_anchors else guide_anchor_BD
    return guide_anchor_BD, guide_anchors_MD, guide_candidates


def _mask_false_negatives(
    scores, false_negatives, guide, anchor_BD, all_anchors_MD, all_candidates, place_B, gather
):
    """Each direction of `scores` ({name: (B, X) logits}, as in _mnrl_directions; "doc_to_query" is
    also `symmetric`'s positive -> anchors) with its false negatives at -inf: false_negative_mask of
    the guide's similarities of the same pairs, as GISTEmbedLoss does for its anchor-positive,
    anchor-anchor (query_to_query), positive-positive (positive_to_positive) and anchor-negative
    matrices; doc_to_doc ranks p_i against every document. With `gather` and a guide, the guide's
    gathers (all ranks participate)."""
    needs_anchors = not scores.keys().isdisjoint({"query_to_query", "doc_to_query"})
    g_anchor_BD, g_anchors_MD, g_candidates = _guide_embeddings(
        guide, anchor_BD, all_anchors_MD, all_candidates, gather, needs_anchors
    )
    g_cand_ND, g_positive_BD = torch.cat(g_candidates), g_candidates[0][place_B]
    pairs = {  # each direction's guide rows and columns, and the column of row i's positive pair
        "query_to_doc": (g_anchor_BD, g_cand_ND, place_B),
        "query_to_query": (g_anchor_BD, g_anchors_MD, None),
        "doc_to_query": (g_positive_BD, g_anchors_MD, place_B),
        "doc_to_doc": (g_positive_BD, g_cand_ND, None),
        "positive_to_positive": (g_positive_BD, g_candidates[0], None),
    }
    g_positive_B = cosine_scores(g_anchor_BD, g_cand_ND)[
        torch.arange(len(place_B), device=place_B.device), place_B
    ]
    masked = {}
    for name, scores_BX in scores.items():
        g_rows_BD, g_cols_XD, positive_place_B = pairs[name]
        mask_BX = false_negative_mask(
            cosine_scores(g_rows_BD, g_cols_XD), g_positive_B, *false_negatives, positive_place_B
        )
        masked[name] = scores_BX.masked_fill(mask_BX, float("-inf"))
    return masked


def hardness_penalty(cos_BN, place_B, num_columns, mode, strength):
    """sentence-transformers' MultipleNegativesRankingLoss hardness weighting (Lan et al. 2025, Eq. 5):
    strength * stop_grad(cos), added to the selected query_to_doc logits after `scale`, so that harder
    negatives weigh more in the softmax. `cos_BN`: the unscaled query_to_doc cosines, `num_columns`
    columns of candidates (positives, then each negative column); the penalised candidates of row i
    (its positive at `place_B[i]`):
        in_batch_negatives  other rows' documents (their positives and hard negatives)
        hard_negatives      row i's own hard negatives
        all_negatives       every document but row i's positive"""
    if mode not in HARDNESS_MODES:
        raise ValueError(f"hardness mode {mode!r}: use one of {HARDNESS_MODES}")
    num_world_rows = cos_BN.shape[1] // num_columns
    own_docs_BN = at_place(place_B, num_world_rows).repeat(1, num_columns)
    is_positive_BN = at_place(place_B, cos_BN.shape[1])
    penalised_BN = {
        "in_batch_negatives": ~own_docs_BN,
        "hard_negatives": own_docs_BN & ~is_positive_BN,
        "all_negatives": ~is_positive_BN,
    }[mode]
    return torch.where(penalised_BN, strength * cos_BN.detach(), 0.0)


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


def mse_loss(student_embs, teacher_embs):
    """MSELoss (Reimers & Gurevych, 2020; sentence-transformers' EmbedDistillLoss with distance "mse",
    no projection): distil a teacher's embeddings into the student's, column by column.

        loss = mean_c  mean_{i, d} (s_cid - t_cid)^2

    `student_embs`: C columns of (B, D). `teacher_embs` (labels, no gradient): (B, D), one target
    for every column (multilingual distillation: a sentence and its translations), or (B, C, D).
    Under Matryoshka the student's columns are cut to a size d < D, and the teacher's vectors are
    cut to it too, as sentence-transformers' MatryoshkaLoss cuts the labels."""
    teacher = teacher_embs.detach()[..., : student_embs[0].shape[-1]]
    teacher_columns = [teacher] * len(student_embs) if teacher.dim() == 2 else list(teacher.unbind(1))
    assert len(teacher_columns) == len(student_embs), (teacher.shape, len(student_embs))
    per_column = [F.mse_loss(s, t.to(s.dtype)) for s, t in zip(student_embs, teacher_columns)]
    return torch.stack(per_column).mean()


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


# ---- SPLADE (sparse embeddings, splade.py): V is the vocabulary size, the embedding dimension.


def flops_loss(emb_BV, threshold=None):
    """FLOPS regulariser (Paria et al., 2020), sentence-transformers' FlopsLoss: the squared mean
    weight of each vocabulary entry over the rows, summed, a smooth stand-in for the cost of
    retrieving with these rows:

        loss = sum_v ( mean_i e_iv )^2

    threshold (l0 masking, Geng et al., 2025): a row with at most `threshold` non-zero entries is
    zeroed, not dropped: it still counts in the mean's denominator, as there."""
    if threshold is not None:
        keep_B = ((emb_BV != 0).sum(dim=1) > threshold).to(emb_BV.dtype)
        emb_BV = emb_BV * keep_B[:, None]
    return emb_BV.mean(dim=0).pow(2).sum()


def splade_loss_parts(
    emb_query_BV,
    emb_docs,
    query_regularizer_weight,
    document_regularizer_weight,
    query_regularizer_threshold=None,
    document_regularizer_threshold=None,
    use_document_regularizer_only=False,
    gather=False,
    scale=1.0,
    gather_regularizers=None,
    base_loss=None,
):
    """The terms of `splade_loss`, by sentence-transformers' SpladeLoss's names: base_loss,
    document_regularizer_loss and, with a query weight, query_regularizer_loss (weights applied).
    gather_regularizers (None: as `gather`): the FLOPS terms over every rank's rows (all ranks
    participate), with the negatives gathered or not. base_loss: `splade_loss`'s."""
    if use_document_regularizer_only and query_regularizer_weight is not None:
        # SpladeLoss warns and drops the query weight; a setting dropped without a word is a bug in a run
        raise ValueError(
            "use_document_regularizer_only regularises the queries as documents: "
            "pass query_regularizer_weight=None"
        )
    if gather and base_loss is not None:
        raise ValueError(
            "gather: only MNRL's candidates are gathered, and base_loss is another loss; pass gather=False "
            "(gather_regularizers=True keeps the FLOPS terms over every rank's rows)"
        )
    over_ranks = gather if gather_regularizers is None else gather_regularizers
    # when gathered: every column, in the same order on every rank
    all_docs = [gather_with_grad(emb) for emb in emb_docs] if gather or over_ranks else list(emb_docs)
    parts = {"base_loss": base_loss}
    if base_loss is None:  # SparseMultipleNegativesRankingLoss: every candidate column, gathered or not
        num_rows = emb_query_BV.shape[0]
        offset = dist.get_rank() * num_rows if gather and dist.is_initialized() else 0
        labels_B = torch.arange(offset, offset + num_rows, device=emb_query_BV.device)
        candidates = torch.cat(all_docs if gather else list(emb_docs))
        parts["base_loss"] = F.cross_entropy(scale * emb_query_BV @ candidates.T, labels_B)
    regularized_docs = all_docs if over_ranks else list(emb_docs)
    needs_queries = use_document_regularizer_only or query_regularizer_weight is not None
    # when gathered: the same columns on every rank, so the same gathers
    all_queries = gather_with_grad(emb_query_BV) if over_ranks and needs_queries else emb_query_BV
    documents = torch.cat(
        [all_queries, *regularized_docs] if use_document_regularizer_only else regularized_docs
    )
    document_flops = flops_loss(documents, document_regularizer_threshold)
    parts["document_regularizer_loss"] = document_flops * document_regularizer_weight
    if query_regularizer_weight is not None:
        query_flops = flops_loss(all_queries, query_regularizer_threshold)
        parts["query_regularizer_loss"] = query_flops * query_regularizer_weight
    return parts


def splade_loss(
    emb_query_BV,
    emb_docs,
    query_regularizer_weight,
    document_regularizer_weight,
    query_regularizer_threshold=None,
    document_regularizer_threshold=None,
    use_document_regularizer_only=False,
    gather=False,
    scale=1.0,
    gather_regularizers=None,
    base_loss=None,
):
    """SPLADE's training loss (Formal et al., 2022), sentence-transformers' SpladeLoss: a base loss
    plus the FLOPS regularisers of the queries and of the documents (every document column).

        loss = base + lambda_d * flops(concat(d_1, d_2, ...)) + lambda_q * flops(q)

    base_loss None: SparseMultipleNegativesRankingLoss at its defaults (dot product, scale 1),
    in-batch negatives:
        scores_BN = scale * q_i . c_j        with c = concat(positives, negatives...)
        base      = mean_i -log softmax(scores_BN[i])[i]
    Else the value of another base loss on these same embeddings: SparseMarginMSELoss is
    `margin_mse_loss(q, d_1, d_2, margins_B)`, SparseDistillKLDivLoss `distill_kl_loss(q, docs,
    teacher_BG, T, T)` (both score by dot product, as there; SparseDistillKLDivLoss's default T is 2).

    query_regularizer_weight None: no query term (inference-free queries). The weights are those of
    this step (splade.regularizer_weight warms them up). use_document_regularizer_only: one document
    term over the queries and the documents together (symmetric texts); thresholds: `flops_loss`'s.

    gather=True (all ranks participate; MNRL alone): every rank's candidates are negatives for every
    rank's queries, as in mnrl_loss. gather_regularizers (None: as `gather`; with another base loss,
    pass True to train under DDP as one process): the FLOPS terms over every rank's rows, the same
    value on every rank. Unlike sentence-transformers under DDP (each rank's FLOPS over its own rows:
    the square of a mean is not the mean of squares), world W then trains as world 1 on the W x B
    rows: the reduce-scatter hands each rank W times its rows' share of the FLOPS gradient, which
    DDP's average over ranks divides back.
    """
    parts = splade_loss_parts(
        emb_query_BV,
        emb_docs,
        query_regularizer_weight,
        document_regularizer_weight,
        query_regularizer_threshold,
        document_regularizer_threshold,
        use_document_regularizer_only,
        gather,
        scale,
        gather_regularizers,
        base_loss,
    )
    return sum(parts.values())
