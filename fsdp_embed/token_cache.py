"""Texts tokenized once: each training set's token ids in a memory-mapped Arrow file, read by the loop.

`write_or_read_token_table(ts, loaded, fallback_dir, fingerprint)` returns the table of a training
set (training_data.TrainSet): one list<int32> column per text column, the ids of each row's text as
`loaded.tokenize` (embedding_model.py) makes them before padding: prompted, as written, cut at the
column's length, with the EOS an --append-eos tokenizer adds. The file lies beside the data set's
own Arrow cache (where it has none, or that folder is read-only: in `fallback_dir`), named
tokens-NAME-HASH.arrow by a hash of everything the ids depend on (`cache_key`): the data, the
tokenizer, the columns, their prompts and lengths, lowercasing, the texts read as written. It is
written once, a window of rows at a time (memory flat in rows), to NAME.tmp-PID and renamed, under
a file lock: the first process of a host (or of every host that shares the folder) writes it, the
others wait on the lock and then read it; every epoch and every resume reads it again. No
collective: a writer that fails releases the lock, and the next process tries itself.
`features(table, indices, columns, loaded)` pads a micro-batch's ids exactly as `loaded.tokenize`
pads them (tests/test_token_cache.py: equal tensors).

    table, path, wrote = token_cache.write_or_read_token_table(ts, loaded, output_dir, fingerprint)
    features = token_cache.features(table, indices, ts.text_columns, loaded)

Left out on purpose: grouped rows (their texts are drawn anew each step: batches.py tokenizes
them on the fly), evaluation (it tokenizes its own texts), and tokenizers whose features are more
than ids, a mask and all-zero token types (`unsupported`: tokenized on the fly).

Needs torch, numpy, pyarrow (installed with datasets) and tqdm (with transformers); imports no other
project file.
"""

import errno
import fcntl
import glob
import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import tqdm

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the errors of a disk that has no room for the file
ROWS_AT_ONCE = 1 << 14  # rows tokenized (and held as Python lists) at a time while writing
FORMAT = 1  # bump when the file's layout or what its ids mean changes: older files are then left unread


def unsupported(tokenizer):
    """Why padding stored ids could differ from what the tokenizer returns, or "" (they do not):
    only input_ids, attention_mask and token_type_ids that are all 0, padding included."""
    sample = tokenizer("a b")
    extra = sorted(set(sample) - {"input_ids", "attention_mask", "token_type_ids"})
    if extra:
        return f"the tokenizer also returns {', '.join(extra)}"
    if any(sample.get("token_type_ids", [0])) or getattr(tokenizer, "pad_token_type_id", 0):
        return "the tokenizer gives a text token type ids other than 0"
    if tokenizer.pad_token_id is None:
        return "the tokenizer has no pad token"
    return ""


def cache_key(ts, loaded, fingerprint):
    """Everything a set's stored ids depend on, as a dict (its hash names the file)."""
    tokenizer = loaded.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A fast tokenizer's whole definition (vocabulary, normaliser, post-processor: --append-eos's
    # EOS) is its JSON; a slow one's, its vocabulary.
    if backend is not None:
        definition = backend.to_str()
    else:
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "format": FORMAT,
        "data": [ts.ds._fingerprint, fingerprint, len(ts.ds)],  # datasets' (path, mtime) and the content's
        "tokenizer": [type(tokenizer).__name__, hashlib.sha256(definition.encode()).hexdigest()],
        "sides": [tokenizer.truncation_side, tokenizer.padding_side],
        "eos": tokenizer("a")["input_ids"][-1:] == [tokenizer.eos_token_id],
        "columns": ts.text_columns,
        "prompts": [ts.prompts.get(c, "") for c in ts.prompt_columns],
        "lengths": [loaded.column_lengths.get(c, loaded.max_seq_length) for c in ts.prompt_columns],
        "lowercase": loaded.lowercase,
        # Texts as sentence-transformers 6 reads them, as written: a file of stripped texts' ids
        # (written before) has another key, so it is never read.
        "texts": "as written",
    }


