"""Resumable checkpoints, resuming, and the output folder's lock.

OUTPUT_DIR/checkpoints/step-N/, written with torch.distributed.checkpoint (DCP):

  shard-0000R-model-00001-of-00001.safetensors   this rank's part of model + optimizer tensors
  rng-rank-R.safetensors                          rank R's random-number generator states
  trainer_state.json                              step, scheduler, optimizer hyper-parameters, config
  manifest.json                                   every other file and its size, written last

Written under a hidden name and renamed to step-N only when every rank has finished, so a
crash mid-save leaves a hidden folder that resuming never picks (and the next save removes).
A step-N folder can still be damaged later (a full disk, a copy cut short, a file deleted by
hand): `checkpoint_problem` compares it with its manifest, so a damaged one is never loaded,
and `newest_usable_checkpoint` passes over one whose weights were not finite. A checkpoint
is resumable state only; the model people use is the export (export.py).

One run per output folder: rank 0 holds OUTPUT_DIR/.lock while it runs (`take_output_lock`).

`checkpoint_to_resume` picks the checkpoint a run continues from at start-up (run_plan.py
calls it), and `check_same_run` refuses one written by another run.

Needs safetensors, fsdp_utils.py (`print0`), fsdp_embed/checkpoint_warnings.py,
fsdp_embed/random_state.py (each rank's generator states), fsdp_embed/faults.py (the disk's room,
writes agreed across ranks) and fsdp_embed/config.py (the settings a resume may change): its whole
copy set, none of them importing another project file.
"""

import atexit
import dataclasses
import datetime
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import fsdp_utils
from fsdp_embed import checkpoint_warnings
from fsdp_embed import config
from fsdp_embed import faults
from fsdp_embed import random_state

# torch.distributed.checkpoint is imported by the functions that use it: start-up time that
# runs without FSDP or checkpoints never need (docs/speed.md).


# Flattened optimizer state ("state.<param>.exp_avg", ...): the same keys on every rank even when
# a rank holds no elements of a parameter. FSDP1 at 4 ranks needs it: unflattened, loading fails
# with "Missing key in checkpoint state_dict: optim.param_groups" (and allow_partial_load=True
# would "work" by silently dropping the learning rate).
CHECKPOINT_OPTIONS = {"flatten_optimizer_state_dict": True}  # StateDictOptions(**this)


CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def _tensor_state(model, optimizer):
    """(tensors for DCP, non-tensor optimizer entries): under FSDP a collective (all ranks participate)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(  # (all ranks participate): FSDP's state dict
        model, optimizer, options=StateDictOptions(**CHECKPOINT_OPTIONS)
    )
    tensors = {"model." + k: v for k, v in model_state.items()}
    tensors.update({"optim." + k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)})
    # The hyper-parameters of each group (lr, betas, ...): plain numbers, kept as JSON.
    hyper = {k: v for k, v in optim_state.items() if not isinstance(v, torch.Tensor)}
    return tensors, hyper


def _untied(tensors):
    """(`tensors` with each storage once, {left-out name: the name kept}): tied tensors (a SPLADE
    head's decoder is the word embeddings) share storage, and safetensors refuses to write such a
    pair. Loading the kept name fills the other, which is the same storage. FSDP1's ShardedTensors
    are passed through as they are (FSDP1 with a tied head is not tested: docs/sparse.md)."""
    kept, tied = {}, {}
    for name, t in tensors.items():
        if hasattr(t, "local_shards"):  # FSDP1's ShardedTensor: written as it is
            continue
        local = getattr(t, "_local_tensor", t)  # a DTensor's shard (FSDP2)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in kept:
            tied[name] = kept[key]
        else:
            kept.setdefault(key, name)
    return {name: t for name, t in tensors.items() if name not in tied}, tied


MANIFEST = "manifest.json"


def checkpoint_problem(path):
    """Why the checkpoint folder `path` cannot be loaded, or None when it is complete: every file
    its manifest lists is there with the size it was written with. (Sizes catch truncated and
    missing files, the damage crashes and full disks leave; they do not catch flipped bits.)"""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish, or an older version wrote it)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, size in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return (
                f"{name} has {os.path.getsize(file)} bytes where {size} were written "
                "(truncated or overwritten)"
            )
    return None


def list_checkpoints(checkpoints_dir):
    """[(step, path, problem)] of every step-N folder under `checkpoints_dir`, oldest first;
    problem is None for a complete checkpoint (see `checkpoint_problem`)."""
    if not os.path.isdir(checkpoints_dir):
        return []
    found = []
    for name in os.listdir(checkpoints_dir):
        match = CHECKPOINT_NAME.match(name)
        path = os.path.join(checkpoints_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path, checkpoint_problem(path)))
    return sorted(found)


def complete_checkpoints(checkpoints_dir):
    """[(step, path)] of the complete checkpoints under `checkpoints_dir`, oldest first."""
    return [(step, path) for step, path, problem in list_checkpoints(checkpoints_dir) if problem is None]


def _write_manifest(tmp_dir):
    """Rank 0, once every rank has written: the manifest (each file's size), which makes the
    folder a complete checkpoint. The folder is a shared file system's (the start-up checks refuse
    --save-steps where it is not): rank 0 sees every rank's files, now complete. A rank's file
    missing here means it wrote elsewhere: no manifest, so this step never looks complete."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    expected = [os.path.join(tmp_dir, f"rng-rank-{r}.safetensors") for r in range(world_size)]
    missing = [r for r, path in enumerate(expected) if not os.path.exists(path)]
    if missing:  # not an assert: it must hold under `python -O` too
        raise RuntimeError(f"{tmp_dir} lacks the files of ranks {missing}: is it on a disk every host sees?")
    files = {name: os.path.getsize(os.path.join(tmp_dir, name)) for name in sorted(os.listdir(tmp_dir))}
    with open(os.path.join(tmp_dir, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(model, optimizer, checkpoints_dir, step, trainer_state, keep_last=0):
    """Save model, optimizer, every rank's RNG and `trainer_state` (a JSON-able dict) as
    `checkpoints_dir/step-{step}` (all ranks participate): gathering the state dict, the DCP
    save and the agreements between the writes are collectives. Only rank 0 writes the JSON
    files and renames.
    A folder already named step-{step} (a damaged one, or one a resume from an older step is
    about to replace) is moved aside to step-{step}.replaced-TIME, never deleted.
    `keep_last` > 0 removes older checkpoints beyond that many, after the new one is complete.
    A disk without room for it stops every rank before anything is written, and a write that
    fails on any rank stops every rank with the half-written folder removed (faults.DiskFull);
    the older checkpoints are then untouched."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    final_dir = os.path.join(checkpoints_dir, f"step-{step}")
    tmp_dir = os.path.join(checkpoints_dir, f".incomplete-step-{step}")
    with checkpoint_warnings.quiet_checkpoint_warnings():  # (FSDP1's ShardedTensor warns at each use)
        tensors, hyper = _tensor_state(model, optimizer)
        # RNG states, JSON and safetensors headers: a few kB a rank, within the 1% + 1 MiB.
        need = int(1.01 * faults.global_bytes(tensors.values())) + 2**20
    what = f"checkpoint step-{step}"
    # when the disk cannot hold it, every rank stops before writing anything.
    faults.check_space(checkpoints_dir, need, what)

    # Each `agreed_writes` is an all_reduce: a write that fails on any rank (a full disk) stops
    # every rank, with the half-written folder removed. Each is also a barrier: nobody writes
    # into the folder before it exists, nor lists the files before all are written.
    remove_tmp = functools.partial(shutil.rmtree, tmp_dir, ignore_errors=True)
    with faults.agreed_writes(what, checkpoints_dir, remove_tmp):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # a leftover of a save that was killed
            os.makedirs(tmp_dir)
    with faults.agreed_writes(what, checkpoints_dir, remove_tmp):
        with checkpoint_warnings.quiet_checkpoint_warnings():
            # (all ranks participate): each writes the tensors (or shards) it is assigned;
            # safetensors files, so loading them back runs no pickle. A failed write raises on
            # every rank.
            dcp.save(
                _untied(tensors)[0],
                storage_writer=dcp.HuggingFaceStorageWriter(
                    tmp_dir, save_distributed=True, enable_consolidation=False
                ),
            )
        save_file(random_state.rng_states(), os.path.join(tmp_dir, f"rng-rank-{rank}.safetensors"))
        if rank == 0:
            with open(os.path.join(tmp_dir, "trainer_state.json"), "w") as f:
                json.dump({**trainer_state, "step": step, "optimizer_hyperparameters": hyper}, f, indent=1)

    # rank 0 writes the manifest, renames, and removes the oldest; the
    # others wait for it.
    with faults.agreed_writes(what, checkpoints_dir, remove_tmp):
        if rank == 0:
            _make_complete(tmp_dir, final_dir, checkpoints_dir, keep_last)
    return final_dir


def _make_complete(tmp_dir, final_dir, checkpoints_dir, keep_last):
    """Rank 0, once every rank has written: the manifest, the rename to step-N (a folder in the
    way moved aside), and the removal of the checkpoints beyond the newest `keep_last`."""
    _write_manifest(tmp_dir)
    if os.path.exists(final_dir):
        aside = stamped = f"{final_dir}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in itertools.count(2):
            if not os.path.exists(aside):
                break
            aside = f"{stamped}-{n}"
        os.rename(final_dir, aside)
        # On a line of its own: a progress bar may hold the current one.
        print(
            f"\nwarning: {final_dir} was in the way of this save; moved to {aside}",
            file=sys.stderr,
            flush=True,
        )
    os.rename(tmp_dir, final_dir)  # atomic: from here on step-N is complete
    older = complete_checkpoints(checkpoints_dir)[:-keep_last] if keep_last > 0 else []
    for _, path in older:
        # Hide first, then delete: a crash mid-delete must not leave a step-N that looks whole.
        hidden = os.path.join(checkpoints_dir, ".deleting-" + os.path.basename(path))
        os.rename(path, hidden)
        shutil.rmtree(hidden)


def load_checkpoint(model, optimizer, checkpoint_dir):
    """Load what `save_checkpoint` wrote into `model` and `optimizer` (built the same way, at any
    world size and strategy: DCP gives each rank its part of every tensor) and this rank's RNG;
    return the trainer state dict. Reading sharded state and setting it are collectives
    (all ranks participate)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    with checkpoint_warnings.quiet_checkpoint_warnings():
        tensors, _ = _tensor_state(model, optimizer)  # the shards to fill
        untied, tied = _untied(tensors)
        reader = dcp.HuggingFaceStorageReader(checkpoint_dir)
        dcp.load(untied, storage_reader=reader)  # (all ranks participate): each its shards
        tensors = {name: untied[tied.get(name, name)] for name in tensors}
        model_state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        optim_state = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
        optim_state.update(trainer_state["optimizer_hyperparameters"])
        set_state_dict(  # (all ranks participate)
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=StateDictOptions(**CHECKPOINT_OPTIONS),
        )
    random_state.set_rng_states(rng_for_rank(checkpoint_dir, rank))
    return trainer_state


def rng_for_rank(checkpoint_dir, rank):
    """Rank `rank`'s saved random-number generator states; for a rank the run had not (resumed at
    a larger world), a CPU stream of its own, drawn from rank 0's and the rank (another rank's
    would repeat its dropout masks)."""
    rng_file = os.path.join(checkpoint_dir, f"rng-rank-{rank}.safetensors")
    if os.path.exists(rng_file):
        return load_file(rng_file)
    rank0_state = load_file(os.path.join(checkpoint_dir, "rng-rank-0.safetensors"))["cpu"]
    digest = hashlib.blake2b(rank0_state.numpy().tobytes() + str(rank).encode(), digest_size=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest.digest(), "little"))
        return {"cpu": torch.get_rng_state()}


def restore_checkpoint(resume_dir, model, optimizer, scheduler, scaler, total_steps):
    """Loading sharded state is a collective (all ranks participate): the weights, AdamW's
    moments, this rank's RNG, the schedule and the loss scale. The data position is the step itself (every
    step's rows follow from the seed). Returns (start_step, best metric value so far); (0, None)
    when there is nothing to resume (resume_dir None)."""
    if resume_dir is None:
        return 0, None
    saved = load_checkpoint(model, optimizer, resume_dir)
    scheduler.load_state_dict(schedule_for_groups(saved["scheduler"], len(optimizer.param_groups)))
    if scaler:
        scaler.load_state_dict(saved["grad_scaler"])
    fsdp_utils.print0(f"resuming from {resume_dir} (step {saved['step']} of {total_steps})")
    return saved["step"], saved.get("best_value")


def schedule_for_groups(schedule, groups):
    """A saved learning-rate schedule's state for an optimizer with `groups` parameter groups.
    A checkpoint written before FSDP2's shard_grad_op gave the embedding tables a group of their
    own (sharding.wrap_fsdp2) has one group fewer, and one resumed at a world size or strategy
    without that group one more; every group follows the same schedule (__main__.py), so each
    per-group list holds one value, now given to every group. The schedule's function is a pure
    function of the step: its saved state (`lr_lambdas`) holds nothing, and is given per group too."""
    if len(schedule["base_lrs"]) == groups or len(set(schedule["base_lrs"])) != 1:
        return schedule
    one_each = {key: schedule[key][:1] * groups for key in ("base_lrs", "_last_lr", "lr_lambdas")}
    return {**schedule, **one_each}


def saved_state(checkpoint_dir):
    """The trainer state a checkpoint was written with: its config, the plan's record (world size,
    each set's batches), the schedule's state."""
    with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
        return json.load(f)


def newest_usable_checkpoint(checkpoints_dir):
    """(path, skipped): the newest checkpoint that is complete (see checkpoint_problem)
    and holds finite weights, or None; and [(path, why)] of the newer ones passed over. By the
    global-batch rule a run resumed from an older checkpoint still ends with the same weights."""
    skipped = []
    for _, path, problem in reversed(list_checkpoints(checkpoints_dir)):
        if problem is None:
            with open(os.path.join(path, "trainer_state.json")) as f:
                if json.load(f).get("weights_finite", True):
                    return path, skipped
            problem = "its weights are not finite (the run had diverged when it was saved)"
        skipped.append((path, problem))
    return None, skipped


def weights_finite(model, device):
    """Whether every weight is finite, on every rank's shard: an all_reduce (all ranks participate)."""
    non_finite = torch.zeros((), device=device)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
        non_finite += (~torch.isfinite(local.detach())).sum()
    if dist.is_initialized():
        dist.all_reduce(non_finite)  # (all ranks participate): every rank's shard counts
    return non_finite.item() == 0


def check_loss_finite(step_losses, output_dir):
    """FloatingPointError (exit 3) for the first loss of `step_losses` ([(step, loss)]: those since
    the last check, metrics.StepMeter.read_losses) that is NaN or inf: its step, and the newest
    checkpoint a rerun can start from. Every rank holds the same losses, so every rank raises."""
    step, loss_value = next(((s, v) for s, v in step_losses if not math.isfinite(v)), (None, None))
    if step is None:
        return
    usable, skipped = newest_usable_checkpoint(os.path.join(output_dir, "checkpoints"))
    passed_over = "".join(f" ({path}: {problem})" for path, problem in skipped)
    raise FloatingPointError(
        f"the loss is {loss_value} at step {step}; stopped before anything was written after it. "
        f"Newest checkpoint with finite weights: {usable or 'none'}{passed_over}"
        f"{'' if usable or skipped else ' (use --save-steps)'}. "
        "Lower --lr, use --precision fp32 or bf16, or check the data"
    )


# ----------------------------------------------------------------------------------------------
# Resuming: which checkpoint, and only for the same run


def checkpoint_to_resume(output_dir, resume, overwrite, flags, fingerprint, fingerprint_before_arrow=None):
    """The checkpoint a run with --output-dir `output_dir`, --resume `resume` ("", "auto" or a
    folder) and --overwrite `overwrite` continues from (None: start fresh), or "finished" when
    `output_dir` already holds the finished run. Refuses to overwrite anything by accident; with
    --resume, `resumed_checkpoint` also refuses to continue a run with other settings or other
    training data."""
    final_dir, checkpoints_dir = (
        os.path.join(output_dir, "final"),
        os.path.join(output_dir, "checkpoints"),
    )
    if os.path.exists(final_dir) and not overwrite and not resume:
        raise ValueError(
            f"{final_dir} already holds a finished run's export; "
            "pass --overwrite to replace it, or another --output-dir"
        )
    if resume:
        return resumed_checkpoint(output_dir, resume, overwrite, flags, fingerprint, fingerprint_before_arrow)
    # complete or not: an unfinished run's state either way
    found = list_checkpoints(checkpoints_dir)
    if found and not overwrite:
        raise ValueError(
            f"{checkpoints_dir} holds checkpoints of an unfinished run (newest: step {found[-1][0]}); "
            "pass --resume auto to continue it, or --overwrite to start over"
        )
    return None


def resumed_checkpoint(output_dir, resume, overwrite, flags, fingerprint, fingerprint_before_arrow):
    """checkpoint_to_resume with --resume: the checkpoint folder, "finished", or None (no usable
    checkpoint). `flags`: the run's flags as a dict (the Plan's `flags`), compared with the
    checkpoint's, and `fingerprint` with its data's (a checkpoint written before fingerprints
    hashed Arrow's buffers is compared with `fingerprint_before_arrow()`, computed only then)."""
    final_dir = os.path.join(output_dir, "final")
    if os.path.exists(final_dir) and not overwrite:
        # e.g. torchrun restarting a job that had already exported: nothing to do, provided it
        # is the same run (another one would silently "finish" without training).
        with open(os.path.join(final_dir, "training_config.json")) as f:
            check_same_run(flags, json.load(f), fingerprint, final_dir, fingerprint_before_arrow)
        return "finished"
    resume_dir = resume
    if resume == "auto":
        resume_dir, skipped = newest_usable_checkpoint(os.path.join(output_dir, "checkpoints"))
        for path, problem in skipped:
            fsdp_utils.print0(f"warning: not resuming from {path}: {problem}")
        if resume_dir is None:
            if skipped:
                fsdp_utils.print0(
                    "warning: no usable checkpoint is left: training starts from step 0 "
                    "(the same steps, so the same result)"
                )
            return None
    with open(os.path.join(resume_dir, "trainer_state.json")) as f:
        saved = json.load(f)
    check_same_run(flags, {**saved["config"], **saved}, fingerprint, resume_dir, fingerprint_before_arrow)
    return resume_dir


def check_same_run(flags, saved, fingerprint, where, fingerprint_before_arrow=None):
    """`saved` (a checkpoint's or an export's config and derived values) must describe this run
    (`flags`: its config as a dict):
    every setting but those a resume may change, and the training data. The number of processes
    may change: run_plan.resumed_batches keeps the global batch."""
    saved_fingerprint = saved.get("train_data_fingerprint", fingerprint)
    if "arrow-sha256" not in saved_fingerprint and fingerprint_before_arrow is not None:
        fingerprint = fingerprint_before_arrow()  # saved by an earlier version, hashed as it hashed
    current = flags
    may_change = {
        field.name
        for field in dataclasses.fields(config.Config)
        if field.metadata["rules"]["resume_may_change"]
    }
    # a flag of config.FROM_CHECKPOINT_WHEN_UNSET left unset takes the checkpoint's value
    may_change |= {k for k in config.FROM_CHECKPOINT_WHEN_UNSET if current.get(k) is None}
    diffs = [
        f"--{k.replace('_', '-')} {saved[k]!r} (this run: {current[k]!r})"
        for k in current
        if k in saved and k not in may_change and current[k] != saved[k]
    ]
    if saved_fingerprint != fingerprint:
        diffs.append(
            f"other training data ({saved['train_data_fingerprint']}; "
            f"--train-data {current['train_data']} now: {fingerprint}), "
            "so the steps ahead would take other rows"
        )
    if diffs:
        raise ValueError(
            f"cannot resume from {where}: it was written with "
            + "; ".join(diffs)
            + ". Resume with the same settings and data, or start a fresh --output-dir"
        )


# ----------------------------------------------------------------------------------------------
# One run per output folder: the lock, and what earlier runs left


LOCK_NAME = ".lock"


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


def take_output_lock(output_dir, run_id=""):
    """Rank 0: create OUTPUT_DIR/.lock atomically, naming this run (host, pid, start time,
    `run_id`), and remove it when the process ends. Returns None, or why the folder is taken. A
    lock whose process is dead on this host (a run killed with SIGKILL), or that this very
    process left (an earlier main() in a notebook), is taken over with a note. A lock from
    another host is never taken over, even when its pid is ours: pids repeat across hosts, and
    whether that run lives cannot be told from here."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "run": run_id,
    }
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if problem := lock_holder_alive(path, me, output_dir):
            return problem
        os.remove(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
    except OSError as e:  # a full disk: refused like any output folder that cannot be written
        os.remove(path)
        return f"--output-dir {output_dir}: cannot write {path} ({e}); free space on its disk"
    atexit.register(release_output_lock, output_dir)  # also when the run fails with an exception
    return None


def lock_holder_alive(path, me, output_dir):
    """Why the lock at `path` still holds (its run lives, or runs on another host), or None, with
    a note, when its run is dead on this host or is this very process (`me`)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        # torn by a crash while it was written
        holder = {"host": me["host"], "pid": -1, "started": "?"}
    if holder.get("host") != me["host"] or (
        holder.get("pid") != me["pid"] and process_alive(holder.get("pid"))
    ):
        return (
            f"--output-dir {output_dir} is in use by another run "
            f"(host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')}); "
            "wait for it to end, or choose another --output-dir. "
            f"If that run is dead on another host, remove {path}"
        )
    print(
        f"note: {path} was left by a run that is no longer alive "
        f"(pid {holder.get('pid')}, since {holder.get('started')}); taking it over",
        flush=True,
    )
    return None


def read_output_lock(output_dir):
    """The text of OUTPUT_DIR/.lock as this process sees it ("" when there is none)."""
    try:
        with open(os.path.join(output_dir, LOCK_NAME)) as f:
            return f.read()
    except OSError:
        return ""


def process_alive(pid):
    """Whether a process of this host runs. An exited one not yet reaped (a zombie) does not:
    when a launcher is killed its workers' parent becomes init, and for a moment after they exit
    they are zombies, which signal 0 still reaches."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # alive under another user, or unreadable: never take it over
    try:
        with open(f"/proc/{int(pid)}/stat") as f:  # Linux: "PID (NAME) STATE ..."
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc here: signal 0 is all there is


def release_output_lock(output_dir):
    """Rank 0: remove the lock if it is this process's (never another run's: on a folder that
    several hosts share, a rank on another host may have rank 0's pid)."""
    path = os.path.join(output_dir, LOCK_NAME)
    try:
        with open(path) as f:
            holder = json.load(f)
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            os.remove(path)
    except (OSError, ValueError):
        pass


def prepare_output_dir(output_dir, overwrite):
    """Rank 0, after the start-up checks: what earlier runs left in `output_dir` that must not be
    kept (`overwrite`, starting over: the old run's checkpoints too)."""
    checkpoints_dir = os.path.join(output_dir, "checkpoints")
    if overwrite:
        shutil.rmtree(
            checkpoints_dir, ignore_errors=True
        )  # starting over: the old run's state must not be resumed
    # Exports are written as NAME.tmp-PID and swapped in through NAME.old-PID: a process killed
    # in between leaves these behind, never a half-written NAME.
    for leftover in glob.glob(os.path.join(glob.escape(output_dir), "*.tmp-*")) + glob.glob(
        os.path.join(glob.escape(output_dir), "*.old-*")
    ):
        shutil.rmtree(leftover, ignore_errors=True)
    # Checkpoints: a save killed before its rename, or a removal killed half-way (never resumed from).
    for leftover in glob.glob(os.path.join(glob.escape(checkpoints_dir), ".incomplete-step-*")) + glob.glob(
        os.path.join(glob.escape(checkpoints_dir), ".deleting-*")
    ):
        shutil.rmtree(leftover, ignore_errors=True)
