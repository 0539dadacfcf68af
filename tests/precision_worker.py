"""The full trainer (fsdp_embed) for one step under torchrun (or one process), watched from outside:
MNRL's inputs and output on this rank, and whether autocast was on when the loss ran. Then, from the
same embeddings, the loss in fp32 outside autocast and the loss under bf16 autocast, as references.
And how the encoder's first Linear layer computed in each evaluation forward: in autocast (its
dtype) or not, and its weight's dtype (FSDP's own cast). The trainer itself is unchanged;
losses.mnrl_loss and sharding.wrap_model are wrapped here. Writes OUTPUT_DIR/loss-rank-R.json; the
arguments are the trainer's.

Run by tests/test_fsdp_precision.py:  torchrun --nproc_per_node=2 tests/precision_worker.py ARGS...
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp_embed import config  # noqa: E402
from fsdp_embed import sharding  # noqa: E402
import losses  # noqa: E402
from fsdp_embed import __main__ as full_train  # noqa: E402

seen = []
mnrl_loss = losses.mnrl_loss


def watched(anchor, candidates, **options):
    loss = mnrl_loss(anchor, candidates, **options)
    if not seen:  # the first micro-batch
        copies = [t.detach().clone() for t in (anchor, *candidates)]
        seen.append((copies, options, torch.is_autocast_enabled("cpu"), loss.item()))
    return loss


losses.mnrl_loss = watched
evaluation_forwards = []  # (autocast dtype or None, the weight's dtype) of each
wrap_model = sharding.wrap_model


def note_evaluation_forward(module, args):
    if not module.training:
        autocast_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        evaluation_forwards.append((str(autocast_dtype), str(module.weight.dtype)))


def wrap_and_watch(model, *args, **kwargs):
    first_linear = next(m for m in model.encoder.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_pre_hook(note_evaluation_forward)
    return wrap_model(model, *args, **kwargs)


sharding.wrap_model = wrap_and_watch
cfg = config.parse_config()
try:
    full_train.main(cfg)
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
(anchor, *candidates), options, autocast_on, loss = seen[0]
fp32 = mnrl_loss(anchor.float(), [c.float() for c in candidates], **options).item()
with torch.autocast("cpu", dtype=torch.bfloat16):
    bf16 = mnrl_loss(anchor.float(), [c.float() for c in candidates], **options).item()
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(cfg.output_dir, f"loss-rank-{rank}.json"), "w") as f:
    result = {"loss": loss, "fp32": fp32, "under_autocast": bf16, "autocast_on": autocast_on}
    result["evaluation_forwards"] = evaluation_forwards
    json.dump({**result, "dtype": str(anchor.dtype)}, f)
