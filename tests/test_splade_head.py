"""SPLADE's head split into its transform and decoder (splade.splade_from_split: max pooling by
TokenMaxLogits, without the logits' backward; sum pooling by TokenSumWeights) against the checkpointed
head it replaces (splade.splade_from_hidden under torch.utils.checkpoint),
on tiny random masked LMs built from a config (test_splade.tiny_masked_lm: BERT, RoBERTa,
DistilBERT, ModernBERT; decoders tied to the word embeddings):

- the values and every parameter's gradient (encoder, transform, the tied decoder / word
  embeddings, the decoder's bias), float64 to 1e-12 and float32 to 1e-6 of the largest, with
  padding on the right and on the left, relu and log1p_relu, chunks of rows smaller than the batch
  and not dividing it, and vocabulary blocks that do not divide the vocabulary;
- ties: two tokens with the same logits, the gradient on the first (torch.max's index), as the
  reference; mutations (the last of equal values, the next token) are caught;
- sum pooling (splade.TokenSumWeights: the logits computed again in the backward, by blocks)
  against the same reference, values and gradients;
- an empty row, no_grad, autocast (bf16), the memory (one chunk's logits at most in the forward
  and the backward; under max pooling nothing logits-sized in the backward), and heads whose split
  is not known keeping the checkpointed path.

Run: python -m pytest tests/test_splade_head.py -q
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fsdp_embed import splade  # noqa: E402
from test_splade import tiny_masked_lm  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

ARCHS = ["bert", "roberta", "distilbert", "modernbert"]
POOLINGS = [(s, a) for s in splade.POOLING_STRATEGIES for a in splade.ACTIVATION_FUNCTIONS]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}  # of the largest value of each tensor


def batch(vocab_size=300, tokens=9):
    """5 rows of random ids: right padding, one row padded on the left, one row of one token."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(5, vocab_size, (5, tokens), generator=g)
    mask = (torch.arange(tokens)[None, :] < torch.tensor([tokens, 4, 6, 1, 7])[:, None]).long()
    mask[2] = mask[2].flip(0)  # left padding: the real tokens need not come first
    return input_ids, mask


def sparse_vectors(model, fast, pooling, activation, rows_per_chunk, input_ids, mask):
    """The encoder, then the new head (fast) or the checkpointed one, on the same inputs."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask)[0]
    settings = (pooling, activation, rows_per_chunk)
    if fast:
        assert splade.split_gives_the_head(model)
        transform, decoder = splade.masked_lm_head_split(model)
        return splade.splade_from_split(hidden, mask, transform, decoder, *settings)
    return splade.splade_from_hidden(hidden, mask, splade.masked_lm_head(model), *settings, checkpoint=True)


def values_and_grads(model, fast, pooling, activation, rows_per_chunk, inputs):
    params = [p for p in model.parameters() if p.requires_grad]
    emb = sparse_vectors(model, fast, pooling, activation, rows_per_chunk, *inputs)
    weights = torch.rand(emb.shape, dtype=emb.dtype, generator=torch.Generator().manual_seed(4))
    return emb.detach(), torch.autograd.grad((emb * weights).sum(), params, allow_unused=True)


def assert_close(ours, reference, tolerance, name="", floor=1e-30):
    """|ours - reference| within `tolerance` of the reference's largest entry, or of `floor` where
    that is smaller (a gradient that is zero but for rounding)."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape, name
    error, largest = (ours - reference).abs().max().item(), reference.abs().max().item()
    assert error <= tolerance * max(largest, floor), (name, error, largest)


