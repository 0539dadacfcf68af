"""Benchmark: what each part of the LLM-embedder recipe costs in throughput (EmbeddingGemma's
layout: a Gemma3 decoder, mean pooling, two Dense layers, Normalize), one feature added a row.

The model is a tiny random EmbeddingGemma-shaped SentenceTransformer folder built here: a
Gemma3TextModel (2 layers, 64 wide, a sliding window wider than any text) with a byte-level BPE
tokenizer trained on STS-B's sentences (an EOS token, left padding, as tests/conftest.py's
tiny_decoder), then Transformer(max_seq_length=64) -> Pooling(mean) -> Dense(64 -> 256, no bias,
Identity) -> Dense(256 -> 64, no bias, Identity) -> Normalize (EmbeddingGemma-300m: 768 -> 3072 ->
768), and the same folder without the Dense modules. The full trainer trains it with MNRL on
sick-pairs-train.jsonl for --steps steps, dropout 0, no checkpoints, no evaluation:
  a  causal, no Dense, no prompts (one process)
  b  + the Dense layers
  c  + prompts on both columns (EmbeddingGemma's retrieval prompts)
  d  + --no-include-prompt (pooling leaves the prompts' tokens out)
  e  + --bidirectional
  f  + --lora-rank 8 (adapters on the decoder; the Dense layers trained in full)
  g  the whole recipe (f) at 2 processes: --strategy fsdp (FSDP2), --gather-negatives, 8 rows a
     rank (the same global batch of 16)
samples/s is the trainer's own summary (the training loop only, start-up and export left out).
Each configuration runs --rounds times, the order turned round each round (this machine's
speed drifts over minutes); the table gives the mean, each round's value, the ratio of the means
to (a) and to the row above, and "others' CPU": how many cores processes other than the run's own
kept busy while it ran (from /proc/stat, less the run's own CPU time; Linux only), a round with
more than ~0.2 was not measured on a quiet machine.

A model this small measures the recipe's overheads (prompt tokens, the pool mask, the Dense
layers, the bidirectional mask's construction, LoRA's extra matmuls, FSDP's collectives over
gloo), not a 300M model's compute.

Run (about 4.5 minutes on 2 CPU cores with the defaults):
    python bench/bench_llm_recipe.py                       # writes bench/results/llm_recipe.json
    python bench/bench_llm_recipe.py --data-dir DATA       # another copy of data/
    python bench/bench_llm_recipe.py --configs a,b,e --rounds 1 --json ''
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# a free port for torchrun; a run and the CPU other processes used meanwhile (others' CPU)
from bench_fsdp_vs_ddp import free_port, run_timed

REPO_DIR = Path(__file__).resolve().parents[1]
PROMPTS = {"anchor": "task: search result | query: ", "positive": "title: none | text: "}
# The whole recipe's flags; each configuration adds one more of them to the one before it.
RECIPE = ["--prompts", json.dumps(PROMPTS), "--no-include-prompt", "--bidirectional", "--lora-rank", "8"]
CONFIGS = {  # name: (what it adds, which folder, its flags)
    "a": ("causal, no Dense, no prompts", "plain", []),
    "b": ("+ Dense (64 -> 256 -> 64)", "dense", []),
    "c": ("+ prompts", "dense", RECIPE[:2]),
    "d": ("+ --no-include-prompt", "dense", RECIPE[:3]),
    "e": ("+ --bidirectional", "dense", RECIPE[:4]),
    "f": ("+ --lora-rank 8", "dense", RECIPE),
    "g": (
        "the recipe (f), 2 processes, FSDP2, --gather-negatives",
        "dense",
        [*RECIPE, "--strategy", "fsdp", "--fsdp-version", "2", "--gather-negatives"],
    ),
}
NUM_PROCESSES = {"g": 2}


def build_models(work, data_dir):
    """{"plain": folder, "dense": folder}: the tiny EmbeddingGemma-shaped SentenceTransformer
    folders, without and with the two Dense layers; the tokenizer learns from STS-B's sentences."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers.logging.disable_progress_bar()
    with open(Path(data_dir) / "stsb-train.jsonl") as f:
        sentences = [json.loads(line)["sentence1"] for line in f][:2000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        sentences,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
    )
    base = Path(work) / "gemma3"
    fast.save_pretrained(base)
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        sliding_window=256,  # wider than any text: the window never cuts
    )
    transformers.Gemma3TextModel(config).save_pretrained(base)
    folders = {}
    for name, widths in (("plain", []), ("dense", [(64, 256), (256, 64)])):
        torch.manual_seed(0)
        modules = [Transformer(str(base), max_seq_length=64), Pooling(64, pooling_mode="mean")]
        modules += [Dense(i, o, bias=False, activation_function=torch.nn.Identity()) for i, o in widths]
        folders[name] = str(Path(work) / f"st-{name}")
        SentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(folders[name])
    return folders


