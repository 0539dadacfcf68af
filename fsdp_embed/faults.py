"""Faults in the middle of a run: each ends with one `error:` line and an exit code that tells a
scheduler what to do. Start-up problems end the same way (startup_checks.py, exit 2).

  exit  what happened                                         what to do
  2     bad input: flags, data, model files, output folder    fix it; a retry fails the same way
  3     the loss turned NaN or inf                            do not retry as is: lower --lr, ...
  4     a peer rank lost or silent (its host, link, process)  retry: --resume auto goes on from
                                                              the newest complete checkpoint
  5     the output disk full (or failing) in a save or export free space, then retry as for 4
  1     anything else: a bug, with its traceback

The line says what happened and where, the newest complete checkpoint, and the fix;
FSDP_EMBED_TRACEBACK=1 adds the stack. Under torchrun the rank that prints the line also writes it
to that worker's error file (TORCHELASTIC_ERROR_FILE, set by torchrun), so torchrun's failure
summary shows it. torchrun itself exits 1 when any worker fails; a torchrun started with its own
TORCHELASTIC_ERROR_FILE=PATH copies the worker's exit code to "errorCode" in PATH.

  - `end_run(error, timeout_minutes, newest_checkpoint)`: the exception a run ended with -> line and code;
  - the disk: `check_space` before a checkpoint or an export is written (all ranks participate),
    `agreed_writes` around its writes (all ranks participate: a write that failed on any rank
    stops every rank, with nothing left looking complete), `warn_space` at start-up;
  - a lost or silent peer: `lost_peer`, `Heartbeat` (who went silent, when, at which step),
    `watch_sigterm` (a rank that torchrun stops after a peer was killed says so first),
    `end_job`, `kill_once_reaped`, `stop_launcher_if_stuck`.

Needs torch only (the newest checkpoint comes from the caller: checkpoints.py in __main__.py).
"""

import atexit
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

BAD_INPUT, DIVERGED, LOST_PEER, DISK = 2, 3, 4, 5
MB = 10**6


# ----------------------------------------------------------------------------------------------
# The disk: room checked before writing, writes agreed after


class DiskFull(Exception):
    """A checkpoint or an export did not fit, or its writes failed (exit 5)."""

    def __init__(self, what, folder, need=None, cause=None, room=None):
        self.what, self.folder, self.need, self.cause = what, folder, need, cause
        self.room = room  # (bytes, inodes) free when it was found, if measured then
        super().__init__(f"{what} at {folder}")


def free_space(folder):
    """(bytes, inodes) a process may still use on the file system of `folder` (or of its nearest
    existing parent, for a folder not made yet)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize, stat.f_favail


def global_bytes(tensors):
    """Bytes of the tensors whole: a DTensor's (FSDP2) or ShardedTensor's (FSDP1) shape is the
    whole tensor's, so this is what all ranks together write, each replicated tensor once (DCP
    writes a tensor that every rank holds whole, as under DDP, from one rank)."""
    return sum(t.shape.numel() * t.dtype.itemsize for t in tensors)


def flag_device():
    """Where the ranks' flags meet: the current CUDA device under NCCL, else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def check_space(folder, need, what):
    """A broadcast (all ranks participate): stop every rank with DiskFull, before anything is
    written, when rank 0 finds less than `need` bytes free at `folder` (checkpoints and exports
    are on a disk that rank 0 sees: the start-up checks make sure)."""
    short, room = torch.zeros(1, device=flag_device()), None
    if not dist.is_initialized() or dist.get_rank() == 0:
        room = free_space(folder)
        short[0] = float(room[0] < need)
    if dist.is_initialized():
        dist.broadcast(short, src=0)  # (all ranks participate): rank 0's verdict
    if short.item():
        raise DiskFull(what, folder, need, room=room)


WRITE_ERROR_SIGNS = ("No space left on device", "Disk quota exceeded", "Errno 28", "StorageFull")


