"""Processes, wrapping and collectives: what sits between a plain `nn.Module` and the ranks.

  - `setup_dist` / `cleanup_dist`: the process group under torchrun (gloo on CPU, NCCL on CUDA),
    one process without it; `print0` prints once; `set_cpu_allocator`: glibc's malloc setting,
    for the sharding that `resolve_sharding` gives;
  - `detect_layer_classes` / `resolve_layer_classes`: the repeated transformer block that
    FSDP wraps, found in the model itself (or named, and checked, by the user);
  - `wrap_model`: nothing (one process), DDP, FSDP1 (`FullyShardedDataParallel` with
    `transformer_auto_wrap_policy`) or FSDP2 (`fully_shard` per block, then the root), with
    bf16/fp16 mixed precision, `resolve_sharding` for --sharding auto, and over gloo FSDP2's
    collectives as rings (collectives.py); under DDP the hook `all_reduce_embedding_rows`
    (collectives.py) sends only the rows of the embedding tables that some rank used (and so
    does `all_reduce_replicated` for the tables FSDP2 leaves whole under shard_grad_op);
    `clip_grad_norm`, `grad_scaler` for the loop; `rng_states` / `set_rng_states` for checkpoints
    and GradCache;
  - `load_pretrained_sharded`: a model built on the meta device and sharded gets its weights
    from the safetensors files, each rank reading only the slices its shards hold.

Needs torch, safetensors and collectives.py (standard library and torch only): copy the two.
Usage (all ranks participate: every rank calls each of these):
    rank, world_size, device = fsdp_utils.setup_dist(timeout_minutes=30)
    raw_model = AutoModel.from_config(config)  # under `with torch.device("meta")`: shapes only
    sharding, why = sharding.resolve_sharding(raw_model, "fsdp", device, "auto", "fp32")
    sharding.set_cpu_allocator(device, "fsdp", sharding)       # glibc's malloc, on CPU
    model = sharding.wrap_model(raw_model, "fsdp", device, sharding=sharding, fsdp_version=2)
    sharding.load_pretrained_sharded(model, folder, {name: name for name in raw_model.state_dict()}, {})
    sharding.all_reduce_replicated(model)   # each step, after its last backward: whole tables (FSDP2)
    sharding.clip_grad_norm(model, 1.0)
    fsdp_utils.cleanup_dist()

FSDP1 -> FSDP2: `wrap_fsdp1` and `wrap_fsdp2` side by side; docs/fsdp.md has the table. Left out
on purpose: CPU offload, resuming at another world size (refused at start-up). Activation
checkpointing is the model's own (transformers' gradient checkpointing).
"""

import contextlib
import datetime
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist

import fsdp_utils
from fsdp_embed import collectives


# ----------------------------------------------------------------------------------------------
# Processes: set-up and teardown under torchrun, printing once, the CPU allocator






def barrier():
    """Wait for every rank (all ranks participate); nothing to wait for in one process."""
    if dist.is_initialized():
        dist.barrier()  # (all ranks participate)




def set_tf32(device, precision, tf32):
    """Let fp32 matmuls and convolutions on an NVIDIA GPU use TensorFloat-32 (`tf32` "on", the
    --tf32 default) under --precision fp32, for the whole process; returns the log line saying
    so, or None on CPU. Under bf16 and fp16 the encoder computes in 16 bits anyway, and TF32 stays
    off so that the loss, computed in fp32 (train.forward_backward), is fp32. Without TF32
    (before Ampere) the setting changes nothing."""
    if device.type != "cuda":
        return None
    on = tf32 == "on" and precision == "fp32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    if not on:
        return f"tf32: off (--precision {precision}, --tf32 {tf32}): fp32 matmuls in full fp32"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "tf32: on, but this GPU has no TensorFloat-32 (it needs Ampere or newer): full fp32"
    return "tf32: on: fp32 matmuls use TensorFloat-32; --tf32 off keeps them in full fp32"


