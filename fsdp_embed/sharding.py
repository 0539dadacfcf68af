"""Sharding: what stands between a plain `nn.Module` and the ranks of a DDP or FSDP run, beyond
the FSDP1 wrapping of the root's fsdp_utils.py (which the one-file loop uses alone):

  - `resolve_sharding`: --sharding auto by the free memory of the ranks (`auto_sharding`);
  - `wrap_model`: nothing (one process), DDP (`wrap_ddp`), FSDP1 (`wrap_fsdp1`:
    fsdp_utils.wrap_fsdp1 with the sharding strategy, hybrid_shard's two-level mesh and a model
    on the meta device) or FSDP2 (`wrap_fsdp2`: `fully_shard` per block, then the root), with
    bf16/fp16 mixed precision; `is_fsdp1`, `is_fsdp2`, `is_sharded` tell them apart;
  - for the loop: `all_reduce_replicated` (the embedding tables FSDP2 leaves whole under
    shard_grad_op), `clip_grad_norm` (sharded gradients too), `grad_scaler` (fp16);
  - the communication this project writes itself, where torch's own sends more than it needs:
    over gloo, FSDP2's all-gather and reduce-scatter as rings of point-to-point messages
    (`RingAllGather`, `RingReduceScatter`: wrap_fsdp2 sets them); on CPU, the mean over ranks of
    the gradients, sending of an embedding table only the rows some rank used (the DDP
    communication hook `all_reduce_embedding_rows`, its state an `EmbeddingRows`, and
    `mean_over_ranks`), bit for bit what the dense all-reduce gives.

Needs torch, and fsdp_utils.py (at the repository's root: the repeated block, FSDP1 with mixed
precision, `print0`, `PRECISIONS`; it needs torch only): copy the two.
Usage (all ranks participate: every rank calls each of these, in the same order):
    rank, world_size, device = fsdp_utils.setup_dist(timeout_minutes=30)
    raw_model = AutoModel.from_config(config)  # under `with torch.device("meta")`: shapes only
    chosen, why = sharding.resolve_sharding(raw_model, "fsdp", device, "auto", "fp32")
    model = sharding.wrap_model(raw_model, "fsdp", device, sharding=chosen, fsdp_version=2)
    shard_loading.load_pretrained_sharded(model, folder, {name: name for name in raw_model.state_dict()}, {})
    sharding.all_reduce_replicated(model)   # each step, after its last backward: whole tables (FSDP2)
    sharding.clip_grad_norm(model, 1.0)
    fsdp_utils.cleanup_dist()

FSDP1 -> FSDP2: `wrap_fsdp1` and `wrap_fsdp2` side by side; docs/fsdp.md has the table. Left out
on purpose: CPU offload, resuming at another world size (refused at start-up), rings under NCCL
(NCCL's own collectives serve there). Activation checkpointing is the model's own (transformers'
gradient checkpointing). The rings and the rows' mean are tested against gloo's own collectives
and DDP's dense all-reduce: tests/test_ring_collectives.py, tests/test_embedding_rows.py.
"""

import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist

import fsdp_utils


# ----------------------------------------------------------------------------------------------
# Choosing the sharding: --sharding auto, by the free memory


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
        ddp.register_comm_hook(EmbeddingRows(embeddings), all_reduce_embedding_rows)
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
                module.set_custom_all_gather(RingAllGather())
                module.set_custom_reduce_scatter(RingReduceScatter())
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
        mean_over_ranks([(p.grad, True) for p in tables])


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


# ----------------------------------------------------------------------------------------------
# For the loop: the gradient norm, fp16's loss scaling


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
# The communication this project writes itself, where torch's own sends more than it needs


