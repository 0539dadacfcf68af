"""Distributed training is the same training as one process (DESIGN.md, "global batches first"),
through train.py itself, fp32, dropout 0, a tiny random BERT (conftest.tiny_model: the mechanics
are the model's size-independent, and 16 launches of the real all-MiniLM-L6-v2 took 5 minutes):

- DDP at 2 ranks with batch B == one process with batch B and 2 accumulation steps, every loss;
- FSDP1 full_shard and FSDP2 full_shard, shard_grad_op at 2 ranks == the same (Softmax loss: its
  head lives in the FSDP root, outside the wrapped blocks);
- at 4 ranks: FSDP1 full_shard, and hybrid_shard on a 2 x 2 mesh (two torchrun "nodes" of 2
  processes), FSDP1 and FSDP2 == one process with 4 accumulation steps == DDP at 4 ranks.

Same means: per-step losses to 1e-5 (relative) and every exported tensor to 1e-5 (absolute).

Run: python -m pytest tests/test_equivalence.py
"""

import json
from pathlib import Path

import pytest
from conftest import data_file, read_metrics, run_train
from safetensors.torch import load_file

DATA = {"mnrl": "sick-triplets-train.jsonl", "cosent": "stsb-train.jsonl", "softmax": "sick-nli-train.jsonl"}


def common_args(model, loss, per_device_batch_size):
    return ["--model", model, "--loss", loss, "--train-data", data_file(DATA[loss]), "--max-steps", 5,
            "--per-device-batch-size", per_device_batch_size, "--lr", 1e-4, "--dropout", 0,
            "--max-seq-length", 48, "--log-steps", 1, "--seed", 3,
            # Gradient norms here are ~1: clip at 0.1 so clipping acts on every step, and a
            # norm computed from one rank's shard only would show.
            "--max-grad-norm", 0.1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """Runs train.py once per (name, ...) and remembers the output folder: the references are
    shared by several comparisons."""
    done = {}

    def run(name, loss, per_device_batch_size, extra=(), nproc=1, nnodes=1):
        key = (name, loss)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{name}-{loss}")
            run_train([*common_args(tiny_model, loss, per_device_batch_size), *extra, "--output-dir", out], nproc=nproc, nnodes=nnodes)
            done[key] = out
        return done[key]

    return run


def assert_same_training(run_dir, reference_dir):
    got, want = read_metrics(run_dir), read_metrics(reference_dir)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * max(1.0, abs(w["loss"])), (g, w)
        assert g["lr"] == w["lr"]
    for name in ["model.safetensors"] + (["softmax_head.safetensors"] if (reference_dir / "final" / "softmax_head.safetensors").exists() else []):
        got_weights = load_file(run_dir / "final" / name)
        want_weights = load_file(reference_dir / "final" / name)
        assert got_weights.keys() == want_weights.keys(), name
        worst = max((got_weights[k] - want_weights[k]).abs().max().item() for k in want_weights)
        assert worst <= 1e-5, (name, worst)
    # ...and training really moved the weights, so equality is not that of two untouched copies.
    base_model = json.loads((reference_dir / "final" / "training_config.json").read_text())["model"]
    base = load_file(Path(base_model) / "model.safetensors")
    trained = load_file(reference_dir / "final" / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in trained if k in base) > 1e-4


@pytest.mark.parametrize("loss", list(DATA))
def test_ddp_two_ranks_equals_one_process_with_accumulation(runs, loss):
    reference = runs("accum2", loss, 8, ["--grad-accum-steps", 2])
    assert_same_training(runs("ddp2", loss, 8, nproc=2), reference)


# FSDP1 shard_grad_op and no_shard left out to keep CI under 15 minutes (they passed in every run
# up to 2026-11-22); shard_grad_op stays covered through FSDP2.
@pytest.mark.parametrize("version,sharding", [(1, "full_shard"), (2, "full_shard"), (2, "shard_grad_op")])
def test_fsdp_two_ranks_equals_ddp_and_one_process(runs, version, sharding):
    reference = runs("accum2", "softmax", 8, ["--grad-accum-steps", 2])
    fsdp = runs(f"fsdp{version}-{sharding}", "softmax", 8, ["--strategy", "fsdp", "--fsdp-version", version, "--sharding", sharding], nproc=2)
    assert_same_training(fsdp, reference)
    assert_same_training(fsdp, runs("ddp2", "softmax", 8, nproc=2))


@pytest.mark.parametrize("name,extra,nproc,nnodes", [
    ("fsdp1-full-4", ["--strategy", "fsdp"], 4, 1),
    ("fsdp1-hybrid-2x2", ["--strategy", "fsdp", "--sharding", "hybrid_shard"], 2, 2),
    ("fsdp2-hybrid-2x2", ["--strategy", "fsdp", "--fsdp-version", 2, "--sharding", "hybrid_shard"], 2, 2),
])
def test_fsdp_four_ranks_equals_one_process(runs, name, extra, nproc, nnodes):
    """hybrid_shard across 2 'nodes' of 2: without the explicit 2-D mesh FSDP1 would fall back
    to NO_SHARD with unreduced gradients on CPU, and the losses would part from step 2 on."""
    reference = runs("accum4", "softmax", 4, ["--grad-accum-steps", 4])
    assert_same_training(runs(name, "softmax", 4, extra, nproc=nproc, nnodes=nnodes), reference)


def test_ddp_four_ranks_exports_what_fsdp_four_ranks_exports(runs):
    ddp = runs("ddp4", "softmax", 4, nproc=4)
    assert_same_training(runs("fsdp1-full-4", "softmax", 4, ["--strategy", "fsdp"], nproc=4), ddp)
