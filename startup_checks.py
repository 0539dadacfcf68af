"""Start-up checks: everything that refuses a bad launch, in the first seconds, on every rank.

`agreed_start_up` runs `start_up_checks` on every rank and combines their verdicts (two
collectives), so bad input stops every rank with one message from rank 0, before any weights
load or any file is written, and no rank walks on into a collective that would hang. The checks:
the flags (each field's bounds, then the settings that involve several fields or the machine),
the training and evaluation data (loaded here: data.py), the model's folder, config, tokenizer and
weight files (from headers alone: model_checks.py), the output folder, and which checkpoint a
resume continues from (only one written by the same run: same settings, data and number of
processes; checkpoints.py). What they find is the run's plan (`StartUp`): the strategy, the
data sets and every step's rows.

Needs config.py, data.py, batches.py, checkpoints.py, export.py (`parse_size`) and
model_checks.py: it is where the files meet, not a file to copy alone.
"""

import dataclasses
from dataclasses import dataclass
import importlib.util
import json
import math
import os
import secrets
import socket

import torch
import torch.distributed as dist

import batches
import checkpoints
import config
import data
import export
import model_checks


@dataclass
class StartUp:
    """What the start-up checks found, and what the run is planned from."""

    finished: bool = False  # --output-dir already holds this run's export (and --resume is set)
    strategy: str = ""
    resume_dir: str | None = None
    train_sets: list = dataclasses.field(default_factory=list)
    # every step's (epoch, set index, rows): training_schedule
    schedule: list = dataclasses.field(default_factory=list)
    num_labels: int = 0  # classes of the Softmax head (0: none)
    global_batch: int = 0
    layer_classes: list | None = None  # the FSDP block classes, or None when not sharding
    eval_sets: list = dataclasses.field(default_factory=list)
    # row counts and hashes of the training data, saved to refuse changed data on resume
    data_fingerprint: str = ""
    # by rank: whether that rank sees the --output-dir rank 0 writes (False: another host's disk)
    sees_output_dir: list = dataclasses.field(default_factory=lambda: [True])


class StartUpError(ValueError):
    """Bad input that every rank found (or was told of) at start-up."""


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
    # Hosts without a shared disk read their own copies of the data: each rank checks that its
    # copy is rank 0's (rows and contents), or every rank would train on other batches.
    # (An empty one: --eval-only, or a run already finished, which reads no training data.)
    theirs = broadcast_text(plan.data_fingerprint, rank, device)  # all ranks
    differs = theirs and plan.data_fingerprint and theirs != plan.data_fingerprint
    error = different_data_problem(cfg, plan, rank, theirs) if differs else None
    error = agree_on_error(error, rank, device)  # all ranks
    if error is not None:
        raise StartUpError(error)
    # The export lives on rank 0's disk, which other hosts may not see: rank 0's view decides.
    if broadcast_text("finished" if plan.finished else "", rank, device) == "finished":  # all ranks
        return StartUp(finished=True)
    # One run per output folder: rank 0 takes the lock once every check passed (a refused run
    # writes nothing), and all ranks hear whether it got it. The lock names this run (`run_id`).
    run_id = secrets.token_hex(8)
    error = checkpoints.take_output_lock(cfg.output_dir, run_id) if rank == 0 else None
    error = agree_on_error(error, rank, device)  # all ranks
    if error is not None:
        raise StartUpError(error)
    # Which ranks share rank 0's disk: those that find rank 0's lock, with this run's id, in
    # their own --output-dir. Hosts without a shared file system do not (and a stale lock in
    # another host's folder has another id).
    lock = broadcast_text(checkpoints.read_output_lock(cfg.output_dir) if rank == 0 else "", rank, device)
    sees = checkpoints.read_output_lock(cfg.output_dir) == lock
    plan.sees_output_dir = all_ranks_flags(sees, rank, device)  # all ranks
    error = None if sees else unshared_output_dir_problem(cfg, plan, rank, json.loads(lock)["host"])
    error = agree_on_error(error, rank, device)  # all ranks
    if error is not None:
        raise StartUpError(error)
    return plan