def is_write_error(error):
    """Whether `error` is the disk's: an OSError, or what DCP (CheckpointException, every rank's
    failure as text) or safetensors (SafetensorError) make of one."""
    if isinstance(error, (OSError, DiskFull)):  # DiskFull: from an agreement inside another
        return True
    return any(sign in str(error) for sign in WRITE_ERROR_SIGNS)


@contextlib.contextmanager
def agreed_writes(what, folder, clean_up=lambda: None):
    """Run this rank's writes (the block), then learn whether any rank's failed: an all_reduce,
    which is also a barrier (all ranks participate). Without it a rank whose write failed would leave the
    others waiting in the next collective until --dist-timeout-minutes. A failure anywhere:
    rank 0 runs `clean_up` (removes what was half written), then every rank raises DiskFull
    (a disk error) or its own error. A rank whose block lost a peer (DCP's collectives timed out)
    raises at once instead, with gloo's words: the agreement could only fail too, and the folder
    stays named .incomplete-step-N, removed at the next start."""
    error = None
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = e  # each rank goes on to the all_reduce below..
    lost = lost_peer(error) if error is not None else None
    if lost is not None:  # ...unless a peer is gone: the all_reduce would wait the timeout again
        raise RuntimeError(lost) from error
    code = 0.0 if error is None else 1.0 if is_write_error(error) else 2.0
    failed = torch.tensor([code], device=flag_device())
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # (all ranks participate): the worst outcome
    if failed.item() != 0:
        raise_write_failure(what, folder, clean_up, error, another_failed=failed.item() == 2)


def raise_write_failure(what, folder, clean_up, error, another_failed):
    """agreed_writes after a failed write on some rank: rank 0 cleans up, then every rank raises
    its own error where it is not a disk's, or else a RuntimeError where another rank's is not a
    disk's (`another_failed`), or else DiskFull."""
    room = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        room = free_space(folder)  # as the failed write left it
        clean_up()
    if isinstance(error, DiskFull) or (error is not None and not is_write_error(error)):
        raise error
    if another_failed:
        raise RuntimeError(f"another rank failed while writing {what} at {folder}")
    raise DiskFull(what, folder, cause=error, room=room)


def disk_message(error, newest_checkpoint):
    """The exit-5 line: what did not fit where, how much is free and needed, what is safe."""
    free, inodes = error.room or free_space(error.folder)
    room = f"{free / MB:.0f} MB free" + (", no free inodes" if inodes == 0 else "")
    need = f", about {error.need / MB:.0f} MB needed" if error.need else ""
    seen = f" ({first_line(error.cause)})" if error.cause else ""
    done = "nothing was written" if error.need else "what was half written is removed"
    full = error.need or inodes == 0 or any(sign in str(error.cause) for sign in WRITE_ERROR_SIGNS)
    return (
        f"the disk {'is full' if full else 'failed'} writing {error.what}: {error.folder} has "
        f"{room}{need}{seen}; {done}. "
        f"Newest complete checkpoint: {newest_checkpoint or 'none (use --save-steps)'}. Free space "
        "(or lower --save-total-limit, or choose another --output-dir), then run the same command "
        "with --resume auto"
    )


