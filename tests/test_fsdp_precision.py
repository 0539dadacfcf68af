"""Mixed precision under FSDP (2 ranks, the tiny random BERT: a CPU without bf16 or fp16 units
takes several seconds a step of all-MiniLM-L6-v2 in either): bf16 and fp16 runs train (the loss
on trained rows falls), their export holds the fp32 master weights (not bf16/fp16-rounded
copies), `SentenceTransformer` loads it with embeddings equal to our model's on the same
weights, and a normal FSDP run (and one with gathered negatives) prints no
FutureWarning/DeprecationWarning from torch. bf16 on all-MiniLM-L6-v2 trains to the fp32 run's
quality: bench/bench_cosent_vs_st.py.

Run: python -m pytest tests/test_fsdp_precision.py
"""

import functools
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import data_file, load_model, loss_on_fixed_rows, run_train, warm_run
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

from fsdp_embed import config
from fsdp_embed import process_settings


TEXTS = ["A woman is slicing an onion.", "Nobody is riding the bike", "A dog runs after a ball in the park."]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.lru_cache
def loss_before_training(model, data):
    """The base model's loss on the fixed rows (with the seeded new head): once for all cases."""
    return loss_on_fixed_rows(str(model), "softmax", data)


@pytest.mark.parametrize("version,precision", [(1, "bf16"), (1, "fp16"), (2, "bf16"), (2, "fp16")])
def test_fsdp_mixed_precision_trains_and_exports_fp32(version, precision, tmp_path, tiny_model):
    data = data_file("sick-nli-train.jsonl")
    steps, lr = 6, 1e-3
    proc = warm_run(
        [
            "--model",
            tiny_model,
            "--loss",
            "softmax",
            "--train-data",
            data,
            "--max-steps",
            steps,
            "--per-device-batch-size",
            8,
            "--lr",
            lr,
            "--max-seq-length",
            48,
            "--log-steps",
            4,
            "--output-dir",
            tmp_path,
            "--strategy",
            "fsdp",
            "--fsdp-version",
            version,
            "--precision",
            precision,
        ],
        nproc=2,
    )
    for warning in ("FutureWarning", "DeprecationWarning"):
        assert warning not in proc.stderr, proc.stderr[-3000:]

    final = tmp_path / "final"
    before = loss_before_training(tiny_model, data)
    after = loss_on_fixed_rows(str(final), "softmax", data, head_file=final / "softmax_head.safetensors")
    print("loss on fixed rows, before and after:", before, after)
    assert after < 0.97 * before, (before, after)

    weights = load_file(final / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    # fp32 master weights, not low-precision copies: most values do not survive a round trip.
    w = weights["encoder.layer.0.attention.self.query.weight"]
    assert (w.to(LOW[precision]).float() != w).float().mean() > 0.5

    loaded = load_model(config.Config(model=str(final)), 0)
    loaded.model.eval()
    with torch.no_grad():
        ours = loaded.model(**loaded.tokenize(TEXTS))
    theirs = SentenceTransformer(str(final), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "extra",
    [["--fsdp-version", 1], ["--fsdp-version", 2, "--gather-negatives", "--symmetric", "--mask-duplicates"]],
    ids=["fsdp1", "fsdp2-gathered-negatives"],
)
def test_plain_fsdp_run_prints_no_torch_deprecation(tmp_path, tiny_model, extra):
    """Training, a checkpoint (torch's own DCP code warns about FSDP1's ShardedTensor unless
    silenced) and the export, on the tiny BERT; and gathered negatives (their all-gather and
    reduce-scatter, the text ids' all-gather: names torch 2.13 deprecated)."""
    proc = run_train(
        [
            "--model",
            tiny_model,
            "--loss",
            "mnrl",
            "--train-data",
            data_file("sick-pairs-train.jsonl"),
            "--max-steps",
            2,
            "--per-device-batch-size",
            4,
            "--max-seq-length",
            32,
            "--output-dir",
            tmp_path,
            "--strategy",
            "fsdp",
            "--save-steps",
            1,
            *extra,
        ],
        nproc=2,
    )
    assert (tmp_path / "checkpoints" / "step-2" / "trainer_state.json").exists()
    for warning in ("FutureWarning", "DeprecationWarning", "UserWarning"):
        assert warning not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("strategy,nproc", [("single", 1), ("ddp", 2), ("fsdp", 2)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_loss_runs_in_fp32_under_mixed_precision(tmp_path, tiny_model, strategy, nproc, precision):
    """Under --precision bf16 and fp16, on one process, DDP and FSDP alike, MNRL gets fp32
    embeddings and runs outside autocast: its loss equals the fp32 loss of the same embeddings
    to 1e-6, and differs from their loss under bf16 autocast (which casts the scores' matmul to
    bf16), so the test fails if autocast reaches the scores. The evaluation's encoder computes in
    that precision on every strategy: under autocast (single, DDP) or on FSDP's cast weights
    (tests/precision_worker.py)."""
    flags = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--loss", "mnrl"]
    flags += ["--max-steps", 1, "--per-device-batch-size", 8 // nproc, "--precision", precision]
    sts = tmp_path / "sts.jsonl"  # 64 pairs to evaluate on
    sts.write_text("".join(Path(data_file("stsb-dev.jsonl")).read_text().splitlines(True)[:64]))
    flags += ["--strategy", strategy, "--output-dir", tmp_path / "out", "--save-steps", 0, "--eval-data", sts]
    warm_run(flags, nproc=nproc, script=Path(__file__).parent / "precision_worker.py")
    for rank in range(nproc):
        seen = json.loads((tmp_path / "out" / f"loss-rank-{rank}.json").read_text())
        assert seen["dtype"] == "torch.float32" and not seen["autocast_on"], seen
        assert abs(seen["loss"] - seen["fp32"]) <= 1e-6 * abs(seen["fp32"]), seen
        assert abs(seen["under_autocast"] - seen["fp32"]) > 1e-4 * abs(seen["fp32"]), seen
        low = str(LOW[precision])
        computed = {
            autocast if strategy != "fsdp" else weight for autocast, weight in seen["evaluation_forwards"]
        }
        assert seen["evaluation_forwards"] and computed == {low}, seen["evaluation_forwards"]


@pytest.mark.quick
def test_tf32_is_on_for_fp32_on_cuda_only():
    """process_settings.set_tf32: TF32 for fp32 on a CUDA device unless --tf32 off; off under bf16 and
    fp16 (their loss is fp32); nothing changed on CPU. torch's switches exist without a GPU."""
    cuda = torch.device("cuda", 0)
    switches = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    before = switches()
    try:
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            assert process_settings.set_tf32(cuda, "fp32", "on").startswith("tf32: on")
            assert switches() == (True, True)
            for precision, tf32 in [("bf16", "on"), ("fp16", "on"), ("fp32", "off")]:
                assert process_settings.set_tf32(cuda, precision, tf32).startswith("tf32: off")
                assert switches() == (False, False)
        with mock.patch("torch.cuda.get_device_capability", return_value=(7, 0)):
            assert "no TensorFloat-32" in process_settings.set_tf32(cuda, "fp32", "on")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        assert process_settings.set_tf32(torch.device("cpu"), "fp32", "off") is None
        assert switches() == (True, True)  # unchanged on CPU
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.quick
def test_the_gpu_check_says_there_is_no_gpu_here_and_its_runs_parse():
    """bench/gpu_check.py on this machine (no GPU): it measures nothing, says so, and exits 0 once
    every run of the full trainer it would make has parsed (a flag the trainer lacks exits 2)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # 8 timed runs (2 GPUs assumed) and 3 whose micro-batches are watched for host waits
    assert "no GPU found: nothing measured; the 11 runs this check makes parse" in done.stdout
