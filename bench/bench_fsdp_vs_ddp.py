"""Benchmark: FSDP (as launched, FSDP1, FSDP2) against DDP, in throughput and quality, at 2 processes.

The full trainer alone, all-MiniLM-L6-v2, the settings of bench_cosent_vs_st.py (global batch 32, lr
2e-5, 10% warm-up, weight decay 0.01, max length 128, seed 12), packed rows (the default):
  cosent: CoSENT on stsb-train.jsonl;
  mnrl:   MultipleNegativesRanking on sick-pairs-train.jsonl;
--steps steps each, then STS-B dev Spearman (x100, the trainer's own sharded evaluation, after
the last step: not counted in samples/s). Each strategy runs --rounds times, the order turned
round each round (this machine's speed drifts by ~10% over minutes). samples/s is the full trainer's
own summary (the training loop only), the mean of the rounds; the ratio to DDP is that of the
means, then each round's (a round's runs follow each other, so drift shows less there). "others'
CPU" is how many cores processes other than the run's own kept busy while it ran (from
/proc/stat, less the run's own CPU time; Linux only): a round with more than ~0.2 was not measured
on a quiet machine.

Strategies: ddp; fsdp (`--strategy fsdp` as a user launches it, no version flag: the default
FSDP, with its --sharding auto); fsdp1 and fsdp2 (--fsdp-version 1 / 2, --sharding auto:
shard_grad_op for a model this small, with its log line); fsdp2_full_shard (memory first: every
block gathered again in backward, and on CPU freed blocks given back to the system at once).
The FSDP version each run used is read from its exported config and printed beside its sharding.

Run (a quiet machine; about 15 minutes on 2 CPU cores with the defaults):
    python bench/bench_fsdp_vs_ddp.py          # the public sets in data/ (--data-dir: another copy)
    python bench/bench_fsdp_vs_ddp.py --precisions bf16 --strategies ddp,fsdp2
    python bench/bench_fsdp_vs_ddp.py --strategies ddp,fsdp,fsdp1 --steps 40   # the default FSDP
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
FILES = {"cosent": "stsb-train.jsonl", "mnrl": "sick-pairs-train.jsonl"}
STRATEGIES = {
    "ddp": ["--strategy", "ddp"],
    "fsdp": ["--strategy", "fsdp"],
    "fsdp1": ["--strategy", "fsdp", "--fsdp-version", "1"],
    "fsdp2": ["--strategy", "fsdp", "--fsdp-version", "2"],
    "fsdp2_full_shard": ["--strategy", "fsdp", "--fsdp-version", "2", "--sharding", "full_shard"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_cpu_seconds():
    """CPU seconds spent busy by the whole machine so far (all cores, all processes), or None."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_timed(command):
    """(the finished run of the trainer, the cores other processes kept busy meanwhile or None)."""
    busy, own, start = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True)
    others = None
    if busy is not None:
        others = (busy_cpu_seconds() - busy - (own_cpu_seconds() - own)) / (time.perf_counter() - start)
    return done, others


def own_cpu_seconds():
    """CPU seconds of this script's finished children (the runs): user and system."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(task, precision, strategy, args, out):
    """(samples/s, STS-B dev Spearman x100, "FSDP<version> <the log's sharding line>" or "",
    cores kept busy by other processes during the run or None)."""
    data = Path(args.data_dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "fsdp_embed"]
    command += ["--loss", task, "--train-data", str(data / FILES[task])]
    command += ["--eval-data", str(data / "stsb-dev.jsonl")]
    command += ["--max-steps", str(args.steps), "--per-device-batch-size", "16", "--max-seq-length", "128"]
    command += ["--lr", "2e-5", "--warmup-ratio", "0.1", "--weight-decay", "0.01", "--seed", "12"]
    command += ["--precision", precision, *STRATEGIES[strategy], "--output-dir", str(out), "--overwrite"]
    done, others = run_timed(command)
    if done.returncode != 0:
        sys.exit(f"error: fsdp_embed exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    spearman = [v for line in lines for k, v in line.get("eval", {}).items() if k.endswith("spearman")][-1]
    sharding = next((line for line in done.stdout.splitlines() if line.startswith("sharding:")), "")
    if sharding:  # the version this run trained with (the default one, for "fsdp")
        version = json.loads(Path(out, "final", "training_config.json").read_text())["fsdp_version"]
        sharding = f"FSDP{version} {sharding}"
    return lines[-1]["samples_per_s"], spearman, sharding, others  # the trainer logs it x 100


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=os.path.join(REPO_DIR, "data"))
    parser.add_argument("--tasks", default="cosent,mnrl")
    parser.add_argument("--precisions", default="fp32")
    parser.add_argument("--strategies", default="ddp,fsdp2,fsdp2_full_shard")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    needed = [*FILES.values(), "stsb-dev.jsonl"]
    if not all((Path(args.data_dir) / f).is_file() for f in needed):
        parser.error(f"--data-dir must hold {', '.join(needed)}")
    work = Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    strategies = args.strategies.split(",")
    results = []
    print(
        "| task | precision | strategy | samples/s (by round) | ratio to DDP (by round) "
        "| STS-B dev Spearman | others' CPU (by round) |"
    )
    print("|---|---|---|---|---:|---:|---|")
    for task in args.tasks.split(","):
        for precision in args.precisions.split(","):
            runs = {s: [] for s in strategies}
            for round_ in range(args.rounds):
                for strategy in strategies if round_ % 2 == 0 else strategies[::-1]:
                    out = work / f"{task}-{precision}-{strategy}"
                    runs[strategy].append(train(task, precision, strategy, args, out))
            mean = {s: sum(r[0] for r in runs[s]) / len(runs[s]) for s in strategies}
            for strategy in strategies:
                speeds = ", ".join(f"{r[0]:.1f}" for r in runs[strategy])
                ratio = "-"
                if "ddp" in mean:
                    each = ", ".join(f"{r[0] / d[0]:.2f}" for r, d in zip(runs[strategy], runs["ddp"]))
                    ratio = f"{mean[strategy] / mean['ddp']:.2f} ({each})"
                spearman = runs[strategy][-1][1]
                others = ", ".join("-" if r[3] is None else f"{r[3]:.2f}" for r in runs[strategy])
                row = f"| {task} | {precision} | {strategy} | {mean[strategy]:.1f} ({speeds})"
                print(f"{row} | {ratio} | {spearman:.2f} | {others} |")
                if runs[strategy][-1][2]:
                    print(f"  {strategy}: {runs[strategy][-1][2]}", file=sys.stderr)
                row = {"task": task, "precision": precision, "strategy": strategy}
                results.append({**row, "runs": runs[strategy]})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
