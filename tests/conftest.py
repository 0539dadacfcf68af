"""Shared helpers for the tests: paths, and running train.py as a subprocess.

Run the whole suite:  python -m pytest tests
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_DIR = Path(__file__).resolve().parents[1]
# The real public data sets live beside the repository (../shared/data); FSDP_EMBED_DATA moves them.
DATA_DIR = Path(os.environ.get("FSDP_EMBED_DATA", REPO_DIR.parent / "shared" / "data"))
sys.path.insert(0, str(REPO_DIR))


def data_file(name):
    path = DATA_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: the tests train on the real data in ../shared/data (or set FSDP_EMBED_DATA)")
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(args, nproc=1, cwd=None, timeout=600, check=True):
    """Run train.py as a user would: `python train.py` or `torchrun --nproc_per_node=N train.py`.
    Collectives get a finite timeout, so a hang fails the test instead of stalling CI."""
    script = str(REPO_DIR / "train.py")
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", script]
    if "--dist-timeout-minutes" not in args:
        args = [*args, "--dist-timeout-minutes", "3"]
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=cwd or REPO_DIR, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r]
