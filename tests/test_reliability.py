"""Faults a cluster produces, through the full trainer itself (the tiny BERT, conftest.tiny_model):

- one run per output folder: while a run trains (torchrun, 2 ranks), a second launch into the same
  --output-dir is refused at start-up (exit 2, one `error:` line naming the holder's host and
  pid); the first run's lock (OUTPUT_DIR/.lock) is removed when a run ends;
- SIGKILL of the torchrun launcher leaves no worker running (they die with their parent), and the
  lock it leaves (its process dead on this host) is taken over by the next run, with a note;
- a metric that cannot be computed (a correlation with constant gold scores) is written as JSON
  null, never as bare NaN, and is never chosen as the best;
- a torn last line of metrics.jsonl (a crash mid-write) does not stop a resume;
- a run killed after its last checkpoint and resumed at the final step reports the final loss;
- a rank that dies of a segmentation fault prints the Python stack it was running (faulthandler);
- a non-finite loss stops with exit code 3 and an `error:` line that starts its line, after the
  progress bar, naming the newest checkpoint whose weights are finite (DDP, 2 ranks: a checkpoint
  saved after the weights overflowed is passed over, by the message and by `--resume auto`);
- damaged checkpoints (a shard cut short, trainer_state.json deleted) are named and skipped by
  `--resume auto`, which resumes from the newest complete one and ends bitwise equal to an
  unbroken run (FSDP2, 2 ranks); the damaged folders are moved aside when their step is saved
  again; in-process, every kind of damage to a real checkpoint is found against its manifest;
- a model with its own code whose pooler cannot be switched off trains under DDP (2 ranks).

Run: python -m pytest tests/test_reliability.py
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import REPO_DIR, data_file, read_metrics, run_train, start_up, torchrun_command, warm_run
from safetensors.torch import load_file

from fsdp_embed import checkpoints

from fsdp_embed import config

from fsdp_embed import metrics


from fsdp_embed import __main__ as full_train


def workers_of(out):
    """Processes still running with this output folder on their command line."""
    return subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()


def strict_json(line):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_one_run_per_output_folder_and_no_orphans(tmp_path, tiny_model):
    out = tmp_path / "out"
    common = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--output-dir",
        out,
        "--dist-timeout-minutes",
        3,
    ]
    endless = torchrun_command([*common, "--max-steps", 100000])
    first = subprocess.Popen(
        endless, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 180
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert first.poll() is None and time.time() < deadline, "the first run did not start training"
            time.sleep(0.5)
        holder = json.loads((out / ".lock").read_text())
        assert (
            holder["host"] == socket.gethostname() and holder["pid"] != first.pid
        )  # rank 0 holds it, not the launcher

        # A second launch into the same folder: refused before it loads anything.
        second = run_train([*common, "--max-steps", 2], nproc=2, check=False, timeout=180)
        errors = [line for line in (second.stdout + second.stderr).splitlines() if line.startswith("error:")]
        assert second.returncode == 1 and "(exitcode: 2)" in second.stderr, second.stderr[-3000:]
        assert len(errors) == 1 and "is in use by another run" in errors[0], errors
        assert f"host {holder['host']}, pid {holder['pid']}" in errors[0], errors
        assert first.poll() is None  # the first run is untouched

        # SIGKILL the launcher alone (as a scheduler or an OOM killer might): its workers follow.
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.time() + 30
        while workers_of(out) and time.time() < deadline:
            time.sleep(0.5)
        assert not workers_of(out), "workers outlived their launcher"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        for pid in workers_of(out):
            os.kill(int(pid), signal.SIGKILL)

    # The dead run's lock is still there; the next run takes it over and removes it at the end
    # (what a lock left behind does to a run, not its launch: warm_run starts it).
    assert json.loads((out / ".lock").read_text())["pid"] == holder["pid"]
    third = warm_run([*common, "--max-steps", 2], nproc=2)
    assert (
        f"note: {out / '.lock'} was left by a run that is no longer alive (pid {holder['pid']}"
        in third.stdout
    )
    assert (out / "final" / "model.safetensors").exists() and not (out / ".lock").exists()


def test_a_nan_metric_is_written_as_null_and_never_chosen_as_best(tmp_path, tiny_model):
    constant = tmp_path / "constant-dev.jsonl"
    rows = [json.loads(line) for line in open(data_file("stsb-dev.jsonl")).readlines()[:30]]
    constant.write_text(
        "".join(json.dumps({**r, "score": 0.5}) + "\n" for r in rows)
    )  # Pearson/Spearman: 0/0
    out = tmp_path / "out"
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        2,
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--eval-data",
        constant,
        "--eval-steps",
        1,
        "--metric-for-best",
        "constant-dev/spearman",
        "--output-dir",
        out,
    ]
    full_train.main(config.parse_config([str(a) for a in args]))
    rows = [
        strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()
    ]  # valid JSON throughout
    evals = [r["eval"] for r in rows if "eval" in r]
    assert len(evals) == 2 and all(
        e == {"constant-dev/spearman": None, "constant-dev/pearson": None} for e in evals
    )
    assert not (out / "best").exists()  # NaN is never the best
    assert "| constant-dev/spearman | not computable |" in (out / "final" / "README.md").read_text()
    assert (out / "final" / "model.safetensors").exists() and not (out / ".lock").exists()


def test_a_lock_held_by_a_live_process_is_never_taken_over(tmp_path):
    """In-process: a lock naming a live process on this host (here: this test's parent) refuses;
    one naming a dead pid is taken over, an exited one not yet reaped (a zombie) too; one naming
    another host refuses, even with this very pid (its liveness is unknowable)."""
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "then"}))
    assert "is in use by another run" in checkpoints.take_output_lock(str(out))
    lock.write_text(json.dumps({"host": "another-host", "pid": 1, "started": "then"}))
    assert "host another-host" in checkpoints.take_output_lock(str(out))
    # Our own pid on another host (pids repeat across hosts) is another run, not a leftover of ours.
    lock.write_text(json.dumps({"host": "another-host", "pid": os.getpid(), "started": "then"}))
    assert "host another-host" in checkpoints.take_output_lock(str(out))
    checkpoints.release_output_lock(str(out))  # and it is not ours to remove
    assert json.loads(lock.read_text())["host"] == "another-host"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"}))
    assert checkpoints.take_output_lock(str(out)) is None
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    checkpoints.release_output_lock(str(out))
    assert not lock.exists()
    # A zombie: what a killed launcher's workers are for a moment after they exit (signal 0
    # still reaches it). Before this was checked, a run started then was refused.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": zombie.pid, "started": "then"}))
        assert checkpoints.take_output_lock(str(out)) is None
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        zombie.wait()
    checkpoints.release_output_lock(str(out))


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows = [
        {"step": 1, "loss": 0.5},
        {"step": 2, "eval": {"x/spearman": 1.0}},
        {"step": 2, "loss": 0.25},
        {"step": 3, "loss": 0.1},
    ]
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo' + "\0" * 7
    )
    log = metrics.MetricsLog(str(out), 2, dataclasses.asdict(config.Config(output_dir=str(out))))
    log.close()
    assert [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] == rows[:3]
    assert log.last_loss == 0.25


def test_resumed_at_the_last_step_the_final_loss_survives(tmp_path, tiny_model):
    out = tmp_path / "out"
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        2,
        "--save-steps",
        2,
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--output-dir",
        out,
        "--resume",
        "auto",
    ]
    killed = run_train(args, kill="after-save:2:0", check=False)
    assert killed.returncode == -signal.SIGKILL and not (out / "final").exists()
    resumed = warm_run(args)
    assert "resuming from" in resumed.stdout
    rows = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert rows[-1]["final_loss"] == logged[-1]["loss"]  # not NaN: the last step's loss


def test_a_crash_in_native_code_prints_where_the_crashed_rank_was(tmp_path, tiny_model):
    """Rank 1 of 2 dies of a segmentation fault (sent from outside: kill_launcher) right after
    step 2's checkpoint. Its stderr holds Python's fatal-error report with the stack that was
    running, down to the full trainer's loop, not only torchrun's "Signal 11 (SIGSEGV) received"."""
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        4,
        "--save-steps",
        2,
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--output-dir",
        tmp_path / "out",
    ]
    # PYTHONFAULTHANDLER empty: the report must come from the trainer, not from the environment.
    crashed = run_train(
        args, nproc=2, kill="after-save:2:1:SEGV", check=False, env={"PYTHONFAULTHANDLER": ""}
    )
    assert crashed.returncode != 0 and not (tmp_path / "out" / "final").exists()
    at = crashed.stderr.find("Fatal Python error: Segmentation fault")
    assert at >= 0, crashed.stderr[-3000:]
    report = crashed.stderr[at:]
    entry = REPO_DIR / "fsdp_embed" / "__main__.py"  # the full trainer's loop
    assert "in save_then_die" in report and f'{entry}", line' in report, report[:3000]


def test_a_non_finite_loss_prints_its_error_on_a_line_of_its_own(tmp_path, tiny_model):
    out = tmp_path / "out"
    proc = run_train(
        [
            "--model",
            tiny_model,
            "--train-data",
            data_file("sick-pairs-train.jsonl"),
            "--max-steps",
            4,
            "--per-device-batch-size",
            4,
            "--max-seq-length",
            32,
            "--lr",
            1e30,
            "--warmup-ratio",
            0,
            "--max-grad-norm",
            0,
            "--output-dir",
            out,
        ],
        check=False,
    )
    assert proc.returncode == 3
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: the loss is")]
    assert len(errors) == 1 and "at step 2" in errors[0], proc.stderr[-2000:]


def test_damaged_checkpoints_are_skipped_and_the_run_ends_as_an_unbroken_one(tmp_path, tiny_model):
    """FSDP2, 2 ranks, 8 steps, a checkpoint every 2, killed after step 6's. Then step-6 loses the
    end of its last shard (a copy cut short, a full disk) and step-4 its trainer_state.json
    (deleted by hand), and the last line of metrics.jsonl is torn: `--resume auto` names both
    checkpoints, resumes from step-2, moves each damaged folder aside when it saves that step
    again, and ends bitwise equal to a run that never broke, with a clean metrics file."""
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-triplets-train.jsonl"),
        "--max-steps",
        8,
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
        "--strategy",
        "fsdp",
        "--fsdp-version",
        2,
    ]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    warm_run([*args, "--output-dir", straight], nproc=2)
    killed = run_train(
        [*args, "--output-dir", broken, "--resume", "auto"], nproc=2, kill="after-save:6:0", check=False
    )
    assert killed.returncode != 0 and not (broken / "final").exists()
    checkpoints = broken / "checkpoints"
    shard = sorted((checkpoints / "step-6").glob("shard-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut_size = shard.stat().st_size
    (checkpoints / "step-4" / "trainer_state.json").unlink()
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo' + "\0" * 5)  # and the crash tore the metrics file's last line

    resumed = warm_run([*args, "--output-dir", broken, "--resume", "auto"], nproc=2)
    output = resumed.stdout + resumed.stderr
    assert (
        f"warning: not resuming from {checkpoints / 'step-6'}: {shard.name} has {cut_size} bytes where"
        in output
    ), output[-3000:]
    assert f"warning: not resuming from {checkpoints / 'step-4'}: trainer_state.json is missing" in output
    assert f"resuming from {checkpoints / 'step-2'} (step 2 of 8)" in output
    names = sorted(p.name for p in checkpoints.iterdir())
    assert [n for n in names if "." not in n] == ["step-2", "step-4", "step-6", "step-8"]
    assert sorted(n.split(".")[0] for n in names if ".replaced-" in n) == ["step-4", "step-6"], (
        names
    )  # moved aside, not lost
    assert (
        f"\nwarning: {checkpoints / 'step-4'} was in the way of this save; moved to" in output
    )  # at the start of a line

    assert all(strict_json(line) for line in (broken / "metrics.jsonl").read_text().splitlines())
    got, want = read_metrics(broken), read_metrics(straight)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in got] == [
        (r["loss"], r["grad_norm"], r["lr"]) for r in want
    ]
    got_w, want_w = (
        load_file(broken / "final" / "model.safetensors"),
        load_file(straight / "final" / "model.safetensors"),
    )
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)


def test_a_diverged_run_names_the_newest_checkpoint_with_finite_weights(tmp_path, tiny_model, capsys):
    """DDP, 2 ranks. Step 1 runs at lr 0 (warm-up); step 2 at lr 3e38 throws weights past the
    float range, and its checkpoint holds them; step 3's loss is NaN. The exit-3 error names
    step-1 as the checkpoint to go back to, not step-2, and `--resume auto` skips step-2 too."""
    out = tmp_path / "out"
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        4,
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--lr",
        3e38,
        "--warmup-ratio",
        0.25,
        "--max-grad-norm",
        0,
        "--save-steps",
        1,
        "--log-steps",
        1,
        "--output-dir",
        out,
    ]
    proc = run_train(args, nproc=2, check=False)
    assert proc.returncode == 1 and "(exitcode: 3)" in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    checkpoints = out / "checkpoints"
    assert len(errors) == 1 and "at step 3" in errors[0], errors
    assert (
        f"Newest checkpoint with finite weights: {checkpoints / 'step-1'} "
        f"({checkpoints / 'step-2'}: its weights are not finite"
    ) in errors[0], errors[0]
    states = {
        n: json.loads((checkpoints / n / "trainer_state.json").read_text())["weights_finite"]
        for n in ("step-1", "step-2")
    }
    assert states == {"step-1": True, "step-2": False}
    weights = load_file(sorted((checkpoints / "step-2").glob("shard-*.safetensors"))[0])
    assert not all(
        torch.isfinite(t).all() for k, t in weights.items() if k.startswith("model.")
    )  # the flag tells the truth

    cfg = config.parse_config([str(a) for a in [*args, "--resume", "auto"]])
    capsys.readouterr()
    assert start_up(cfg, 2).resume_dir == str(checkpoints / "step-1")
    assert (
        f"warning: not resuming from {checkpoints / 'step-2'}: its weights are not finite"
        in capsys.readouterr().out
    )


def test_a_nan_between_logged_steps_is_named_at_the_next_one(tmp_path, tiny_model):
    """The step losses are read on the host only before a step that logs, evaluates or saves (one
    wait for the device, not one a step): step 3's NaN loss, in a run that logs every 4 steps, stops
    the run at step 4 with step 3 named, and nothing is written: no log line, no export."""
    out = tmp_path / "out"
    args = [
        "--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--max-steps", 4,
        "--per-device-batch-size", 4, "--max-seq-length", 32, "--lr", 3e38, "--warmup-ratio", 0.25,
        "--max-grad-norm", 0, "--log-steps", 4, "--output-dir", out,
    ]  # fmt: skip
    proc = run_train(args, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3 and len(errors) == 1, proc.stderr[-3000:]
    assert "the loss is nan at step 3" in errors[0], errors
    assert not (out / "final").exists() and read_metrics(out) == []


REMOTE_CODE = '''
from transformers import BertConfig, BertModel


class PooledBertConfig(BertConfig):
    model_type = "pooled-bert"


class PooledBertModel(BertModel):
    """A BERT whose class always builds (and runs) its pooler: it takes no add_pooling_layer."""

    config_class = PooledBertConfig

    def __init__(self, config):
        super().__init__(config, add_pooling_layer=True)
'''


def test_a_remote_code_model_with_a_pooler_trains_under_ddp(tmp_path, tiny_model):
    """A model with its own code (trust_remote_code) whose pooler cannot be switched off: no pooling
    mode uses it, so it gets no gradient, and DDP would fail waiting for one ("Expected to have
    finished reduction"). It is kept frozen: training runs, and the export carries the base's pooler."""
    import importlib.util

    import transformers

    folder = tmp_path / "pooled-bert"
    folder.mkdir()
    (folder / "modeling_pooled_bert.py").write_text(REMOTE_CODE)
    spec = importlib.util.spec_from_file_location("modeling_pooled_bert", folder / "modeling_pooled_bert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    config = module.PooledBertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    config.auto_map = {
        "AutoConfig": "modeling_pooled_bert.PooledBertConfig",
        "AutoModel": "modeling_pooled_bert.PooledBertModel",
    }
    module.PooledBertModel(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(folder)
    base = load_file(folder / "model.safetensors")
    assert any(k.startswith("pooler.") for k in base)

    out = tmp_path / "out"
    warm_run(
        [
            "--model",
            folder,
            "--trust-remote-code",
            "--train-data",
            data_file("sick-pairs-train.jsonl"),
            "--max-steps",
            2,
            "--per-device-batch-size",
            4,
            "--max-seq-length",
            32,
            "--lr",
            1e-3,
            "--output-dir",
            out,
        ],
        nproc=2,
    )
    exported = load_file(out / "final" / "model.safetensors")
    assert all(
        torch.equal(exported[k], base[k]) for k in base if k.startswith("pooler.")
    )  # frozen: the base's
    assert not torch.equal(
        exported["embeddings.word_embeddings.weight"], base["embeddings.word_embeddings.weight"]
    )  # trained


def test_a_checkpoint_is_checked_against_its_manifest(tmp_path, capsys):
    """In-process, one process: a real checkpoint of a small module, then each kind of damage a
    crash, a full disk or a hand can do. Each is named, and never counted as complete. A second
    save of the same step moves the first aside instead of failing."""
    import shutil

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    checkpoints_dir = tmp_path / "checkpoints"
    pristine = Path(checkpoints.save_checkpoint(model, optimizer, str(checkpoints_dir), 1, {"note": "x"}))
    manifest = json.loads((pristine / "manifest.json").read_text())["files"]
    assert manifest == {p.name: p.stat().st_size for p in pristine.iterdir() if p.name != "manifest.json"}
    assert {"trainer_state.json", "rng-rank-0.safetensors"} < set(
        manifest
    ) and checkpoints.checkpoint_problem(str(pristine)) is None
    shard = next(name for name in manifest if name.startswith("shard-"))

    def cut(file, size):
        file.write_bytes(file.read_bytes()[:size])

    damages = [
        (lambda p: (p / "manifest.json").unlink(), "it has no manifest.json"),
        (lambda p: cut(p / "manifest.json", 10), "its manifest.json is unreadable"),
        (lambda p: (p / "rng-rank-0.safetensors").unlink(), "rng-rank-0.safetensors is missing"),
        (lambda p: cut(p / shard, 100), f"{shard} has 100 bytes where {manifest[shard]} were written"),
        (
            lambda p: (p / shard).write_bytes((p / shard).read_bytes() + b"\0"),
            f"{shard} has {manifest[shard] + 1} bytes where",
        ),
        (lambda p: (p / "trainer_state.json").write_text("{}"), "trainer_state.json has 2 bytes where"),
    ]
    for step, (damage, expected) in enumerate(damages, start=2):
        folder = checkpoints_dir / f"step-{step}"
        shutil.copytree(pristine, folder)
        damage(folder)
        assert expected in checkpoints.checkpoint_problem(str(folder))
    assert checkpoints.complete_checkpoints(str(checkpoints_dir)) == [(1, str(pristine))]
    assert [
        (step, problem is None) for step, _, problem in checkpoints.list_checkpoints(str(checkpoints_dir))
    ] == [(1, True)] + [(step, False) for step in range(2, 2 + len(damages))]

    capsys.readouterr()
    checkpoints.save_checkpoint(model, optimizer, str(checkpoints_dir), 1, {"note": "again"})
    checkpoints.save_checkpoint(
        model, optimizer, str(checkpoints_dir), 1, {"note": "and again"}
    )  # within the same second, likely
    aside = sorted(p for p in checkpoints_dir.iterdir() if p.name.startswith("step-1.replaced-"))
    assert len(aside) == 2 and all(checkpoints.checkpoint_problem(str(p)) is None for p in aside)
    assert json.loads((pristine / "trainer_state.json").read_text())["note"] == "and again"
    assert capsys.readouterr().err.count(f"warning: {pristine} was in the way of this save; moved to") == 2
