"""Every script in bench/ still starts, without running its benchmark: a script moved, a module
renamed or a function an import names gone fails here, not on the day someone runs the benchmark.

- `--help` exits 0 and prints the script's usage, within a few seconds and without starting a
  Python process (no benchmark begins);
- every import of the repository's modules in a script, at its top or inside a function (most
  scripts import the trainer's modules only when they run), names a module and a name that exist.

All scripts run in one interpreter (runpy, as `python bench/NAME.py --help` would: sys.argv, and
sys.path from the script's folder), which pays for the imports of torch, transformers and
datasets once instead of once a script; then the imports are checked there, with the repository,
bench/ and tests/ on the path (where the scripts put them). A new script in bench/ joins by itself.

Run: python -m pytest tests/test_bench_scripts.py -q
"""

import ast
import json
import subprocess
import sys

import pytest
from conftest import REPO_DIR

pytestmark = pytest.mark.quick

BENCH_DIR = REPO_DIR / "bench"
SCRIPTS = sorted(BENCH_DIR.glob("*.py"))
SECONDS_PER_HELP = 20  # imports included: the first script pays for torch's

# argv: bench/, the repository, tests/, then a JSON {script path: [(line, module, name or None)]}.
RUNNER = r"""
import contextlib, importlib, io, json, runpy, subprocess, sys, time

bench_dir, repo_dir, tests_dir, scripts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
popen = subprocess.Popen.__init__

def no_python(self, command, *args, **kwargs):
    # Libraries start tools while importing (ctypes: ldconfig); a benchmark starts Python (torchrun).
    words = [command] if isinstance(command, (str, bytes)) else list(command)
    if "python" in str(words[0]) or sys.executable in map(str, words):
        raise RuntimeError(f"--help started a Python process: {words}")
    popen(self, command, *args, **kwargs)

subprocess.Popen.__init__ = no_python  # subprocess.run, check_output: all go through it
base_path = [bench_dir, *sys.path[1:]]  # what `python bench/NAME.py` starts with
results = {}
for script in scripts:
    sys.path[:] = base_path
    sys.argv = [script, "--help"]
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
        except BaseException as e:
            code = repr(e)
    results[script] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                       "seconds": time.perf_counter() - started, "missing": []}
subprocess.Popen.__init__ = popen
sys.path[:0] = [bench_dir, tests_dir, repo_dir]
for script, imports in scripts.items():
    for line, module, name in imports:
        try:
            imported = importlib.import_module(module)
            if name is not None and not hasattr(imported, name):
                importlib.import_module(f"{module}.{name}")  # a submodule not imported yet
        except ImportError as e:
            results[script]["missing"].append(f"line {line}: {module} {name or ''}: {e}")
print("RESULTS", json.dumps(results))
"""


def project_modules():
    """The top-level names an import of the repository resolves to: the package, the root's
    files, bench's scripts and tests' helpers."""
    files = [*REPO_DIR.glob("*.py"), *BENCH_DIR.glob("*.py"), *(REPO_DIR / "tests").glob("*.py")]
    return {"fsdp_embed"} | {f.stem for f in files}


def project_imports(script):
    """[(line, module, name or None)] of each import of a project module in `script`, wherever
    it is (a relative import has no place in a script)."""
    project = project_modules()
    found = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in project]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in project:
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


@pytest.fixture(scope="module")
def results():
    """{script name: {"code", "stdout", "stderr", "seconds" of its --help; "missing" imports}}."""
    scripts = {str(s): project_imports(s) for s in SCRIPTS}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNNER,
            str(BENCH_DIR),
            str(REPO_DIR),
            str(REPO_DIR / "tests"),
            json.dumps(scripts),
        ],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return {s.rsplit("/", 1)[-1]: r for s, r in json.loads(lines[0][len("RESULTS ") :]).items()}


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_help_prints_the_usage_and_starts_nothing(results, script):
    run = results[script]
    assert run["code"] == 0, (run["code"], run["stderr"][-3000:])
    assert run["stdout"].startswith("usage: "), run["stdout"][:500]
    assert run["seconds"] < SECONDS_PER_HELP, run["seconds"]


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_every_import_of_the_project_names_what_exists(results, script):
    """Each module imports, and each name imported from it is in it (an attribute or a submodule)."""
    assert results[script]["missing"] == []
