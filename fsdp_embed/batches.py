"""Batches: every step's rows from the seed alone, tokenized, and cut into sub-batches.

  - the schedule (`Schedule`): each epoch's permutation is drawn from (seed, epoch) and cut
    into global batches of per_device_batch_size x world x grad_accum_steps rows, an epoch at a
    time, as the loop reaches it (memory flat in rows and epochs); rank r,
    micro-step j takes its own contiguous slice (`micro_batch_indices`). So 2 ranks x batch B
    train on exactly the rows of 1 process x batch B x 2 accumulation steps, and a resumed run
    continues with the same rows. Several data sets are mixed a whole global batch at a time,
    each with its own batch size and weight (`set_batches`); `no_duplicate_batches` keeps a
    text from being its own negative;
  - grouped rows (`grouped_rows`): each step, a query's positive and G-1 negatives drawn from
    (seed, step, row) alone, so the same on any rank and in a resumed run;
  - collation (`collate`, `micro_batches`): prompts, one tokenizer call for all columns, in a
    background thread that reads the next micro-batches while this one computes, tokenizing them
    itself or handing them to worker processes (`TokenizingWorkers`), in order;
  - length-sorted sub-batches (`sub_batches`): a micro-batch's texts of all columns as one pool
    (pool_columns), cut into runs of similar length, each run one encoder pass
    padded to its own longest row. Packing the pool's texts end to end instead lives with the
    model (embedding_model.pack, EmbeddingModel.embed_packed).

Needs torch and tqdm (with transformers), and fsdp_embed/token_cache.py (the token ids read once,
--tokenize once).
"""

import bisect
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import hashlib
import itertools
import math
import multiprocessing
import os
import random
import signal
import sys
import threading
import time

import torch
import tqdm

from fsdp_embed import token_cache


# ----------------------------------------------------------------------------------------------
# The schedule: every step's rows, from the seed alone


def epoch_order(num_rows, seed, epoch):
    """The epoch's permutation of the rows: a function of (seed, epoch) alone, the same on every
    rank and in a resumed run. In int32 below 2^31 rows: 4 bytes a row, and the same permutation
    as in int64 (torch draws the same numbers for either)."""
    dtype = torch.int32 if num_rows < 2**31 else torch.int64
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch), dtype=dtype)


