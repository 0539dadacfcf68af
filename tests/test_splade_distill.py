"""SPLADE distillation in the full trainer, against sentence-transformers' SparseEncoder itself:
--loss margin_mse and --loss distill_kl on a sparse model are SpladeLoss(SparseMarginMSELoss) and
SpladeLoss(SparseDistillKLDivLoss) on one micro-batch (the loss and every parameter's gradient; both
regularisers, with thresholds, and use_document_regularizer_only; DistillKL over two negatives at
sentence-transformers' temperature 2), a comparison that fails when the negatives' FLOPS are left
out, world 2 under DDP trains as world 1 on the same global batch (the FLOPS terms over every rank's
rows, with no --gather-negatives), and --gather-negatives with these losses, or a loss SpladeLoss
does not wrap here, ends with one error: line before any weights load.

    python -m pytest tests/test_splade_distill.py -q
"""

import dataclasses
import json

import pytest
import torch
from conftest import assert_same_training, data_file, load_model, plan_for, run_train, start_up, warm_run
from conftest import save_tiny_masked_lm

import losses
from fsdp_embed import config
from fsdp_embed import run_plan
from fsdp_embed import splade
from fsdp_embed import __main__ as full_train

TEXTS = {
    "query": ["a man plays a guitar", "two dogs run on the grass", "a woman cuts an onion", "kids swim"],
    "positive": [
        "someone plays music",
        "dogs are running",
        "a person slices a vegetable",
        "children in a pool",
    ],
    "negative": ["a cat sleeps", "a car drives on a road", "the sky is blue", "a man reads a book"],
    "negative_2": ["a bird sings", "rain falls on a city", "a chef tastes a soup", "the old man runs"],
}
# The teacher's: MarginMSE's margins (query . positive - query . negative), DistillKL's scores of
# (positive, negative, negative_2), on the scale of the student's dot products (a few units).
MARGINS = torch.tensor([2.0, -1.0, 0.5, 3.0])
SCORES = torch.tensor([[3.0, 1.0, 0.5], [2.5, 2.0, -1.0], [1.0, -1.0, 0.0], [0.5, 0.25, 2.0]])
PROGRESS = (1, 9)  # step 1 of 9: warmup_steps 3, so each regulariser at (1/3)^2 of its weight


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory):
    """conftest's tiny masked LM (save_tiny_masked_lm), its head's output bias lowered by 0.4 (2.5
    standard deviations of the logits). A text then has about 1,000 active dimensions, not 28,000
    of 30,522, and dot products of a few units, not hundreds: MarginMSE's squared errors would
    otherwise be in the thousands, a step at lr 1e-4 would move them several-fold, and float32's
    rounding would grow with them past the tolerance of world 2 against world 1."""
    return save_tiny_masked_lm(tmp_path_factory.mktemp("tiny-mlm"), bias_shift=-0.4)


# The flags of each case: both regularisers; with l0 thresholds between the rows' counts of active
# dimensions (about 700 to 1,300 here), so each zeroes some rows and keeps others; one
# document term over the queries and the documents (use_document_regularizer_only).
CASES = {
    "weights": ["--query-regularizer-weight", "0.5", "--document-regularizer-weight", "0.3"],
    "thresholds": [
        "--query-regularizer-weight", "0.5", "--document-regularizer-weight", "0.3",
        "--query-regularizer-threshold", "1000", "--document-regularizer-threshold", "950",
    ],
    "document only": ["--document-regularizer-weight", "0.3", "--use-document-regularizer-only"],
}  # fmt: skip


def parse(masked_lm, loss, case):
    """The Config of a run of `loss` on the sparse model with `case`'s flags; distill_kl at
    sentence-transformers' SparseDistillKLDivLoss temperature (2, where the flags' default is 1)."""
    flags = ["--model", str(masked_lm), "--pooling", "splade", "--loss", loss, *CASES[case]]
    if loss == "distill_kl":
        flags += ["--student-temperature", "2", "--teacher-temperature", "2"]
    return config.parse_config(flags)


def columns_and_labels(loss):
    """MarginMSE's three columns and margins, DistillKL's four and scores."""
    if loss == "margin_mse":
        return {c: TEXTS[c] for c in ("query", "positive", "negative")}, MARGINS
    return TEXTS, SCORES


