"""Sparse (SPLADE) retrieval evaluation: eval_dist.evaluate_retrieval(..., similarity="dot") against
sentence-transformers' SparseInformationRetrievalEvaluator, and at world 2 against world 1.

The model: a tiny random BertForMaskedLM (hidden 32, 2 layers) with a BertTokenizer whose vocabulary
is the words of a few dozen sentences, saved as a plain Hugging Face folder. Ours is that masked LM
wrapped to return splade.splade_embed's (B, V) vectors; sentence-transformers' is SparseEncoder(folder),
which builds Transformer(fill-mask) + SpladePooling("max") from a *ForMaskedLM folder by itself.
The data: 30 queries, 60 corpus rows (50 distinct texts, 5 distractors twice more), 1-2 relevant
texts per query, each query a few words of its first relevant text and random words.

- both models give the same vectors, with the same non-zero entries;
- every metric both report (MRR@10, nDCG@10, Recall@1/3/5/10, MAP@100), the active dimensions and
  sparsity ratios of the queries and of the corpus, and avg_flops, to 1e-6;
- world 2 (torch.multiprocessing spawn, gloo, file rendezvous) == world 1, exactly, on every rank.

Run: python -m pytest tests/test_sparse_eval.py -q
"""

import datetime
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the spawned workers import this file
import eval_dist  # noqa: E402
from fsdp_embed import splade  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

SENTENCES = """
The old river runs past the mill and under a stone bridge near the village.
A young doctor walked to the market every morning before the shops opened.
Winter storms closed the mountain pass for nearly three weeks last year.
Her grandfather kept bees in a small garden behind the bakery.
The orchestra played a quiet symphony while the audience held its breath.
Fresh bread and strong coffee filled the kitchen with a warm smell.
Children built a castle of sand while the ocean tide crept closer.
The library opened a new reading room with tall windows and green lamps.
A silver engine pulled the night train through the frozen forest.
Farmers harvest apples and pears in the late days of autumn.
The painter mixed yellow and blue until she found the colour of the sea.
Thunder rolled over the valley and rain drummed on the tin roof.
A curious rabbit slipped under the fence into the vegetable patch.
Sailors mended the torn canvas before the ship left the harbour.
The professor wrote equations on the board in careful white chalk.
Lanterns glowed along the street during the summer festival.
An eagle circled high above the cliffs searching for prey.
The museum displayed ancient coins, pottery and a golden crown.
Students argued about philosophy in the cafe until midnight.
A gentle breeze carried the scent of pine across the lake.
The mechanic replaced the broken wheel and checked the brakes.
Merchants traded silk, spices and salt along the desert road.
The island has white beaches, tall palms and a lighthouse.
Snow covered the rooftops and the chimneys released thin smoke.
The pilot announced a short delay because of heavy fog.
Grandmother knitted a thick scarf of red wool for the journey.
The astronomer pointed the telescope at a distant planet.
Wolves howled in the hills as the moon rose over the pines.
A clever fox outwitted the hounds and vanished into the reeds.
The baker sold cinnamon rolls, rye loaves and honey cakes.
Engineers tested the new bridge with heavy trucks full of gravel.
The choir sang an old hymn in the candlelit chapel.
"""
WORDS = sorted(set(re.findall(r"[a-z]+", SENTENCES.lower())))
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NAMES = ("mrr@10", "ndcg@10", "map@100", "recall@1", "recall@3", "recall@5", "recall@10")
SPARSITY = (
    "query_active_dims",
    "query_sparsity_ratio",
    "corpus_active_dims",
    "corpus_sparsity_ratio",
    "avg_flops",
)
BATCH_SIZE = 16  # several batches: rule 1's sorting and padding matter
WORLD = 2


