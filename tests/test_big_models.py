"""Models that do not fit one device: under FSDP no rank holds the whole model.

- Sharded loading: the model is built on the meta device, sharded, and each rank reads from the
  safetensors files only the slices its shards hold. Trained a few steps, it equals one process
  that loaded the model in full (conftest.assert_same_training: per-step losses, gradient norms
  and every exported tensor to 1e-5): a Qwen2 task checkpoint (its weights under `model.`, an
  lm_head to ignore) under FSDP2 at world 2, Llama under FSDP2 at world 4. (BERT:
  tests/test_equivalence.py, FSDP1 and FSDP2 at world 2, FSDP1 and hybrid at world 4, now all
  loaded this way.)
- Under FSDP2 a rank that does not write never makes a tensor as large as a whole parameter,
  while loading or while exporting: the largest it makes is the embedding's shard (watched from
  outside by tests/memory_worker.py); the writer does read the embedding whole, which shows the
  watch sees what it should.
- Nor a whole gradient while training (FSDP2): one forward per micro-batch, and a reduce-scatter
  in every backward (also between accumulation steps); a step raises a rank's resident memory
  by its gradient shards and a few blocks, where two forwards before one backward raise it by
  most of a whole gradient more (the control).
- The export in files of at most --export-max-shard-size, with an index, in fp32, bf16 or fp16:
  sentence-transformers and AutoModel load it, its tensors are of that dtype, and its embeddings
  equal the trained model's in memory: fp32 to 1e-5; bf16 and fp16 to the rounding of their
  weights (8 and 11 significant bits; measured 3.6e-3 and 4.0e-4 on unit-length embeddings, held
  to 1e-2 and 1e-3).
- A bf16 checkpoint trains fp32 master weights (transformers 5 would load it in bf16, where
  small updates round away).
- A folder the slices cannot be read from (pytorch_model.bin) is loaded in full, with a note.

Run: python -m pytest tests/test_big_models.py
"""

import json
import math

import pytest
import torch
import transformers
from conftest import (
    load_model,
    REPO_DIR,
    assert_same_training,
    data_file,
    export_weights,
    sentences,
    tiny_decoder,
    warm_run,
)
from safetensors import safe_open

from fsdp_embed import config


from fsdp_embed import __main__ as full_train

ARGS = [
    "--train-data",
    data_file("sick-pairs-train.jsonl"),
    "--loss",
    "mnrl",
    "--pooling",
    "lasttoken",
    "--append-eos",
    "--normalize",
    "--max-seq-length",
    32,
    "--max-steps",
    3,
    "--lr",
    1e-3,
    "--dropout",
    0,
    "--log-steps",
    1,
    "--max-grad-norm",
    0.1,
    "--seed",
    5,
]
TEXTS = sentences(3000)[2990:]