def assert_same_as_checkpointed(model, pooling, activation, rows_per_chunk, inputs, dtype):
    """Values and every parameter's gradient of the new head equal the checkpointed one's."""
    ours, our_grads = values_and_grads(model, True, pooling, activation, rows_per_chunk, inputs)
    reference, ref_grads = values_and_grads(model, False, pooling, activation, rows_per_chunk, inputs)
    assert_close(ours, reference, TOLERANCE[dtype], "values")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    # Attention's key bias gets no gradient but rounding's (a softmax does not change when every
    # score of a row moves alike), 1e-12 of the largest in fp32: such a tensor is held to the
    # tolerance of 1e-4 of the largest gradient instead of its own largest entry.
    floor = 1e-4 * max(g.abs().max().item() for g in ref_grads if g is not None)
    for name, our_grad, ref_grad in zip(names, our_grads, ref_grads):
        assert (our_grad is None) == (ref_grad is None), name
        if ref_grad is not None:
            key_bias = name.endswith(("attention.self.key.bias", "attention.k_lin.bias"))
            assert_close(our_grad, ref_grad, TOLERANCE[dtype], name, floor if key_bias else 1e-30)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pooling, activation", POOLINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_values_and_gradients_equal_the_checkpointed_head(monkeypatch, arch, pooling, activation, dtype):
    """2 rows a chunk of 5 (the last chunk short), vocabulary blocks of 37 entries of 300 (the last
    short). Catches: a gradient on the wrong token or lost on padding, the bias or the transform
    left out of a gradient, chunk or block boundaries that drop or repeat rows or entries, the
    relu's zeros given a gradient, padding's zeros read as logits, a wrong activation derivative
    (sum pooling's backward computes it itself)."""
    monkeypatch.setattr(splade, "VOCAB_BLOCK", 37)
    model = tiny_masked_lm(arch).to(dtype)
    transform, decoder = splade.masked_lm_head_split(model)
    word_embeddings = model.get_input_embeddings().weight
    assert decoder.weight is word_embeddings  # tied: the gradient below is the embeddings' too
    assert_same_as_checkpointed(model, pooling, activation, 2, batch(), dtype)
    emb, grads = values_and_grads(model, True, pooling, activation, 2, batch())
    grad_of = dict(zip([p for p in model.parameters() if p.requires_grad], grads))
    assert grad_of[word_embeddings].abs().max() > 0 and grad_of[decoder.bias].abs().max() > 0
    assert 0 < (emb > 0).float().mean() < 1  # active entries and the relu's zeros both present


@pytest.mark.parametrize("pooling", splade.POOLING_STRATEGIES)
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8])
def test_any_chunk_of_rows_gives_the_same(rows_per_chunk, pooling):
    """One row, three (not dividing 5) and more than the batch, at the default vocabulary block
    (larger than this vocabulary: one block)."""
    model = tiny_masked_lm("bert")
    assert_same_as_checkpointed(model, pooling, "relu", rows_per_chunk, batch(), torch.float64)


def decoder_with_ties():
    """A decoder of 6 entries on 4-wide states, and states of 2 rows x 5 tokens in which tokens 1
    and 3 of row 0 are equal: every logit of token 3 ties with token 1's. Small dyadic numbers, so
    every product and sum is exact in float64, whatever the order of the sums."""
    g = torch.Generator().manual_seed(5)
    decoder = torch.nn.Linear(4, 6).double()
    with torch.no_grad():
        decoder.weight.copy_(torch.randint(-4, 5, (6, 4), generator=g) / 4)
        decoder.bias.copy_(torch.randint(-4, 5, (6,), generator=g) / 8)
    states = torch.randint(-4, 5, (2, 5, 4), generator=g).double() / 4
    states[0, 3] = states[0, 1]
    return decoder, states.requires_grad_()


def tie_grads(fast):
    decoder, states = decoder_with_ties()
    mask = torch.ones(2, 5, dtype=torch.long)
    if fast:
        emb = splade.splade_from_split(states, mask, lambda x: x, decoder, "max", "relu", 1)
    else:
        emb = splade.splade_from_hidden(states, mask, decoder, "max", "relu", 1, checkpoint=True)
    weights = 1 + torch.arange(emb.numel(), dtype=emb.dtype).view(emb.shape)  # each entry its own
    params = [states, decoder.weight, decoder.bias]
    return emb, torch.autograd.grad((emb * weights).sum(), params)


