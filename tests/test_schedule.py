"""The schedule drawn an epoch at a time (batches.Schedule) plans exactly the steps that the
whole-list schedule of earlier versions planned (copied below, as it was, as the reference): the
same rows per step, for a fixed seed, with one set or several, weights and own batch sizes, both
mixes, the no_duplicates sampler, several epochs and --max-steps across epochs; and it holds one
epoch's rows at a time.

Run: python -m pytest tests/test_schedule.py
"""

import collections
import itertools
import json
import math

import pytest
import torch
from conftest import data_file, start_up

from fsdp_embed import config

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


# ---- the reference: the schedule of earlier versions, every step of every epoch as one list


def old_training_schedule(train_sets, cfg):
    """Every optimizer step's global batch, [(epoch, set index, row indices)], the same on every
    rank and in a resumed run: a function of the seed and the data alone. Epochs follow each
    other until --max-steps (or --epochs) is reached."""
    schedule = []
    for epoch in itertools.count():
        batches = old_epoch_batches(train_sets, cfg, epoch)
        if not batches:
            raise ValueError(
                f"--train-data: epoch {epoch} makes no global batch of "
                f"{' / '.join(str(ts.global_batch) for ts in train_sets)} rows"
                + (
                    " with no text twice (--batch-sampler no_duplicates)"
                    if cfg.batch_sampler == "no_duplicates"
                    else ""
                )
            )
        schedule += [
            (epoch + (i + 1) / len(batches), set_index, rows) for i, (set_index, rows) in enumerate(batches)
        ]
        if (cfg.max_steps and len(schedule) >= cfg.max_steps) or (
            not cfg.max_steps and epoch + 1 == cfg.epochs
        ):
            return schedule[: cfg.max_steps or None]


def old_epoch_batches(train_sets, cfg, epoch):
    """One epoch's global batches, [(set index, row indices)]: each set's (set_batches), then
    interleaved by --mix. One set with the default sampler: the epoch's permutation cut in order."""
    per_set = [old_set_batches(ts, cfg, i, epoch) for i, ts in enumerate(train_sets)]
    if cfg.mix == "round_robin":
        rounds = min(len(batches) for batches in per_set)
        return [(i, per_set[i][r]) for r in range(rounds) for i in range(len(per_set))]
    # Proportional: every batch of every set once, in an order drawn from (seed, epoch).
    labels = torch.cat([torch.full((len(batches),), i) for i, batches in enumerate(per_set)])
    if len(per_set) > 1:
        labels = labels[
            torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.seed + 104729 + epoch))
        ]
    taken = [0] * len(per_set)
    plan = []
    for i in labels.tolist():
        plan.append((i, per_set[i][taken[i]]))
        taken[i] += 1
    return plan


