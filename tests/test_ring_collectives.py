"""FSDP2's all-gather and reduce-scatter over gloo run as rings of point-to-point messages
(sharding.RingAllGather / RingReduceScatter), and give what gloo's own collectives give.

The reference is gloo's `all_gather_into_tensor` and `reduce_scatter_tensor`, and a float64
sum by hand. At world size 2 a ring's sum is a + b, the all-reduce's too: equal bit for bit. At
4 ranks the additions run in another order, so the check is against the float64 sum, to fp32
rounding. Sub-groups of 2 (hybrid sharding's shard groups, whose ranks are not the global ones)
and sizes that do not divide evenly by 4 are covered. Then FSDP2 itself: a model wrapped by
`wrap_model` never calls gloo's all-gather or reduce-scatter, and its gradients equal DDP's.
And --sharding auto: when one rank is short of memory, every rank shards fully.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_embed import sharding  # noqa: E402
from conftest import exit_without_teardown, warm_run  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def check_group(group, rank, seed, numel, dtype):
    """(all-gather equal to gloo's, reduce-scatter SUM and AVG: largest difference from gloo's
    and from a float64 sum by hand) on `group`; `numel` values per rank's part."""
    size, me = group.size(), group.rank()
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(size * numel, generator=g).to(dtype) for _ in range(size)]  # every rank's input
    mine = parts[me]
    out = torch.empty(size * numel, dtype=dtype)
    out.view(size, -1)[me].copy_(mine[:numel])  # FSDP2 copies the shard into its slot first
    sharding.RingAllGather()(out, out.view(size, -1)[me], group)
    expected = torch.empty_like(out)
    dist.all_gather_into_tensor(expected, mine[:numel].clone(), group=group)
    gathered = torch.equal(out, expected)
    worst_gloo, worst_exact = 0.0, 0.0
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        got = torch.empty(numel, dtype=dtype)
        sharding.RingReduceScatter()(got, mine.clone(), group, op)
        gloo = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_tensor(gloo, mine.clone(), op=dist.ReduceOp.SUM, group=group)
        exact = torch.stack([p.view(size, -1)[me].double() for p in parts]).sum(0)
        if op == dist.ReduceOp.AVG:
            gloo, exact = gloo / size, exact / size
        worst_gloo = max(worst_gloo, (got - gloo).abs().max().item())
        worst_exact = max(worst_exact, ((got.double() - exact).abs() / exact.abs().clamp_min(1)).max().item())
    return gathered, worst_gloo, worst_exact


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(12, 12)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 12)
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(12, 5)  # 65 values: the shards are uneven

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single")


def fsdp2_against_ddp(rank):
    """(calls of gloo's all-gather / reduce-scatter under FSDP2, largest gradient difference
    from DDP) over 2 steps of a tiny model."""
    torch.manual_seed(0)
    models = {"ddp": Tiny(), "fsdp": Tiny()}
    models["fsdp"].load_state_dict(models["ddp"].state_dict())
    wrapped = {s: sharding.wrap_model(m, s, torch.device("cpu"), fsdp_version=2) for s, m in models.items()}
    calls = []
    # torch's names for them (FSDP2 calls the *_single ones in torch 2.13)
    names = [n for n in NAMES if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _n=n, **k: calls.append(_n) or originals[_n](*a, **k))
    worst = 0.0
    for step in range(2):
        ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(10 * step + rank))
        for model in wrapped.values():
            model(ids).backward()
        # --sharding auto picks shard_grad_op for this tiny model: FSDP2 leaves `embed` whole,
        # and its gradient is averaged here, as the full trainer does after each step's last backward.
        sharding.all_reduce_replicated(wrapped["fsdp"])
        ddp_grads = dict(wrapped["ddp"].module.named_parameters())
        for name, p in wrapped["fsdp"].named_parameters():
            full = p.grad.full_tensor() if sharding.is_sharded(p.grad) else p.grad
            worst = max(worst, (full - ddp_grads[name].grad).abs().max().item())
        for model in wrapped.values():
            model.zero_grad(set_to_none=True)
    for n in names:
        setattr(dist, n, originals[n])
    return len(calls), worst


def worker(rank, world_size, folder):
    """One rank: writes what it found to FOLDER/rank{R}.json, then ends the process."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # MASTER_ADDR/PORT: the launcher's
    torch.set_num_threads(1)
    out = {}
    world = dist.group.WORLD
    for numel in (1, 7, 1000):
        out[f"world {numel}"] = check_group(world, rank, numel, numel, torch.float32)
    out["world bf16"] = check_group(world, rank, 5, 64, torch.bfloat16)
    if world_size == 4:
        # Hybrid sharding's shard groups: {0, 1} and {2, 3}; and {0, 2}, {1, 3} across them.
        for ranks_list in ([[0, 1], [2, 3]], [[0, 2], [1, 3]]):
            groups = [dist.new_group(ranks) for ranks in ranks_list]  # every rank makes every group
            mine = next(g for g, ranks in zip(groups, ranks_list) if rank in ranks)
            out[f"group {ranks_list}"] = check_group(mine, rank, 3, 33, torch.float32)
    else:
        out["fsdp2"] = fsdp2_against_ddp(rank)
        # --sharding auto: rank 1 alone short of memory for a gathered copy: both ranks shard fully.
        model = Tiny()
        fp32 = 4 * sum(p.numel() for p in model.parameters())
        sharding.free_memory_per_process = lambda device: 10**12 if rank == 0 else 5 * fp32
        out["auto"] = sharding.auto_sharding(model, torch.device("cpu"), None)[0]
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
    exit_without_teardown()  # no DDP or gloo teardown: see conftest


def run(world_size, folder):
    """{rank: what `worker` found}: this file run at `world_size` ranks by the warm launcher
    (conftest.warm_run: torchrun's worker environment, one thread a process)."""
    warm_run([folder], nproc=world_size, script=__file__, train_flags=False, timeout=300)
    return {rank: json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world_size)}


def test_rings_at_two_ranks_equal_gloo_bit_for_bit_and_fsdp2_uses_them(tmp_path):
    results = run(2, tmp_path)
    for rank, out in results.items():
        for case, value in out.items():
            if case == "auto":
                assert value == "full_shard", (rank, value)  # the ranks agree on the least memory
            elif case == "fsdp2":
                gloo_calls, worst = value
                assert gloo_calls == 0, (rank, value)  # every FSDP2 collective went through the rings
                assert worst <= 1e-6, (rank, value)  # and the gradients are DDP's
            else:
                gathered, worst_gloo, worst_exact = value
                assert gathered and worst_gloo == 0.0, (rank, case, value)


def test_rings_at_four_ranks_and_in_sub_groups_give_the_exact_sum_to_rounding(tmp_path):
    results = run(4, tmp_path)
    assert len(results) == 4
    for rank, out in results.items():
        for case, (gathered, worst_gloo, worst_exact) in out.items():
            assert gathered, (rank, case)
            # fp32: a few ulps of 4 summands; bf16 (8 bits of mantissa): its own rounding.
            tolerance = 2e-2 if "bf16" in case else 1e-6
            assert worst_exact <= tolerance, (rank, case, worst_exact)


if __name__ == "__main__":  # one rank of `run`
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1])
