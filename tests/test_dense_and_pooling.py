"""Dense layers and prompt-free pooling, against sentence-transformers itself.

- A SentenceTransformer folder shaped as EmbeddingGemma (a tiny random Gemma3, mean pooling,
  Dense 64 -> 96 -> 64, Normalize) embeds as sentence-transformers embeds it, and one MNRL step
  (plain, with prompts and include_prompt False, with Matryoshka, with GradCache, bidirectional)
  gives the loss and every gradient, the Dense layers' too, that sentence-transformers' own
  forward/backward gives on the same batch (MultipleNegativesRankingLoss, MatryoshkaLoss,
  CachedMultipleNegativesRankingLoss);
- --no-include-prompt pools as sentence-transformers' Pooling(include_prompt=False) on the same
  token states: mean, max, cls and lasttoken, left and right padding, texts the truncation cuts
  (the prompt's tokens counted as sentence-transformers counts them);
- max pooling in fp16 and bf16 gives what it gives in fp32 (no fill value that overflows fp16);
- packed rows and length-sorted sub-batches leave out the same prompt tokens as the padded batch.

Run: python -m pytest tests/test_dense_and_pooling.py
"""

import json
import shutil

import pytest
import torch
from conftest import (
    cached_backward,
    data_file,
    embed_columns,
    load_model,
    micro_batch_loss,
    pool_mask,
    tiny_decoder,
)

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import run_plan
from fsdp_embed import __main__ as full_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

PROMPTS = {"anchor": "task: search result | query: ", "positive": "title: none | text: "}