class Schedule:
    """Every optimizer step's global batch: `schedule[step]` (from 0) is (epoch, set index, row
    indices), the same on every rank and in a resumed run, a function of the seed and the data
    alone. Epochs follow each other until --max-steps (or --epochs) is reached.

    Planned at start-up from counts alone: each epoch's sequence of sets (`set_orders`, a few
    bytes a step). An epoch's rows are drawn when a step of it is first asked for, and only that
    epoch's are held: one permutation of each set's rows (4 bytes a row; with --batch-sampler
    no_duplicates also 8 bytes a text of hashes), whatever the number of epochs planned."""

    def __init__(self, train_sets, seed, epochs, max_steps, mix="proportional", no_duplicates=False):
        """`train_sets` (training_data.TrainSet, each with its global batch) over --epochs `epochs` or
        --max-steps `max_steps` (0: --epochs), mixed by --mix `mix`; `no_duplicates`: --batch-sampler
        no_duplicates (no text twice in a batch)."""
        self.train_sets, self.seed, self.mix, self.no_duplicates = train_sets, seed, mix, no_duplicates
        self.held = (None, [], None)  # (epoch, epoch_rows(epoch)): the one epoch whose rows are held
        self.hashes = {}  # --batch-sampler no_duplicates: set index -> its texts' hashes (text_hashes)
        self.counted = {}  # no_duplicates: the last planned epoch's set_batches, {(set, epoch): ...}
        self.set_orders = []  # per epoch: the set index of each of its global batches
        planned = 0
        for epoch in itertools.count():
            self.set_orders.append(self.set_order(epoch))
            if not len(self.set_orders[-1]):
                raise ValueError(
                    f"--train-data: epoch {epoch} makes no global batch of "
                    f"{' / '.join(str(ts.global_batch) for ts in train_sets)} rows"
                    + (" with no text twice (--batch-sampler no_duplicates)" if self.no_duplicates else "")
                )
            planned += len(self.set_orders[-1])
            if planned >= max_steps if max_steps else epoch + 1 == epochs:
                break
        self.total_steps = min(planned, max_steps) if max_steps else planned
        self.epoch_starts = list(itertools.accumulate([0] + [len(order) for order in self.set_orders]))

    def __len__(self):
        return self.total_steps

    def __getitem__(self, step):
        """(epoch, set index, row indices) of optimizer step `step` (from 0); a slice: a list of them."""
        if isinstance(step, slice):
            return [self[i] for i in range(*step.indices(self.total_steps))]
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} of {self.total_steps}")
        epoch, i = self.locate(step)
        if self.held[0] != epoch:
            self.held = (None, [], None)  # the previous epoch's rows go before the next one's are drawn
            self.held = (epoch, *self.epoch_rows(epoch))
        set_index = int(self.set_orders[epoch][i])
        chunks, place = self.held[1][set_index], self.held[2][i]
        return (
            self.epoch_at(step),
            set_index,
            nth_batch(chunks, place, self.train_sets[set_index].global_batch),
        )

    def locate(self, step):
        """(epoch, the step's place in it)."""
        epoch = bisect.bisect_right(self.epoch_starts, step) - 1
        return epoch, step - self.epoch_starts[epoch]

    def epoch_at(self, step):
        """The epochs done after step `step` (from 0), e.g. 1.5 halfway through the second."""
        epoch, i = self.locate(step)
        return epoch + (i + 1) / len(self.set_orders[epoch])

    def steps_of_set(self, set_index):
        """How many of the planned steps train on set `set_index`."""
        orders = torch.cat(self.set_orders)[: self.total_steps]
        return int((orders == set_index).sum())

    def set_order(self, epoch):
        """The set index of each global batch of epoch `epoch`, in order: each set's batches
        interleaved by --mix. Proportional: every batch of every set once, in an order drawn from
        (seed, epoch); round_robin: the sets in turn, until the smallest runs out."""
        counts = [self.batch_count(i, epoch) for i in range(len(self.train_sets))]
        if self.mix == "round_robin":
            return torch.arange(len(counts)).repeat(min(counts))
        labels = torch.cat([torch.full((count,), i) for i, count in enumerate(counts)])
        if len(counts) > 1:
            seed = self.seed + 104729 + epoch
            labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]
        return labels

    def batch_count(self, set_index, epoch):
        """Set `set_index`'s global batches in epoch `epoch`: from its size and weight alone, but
        with --batch-sampler no_duplicates, whose batches depend on the epoch's order (drawn here
        and kept for the epoch's first step if the epoch is the last one planned, else drawn
        again when the epoch is trained)."""
        ts = self.train_sets[set_index]
        if self.no_duplicates:
            self.counted = {key: chunks for key, chunks in self.counted.items() if key[1] == epoch}
            self.counted[set_index, epoch] = self.set_batches(set_index, epoch)
            return sum(len(chunk) for chunk in self.counted[set_index, epoch]) // ts.global_batch
        cut = len(ts.ds) // ts.global_batch
        return max(1, round(ts.weight * cut)) if cut else 0

    def epoch_rows(self, epoch):
        """What epoch `epoch`'s steps read their rows from: each set's batches (set_batches, as
        flat tensors of rows) and each step's place among its set's batches. No object per batch:
        a batch is a slice taken when its step is asked for."""
        order = self.set_orders[epoch]
        places = torch.empty_like(order)
        for set_index in range(len(self.train_sets)):
            steps = order == set_index
            places[steps] = torch.arange(int(steps.sum()))
        counted, self.counted = self.counted, {}
        sets = range(len(self.train_sets))
        return [counted.get((i, epoch)) or self.set_batches(i, epoch) for i in sets], places

    def set_batches(self, set_index, epoch):
        """One set's global batches of an epoch, end to end in flat tensors of rows (one a shuffle;
        nth_batch cuts them): its rows shuffled from (seed, set, epoch) and cut into global batches
        of its size (the tail dropped; with --batch-sampler no_duplicates, no text twice in one). A
        weight w (--dataset-settings) keeps round(w x that many) batches, at least one: from one
        shuffle below 1, from further shuffles above (each row then w times)."""
        ts = self.train_sets[set_index]
        if self.no_duplicates and set_index not in self.hashes:
            self.hashes[set_index] = text_hashes(ts.ds, ts.text_columns)
        chunks, count, keep, size = [], 0, 0, ts.global_batch
        for shuffle in range(max(1, math.ceil(ts.weight))):
            # Set 0, shuffle 0: the one-set order; every other (set, shuffle) a seed of its own.
            order = epoch_order(len(ts.ds), self.seed + 7919 * set_index + 15485863 * shuffle, epoch)
            if self.no_duplicates:
                order = no_duplicate_batches(self.hashes[set_index], order, size)
            cut = len(order) // size
            if shuffle == 0:
                keep = max(1, round(ts.weight * cut)) if cut else 0
            chunks.append(order[: min(cut, keep - count) * size])  # a view: no copy
            count += len(chunks[-1]) // size
            if count >= keep:
                break  # the further shuffles would be cut off anyway
        return chunks


