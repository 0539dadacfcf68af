"""Wrapping, state-dict gathering and SentenceTransformer export for distributed training.

This file holds what sits between a plain `nn.Module` and the distributed world:
  - `detect_layer_classes` / `resolve_layer_classes`: the repeated transformer block that
    FSDP wraps, found in the model itself (or named, and checked, by the user);
  - `wrap_model`: nothing (one process), DDP, FSDP1 (`FullyShardedDataParallel` with
    `transformer_auto_wrap_policy`) or FSDP2 (`fully_shard` per block, then the root), with
    bf16/fp16 mixed precision; under DDP, `all_reduce_embedding_rows` sends only the rows of
    the embedding tables that some rank used; `gradient_sync`, `clip_grad_norm`, `grad_scaler`
    for the loop;
  - `load_pretrained_sharded`: a model built on the meta device and sharded gets its weights
    from the safetensors files, each rank reading only the slices its shards hold;
  - `save_checkpoint` / `load_checkpoint` / `complete_checkpoints`: resumable state with
    `torch.distributed.checkpoint` (every rank writes its own shard, safetensors files, no
    pickle), made visible by one rename when complete, with a manifest of its files and sizes
    that `checkpoint_problem` checks, so a damaged checkpoint is never loaded;
  - `stage_state_dict` / `read_staged`: every rank writes what it holds, one writer reads it
    back a few tensors at a time: an export with no whole copy of the model on any rank;
  - `export_sentence_transformer`: rank 0 writes a folder that `SentenceTransformer(path)`
    (sentence-transformers 2.x to 6.x) and `AutoModel.from_pretrained(path)` both load, its
    weights in files of a bounded size; `read_sentence_transformer_config` reads back what it
    writes (pooling, normalisation, max length, casing, prompts), from such a folder or any
    other SentenceTransformer folder.

It imports only the standard library, torch, transformers and safetensors, never the other
files of this project, so it can be copied into another pipeline alone.

Usage (from train.py; every rank calls the first four, rank 0 alone the rest):
    with torch.device("meta"):
        raw_model = AutoModel.from_config(config)                # shapes only, no storage
    model = fsdp_utils.wrap_model(raw_model, "fsdp", device, sharding="full_shard", fsdp_version=2)
    fsdp_utils.load_pretrained_sharded(model, folder, {name: name for name in raw_model.state_dict()}, {})
    ...                                                          # train
    fsdp_utils.stage_state_dict(model, staging)
    if rank == 0:
        names = list(fsdp_utils.staged_tensors(staging))
        fsdp_utils.export_sentence_transformer(out_dir, [lambda: fsdp_utils.read_staged(staging, names)], config, tokenizer, ...)

FSDP1 -> FSDP2, as this file shows them side by side:
    FullyShardedDataParallel(model, auto_wrap_policy=...)   ->  fully_shard(block) for each block, fully_shard(model)
    ShardingStrategy.FULL_SHARD / SHARD_GRAD_OP             ->  reshard_after_forward=True / False
    ShardingStrategy.HYBRID_SHARD + device_mesh             ->  fully_shard(..., mesh=2-D mesh)
    MixedPrecision(param_dtype, reduce_dtype)               ->  MixedPrecisionPolicy(param_dtype, reduce_dtype)
    model.no_sync()                                         ->  model.set_requires_gradient_sync(False) (neither used here: gradient_sync)
    model.clip_grad_norm_(max_norm)                         ->  torch.nn.utils.clip_grad_norm_ (on DTensors)
    FSDP.state_dict_type(...) + state_dict()                ->  get_model_state_dict (serves both, and DDP)

Left out on purpose: CPU offload of parameters, resuming at another world size (train.py
refuses it). Activation checkpointing is the model's own (transformers' gradient checkpointing).
"""

import contextlib
import copy
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

# ----------------------------------------------------------------------------------------------
# Which blocks to shard: the repeated transformer layer, found in the model itself


def detect_layer_classes(model):
    """Names of the classes of the model's repeated block: the element classes of the
    `nn.ModuleList` that holds the most parameters (BertLayer, XLMRobertaLayer, MPNetLayer,
    Qwen2DecoderLayer, ...). Works whatever `_no_split_modules` says, or when it is missing."""
    best, best_numel = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    if best is None:
        raise ValueError(f"{type(model).__name__} has no repeated block (no nn.ModuleList of layers); name the classes to wrap with --fsdp-layer-cls")
    return sorted({type(m).__name__ for m in best})


