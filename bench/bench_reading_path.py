"""What a reader must read to follow a run: the lines of every function the run enters (the
reading path), per project file, and the files one micro-batch's forward, loss and backward cross.

    python bench/bench_reading_path.py                 # the README's default run, 2 processes, 3 steps
    python bench/bench_reading_path.py --json out.json
    python bench/bench_reading_path.py --nproc 1 -- --strategy fsdp   # other flags for the trainer

It launches `torchrun --nproc_per_node=N` on this script, which runs the full trainer's main
(fsdp_embed.__main__.main) in each process under a profiler hook (every thread) that notes each
function of the project's files (the root's and fsdp_embed/'s) the run calls; the reading path is
the union, over the ranks, of those functions' lines (a nested function's lines once, inside its
outer one), docstrings and comments included: what a reader meets at each call. While its
forward_backward runs (one micro-batch), the files of the functions it calls are noted apart.
Nothing here changes what the run does.

Left out on purpose: code reached only through torch or transformers (not the project's), and
module-level code (imports, constants), which a reader skims.
"""

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]


def function_spans(path):
    """{first line of a function's code object: (first, last) line of its definition} of a file:
    decorators included, as the code object counts them."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[first] = (first, node.end_lineno)
    return spans


def worker(out_dir, train_args):
    """One rank: full_train.main under the hook; writes rank-N.json with the functions it entered."""
    sys.path.insert(0, str(REPO_DIR))
    from fsdp_embed import config
    from fsdp_embed import __main__ as full_train

    entered, in_step, stepping = set(), set(), threading.local()
    project = {str(p) for p in [*REPO_DIR.glob("*.py"), *REPO_DIR.glob("fsdp_embed/*.py")]}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in project:
            where = (frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_qualname)
            entered.add(where)
            if getattr(stepping, "on", False):
                in_step.add(where)

    forward_backward = full_train.forward_backward

    def watched(*args, **kwargs):
        stepping.on = True
        try:
            return forward_backward(*args, **kwargs)
        finally:
            stepping.on = False

    full_train.forward_backward = watched
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        full_train.main(config.parse_config(train_args))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"entered": sorted(entered), "step": sorted(in_step)}, f)


def relative(file):
    """A project file's path in the repository: fsdp_embed/__main__.py, losses.py."""
    return Path(file).relative_to(REPO_DIR).as_posix()


def reading_path(records):
    """{file: {"lines", "functions"}} of the union of the ranks' entered functions, and the
    sorted files the step crossed."""
    entered = {tuple(e) for r in records for e in r["entered"]}
    per_file = {}
    for file in sorted({f for f, *_ in entered}):
        spans = function_spans(Path(file))
        names = {spans[line]: name for f, line, name in entered if f == file and line in spans}
        lines, outermost = set(), {}
        for first, last in sorted(names):
            if first not in lines:  # else a nested function: its lines are its outer one's
                lines.update(range(first, last + 1))
                outermost[names[first, last]] = last - first + 1
        per_file[relative(file)] = {"lines": len(lines), "functions": len(names), "entered": outermost}
    step = {(relative(f), name) for r in records for f, _, name in r["step"]}
    step_files = {
        file: sorted(name for f, name in step if f == file) for file in sorted({f for f, _ in step})
    }
    return per_file, step_files


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=3, help="--max-steps of the run")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the folder a launched rank writes to
    parser.add_argument("train_args", nargs="*", help="more flags for the trainer (after --)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.train_args)
    with tempfile.TemporaryDirectory() as work:
        flags = ["--max-steps", str(args.steps), "--output-dir", os.path.join(work, "out"), *args.train_args]
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
            __file__, "--worker", work, "--", *flags,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=REPO_DIR, stdout=subprocess.DEVNULL)
        records = [json.loads(p.read_text()) for p in sorted(Path(work).glob("rank-*.json"))]
    per_file, step_files = reading_path(records)
    total = sum(v["lines"] for v in per_file.values())
    functions = sum(v["functions"] for v in per_file.values())
    result = {
        "command": f"torchrun --nproc_per_node={args.nproc} -m fsdp_embed "
        + " ".join(flags[:2] + args.train_args),
        "reading_path_lines": total,
        "functions": functions,
        "files": len(per_file),
        "per_file": per_file,
        "step_files": step_files,
    }
    print(f"{result['command']}: {total} lines in {functions} functions across {len(per_file)} files")
    for name, v in sorted(per_file.items(), key=lambda item: -item[1]["lines"]):
        print(f"  {name:30s} {v['lines']:5d} lines  {v['functions']:3d} functions")
    print(f"one micro-batch's forward, loss and backward: {len(step_files)} files")
    for name, functions in step_files.items():
        print(f"  {name:20s} {', '.join(functions)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
