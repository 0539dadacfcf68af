"""Run by tests/test_losses.py at world size W (torchrun's worker environment, through
conftest.warm_run): every rank builds the same seeded embeddings of a global batch (W x B rows
per column), takes its own B rows, computes mnrl_loss with gathered negatives and the given
directions, backwards it, and writes its loss and the gradients of its rows to
OUT/rank-R.safetensors. OPTIONS (JSON, optional; tests/test_false_negatives.py): more keyword
arguments of mnrl_loss ("symmetric", "false_negatives", "hardness"), and "guide": true for a
guide model's embeddings, seeded after the student's (each column plus 0.3 x noise).

    torchrun --nproc_per_node=2 tests/loss_worker.py OUT B COLUMNS DIRECTIONS PARTITION [OPTIONS]
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import losses  # noqa: E402


def main():
    out, rows, columns, directions, partition = sys.argv[1:6]
    rows, columns = int(rows), int(columns)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(11)
    full = [torch.randn(world * rows, 16, generator=generator, dtype=torch.float64) for _ in range(columns)]
    mine = [t[rank * rows : (rank + 1) * rows].clone().requires_grad_() for t in full]
    options = {"gather": True, "directions": tuple(directions.split(",")), "partition": partition}
    more = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    if more.pop("guide", False):
        guide = [t + 0.3 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in full]
        mine_guide = [t[rank * rows : (rank + 1) * rows] for t in guide]
        options["guide"] = (mine_guide[0], mine_guide[1:])
    options.update(more)
    loss = losses.mnrl_loss(mine[0], mine[1:], **options)
    loss.backward()
    grads = {f"grad-{i}": t.grad for i, t in enumerate(mine)}
    save_file({"loss": loss.detach().reshape(1), **grads}, os.path.join(out, f"rank-{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
