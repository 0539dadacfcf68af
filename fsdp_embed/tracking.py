"""The experiment trackers of --report-to, beside metrics.jsonl: TensorBoard, Weights & Biases and
MLflow, comma-separated (`--report-to wandb,mlflow`). Rank 0 alone reports (metrics.MetricsLog
starts them): nothing here is a collective.

Each tracker gets the numbers of every metrics.jsonl line at its step, under the names `scalars`
gives: train/loss, train/lr, ..., train/loss/FILE-STEM, eval/FILE-STEM/METRIC, and the run's
totals as summary/train_seconds, ... (MLflow's keys differ a little: `mlflow_key`).
W&B gets the run's configuration (the Config and the derived values, as rank 0 prints them) as
its config, MLflow as params. Run name: the output folder's name. Project, experiment, mode,
server: the tools' own environment variables (WANDB_PROJECT, WANDB_MODE, WANDB_NAME, WANDB_DIR,
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...), which the libraries read themselves.

Where the files go: OUTPUT_DIR/tensorboard; OUTPUT_DIR/wandb unless WANDB_DIR is set; MLflow's
store: MLFLOW_TRACKING_URI, else MLflow's own default (see MLflowRun).

A resumed run continues the tracked run, with no step twice. OUTPUT_DIR/tracking.json keeps each
tool's run id (written at start); resuming from step S:
  - TensorBoard: purge_step S+1 drops what the broken run wrote after S;
  - W&B: wandb.init(resume_from="ID?_step=0"), W&B's rewind: the same run, its history cut after
    step 0, then metrics.jsonl's rows 1..S replayed (the broken run's W&B file may lack any of
    them: see WandbRun), then this run's (a plain resume would drop our steps as "not above the
    last step");
  - MLflow keeps every value ever logged and no API deletes one, so the broken run cannot be cut:
    a new run takes its place (same experiment and name; tag fsdp_embed.replaces_run), holding
    metrics.jsonl's rows up to S, then this run's; the old one is deleted (MLflow's soft delete:
    `mlflow runs restore --run-id ID` brings it back); tracking.json names the new one.
  W&B without a run to continue (not reported to before) likewise gets metrics.jsonl's rows up to S.

Failures: a tracker that cannot start (a server not reachable, no W&B login, ...) stops the run
before its first step (TrackerError, a ValueError; __main__.py's clear_output_and_open_log makes
every rank stop with it: one `error:` line, exit 2); one that fails later costs one `warning:`
line and reports nothing more, never the run (MetricsLog).

Needs no other project file; tensorboard, wandb and mlflow only when asked for (imported inside the classes).
"""

import contextlib
import json
import math
import os
import re
import time


class TrackerError(ValueError):
    """A tracker of --report-to could not start (exit 2, before the first step)."""


def start_trackers(output_dir, tools, start_step, run_config, kept_rows):
    """{tool: tracker} for each of `tools` (--report-to's, as the run's plan lists them), each
    started (and on resume, continuing its run); `output_dir`/tracking.json then names their runs.
    `kept_rows`: metrics.jsonl's rows up to `start_step`. Raises TrackerError naming the tool that
    could not start."""
    previous = read_run_ids(output_dir) if start_step else {}
    trackers = {}
    for tool in tools:
        try:
            if tool == "tensorboard":
                trackers[tool] = TensorBoard(output_dir, start_step)
            elif tool == "wandb":
                trackers[tool] = WandbRun(output_dir, run_config, previous.get(tool), kept_rows)
            elif tool == "mlflow":
                trackers[tool] = MLflowRun(output_dir, run_config, previous.get(tool), kept_rows)
        except Exception as e:
            for tracker in trackers.values():
                tracker.abandon()
            hint = " (or delete OUTPUT_DIR/tracking.json to start a new tracked run)" if previous else ""
            raise TrackerError(
                f"--report-to {tool} cannot start: {first_line(e)}. Check its settings (its environment "
                f"variables) and its server, or leave {tool} out of --report-to{hint}"
            ) from e
    write_run_ids(output_dir, {tool: t.run_id for tool, t in trackers.items() if t.run_id})
    return trackers