def our_loss(cfg, dtype, loss_of=full_train.embeddings_loss):
    """The full trainer's loss of one micro-batch (its LossPlan as run_plan.loss_plan makes it from
    the flags, in training) and its gradients by sentence-transformers' parameter names."""
    loaded = load_model(cfg)
    model = loaded.model.to(dtype)
    plan = run_plan.loss_plan(plan_for(cfg), cfg, cfg.loss, False, 0, gather=False)
    assert plan.splade["over_ranks"] and plan.scale == 1.0
    texts, labels = columns_and_labels(cfg.loss)
    features = [loaded.tokenize(t, [c] * len(t)) for c, t in texts.items()]
    pool = full_train.batches.pool_columns(features)
    if dtype == torch.float64:  # embed_columns casts to float32, as the trainer computes its losses
        embs = list(model(**pool).chunk(len(features)))
    else:
        embs = full_train.embed_columns(model, pool, len(features))
    value = loss_of(model, embs, labels.to(dtype), plan, progress=PROGRESS)
    value.backward()
    prefix = "sparse.head_modules."  # the masked LM's head, under its own names
    grads = {
        n.removeprefix(prefix) if n.startswith(prefix) else "bert." + n.removeprefix("encoder."): p.grad
        for n, p in model.named_parameters()
    }
    return value.item(), grads, [(e != 0).sum(1) for e in embs]


