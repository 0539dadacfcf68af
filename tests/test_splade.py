"""SPLADE (splade.py, losses.flops_loss, losses.splade_loss) against sentence-transformers' sparse
encoder itself, on tiny random masked-LM models built from a config (no downloads):

- the pooling against SpladePooling on the same logits (each strategy and activation), and the
  chunked forms from the hidden states (the split head and the checkpointed one) against ST's
  Transformer(fill-mask) + SpladePooling: values and every parameter's gradient; the checkpointed
  form keeps no chunk's logits for the backward (tests/test_splade_head.py: the split head's);
- flops_loss and splade_loss against FlopsLoss and SpladeLoss(SparseMultipleNegativesRankingLoss)
  on the same embeddings, loss and gradients, with thresholds, use_document_regularizer_only and
  one hard-negative column;
- the regulariser's warm-up against SpladeRegularizerWeightSchedulerCallback at every step;
- world 2 with gather=True against world 1 on the whole batch (torch.multiprocessing spawn, gloo).

Run: python -m pytest tests/test_splade.py -q
"""

import datetime
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the spawned workers import this file
import losses  # noqa: E402
from fsdp_embed import splade  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

POOLINGS = [(s, a) for s in splade.POOLING_STRATEGIES for a in splade.ACTIVATION_FUNCTIONS]
TEXTS = ["the cat sat", "a dog", "the dog sat on the cat mat", "cat", "a mat the dog sat on"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on", "mat"]


@pytest.fixture(scope="module")
def st():
    """sentence-transformers' sparse classes, imported here rather than at the top: the world-2
    workers import this file, and would each pay the seconds these imports take."""
    from sentence_transformers.sparse_encoder import SparseEncoder, callbacks
    from sentence_transformers.sparse_encoder import losses as st_losses
    from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer

    return SimpleNamespace(
        SparseEncoder=SparseEncoder,
        SpladePooling=SpladePooling,
        Transformer=Transformer,
        losses=st_losses,
        WeightScheduler=callbacks.SpladeRegularizerWeightSchedulerCallback,
    )


def tiny_masked_lm(arch, vocab_size=300):
    """A random masked LM (2 layers, hidden 32), dropout off so two forwards agree."""
    import transformers

    sizes = {"vocab_size": vocab_size, "num_hidden_layers": 2, "num_attention_heads": 2, "pad_token_id": 0}
    torch.manual_seed(0)
    if arch == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=vocab_size,
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
        )
        return transformers.DistilBertForMaskedLM(config).double()
    if arch == "modernbert":
        config = transformers.ModernBertConfig(
            **sizes,
            hidden_size=32,
            intermediate_size=64,
            global_attn_every_n_layers=1,
            attn_implementation="eager",
        )
        return transformers.ModernBertForMaskedLM(config).double()
    config_class, model_class = {
        "bert": (transformers.BertConfig, transformers.BertForMaskedLM),
        "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM),
    }[arch]
    config = config_class(
        **sizes,
        hidden_size=32,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return model_class(config).double()


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """The tiny BERT with a word-level tokenizer of its own, saved as a plain Hugging Face folder."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-splade-bert")
    words = VOCAB + [f"w{i}" for i in range(300 - len(VOCAB))]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    tiny_masked_lm("bert").float().save_pretrained(folder)
    return str(folder)


def logits_and_mask(batch=3, tokens=6, vocab=50, seed=0):
    """Random logits (about half negative, as a trained head's) and a mask with padded rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, tokens, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([tokens, 2, 4][:batch])
    return logits, (torch.arange(tokens)[None, :] < lengths[:, None]).long()


def grad_of(value, tensors):
    return torch.autograd.grad(value, tensors, allow_unused=True)


def assert_close(ours, reference, tol=1e-5):
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    assert (ours - reference).abs().max().item() <= tol, (ours - reference).abs().max().item()


# ---- the pooling


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("pooling_strategy, activation_function", POOLINGS)
def test_pooling_equals_splade_pooling(st, pooling_strategy, activation_function, chunk_size):
    """Catches: a missing second log1p (log1p_relu), the mask not applied (padding's logits would
    count), max and sum swapped, and a gradient that differs from ST's at the max."""
    logits, mask = logits_and_mask()
    pooling = st.SpladePooling(pooling_strategy, activation_function, chunk_size=chunk_size).train()
    reference = pooling({"token_embeddings": logits, "attention_mask": mask})["sentence_embedding"]
    ours = splade.splade_pool(logits, mask, pooling_strategy, activation_function)
    assert_close(ours, reference)
    weights = torch.rand(reference.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (ref_grad,), (our_grad,) = (
        grad_of((reference * weights).sum(), logits),
        grad_of((ours * weights).sum(), logits),
    )
    assert_close(our_grad, ref_grad)
    assert our_grad.abs().max() > 1e-3  # something flows
    with torch.no_grad():  # ST's eval path works in place; the values are the same
        assert_close(
            pooling.eval()({"token_embeddings": logits, "attention_mask": mask})["sentence_embedding"], ours
        )
    padded_only = splade.splade_pool(
        logits * (1 - mask[..., None]), mask, pooling_strategy, activation_function
    )
    assert padded_only.abs().max() == 0  # padding's logits count for nothing


@pytest.mark.parametrize("checkpoint", [None, True])
@pytest.mark.parametrize("pooling_strategy, activation_function", POOLINGS)
def test_chunked_form_equals_sentence_transformers(
    st, bert_folder, pooling_strategy, activation_function, checkpoint
):
    """ST's Transformer(fill-mask) + SpladePooling on the full logits against splade_embed, 2 rows a
    chunk of 5 (the last chunk short): values and every parameter's gradient, by the split head
    (checkpoint None: splade_from_split, the default for BERT) and by the checkpointed one (True:
    splade_from_hidden). Catches: a wrong head (e.g. the decoder without the transform), chunk
    boundaries that drop or repeat rows, a checkpoint whose recompute differs, a backward from the
    wrong token, a gradient lost on the tied embeddings."""
    transformer = st.Transformer(bert_folder, transformer_task="fill-mask")
    encoder = st.SparseEncoder(modules=[transformer, st.SpladePooling(pooling_strategy, activation_function)])
    encoder.to(torch.float64).train()
    features = encoder.tokenize(TEXTS)
    assert features["attention_mask"].min() == 0  # rows of different lengths: padding to mask
    params = [p for p in encoder.parameters() if p.requires_grad]
    reference = encoder(dict(features))["sentence_embedding"]
    assert splade.split_gives_the_head(transformer.model)  # so checkpoint None runs the split head
    ours = splade.splade_embed(
        transformer.model,
        features,
        pooling_strategy,
        activation_function,
        rows_per_chunk=2,
        checkpoint=checkpoint,
    )
    assert_close(ours, reference, 1e-10)
    weights = torch.rand(reference.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_grads = grad_of((reference * weights).sum(), params)
    our_grads = grad_of((ours * weights).sum(), params)
    for ours_g, ref_g in zip(our_grads, ref_grads):
        assert (ours_g is None) == (ref_g is None)
        if ref_g is not None:
            assert_close(ours_g, ref_g, 1e-9 * max(1.0, ref_g.abs().max().item()))
    word_embeddings = transformer.model.bert.embeddings.word_embeddings.weight  # tied to the decoder
    assert our_grads[[p is word_embeddings for p in params].index(True)].abs().max() > 1e-3


@pytest.mark.parametrize("checkpoint", [True, False])
def test_chunks_keep_no_logits_for_the_backward(checkpoint):
    """Every tensor autograd saves for the backward while the sparse vectors are computed from the
    hidden states, counted: under checkpoint, far less than the full (B, T, V) logits (catches a
    checkpoint not applied); without it, every chunk's logits (shows the count would see them).
    The head never sees more than a chunk's rows (catches logits computed whole)."""
    model = tiny_masked_lm("bert", vocab_size=2000)
    batch, tokens, rows_per_chunk = 5, 7, 2
    hidden = torch.randn(batch, tokens, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    rows_seen, saved_numel = [], []

    def head(hidden_RTH):
        rows_seen.append(hidden_RTH.shape[0])
        return model.cls(hidden_RTH)

    def count(tensor):
        saved_numel.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        emb = splade.splade_from_hidden(
            hidden, mask, head, rows_per_chunk=rows_per_chunk, checkpoint=checkpoint
        )
    emb.sum().backward()  # the recompute, under checkpoint
    full_logits = batch * tokens * 2000
    if checkpoint:
        assert sum(saved_numel) < full_logits / 10, (sum(saved_numel), full_logits)
    else:
        assert sum(saved_numel) >= full_logits, (sum(saved_numel), full_logits)
    assert max(rows_seen) == rows_per_chunk and hidden.grad.abs().max() > 0


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert", "modernbert"])
def test_masked_lm_head_gives_the_models_logits(arch):
    """head(base_model(inputs)) is the model's own logits. Catches a head that leaves out a layer."""
    model = tiny_masked_lm(arch)
    input_ids = torch.randint(5, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask)[0]
    assert_close(splade.masked_lm_head(model)(hidden), logits, 1e-10)


def test_active_dims_and_settings():
    """active_dims counts each row's non-zeros (ST's sparsity() reports their mean); unknown
    settings are refused, not replaced by a default."""
    emb = torch.tensor([[0.0, 1.5, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert splade.active_dims(emb).tolist() == [2, 0, 4]
    with pytest.raises(ValueError):
        splade.splade_pool(torch.zeros(1, 1, 4), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError):
        splade.regularizer_weight(0, 10, 1.0, scheduler_type="cosine")


# ---- the losses


def sparse_rows(counts, vocab=40, seed=0):
    """Non-negative rows (as SPLADE's), row i with exactly counts[i] non-zero entries."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(len(counts), vocab, dtype=torch.float64)
    for i, count in enumerate(counts):
        rows[i, torch.randperm(vocab, generator=g)[:count]] = 0.1 + torch.rand(
            count, generator=g, dtype=torch.float64
        )
    return rows.requires_grad_()


@pytest.mark.parametrize("threshold", [None, 6])
def test_flops_loss_equals_flops_loss_of_sentence_transformers(st, threshold):
    """Catches: the square and the mean swapped (mean of squares), rows dropped from the mean
    rather than zeroed, and `>=` for the threshold's `>` (two rows have exactly 6 non-zeros)."""
    emb = sparse_rows([3, 6, 6, 9, 20, 31])
    reference = st.losses.FlopsLoss(None, threshold=threshold).compute_loss_from_embeddings(emb)
    ours = losses.flops_loss(emb, threshold)
    assert_close(ours, reference)
    assert_close(grad_of(ours, emb)[0], grad_of(reference, emb)[0])
    if threshold is not None:  # the threshold changed something, so the comparison saw it
        assert abs(ours.item() - losses.flops_loss(emb).item()) > 1e-3


class EmbeddingsAsModel(torch.nn.Module):
    """A stand-in model for ST's SpladeLoss: each column's 'features' are its embeddings."""

    def forward(self, features):
        return {"sentence_embedding": features["embedding"]}


SPLADE_CASES = {  # weights of order 1, so an error in a FLOPS term shows above the tolerance
    "both_regularizers": dict(query_regularizer_weight=0.5, document_regularizer_weight=0.3),
    "no_query_regularizer": dict(query_regularizer_weight=None, document_regularizer_weight=0.3),
    "thresholds": dict(
        query_regularizer_weight=0.5,
        document_regularizer_weight=0.3,
        query_regularizer_threshold=8,
        document_regularizer_threshold=12,
    ),
    "document_regularizer_only": dict(
        query_regularizer_weight=None,
        document_regularizer_weight=0.3,
        document_regularizer_threshold=12,
        use_document_regularizer_only=True,
    ),
}


@pytest.mark.parametrize("scale", [1.0, 5.0])
@pytest.mark.parametrize("case", SPLADE_CASES)
def test_splade_loss_equals_splade_loss_of_sentence_transformers(st, case, scale):
    """Query, positive and one hard-negative column. Catches: a FLOPS term over the wrong columns
    (the document term covers positives and negatives; with use_document_regularizer_only the
    queries too), a threshold given to the wrong term, the hard negatives not among the
    candidates, cosine for the dot product, and a weight applied twice or not at all."""
    settings = SPLADE_CASES[case]
    columns = [sparse_rows([5, 9, 14, 20, 30], seed=s) for s in range(3)]
    model = EmbeddingsAsModel()
    reference_loss = st.losses.SpladeLoss(
        model, st.losses.SparseMultipleNegativesRankingLoss(model, scale=scale), **settings
    )
    reference_parts = reference_loss([{"embedding": c} for c in columns], None)
    parts = losses.splade_loss_parts(columns[0], columns[1:], **settings, scale=scale)
    assert sorted(parts) == sorted(reference_parts)
    for name in parts:
        assert_close(parts[name], reference_parts[name])
    total = losses.splade_loss(columns[0], columns[1:], **settings, scale=scale)
    for ours_g, ref_g in zip(grad_of(total, columns), grad_of(sum(reference_parts.values()), columns)):
        assert_close(ours_g, ref_g)
        assert ours_g.abs().max() > 1e-3
    assert parts["document_regularizer_loss"].item() > 1e-3  # the regulariser is in the comparison


@pytest.mark.parametrize("case", ["both_regularizers", "thresholds"])
def test_a_given_base_loss_gets_the_same_flops_terms_and_refuses_gather(st, case):
    """splade_loss(base_loss=) (the distillation losses' path): the given loss plus the FLOPS terms
    SpladeLoss adds to any base loss, computed as with MNRL (which is then not computed), in value
    and gradient; gather=True with it is refused (only MNRL's candidates are gathered)."""
    settings = SPLADE_CASES[case]
    columns = [sparse_rows([5, 9, 14, 20, 30], seed=s) for s in range(3)]
    model = EmbeddingsAsModel()
    reference_loss = st.losses.SpladeLoss(
        model, st.losses.SparseMultipleNegativesRankingLoss(model), **settings
    )
    reference_parts = reference_loss([{"embedding": c} for c in columns], None)

    def base():  # any loss of the embeddings, a graph of its own at each call
        return (columns[0] * columns[1]).sum() * 0.1

    given = base()
    parts = losses.splade_loss_parts(columns[0], columns[1:], **settings, base_loss=given)
    assert sorted(parts) == sorted(reference_parts) and parts["base_loss"] is given
    regularizers = [name for name in parts if name != "base_loss"]
    for name in regularizers:
        assert_close(parts[name], reference_parts[name])
    total = losses.splade_loss(columns[0], columns[1:], **settings, base_loss=base())
    reference = base() + sum(reference_parts[name] for name in regularizers)
    for ours_g, ref_g in zip(grad_of(total, columns), grad_of(reference, columns)):
        assert_close(ours_g, ref_g)
    with pytest.raises(ValueError, match="base_loss is another loss"):
        losses.splade_loss(columns[0], columns[1:], **settings, gather=True, base_loss=base())


def test_query_weight_with_document_regularizer_only_is_refused():
    """SpladeLoss would drop the query weight with a warning; here it is an error."""
    emb = sparse_rows([5, 9])
    with pytest.raises(ValueError, match="query_regularizer_weight"):
        losses.splade_loss(emb, [emb], 0.5, 0.3, use_document_regularizer_only=True)


# ---- the regulariser's warm-up


WARMUPS = [(30, 1 / 3), (20, 1 / 3), (97, 0.25), (2, 1 / 3), (10, 1.0)]  # (total steps, warm-up ratio)


@pytest.mark.parametrize("scheduler_type", splade.SCHEDULER_TYPES)
@pytest.mark.parametrize("total_steps, warmup_ratio", WARMUPS)
def test_regularizer_weight_equals_the_callback(st, scheduler_type, total_steps, warmup_ratio):
    """The callback's weights at the start of every step, as the Trainer drives it (global_step =
    steps taken). Catches: an off-by-one in the step, rounding for int() in the warm-up length
    (20 x 1/3), no floor of one step (2 x 1/3 -> 0 steps), linear and quadratic swapped."""
    from transformers import TrainerState

    model = EmbeddingsAsModel()
    loss = st.losses.SpladeLoss(
        model, st.losses.SparseMultipleNegativesRankingLoss(model), 3e-5, query_regularizer_weight=5e-5
    )
    callback = st.WeightScheduler(loss, scheduler_type=scheduler_type, warmup_ratio=warmup_ratio)
    state = TrainerState(max_steps=total_steps)
    callback.on_train_begin(None, state, None)
    for step in range(total_steps + 1):
        state.global_step = step
        callback.on_step_begin(None, state, None)
        for final, current in [
            (3e-5, loss.document_regularizer_weight),
            (5e-5, loss.query_regularizer_weight),
        ]:
            ours = splade.regularizer_weight(step, total_steps, final, scheduler_type, warmup_ratio)
            assert abs(ours - current) <= 1e-15, (step, ours, current)
    assert splade.regularizer_weight(0, total_steps, None) is None


# ---- world 2 with gathered rows against world 1


WORLD, ROWS, FEATURES, VOCAB_SIZE = 2, 3, 16, 40
GATHER_CASES = {
    "both_regularizers": SPLADE_CASES["both_regularizers"],
    "document_regularizer_only": SPLADE_CASES["document_regularizer_only"],
}


def encoder_and_inputs():
    """The same seeded 'encoder' (relu of a linear map: sparse non-negative rows) and the global
    batch (query, positive, hard negative) of WORLD x ROWS rows, in every process."""
    g = torch.Generator().manual_seed(5)
    encoder = torch.nn.Linear(FEATURES, VOCAB_SIZE).double()
    with torch.no_grad():
        encoder.weight.copy_(torch.randn(encoder.weight.shape, generator=g, dtype=torch.float64))
        encoder.bias.copy_(torch.randn(VOCAB_SIZE, generator=g, dtype=torch.float64) - 0.5)
    inputs = [torch.randn(WORLD * ROWS, FEATURES, generator=g, dtype=torch.float64) for _ in range(3)]
    return encoder, inputs


def loss_and_grads(rows, settings, gather):
    """The loss of these input rows, its parts, and the gradients of the encoder and of the rows."""
    encoder, _ = encoder_and_inputs()
    rows = [r.clone().requires_grad_() for r in rows]
    embs = [torch.relu(encoder(r)) for r in rows]
    parts = losses.splade_loss_parts(embs[0], embs[1:], **settings, gather=gather)
    total = sum(parts.values())
    total.backward()
    grads = {"weight": encoder.weight.grad, "bias": encoder.bias.grad}
    return total.detach(), {k: v.detach() for k, v in parts.items()}, grads, [r.grad for r in rows]


def _world2_worker(rank, init_file, out_dir):
    """One rank: its rows of the global batch, each case with gather=True and with gather=False;
    the encoder's gradients averaged over ranks as DDP does (an all_reduce of the sum, / WORLD)."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout
    )
    _, inputs = encoder_and_inputs()
    mine = [x[rank * ROWS : (rank + 1) * ROWS] for x in inputs]
    results = {}
    for case, settings in GATHER_CASES.items():
        for gather in (True, False):
            total, parts, grads, row_grads = loss_and_grads(mine, settings, gather)
            for grad in grads.values():
                dist.all_reduce(grad)  # (all ranks participate) DDP's gradient average
                grad /= WORLD
            results[case, gather] = (total, parts, grads, row_grads)
    torch.save(results, os.path.join(out_dir, f"rank-{rank}.pt"))
    # End without tearing gloo down: see tests/conftest.py, exit_without_teardown (a rare deadlock)
    sys.stdout.flush()
    os._exit(0)


def test_world2_with_gather_equals_world1(tmp_path):
    """World 2, each rank with B rows and gather=True, against one process with the 2B rows: the mean
    of the ranks' losses is the world-1 loss, each FLOPS term is world 1's on both ranks, the DDP
    average of the encoder's gradients is world 1's, and each rank's input-row gradient is WORLD x
    world 1's on those rows (the reduce-scatter sums every rank's loss's gradient). Catches: FLOPS
    over each rank's own rows (the square of a mean is not the mean of squares; gather=False, own
    rows throughout, is checked to differ), negatives not gathered, rows of the wrong rank (the
    offset), a missing or doubled reduce-scatter."""
    context = mp.spawn(_world2_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the world-2 workers did not finish in 60 s")
    ranks = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(WORLD)]
    _, inputs = encoder_and_inputs()
    for case, settings in GATHER_CASES.items():
        total, parts, grads, row_grads = loss_and_grads(inputs, settings, gather=False)  # world 1
        gathered = [saved[case, True] for saved in ranks]
        assert abs(sum(r[0].item() for r in gathered) / WORLD - total.item()) <= 1e-10
        for name in parts:
            if name != "base_loss":  # every rank's FLOPS term is world 1's
                assert all(abs(r[1][name].item() - parts[name].item()) <= 1e-10 for r in gathered), name
        for name, grad in grads.items():
            for result in gathered:
                assert_close(result[2][name], grad, 1e-10)
            local = ranks[0][case, False][2][name]  # each rank's own rows only: another gradient
            assert (local - grad).abs().max() > 1e-4, name
        for rank, result in enumerate(gathered):
            for mine, whole in zip(result[3], row_grads):
                assert_close(mine / WORLD, whole[rank * ROWS : (rank + 1) * ROWS], 1e-10)