def nth_batch(chunks, n, size):
    """Batch `n` of the batches of `size` rows laid end to end in `chunks` (set_batches)."""
    for chunk in chunks:
        if n < len(chunk) // size:
            return chunk[n * size : (n + 1) * size]
        n -= len(chunk) // size
    raise IndexError(f"batch {n} past the end")


def text_hashes(ds, text_columns):
    """(rows, columns) int64: 8 bytes of blake2b of each text as written, what no_duplicate_batches
    compares (equal texts, equal hashes; another text collides once in ~10^19). Read a window of
    rows at a time, so no column is held as Python strings."""
    hashes = torch.empty((len(ds), len(text_columns)), dtype=torch.int64)
    table = ds.with_format("arrow")
    shown = len(ds) > 1 << 20 and os.environ.get("RANK", "0") == "0"  # on rank 0, where it takes seconds
    bar = tqdm.tqdm(total=len(ds), desc="hashing texts (no_duplicates)", unit=" rows", disable=not shown)
    for start in range(0, len(ds), 1 << 16):
        window = table[start : start + (1 << 16)]
        for j, column in enumerate(text_columns):
            texts = window.column(column).to_pylist()
            hashes[start : start + len(texts), j] = torch.tensor([text_hash(t) for t in texts])
        bar.update(len(window))
    bar.close()
    return hashes


