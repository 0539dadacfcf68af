"""GradCache (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): a contrastive batch of any size in the memory of one chunk of rows.

    loss = gradcache.cached_backward(model, features, loss_of, chunk_size, sync=True,
                                     autocast=contextlib.nullcontext, scale_loss=lambda x: x)

`loss_of(embs)` is the micro-batch's loss from its column embeddings (train.embeddings_loss), so
every loss, --gather-negatives and Matryoshka work unchanged; the gradients equal those of one
backward through the whole batch (tests/test_gradcache_gather.py). Dropout draws the same masks
in both passes: each chunk's RNG state is noted before its first forward and restored before its
second.

Left out on purpose: caching across optimizer steps (the embeddings change with the weights),
and chunks of unequal sizes across ranks (every forward is a collective under FSDP).

Needs torch, and batches.py (`pool_columns`), checkpoints.py (`rng_states`, `set_rng_states`),
embedding_model.py (`select_rows`) and fsdp_utils.py (`gradient_sync`).
"""

import torch

import batches
import checkpoints
import embedding_model
import fsdp_utils


def cached_backward(
    model, features, loss_of, chunk_size, *, sync, autocast, scale_loss, has_head=False, groups=None
):
    """GradCache (Gao et al., 2021): backward of the loss of the whole micro-batch while only
    one chunk of `chunk_size` rows holds activations. `loss_of(embs)` is the micro-batch's loss
    from its column embeddings. Returns the (detached) loss.

      1. embed every chunk without a graph, noting the RNG state before each;
      2. compute the loss on those embeddings (leaves that require grad) and backward it:
         d loss / d embedding for every row (and the Softmax head's own gradient);
      3. re-embed each chunk with a graph from its noted RNG state (the same dropout masks)
         and backward the cached d loss / d embedding through the encoder.
    Step 2 is the loss itself, so every loss (and --gather-negatives) works unchanged. Chunks
    are cut from each of sub_batches' `groups` (length-sorted row sets of the pool of all
    columns; None: the pool in order), so with chunk_size >= the group sizes the forwards (and
    the random numbers they draw) are exactly those of embed_columns with the same groups.

    (all ranks participate) Every rank runs the same number of chunks (equal batch sizes, equal
    groups): each forward is a collective under FSDP (a buffer broadcast under DDP). DDP
    all-reduces the gradients only in the step's last backward (`sync`); FSDP reduce-scatters in
    every one (gradient_sync). `has_head`: the model has a Softmax head, which gets its gradient
    in step 2."""
    pool = batches.pool_columns(features)
    device = pool["input_ids"].device
    groups = groups or [torch.arange(len(pool["input_ids"]), device=device)]
    chunks = [rows for group in groups for rows in group.split(chunk_size)]

    # 1. embeddings without a graph, put back in pool order, one leaf per column
    chunk_rng, pieces = [], []
    with torch.no_grad(), autocast():
        for rows in chunks:
            chunk_rng.append(checkpoints.rng_states())
            pieces.append(model(**embedding_model.select_rows(pool, rows)).float())
    in_pool_order = torch.cat(pieces)[torch.argsort(torch.cat(groups))]
    embs = [e.requires_grad_() for e in in_pool_order.split(len(features[0]["input_ids"]))]

    # 2. the loss and its gradient with respect to every embedding (DDP: nothing all-reduced yet)
    with fsdp_utils.gradient_sync(model, enabled=False):
        with autocast():
            loss = loss_of(embs)
        scale_loss(loss).backward()

    # 3. re-embed each chunk with a graph and push its cached gradient through the encoder
    grad_PD = torch.cat([e.grad for e in embs])
    for i, rows in enumerate(chunks):
        is_last = i == len(chunks) - 1
        checkpoints.set_rng_states(chunk_rng[i])
        with fsdp_utils.gradient_sync(model, enabled=sync and is_last):
            with autocast():
                emb_CD = model(**embedding_model.select_rows(pool, rows)).float()
            surrogate = (emb_CD * grad_PD[rows]).sum()
            if is_last and has_head:
                # The head got its gradient in step 2; DDP reduces a parameter only when the
                # synchronised backward reaches it, so touch it here with a zero on every rank.
                with autocast():
                    head_out = model(head_input=emb_CD.detach()[:1].repeat(1, 3)).float()
                surrogate = surrogate + 0.0 * head_out.sum()
            surrogate.backward()
    return loss.detach()
