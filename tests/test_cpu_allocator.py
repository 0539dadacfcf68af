"""On CPU, train.py keeps freed large blocks for reuse (train.keep_freed_blocks): a tensor made
and freed every step, like the dense gradient of the word embeddings, is not faulted in again
page by page at each step. Unless the user set glibc's MALLOC_* variables: theirs win.

Measured in a fresh interpreter, by the page faults that making a 64 MB tensor a second time
costs (getrusage's minor faults): about 16k (one per 4 KB page) when glibc unmapped the first.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_DIR

PROBE = """
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
import train
if sys.argv[2] == "train.py":
    train.keep_freed_blocks(torch.device("cpu"))
def faults_to_make_one():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 1024 * 1024)  # 64 MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_to_make_one()  # made and freed once
print(json.dumps(faults_to_make_one()))
"""


def faults(setting, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE, str(REPO_DIR), setting], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again():
    pages = 64 * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE")
    assert faults("default") > pages // 2  # the premise: glibc unmaps it, the next one faults
    assert faults("train.py") < pages // 20
    # The user's own malloc settings win: one that unmaps at once is left as it is.
    assert faults("train.py", {"MALLOC_MMAP_THRESHOLD_": "65536"}) > pages // 2
