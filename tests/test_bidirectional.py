"""--bidirectional, and the whole EmbeddingGemma-shaped recipe at world 1 and 2.

- A causal decoder (tiny Gemma3) trained with --bidirectional attends over each whole text: its
  embeddings equal a naive forward with a full (padding-only) attention mask, with left padding,
  one text at a time and in length-sorted sub-batches; without the flag they differ;
- decoders whose config cannot carry the setting (Qwen2), whose code in this transformers does
  not honour it with padding (Gemma) are refused at start-up, one `error:` line from a
  two-process launch; models that attend both ways already (EmbeddingGemma's config, BERT) take
  the flag and embed as without it;
- the export of a run with Dense layers, --bidirectional, prompts and --no-include-prompt loads in
  sentence-transformers and in plain transformers (no remote code) attending both ways, and
  embeds as the trained model in memory did;
- that recipe trains the same (per-step loss, gradient norm, every exported tensor, the Dense
  layers' too) at world 2 under DDP, FSDP2 and FSDP1, with GradCache and with LoRA, as at world 1.

Run: python -m pytest tests/test_bidirectional.py
"""

import json
import shutil

import pytest
import torch
import transformers
from conftest import (
    assert_same_training,
    data_file,
    embed_columns,
    export_weights,
    load_model,
    pool_mask,
    run_train,
    sentences,
    start_up,
    tiny_decoder,
    warm_run,
)

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import model_card
from fsdp_embed import __main__ as full_train

PROMPTS = {"anchor": "task: search result | query: ", "positive": "title: none | text: "}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return tiny_decoder(tmp_path_factory.mktemp("gemma3"), arch="gemma3")


@pytest.fixture(scope="module")
def gemma_st(tmp_path_factory, gemma):
    """An EmbeddingGemma-shaped SentenceTransformer folder on the causal tiny Gemma3:
    Transformer -> Pooling(mean) -> Dense(64 -> 96) -> Dense(96 -> 64) -> Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(1)
    modules = [
        Transformer(str(gemma), max_seq_length=48),
        Pooling(64, "mean"),
        Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
        Dense(96, 64, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    folder = tmp_path_factory.mktemp("gemma3-st")
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def naive_full_attention(folder, tokens, dtype=torch.float32):
    """Mean-pooled token states of the causal model at `folder`, in `dtype`, run with a ready 4D
    mask that lets every position see every real token of its row (what bidirectional means),
    positions counted from each row's first real token. SDPA attention: eager's softmax runs in
    fp32 whatever the dtype (7.7e-8 from float64's here)."""
    encoder = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="sdpa").to(dtype).eval()
    mask_BT = tokens["attention_mask"]
    allowed_B1TT = mask_BT[:, None, None, :].bool().expand(-1, 1, mask_BT.shape[1], -1)
    additive_B1TT = torch.zeros(allowed_B1TT.shape, dtype=dtype).masked_fill(
        ~allowed_B1TT, torch.finfo(dtype).min
    )
    positions_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        states_BTD = encoder(
            input_ids=tokens["input_ids"], attention_mask=additive_B1TT, position_ids=positions_BT
        ).last_hidden_state
    mask_BT1 = mask_BT.unsqueeze(-1).to(dtype)
    return (states_BTD * mask_BT1).sum(1) / mask_BT1.sum(1)


@pytest.mark.quick
def test_bidirectional_attention_is_full_attention_over_each_text(gemma, keep_float64):
    """In float64 (the same rotations on both sides: positions from each row's first token): the
    comparison measures the attention masks, not the CPU's fp32 summation order (6e-7 in fp32)."""
    texts = sentences(12)
    loaded = load_model(config.Config(model=str(gemma), bidirectional=True, dropout=0.0))
    assert not loaded.model.causal and loaded.tokenizer.padding_side == "left"
    assert loaded.export_config.use_bidirectional_attention is True
    model = loaded.model.to(torch.float64).eval()
    tokens = loaded.tokenize(texts)
    assert tokens["attention_mask"].sum(1).min() < tokens["attention_mask"].shape[1]  # some rows padded
    features = [tokens]
    with torch.no_grad():
        ours = model(**tokens)
        sub = embed_columns(model, features, batches.sub_batches(pool_mask(features), 3, "cpu"))[0]
        alone = torch.cat([model(**loaded.tokenize([t])) for t in texts])  # no padding: no mask built
        causal = load_model(config.Config(model=str(gemma), dropout=0.0)).model.eval()(**tokens)
    naive = naive_full_attention(gemma, tokens, torch.float64)
    differences = [(got - naive).abs().max().item() for got in (ours, sub, alone)]
    print("bidirectional vs a naive full-attention forward (padded, sub-batches, alone):", differences)
    assert ours.dtype == naive.dtype == torch.float64
    assert max(differences) <= 1e-10 * naive.abs().max().item()
    assert (causal - naive).abs().max().item() > 1e-3