def broadcast_text(text, rank, device, src=0, size=4096):
    """Rank `src`'s `text` on every rank (ALL ranks must call it). Bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return text
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    if rank == src:
        encoded = text.encode()[:size]
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=src)  # all ranks
    return bytes(buffer[buffer != 0].tolist()).decode(errors="replace")


def all_ranks_flags(flag, rank, device):
    """[flag of rank 0, flag of rank 1, ...] on every rank (ALL ranks must call it)."""
    if not dist.is_initialized():
        return [bool(flag)]
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[rank] = float(flag)
    dist.all_reduce(flags)  # all ranks
    return [bool(f) for f in flags.tolist()]


def different_data_problem(cfg, plan, rank, rank0_fingerprint):
    """Why this rank's --train-data is not rank 0's (another copy, on another host)."""
    return (
        f"--train-data {cfg.train_data} on host {socket.gethostname()} (rank {rank}) is not the "
        f"data rank 0 reads: {plan.data_fingerprint} here, {rank0_fingerprint} on rank 0. "
        "Copy the same files to every host (or put them on a disk all hosts share)"
    )


def unshared_output_dir_problem(cfg, plan, rank, writer_host):
    """Why this rank, which does not see rank 0's --output-dir, cannot run as asked (or None).
    The export travels to rank 0 over the process group; checkpoints do not: a resume needs
    every rank's shard, and each rank reads its own from the one folder."""
    if not (cfg.save_steps or plan.resume_dir):
        return None
    what = f"--save-steps {cfg.save_steps}" if cfg.save_steps else f"resuming from {plan.resume_dir}"
    return (
        f"{what} needs one --output-dir that every host sees: rank {rank} (host "
        f"{socket.gethostname()}) does not see the {cfg.output_dir} that rank 0 (host {writer_host}) "
        "writes. Put --output-dir on a file system all hosts share (NFS, Lustre, a mounted bucket), "
        "or train without --save-steps (the export needs no shared disk)"
    )


def agree_on_error(message, rank, device):
    """Combine every rank's verdict of the start-up checks: if any rank failed, every rank gets
    the first failing rank's message, so no rank walks on into a collective that would hang.
    ALL ranks must call it (two collectives). Text travels as bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return message
    failed = all_ranks_flags(message is not None, rank, device)  # all ranks
    if not any(failed):
        return None
    source = failed.index(True)
    message = broadcast_text(message if rank == source else "", rank, device, src=source)  # all ranks
    return message if source == 0 else f"(found by rank {source}) {message}"


def agreed_on_rank0(start, device):
    """`start()` on rank 0 (None elsewhere), which may raise ValueError (a tracker of --report-to
    that cannot start: tracking.py); ALL ranks must call it, and all stop with its one message."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = error = None
    if rank == 0:
        try:
            result = start()
        except ValueError as e:
            error = str(e)
    if (error := agree_on_error(error, rank, device)) is not None:  # all ranks
        raise StartUpError(error)
    return result


def start_up_checks(cfg, world_size, device):
    """Every check before heavy work; returns the StartUp the run is planned from. Raises ValueError."""
    strategy = check_flags(cfg, world_size, device)
    check_output_dir(cfg.output_dir)
    if cfg.eval_only:  # no training data, no checkpoints: the model and the evaluation data
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path) and not cfg.overwrite:
            raise ValueError(
                f"{metrics_path} already exists; pass --overwrite to replace it, or another --output-dir"
            )
        eval_sets = data.load_eval_sets(cfg, 0)
        check_prompt_columns(cfg, [], eval_sets)
        return StartUp(
            strategy=strategy, eval_sets=eval_sets, layer_classes=model_checks.check_model(cfg, strategy)
        )
    train_sets = data.load_train_sets(cfg)
    check_losses(cfg, train_sets, world_size)
    # One set: 'N rows, sha256 H', as before several sets could train together.
    fingerprint = "; ".join(data.data_fingerprint(ts.ds, ts.read_columns) for ts in train_sets)
    resume_dir = checkpoints.checkpoint_to_resume(cfg, world_size, fingerprint)
    if resume_dir == "finished":
        return StartUp(finished=True)
    global_batch = cfg.per_device_batch_size * world_size * cfg.grad_accum_steps
    for ts in train_sets:
        ts.global_batch = ts.per_device_batch_size * world_size * cfg.grad_accum_steps
        if len(ts.ds) < ts.global_batch:
            raise ValueError(
                f"--train-data {ts.name}: {len(ts.ds)} rows make no global batch of {ts.global_batch} "
                f"(= {ts.per_device_batch_size} per device x {world_size} processes x "
                f"{cfg.grad_accum_steps} accumulation); lower --per-device-batch-size"
            )
    schedule = batches.training_schedule(train_sets, cfg)
    # the Softmax set's classes (at most one set has them)
    num_labels = max(ts.num_labels for ts in train_sets)
    eval_sets = data.load_eval_sets(cfg, num_labels)
    check_prompt_columns(cfg, train_sets, eval_sets)
    layer_classes = model_checks.check_model(cfg, strategy)
    return StartUp(
        False,
        strategy,
        resume_dir,
        train_sets,
        schedule,
        num_labels,
        global_batch,
        layer_classes,
        eval_sets,
        fingerprint,
    )


