"""Start-up checks: everything that refuses a bad launch, in the first seconds, on every rank.

main() takes two agreed steps, each run on every rank and its verdicts combined by collectives,
so bad input stops every rank with one message from rank 0, before any weights load or any file
is written, and no rank walks on into a collective that would hang:
  1. `agreed_check` (`checked_flags` on each rank): the flags (each field's bounds, then the
     settings that involve several fields or the machine), resolved once into the run's Plan
     (run_plan.py); the model's folder, config, tokenizer and weight files (from headers alone:
     model_checks.py); the output folder;
  2. `agreed_plan` (`planned_data` on each rank): the training and evaluation data (data.py),
     checked against the flags; which checkpoint a resume continues from (only one written by the
     same run: same settings and data, checkpoints.py; at any world size with its global batch
     kept, run_plan.resumed_batches); every step's rows
     (batches.py); then that every rank reads rank 0's data, and rank 0's lock on the output folder.

Needs config.py, run_plan.py, data.py, batches.py, checkpoints.py, export.py (`parse_size`) and
model_checks.py: it is where the files meet, not a file to copy alone.
"""

import dataclasses
import importlib.util
import json
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
import run_plan


class StartUpError(ValueError):
    """Bad input that every rank found (or was told of) at start-up."""


def agreed_check(cfg, rank, world_size, device):
    """main()'s first step (all ranks participate): the flags checked and resolved into the run's
    Plan (run_plan.py), the model's files and the output folder checked, and every rank's verdict
    combined by collectives. Returns the Plan, or raises StartUpError with the first failing
    rank's message."""
    try:
        plan, error = checked_flags(cfg, world_size, device), None
    except ValueError as e:
        plan, error = None, str(e)
    raise_if_any_failed(error, rank, device)  # (all ranks participate)
    return plan


def agreed_plan(cfg, plan, rank, device):
    """main()'s second step (all ranks participate): the data read and checked, every step's rows
    planned (planned_data), then agreed by collectives: every rank reads rank 0's data, the run is
    not finished already, rank 0 holds the output folder's lock, and which ranks see its disk.
    Returns the Plan, or raises StartUpError with the first failing rank's message."""
    try:
        plan, error = planned_data(cfg, plan), None
    except ValueError as e:
        plan, error = None, str(e)
    raise_if_any_failed(error, rank, device)  # (all ranks participate)
    if rank == 0 and plan.resume_note:
        print(plan.resume_note, flush=True)
    # Hosts without a shared disk read their own copies of the data: each rank checks that its
    # copy is rank 0's (rows and contents), or every rank would train on other batches.
    # (An empty one: --eval-only, or a run already finished, which reads no training data.)
    theirs = broadcast_text(plan.data_fingerprint, rank, device)  # (all ranks participate)
    differs = theirs and plan.data_fingerprint and theirs != plan.data_fingerprint
    error = different_data_problem(cfg, plan, rank, theirs) if differs else None
    raise_if_any_failed(error, rank, device)  # (all ranks participate)
    # The export lives on rank 0's disk, which other hosts may not see: rank 0's view decides.
    finished = broadcast_text("finished" if plan.finished else "", rank, device)  # (all ranks participate)
    if finished == "finished":
        return dataclasses.replace(plan, finished=True)
    # One run per output folder: rank 0 takes the lock once every check passed (a refused run
    # writes nothing), and all ranks hear whether it got it. The lock names this run (`run_id`).
    run_id = secrets.token_hex(8)
    error = checkpoints.take_output_lock(cfg.output_dir, run_id) if rank == 0 else None
    raise_if_any_failed(error, rank, device)  # (all ranks participate)
    # Which ranks share rank 0's disk: those that find rank 0's lock, with this run's id, in
    # their own --output-dir. Hosts without a shared file system do not (and a stale lock in
    # another host's folder has another id).
    lock = checkpoints.read_output_lock(cfg.output_dir) if rank == 0 else ""
    lock = broadcast_text(lock, rank, device)  # (all ranks participate)
    sees = checkpoints.read_output_lock(cfg.output_dir) == lock
    plan.sees_output_dir = all_ranks_flags(sees, rank, device)  # (all ranks participate)
    error = None if sees else unshared_output_dir_problem(cfg, plan, rank, json.loads(lock)["host"])
    raise_if_any_failed(error, rank, device)  # (all ranks participate)
    return plan


