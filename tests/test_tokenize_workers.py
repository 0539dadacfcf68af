"""Tokenizing on the fly by worker processes (--tokenize-workers, batches.TokenizingWorkers) gives
every rank exactly the micro-batches the reader thread gives, tensor for tensor, in order: over two
epochs, from a resumed step, with prompts and a column cut at a length of its own, for grouped
rows; two processes train with two workers each to the losses
and weights of the reader thread's run, a resume included; a worker that fails ends the run with
its error, and no worker outlives the run.

Run: python -m pytest tests/test_tokenize_workers.py
"""

import dataclasses
import multiprocessing
import os
import time

import pytest
import torch
from conftest import (
    data_file,
    export_weights,
    grouped_file,
    load_model,
    read_metrics,
    run_train,
    start_up,
    warm_run,
)

from fsdp_embed import batches
from fsdp_embed import config

PROMPTS = '{"anchor": "query: ", "positive": "passage: "}'


def every_micro_batch(plan, loaded, rank, start_step, workers, tables=None):
    """Each micro-batch's (set name, features, labels) from batches.micro_batches, prepared as is."""
    plan = dataclasses.replace(plan, tokenize_workers=workers)
    tables = tables or [None] * len(plan.train_sets)

    def prepare(ts, rows, features, labels, progress):
        return ts.name, features, labels

    return list(batches.micro_batches(plan, loaded, tables, rank, start_step, prepare))


def assert_same(got, want):
    assert len(got) == len(want) > 0
    for (g_name, g_features, g_labels), (w_name, w_features, w_labels) in zip(got, want):
        assert g_name == w_name
        assert [sorted(f) for f in g_features] == [sorted(f) for f in w_features]
        for g, w in zip(g_features, w_features):
            assert all(torch.equal(g[k], w[k]) for k in w)
        assert (g_labels is None and w_labels is None) or torch.equal(g_labels, w_labels)


def test_workers_give_the_reader_threads_micro_batches_every_epoch_and_from_a_resumed_step(tmp_path):
    args = ["--train-data", data_file("sick-pairs-train.jsonl"), "--output-dir", str(tmp_path / "out")]
    args += ["--prompts", PROMPTS, "--max-seq-length", '{"anchor": 9}', "--per-device-batch-size", "8"]
    args += ["--epochs", "2", "--grad-accum-steps", "2"]
    cfg = config.parse_config(args)
    plan = start_up(cfg, world_size=2)
    loaded = load_model(cfg)
    assert plan.schedule.epoch_at(len(plan.schedule) - 1) >= 1  # the run spans two epochs
    for rank, start_step in ((0, 0), (1, 0), (1, len(plan.schedule) - 3)):
        thread = every_micro_batch(plan, loaded, rank, start_step, workers=0)
        assert len(thread) == (len(plan.schedule) - start_step) * 2
        assert_same(every_micro_batch(plan, loaded, rank, start_step, workers=2 if rank else 1), thread)
    # A tokenize call the reader thread would make, by hand: the worker path gave the same.
    first = every_micro_batch(plan, loaded, 0, 0, workers=2)[0][1]
    _, _, rows_of_step = plan.schedule[0]
    indices = batches.micro_batch_indices(rows_of_step, 0, 0, 8, 2)
    ts = plan.train_sets[0]
    want, _ = batches.collate(
        ts.ds[indices], ts.text_columns, None, "mnrl", loaded.tokenize, "cpu", ts.prompts
    )
    assert_same([("x", first, None)], [("x", want, None)])


def test_workers_give_grouped_rows_as_the_reader_thread(tmp_path):
    args = [
        "--train-data",
        str(grouped_file(tmp_path / "grouped.jsonl")),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    args += ["--group-size", "3", "--per-device-batch-size", "4", "--max-steps", "6"]
    cfg = config.parse_config(args)
    plan = start_up(cfg, world_size=2)
    loaded = load_model(cfg)
    assert plan.train_sets[0].group_size == 3
    for rank in (0, 1):
        thread = every_micro_batch(plan, loaded, rank, 0, workers=0)
        assert len(thread[0][1]) == 4  # query, pos, two negatives
        assert_same(every_micro_batch(plan, loaded, rank, 0, workers=2), thread)


def test_two_processes_with_two_workers_each_train_as_the_reader_thread_resume_included(tmp_path, tiny_model):
    common = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--max-steps", 6]
    common += ["--per-device-batch-size", 8, "--max-seq-length", '{"anchor": 12}', "--prompts", PROMPTS]
    common += ["--log-steps", 1, "--save-steps", 3, "--lr", 1e-3, "--seed", 5]
    warm_run([*common, "--tokenize-workers", 0, "--output-dir", tmp_path / "thread"], nproc=2)
    # Two workers a rank; rank 1 killed after the step-3 save, then resumed, with workers again.
    args = [*common, "--tokenize-workers", 2, "--output-dir", tmp_path / "workers", "--resume", "auto"]
    first = run_train(args, nproc=2, kill="after-save:3:1", check=False)
    assert first.returncode != 0 and not (tmp_path / "workers" / "final").exists()
    second = warm_run(args, nproc=2)
    assert f"resuming from {tmp_path / 'workers' / 'checkpoints' / 'step-3'}" in second.stdout + second.stderr
    got, want = read_metrics(tmp_path / "workers"), read_metrics(tmp_path / "thread")
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    trained, reference = (export_weights(tmp_path / run / "final") for run in ("workers", "thread"))
    assert all(torch.equal(trained[k], reference[k]) for k in reference)
    time.sleep(2)  # a worker whose parent was killed notices within a second
    assert not worker_processes()


def worker_processes():
    """Worker processes (multiprocessing's spawn) still alive on this machine: after a run whose
    rank was killed, none should be (the suite runs one test at a time)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing" in command and "spawn" in command and int(pid) != os.getpid():
            left.append((pid, command))
    return left


def test_what_a_worker_raises_is_raised_in_the_run_and_a_dead_worker_is_named(tmp_path):
    args = ["--train-data", data_file("sick-pairs-train.jsonl"), "--output-dir", str(tmp_path / "out")]
    cfg = config.parse_config([*args, "--per-device-batch-size", "8", "--max-steps", "6"])
    plan = start_up(cfg)
    loaded = load_model(cfg)
    broken = dataclasses.replace(loaded, column_lengths={"anchor": "nine"})  # not a length
    with pytest.raises(TypeError) as in_thread:
        every_micro_batch(plan, broken, 0, 0, workers=0)
    with pytest.raises(TypeError) as in_worker:
        every_micro_batch(plan, broken, 0, 0, workers=1)
    assert str(in_worker.value) == str(in_thread.value)
    reader = batches.micro_batches(
        dataclasses.replace(plan, tokenize_workers=1), loaded, [None], 0, 0, lambda *a: a[0].name
    )
    assert next(reader) == plan.train_sets[0].name
    for worker in multiprocessing.active_children():
        worker.kill()
    with pytest.raises(RuntimeError, match=r"a tokenizing worker \(--tokenize-workers\) died"):
        list(reader)
