"""The layout a reader meets holds its targets: train.py short, its loop near the top, no long
function, no project file over 800 lines, no line wider than 110 characters, a short README,
every helper file copyable with the few project files its docstring names, and every collective
(and every function that reaches one) marked "(all ranks participate)" where it is called
(bench/check_layout.py measures all of it).

    python -m pytest tests/test_layout.py
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO_DIR, data_file

sys.path.insert(0, str(REPO_DIR / "bench"))

import check_layout  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def test_the_layout_targets_hold():
    proc = subprocess.run(
        [sys.executable, str(REPO_DIR / "bench" / "check_layout.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = check_layout.measure()
    assert m["train_lines"] <= 600 and m["main_lines"] <= 80 and m["loop_line"] <= 250, m
    assert m["imports"]["losses.py"] == m["imports"]["eval_dist.py"] == m["imports"]["lora.py"] == []
    assert m["imports"]["collectives.py"] == [] and m["imports"]["fsdp_utils.py"] == ["collectives"]
    assert max(m["file_lines"].values()) <= 800, m["file_lines"]


def test_the_checker_reports_what_it_should():
    """A measurement that misses each target is reported (the checker can fail)."""
    m = check_layout.measure()
    broken = {
        **m,
        "train_lines": 601,
        "main_lines": 81,
        "loop_line": 251,
        "longest_function": {"training_data.py": {"function": "load_data", "lines": 61}},
        "file_lines": {**m["file_lines"], "export.py": 801},
        "lines_over_110": {"train.py": 1},
        "readme_lines": 401,
        "minimal": {"lines": 601, "longest_function": ("main", 51), "imports_beyond": ["config"]},
        "imports": {**m["imports"], "losses.py": ["train"]},
        "imports_not_named_in_docstring": {"export.py": ["lora"]},
        "unmarked_collectives": ["faults.py:94 in check_space(): dist.broadcast called without the marker"],
        "parsers_outside_plan": ["training_data.py:12 config.prompts_of()"],
        "config_holders": ["batches.py:9 micro_batches() is handed the Config (cfg)"],
        "modules_named_like_folders": ["data"],
    }
    problems = "\n".join(check_layout.missed(broken))
    for expected in (
        "train_lines 601",
        "main_lines 81",
        "loop_line 251",
        "load_data has 61 lines",
        "export.py has 801 lines > 800",
        "train.py: 1 lines over",
        "README.md has 401",
        "train.py has 601 lines > 600",
        "train.py: main has 51 lines > 50",
        "train.py imports config",
        "losses.py imports train",
        "export.py needs lora (directly or through another) without naming it",
        "faults.py:94 in check_space(): dist.broadcast",
        "training_data.py:12 config.prompts_of(): a flag's text parsed outside run_plan.py",
        "batches.py:9 micro_batches() is handed the Config (cfg)",
        "data.py shares its name with the folder data/",
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


def step(x, rank):
    \"\"\"One step.\"\"\"
    helpers.agree(x)
    if rank == 0:
        helpers.agree(x)
    if rank != 0:
        pass
    else:
        helpers.unmarked(x)
    return helpers.read_alone(x)


def main(x, rank):
    helpers.agree(x)
    y = helpers.gathered(  # (all ranks participate)
        x
    )
    return step(y, rank)  # (all ranks participate)
"""


