"""SPLADE sparse embeddings (sentence-transformers' SparseEncoder) from a masked-language model:
the pooling, the head computed a chunk of rows at a time so that the vocabulary-sized logits are
never held whole, the warm-up of the FLOPS regulariser's weight, and the active dimensions of a row.
Pure functions of tensors, like losses.py (whose `flops_loss` and `splade_loss` train these
embeddings), and the two autograd Functions of the split head.

Shape legend: B rows, R rows of one chunk, T tokens, N the batch's real (unpadded) tokens, n those
of one chunk, H hidden size, V vocabulary size (the embedding dimension), K entries of one block
of the vocabulary, E (row, entry) pairs that get a gradient.

SPLADE (Formal et al., 2021), as sentence-transformers' SpladePooling computes it from the MLM
logits z and the attention mask m:

    w_tv = log(1 + relu(m_t * z_tv))                  activation_function "relu"
    w_tv = log(1 + log(1 + relu(m_t * z_tv)))         "log1p_relu" (OpenSearch's models)
    e_v  = max_t w_tv   ("max", SPLADE v2 and later)  or  sum_t w_tv   ("sum", SPLADE v1)

Two ways from the encoder's hidden states to e, the same values and gradients:
  - `splade_from_split`, for the heads it knows (BERT, RoBERTa, DistilBERT, ModernBERT; checked
    against the head's own output when SpladeHead is built): the head split into its transform,
    ordinary autograd, and its decoder (z = states @ weight.T + bias, the weight tied to the word
    embeddings), whose weight and bias are inputs of an autograd Function, so that their gradients
    return through autograd to the very parameters, as DDP and FSDP expect. Padding's tokens are
    left out before the transform. Max pooling (TokenMaxLogits): the logits are computed a block of
    the vocabulary at a time and reduced at once to each (row, entry)'s chosen token and its logit;
    the backward never computes them again: the gradient of a max reaches one token, so the
    logits' gradient is a sparse matrix (one non-zero per active (row, entry)), multiplied with the
    decoder's weight and with the transformed states (F.embedding_bag). Sum pooling
    (TokenSumWeights): every positive logit has a gradient, so the backward computes the logits
    again, a block at a time, and their gradient in place.
  - `splade_from_hidden`: any head, a callable (..., H) -> (..., V), on chunks of rows, under
    torch.utils.checkpoint in training (the whole head runs twice, and its backward is dense): the
    reference of the first (tests/test_splade_head.py), and the path of a head not known.
`splade_from_head` chooses; bench/bench_splade_head.py measures the two.

Usage (one process, CPU is fine; `masked_lm` a Hugging Face *ForMaskedLM model):
    import losses, splade
    emb_query_BV = splade.splade_embed(masked_lm, query_features, rows_per_chunk=8)
    emb_docs = [splade.splade_embed(masked_lm, f, rows_per_chunk=8) for f in doc_features]
    query_weight = splade.regularizer_weight(step, total_steps, 5e-5)  # warmed up from 0
    document_weight = splade.regularizer_weight(step, total_steps, 3e-5)
    loss = losses.splade_loss(emb_query_BV, emb_docs, query_weight, document_weight)

Under FSDP, `splade_embed` calls the encoder and the head directly, not the wrapped root's
forward, so a root that holds the head's parameters would not gather them. The trainer runs the
head inside its model's forward instead: a `SpladeHead` in place of pooling
(embedding_model.EmbeddingModel), which the wrapped root gathers with the word embeddings it shares.

Needs only torch (no other project file).
Tests: python -m pytest tests/test_splade.py tests/test_splade_head.py -q.
Left out: sentence-transformers' path for unpadded (flattened, FlashAttention-2) inputs, the top-k
`max_active_dims` of encode(), the SparseAutoEncoder (CSR) models (inference-free SPLADE's query
side is inference_free.py's);
a fused kernel for the split head (each block of logits is written to memory and read back once
more, by the activation and the max or sum, and the backward's sparse products gather rows one by
one), and the split for heads beyond the four above (ESM adds its bias outside the decoder, for one:
they keep the checkpointed path).
The export as a SparseEncoder folder is export.py's (`sparse_encoder_files`).
"""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

POOLING_STRATEGIES = ("max", "sum")
ACTIVATION_FUNCTIONS = ("relu", "log1p_relu")
SCHEDULER_TYPES = ("linear", "quadratic")