def scalars(record):
    """The numbers of a metrics.jsonl record by tracker name: a logged step's as train/NAME, an
    evaluation's as eval/NAME, the run's totals as summary/NAME. NaN, inf and null are left out."""
    named = {f"eval/{k}": v for k, v in record.get("eval", {}).items()}
    prefix = "train" if "loss" in record else "summary"  # a logged step, or the run's totals
    named.update({f"{prefix}/{k}": v for k, v in record.items() if k not in ("step", "eval")})
    return {k: v for k, v in named.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def run_name(output_dir):
    return os.path.basename(os.path.abspath(output_dir))


class TensorBoard:
    run_id = None  # the event files are the record: nothing to name in tracking.json

    def __init__(self, output_dir, start_step):
        from torch.utils.tensorboard import SummaryWriter  # optional; checked at start-up

        # A resumed run drops what the broken one wrote after the checkpoint's step.
        self.writer = SummaryWriter(
            os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1 if start_step else None
        )

    def log(self, step, named):
        for name, value in named.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()

    def abandon(self):
        with contextlib.suppress(Exception):
            self.writer.close()


class WandbRun:
    def __init__(self, output_dir, run_config, previous_id, kept_rows):
        import wandb  # optional; checked at start-up

        options = {"config": run_config}
        if "WANDB_DIR" not in os.environ:  # W&B's own default: the working directory
            options["dir"] = output_dir
        if "WANDB_NAME" not in os.environ:
            options["name"] = run_name(output_dir)
        if previous_id:
            # The rewind goes to step 0, not to the checkpoint's step S: what the broken run's W&B
            # run holds is not known. wandb-core keeps a step's row open until a later step is
            # logged, writes its file in whole blocks, and drops what it has not written when its
            # parent dies ("parent process exited... forced shutdown"): a rank killed after the
            # step-S checkpoint can leave W&B without step S and many steps before it (measured:
            # docs/tracking.md). So the run is cut after step 0 and metrics.jsonl's rows 1..S are
            # replayed; a rewound run drops any row at or below the rewind step, so the broken
            # run's step-0 rows stay as it left them. Not below 0: W&B's steps start there, and
            # what its server does with a negative rewind step is not documented. Offline, the
            # rewind is recorded in the run's file and done at `wandb sync`.
            options["resume_from"] = f"{previous_id}?_step=0"
        self.run = wandb.init(**options)
        self.run_id = self.run.id
        try:
            for row in kept_rows:
                if row["step"] > 0 or not previous_id:  # step 0: the rewound run keeps its own
                    self.log(row["step"], scalars(row))
        except Exception:
            self.abandon()
            raise

    def log(self, step, named):
        self.run.log(named, step=step)

    def close(self):
        self.run.finish()

    def abandon(self):
        # When wandb's service died, its own exit hook would raise again at exit (a traceback):
        # teardown unregisters it.
        import wandb

        with contextlib.suppress(Exception):
            self.run.finish(exit_code=1)
        with contextlib.suppress(Exception):
            wandb.teardown()


class MLflowRun:
    def __init__(self, output_dir, run_config, previous_id, kept_rows):
        import mlflow  # optional; checked at start-up
        from mlflow.entities import Param

        # MLflow's HTTP client retries a request 7 times, ~4 minutes in all, by default: a server
        # gone mid-run would hold a training step that long. Bounded here, unless set.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        # With MLFLOW_TRACKING_URI unset, MLflow's own default store in the working directory
        # (./mlflow.db and ./mlruns, where `mlflow ui` started there looks), not OUTPUT_DIR: a
        # store is where runs are compared, so the runs of every output folder belong in one.
        self.client = mlflow.MlflowClient()
        previous = self.client.get_run(previous_id) if previous_id else None
        run = mlflow.start_run(
            run_name=run_name(output_dir),
            experiment_id=previous.info.experiment_id if previous else None,  # None: MLflow's choice
            tags={"fsdp_embed.replaces_run": previous_id} if previous else None,
        )
        self.run_id = run.info.run_id
        try:
            params = [Param(k, param_value(v)) for k, v in run_config.items()]
            for i in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.log_steps([(row["step"], scalars(row)) for row in kept_rows])
            if previous and previous.info.lifecycle_stage == "active":
                self.client.delete_run(previous_id)
        except Exception:
            self.abandon()
            raise

    def log(self, step, named):
        self.log_steps([(step, named)])

    def log_steps(self, steps):
        """[(step, {name: value})] in as few calls as MLflow's batch limit allows."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for step, named in steps for k, v in named.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self):
        import mlflow

        mlflow.end_run()

    def abandon(self):
        import mlflow

        with contextlib.suppress(Exception):  # the run this process holds ends, if it still can
            mlflow.end_run("FAILED")


def mlflow_key(name):
    """MLflow's keys allow letters, digits, _ - . / and spaces: mrr@10 is written mrr_at_10, any
    other character _. Its file store keeps a metric as a file named by its key, so train/loss
    cannot also be a folder: each training set's loss is train/loss_FILE-STEM there."""
    name = name.replace("train/loss/", "train/loss_", 1).replace("@", "_at_")
    return re.sub(r"[^\w\-./ ]", "_", name)


def param_value(value):
    """A config value as an MLflow param: strings as they are, anything else as JSON (as rank 0
    prints it), cut to 500 characters, the limit of older MLflow servers (newer ones take 6000),
    so that every server takes it (the whole config is in every checkpoint and export)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 500 else text[:497] + "..."


def read_run_ids(output_dir):
    """{tool: run id} from OUTPUT_DIR/tracking.json; {} without one (or a torn one)."""
    try:
        with open(os.path.join(output_dir, "tracking.json")) as f:
            ids = json.load(f)
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def write_run_ids(output_dir, ids):
    """OUTPUT_DIR/tracking.json names this run's tracked runs (written whole, then renamed); with
    none, an earlier file goes: a later resume must not continue a run that missed these steps."""
    path = os.path.join(output_dir, "tracking.json")
    if not ids:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    with open(path + ".tmp", "w") as f:
        json.dump(ids, f)
    os.replace(path + ".tmp", path)


def first_line(error):
    """The exception's type and first line, at most 300 characters: for a one-line message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."