class SpladeEncoder(torch.nn.Module):
    """The masked LM as eval_dist calls a model: model(**tokens) -> (B, V) SPLADE vectors."""

    def __init__(self, masked_lm):
        super().__init__()
        self.masked_lm = masked_lm

    def forward(self, **features):
        return splade.splade_embed(self.masked_lm, features)


def retrieval_set():
    """(queries, corpus, relevant), the same in every process: 50 distinct corpus texts of 4-10
    random words, texts 45-49 distractors repeated twice more (60 rows); query q relevant to text q,
    and even queries also to text 30 + q // 2; each query 2-3 words of text q and 1-2 random words."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(50)]
    corpus = texts + texts[45:] + texts[45:]
    queries, relevant = [], []
    for q in range(30):
        words = rng.sample(texts[q].split(), rng.randint(2, 3)) + rng.choices(WORDS, k=rng.randint(1, 2))
        queries.append(" ".join(words))
        relevant.append({q, 30 + q // 2} if q % 2 == 0 else {q})
    return queries, corpus, relevant


def load_ours(folder):
    """(SpladeEncoder, tokenize) from the saved folder."""
    import transformers

    tokenizer = transformers.BertTokenizer.from_pretrained(folder)
    masked_lm = transformers.BertForMaskedLM.from_pretrained(folder).eval()

    def tokenize(texts):
        return tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")

    return SpladeEncoder(masked_lm), tokenize


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny random BERT masked LM and its tokenizer, saved as a plain Hugging Face folder."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-splade")
    (folder / "vocab.txt").write_text("\n".join(SPECIAL_TOKENS + WORDS) + "\n")
    transformers.BertTokenizer(str(folder / "vocab.txt"), model_max_length=64).save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(SPECIAL_TOKENS) + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    masked_lm = transformers.BertForMaskedLM(config)
    with torch.no_grad():
        # A random BERT barely tells its input words apart, and its head is positive somewhere in a
        # text at almost every entry (dense rows, every rank near chance). Larger word embeddings
        # make the vectors lexical (texts that share words share entries), as a trained SPLADE
        # model's are, and a lower bias leaves about a fifth of the entries active.
        masked_lm.bert.embeddings.word_embeddings.weight.mul_(4.0)  # tied to the head's decoder
        masked_lm.cls.predictions.bias.fill_(-0.8)
    masked_lm.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def st_encoder(folder):
    """sentence-transformers' model of the folder: it adds SpladePooling to a *ForMaskedLM itself."""
    from sentence_transformers import SparseEncoder

    return SparseEncoder(folder, device="cpu")


def test_splade_encoder_gives_sparse_encoders_vectors(folder, st_encoder):
    """The premise of the comparison below. Catches: a different head or pooling, a tokenizer that
    reads the texts differently (special tokens, casing, truncation), a model other than the
    folder's; and entries non-zero in one model only, which would shift the active dimensions."""
    assert [type(m).__name__ for m in st_encoder] == ["Transformer", "SpladePooling"]
    queries, corpus, _ = retrieval_set()
    model, tokenize = load_ours(folder)
    for texts, st_encode in ((queries, st_encoder.encode_query), (corpus, st_encoder.encode_document)):
        ours = eval_dist.encode(model, tokenize, texts, BATCH_SIZE)
        reference = st_encode(texts, batch_size=BATCH_SIZE, convert_to_tensor=True).to_dense()
        assert ours.shape == reference.shape == (len(texts), len(SPECIAL_TOKENS) + len(WORDS))
        assert (ours - reference).abs().max().item() <= 1e-6
        assert torch.equal(ours != 0, reference != 0)
        active = (ours != 0).sum(1)
        assert 0 < active.min() and active.max() < ours.shape[1]  # sparse rows, not dense nor empty


