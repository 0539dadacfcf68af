"""Benchmark: what each rank holds under DDP and each FSDP sharding strategy, for a randomly
initialised bert-base-sized encoder (`BertConfig()` defaults, 109M parameters), at 2 and 4 ranks.

For every configuration it runs a few MNRL training steps through the same code as the trainer
(sharding.wrap_model, full_train.build_optimizer, full_train.embed_columns, full_train.embeddings_loss) on
random token batches and reports, per rank:
  - state MB: bytes of parameters + gradients + optimizer state, summed over the distinct
    storages those local tensors live in (a sharded parameter counts its local shard only),
    measured after the optimizer step, before the gradients are freed;
  - peak RSS MB of the process (includes torch itself and the full model, which
    every rank builds before sharding);
  - seconds per step (mean of the steps after the first).
Target: full_shard state per rank <= 1.1 x (DDP's / world).

Run (CPU, gloo; about 8 minutes on 2 cores):
    python bench/bench_fsdp_memory.py
    python bench/bench_fsdp_memory.py --precision bf16      # on a GPU machine, for example
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # (label, extra trainer-style arguments)
    ("ddp", dict(strategy="ddp")),
    ("fsdp1 no_shard", dict(strategy="fsdp", fsdp_version=1, sharding="no_shard")),
    ("fsdp1 shard_grad_op", dict(strategy="fsdp", fsdp_version=1, sharding="shard_grad_op")),
    ("fsdp1 full_shard", dict(strategy="fsdp", fsdp_version=1, sharding="full_shard")),
    ("fsdp2 shard_grad_op", dict(strategy="fsdp", fsdp_version=2, sharding="shard_grad_op")),
    ("fsdp2 full_shard", dict(strategy="fsdp", fsdp_version=2, sharding="full_shard")),
]


def state_bytes(model, optimizer):
    """Bytes of the distinct storages behind this rank's parameters, gradients and optimizer
    state. Storages, not tensors: FSDP1's parameters are views into one flat shard."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        if hasattr(t, "to_local"):  # FSDP2: a DTensor; this rank holds its local shard
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return total


def worker(args):
    import torch.distributed as dist
    import transformers

    from fsdp_embed import batches
    from fsdp_embed import embedding_model
    from fsdp_embed import run_plan

    import fsdp_utils

    from fsdp_embed import sharding
    from fsdp_embed import __main__ as full_train

    rank, world_size, device = fsdp_utils.setup_dist(10)
    torch.manual_seed(0)
    encoder = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False)
    raw_model = embedding_model.EmbeddingModel(encoder, "mean", False).to(device)
    no_decay = {n for n, p in raw_model.named_parameters() if p.ndim < 2}
    options = json.loads(args.options)
    strategy = options.pop("strategy")
    model = sharding.wrap_model(raw_model, strategy, device, precision=args.precision, **options)
    fused = not (args.precision == "fp16" and strategy == "fsdp")
    optimizer = full_train.build_optimizer(model, no_decay, 1e-5, 0.01, fused=fused)
    scaler = sharding.grad_scaler(model, args.precision, device)
    use_autocast = args.precision != "fp32" and strategy == "ddp"

    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps):
        features = [
            {
                "input_ids": torch.randint(1000, 30000, (args.batch, args.seq_len), generator=generator).to(
                    device
                ),
                "attention_mask": torch.ones(args.batch, args.seq_len, dtype=torch.long, device=device),
            }
            for _ in range(2)
        ]
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=fsdp_utils.PRECISIONS[args.precision], enabled=use_autocast):
            embs = full_train.embed_columns(model, batches.pool_columns(features), len(features))
            loss = full_train.embeddings_loss(model, embs, None, run_plan.LossPlan("mnrl"))
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        sharding.clip_grad_norm(model, 1.0)
        (scaler.step(optimizer), scaler.update()) if scaler else optimizer.step()
        if step == args.steps - 1:
            held = state_bytes(model, optimizer)  # before zero_grad frees the gradients
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    # (all ranks participate): the per-rank numbers are reduced to their maximum.
    stats = torch.tensor(
        [
            held,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            sum(times[1:]) / max(1, len(times) - 1),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        peak_gpu = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        print(
            "RESULT "
            + json.dumps(
                {
                    "state_bytes": stats[0].item(),
                    "peak_rss": stats[1].item(),
                    "s_per_step": stats[2].item(),
                    "peak_gpu": peak_gpu,
                }
            ),
            flush=True,
        )
    fsdp_utils.cleanup_dist()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", default="2,4", help="world sizes to measure")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch", type=int, default=4, help="rows per rank and column")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    print(
        f"bert-base (BertConfig(), random init), MNRL, batch {args.batch} x 2 columns "
        f"x {args.seq_len} tokens per rank, {args.precision}\n"
    )
    print("| world | strategy | state per rank (MB) | vs DDP / world | peak RSS (MB) | s/step |")
    print("|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        ddp_state = None
        for label, options in CONFIGS:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={world}",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                os.path.abspath(__file__),
                "--worker",
                "--options",
                json.dumps(options),
                "--precision",
                args.precision,
                "--batch",
                str(args.batch),
                "--seq-len",
                str(args.seq_len),
                "--steps",
                str(args.steps),
            ]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, cwd=REPO_DIR, env={**os.environ, "PYTHONPATH": REPO_DIR}
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(
                    f"| {world} | {label} | failed: "
                    f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode} "
                    "| | | |"
                )
                continue
            r = json.loads(lines[0][len("RESULT ") :])
            ddp_state = ddp_state or r["state_bytes"]
            ratio = r["state_bytes"] / (ddp_state / world)
            print(
                f"| {world} | {label} | {r['state_bytes'] / 2**20:.0f} | {ratio:.2f} "
                f"| {r['peak_rss'] / 2**20:.0f} | {r['s_per_step']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    import torch

    main()
