"""Silence, around a use of torch's checkpoint and state-dict code, the warnings that code gives
about its own internals: FSDP1's sharded state is ShardedTensor, which torch deprecates (dozens of
lines per save), and one process is told it is one process. Nothing a user can act on.

Needs nothing of the project: copy it alone. Usage (wherever torch.distributed.checkpoint or
its state-dict functions run: checkpoints.py, export.py, shard_loading.py):
    with checkpoint_warnings.quiet_checkpoint_warnings():
        state = get_model_state_dict(model)

Left out on purpose: every other warning, which stays as torch gives it.
"""

import contextlib
import warnings


@contextlib.contextmanager
def quiet_checkpoint_warnings():
    """Inside the `with` block, the warnings above are silenced, here and only here."""
    with warnings.catch_warnings():
        for message in (
            "Please use DTensor instead and we are deprecating ShardedTensor",
            "`_get_pg_default_device` will be deprecated",
            "Multiple backends are registered with this ProcessGroup",
            "torch.distributed is disabled",
        ):
            warnings.filterwarnings("ignore", message=message)
        yield