def check_flags(cfg, world_size, device):
    """Each field's own rules, then the settings that involve several fields or the machine.
    Returns the strategy to use."""
    config.check_field_rules(cfg)
    strategy = cfg.strategy if cfg.strategy != "auto" else ("ddp" if world_size > 1 else "single")
    if strategy != "single" and world_size == 1:
        strategy = "single"  # one process: nothing to synchronise or shard
    if strategy == "single" and world_size > 1:
        raise ValueError(
            f"--strategy single with {world_size} processes would train {world_size} unrelated models; "
            "use --strategy ddp"
        )
    if device.type == "cuda" and cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "--precision bf16: this GPU has no bf16 support (it needs Ampere or newer); use --precision fp16"
        )
    if cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs} trains nothing; use --epochs 1 or more, or --max-steps")
    unknown = [name for name in cfg.loss.split(",") if name not in config.LOSS_NAMES] if cfg.loss else []
    if unknown:
        raise ValueError(
            f"--loss {cfg.loss}: unknown {unknown}; choose from {', '.join(config.LOSS_NAMES)} "
            "(one, or one per --train-data file)"
        )
    check_matryoshka(cfg)
    config.prompts_of(cfg)
    config.column_lengths(cfg)
    check_export_flags(cfg)
    check_run_mode_flags(cfg)
    return strategy


def check_export_flags(cfg):
    """--export-max-shard-size is a size, and --export-adapter has LoRA adapters to write."""
    try:
        if export.parse_size(cfg.export_max_shard_size) < 1:
            raise ValueError("zero")
    except ValueError:
        raise ValueError(
            f"--export-max-shard-size {cfg.export_max_shard_size!r} is not a size: "
            "write it like 5GB, 300MB or 2GiB"
        ) from None
    if cfg.export_adapter and not cfg.lora_rank:
        raise ValueError(
            "--export-adapter writes LoRA adapters, and there are none without --lora-rank R; "
            "pass one, or drop --export-adapter"
        )


def check_run_mode_flags(cfg):
    """The flags that choose what the run does: resume or overwrite, evaluate only or first, report
    to trackers; --resume PATH must name a complete checkpoint."""
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues a run and --overwrite starts it over: choose one")
    if (cfg.eval_only or cfg.eval_on_start) and not cfg.eval_data:
        raise ValueError(
            f"--{'eval-only' if cfg.eval_only else 'eval-on-start'} evaluates on "
            "--eval-data FILE[,FILE]; pass one"
        )
    if cfg.eval_only and cfg.resume:
        raise ValueError(
            "--eval-only evaluates --model and trains nothing, so --resume has nothing to continue: drop one"
        )
    check_report_to(cfg)
    if cfg.resume not in ("", "auto") and (problem := checkpoints.checkpoint_problem(cfg.resume)):
        raise ValueError(
            f"--resume {cfg.resume}: not a complete checkpoint ({problem}); "
            "pass a complete OUTPUT_DIR/checkpoints/step-N folder, or --resume auto, "
            "which takes the newest complete one"
        )


def check_report_to(cfg):
    """--report-to names each tracker once, and its package is installed (optional packages, imported
    only by tracking.py when asked for)."""
    tools = config.report_tools(cfg)
    unknown = [name for name in tools if name not in config.REPORT_TOOLS]
    if unknown:
        raise ValueError(
            f"--report-to {cfg.report_to}: unknown {unknown}; choose from "
            f"{', '.join(config.REPORT_TOOLS)}, comma-separated (e.g. wandb,mlflow)"
        )
    twice = sorted({name for name in tools if tools.count(name) > 1})
    if twice:
        raise ValueError(f"--report-to {cfg.report_to}: {', '.join(twice)} named twice; name each tool once")
    for name in tools:  # the package has the tool's name
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--report-to {name} needs the {name} package: pip install {name} "
                "(or leave it out of --report-to)"
            )