def set_cpu_allocator(device, strategy, sharding):
    """Set how glibc's malloc treats large freed blocks on CPU, for the whole process: kept for
    reuse (speed first), or given back to the system at once (memory first, under full_shard and
    hybrid_shard: `sharding` as `resolve_sharding` gives it). Call it once, before wrapping.
    Returns the log line saying which, or None where it does nothing: on a GPU (PyTorch's
    caching allocator keeps blocks), off glibc, or when the user set MALLOC_* variables (theirs
    win). The numbers behind both: docs/fsdp.md and docs/big-models.md.

    Speed first: glibc gives each block above 32 MB its own mapping and unmaps it when freed, so a
    tensor made and freed every step, such as the dense gradient of the word embeddings
    (vocabulary x width), is mapped again and each of its pages faulted in again, every step;
    FSDP makes and frees a gathered block and its gradient for every block, every step. The
    cost: up to 1 GiB freed is kept, not given back.

    Memory first: with glibc's defaults, freed blocks stay in the heaps of several arenas, and a
    large model under FSDP holds a multiple of its weights more than it needs on each rank; every
    block above 64 KiB mapped apart (and unmapped when freed), with 2 arenas, bounds it
    (bench/bench_big_model.py). The price is speed: every such block is faulted in again each
    time."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    if any(k.startswith("MALLOC_") for k in os.environ):
        return "cpu allocator: as the MALLOC_* variables in the environment set it"
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):  # not glibc: its own policy
        return None
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    if strategy == "fsdp" and sharding in ("full_shard", "hybrid_shard"):
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(M_ARENA_MAX, 2)
        return (
            f"cpu allocator: memory first ({sharding}): blocks above 64 KiB are given back to the "
            "system when freed, 2 malloc arenas"
        )
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # blocks up to 1 GiB come from the heap...
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)  # ...which keeps up to 1 GiB free at its top
    return "cpu allocator: speed first: freed blocks up to 1 GiB are kept for reuse"


def free_memory_per_process(device):
    """Bytes of free memory this process can count on, or None where it cannot be read: its
    GPU's free memory; on CPU the system's available memory shared by this host's processes."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # in kB
    except (OSError, KeyError, ValueError):
        return None
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


SMALL_MODEL_SHARE = 0.1  # of a process's free memory, for a gathered copy of the whole model


def auto_sharding(model, device, low):
    """--sharding auto: (the sharding, the log line saying why). shard_grad_op, which keeps each
    block's gathered weights from its forward to its backward (one all-gather per block a step,
    not two), when a gathered copy of the whole model in the compute dtype takes at most
    SMALL_MODEL_SHARE of the free memory of every process: a model this small is trained on
    FSDP for speed, not to fit. Otherwise full_shard, memory first. The ranks agree on the
    smallest free memory, an all_reduce (all ranks participate), so every rank shards alike."""
    gathered = sum(p.numel() for p in model.parameters()) * (low or torch.float32).itemsize
    free = free_memory_per_process(device)
    smallest = torch.tensor(-1.0 if free is None else float(free), dtype=torch.float64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)  # (all ranks participate): the least free memory
    smallest = smallest.item()
    if smallest < 0:
        return "full_shard", "sharding: auto -> full_shard (the free memory could not be read)"
    sharding = "shard_grad_op" if gathered <= SMALL_MODEL_SHARE * smallest else "full_shard"
    return sharding, (
        f"sharding: auto -> {sharding}: a gathered copy of the weights takes {gathered / 2**20:,.0f} MiB, "
        f"{gathered / smallest:.1%} of the least free memory of a process ({smallest / 2**30:,.1f} GiB; "
        f"shard_grad_op up to {SMALL_MODEL_SHARE:.0%})"
    )


def resolve_sharding(model, strategy, device, sharding, precision):
    """(the sharding wrap_model applies, the log line saying why or None): under FSDP, --sharding
    auto becomes `auto_sharding`'s choice, the ranks agreeing on the least free memory
    (all ranks participate); any other value, or another strategy, stays as given."""
    if strategy != "fsdp" or sharding != "auto":
        return sharding, None
    low = None if precision == "fp32" else fsdp_utils.PRECISIONS[precision]
    return auto_sharding(model, device, low)


# ----------------------------------------------------------------------------------------------
# Which blocks to shard: the repeated transformer layer, found in the model itself






# ----------------------------------------------------------------------------------------------
# Wrapping: single, DDP, FSDP1 (FullyShardedDataParallel) or FSDP2 (fully_shard)




FSDP1_SHARDING = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid_shard": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}


