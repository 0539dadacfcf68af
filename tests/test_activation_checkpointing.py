"""--activation-checkpointing changes memory, never results: with dropout on (the recomputed
blocks replay the same dropout masks), per-step losses, gradient norms and final weights equal a
run without it (<= 1e-5) in one process, under DDP, FSDP1, and FSDP2 with GradCache and LoRA, at
world 2. And it really recomputes: every block's forward runs twice per step instead of once
(seen by a forward hook, from outside).

Run: python -m pytest tests/test_activation_checkpointing.py
"""

import pytest
from conftest import assert_same_training, data_file, warm_run

from fsdp_embed import config

from fsdp_embed import embedding_model

from fsdp_embed import __main__ as full_train

ARGS = [
    "--train-data",
    data_file("sick-triplets-train.jsonl"),
    "--loss",
    "mnrl",
    "--max-steps",
    3,
    "--max-seq-length",
    32,
    "--log-steps",
    1,
    "--lr",
    1e-3,
    "--dropout",
    0.1,
    "--per-device-batch-size",
    6,
]


def test_each_block_runs_twice_a_step_with_it(tmp_path, tiny_model, monkeypatch):
    calls = {}
    load_model = embedding_model.load_model

    def load_and_count(spec, *args, **options):
        loaded = load_model(spec, *args, **options)
        # A module inside each BertLayer: transformers checkpoints the layer's forward (the layer's
        # own hooks stay outside the checkpoint and run once), so what runs again is inside it.
        for layer in loaded.model.encoder.encoder.layer:
            layer.intermediate.register_forward_hook(
                lambda *_, key=spec.activation_checkpointing: calls.__setitem__(key, calls.get(key, 0) + 1)
            )
        return loaded

    monkeypatch.setattr(embedding_model, "load_model", load_and_count)
    for flags in ([], ["--activation-checkpointing"]):
        full_train.main(
            config.parse_config(
                [
                    str(a)
                    for a in [
                        "--model",
                        tiny_model,
                        *ARGS,
                        *flags,
                        "--output-dir",
                        tmp_path / str(len(flags)),
                    ]
                ]
            )
        )
    # 3 steps x 2 layers, the three columns together in one or more length-sorted forwards
    assert calls[True] == 2 * calls[False] and calls[False] >= 3 * 2
    assert_same_training(tmp_path / "1", tmp_path / "0", num_steps=3)


@pytest.mark.parametrize(
    "strategy",
    [
        ["--strategy", "ddp"],
        ["--strategy", "fsdp", "--fsdp-version", 1],
        [
            "--strategy",
            "fsdp",
            "--fsdp-version",
            2,
            "--cache-chunk-size",
            2,
            "--lora-rank",
            4,
            "--lora-dropout",
            0.1,
        ],
    ],
    ids=["ddp", "fsdp1", "fsdp2-gradcache-lora"],
)
def test_activation_checkpointing_at_world_2_gives_the_same_training(strategy, tmp_path, tiny_model):
    for flags, out in (([], "plain"), (["--activation-checkpointing"], "checkpointed")):
        warm_run(["--model", tiny_model, *ARGS, *strategy, *flags, "--output-dir", tmp_path / out], nproc=2)
    assert_same_training(tmp_path / "checkpointed", tmp_path / "plain", num_steps=3)
