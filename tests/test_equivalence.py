"""Distributed training is the same training as one process, through the full trainer itself (every
step's rows follow from the seed and the global batch alone, however they are split), fp32, dropout
0, a tiny random BERT (conftest.tiny_model: the mechanics do not depend on the model's size, and 16
launches of the real all-MiniLM-L6-v2 took 5 minutes), each run started by conftest.warm_run
(torchrun's environment, the package as `__main__`, without its imports again; the 2 x 2 mesh as two
torchruns on one host give it):

- DDP at 2 ranks with batch B == one process with batch B and 2 accumulation steps, every loss;
- FSDP1 and FSDP2, full_shard and shard_grad_op, at 2 ranks == the same (Softmax loss: its head
  lives in the FSDP root, outside the wrapped blocks);
- at 4 ranks: FSDP1 full_shard, and hybrid_shard on a 2 x 2 mesh (as two torchrun "nodes" of 2
  processes), FSDP1 and FSDP2 == one process with 4 accumulation steps (DDP at 4 ranks: the
  gathered-negatives runs of test_gradcache_gather.py).

Same means (conftest.assert_same_training): per-step losses and gradient norms to 1e-5
(relative) and every exported tensor to 1e-5 (absolute).

Run: python -m pytest tests/test_equivalence.py
"""

import pytest
import two_hosts
from conftest import assert_same_training, data_file, export_weights, read_metrics, run_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

DATA = {"mnrl": "sick-triplets-train.jsonl", "cosent": "stsb-train.jsonl", "softmax": "sick-nli-train.jsonl"}
NUM_STEPS = 5


def common_args(model, loss, per_device_batch_size):
    return [
        "--model",
        model,
        "--loss",
        loss,
        "--train-data",
        data_file(DATA[loss]),
        "--max-steps",
        NUM_STEPS,
        "--per-device-batch-size",
        per_device_batch_size,
        "--lr",
        1e-4,
        "--dropout",
        0,
        "--max-seq-length",
        48,
        "--log-steps",
        1,
        "--seed",
        3,
        # Gradient norms here are ~1: clip at 0.1 so clipping acts on every step, and a
        # norm computed from one rank's shard only would show.
        "--max-grad-norm",
        0.1,
    ]


@pytest.mark.parametrize("loss", list(DATA))
def test_ddp_two_ranks_equals_one_process_with_accumulation(runs, loss):
    reference = runs("accum2", loss, 8, ["--grad-accum-steps", 2])
    assert_same_training(runs("ddp2", loss, 8, nproc=2), reference, NUM_STEPS)


@pytest.mark.parametrize(
    "version,sharding", [(1, "full_shard"), (1, "shard_grad_op"), (2, "full_shard"), (2, "shard_grad_op")]
)
def test_fsdp_two_ranks_equals_ddp_and_one_process(runs, version, sharding):
    reference = runs("accum2", "softmax", 8, ["--grad-accum-steps", 2])
    fsdp = runs(
        f"fsdp{version}-{sharding}",
        "softmax",
        8,
        ["--strategy", "fsdp", "--fsdp-version", version, "--sharding", sharding],
        nproc=2,
    )
    assert_same_training(fsdp, reference, NUM_STEPS)
    assert_same_training(fsdp, runs("ddp2", "softmax", 8, nproc=2), NUM_STEPS)


@pytest.mark.parametrize(
    "name,extra,nproc,nnodes",
    [
        ("fsdp1-full-4", ["--strategy", "fsdp", "--fsdp-version", 1], 4, 1),
        ("fsdp1-hybrid-2x2", ["--strategy", "fsdp", "--fsdp-version", 1, "--sharding", "hybrid_shard"], 2, 2),
        pytest.param(
            "fsdp2-hybrid-2x2",
            ["--strategy", "fsdp", "--fsdp-version", 2, "--sharding", "hybrid_shard"],
            2,
            2,
            # Where two real hosts can be made, test_multi_node.py proves this across them.
            marks=pytest.mark.skipif(two_hosts.why_not() is None, reason="proven across two hosts"),
        ),
    ],
)
def test_fsdp_four_ranks_equals_one_process(runs, name, extra, nproc, nnodes):
    """hybrid_shard across 2 'nodes' of 2: without the explicit 2-D mesh FSDP1 would fall back
    to NO_SHARD with unreduced gradients on CPU, and the losses would part from step 2 on."""
    reference = runs("accum4", "softmax", 4, ["--grad-accum-steps", 4])
    assert_same_training(runs(name, "softmax", 4, extra, nproc=nproc, nnodes=nnodes), reference, NUM_STEPS)


def test_a_warm_launched_run_is_the_run_torchrun_launches(runs, tmp_path, tiny_model):
    """The runs above are started by conftest.warm_run (forked from a process that has done the
    imports); torchrun itself, with the same flags, trains bit for bit the same: every logged
    number and every exported tensor. FSDP2 at 2 ranks, the most machinery."""
    extra = ["--strategy", "fsdp", "--fsdp-version", 2, "--sharding", "full_shard"]
    warm = runs("fsdp2-full_shard", "softmax", 8, extra, nproc=2)
    torchrun = tmp_path / "torchrun"
    run_train([*common_args(tiny_model, "softmax", 8), *extra, "--output-dir", torchrun], nproc=2)
    numbers = ("step", "loss", "grad_norm", "lr")  # samples/s is a timing
    rows = [[tuple(r[k] for k in numbers) for r in read_metrics(d)] for d in (torchrun, warm)]
    assert rows[0] == rows[1] and len(rows[0]) == NUM_STEPS
    for name in ("model.safetensors", "softmax_head.safetensors"):
        got, want = export_weights(torchrun / "final", name), export_weights(warm / "final", name)
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want), name
