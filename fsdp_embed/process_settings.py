"""Settings of the whole process that follow from the run's device, precision and sharding, set
once at start-up before the model is wrapped:

  - `set_tf32`: on an NVIDIA GPU, whether fp32 matmuls may use TensorFloat-32 (--tf32);
  - `set_cpu_allocator`: on CPU, how glibc's malloc treats large freed blocks: kept for reuse
    (speed first), or given back at once under full_shard and hybrid_shard (memory first).

Each returns the line to log, or None where it does nothing. Needs torch only: copy it alone.
Usage (each rank for itself, no collective):
    print0(process_settings.set_cpu_allocator(device, "fsdp", "full_shard"))  # glibc's malloc, CPU
    print0(process_settings.set_tf32(device, "fp32", "on"))                   # CUDA's fp32 matmuls

Left out on purpose: other allocators than glibc's (their own policy stays), and PyTorch's
CUDA caching allocator (its defaults serve).
"""

import os
import sys

import torch


def set_tf32(device, precision, tf32):
    """Let fp32 matmuls and convolutions on an NVIDIA GPU use TensorFloat-32 (`tf32` "on", the
    --tf32 default) under --precision fp32, for the whole process; returns the log line saying
    so, or None on CPU. Under bf16 and fp16 the encoder computes in 16 bits anyway, and TF32 stays
    off so that the loss, computed in fp32 (__main__.forward_backward), is fp32. Without TF32
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
    hybrid_shard: `sharding` as sharding.resolve_sharding gives it). Call it once, before wrapping.
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
