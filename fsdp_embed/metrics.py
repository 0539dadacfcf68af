"""What a run records: OUTPUT_DIR/metrics.jsonl (rank 0), and the same numbers to the trackers of
--report-to (TensorBoard, Weights & Biases, MLflow: tracking.py).

One JSON object a line, flushed at once, so a crash loses no logged step: {"step", "epoch",
"loss", "grad_norm", "lr", "samples_per_s", "world_size"} every --log-steps steps (a run resumed at
another number of processes says so in its lines), {"step", "eval": {...}} at
every evaluation, and the run's summary (final_loss, train_seconds, ...) at the end. NaN and inf
are written as null. A resumed run keeps the rows up to its checkpoint's step.

Needs fsdp_embed/tracking.py (and the packages of the trackers asked for); otherwise the standard library.
"""

import collections
import contextlib
import json
import math
import os
import sys
import time

from fsdp_embed import tracking


class MetricsLog:
    """Rank 0's record of the run: OUTPUT_DIR/metrics.jsonl, one JSON object a line, flushed at
    once (a crash loses no logged step), and the same numbers to each tracker of --report-to
    (tracking.py), at the same steps. A tracker that fails costs a warning line, never the run."""

    def __init__(self, output_dir, start_step, run_config, report_tools=()):
        """`run_config`: what rank 0 printed (the flags and what the run derived from them), saved
        with the trackers' runs; `report_tools`: --report-to's trackers."""
        # On resume the rows up to the checkpoint's step are kept (the later ones are about to be
        # redone); a crash can tear the last line (or leave NUL bytes): such lines are dropped.
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "metrics.jsonl")
        kept = []
        if start_step and os.path.exists(path):
            with open(path, errors="replace") as f:
                rows = [(line, parse_json_line(line)) for line in f]
            kept = [
                (line, row)
                for line, row in rows
                if row is not None and "final_loss" not in row and row.get("step", 0) <= start_step
            ]
        # The trackers first: one that cannot start stops the run here (TrackerError), before the
        # first step.
        kept_rows = [row for _, row in kept]
        self.trackers = tracking.start_trackers(output_dir, report_tools, start_step, run_config, kept_rows)
        self.file = open(path, "w")
        self.file.writelines(line for line, _ in kept)
        # The last logged loss, for the summary of a run resumed at its very last step.
        self.last_loss = next(
            (row["loss"] for _, row in reversed(kept) if row.get("loss") is not None), float("nan")
        )
        self.write_failed = False

    def write(self, record):
        # NaN and inf are not JSON: they are written as null (a metric that could not be computed).
        try:
            self.file.write(json.dumps(finite_or_none(record)) + "\n")
            self.file.flush()
        except OSError as e:
            # A full disk costs the log, not the run: the lines wait in the buffer (the next
            # flush that fits writes them), and the next checkpoint or the export, which check
            # their room first, stop the run with its error line (faults.py). Said once.
            if not self.write_failed:
                warning = f"\nwarning: cannot write metrics.jsonl ({e}); training goes on"
                print(warning, file=sys.stderr, flush=True)
            self.write_failed = True
        named = tracking.scalars(record)
        for tool, tracker in list(self.trackers.items()):
            try:
                tracker.log(record["step"], named)
            except Exception as e:
                self.drop_tracker(tool, e)

    def drop_tracker(self, tool, error):
        """A tracker that failed (its server gone, its disk full, anything it raised): said once,
        and it gets nothing more, so a dead server costs one wait, not one a step."""
        warning = (
            f"\nwarning: --report-to {tool} failed ({tracking.first_line(error)}); it reports nothing "
            "more, training goes on (metrics.jsonl has every number)"
        )
        print(warning, file=sys.stderr, flush=True)
        self.trackers.pop(tool).abandon()

    def close(self):
        with contextlib.suppress(OSError):  # a full disk: said by write already
            self.file.close()
        for tool, tracker in list(self.trackers.items()):
            try:
                tracker.close()
            except Exception as e:
                self.drop_tracker(tool, e)


def parse_json_line(line):
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def finite_or_none(value):
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


