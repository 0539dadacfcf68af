"""Frozen models that steer the loss: a guide (--guide-model, GISTEmbed's false-negative masking)
and a teacher (--teacher-model, embedding distillation with --loss mse).

    guide, teacher = guide_model.load_frozen_models(plan)   # (all ranks participate)
    tokens, groups, num_columns = guide_model.tokens_of(guide, rows, train_set, device)   # on the CPU
    guide_embs = guide_model.embed(guide, tokens, groups, num_columns, autocast)   # one per column

Either is loaded as the student is (embedding_model.load_model: a SentenceTransformer or HF folder
with its own pooling, normalisation, Dense layers, tokenizer and max length) and then frozen: no
gradient, no optimizer state, eval mode (no dropout), never saved or exported. Its embeddings are
computed once per micro-batch, under no_grad, from the texts the student reads (with the same
prompts: sentence-transformers' GISTEmbedLoss hands its guide the student's decoded input), cut by
its own tokenizer at its own max length (GISTEmbedLoss's guide sees the student's tokens, cut at
the student's length: the same wherever the texts fit it). Under GradCache the student embeds each
chunk twice, the frozen model once.

Where it lives: under FSDP it is sharded as the student is (its blocks each a unit, each rank
reads only its own slices of the weights), so a guide as big as the student costs each rank a
shard, not a whole copy; every forward then gathers its blocks, a collective that every rank
reaches, as it runs on every rank for every micro-batch. Under DDP and single it is a plain
module on each device: DDP has nothing to synchronise in a model without gradients (and refuses
to wrap one).

Left out on purpose: a guide or teacher that trains, and a projection between a teacher and a
student of other widths (the embeddings must be the same size: a start-up check).

Needs torch, and fsdp_embed/embedding_model.py (`load_model`), fsdp_embed/shard_loading.py
(`fill_sharded_weights`), fsdp_embed/batches.py (`with_prompt`), fsdp_embed/sharding.py
(`wrap_model`) and fsdp_utils.py (`print0`). Its whole copy set (what it needs, directly or
through another): fsdp_utils.py,
fsdp_embed/batches.py, fsdp_embed/checkpoint_warnings.py, fsdp_embed/config.py,
fsdp_embed/embedding_model.py, fsdp_embed/inference_free.py, fsdp_embed/lora.py,
fsdp_embed/shard_loading.py, fsdp_embed/sharding.py, fsdp_embed/splade.py, fsdp_embed/st_folder.py,
fsdp_embed/token_cache.py.
"""

from dataclasses import dataclass

import torch

import fsdp_utils
from fsdp_embed import batches
from fsdp_embed import embedding_model
from fsdp_embed import shard_loading
from fsdp_embed import sharding


@dataclass
class FrozenModel:
    """A guide or teacher: the module every forward runs through (FSDP-wrapped or plain) and what
    load_model read with it (its tokenizer, max length, pooling)."""

    model: object
    loaded: object  # embedding_model.LoadedModel
    packed: bool = False  # one forward over packed rows, as the student (embedding_model.packing_choice)
    length_buckets: int = 0  # else forwards a micro-batch (the plan's; 0: chosen for each)
    chunk_size: int = 0  # at most this many rows a forward (--cache-chunk-size); 0: no bound


def frozen_spec(spec, path):
    """The ModelSpec of a frozen model at `path`, from the student's `spec`: the folder's own
    pooling, normalisation, prompt handling, attention, lengths and tokenizer (--append-eos is the
    student's: a decoder guide that needs an EOS must have a tokenizer that appends it), the
    student's prompts, no LoRA, no activation checkpointing."""
    return embedding_model.ModelSpec(
        path=path, trust_remote_code=spec.trust_remote_code, prompts=spec.prompts
    )


def load_frozen(path, flag, spec, plan):
    """The frozen model at `path` (named `flag` in the log), loaded as the student's `spec` says
    (frozen_spec), on this rank's device: under FSDP sharded, each rank reading the slices of the
    weights it holds (all ranks participate); else whole. Rank 0 prints how many parameters it has
    and how many each rank holds."""
    sharded = plan.strategy == "fsdp"
    loaded = embedding_model.load_model(frozen_spec(spec, path), 0, on_meta=sharded)
    raw = loaded.model.requires_grad_(False)
    total = sum(p.numel() for p in raw.parameters())
    if sharded:
        model = sharding.wrap_model(  # sharding is resolved: no all_reduce
            raw,
            "fsdp",
            plan.device,
            sharding=plan.sharding,
            fsdp_version=plan.fsdp_version,
            precision=plan.precision,
        )
        shard_loading.fill_sharded_weights(model, loaded)
    else:
        model = raw.to(plan.device)
    model.eval()  # no dropout: the same embeddings for the same texts, on every rank
    held = sum(local_numel(p) for p in model.parameters())
    fsdp_utils.print0(
        f"{flag} {path}: {total / 1e6:.1f}M parameters, frozen; {held / 1e6:.1f}M of them held by each rank"
    )
    # its own attention decides, as the student's
    packed, _ = embedding_model.packing_choice(raw, plan.packing_refused)
    return FrozenModel(model, loaded, packed, plan.length_buckets, plan.cache_chunk_size)


