"""Runs the full trainer (`python -m fsdp_embed`) unchanged, except that one rank SIGKILLs itself at
one point of one checkpoint save, on the first torchrun attempt only, as a preemption or an
out-of-memory kill would (or, with a fourth field SEGV, dies of a segmentation fault, as a crash in
native code would). The kill comes from outside the product: this launcher wraps two functions of
fsdp_embed.checkpoints (save_checkpoint, and the save_file it writes with), then runs the package as
__main__ (runpy.run_module), whose `from fsdp_embed import checkpoints` finds the wrapped module.

    python tests/kill_launcher.py WHERE:STEP:RANK[:SEGV] [trainer arguments ...]
    torchrun --nproc_per_node=2 tests/kill_launcher.py WHERE:STEP:RANK[:SEGV] [trainer arguments ...]

WHERE is
    after-save  rank RANK dies as soon as the checkpoint of step STEP is complete and visible;
    while-busy  the same, while every other rank spends 3 s outside any collective right after
                that save (as in a slow forward or tokenizer), so that torchrun's SIGTERM, sent
                within 0.1 s of the death, reaches them before any collective could tell them;
    in-save     rank RANK dies right after writing its own files of step STEP's checkpoint
                (its DCP shard and its RNG file), before the checkpoint is made visible.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

from fsdp_embed import checkpoints  # noqa: E402


def arm(where, step, rank, signal_name="KILL"):
    def die():
        os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))

    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # a restarted attempt: train undisturbed
    if where == "while-busy":
        save_checkpoint = checkpoints.save_checkpoint

        def save_then_die_or_wait(*args, **kwargs):
            path = save_checkpoint(*args, **kwargs)
            if os.path.basename(path) == f"step-{step}":
                if os.environ.get("RANK", "0") == rank:
                    die()
                time.sleep(3)
            return path

        checkpoints.save_checkpoint = save_then_die_or_wait
    elif os.environ.get("RANK", "0") != rank:
        return  # another rank: train undisturbed
    elif where == "after-save":
        save_checkpoint = checkpoints.save_checkpoint

        def save_then_die(*args, **kwargs):
            path = save_checkpoint(*args, **kwargs)
            if os.path.basename(path) == f"step-{step}":
                die()
            return path

        checkpoints.save_checkpoint = save_then_die
    elif where == "in-save":
        save_file = checkpoints.save_file  # save_checkpoint writes this rank's RNG file with it, last

        def write_then_die(tensors, filename, *args, **kwargs):
            save_file(tensors, filename, *args, **kwargs)
            if os.path.basename(os.path.dirname(filename)) == f".incomplete-step-{step}" and os.path.basename(
                filename
            ).startswith("rng-rank-"):
                die()

        checkpoints.save_file = write_then_die
    else:
        raise SystemExit(f"kill_launcher: unknown kill point {where!r}: after-save, while-busy or in-save")


if __name__ == "__main__":
    arm(*sys.argv[1].split(":"))
    sys.argv = [str(REPO_DIR / "fsdp_embed" / "__main__.py"), *sys.argv[2:]]
    runpy.run_module("fsdp_embed", run_name="__main__", alter_sys=True)  # python -m fsdp_embed