def first_line(error):
    """The line of `error` that says what the disk said (DCP puts every rank's traceback in its
    CheckpointException), else its first line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    said = [line for line in lines if any(sign in line for sign in WRITE_ERROR_SIGNS)]
    return (said or lines or [type(error).__name__])[-1 if said else 0][:300]


def warn_space(plan, parameter_counts, export_bytes):
    """Rank 0, at start-up: a warning line when the output folder's free space cannot hold what
    the run `plan` (run_plan.Plan: its output folder, steps and saves) will write: the checkpoints
    it keeps (one more while a save replaces the oldest; fp32 weights and AdamW's two fp32 moments
    for each trainable weight) and its exports of `export_bytes` (final/, and best/ with
    --metric-for-best)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    params, trainable = parameter_counts
    checkpoint = 4 * params + 8 * trainable
    saves = plan.total_steps // plan.save_steps if plan.save_steps else 0
    kept = min(saves, plan.save_total_limit + 1) if plan.save_total_limit else saves
    export = export_bytes * (2 if plan.metric_for_best else 1)
    need, free = kept * checkpoint + export, free_space(plan.output_dir)[0]
    if need > free:
        print(
            f"warning: {plan.output_dir} has {free / MB:.0f} MB free; this run writes about "
            f"{need / MB:.0f} MB ({kept} checkpoints of {checkpoint / MB:.0f} MB, exports of "
            f"{export / MB:.0f} MB): a save that does not fit will stop it (exit 5)",
            file=sys.stderr,
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# A peer lost or silent: gloo/NCCL's timeout finds it, the heartbeat names it

# What gloo and NCCL say when a peer is gone (its host, its link, or its process): a collective
# that waited out the process group's timeout, or a connection the other side closed.
LOST_PEER_SIGNS = (
    "Timed out waiting",  # gloo: no answer within the timeout
    "Connection closed by peer",  # gloo: the peer's process died (its kernel closed the socket)
    "Connection reset by peer",
    "Application timeout caused pair closure",  # gloo: another thread's collective timed out
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",  # NCCL
    "The client socket has failed to connect",  # the store, before any collective
)


def lost_peer(error):
    """The first line of `error` that says a peer rank is gone (timed out, or its connection
    closed), without the exception's name and gloo's source path; else None. DCP's
    CheckpointException (every rank's traceback as text) has it on a later line. A disk's own
    error (an OSError, as from a network file system) is the disk's, whatever it says."""
    if isinstance(error, (OSError, DiskFull)):
        return None
    lines = [line.strip() for line in str(error).splitlines() if any(s in line for s in LOST_PEER_SIGNS)]
    if not lines:
        return None
    # "torch.distributed.DistBackendError: [/pytorch/third_party/gloo/...cc:81] Timed out ..."
    line = re.sub(r"^[\w.]+: ", "", lines[0])  # the exception's name
    return re.sub(r"^\[/[^\]]*\] ", "", line)  # gloo's source path


class Heartbeat:
    """Every `interval` seconds a thread of each rank writes (host, pid, step, time) to the
    rendezvous store. A collective that times out says only that it waited; the heartbeats say
    who stopped: a rank whose heartbeat is old is silent as a whole process (stopped, swapped
    out, its host or link gone). `start()` starts the thread, once the process group (hence its
    store) is up; the loop sets `step` each step. Its own store client, so the process group's is
    never used from two threads; nothing when not launched by torchrun."""

    def __init__(self, interval=2.0):
        self.step, self.interval, self.store, self.silent_ranks = 0, interval, None, []
        self.store_unreachable = False
        self.stopped = threading.Event()

    def start(self):
        """Start the heartbeat thread (once; not without torchrun)."""
        if "RANK" not in os.environ or self.store is not None:
            return
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.store = self.connect()
        thread = threading.Thread(target=self.beat, daemon=True, name="heartbeat")
        thread.start()
        # At exit the thread ends first (never in a store call while the interpreter goes down).
        atexit.register(lambda: (self.stopped.set(), thread.join(timeout=10)))

    @staticmethod
    def connect(timeout_seconds=5):
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_seconds),
        )
        return dist.PrefixStore(f"heartbeat-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)

    def beat(self):
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        while not self.stopped.is_set():
            try:
                self.store.set(str(self.rank), json.dumps({**me, "step": self.step, "time": time.time()}))
            except Exception:  # the store's host may be the one gone: keep quiet
                return
            self.stopped.wait(self.interval)

    def silent(self):
        """[{rank, host, pid, step, seconds}] of the ranks whose last heartbeat is older than
        three intervals (read with a client of its own: the store's host may be gone)."""
        if self.store is None:
            return []
        try:
            store = self.connect()
            others = [str(r) for r in range(self.world_size) if r != self.rank]
            beats = {int(r): json.loads(store.get(r)) for r in others if store.check([r])}
        except Exception:  # the store is on rank 0's host, which may be the one gone
            self.store_unreachable = True
            return []
        now = time.time()
        self.silent_ranks = [
            {"rank": r, **beat, "seconds": now - beat["time"]}
            for r, beat in beats.items()
            if now - beat["time"] > 3 * self.interval
        ]
        return self.silent_ranks


HEARTBEAT = Heartbeat()  # this process's: __main__.py starts it before its loop, which sets its step


def lost_peer_message(lost, silent, step, newest_checkpoint, dist_timeout_minutes, ended=()):
    """The line a rank prints when another rank, its host or its link is gone mid-run (`lost`:
    lost_peer's words; `silent`: Heartbeat.silent's ranks; `ended`: ranks on this host whose
    process ended): who saw it, who is gone or silent, the newest complete checkpoint, and how to
    go on. When the rendezvous store does not answer either, its host is named."""
    who = [
        f"rank {e['rank']} on host {e['host']} (pid {e['pid']}) ended (killed or crashed)" for e in ended
    ] + [
        f"rank {s['rank']} on host {s['host']} (pid {s['pid']}) silent for {s['seconds']:.0f} s "
        f"(its last heartbeat at step {s['step']})"
        for s in silent
    ]
    if HEARTBEAT.store_unreachable:
        who.append(f"the rendezvous store on host {os.environ.get('MASTER_ADDR')} does not answer")
    return (
        f"rank {os.environ.get('RANK', '0')} on host {socket.gethostname()} lost contact with the "
        f"other ranks ({lost}; --dist-timeout-minutes {dist_timeout_minutes:g}) at step {step}"
        f"{': ' + '; '.join(who) if who else ''}. A host, its network link or one of its processes "
        f"is gone or stopped. Newest complete checkpoint: {newest_checkpoint or 'none (use --save-steps)'}. "
        + next_move()
    )


def next_move():
    """What happens next after a lost peer: torchrun restarts this host's processes where it has
    restarts left (--max-restarts; with --nnodes MIN:MAX and --resume auto they continue from the
    newest checkpoint at the world size that meets again: run_plan.resumed_batches), else the
    user runs the command again."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > restarts:
        return (
            f"torchrun restarts this host's processes (restart {restarts + 1} of "
            f"{os.environ['TORCHELASTIC_MAX_RESTARTS']}): with --resume auto they continue from that "
            "checkpoint, under --nnodes MIN:MAX with the hosts that meet again"
        )
    return "Once every host is back, run the same command on every host with --resume auto"


def end_job(code):
    """After a lost peer, end this process with `code` and no teardown (destroying a process
    group whose peer is gone can block), and make sure the job ends. Silent ranks on this host
    (stopped, or hung past the timeout) get SIGKILL, so their launcher ends or restarts the job
    at once instead of waiting 30 s for a stopped process to answer SIGTERM; the kill comes
    after this process's exit (kill_once_reaped). Otherwise torchrun ends by itself once it sees
    this exit, except on a host cut off from the rendezvous store, where it is killed only if it
    does not collect the exit (stop_launcher_if_stuck)."""
    host = socket.gethostname()
    silent = HEARTBEAT.silent_ranks
    if silent and all(s["host"] == host for s in silent):
        kill_once_reaped([s["pid"] for s in silent])
    elif no_restart_left():
        stop_launcher_if_stuck()
    os._exit(code)


# Run as a process of its own (it outlives the one that starts it): argv = the seconds to wait,
# the pid to outlive, then the pids to kill once it is gone (or the wait is over).
KILL_ONCE_REAPED = """
import os, signal, sys, time
wait, watched, pids = float(sys.argv[1]), sys.argv[2], [int(pid) for pid in sys.argv[3:]]
deadline = time.monotonic() + wait
while os.path.exists('/proc/' + watched) and time.monotonic() < deadline:
    time.sleep(0.005)
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""

# The same, for a launcher that may be stuck: argv = the seconds to wait, the pid to outlive, the
# launcher's pid, its error file and what to write there. Nothing if the exit is collected in time.
STOP_IF_STUCK = """
import os, signal, sys, time
wait, watched, launcher, error_file, data = float(sys.argv[1]), *sys.argv[2:]
deadline = time.monotonic() + wait
while os.path.exists('/proc/' + watched) and time.monotonic() < deadline:
    time.sleep(0.05)
if os.path.exists('/proc/' + watched):
    if error_file:
        with open(error_file + '.tmp', 'w') as f:
            f.write(data)
        os.replace(error_file + '.tmp', error_file)
    try:
        os.kill(int(launcher), signal.SIGKILL)
    except OSError:
        pass
"""


def after_exit(script, *args):
    """Start `script` with this process's pid after `args[0]`, in a session of its own (torchrun's
    SIGTERM goes to a worker's whole process group) and quiet. False without /proc (not Linux)."""
    me = os.getpid()
    if not os.path.isdir(f"/proc/{me}"):
        return False
    command = [sys.executable, "-S", "-c", script, str(args[0]), str(me), *map(str, args[1:])]
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.Popen(command, start_new_session=True, **quiet)
    return True


def kill_once_reaped(pids):
    """SIGKILL `pids` once this process has exited and its launcher has collected its exit (its
    /proc entry is gone), from a process of its own. Why not before this process exits: torchrun
    copies to its own error file the error file of the worker it saw fail first; a silent rank
    killed first writes none, so the exit code this process wrote (4) would be lost (seen under
    load). The helper gives up waiting after 10 s. Without /proc (not Linux): at once."""
    if not after_exit(KILL_ONCE_REAPED, 10, *pids):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def stop_launcher_if_stuck(grace_seconds=10):
    """SIGKILL torchrun's agent (this process's parent) if it has not collected this process's
    exit `grace_seconds` after it. A healthy agent looks at its workers every 0.1 s, then ends by
    itself (exit 1, its error file copied from the worker's): it is never signalled, since a
    SIGTERM makes torchrun end in a SignalException traceback with no exit code in its error file.
    The one agent that does not: under the c10d rendezvous, on a host cut off from the host that
    holds the store, the agent sits in a store call (up to --rdzv-conf read_timeout, 60 s by
    default; measured: minutes, closing the rendezvous after it) that no SIGTERM interrupts, then
    dies with the store's error and its traceback. The static rendezvous (--master-addr,
    --node-rank) makes no store call while its workers run, and ends by itself
    (docs/multi-node.md). A killed torchrun writes no error file: the helper writes this
    worker's report there first."""
    data = json.dumps(LAST_ERROR) if LAST_ERROR else ""
    after_exit(STOP_IF_STUCK, grace_seconds, os.getppid(), launcher_error_file() or "", data)


def no_restart_left():
    """Whether torchrun ends the job when a worker fails (TORCHELASTIC_MAX_RESTARTS: torchrun
    sets it to --max-restarts, 0 by default), rather than restarting the workers."""
    if "TORCHELASTIC_MAX_RESTARTS" not in os.environ:
        return False
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return restarts >= int(os.environ["TORCHELASTIC_MAX_RESTARTS"])


def launcher_error_file():
    """torchrun's own TORCHELASTIC_ERROR_FILE, set by whoever started it (a scheduler), read from
    its environment in /proc: torchrun gives each of its workers another one. None if unset, or
    not on Linux."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith(b"TORCHELASTIC_ERROR_FILE="):
                    return entry.split(b"=", 1)[1].decode() or None
    return None


def process_ended(pid, collected_only=False):
    """Whether process `pid` (on this host) has ended: its /proc entry gone (collected by its
    parent) or, unless `collected_only`, a zombie (ended, not yet collected)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return not collected_only and state in ("Z", "X")


def local_peers(timeout_seconds=10):
    """{rank: (pid, error file)} of this worker's siblings: the other workers of its launcher, as
    their /proc entries say (their parent, their RANK and TORCHELASTIC_ERROR_FILE). The launcher
    starts them together; one not yet running its program is looked for again, for up to
    `timeout_seconds`. {} without /proc, or where workers are forked rather than started as
    programs (their /proc environment is then their parent's)."""
    expected = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1
    parent, me, peers = str(os.getppid()), os.getpid(), {}
    deadline = time.monotonic() + timeout_seconds
    while os.path.isdir("/proc/self") and time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/stat") as f:
                    if int(pid) == me or f.read().rsplit(")", 1)[1].split()[1] != parent:
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                if b"RANK" in env:
                    peers[int(env[b"RANK"])] = (int(pid), env.get(b"TORCHELASTIC_ERROR_FILE", b"").decode())
        if len(peers) >= expected:
            break
        time.sleep(0.5)
    return peers


# ----------------------------------------------------------------------------------------------
# The end of a run that failed


def say(message, code, printed=True, launcher=False):
    """Print `error: message` on a line of its own (a progress bar may hold the current one), and
    give it to torchrun's error file for this worker with the code it exits with: torchrun's
    summary shows it, and copies the code to its own error file. `printed` False: only the file
    (a rank whose error rank 0 prints; every rank writes one, since torchrun reports whichever
    rank it saw stop first). `launcher`: also torchrun's own error file, when it has no restart
    left (a lost peer: see below)."""
    if printed:
        print(f"\nerror: {message}", file=sys.stderr, flush=True)
    # No "py_callstack": torchrun's summary shows it in place of the message, even when empty.
    data = {"message": f"error: {message}", "extraInfo": {"timestamp": str(int(time.time()))}}
    write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE"), {"message": {**data, "errorCode": code}})
    LAST_ERROR["message"] = {**data, "errorCode": code}
    if launcher and no_restart_left():
        # torchrun copies to its own error file the error file of the failure with the smallest
        # timestamp (whole seconds); a rank killed by a signal has none and is stamped when torchrun
        # collects it, mostly in the same second as this line, and a tie goes to the rank collected
        # first: the dead one. torchrun then writes nothing, and the code is lost (17 times in 19).
        # So the rank that names a killed peer writes torchrun's file itself. Should torchrun find a
        # root cause with a file of its own (this rank's), it replaces this one with that, and logs
        # what it replaced (a dozen "already exists and will be overwritten" lines): only here.
        write_error_file(launcher_error_file(), LAST_ERROR)


def write_error_file(path, data):
    """Whole or not at all (a temporary file, then a rename): torchrun reads a worker's file when
    the worker ends, and an empty or torn one crashes torchrun itself (JSONDecodeError), with no
    restart; seen once under --max-restarts, after the other rank was killed."""
    if not path:
        return
    partial = f"{path}.tmp-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        pass  # nowhere to write it: the printed line stands
    finally:
        with contextlib.suppress(OSError):
            os.remove(partial)  # there only when the write was cut short


LAST_ERROR = {}  # what say() last wrote to torchrun's error file for this worker

# One report per process: the main thread's (end_run) or the SIGTERM watch's, whichever starts
# first; the other stays quiet (and the process ends with the first one's code).
REPORTING = threading.Lock()


def end_run(error, timeout_minutes, newest_checkpoint):
    """The exit code for the exception `error` a run ended with, after its line is printed; None
    for an error this file does not know (a bug: the caller re-raises it, with its traceback).
    `newest_checkpoint()`: the path of the newest complete checkpoint, or None; `timeout_minutes`:
    --dist-timeout-minutes, named in a lost peer's line."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if isinstance(error, (ValueError, FloatingPointError, DiskFull)):
        # Bad input (startup_checks.StartUpError and the like), a non-finite loss (its message
        # names the checkpoint: __main__.py), the disk: every rank raised it, rank 0 says it.
        code = BAD_INPUT if isinstance(error, ValueError) else DIVERGED
        message = str(error)
        if isinstance(error, DiskFull):
            code, message = DISK, disk_message(error, newest_checkpoint()) if rank0 else ""
        say(message if rank0 else "rank 0 printed what happened", code, printed=rank0)
        return code
    lost = lost_peer(error)
    if lost is None:
        # A bug: its traceback follows. Its last line goes to torchrun as this rank's error, so that
        # the ranks that then lose this one are not taken for the cause (watch_sigterm).
        say(f"{type(error).__name__}: {error}".splitlines()[0], 1, printed=False)
        return None
    if not REPORTING.acquire(blocking=False):
        threading.Event().wait()  # the SIGTERM watch is saying it, and ends this process
    # Every rank that sees it says it: each knows only its own peers.
    report_lost_peer(lost, timeout_minutes, newest_checkpoint)
    return LOST_PEER


def report_lost_peer(lost, timeout_minutes, newest_checkpoint):
    """The lost-peer line, naming the peers on this host whose process ended (killed or crashed:
    any that ended with an error of its own wrote its own line) and the silent ones."""
    host = socket.gethostname()
    # A killed peer's sockets close a moment before its process is seen to end: look for 1 s.
    deadline = time.monotonic() + 1
    pids = [pid for pid, _ in LOCAL_PEERS.values()]
    while pids and not any(map(process_ended, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = [
        {"rank": rank, "host": host, "pid": pid, "killed": not os.path.exists(error_file or "/")}
        for rank, (pid, error_file) in sorted(LOCAL_PEERS.items())
        if process_ended(pid)
    ]
    silent = [s for s in HEARTBEAT.silent() if s["rank"] not in LOCAL_PEERS or not process_ended(s["pid"])]
    newest, timeout = newest_checkpoint(), timeout_minutes
    message = lost_peer_message(lost, silent, HEARTBEAT.step, newest, timeout, ended)
    say(message, LOST_PEER, launcher=any(e["killed"] for e in ended))


LOCAL_PEERS = {}  # {rank: (pid, error file)} of the other workers of this launcher (watch_sigterm)


def watch_sigterm(timeout_minutes, newest_checkpoint):
    """Under torchrun: when a worker dies, torchrun sends the others SIGTERM within 0.1 s. A rank
    that was not inside a collective then (a forward, the tokenizer) would die by that signal
    without a word (2 runs in 19, a rank killed at step 5). This watch makes such a rank say
    what happened first: on a SIGTERM that comes after a worker of the same torchrun ended
    without an error file of its own (killed: SIGKILL, the out-of-memory killer, a crash), it
    prints the lost-peer line naming that rank, writes it to the error files and exits 4. Any
    other SIGTERM (a scheduler's, Ctrl-C to torchrun, a peer that failed with its own line) ends
    the process as the signal always did. Main thread only (Python's signal calls)."""
    if "RANK" not in os.environ or not os.path.isdir("/proc/self"):
        return
    # Python runs a signal's handler in the main thread between two bytecodes, which a thread
    # blocked in native code (a gloo collective, a forward) reaches only when that returns. The
    # wakeup fd is written by the C handler the moment the signal arrives, and wakes this thread.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watch decides
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch():
        LOCAL_PEERS.update(local_peers())
        while True:
            if signal.SIGTERM not in os.read(read_end, 64):
                continue
            # Look at once: torchrun collects (reaps) the dead worker before it signals the others,
            # while on a SIGTERM from outside it signals every worker before it collects any, so
            # here no peer is collected yet (the check is within a few ms of the signal).
            ended = [
                rank
                for rank, (pid, error_file) in LOCAL_PEERS.items()
                if process_ended(pid, collected_only=True) and not (error_file and os.path.exists(error_file))
            ]
            if not ended:
                die_by_signal(signal.SIGTERM)
            if not REPORTING.acquire(blocking=False):
                continue  # the main thread is saying it (end_run), and exits with code 4
            lost = f"torchrun stopped this rank: rank {', '.join(map(str, ended))} ended"
            report_lost_peer(lost, timeout_minutes, newest_checkpoint)
            os._exit(LOST_PEER)

    threading.Thread(target=watch, daemon=True, name="sigterm-watch").start()


def die_by_signal(signum):
    """End this process by `signum` with its default action (as if no handler were set), from any
    thread: Python's signal.signal works in the main thread only."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(signum, 0)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(60)  # the signal ends the process before this does
