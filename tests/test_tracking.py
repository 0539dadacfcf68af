"""Experiment tracking beside metrics.jsonl (--report-to wandb,mlflow), read back with each tool's
own reader and compared with metrics.jsonl, with no network: W&B in offline mode (its .wandb files
through `wandb leet inspect --json`), MLflow with a file store in tmp_path (MlflowClient).
Tiny BERT (conftest.tiny_model), in-process train.main, except two runs at world 2: one through
torchrun (a tracker that cannot start), one through the warm launcher (conftest.warm_run).

- A run sends every scalar of metrics.jsonl at its step (training, each training set's loss,
  every evaluation metric, the summary; values to 1e-6), and the run's configuration as W&B's
  config and MLflow's params.
- Resumed from its step-2 checkpoint after it had logged up to step 4, the run continues ONE
  tracked run whose history per metric is the final metrics.jsonl, each step once. W&B: the same
  run id, the resumed file rewound to step 2 (resume_from), read as W&B applies it; MLflow: one
  active run, the broken one deleted.
- A tracker that fails mid-run (wandb's service killed, MLflow's store replaced by a file) costs
  one `warning:` line each; the run trains, checkpoints and exports as usual.
- A tracker that cannot start (MLflow at a port where nothing listens) stops every rank (world
  size 2, under torchrun) before the first step, with one `error:` line and exit code 2.
- Unknown or repeated names in --report-to, or a tool whose package is missing, are refused at
  start-up.

Run: python -m pytest tests/test_tracking.py
"""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import data_file, free_port, run_train, warm_run

import config

import startup_checks

import train

NUM_STEPS, RESUME_STEP = 4, 2


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-data")
    sts, pairs = folder / "sts-dev.jsonl", folder / "pairs-dev.jsonl"
    sts.write_text("".join(open(data_file("stsb-dev.jsonl")).readlines()[:40]))
    pairs.write_text("".join(open(data_file("sick-pairs-train.jsonl")).readlines()[-40:]))
    return f"{sts},{pairs}"


def tracked_args(model, out, extra=()):
    """4 steps of two training sets (MNRL pairs, CoSENT on STS-B: each set's own loss is logged),
    a checkpoint every 2, evaluation (STS and retrieval) at step 0 and every 2 steps."""
    return [
        str(a)
        for a in [
            "--model",
            model,
            "--train-data",
            f"{data_file('sick-pairs-train.jsonl')},{data_file('stsb-train.jsonl')}",
            "--max-steps",
            NUM_STEPS,
            "--per-device-batch-size",
            8,
            "--max-seq-length",
            32,
            "--log-steps",
            1,
            "--save-steps",
            2,
            "--report-to",
            "wandb,mlflow",
            "--output-dir",
            out,
            *extra,
        ]
    ]


def tracking_env(mp, store):
    """W&B offline and MLflow in a file store of its own, nothing else from the environment."""
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_")):
            mp.delenv(name)
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    # mlflow >= 3.7 refuses the file store unless asked (its default is now SQLite, which needs
    # SQLAlchemy, not in mlflow-skinny); reading back is the same MlflowClient for either.
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def forget_wandb():
    """wandb reads its environment once per process, at its first run: start the next afresh."""
    import wandb

    wandb.teardown()


# ----------------------------------------------------------------------------------------------
# Reading each tool back, and what metrics.jsonl says it should hold


def metrics_rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def expected_history(rows):
    """{name: [(step, value)]} of metrics.jsonl's rows, under the trackers' names (null left out)."""
    history = collections.defaultdict(list)
    for row in rows:
        prefix = "train" if "loss" in row else "summary"
        for key, value in row.items():
            if key == "eval":
                for metric, score in value.items():
                    history[f"eval/{metric}"].append((row["step"], score))
            elif key != "step" and value is not None:
                history[f"{prefix}/{key}"].append((row["step"], value))
    return dict(history)


def assert_same_history(got, want):
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for name in want:
        steps = [step for step, _ in got[name]]
        assert steps == [step for step, _ in want[name]], (name, steps)  # each step once, in order
        values = [value for _, value in got[name]]
        assert values == pytest.approx([value for _, value in want[name]], rel=1e-6), name