def hybrid_mesh(device):
    """2-D mesh (replicate across nodes, shard within a node) from torchrun's environment.
    Without an explicit mesh, FSDP1 takes the node size from the device count, which on CPU is
    1, warns "switching to use NO_SHARD", and trains with unreduced gradients: silently wrong."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % procs_per_node:
        raise ValueError(
            f"hybrid_shard: world size {world_size} is not a multiple of the {procs_per_node} "
            "processes per node"
        )
    return init_device_mesh(
        device.type, (world_size // procs_per_node, procs_per_node), mesh_dim_names=("replicate", "shard")
    )


def wrap_model(model, strategy, device, *, sharding="auto", fsdp_version=2, layer_cls="", precision="fp32"):
    """Return the module the training loop calls: `model` itself, DDP, FSDP1 or FSDP2 around it.

    The wrapped module must own every trainable parameter (encoder, pooling, heads), and every
    forward must go through it: that is where DDP hooks its all-reduce and FSDP gathers the
    parameters of each block. Mixed precision (bf16/fp16) under FSDP: parameters are cast to
    the low precision for compute, the fp32 master copy stays sharded, gradients are reduced in
    fp32. Under single/DDP the training loop uses autocast instead (see `autocast`).

    A model built on the meta device (FSDP only) is sharded as it is and each rank then gets
    uninitialised storage for its own shards alone: no rank ever holds the whole model. Fill
    them with `load_pretrained_sharded` before use.

    (all ranks participate): DDP broadcasts rank 0's weights as it wraps; under FSDP --sharding
    auto is resolved here when the caller has not (`resolve_sharding`: an all_reduce, its log line
    printed). glibc's malloc is the caller's to set (`set_cpu_allocator`).
    """
    if strategy not in ("single", "ddp", "fsdp"):
        raise ValueError(f"unknown strategy {strategy!r}: expected single, ddp or fsdp")
    low = None if precision == "fp32" else fsdp_utils.PRECISIONS[precision]
    if strategy == "fsdp":
        layer_classes = fsdp_utils.resolve_layer_classes(model, layer_cls)  # fails here, before any wrapping
        if sharding == "auto":  # the caller has not resolved it
            # the ranks agree on the least free memory
            sharding, why = resolve_sharding(model, strategy, device, sharding, precision)
            fsdp_utils.print0(why)
    if strategy == "single":
        return model
    if strategy == "ddp":
        return wrap_ddp(model, device)
    on_meta = any(p.is_meta for p in model.parameters())
    if fsdp_version == 1:
        return wrap_fsdp1(model, device, layer_classes, sharding, precision, on_meta)
    if fsdp_version == 2:
        return wrap_fsdp2(model, device, layer_classes, sharding, low, on_meta)
    raise ValueError(f"--fsdp-version {fsdp_version}: expected 1 or 2")


def wrap_ddp(model, device):
    """DDP around `model`, on CPU its embedding tables' gradients all-reduced by the rows some rank
    used (`all_reduce_embedding_rows`). DDP's constructor broadcasts rank 0's weights (all ranks
    participate). On a GPU DDP's own dense all-reduce stays: the rows' hook must learn on the host
    how many rows to send (a `nonzero`), which would make the GPU wait each step, while over NVLink
    or InfiniBand the whole table (47 MB for MiniLM) is sent in about a millisecond."""
    device_ids = [device.index] if device.type == "cuda" else None
    # find_unused_parameters stays False: the model is built with no unused parameters
    # (no BERT pooler), which DDP would otherwise refuse at the second step.
    # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce buffer, so no
    # second copy of the whole gradient is kept and none is copied in and out each step.
    ddp = torch.nn.parallel.DistributedDataParallel(  # (all ranks participate): rank 0's weights
        model, device_ids=device_ids, gradient_as_bucket_view=True
    )
    if device.type == "cpu":
        embeddings = [m.weight for m in embedding_tables(model)]
        ddp.register_comm_hook(collectives.EmbeddingRows(embeddings), collectives.all_reduce_embedding_rows)
    return ddp


def embedding_tables(model):
    """The trainable embedding tables (`nn.Embedding`) of `model`."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad]


def wrap_fsdp1(model, device, layer_classes, sharding, precision, on_meta):
    """FSDP1: fsdp_utils.wrap_fsdp1 (each block of `layer_classes` its own unit, mixed precision
    in `precision`) with the sharding strategy of --sharding, hybrid_shard's two-level mesh, and
    for a model on the meta device, storage for each unit's shard only."""
    from torch.distributed.fsdp import ShardingStrategy

    if sharding == "no_shard":
        # FSDP1 marks NO_SHARD deprecated in favour of DDP (which --strategy ddp is) and warns
        # that its state dict is the full one; both are true and harmless for an explicit
        # choice, so they are said once here instead of on every rank at every save.
        if dist.get_rank() == 0:
            print(
                "note: --sharding no_shard is DDP through FSDP1 (deprecated by torch); "
                "--strategy ddp does the same",
                flush=True,
            )
        warnings.filterwarnings(
            "ignore", message="The `NO_SHARD` sharding strategy is deprecated", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore", message="When using ``NO_SHARD`` for ``ShardingStrategy``", category=UserWarning
        )
    return fsdp_utils.wrap_fsdp1(
        model,
        device,
        layer_classes,
        precision,
        sharding_strategy=getattr(ShardingStrategy, FSDP1_SHARDING[sharding]),
        device_mesh=hybrid_mesh(device) if sharding == "hybrid_shard" else None,
        # A meta model: storage for each unit's shard only, left uninitialised (FSDP1's own
        # default would run reset_parameters and draw from the RNG: other dropout masks).
        param_init_fn=(lambda module: module.to_empty(device=device, recurse=False)) if on_meta else None,
    )