def resolve_layer_classes(model, override=""):
    """The classes to wrap: `override` ("NAME[,NAME]") if given, else the detected block. Fails
    before any wrapping when a name is not a class in the model, listing the ones that are."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    names = [n.strip() for n in override.split(",") if n.strip()] or detect_layer_classes(model)
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"--fsdp-layer-cls {','.join(missing)}: no such layer class in this {type(model).__name__}. "
            f"Its repeated block is {detect_layer_classes(model)}; leave --fsdp-layer-cls empty to use it "
            f"(all classes in the model: {sorted(present)})")
    return {present[n] for n in names}


# ----------------------------------------------------------------------------------------------
# Wrapping: single, DDP, FSDP1 (FullyShardedDataParallel) or FSDP2 (fully_shard)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FSDP1_SHARDING = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "hybrid_shard": "HYBRID_SHARD", "no_shard": "NO_SHARD"}


def hybrid_mesh(device):
    """2-D mesh (replicate across nodes, shard within a node) from torchrun's environment.
    Without an explicit mesh, FSDP1 takes the node size from the device count, which on CPU is
    1, warns "switching to use NO_SHARD", and trains with unreduced gradients: silently wrong."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % procs_per_node:
        raise ValueError(f"hybrid_shard: world size {world_size} is not a multiple of the {procs_per_node} processes per node")
    return init_device_mesh(device.type, (world_size // procs_per_node, procs_per_node), mesh_dim_names=("replicate", "shard"))


def wrap_model(model, strategy, device, *, sharding="full_shard", fsdp_version=1, layer_cls="", precision="fp32"):
    """Return the module the training loop calls: `model` itself, DDP, FSDP1 or FSDP2 around it.

    The wrapped module must own every trainable parameter (encoder, pooling, heads), and every
    forward must go through it: that is where DDP hooks its all-reduce and FSDP gathers the
    parameters of each block. Mixed precision (bf16/fp16) under FSDP: parameters are cast to
    the low precision for compute, the fp32 master copy stays sharded, gradients are reduced in
    fp32. Under single/DDP the training loop uses autocast instead (see `autocast`).

    A model built on the meta device (FSDP only) is sharded as it is and each rank then gets
    uninitialised storage for its own shards alone: no rank ever holds the whole model. Fill
    them with `load_pretrained_sharded` before use.
    """
    if strategy == "single":
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        # find_unused_parameters stays False: the model is built with no unused parameters
        # (no BERT pooler), which DDP would otherwise refuse at the second step.
        # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce buffer, so no
        # second copy of the whole gradient is kept and none is copied in and out each step.
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad]
        ddp.register_comm_hook(EmbeddingRows(embeddings), all_reduce_embedding_rows)
        return ddp
    if strategy != "fsdp":
        raise ValueError(f"unknown strategy {strategy!r}: expected single, ddp or fsdp")
    layer_classes = resolve_layer_classes(model, layer_cls)  # fails here, before any wrapping
    low = PRECISIONS[precision]
    on_meta = any(p.is_meta for p in model.parameters())
    if fsdp_version == 1:
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        mixed = None if precision == "fp32" else MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
        if sharding == "no_shard":
            # FSDP1 marks NO_SHARD deprecated in favour of DDP (which --strategy ddp is) and warns
            # that its state dict is the full one; both are true and harmless for an explicit
            # choice, so they are said once here instead of on every rank at every save.
            if dist.get_rank() == 0:
                print("note: --sharding no_shard is DDP through FSDP1 (deprecated by torch); --strategy ddp does the same", flush=True)
            warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated", category=FutureWarning)
            warnings.filterwarnings("ignore", message="When using ``NO_SHARD`` for ``ShardingStrategy``", category=UserWarning)
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes),
            sharding_strategy=getattr(ShardingStrategy, FSDP1_SHARDING[sharding]),
            device_mesh=hybrid_mesh(device) if sharding == "hybrid_shard" else None,
            mixed_precision=mixed,
            device_id=device,  # on CPU too: without it FSDP1 looks for an accelerator and fails
            use_orig_params=True,  # named parameters keep their names: optimizer groups, clipping, state dicts
            # A meta model: storage for each unit's shard only, left uninitialised (FSDP1's own
            # default would run reset_parameters and draw from the RNG: other dropout masks).
            param_init_fn=(lambda module: module.to_empty(device=device, recurse=False)) if on_meta else None,
        )
    if fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP1 strategy -> FSDP2: full_shard = reshard after forward; shard_grad_op = keep the
        # gathered parameters until backward; hybrid_shard = a 2-D mesh; no_shard has no FSDP2
        # form (use DDP).
        if sharding == "no_shard":
            raise ValueError("--sharding no_shard has no FSDP2 form; use --strategy ddp (the same thing) or --fsdp-version 1")
        mesh = hybrid_mesh(device) if sharding == "hybrid_shard" else None
        mixed = MixedPrecisionPolicy() if precision == "fp32" else MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        options = {"mesh": mesh, "mp_policy": mixed, "reshard_after_forward": sharding != "shard_grad_op"}
        for module in list(model.modules()):
            if isinstance(module, tuple(layer_classes)):
                fully_shard(module, **options)
        fully_shard(model, **options)  # the root: embeddings, final norm, heads
        if on_meta:
            model.to_empty(device=device)  # each rank's shards only, uninitialised
        return model
    raise ValueError(f"--fsdp-version {fsdp_version}: expected 1 or 2")