def wandb_runs(out):
    """Each offline run folder's (run record, history rows), oldest first, through wandb's own
    reader of .wandb files (`wandb leet inspect --json`: one JSON record a line)."""
    runs = []
    for folder in sorted((Path(out) / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        text = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", str(log), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        records = [json.loads(line) for line in text.splitlines()]
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        runs.append((run, [r["history"]["item"] for r in records if r["type"] == "history"]))
    return runs


def wandb_history(rows):
    history = collections.defaultdict(list)
    for row in rows:
        for name, value in row.items():
            if not name.startswith("_"):
                history[name].append((row["_step"], value))
    return dict(history)


def mlflow_runs(store):
    """{run id: (run, {key: [(step, value)]})} of the active runs in the store, by MlflowClient."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{store}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = {}
    for run in client.search_runs(experiments):  # active runs only, as the UI lists them
        history = {
            key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics
        }
        found[run.info.run_id] = (run, history)
    return found


def mlflow_names(history):
    """The names as MLflow keys: no '@' (mrr@10), and train/loss is a file in MLflow's file store,
    so it cannot be the folder of each set's loss."""
    return {
        name.replace("@", "_at_").replace("train/loss/", "train/loss_"): steps
        for name, steps in history.items()
    }


def run_config(out):
    """The configuration rank 0 printed: the export's training_config.json less the summary."""
    saved = json.loads((Path(out) / "final" / "training_config.json").read_text())
    summary = metrics_rows(out)[-1]
    return {k: v for k, v in saved.items() if k not in summary}


# ----------------------------------------------------------------------------------------------
# A run, then the same run resumed from step 2


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_model, eval_files):
    """A 4-step run reporting to W&B and MLflow; then final/ and the step-4 checkpoint removed
    and the run resumed from step 2 (it had logged steps 3 and 4 already). What each tool holds
    after each run."""
    folder = tmp_path_factory.mktemp("tracked")
    out, store = folder / "out", folder / "mlruns"
    # A long instruction (as LLM embedders take) makes config values longer than MLflow's 500.
    prompt = "Instruct: " + "Given a question, retrieve the passages that answer it. " * 10
    evaluation = ["--eval-data", eval_files, "--eval-steps", 2, "--eval-on-start"]
    args = tracked_args(tiny_model, out, [*evaluation, "--prompts", json.dumps({"anchor": prompt})])
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        tracking_env(mp, store)
        try:
            train.main(config.parse_config(args))
            seen["first"] = {
                "metrics": metrics_rows(out),
                "config": run_config(out),
                "wandb": wandb_runs(out),
                "mlflow": mlflow_runs(store),
                "ids": json.loads((out / "tracking.json").read_text()),
            }
            shutil.rmtree(out / "final")
            shutil.rmtree(out / "checkpoints" / f"step-{NUM_STEPS}")
            train.main(config.parse_config([*args, "--resume", "auto"]))
            seen["resumed"] = {
                "metrics": metrics_rows(out),
                "wandb": wandb_runs(out),
                "mlflow": mlflow_runs(store),
                "ids": json.loads((out / "tracking.json").read_text()),
            }
        finally:
            forget_wandb()
    return seen


def test_wandb_and_mlflow_hold_every_number_of_metrics_jsonl(tracked):
    first = tracked["first"]
    want = expected_history(first["metrics"])
    # What the comparison covers: training, per-set losses, evaluation (with '@'), the summary.
    assert {"train/loss", "train/loss/stsb-train", "eval/pairs-dev/mrr@10", "summary/train_seconds"} <= set(
        want
    )
    assert [step for step, _ in want["eval/sts-dev/spearman"]] == [0, 2, 4]

    (run, rows) = first["wandb"][0]
    assert len(first["wandb"]) == 1 and run["run_id"] == first["ids"]["wandb"]
    assert run["display_name"] == "out"  # the output folder's name
    assert_same_history(wandb_history(rows), want)
    config_seen = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config_seen == first["config"]

    ((run_id, (run, history)),) = first["mlflow"].items()
    assert run_id == first["ids"]["mlflow"] and run.info.run_name == "out"
    assert_same_history(history, mlflow_names(want))
    params = run.data.params
    assert params.keys() == first["config"].keys()
    cut = 0
    for key, value in first["config"].items():
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > 500:  # MLflow's older servers' limit: cut, marked
            assert params[key] == text[:497] + "...", key
            cut += 1
        else:
            assert params[key] == text, key
    assert cut >= 1  # the prompt


def test_a_resumed_run_continues_one_tracked_run_with_each_step_once(tracked):
    first, resumed = tracked["first"], tracked["resumed"]
    want = expected_history(resumed["metrics"])
    assert [step for step, _ in want["train/loss"]] == list(range(1, NUM_STEPS + 1))
    # The resumed steps' own numbers differ from the broken run's (samples/s): the tools must
    # hold the resumed ones, each once.
    step_rows = [
        [r for r in run["metrics"] if r["step"] == RESUME_STEP + 1 and "loss" in r]
        for run in (first, resumed)
    ]
    assert step_rows[0][0]["samples_per_s"] != step_rows[1][0]["samples_per_s"]

    # W&B: the same run id; the resumed file is rewound to step 2 and logs from step 3 on, where
    # the broken one had logged up to 4. W&B's rewind keeps the run's rows up to 2, then these.
    (_, broken_rows), (run, rows) = resumed["wandb"]
    assert run["run_id"] == first["ids"]["wandb"] == resumed["ids"]["wandb"]
    assert run["branch_point"] == {"metric": "_step", "run": run["run_id"], "value": RESUME_STEP}
    assert max(row["_step"] for row in broken_rows) == NUM_STEPS  # a plain append would repeat 3, 4
    assert min(row["_step"] for row in rows) == RESUME_STEP + 1
    kept = [row for row in broken_rows if row["_step"] <= run["branch_point"]["value"]]
    assert_same_history(wandb_history(kept + rows), want)

    # MLflow: one active run, which replaced the broken one (deleted: MLflow's history keeps
    # every value logged, so the broken run could not be cut).
    ((run_id, (run, history)),) = resumed["mlflow"].items()
    assert run_id == resumed["ids"]["mlflow"] != first["ids"]["mlflow"]
    assert run.data.tags["fsdp_embed.replaces_run"] == first["ids"]["mlflow"]
    assert run.info.run_name == "out"
    assert_same_history(history, mlflow_names(want))


# ----------------------------------------------------------------------------------------------
# Failures


def kill_wandb_service():
    """SIGKILL the wandb-core process this process started (wandb's service; found in /proc)."""
    killed = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and b"wandb-core" in command:
            os.kill(int(stat.parent.name), signal.SIGKILL)
            killed += 1
    assert killed == 1


def test_a_tracker_failing_mid_run_costs_one_warning_line_not_the_run(
    tmp_path, tiny_model, capfd, monkeypatch
):
    """After the step-2 checkpoint, wandb's service is killed and MLflow's store becomes a file."""
    out, store = tmp_path / "out", tmp_path / "mlruns"
    tracking_env(monkeypatch, store)
    save_state = train.save_state

    def save_then_break_the_trackers(*args):
        save_state(*args)
        if args[6] == RESUME_STEP:  # the step
            kill_wandb_service()
            shutil.rmtree(store)
            store.write_text("not a folder")

    monkeypatch.setattr(train, "save_state", save_then_break_the_trackers)
    try:
        train.main(config.parse_config(tracked_args(tiny_model, out)))
    finally:
        forget_wandb()
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: --report-to")]
    assert len(warnings) == 2, err[-3000:]  # once per tool, though 3 more records came
    assert warnings[0].startswith("warning: --report-to wandb failed (ConnectionResetError")
    assert warnings[1].startswith("warning: --report-to mlflow failed")
    assert "training goes on" in warnings[1]
    rows = metrics_rows(out)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, NUM_STEPS + 1))
    assert "final_loss" in rows[-1]
    assert (out / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_a_tracker_that_cannot_start_stops_every_rank_before_the_first_step(tmp_path, tiny_model):
    """MLflow pointed at a port where nothing listens, under torchrun at world size 2: rank 0
    cannot start it, and both ranks stop with one `error:` line and exit code 2, nothing trained."""
    out = tmp_path / "out"
    env = {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    }
    args = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--max-steps", 2]
    args += ["--max-seq-length", 32, "--report-to", "mlflow", "--output-dir", out]
    proc = run_train(args, nproc=2, check=False, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # torchrun itself exits 1 when a worker fails; the workers' own code is 2, not a crash.
    assert proc.returncode == 1 and "(exitcode: 2)" in proc.stderr, output[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: --report-to mlflow cannot start"), errors
    # No traceback through train.py (torchrun prints one of its own).
    assert 'train.py", line' not in output, output[-3000:]
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_at_world_2_rank_0_alone_reports(tmp_path, tiny_model):
    """At world size 2 (torchrun's worker environment) the tools hold one run each, equal to
    metrics.jsonl (rank 1 starting a tracker of its own would add a second W&B folder and a
    second MLflow run)."""
    out, store = tmp_path / "out", tmp_path / "mlruns"
    args = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--max-steps", 2]
    args += ["--max-seq-length", 32, "--log-steps", 1, "--report-to", "wandb,mlflow", "--output-dir", out]
    with pytest.MonkeyPatch.context() as mp:
        tracking_env(mp, store)
        warm_run(args, nproc=2, env=dict(os.environ), timeout=300)  # which rank reports, not the launch
        runs = mlflow_runs(store)
    want = expected_history(metrics_rows(out))
    assert [step for step, _ in want["train/loss"]] == [1, 2]
    ((_, rows),) = wandb_runs(out)
    assert_same_history(wandb_history(rows), want)
    ((_, (_, history)),) = runs.items()
    assert_same_history(history, mlflow_names(want))


@pytest.mark.parametrize(
    "report_to,missing,expected",
    [
        (
            "wandb,comet",
            None,
            "--report-to wandb,comet: unknown ['comet']; choose from tensorboard, wandb, mlflow",
        ),
        ("mlflow,wandb,mlflow", None, "mlflow named twice"),
        ("tensorboard,wandb", "wandb", "--report-to wandb needs the wandb package: pip install wandb"),
        ("mlflow", "mlflow", "--report-to mlflow needs the mlflow package: pip install mlflow"),
    ],
)
def test_report_to_is_checked_at_start_up(tmp_path, monkeypatch, report_to, missing, expected):
    """Through the start-up check every rank runs, before any weights load (as test_bad_input)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a)
    )
    cfg = config.parse_config(["--report-to", report_to, "--output-dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        startup_checks.start_up_checks(cfg, 1, torch.device("cpu"))