def causal_lm(base, folder):
    """The tiny Qwen2 as a task checkpoint, as LLMs ship: Qwen2ForCausalLM, weights under `model.`."""
    transformers.Qwen2ForCausalLM.from_pretrained(base).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def test_fsdp2_loads_and_exports_without_a_whole_parameter_on_the_other_rank(tmp_path):
    model = causal_lm(tiny_decoder(tmp_path / "base", "qwen2"), tmp_path / "lm")
    with safe_open(model / "model.safetensors", framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" in f.keys()
        vocab, dim = f.get_slice("model.embed_tokens.weight").get_shape()
    # Shards of at most 40 KB: the embedding (vocab x 64 x 4 bytes, ~100 KB) alone, the rest grouped.
    # full_shard, as --sharding auto picks for a model that does not fit (for this tiny one it
    # would pick shard_grad_op, which keeps the embedding tables whole on every rank).
    proc = warm_run(
        [
            "--model",
            model,
            *ARGS,
            "--per-device-batch-size",
            4,
            "--strategy",
            "fsdp",
            "--fsdp-version",
            2,
            "--sharding",
            "full_shard",
            "--export-max-shard-size",
            "40KB",
            "--output-dir",
            tmp_path / "fsdp2",
        ],
        nproc=2,
        script=REPO_DIR / "tests" / "memory_worker.py",
    )
    assert "loads the whole model" not in proc.stdout + proc.stderr
    other = json.loads((tmp_path / "fsdp2" / "memory-rank-1.json").read_text())
    writer = json.loads((tmp_path / "fsdp2" / "memory-rank-0.json").read_text())
    shard = math.ceil(vocab / 2) * dim * 4  # bytes of the embedding's shard, the largest there is
    assert other["load"] <= shard and other["export"] <= shard, (other, shard, vocab * dim * 4)
    assert writer["export"] >= vocab * dim * 4  # the writer reads it whole: the watch sees reads

    index = json.loads((tmp_path / "fsdp2" / "final" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (tmp_path / "fsdp2" / "final" / "model.safetensors").exists()
    for file in files:
        with safe_open(tmp_path / "fsdp2" / "final" / file, framework="pt") as f:
            sizes = [math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (file, sizes)
    warm_run(
        [
            "--model",
            model,
            *ARGS,
            "--per-device-batch-size",
            4,
            "--grad-accum-steps",
            2,
            "--output-dir",
            tmp_path / "one",
        ]
    )
    assert_same_training(tmp_path / "fsdp2", tmp_path / "one", num_steps=3)


def test_fsdp2_training_never_holds_a_whole_gradient(tmp_path):
    """A 24-block decoder (4 MB a block, 99% of the model in blocks) under FSDP2 at world 2, with
    activation checkpointing (so that activations stay small beside the weights): the trainer runs
    one forward per micro-batch (both columns together), and from a step's start to the end of
    its backward a rank's resident memory rises by this rank's gradient shards (half the fp32
    model, set to None after each step) and a few blocks, far less than a whole gradient more;
    so it does with 2 accumulation steps, where every backward reduce-scatters (FSDP's no-sync
    would keep the unsharded gradients; GradCache's chunks go through the same
    sharding.gradient_sync).
    The control: with --length-buckets 2 (two forwards before one backward) the same watch sees
    most of a whole gradient more (autograd keeps each block's gradient from the second forward
    until backward reaches the first forward's block)."""
    model = tiny_decoder(
        tmp_path / "base",
        "qwen2",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    fp32 = 4 * sum(p.numel() for p in transformers.AutoModel.from_pretrained(model).parameters())
    beyond_shards = {}
    for name, options, forwards in [
        ("default", [], 1),
        ("two-forwards", ["--length-buckets", 2], 2),
        ("accumulation", ["--grad-accum-steps", 2], 2),
    ]:
        out = tmp_path / name
        warm_run(
            [
                "--model",
                model,
                *ARGS,
                "--per-device-batch-size",
                2,
                "--strategy",
                "fsdp",
                "--fsdp-version",
                2,
                "--sharding",  # memory first, as for a model that does not fit: also glibc's setting
                "full_shard",
                "--activation-checkpointing",
                *options,
                "--output-dir",
                out,
            ],
            nproc=2,
            script=REPO_DIR / "tests" / "memory_worker.py",
        )
        for rank in (0, 1):
            watched = json.loads((out / f"memory-rank-{rank}.json").read_text())
            assert watched["forwards"] == 3 * forwards, (name, watched)  # 3 steps
            assert len(watched["step_rise"]) == 2
            beyond_shards[name, rank] = (max(watched["step_rise"]) - fp32 / 2) / fp32
    print(
        f"largest rise in a step minus the gradient shards, x the fp32 model ({fp32 / 2**20:.0f} MiB):",
        beyond_shards,
    )
    assert all(beyond_shards["two-forwards", rank] >= 0.6 for rank in (0, 1)), (
        beyond_shards
    )  # the watch sees it
    assert all(beyond_shards[name, rank] <= 0.4 for name in ("default", "accumulation") for rank in (0, 1)), (
        beyond_shards
    )


def test_llama_at_world_4_loaded_into_shards_trains_as_one_process(tmp_path):
    """FSDP2; FSDP1 at world 4 loads the same way in tests/test_equivalence.py (BERT)."""
    tiny_decoder(tmp_path / "base", "llama", padding_side="right")
    warm_run(
        [
            "--model",
            tmp_path / "base",
            *ARGS,
            "--per-device-batch-size",
            2,
            "--grad-accum-steps",
            4,
            "--output-dir",
            tmp_path / "one",
        ]
    )
    proc = warm_run(
        [
            "--model",
            tmp_path / "base",
            *ARGS,
            "--per-device-batch-size",
            2,
            "--strategy",
            "fsdp",
            "--fsdp-version",
            2,
            "--output-dir",
            tmp_path / "fsdp2",
        ],
        nproc=4,
    )
    assert "loads the whole model" not in proc.stdout + proc.stderr
    assert_same_training(tmp_path / "fsdp2", tmp_path / "one", num_steps=3)


def embeddings(model, tokenizer, texts):
    with torch.no_grad():
        return model.eval()(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))


@pytest.mark.parametrize("dtype,tolerance", [("fp32", 1e-5), ("bf16", 1e-2), ("fp16", 1e-3)])
def test_sharded_export_loads_in_sentence_transformers_and_automodel(dtype, tolerance, tmp_path):
    from sentence_transformers import SentenceTransformer

    base = tiny_decoder(tmp_path / "base", "qwen2")
    cfg = config.parse_config(
        [
            str(a)
            for a in [
                "--model",
                base,
                *ARGS,
                "--per-device-batch-size",
                8,
                "--export-max-shard-size",
                "40KB",
                "--export-dtype",
                dtype,
                "--output-dir",
                tmp_path / "out",
            ]
        ]
    )
    model = full_train.main(cfg)
    final = tmp_path / "out" / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert len(set(index["weight_map"].values())) >= 3
    assert {t.dtype for t in export_weights(final).values()} == {torch_dtype}

    tokenizer = transformers.AutoTokenizer.from_pretrained(final)  # it appends EOS, as in training
    ours = embeddings(model, tokenizer, TEXTS)
    st = SentenceTransformer(str(final), device="cpu")
    assert (st.encode(TEXTS, convert_to_tensor=True).float() - ours).abs().max().item() <= tolerance
    auto = transformers.AutoModel.from_pretrained(final)
    assert auto.dtype == torch_dtype
    with torch.no_grad():
        for text, want in zip(TEXTS, ours):  # one text at a time: its last token is its EOS
            got = (
                auto(**tokenizer([text], truncation=True, return_tensors="pt"))
                .last_hidden_state[0, -1]
                .float()
            )
            assert (torch.nn.functional.normalize(got, dim=0) - want).abs().max().item() <= tolerance


def test_a_bf16_checkpoint_trains_fp32_master_weights(tmp_path):
    base = tiny_decoder(tmp_path / "base", "llama")
    transformers.LlamaModel.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    # lr 1e-6: an update far below bf16's resolution, which bf16 weights would round away.
    model = full_train.main(
        config.parse_config(
            [
                str(a)
                for a in [
                    "--model",
                    base,
                    *ARGS,
                    "--per-device-batch-size",
                    8,
                    "--lr",
                    1e-6,
                    "--max-grad-norm",
                    0,
                    "--output-dir",
                    tmp_path / "out",
                ]
            ]
        )
    )
    trained = export_weights(tmp_path / "out" / "final")
    with safe_open(base / "model.safetensors", framework="pt") as f:
        start = {k: f.get_tensor(k) for k in f.keys()}
    assert {p.dtype for p in model.parameters()} == {t.dtype for t in trained.values()} == {torch.float32}
    weight = "layers.0.mlp.up_proj.weight"
    assert start[weight].dtype == torch.bfloat16
    moved = (trained[weight] != start[weight].float()).float().mean().item()
    assert moved > 0.9 and (trained[weight] - start[weight].float()).abs().max().item() < 1e-4


def test_weights_that_cannot_be_read_by_slices_are_loaded_in_full_with_a_note(tmp_path, capsys):
    base = tiny_decoder(tmp_path / "base", "qwen2")
    (tmp_path / "bin").mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bin" / file).write_bytes((base / file).read_bytes())
    with safe_open(
        base / "model.safetensors", framework="pt"
    ) as f:  # the older pickle format, which has no slices to read
        torch.save({k: f.get_tensor(k) for k in f.keys()}, tmp_path / "bin" / "pytorch_model.bin")
    on_meta = load_model(config.Config(model=str(base)), 0, on_meta=True)
    assert on_meta.pretrained_dir == str(base) and all(p.is_meta for p in on_meta.model.parameters())
    assert (
        on_meta.pretrained_names["encoder.layers.1.mlp.down_proj.weight"] == "layers.1.mlp.down_proj.weight"
    )
    in_full = load_model(config.Config(model=str(tmp_path / "bin")), 0, on_meta=True)
    assert (
        in_full.pretrained_dir is None and "note: every rank loads the whole model" in capsys.readouterr().out
    )
    want = load_model(config.Config(model=str(base)), 0).model.state_dict()
    assert all(torch.equal(in_full.model.state_dict()[k], v) for k, v in want.items())
