"""The commands of the README and docs/ run as written from a fresh clone: each command's flags
parse with the parser of the program it names (`train.py`: the one-file loop's, train.parse_args;
`python -m fsdp_embed` or `torchrun ... -m fsdp_embed`: the full trainer's Config and its field
rules; `-m fsdp_embed.mine`: the miner's), every file under data/ that a command names is in the
repository, and no command runs a package module as a file (`python mine.py`, `python
fsdp_embed/__main__.py`: from the repository's folder the package runs with -m) or the loop's old
name. (The full trainer's default command runs end to end in test_train_e2e.py; the README's test
command is what CI runs.)

Run: python -m pytest tests/test_readme.py
"""

import re
import shlex

import pytest
from conftest import REPO_DIR

from fsdp_embed import config
from fsdp_embed import mine
import train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def parse_full_trainer(args):
    return config.check_field_rules(config.parse_config(args))


PARSERS = {
    "train.py": train.parse_args,  # the one-file loop
    "-m fsdp_embed": parse_full_trainer,  # the full trainer
    "-m fsdp_embed.mine": mine.parse_args,
}
PACKAGE_MODULES = {p.name for p in (REPO_DIR / "fsdp_embed").glob("*.py")}
PAGES = [REPO_DIR / "README.md", *sorted((REPO_DIR / "docs").glob("*.md"))]


def commands(text):
    """(program, arguments) of each command in the bash blocks of a page's `text`, their
    continuation lines joined and comments dropped: the program is `train.py`, `-m fsdp_embed`
    or `-m fsdp_embed.mine` (run by python or torchrun), or, for a command that runs a package
    module as a file or the loop by its old name, that file (no parser: the test fails)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                program = None
                if word == "-m" and i + 1 < len(words) and f"-m {words[i + 1]}" in PARSERS:
                    program, i = f"-m {words[i + 1]}", i + 1
                elif word == "train.py" or word in PACKAGE_MODULES or word == "minimal_train.py":
                    program = word
                elif word.startswith("fsdp_embed/") and word.endswith(".py"):
                    program = word
                if program:  # "..." stands for the rest of a command the page leaves out
                    found.append((program, [w for w in words[i + 1 :] if w != "..."]))
                    break
    return found


ALL = [(page.name, program, args) for page in PAGES for program, args in commands(page.read_text())]


def test_the_pages_have_commands_to_check():
    # A change in how the pages write their commands must not leave this file checking nothing.
    assert len(ALL) >= 40, len(ALL)
    assert {page for page, _, _ in ALL} >= {"README.md", "recipes.md", "evaluation.md", "mining.md"}
    assert {program for _, program, _ in ALL} >= set(PARSERS), {program for _, program, _ in ALL}


def test_commands_are_found_under_each_launcher():
    """Each form a page writes a command in is found, with its program: python or torchrun, the
    loop or the package, a comment and a continuation line; a package module run as a file, and
    the loop's old name, are found too (and then refused by the test below)."""
    page = """```bash
python train.py --epochs 1   # the loop
torchrun --nproc_per_node=2 train.py --strategy fsdp \\
    --precision bf16
python -m fsdp_embed --lr 1e-5 ...
torchrun --nnodes=2 --rdzv-id=job42 -m fsdp_embed --strategy fsdp
torchrun --nproc_per_node=2 -m fsdp_embed.mine --data x.jsonl
python mine.py --data x.jsonl
python minimal_train.py
python -m pytest tests/test_readme.py
```
"""
    assert commands(page) == [
        ("train.py", ["--epochs", "1"]),
        ("train.py", ["--strategy", "fsdp", "--precision", "bf16"]),
        ("-m fsdp_embed", ["--lr", "1e-5"]),
        ("-m fsdp_embed", ["--strategy", "fsdp"]),
        ("-m fsdp_embed.mine", ["--data", "x.jsonl"]),
        ("mine.py", ["--data", "x.jsonl"]),
        ("minimal_train.py", []),
    ]


@pytest.mark.parametrize("program", list(PARSERS))
def test_each_parser_refuses_a_flag_it_does_not_have(program, capsys):
    """So a page's command that names a flag its program lacks fails below: the loop's parser
    refuses the full trainer's flags (naming `python -m fsdp_embed`), each refuses a made-up one."""
    bad = {"train.py": ["--cache-chunk-size", "8"]}.get(program, ["--no-such-flag", "1"])
    if program == "-m fsdp_embed.mine":
        bad += ["--data", "data/sick-pairs-train.jsonl", "--output", "mined.jsonl"]
        with pytest.raises(mine.BadFlags, match="--no-such-flag"):  # not an exit: every rank stops alike
            PARSERS[program](bad)
        return
    with pytest.raises(SystemExit) as exited:
        PARSERS[program](bad)
    assert exited.value.code not in (0, None)
    if program == "train.py":
        assert "-m fsdp_embed" in capsys.readouterr().err


def run_parser(page, program, args):
    """The program's parser on `args`; a refusal (argparse exits) fails with the command named."""
    try:
        return PARSERS[program](args)
    except SystemExit as exited:
        if exited.code not in (0, None):
            pytest.fail(
                f"{page}: `{program} {shlex.join(args)}` is refused by its parser (exit {exited.code})"
            )
        raise


@pytest.mark.parametrize("page, program, args", ALL, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(ALL)])
def test_a_command_parses_and_names_only_files_the_repository_has(page, program, args):
    assert program in PARSERS, (
        f"{page} runs {program}: the loop is train.py; the full trainer and the miner run from the "
        "repository's folder as python -m fsdp_embed and python -m fsdp_embed.mine"
    )
    assert not any("$DATA" in arg for arg in args), "name the repository's data/ folder"
    for arg in args:
        for path in arg.split(","):
            if path.startswith("data/"):
                assert (REPO_DIR / path).is_file(), f"{page} names {path}, which the repository lacks"
    if args == ["--help"]:
        with pytest.raises(SystemExit) as exited:
            PARSERS[program](args)
        assert exited.value.code == 0
    else:
        run_parser(page, program, args)
