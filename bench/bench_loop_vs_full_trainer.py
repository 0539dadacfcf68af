"""Benchmark: the one-file loop (train.py) beside the full trainer (python -m fsdp_embed) on the
same run: what the full trainer's extra machinery buys in samples/s.

Three programs, each on the same command line (all-MiniLM-L6-v2, 2 processes, global batch 32,
lr 2e-5, 10% warm-up, max length 128, seed 12, --steps steps):
  loop:           train.py (one padded forward a micro-batch, texts tokenized as read);
  full_same:      python -m fsdp_embed with the flags of train.py's "python -m fsdp_embed flags
                  for the same path" line (the same computation: tests/test_train_loop.py proves
                  the same weights);
  full_default:   python -m fsdp_embed at its defaults (packed rows, ids tokenized once into a
                  file, the reader thread; FSDP2 under --strategy fsdp).
Tasks: mnrl (MultipleNegativesRanking on sick-pairs-train.jsonl) and cosent (CoSENT on
stsb-train.jsonl); strategies ddp and fsdp (loop and full_same: FSDP1; full_default: FSDP2,
--sharding auto). samples/s is each program's own summary (the training loop alone: evaluation
and the export left out); STS-B dev Spearman (x100) after the last step, as each evaluates it.
Each run --rounds times, the order turned round each round (this machine's speed drifts over
minutes); "others' CPU": cores other processes kept busy meanwhile (bench_fsdp_vs_ddp.py).
full_default's first round also writes its token file, before step 1, inside its training time.

Run (a quiet machine; about 15 minutes on 2 CPU cores with the defaults):
    python bench/bench_loop_vs_full_trainer.py
    python bench/bench_loop_vs_full_trainer.py --tasks mnrl --strategies ddp --steps 60
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_fsdp_vs_ddp import free_port, run_timed

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import train  # noqa: E402  (its docstring names the full trainer's flags for the same path)

FILES = {"mnrl": "sick-pairs-train.jsonl", "cosent": "stsb-train.jsonl"}
PROGRAMS = ("loop", "full_same", "full_default")


def same_path_flags(strategy):
    """python -m fsdp_embed's flags for the loop's path, as train.py's docstring gives them (a
    line that may wrap: "... same path: FLAGS (FSDP: FLAGS)")."""
    text = train.__doc__.split("python -m fsdp_embed flags for the same path:", 1)[1]
    flags, _, fsdp = text.partition("(FSDP:")
    return flags.split() + (fsdp.split(")", 1)[0].split() if strategy == "fsdp" else [])


def run(program, task, strategy, args, out):
    """(samples/s, STS-B dev Spearman x100, cores kept busy by other processes or None)."""
    program_args = [str(REPO_DIR / "train.py")] if program == "loop" else ["-m", "fsdp_embed"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", *program_args]
    command += ["--loss", task, "--train-data", str(REPO_DIR / "data" / FILES[task])]
    command += ["--eval-data", str(REPO_DIR / "data" / "stsb-dev.jsonl"), "--strategy", strategy]
    command += ["--max-steps", str(args.steps), "--per-device-batch-size", "16", "--max-seq-length", "128"]
    command += ["--lr", "2e-5", "--warmup-ratio", "0.1", "--seed", "12", "--output-dir", str(out)]
    if program == "full_same":
        command += same_path_flags(strategy)
    done, others = run_timed(command)
    if done.returncode != 0:
        sys.exit(f"error: {program} exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    spearman = [v for line in lines for k, v in line.get("eval", {}).items() if k.endswith("spearman")][-1]
    return lines[-1]["samples_per_s"], spearman, others


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="mnrl,cosent")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    results = []
    header = "| task | strategy | program | samples/s (by round) | ratio to the loop (by round) "
    print(header + "| STS-B dev Spearman | others' CPU |")
    print("|---|---|---|---|---:|---:|---|")
    for task in args.tasks.split(","):
        for strategy in args.strategies.split(","):
            runs = {p: [] for p in PROGRAMS}
            for round_ in range(args.rounds):
                for program in PROGRAMS if round_ % 2 == 0 else PROGRAMS[::-1]:
                    out = work / f"{task}-{strategy}-{program}-{round_}"
                    runs[program].append(run(program, task, strategy, args, out))
            mean = {p: sum(r[0] for r in runs[p]) / len(runs[p]) for p in PROGRAMS}
            for program in PROGRAMS:
                speeds = ", ".join(f"{r[0]:.1f}" for r in runs[program])
                each = ", ".join(f"{r[0] / m[0]:.2f}" for r, m in zip(runs[program], runs["loop"]))
                others = ", ".join("-" if r[2] is None else f"{r[2]:.2f}" for r in runs[program])
                row = f"| {task} | {strategy} | {program} | {mean[program]:.1f} ({speeds}) "
                ratio = f"{mean[program] / mean['loop']:.2f} ({each})"
                print(f"{row}| {ratio} | {runs[program][-1][1]:.2f} | {others} |")
                results.append(
                    {"task": task, "strategy": strategy, "program": program, "runs": runs[program]}
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
