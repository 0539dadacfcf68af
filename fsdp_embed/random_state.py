"""The states of this process's random-number generators (CPU, and the current CUDA device's
where present): what a checkpoint keeps for each rank (checkpoints.py), and what GradCache
restores before re-running a chunk, so that dropout draws the same masks (gradcache.py).

Needs torch only: copy it alone. Usage (each rank for itself, no collective):
    states = random_state.rng_states()
    ...                           # draws from the generators
    random_state.set_rng_states(states)    # the same draws again

Left out on purpose: Python's `random` and NumPy's global generators (the trainer's own draws
use generators seeded per draw, batches.py), and other CUDA devices than the current one (one
device per process).
"""

import torch


def rng_states():
    """This process's random-number generator states (CPU, and the current CUDA device's where
    present): what a checkpoint keeps, and what GradCache restores before re-running a chunk."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