def train(name, folders, args, out):
    """(samples/s, cores kept busy by other processes during the run or None, the log's lines
    that say how it embeds: "forwards: ...", "sharding: ...") of configuration `name`; exits with
    the trainer's error where a run fails."""
    _, model, flags = CONFIGS[name]
    num_processes = NUM_PROCESSES.get(name, 1)
    command = [sys.executable]
    if num_processes > 1:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={num_processes}"]
        command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    command += ["-m", "fsdp_embed", "--model", folders[model], "--loss", "mnrl"]
    command += ["--train-data", str(Path(args.data_dir) / "sick-pairs-train.jsonl")]
    command += ["--max-steps", str(args.steps), "--per-device-batch-size", str(args.batch // num_processes)]
    command += ["--dropout", "0", "--save-steps", "0", "--eval-steps", "0", "--seed", "12"]
    command += ["--lr", "2e-5", *flags, "--output-dir", str(out), "--overwrite"]
    done, others = run_timed(command)
    if done.returncode != 0:
        sys.exit(f"error: configuration {name}: fsdp_embed exited {done.returncode}:\n{done.stderr[-3000:]}")
    last = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[-1])
    paths = [line for line in done.stdout.splitlines() if line.startswith(("forwards:", "sharding:"))]
    return last["samples_per_s"], others, paths


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=os.path.join(REPO_DIR, "data"))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=16, help="the global batch (rows a step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=str(REPO_DIR / "bench" / "results" / "llm_recipe.json"))
    args = parser.parse_args()
    needed = ["sick-pairs-train.jsonl", "stsb-train.jsonl"]
    if not all((Path(args.data_dir) / f).is_file() for f in needed):
        parser.error(f"--data-dir must hold {', '.join(needed)}")
    names = args.configs.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-llm-recipe-"))
    folders = build_models(work, args.data_dir)
    runs = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            runs[name].append(train(name, folders, args, work / f"run-{name}"))
    mean = {name: sum(r[0] for r in runs[name]) / len(runs[name]) for name in names}
    print(
        "| configuration | samples/s (by round) | ratio to (a) | ratio to the row above "
        "| others' CPU (by round) |"
    )
    print("|---|---|---:|---:|---|")
    results = []
    for i, name in enumerate(names):
        speeds = ", ".join(f"{r[0]:.1f}" for r in runs[name])
        to_first = f"{mean[name] / mean[names[0]]:.2f}"
        to_previous = f"{mean[name] / mean[names[i - 1]]:.2f}" if i else "-"
        others = ", ".join("-" if r[1] is None else f"{r[1]:.2f}" for r in runs[name])
        label = f"({name}) {CONFIGS[name][0]}"
        print(f"| {label} | {mean[name]:.1f} ({speeds}) | {to_first} | {to_previous} | {others} |")
        for line in runs[name][-1][2]:
            print(f"  ({name}) {line}", file=sys.stderr)
        results.append(
            {
                "config": name,
                "description": CONFIGS[name][0],
                "processes": NUM_PROCESSES.get(name, 1),
                "flags": CONFIGS[name][2],
                "samples_per_s": [r[0] for r in runs[name]],
                "others_cpu": [r[1] for r in runs[name]],
                "log": runs[name][-1][2],
            }
        )
    if args.json:
        settings = {"steps": args.steps, "global_batch": args.batch, "rounds": args.rounds}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
