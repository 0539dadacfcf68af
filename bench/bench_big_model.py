"""Benchmark: what each rank holds when the model is big ("Models that don't fit"): peak RSS per
rank in each phase of a run of the full trainer (load, training, export), and what activation
checkpointing saves.

Models, built here at random (no download) with a byte-level BPE tokenizer trained on the
training texts (EOS token, no special tokens added to a text, as decoder tokenizers behave):
  big:      Qwen2, hidden 1024, 18 layers, intermediate 2816, 16 heads / 4 KV heads, vocab 8000:
            211M parameters (806 MB in fp32), 96% of them in the repeated blocks;
  baseline: the same family, hidden 64, 2 layers: what torch, transformers, datasets and the
            trainer cost without weights, subtracted from the big model's numbers;
both saved with save_pretrained (safetensors, fp32) in the work folder, beside a JSON Lines file
of synthetic (anchor, positive) pairs.

1. Peak RSS per rank. The full trainer runs through torchrun, MNRL, --pooling lasttoken --append-eos,
   --max-steps 2, batch 2 per rank, --max-seq-length 64 (the synthetic texts are ~15 tokens, so
   batches are padded to ~20), FSDP2 full_shard at each --worlds size and DDP at world 2, for
   the big model and the baseline. Every run ends with its export (part of the run). From
   outside, every ~20 ms, the VmRSS of each rank process (torchrun's children, mapped to ranks
   through RANK in /proc/PID/environ) is sampled with a timestamp. The phases are cut by what
   rank 0 prints: the config JSON (printed just before the training loop) ends "load" (process
   start until training starts: loading, wrapping, the optimizer); the summary JSON (printed
   after the export) minus its export_seconds ends "train"; "export" runs from there to the
   process's exit. Each rank's lifetime VmHWM is read too: a sampled peak well under it means
   the sampling missed a spike; and RssFile, the part of RSS in pages of mapped files (the
   safetensors checkpoint is mapped, and the page cache shares those pages between ranks, so
   RSS summed over ranks overstates what the machine holds). Reported per configuration: each
   rank's peak per phase, the big model's minus the baseline's per phase, and that difference
   as a multiple of the big model's fp32 size (parameters x 4 bytes). Rank 0 writes the export
   (marked *).
   The issue's targets, at world 8, FSDP2: every other rank's (big - baseline) peak, in every
   phase, <= 0.8 x the fp32 size; rank 0's at most one export shard more (min of
   --export-max-shard-size, default 5GB, and the model in the export dtype).
   A world-8 run of the big model starts only with >= 20 GiB of memory available (else
   "skipped: not enough free memory"), and any run is stopped if available memory falls under
   1.5 GiB (recorded as "aborted").

2. Activation checkpointing: a 12-layer model of the same family (hidden 512, intermediate
   1408, 8 heads / 2 KV heads: head size 64 as in the big model; smaller for time), built by
   embedding_model.load_model exactly as the trainer builds it, with and without --activation-checkpointing,
   one forward of a batch of 8 x 512 random tokens, each in a fresh process. Activation
   memory, the number the target (>= 3x lower with it) is judged on: the bytes of the distinct
   storages saved for backward during that forward (torch.autograd.graph.saved_tensors_hooks;
   parameters excluded). Also, as a cross-check, the peak RSS of that first forward + backward
   minus the RSS before it (VmHWM reset through /proc/self/clear_refs; glibc told to return
   freed blocks >= 64 KiB at once, MALLOC_MMAP_THRESHOLD_, so RSS follows live memory); it
   includes the gradients (the model's size) and, with checkpointing, one block's recomputed
   activations. Time: CPU seconds of one forward + backward (no optimizer step: it costs the
   same either way) on one thread, in a third process: --ac-steps steps of each, alternating
   without and with it (transformers' gradient_checkpointing_disable / _enable on the same
   model) after a warm-up, the least of each; CPU time on one thread, because the wall time of
   a step on a machine that others use too varied by 3x. Wall seconds are recorded beside it.

MB in this file and its results are 2^20 bytes.

Run (CPU, gloo; about 8 minutes on 2 cores with the defaults, half of it the big model at world 8):
    python bench/bench_big_model.py
    python bench/bench_big_model.py --worlds 2,4 --skip-ac
    python bench/bench_big_model.py --only-ac
    python bench/bench_big_model.py --extra-args "--export-max-shard-size 300MB --export-dtype bf16" \
        --out bench/results/big_model_after.json
Results: a table printed at the end, and --out (default bench/results/big_model.json). The
work folder (models, data, run outputs) is --work-dir, a new folder under /tmp by default.
Left out: GPU memory, bf16 training, timing of the torchrun runs beyond the trainer's own summary.
"""

