"""train.py under torchrun, watched from outside: on each rank, the largest storage any torch
operation allocated (its local part, for a DTensor), in bytes, while the model was loaded and wrapped, and
while it was exported. train.py itself is unchanged; its phases are wrapped here. Writes
OUTPUT_DIR/largest-tensor-rank-R.json; the arguments are train.py's.

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

import fsdp_utils  # noqa: E402
import train  # noqa: E402


class LargestTensor(TorchDispatchMode):
    """Sees every operation's outputs (factory functions, copies, collectives' buffers) and keeps
    the size in bytes of the largest new storage (local storage, for a DTensor). Views, and
    tensors over storage that already exists (a memory-mapped safetensors file's), are not new."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        existing = {storage_of(x).data_ptr() for x in tree_leaves((args, kwargs)) if storage_of(x) is not None}
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
    if not isinstance(x, torch.Tensor) or x.is_meta or type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
        return None  # no storage of its own (another wrapper subclass)
    return x.untyped_storage()


largest = {"load": LargestTensor(), "export": LargestTensor()}


def during(phase, function):
    def watched(*args, **kwargs):
        with largest[phase]:
            return function(*args, **kwargs)
    return watched


train.load_model = during("load", train.load_model)
fsdp_utils.wrap_model = during("load", fsdp_utils.wrap_model)
train.init_non_persistent_buffers = during("load", train.init_non_persistent_buffers)
fsdp_utils.load_pretrained_sharded = during("load", fsdp_utils.load_pretrained_sharded)
train.export = during("export", train.export)

cfg = train.parse_config()
rank = int(os.environ["RANK"])
try:
    train.main(cfg)
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
with open(os.path.join(cfg.output_dir, f"largest-tensor-rank-{rank}.json"), "w") as f:
    json.dump({phase: mode.nbytes for phase, mode in largest.items()}, f)
