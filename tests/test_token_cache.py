"""Texts tokenized once (--tokenize once, token_cache.py): every micro-batch's features equal, as
tensors, those of tokenizing it on the fly (batches.collate with LoadedModel.tokenize), for
all-MiniLM-L6-v2 and for a decoder that pads left and appends EOS (another file without
--append-eos), both with prompts and a column of its own length; a writer that fails leaves no
file a later run reads, and windows of rows write the same table as one; two processes train to
the same losses and weights either way, one process of the host writes the file, a later run
reads it unchanged, a changed prompt or length writes another.

Run: python -m pytest tests/test_token_cache.py
"""

import dataclasses
import json
import os
import re
import shutil
import time

import pyarrow as pa
import pytest
import torch
from conftest import data_file, export_weights, load_model, read_metrics, start_up, tiny_decoder, warm_run

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import token_cache
from fsdp_embed import __main__ as full_train

PROMPTS = '{"anchor": "query: ", "positive": "passage: "}'


def fresh_copy(tmp_path, name="sick-pairs-train.jsonl"):
    """A copy of a data file at a path of its own: a data set cache, and so a token file, no
    earlier run made."""
    (tmp_path / "data").mkdir(exist_ok=True)
    return str(shutil.copy(data_file(name), tmp_path / "data" / name))


def set_up(tmp_path, extra=()):
    """The plan (world 2), the loaded model and the training set of SICK pairs with prompts and
    the anchors cut at 9 tokens."""
    args = ["--train-data", fresh_copy(tmp_path), "--output-dir", str(tmp_path / "out")]
    args += ["--prompts", PROMPTS, "--max-seq-length", '{"anchor": 9}', "--per-device-batch-size", "8"]
    cfg = config.parse_config([*args, *extra])
    plan = start_up(cfg, world_size=2)
    return cfg, plan, load_model(cfg), plan.train_sets[0]


@pytest.mark.quick
@pytest.mark.parametrize("model", ["minilm", "decoder-eos"])
def test_cached_ids_pad_to_the_features_of_on_the_fly_tokenizing(tmp_path, model):
    extra = []
    if model == "decoder-eos":
        extra = ["--model", str(tiny_decoder(tmp_path / "decoder")), "--append-eos", "--pooling", "lasttoken"]
    cfg, plan, loaded, ts = set_up(tmp_path, extra)
    assert token_cache.unsupported(loaded.tokenizer) == ""
    table, path, wrote = token_cache.write_or_read_token_table(ts, loaded, str(tmp_path / "fallback"), "f")
    assert wrote and os.path.exists(path) and not str(path).startswith(str(tmp_path / "fallback"))
    assert loaded.tokenizer.padding_side == ("left" if model == "decoder-eos" else "right")
    for step in range(3):
        _, _, rows_of_step = plan.schedule[step]
        for rank in (0, 1):
            indices = batches.micro_batch_indices(rows_of_step, rank, 0, 8, 2)
            rows = ts.ds[indices]
            want, _ = batches.collate(
                rows, ts.text_columns, ts.target, ts.loss, loaded.tokenize, "cpu", ts.prompts
            )
            got = token_cache.features(table, indices, ts.text_columns, loaded)
            assert [sorted(f) for f in got] == [sorted(f) for f in want]
            for g, w in zip(got, want):
                assert all(torch.equal(g[k], w[k]) for k in w), (step, rank)
    anchors = table.column("anchor").to_pylist()
    assert max(len(i) for i in anchors) == 9  # the column's own length
    if model == "decoder-eos":  # every text ends with EOS, kept through the cut
        eos = loaded.tokenizer.eos_token_id
        assert all(i[-1] == eos for c in ts.text_columns for i in table[c].to_pylist())
        without_eos = load_model(dataclasses.replace(cfg, append_eos=False))
        assert token_cache.cache_path(ts, without_eos, str(tmp_path / "fallback"), "f") != path
    else:
        assert "token_type_ids" in got[0]
    # The same data, tokenizer and settings: the file is read, not written again.
    again = token_cache.write_or_read_token_table(ts, loaded, str(tmp_path / "fallback"), "f")
    assert again[1:] == (path, False)


