"""The training and evaluation data: reading it, its columns, and checks of every row.

  - `load_data`: a .jsonl/.json/.csv/.parquet file, a `Dataset.save_to_disk` folder or a hub
    data-set id, with one message naming the file and line at fault when it cannot be read;
  - column conventions as in sentence-transformers: the text columns in order, a column named
    `label` or `score` is the target (`data_columns`, `loss_from_columns`);
  - `load_train_sets` / `load_eval_sets`: the --train-data and --eval-data files, each checked
    against its loss (`check_rows`: no null or empty text, finite targets);
  - `data_fingerprint`: what a resume compares, so it never continues on changed data.
Every rank loads the same rows; what to do with them step by step is batches.py.

Each function reads the flags' values as the run's plan resolved them (run_plan.py: the losses,
prompts, per-file settings and Matryoshka sizes), never the flags' text.

Needs datasets and eval_dist.py (`retrieval_from_pairs`).
"""

import csv
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import eval_dist


# ----------------------------------------------------------------------------------------------
# Reading a file, a saved folder or a hub data set, with one message naming the line at fault


FILE_TYPES = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}  # extension: reader


def load_data(path, split, subset="", flag="--train-data"):
    """Every rank loads the same rows. All ranks may load at once: `datasets` guards its cache
    with file locks, and a rank-0-first barrier would hang the others if rank 0 failed. `path`: a
    file, a folder or glob of shards of one type (one data set, the shards in sorted order), or
    (load_saved_or_hub) a Dataset.save_to_disk folder or a hub id."""
    files = [path] if os.path.isfile(path) else shards_of(path, flag)
    return load_files(files, flag) if files else load_saved_or_hub(path, split, subset, flag)


def load_saved_or_hub(path, split, subset, flag):
    """A Dataset.save_to_disk folder (its split `split` when it holds several), or a hub id."""
    if os.path.isdir(path):
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as e:
            raise ValueError(f"{flag} {path}: not a folder written by Dataset.save_to_disk ({e})") from e
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{flag} {path} has splits {list(loaded)}; choose one with --train-split")
            loaded = loaded[split]
        return loaded
    if os.path.sep in path or path.startswith("."):
        raise ValueError(f"{flag} {path}: no such file or folder")
    try:
        return datasets.load_dataset(path, subset or None, split=split)
    except Exception as e:  # no network, unknown id, missing split: one message with the cause
        raise ValueError(
            f"{flag} {path}: not a local file or folder, and loading it as a hub data set failed: {e}"
        ) from e


def shards_of(path, flag):
    """The data files a glob (`shards/*.parquet`) or a folder of data files names, sorted, so that
    every rank and every host reads the rows in one order; [] when `path` is neither (a
    save_to_disk folder, a hub id, a missing file). One file type only."""
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))  # ** crosses folders
        if not files:
            raise ValueError(f"{flag} {path}: no file matches the pattern")
    elif os.path.isdir(path) and not is_saved_dataset(path):
        # Names starting with . or _ are left out, as pyarrow's datasets do (Spark's _SUCCESS, .crc files).
        names = sorted(n for n in os.listdir(path) if not n.startswith((".", "_")))
        files = [os.path.join(path, n) for n in names if n.rsplit(".", 1)[-1].lower() in FILE_TYPES]
        if not files:
            raise ValueError(
                f"{flag} {path}: a folder with no data files (.jsonl, .json, .csv, .parquet) that "
                "Dataset.save_to_disk did not write either; pass files, a glob of them, or such a folder"
            )
    else:
        return []
    types = sorted({f.rsplit(".", 1)[-1].lower() for f in files})
    if len(types) > 1:
        raise ValueError(
            f"{flag} {path}: its files are .{', .'.join(types)}; the shards of one data set share one "
            "type (all .jsonl, all .json, all .csv or all .parquet): move the others out or name one type"
        )
    return files


def load_files(files, flag):
    """One data set from data files of one type (a file, or shards in order), with one message
    naming the file and line at fault when one cannot be read."""
    ext = files[0].rsplit(".", 1)[-1].lower()
    builder = FILE_TYPES.get(ext)
    if builder is None:
        raise ValueError(f"{flag} {files[0]}: unknown file type .{ext}; use .jsonl, .json, .csv or .parquet")
    for path in files:
        if os.path.getsize(path) == 0:
            raise ValueError(f"{flag} {path}: the file is empty")
        if builder != "parquet" and (bad := first_non_utf8(path)):
            # datasets would read it, and fail later with no file or line named.
            raise ValueError(
                f"{flag} {path}: line {bad[0]} is not UTF-8 (byte 0x{bad[1]:02x}); save the file as UTF-8"
            )
    try:
        return datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:  # malformed JSON/CSV, numbers out of range: one message naming the line
        raise ValueError(f"{flag} {why_unreadable(files, ext, builder, e)}") from e


