"""SPLADE sparse embeddings (sentence-transformers' SparseEncoder) from a masked-language model:
the pooling, a chunked form of it that never holds the vocabulary-sized logits whole, the warm-up
of the FLOPS regulariser's weight, and the active dimensions of a row. Pure functions of tensors,
like losses.py (whose `flops_loss` and `splade_loss` train these embeddings).

Shape legend: B rows, R rows of one chunk, T tokens, H hidden size, V vocabulary size (the
embedding dimension).

SPLADE (Formal et al., 2021), as sentence-transformers' SpladePooling computes it from the MLM
logits z and the attention mask m:

    w_tv = log(1 + relu(m_t * z_tv))                  activation_function "relu"
    w_tv = log(1 + log(1 + relu(m_t * z_tv)))         "log1p_relu" (OpenSearch's models)
    e_v  = max_t w_tv   ("max", SPLADE v2 and later)  or  sum_t w_tv   ("sum", SPLADE v1)

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

Needs only torch (no other project file). Tests: python -m pytest tests/test_splade.py -q.
Left out: sentence-transformers' path for unpadded (flattened, FlashAttention-2) inputs, the top-k
`max_active_dims` of encode(), inference-free (Router) SPLADE, the SparseAutoEncoder (CSR) models.
The export as a SparseEncoder folder is export.py's (`sparse_encoder_files`).
"""

import torch
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


def splade_pool(logits_BTV, attention_mask_BT, pooling_strategy="max", activation_function="relu"):
    """SpladePooling's sparse vectors from the MLM logits -> (B, V), the formula in the module
    docstring. Padding contributes zeros, as there (the mask multiplies the logits before the relu),
    which max pooling cannot tell from a real zero: every weight is >= 0. Max pooling's gradient goes
    to one token per entry (`max`, as there, not `amax`, which splits it between ties)."""
    check_pooling(pooling_strategy, activation_function)
    mask_BT1 = attention_mask_BT.unsqueeze(-1).to(logits_BTV.dtype)
    weights_BTV = torch.log1p(torch.relu(logits_BTV * mask_BT1))
    if activation_function == "log1p_relu":
        weights_BTV = torch.log1p(weights_BTV)
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


def splade_embed(
    masked_lm, features, pooling_strategy="max", activation_function="relu", rows_per_chunk=8, checkpoint=None
):
    """The sparse vectors of one batch of tokenised texts -> (B, V): the encoder runs whole, the head
    and the pooling `rows_per_chunk` rows at a time (`splade_from_hidden`). `features`: the tokenizer's
    input_ids, attention_mask and, where the model takes them, token_type_ids."""
    inputs = {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in features}
    hidden_BTH = masked_lm.base_model(**inputs)[0]
    head, mask_BT = masked_lm_head(masked_lm), features["attention_mask"]
    settings = (pooling_strategy, activation_function, rows_per_chunk, checkpoint)
    return splade_from_hidden(hidden_BTH, mask_BT, head, *settings)


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
    (`splade_from_hidden`). The head's modules are kept under the masked LM's own names (BERT's
    `cls`, RoBERTa's `lm_head`, ...) in `head_modules`, so an export writes them back where the
    masked LM has them; a decoder tied to the word embeddings stays the encoder's very parameter.
    `tied`: the head's names of tensors that are another tensor of the masked LM (the export leaves
    them out, as save_pretrained does, and from_pretrained ties them again)."""

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

    def forward(self, token_states_BTH, mask_BT):
        head = masked_lm_head(self.head_modules)
        return splade_from_hidden(token_states_BTH, mask_BT, head, *self.settings)


def head_of(masked_lm, flags, saved):
    """The SpladeHead of `masked_lm`, SpladePooling's settings from the trainer's flags (ModelSpec.splade:
    strategy, activation, rows a chunk), else as the SparseEncoder folder saved them (`saved`), else
    sentence-transformers' defaults (max, relu)."""
    strategy = flags[0] or saved.get("pooling_strategy", "max")
    activation = flags[1] or saved.get("activation_function", "relu")
    return SpladeHead(masked_lm, strategy, activation, rows_per_chunk=flags[2])
