"""Experiment tracking beside metrics.jsonl (--report-to wandb,mlflow), read back with each tool's
own reader and compared with metrics.jsonl, with no network: W&B in offline mode (its .wandb files
through `wandb leet inspect --json`), MLflow with a file store in tmp_path (MlflowClient).
Tiny BERT (conftest.tiny_model), in-process full_train.main, except the runs at world 2: one through
torchrun (a tracker that cannot start), the others through the warm launcher (conftest.warm_run).

- A run sends every scalar of metrics.jsonl at its step (training, each training set's loss,
  every evaluation metric, the summary; values to 1e-6), and the run's configuration as W&B's
  config and MLflow's params.
- Resumed from its step-2 checkpoint after it had logged up to step 4, the run continues ONE
  tracked run whose history per metric is the final metrics.jsonl, each step once. W&B: the same
  run id, the resumed file rewound to step 0 (resume_from) with rows 1-2 replayed, read as W&B
  applies it; MLflow: one active run, the broken one deleted.
- A rank SIGKILLed right after a checkpoint at world 2 (rank 0 or 1; --log-steps 1, 2, 5;
  evaluations between), then the run restarted with --resume auto: TensorBoard, W&B (its offline
  folders with the rewind applied) and MLflow each hold every row of the final metrics.jsonl once.
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
from conftest import data_file, free_port, repository_frames, run_train, start_up, warm_run

from fsdp_embed import config


from fsdp_embed import __main__ as full_train

NUM_STEPS, RESUME_STEP = 4, 2
KILL_LAUNCHER = Path(__file__).resolve().parent / "kill_launcher.py"


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
        found = [r["run"] for r in records if r["type"] == "run"]
        assert len(found) <= 1, folder
        # None: a process killed before wandb-core wrote more than the file's header.
        run = found[0] if found else None
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
            full_train.main(config.parse_config(args))
            seen["first"] = {
                "metrics": metrics_rows(out),
                "config": run_config(out),
                "wandb": wandb_runs(out),
                "mlflow": mlflow_runs(store),
                "ids": json.loads((out / "tracking.json").read_text()),
            }
            shutil.rmtree(out / "final")
            shutil.rmtree(out / "checkpoints" / f"step-{NUM_STEPS}")
            full_train.main(config.parse_config([*args, "--resume", "auto"]))
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

    # W&B: the same run id; the resumed file is rewound to step 0 (its JSON leaves out a value of
    # 0, protobuf's default), replays metrics.jsonl's rows 1 and 2, then logs from step 3 on,
    # where the broken one had logged up to 4. W&B's rewind keeps the run's rows up to 0 (the
    # evaluation at the start), then these.
    (_, broken_rows), (run, rows) = resumed["wandb"]
    assert run["run_id"] == first["ids"]["wandb"] == resumed["ids"]["wandb"]
    assert run["branch_point"] == {"metric": "_step", "run": run["run_id"]}
    assert max(row["_step"] for row in broken_rows) == NUM_STEPS  # a plain append would repeat 3, 4
    assert min(row["_step"] for row in rows) == 1
    assert_same_history(wandb_history(wandb_as_applied(resumed["wandb"])), want)

    # MLflow: one active run, which replaced the broken one (deleted: MLflow's history keeps
    # every value logged, so the broken run could not be cut).
    ((run_id, (run, history)),) = resumed["mlflow"].items()
    assert run_id == resumed["ids"]["mlflow"] != first["ids"]["mlflow"]
    assert run.data.tags["fsdp_embed.replaces_run"] == first["ids"]["mlflow"]
    assert run.info.run_name == "out"
    assert_same_history(history, mlflow_names(want))


# ----------------------------------------------------------------------------------------------
# A rank killed right after a checkpoint, then the run restarted with --resume auto


def wandb_as_applied(runs):
    """One run's history as W&B applies its offline folders at `wandb sync`, oldest first: a
    folder whose run record has a branch point (resume_from, the rewind) cuts the history after
    that step, then adds its own rows; any other folder adds its rows."""
    rows = []
    for run, folder_rows in runs:
        branch = run and run.get("branch_point")
        if branch:  # its JSON leaves out a value of 0 (protobuf's default)
            rows = [row for row in rows if row["_step"] <= branch.get("value", 0)]
        rows += folder_rows
    return rows


def tensorboard_history(folder):
    """{tag: [(step, value)]} as TensorBoard reads the event files (purge_step applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


CRASH_STEPS, KILL_STEP = 30, 24


@pytest.mark.parametrize("log_steps,killed_rank", [(1, 0), (2, 1), (5, 0)])
def test_a_rank_killed_after_a_checkpoint_costs_no_tool_a_step(
    tmp_path, tiny_model, eval_files, log_steps, killed_rank
):
    """World 2, --report-to tensorboard,wandb,mlflow, 30 steps, a checkpoint every 24, an
    evaluation at the start and every 3 steps: a rank is SIGKILLed as soon as the step-24
    checkpoint is complete (tests/kill_launcher.py, through the warm launcher, which stops the
    other rank as torchrun does), then the run is started again with --resume auto, as torchrun's
    restart does. Each tool then holds every row of the final metrics.jsonl once, at its step.
    The broken run's W&B file lacks its last rows, or all of them (wandb-core writes it in 32 KiB
    blocks and drops the rest when its parent dies): the rows up to step 24 that it lacks come
    back only through the replay (a rewind to step 24 leaves W&B without them)."""
    out, store = tmp_path / "out", tmp_path / "mlruns"
    args = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl")]
    args += ["--max-steps", CRASH_STEPS, "--per-device-batch-size", 8, "--max-seq-length", 32]
    args += ["--log-steps", log_steps, "--save-steps", KILL_STEP, "--resume", "auto"]
    args += ["--eval-data", eval_files, "--eval-steps", 3, "--eval-on-start"]
    args += ["--report-to", "tensorboard,wandb,mlflow", "--output-dir", out]
    with pytest.MonkeyPatch.context() as mp:
        tracking_env(mp, store)
        env = dict(os.environ)
        kill = f"after-save:{KILL_STEP}:{killed_rank}"
        killed = warm_run([kill, *args], nproc=2, env=env, script=KILL_LAUNCHER, check=False, timeout=300)
        assert killed.returncode != 0 and not (out / "final").exists(), killed.stderr[-3000:]
        assert (out / "checkpoints" / f"step-{KILL_STEP}").exists()
        warm_run(args, nproc=2, env=env, timeout=300)  # the restart
        runs = mlflow_runs(store)
    want = expected_history(metrics_rows(out))
    logged = sorted({*range(log_steps, CRASH_STEPS + 1, log_steps), CRASH_STEPS})
    assert [step for step, _ in want["train/loss"]] == logged
    assert [step for step, _ in want["eval/sts-dev/spearman"]] == list(range(0, CRASH_STEPS + 1, 3))

    # TensorBoard: the restart's writer purged what the broken run wrote after step 4.
    assert_same_history(tensorboard_history(out / "tensorboard"), want)

    # MLflow: one active run, which replaced the broken one.
    ((_, (_, history)),) = runs.items()
    assert_same_history(history, mlflow_names(want))

    # W&B: two offline folders of one run id (in the folder's name: the broken run's file may
    # hold no more than its header), the second rewound and replaying metrics.jsonl's rows up to
    # the checkpoint's step before its own.
    run_id = json.loads((out / "tracking.json").read_text())["wandb"]
    folders = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(name.endswith(f"-{run_id}") for name in folders), folders
    wandb = wandb_runs(out)
    assert wandb[1][0]["run_id"] == wandb[1][0]["branch_point"]["run"] == run_id
    # Step 0 (the evaluation at the start) is the one step not replayed (the rewind cannot go
    # below it): W&B holds it when the broken run's file does, which depends on how far that
    # file got (wandb-core writes it in 32 KiB blocks), so it is compared apart.
    got = wandb_history(wandb_as_applied(wandb))
    at_0 = {name: [(s, v) for s, v in steps if s == 0] for name, steps in got.items()}
    broken_at_0 = wandb_history(row for row in wandb[0][1] if row["_step"] == 0)
    assert {name: steps for name, steps in at_0.items() if steps} == broken_at_0
    if broken_at_0:
        assert_same_history(got, want)
    else:
        after_0 = {name: [(s, v) for s, v in steps if s > 0] for name, steps in want.items()}
        assert_same_history(got, {name: steps for name, steps in after_0.items() if steps})


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
    save_state = full_train.save_state

    def save_then_break_the_trackers(*args):
        save_state(*args)
        if args[6] == RESUME_STEP:  # the step
            kill_wandb_service()
            shutil.rmtree(store)
            store.write_text("not a folder")

    monkeypatch.setattr(full_train, "save_state", save_then_break_the_trackers)
    try:
        full_train.main(config.parse_config(tracked_args(tiny_model, out)))
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
    # No traceback through the trainer's files (torchrun prints one of its own).
    assert not repository_frames(output), output[-3000:]
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
        start_up(cfg, 1)
