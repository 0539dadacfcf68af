"""GradCache (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): a contrastive batch of any size in the memory of one chunk of rows.

    loss = gradcache.cached_backward(embed_chunks, embed, chunks, num_columns, loss_of, sync=True,
                                     gradient_sync=lambda enabled: contextlib.nullcontext(),
                                     autocast=contextlib.nullcontext, scale_loss=lambda x: x)

`embed_chunks(chunks)` embeds the micro-batch's pool of texts (every column's rows, one after the
other) through the wrapped model in one call, an encoder pass per chunk, in pool order;
`embed(rows, positions)` embeds one chunk's rows at its token positions; `chunks` are (rows,
positions) pairs (batches.sub_batches) whose rows hold every row once;
`loss_of(embs)` is the micro-batch's loss from its column embeddings (__main__.embeddings_loss), so
every loss, --gather-negatives and Matryoshka work unchanged; the gradients equal those of one
backward through the whole batch (tests/test_gradcache_gather.py). Dropout draws the same masks
in both passes: the RNG state is noted before the first pass and restored before the second,
which runs the chunks in the same order (nothing else draws between them).

Left out on purpose: caching across optimizer steps (the embeddings change with the weights),
and chunks of unequal sizes across ranks (every forward is a collective under FSDP).

Needs torch, and fsdp_embed/random_state.py (`rng_states`, `set_rng_states`), which needs torch only.
"""

import torch

from fsdp_embed import random_state


def cached_backward(
    embed_chunks,
    embed,
    chunks,
    num_columns,
    loss_of,
    *,
    sync,
    gradient_sync,
    autocast,
    scale_loss,
    touch_head=None,
):
    """GradCache (Gao et al., 2021): backward of the loss of the whole micro-batch while only
    one chunk of rows holds activations. `embed_chunks(chunks)`: the pool's embeddings, an encoder
    pass per chunk, in pool order; `embed(rows, positions)`: the embeddings of one chunk's rows of
    the pool, at its token positions;
    `loss_of(embs)`: the micro-batch's loss from its `num_columns` column embeddings. Returns the
    (detached) loss.

      1. embed every chunk without a graph, in one call, noting the RNG state before it;
      2. compute the loss on those embeddings (leaves that require grad) and backward it:
         d loss / d embedding for every row (and the Softmax head's own gradient);
      3. re-embed each chunk with a graph, in the same order from the noted RNG state (the same
         dropout masks), and backward the cached d loss / d embedding through the encoder.
    Step 2 is the loss itself, so every loss (and --gather-negatives) works unchanged. Chunks are
    cut by the caller from sub_batches' length-sorted groups, so with chunks as large as the groups
    the forwards (and the random numbers they draw) are exactly those without GradCache.

    (all ranks participate) Every rank runs the same number of chunks (equal batch sizes, equal
    groups): each forward is a collective under FSDP (a buffer broadcast under DDP).
    `gradient_sync(enabled)`: the context of a backward (sharding.gradient_sync), so that DDP
    all-reduces the gradients only in the step's last backward (`sync`). `touch_head(emb)`: a zero
    that reaches the Softmax head, which got its gradient in step 2, added to the last backward
    (DDP reduces a parameter only when the synchronised backward reaches it); None: no head."""
    # 1. embeddings without a graph, in pool order, one leaf per column
    rng = random_state.rng_states()
    with torch.no_grad(), autocast():
        embs = [e.requires_grad_() for e in embed_chunks(chunks).float().chunk(num_columns)]

    # 2. the loss and its gradient with respect to every embedding (DDP: nothing all-reduced yet)
    with gradient_sync(False):
        loss = loss_of(embs)  # in fp32, outside autocast, as without GradCache
        scale_loss(loss).backward()

    # 3. re-embed each chunk with a graph and push its cached gradient through the encoder
    grad_PD = torch.cat([e.grad for e in embs])
    random_state.set_rng_states(rng)
    for i, (rows, positions) in enumerate(chunks):
        is_last = i == len(chunks) - 1
        with gradient_sync(sync and is_last):
            with autocast():
                emb_CD = embed(rows, positions).float()
            surrogate = (emb_CD * grad_PD[rows]).sum()
            if is_last and touch_head is not None:  # a zero on every rank, so DDP reduces the head
                with autocast():
                    surrogate = surrogate + touch_head(emb_CD.detach())
            surrogate.backward()
    return loss.detach()
