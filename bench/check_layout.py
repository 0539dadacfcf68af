"""Measure the layout a reader meets: how long train.py is, where its loop starts, how long the
longest function is, how long each project file is, how many lines are too wide, how long the
README is, and which project files each file needs. Exits 1 when a target is missed
(tests/test_layout.py runs it).

    python bench/check_layout.py            # the table, and any target missed
    python bench/check_layout.py --json     # the same numbers as JSON

Targets: train.py at most 600 lines; main() at most 80 lines; the training loop (main's
`for step in ...`) within the first 250 lines of train.py; no other function over 60 lines in
any top-level file; no top-level file (a project file) over 800 lines; no line over 110
characters in any Python file (ruff's setting too); the README at most 350 lines; no file but
train.py imports train; losses.py, eval_dist.py, lora.py and collectives.py import no other file
of the project; every other file names in its docstring each project file it imports, so a
reader can copy it with the few it needs.
"""

import argparse
import ast
import json
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
TARGETS = {"train_lines": 600, "main_lines": 80, "loop_line": 250, "function_lines": 60, "line_chars": 110}
FILE_LINES = 800  # any project file: past it, a file holds more than one concern
README_LINES = 350
STANDALONE = ("losses.py", "eval_dist.py", "lora.py", "collectives.py")


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
    unnamed = {
        name: [m for m in needed if f"{m}.py" not in (ast.get_docstring(trees[name]) or "")]
        for name, needed in imports.items()
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
        "imports_not_named_in_docstring": {name: missing for name, missing in unnamed.items() if missing},
    }


def missed(m):
    """The targets `m` misses, one line each."""
    problems = []
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
    if m["readme_lines"] > README_LINES:
        problems.append(f"README.md has {m['readme_lines']} lines > {README_LINES}")
    problems += [f"{name} imports train" for name, needed in m["imports"].items() if "train" in needed]
    problems += [f"{name} imports {m['imports'][name]}" for name in STANDALONE if m["imports"].get(name)]
    problems += [
        f"{name} imports {', '.join(missing)} without naming it in its docstring"
        for name, missing in m["imports_not_named_in_docstring"].items()
    ]
    return problems


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
            needs = ", ".join(m["imports"][name]) or "no other project file"
            size, function = m["file_lines"][name], f"{longest['function']} ({longest['lines']})"
            print(f"  {name:20s} {size:4d} lines; longest {function}; needs {needs}")
    problems = missed(m)
    for problem in problems:
        print(f"missed: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
