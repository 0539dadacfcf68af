"""SPLADE trained by the full trainer, against sentence-transformers' SparseEncoder itself: one
micro-batch's loss and gradients equal SpladeLoss(SparseMultipleNegativesRankingLoss) on the same
batch, world 2 with gathered negatives trains as world 1 on the whole batch (DDP and FSDP2), the
export loads in SparseEncoder and plain transformers and embeds as the trained model, a
SparseEncoder folder trains with no other flag, and bad input ends with one error: line before any
weights load.

    python -m pytest tests/test_splade_training.py -q
"""

import json

import pytest
import torch
from conftest import assert_same_training, data_file, load_model, read_metrics, run_train, warm_run
from conftest import assert_sparse_retrieval_as_sentence_transformers

from fsdp_embed import config
from fsdp_embed import model_checks
from fsdp_embed import run_plan
from fsdp_embed import splade
from fsdp_embed import __main__ as full_train

TEXTS = {
    "anchor": ["a man plays a guitar", "two dogs run on the grass", "a woman cuts an onion", "kids swim"],
    "positive": [
        "someone plays music",
        "dogs are running",
        "a person slices a vegetable",
        "children in a pool",
    ],
    "negative": ["a cat sleeps", "a car drives on a road", "the sky is blue", "a man reads a book"],
}


# masked_lm's vocabulary, the length of the head's sums. fp32's bound: a sum of VOCAB terms is within
# VOCAB * eps_fp32 (3.6e-3) of its terms' magnitudes in any order the CPU sums them; the largest
# gradient stands for those magnitudes (measured: 6.8e-5 of it, which a tolerance of 1e-4 held by a
# margin that another CPU's order could take away).
VOCAB = 30522


