"""A launcher for the tests' numerical comparisons: what `torchrun --nproc_per_node=N -m
fsdp_embed ARGS` (or, for one process, `python -m fsdp_embed ARGS`) runs, without paying for the
imports again in every process.

Why: on a 2-core machine a launch of the full trainer spends ~5 s per process importing torch,
transformers and datasets, and the run a comparison needs takes about a second (a tiny model, a
few steps). This process does the trainer's imports once, then for each request forks the workers
from itself. With more than one, each gets the environment torchrun gives its workers (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT;
OMP_NUM_THREADS=1 at N > 1, as torchrun sets it; none of torchrun's TORCHELASTIC_* variables, so
the trainer never takes the launcher for torchrun's agent); each runs the package as `__main__`
(runpy.run_module), so its flag parsing, error handling and exit codes are the trainer's own. As
torchrun does, when one worker fails the others are stopped.

What this does not prove, and the tests that launch torchrun itself do: the launcher (its
rendezvous, restarts, exit codes and messages), what the trainer prints while importing, a worker
whose launcher dies, and a user's MALLOC_* variables (glibc reads them when a process starts).
Forking after the imports is what a DataLoader's fork workers do; this process runs no tensor
operation, so torch's thread pools are not started yet when it forks.

Protocol, one JSON object a line: a request on stdin {args, nproc, nnodes, script, port, env,
cwd, stdout, stderr, timeout}; the reply on stdout {"codes": [exit code of each rank]}. Workers
write to the request's stdout and stderr files. `nnodes` > 1 stands for that many torchruns on
this host (`--nnodes`, `--node_rank`), `script` for a test's worker that wraps the trainer.

Run by tests/conftest.py (warm_run), one per test session; it ends when pytest closes its stdin.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
FULL_TRAIN = REPO_DIR / "fsdp_embed" / "__main__.py"
sys.path.insert(0, str(REPO_DIR))

import torch  # noqa: E402
import transformers  # noqa: E402, F401
from transformers.models.bert import modeling_bert  # noqa: E402, F401  (the tiny BERT's code)
from transformers.models.llama import modeling_llama  # noqa: E402, F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402, F401

import fsdp_embed.__main__  # noqa: E402, F401  (everything the full trainer imports)

# runpy runs the entry afresh in each worker; left in sys.modules, it would warn there
del sys.modules["fsdp_embed.__main__"]


def worker(request, rank, reply_fd):
    """Never returns: runs the full trainer as rank `rank` and exits with its code."""
    code = 1
    try:
        if sys.platform.startswith("linux"):  # a worker does not outlive this launcher
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG, as the trainer's own
        os.close(reply_fd)  # the reply pipe is the launcher's alone
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
        nproc, nnodes = request["nproc"], request["nnodes"]
        os.environ.update(request["env"])
        if nproc * nnodes > 1:  # torchrun's workers; one process is `python -m fsdp_embed`, with none
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank % nproc),
                GROUP_RANK=str(rank // nproc),  # the "node": one torchrun per node on this host
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(nproc * nnodes),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(request["port"]),
            )
        if nproc > 1 and "OMP_NUM_THREADS" not in request["env"]:
            # torchrun's default; OpenMP read the variable when torch was imported, so set it too.
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        os.chdir(request["cwd"])
        script = request["script"] or "fsdp_embed"
        if script.startswith("fsdp_embed"):  # python -m fsdp_embed, python -m fsdp_embed.mine
            sys.argv = [str(FULL_TRAIN) if script == "fsdp_embed" else script, *request["args"]]
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"), as Python itself reports it
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a normal exit runs (the trainer releases its lock there)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def launch(request, reply_fd):
    """Fork the workers, wait for them all; on the first failure (or the timeout) stop the rest,
    SIGTERM then SIGKILL, as torchrun does."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["nproc"] * request["nnodes"]):
        pid = os.fork()
        if pid == 0:
            worker(request, rank, reply_fd)
        pids.append(pid)
    codes, stop_at, kill_at = {}, time.monotonic() + request["timeout"], None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and kill_at is None:
                stop_at = time.monotonic()
            continue
        now = time.monotonic()
        if now >= stop_at and kill_at is None:
            kill_at = now + 10
            for p in pids:
                if p not in codes:
                    os.kill(p, signal.SIGTERM)
        if kill_at is not None and now >= kill_at:
            for p in pids:
                if p not in codes:
                    os.kill(p, signal.SIGKILL)
        time.sleep(0.02)
    return [codes[p] for p in pids]


def main():
    reply = os.dup(1)
    os.dup2(2, 1)  # anything printed here goes to stderr; replies go to the saved stdout only
    with os.fdopen(reply, "w") as replies:
        for line in sys.stdin:
            codes = launch(json.loads(line), reply)
            replies.write(json.dumps({"codes": codes}) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