def old_set_batches(ts, cfg, set_index, epoch):
    """One set's global batches of an epoch: its rows shuffled from (seed, set, epoch) and cut
    into global batches of its size (the tail dropped; with --batch-sampler no_duplicates, no
    text twice in one). A weight w (--dataset-settings) keeps round(w x that many) batches, at
    least one: from one shuffle below 1, from further shuffles above (each row then w times)."""
    batches = []
    for shuffle in range(max(1, math.ceil(ts.weight))):
        # Set 0, shuffle 0: the one-set order; every other (set, shuffle) a seed of its own.
        order = torch_epoch_order(len(ts.ds), cfg.seed + 7919 * set_index + 15485863 * shuffle, epoch)
        if cfg.batch_sampler == "no_duplicates":
            cut = old_no_duplicate_batches(
                [ts.ds[c][:] for c in ts.text_columns], order.tolist(), ts.global_batch
            )
        else:
            cut = [
                order[k * ts.global_batch : (k + 1) * ts.global_batch]
                for k in range(len(order) // ts.global_batch)
            ]
        batches += cut
        if shuffle == 0:
            keep = max(1, round(ts.weight * len(cut))) if cut else 0
    return batches[:keep]


def old_no_duplicate_batches(columns, order, global_batch):
    """Cut `order` into global batches in which no text (as written, in any text column) appears
    in two rows: a row that would repeat a text waits, and joins the first later batch where it
    fits (waiting rows go first, oldest first). Rows still waiting at the end are dropped, as is
    a last batch that cannot be filled. One pass, so fast on large data (see the README)."""
    batches, waiting, stream = [], collections.deque(), iter(order)
    while True:
        batch, seen, still_waiting = [], set(), collections.deque()

        def fits(row):
            texts = [column[row] for column in columns]
            if seen.isdisjoint(texts):
                batch.append(row)
                seen.update(texts)
                return True
            return False

        while waiting and len(batch) < global_batch:
            row = waiting.popleft()
            if not fits(row):
                still_waiting.append(row)
        waiting = still_waiting + waiting
        for row in stream:
            if not fits(row):
                waiting.append(row)
            if len(batch) == global_batch:
                break
        if len(batch) < global_batch:
            return batches
        batches.append(torch.tensor(batch))


def torch_epoch_order(num_rows, seed, epoch):
    """batches.epoch_order as it was: in int64."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


# ---- the comparisons

SETTINGS = json.dumps(
    {"stsb-train": {"per_device_batch_size": 6, "weight": 0.5}, "sick-pairs-train": {"weight": 2.5}}
)
CASES = {
    "one set, 3 epochs": ["--train-data", "PAIRS", "--epochs", 3],
    "one set, max steps across epochs": ["--train-data", "PAIRS", "--max-steps", 100],
    "two sets, proportional": ["--train-data", "PAIRS,STS", "--epochs", 2],
    "two sets, round robin": ["--train-data", "PAIRS,STS", "--mix", "round_robin", "--max-steps", 70],
    "weights and own batches": ["--train-data", "PAIRS,STS", "--dataset-settings", SETTINGS, "--epochs", 2],
    "no duplicates, 2 epochs": ["--train-data", "PAIRS", "--batch-sampler", "no_duplicates", "--epochs", 2],
    "no duplicates, two sets": [
        "--train-data",
        "PAIRS,STS",
        "--batch-sampler",
        "no_duplicates",
        "--max-steps",
        90,
    ],
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_the_schedule_plans_the_steps_it_planned_before(case, world_size):
    pairs, sts = data_file("sick-pairs-train.jsonl"), data_file("stsb-train.jsonl")
    args = [str(a).replace("PAIRS", pairs).replace("STS", sts) for a in CASES[case]]
    cfg = config.parse_config([*args, "--per-device-batch-size", str(16 // world_size)])
    plan = start_up(cfg, world_size)
    want = old_training_schedule(plan.train_sets, cfg)
    got = plan.schedule
    assert len(got) == len(want) == plan.total_steps
    for step, (epoch, set_index, rows) in enumerate(want):
        got_epoch, got_set, got_rows = got[step]
        assert (got_epoch, got_set) == (epoch, set_index) and torch.equal(got_rows.long(), rows), (case, step)
        assert got.epoch_at(step) == epoch
    for index in range(len(plan.train_sets)):
        assert got.steps_of_set(index) == sum(1 for _, i, _ in want if i == index)
    assert plan.steps_per_epoch == len(old_epoch_batches(plan.train_sets, cfg, 0))


def test_one_epoch_of_rows_is_held_at_a_time():
    """Stepping through 3 epochs, the schedule holds the rows of the epoch it is in, and no other."""
    cfg = config.parse_config(["--train-data", data_file("sick-pairs-train.jsonl"), "--epochs", "3"])
    schedule = start_up(cfg).schedule
    per_epoch = len(schedule.set_orders[0])
    assert len(schedule) == 3 * per_epoch and schedule.held[0] is None  # nothing drawn at start-up
    for step in range(len(schedule)):
        schedule[step]
        assert schedule.held[0] == step // per_epoch and len(schedule.held[2]) == per_epoch
