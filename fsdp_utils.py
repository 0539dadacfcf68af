"""What a training loop needs of torch.distributed and FSDP, and nothing else:

  - `setup_dist` / `cleanup_dist`: the process group of torchrun's environment (gloo on CPU,
    NCCL on CUDA), or one process without it; `print0` prints once;
  - `resolve_layer_classes`: the model's repeated block (BertLayer, XLMRobertaLayer,
    Qwen2DecoderLayer, ...), found in the model itself rather than by a name that differs per
    architecture, or named by the caller and checked;
  - `wrap_fsdp1`: FSDP1 (`FullyShardedDataParallel`) with `transformer_auto_wrap_policy` on that
    block and `MixedPrecision`;
  - `full_state_dict`: every weight whole, gathered for the export.

Needs torch only: copy it with train.py. Usage (every rank calls each of these):
    rank, world_size, device = fsdp_utils.setup_dist(timeout_minutes=30)
    model = fsdp_utils.wrap_fsdp1(model, device, fsdp_utils.resolve_layer_classes(model), "bf16")
    state = fsdp_utils.full_state_dict(model)   # whole tensors; rank 0 writes them
    fsdp_utils.cleanup_dist()

Left out on purpose: FSDP2, hybrid sharding over several hosts, CPU offload of the parameters
(the package fsdp_embed/ has the first two, in its sharding.py).
"""

import datetime
import functools
import os
import signal
import sys

import torch
import torch.distributed as dist

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def setup_dist(timeout_minutes=30):
    """(rank, world size, device): the process group of torchrun's environment, one process
    without it. Every collective fails after `timeout_minutes` instead of waiting forever for a
    rank that is gone."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if sys.platform.startswith("linux"):
        # A worker outlives a launcher killed with SIGKILL and would go on training and writing
        # beside its relaunch: ask Linux to end this process when its parent (torchrun) dies.
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # Under `torchrun --max-restarts` the store outlives a failed attempt, and a restarted gloo
    # group can read the dead attempt's addresses from it ("Gloo connectFullMesh failed ...
    # Connection refused"). Each attempt gets its own key space in the store.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(  # (all ranks participate)
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"attempt-{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return rank, world_size, device


def cleanup_dist():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):  # rank 0's print
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def detect_layer_classes(model):
    """Names of the classes of the model's repeated block: the element classes of the
    `nn.ModuleList` that holds the most parameters (BertLayer, XLMRobertaLayer, MPNetLayer,
    Qwen2DecoderLayer, ...). Works whatever `_no_split_modules` says, or when it is missing
    (older transformers versions name only the attention class for some models)."""
    best, best_numel = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = module, numel
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no repeated block (no nn.ModuleList of layers) for FSDP to "
            "wrap: train it with --strategy ddp, or name its layer classes with the full trainer's "
            "--fsdp-layer-cls (python -m fsdp_embed)"
        )
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
            f"(all classes in the model: {sorted(present)})"
        )
    return {present[n] for n in names}


def wrap_fsdp1(model, device, layer_classes, precision="fp32", **fsdp_options):
    """FSDP1 around `model`: each block of `layer_classes` its own unit, so only one block's
    weights are whole at a time (gathered for its forward, and again for its backward); the rest
    (embeddings, final norm, heads) in the root unit. `fsdp_options` go to
    `FullyShardedDataParallel` as they are (the full trainer's sharding strategy and mesh).
    Wrapping is no collective (without sync_module_states): each rank keeps its own part of its
    own weights, so every rank must have built the same weights (the same files, a new head drawn
    from the same seed).

    Mixed precision (bf16, fp16): FSDP keeps the fp32 weights sharded, casts the gathered ones to
    `precision` for compute, and reduces the gradients in fp32, so the optimizer updates fp32
    master weights with fp32 gradients."""
    # Imported here, not at the top: a run that wraps nothing starts faster without FSDP.
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    low = PRECISIONS[precision]
    mixed = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=set(layer_classes)
        ),
        mixed_precision=mixed if precision != "fp32" else None,
        device_id=device,  # on CPU too: without it FSDP1 looks for an accelerator and fails
        # The parameters keep their own names and shapes (views into FSDP's flat shards): the
        # optimizer's groups are chosen by name, the gradient norm and the state dict read them.
        use_orig_params=True,
        **fsdp_options,
    )


def full_state_dict(model):
    """Every weight whole, under the unwrapped model's names ("encoder.layer.0...", no "module."
    or "_fsdp_wrapped_module."), for the export. A collective under FSDP: every rank enters it.

    Under FSDP each rank holds a shard of every weight, so the weights are all-gathered, one unit
    at a time. On a GPU each gathered tensor is copied to the CPU of rank 0 alone (the others
    get an empty dict), so no GPU ever holds the whole model. On a CPU every rank keeps the whole
    copy instead (torch 2.13 crashes copying a CPU run's tensors "to the CPU" of rank 0), and only
    rank 0 writes it. Under DDP and in one process nothing is gathered: every rank already holds
    every weight."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    on_gpu = next(model.parameters()).is_cuda
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
    return get_model_state_dict(model, options=options)  # (all ranks participate)