@pytest.mark.quick
def test_a_failed_writer_leaves_no_file_and_windows_write_the_same_table(tmp_path, monkeypatch):
    cfg, plan, loaded, ts = set_up(tmp_path)
    whole, path, _ = token_cache.write_or_read_token_table(ts, loaded, str(tmp_path / "fallback"), "whole")
    monkeypatch.setattr(token_cache, "ROWS_AT_ONCE", 7)
    ids_of = token_cache.ids_of
    calls = []

    def fails_in_the_third_window(texts, *args):
        calls.append(len(texts))
        if len(calls) == 5:  # two columns a window
            raise OSError("killed")
        return ids_of(texts, *args)

    monkeypatch.setattr(token_cache, "ids_of", fails_in_the_third_window)
    with pytest.raises(OSError):
        token_cache.write_or_read_token_table(ts, loaded, str(tmp_path / "fallback"), "windows")
    folder = os.path.dirname(path)
    left = [name for name in os.listdir(folder) if name.startswith("tokens-") and ".tmp-" in name]
    assert left and not any(name.endswith(".arrow") for name in left)  # only its temporary name
    monkeypatch.setattr(token_cache, "ids_of", ids_of)
    windows, other, wrote = token_cache.write_or_read_token_table(
        ts, loaded, str(tmp_path / "fallback"), "windows"
    )
    assert wrote and other != path and windows.equals(whole)
    assert windows.column("anchor").num_chunks == -(-len(ts.ds) // 7)
    indices = [int(i) for i in torch.randperm(len(ts.ds), generator=torch.Generator().manual_seed(0))[:40]]
    by_chunks = token_cache.features(windows, indices, ts.text_columns, loaded)  # rows from many chunks
    for got, want in zip(by_chunks, token_cache.features(whole, indices, ts.text_columns, loaded)):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not [name for name in os.listdir(folder) if ".tmp-" in name]  # the killed writer's removed
    assert isinstance(windows.column("anchor").type, pa.ListType)


def test_two_processes_train_alike_on_ids_read_once_and_tokenized_on_the_fly(tmp_path, tiny_model):
    train_data = fresh_copy(tmp_path)
    common = ["--model", tiny_model, "--train-data", train_data, "--max-steps", 4, "--log-steps", 1]
    common += ["--per-device-batch-size", 8, "--max-seq-length", '{"anchor": 12}', "--prompts", PROMPTS]
    common += ["--tokenize", "once"]  # the last --tokenize given counts
    fly = warm_run([*common, "--tokenize", "on_the_fly", "--output-dir", tmp_path / "fly"], nproc=2)
    once = warm_run([*common, "--output-dir", tmp_path / "once"], nproc=2)
    assert "tokens of" not in fly.stdout
    written = [line for line in once.stdout.splitlines() if "tokens of sick-pairs-train: written to" in line]
    assert len(written) == 1, once.stdout[-3000:]  # one process of the host wrote it
    path = written[0].split("written to ")[1].split()[0]
    losses = {run: [r["loss"] for r in read_metrics(tmp_path / run)] for run in ("once", "fly")}
    assert len(losses["once"]) == 4 and losses["once"] == pytest.approx(losses["fly"], abs=1e-6)
    trained, reference = (export_weights(tmp_path / run / "final") for run in ("once", "fly"))
    assert max((trained[k] - reference[k]).abs().max().item() for k in reference) <= 1e-6
    # A later run reads the file, unchanged; another prompt or column length writes another.
    mtime = os.stat(path).st_mtime_ns
    again = warm_run([*common, "--output-dir", tmp_path / "again", "--max-steps", 1])
    assert f"read from {path}" in again.stdout and os.stat(path).st_mtime_ns == mtime
    for flag, value in (("--prompts", json.dumps({"anchor": "q: "})), ("--max-seq-length", "16")):
        changed = [*common, flag, value, "--output-dir", tmp_path / flag.strip("-"), "--max-steps", 1]
        other = warm_run(changed)
        assert "written to" in other.stdout and path not in other.stdout, (flag, other.stdout[-2000:])


@pytest.mark.quick
def test_writing_the_token_file_shows_progress_and_counts_as_start_up_not_training(
    tmp_path, tiny_model, monkeypatch, capfd
):
    write_table = token_cache.write_table

    def slow_write(*args):  # a data set large enough to take 4 s to tokenize
        time.sleep(4)
        return write_table(*args)

    monkeypatch.setattr(token_cache, "write_table", slow_write)
    args = ["--model", tiny_model, "--train-data", fresh_copy(tmp_path), "--max-steps", 3, "--log-steps", 1]
    args += ["--per-device-batch-size", 8, "--tokenize", "once", "--output-dir", tmp_path / "out"]
    full_train.main(config.parse_config([str(a) for a in args]))
    out, err = capfd.readouterr()
    assert "tokens of sick-pairs-train: written to" in out
    assert re.search(r"tokenizing sick-pairs-train: 100%.*rows/s", err), err[-2000:]  # tqdm's bar, its rate
    summary = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["startup_seconds"] >= 4 and summary["train_seconds"] < 4, summary
    assert summary["samples_per_s"] * summary["train_seconds"] == pytest.approx(3 * 8)
    steps = read_metrics(tmp_path / "out")
    assert steps[0]["samples_per_s"] > 8 / 4  # the first step's window holds no writing either
