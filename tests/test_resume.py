"""Resumable checkpoints and self-healing restarts, through the full trainer (a tiny random BERT,
conftest.tiny_model, fp32, dropout ON (0.1): the RNG state is part of what must be restored).

Every case trains 6 steps with a checkpoint every 2, once straight and once broken, and the two
must give bitwise identical per-step losses, gradient norms and final weights:
- single process: killed (SIGKILL) after the step-2 checkpoint, then `--resume auto` by hand;
- DDP, 2 ranks: rank 1 SIGKILLs itself after the step-4 checkpoint, and
  `torchrun --max-restarts=1 ... --resume auto` finishes the job by itself;
- FSDP1, 2 ranks: rank 1 is killed in the middle of the step-4 save (after writing its shard,
  before the checkpoint is made visible): the half-written checkpoint is never resumed from,
  the step-2 one is, and the next save replaces the leftover;
- FSDP2, 2 ranks: self-healing as for DDP, killed after the step-2 checkpoint.
The kills come from outside the product: tests/kill_launcher.py runs the full trainer unchanged
after wrapping checkpoints.save_checkpoint (after-save) or the file writer inside it (in-save), and
the chosen rank SIGKILLs itself there, on the first torchrun attempt only.
The FSDP1 and FSDP2 broken runs also evaluate every 2 steps (STS and retrieval, keeping the best
export) and the straight runs do not: equality also proves that evaluation under FSDP, mid-training,
leaves the training untouched.

Run: python -m pytest tests/test_resume.py
"""

import json

import pytest
import torch
from conftest import data_file, read_metrics, run_train, warm_run
from safetensors.torch import load_file

COMMON = [
    "--train-data",
    data_file("sick-triplets-train.jsonl"),
    "--max-steps",
    6,
    "--save-steps",
    2,
    "--per-device-batch-size",
    4,
    "--max-seq-length",
    32,
    "--log-steps",
    1,
    "--lr",
    1e-3,
    "--seed",
    5,
]


def assert_bitwise_same_run(got_dir, want_dir):
    got, want = read_metrics(got_dir), read_metrics(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in got] == [
        (r["loss"], r["grad_norm"], r["lr"]) for r in want
    ]
    got_w, want_w = (
        load_file(got_dir / "final" / "model.safetensors"),
        load_file(want_dir / "final" / "model.safetensors"),
    )
    assert got_w.keys() == want_w.keys()
    assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)


