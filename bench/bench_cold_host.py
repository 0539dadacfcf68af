"""Benchmark: does a host wait for another host's tokenizing? Two hosts, each with a data set cache
of its own, one warm (the Arrow conversion done, and a token file written by an earlier `--tokenize
once` run) and one cold (the Arrow conversion done, no token file).

Two hosts are made on this machine (tests/two_hosts.py: network + UTS namespaces joined by a veth
pair; one `torchrun --nnodes 2` per host, one process per host), each with its own
HF_DATASETS_CACHE. The full trainer (`-m fsdp_embed`) trains all-MiniLM-L6-v2 on --rows synthetic
pairs (bench_data_scale.write_pairs, Parquet), batch 32 per rank, max length 128, 2 steps.
Reported for the warm host's rank 0, from the trainer's summary: start-up seconds, and start-up
plus the 2 steps' seconds (the second step cannot end before the cold host has reached its first).
Three launches:
  - defaults (tokenized on the fly), the second host cold;
  - defaults, both hosts warm (the reference);
  - --tokenize once, the second host cold: it writes its token file before its first step, and
    the warm host waits for it at the first collective.

    python bench/bench_cold_host.py                 # as root; ~15 minutes on 2 CPU cores
    python bench/bench_cold_host.py --rows 200000
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR / "tests"))
sys.path.insert(0, str(REPO_DIR / "bench"))

import two_hosts  # noqa: E402
from bench_data_scale import write_pairs  # noqa: E402


def train_args(parquet, out, flags, steps=2):
    return [
        "-m", "fsdp_embed", "--train-data", str(parquet), "--max-steps", str(steps),
        "--per-device-batch-size", "32", "--max-seq-length", "128", "--log-steps", "1",
        "--output-dir", str(out), "--dist-timeout-minutes", "30", *flags,
    ]  # fmt: skip


def prepare(parquet, cache, flags, out):
    """A one-process run on this machine with `cache` as the data set cache: converts the data
    (and with --tokenize once writes the token file)."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    command = [sys.executable, *train_args(parquet, out, flags, steps=1)]
    subprocess.run(command, cwd=REPO_DIR, env=env, check=True, capture_output=True)


def launch(parquet, caches, flags, out, timeout):
    """The warm host's summary of one two-host launch."""
    with two_hosts.TwoHosts() as hosts:
        env = [{"HF_DATASETS_CACHE": str(cache)} for cache in caches]
        procs = hosts.torchrun(train_args(parquet, out, flags), nproc=1, env=env)
        codes, outputs, seconds = hosts.wait(procs, timeout=timeout)
    if codes != [0, 0]:
        sys.exit(f"the launch with {flags} failed: {codes}\n{outputs[0][1][-3000:]}\n{outputs[1][1][-3000:]}")
    with open(out / "metrics.jsonl") as f:
        summary = [json.loads(line) for line in f][-1]
    return {
        "startup_seconds": round(summary["startup_seconds"], 1),
        "to_step_2_seconds": round(summary["startup_seconds"] + summary["train_seconds"], 1),
        "wall_seconds": round(seconds, 1),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one launch may take")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    reason = two_hosts.why_not()
    if reason:
        sys.exit(f"error: cannot make two hosts here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="bench-cold-host-"))
    parquet = work / f"pairs-{args.rows}.parquet"
    write_pairs(parquet, args.rows)
    warm, cold = work / "cache-warm", work / "cache-cold"
    prepare(parquet, warm, ["--tokenize", "once"], work / "prepare-warm")  # Arrow and the token file
    prepare(parquet, cold, [], work / "prepare-cold")  # Arrow only
    results = {"rows": args.rows}
    launches = {
        "defaults, second host cold": ([warm, cold], []),
        "defaults, both warm": ([warm, warm], []),
        "--tokenize once, second host cold": ([warm, cold], ["--tokenize", "once"]),
    }
    for name, (caches, flags) in launches.items():
        results[name] = launch(
            parquet, caches, flags, work / name.replace(" ", "_").replace(",", ""), args.timeout
        )
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