def check_pooling(pooling_strategy, activation_function):
    """ValueError for a setting SpladePooling does not have."""
    if pooling_strategy not in POOLING_STRATEGIES:
        raise ValueError(f"pooling_strategy {pooling_strategy!r}: use one of {POOLING_STRATEGIES}")
    if activation_function not in ACTIVATION_FUNCTIONS:
        raise ValueError(f"activation_function {activation_function!r}: use one of {ACTIVATION_FUNCTIONS}")


def activate(logits, activation_function):
    """SpladePooling's weights of the logits: log1p(relu(.)), or log1p of that ("log1p_relu")."""
    weights = torch.log1p(torch.relu(logits))
    return torch.log1p(weights) if activation_function == "log1p_relu" else weights


def splade_pool(logits_BTV, attention_mask_BT, pooling_strategy="max", activation_function="relu"):
    """SpladePooling's sparse vectors from the MLM logits -> (B, V), the formula in the module
    docstring. Padding contributes zeros, as there (the mask multiplies the logits before the relu),
    which max pooling cannot tell from a real zero: every weight is >= 0. Max pooling's gradient goes
    to one token per entry (`max`, as there, not `amax`, which splits it between ties)."""
    check_pooling(pooling_strategy, activation_function)
    mask_BT1 = attention_mask_BT.unsqueeze(-1).to(logits_BTV.dtype)
    weights_BTV = activate(logits_BTV * mask_BT1, activation_function)
    if pooling_strategy == "max":
        return weights_BTV.max(dim=1).values
    return weights_BTV.sum(dim=1)


def _pool_rows(hidden_RTH, attention_mask_RT, mlm_head, pooling_strategy, activation_function):
    """One chunk of rows: the head's logits (R, T, V), pooled -> (R, V)."""
    return splade_pool(mlm_head(hidden_RTH), attention_mask_RT, pooling_strategy, activation_function)