def load_frozen_models(plan):
    """(the --guide-model, the --teacher-model), each a FrozenModel or None where the plan names
    none. (all ranks participate) under FSDP: load_frozen."""
    guide = load_frozen(plan.guide_model, "--guide-model", plan.model, plan) if plan.guide_model else None
    teacher = (
        load_frozen(plan.teacher_model, "--teacher-model", plan.model, plan) if plan.teacher_model else None
    )
    return guide, teacher


def prepare_rows(opts, rows, train_set):
    """What the frozen models read of one micro-batch of `train_set`, prepared by the reader thread
    (__main__.prepare_micro_batch): {"guide": its tokens and groups (`tokens_of`), for an mnrl set
    that ranks against other rows; "teacher": of the first column, for an mse set}. The reader
    alone tokenizes with the frozen models' tokenizers, so no other thread shares them."""
    frozen = {}
    if opts.guide and train_set.loss == "mnrl" and not train_set.loss_plan.own_negatives:
        frozen["guide"] = tokens_of(opts.guide, rows, train_set, opts.device)
    if opts.teacher and train_set.loss == "mse":
        frozen["teacher"] = tokens_of(opts.teacher, rows, train_set, opts.device, num_columns=1)
    return frozen


def embed_rows(opts, frozen, train_set, labels):
    """What the frozen models give one micro-batch of `train_set` from its `frozen` tokens
    (prepare_rows, on the device): (the guide's embeddings of each column, or None; the labels:
    for an mse set with a teacher, the teacher's embedding of the first column, every column's
    target; else `labels`). `opts`: __main__.py's StepOptions (its guide, teacher and autocast).
    Under FSDP (all ranks participate) every rank's micro-batch is of the same set: the same
    forwards."""
    guide = embed(opts.guide, *frozen["guide"], opts.autocast) if "guide" in frozen else None
    if "teacher" in frozen:
        labels = embed(opts.teacher, *frozen["teacher"], opts.autocast)[0]
    return guide, labels


def local_numel(param):
    """The elements of `param` this rank stores: its shard under FSDP2 (a DTensor), FSDP1's flat
    shard, or all of them."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def tokens_of(frozen, rows, train_set, device, num_columns=None):
    """(tokens, groups, number of columns) of the text columns of `rows` as `train_set` reads
    them (its text_columns with its prompts; the first `num_columns`), for the frozen model: all
    columns' texts pooled as the student's are (__main__.prepare_micro_batch), in one forward over
    packed rows, or length-sorted sub-batches (as many as suit `device`), at most
    --cache-chunk-size rows each. On the CPU."""
    columns = train_set.text_columns[:num_columns]
    keys = (train_set.prompt_columns or train_set.text_columns)[:num_columns]
    # texts -> prompts -> tokens as the student's are collated, cut at the frozen model's own length
    features, _ = batches.collate(
        rows, columns, None, "", frozen.loaded.tokenize, "cpu", train_set.prompts, keys
    )
    tokens = batches.pool_columns(features)
    # As many forwards on every rank: one packed, or the plan's count of sub-batches (fixed under FSDP),
    # cut into chunks of equally many rows (equal micro-batches make equally many).
    mask_NT = tokens["attention_mask"]
    if frozen.packed:
        groups = embedding_model.pack(mask_NT)
    else:
        groups = batches.sub_batches(mask_NT, frozen.length_buckets, device, frozen.chunk_size)
    return tokens, groups, len(columns)


def embed(frozen, tokens, groups, num_columns, autocast):
    """The frozen model's embeddings of `tokens` (tokens_of, on its device), fp32, without
    gradient: one (B, D) per column. Under FSDP each forward gathers the model's blocks (all ranks
    participate): every rank runs as many."""
    with torch.no_grad(), autocast():
        embs = frozen.model(**tokens, groups=groups).float()  # in pool order
    return list(embs.chunk(num_columns))
