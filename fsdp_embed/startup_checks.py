"""Start-up agreement: every rank's verdict on the start-up checks combined, so bad input stops every
rank with one message from rank 0, in the first seconds, before any weights load or any file is
written, and no rank walks on into a collective that would hang.

main() makes the run's plan in two steps on every rank (run_plan.py: the flags and the model's
files; the data and every step's rows): the first through `agreed`, the second through
`agreed_plan_locking_output`, which then checks that every rank reads rank 0's data and the
run is not finished already, takes rank 0's lock on the output folder, and tells the ranks which of
them see its disk.

    plan = startup_checks.agreed(lambda: run_plan.flags_plan(cfg, world_size, device), rank, device)
    plan = startup_checks.agreed_plan_locking_output(lambda: run_plan.data_plan(cfg, plan), rank, device)

Every function here is a collective (all ranks participate) but the two messages.

Needs torch, and fsdp_embed/checkpoints.py (the output folder's lock).
Its whole copy set (what it needs, directly or through another): fsdp_utils.py,
fsdp_embed/checkpoint_warnings.py, fsdp_embed/checkpoints.py, fsdp_embed/config.py,
fsdp_embed/faults.py, fsdp_embed/random_state.py.
"""

import dataclasses
import json
import os
import secrets
import socket

import torch
import torch.distributed as dist

from fsdp_embed import checkpoints


class StartUpError(ValueError):
    """Bad input that every rank found (or was told of) at start-up."""


def agreed(step, rank, device):
    """`step()`, a start-up step that may raise ValueError (run_plan.flags_plan, data_plan), on
    every rank, its verdicts combined (all ranks participate). Returns what it returned, or raises
    StartUpError with the first failing rank's message on every rank."""
    try:
        result, error = step(), None
    except ValueError as e:
        result, error = None, str(e)
    raise_if_any_failed(error, rank, device)
    return result


def agreed_plan_locking_output(data_plan, rank, device):
    """The Plan `data_plan()` returns (run_plan.data_plan, which may raise ValueError), agreed on
    (all ranks participate): every rank's verdict, then every rank reads rank 0's data, the run is
    not finished already, rank 0 takes the output folder's lock, and which ranks see its disk.
    Returns a new Plan with `finished` or `sees_output_dir`, or raises StartUpError with the first
    failing rank's message on every rank."""
    plan = agreed(data_plan, rank, device)
    if rank == 0 and plan.resume_note:
        print(plan.resume_note, flush=True)
    # Hosts without a shared disk read their own copies of the data: each rank checks that its
    # copy is rank 0's (rows and contents), or every rank would train on other batches.
    # (An empty one: --eval-only, or a run already finished, which reads no training data.)
    theirs = broadcast_text(plan.data_fingerprint, rank, device)
    differs = theirs and plan.data_fingerprint and theirs != plan.data_fingerprint
    error = different_data_problem(plan, rank, theirs) if differs else None
    raise_if_any_failed(error, rank, device)
    # The export lives on rank 0's disk, which other hosts may not see: rank 0's view decides.
    finished = broadcast_text("finished" if plan.finished else "", rank, device)
    if finished == "finished":
        if rank == 0:
            final_dir = os.path.join(plan.output_dir, "final")
            print(f"{final_dir} already holds this run's export: nothing left to do", flush=True)
        return dataclasses.replace(plan, finished=True)
    # One run per output folder: rank 0 takes the lock once every check passed (a refused run
    # writes nothing), and all ranks hear whether it got it. The lock names this run (`run_id`).
    run_id = secrets.token_hex(8)
    error = checkpoints.take_output_lock(plan.output_dir, run_id) if rank == 0 else None
    raise_if_any_failed(error, rank, device)
    # Which ranks share rank 0's disk: those that find rank 0's lock, with this run's id, in
    # their own --output-dir. Hosts without a shared file system do not (and a stale lock in
    # another host's folder has another id).
    lock = checkpoints.read_output_lock(plan.output_dir) if rank == 0 else ""
    lock = broadcast_text(lock, rank, device)
    sees = checkpoints.read_output_lock(plan.output_dir) == lock
    sees_output_dir = tuple(all_ranks_flags(sees, rank, device))
    error = None if sees else unshared_output_dir_problem(plan, rank, json.loads(lock)["host"])
    raise_if_any_failed(error, rank, device)
    return dataclasses.replace(plan, sees_output_dir=sees_output_dir)


def raise_if_any_failed(error, rank, device):
    """StartUpError with the first failing rank's message on every rank, if any rank failed:
    agree_on_error (all ranks participate)."""
    error = agree_on_error(error, rank, device)
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


def different_data_problem(plan, rank, rank0_fingerprint):
    """Why this rank's --train-data is not rank 0's (another copy, on another host)."""
    return (
        f"--train-data {plan.train_data} on host {socket.gethostname()} (rank {rank}) is not the "
        f"data rank 0 reads: {plan.data_fingerprint} here, {rank0_fingerprint} on rank 0. "
        "Copy the same files to every host (or put them on a disk all hosts share)"
    )


def unshared_output_dir_problem(plan, rank, writer_host):
    """Why this rank, which does not see rank 0's --output-dir, cannot run as asked (or None).
    The export travels to rank 0 over the process group; checkpoints do not: a resume needs
    every rank's shard, and each rank reads its own from the one folder."""
    if not (plan.save_steps or plan.resume_dir):
        return None
    what = f"--save-steps {plan.save_steps}" if plan.save_steps else f"resuming from {plan.resume_dir}"
    return (
        f"{what} needs one --output-dir that every host sees: rank {rank} (host "
        f"{socket.gethostname()}) does not see the {plan.output_dir} that rank 0 (host {writer_host}) "
        "writes. Put --output-dir on a file system all hosts share (NFS, Lustre, a mounted bucket), "
        "or train without --save-steps (the export needs no shared disk)"
    )


def agree_on_error(message, rank, device):
    """Combine every rank's verdict of the start-up checks: if any rank failed, every rank gets
    the first failing rank's message, so no rank walks on into a collective that would hang.
    Two collectives (all ranks participate). Text travels as bytes in a tensor: no pickling."""
    if not dist.is_initialized():
        return message
    failed = all_ranks_flags(message is not None, rank, device)
    if not any(failed):
        return None
    source = failed.index(True)
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
    if (error := agree_on_error(error, rank, device)) is not None:
        raise StartUpError(error)
    return result
