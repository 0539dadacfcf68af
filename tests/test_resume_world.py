"""Resuming at another number of processes, and across a change of strategy.

Each case trains 6 steps straight (a checkpoint every 2), then takes that run's output folder as
it stood after the step-2 checkpoint (its later checkpoints and export removed: a host lost
after step 2) and resumes it at another world size with the same command (`--resume auto`).
The resumed run keeps the checkpoint's global batch by the rule run_plan.resumed_batches states
(the accumulation scaled; with --gather-negatives the per-device batch), so it trains exactly
the rows of the unbroken run, and where each loss sees the same rows together it ends on the
unbroken run's weights: per-step losses and gradient norms (1e-5 relative), every exported
tensor (1e-5), with dropout 0. DDP 2 -> 1 and 2 -> 4, FSDP2 full_shard 2 -> 4, FSDP2
shard_grad_op 4 -> 2 with gathered negatives, FSDP1 4 -> 2 and no_shard 2 -> 1, and changes of
strategy at world 2: FSDP2 -> DDP, DDP -> FSDP2, FSDP1 -> FSDP2.

Also: metrics.jsonl and TensorBoard hold each step once, each row with the world size it ran
at; a resume that regroups the rows (2 -> 4 without accumulation to scale) says so and goes on;
one whose global batch cannot be kept (16 rows at 3 processes), or that asks for another, is
refused at start-up naming values that keep it.

Run: python -m pytest tests/test_resume_world.py
"""

import json
import shutil

import pytest
import torch
from conftest import assert_same_training, data_file, export_weights, read_metrics, start_up, warm_run

from fsdp_embed import checkpoints
from fsdp_embed import random_state
from fsdp_embed import config

NUM_STEPS = 6


def common_args(model, out, per_device_batch_size=4, extra=()):
    return [
        *("--model", model, "--loss", "mnrl", "--train-data", data_file("sick-pairs-train.jsonl")),
        *("--max-steps", NUM_STEPS, "--save-steps", 2, "--per-device-batch-size", per_device_batch_size),
        *("--lr", 1e-3, "--dropout", 0, "--max-seq-length", 32, "--log-steps", 1, "--seed", 3),
        *("--max-grad-norm", 0.1, "--output-dir", out, *extra),
    ]


def as_after_step_2(straight, broken):
    """`straight`'s output folder as a run lost after its step-2 checkpoint left it: the later
    checkpoints and the export gone (the lock file too: its run has ended)."""
    shutil.copytree(straight, broken)
    for path in [broken / "final", broken / ".lock"] + [
        broken / "checkpoints" / f"step-{step}" for step in range(3, NUM_STEPS + 1)
    ]:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    assert [step for step, _, _ in checkpoints.list_checkpoints(broken / "checkpoints")] == [2]