@pytest.mark.parametrize(
    "name,extra,nproc,kill,max_restarts",
    [
        ("single", [], 1, "after-save:2:0", 0),
        ("ddp", ["--save-total-limit", 1], 2, "after-save:4:1", 1),
        ("fsdp1", ["--strategy", "fsdp", "--fsdp-version", 1], 2, "in-save:4:1", 0),
        ("fsdp2", ["--strategy", "fsdp", "--fsdp-version", 2], 2, "after-save:2:1", 1),
    ],
)
def test_a_broken_run_resumes_exactly(tmp_path, tiny_model, name, extra, nproc, kill, max_restarts):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    warm_run([*COMMON, "--model", tiny_model, *extra, "--output-dir", straight], nproc=nproc)
    evaluation = []
    if name.startswith("fsdp"):
        sts = tmp_path / "sts-dev.jsonl"
        sts.write_text("".join(open(data_file("stsb-dev.jsonl")).readlines()[:40]))
        pairs = tmp_path / "pairs-dev.jsonl"
        pairs.write_text("".join(open(data_file("sick-pairs-train.jsonl")).readlines()[-40:]))
        evaluation = [
            "--eval-data",
            f"{sts},{pairs}",
            "--eval-steps",
            2,
            "--metric-for-best",
            "sts-dev/spearman",
        ]
    args = [*COMMON, "--model", tiny_model, *extra, *evaluation, "--output-dir", broken, "--resume", "auto"]
    first = run_train(args, nproc=nproc, kill=kill, max_restarts=max_restarts, check=max_restarts > 0)
    checkpoints = broken / "checkpoints"
    if max_restarts == 0:
        # The job died (killed: SIGKILL's exit code, or torchrun's 1); nothing was exported, and
        # only complete checkpoints carry a step-N name.
        assert first.returncode in (-9, 1) and not (broken / "final").exists()
        if kill.startswith("in-save"):
            assert sorted(p.name for p in checkpoints.iterdir()) == [".incomplete-step-4", "step-2"]
        second = warm_run(args, nproc=nproc)
        resumed_from = "step-2"
    else:
        second = first  # torchrun restarted the ranks itself
        resumed_from = f"step-{kill.split(':')[1]}"
    assert f"resuming from {checkpoints / resumed_from}" in second.stdout + second.stderr
    assert_bitwise_same_run(broken, straight)
    if evaluation:
        rows = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval" in r]
        assert [r["step"] for r in evals] == [2, 4, 6]
        assert set(evals[0]["eval"]) == {
            "sts-dev/spearman",
            "sts-dev/pearson",
            "pairs-dev/mrr@10",
            "pairs-dev/ndcg@10",
            "pairs-dev/recall@1",
            "pairs-dev/recall@10",
        }
        assert (broken / "best" / "model.safetensors").exists()
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == (["step-6"] if "--save-total-limit" in extra else ["step-2", "step-4", "step-6"])
    state = json.loads((checkpoints / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["world_size"] == nproc and state["config"]["seed"] == 5
    if name == "single":
        # --resume auto on the finished run (torchrun restarting a job that had exported):
        # exits 0, rewrites nothing. (Without --resume it is refused: tests/test_bad_input.py.)
        before = (broken / "final" / "model.safetensors").stat().st_mtime_ns
        done = warm_run(args)
        assert "nothing left to do" in done.stdout
        assert (broken / "final" / "model.safetensors").stat().st_mtime_ns == before


def test_a_non_finite_loss_stops_before_the_update_and_keeps_the_last_checkpoint(tmp_path, tiny_model):
    """lr 1e30 wrecks the weights at the first update (still finite: about 1e30); step 2's loss
    is not finite. Training stops there, names the step and the newest checkpoint with finite
    weights, and writes nothing more."""
    from fsdp_embed import config
    from fsdp_embed import __main__ as full_train

    out = tmp_path / "run"
    cfg = config.parse_config(
        [
            str(a)
            for a in [
                *COMMON,
                "--model",
                tiny_model,
                "--lr",
                1e30,
                "--warmup-ratio",
                0,
                "--max-grad-norm",
                0,
                "--save-steps",
                1,
                "--output-dir",
                out,
            ]
        ]
    )
    with pytest.raises(
        FloatingPointError,
        match=r"the loss is (nan|inf) at step 2; .*Newest checkpoint with finite weights: .*step-1\. ",
    ):
        full_train.main(cfg)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    assert not (out / "final").exists()


def test_a_schedule_saved_with_one_parameter_group_fewer_resumes_on_the_same_rates():
    """A checkpoint written before FSDP2's shard_grad_op gave the embedding tables an optimizer
    group of their own holds the schedule of one group fewer; torch's LambdaLR then fails at the
    first step ("zip() argument 2 is shorter than argument 1"). checkpoints.schedule_for_groups
    gives it to every group: the rates equal those of a schedule run with the three groups from
    the start (transformers' get_linear_schedule_with_warmup: the formula full_train.build_training
    writes out, a LambdaLR too)."""
    from fsdp_embed import checkpoints
    import transformers

    def run(groups, steps):
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
        optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=2e-5)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, 10)
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
        return scheduler

    saved = run(2, 3).state_dict()
    unbroken, resumed, as_saved = run(3, 3), run(3, 0), run(3, 0)
    resumed.load_state_dict(checkpoints.schedule_for_groups(saved, 3))
    as_saved.load_state_dict(saved)
    with pytest.raises(ValueError, match="zip"):
        as_saved.step()
    assert resumed.get_last_lr() == unbroken.get_last_lr()
    for _ in range(5):
        resumed.step()
        unbroken.step()
        assert resumed.get_last_lr() == unbroken.get_last_lr() and len(set(unbroken.get_last_lr())) == 1
    assert checkpoints.schedule_for_groups(unbroken.state_dict(), 3) == unbroken.state_dict()
    # And one group fewer: a run resumed without the tables' group (FSDP2 at world 2, then one
    # process) loads the 3-group schedule, lr_lambdas too ("list index out of range" otherwise).
    fewer = run(2, 0)
    fewer.load_state_dict(checkpoints.schedule_for_groups(run(3, 3).state_dict(), 2))
    assert fewer.get_last_lr() == run(2, 3).get_last_lr()
