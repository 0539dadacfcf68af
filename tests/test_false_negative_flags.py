"""--false-negative-margin and --hardness-mode through the full trainer (the losses themselves:
test_false_negatives.py, against sentence-transformers and naive loops).

- world 2 with gathered negatives trains as world 1 with the whole batch (per-step losses,
  gradient norms, every exported tensor), with the self-guided margin (Qwen3-Embedding's rule)
  and with hardness weighting (in_batch_negatives, Lan et al.'s alpha 9), under DDP and FSDP2;
- each flag changes the training (the per-step losses differ from plain MNRL's);
- a flag that cannot act is refused at start-up: without an mnrl file, or a strength of 0.

Run: python -m pytest tests/test_false_negative_flags.py
"""

import pytest
from conftest import assert_same_training, data_file, read_metrics, start_up, warm_run

from fsdp_embed import config

NUM_STEPS = 4


def common_args(model, per_device_batch_size, out, extra=()):
    return [
        *("--model", model, "--loss", "mnrl", "--train-data", data_file("sick-triplets-train.jsonl")),
        *("--max-steps", NUM_STEPS, "--per-device-batch-size", per_device_batch_size, "--lr", 1e-3),
        *("--dropout", 0, "--max-seq-length", 32, "--log-steps", 1, "--seed", 3, "--max-grad-norm", 0.1),
        *("--gather-negatives", "--output-dir", out, *extra),
    ]


FLAGS = {
    "margin": ["--false-negative-margin", 0.0],  # 0.1 masks nothing on a random model: its cosines are close
    "hardness": ["--hardness-mode", "in_batch_negatives", "--hardness-strength", 9],
    "both, symmetric": ["--false-negative-margin", 0.0, "--hardness-mode", "all_negatives"]
    + ["--hardness-strength", 5, "--symmetric"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    done = {}

    def run(name, flags, nproc, extra=()):
        if name not in done:
            out = tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", ""))
            warm_run(common_args(tiny_model, 8 // nproc, out, [*flags, *extra]), nproc=nproc)
            done[name] = out
        return done[name]

    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", list(FLAGS))
def test_world_2_with_gathered_negatives_trains_as_world_1(runs, name, strategy):
    want = runs(f"{name} world 1", FLAGS[name], 1)
    got = runs(f"{name} {strategy}", FLAGS[name], 2, ["--strategy", strategy])
    assert_same_training(got, want, NUM_STEPS)
    plain = runs("plain world 1", [], 1)
    assert any(abs(g["loss"] - p["loss"]) > 1e-4 for g, p in zip(read_metrics(want), read_metrics(plain)))


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--loss", "cosent", "--false-negative-margin", "0.1"],
            "--false-negative-margin needs a --train-data",
        ),
        (["--hardness-mode", "hard_negatives"], "--hardness-strength 0 weights nothing"),
    ],
)
def test_a_flag_that_cannot_act_is_refused(tmp_path, tiny_model, flags, expected):
    train_data = data_file(
        "sick-relatedness-train.jsonl" if "cosent" in flags else "sick-triplets-train.jsonl"
    )
    args = ["--model", str(tiny_model), "--train-data", train_data, "--output-dir", str(tmp_path / "out")]
    cfg = config.parse_config(args + flags)
    with pytest.raises(ValueError, match=expected):
        start_up(cfg)