def text_hash(text):
    """8 bytes of blake2b of `text`, as a signed int64: the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def no_duplicate_batches(hashes, order, global_batch):
    """Cut `order` into global batches in which no text (as written, in any text column: `hashes`,
    one row of text hashes per data row) appears in two rows: a row that would repeat a text
    waits, and joins the first later batch where it fits (waiting rows go first, oldest first).
    Rows still waiting at the end are dropped, as is a last batch that cannot be filled. One pass,
    so fast on large data (see the README). Returns the batches end to end, one flat tensor."""
    batches, filled, waiting = torch.empty_like(order), 0, collections.deque()
    # (row, its texts' hashes), 65,536 rows at a time: no list of every row
    stream = (entry for rows in order.split(1 << 16) for entry in zip(rows.tolist(), hashes[rows].tolist()))
    while True:
        batch, seen, still_waiting = [], set(), collections.deque()

        def fits(entry):
            row, texts = entry
            if seen.isdisjoint(texts):
                batch.append(row)
                seen.update(texts)
                return True
            return False

        while waiting and len(batch) < global_batch:
            entry = waiting.popleft()
            if not fits(entry):
                still_waiting.append(entry)
        waiting = still_waiting + waiting
        for entry in stream:
            if not fits(entry):
                waiting.append(entry)
            if len(batch) == global_batch:
                break
        if len(batch) < global_batch:
            return batches[:filled]
        batches[filled : filled + global_batch] = torch.tensor(batch)
        filled += global_batch


def micro_batch_indices(global_batch_rows, rank, micro_step, per_device_batch_size, world_size):
    """Row indices of one micro-batch of a step's global batch (per_device x world x accum
    rows, from the schedule): rank r, micro-step j takes its contiguous slice j * world + r, so
    the ranks' micro-batches of one micro-step are consecutive rows, and with --gather-negatives
    they form exactly the batch one process of world x per_device rows would see. Every rank
    gets as many rows (a rank with one batch more would hang the others in a collective)."""
    start = (micro_step * world_size + rank) * per_device_batch_size
    return global_batch_rows[start : start + per_device_batch_size].tolist()


# ----------------------------------------------------------------------------------------------
# Collation: texts to tokens, in a background thread


def with_prompt(texts, prompts, column):
    """A column's texts with its --prompts prefix, prepended as sentence-transformers'
    encode(texts, prompt_name=column) does (before tokenizing)."""
    prefix = prompts.get(column, "")
    return [prefix + text for text in texts] if prefix else texts


def grouped_rows(rows, indices, group_size, seed, step):
    """Grouped rows {query, pos: [...], neg: [...]} as the text columns query, pos, neg_1 ..
    neg_{G-1} (and, with pos_scores/neg_scores, `scores`: the teacher's score of each). Each row
    draws one positive and G-1 negatives (without repeats while it has enough; with fewer, its
    list repeated, as FlagEmbedding does) from (seed, step, row index) alone: any rank, any
    split of the step, and a resumed run draw the same group, and each epoch draws anew."""
    columns = {"query": list(rows["query"]), "pos": [], **{f"neg_{g}": [] for g in range(1, group_size)}}
    scores = []
    for i, row in enumerate(indices):
        draw = random.Random(f"{seed} {step} {row}")  # a string seed is hashed the same in every process
        pos, neg = rows["pos"][i], rows["neg"][i]
        p = draw.randrange(len(pos))
        wanted = group_size - 1
        pool = list(range(len(neg))) * (math.ceil(wanted / len(neg)) if neg else 0)
        picked = draw.sample(pool, wanted) if wanted else []
        columns["pos"].append(pos[p])
        for g, n in enumerate(picked, start=1):
            columns[f"neg_{g}"].append(neg[n])
        if "pos_scores" in rows:
            scores.append([rows["pos_scores"][i][p], *(rows["neg_scores"][i][n] for n in picked)])
    return {**columns, "scores": scores} if "pos_scores" in rows else columns


def collate(rows, text_columns, target, loss_name, tokenize, device, prompts=None, prompt_columns=None):
    """The text columns (each with its prompt and length: `prompt_columns` names each column's
    --prompts and --max-seq-length key, when not the column itself), one dict of tokens per
    column, and the targets. `tokenize(texts, columns, prompts)`: LoadedModel.tokenize. All
    columns are tokenized in one call, so they share one padded length (and padding side) and
    embed_columns can run rows of different columns in the same forward."""
    tokens = tokenize(*flat_texts(rows, text_columns, prompt_columns or text_columns, prompts or {}))
    return per_column(tokens, len(text_columns), device), targets(rows, target, loss_name, device)


def flat_texts(rows, text_columns, keys, prompts):
    """What one tokenize call takes for the text columns, column after column: each text with its
    prompt prepended, its column's key (--max-seq-length may cut columns at lengths of their own),
    its prompt (pooling leaves the prompt's tokens out under --no-include-prompt), and its task:
    "query" in column 0, "document" in the others (a ColBERT model's lengths and query expansion)."""
    texts = [with_prompt(rows[column], prompts, key) for column, key in zip(text_columns, keys)]
    return (
        [text for column in texts for text in column],
        [key for key, column in zip(keys, texts) for _ in column],
        [prompts.get(key, "") for key, column in zip(keys, texts) for _ in column],
        [("query" if i == 0 else "document") for i, column in enumerate(texts) for _ in column],
    )


def pool_columns(features, static_queries=False):
    """The columns' tokens as one batch: column 0's rows, then column 1's, ... collate gives them
    one padded length; columns tokenized apart are padded to the longest, on their tokenizer's
    side (left if any column has a row that starts with padding), with masked zeros; and
    "pads_left", which side that is, seen here on the CPU so that the model need not read it back
    from the device (EmbeddingModel.embed). `static_queries` (inference-free SPLADE): column 0 as
    static_ids and static_mask, which the model looks up; the pool holds the other columns."""
    if static_queries:
        ids, mask = features[0]["input_ids"], features[0]["attention_mask"]
        return {**pool_columns(features[1:]), "static_ids": ids, "static_mask": mask}
    T = max(tokens["attention_mask"].shape[1] for tokens in features)
    left = any(not tokens["attention_mask"][:, 0].all() for tokens in features)

    def pad(v):
        return torch.nn.functional.pad(v, (T - v.shape[1], 0) if left else (0, T - v.shape[1]))

    return {**{k: torch.cat([pad(tokens[k]) for tokens in features]) for k in features[0]}, "pads_left": left}


def per_column(tokens, num_columns, device):
    """One tokenize call's tokens (flat_texts' order) cut back into one dict a column."""
    size = len(tokens["input_ids"]) // num_columns
    return [
        {k: v[i * size : (i + 1) * size].to(device) for k, v in tokens.items()} for i in range(num_columns)
    ]


def targets(rows, target, loss_name, device):
    """The rows' targets as a tensor (class ids for softmax, else floats), or None without a target."""
    if target is None:
        return None
    return torch.tensor(
        rows[target], dtype=torch.long if loss_name == "softmax" else torch.float32, device=device
    )


# Micro-batches the reader thread keeps ready ahead of the step (micro_batches): two, so that one
# slow to read (a long text, a cold page of the data) still arrives before the step needs it.
READ_AHEAD = 2


def micro_batches(plan, loaded, tables, rank, start_step, prepare):
    """This rank's micro-batches from start_step on, in training order: what `prepare(train set,
    rows, features, labels)` makes of each (__main__.prepare_micro_batch: pooled, packed, pinned),
    tokenized on the CPU. Where `tables` (write_or_read_token_files; None: none) holds a set's token
    table, its ids are read from it and only padded; else each micro-batch is tokenized as it is read: by the
    reader thread, or with plan.tokenize_workers by that many worker processes (TokenizingWorkers),
    twice as many micro-batches under way as there are workers, so that none waits for work. A
    background thread reads and prepares the next READ_AHEAD micro-batches while the caller computes on this
    one, so reading overlaps the step (tokenizing and packing: a small share of a CPU's step, a
    far larger one of a GPU's: docs/steps.md), and the step never waits on them while the reader
    keeps up. The thread has its own copy of the tokenizer: a fast tokenizer used from two threads
    at once fails ("Already borrowed"), and evaluation tokenizes in the main thread."""
    thread_loaded = dataclasses.replace(loaded, tokenizer=copy.deepcopy(loaded.tokenizer))
    tables = tables or [None] * len(plan.train_sets)

    def start(step, micro_step, pool):
        """A micro-batch's rows and tokens, or (handed to a worker) its number in the workers' turn."""
        _, set_index, batch_rows = plan.schedule[step]
        ts = plan.train_sets[set_index]
        indices = micro_batch_indices(batch_rows, rank, micro_step, ts.per_device_batch_size, plan.world_size)
        if pool is not None and tables[set_index] is None:
            return ts, pool.send(set_index, indices, step), step  # the worker that reads it, in turn
        return ts, read_rows(ts, indices, step, plan.seed, thread_loaded, tables[set_index]), step

    def finish(ts, read, step, pool):
        if isinstance(read, int):  # the worker's; re-raises what it raised
            rows, arrays = pool.receive(read)
            read = rows, [{k: torch.from_numpy(v) for k, v in column.items()} for column in arrays]
        rows, features = read
        return prepare(
            ts, rows, features, targets(rows, ts.target, ts.loss, "cpu"), (step, len(plan.schedule))
        )

    def prepared(pool):  # in order; 2 x workers micro-batches tokenizing: each worker has its next queued
        started = collections.deque()
        for step in range(start_step, len(plan.schedule)):  # one at a time: no list of every step
            for micro_step in range(plan.grad_accum_steps):
                started.append(start(step, micro_step, pool))
                if len(started) > 2 * plan.tokenize_workers:
                    yield finish(*started.popleft(), pool)
        while started:
            yield finish(*started.popleft(), pool)

    def read_ahead():
        workers = plan.tokenize_workers
        tokenizing = TokenizingWorkers(workers, loaded, plan.train_sets, plan.seed) if workers else None
        with tokenizing or contextlib.nullcontext() as pool:
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as reader:
                # the next READ_AHEAD micro-batches, read in order by the one thread (None: no more)
                batches = prepared(pool)
                pending = collections.deque(reader.submit(next, batches, None) for _ in range(READ_AHEAD))
                while (batch := pending.popleft().result()) is not None:  # re-raises what reading raised
                    pending.append(reader.submit(next, batches, None))
                    yield batch

    return read_ahead()


def tokenize_workers(requested, device):
    """--tokenize-workers resolved: as given, or (-1) on a GPU the cores each rank of the host has
    beyond its training and reader threads, at most 4 (one worker supplies several thousand texts
    a second: docs/steps.md); on a CPU 0, as the step's threads already use every core."""
    if requested >= 0:
        return requested
    if device.type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(4, cores - 2))


def read_rows(ts, indices, step, seed, loaded, table=None):
    """A micro-batch's rows (grouped rows drawn for `step`) and one dict of tokens a text column:
    its ids read from the set's token `table` and padded, or its texts tokenized."""
    rows = ts.ds[indices]
    if ts.group_size:
        rows = grouped_rows(rows, indices, ts.group_size, seed, step)
    if table is not None:
        prompts = [ts.prompts.get(key, "") for key in ts.prompt_columns]
        return rows, token_cache.features(table, indices, ts.text_columns, loaded, prompts)
    tokens = loaded.tokenize(*flat_texts(rows, ts.text_columns, ts.prompt_columns, ts.prompts))
    return rows, per_column(tokens, len(ts.text_columns), "cpu")


class TokenizingWorkers:
    """`workers` processes that read rows and tokenize them (read_rows), each with its own
    single-threaded copy of the tokenizer and its own map of the memory-mapped data sets, started
    fresh (spawn: no fork of a process that runs threads and collectives). Micro-batches go to
    them in turn over one pipe each and come back in the same turn, so in order; no thread of
    the parent's is involved (a pool's own threads cost the parent more CPU than its reading)."""

    def __init__(self, workers, loaded, train_sets, seed):
        tokenizer_only = dataclasses.replace(
            loaded, model=None, export_config=None, untrained_state={}, fresh_tensors={}
        )  # what LoadedModel.tokenize reads, without the weights
        state = {"loaded": tokenizer_only, "train_sets": train_sets, "seed": seed}
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes, self.sent = [], [], 0
        for _ in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=worker_loop, args=(theirs, state, os.getpid()), daemon=True)
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)

    def send(self, *task):
        """Hands a micro-batch to the next worker in turn; returns its number, for `receive`."""
        self.pipes[self.sent % len(self.pipes)].send(task)
        self.sent += 1
        return self.sent - 1

    def receive(self, number):
        """Micro-batch `number`'s (rows, arrays); what the worker raised is raised here."""
        try:
            ok, result = self.pipes[number % len(self.pipes)].recv()
        except (EOFError, OSError):
            raise RuntimeError(
                "a tokenizing worker (--tokenize-workers) died; see its message above"
            ) from None
        if not ok:
            raise result
        return result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for pipe in self.pipes:
            pipe.close()  # a worker ends at its pipe's end
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()