def test_ties_send_the_gradient_to_the_forwards_token():
    """Token 3 of row 0 ties with token 1 on every entry: its states get no gradient, token 1's do,
    as in the reference (torch.max's index: the first of equal values); values and gradients are
    exactly the reference's."""
    decoder, states = decoder_with_ties()
    logits = decoder(states[0].detach())
    assert torch.equal(logits[1], logits[3]) and (logits[1] > 0).any()  # the ties are real
    (emb, grads), (reference, ref_grads) = tie_grads(True), tie_grads(False)
    assert torch.equal(emb, reference)
    for ours, theirs in zip(grads, ref_grads):
        assert torch.equal(ours, theirs)
    assert grads[0][0, 3].abs().max() == 0 and grads[0][0, 1].abs().max() > 0


def test_a_gradient_on_the_wrong_token_is_caught(monkeypatch):
    """Mutations of the token choice that the comparisons above must catch: the last of equal
    values (the tie test), and the next token (the random models' comparison)."""
    original = splade._max_and_token

    def last_of_equal(weights_RTK):
        values, token = original(weights_RTK.flip(1))
        return values, weights_RTK.shape[1] - 1 - token

    monkeypatch.setattr(splade, "_max_and_token", last_of_equal)
    (_, grads), (_, ref_grads) = tie_grads(True), tie_grads(False)
    assert not torch.equal(grads[0], ref_grads[0])
    assert grads[0][0, 3].abs().max() > 0  # the gradient went to the later token

    def next_token(weights_RTK):  # the next of the row's places (a padding place is caught too)
        values, token = original(weights_RTK)
        return values, (token + 1) % weights_RTK.shape[1]

    monkeypatch.setattr(splade, "_max_and_token", next_token)
    with pytest.raises(AssertionError):
        assert_same_as_checkpointed(tiny_masked_lm("bert"), "max", "relu", 2, batch(), torch.float64)


@pytest.mark.parametrize("pooling", splade.POOLING_STRATEGIES)
def test_a_row_without_tokens_is_zeros_without_gradient(pooling):
    """A row whose mask is all zeros: zeros, as the reference (its padding's zeros), and no
    gradient from it (under max its logits are -inf: no token to send one to); the other rows
    unchanged."""
    decoder, states = decoder_with_ties()
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]])
    emb = splade.splade_from_split(states, mask, lambda x: x, decoder, pooling, "log1p_relu", 1)
    reference = splade.splade_from_hidden(states, mask, decoder, pooling, "log1p_relu", 1, checkpoint=True)
    assert torch.equal(emb[1], torch.zeros_like(emb[1])) and torch.allclose(emb, reference, atol=1e-15)
    (grad,) = torch.autograd.grad(emb.sum(), states)
    (ref_grad,) = torch.autograd.grad(reference.sum(), states)
    assert grad[1].abs().max() == 0 and torch.allclose(grad, ref_grad, atol=1e-15)


@pytest.mark.parametrize("pooling", splade.POOLING_STRATEGIES)
def test_no_grad_gives_the_same_values(pooling):
    """Evaluation and GradCache's first pass run the head under no_grad: the same vectors."""
    model = tiny_masked_lm("roberta")
    with torch.no_grad():
        ours = sparse_vectors(model, True, pooling, "relu", 2, *batch())
        reference = sparse_vectors(model, False, pooling, "relu", 2, *batch())
    assert_close(ours, reference, 1e-12)