def check_matryoshka(cfg):
    if cfg.matryoshka_weights and not cfg.matryoshka_dims:
        raise ValueError("--matryoshka-weights weighs the sizes of --matryoshka-dims; pass those too")
    if not cfg.matryoshka_dims:
        return
    try:
        dims, weights = config.matryoshka_sizes(cfg)
    except ValueError:
        raise ValueError(
            f"--matryoshka-dims {cfg.matryoshka_dims!r} / --matryoshka-weights {cfg.matryoshka_weights!r}: "
            "give comma-separated whole numbers (and numbers for the weights), e.g. 384,128,64 and 1,1,0.5"
        ) from None
    if min(dims) < 1 or len(set(dims)) < len(dims):
        raise ValueError(f"--matryoshka-dims {cfg.matryoshka_dims}: sizes must be positive and distinct")
    if len(weights) != len(dims) or not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ValueError(
            f"--matryoshka-weights {cfg.matryoshka_weights}: one finite, non-negative weight per size "
            f"({len(dims)}), not all 0"
        )


def check_output_dir(output_dir):
    """--output-dir must be a folder this process can create files in (checked without writing)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output-dir {output_dir} is a file, not a folder; choose another --output-dir")
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"--output-dir {output_dir}: cannot write in {existing}; choose a folder you can write to"
        )


def check_mnrl_directions(cfg, losses_used):
    """--mnrl-directions: known names, an mnrl file to train, and the flags they combine with."""
    unknown = sorted({d.strip() for d in cfg.mnrl_directions.split(",")} - set(config.MNRL_DIRECTIONS))
    if unknown:
        raise ValueError(
            f"--mnrl-directions {cfg.mnrl_directions}: unknown {', '.join(unknown)}; "
            f"choose from {', '.join(config.MNRL_DIRECTIONS)}"
        )
    directions = config.mnrl_options(cfg)["directions"]
    if len(directions) == 1:
        return
    if "mnrl" not in losses_used:
        raise ValueError(
            "--mnrl-directions needs a --train-data file that trains with mnrl "
            f"(losses: {', '.join(losses_used)})"
        )
    if cfg.symmetric or cfg.mask_duplicates:
        flag = (
            "--symmetric (use --mnrl-directions query_to_doc,doc_to_query)"
            if cfg.symmetric
            else "--mask-duplicates"
        )
        raise ValueError(f"--mnrl-directions {cfg.mnrl_directions} does not combine with {flag}")
    if cfg.mnrl_partition == "per_direction" and not set(directions) <= {"query_to_doc", "doc_to_query"}:
        raise ValueError(
            "--mnrl-partition per_direction needs every direction's candidates to hold the positive pair: "
            "query_to_query and doc_to_doc never do; use --mnrl-partition joint"
        )


def check_losses(cfg, train_sets, world_size):
    """The flags that need a loss, against the losses the files train with."""
    losses_used = sorted({ts.loss for ts in train_sets})
    if (cfg.gather_negatives or cfg.symmetric or cfg.mask_duplicates) and "mnrl" not in losses_used:
        flag = (
            "--gather-negatives"
            if cfg.gather_negatives
            else "--symmetric"
            if cfg.symmetric
            else "--mask-duplicates"
        )
        raise ValueError(
            f"{flag} works on MNRL's candidates, and no --train-data file trains with mnrl "
            f"(losses: {', '.join(losses_used)})"
        )
    check_mnrl_directions(cfg, losses_used)
    if cfg.matryoshka_dims and "softmax" in losses_used:
        raise ValueError(
            "--matryoshka-dims: the Softmax head reads embeddings of one fixed size, "
            "so it cannot train truncated ones; "
            "use --loss mnrl, cosent, margin_mse or distill_kl"
        )
    grouped = [ts.name for ts in train_sets if ts.group_size]
    if grouped and cfg.batch_sampler == "no_duplicates":
        raise ValueError(
            f"--batch-sampler no_duplicates: the grouped rows of {', '.join(grouped)} draw their texts each "
            "step, so no batch can be checked in advance; use --mask-duplicates (mnrl) instead"
        )
    for ts in train_sets:
        check_set_settings(cfg, ts)
        candidates = (
            ts.per_device_batch_size
            * (world_size if cfg.gather_negatives and not ts.own_negatives else 1)
            * (len(ts.text_columns) - 1)
        )
        if ts.loss == "mnrl" and candidates == 1:
            raise ValueError(
                "--loss mnrl with one row per micro-batch and no hard-negative column ranks each anchor "
                "against its own positive alone: the loss is 0 and nothing trains. "
                "Raise --per-device-batch-size, add a negative column, or use --gather-negatives"
            )


def check_set_settings(cfg, ts):
    """A training set's own settings (--dataset-settings), against its loss and columns."""
    if cfg.cache_chunk_size > ts.per_device_batch_size:
        raise ValueError(
            f"--cache-chunk-size {cfg.cache_chunk_size} must be between 1 and the per-device batch size "
            f"({ts.per_device_batch_size}, {ts.name}'s); 0 turns GradCache off"
        )
    if ts.own_negatives and (ts.loss != "mnrl" or len(ts.text_columns) < 3):
        raise ValueError(
            f"--dataset-settings {ts.name}: own_negatives ranks each anchor against its own positive and "
            f"hard negatives, so it needs --loss mnrl and a negative column (it has {ts.loss}, columns "
            f"{ts.text_columns})"
        )
    if ts.weight != 1 and cfg.mix == "round_robin":
        raise ValueError(
            f"--dataset-settings {ts.name}: a weight sets its share of a proportional mix; "
            "--mix round_robin takes the sets in turn (use --mix proportional)"
        )