def raise_if_any_failed(error, rank, device):
    """StartUpError with the first failing rank's message on every rank, if any rank failed:
    agree_on_error (all ranks participate)."""
    error = agree_on_error(error, rank, device)  # (all ranks participate)
    if error is not None:
        raise StartUpError(error)


def broadcast_text(text, rank, device, src=0, size=4096):
    """Rank `src`'s `text` on every rank (all ranks participate). Bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return text
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    if rank == src:
        encoded = text.encode()[:size]
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=src)  # (all ranks participate)
    return bytes(buffer[buffer != 0].tolist()).decode(errors="replace")


def all_ranks_flags(flag, rank, device):
    """[flag of rank 0, flag of rank 1, ...] on every rank (all ranks participate)."""
    if not dist.is_initialized():
        return [bool(flag)]
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[rank] = float(flag)
    dist.all_reduce(flags)  # (all ranks participate)
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
    Two collectives (all ranks participate). Text travels as bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return message
    failed = all_ranks_flags(message is not None, rank, device)  # (all ranks participate)
    if not any(failed):
        return None
    source = failed.index(True)
    # (all ranks participate)
    message = broadcast_text(message if rank == source else "", rank, device, src=source)
    return message if source == 0 else f"(found by rank {source}) {message}"


def agreed_on_rank0(start, device):
    """`start()` on rank 0 (None elsewhere), which may raise ValueError (a tracker of --report-to
    that cannot start: tracking.py); every rank then stops with its one message. A collective
    (all ranks participate)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = error = None
    if rank == 0:
        try:
            result = start()
        except ValueError as e:
            error = str(e)
    if (error := agree_on_error(error, rank, device)) is not None:  # (all ranks participate)
        raise StartUpError(error)
    return result


def checked_flags(cfg, world_size, device):
    """This rank's first step, no collective: every check of the flags, the model's files and the
    output folder; returns the Plan of the flags (run_plan.resolve_flags). Raises ValueError."""
    config.check_field_rules(cfg)
    check_launch(cfg, world_size, device)
    plan = run_plan.resolve_flags(cfg, world_size, device)  # a flag's bad text raises here
    unknown = [name for name in plan.losses if name not in config.LOSS_NAMES]
    if unknown:
        raise ValueError(
            f"--loss {cfg.loss}: unknown {unknown}; choose from {', '.join(config.LOSS_NAMES)} "
            "(one, or one per --train-data file)"
        )
    check_export_flags(cfg)
    check_run_mode_flags(cfg, plan)
    check_output_dir(cfg.output_dir)
    if cfg.eval_only:
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path) and not cfg.overwrite:
            raise ValueError(
                f"{metrics_path} already exists; pass --overwrite to replace it, or another --output-dir"
            )
    plan.layer_classes = model_checks.check_model(cfg, plan)
    model_checks.check_frozen_models(cfg, plan)
    return plan