@pytest.mark.parametrize("pooling", splade.POOLING_STRATEGIES)
def test_autocast_bf16_computes_as_the_reference(pooling):
    """Under CPU autocast (bf16), as the trainer's --precision bf16 runs single and DDP: the logits
    and so the vectors in bf16 as the reference's, the same values to bf16's rounding, and the
    gradients in the parameters' dtype (fp32), near the reference's (bf16 ties and roundings may
    send a few entries' gradient to another token)."""
    model = tiny_masked_lm("bert").float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, our_grads = values_and_grads(model, True, pooling, "relu", 2, batch())
        reference, ref_grads = values_and_grads(model, False, pooling, "relu", 2, batch())
    assert ours.dtype == reference.dtype == torch.bfloat16
    assert (ours.float() - reference.float()).abs().max() <= 2**-6 * reference.float().abs().max()
    for (name, _), ours_g, ref_g in zip(model.named_parameters(), our_grads, ref_grads):
        assert ours_g.dtype == torch.float32
        if name.endswith("attention.self.key.bias"):  # rounding's gradient: assert_same_as_checkpointed
            continue
        cosine = torch.nn.functional.cosine_similarity(ours_g.flatten(), ref_g.flatten(), dim=0)
        assert cosine > 0.99, (name, cosine)


class LargestTensors(TorchDispatchMode):
    """The largest tensor (number of elements) each op makes, in the forward and in the backward."""

    def __init__(self):
        super().__init__()
        self.largest, self.phase = {"forward": 0, "backward": 0}, "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest[self.phase] = max([self.largest[self.phase], *sizes])
        return out


@pytest.mark.parametrize("pooling, fast", [("max", True), ("sum", True), ("max", False)])
def test_memory_one_chunk_of_logits_and_no_recompute(pooling, fast):
    """No tensor larger than one chunk's logits (rows_per_chunk x T x V) in the forward, nor in the
    backward; the new max pooling's backward makes nothing near that size (no recompute, no dense
    gradient of the logits: its largest is the decoder weight's gradient, V x H), where the
    checkpointed head's backward makes a chunk's logits again (shows the count sees them)."""
    model = tiny_masked_lm("bert", vocab_size=2000)
    tokens, rows_per_chunk, vocab_size, hidden_size = 60, 2, 2000, 32
    hidden = torch.randn(5, tokens, hidden_size, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(5, tokens, dtype=torch.long)
    chunk_logits = rows_per_chunk * tokens * vocab_size
    assert vocab_size * hidden_size < chunk_logits / 2  # the weight's gradient stays below the bar
    with LargestTensors() as seen:
        emb = splade.splade_from_head(hidden, mask, model, pooling, "relu", rows_per_chunk, split=fast)
        seen.phase = "backward"
        emb.sum().backward()
    assert seen.largest["forward"] <= chunk_logits, seen.largest
    if fast:
        assert seen.largest["backward"] <= (chunk_logits / 2 if pooling == "max" else chunk_logits)
    else:
        assert seen.largest["backward"] >= chunk_logits, seen.largest
    assert hidden.grad.abs().max() > 0


class BiasAfterDecoder(torch.nn.Module):
    """A RoBERTa-like head that adds a bias of its own after a bias-free decoder (as ESM's does):
    the split (transform, decoder) alone would leave the bias out."""

    def __init__(self, hidden_size, vocab_size):
        super().__init__()
        self.dense = torch.nn.Linear(hidden_size, hidden_size).double()
        self.layer_norm = torch.nn.LayerNorm(hidden_size).double()
        self.decoder = torch.nn.Linear(hidden_size, vocab_size, bias=False).double()
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, vocab_size, dtype=torch.float64))

    def forward(self, hidden):
        x = self.layer_norm(torch.nn.functional.gelu(self.dense(hidden)))
        return self.decoder(x) + self.bias


def test_known_heads_split_and_others_keep_the_checkpointed_path():
    """Every architecture above splits (SpladeHead too); a head that does more than transform +
    decoder does not, and gets the checkpointed head's vectors."""
    for arch in ARCHS:
        model = tiny_masked_lm(arch)
        assert splade.split_gives_the_head(model), arch
        assert splade.SpladeHead(model).split, arch
    owner = torch.nn.Module()
    owner.lm_head = BiasAfterDecoder(8, 50)
    assert not splade.split_gives_the_head(owner)
    hidden = torch.randn(3, 4, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    ours = splade.splade_from_head(hidden, mask, owner, "max", "relu", 2)
    reference = splade.splade_from_hidden(hidden, mask, owner.lm_head, "max", "relu", 2)
    assert torch.equal(ours, reference)