def wrap_fsdp2(model, device, layer_classes, sharding, low, on_meta):
    """FSDP2: `fully_shard` on each block of `layer_classes`, then on the root. `low`: the
    compute dtype of mixed precision (None: fp32, no mixed precision); `on_meta`: the model is
    on the meta device, and each rank gets uninitialised storage for its own shards only.
    Under shard_grad_op the trainable embedding tables stay whole (below): the caller averages
    their gradients each step (`all_reduce_replicated`) and gives them an optimizer parameter
    group of their own (AdamW cannot update whole tensors and DTensors together)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    # FSDP1 strategy -> FSDP2: full_shard = reshard after forward; shard_grad_op = keep the
    # gathered parameters until backward; hybrid_shard = a 2-D mesh; no_shard has no FSDP2
    # form (use DDP).
    if sharding == "no_shard":
        raise ValueError(
            "--sharding no_shard has no FSDP2 form; use --strategy ddp (the same thing) or --fsdp-version 1"
        )
    mesh = hybrid_mesh(device) if sharding == "hybrid_shard" else None
    mixed = (
        MixedPrecisionPolicy()
        if low is None
        else MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    )
    options = {"mesh": mesh, "mp_policy": mixed, "reshard_after_forward": sharding != "shard_grad_op"}
    for module in list(model.modules()):
        if isinstance(module, tuple(layer_classes)):
            fully_shard(module, **options)
    # shard_grad_op is the choice for a model small against memory (--sharding auto), on FSDP for
    # speed. There the embedding tables stay whole on every rank, out of FSDP's collectives, and
    # their gradients are all-reduced by the rows some rank used (`all_reduce_replicated`), as
    # under DDP: a batch looks up a few hundred rows of a vocabulary of 30k and more, which FSDP
    # would all-gather and reduce-scatter whole every step (MiniLM's word embeddings are 11.9M of
    # its 22.7M weights). The price: each rank holds the tables' AdamW moments whole. Not under
    # fp16: the sharded loss scaler unscales all gradients together and cannot mix whole
    # tensors with FSDP's sharded ones (DTensors).
    tables = embedding_tables(model) if sharding == "shard_grad_op" and low != torch.float16 else []
    ignored = {table.weight for table in tables}
    fully_shard(model, **options, ignored_params=ignored or None)  # the root: embeddings, final norm, heads
    for table in tables if low is not None else []:
        # FSDP casts the weights it gathers to `low` for compute; a table it does not manage is
        # looked up in fp32, and its output is cast to `low` here: the same values.
        table.register_forward_hook(lambda module, args, output: output.to(low))
    if dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(collectives.RingAllGather())
                module.set_custom_reduce_scatter(collectives.RingReduceScatter())
    if on_meta:
        model.to_empty(device=device)  # each rank's shards only, uninitialised
    return model


def all_reduce_replicated(model):
    """Under FSDP2's shard_grad_op: the mean over ranks of the gradients of the embedding tables
    FSDP leaves whole on every rank (`wrap_fsdp2`): on the CPU by the rows some rank used, on a
    GPU whole (counting the rows would make it wait, as wrap_ddp says). Call it after the
    step's last backward, before clipping: a collective (all ranks participate). Nothing to do
    elsewhere."""
    if not is_fsdp2(model):
        return
    tables = [p for p in model.parameters() if p.requires_grad and not is_sharded(p)]
    for p in tables:
        if p.grad is None:  # not looked up on this rank: a zero gradient, still sent
            p.grad = torch.zeros_like(p)
    if tables and tables[0].device.type != "cpu":  # every row, as DDP's on a GPU (wrap_ddp)
        for p in tables:  # the same tables on every rank
            dist.all_reduce(p.grad.div_(dist.get_world_size()))  # (all ranks participate)
    elif tables:  # the same tables on every rank
        collectives.mean_over_ranks([(p.grad, True) for p in tables])


def is_sharded(tensor):
    """An FSDP2 parameter or gradient (a DTensor) rather than a whole tensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def is_fsdp1(model):
    # Not imported yet: no model is wrapped by FSDP (and start-up is faster without it: docs/speed.md).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel)


