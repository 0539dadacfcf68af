"""The commands of the README and docs/ run as written from a fresh clone: every train.py, mine.py
and train.py command's flags parse (train.py's Config and its field rules, the others' own
parsers), and
every file under data/ that a command names is in the repository. (The README's first command
runs end to end in test_train_e2e.py; its test command is what CI runs.)

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

PARSERS = {
    "train.py": config.parse_config,
    "mine.py": mine.parse_args,
    "train.py": train.parse_args,
}
PAGES = [REPO_DIR / "README.md", *sorted((REPO_DIR / "docs").glob("*.md"))]


def commands(page):
    """(script, arguments) of each train.py, mine.py or train.py command in the page's bash
    blocks, their continuation lines joined and comments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            scripts = [i for i, word in enumerate(words) if word in PARSERS]
            if scripts:  # "..." stands for the rest of a command the page leaves out
                found.append((words[scripts[0]], [w for w in words[scripts[0] + 1 :] if w != "..."]))
    return found


ALL = [(page.name, script, args) for page in PAGES for script, args in commands(page)]


def test_the_pages_have_commands_to_check():
    # A change in how the pages write their commands must not leave this file checking nothing.
    assert len(ALL) >= 40, len(ALL)
    assert {page for page, _, _ in ALL} >= {"README.md", "recipes.md", "evaluation.md", "mining.md"}
    assert "train.py" in {script for _, script, _ in ALL}


@pytest.mark.parametrize("page, script, args", ALL, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(ALL)])
def test_a_command_parses_and_names_only_files_the_repository_has(page, script, args):
    assert not any("$DATA" in arg for arg in args), "name the repository's data/ folder"
    for arg in args:
        for path in arg.split(","):
            if path.startswith("data/"):
                assert (REPO_DIR / path).is_file(), f"{page} names {path}, which the repository lacks"
    if args == ["--help"]:
        with pytest.raises(SystemExit) as exited:
            PARSERS[script](args)
        assert exited.value.code == 0
    elif script == "train.py":
        config.check_field_rules(config.parse_config(args))
    else:
        PARSERS[script](args)
