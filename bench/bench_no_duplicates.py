"""Benchmark: the time to plan one epoch of no-duplicate global batches (--batch-sampler
no_duplicates) at batch 8192 on 500,000 rows, against the default sampler and against
sentence-transformers' NoDuplicatesBatchSampler (which checks one device's batch only).

The rows are synthetic (anchor, positive) pairs drawn from a pool of texts so that about 2% of
the texts repeat: the case the sampler exists for. Each plan is made from scratch (with
no_duplicates: the texts' hashes, the epoch planned for its count, then drawn); the time is the
best of --repeats runs. The plan is also checked: no text twice in any global batch.

Run (CPU, one process; about a minute):
    python bench/bench_no_duplicates.py
Results are also written to bench/results/no_duplicates.json.
"""

import argparse
import json
import os
import platform
import random
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)

import datasets  # noqa: E402

from fsdp_embed import batches  # noqa: E402


from fsdp_embed import training_data  # noqa: E402


def synthetic_pairs(num_rows, seed=0):
    rng = random.Random(seed)
    pool = [f"text number {i}" for i in range(int(2 * num_rows * 0.98))]  # 2 texts a row, ~2% drawn twice
    return {
        "anchor": [rng.choice(pool) for _ in range(num_rows)],
        "positive": [rng.choice(pool) for _ in range(num_rows)],
    }


def best_of(repeats, fn):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-sentence-transformers", action="store_true")
    args = parser.parse_args()

    columns = synthetic_pairs(args.rows)
    ds = datasets.Dataset.from_dict(columns)
    sets = [
        training_data.TrainSet("synthetic", ds, "mnrl", ["anchor", "positive"], None, global_batch=args.batch)
    ]
    results = {
        "rows": args.rows,
        "global_batch": args.batch,
        "machine": platform.processor() or platform.machine(),
    }
    for sampler in ("default", "no_duplicates"):

        def plan_epoch():  # the text hashes (no_duplicates) and the epoch's batches, from scratch
            schedule = batches.Schedule(sets, 12, 1, 0, no_duplicates=sampler == "no_duplicates")
            return [schedule[step][1:] for step in range(len(schedule))]

        seconds, plan = best_of(args.repeats, plan_epoch)
        results[sampler] = {
            "seconds": round(seconds, 3),
            "batches": len(plan),
            "rows_used": sum(len(rows) for _, rows in plan),
        }
        if sampler == "no_duplicates":
            for _, rows in plan:
                texts = [columns[c][i] for i in rows.tolist() for c in ("anchor", "positive")]
                pairs_equal = sum(columns["anchor"][i] == columns["positive"][i] for i in rows.tolist())
                assert len(set(texts)) == len(texts) - pairs_equal, "a text twice in a global batch"
        print(f"{sampler:>14}: {seconds:.2f} s, {len(plan)} batches of {args.batch}", flush=True)

    if not args.skip_sentence_transformers:
        import torch

        try:  # sentence-transformers >= 6; older versions have it in sentence_transformers.sampler
            from sentence_transformers.base.sampler import NoDuplicatesBatchSampler
        except ImportError:
            from sentence_transformers.sampler import NoDuplicatesBatchSampler

        def st_plan():
            sampler = NoDuplicatesBatchSampler(
                ds,
                batch_size=args.batch,
                drop_last=True,
                valid_label_columns=[],
                generator=torch.Generator().manual_seed(0),
                seed=0,
            )
            return list(iter(sampler))

        seconds, plan = best_of(1, st_plan)
        results["sentence_transformers_no_duplicates"] = {"seconds": round(seconds, 3), "batches": len(plan)}
        print(
            f"sentence-transformers NoDuplicatesBatchSampler (one device's batch): {seconds:.2f} s, "
            f"{len(plan)} batches",
            flush=True,
        )

    os.makedirs(os.path.join(REPO_DIR, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO_DIR, "bench", "results", "no_duplicates.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