def why_unreadable(files, ext, builder, error):
    """Why `datasets` could not read the data files `files` (`error`), naming the file and line
    at fault where one can be found: "PATH: ..." ."""
    for path in files:
        detail = (ext == "jsonl" and first_bad_json_line(path)) or (
            ext == "json" and json_document_error(path)
        )
        if detail:
            return f"{path}: cannot be read as {builder}: {detail}"
    # datasets' "Couldn't cast" names neither shard: find the first whose columns differ.
    first = first_columns(files[0], ext)
    for path in files[1:]:
        if first is not None and (columns := first_columns(path, ext)) not in (None, first):
            return (
                f"{path}: columns {columns}, but {files[0]} has {first}; the shards of one data set "
                "share their columns"
            )
    where = files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]}"
    return f"{where}: cannot be read as {builder}: {root_cause(error)}"


def first_columns(path, ext):
    """The sorted column names of a Parquet file, a CSV file's header or a JSON Lines file's first
    row; None for a .json document or a file that cannot be read this far. Only for naming the
    shard at fault after datasets has refused the shards: a later row may add a column."""
    try:
        if ext == "parquet":
            return sorted(pq.read_schema(path).names)
        with open(path, encoding="utf-8") as f:
            if ext == "csv":
                return sorted(next(csv.reader(f)))
            if ext == "jsonl":
                return sorted(json.loads(next(line for line in f if line.strip())))
    except Exception:  # the caller's own message stands
        return None
    return None


def set_name(path):
    """A data set's name (its steps' loss is logged as loss/NAME; --dataset-settings keys it): a
    file's stem, a folder's name, or a glob's last folder before the pattern (`shards` for
    `data/shards/*.parquet`). A file's or a saved folder's stem as before shards were read."""
    if any(c in path for c in "*?["):
        parts = path.split(os.path.sep)
        fixed = parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]
        return os.path.basename(os.path.abspath(os.path.sep.join(fixed) or "."))
    if os.path.isdir(path) and not is_saved_dataset(path):
        return os.path.basename(os.path.abspath(path))
    return os.path.splitext(os.path.basename(path.rstrip("/")))[0]


def is_saved_dataset(path):
    """Whether the folder `path` was written by Dataset(Dict).save_to_disk (its files say so)."""
    return any(
        os.path.exists(os.path.join(path, name))
        for name in ("dataset_info.json", "dataset_dict.json", "state.json")
    )