def rows(n=6):
    pairs = [json.loads(line) for line in open(data_file("sick-pairs-train.jsonl"))][:n]
    return {c: [r[c] for r in pairs] for c in ("anchor", "positive")}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny random Gemma3 (causal) as a plain HF folder, and a copy that attends both ways."""
    folder = tiny_decoder(tmp_path_factory.mktemp("gemma3"), arch="gemma3")
    both_ways = tmp_path_factory.mktemp("gemma3-bidirectional")
    shutil.copytree(folder, both_ways, dirs_exist_ok=True)
    model_config = json.loads((both_ways / "config.json").read_text())
    (both_ways / "config.json").write_text(json.dumps({**model_config, "use_bidirectional_attention": True}))
    return folder, both_ways


def st_folder(base, out, pooling="mean", include_prompt=True, max_seq_length=32):
    """sentence-transformers' own EmbeddingGemma-shaped folder on `base`: Transformer -> Pooling ->
    Dense(64 -> 96, no bias, Identity) -> Dense(96 -> 64, Tanh) -> Normalize, fresh Dense layers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(1)
    modules = [
        Transformer(str(base), max_seq_length=max_seq_length),
        Pooling(64, pooling, include_prompt=include_prompt),
        Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
        Dense(96, 64, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def st_name(name):
    """sentence-transformers' name of one of our parameters: encoder.X -> 0.model.X,
    dense.i.X -> (i + 2).X."""
    if name.startswith("encoder."):
        return "0.model." + name.removeprefix("encoder.")
    _, index, rest = name.split(".", 2)
    return f"{int(index) + 2}.{rest}"


def largest_gradient_difference(ours, theirs):
    """max |grad ours - grad theirs| over every parameter, and the largest gradient (scale)."""
    their_grads = {name: p.grad for name, p in theirs.named_parameters() if p.grad is not None}
    differences, largest = [], 0.0
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        differences.append((p.grad - their_grads.pop(st_name(name))).abs().max().item())
        largest = max(largest, p.grad.abs().max().item())
    assert not their_grads, sorted(their_grads)  # every parameter of theirs has its counterpart
    return max(differences), largest


@pytest.mark.parametrize("variant", ["plain", "prompts", "matryoshka", "gradcache", "bidirectional"])
def test_one_step_equals_sentence_transformers_forward_and_backward(tmp_path, gemma, variant, keep_float64):
    """Both models in float64 (the casts to fp32 kept float64, on both sides): the comparison
    measures the two computations, not the CPU's fp32 summation order (~1e-5 of the largest
    gradient at scale 20, different on another CPU)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as st_losses

    causal, both_ways = gemma
    prompted = variant != "plain"
    folder = st_folder(causal, tmp_path / "ours", include_prompt=not prompted)
    # sentence-transformers gets the same folder, attending both ways where we pass --bidirectional
    their_folder = (
        st_folder(both_ways, tmp_path / "theirs", include_prompt=False)
        if variant == "bidirectional"
        else folder
    )
    cfg = config.Config(
        model=str(folder),
        dropout=0.0,
        prompts=json.dumps(PROMPTS) if prompted else "",
        matryoshka_dims="64,32" if variant == "matryoshka" else "",
        bidirectional=variant == "bidirectional",
    )
    plan = run_plan.resolve_flags(cfg, 1, torch.device("cpu"))
    loaded = load_model(cfg)
    loaded.model.to(torch.float64)
    assert [type(m).__name__ for m in loaded.model.dense] == ["DenseLayer", "DenseLayer"]
    assert loaded.include_prompt is not prompted
    batch = rows()
    features, _ = batches.collate(
        batch, ["anchor", "positive"], None, "mnrl", loaded.tokenize, "cpu", loaded.prompts
    )
    if variant == "gradcache":
        loss = cached_backward(
            loaded.model,
            features,
            lambda embs: full_train.embeddings_loss(loaded.model, embs, None, run_plan.LossPlan("mnrl")),
            2,
        )
    else:
        loss = micro_batch_loss(loaded.model, features, None, "mnrl", matryoshka=plan.matryoshka)
        loss.backward()

    st = SentenceTransformer(str(their_folder), device="cpu").to(torch.float64)
    st.train()
    their_features = [
        st.preprocess(batch[c], prompt=PROMPTS[c] if prompted else None) for c in ("anchor", "positive")
    ]
    if prompted:  # what sentence-transformers leaves out: the prompt's tokens, as we count them
        assert their_features[0]["prompt_length"] == loaded.prompt_length(PROMPTS["anchor"]) > 3
    mnrl = st_losses.MultipleNegativesRankingLoss(st)
    their_loss = {
        "matryoshka": lambda: st_losses.MatryoshkaLoss(st, mnrl, [64, 32]),
        "gradcache": lambda: st_losses.CachedMultipleNegativesRankingLoss(st, mini_batch_size=2),
    }.get(variant, lambda: mnrl)()(their_features, None)
    their_loss.backward()

    assert loss.dtype == their_loss.dtype == torch.float64
    # float64 sums in another order: ~3e-14 of the largest gradient (~14 here: embeddings' rows).
    # Except where a row is padded (left: "plain"; the prompted rows are all cut at 32 tokens):
    # transformers computes RoPE's angles m*theta in fp32 whatever the dtype, and we count m from
    # a row's first token, sentence-transformers from the padding (the same rotations, exactly);
    # fp32's rounding of an angle (m < 32, theta <= 1) is < 32 * eps_fp32 = 3.8e-6 of a rotation,
    # the relative bound on the loss and the gradients (measured: 6e-8 of the largest).
    padded = any(not f["attention_mask"].all() for f in their_features)
    tolerance = 32 * torch.finfo(torch.float32).eps if padded else 1e-10
    assert padded == (variant == "plain")
    assert abs(loss.item() - their_loss.item()) <= tolerance * max(1.0, abs(loss.item()))
    difference, largest = largest_gradient_difference(loaded.model, st)
    assert largest > 1e-3 and difference <= tolerance * max(1.0, largest), (difference, largest)
    loss_difference = abs(loss.item() - their_loss.item())
    print(f"{variant}: loss {loss_difference:.1e}, gradients {difference:.1e} of {largest:.1f}")


def test_the_model_embeds_as_sentence_transformers_and_a_bad_dense_module_is_refused(tmp_path, gemma):
    from sentence_transformers import SentenceTransformer

    folder = st_folder(gemma[0], tmp_path / "st", include_prompt=False)
    loaded = load_model(config.Config(model=str(folder)))
    loaded.model.eval()
    texts = rows(8)["anchor"]
    prompt = PROMPTS["anchor"]
    with torch.no_grad():
        ours = loaded.model(**loaded.tokenize([prompt + t for t in texts], prompts=[prompt] * len(texts)))
    theirs = SentenceTransformer(str(folder), device="cpu").encode(
        texts, prompt=prompt, convert_to_tensor=True
    )
    print("Dense model vs sentence-transformers encode:", (ours - theirs).abs().max().item())
    assert (ours - theirs).abs().max().item() <= 1e-5
    # A Dense module whose activation is not torch's would need remote code: refused, named.
    dense_config = folder / "2_Dense" / "config.json"
    dense_config.write_text(
        json.dumps({**json.loads(dense_config.read_text()), "activation_function": "my.Act"})
    )
    with pytest.raises(ValueError, match="2_Dense uses the activation my.Act"):
        load_model(config.Config(model=str(folder)))


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("pooling", ["mean", "max", "cls", "lasttoken"])
def test_no_include_prompt_pools_as_sentence_transformers_pooling(tmp_path, gemma, pooling, padding_side):
    """The same token states, pooled by embedding_model.pool over our pool mask and by
    sentence-transformers' Pooling(include_prompt=False) with its prompt_length: equal, with texts
    cut by truncation at 40 tokens (a prompt of 22 leaves 18 of the text: the count the mean
    divides by) and texts padded."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    folder = st_folder(gemma[0], tmp_path / "st", pooling, include_prompt=False, max_seq_length=40)
    loaded = load_model(config.Config(model=str(folder)))
    st = SentenceTransformer(str(folder), device="cpu")
    loaded.tokenizer.padding_side = st.tokenizer.padding_side = padding_side
    texts = ["short", *rows(7)["positive"]]
    for prompt in PROMPTS.values():
        tokens = loaded.tokenize([prompt + t for t in texts], prompts=[prompt] * len(texts))
        theirs = st.preprocess(texts, prompt=prompt)
        assert torch.equal(tokens["input_ids"], theirs["input_ids"])
        lengths = tokens["attention_mask"].sum(1)
        assert lengths.max() == 40 and lengths.min() < 40  # some texts cut, some padded
        kept = tokens["pool_mask"].sum(1)
        assert torch.equal(kept, lengths - theirs["prompt_length"])
        states = torch.randn(*tokens["input_ids"].shape, 64, dtype=torch.float64)  # no fp32 sums to bound
        ours = embedding_model.pool(states, tokens["pool_mask"], pooling)
        features = {"token_embeddings": states, "attention_mask": theirs["attention_mask"]}
        expected = Pooling(64, pooling, include_prompt=False)(
            {**features, "prompt_length": theirs["prompt_length"]}
        )["sentence_embedding"]
        print(f"{pooling}, {padding_side} padding: {(ours - expected).abs().max().item():.1e}")
        assert (ours - expected).abs().max().item() <= 1e-12
        with_prompt = Pooling(64, pooling)(dict(features))["sentence_embedding"]
        if pooling != "lasttoken":  # the last token is the text's either way
            assert (ours - with_prompt).abs().max().item() > 1e-3


def test_packed_rows_and_sub_batches_leave_out_the_same_prompt_tokens(tmp_path):
    """A packable decoder (tiny Qwen2, left padding) with --no-include-prompt: the packed forward
    and length-sorted sub-batches give the padded batch's embeddings, and they differ from
    pooling with the prompt (so the pool mask reached every path)."""
    folder = tiny_decoder(tmp_path / "qwen2", arch="qwen2")
    embeddings = {}
    for include in (False, True):
        cfg = config.Config(
            model=str(folder), prompts=json.dumps(PROMPTS), include_prompt=include, dropout=0.0
        )
        loaded = load_model(cfg)
        assert loaded.model.cannot_pack is None
        features, _ = batches.collate(
            rows(8), ["anchor", "positive"], None, "mnrl", loaded.tokenize, "cpu", loaded.prompts
        )
        model = loaded.model.eval()
        with torch.no_grad():
            padded = embed_columns(model, features)
            packed = embed_columns(model, features, embedding_model.pack(pool_mask(features)))
            sub = embed_columns(model, features, batches.sub_batches(pool_mask(features), 3, "cpu"))
        for got in (packed, sub):
            assert max((g - p).abs().max().item() for g, p in zip(got, padded)) <= 1e-5
        embeddings[include] = padded
    assert (embeddings[False][0] - embeddings[True][0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_pooling_in_low_precision_pools_as_in_fp32(dtype):
    """The left-out positions are filled with a value the dtype holds (-1e9 overflows fp16), below
    every kept one: the same maxima as in fp32, rounded to the dtype (rounding keeps the order)."""
    states_BTD = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)) * 10
    states_BTD[0] -= 1000  # every kept value far below zero: the fill must be lower still
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected_BD = embedding_model.pool(states_BTD, mask_BT, "max").to(dtype)
    got_BD = embedding_model.pool(states_BTD.to(dtype), mask_BT, "max")
    assert got_BD.dtype == dtype
    assert torch.equal(got_BD, expected_BD)