def check_prompt_columns(cfg, train_sets, eval_sets):
    """Every --prompts (and --max-seq-length) key names a text column of some training or
    evaluation file: a typo would otherwise train without the prompt (the length), silently."""
    columns = sorted(
        {c for s in train_sets for c in s.prompt_columns} | {c for s in eval_sets for c in s.text_columns}
    )
    for flag, keys in (
        ("--prompts", config.prompts_of(cfg)),
        ("--max-seq-length", config.column_lengths(cfg)[1]),
    ):
        for column in keys:
            if column not in columns:
                raise ValueError(
                    f"{flag}: {column!r} is no text column of --train-data or --eval-data "
                    f"(they have: {', '.join(columns)}); key each by the column it is for"
                )
    own = json.loads(cfg.dataset_settings or "{}")
    for ts in train_sets:
        for column in own.get(ts.name, {}).get("prompts", {}):
            if column not in ts.prompt_columns:
                raise ValueError(
                    f"--dataset-settings {ts.name}: prompts names {column!r}, no text column of its file "
                    f"(it has: {', '.join(dict.fromkeys(ts.prompt_columns))})"
                )


def derived_values(cfg, plan, loaded, world_size, device):
    """What the run computed from its config, data and model: printed at start, saved with every
    checkpoint and export beside the config."""
    total_steps = len(plan.schedule)
    return {
        "world_size": world_size,
        "strategy_used": plan.strategy,
        "fsdp_layer_classes": plan.layer_classes,
        "device": str(device),
        "global_batch": plan.global_batch,
        "train_rows": sum(len(ts.ds) for ts in plan.train_sets),
        "train_data_fingerprint": plan.data_fingerprint,
        "steps_per_epoch": len(batches.epoch_batches(plan.train_sets, cfg, 0)),
        "total_steps": total_steps,
        "warmup_steps": math.ceil(cfg.warmup_ratio * total_steps),
        "max_seq_length_used": loaded.max_seq_length,
        "pooling_used": loaded.model.pooling,
        "normalize_used": loaded.model.normalize,
        "train_sets": [
            {
                "name": ts.name,
                "rows": len(ts.ds),
                "loss": ts.loss,
                "text_columns": ts.text_columns,
                "target_column": ts.target,
                "per_device_batch_size": ts.per_device_batch_size,
                "global_batch": ts.global_batch,
                "weight": ts.weight,
                "own_negatives": ts.own_negatives,
                "prompts": ts.prompts,
                "steps": sum(1 for _, i, _ in plan.schedule if i == index),
            }
            for index, ts in enumerate(plan.train_sets)
        ],
        "num_labels": plan.num_labels,
    }
