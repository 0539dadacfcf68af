"""Prose names what exists: every `module.name` that the product's docstrings and comments (the
root's files and the package's), the README and docs/ name, where `module` is a project file (a
root file, `train.forward`, or a module of the package, `config.parse_config`, also written
`fsdp_embed.config.parse_config`), is defined there (a function, a class, a method or attribute
of one, a module-level name). File names (`metrics.jsonl`, `config.json`, `train.py`) are not
such references.

    python -m pytest tests/test_prose.py
"""

import ast
import io
import re
import tokenize

import pytest

from conftest import REPO_DIR

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

# {module: its file}: the root's files and the package's modules, as `from fsdp_embed import x`
# names them (no module of the package shares a root file's name: test_layout.py).
FILES = {p.stem: p for p in [*REPO_DIR.glob("*.py"), *(REPO_DIR / "fsdp_embed").glob("*.py")]}
FILES.pop("__init__")
MODULES = sorted(FILES)
# What follows a module's name and a dot in a file name, not an attribute.
EXTENSIONS = {
    "py",
    "json",
    "jsonl",
    "md",
    "txt",
    "csv",
    "parquet",
    "arrow",
    "lock",
    "safetensors",
    "bin",
    "onnx",
}
REFERENCE = re.compile(
    r"(?<![\w./-])(?:fsdp_embed\.)?(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)


def defined_names(module):
    """Every name `module.X` or `module.Class.Y` can resolve to, from the file's syntax."""
    tree = ast.parse(FILES[module].read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{child.name}")
                elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                    names.add(f"{node.name}.{child.target.id}")
                elif isinstance(child, ast.Assign):
                    names.update(f"{node.name}.{t.id}" for t in child.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def python_prose(path):
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.lineno, value.value))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def markdown_prose(path):
    """(line, text) of every backticked span of a Markdown file."""
    return [
        (i, span)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for span in re.findall(r"`([^`]+)`", line)
    ]


def missing_references(places):
    """["file:line module.name"] of the references in `places` ({file: [(line, text)]}) that name
    nothing the module defines."""
    defined = {module: defined_names(module) for module in MODULES}
    missing = []
    for file, texts in places.items():
        for line, text in texts:
            for module, name in REFERENCE.findall(text):
                parts = name.split(".")
                if parts[0] in EXTENSIONS:
                    continue
                if parts[0] not in defined[module] and ".".join(parts[:2]) not in defined[module]:
                    missing.append(f"{file}:{line} {module}.{name}")
    return missing


def test_every_module_name_the_prose_names_exists():
    places = {str(p.relative_to(REPO_DIR)): python_prose(p) for p in sorted(FILES.values())}
    for path in [REPO_DIR / "README.md", *sorted((REPO_DIR / "docs").glob("*.md"))]:
        places[str(path.relative_to(REPO_DIR))] = markdown_prose(path)
    assert missing_references(places) == []


def test_a_name_that_does_not_exist_is_named():
    """The check can fail: a stale name in a docstring, a comment and a Markdown span is named;
    a file name and a name that exists are not."""
    places = {
        "a.py": [(3, "Built by run_plan.add_data, see batches.Schedule and metrics.jsonl.")],
        "b.py": [(7, "# the check is model_checks.bidirectional_problem's")],
        "docs/x.md": [(2, "run_plan.record(plan)"), (3, "train.no_such_helper"), (4, "config.json")],
        "docs/y.md": [
            (5, "fsdp_embed.config.no_such_parser"),
            (6, "__main__.no_such_phase"),
            (7, "train.main"),
        ],
        "docs/z.md": [(8, "fsdp_embed/config.py, python -m fsdp_embed.mine, fsdp_embed.__main__.main")],
    }
    assert missing_references(places) == [
        "a.py:3 run_plan.add_data",
        "b.py:7 model_checks.bidirectional_problem",
        "docs/x.md:3 train.no_such_helper",
        "docs/y.md:5 config.no_such_parser",
        "docs/y.md:6 __main__.no_such_phase",
    ]