class RingAllGather:
    """FSDP2's all-gather over gloo as a ring of point-to-point messages, straight into the
    gathered buffer: gloo's own `all_gather_into_tensor` is slower on CPU (docs/fsdp.md has the
    numbers). The values are the ones sent: the same result.

    FSDP2 calls it on every rank of `group` in the same order (one per block, forward and
    backward), as it calls its own collectives (all ranks participate). `input_tensor` is this rank's slot of
    `output_tensor` (FSDP2 copies the shards in there); the ring fills the other slots."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        """The ring (all ranks participate)."""
        world_size, rank = group.size(), group.rank()
        slots = output_tensor.view(world_size, -1)
        if input_tensor.data_ptr() != slots[rank].data_ptr():
            slots[rank].copy_(input_tensor.view(-1))
        after, before = (rank + 1) % world_size, (rank - 1) % world_size
        # Step k: pass on the slot received in step k - 1 (this rank's own in step 0).
        for k in range(world_size - 1):
            # (all ranks participate): each sends to the next rank, and receives from the one before
            sent = dist.isend(slots[(rank - k) % world_size], group=group, group_dst=after)
            # (all ranks participate)
            dist.irecv(slots[(rank - k - 1) % world_size], group=group, group_src=before).wait()
            sent.wait()
        return None  # done: FSDP2 waits only on a returned Work


class RingReduceScatter:
    """FSDP2's reduce-scatter over gloo as a ring of point-to-point messages. gloo has no
    reduce-scatter of one tensor: `reduce_scatter_tensor` all-reduces the whole input, which
    sends every rank's gradient to every rank, and then copies its part out. A ring sends each
    rank's part once (faster: docs/fsdp.md). Sum (or mean) of the same values: at world size 2
    bit for bit what the all-reduce gives (a + b); at more ranks the order of the additions
    differs, so the last bit may.

    Every rank of `group` calls it in the same order (all ranks participate): FSDP2 reduces block
    by block as backward reaches them. The input, FSDP2's own scratch copy of the gradients, is
    summed into in place."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        """The ring, or gloo's own for another op (all ranks participate)."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # a pre-multiplied sum: gloo's own
            return dist.reduce_scatter_tensor(  # (all ranks participate)
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        world_size, rank = group.size(), group.rank()
        parts = input_tensor.view(world_size, -1)
        received = torch.empty_like(parts[0])
        after, before = (rank + 1) % world_size, (rank - 1) % world_size
        # Step k: send part (rank - k - 1), summed over the k ranks before this one; receive
        # part (rank - k - 2) summed likewise, and add this rank's own. After world_size - 1
        # steps this rank holds part `rank` summed over all.
        for k in range(world_size - 1):
            # (all ranks participate): each sends to the next rank, and receives from the one before
            sent = dist.isend(parts[(rank - k - 1) % world_size], group=group, group_dst=after)
            dist.irecv(received, group=group, group_src=before).wait()  # (all ranks participate)
            sent.wait()
            mine = parts[(rank - k - 2) % world_size]
            if k == world_size - 2:
                torch.add(mine, received, out=output_tensor.view(-1))
            else:
                mine.add_(received)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world_size)
        return None


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
    Every rank calls the same collectives (all ranks participate): DDP hands the buckets over in
    the same order on all of them, and the number of rows sent is agreed before it is sent."""
    flat = bucket.buffer()
    parameters = bucket.parameters()
    if not any(id(p) in state.ids for p in parameters):
        flat.div_(dist.get_world_size())  # DDP's own order: divide, then sum
        # (all ranks participate): a bucket without tables, as DDP's own hook
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0])
    pieces, offset = [], 0  # (gradient, is an embedding), in the bucket's own order
    for p in parameters:
        grad = flat[offset : offset + p.numel()]
        offset += p.numel()
        pieces.append((grad.view(p.shape[0], -1), True) if id(p) in state.ids else (grad, False))
    mean_over_ranks(pieces)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def mean_over_ranks(pieces):
    """In place, the mean over ranks of each gradient in `pieces`, a list of (gradient, is an
    embedding table), sending of a table only the rows some rank used, in one message. Two
    all_reduces (all ranks participate), each rank passing the same shapes in the same order."""
    world_size = dist.get_world_size()
    # A row is used when any of its entries is non-zero (or NaN): when its largest or its
    # smallest entry is. Two min/max passes read the table at memory speed; `ne(0).any(1)`
    # writes a boolean per entry first, several times slower (docs/fsdp.md).
    used = torch.cat([grad.amax(1).ne(0) | grad.amin(1).ne(0) for grad, is_table in pieces if is_table]).to(
        torch.uint8
    )
    # (all ranks participate): a row any rank touched is sent by every rank
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    rows, start = [], 0
    for grad, is_table in pieces:
        if is_table:
            rows.append(used[start : start + grad.shape[0]].nonzero().squeeze(1))
            start += grad.shape[0]
        else:
            rows.append(None)
    message = torch.cat(
        [grad if r is None else grad.index_select(0, r).view(-1) for (grad, _), r in zip(pieces, rows)]
    )
    # Divided before the sum, as DDP does (the same numbers, bit for bit), but only what is sent:
    # the rows no rank used are zero, and stay so (all ranks participate).
    dist.all_reduce(message.div_(world_size))
    start = 0
    for (grad, _), r in zip(pieces, rows):
        if r is None:
            grad.copy_(message[start : start + grad.numel()])
            start += grad.numel()
        else:
            grad.index_copy_(0, r, message[start : start + r.numel() * grad.shape[1]].view(-1, grad.shape[1]))
            start += r.numel() * grad.shape[1]


def gradient_sync(model, enabled):
    """Context for one micro-step's backward. DDP with `enabled=False`: the gradients accumulate
    locally and are all-reduced in the next synchronised backward (accumulation without
    communication). FSDP reduce-scatters in every backward, whatever `enabled` says, and
    accumulates the gradients in their shards: skipping it (FSDP1's no_sync, FSDP2's
    set_requires_gradient_sync(False)) keeps every parameter's unsharded gradient until the
    last micro-step, a whole model's gradients on every rank, which is what FSDP is there to
    avoid. The price: one reduce-scatter per micro-step (per GradCache chunk), not per step."""
    # Only DDP defers: one process needs nothing, also under torchrun (a process group of one).
    if enabled or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
