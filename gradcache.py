"""GradCache (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): a contrastive batch of any size in the memory of one chunk of rows.

    loss = gradcache.cached_backward(embed, chunks, num_columns, loss_of, sync=True,
                                     gradient_sync=lambda enabled: contextlib.nullcontext(),
                                     autocast=contextlib.nullcontext, scale_loss=lambda x: x)

`embed(rows)` embeds those rows of the micro-batch's pool of texts (every column's rows, one
after the other) through the wrapped model; `chunks` are row sets that hold every row once;
`loss_of(embs)` is the micro-batch's loss from its column embeddings (train.embeddings_loss), so
every loss, --gather-negatives and Matryoshka work unchanged; the gradients equal those of one
backward through the whole batch (tests/test_gradcache_gather.py). Dropout draws the same masks
in both passes: each chunk's RNG state is noted before its first forward and restored before its
second.

Left out on purpose: caching across optimizer steps (the embeddings change with the weights),
and chunks of unequal sizes across ranks (every forward is a collective under FSDP).

Needs torch, and fsdp_utils.py (`rng_states`, `set_rng_states`), which needs collectives.py.
"""

import torch

import fsdp_utils


def cached_backward(
    embed, chunks, num_columns, loss_of, *, sync, gradient_sync, autocast, scale_loss, touch_head=None
):
    """GradCache (Gao et al., 2021): backward of the loss of the whole micro-batch while only
    one chunk of rows holds activations. `embed(rows)`: the embeddings of those rows of the pool;
    `loss_of(embs)`: the micro-batch's loss from its `num_columns` column embeddings. Returns the
    (detached) loss.

      1. embed every chunk without a graph, noting the RNG state before each;
      2. compute the loss on those embeddings (leaves that require grad) and backward it:
         d loss / d embedding for every row (and the Softmax head's own gradient);
      3. re-embed each chunk with a graph from its noted RNG state (the same dropout masks)
         and backward the cached d loss / d embedding through the encoder.
    Step 2 is the loss itself, so every loss (and --gather-negatives) works unchanged. Chunks are
    cut by the caller from sub_batches' length-sorted groups, so with chunks as large as the groups
    the forwards (and the random numbers they draw) are exactly those without GradCache.

    (all ranks participate) Every rank runs the same number of chunks (equal batch sizes, equal
    groups): each forward is a collective under FSDP (a buffer broadcast under DDP).
    `gradient_sync(enabled)`: the context of a backward (train.gradient_sync), so that DDP
    all-reduces the gradients only in the step's last backward (`sync`). `touch_head(emb)`: a zero
    that reaches the Softmax head, which got its gradient in step 2, added to the last backward
    (DDP reduces a parameter only when the synchronised backward reaches it); None: no head."""
    # 1. embeddings without a graph, put back in pool order, one leaf per column
    chunk_rng, pieces = [], []
    with torch.no_grad(), autocast():
        for rows in chunks:
            chunk_rng.append(fsdp_utils.rng_states())
            pieces.append(embed(rows).float())
    in_pool_order = torch.cat(pieces)[torch.argsort(torch.cat(chunks))]
    embs = [e.requires_grad_() for e in in_pool_order.chunk(num_columns)]

    # 2. the loss and its gradient with respect to every embedding (DDP: nothing all-reduced yet)
    with gradient_sync(False):
        with autocast():
            loss = loss_of(embs)
        scale_loss(loss).backward()

    # 3. re-embed each chunk with a graph and push its cached gradient through the encoder
    grad_PD = torch.cat([e.grad for e in embs])
    for i, rows in enumerate(chunks):
        is_last = i == len(chunks) - 1
        fsdp_utils.set_rng_states(chunk_rng[i])
        with gradient_sync(sync and is_last):
            with autocast():
                emb_CD = embed(rows).float()
            surrogate = (emb_CD * grad_PD[rows]).sum()
            if is_last and touch_head is not None:  # a zero on every rank, so DDP reduces the head
                with autocast():
                    surrogate = surrogate + touch_head(emb_CD.detach())
            surrogate.backward()
    return loss.detach()