class EmbeddingRows:
    """The state of `all_reduce_embedding_rows`: which parameters are embedding tables."""

    def __init__(self, weights):
        self.ids = {id(weight) for weight in weights}


def all_reduce_embedding_rows(state, bucket):
    """DDP communication hook: the mean over ranks of a bucket of gradients, as DDP's own
    all-reduce computes it, but sending only the rows of an embedding table that some rank used.

    An embedding's gradient is non-zero only in the rows its batch looked up: a few hundred of
    a vocabulary's 30k (BERT) to 250k (XLM-R) rows, which are most of the model's weights. So
    the ranks first agree on the rows any of them touched (a max over a byte per row), then
    all-reduce those rows and the bucket's other gradients in one message. A row no rank
    touched is zero everywhere, and zero is its mean: the result is exactly the dense mean.
    Every rank calls the same collectives: DDP hands the buckets over in the same order on all
    of them, and the number of rows sent is agreed before it is sent."""
    world_size = dist.get_world_size()
    flat = bucket.buffer()
    parameters = bucket.parameters()
    if not any(id(p) in state.ids for p in parameters):
        flat.div_(world_size)  # DDP's own order: divide, then sum
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0])
    pieces, offset = [], 0  # (gradient, is an embedding), in the bucket's own order
    for p in parameters:
        grad = flat[offset:offset + p.numel()]
        offset += p.numel()
        pieces.append((grad.view(p.shape[0], -1), True) if id(p) in state.ids else (grad, False))
    # A row is used when any of its entries is non-zero (or NaN): when its largest or its
    # smallest entry is. Two min/max passes read the table at memory speed; `ne(0).any(1)`
    # writes a boolean per entry first (MiniLM's table on one CPU thread: 3.4 ms against 13).
    used = torch.cat([grad.amax(1).ne(0) | grad.amin(1).ne(0) for grad, is_table in pieces if is_table]).to(torch.uint8)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)  # a row any rank touched is sent by every rank
    rows, start = [], 0
    for grad, is_table in pieces:
        if is_table:
            rows.append(used[start:start + grad.shape[0]].nonzero().squeeze(1))
            start += grad.shape[0]
        else:
            rows.append(None)
    message = torch.cat([grad if r is None else grad.index_select(0, r).view(-1) for (grad, _), r in zip(pieces, rows)])
    # Divided before the sum, as DDP does (the same numbers, bit for bit), but only what is sent:
    # the rows no rank used are zero, and stay so.
    dist.all_reduce(message.div_(world_size))
    start = 0
    for (grad, _), r in zip(pieces, rows):
        if r is None:
            grad.copy_(message[start:start + grad.numel()])
            start += grad.numel()
        else:
            grad.index_copy_(0, r, message[start:start + r.numel() * grad.shape[1]].view(-1, grad.shape[1]))
            start += r.numel() * grad.shape[1]
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def is_fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def is_fsdp2(model):
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(model, enabled):
    """Context for one micro-step's backward. DDP with `enabled=False`: the gradients accumulate
    locally and are all-reduced in the next synchronised backward (accumulation without
    communication). FSDP reduce-scatters in every backward, whatever `enabled` says, and
    accumulates the gradients in their shards: skipping it (FSDP1's no_sync, FSDP2's
    set_requires_gradient_sync(False)) keeps every parameter's unsharded gradient until the
    last micro-step, a whole model's gradients on every rank, which is what FSDP is there to
    avoid. The price: one reduce-scatter per micro-step (per GradCache chunk), not per step."""
    if enabled or not dist.is_initialized() or is_fsdp1(model) or is_fsdp2(model):
        return contextlib.nullcontext()
    return model.no_sync()