@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, VOCAB * torch.finfo(torch.float32).eps)]
)
def test_one_micro_batch_equals_sentence_transformers_splade_loss(masked_lm, dtype, tolerance):
    """full_train.embeddings_loss of a sparse model's MNRL (LossPlan.splade) on one micro-batch of
    (anchor, positive, negative) rows, with the regularisers at their warm-up value of step 1 of 9,
    equals SpladeLoss(SparseMNRL) with those weights on the same texts: the loss, and every
    parameter's gradient to `tolerance` of the largest (the tied word embeddings and the head too).
    In float64 on both sides the two agree to 1e-9 (measured: 9e-14): the same computation. In
    float32, as the full trainer runs (full_train.embed_columns), they differ by rounding alone,
    which the sums over the vocabulary (30,522 entries per dot product and FLOPS term) grow to
    about 7e-5 of the largest gradient: held to the bound of such a sum (VOCAB), it shows that fp32
    runs, the float64 case that the formulas agree. Catches a wrong pooling, head, similarity or
    scale, a FLOPS term over the wrong columns, a weight not warmed up as
    SpladeRegularizerWeightSchedulerCallback does, or the head's gradient lost on its way back to
    the word embeddings."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    cfg = config.parse_config(["--model", str(masked_lm), "--pooling", "splade"])
    loaded = load_model(cfg)
    model = loaded.model.to(dtype)
    settings = {f: getattr(cfg, f) for f in model_checks.SPLADE_FLAGS} | {"over_ranks": True}
    # Weights large enough that a wrong FLOPS term shows beyond the tolerance.
    settings |= {"query_regularizer_weight": 0.002, "document_regularizer_weight": 0.001}
    plan = run_plan.LossPlan("mnrl", scale=1.0, splade=settings)
    features = [loaded.tokenize(texts, [column] * len(texts)) for column, texts in TEXTS.items()]
    pool = full_train.batches.pool_columns(features)
    embs = list(model(**pool).chunk(len(features))) if dtype == torch.float64 else None
    embs = embs or full_train.embed_columns(model, pool, len(features))
    loss = full_train.embeddings_loss(model, embs, None, plan, progress=(1, 9))
    loss.backward()
    ours = {name: p.grad for name, p in model.named_parameters()}

    st = SparseEncoder(str(masked_lm), device="cpu").to(dtype)
    st.train()
    warm = splade.loss_arguments(settings, 1, 9)  # warmup_steps 3: (1/3)^2 of each weight
    assert warm["query_regularizer_weight"] == pytest.approx(0.002 / 9)
    splade_loss = SpladeLoss(
        st,
        SparseMultipleNegativesRankingLoss(st),
        document_regularizer_weight=warm["document_regularizer_weight"],
        query_regularizer_weight=warm["query_regularizer_weight"],
    )
    st_features = [st.preprocess(texts) for texts in TEXTS.values()]
    st_loss = sum(splade_loss(st_features, None).values())
    st_loss.backward()
    assert loss.item() == pytest.approx(st_loss.item(), rel=tolerance)
    theirs = {name.removeprefix("0.model."): p.grad for name, p in st.named_parameters()}
    largest = max(g.abs().max().item() for g in theirs.values())
    prefix = "sparse.head_modules."
    for name, grad in ours.items():
        plain = (
            name.removeprefix(prefix) if name.startswith(prefix) else "bert." + name.removeprefix("encoder.")
        )
        assert (grad - theirs[plain]).abs().max().item() <= tolerance * largest, name
    assert len(ours) == len(theirs)


def splade_args(model, output_dir, *extra):
    return [
        "--model", model, "--pooling", "splade", "--train-data", data_file("sick-triplets-train.jsonl"),
        "--max-steps", 3, "--log-steps", 1, "--lr", 1e-4, "--warmup-ratio", 0,
        "--output-dir", output_dir, "--overwrite",
        "--query-regularizer-weight", 0.01, "--document-regularizer-weight", 0.005, *extra,
    ]  # fmt: skip


def test_world_two_with_gathered_negatives_trains_as_world_one(masked_lm, tmp_path):
    """2 processes x 4 rows with --gather-negatives, under DDP and FSDP2, train as 1 process x 8
    rows: the same losses, gradient norms and exported weights (assert_same_training). The FLOPS
    terms are over every rank's rows: computed over each rank's own (sentence-transformers under
    DDP), the squared means differ and so would the losses.

    --packing off: packing lays 8 rows out otherwise than 2 x 4, so the hidden states differ by
    ~1e-7; where a (row, vocabulary entry)'s two largest logits are that close, max pooling's token
    flips, and AdamW turns the flipped gradient into lr-sized steps (1e-5 of the gradient norm by
    step 3). Packing's own world-2 equality is the dense tests'; this one is the FLOPS terms'."""
    one = tmp_path / "one"
    warm_run(splade_args(masked_lm, one, "--per-device-batch-size", 8, "--packing", "off"))
    for strategy in ("ddp", "fsdp"):
        two = tmp_path / strategy
        flags = ["--per-device-batch-size", 4, "--gather-negatives", "--strategy", strategy]
        flags += ["--packing", "off"]
        warm_run(splade_args(masked_lm, two, *flags), nproc=2)
        assert_same_training(two, one, 3)
    record = json.loads((one / "final" / "training_config.json").read_text())
    assert record["pooling_used"] == "splade" and record["train_sets"][0]["scale"] == 1.0


def test_gradcache_and_sub_batches_train_as_one_packed_pass(masked_lm, tmp_path):
    """GradCache (--cache-chunk-size 2) and length-sorted sub-batches (--packing off) train a sparse
    model as one packed pass over the micro-batch does: with GradCache the FLOPS terms are over the
    whole micro-batch, computed once on every chunk's cached vectors, not a chunk's; the split head
    (max pooling's TokenMaxLogits) re-runs in GradCache's second pass. The three lay the rows out
    alike or padded, not packed 2 x 4 against 8 (the world-2 test's docstring): no token flips at
    this seed, which the test would show as a gradient norm off by ~1e-5."""
    packed = tmp_path / "packed"
    warm_run(splade_args(masked_lm, packed, "--per-device-batch-size", 8))
    for name, flags in (("cached", ["--cache-chunk-size", 2]), ("unpacked", ["--packing", "off"])):
        warm_run(splade_args(masked_lm, tmp_path / name, "--per-device-batch-size", 8, *flags))
        assert_same_training(tmp_path / name, packed, 3)