def planned_data(cfg, plan):
    """This rank's second step, no collective: the training and evaluation data read and checked
    against the flags, the checkpoint to continue from, every step's rows. Returns the Plan with
    its data (run_plan.add_train_sets, add_schedule). Raises ValueError."""
    if cfg.eval_only:  # no training data, no checkpoints: the evaluation data
        eval_sets = data.load_eval_sets(cfg, plan, 0)
        check_target_vectors(cfg, eval_sets, "--eval-data")
        check_prompt_columns(cfg, plan, [], eval_sets)
        return run_plan.add_schedule(plan, cfg, [], 0, eval_sets, "")
    train_sets = data.load_train_sets(cfg, plan)
    # One set: 'N rows, sha256 H', as before several sets could train together.
    fingerprint = "; ".join(data.data_fingerprint(ts.ds, ts.read_columns) for ts in train_sets)
    before_arrow = lambda: "; ".join(  # noqa: E731
        data.fingerprint_before_arrow(ts.ds, ts.read_columns) for ts in train_sets
    )
    resume_dir = checkpoints.checkpoint_to_resume(cfg, fingerprint, before_arrow)
    if resume_dir == "finished":
        return dataclasses.replace(plan, finished=True)
    note = ""
    if resume_dir is not None:  # at another world size too: the checkpoint's global batches kept
        plan, note = run_plan.resumed_batches(plan, cfg, train_sets, checkpoints.saved_state(resume_dir))
    check_losses(cfg, plan, train_sets)
    plan = run_plan.add_train_sets(plan, cfg, train_sets)
    for ts in plan.train_sets:
        if len(ts.ds) < ts.global_batch:
            raise ValueError(
                f"--train-data {ts.name}: {len(ts.ds)} rows make no global batch of {ts.global_batch} "
                f"(= {ts.per_device_batch_size} per device x {plan.world_size} processes x "
                f"{plan.grad_accum_steps} accumulation); lower --per-device-batch-size"
            )
    schedule = batches.Schedule(plan.train_sets, cfg)
    steps_per_epoch = len(schedule.set_orders[0])
    eval_sets = data.load_eval_sets(cfg, plan, plan.num_labels)
    check_target_vectors(cfg, eval_sets, "--eval-data")
    check_prompt_columns(cfg, plan, train_sets, eval_sets)
    plan = run_plan.add_schedule(plan, cfg, schedule, steps_per_epoch, eval_sets, fingerprint)
    plan.resume_dir, plan.resume_note = resume_dir, note
    return plan


def check_launch(cfg, world_size, device):
    """The settings that involve the launch or the machine: the strategy for this many processes,
    bf16 on this GPU, something to train."""
    if cfg.strategy == "single" and world_size > 1:
        raise ValueError(
            f"--strategy single with {world_size} processes would train {world_size} unrelated models; "
            "use --strategy ddp"
        )
    if cfg.strategy == "fsdp" and cfg.sharding == "no_shard" and cfg.fsdp_version == 2:
        raise ValueError(
            "--sharding no_shard has no FSDP2 form (FSDP2 is the default --fsdp-version); "
            "use --strategy ddp (the same thing) or --fsdp-version 1"
        )
    if device.type == "cuda" and cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "--precision bf16: this GPU has no bf16 support (it needs Ampere or newer); use --precision fp16"
        )
    if cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs} trains nothing; use --epochs 1 or more, or --max-steps")


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


def check_run_mode_flags(cfg, plan):
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
    check_report_to(plan.report_tools)
    if cfg.resume not in ("", "auto") and (problem := checkpoints.checkpoint_problem(cfg.resume)):
        raise ValueError(
            f"--resume {cfg.resume}: not a complete checkpoint ({problem}); "
            "pass a complete OUTPUT_DIR/checkpoints/step-N folder, or --resume auto, "
            "which takes the newest complete one"
        )


def check_report_to(tools):
    """Each tracker's package is installed (optional packages, imported only by tracking.py when
    asked for; the package has the tool's name)."""
    for name in tools:
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--report-to {name} needs the {name} package: pip install {name} "
                "(or leave it out of --report-to)"
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


def check_mnrl_directions(cfg, plan, losses_used):
    """--mnrl-directions: an mnrl file to train, and the flags they combine with."""
    directions = plan.mnrl["directions"]
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


def check_false_negative_flags(cfg, losses_used):
    """--false-negative-margin, --guide-model and --hardness-mode: an mnrl file that ranks against
    other rows; one rule for the false negatives; the guide's margin only with a guide."""
    flags = ["--false-negative-margin"] if cfg.false_negative_margin is not None else []
    flags += ["--guide-model"] if cfg.guide_model else []
    if len(flags) == 2:
        raise ValueError(
            "--false-negative-margin leaves out what the model itself scores above the positive, "
            "--guide-model what the guide does: choose one"
        )
    guide_flags = (cfg.guide_margin, cfg.guide_margin_strategy) != (0.0, "absolute")
    if guide_flags and not cfg.guide_model:
        raise ValueError(
            "--guide-margin and --guide-margin-strategy set the guide's rule; pass --guide-model"
        )
    flags += ["--hardness-mode"] if cfg.hardness_mode else []
    if flags and "mnrl" not in losses_used:
        raise ValueError(
            f"{flags[0]} needs a --train-data file that trains with mnrl (losses: {', '.join(losses_used)})"
        )
    if cfg.hardness_mode and cfg.hardness_strength == 0:
        raise ValueError(
            f"--hardness-mode {cfg.hardness_mode} with --hardness-strength 0 weights nothing; "
            "set a strength above 0"
        )