def first_non_utf8(path):
    """(line number, byte value) of the first byte of `path` that is not UTF-8, or None. Reads
    16 MiB at a time, cut at line ends, so a multi-byte character is never split."""
    lines, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 24)
            buffer = carry + chunk
            cut = buffer.rfind(b"\n") + 1 if chunk else len(buffer)
            try:
                buffer[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                return lines + buffer[: e.start].count(b"\n") + 1, buffer[e.start]
            if not chunk:
                return None
            lines, carry = lines + buffer[:cut].count(b"\n"), buffer[cut:]


def first_bad_json_line(path):
    """Why a JSON Lines file does not load, naming the first line at fault (None: no line is)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                return f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"line {number} holds a JSON {type(row).__name__}, not an object of columns"
            for key, value in row.items():
                if isinstance(value, float) and not math.isfinite(value):
                    return (
                        f"line {number}: {key!r} is {value}, as Python reads it "
                        "(too large for a 64-bit float, or NaN); write a finite number"
                    )
    return None


def json_document_error(path):
    with open(path, encoding="utf-8") as f:
        try:
            json.load(f)
        except ValueError as e:
            return f"line {e.lineno}, column {e.colno}: {e.msg}"
    return None


def root_cause(error):
    """The innermost exception's first line: datasets wraps the parser's message in its own."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ----------------------------------------------------------------------------------------------
# Columns: sentence-transformers' conventions, checked against the loss


TARGET_COLUMNS = ("label", "score", "scores", "embedding")
# Grouped rows (BGE's and tevatron's format): a query, lists of positives and negatives, and
# optionally a teacher's score for each. Each step draws a fixed-size group from each row
# (batches.grouped_rows), so the text columns are made up: query, pos, neg_1 .. neg_{G-1}.
GROUPED_COLUMNS = ("query", "pos", "neg")
GROUP_SCORES = ("pos_scores", "neg_scores")


# What each --eval-type reports, and the loss whose column rules its data follows.
EVAL_METRICS = {
    "sts": ("spearman", "pearson"),
    "retrieval": ("mrr@10", "ndcg@10", "recall@1", "recall@10"),
    "beir": ("mrr@10", "ndcg@10", "recall@1", "recall@10", "recall@100", "map@100"),
    "nli": ("accuracy",),
    "loss": ("loss",),
}


EVAL_COLUMNS_LIKE = {"sts": "cosent", "retrieval": "mnrl", "nli": "softmax"}


@dataclass(frozen=True)
class TrainSet:
    """One --train-data file and how it trains."""

    name: str  # the file's stem: its steps' mean loss is logged as loss/NAME
    ds: datasets.Dataset
    loss: str
    text_columns: list
    target: str | None
    num_labels: int = 0
    group_size: int = 0  # grouped rows: the texts drawn per query each step; 0: the rows as they are
    # --dataset-settings: its micro-batch's rows (the global batch is that x world x accumulation),
    # its batches an epoch x weight, MNRL against its own texts only, its prompts over --prompts.
    per_device_batch_size: int = 0
    weight: float = 1.0
    own_negatives: bool = False
    prompts: dict = None
    global_batch: int = 0  # run_plan.add_train_sets', when the world size is known
    loss_plan: object = None  # run_plan.LossPlan: how its micro-batches' loss is computed

    @property
    def prompt_columns(self):
        """The --prompts key of each text column: a grouped set's neg_1 .. neg_{G-1} all take 'neg'."""
        return [c.split("_")[0] if self.group_size else c for c in self.text_columns]

    @property
    def read_columns(self):
        """The columns the run reads, as the file has them (what data_fingerprint hashes)."""
        if self.group_size:
            return self.ds.column_names
        return self.text_columns + ([self.target] if self.target else [])


@dataclass(frozen=True)
class EvalSet:
    name: str  # the file's stem; it prefixes the metrics: stsb-dev/spearman
    kind: str  # sts, retrieval, nli, loss or beir
    ds: datasets.Dataset
    text_columns: list
    target: str | None
    loss: str = ""  # for kind "loss": the loss it is scored with
    beir: "BeirSet" = None  # for kind "beir": a corpus, its queries and their graded relevance
    loss_plan: object = None  # kind "loss": run_plan.LossPlan (run_plan.add_schedule)

    @property
    def metric_names(self):
        return EVAL_METRICS[self.kind]

    def retrieval_set(self, texts):
        """(queries, corpus, relevant) of a retrieval evaluation, from its (prompted) `texts`."""
        if self.beir:
            return texts[0], texts[1], self.beir.relevance
        return eval_dist.retrieval_from_pairs(texts[0], texts[1])

    def texts(self):
        """Each text column's texts (a BEIR set: its queries, then its documents)."""
        if self.beir:
            return [self.beir.queries, self.beir.corpus]
        return [self.ds[c][:] for c in self.text_columns]


@dataclass
class BeirSet:
    """A BEIR-layout folder: corpus.jsonl ({_id, title, text}), queries.jsonl ({_id, text}) and
    qrels/test.tsv (query-id, corpus-id, score), read as lists and indices."""

    queries: list  # the text of each query that has a relevant document
    corpus: list  # title and text of each document, joined by a space (as BEIR and MTEB do)
    relevance: list  # per query, {corpus index: graded relevance > 0}


def loss_from_columns(columns):
    """The loss a file's columns call for, when --loss leaves it open."""
    texts = [c for c in columns if c not in TARGET_COLUMNS]
    if set(GROUPED_COLUMNS) <= set(columns):
        return "distill_kl" if set(GROUP_SCORES) <= set(columns) else "mnrl"
    if "scores" in columns:
        return "distill_kl"
    if "embedding" in columns:
        return "mse"
    if "score" in columns:
        return "cosent"
    if "label" in columns:
        return "margin_mse" if len(texts) == 3 else "softmax"
    return "mnrl"


def load_train_sets(paths, split, subset, group_size, per_device_batch_size, names, settings, prompts):
    """The --train-data files `paths` as TrainSets, each checked against its loss (one of `names`,
    --loss's: one, one per file, or none: its columns'), with its settings (`settings`:
    --dataset-settings {file stem: {setting: value}}, over `per_device_batch_size` and `prompts`).
    `group_size`: the texts a grouped row draws each step. run_plan.data_plan calls it."""
    if len(names) > 1 and len(names) != len(paths):
        raise ValueError(
            f"--loss {','.join(names)} names {len(names)} losses for {len(paths)} --train-data files; "
            "give one, one per file, or none"
        )
    stems = [set_name(path) for path in paths]
    if len(set(stems)) < len(stems):
        raise ValueError(
            f"--train-data: several files are named {sorted({n for n in stems if stems.count(n) > 1})} "
            "(without folder and extension), so their losses would be logged under one name; give them "
            "distinct file names"
        )
    for name in settings:
        if name not in stems:
            raise ValueError(
                f"--dataset-settings: {name!r} is no --train-data file (their stems: {', '.join(stems)})"
            )
    train_sets = []
    for i, (path, name) in enumerate(zip(paths, stems)):
        flag = f"--train-data {path}"
        ds = load_data(path, split, subset, flag="--train-data")
        loss = names[i if len(names) == len(paths) else 0] if names else loss_from_columns(ds.column_names)
        grouped = set(GROUPED_COLUMNS) <= set(ds.column_names)
        try:
            if grouped:
                text_columns, target, num_labels = grouped_columns(ds, loss, group_size)
            else:
                text_columns, target, num_labels = data_columns(ds, loss)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from e
        if not grouped:
            check_rows(ds, text_columns, target, flag)
        own = settings.get(name, {})  # --dataset-settings: this file's, over the run's
        own = {
            "per_device_batch_size": own.get("per_device_batch_size", per_device_batch_size),
            "weight": own.get("weight", 1.0),
            "own_negatives": own.get("own_negatives", False),
            "prompts": {**prompts, **own.get("prompts", {})},
        }
        columns = text_columns, target, num_labels, group_size if grouped else 0
        train_sets.append(TrainSet(name, ds, loss, *columns, **own))
    if sum(ts.loss == "softmax" for ts in train_sets) > 1:
        raise ValueError(
            "--train-data: several files train with --loss softmax, but the run has one Softmax head; "
            "keep one"
        )
    return train_sets


def load_eval_sets(eval_data, eval_type, eval_only, losses, num_labels):
    """The --eval-data files (`eval_data`, comma-separated) as EvalSets, checked like the training
    data: each of --eval-type `eval_type` (or its columns'), scored by --loss's `losses` where it is
    one, for a run whose Softmax head has `num_labels` classes (`eval_only`: none trains)."""
    eval_sets = []
    for path in [p for p in eval_data.split(",") if p]:
        flag = f"--eval-data {path}"
        if os.path.isfile(os.path.join(path, "corpus.jsonl")):
            name = os.path.basename(os.path.normpath(path))
            eval_sets.append(
                EvalSet(name, "beir", None, ["query", "document"], None, beir=load_beir(path, flag))
            )
            continue
        ds = load_data(path, "validation", flag=flag)
        columns = ds.column_names
        if set(GROUPED_COLUMNS) <= set(columns):
            raise ValueError(
                f"{flag}: grouped rows (query, pos, neg) are for training; evaluate on pairs (retrieval) "
                "or on (query, positive, negative ..., scores) rows (the distill_kl loss)"
            )
        kind = eval_type or eval_kind(columns)
        # Scored by its loss: --loss when it names one, else the file's columns decide (as for training).
        loss = losses[0] if len(losses) == 1 else loss_from_columns(columns)
        try:
            text_columns, target, eval_labels = data_columns(ds, EVAL_COLUMNS_LIKE.get(kind, loss))
        except ValueError as e:
            raise ValueError(f"{flag} (--eval-type {kind}): {e}") from e
        check_rows(ds, text_columns, target, flag)
        if eval_only and (kind == "nli" or (kind == "loss" and loss == "softmax")):
            raise ValueError(
                f"{flag}: --eval-only evaluates embeddings; nli accuracy and the softmax loss need a "
                "trained Softmax head, which a --model folder does not hold. Use --eval-type sts, "
                "retrieval, or loss with --loss mnrl or cosent"
            )
        if kind == "nli" and eval_labels > num_labels:
            raise ValueError(
                f"{flag}: nli accuracy needs the Softmax head trained on the same classes; this run's head "
                f"has {num_labels} classes (0: no --train-data file trains with softmax) and the file "
                f"{eval_labels}. Use --eval-type loss or sts instead"
            )
        if kind == "loss" and loss == "softmax" and num_labels == 0:
            raise ValueError(
                f"{flag}: the softmax loss needs the Softmax head, which no --train-data file of this run "
                "trains; use --eval-type sts"
            )
        name = set_name(path)
        eval_sets.append(EvalSet(name, kind, ds, text_columns, target, loss))
    return eval_sets


def check_eval_names(eval_sets, matryoshka, metric_for_best):
    """Distinct evaluation names, and --metric-for-best among the metrics they make (with the
    Matryoshka sizes `matryoshka`: (dims, weights) or None)."""
    stems = [es.name for es in eval_sets]
    if len(set(stems)) < len(stems):
        twice = sorted({stem for stem in stems if stems.count(stem) > 1})
        raise ValueError(
            f"--eval-data: several files are named {twice} (without folder and extension), so their metrics "
            "would overwrite each other; give them distinct file names"
        )
    sizes = [""] + [f"@{d}" for d in (matryoshka or [()])[0]]
    names = [
        f"{es.name}/{metric}{size}"
        for es in eval_sets
        for metric in EVAL_METRICS[es.kind]
        for size in (sizes if es.kind in ("sts", "retrieval", "beir") else [""])
    ]
    if metric_for_best and metric_for_best not in names:
        raise ValueError(f"--metric-for-best {metric_for_best}: not among this run's metrics {names}")


def load_beir(folder, flag):
    """A BEIR-layout folder as a BeirSet: qrels/test.tsv, else the folder's only qrels file.
    Relevance 0 means judged not relevant; queries with no relevant document are left out, as
    sentence-transformers' InformationRetrievalEvaluator does."""
    qrels_dir = os.path.join(folder, "qrels")
    files = sorted(f for f in os.listdir(qrels_dir) if f.endswith(".tsv")) if os.path.isdir(qrels_dir) else []
    qrels = "test.tsv" if "test.tsv" in files else files[0] if len(files) == 1 else None
    if qrels is None:
        raise ValueError(f"{flag}: a BEIR folder needs qrels/test.tsv (or one qrels/*.tsv); found {files}")
    corpus_rows = load_data(os.path.join(folder, "corpus.jsonl"), "train", flag=flag)
    query_rows = load_data(os.path.join(folder, "queries.jsonl"), "train", flag=flag)
    for rows, needed in ((corpus_rows, ("_id", "text")), (query_rows, ("_id", "text"))):
        if not set(needed) <= set(rows.column_names):
            raise ValueError(f"{flag}: BEIR rows need the columns {needed}; found {rows.column_names}")
    titles = corpus_rows["title"][:] if "title" in corpus_rows.column_names else [""] * len(corpus_rows)
    corpus = [f"{title or ''} {text or ''}".strip() for title, text in zip(titles, corpus_rows["text"][:])]
    corpus_index = {str(i): n for n, i in enumerate(corpus_rows["_id"][:])}
    query_text = {str(i): t for i, t in zip(query_rows["_id"][:], query_rows["text"][:])}
    relevance = {}
    with open(os.path.join(qrels_dir, qrels), encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            fields = line.rstrip("\n").split("\t")
            if line_number == 1 and fields[0] == "query-id":
                continue
            known = len(fields) == 3 and fields[0] in query_text and fields[1] in corpus_index
            if not known or not fields[2].strip().lstrip("-").replace(".", "", 1).isdigit():
                raise ValueError(
                    f"{flag}: qrels/{qrels} line {line_number} is not 'query-id<TAB>corpus-id<TAB>score' "
                    f"of a known query and document: {line.strip()!r}"
                )
            if float(fields[2]) > 0:
                relevance.setdefault(fields[0], {})[corpus_index[fields[1]]] = float(fields[2])
    if not relevance:
        raise ValueError(f"{flag}: qrels/{qrels} marks no document relevant to any query")
    queries = [q for q in query_text if q in relevance]
    return BeirSet([query_text[q] for q in queries], corpus, [relevance[q] for q in queries])


def eval_kind(columns):
    """What an evaluation file's columns call for when --eval-type leaves it open. A 'label' with
    three text columns is a teacher's margin (margin_mse), 'scores' a teacher's scores (distill_kl),
    'embedding' a teacher's vector (mse): such a file's metric is the loss."""
    texts = [c for c in columns if c not in TARGET_COLUMNS]
    if "score" in columns:
        return "sts"
    if "scores" in columns or "embedding" in columns or ("label" in columns and len(texts) == 3):
        return "loss"
    return "nli" if "label" in columns else "retrieval"


# What each loss needs of a file's columns: (fewest text columns, most (None: any), a target:
# True needs one, False refuses one, None takes either), and how its error message says it.
# fmt: off
LOSS_COLUMNS = {
    "mnrl": (2, None, False, "(anchor, positive[, negative ...]) text columns and no target"),
    "distill_kl": (3, None, True, "(query, positive, negative[, negative ...]) text columns and a "
                   "'scores' (or 'label') list with the teacher's score of each"),
    "mse": (1, None, None, "text columns (a text[, its translations ...]) and an 'embedding' column "
            "with the teacher's vector (or --teacher-model)"),
    "margin_mse": (3, 3, True, "(query, positive, negative) text columns and a 'label' with the "
                   "teacher's score margin"),
    "cosent": (2, 2, True, "two text columns and a target (sentence1, sentence2, score)"),
    "softmax": (2, 2, True, "two text columns and a target (premise, hypothesis, label)"),
}
# fmt: on


def data_columns(ds, loss_name):
    """Split the columns into text columns (in order) and the target column, and check that
    they fit the loss (LOSS_COLUMNS). Returns (text_columns, target_column or None, num_labels
    or 0)."""
    if len(ds) == 0:
        raise ValueError("the data set holds no rows")
    targets = [c for c in ds.column_names if c in TARGET_COLUMNS]
    texts = [c for c in ds.column_names if c not in TARGET_COLUMNS]
    for c in texts:
        if getattr(ds.features[c], "dtype", None) not in ("string", "large_string"):
            raise ValueError(
                f"column {c!r} holds {ds.features[c]}, not text; "
                "the target column must be named 'label' or 'score'"
            )
    if len(targets) > 1:
        raise ValueError(f"columns {targets} are both targets; keep one")
    target = targets[0] if targets else None
    fewest, most, wants_target, needs = LOSS_COLUMNS[loss_name]
    if len(texts) < fewest or len(texts) > (most or len(texts)) or wants_target not in (None, bool(target)):
        raise ValueError(f"--loss {loss_name} needs {needs}; got {ds.column_names}")
    if loss_name == "distill_kl":
        check_score_lists(ds, target, len(texts) - 1)
    numeric = ("float16", "float32", "float64", "int32", "int64")
    if loss_name in ("cosent", "margin_mse") and getattr(ds.features[target], "dtype", "") not in numeric:
        raise ValueError(
            f"--loss {loss_name} needs numeric scores in {target!r}; "
            f"{first_offender(ds[target][:ROWS_AT_ONCE], 'a number')}"
        )
    num_labels = softmax_classes(ds, target) if loss_name == "softmax" else 0
    return texts, target, num_labels


def is_score_list(value, length):
    """A list of `length` finite numbers (a teacher's scores)."""
    return (
        isinstance(value, list)
        and len(value) == length
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
    )


def check_score_lists(ds, column, lengths):
    """Every row's `column` lists one finite teacher score per text after the query: `lengths`, an
    int (every row's count) or the name of the list column whose lengths each row's must match."""
    for start, values in windows(ds, column):
        expected = length_of(ds, lengths, start) if isinstance(lengths, str) else lengths
        i = bad_score_list(values, expected)
        if i is not None:
            count = expected if isinstance(expected, int) else expected[i].as_py()
            what = (
                f"the teacher's score of each text in {lengths}"
                if isinstance(lengths, str)
                else ("the teacher's score of each text after the query")
            )
            raise ValueError(
                f"row {start + i} has {column} = {values[i].as_py()!r}; it must list {count} finite numbers, "
                + what
            )


def length_of(ds, list_column, start):
    """The lengths of `list_column`'s lists in the window that starts at row `start`."""
    values = ds.with_format("arrow")[start : start + ROWS_AT_ONCE].column(list_column)
    return pc.list_value_length(pa.concat_arrays(values.chunks))


def bad_score_list(values, expected):
    """The index of the first row whose value is not a list of `expected` finite numbers (an int,
    or an Arrow array of each row's count), or None."""
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
        return 0
    item = values.type.value_type
    if not (pa.types.is_floating(item) or pa.types.is_integer(item) or pa.types.is_null(item)):
        return 0
    wrong_length = pc.not_equal(pc.list_value_length(values), expected)
    if (i := first_true(pc.or_kleene(pc.is_null(values), wrong_length))) is not None:
        return i
    flat = pc.list_flatten(values)
    finite = pc.is_finite(flat) if pa.types.is_floating(item) else pc.is_valid(flat)
    if (j := first_true(pc.invert(pc.fill_null(finite, False)))) is not None:
        return pc.list_parent_indices(values)[j].as_py()
    return None


def grouped_columns(ds, loss_name, group_size):
    """A grouped data set's (made-up text columns, target, 0), after checking every row: a
    non-empty query, at least one positive, at least one negative when the group needs any,
    and (with distill_kl) one finite teacher score per positive and per negative."""
    if len(ds) == 0:
        raise ValueError("the data set holds no rows")
    has_scores = set(GROUP_SCORES) <= set(ds.column_names)
    if loss_name not in ("mnrl", "distill_kl") or (loss_name == "distill_kl" and not has_scores):
        raise ValueError(
            f"grouped rows {GROUPED_COLUMNS} train with --loss mnrl, or distill_kl with the teacher's "
            f"{' and '.join(GROUP_SCORES)}; got --loss {loss_name} and columns {ds.column_names}"
        )
    if loss_name == "distill_kl" and group_size < 2:
        raise ValueError(
            "--loss distill_kl over groups needs --group-size 2 or more (a positive and a negative)"
        )
    for start, queries in windows(ds, "query"):
        if (i := first_true(blank_texts(queries))) is not None:
            query = queries[i].as_py()
            raise ValueError(
                f"row {start + i} has {'no' if query is None else 'an empty'} query; remove or fill it"
            )
    for column, needed in (("pos", 1), ("neg", 1 if group_size > 1 else 0)):
        for start, texts in windows(ds, column):
            check_text_lists(texts, start, column, needed, group_size)
    if loss_name == "distill_kl":
        for column, texts_column in zip(GROUP_SCORES, GROUPED_COLUMNS[1:]):
            check_score_lists(ds, column, texts_column)
    negatives = [f"neg_{g}" for g in range(1, group_size)]
    return ["query", "pos", *negatives], "scores" if loss_name == "distill_kl" else None, 0


def check_text_lists(texts, start, column, needed, group_size):
    """A window of grouped rows' `column` (from row `start`): every row a list of at least `needed`
    texts, none of them null or empty."""
    is_list = pa.types.is_list(texts.type) or pa.types.is_large_list(texts.type)
    short = (
        None if not is_list else pc.or_kleene(pc.is_null(texts), pc.less(pc.list_value_length(texts), needed))
    )
    if not is_list or (i := first_true(short)) is not None:
        i = 0 if not is_list else i
        raise ValueError(
            f"row {start + i} has {column} = {texts[i].as_py()!r}; it must be a list of at least {needed} "
            "text(s)" + (f" for --group-size {group_size}" if column == "neg" else "")
        )
    flat = pc.list_flatten(texts)
    if not (pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type) or len(flat) == 0):
        raise ValueError(f"row {start}: {column} holds {flat.type} values, not texts")
    if len(flat) and (j := first_true(blank_texts(flat))) is not None:
        i = pc.list_parent_indices(texts)[j].as_py()
        raise ValueError(f"row {start + i}: {column} holds a null or empty text; remove or fill it")


def softmax_classes(ds, target):
    """The number of classes of the --loss softmax labels in column `target`, after checking that
    every row has an integer label in 0..C-1 (C: the ClassLabel's classes, else the largest label + 1)."""
    feature = ds.features[target]
    if not (isinstance(feature, datasets.ClassLabel) or getattr(feature, "dtype", "").startswith("int")):
        raise ValueError(
            f"--loss softmax needs integer class labels in {target!r}; "
            f"{first_offender(ds[target][:ROWS_AT_ONCE], 'an integer', int)}"
        )
    lowest, highest = math.inf, -math.inf
    for start, labels in windows(ds, target):
        if (i := first_true(pc.is_null(labels))) is not None:
            raise ValueError(f"--loss softmax: row {start + i} has no {target}; every row needs a class")
        extremes = pc.min_max(labels).as_py()
        lowest, highest = min(lowest, extremes["min"]), max(highest, extremes["max"])
    num_labels = feature.num_classes if isinstance(feature, datasets.ClassLabel) else highest + 1
    if lowest < 0:
        raise ValueError(
            f"--loss softmax: {target!r} holds negative labels ({lowest}); classes are numbered 0..C-1"
        )
    if highest >= num_labels:
        raise ValueError(
            f"--loss softmax: {target!r} holds class {highest}, but the data set declares "
            f"{num_labels} classes (0..{num_labels - 1})"
        )
    return num_labels


def first_offender(values, what, kind=(int, float)):
    """'row I holds VALUE (a TYPE), not WHAT; ...' for the first value that is not of `kind`."""
    for i, value in enumerate(values):
        if not isinstance(value, kind) or isinstance(value, bool):
            quoted = " (write numbers without quotes)" if isinstance(value, str) else ""
            return f"row {i} holds {value!r} (a {type(value).__name__}), not {what}{quoted}"
    # datasets reads a JSON column that mixes types (0.5 and "0.5") as Json and decodes both to 0.5.
    return (
        'its rows mix numbers and other types (e.g. some quoted: "0.5"); '
        "write every value as a number without quotes"
    )


# ----------------------------------------------------------------------------------------------
# Every row checked, and the data's fingerprint, in Arrow's compute: no text becomes a Python
# object, and a window of ROWS_AT_ONCE rows is all that is held at a time, so start-up costs
# seconds and memory flat in the data's size (bench/bench_data_scale.py).

ROWS_AT_ONCE = 1 << 16


def windows(ds, column):
    """(first row, the column's values there as one Arrow array) for each window of ROWS_AT_ONCE
    rows, in order: memory-mapped slices of the data set's table, not copies."""
    table = ds.with_format("arrow")
    for start in range(0, len(ds), ROWS_AT_ONCE):
        values = table[start : start + ROWS_AT_ONCE].column(column)
        yield start, values.chunk(0) if values.num_chunks == 1 else pa.concat_arrays(values.chunks)


def first_true(mask):
    """The index of the first true value of a boolean Arrow array (nulls count as false), or None."""
    index = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if index < 0 else index


def blank_texts(values):
    """Which texts are null, empty or all whitespace (what `not text.strip()` finds)."""
    return pc.or_kleene(
        pc.or_kleene(pc.is_null(values), pc.equal(pc.binary_length(values), 0)), pc.utf8_is_space(values)
    )


def check_rows(ds, text_columns, target, flag):
    """What the schema cannot show: null or empty texts, missing or non-finite targets. Each
    problem is reported with the first row that has it, so it can be found and fixed."""
    for column in text_columns:
        for start, values in windows(ds, column):
            if (i := first_true(blank_texts(values))) is not None:
                text = values[i].as_py()
                raise ValueError(
                    f"{flag}: row {start + i} has {'a null' if text is None else 'an empty'} {column!r}; "
                    "remove or fill such rows"
                )
    if target is None:
        return
    for start, values in windows(ds, target):
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            return  # a teacher's scores (distill_kl): checked by check_score_lists
        finite = pc.is_finite(values) if pa.types.is_floating(values.type) else pc.is_valid(values)
        if (i := first_true(pc.invert(pc.fill_null(finite, False)))) is not None:
            value = values[i].as_py()
            raise ValueError(
                f"{flag}: row {start + i} has {target} = {value}; every row needs a finite {target}"
            )


def data_fingerprint(ds, columns):
    """'N rows, arrow-sha256 HASH' of the columns the run reads: saved with every checkpoint, so a
    resume on data that changed (rows added, removed, edited or reordered) is refused. Texts are
    hashed from Arrow's buffers (each text's length, then the bytes of all of them), window by
    window, so the hash is the same however the table is cut into chunks; other columns (targets,
    grouped lists) as JSON, a window at a time."""
    digest = hashlib.sha256()
    for column in columns:
        digest.update(json.dumps(column).encode())
        for _, values in windows(ds, column):
            digest.update(pc.is_null(values).cast(pa.int8()).buffers()[1])
            if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
                values = pa.concat_arrays([values.cast(pa.large_string())])  # one buffer, from offset 0
                lengths = pc.fill_null(pc.binary_length(values), 0)
                digest.update(memoryview(lengths.buffers()[1])[: 8 * len(values)])
                digest.update(memoryview(values.buffers()[2])[: pc.sum(lengths).as_py() or 0])
            else:
                digest.update(json.dumps(values.to_pylist()).encode())
    return f"{len(ds)} rows, arrow-sha256 {digest.hexdigest()[:16]}"


def fingerprint_before_arrow(ds, columns):
    """The fingerprint as checkpoints written before data_fingerprint hashed Arrow's buffers hold
    it ('N rows, sha256 HASH'), so a resume from one still recognises its data. It reads every
    text into Python: computed only when such a checkpoint is resumed."""
    digest = hashlib.sha256()
    for column in columns:
        digest.update(json.dumps([column, ds[column][:]]).encode())
    return f"{len(ds)} rows, sha256 {digest.hexdigest()[:16]}"