def their_loss(cfg, dtype):
    """SpladeLoss around SparseMarginMSELoss or SparseDistillKLDivLoss (at its defaults: dot product,
    temperature 2) with the same weights at step 1 of 9, thresholds and use_document_regularizer_only,
    on the same texts."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder import losses as st_losses

    st = SparseEncoder(str(cfg.model), device="cpu").to(dtype)
    st.train()
    warm = 1 / 9  # SpladeRegularizerWeightSchedulerCallback's quadratic warm-up at step 1 of 3
    base = st_losses.SparseMarginMSELoss if cfg.loss == "margin_mse" else st_losses.SparseDistillKLDivLoss
    splade_loss = st_losses.SpladeLoss(
        st,
        base(st),
        document_regularizer_weight=cfg.document_regularizer_weight * warm,
        query_regularizer_weight=cfg.query_regularizer_weight * warm or None,
        document_regularizer_threshold=cfg.document_regularizer_threshold or None,
        query_regularizer_threshold=cfg.query_regularizer_threshold or None,
        use_document_regularizer_only=cfg.use_document_regularizer_only,
    )
    texts, labels = columns_and_labels(cfg.loss)
    value = sum(splade_loss([st.preprocess(t) for t in texts.values()], labels.to(dtype)).values())
    value.backward()
    return value.item(), {n.removeprefix("0.model."): p.grad for n, p in st.named_parameters()}


def differences(ours, theirs):
    """(the losses' relative difference, the largest gradient difference relative to the largest
    gradient), over every parameter (the tied word embeddings and the head's too)."""
    (value, grads, _), (st_value, st_grads) = ours, theirs
    assert grads.keys() == st_grads.keys()
    largest = max(g.abs().max().item() for g in st_grads.values())
    worst = max((g - st_grads[n]).abs().max().item() for n, g in grads.items())
    return abs(value - st_value) / abs(st_value), worst / largest


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss", ["margin_mse", "distill_kl"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_one_micro_batch_equals_sentence_transformers_splade_loss(masked_lm, loss, case, dtype, tolerance):
    """full_train.embeddings_loss of --loss margin_mse (query, positive, negative, margin) and
    distill_kl (query, positive, two negatives, the teacher's three scores) on a sparse model, the
    regularisers warmed up to step 1 of 9, equals SpladeLoss around SparseMarginMSELoss and
    SparseDistillKLDivLoss on the same texts: the loss, and every parameter's gradient to `tolerance`
    of the largest. float64 1e-9: the same computation. float32 1e-5, as the trainer runs: rounding
    alone. Catches a cosine in place of the dot product, DistillKL at another temperature than
    sentence-transformers' 2, a FLOPS term over the wrong columns (the documents are every column
    but the queries), a threshold not applied, or a query term under use_document_regularizer_only."""
    cfg = parse(masked_lm, loss, case)
    ours = our_loss(cfg, dtype)
    if case == "thresholds":  # each threshold zeroes some rows and keeps others
        active_queries, active_documents = ours[2][0], torch.cat(ours[2][1:])
        assert 0 < (active_queries > cfg.query_regularizer_threshold).sum() < len(active_queries)
        assert 0 < (active_documents > cfg.document_regularizer_threshold).sum() < len(active_documents)
    loss_and_gradients = differences(ours, their_loss(cfg, dtype))
    assert max(loss_and_gradients) <= tolerance, loss_and_gradients


def without_the_negatives_flops(model, embs, labels, plan, progress):
    """A mutation of the trainer's MarginMSE on a sparse model: the document FLOPS over the positives
    alone, the base loss as it is."""
    arguments = splade.loss_arguments(plan.splade, *progress)
    base = losses.margin_mse_loss(embs[0], embs[1], embs[2], labels)
    return losses.splade_loss(embs[0], embs[1:2], base_loss=base, **arguments)


@pytest.mark.parametrize("mutation", ["negatives' FLOPS left out", "temperature 1"])
def test_the_comparison_fails_on_a_mutated_loss(masked_lm, mutation):
    """The comparison above can fail, in float64 by more than float32's tolerance (1e-5): the
    loss or the largest gradient difference. The document FLOPS over the positives alone (not over
    every document column, SpladeLoss's torch.cat(embeddings[1:])); or DistillKL at the flags'
    default temperature 1, where SparseDistillKLDivLoss's is 2."""
    if mutation == "temperature 1":
        cfg = parse(masked_lm, "distill_kl", "weights")
        cfg = dataclasses.replace(cfg, student_temperature=1.0, teacher_temperature=1.0)
        mutated = our_loss(cfg, torch.float64)
    else:
        cfg = parse(masked_lm, "margin_mse", "weights")
        mutated = our_loss(cfg, torch.float64, loss_of=without_the_negatives_flops)
    loss_and_gradients = differences(mutated, their_loss(cfg, torch.float64))
    assert max(loss_and_gradients) > 1e-5, loss_and_gradients


def write_rows(folder, loss):
    """SICK's triplets as MarginMSE rows (a made-up teacher margin) or DistillKL rows (two negatives:
    the row's and the next row's, a made-up teacher score for each)."""
    with open(data_file("sick-triplets-train.jsonl")) as f:
        triplets = [json.loads(line) for line in f]
    rows = []
    for i, (r, following) in enumerate(zip(triplets, triplets[1:] + triplets[:1])):
        row = {"query": r["anchor"], "positive": r["positive"], "negative": r["negative"]}
        if loss == "margin_mse":
            rows.append({**row, "label": 1 + i % 5 / 2})
        else:
            scores = [5.0 + i % 3, 1.0 + i % 4, float(i % 2)]
            rows.append({**row, "negative_2": following["negative"], "scores": scores})
    path = folder / f"{loss}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def distill_args(model, loss, train_data, output_dir, *extra):
    """The flags of a 3-step run, with regulariser weights large enough that FLOPS terms over each
    rank's own rows would show beyond the tolerance."""
    temperatures = ["--student-temperature", 2, "--teacher-temperature", 2] if loss == "distill_kl" else []
    return [
        "--model", model, "--pooling", "splade", "--loss", loss, "--train-data", train_data,
        "--max-steps", 3, "--log-steps", 1, "--lr", 1e-4, "--warmup-ratio", 0,
        "--output-dir", output_dir, "--overwrite", *temperatures,
        "--query-regularizer-weight", 0.5, "--document-regularizer-weight", 0.3, *extra,
    ]  # fmt: skip


# The mutation of the launch: the full trainer with each rank's FLOPS terms over its own rows, as
# sentence-transformers computes them under DDP.
PER_RANK_FLOPS = """
import runpy

from fsdp_embed import splade

over_ranks = splade.loss_arguments
splade.loss_arguments = lambda *args: over_ranks(*args) | {"gather_regularizers": False}
runpy.run_module("fsdp_embed", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("loss", ["margin_mse", "distill_kl"])
def test_world_two_trains_as_world_one(masked_lm, tmp_path, loss):
    """2 processes x 4 rows under DDP (gloo) train as 1 process x 8 rows, --packing off in both: the
    same step losses and gradient norms to 1e-5, and the same exported weights (assert_same_training).
    Each rank's base loss is the mean over its own rows (DDP averages the ranks'), and the FLOPS terms
    are over every rank's rows without --gather-negatives. The same launch with each rank's FLOPS over
    its own rows (sentence-transformers under DDP: the squared means differ) fails the comparison."""
    train_data = write_rows(tmp_path, loss)
    one, two, per_rank = tmp_path / "one", tmp_path / "two", tmp_path / "per-rank"
    # --packing off: packed 8 rows are laid out otherwise than 2 x 4, and max pooling's token can flip
    # at near-ties (test_splade_training.py::test_world_two_with_gathered_negatives_trains_as_world_one)
    warm_run(distill_args(masked_lm, loss, train_data, one, "--per-device-batch-size", 8, "--packing", "off"))
    flags = ["--per-device-batch-size", 4, "--strategy", "ddp", "--packing", "off"]
    warm_run(distill_args(masked_lm, loss, train_data, two, *flags), nproc=2)
    assert_same_training(two, one, 3)
    record = json.loads((one / "final" / "training_config.json").read_text())
    assert record["pooling_used"] == "splade" and record["train_sets"][0]["loss"] == loss
    (tmp_path / "per_rank_flops.py").write_text(PER_RANK_FLOPS)
    script = tmp_path / "per_rank_flops.py"
    warm_run(distill_args(masked_lm, loss, train_data, per_rank, *flags), nproc=2, script=script)
    with pytest.raises(AssertionError):
        assert_same_training(per_rank, one, 3)


@pytest.mark.parametrize(
    "loss, flags, words",
    [
        ("margin_mse", ["--gather-negatives"], "drop --gather-negatives"),
        ("distill_kl", ["--gather-negatives"], "drop --gather-negatives"),
        ("cosent", [], "a sparse (SPLADE) model trains with mnrl, margin_mse, distill_kl"),
    ],
)
def test_what_a_sparse_model_cannot_train_ends_with_one_error_line_before_weights_load(
    masked_lm, tmp_path, loss, flags, words
):
    """--gather-negatives with MarginMSE or DistillKL on a sparse model (nothing to gather: each query
    is scored against its own row's documents), and CoSENT (no SpladeLoss around it here), at world
    2 under torchrun: a non-zero exit, one error: line naming the fix, before the run's record
    (printed once the weights have loaded), no export."""
    train_data = data_file("stsb-train.jsonl") if loss == "cosent" else write_rows(tmp_path, loss)
    out = tmp_path / "out"
    args = ["--model", masked_lm, "--pooling", "splade", "--loss", loss, "--train-data", train_data, *flags]
    proc = run_train([*args, "--max-steps", 1, "--output-dir", out], nproc=2, check=False, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert words in errors[0], errors[0]
    assert '"world_size"' not in proc.stdout and not (out / "final").exists()


def test_gather_negatives_stays_with_an_mnrl_file_beside_a_distillation_file(masked_lm, tmp_path):
    """An mnrl file and a margin_mse file on a sparse model with --gather-negatives plan as a dense
    model's mix does: the MNRL set gathers its candidates, and both sets' FLOPS are over every rank's
    rows. The MarginMSE set's plan carries the flag too, yet has nothing to gather: embeddings_loss
    of that plan (in one process) is splade_loss with gather=False around MarginMSE, where
    gather=True raises (splade_loss gathers no candidates of another base loss)."""
    files = f"{data_file('sick-triplets-train.jsonl')},{write_rows(tmp_path, 'margin_mse')}"
    flags = ["--model", str(masked_lm), "--pooling", "splade", "--loss", "mnrl,margin_mse"]
    flags += ["--train-data", files, "--gather-negatives", "--output-dir", str(tmp_path / "out")]
    plan = start_up(config.parse_config(flags), world_size=2)
    plans = {ts.loss: ts.loss_plan for ts in plan.train_sets}
    assert plans["mnrl"].gather and all(p.splade["over_ranks"] for p in plans.values())
    margin = plans["margin_mse"]
    assert margin.gather  # the flag reaches the plan: embeddings_loss is what drops it
    embs = [torch.rand(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    arguments = splade.loss_arguments(margin.splade) | {"base_loss": losses.margin_mse_loss(*embs, MARGINS)}
    expected = losses.splade_loss(embs[0], embs[1:], scale=margin.scale, gather=False, **arguments)
    assert full_train.embeddings_loss(None, embs, MARGINS, margin).item() == expected.item()
    with pytest.raises(ValueError, match="only MNRL's candidates are gathered"):
        losses.splade_loss(embs[0], embs[1:], scale=margin.scale, gather=True, **arguments)