@pytest.mark.quick
@pytest.mark.parametrize(
    "arch,message",
    [
        ("qwen2", r"the config of qwen2 models \(Qwen2Config\) cannot carry use_bidirectional_attention"),
        ("gemma", r"gemma models in transformers .* do not attend both ways .*\(not with padding\)"),
    ],
)
def test_models_that_cannot_attend_both_ways_are_refused_at_start_up(tmp_path, arch, message):
    folder = tiny_decoder(tmp_path / arch, arch=arch)
    cfg = config.Config(model=str(folder), bidirectional=True, output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=f"^--bidirectional: .*{message}"):
        start_up(cfg)
    start_up(config.Config(model=str(folder), output_dir=str(tmp_path / "out")))  # causal: fine


@pytest.mark.quick
def test_models_that_attend_both_ways_already_take_the_flag(tmp_path, gemma, tiny_model):
    """A Gemma3 whose config says bidirectional already (EmbeddingGemma's) and an encoder (BERT):
    --bidirectional is accepted and changes nothing (the same embeddings without it)."""
    already = tmp_path / "gemma3-bidirectional"
    shutil.copytree(gemma, already)
    model_config = json.loads((already / "config.json").read_text())
    (already / "config.json").write_text(json.dumps({**model_config, "use_bidirectional_attention": True}))
    for folder in (already, tiny_model):
        cfg = config.Config(
            model=str(folder), bidirectional=True, output_dir=str(tmp_path / "out"), dropout=0.0
        )
        start_up(cfg)
        loaded, plain = load_model(cfg), load_model(config.Config(model=str(folder), dropout=0.0))
        assert not loaded.model.causal and not plain.model.causal
        tokens = loaded.tokenize(sentences(6))
        with torch.no_grad():
            assert torch.equal(loaded.model.eval()(**tokens), plain.model.eval()(**tokens))


def test_a_refused_model_stops_a_launch_with_one_error_line(tmp_path):
    folder = tiny_decoder(tmp_path / "qwen2", arch="qwen2")
    result = run_train(
        ["--model", folder, "--bidirectional", "--output-dir", tmp_path / "out"], nproc=2, check=False
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith("error: --bidirectional: the config of qwen2 models")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_export_attends_both_ways_keeps_its_dense_layers_and_embeds_as_trained(tmp_path, gemma_st):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "out"
    args = [
        "--model", gemma_st, "--train-data", data_file("sick-pairs-train.jsonl"), "--loss", "mnrl",
        "--per-device-batch-size", 8, "--max-steps", 3, "--lr", 1e-3, "--dropout", 0,
        "--bidirectional", "--no-include-prompt", "--prompts", json.dumps(PROMPTS), "--output-dir", out,
    ]  # fmt: skip
    trained = full_train.main(config.parse_config([str(a) for a in args])).eval()
    final = out / "final"
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads((final / "modules.json").read_text())]
    assert kinds == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert json.loads((final / "1_Pooling" / "config.json").read_text())["include_prompt"] is False
    assert json.loads((final / "config.json").read_text())["use_bidirectional_attention"] is True
    for dense in ("2_Dense", "3_Dense"):  # the layout and settings sentence-transformers wrote
        assert sorted(p.name for p in (final / dense).iterdir()) == ["config.json", "model.safetensors"]
        # the settings sentence-transformers wrote, but the names of the input and output (its
        # default; versions before 5 refuse keys they do not know)
        ours = json.loads((final / dense / "config.json").read_text())
        assert ours.items() <= json.loads((gemma_st / dense / "config.json").read_text()).items()
    base = export_weights(gemma_st / "2_Dense")
    assert (export_weights(final / "2_Dense")["linear.weight"] - base["linear.weight"]).abs().max() > 1e-4

    texts = sentences(10)
    st = SentenceTransformer(str(final), device="cpu")
    assert st[0].model.config.use_bidirectional_attention is True
    reread = load_model(config.Config(model=str(final)))  # the export read back: pool mask, Dense
    assert not reread.include_prompt and len(reread.model.dense) == 2
    prompt = PROMPTS["anchor"]
    tokens = reread.tokenize([prompt + t for t in texts], prompts=[prompt] * len(texts))
    with torch.no_grad():
        ours = trained(**tokens)
        states = trained.encoder(**{k: tokens[k] for k in ("input_ids", "attention_mask")}).last_hidden_state
    theirs = st.encode(texts, prompt_name="anchor", convert_to_tensor=True)
    print("export in sentence-transformers vs trained:", (ours - theirs).abs().max().item())
    assert (ours - theirs).abs().max().item() <= 1e-5
    plain = transformers.AutoModel.from_pretrained(str(final)).eval()  # no remote code
    assert plain.config.use_bidirectional_attention is True
    with torch.no_grad():
        plain_states = plain(**{k: tokens[k] for k in ("input_ids", "attention_mask")}).last_hidden_state
    mask = tokens["attention_mask"].bool()
    print(
        "export in plain transformers vs trained (token states):",
        (plain_states - states)[mask].abs().max().item(),
    )
    assert (plain_states - states)[mask].abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------------------------