def splade_from_hidden(
    hidden_BTH,
    attention_mask_BT,
    mlm_head,
    pooling_strategy="max",
    activation_function="relu",
    rows_per_chunk=8,
    checkpoint=None,
):
    """The sparse vectors from the encoder's last hidden states -> (B, V), `rows_per_chunk` rows at
    a time: the same values as `splade_pool(mlm_head(hidden_BTH), ...)`, and the same gradients.

    `mlm_head`: a callable (..., H) -> (..., V), what the masked LM applies to the hidden states
    (`masked_lm_head`). checkpoint (default: whether autograd records, i.e. in training): run each
    chunk under torch.utils.checkpoint, so the backward recomputes its logits instead of keeping them.

    Memory: the forward holds the (B, V) output and, at any moment, one chunk's (R, T, V) logits
    and the few same-sized tensors of the activation; with checkpoint the graph keeps only the
    chunk's inputs (views of the hidden states) and the backward recomputes one chunk at a time
    (its logits, intermediates and their gradients, a few x R x T x V). Without checkpoint, under
    autograd, every chunk's logits stay until the backward: the chunks then bound only the forward's
    peak. The price of checkpoint: the head runs twice. One row is the smallest chunk (T x V each).
    """
    check_pooling(pooling_strategy, activation_function)
    assert rows_per_chunk >= 1, f"rows_per_chunk must be >= 1, got {rows_per_chunk}"
    use_checkpoint = torch.is_grad_enabled() if checkpoint is None else checkpoint
    settings = (mlm_head, pooling_strategy, activation_function)
    pooled = []
    for start in range(0, hidden_BTH.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        if use_checkpoint:
            pooled_RV = torch.utils.checkpoint.checkpoint(
                _pool_rows, hidden_BTH[rows], attention_mask_BT[rows], *settings, use_reentrant=False
            )
        else:
            pooled_RV = _pool_rows(hidden_BTH[rows], attention_mask_BT[rows], *settings)
        pooled.append(pooled_RV)
    return torch.cat(pooled)


def masked_lm_head(masked_lm):
    """The head of a Hugging Face *ForMaskedLM model as a callable (..., H) -> (..., V): what its
    forward applies to the last hidden states of `masked_lm.base_model` to give the logits."""
    if hasattr(masked_lm, "cls"):  # BERT and the models that copy it
        return masked_lm.cls
    if hasattr(masked_lm, "lm_head"):  # RoBERTa, XLM-RoBERTa, CamemBERT
        return masked_lm.lm_head
    if hasattr(masked_lm, "vocab_projector"):  # DistilBERT: four modules, no head module

        def distilbert_head(hidden):
            hidden = masked_lm.activation(masked_lm.vocab_transform(hidden))
            return masked_lm.vocab_projector(masked_lm.vocab_layer_norm(hidden))

        return distilbert_head
    if hasattr(masked_lm, "head") and hasattr(masked_lm, "decoder"):  # ModernBERT
        return lambda hidden: masked_lm.decoder(masked_lm.head(hidden))
    raise ValueError(
        f"{type(masked_lm).__name__}: no known masked-LM head (cls, lm_head, DistilBERT's, ModernBERT's); "
        "pass the head to splade_from_hidden yourself"
    )


# ---- the head split into its transform and its decoder: the decoder's logits reduced as they are
# computed, a block at a time; under max pooling the gradient sent back through the argmax tokens
# alone, without computing the logits again


def masked_lm_head_split(masked_lm):
    """(transform, decoder) of a Hugging Face *ForMaskedLM model's head, or None for a head not
    known: `transform` a callable (..., H) -> (..., H) (BERT's cls.predictions.transform, RoBERTa's
    dense + gelu + layer_norm, DistilBERT's vocab_transform + activation + vocab_layer_norm,
    ModernBERT's head), `decoder` the nn.Linear (weight V x H, bias V or None) applied after it.
    The decoder's weight is the word embeddings' (tied) and BERT's and RoBERTa's decoder.bias is the
    head's `bias`: the very parameters, read at each call, so FSDP's gathered ones are used."""
    try:
        if hasattr(masked_lm, "cls"):  # BERT and the models that copy it
            return masked_lm.cls.predictions.transform, masked_lm.cls.predictions.decoder
        if hasattr(masked_lm, "lm_head"):  # RoBERTa, XLM-RoBERTa, CamemBERT
            head = masked_lm.lm_head
            return (lambda hidden: head.layer_norm(F.gelu(head.dense(hidden)))), head.decoder
        if hasattr(masked_lm, "vocab_projector"):  # DistilBERT

            def distilbert_transform(hidden):
                return masked_lm.vocab_layer_norm(masked_lm.activation(masked_lm.vocab_transform(hidden)))

            return distilbert_transform, masked_lm.vocab_projector
        if hasattr(masked_lm, "head") and hasattr(masked_lm, "decoder"):  # ModernBERT
            return masked_lm.head, masked_lm.decoder
    except AttributeError:  # a head of the same name but another shape
        return None
    return None


def split_gives_the_head(masked_lm):
    """Whether `masked_lm_head_split` knows this head and decoder(transform(x)) is the head's own
    output (`masked_lm_head`) on a few random states: a head that adds anything of its own (a bias
    outside the decoder, as ESM's, a soft cap) keeps the checkpointed path. Draws from a generator of
    its own, so the caller's random state is untouched."""
    split = masked_lm_head_split(masked_lm)
    if split is None or not isinstance(split[1], torch.nn.Linear):
        return False
    weight = split[1].weight
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, weight.shape[1], generator=generator, dtype=weight.dtype).to(weight.device)
    with torch.no_grad():
        ours, theirs = split[1](split[0](hidden)), masked_lm_head(masked_lm)(hidden)
    if ours.is_meta:  # model_checks' start-up check: shapes only; the loaded head is checked again
        return ours.shape == theirs.shape
    return ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6)


VOCAB_BLOCK = 2048  # rows of the decoder weight used together: K x H and (a chunk's tokens) x K
# fit a CPU's cache (L2/L3), so what reads a block's products finds them there


