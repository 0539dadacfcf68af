"""The layout a reader meets holds its targets: train.py short, its loop near the top, no long
function, no project file over 800 lines, no line wider than 110 characters, a short README,
every helper file copyable with the few project files its docstring names, and every collective
(and every function that reaches one) marked "(all ranks participate)" where it is called
(bench/check_layout.py measures all of it).

    python -m pytest tests/test_layout.py
"""

import subprocess
import sys

import pytest

from conftest import REPO_DIR

sys.path.insert(0, str(REPO_DIR / "bench"))

import check_layout  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def test_the_layout_targets_hold():
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "bench" / "check_layout.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = check_layout.measure()
    assert m["train_lines"] <= 550 and m["main_lines"] <= 70 and m["loop_line"] <= 250, m
    assert m["imports"]["losses.py"] == m["imports"]["eval_dist.py"] == m["imports"]["lora.py"] == []
    assert m["imports"]["collectives.py"] == [] and m["imports"]["fsdp_utils.py"] == ["collectives"]
    assert max(m["file_lines"].values()) <= 800, m["file_lines"]


def test_the_checker_reports_what_it_should():
    """A measurement that misses each target is reported (the checker can fail)."""
    m = check_layout.measure()
    broken = {
        **m,
        "train_lines": 551,
        "main_lines": 71,
        "loop_line": 251,
        "longest_function": {"data.py": {"function": "load_data", "lines": 61}},
        "file_lines": {**m["file_lines"], "export.py": 801},
        "lines_over_110": {"train.py": 1},
        "readme_lines": 401,
        "minimal": {"lines": 601, "longest_function": ("main", 51), "imports_beyond": ["config"]},
        "imports": {**m["imports"], "losses.py": ["train"]},
        "imports_not_named_in_docstring": {"export.py": ["lora"]},
        "unmarked_collectives": ["faults.py:94 in check_space(): dist.broadcast called without the marker"],
        "parsers_outside_plan": ["data.py:12 config.prompts_of()"],
    }
    problems = "\n".join(check_layout.missed(broken))
    for expected in (
        "train_lines 551",
        "main_lines 71",
        "loop_line 251",
        "load_data has 61 lines",
        "export.py has 801 lines > 800",
        "train.py: 1 lines over",
        "README.md has 401",
        "minimal_train.py has 601 lines > 600",
        "minimal_train.py: main has 51 lines > 50",
        "minimal_train.py imports config",
        "losses.py imports train",
        "export.py imports lora without naming it",
        "faults.py:94 in check_space(): dist.broadcast",
        "data.py:12 config.prompts_of(): a flag's text parsed outside run_plan.py",
    ):
        assert expected in problems, (expected, problems)
    assert check_layout.missed(m) == []


HELPERS = """import torch.distributed as dist
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def agree(x):
    \"\"\"The sum over ranks (all ranks participate).\"\"\"
    dist.all_reduce(x)  # (all ranks participate)


def unmarked(x):
    \"\"\"Waits.\"\"\"
    dist.barrier()


def gathered(x):
    \"\"\"Every rank's rows (all ranks participate).\"\"\"
    # (all ranks participate): above the call, which spans lines
    return _gather(
        x, x
    )


def read_alone(folder):
    \"\"\"One reader.\"\"\"
    dcp.load({}, storage_reader=None, no_dist=True)
"""
MAIN = """import helpers


def step(x):
    \"\"\"One step.\"\"\"
    helpers.agree(x)
    y = helpers.gathered(  # (all ranks participate)
        x
    )
    helpers.read_alone(x)
    return helpers.unmarked(y)
"""


def test_the_collective_marker_check_names_each_unmarked_call_and_docstring():
    """Unmarked: a direct collective, the call of a function that reaches one (through another
    file, and through a module-level alias of a collective), and the docstrings of the functions
    that reach one; marked on the line, on the statement's first line or in the comment lines
    directly above, and a DCP load with no_dist=True, are not reported."""
    problems = check_layout.unmarked_collectives({"helpers.py": HELPERS, "main.py": MAIN})
    marker = "'(all ranks participate)'"
    assert problems == [
        f"helpers.py:10 unmarked() reaches a collective: {marker} not on one line of its docstring",
        f"helpers.py:12 in unmarked(): dist.barrier called without {marker}",
        f"main.py:4 step() reaches a collective: {marker} not on one line of its docstring",
        f"main.py:6 in step(): helpers.agree(), which reaches a collective, called without {marker}",
        f"main.py:11 in step(): helpers.unmarked(), which reaches a collective, called without {marker}",
    ], problems


def test_a_flag_parsed_outside_the_plan_is_named():
    """config.py's parsers of a flag's text are run_plan.py's alone: a call anywhere else (here
    one in data.py, one in train.py's loop) is named with its line; run_plan.py's are not."""
    import ast

    trees = {
        "run_plan.py": ast.parse("import config\nsizes = config.matryoshka_sizes(cfg)\n"),
        "data.py": ast.parse("import config\n\n\ndef f(cfg):\n    return config.prompts_of(cfg)\n"),
        "train.py": ast.parse("for s in x:\n    dims = (config.matryoshka_sizes(cfg) or [()])[0]\n"),
    }
    assert check_layout.parsers_outside_plan(trees) == [
        "data.py:5 config.prompts_of()",
        "train.py:2 config.matryoshka_sizes()",
    ]