def test_dot_retrieval_equals_sparse_information_retrieval_evaluator(folder, st_encoder):
    """Every metric both report, to 1e-6. Catches: normalised (cosine) scores in the dot path (the
    data is checked to rank differently by cosine), a wrong metric, active dimensions of the
    corpus counted once per distinct text instead of per row (the repeated distractors are
    checked to make the two differ), a sparsity ratio or avg_flops off its formula (per-row
    means of counts instead of the dot product of the mean count vectors, for one)."""
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    queries, corpus, relevant = retrieval_set()
    evaluator = SparseInformationRetrievalEvaluator(
        queries={f"q{i:02d}": text for i, text in enumerate(queries)},
        corpus={f"c{i:02d}": text for i, text in enumerate(corpus)},  # zero-padded: ST breaks ties by id
        relevant_docs={f"q{i:02d}": {f"c{j:02d}" for j in rel} for i, rel in enumerate(relevant)},
        batch_size=BATCH_SIZE,
        name="tiny",
        write_csv=False,
    )
    reference = evaluator(st_encoder)
    model, tokenize = load_ours(folder)
    settings = {"batch_size": BATCH_SIZE, "metrics": NAMES}
    ours = eval_dist.evaluate_retrieval(
        model, tokenize, queries, corpus, relevant, similarity="dot", **settings
    )
    assert set(ours) == set(NAMES) | set(SPARSITY)
    for name in NAMES:
        assert ours[name] == pytest.approx(reference[f"tiny_dot_{name}"], abs=1e-6), name
    for name in SPARSITY:
        assert ours[name] == pytest.approx(reference[f"tiny_{name}"], rel=1e-6), name
    assert 0 < ours["mrr@10"] < 1 and 0 < ours["recall@1"] < 1  # rankings neither all right nor all wrong
    cosine = eval_dist.evaluate_retrieval(model, tokenize, queries, corpus, relevant, **settings)
    assert set(cosine) == set(NAMES)  # no sparsity numbers for cosine
    assert max(abs(cosine[name] - ours[name]) for name in NAMES) > 1e-3
    distinct = eval_dist.encode(model, tokenize, list(dict.fromkeys(corpus)), BATCH_SIZE)
    assert abs((distinct != 0).sum(1).double().mean().item() - ours["corpus_active_dims"]) > 1e-3


def test_unknown_similarity_is_refused(folder):
    """Catches: a typo ("dot_product", "cos") silently scored by cosine."""
    model, tokenize = load_ours(folder)
    queries, corpus, relevant = retrieval_set()
    with pytest.raises(ValueError, match="similarity"):
        eval_dist.evaluate_retrieval(model, tokenize, queries, corpus, relevant, similarity="dot_product")


def evaluate_dot(folder):
    """The evaluation both worlds run: small batches (every rank encodes a share of the corpus) and
    query chunks of 7 (several chunks, the last one short)."""
    model, tokenize = load_ours(folder)
    queries, corpus, relevant = retrieval_set()
    return eval_dist.evaluate_retrieval(
        model,
        tokenize,
        queries,
        corpus,
        relevant,
        batch_size=4,
        metrics=NAMES,
        query_chunk=7,
        similarity="dot",
    )


def _world2_worker(rank, folder, init_file, out_dir):
    torch.set_num_threads(1)  # as world 1 below: bit-identical embeddings at any world size
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timeout
    )
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(evaluate_dot(folder)))
    # End without tearing gloo down: see tests/conftest.py, exit_without_teardown (a rare deadlock)
    sys.stdout.flush()
    os._exit(0)


def test_world2_equals_world1(folder, tmp_path):
    """World 2 against world 1, every number exactly, on both ranks. Catches: corpus counts not
    summed across ranks (each rank's active dims and avg_flops would cover its half), summed twice,
    a rank-dependent ranking or tie order, a hang (a rank skipping the collective)."""
    context = mp.spawn(
        _world2_worker, args=(folder, str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=False
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        world1 = evaluate_dot(folder)  # meanwhile, in this process
    finally:
        torch.set_num_threads(previous)
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the world-2 workers did not finish in 60 s")
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == world1, rank