def cache_path(ts, loaded, fallback_dir, fingerprint=""):
    """Where the set's token ids live: beside its Arrow cache where that folder is writable, else in
    fallback_dir; the name holds the hash of cache_key."""
    key = json.dumps(cache_key(ts, loaded, fingerprint), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    files = [f["filename"] for f in ts.ds.cache_files]
    folder = os.path.dirname(files[0]) if files else ""
    if not folder or not os.access(folder, os.W_OK):
        folder = fallback_dir
    return os.path.join(folder, f"tokens-{ts.name}-{digest}.arrow")


def write_or_read_token_table(ts, loaded, fallback_dir, fingerprint=""):
    """The set's token ids as a memory-mapped Arrow table, written first if no process has yet.
    Returns (table, path, whether this process wrote it). `fingerprint`: the set's content hash
    (training_data.data_fingerprint), so an edit that keeps the file's path and time still makes a
    new file."""
    path = cache_path(ts, loaded, fallback_dir, fingerprint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    wrote = False
    with open(path + ".lock", "w") as lock:
        # The first process of the host writes; the others wait here, then read. The kernel drops
        # the lock of a process that dies, so a killed writer blocks no one.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            for stale in glob.glob(glob.escape(path) + ".tmp-*"):  # a killed writer's: no one else writes now
                os.remove(stale)
            write_table(ts, loaded, path)
            wrote = True
    return pa.ipc.open_file(pa.memory_map(path)).read_all(), path, wrote


def write_table(ts, loaded, path):
    """Tokenize the set's text columns a window of rows at a time into `path` (via a temporary file)."""
    schema = pa.schema([(c, pa.list_(pa.int32())) for c in ts.text_columns])
    temporary = f"{path}.tmp-{os.getpid()}"
    rows = ts.ds.with_format("arrow")
    bar = tqdm.tqdm(total=len(ts.ds), desc=f"tokenizing {ts.name}", unit=" rows", unit_scale=True)
    try:
        with pa.OSFile(temporary, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for start in range(0, len(ts.ds), ROWS_AT_ONCE):
                window = rows[start : start + ROWS_AT_ONCE]
                columns = [
                    pa.array(ids_of(window.column(c).to_pylist(), key, ts, loaded), type=pa.list_(pa.int32()))
                    for c, key in zip(ts.text_columns, ts.prompt_columns)
                ]
                writer.write_batch(pa.record_batch(columns, schema=schema))
                bar.update(len(window))
    except OSError as e:
        if e.errno in DISK_FULL:  # nothing half written stays on a full disk
            os.remove(temporary)
        raise
    finally:
        bar.close()
    os.replace(temporary, path)  # whole, or not there: a killed writer leaves only its .tmp file


def ids_of(texts, key, ts, loaded):
    """The unpadded ids of a column's texts, as loaded.tokenize makes them: the prompt prepended as
    batches.with_prompt does, then as written (never stripped) and cut at the column's length
    (`key`: its --prompts and --max-seq-length key)."""
    prefix = ts.prompts.get(key, "")
    texts = [prefix + t for t in texts] if prefix else texts  # as written (LoadedModel.tokenize)
    length = loaded.column_lengths.get(key, loaded.max_seq_length)
    return loaded.tokenizer(texts, truncation=True, max_length=length)["input_ids"]


def rows_of(column, indices):
    """Rows `indices` of a chunked list<int32> column, in that order. Taken chunk by chunk:
    pyarrow's take on the whole column joins every chunk first, a copy of the column per call."""
    indices = np.asarray(indices, dtype=np.int64)
    starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])
    which = np.searchsorted(starts, indices, side="right") - 1  # each row's chunk
    order = np.argsort(which, kind="stable")
    pieces = [
        column.chunk(k).take(pa.array(indices[order][which[order] == k] - starts[k]))
        for k in np.unique(which)
    ]
    return pa.concat_arrays(pieces).take(pa.array(np.argsort(order)))  # back in the asked order


def features(table, indices, columns, loaded, prompts=None):
    """One dict of padded tokens per text column for rows `indices`, all columns padded to one
    length together on the tokenizer's padding side, as batches.collate gets them from
    loaded.tokenize (int64 tensors: input_ids, attention_mask, token_type_ids where it returns
    them; the pool mask under --no-include-prompt, from `prompts`: each column's prefix)."""
    lists = [rows_of(table.column(c), indices) for c in columns]  # all columns' texts, column by column
    # Copied out of Arrow's read-only buffers (torch cannot share them) as int64, the tokenizer's type.
    lengths = np.concatenate([pc.list_value_length(x).to_numpy() for x in lists])
    values = np.concatenate([pc.list_flatten(x).to_numpy() for x in lists])
    lengths, values = torch.tensor(lengths, dtype=torch.long), torch.tensor(values, dtype=torch.long)
    longest = int(lengths.max())
    positions = torch.arange(longest)
    if loaded.tokenizer.padding_side == "left":
        mask = positions >= (longest - lengths)[:, None]
    else:
        mask = positions < lengths[:, None]
    input_ids = torch.full((len(lengths), longest), loaded.tokenizer.pad_token_id, dtype=torch.long)
    input_ids[mask] = values  # row-major: each text's ids fill its unpadded positions in order
    tokens = {"input_ids": input_ids}
    names = loaded.tokenizer("a").keys()
    if "attention_mask" in names:
        tokens["attention_mask"] = mask.long()
    if "token_type_ids" in names:  # one sequence a text: all 0 (unsupported() checked it)
        tokens["token_type_ids"] = torch.zeros_like(input_ids)
    size = len(indices)
    tokens = loaded.with_pool_mask(tokens, [p for p in prompts or [""] * len(columns) for _ in range(size)])
    return [{k: v[n * size : (n + 1) * size] for k, v in tokens.items()} for n in range(len(columns))]