def test_the_collective_marker_check_names_each_unmarked_call_and_rank0_branch():
    """The marker where it helps a reader: a direct collective without it is named, and so is a
    call in full_train.main (a phase of the story) of a function that reaches one (through another file,
    and through a module-level alias of a collective); a call elsewhere of a function that reaches
    one needs none. Marked on the line, on the statement's first line or in the comment lines
    directly above, and a DCP load with no_dist=True, are not reported. A collective reached inside
    an `if` that rank 0 alone enters is named, marked or not."""
    problems = check_layout.unmarked_collectives({"helpers.py": HELPERS, "train.py": MAIN})
    marker = "'(all ranks participate)'"
    assert problems == [
        f"helpers.py:12 in unmarked(): dist.barrier called without {marker}",
        "train.py:8 in step(): helpers.agree(), which reaches a collective, called inside `if rank == 0`",
        "train.py:12 in step(): helpers.unmarked(), which reaches a collective, called inside `if rank != 0`",
        f"train.py:17 in main(): helpers.agree(), which reaches a collective, called without {marker}",
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


# A run whose Config leaks past main() and run_plan.py in every way the check follows.
CONFIG_SOURCES = {
    "config.py": """import dataclasses


class Config:
    pass


def parse_config():
    return Config()


def with_seed(cfg, seed):
    return dataclasses.replace(cfg, seed=seed)
""",
    "run_plan.py": """import helpers


def plan_of(cfg):
    plan = helpers.Plan()
    plan.cfg = cfg
    helpers.read(settings=cfg)
    return plan
""",
    "helpers.py": """class Plan:
    pass


class Log:
    def __init__(self, options, step):
        self.step = step

    def write(self, row):
        pass


def read(settings):
    def inner():
        return settings.seed

    return inner()


def seeded(run):
    return run.seed


def lr_of(lr):
    return lr
""",
    "train.py": """import functools

from fsdp_embed import config
import helpers
from fsdp_embed import run_plan


def main(cfg):
    plan = run_plan.plan_of(cfg)
    helpers.lr_of(cfg.lr)
    log = helpers.Log(config.with_seed(cfg, 1), 0)
    again = functools.partial(helpers.seeded, cfg)
    return plan, log, again


if __name__ == "__main__":
    main(config.parse_config())
""",
}


def test_the_config_is_followed_past_main_by_what_each_function_is_handed():
    """The check follows the Config from where it is made (config.parse_config) by what each call
    hands on, under any name: into run_plan.py (allowed), on into a helper by keyword (`settings`),
    into a nested function that reads it, stored on another object (`plan.cfg`), through a function
    that returns a copy of it (dataclasses.replace) into a class's __init__ (not its other methods),
    and through functools.partial. A flag's value handed on (`cfg.lr`) is not the Config."""
    problems = check_layout.config_holders(CONFIG_SOURCES)
    assert problems == [
        "helpers.py:6 Log.__init__() is handed the Config (options)",
        "helpers.py:13 read() is handed the Config (settings)",
        "helpers.py:14 read.inner() reads the Config (settings) from outside",
        "helpers.py:20 seeded() is handed the Config (run)",
        "run_plan.py:6 plan.cfg = the Config: the Config stored in another object",
    ], problems
    clean = {
        **CONFIG_SOURCES,
        "train.py": "import run_plan\n\n\ndef main(cfg):\n    return run_plan.plan_of(cfg)\n",
    }
    clean["run_plan.py"] = "import helpers\n\n\ndef plan_of(cfg):\n    return helpers.lr_of(cfg.lr)\n"
    assert check_layout.config_holders(clean) == []


def config_handed_past_main(run):
    """[file:function] of every call `run()` makes, in any thread, of a function of the project's
    top-level files outside config.py, run_plan.py and full_train.main (its lambdas too) that is given a
    Config: as an argument, inside one (an attribute, a dict value, a list or tuple item), or in a
    variable it reads from an enclosing function. Seen by type, at call time, by a profiler hook."""
    import threading

    from fsdp_embed import config

    def holds(value):
        if isinstance(value, config.Config):
            return True
        inside = list(vars(value).values()) if hasattr(value, "__dict__") else []
        inside += list(value.values()) if isinstance(value, dict) else []
        inside += list(value) if isinstance(value, (list, tuple)) else []
        return any(isinstance(v, config.Config) for v in inside)

    seen = set()

    def hook(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if os.path.dirname(path) != str(REPO_DIR) or os.path.basename(path) in ("config.py", "run_plan.py"):
            return
        where = f"{os.path.basename(path)}:{frame.f_code.co_qualname}"
        in_main = where == "train.py:main" or where.startswith("train.py:main.<locals>.<lambda>")
        if not in_main and any(holds(v) for v in frame.f_locals.values()):
            seen.add(where)

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


def test_no_function_past_main_is_handed_the_config_at_run_time(tmp_path, tiny_model):
    """By type, at run time (the static check's complement): a one-process run that evaluates,
    keeps its best export, saves a checkpoint and exports hands no function past full_train.main a
    Config; and the watch sees one that is handed it (a helper called with it on purpose)."""
    import contextlib

    from fsdp_embed import config
    from fsdp_embed import model_card
    from fsdp_embed import __main__ as full_train

    cfg = config.Config(
        model=str(tiny_model),
        train_data=data_file("sick-pairs-train.jsonl"),
        eval_data=data_file("stsb-dev.jsonl"),
        metric_for_best="stsb-dev/spearman",
        max_steps=2,
        per_device_batch_size=8,
        max_seq_length=32,
        save_steps=1,
        log_steps=1,
        output_dir=str(tmp_path / "run"),
    )
    assert config_handed_past_main(lambda: full_train.main(cfg)) == []
    assert (tmp_path / "run" / "final").is_dir() and (tmp_path / "run" / "best").is_dir()

    def leak():
        with contextlib.suppress(TypeError):
            model_card.public_name(cfg)

    assert config_handed_past_main(leak) == ["model_card.py:public_name"]