# The recipe at world 1 and 2


def recipe_args(model, dev, per_device_batch_size, out, extra=()):
    return [
        "--model", model, "--loss", "mnrl", "--train-data", data_file("sick-pairs-train.jsonl"),
        "--max-steps", 3, "--per-device-batch-size", per_device_batch_size, "--lr", 1e-3,
        "--dropout", 0, "--log-steps", 1, "--seed", 3, "--max-grad-norm", 0.1, "--gather-negatives",
        "--bidirectional", "--no-include-prompt", "--prompts", json.dumps(PROMPTS), "--save-steps", 0,
        "--eval-data", dev, "--output-dir", out, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, gemma_st):
    """The recipe's runs by name, each launched once; evaluated after the last step on retrieval
    pairs (anchor, positive: each column with its prompt, its tokens left out of pooling)."""
    dev = tmp_path_factory.mktemp("dev") / "sick-dev.jsonl"
    pairs = open(data_file("sick-pairs-train.jsonl")).read().splitlines()[-80:]
    dev.write_text("\n".join(pairs) + "\n")
    done = {}

    def run(name, nproc, extra=()):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            warm_run(recipe_args(gemma_st, dev, 8 // nproc, out, extra), nproc=nproc)
            done[name] = out
        return done[name]

    return run


CASES = {
    "ddp": ("reference", ["--strategy", "ddp"]),
    "fsdp2": ("reference", ["--strategy", "fsdp"]),
    "fsdp1": ("reference", ["--strategy", "fsdp", "--fsdp-version", "1"]),
    "fsdp2-gradcache": ("reference", ["--strategy", "fsdp", "--cache-chunk-size", 2]),
    "fsdp1-gradcache": ("reference", ["--strategy", "fsdp", "--fsdp-version", "1", "--cache-chunk-size", 2]),
    "fsdp2-lora": ("lora", ["--strategy", "fsdp", "--lora-rank", 4]),
    "fsdp1-lora": ("lora", ["--strategy", "fsdp", "--fsdp-version", "1", "--lora-rank", 4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_recipe_trains_at_world_2_as_at_world_1(recipe_runs, case):
    reference, extra = CASES[case]
    want = recipe_runs(reference, 1, ["--lora-rank", 4] if reference == "lora" else [])
    got = recipe_runs(case, 2, extra)
    assert_same_training(got, want, 3)
    for dense in ("2_Dense", "3_Dense"):
        got_weights, want_weights = (
            export_weights(got / "final" / dense),
            export_weights(want / "final" / dense),
        )
        assert got_weights.keys() == want_weights.keys()
        for name in want_weights:
            assert (got_weights[name] - want_weights[name]).abs().max().item() <= 1e-5, (dense, name)
    # the sharded evaluator's metrics, as at world 1
    got_eval, want_eval = (model_card.last_evaluation(out) for out in (got, want))
    assert got_eval.keys() == want_eval.keys() and "sick-dev/mrr@10" in want_eval
    assert all(abs(got_eval[k] - want_eval[k]) <= 1e-5 for k in want_eval), (got_eval, want_eval)
    record = json.loads((got / "final" / "training_config.json").read_text())
    assert record["attention"] == "bidirectional" and record["include_prompt_used"] is False
