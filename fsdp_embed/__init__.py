"""fsdp-embed's full trainer: the one-file loop of train.py at scale, one module per concern.

    python -m fsdp_embed --help                          # every flag, with its default
    torchrun --nproc_per_node=4 -m fsdp_embed --strategy fsdp
    python -m fsdp_embed.mine --help                     # hard-negative mining

Run from the repository's folder: the package uses the root's losses.py, eval_dist.py and
fsdp_utils.py, never a copy. __main__.py is the story (start-up, the loop, evaluation, the
export); every other module is named after what it holds.
"""