# name: (world, flags of the straight run, world resumed at, flags of the resumed run, the line it prints)
CASES = {
    "ddp 2 -> 1": (2, ["--strategy", "ddp"], 1, [], "per-device batch 4, accumulation 2"),
    "ddp 2 -> 4": (
        2,
        ["--strategy", "ddp", "--grad-accum-steps", 2],
        4,
        None,
        "per-device batch 4, accumulation 1",
    ),
    "fsdp2 full_shard 2 -> 4": (
        2,
        ["--strategy", "fsdp", "--sharding", "full_shard", "--grad-accum-steps", 2],
        4,
        None,
        "per-device batch 4, accumulation 1",
    ),
    "fsdp2 shard_grad_op 4 -> 2, gathered negatives": (
        4,
        ["--strategy", "fsdp", "--sharding", "shard_grad_op", "--gather-negatives"],
        2,
        ["--strategy", "fsdp", "--sharding", "shard_grad_op", "--gather-negatives"],
        "per-device batch 8, accumulation 1",
    ),
    "fsdp1 4 -> 2": (
        4,
        ["--strategy", "fsdp", "--fsdp-version", 1],
        2,
        None,
        "per-device batch 4, accumulation 2",
    ),
    "fsdp1 no_shard 2 -> 1": (
        2,
        ["--strategy", "fsdp", "--fsdp-version", 1, "--sharding", "no_shard"],
        1,
        ["--fsdp-version", 1, "--sharding", "no_shard"],
        "per-device batch 4, accumulation 2",
    ),
    "fsdp2 -> ddp at 2": (2, ["--strategy", "fsdp"], 2, ["--strategy", "ddp"], None),
    "ddp -> fsdp2 at 2": (2, ["--strategy", "ddp"], 2, ["--strategy", "fsdp"], None),
    "fsdp1 -> fsdp2 at 2": (2, ["--strategy", "fsdp", "--fsdp-version", 1], 2, ["--strategy", "fsdp"], None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumed_at_another_world_size_ends_on_the_unbroken_runs_weights(tmp_path, tiny_model, case):
    world, flags, resumed_world, resumed_flags, line = CASES[case]
    resumed_flags = flags if resumed_flags is None else resumed_flags
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    warm_run(common_args(tiny_model, straight, extra=flags), nproc=world)
    as_after_step_2(straight, broken)
    result = warm_run(
        common_args(tiny_model, broken, extra=[*resumed_flags, "--resume", "auto"]), nproc=resumed_world
    )
    assert f"resuming from {broken / 'checkpoints' / 'step-2'} (step 2 of 6)" in result.stdout
    if line:
        assert f"resuming at {resumed_world} processes (the checkpoint: {world}): {line}" in result.stdout
    assert "other in-batch negatives" not in result.stdout  # each loss sees the rows it saw
    assert_same_training(broken, straight, NUM_STEPS)
    got, want = export_weights(broken / "final"), export_weights(straight / "final")
    print(f"{case}: largest weight difference {max((got[k] - want[k]).abs().max().item() for k in want):.1e}")
    record = json.loads((broken / "final" / "training_config.json").read_text())
    resumed_config = config.parse_config([str(a) for a in resumed_flags])
    assert record["fsdp_version"] == resumed_config.fsdp_version and record["world_size"] == resumed_world
    assert record["strategy_used"] == ("single" if resumed_world == 1 else resumed_config.strategy)
    rows = read_metrics(broken)
    assert [(r["step"], r["world_size"]) for r in rows] == [(1, world), (2, world)] + [
        (step, resumed_world) for step in range(3, NUM_STEPS + 1)
    ]


def test_tensorboard_and_the_log_hold_each_step_once_across_the_change(tmp_path, tiny_model):
    """FSDP2 2 -> 4, without accumulation to scale: the per-device batch halves, the run says that
    each loss now sees 2 rows where it saw 4 (the same rows, other in-batch negatives) and goes on;
    metrics.jsonl and TensorBoard hold steps 1 to 6 once each, with the world size of each."""
    pytest.importorskip("tensorboard")
    from test_tracking import tensorboard_history

    straight, broken = tmp_path / "straight", tmp_path / "broken"
    flags = ["--strategy", "fsdp", "--report-to", "tensorboard"]
    warm_run(common_args(tiny_model, straight, extra=flags), nproc=2)
    as_after_step_2(straight, broken)
    result = warm_run(common_args(tiny_model, broken, extra=[*flags, "--resume", "auto"]), nproc=4)
    assert (
        "resuming at 4 processes (the checkpoint: 2): per-device batch 2, accumulation 1, global batch 8 "
        "as before; note: each loss now sees 2 rows together where it saw 4: the same rows, other "
        "in-batch negatives"
    ) in result.stdout
    rows = read_metrics(broken)
    assert [(r["step"], r["world_size"]) for r in rows] == [(s, 2 if s <= 2 else 4) for s in range(1, 7)]
    straight_rows = read_metrics(straight)
    assert [r["loss"] for r in rows[:2]] == [r["loss"] for r in straight_rows[:2]]
    assert abs(rows[2]["loss"] - straight_rows[2]["loss"]) > 1e-3  # step 3: the rows regrouped
    history = tensorboard_history(broken / "tensorboard")
    assert history["train/world_size"] == [(s, 2.0 if s <= 2 else 4.0) for s in range(1, 7)]
    assert [step for step, _ in history["train/loss"]] == list(range(1, 7))
    assert [value for _, value in history["train/loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


@pytest.fixture(scope="module")
def checkpoint_of_world_4(tmp_path_factory, tiny_model):
    """A run at world 4, 4 rows per device (global batch 16), stopped after its step-2 checkpoint."""
    straight = tmp_path_factory.mktemp("straight")
    warm_run(common_args(tiny_model, straight), nproc=4)
    return straight


@pytest.mark.quick
@pytest.mark.parametrize(
    "world,flags,expected",
    [
        (3, [], "no whole per-device batch or accumulation gives the global batch 16 at 3 processes"),
        (
            2,
            ["--per-device-batch-size", 3],
            "--per-device-batch-size 3 and --grad-accum-steps 1 give global batch 6, and another",
        ),
        (2, ["--per-device-batch-size", 2, "--grad-accum-steps", 4], None),  # 2 x 4 x 2 = 16: accepted
    ],
)
def test_a_resume_that_would_change_the_global_batch_is_refused(
    tmp_path, tiny_model, checkpoint_of_world_4, world, flags, expected
):
    broken = tmp_path / "broken"
    as_after_step_2(checkpoint_of_world_4, broken)
    args = common_args(tiny_model, broken, extra=["--resume", "auto"])
    cfg = config.parse_config([str(a) for a in args + flags])
    if expected is None:
        plan = start_up(cfg, world)
        assert plan.grad_accum_steps == 4 and plan.train_sets[0].per_device_batch_size == 2
        return
    with pytest.raises(ValueError) as error:
        start_up(cfg, world)
    message = str(error.value)
    assert message.startswith(
        "cannot resume from a checkpoint with global batch 16 (4 per device x 4 processes"
    )
    assert expected in message, message
    assert "whose per-device batch x accumulation x" in message and "resume at 4 processes" in message


def test_a_new_rank_draws_its_own_random_numbers(tmp_path):
    """A rank the checkpoint had not (resumed at a larger world) gets a stream of its own, not
    rank 0's: dropout masks would otherwise repeat across ranks."""
    folder = tmp_path / "step-2"
    folder.mkdir()
    torch.manual_seed(5)
    from safetensors.torch import save_file

    save_file({"cpu": torch.get_rng_state()}, str(folder / "rng-rank-0.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 2}))
    draws = []
    for rank in (0, 1, 2):
        torch.manual_seed(0)
        random_state.set_rng_states(checkpoints.rng_for_rank(folder, rank))
        draws.append(torch.rand(3))
    torch.manual_seed(5)
    assert torch.equal(draws[0], torch.rand(3))  # rank 0: its own saved state
    assert not torch.equal(draws[1], draws[0]) and not torch.equal(draws[2], draws[1])
