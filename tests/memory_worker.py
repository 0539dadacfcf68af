"""The full trainer under torchrun, watched from outside. On each rank:
- the largest storage any torch operation allocated (its local part, for a DTensor), in bytes,
  while the model was loaded and wrapped, and while it was exported;
- for each optimizer step after the first, how far the process's resident memory rose above where
  the step began, until its backward ended (until the trainer clips the gradients), in bytes: VmHWM,
  reset at the step's start through /proc/self/clear_refs (run it with MALLOC_MMAP_THRESHOLD_=65536,
  so that freed blocks leave RSS at once);
- the encoder's forwards with a graph (training forwards).
The trainer itself is unchanged; its phases are wrapped here. Writes OUTPUT_DIR/memory-rank-R.json;
the arguments are the trainer's.

Run by tests/test_big_models.py:  torchrun --nproc_per_node=2 tests/memory_worker.py ARGS...
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp_embed import batches  # noqa: E402

from fsdp_embed import config  # noqa: E402

from fsdp_embed import embedding_model  # noqa: E402

from fsdp_embed import export  # noqa: E402

from fsdp_embed import shard_loading  # noqa: E402
from fsdp_embed import sharding  # noqa: E402
from fsdp_embed import __main__ as full_train  # noqa: E402


class LargestTensor(TorchDispatchMode):
    """Sees every operation's outputs (factory functions, copies, collectives' buffers) and keeps
    the size in bytes of the largest new storage (local storage, for a DTensor). Views, and
    tensors over storage that already exists (a memory-mapped safetensors file's), are not new."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        existing = {
            storage_of(x).data_ptr() for x in tree_leaves((args, kwargs)) if storage_of(x) is not None
        }
        out = func(*args, **(kwargs or {}))
        for storage in map(storage_of, tree_leaves(out)):
            if storage is not None and storage.data_ptr() not in existing:
                self.nbytes = max(self.nbytes, storage.nbytes())
        return out


def storage_of(x):
    if isinstance(x, (torch.UntypedStorage, torch.TypedStorage)):
        return x.untyped_storage() if isinstance(x, torch.TypedStorage) else x
    if isinstance(x, DTensor):
        x = x._local_tensor
    if (
        not isinstance(x, torch.Tensor)
        or x.is_meta
        or type(x) is not torch.Tensor
        and not isinstance(x, torch.nn.Parameter)
    ):
        return None  # no storage of its own (another wrapper subclass)
    return x.untyped_storage()


largest = {"load": LargestTensor(), "export": LargestTensor()}
steps = {"rise": [], "started_kb": None, "forwards": 0}


def status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def step_ends():
    """Closes the step under way (if any, and not the first), starts watching the next one."""
    if steps["started_kb"] is not None:
        steps["rise"].append((status_kb("VmHWM") - steps["started_kb"]) * 1024)
    steps["started_kb"] = None


def step_starts():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    steps["started_kb"] = status_kb("VmRSS")


def watch_steps(micro_batches):
    def watched(*args, **kwargs):
        for i, batch in enumerate(micro_batches(*args, **kwargs)):
            if i > 0 and i % cfg.grad_accum_steps == 0:  # a step's first micro-step
                step_starts()
            yield batch

    return watched


def count_forwards(load_model):
    def watched(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        loaded.model.encoder.register_forward_pre_hook(
            lambda *_: steps.update(forwards=steps["forwards"] + torch.is_grad_enabled())
        )
        return loaded

    return watched


def during(phase, function):
    def watched(*args, **kwargs):
        with largest[phase]:
            return function(*args, **kwargs)

    return watched


embedding_model.load_model = during("load", count_forwards(embedding_model.load_model))
batches.micro_batches = watch_steps(batches.micro_batches)
sharding.wrap_model = during("load", sharding.wrap_model)
shard_loading.init_non_persistent_buffers = during("load", shard_loading.init_non_persistent_buffers)
shard_loading.load_pretrained_sharded = during("load", shard_loading.load_pretrained_sharded)
export.export_model = during("export", export.export_model)
clip_grad_norm = sharding.clip_grad_norm
sharding.clip_grad_norm = lambda *args, **kwargs: (step_ends(), clip_grad_norm(*args, **kwargs))[
    1
]  # backward is over

cfg = config.parse_config()
rank = int(os.environ["RANK"])
try:
    full_train.main(cfg)
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
with open(os.path.join(cfg.output_dir, f"memory-rank-{rank}.json"), "w") as f:
    json.dump(
        {
            **{phase: mode.nbytes for phase, mode in largest.items()},
            "step_rise": steps["rise"],
            "forwards": steps["forwards"],
        },
        f,
    )