def check_losses(cfg, plan, train_sets):
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
    check_mnrl_directions(cfg, plan, losses_used)
    check_false_negative_flags(cfg, losses_used)
    check_distillation(cfg, train_sets)
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
            * (plan.world_size if cfg.gather_negatives and not ts.own_negatives else 1)
            * (len(ts.text_columns) - 1)
        )
        if ts.loss == "mnrl" and candidates == 1:
            raise ValueError(
                "--loss mnrl with one row per micro-batch and no hard-negative column ranks each anchor "
                "against its own positive alone: the loss is 0 and nothing trains. "
                "Raise --per-device-batch-size, add a negative column, or use --gather-negatives"
            )


def check_distillation(cfg, train_sets):
    """--loss mse's targets: each mse file's 'embedding' (or 'label') column or --teacher-model, not
    both; every row's vector finite and as wide as the model's embeddings; no Matryoshka sizes."""
    mse_sets = [ts for ts in train_sets if ts.loss == "mse"]
    if cfg.teacher_model and not mse_sets:
        raise ValueError(
            "--teacher-model computes --loss mse's targets, and no --train-data file trains with mse "
            f"(losses: {', '.join(sorted({ts.loss for ts in train_sets}))}); pass --loss mse"
        )
    if mse_sets and cfg.matryoshka_dims:
        raise ValueError(
            "--matryoshka-dims: --loss mse compares whole embeddings with the teacher's; drop one"
        )
    for ts in mse_sets:
        where = f"--train-data {ts.name}"
        if ts.target is None and not cfg.teacher_model:
            raise ValueError(
                f"{where}: --loss mse needs each row's target: an 'embedding' column with the teacher's "
                "vector, or --teacher-model to compute it"
            )
        if ts.target is not None and cfg.teacher_model:
            raise ValueError(
                f"{where} holds the targets ({ts.target!r}) and --teacher-model computes them: drop one"
            )
    check_target_vectors(cfg, mse_sets, "--train-data")


def check_target_vectors(cfg, sets, flag):
    """Each mse set's target column (training, or evaluation scored by its loss) holds, in every row,
    as many finite numbers as the model's embeddings have: the teacher's embedding."""
    width = None
    for ts in sets:
        if ts.loss != "mse" or ts.target is None:
            continue
        width = width or model_checks.model_width(cfg)
        for start, values in data.windows(ts.ds, ts.target):
            if (i := data.bad_score_list(values, width)) is not None:
                raise ValueError(
                    f"{flag} {ts.name}: row {start + i} has {ts.target} = {str(values[i].as_py())[:80]}; "
                    f"--loss mse needs a list of {width} finite numbers, the teacher's embedding "
                    f"({cfg.model}'s width)"
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


def check_prompt_columns(cfg, plan, train_sets, eval_sets):
    """Every --prompts (and --max-seq-length) key names a text column of some training or
    evaluation file: a typo would otherwise train without the prompt (the length), silently."""
    columns = sorted(
        {c for s in train_sets for c in s.prompt_columns} | {c for s in eval_sets for c in s.text_columns}
    )
    for flag, keys in (
        ("--prompts", plan.prompts),
        ("--max-seq-length", plan.column_lengths),
    ):
        for column in keys:
            if column not in columns:
                raise ValueError(
                    f"{flag}: {column!r} is no text column of --train-data or --eval-data "
                    f"(they have: {', '.join(columns)}); key each by the column it is for"
                )
    for ts in train_sets:
        for column in plan.dataset_settings.get(ts.name, {}).get("prompts", {}):
            if column not in ts.prompt_columns:
                raise ValueError(
                    f"--dataset-settings {ts.name}: prompts names {column!r}, no text column of its file "
                    f"(it has: {', '.join(dict.fromkeys(ts.prompt_columns))})"
                )
