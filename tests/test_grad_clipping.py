"""sharding.clip_grad_norm on a plain model gives what torch.nn.utils.clip_grad_norm_ gives,
bit for bit: the same norm, the same gradients, whether it clips or not. It skips the multiply
by 1 that torch does when nothing is clipped, so the case at the edge (a norm just below and
just above max_norm) is checked too. DDP takes the same path (its gradients are whole on every
rank); DDP runs that clip on every step are compared with one process in test_equivalence.py.

Run: python -m pytest tests/test_grad_clipping.py -q
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_embed import sharding  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def model_with_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model[0].weight.requires_grad_(False)  # a frozen parameter has no gradient
    model(torch.randint(0, 100, (4, 5))).pow(2).sum().backward()
    return model


NORM = torch.nn.utils.get_total_norm(
    [p.grad for p in model_with_gradients().parameters() if p.grad is not None]
).item()


@pytest.mark.parametrize(
    "max_norm",
    [0.1 * NORM, NORM * (1 - 1e-5), NORM, NORM * (1 + 1e-5), 10 * NORM, float("inf")],
    ids=["clips", "just-below", "at", "just-above", "far-above", "off"],
)
def test_clip_grad_norm_is_torchs(max_norm):
    ours, reference = model_with_gradients(), model_with_gradients()
    before = [p.grad.clone() for p in ours.parameters() if p.grad is not None]
    norm = sharding.clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    assert torch.equal(norm, expected)
    for p, q in zip(ours.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), (max_norm, NORM)
    # The premise: both cases are exercised (at the edge the factor may round to no change).
    changed = any(
        not torch.equal(g, p.grad)
        for g, p in zip(before, [p for p in ours.parameters() if p.grad is not None])
    )
    if max_norm < 0.5 * NORM:
        assert changed
    if max_norm > NORM + 1e-6:
        assert not changed


def test_a_nan_gradient_makes_every_gradient_nan_as_in_torch():
    ours, reference = model_with_gradients(), model_with_gradients()
    for model in (ours, reference):
        model[1].bias.grad[0] = float("nan")
    assert sharding.clip_grad_norm(ours, 1.0).isnan()
    assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).isnan()
    assert all(p.grad.isnan().all() for p in ours.parameters() if p.grad is not None)