def clip_grad_norm(model, max_norm):
    """Clip the global gradient norm. A collective under FSDP (the norm of sharded gradients is
    all-reduced): every rank must call it."""
    if is_fsdp1(model):
        return model.clip_grad_norm_(max_norm)
    if is_fsdp2(model):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()  # a DTensor
    # Single and DDP: every rank holds whole gradients, so the norm is local. torch's
    # clip_grad_norm_ multiplies every gradient by its clamped coefficient even when that is 1
    # (a read and a write of the whole gradient: 4 ms a step for MiniLM on one CPU thread), so
    # that a GPU never waits for the norm on the host. train.py reads each step's loss on the
    # host anyway; here the norm is read too, and the multiply by 1, which changes nothing, is
    # skipped.
    parameters = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    coefficient = max_norm / (total.item() + 1e-6)  # clip_grad_norm_'s own
    if not coefficient >= 1.0:  # a NaN norm too: torch multiplies every gradient by NaN
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def grad_scaler(model, precision, device):
    """fp16 needs loss scaling; bf16 and fp32 do not. The sharded scaler all-reduces the
    inf/nan check, so every rank skips the same steps."""
    if precision != "fp16":
        return None
    if is_fsdp1(model) or is_fsdp2(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # Under FSDP2 the scale (a 1-element tensor, the same on every rank) meets DTensor
        # gradients, and DTensor warns that it treats it as replicated: it is, so all is well.
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


# ----------------------------------------------------------------------------------------------
# Loading pretrained weights straight into the shards: no rank holds the whole model
#
# The model is built on the meta device (shapes, no storage), sharded by `wrap_model`, and then
# every rank reads, from the safetensors files, the slices its own shards cover, through
# torch.distributed.checkpoint's reader of the Hugging Face layout (it reads a slice with
# safetensors' `get_slice`). Under FSDP2 no rank ever materialises a whole parameter; FSDP1
# all-gathers each wrapped unit once while loading (its sharded state dict is by parameter, its
# storage by flattened unit), the same memory its forward needs.


def safetensors_keys(folder):
    """{tensor name: file} over the *.safetensors files directly in `folder`, or None when a name
    is in two files: the checkpoint reader reads every such file, so the folder is ambiguous."""
    from safetensors import safe_open

    keys = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors") and os.path.isfile(os.path.join(folder, file)):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for key in f.keys():
                    if key in keys:
                        return None
                    keys[key] = file
    return keys


def load_pretrained_sharded(model, folder, file_names, fresh_tensors):
    """Fill a model that `wrap_model` sharded while it was on the meta device. EVERY rank must
    call it: the checkpoint reader and FSDP's loading are collectives.

    `file_names` maps state-dict names to the tensor names in the safetensors files of `folder`
    (read slice by slice: each rank reads what its shards hold). `fresh_tensors` holds the whole
    value of every other entry (a new head, adapters: small, drawn from the seeded RNG, the same
    on every rank), of which each rank keeps its own part. Non-persistent buffers are not in a
    state dict; the caller initialises them."""
    with _quiet_checkpoint_warnings():
        state = get_model_state_dict(model)  # this rank's shards, uninitialised
        unknown = set(state) - set(file_names) - set(fresh_tensors)
        if unknown:
            raise ValueError(f"no value for {sorted(unknown)[:3]}: neither in {folder} nor new")
        # Loaded in place, into the shards' own storage, read under the files' names.
        dcp.load({file_names[name]: state[name] for name in file_names}, storage_reader=dcp.HuggingFaceStorageReader(folder))
        set_model_state_dict(model, {name: state[name] for name in file_names}, options=StateDictOptions(strict=False))
        if fresh_tensors:
            set_model_state_dict(model, fresh_tensors, options=StateDictOptions(full_state_dict=True, strict=False))


# ----------------------------------------------------------------------------------------------
# Resumable checkpoints (torch.distributed.checkpoint): OUTPUT/checkpoints/step-N/
#
#   shard-0000R-model-00001-of-00001.safetensors   this rank's part of model + optimizer tensors
#   rng-rank-R.safetensors                          rank R's random-number generator states
#   trainer_state.json                              step, scheduler, optimizer hyper-parameters, config
#   manifest.json                                   every other file and its size, written last
#
# Written under a hidden name and renamed to step-N only when every rank has finished, so a
# crash mid-save leaves a hidden folder that resuming never picks (and the next save removes).
# A step-N folder can still be damaged later (a full disk, a copy cut short, a file deleted by
# hand): `checkpoint_problem` compares it with its manifest, so a damaged one is never loaded.

# Flattened optimizer state ("state.<param>.exp_avg", ...): the same keys on every rank even when
# a rank holds no elements of a parameter. FSDP1 at 4 ranks needs it: unflattened, loading fails
# with "Missing key in checkpoint state_dict: optim.param_groups" (and allow_partial_load=True
# would "work" by silently dropping the learning rate).
CHECKPOINT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def _tensor_state(model, optimizer):
    """(tensors for DCP, non-tensor optimizer entries). A collective under FSDP: all ranks."""
    model_state, optim_state = get_state_dict(model, optimizer, options=CHECKPOINT_OPTIONS)
    tensors = {"model." + k: v for k, v in model_state.items()}
    tensors.update({"optim." + k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)})
    # The hyper-parameters of each group (lr, betas, ...): plain numbers, kept as JSON.
    hyper = {k: v for k, v in optim_state.items() if not isinstance(v, torch.Tensor)}
    return tensors, hyper