def test_export_loads_in_sparse_encoder_and_transformers(masked_lm, tmp_path):
    """The export is a SparseEncoder folder: sentence-transformers' SparseEncoder loads it and
    encodes as the trained model (full_train.main's, in eval mode) to 1e-6, and plain transformers
    loads the masked LM, whose logits pooled by hand (the model card's recipe) give the same
    vectors. Its folder reads back as SPLADE (st_folder), so it trains again with no flag."""
    import transformers
    from sentence_transformers import SparseEncoder

    cfg = config.parse_config([str(a) for a in splade_args(masked_lm, tmp_path / "out", "--max-steps", 2)])
    trained = full_train.main(cfg).eval()
    texts = TEXTS["anchor"] + TEXTS["negative"]
    loaded = load_model(config.parse_config(["--model", str(tmp_path / "out" / "final")]))
    assert loaded.model.pooling == "splade" and loaded.model.sparse.settings[:2] == ("max", "relu")
    with torch.no_grad():
        ours = trained(**{k: v for k, v in loaded.tokenize(texts).items() if k != "pool_mask"})
    st = SparseEncoder(str(tmp_path / "out" / "final"), device="cpu")
    theirs = st.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=False)
    assert (ours - theirs).abs().max().item() <= 1e-6 * ours.abs().max().item()
    base = load_model(config.parse_config(["--model", str(masked_lm), "--pooling", "splade"])).model.eval()
    with torch.no_grad():
        untrained = base(**{k: v for k, v in loaded.tokenize(texts).items() if k != "pool_mask"})
    assert (ours != 0).any(1).all() and (ours - untrained).abs().max() > 1e-3  # it trained
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out" / "final").eval()
    batch = loaded.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        by_hand = torch.log1p(torch.relu(mlm(**batch).logits * batch["attention_mask"].unsqueeze(-1))).amax(1)
    assert (by_hand - ours).abs().max().item() <= 1e-5 * ours.abs().max().item()


def test_sparse_encoder_folder_trains_with_no_flag(masked_lm, tmp_path):
    """A SparseEncoder folder as sentence-transformers 6 saves it (a Transformer with
    transformer_task fill-mask, then SpladePooling with sum pooling and log1p_relu) trains as SPLADE
    with no --pooling: its settings are read from the folder and written back in the export."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import SpladePooling, Transformer

    folder = tmp_path / "st6"
    transformer = Transformer(str(masked_lm), transformer_task="fill-mask")
    pooling = SpladePooling(pooling_strategy="sum", activation_function="log1p_relu")
    SparseEncoder(modules=[transformer, pooling], device="cpu").save(str(folder))
    out = tmp_path / "out"
    warm_run(
        [
            "--model",
            folder,
            "--max-steps",
            1,
            "--output-dir",
            out,
            "--train-data",
            data_file("sick-pairs-train.jsonl"),
        ]
    )
    exported = json.loads((out / "final" / "1_SpladePooling" / "config.json").read_text())
    assert (exported["pooling_strategy"], exported["activation_function"]) == ("sum", "log1p_relu")
    assert read_metrics(out)[0]["loss"] > 0


def test_a_regulariser_flag_on_a_dense_model_ends_with_one_error_line_before_weights_load(
    tiny_model, tmp_path
):
    """A regulariser flag on a dense model: one error: line naming the culprit, a non-zero exit,
    before the run's record (printed once the weights have loaded). A decoder given --pooling
    splade, Matryoshka sizes or a dense loss on a sparse model: tests/test_flag_matrix.py's
    refusals."""
    flags = ["--query-regularizer-weight", "0.1"]
    proc = run_train(
        ["--model", tiny_model, "--max-steps", 1, "--output-dir", tmp_path / "out", *flags], check=False
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and flags[0] in errors[0], proc.stderr[-2000:]
    assert '"world_size"' not in proc.stdout


def test_eval_only_scores_sparse_retrieval_as_sentence_transformers_at_any_world_size(masked_lm, tmp_path):
    """--eval-only of a SPLADE export on (anchor, positive) pairs, at world 1 and 2, reports the
    same MRR@10, nDCG@10, recall and active dimensions of the queries and the corpus, equal to
    sentence-transformers' SparseInformationRetrievalEvaluator on the same folder: the trainer
    scores a sparse model by dot product (cosine would rank otherwise) and counts its active
    dimensions as sentence-transformers does."""
    warm_run(splade_args(masked_lm, tmp_path / "train", "--max-steps", 2))
    assert_sparse_retrieval_as_sentence_transformers(
        tmp_path / "train" / "final", tmp_path, ((1, []), (2, []))
    )