import argparse
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20
GIB = 2**30
# Qwen2 sizes. The big one's blocks hold 96% of its parameters, as in a real LLM embedder.
MODELS = {
    "big": dict(
        hidden_size=1024,
        num_hidden_layers=18,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    "baseline": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "ac": dict(
        hidden_size=512,
        num_hidden_layers=12,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}
VOCAB_SIZE = 8000  # the embedding rows; the tokenizer's own vocabulary is smaller (synthetic texts)
NUM_PAIRS = 4000
PHASES = ("load", "train", "export")
SAMPLE_EVERY_S = 0.02
MIN_AVAILABLE_FOR_WORLD_8 = 20 * GIB  # the brief's rule for a world-8 run of the big model
ABORT_BELOW_AVAILABLE = int(1.5 * GIB)  # stop a run before it can exhaust RAM (other work shares the machine)
TARGET_MULTIPLE = (
    0.8  # the target, at world 8: a non-writing rank's peak - baseline <= 0.8 x fp32 size
)


# ----------------------------------------------------------------------------------------------
# The work folder: synthetic pairs, a tokenizer trained on them, the random models


WORDS = {
    "subject": (
        "the engineer|a small dog|my neighbour|the committee|an old sailor|the children|a young doctor|"
        "the city council|our teacher|the pilot|a tired farmer|the orchestra|the new manager|"
        "a quiet student|the baker|two cyclists"
    ).split("|"),
    "verb": (
        "repaired|painted|visited|described|carried|ignored|photographed|cleaned|measured|discussed|"
        "ordered|found|sold|borrowed|studied|watched"
    ).split("|"),
    "object": (
        "the broken bridge|a wooden boat|the red kitchen|an empty warehouse|the mountain road|"
        "a strange letter|the garden fence|the museum roof|a heavy suitcase|the river bank|"
        "an electric guitar|the village church|a paper map|the train station"
    ).split("|"),
    "when": (
        "on monday|after the storm|before sunrise|in the spring|late at night|during the festival|"
        "last winter|yesterday afternoon|every weekend|at noon"
    ).split("|"),
    "why": (
        "because it was needed|for the first time|without any help|as a surprise|with great care|"
        "in a hurry|for a small fee|to everyone's relief"
    ).split("|"),
}
SYNONYMS = {
    "repaired": "fixed",
    "painted": "coloured",
    "visited": "went to see",
    "described": "explained",
    "carried": "moved",
    "ignored": "paid no attention to",
    "cleaned": "washed",
    "discussed": "talked about",
    "found": "discovered",
    "sold": "got rid of",
    "studied": "examined",
    "watched": "observed",
    "a small dog": "a little puppy",
    "the children": "the kids",
    "in a hurry": "quickly",
    "with great care": "carefully",
    "yesterday afternoon": "the day before, after lunch",
}


def synthetic_pairs(num_pairs, seed=0):
    """(anchor, positive) rows: a sentence, and the same event told with other words and order."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_pairs):
        s, v, o, w, y = (rng.choice(WORDS[k]) for k in ("subject", "verb", "object", "when", "why"))
        anchor = f"{s.capitalize()} {v} {o} {w} {y}."
        swap = lambda text: SYNONYMS.get(text, text)  # noqa: E731
        positive = (
            f"{w.capitalize()}, {swap(s)} {swap(v)} {o} {swap(y)}."
            if rng.random() < 0.5
            else f"{o.capitalize()} was {swap(v)} by {s} {w}."
        )
        rows.append({"anchor": anchor, "positive": positive})
    return rows


def build_tokenizer(texts, folder):
    """A byte-level BPE tokenizer trained here (as tests/conftest.py's tiny_decoder builds one): an
    EOS token, also the pad token, and no special tokens added to a text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
    )
    fast.save_pretrained(folder)
    return fast


def build_model(folder, sizes, texts):
    """A random Qwen2 model saved at `folder` (safetensors, fp32) with its tokenizer; returns
    (parameters, fraction of them inside the repeated blocks)."""
    import torch
    import transformers

    tokenizer = build_tokenizer(texts, folder)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=max(VOCAB_SIZE, len(tokenizer)), max_position_embeddings=1024, **sizes
    )
    model = transformers.Qwen2Model(config)
    transformers.logging.disable_progress_bar()
    model.save_pretrained(folder)
    num_params = sum(p.numel() for p in model.parameters())
    return num_params, sum(p.numel() for p in model.layers.parameters()) / num_params


def prepare_work_dir(work_dir, which):
    """The data file and the models in `which`; returns (data path, {name: model info})."""
    os.makedirs(work_dir, exist_ok=True)
    rows = synthetic_pairs(NUM_PAIRS)
    data_path = os.path.join(work_dir, "pairs.jsonl")
    with open(data_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    texts = [r[c] for r in rows for c in ("anchor", "positive")]
    models = {}
    for name in which:
        folder = os.path.join(work_dir, f"qwen2-{name}")
        started = time.perf_counter()
        num_params, in_blocks = build_model(folder, MODELS[name], texts)
        models[name] = {
            "path": folder,
            "sizes": MODELS[name],
            "vocab_size": VOCAB_SIZE,
            "num_params": num_params,
            "fp32_bytes": 4 * num_params,
            "fraction_in_blocks": in_blocks,
        }
        print(
            f"built {name}: {num_params / 1e6:.1f}M parameters ({4 * num_params / 1e9:.2f} GB fp32, "
            f"{100 * in_blocks:.0f}% in blocks) in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
    return data_path, models


# ----------------------------------------------------------------------------------------------
# One run of the full trainer under torchrun, its ranks' RSS sampled from outside


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def proc_status_kb(pid, keys=("VmRSS", "VmHWM", "RssFile")):
    """{key: kB} from /proc/PID/status; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            values[name] = int(rest.split()[0])
    return values if len(values) == len(keys) else None  # a zombie has no Vm* lines


def children(pid):
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def rank_of(pid):
    """RANK from the process's environment; None until it has exec'd into the worker (between
    fork and exec it still shows torchrun's environment, which has no RANK)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().split(b"\0")
        # A worker runs `python -u -m fsdp_embed ...`; the agent `python -m torch.distributed.run ...`
        is_worker = b"-m" in command and command[command.index(b"-m") + 1] == b"fsdp_embed"
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return int(env[b"RANK"]) if is_worker and b"RANK" in env else None


class RankSampler(threading.Thread):
    """Every SAMPLE_EVERY_S: VmRSS and RssFile (its file-backed part: pages of mapped files,
    such as the safetensors checkpoint, which the page cache shares between ranks) of each rank
    process of one torchrun, with a timestamp (time.monotonic); each rank's last seen VmHWM;
    stops the run if memory runs low."""

    def __init__(self, launcher):
        super().__init__(daemon=True)
        self.launcher = launcher
        self.pids = {}  # pid -> rank
        self.samples = {}  # rank -> [(t, rss kB)]
        self.hwm_kb = {}
        self.min_available = mem_available()
        self.aborted = None
        self.stop = threading.Event()

    def run(self):
        next_check = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            for pid in children(self.launcher.pid):
                if pid not in self.pids and (rank := rank_of(pid)) is not None:
                    self.pids[pid] = rank
            for pid, rank in self.pids.items():
                status = proc_status_kb(pid)
                if status:
                    self.samples.setdefault(rank, []).append((now, status["VmRSS"], status["RssFile"]))
                    self.hwm_kb[rank] = status["VmHWM"]
            if now >= next_check:  # /proc/meminfo is the costlier read: every 0.1 s
                available = mem_available()
                self.min_available = min(self.min_available, available)
                if available < ABORT_BELOW_AVAILABLE and self.aborted is None:
                    self.aborted = f"aborted: available memory fell to {available / GIB:.1f} GiB"
                    os.killpg(
                        self.launcher.pid, signal.SIGKILL
                    )  # the torchrun this script started, and its ranks
                next_check = now + 0.1
            time.sleep(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - now)))


def read_lines(stream, lines):
    """(monotonic time, line) for every line of the stream, as it arrives."""
    for line in stream:
        lines.append((time.monotonic(), line.rstrip("\n")))


def phase_marks(stdout_lines):
    """(time training starts, time training ends, summary) from rank 0's output: the config JSON
    is printed (flushed) just before the training loop; the summary JSON after the export,
    which took summary["export_seconds"]."""
    t_config = summary = t_summary = None
    for t, line in stdout_lines:
        if line == "{" and t_config is None:
            t_config = t
        elif line.startswith('{"final_loss"'):
            t_summary, summary = t, json.loads(line)
    if t_config is None or summary is None:
        return None
    return t_config, t_summary - summary["export_seconds"], summary


def run_measured(model_dir, data_path, out_dir, world, strategy, args):
    """The full trainer under torchrun at `world`, sampled; returns the run's record."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "fsdp_embed",
        "--model",
        model_dir,
        "--train-data",
        data_path,
        "--loss",
        "mnrl",
        "--pooling",
        "lasttoken",
        "--append-eos",
        "--max-steps",
        str(args.steps),
        "--per-device-batch-size",
        str(args.per_device_batch_size),
        "--max-seq-length",
        str(args.max_seq_length),
        "--log-steps",
        "1",
        "--output-dir",
        out_dir,
        "--overwrite",
        "--dist-timeout-minutes",
        "15",
    ]
    cmd += (
        ["--strategy", "ddp"]
        if strategy == "ddp"
        else ["--strategy", "fsdp", "--fsdp-version", "2", "--sharding", "full_shard"]
    )
    cmd += shlex.split(args.extra_args)
    # Unbuffered: the phase marks are the times rank 0's lines arrive. A new session, so that a
    # run can be stopped (low memory) with everything it started, and nothing else.
    launcher = subprocess.Popen(
        cmd,
        cwd=REPO_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    sampler = RankSampler(launcher)
    sampler.start()
    stdout_lines, stderr_lines = [], []
    readers = [
        threading.Thread(target=read_lines, args=(launcher.stdout, stdout_lines), daemon=True),
        threading.Thread(target=read_lines, args=(launcher.stderr, stderr_lines), daemon=True),
    ]
    for r in readers:
        r.start()
    started = time.monotonic()
    launcher.wait()
    for r in readers:
        r.join()
    sampler.stop.set()
    sampler.join()
    record = {
        "world": world,
        "strategy": "fsdp2" if strategy == "fsdp" else "ddp",
        "command": shlex.join(cmd[cmd.index("--model") :]),
        "wall_seconds": time.monotonic() - started,
        "min_available_gib": sampler.min_available / GIB,
    }
    marks = phase_marks(stdout_lines)
    if sampler.aborted or launcher.returncode != 0 or marks is None:
        tail = "\n".join(line for _, line in stderr_lines[-15:])
        record["status"] = sampler.aborted or f"failed (exit {launcher.returncode})"
        record["stderr_tail"] = tail
        print(f"{record['status']}:\n{tail}", file=sys.stderr, flush=True)
        return record
    t_train, t_train_end, summary = marks
    peaks, file_peaks = {}, {}
    windows = {
        "load": (float("-inf"), t_train),
        "train": (t_train, t_train_end),
        "export": (t_train_end, float("inf")),
    }
    for rank, samples in sorted(sampler.samples.items()):
        peaks[str(rank)] = {
            phase: max((rss for t, rss, _ in samples if lo <= t < hi), default=0) / 1024
            for phase, (lo, hi) in windows.items()
        }
        file_peaks[str(rank)] = {
            phase: max((f for t, _, f in samples if lo <= t < hi), default=0) / 1024
            for phase, (lo, hi) in windows.items()
        }
    record.update(
        status="ok",
        writer_rank=0,
        num_samples={str(r): len(s) for r, s in sampler.samples.items()},
        peak_rss_mb=peaks,
        peak_rss_file_mb=file_peaks,
        vmhwm_mb={str(r): kb / 1024 for r, kb in sorted(sampler.hwm_kb.items())},
        seconds={
            "load": t_train - min(s[0][0] for s in sampler.samples.values()),
            "train": summary["train_seconds"],
            "export": summary["export_seconds"],
        },
        final_loss=summary["final_loss"],
    )
    missing = set(range(world)) - set(sampler.samples)
    assert not missing, f"ranks {sorted(missing)} were never sampled"
    return record


def enough_memory(name, world):
    """The brief's rule: a world-8 (or larger) run of the big model needs >= 20 GiB available."""
    if name != "big" or world < 8:
        return None
    available = mem_available()
    if available < MIN_AVAILABLE_FOR_WORLD_8:
        return (
            f"skipped: not enough free memory ({available / GIB:.1f} GiB available, "
            f"{MIN_AVAILABLE_FOR_WORLD_8 / GIB:.0f} needed)"
        )
    return None


# ----------------------------------------------------------------------------------------------
# Activation checkpointing: one forward of 8 x 512 tokens, saved-for-backward bytes and RSS


def rss_kb(key="VmRSS"):
    return proc_status_kb(os.getpid())[key]


def ac_worker(args):
    """In a fresh process: the AC model built by embedding_model.load_model. Modes "off" and "on": one
    forward + backward without or with --activation-checkpointing, its memory measured; mode
    "time": built with it, then steps alternating without and with it (the switch transformers
    offers: gradient_checkpointing_disable / _enable), on one thread, timed in wall and CPU
    seconds, so that load from other work on the machine falls on both alike. Prints one
    RESULT line."""
    import torch

    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import config
    from fsdp_embed import embedding_model
    from fsdp_embed import run_plan

    flags = [
        "--model",
        args.ac_model,
        "--train-data",
        args.ac_data,
        "--loss",
        "mnrl",
        "--pooling",
        "lasttoken",
        "--append-eos",
        "--max-seq-length",
        str(args.ac_seq_len),
    ] + (["--activation-checkpointing"] if args.ac_worker != "off" else [])
    cfg = config.parse_config(flags)
    torch.manual_seed(0)
    plan = run_plan.resolve_flags(cfg, 1, torch.device("cpu"))
    model = embedding_model.load_model(plan.model).model  # train mode, checkpointing on, as the trainer
    encoder = model.encoder
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(
        0, encoder.config.vocab_size, (args.ac_batch, args.ac_seq_len), generator=generator
    )
    attention_mask = torch.ones_like(input_ids)

    def step():
        """(wall seconds, CPU seconds of this process) of one forward + backward."""
        started, started_cpu = time.perf_counter(), time.process_time()
        model(input_ids=input_ids, attention_mask=attention_mask).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started, time.process_time() - started_cpu

    if args.ac_worker == "time":
        # One thread: its CPU time is the step's work, whatever else the machine runs (with two,
        # a thread waiting for one that another process holds spins, and counts).
        torch.set_num_threads(1)
        seconds = {False: [], True: []}
        # A module inside the first block counts its forwards: twice a step only if checkpointing is
        # on. A pre-hook: the recomputation stops once the last saved tensor is back, before the
        # block's last module returns, so its forward hook would not run a second time.
        mlp_calls = []
        encoder.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
        encoder.gradient_checkpointing_disable()
        step()  # warm-up, not counted
        for i in range(args.ac_steps):
            for checkpointing in (False, True) if i % 2 == 0 else (True, False):
                if checkpointing:
                    encoder.gradient_checkpointing_enable(
                        gradient_checkpointing_kwargs={"use_reentrant": False}
                    )  # as load_model does
                else:
                    encoder.gradient_checkpointing_disable()
                calls_before = len(mlp_calls)
                seconds[checkpointing].append(step())
                assert len(mlp_calls) - calls_before == (2 if checkpointing else 1), (
                    checkpointing,
                    len(mlp_calls) - calls_before,
                )
        print(
            "RESULT "
            + json.dumps(
                {
                    "off_wall_seconds": [w for w, _ in seconds[False]],
                    "off_cpu_seconds": [c for _, c in seconds[False]],
                    "on_wall_seconds": [w for w, _ in seconds[True]],
                    "on_cpu_seconds": [c for _, c in seconds[True]],
                    "torch_threads": torch.get_num_threads(),
                }
            ),
            flush=True,
        )
        return

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # storage address -> bytes: a tensor saved by several ops, or views of one, count once

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.nbytes() > 0:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    # The first step of the process: nothing has been allocated for activations before it.
    rss_before = rss_kb()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        emb_BD = model(input_ids=input_ids, attention_mask=attention_mask)
    rss_after_forward = rss_kb()
    emb_BD.pow(2).mean().backward()
    peak = rss_kb("VmHWM")
    num_params = sum(p.numel() for p in model.parameters())
    print(
        "RESULT "
        + json.dumps(
            {
                "activation_checkpointing": args.ac_worker == "on",
                "saved_for_backward_mb": sum(saved.values()) / MB,
                "num_saved_storages": len(saved),
                "rss_forward_delta_mb": (rss_after_forward - rss_before) / 1024,
                "rss_step_peak_delta_mb": (peak - rss_before) / 1024,
                "grads_mb": 4 * num_params / MB,
                "num_params": num_params,
                "attn_implementation": encoder.config._attn_implementation,
            }
        ),
        flush=True,
    )


def run_ac_worker(mode, model_info, data_path, args, env=None):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--ac-worker",
        mode,
        "--ac-model",
        model_info["path"],
        "--ac-data",
        data_path,
        "--ac-steps",
        str(args.ac_steps),
        "--ac-batch",
        str(args.ac_batch),
        "--ac-seq-len",
        str(args.ac_seq_len),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO_DIR, env={**os.environ, **(env or {})}
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"activation-checkpointing worker ({mode}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[0][len("RESULT ") :])
    print(f"activation checkpointing, {mode}: {json.dumps(result)}", flush=True)
    return result


def measure_ac(model_info, data_path, args):
    # Memory: freed blocks of >= 64 KiB go back to the system at once, so RSS follows live
    # tensors. Not for the timing: mapping every block afresh would slow both modes.
    off, on = (
        run_ac_worker(mode, model_info, data_path, args, {"MALLOC_MMAP_THRESHOLD_": "65536"})
        for mode in ("off", "on")
    )
    timing = run_ac_worker("time", model_info, data_path, args)
    for mode, result in (("off", off), ("on", on)):
        result["cpu_s_per_step"] = min(timing[f"{mode}_cpu_seconds"])  # the least disturbed step
        result["wall_s_per_step"] = min(timing[f"{mode}_wall_seconds"])
    return {
        "model": {k: v for k, v in model_info.items() if k != "path"},
        "batch": args.ac_batch,
        "seq_len": args.ac_seq_len,
        "measure": (
            "bytes of distinct non-parameter storages saved for backward during one forward "
            "(saved_tensors_hooks); cross-check: peak RSS of the first forward+backward minus RSS before it; "
            "time: CPU seconds of one forward+backward on one thread, the least of --ac-steps steps "
            "alternating without/with in one process"
        ),
        "off": off,
        "on": on,
        "timing": timing,
        "saved_ratio": off["saved_for_backward_mb"] / on["saved_for_backward_mb"],
        "rss_peak_ratio": off["rss_step_peak_delta_mb"] / max(on["rss_step_peak_delta_mb"], 1e-9),
        "time_ratio": on["cpu_s_per_step"] / off["cpu_s_per_step"],
        "target_met": off["saved_for_backward_mb"] / on["saved_for_backward_mb"] >= 3,
    }


# ----------------------------------------------------------------------------------------------
# Big minus baseline, the targets, the table


def size_bytes(text):
    """'5GB' -> 5e9, '300MB' -> 3e8, '2GiB' -> 2 x 2^30 (transformers' max_shard_size convention)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 300MB or 5GB")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def export_shard_bytes(extra_args, num_params):
    """One export shard as the extra arguments set it: the whole model in the export dtype, at
    most --export-max-shard-size (default 5GB)."""
    tokens = shlex.split(extra_args)

    def option(name, default):
        return next(
            (
                t.split("=", 1)[1] if "=" in t else tokens[i + 1]
                for i, t in enumerate(tokens)
                if t == name or t.startswith(name + "=")
            ),
            default,
        )

    bytes_per_param = 2 if option("--export-dtype", "fp32") in ("bf16", "fp16", "bfloat16", "float16") else 4
    return min(size_bytes(option("--export-max-shard-size", "5GB")), bytes_per_param * num_params)


def compare(runs, big, extra_args):
    """Per configuration run for both models: big - baseline per rank and phase, in MB and as a
    multiple of the big model's fp32 size; and whether the issue's targets hold."""
    fp32_mb = big["fp32_bytes"] / MB
    shard_mb = export_shard_bytes(extra_args, big["num_params"]) / MB
    by_key = {(r["model"], r["strategy"], r["world"]): r for r in runs}
    comparisons = []
    for (name, strategy, world), run in by_key.items():
        base = by_key.get(("baseline", strategy, world))
        if name != "big":
            continue
        row = {"strategy": strategy, "world": world, "status": run["status"]}
        if run["status"] != "ok" or base is None or base["status"] != "ok":
            row["status"] = run["status"] if run["status"] != "ok" else "no baseline run"
            comparisons.append(row)
            continue
        diff = {
            rank: {p: run["peak_rss_mb"][rank][p] - base["peak_rss_mb"][rank][p] for p in PHASES}
            for rank in run["peak_rss_mb"]
        }
        worst = {rank: max(d.values()) for rank, d in diff.items()}
        others = [w for rank, w in worst.items() if rank != str(run["writer_rank"])]
        writer = worst[str(run["writer_rank"])]
        row.update(
            diff_mb=diff,
            diff_x_fp32={rank: {p: v / fp32_mb for p, v in d.items()} for rank, d in diff.items()},
            max_other_rank_x_fp32=max(others) / fp32_mb if others else None,
            writer_x_fp32=writer / fp32_mb,
            other_ranks_target_met=max(others) <= TARGET_MULTIPLE * fp32_mb if others else None,
            writer_target_met=writer <= TARGET_MULTIPLE * fp32_mb + shard_mb,
        )
        comparisons.append(row)
    targets = {
        "rule": f"world 8, FSDP2: every non-writing rank's peak - baseline <= {TARGET_MULTIPLE} x fp32 size "
        f"({TARGET_MULTIPLE * fp32_mb:.0f} MB); the writer <= that + one export shard ({shard_mb:.0f} MB)",
        "fp32_size_mb": fp32_mb,
        "export_shard_mb": shard_mb,
    }
    at_8 = next((c for c in comparisons if c["strategy"] == "fsdp2" and c["world"] == 8), None)
    if at_8 is None or at_8["status"] != "ok":
        targets["met"] = f"not measured ({at_8['status'] if at_8 else 'world 8 not in --worlds'})"
    else:
        targets["met"] = bool(at_8["other_ranks_target_met"] and at_8["writer_target_met"])
        targets.update(other_ranks_met=at_8["other_ranks_target_met"], writer_met=at_8["writer_target_met"])
    return comparisons, targets


def print_tables(results):
    big = results["models"].get("big")
    print(
        f"\n{results['machine']}; torch {results['torch']}, transformers {results['transformers']}; "
        f"{results['seconds'] / 60:.1f} min in all"
    )
    if big:
        print(
            f"big: {big['num_params'] / 1e6:.1f}M parameters, fp32 size {big['fp32_bytes'] / MB:.0f} MB; "
            f"{results['settings']['steps']} steps, "
            f"batch {results['settings']['per_device_batch_size']} per rank, "
            f"max length {results['settings']['max_seq_length']}; "
            f"extra args: {results['settings']['extra_args'] or '(none)'}\n"
        )
        print("Peak RSS per rank (MB), load / train / export; * = rank 0, which writes the export")
        print(
            "| model | strategy | world | rank | load | train | export | VmHWM | file-backed, max "
            "| big - baseline: load / train / export (MB) | x fp32 size |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        comparisons = {(c["strategy"], c["world"]): c for c in results["comparisons"]}
        for run in results["runs"]:
            if run["status"] != "ok":
                print(
                    f"| {run['model']} | {run['strategy']} | {run['world']} | - | {run['status']} "
                    "| | | | | | |"
                )
                continue
            for rank, peaks in run["peak_rss_mb"].items():
                c = comparisons.get((run["strategy"], run["world"])) if run["model"] == "big" else None
                diff = (
                    " / ".join(f"{c['diff_mb'][rank][p]:.0f}" for p in PHASES) if c and "diff_mb" in c else ""
                )
                mult = (
                    " / ".join(f"{c['diff_x_fp32'][rank][p]:.2f}" for p in PHASES)
                    if c and "diff_x_fp32" in c
                    else ""
                )
                star = "*" if rank == str(run["writer_rank"]) else ""
                print(
                    f"| {run['model']} | {run['strategy']} | {run['world']} | {rank}{star} "
                    f"| {peaks['load']:.0f} | {peaks['train']:.0f} | {peaks['export']:.0f} "
                    f"| {run['vmhwm_mb'][rank]:.0f} | {max(run['peak_rss_file_mb'][rank].values()):.0f} "
                    f"| {diff} | {mult} |"
                )
        print(
            "\nPer configuration: the largest (big - baseline) over phases, as a multiple of the fp32 size; "
            "seconds (big model)"
        )
        print(
            "| strategy | world | other ranks, max | writer (rank 0) | load s | train s | export s | wall s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        runs = {(r["model"], r["strategy"], r["world"]): r for r in results["runs"]}
        for c in results["comparisons"]:
            if "diff_mb" not in c:
                print(f"| {c['strategy']} | {c['world']} | {c['status']} | | | | | |")
                continue
            s = runs[("big", c["strategy"], c["world"])]["seconds"]
            other = f"{c['max_other_rank_x_fp32']:.2f}" if c["max_other_rank_x_fp32"] is not None else "-"
            print(
                f"| {c['strategy']} | {c['world']} | {other} | {c['writer_x_fp32']:.2f} "
                f"| {s['load']:.0f} | {s['train']:.0f} | {s['export']:.0f} "
                f"| {runs[('big', c['strategy'], c['world'])]['wall_seconds']:.0f} |"
            )
        t = results["targets"]
        print(f"\nTarget ({t['rule']}): {t['met']}")
    ac = results.get("activation_checkpointing")
    if ac:
        off, on = ac["off"], ac["on"]
        print(
            f"\nActivation checkpointing: {ac['model']['num_params'] / 1e6:.1f}M-parameter Qwen2 "
            f"({ac['model']['sizes']['num_hidden_layers']} layers, "
            f"hidden {ac['model']['sizes']['hidden_size']}), "
            f"one forward of {ac['batch']} x {ac['seq_len']} tokens, {off['attn_implementation']} attention, "
            f"timed on {ac['timing']['torch_threads']} thread"
        )
        print(
            "| | saved for backward (MB) | RSS after forward - before (MB) "
            "| RSS peak of fwd+bwd - before (MB) | CPU s per fwd+bwd | wall s |"
        )
        print("|---|---|---|---|---|---|")
        for label, r in (("without", off), ("with", on)):
            print(
                f"| {label} | {r['saved_for_backward_mb']:.0f} | {r['rss_forward_delta_mb']:.0f} "
                f"| {r['rss_step_peak_delta_mb']:.0f} | {r['cpu_s_per_step']:.2f} "
                f"| {r['wall_s_per_step']:.2f} |"
            )
        print(
            f"saved for backward {ac['saved_ratio']:.1f}x lower with it "
            f"(target >= 3x: {'met' if ac['target_met'] else 'not met'}); "
            f"RSS peak delta {ac['rss_peak_ratio']:.1f}x lower "
            f"(includes {off['grads_mb']:.0f} MB of gradients); "
            f"CPU time per step {ac['time_ratio']:.2f}x"
        )


# ----------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", default="2,4,8", help="FSDP2 world sizes (DDP runs at world 2)")
    parser.add_argument("--skip-ac", action="store_true", help="leave out the activation-checkpointing part")
    parser.add_argument("--only-ac", action="store_true", help="only the activation-checkpointing part")
    parser.add_argument(
        "--extra-args",
        default="",
        help='passed to every run of the trainer, e.g. "--export-max-shard-size 300MB --export-dtype bf16" '
        "(one flag alone: --extra-args=--flag)",
    )
    parser.add_argument("--out", default=os.path.join(REPO_DIR, "bench", "results", "big_model.json"))
    parser.add_argument(
        "--work-dir", default="", help="models, data and run outputs; default: a new folder under /tmp"
    )
    parser.add_argument(
        "--keep-work-dir", action="store_true", help="do not remove the work folder at the end"
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run of the trainer")
    parser.add_argument("--per-device-batch-size", type=int, default=2)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument(
        "--ac-steps",
        type=int,
        default=2,
        help="timed forward+backward steps per mode (alternating, after a warm-up)",
    )
    parser.add_argument("--ac-batch", type=int, default=8)
    parser.add_argument("--ac-seq-len", type=int, default=512)
    parser.add_argument("--ac-worker", choices=("on", "off", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--ac-model", help=argparse.SUPPRESS)
    parser.add_argument("--ac-data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ac_worker:
        return ac_worker(args)
    if args.skip_ac and args.only_ac:
        parser.error("--skip-ac and --only-ac together leave nothing to run")

    import torch
    import transformers

    started = time.time()
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench-big-model-", dir="/tmp")
    print(f"work folder: {work_dir}", flush=True)
    which = ([] if args.only_ac else ["big", "baseline"]) + ([] if args.skip_ac else ["ac"])
    data_path, models = prepare_work_dir(work_dir, which)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB RAM",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": {
            "steps": args.steps,
            "per_device_batch_size": args.per_device_batch_size,
            "max_seq_length": args.max_seq_length,
            "extra_args": args.extra_args,
            "sample_every_s": SAMPLE_EVERY_S,
            "data": f"{NUM_PAIRS} synthetic pairs",
        },
        "models": {name: {k: v for k, v in info.items() if k != "path"} for name, info in models.items()},
        "runs": [],
        "comparisons": [],
        "targets": {},
    }
    out_path = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)

    def save():
        results["seconds"] = time.time() - started
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)

    if not args.only_ac:
        worlds = [int(w) for w in args.worlds.split(",")]
        configs = [("fsdp", w) for w in worlds] + [("ddp", 2)]
        for name in ("baseline", "big"):  # the baseline first: cheap, and it shows a broken setup early
            for strategy, world in configs:
                skipped = enough_memory(name, world)
                if skipped:
                    record = {
                        "world": world,
                        "strategy": "fsdp2" if strategy == "fsdp" else "ddp",
                        "status": skipped,
                    }
                else:
                    print(
                        f"{name} {strategy} world {world}: running "
                        f"({mem_available() / GIB:.1f} GiB available)",
                        flush=True,
                    )
                    out_dir = os.path.join(work_dir, f"run-{name}-{strategy}-{world}")
                    record = run_measured(models[name]["path"], data_path, out_dir, world, strategy, args)
                    shutil.rmtree(out_dir, ignore_errors=True)  # the big model's export is 0.8 GB
                results["runs"].append({"model": name, **record})
                peaks = {
                    r: "/".join(f"{v:.0f}" for v in p.values())
                    for r, p in record.get("peak_rss_mb", {}).items()
                }
                print(
                    f"{name} {record['strategy']} world {world}: {record['status']} {peaks} "
                    f"{record.get('wall_seconds', 0):.0f} s",
                    flush=True,
                )
                save()
        results["comparisons"], results["targets"] = compare(results["runs"], models["big"], args.extra_args)
        save()
    if not args.skip_ac:
        results["activation_checkpointing"] = measure_ac(models["ac"], data_path, args)
        save()
    print_tables(results)
    print(f"\nwrote {out_path}")
    if not args.keep_work_dir and not args.work_dir:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