def worker_loop(pipe, state, parent_pid):
    """A tokenizing worker: one thread (every core is another worker's or a rank's), the parent's
    Ctrl-C left to the parent; reads each task from its pipe until it closes, and ends on its
    own should the parent die unannounced."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_with_parent():
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    while True:
        try:
            set_index, indices, step = pipe.recv()
        except (EOFError, OSError):  # the parent is done (or gone)
            return
        try:
            ts = state["train_sets"][set_index]
            rows, features = read_rows(ts, indices, step, state["seed"], state["loaded"])
            reply = (True, (rows, [{k: v.numpy() for k, v in column.items()} for column in features]))
        except Exception as e:  # the parent raises it
            reply = (False, e)
        try:
            pipe.send(reply)
        except OSError:  # the parent stopped reading (its run ended, or failed)
            return


def write_or_read_token_files(plan, loaded, rank):
    """--tokenize once: each training set's token table (token_cache.py), or None where it is
    tokenized on the fly all the same: grouped rows (drawn anew each step), or a tokenizer whose
    features are more than padded ids (token_cache.unsupported). A set's token file is written
    first where no process has written it (once a host: whichever process takes the file lock),
    else read."""
    problem = token_cache.unsupported(loaded.tokenizer)
    if problem and rank == 0:
        print(f"tokenized on the fly, not once: {problem}", flush=True)
    # Each set's content hash (training_data.data_fingerprint, joined by run_plan.data_plan), so that an edit
    # datasets' own fingerprint (path and time) misses still makes a new file.
    fingerprints = plan.data_fingerprint.split("; ")
    if len(fingerprints) != len(plan.train_sets):
        fingerprints = [plan.data_fingerprint] * len(plan.train_sets)
    tables = []
    for ts, fingerprint in zip(plan.train_sets, fingerprints):
        if ts.group_size or problem:
            tables.append(None)
            continue
        fallback = os.path.join(plan.output_dir, "token-cache")  # for data sets with no cache folder
        try:
            table, path, wrote = token_cache.write_or_read_token_table(ts, loaded, fallback, fingerprint)
        except OSError as e:
            if e.errno not in token_cache.DISK_FULL:
                raise
            said = f"warning: tokens of {ts.name}: no room to write them ({e}); tokenized on the fly instead"
            if os.environ.get("LOCAL_RANK", "0") == "0":  # each host's first process says it once
                print(f"\n{said} (the same ids): free space, or pass --tokenize on_the_fly", file=sys.stderr)
            tables.append(None)
            continue
        if wrote or rank == 0:  # whichever process of a host took the lock first wrote the file
            said = "written to" if wrote else "read from"
            print(f"tokens of {ts.name}: {said} {path} (rank {rank})", flush=True)
        tables.append(table)
    return tables


def text_ids(texts):
    """One int64 per text, equal for equal texts as written (8 bytes of blake2b), as
    sentence-transformers' no-duplicates sampler compares them: what MNRL's duplicate-safe
    negatives compare, on every rank."""
    return torch.tensor([text_hash(t) for t in texts])


# ----------------------------------------------------------------------------------------------
# Length-sorted sub-batches: the same batch for the loss, less padding computed


# The cost of one more forward, in padded tokens: what a sub-batch must save to be worth running.
# CPU: measured with python -m fsdp_embed itself at one and two processes (docs/steps.md has the numbers).
# CUDA: a guess (a GPU forward has a larger fixed cost, so fewer, larger forwards); not measured.
FORWARD_COST_TOKENS = {"cpu": 64, "cuda": 512}


MAX_AUTO_GROUPS = 8


MAX_CUT_POSITIONS = 256  # a larger micro-batch is cut only every (rows / 256) rows: the search stays small


def length_sorted_cuts(mask_BT, max_groups):
    """A tokenized batch's rows sorted by length (longest first, ties in batch order), and for
    k = 1..max_groups the fewest padded tokens of k forwards over consecutive runs of them (each
    run padded to its first, longest row), with `runs(k)`: those runs, as row-index tensors.
    Dynamic programming over the cut positions p: padded_k(p) = min over j < p of
    padded_(k-1)(j) + (p - j) x length(j). A run of a few long rows and one of many short ones
    beats equal-sized runs wherever the lengths are skewed (docs/steps.md: STS-B)."""
    lengths_B = mask_BT.sum(1)
    order_B = torch.sort(lengths_B, descending=True, stable=True).indices
    sorted_B = lengths_B[order_B].double()
    n = len(order_B)
    points_P = torch.tensor(sorted(set(range(0, n, -(-n // MAX_CUT_POSITIONS))) | {n}))
    starts_J = points_P[:-1]
    span_JP = (points_P[None, :] - starts_J[:, None]) * sorted_B[starts_J][
        :, None
    ]  # one run from point j to point p
    span_JP[points_P[None, :] <= starts_J[:, None]] = math.inf
    best_P = torch.full((len(points_P),), math.inf, dtype=torch.float64)
    best_P[0] = 0.0  # zero runs cover zero rows
    padded_K, back_K = [], []
    for _ in range(max_groups):
        best_P, back_P = (best_P[:-1, None] + span_JP).min(0)
        padded_K.append(best_P[-1].item())
        back_K.append(back_P)

    def runs(k):
        p, bounds = len(points_P) - 1, []
        for back_P in reversed(back_K[:k]):  # from the last run back to the first
            j = int(back_P[p])
            bounds.append((int(points_P[j]), int(points_P[p])))
            p = j
        return [order_B[start:end] for start, end in reversed(bounds)]

    return padded_K, runs


def group_count(padded_K, forward_cost):
    """The number of forwards with the fewest padded tokens plus `forward_cost` per forward."""
    costs = [padded + (k + 1) * forward_cost for k, padded in enumerate(padded_K)]
    return 1 + costs.index(min(costs))


def sub_batches(mask_NT, length_buckets, device, chunk_size=0):
    """The groups of rows embed_columns runs as one encoder pass each, as row sets of the pool of all text
    columns (pool_columns; `mask_NT`: its attention mask): consecutive runs of the pool's
    rows sorted by length, cut where they save the most padding (`chunk_size`, GradCache's: into equally
    many rows, as GradCache needs (see below), then into chunks of at most `chunk_size` rows).
    `length_buckets`: the number of groups; 0: the number that saves the most (padded tokens plus
    FORWARD_COST_TOKENS per pass), chosen by each rank alone. Each group comes with the token positions
    it keeps (with_positions).

    Each rank may choose its own: under DDP the wrapped model is called once per micro-batch (GradCache:
    once per chunk, and DDP broadcasts its buffers only in a forward that follows a synchronised one with
    gradients, so extra chunks add no collective). Under FSDP every encoder pass gathers each block (all
    ranks participate), so every rank runs as many: __main__.py fixes the count there (--length-buckets; 1
    unless set), and GradCache's chunks agree too when micro-batches are equal in size and groups equal in
    rows. None: one forward over the whole pool, in batch order."""
    max_groups = min(length_buckets or MAX_AUTO_GROUPS, len(mask_NT))
    padded_K, runs = length_sorted_cuts(mask_NT, max_groups)
    if length_buckets:
        count = max_groups
    else:
        count = group_count(
            padded_K, FORWARD_COST_TOKENS.get(torch.device(device).type, FORWARD_COST_TOKENS["cuda"])
        )
    if chunk_size:  # runs(1): all rows, sorted
        groups = [rows for group in torch.tensor_split(runs(1)[0], count) for rows in group.split(chunk_size)]
        return with_positions(mask_NT, groups)
    # One forward: the pool as it comes (None), nothing to sort and put back; so its gradients
    # are summed over the rows in batch order, as a plain padded forward sums them.
    return with_positions(mask_NT, runs(count)) if count > 1 else None


def with_positions(mask_NT, groups):
    """Each of `groups` (row-index tensors) as (rows, the token positions that are not padding in
    every one of them): what embedding_model.select_rows keeps. Found here, on the CPU where the
    reader holds the mask: on a GPU, selecting them by a boolean mask would make the CPU wait
    for the GPU at every group."""
    return [(rows, mask_NT[rows].any(0).nonzero().squeeze(1)) for rows in groups]