def is_fsdp2(model):
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def rng_states():
    """This process's random-number generator states (CPU, and the current CUDA device's where
    present): what a checkpoint keeps, and what GradCache restores before re-running a chunk."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def clip_grad_norm(model, max_norm):
    """Clip the global gradient norm. A collective under FSDP, the norm of sharded gradients
    all-reduced (all ranks participate)."""
    if is_fsdp1(model):
        return model.clip_grad_norm_(max_norm)  # (all ranks participate)
    if is_fsdp2(model):
        return clip_fsdp2_grad_norm(model, max_norm)  # (all ranks participate)
    # Single and DDP: every rank holds whole gradients, so the norm is local. torch's
    # clip_grad_norm_ multiplies every gradient by its clamped coefficient even when that is 1
    # (a read and a write of the whole gradient, every step: docs/speed.md), so that a GPU never
    # waits for the norm on the host. On a GPU so does this; on the CPU the norm is read and the
    # multiply by 1, which changes nothing, is skipped.
    parameters = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if total.device.type != "cpu" or not max_norm / (total.item() + 1e-6) >= 1.0:  # clip_grad_norm_'s
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)  # a NaN norm too: all NaN
    return total


def clip_fsdp2_grad_norm(model, max_norm):
    """clip_grad_norm under FSDP2 (all ranks participate): the norm of the sharded gradients is
    all-reduced; the tables FSDP leaves whole (wrap_fsdp2) add their local norm."""
    with_grad = [p for p in model.parameters() if p.grad is not None]
    whole = [p for p in with_grad if not is_sharded(p)]  # the tables FSDP leaves out (wrap_fsdp2)
    if not whole:
        # (all ranks participate): the norm of the shards, a DTensor, all-reduced
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
    # torch's clip cannot take sharded and whole gradients in one list: the two norms apart
    # (the sharded one all-reduced: the collective), then one coefficient for both.
    sharded = [p for p in with_grad if is_sharded(p)]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in whole])]
    if sharded:  # the same parameters on every rank
        # (all ranks participate): the norm of the shards, a DTensor, all-reduced
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor())
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(whole, max_norm, total)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)  # clip_grads_with_norm_'s own
    for p in sharded:
        p.grad.mul_(coefficient)
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
        warnings.filterwarnings(
            "ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning
        )

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
    """Fill a model that `wrap_model` sharded while it was on the meta device. The checkpoint
    reader and FSDP's loading are collectives (all ranks participate).

    `file_names` maps state-dict names to the tensor names in the safetensors files of `folder`
    (read slice by slice: each rank reads what its shards hold). `fresh_tensors` holds the whole
    value of every other entry (a new head, adapters: small, drawn from the seeded RNG, the same
    on every rank), of which each rank keeps its own part. Non-persistent buffers are not in a
    state dict; the caller initialises them."""
    import torch.distributed.checkpoint as dcp  # (imported here: see the top of checkpoints.py)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    with quiet_checkpoint_warnings():
        state = get_model_state_dict(model)  # this rank's shards, uninitialised (all ranks participate)
        unknown = set(state) - set(file_names) - set(fresh_tensors)
        if unknown:
            raise ValueError(f"no value for {sorted(unknown)[:3]}: neither in {folder} nor new")
        # Loaded in place, into the shards' own storage, read under the files' names: each rank
        # reads the slices its shards hold (all ranks participate).
        dcp.load(
            {file_names[name]: state[name] for name in file_names},
            storage_reader=dcp.HuggingFaceStorageReader(folder),
        )
        set_model_state_dict(  # (all ranks participate)
            model, {name: state[name] for name in file_names}, options=StateDictOptions(strict=False)
        )
        if fresh_tensors:  # the same on every rank
            set_model_state_dict(  # (all ranks participate): each rank keeps its part
                model, fresh_tensors, options=StateDictOptions(full_state_dict=True, strict=False)
            )


@contextlib.contextmanager
def quiet_checkpoint_warnings():
    """torch's own checkpoint code warns about its own internals: FSDP1's sharded state is
    ShardedTensor, which torch deprecates (dozens of lines per save), and one process is told
    it is one process. Nothing a user can act on, so they are silenced here, and only here."""
    with warnings.catch_warnings():
        for message in (
            "Please use DTensor instead and we are deprecating ShardedTensor",
            "`_get_pg_default_device` will be deprecated",
            "Multiple backends are registered with this ProcessGroup",
            "torch.distributed is disabled",
        ):
            warnings.filterwarnings("ignore", message=message)
        yield
