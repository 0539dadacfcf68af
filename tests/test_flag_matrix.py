"""Every setting the flags accept trains, or is refused in one line: the fixed part of the matrix
that bench/bench_flag_matrix.py builds from the full trainer's parser (the whole pairwise matrix,
dozens of runs, is that benchmark's).

- The pairwise design: every pair of values of two factors meets in at least one run that must
  train, except the pairs a refusal names; the factors' values are the parser's own choices.
- The fixed part (warm runs on tiny random models, 2 steps each, then the export): each pooling
  mode (mean, cls, max on a BERT; lasttoken on a Qwen2 with --append-eos; splade on a BERT masked
  LM) at fp32, bf16 and fp16, at one process and under FSDP2 (2 ranks), and each under DDP or
  FSDP1 at one precision. Each run exits 0 on every rank with an export that sentence-transformers
  loads (SentenceTransformer, or SparseEncoder for splade) whose vectors for two texts equal the
  trainer's own model's on the exported weights, built with the run's flags, to 1e-5.
- Precision in numbers: the bf16 and fp16 runs' losses at both steps are within a stated
  tolerance of the fp32 run's at one process on the same rows (global batch 8 at any world size,
  MNRL over every rank's candidates): two unit roundoffs of the format relative to the loss (bf16
  2^-7, fp16 2^-10), 4-6x the largest deviation measured (docs/tests.md); fp32 runs at world 2 to
  1e-5.
- Each refusal: every rank exits non-zero, with one `error:` line naming the conflicting flags, no
  traceback, and no final/ folder.

Run: python -m pytest tests/test_flag_matrix.py
"""

import itertools
import sys

import pytest
from conftest import REPO_DIR

sys.path.insert(0, str(REPO_DIR / "bench"))
import bench_flag_matrix as matrix  # noqa: E402

from fsdp_embed import config  # noqa: E402

FIXED = matrix.fixed_runs()
# Relative to the fp32 run's loss at one process: two unit roundoffs of the format, 4-6x the
# largest deviation measured (docs/tests.md); fp32 at world 2 is the same computation, to float noise
TOLERANCE = {"fp32": 1e-5, "bf16": 2**-7, "fp16": 2**-10}


def test_the_pairwise_design_meets_every_pair_and_reads_the_parser():
    factors = matrix.factors()
    for name in ("precision", "packing", "gather_negatives"):
        field = next(f for f in config.Config.__dataclass_fields__.values() if f.name == name)
        parsed = field.metadata["argparse"].get("choices") or (False, True)
        assert set(factors[name]) == set(parsed) - {""}, name
    assert {f"fsdp{v}:{s}" for v in (1, 2) for s in ("full_shard", "no_shard")} <= set(factors["strategy"])
    assert set(factors["pooling"]) == {*config.POOLING_MODES, "splade", "multivector"}
    assert set(factors["loss"]) == set(config.LOSS_NAMES)
    allowed = lambda case: matrix.refused(case) is None  # noqa: E731
    runs = matrix.all_pairs(factors, allowed)
    assert all(allowed(run) for run in runs)
    # a naive check: a pair that no run meets is one that no allowed run can hold (a depth-first
    # search over the other factors' values finds none)
    for a, b in itertools.combinations(factors, 2):
        for va, vb in itertools.product(factors[a], factors[b]):
            if not any(run[a] == va and run[b] == vb for run in runs):
                assert not some_allowed_run({a: va, b: vb}, factors, allowed), (a, va, b, vb)


def some_allowed_run(case, factors, allowed):
    """An allowed run that holds `case`'s values, or None. The refusal rules read a missing
    factor as the value that refuses nothing, so a partial run they refuse has no allowed completion."""
    if not allowed(case):
        return None
    rest = [name for name in factors if name not in case]
    if not rest:
        return case
    for value in factors[rest[0]]:
        found = some_allowed_run({**case, rest[0]: value}, factors, allowed)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """Each fixed run's outcome, launched once, on first use: {case's name: (outcome, why, losses)}."""
    work = tmp_path_factory.mktemp("flag-matrix")
    models, data = matrix.write_models(work / "models"), matrix.write_data(work)
    done = {}

    def outcome(case, expect=None):
        key = matrix.short(case)
        if key not in done:
            done[key] = matrix.run_case(case, models, data, work, expect)
        return done[key]

    return outcome


@pytest.mark.parametrize("case", FIXED, ids=matrix.short)
def test_each_setting_trains_and_its_export_embeds_as_the_trained_model(fixed, case):
    outcome, why, losses = fixed(case)
    assert outcome == "trained", why
    assert len(losses) == 2


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("pooling", sorted({case["pooling"] for case in FIXED}))
def test_each_precisions_losses_are_within_the_stated_tolerance_of_fp32(fixed, pooling, precision):
    same = [case for case in FIXED if case["pooling"] == pooling]
    reference = next(c for c in same if c["precision"] == "fp32" and c["strategy"] == "single")
    _, _, want = fixed(reference)
    for case in (c for c in same if c["precision"] == precision and c is not reference):
        _, why, got = fixed(case)
        assert len(got) == len(want) == 2, why
        for step, (g, w) in enumerate(zip(got, want), 1):
            assert abs(g - w) <= TOLERANCE[precision] * abs(w), (matrix.short(case), step, g, w)


@pytest.mark.parametrize("refusal", matrix.refusal_runs(), ids=lambda r: matrix.short(r[0]))
def test_what_cannot_work_is_refused_in_one_line(fixed, refusal):
    case, words = refusal
    assert matrix.refused(case) == words and matrix.refused(matrix.defaults()) is None
    outcome, why, _ = fixed(case, expect=words)
    assert outcome == "refused", why
