"""Inference-free SPLADE (fsdp_embed/inference_free.py) against sentence-transformers itself: a
SparseEncoder whose Router sends queries to a SparseStaticEmbedding and documents to the fill-mask
Transformer + SpladePooling. One micro-batch's loss and every gradient equal SpladeLoss(SparseMNRL)
without a query regulariser on that Router; the static weights train at their own learning rate
with weight decay, as the Hugging Face Trainer with learning_rate_mapping sets them; world 2
trains as world 1; the export loads in SparseEncoder 6 and encodes queries (with no forward of the
model) and documents as the trained model does; a Router folder trains with no flag (frozen
weights stay); an IDF file starts the weights as SparseStaticEmbedding.from_json does; retrieval
evaluation equals SparseInformationRetrievalEvaluator at world 1 and 2; bad input ends with one
error: line.

    python -m pytest tests/test_inference_free.py -q
"""

import json

import pytest
import torch
from conftest import assert_same_training, data_file, load_model, read_metrics, run_train, warm_run
from conftest import assert_sparse_retrieval_as_sentence_transformers

from fsdp_embed import config
from fsdp_embed import run_plan
from fsdp_embed import __main__ as full_train

TEXTS = {
    "anchor": [
        "a man plays a guitar",
        "two dogs run on the grass",
        "a woman cuts an onion",
        "kids swim kids",
    ],
    "positive": [
        "someone plays music",
        "dogs are running",
        "a person slices a vegetable",
        "children in a pool",
    ],
    "negative": ["a cat sleeps", "a car drives on a road", "the sky is blue", "a man reads a book"],
}
VOCAB = 30522  # the masked LM's vocabulary: the length of the sums (test_splade_training.py says why)


def router_model(masked_lm, weight=None, frozen=False):
    """sentence-transformers' inference-free SparseEncoder on `masked_lm`, as its docs build one."""
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling, Transformer

    documents = Transformer(str(masked_lm), transformer_task="fill-mask")
    queries = SparseStaticEmbedding(tokenizer=documents.tokenizer, weight=weight, frozen=frozen)
    router = Router.for_query_document(query_modules=[queries], document_modules=[documents, SpladePooling()])
    return SparseEncoder(modules=[router], similarity_fn_name="dot", device="cpu")


@pytest.fixture(scope="module")
def router_folder(masked_lm, tmp_path_factory):
    """The Router model saved by sentence-transformers, its static weights drawn in [0.5, 1.5)."""
    folder = tmp_path_factory.mktemp("router")
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1)) + 0.5
    router_model(masked_lm, weight).save(str(folder))
    return folder


def our_features(loaded):
    """The columns as the trainer's reader tokenizes them: column 0 the queries."""
    tasks = {"anchor": "query", "positive": "document", "negative": "document"}
    return [loaded.tokenize(t, [c] * len(t), tasks=[tasks[c]] * len(t)) for c, t in TEXTS.items()]