@contextlib.contextmanager
def timed(totals, key):
    """Adds the seconds the block takes to totals[key]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start


class StepMeter:
    """Every rank's bookkeeping between two log lines, with no collective (the step losses it is
    given are already the mean over ranks): each training set's step losses, and the seconds
    spent training, for samples/s. Start-up (to `begin`: loading, checks, a token file),
    evaluation and saving are not training: start-up is counted apart, and evaluation and saving
    are timed into `paused` (timed(meter.paused, "eval")) and left out."""

    def __init__(self, several_sets, world_size=1, started=None):
        self.several_sets = several_sets
        self.world_size = world_size  # in every log line: a resumed run may run at another
        self.paused = {"eval": 0.0, "save": 0.0}
        self.start = self.last_time = time.perf_counter()
        self.started = self.start if started is None else started  # the run's (perf_counter)
        self.startup_seconds, self.paused_before = 0.0, 0.0
        self.paused_at_last = 0.0
        self.loss_sums, self.steps = collections.Counter(), collections.Counter()
        self.rows = self.total_rows = 0  # since the last log line; since the start
        self.pending = []  # (step, set name, loss) added and not yet read on the host (read_losses)

    def begin(self):
        """The first step starts now: the time since the run started, less any evaluation, is
        start-up, reported on its own and left out of train_seconds and samples/s."""
        now, paused = time.perf_counter(), sum(self.paused.values())
        self.startup_seconds = now - self.started - paused
        self.start = self.last_time = now
        self.paused_before = self.paused_at_last = paused

    def add(self, set_name, step_loss, global_batch, step=0):
        """One step of set `set_name`: its loss (the mean over ranks; a tensor on the device is read
        later, by `read_losses`, so that a GPU does not wait for it every step) and its rows."""
        self.pending.append((step, set_name, step_loss))
        self.steps[set_name] += 1
        self.rows += global_batch
        self.total_rows += global_batch

    def read_losses(self):
        """The losses added since the last read, on the host, in one wait for the device, added to
        their sets' sums: [(step, loss)]."""
        import torch

        if not self.pending:
            return []
        values = torch.stack([torch.as_tensor(loss) for *_, loss in self.pending]).tolist()
        for (_, name, _), value in zip(self.pending, values):
            self.loss_sums[name] += value
        read, self.pending = [(step, value) for (step, *_), value in zip(self.pending, values)], []
        return read

    def record(self, step, epoch, grad_norm, lr):
        """The log line of the steps since the last one (with several training sets, each set's
        own mean loss over its steps too), then a new window."""
        if self.pending:
            self.read_losses()
        steps, paused = self.steps.total(), sum(self.paused.values())
        seconds = time.perf_counter() - self.last_time - (paused - self.paused_at_last)
        loss = sum(self.loss_sums.values()) / steps
        record = {"step": step, "epoch": round(epoch, 4), "loss": loss, "grad_norm": grad_norm, "lr": lr}
        record["samples_per_s"] = self.rows / seconds
        record["world_size"] = self.world_size
        if self.several_sets:
            record.update(
                {f"loss/{name}": self.loss_sums[name] / count for name, count in self.steps.items()}
            )
        self.loss_sums, self.steps, self.rows = collections.Counter(), collections.Counter(), 0
        self.last_time, self.paused_at_last = time.perf_counter(), paused
        return record

    def summary(self, final_loss):
        """The run's totals, for the last line of metrics.jsonl and the export."""
        train_seconds = time.perf_counter() - self.start - (sum(self.paused.values()) - self.paused_before)
        return {
            "final_loss": final_loss,
            "startup_seconds": self.startup_seconds,
            "train_seconds": train_seconds,
            "samples_per_s": self.total_rows / train_seconds,
            "eval_seconds": self.paused["eval"],
            "checkpoint_seconds": self.paused["save"],
        }


def log_step(meter, log, progress, step, epoch, grad_norm, lr):
    """The log line of the steps since the last one; returns its mean loss. No collective: every
    rank holds the same mean step losses and the global grad norm; rank 0 (with a `log`) writes."""
    record = meter.record(step, epoch, grad_norm.item(), lr)
    if log is not None:
        log.write(record)
        progress.set_postfix(
            loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", samples_s=f"{record['samples_per_s']:.1f}"
        )
    return record["loss"]