class TokenMaxLogits(torch.autograd.Function):
    """logit_BV[b, v] = the logit (states_NH @ weight_VH.T + bias_V)[n, v] of the token n of row b
    whose weight (`activate`) is the largest, with `torch.max`'s choice among equal weights (the
    first), as splade_pool's max; its weight is then activate(logit_BV). The logits are computed
    `rows_per_chunk` rows at a time (the memory bound: one chunk's R x T x V logits, and in fact a
    block of VOCAB_BLOCK entries of them at a time) and kept only as each (row, entry)'s chosen logit
    and token. `states_NH`: the real tokens of the batch, row after row; `row_starts`: where each
    row begins, B + 1 numbers (an empty row's logits are -inf: weight 0, no gradient).

    The backward never recomputes the logits: the gradient of a max goes to its token alone, so the
    gradient of the logits is a sparse N x V matrix G with one non-zero per (row, entry) whose
    gradient is non-zero (after the relu, the active entries only), and the gradients are G @ weight
    (the states'), G.T @ states (the weight's) and G's column sums (the bias'), the first two sums of
    rows of the other operand weighted by the non-zeros (F.embedding_bag: `_rows_times_weight`).
    Their cost is the active entries times H, against the dense backward's N x V x H twice.
    Under autocast the logits are in the compute dtype, and the backward computes in it too."""

    @staticmethod
    def forward(ctx, states_NH, weight_VH, bias_V, row_starts, rows_per_chunk, activation_function):
        num_rows, vocab_size, device = len(row_starts) - 1, weight_VH.shape[0], weight_VH.device
        # The logits' dtype (autocast's compute dtype, where it is on), from one logit
        dtype = _block_logits(weight_VH[:1], bias_V, states_NH[:1], slice(1)).dtype
        logit_BV = torch.empty((num_rows, vocab_size), dtype=dtype, device=device)
        token_BV = torch.empty((num_rows, vocab_size), dtype=torch.int64, device=device)
        for rows, states_nH, start_R, length_R in _chunks(states_NH, row_starts, rows_per_chunk):
            # The weights of each row's tokens side by side, (R, T', K), T' the chunk's longest row:
            # where each token goes, and padding's places left at -1, below every weight (>= 0).
            longest = max(int(length_R.max()), 1)
            row_n = torch.repeat_interleave(torch.arange(len(length_R), device=device), length_R)
            place_n = row_n * longest + torch.arange(len(row_n), device=device) - start_R[row_n]
            side_by_side = None
            for vocab in _vocab_blocks(vocab_size):  # a block at a time: it stays in cache
                logits_nK = _block_logits(weight_VH[vocab], bias_V, states_nH, vocab)
                weights_nK = activate(logits_nK, activation_function)
                if side_by_side is None:
                    side_by_side = weights_nK.new_full((len(length_R) * longest, weights_nK.shape[1]), -1)
                weights_RTK = side_by_side[:, : weights_nK.shape[1]].index_copy_(0, place_n, weights_nK)
                _, place_RK = _max_and_token(weights_RTK.view(len(length_R), longest, -1))
                token_RK = (start_R[:, None] + place_RK).clamp_(max=max(len(states_nH) - 1, 0))
                if len(states_nH):  # (an empty row's token is anything: its logits are -inf below)
                    logit_BV[rows, vocab] = logits_nK.gather(0, token_RK)
                token_BV[rows, vocab] = token_RK + row_starts[rows.start]  # an index into states_NH
            logit_BV[rows].masked_fill_(length_R[:, None] == 0, -float("inf"))  # weight 0, no gradient
        ctx.save_for_backward(states_NH, weight_VH, token_BV)
        ctx.row_starts, ctx.bias_dtype = row_starts, None if bias_V is None else bias_V.dtype
        return logit_BV

    @staticmethod
    def backward(ctx, grad_BV):
        states_NH, weight_VH, token_BV = ctx.saved_tensors
        row_starts = ctx.row_starts
        empty = [row for row in range(len(row_starts) - 1) if row_starts[row] == row_starts[row + 1]]
        if empty:  # an empty row's -inf has no token to send a gradient to
            grad_BV = grad_BV.index_fill(0, torch.tensor(empty, device=grad_BV.device), 0)
        dtype = grad_BV.dtype  # the compute dtype of the forward's logits
        weight_c, states_c = weight_VH.to(dtype), states_NH.to(dtype)
        num_rows, vocab_size = grad_BV.shape
        # The entries that get a gradient, row by row: G @ weight, the states' gradient
        grad_flat = grad_BV.flatten()
        flat_E = grad_flat.nonzero().squeeze(1)
        grad_states_NH = _rows_times_weight(
            token_BV.flatten()[flat_E], flat_E % vocab_size, grad_flat[flat_E], weight_c, len(states_NH)
        )
        # The same entries, vocabulary entry by entry: G.T @ states, the weight's gradient
        grad_flat, token_flat = grad_BV.T.flatten(), token_BV.T.flatten()
        flat_E = grad_flat.nonzero().squeeze(1)
        grad_weight_VH = F.embedding_bag(
            token_flat[flat_E],
            states_c,
            _bag_offsets(flat_E // num_rows, vocab_size),
            mode="sum",
            per_sample_weights=grad_flat[flat_E],
        )
        grad_bias_V = None if ctx.bias_dtype is None else grad_BV.sum(0).to(ctx.bias_dtype)
        grads = (grad_states_NH.to(states_NH.dtype), grad_weight_VH.to(weight_VH.dtype), grad_bias_V)
        return *grads, None, None, None


def _block_logits(weight_KH, bias_V, states_nH, vocab):
    """(n, K) the logits of a block of the vocabulary, the bias added as the decoder adds it (addmm)."""
    if bias_V is None:
        return states_nH @ weight_KH.T
    return torch.addmm(bias_V[vocab], states_nH, weight_KH.T)


def _max_and_token(weights_RTK):
    """Each (row, entry)'s largest weight over the row's tokens, and the token that gave it: torch.max's,
    the first of equal values, as splade_pool's max sends the gradient (the one place that chooses)."""
    return weights_RTK.max(dim=1)


def _bag_offsets(bag_E, num_bags):
    """F.embedding_bag's offsets: where each of `num_bags` bags begins, for entries sorted by bag."""
    counts = torch.bincount(bag_E, minlength=num_bags)
    return torch.cumsum(counts, 0) - counts


def _rows_times_weight(token_E, vocab_E, grad_E, weight_VH, num_tokens):
    """(num_tokens, H): row n the sum of grad_E[e] * weight_VH[vocab_E[e]] over the entries e of
    token n, i.e. G @ weight for the sparse G with non-zeros grad_E at (token_E, vocab_E). One
    embedding_bag per block of VOCAB_BLOCK vocabulary rows: in one call, every token's bag would
    read its entries' rows from all over the weight, the whole (V, H) weight once per row of the
    batch, from memory; a block's rows stay in cache while every token takes its share of them."""
    num_blocks = -(-weight_VH.shape[0] // VOCAB_BLOCK)
    key_E = ((vocab_E // VOCAB_BLOCK) * num_tokens + token_E).to(torch.int32)  # block, then token
    key_E, order_E = torch.sort(key_E)
    vocab_E, grad_E = vocab_E[order_E], grad_E[order_E]
    counts_KN = torch.bincount(key_E, minlength=num_blocks * num_tokens).view(num_blocks, num_tokens)
    block_ends = torch.cumsum(counts_KN.sum(1), 0).tolist()
    summed = torch.promote_types(weight_VH.dtype, torch.float32)  # the blocks' shares summed in fp32 at least
    out_NH = weight_VH.new_zeros(num_tokens, weight_VH.shape[1], dtype=summed)
    for block, (begin, end) in enumerate(zip([0] + block_ends[:-1], block_ends)):
        if begin < end:
            offsets_N = torch.cumsum(counts_KN[block], 0) - counts_KN[block]
            out_NH += F.embedding_bag(
                vocab_E[begin:end], weight_VH, offsets_N, mode="sum", per_sample_weights=grad_E[begin:end]
            )
    return out_NH


class TokenSumWeights(torch.autograd.Function):
    """sum_BV[b, v] = the sum over row b's tokens n of activate(states_NH @ weight_VH.T + bias_V)[n, v]
    (sum pooling), the logits computed `rows_per_chunk` rows and VOCAB_BLOCK entries at a time and
    dropped once summed. A sum's gradient reaches every (token, entry) whose logit is positive, so
    the backward needs every logit: it computes them again, a block at a time (as checkpoint would,
    at the same bound), and from them their gradient, g_bv * activate'(z), in place; then the
    block's share of the three gradients, two matrix products and a sum. What it saves against
    the checkpointed head: padding's logits, the transform's recompute, and the activation's
    passes over the logits and their autograd (each a pass over R x T x V numbers in memory)."""

    @staticmethod
    def forward(ctx, states_NH, weight_VH, bias_V, row_starts, rows_per_chunk, activation_function):
        sum_BV = None
        for rows, states_nH, _, length_R in _chunks(states_NH, row_starts, rows_per_chunk):
            row_n = torch.repeat_interleave(torch.arange(len(length_R), device=length_R.device), length_R)
            for vocab in _vocab_blocks(weight_VH.shape[0]):
                weights_nK = activate(
                    _block_logits(weight_VH[vocab], bias_V, states_nH, vocab), activation_function
                )
                if sum_BV is None:  # the logits' dtype: autocast's, where it is on
                    sum_BV = weights_nK.new_zeros(len(row_starts) - 1, weight_VH.shape[0])
                member_Rn = F.one_hot(row_n, len(length_R)).T.to(weights_nK.dtype)
                sum_BV[rows, vocab] = member_Rn @ weights_nK  # the sum of each row's tokens
        ctx.save_for_backward(states_NH, weight_VH, bias_V)
        ctx.settings = (row_starts, rows_per_chunk, activation_function)
        return sum_BV

    @staticmethod
    def backward(ctx, grad_BV):
        states_NH, weight_VH, bias_V = ctx.saved_tensors
        row_starts, rows_per_chunk, activation_function = ctx.settings
        dtype = grad_BV.dtype  # the forward's compute dtype: the logits are computed again in it
        weight_c, states_c = weight_VH.to(dtype), states_NH.to(dtype)
        bias_c = None if bias_V is None else bias_V.to(dtype)
        summed = torch.promote_types(dtype, torch.float32)  # the blocks' shares summed in fp32 at least
        grad_states_NH = torch.zeros_like(states_c, dtype=summed)
        grad_weight_VH = torch.zeros_like(weight_c, dtype=summed)
        grad_bias_V = None if bias_V is None else torch.zeros_like(bias_c, dtype=summed)
        for rows, states_nH, _, length_R in _chunks(states_c, row_starts, rows_per_chunk):
            row_n = torch.repeat_interleave(torch.arange(len(length_R), device=length_R.device), length_R)
            tokens = slice(row_starts[rows.start], row_starts[rows.stop])
            for vocab in _vocab_blocks(weight_VH.shape[0]):
                logits_nK = _block_logits(weight_c[vocab], bias_c, states_nH, vocab)
                grad_nK = _activation_grad_(logits_nK, activation_function)
                grad_nK *= grad_BV[rows, vocab][row_n]  # each token's row's gradient
                grad_states_NH[tokens] += grad_nK @ weight_c[vocab]
                grad_weight_VH[vocab] += grad_nK.T @ states_nH
                if grad_bias_V is not None:
                    grad_bias_V[vocab] += grad_nK.sum(0)
        grads = (grad_states_NH.to(states_NH.dtype), grad_weight_VH.to(weight_VH.dtype))
        return *grads, None if bias_V is None else grad_bias_V.to(bias_V.dtype), None, None, None


def _chunks(states_NH, row_starts, rows_per_chunk):
    """Each chunk of `rows_per_chunk` rows: (rows, their tokens' states (n, H), where each row's
    tokens begin among them (R,), how many they are (R,))."""
    num_rows = len(row_starts) - 1
    for first in range(0, num_rows, rows_per_chunk):
        rows = slice(first, min(first + rows_per_chunk, num_rows))
        starts = torch.tensor(row_starts[rows.start : rows.stop + 1], device=states_NH.device)
        states_nH = states_NH[row_starts[rows.start] : row_starts[rows.stop]]
        yield rows, states_nH, starts[:-1] - starts[0], starts[1:] - starts[:-1]


def _vocab_blocks(vocab_size):
    return [slice(v, v + VOCAB_BLOCK) for v in range(0, vocab_size, VOCAB_BLOCK)]


def _activation_grad_(logits, activation_function):
    """d activate(z) / dz, in place of the logits z: 1 / (1 + z) where z > 0, and divided by
    1 + log1p(z) too for "log1p_relu"; 0 elsewhere (the relu's, at 0 too, as autograd's)."""
    not_positive = logits <= 0
    logits.relu_()
    inner = torch.log1p(logits) if activation_function == "log1p_relu" else None
    logits.add_(1)
    if inner is not None:
        logits.mul_(inner.add_(1))
    return logits.reciprocal_().masked_fill_(not_positive, 0)


def splade_from_split(hidden_BTH, attention_mask_BT, transform, decoder, pooling_strategy,
                      activation_function, rows_per_chunk):  # fmt: skip
    """SPLADE's sparse vectors from the encoder's last hidden states -> (B, V), through the head
    decoder(transform(.)) (`masked_lm_head_split`): the values of `splade_from_hidden` and the same
    gradients, without checkpoint's recompute of the whole head; under max pooling without any
    recompute, and without the dense V-wide gradient of the logits (TokenMaxLogits), under sum
    pooling recomputing the logits alone (TokenSumWeights).

    The mask's zeros are left out before the head: their logits would be multiplied by 0, and a
    weight of 0 changes neither a sum nor a max of weights >= 0 (an entry that no token makes
    positive is 0 either way, and gets no gradient: the relu's). Under max pooling, TokenMaxLogits
    keeps, of each (row, entry), the logit of the token with the largest weight; the weights are
    those logits' (`activate`, on (B, V) alone), so the gradient through them is autograd's."""
    check_pooling(pooling_strategy, activation_function)
    assert rows_per_chunk >= 1, f"rows_per_chunk must be >= 1, got {rows_per_chunk}"
    real_BT = attention_mask_BT != 0
    row_starts = [0] + torch.cumsum(real_BT.sum(1), 0).tolist()
    states_NH = transform(hidden_BTH[real_BT])  # the real tokens, row after row
    settings = (row_starts, rows_per_chunk, activation_function)
    if pooling_strategy == "sum":
        return TokenSumWeights.apply(states_NH, decoder.weight, decoder.bias, *settings)
    logit_BV = TokenMaxLogits.apply(states_NH, decoder.weight, decoder.bias, *settings)
    return activate(logit_BV, activation_function)


def splade_from_head(hidden_BTH, attention_mask_BT, masked_lm, pooling_strategy, activation_function,
                     rows_per_chunk, split=None, checkpoint=None):  # fmt: skip
    """The sparse vectors from the hidden states through the head of `masked_lm` (or of a module
    with its head's children, SpladeHead.head_modules): by `splade_from_split` on a head whose
    split is known (`split`: `split_gives_the_head`, asked here when None), else, or with
    `checkpoint` given, by `splade_from_hidden` (checkpointed in training, `checkpoint` as there)."""
    if checkpoint is None and (split if split is not None else split_gives_the_head(masked_lm)):
        transform, decoder = masked_lm_head_split(masked_lm)
        settings = (pooling_strategy, activation_function, rows_per_chunk)
        return splade_from_split(hidden_BTH, attention_mask_BT, transform, decoder, *settings)
    settings = (pooling_strategy, activation_function, rows_per_chunk, checkpoint)
    return splade_from_hidden(hidden_BTH, attention_mask_BT, masked_lm_head(masked_lm), *settings)


def splade_embed(
    masked_lm, features, pooling_strategy="max", activation_function="relu", rows_per_chunk=8, checkpoint=None
):
    """The sparse vectors of one batch of tokenised texts -> (B, V): the encoder runs whole, the head
    and the pooling `rows_per_chunk` rows at a time (`splade_from_head`: the split head where the
    head is known, max pooling by TokenMaxLogits and sum pooling by TokenSumWeights; `checkpoint`
    given: `splade_from_hidden`'s path).
    `features`: the tokenizer's input_ids, attention_mask and, where the model takes them,
    token_type_ids."""
    inputs = {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in features}
    hidden_BTH = masked_lm.base_model(**inputs)[0]
    settings = (pooling_strategy, activation_function, rows_per_chunk)
    return splade_from_head(
        hidden_BTH, features["attention_mask"], masked_lm, *settings, checkpoint=checkpoint
    )


def regularizer_weight(step, total_steps, final_weight, scheduler_type="quadratic", warmup_ratio=1 / 3):
    """The FLOPS regulariser's weight at optimizer step `step` (0 for the first: the number of steps
    already taken), as SpladeRegularizerWeightSchedulerCallback sets it at the start of each step:

        warmup_steps = max(int(total_steps * warmup_ratio), 1)
        weight       = final_weight * (step / warmup_steps) ** p    while step < warmup_steps
                     = final_weight                                  after
    with p = 1 ("linear") or 2 ("quadratic", its default); its default warmup_ratio is 1/3.
    final_weight None (no query regulariser) stays None. Every micro-batch of a step gets the step's
    weight (the callback runs once per optimizer step). Where the callback warns and falls back to
    its defaults (an unknown scheduler_type, warmup_ratio outside (0, 1]), this raises ValueError."""
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(f"scheduler_type {scheduler_type!r}: use one of {SCHEDULER_TYPES}")
    if not 0 < warmup_ratio <= 1:
        raise ValueError(f"warmup_ratio {warmup_ratio}: use a fraction of the steps in (0, 1]")
    warmup_steps = max(int(total_steps * warmup_ratio), 1)
    if final_weight is None or step >= warmup_steps:
        return final_weight
    ratio = step / warmup_steps
    return final_weight * (ratio if scheduler_type == "linear" else ratio**2)


def loss_arguments(flags, step=None, total_steps=None):
    """losses.splade_loss's keyword arguments at optimizer step `step` (0 for the first) of
    `total_steps`, from the trainer's flags by their names ({query_regularizer_weight, ...,
    regularizer_scheduler_type, regularizer_warmup_ratio, over_ranks}): the weights warmed up
    (`regularizer_weight`); a weight or threshold of 0 is none (sentence-transformers' None), and
    so is the query weight under use_document_regularizer_only; over_ranks: the FLOPS terms over
    every rank's rows (gather_regularizers). `step` None: the final weights (an evaluation's loss)."""
    step, total_steps = (1, 1) if step is None else (step, total_steps)  # int(1 x ratio) <= 1: warmed up
    warmup = (flags["regularizer_scheduler_type"], flags["regularizer_warmup_ratio"])
    query_weight = (
        None if flags["use_document_regularizer_only"] else flags["query_regularizer_weight"] or None
    )
    return {
        "query_regularizer_weight": regularizer_weight(step, total_steps, query_weight, *warmup),
        "document_regularizer_weight": regularizer_weight(
            step, total_steps, flags["document_regularizer_weight"], *warmup
        ),
        "query_regularizer_threshold": flags["query_regularizer_threshold"] or None,
        "document_regularizer_threshold": flags["document_regularizer_threshold"] or None,
        "use_document_regularizer_only": flags["use_document_regularizer_only"],
        "gather_regularizers": flags["over_ranks"],
    }


def active_dims(emb_BV):
    """(B,) the number of non-zero entries of each row. sentence-transformers' `sparsity()` reports
    their mean as active_dims and 1 - mean / V as sparsity_ratio: across ranks, reduce the sum and
    the count of rows, and divide once."""
    return (emb_BV != 0).sum(dim=-1)


class SpladeHead(torch.nn.Module):
    """After the encoder of an embedding model: a masked-LM model's head and SpladePooling, token
    states (B, T, H) and the pool mask -> sparse vectors (B, V), `rows_per_chunk` rows at a time
    (`splade_from_head`: `splade_from_split` where the head's split is known, else
    `splade_from_hidden`, checkpointed in training). The head's modules are kept under the
    masked LM's own names (BERT's `cls`, RoBERTa's `lm_head`, ...) in `head_modules`, so an export
    writes them back where the masked LM has them; a decoder tied to the word embeddings stays the
    encoder's very parameter. `tied`: the head's names of tensors that are another tensor of the
    masked LM (the export leaves them out, as save_pretrained does, and from_pretrained ties them
    again)."""

    def __init__(self, masked_lm, pooling_strategy="max", activation_function="relu", rows_per_chunk=8):
        super().__init__()
        check_pooling(pooling_strategy, activation_function)
        base = masked_lm.base_model
        self.head_modules = torch.nn.ModuleDict(
            {name: module for name, module in masked_lm.named_children() if module is not base}
        )
        masked_lm_head(self.head_modules)  # raises for a masked LM whose head is not known
        self.base_model_prefix, self.masked_lm_class = masked_lm.base_model_prefix, type(masked_lm).__name__
        tensors = masked_lm.state_dict(keep_vars=True)
        tied = getattr(masked_lm, "_tied_weights_keys", None) or {}
        self.tied = [
            name for name, source in dict(tied).items() if tensors.get(name) is tensors.get(source, 0)
        ]
        self.settings = (pooling_strategy, activation_function, rows_per_chunk)
        # Checked once here, on the whole weights (before any wrapper shards them): the split head
        # (splade_from_split), or the checkpointed one where the split is not known.
        self.split = split_gives_the_head(self.head_modules)

    def forward(self, token_states_BTH, mask_BT):
        return splade_from_head(
            token_states_BTH, mask_BT, self.head_modules, *self.settings, split=self.split
        )


def head_of(masked_lm, flags, saved):
    """The SpladeHead of `masked_lm`, SpladePooling's settings from the trainer's flags (ModelSpec.splade:
    strategy, activation, rows a chunk), else as the SparseEncoder folder saved them (`saved`), else
    sentence-transformers' defaults (max, relu)."""
    strategy = flags[0] or saved.get("pooling_strategy", "max")
    activation = flags[1] or saved.get("activation_function", "relu")
    return SpladeHead(masked_lm, strategy, activation, rows_per_chunk=flags[2])