@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, VOCAB * torch.finfo(torch.float32).eps)]
)
def test_one_micro_batch_equals_splade_loss_on_a_router(router_folder, dtype, tolerance):
    """The trainer's loss of one micro-batch of (query, positive, negative) rows on a Router
    folder equals SpladeLoss(SparseMultipleNegativesRankingLoss, query_regularizer_weight=None) on
    sentence-transformers' own load of the folder, queries routed to the static embedding: the loss
    and every parameter's gradient, the static weights' too, to `tolerance` of the largest. The
    query regulariser is off as in the recipe (no --query-regularizer-weight given), and the
    queries are tokenized without [CLS] / [SEP]: with either, the static gradient differs."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    cfg = config.parse_config(["--model", str(router_folder)])
    plan = run_plan.flags_plan(cfg, 1, torch.device("cpu"))
    assert plan.model.inference_free
    loaded = load_model(cfg)
    model = loaded.model.to(dtype)
    settings = run_plan.loss_plan(plan, cfg, "mnrl", False, 0, gather=False).splade
    settings |= {"document_regularizer_weight": 0.001}  # large enough to show beyond the tolerance
    assert not settings["query_regularizer_weight"]  # the recipe's: none on the static side
    features = our_features(loaded)
    pool = full_train.batches.pool_columns(features, static_queries=True)
    embs = (
        list(model(**pool).chunk(3)) if dtype == torch.float64 else full_train.embed_columns(model, pool, 3)
    )
    loss = full_train.embeddings_loss(
        model, embs, None, run_plan.LossPlan("mnrl", scale=1.0, splade=settings)
    )
    loss.backward()
    ours = {name: p.grad for name, p in model.named_parameters()}

    st = SparseEncoder(str(router_folder), device="cpu").to(dtype)
    st.train()
    splade_loss = SpladeLoss(st, SparseMultipleNegativesRankingLoss(st), document_regularizer_weight=0.001)
    tasks = ("query", "document", "document")
    st_loss = sum(
        splade_loss([st.preprocess(t, task=k) for t, k in zip(TEXTS.values(), tasks)], None).values()
    )
    st_loss.backward()
    assert loss.item() == pytest.approx(st_loss.item(), rel=tolerance)
    theirs = {name: p.grad for name, p in st.named_parameters()}
    largest = max(g.abs().max().item() for g in theirs.values())
    for name, grad in ours.items():
        suffix = {"static.weight": "query.0.weight"}.get(name, name)
        suffix = suffix.replace("encoder.", "bert.", 1).replace("sparse.head_modules.", "")
        (their_name,) = [n for n in theirs if n.endswith(suffix)]
        assert (grad - theirs[their_name]).abs().max().item() <= tolerance * largest, name
    assert len(ours) == len(theirs) and ours["static.weight"].abs().max() > 1e-3 * largest


def test_static_weights_train_at_their_own_rate_with_weight_decay(router_folder, tmp_path):
    """The optimizer gives the static weights --static-lr (here 2e-3, not the default 1e-3, so a
    rate fixed at the recipe's fails) and weight decay, as the Hugging Face Trainer's
    create_optimizer does with learning_rate_mapping (the same 2e-3 for the query route) beside a
    base of 2e-5. One step from the folder then moves each weight as AdamW's first step does: an
    entry no query holds only decays (w - lr x wd x w, exactly), one with a gradient moves by
    lr x sign(g) besides."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder import SparseEncoderTrainer, SparseEncoderTrainingArguments
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    static_lr = 2e-3
    st = SparseEncoder(str(router_folder), device="cpu")
    # The recipe's r"SparseStaticEmbedding\.*" matches no name in 6.2 (0.sub_modules.query.0.weight):
    # the Trainer raises. The query route's name does.
    mapping = {r"sub_modules\.query\.": static_lr}
    routes = {"anchor": "query", "positive": "document", "negative": "document"}
    args = SparseEncoderTrainingArguments(
        str(tmp_path / "st"),
        learning_rate=2e-5,
        learning_rate_mapping=mapping,
        router_mapping=routes,
        weight_decay=0.01,
    )
    import datasets

    trainer = SparseEncoderTrainer(
        model=st, args=args, train_dataset=datasets.Dataset.from_dict(TEXTS),
        loss=SpladeLoss(st, SparseMultipleNegativesRankingLoss(st), document_regularizer_weight=3e-5),
    )  # fmt: skip
    theirs = trainer.create_optimizer()
    static = next(p for name, p in st.named_parameters() if name.endswith("query.0.weight"))
    (group,) = [g for g in theirs.param_groups if any(p is static for p in g["params"])]
    assert (group["lr"], group["weight_decay"]) == (static_lr, 0.01)

    out = tmp_path / "one-step"
    flags = ["--model", router_folder, "--train-data", data_file("sick-triplets-train.jsonl")]
    flags += ["--max-steps", 1, "--static-lr", static_lr, "--per-device-batch-size", 8]
    flags += ["--warmup-ratio", 0, "--max-grad-norm", 0, "--output-dir", out]
    warm_run(flags)
    before = load_model(config.parse_config(["--model", str(router_folder)])).model.static.weight.detach()
    after = load_model(config.parse_config(["--model", str(out / "final")])).model.static.weight.detach()
    decayed = before * (1 - static_lr * 0.01)
    moved = (after - decayed).abs()
    assert moved.max().item() == pytest.approx(static_lr, rel=1e-3)  # lr x sign(g): a weight in the batch
    assert ((moved < 1e-7) | ((moved - static_lr).abs() < 1e-6)).all()  # only decayed, or moved by lr
    assert 0 < (moved > 1e-7).sum() < 1000  # the batch's query tokens, not the vocabulary


def sparse_args(model, output_dir, *extra):
    return [
        "--model", model, "--train-data", data_file("sick-triplets-train.jsonl"),
        "--max-steps", 3, "--log-steps", 1, "--lr", 1e-4, "--warmup-ratio", 0,
        "--output-dir", output_dir, "--overwrite", "--document-regularizer-weight", 0.005, *extra,
    ]  # fmt: skip


def test_world_two_trains_as_world_one(masked_lm, tmp_path):
    """`--pooling splade --inference-free-queries --packing off`: 2 processes x 4 rows with
    --gather-negatives, under DDP and FSDP2, train as 1 process x 8 rows (losses, gradient norms,
    exported weights)."""
    one = tmp_path / "one"
    # --packing off: packed 8 rows are laid out otherwise than 2 x 4, and max pooling's token can flip
    # at near-ties (test_splade_training.py::test_world_two_with_gathered_negatives_trains_as_world_one)
    common = ["--pooling", "splade", "--inference-free-queries", "--packing", "off"]
    warm_run(sparse_args(masked_lm, one, *common, "--per-device-batch-size", 8))
    for strategy in ("ddp", "fsdp"):
        flags = [*common, "--per-device-batch-size", 4, "--gather-negatives", "--strategy", strategy]
        warm_run(sparse_args(masked_lm, tmp_path / strategy, *flags), nproc=2)
        assert_same_training(tmp_path / strategy, one, 3)


def test_export_loads_in_sparse_encoder_and_encodes_queries_without_the_model(masked_lm, tmp_path):
    """`--pooling splade --inference-free-queries` builds the Router stack: static weights start at
    ones (the loaded model's, exactly), and train. The export is a SparseEncoder 6 folder whose
    encode_query and encode_document equal the trained model's vectors (1e-6), a query longer than
    the max sequence length among them: both cut it at that length (its later tokens, which it
    holds nowhere earlier, are absent); the trained model's queries run no encoder forward; the
    folder trains again with no flag."""
    from sentence_transformers import SparseEncoder

    out = tmp_path / "out"
    args = sparse_args(masked_lm, out, "--pooling", "splade", "--inference-free-queries", "--max-steps", 2)
    cfg = config.parse_config([str(a) for a in args])
    start = load_model(cfg).model.static.weight.detach()
    assert start.shape == (VOCAB,) and torch.equal(start, torch.ones(VOCAB))
    trained = full_train.main(cfg).eval()
    assert trained.static.weight.requires_grad and (trained.static.weight != 1).any()
    loaded = load_model(config.parse_config(["--model", str(out / "final")]))
    # numbers: one token each, none of them in the other words, so the cut changes the vector
    long_query = "a query far longer than the maximum length: " + " ".join(str(n) for n in range(200))
    queries = [*TEXTS["anchor"], long_query]
    length = loaded.max_seq_length
    tokens = loaded.tokenizer(long_query, add_special_tokens=False)["input_ids"]
    assert length == 128 and len(tokens) > length and set(tokens[length:]) - set(tokens[:length])
    documents = TEXTS["positive"]
    calls = []
    hook = trained.encoder.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        q = loaded.tokenize(queries, tasks=["query"] * len(queries))
        ours_q = trained(static_ids=q["input_ids"], static_mask=q["attention_mask"])
        assert not calls  # queries: a lookup, no forward of the encoder
        d = loaded.tokenize(documents, tasks=["document"] * len(documents))
        ours_d = trained(**{k: v for k, v in d.items() if k != "pool_mask"})
    hook.remove()
    st = SparseEncoder(str(out / "final"), device="cpu")
    theirs_q = st.encode_query(queries, convert_to_tensor=True, convert_to_sparse_tensor=False)
    theirs_d = st.encode_document(documents, convert_to_tensor=True, convert_to_sparse_tensor=False)
    assert (ours_q - theirs_q).abs().max().item() <= 1e-6 * ours_q.abs().max().item()
    assert (ours_d - theirs_d).abs().max().item() <= 1e-6 * ours_d.abs().max().item()
    assert (ours_q != 0).sum(1).tolist()[0] == 4  # a, man, plays, guitar: a token twice counts once
    assert (ours_q[-1] != 0).sum().item() == len(set(tokens[:length]))  # the long query, cut
    assert "encode_query" in (out / "final" / "README.md").read_text()  # the card shows the two routes
    warm_run(sparse_args(out / "final", tmp_path / "again", "--max-steps", 1))
    assert read_metrics(tmp_path / "again")[0]["loss"] > 0


def test_a_frozen_router_folder_keeps_its_weights_and_an_idf_file_starts_them(masked_lm, tmp_path):
    """A Router folder saved with frozen: true trains its documents' model alone: the static weights
    leave the run as they came. --idf-file starts them as SparseStaticEmbedding.from_json reads
    the same file (0 for the tokens it does not name)."""
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding

    frozen = tmp_path / "frozen"
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5
    router_model(masked_lm, weight, frozen=True).save(str(frozen))
    warm_run(sparse_args(frozen, tmp_path / "out", "--max-steps", 2))
    after = load_model(config.parse_config(["--model", str(tmp_path / "out" / "final")])).model.static
    assert after.frozen and torch.equal(after.weight.detach(), weight)

    idf = tmp_path / "idf.json"
    idf.write_text(json.dumps({"man": 2.5, "guitar": 7.0, "##s": 0.25, "[UNK]": 1.0}))
    flags = [
        "--model",
        str(masked_lm),
        "--pooling",
        "splade",
        "--inference-free-queries",
        "--idf-file",
        str(idf),
    ]
    ours = load_model(config.parse_config(flags)).model.static.weight.detach()
    import transformers

    reference = SparseStaticEmbedding.from_json(
        str(idf), transformers.AutoTokenizer.from_pretrained(masked_lm)
    )
    assert torch.equal(ours, reference.weight.detach()) and (ours != 0).sum() == 4


def test_retrieval_evaluation_equals_sentence_transformers_at_any_world_size(router_folder, tmp_path):
    """--eval-only of a Router folder on (anchor, positive) pairs, at world 1 and world 2 (FSDP):
    the same MRR@10, nDCG@10, recall@10 and active dimensions, equal to
    SparseInformationRetrievalEvaluator on the folder (queries by the static route, documents by
    the model)."""
    worlds = ((1, []), (2, ["--strategy", "fsdp", "--eval-batch-size", 16]))
    got = assert_sparse_retrieval_as_sentence_transformers(router_folder, tmp_path, worlds)
    assert 0.05 < got["pairs/mrr@10"] < 0.99


def edited_router(source, tmp_path, edit):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(source, folder)
    path = folder / "router_config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return folder


@pytest.mark.parametrize(
    "case",
    ["document columns only", "gradcache", "tokenize once", "sts evaluation", "nli evaluation",
     "two query modules", "route mappings", "idf on a router", "static lr on plain splade",
     "inference-free on a dense model"],
)  # fmt: skip
def test_bad_input_ends_with_one_error_line_before_weights_load(router_folder, masked_lm, tmp_path, case):
    """Each of the ten refusals: one error: line naming the culprit, a non-zero exit, before the
    run's record, no export. What the static query side cannot take (queries regularised as
    documents, GradCache, an STS set, which has no query side; an NLI set, refused sooner: no
    Softmax head trains on a sparse model), Router folders whose routes are not understood or that
    hold their own query weights beside a readable --idf-file, and the inference-free flags where
    there are no static queries."""
    router, plain = ["--model", router_folder], ["--model", masked_lm, "--pooling", "splade"]
    idf = tmp_path / "idf.json"
    idf.write_text(json.dumps({"man": 2.5, "guitar": 7.0}))  # a valid file: the folder is the culprit
    args, culprit = {
        "document columns only": (
            [*router, "--use-document-regularizer-only"],
            "--use-document-regularizer-only",
        ),
        "gradcache": ([*router, "--cache-chunk-size", 2], "--cache-chunk-size"),
        "tokenize once": ([*router, "--tokenize", "once"], "--tokenize once"),
        "sts evaluation": (
            [*router, "--eval-data", data_file("stsb-dev.jsonl"), "--eval-type", "sts"],
            "(sts)",
        ),
        "nli evaluation": (
            [*router, "--eval-data", data_file("sick-nli-train.jsonl"), "--eval-type", "nli"],
            "nli accuracy needs the Softmax head",
        ),
        "idf on a router": (
            [*router, "--idf-file", idf],
            f"--idf-file: {router_folder} holds its own query weights; drop --idf-file",
        ),
        "static lr on plain splade": ([*plain, "--static-lr", 0.01], "--static-lr"),
        "inference-free on a dense model": (["--inference-free-queries"], "--inference-free-queries"),
    }.get(case, (None, None))
    if args is None:
        edit = {
            "two query modules": lambda c: {**c, "structure": {**c["structure"], "query": ["query_0_x"] * 2}},
            "route mappings": lambda c: {
                **c,
                "parameters": {**c["parameters"], "route_mappings": {"a": "query"}},
            },
        }[case]
        args, culprit = ["--model", edited_router(router_folder, tmp_path, edit)], "Router"
    data = ["--train-data", data_file("sick-triplets-train.jsonl"), "--max-steps", 1]
    proc = run_train([*args, *data, "--output-dir", tmp_path / "out"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and culprit in errors[0], proc.stderr[-2000:]
    assert '"world_size"' not in proc.stdout and not (tmp_path / "out" / "final").exists()


def test_a_resumed_run_trains_as_an_unbroken_one(masked_lm, tmp_path):
    """Checkpoints of an inference-free SPLADE run (the head's decoder tied to the word embeddings,
    which safetensors cannot write twice; the static weights in their own optimizer group): 4 steps
    with a checkpoint at step 2, then the same run resumed from step 2 (its step-4 checkpoint and
    export removed) trains steps 3 and 4 to the same losses and exported weights."""
    import shutil

    unbroken = tmp_path / "unbroken"
    flags = [
        "--pooling",
        "splade",
        "--inference-free-queries",
        "--per-device-batch-size",
        8,
        "--save-steps",
        2,
    ]
    warm_run(sparse_args(masked_lm, unbroken, *flags, "--max-steps", 4))
    resumed = tmp_path / "resumed"
    shutil.copytree(unbroken, resumed, ignore=shutil.ignore_patterns("step-4", "final"))
    args = [a for a in sparse_args(masked_lm, resumed, *flags, "--max-steps", 4) if a != "--overwrite"]
    proc = warm_run([*args, "--resume", "auto"])
    assert "resuming from" in proc.stdout + proc.stderr and "step-2" in proc.stdout + proc.stderr
    assert_same_training(resumed, unbroken, 4)