@contextlib.contextmanager
def _quiet_checkpoint_warnings():
    """torch's own checkpoint code warns about its own internals: FSDP1's sharded state is
    ShardedTensor, which torch deprecates (dozens of lines per save), and one process is told
    it is one process. Nothing a user can act on, so they are silenced here, and only here."""
    with warnings.catch_warnings():
        for message in ("Please use DTensor instead and we are deprecating ShardedTensor", "`_get_pg_default_device` will be deprecated",
                        "Multiple backends are registered with this ProcessGroup", "torch.distributed is disabled"):
            warnings.filterwarnings("ignore", message=message)
        yield


def _rng_states():
    """This process's random-number generator states (CPU, and CUDA where present)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _barrier():
    if dist.is_initialized():
        dist.barrier()


MANIFEST = "manifest.json"


def checkpoint_problem(path):
    """Why the checkpoint folder `path` cannot be loaded, or None when it is complete: every file
    its manifest lists is there with the size it was written with. (Sizes catch truncated and
    missing files, the damage crashes and full disks leave; they do not catch flipped bits.)"""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish, or an older version wrote it)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, size in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes where {size} were written (truncated or overwritten)"
    return None


def list_checkpoints(checkpoints_dir):
    """[(step, path, problem)] of every step-N folder under `checkpoints_dir`, oldest first;
    problem is None for a complete checkpoint (see `checkpoint_problem`)."""
    if not os.path.isdir(checkpoints_dir):
        return []
    found = []
    for name in os.listdir(checkpoints_dir):
        match = CHECKPOINT_NAME.match(name)
        path = os.path.join(checkpoints_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path, checkpoint_problem(path)))
    return sorted(found)


def complete_checkpoints(checkpoints_dir):
    """[(step, path)] of the complete checkpoints under `checkpoints_dir`, oldest first."""
    return [(step, path) for step, path, problem in list_checkpoints(checkpoints_dir) if problem is None]


def save_checkpoint(model, optimizer, checkpoints_dir, step, trainer_state, keep_last=0):
    """Save model, optimizer, every rank's RNG and `trainer_state` (a JSON-able dict) as
    `checkpoints_dir/step-{step}`. EVERY rank must call it: gathering the state dict, the DCP
    save and the barriers are collectives. Only rank 0 writes the JSON files and renames.
    A folder already named step-{step} (a damaged one, or one a resume from an older step is
    about to replace) is moved aside to step-{step}.replaced-TIME, never deleted.
    `keep_last` > 0 removes older checkpoints beyond that many, after the new one is complete."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final_dir = os.path.join(checkpoints_dir, f"step-{step}")
    tmp_dir = os.path.join(checkpoints_dir, f".incomplete-step-{step}")
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a leftover of a save that was killed
        os.makedirs(tmp_dir)
    _barrier()  # all ranks: nobody writes into the folder before it exists

    with _quiet_checkpoint_warnings():
        tensors, hyper = _tensor_state(model, optimizer)  # all ranks (collective under FSDP)
        # All ranks: each writes the tensors (or shards) it is assigned; safetensors files, so
        # loading them back runs no pickle.
        dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(tmp_dir, save_distributed=True, enable_consolidation=False))
    save_file(_rng_states(), os.path.join(tmp_dir, f"rng-rank-{rank}.safetensors"))
    if rank == 0:
        with open(os.path.join(tmp_dir, "trainer_state.json"), "w") as f:
            json.dump({**trainer_state, "step": step, "optimizer_hyperparameters": hyper}, f, indent=1)
    _barrier()  # all ranks: every file is written before rank 0 lists them and renames

    if rank == 0:
        # The folder is a shared file system's: rank 0 sees every rank's files, now complete.
        files = {name: os.path.getsize(os.path.join(tmp_dir, name)) for name in sorted(os.listdir(tmp_dir))}
        with open(os.path.join(tmp_dir, MANIFEST), "w") as f:
            json.dump({"files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final_dir):
            aside = stamped = f"{final_dir}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            for n in itertools.count(2):
                if not os.path.exists(aside):
                    break
                aside = f"{stamped}-{n}"
            os.rename(final_dir, aside)
            # On a line of its own: a progress bar may hold the current one.
            print(f"\nwarning: {final_dir} was in the way of this save; moved to {aside}", file=sys.stderr, flush=True)
        os.rename(tmp_dir, final_dir)  # atomic: from here on step-N is complete
        older = complete_checkpoints(checkpoints_dir)[:-keep_last] if keep_last > 0 else []
        for _, path in older:
            # Hide first, then delete: a crash mid-delete must not leave a step-N that looks whole.
            hidden = os.path.join(checkpoints_dir, ".deleting-" + os.path.basename(path))
            os.rename(path, hidden)
            shutil.rmtree(hidden)
    _barrier()  # all ranks: nobody goes on (or dies) before the checkpoint is visible
    return final_dir


def load_checkpoint(model, optimizer, checkpoint_dir):
    """Load what `save_checkpoint` wrote into `model` and `optimizer` (built the same way, same
    world size) and this rank's RNG; return the trainer state dict. EVERY rank must call it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    with _quiet_checkpoint_warnings():
        tensors, _ = _tensor_state(model, optimizer)  # the shapes and shards to fill (all ranks)
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(checkpoint_dir))  # all ranks
        model_state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        optim_state = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
        optim_state.update(trainer_state["optimizer_hyperparameters"])
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=CHECKPOINT_OPTIONS)
    _set_rng_states(load_file(os.path.join(checkpoint_dir, f"rng-rank-{rank}.safetensors")))
    return trainer_state


# ----------------------------------------------------------------------------------------------
# Export without a whole copy on any rank: every rank stages what it holds, one writer reads it
# back, a file's worth at a time
#
#   all ranks:  stage_state_dict(model, staging)         each rank writes its own shards (DCP)
#   the writer: staged_tensors(staging)                  names, shapes, dtypes
#               read_staged(staging, names)              those tensors, whole, and nothing else
#
# Under FSDP nothing is gathered: a rank that does not write never holds more than its shards.


def stage_state_dict(model, folder):
    """Write the model's state dict to `folder` as it lies on the ranks: each rank its own shards
    (FSDP), or each tensor once (DDP, one process). EVERY rank must call it (DCP's save is a
    collective); when it returns, every rank's part is written."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # a leftover of a killed export
        os.makedirs(folder)
    _barrier()  # all ranks: nobody writes into the folder before it exists
    with _quiet_checkpoint_warnings():
        state = get_model_state_dict(model)  # sharded under FSDP: no gathering
        dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(folder, save_distributed=True, enable_consolidation=False))


def staged_tensors(folder):
    """{name: (shape, dtype)} of the tensors `stage_state_dict` wrote to `folder`."""
    metadata = dcp.HuggingFaceStorageReader(folder).read_metadata()
    return {name: (md.size, md.properties.dtype) for name, md in metadata.state_dict_metadata.items()}


def read_staged(folder, names):
    """The named tensors of a staged folder, whole (for the one writer: no collective)."""
    shapes = staged_tensors(folder)
    tensors = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
    with _quiet_checkpoint_warnings():
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(folder), no_dist=True)
    return tensors


SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text):
    """'5GB', '300MB', '1.5GiB' or a number of bytes -> bytes. GB is 10^9 bytes and GiB 2^30, as
    in transformers' `max_shard_size`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = (match.group(2).upper() or "B") if match else None
    if unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: write it like 5GB, 300MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def shard_groups(sizes, max_bytes):
    """The names of `sizes` ({name: bytes}), in order, grouped into files of at most `max_bytes`
    each (a tensor larger than that gets a file of its own: tensors are never split)."""
    groups, total = [], 0
    for name, size in sizes.items():
        if not groups or (groups[-1] and total + size > max_bytes):
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


# ----------------------------------------------------------------------------------------------
# Export to the SentenceTransformer folder format

# The pooling modes this project trains and exports, and their key in 1_Pooling/config.json:
# the one list of them (train.py's --pooling choices come from here).
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                "max": "pooling_mode_max_tokens", "lasttoken": "pooling_mode_lasttoken"}
POOLING_MODES = tuple(POOLING_KEYS)


def pooling_config(pooling_mode, dim):
    """1_Pooling/config.json. Only the keys every sentence-transformers version since 2.0
    understands, plus `pooling_mode_lasttoken` when it is the mode (2.3+ knows it)."""
    config = {"word_embedding_dimension": dim, "pooling_mode_mean_sqrt_len_tokens": False}
    for mode in ("mean", "cls", "max"):
        config[POOLING_KEYS[mode]] = pooling_mode == mode
    if pooling_mode == "lasttoken":
        config[POOLING_KEYS["lasttoken"]] = True
    return config


def read_sentence_transformer_config(path):
    """What a SentenceTransformer folder (local or a hub id) says about how it embeds: the
    transformer's subfolder, pooling mode, normalisation, max_seq_length, do_lower_case,
    prompts, default_prompt_name and similarity_fn_name. A plain HF model (no modules.json)
    gives the defaults: mean pooling, no normalisation, no max length of its own.
    Raises ValueError for modules other than Transformer, Pooling and Normalize."""
    import transformers

    def read_json(filename):
        file = transformers.utils.cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
        if file is None:
            return None
        with open(file, encoding="utf8") as f:
            return json.load(f)

    config = {"subfolder": "", "pooling": "mean", "normalize": False, "max_seq_length": None, "do_lower_case": False,
              "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    modules = read_json("modules.json")
    if modules is None:
        return config
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Transformer":
            config["subfolder"] = module["path"]
            bert_config = read_json(os.path.join(module["path"], "sentence_bert_config.json")) or {}
            config["max_seq_length"] = bert_config.get("max_seq_length")
            config["do_lower_case"] = bool(bert_config.get("do_lower_case", False))
        elif kind == "Pooling":
            pooling = read_json(os.path.join(module["path"], "config.json"))
            if pooling is None:
                raise ValueError(f"{path}: modules.json lists a Pooling module, but {os.path.join(module['path'], 'config.json')} is missing; "
                                 "restore it from the original folder")
            enabled = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
            modes = [mode for mode, key in POOLING_KEYS.items() if [key] == enabled]
            if not modes:
                raise ValueError(f"{path}: pooling {enabled} is not supported; one of {POOLING_MODES} is (or override with --pooling)")
            config["pooling"] = modes[0]
        elif kind == "Normalize":
            config["normalize"] = True
        else:
            raise ValueError(f"{path}: module {module['type']} is not supported; only Transformer, Pooling and Normalize are")
    st_config = read_json("config_sentence_transformers.json") or {}
    for key in ("prompts", "default_prompt_name", "similarity_fn_name"):
        if st_config.get(key) is not None:
            config[key] = st_config[key]
    return config


def export_sentence_transformer(
    out_dir,
    weight_files,
    encoder_config,
    tokenizer,
    *,
    pooling_mode,
    normalize,
    max_seq_length,
    do_lower_case=False,
    model_card="",
    training_config=None,
    extra_tensor_files=None,
    tokenizer_files=None,
    prompts=None,
    dtype=torch.float32,
):
    """Write a SentenceTransformer folder at `out_dir` (rank 0 only; no collective inside).

    `weight_files` is a list of functions, one per weights file, each returning that file's
    tensors: the transformer's weights with plain HF names (no "encoder." prefix), so the folder
    is also a plain HF model (config.json, tokenizer files and model.safetensors, or with more
    than one file model-0000i-of-0000N.safetensors and model.safetensors.index.json). They are
    called one at a time, so only one file's tensors need be in memory (`[lambda: state_dict]`
    for a state dict already there). Floating-point tensors are written in `dtype`, which
    config.json states. Give it every tensor of the base checkpoint, the untrained ones too (a
    BERT pooler), or every `from_pretrained` of the folder warns of newly initialised weights. The
    tokenizer is saved with `model_max_length = max_seq_length`, so plain transformers truncates
    where training did; `tokenizer_files` ({name: path}) are copied beside it unless saving wrote
    them: the base model's slow-tokenizer files (vocab.txt, sentencepiece models), which older
    transformers versions need. On top of that, the sentence-transformers files:
        modules.json                      Transformer (path "") -> Pooling -> [Normalize]
        sentence_bert_config.json         max_seq_length, do_lower_case (texts lowercased first)
        1_Pooling/config.json             pooling mode and dimension
        2_Normalize/                      (empty) when the model normalises
        config_sentence_transformers.json versions, similarity function, `prompts` ({name: prefix},
                                          for encode(texts, prompt_name=name))
        README.md                         the model card
    The folder is written next to `out_dir` and renamed into place at the end, so a crash
    never leaves a half-written export, and an older export is replaced only by a whole one.
    """
    if pooling_mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {pooling_mode!r} cannot be exported; use one of {POOLING_MODES}")
    out_dir = os.path.abspath(out_dir)
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)

    # Plain HF layout, a file at a time. safetensors refuses tensors that are not contiguous.
    weight_map, total_bytes = {}, 0
    for i, read in enumerate(weight_files):
        file = "model.safetensors" if len(weight_files) == 1 else f"model-{i + 1:05d}-of-{len(weight_files):05d}.safetensors"
        tensors = read()
        for name, t in tensors.items():
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
            weight_map[name] = file
            total_bytes += tensors[name].nbytes
        save_file(tensors, os.path.join(tmp_dir, file), metadata={"format": "pt"})
        del tensors  # before the next file's are read
    if len(weight_files) > 1:
        with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w", encoding="utf8") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    encoder_config = copy.deepcopy(encoder_config)
    encoder_config.dtype = dtype  # what from_pretrained(dtype="auto") loads it in
    encoder_config.save_pretrained(tmp_dir)
    tokenizer = copy.deepcopy(tokenizer)  # the caller's keeps its own limit
    tokenizer.model_max_length = max_seq_length
    tokenizer.save_pretrained(tmp_dir)
    # Stated, not left to each transformers version's default (4.4x warns that its default will
    # change): it only affects decoding, which then agrees everywhere.
    tokenizer_config_path = os.path.join(tmp_dir, "tokenizer_config.json")
    with open(tokenizer_config_path, encoding="utf8") as f:
        tokenizer_config = json.load(f)
    tokenizer_config.setdefault("clean_up_tokenization_spaces", bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)))
    with open(tokenizer_config_path, "w", encoding="utf8") as f:
        json.dump(tokenizer_config, f, indent=2)
    for name, source in (tokenizer_files or {}).items():
        if not os.path.exists(os.path.join(tmp_dir, name)):
            shutil.copyfile(source, os.path.join(tmp_dir, name))
    # A WordPiece or BPE tokenizer writes its own slow files (vocab.txt; vocab.json + merges.txt)
    # from its model, when neither saving nor the base folder gave them.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ in ("WordPiece", "BPE"):
        model_dir = os.path.join(tmp_dir, ".tokenizer-model")
        os.makedirs(model_dir)
        for file in backend.model.save(model_dir):
            if not os.path.exists(os.path.join(tmp_dir, os.path.basename(file))):
                os.rename(file, os.path.join(tmp_dir, os.path.basename(file)))
        shutil.rmtree(model_dir)
    for filename, file_tensors in (extra_tensor_files or {}).items():
        file_tensors = {name: t.detach().cpu().contiguous().clone() for name, t in file_tensors.items()}
        save_file(file_tensors, os.path.join(tmp_dir, filename))

    # sentence-transformers module list: the classic `sentence_transformers.models.*` names,
    # which 2.x loads natively and 3.x-6.x map to their current classes.
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(tmp_dir, "2_Normalize"))
    os.makedirs(os.path.join(tmp_dir, "1_Pooling"))
    dim = encoder_config.hidden_size
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling_config(pooling_mode, dim),
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case},
        "config_sentence_transformers.json": {
            # The oldest sentence-transformers version that reads this folder (lasttoken pooling
            # came in 2.3.0); a newer number would make older versions warn "update your library".
            "__version__": {"sentence_transformers": "2.3.0" if pooling_mode == "lasttoken" else "2.0.0",
                            "transformers": importlib.metadata.version("transformers"), "pytorch": torch.__version__},
            "prompts": prompts or {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }
    if training_config is not None:
        files["training_config.json"] = training_config
    for name, content in files.items():
        with open(os.path.join(tmp_dir, name), "w", encoding="utf8") as f:
            json.dump(content, f, indent=2)
    with open(os.path.join(tmp_dir, "README.md"), "w", encoding="utf8") as f:
        f.write(model_card)

    # Swap into place: the old export (if any) is removed only once the new one is complete.
    old_dir = f"{out_dir}.old-{os.getpid()}"
    if os.path.exists(out_dir):
        os.rename(out_dir, old_dir)
    os.rename(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)
