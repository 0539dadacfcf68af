"""The communication this project writes itself over torch.distributed, where the library's own
collectives send more than they need to:

  - `RingAllGather`, `RingReduceScatter`: FSDP2's all-gather and reduce-scatter over gloo as
    rings of point-to-point messages (`module.set_custom_all_gather(RingAllGather())`, and
    likewise for the reduce-scatter, on each FSDPModule: sharding.wrap_fsdp2 does it);
  - `all_reduce_embedding_rows` (a DDP communication hook, its state an `EmbeddingRows`) and
    `mean_over_ranks`: the mean over ranks of gradients, sending of an embedding table only the
    rows some rank used, bit for bit what the dense all-reduce gives;
  - `send_files_to_rank0`: files from ranks on another host to rank 0, over the process group,
    a chunk at a time.

Usage (all ranks participate: every rank of the group calls each of these, in the same order),
under torchrun on gloo (CPU) or NCCL:
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    ddp.register_comm_hook(collectives.EmbeddingRows(tables), collectives.all_reduce_embedding_rows)
    collectives.mean_over_ranks([(table.grad, True) for table in whole_tables])
    collectives.send_files_to_rank0(folder, rank_files, senders)

It imports only the standard library and torch, never the other files of this project, so it
can be copied alone (fsdp_utils.py imports it). Left out on purpose: rings under NCCL (fsdp_utils
sets them over gloo only, and NCCL's own collectives serve there). Tested against gloo's own
collectives and DDP's dense all-reduce: tests/test_ring_collectives.py, tests/test_embedding_rows.py.
"""

import json
import os

import torch
import torch.distributed as dist


class RingAllGather:
    """FSDP2's all-gather over gloo as a ring of point-to-point messages, straight into the
    gathered buffer: gloo's own `all_gather_into_tensor` is slower on CPU (docs/fsdp.md has the
    numbers). The values are the ones sent: the same result.

    FSDP2 calls it on every rank of `group` in the same order (one per block, forward and
    backward), as it calls its own collectives (all ranks participate). `input_tensor` is this rank's slot of
    `output_tensor` (FSDP2 copies the shards in there); the ring fills the other slots."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        """The ring (all ranks participate)."""
        world_size, rank = group.size(), group.rank()
        slots = output_tensor.view(world_size, -1)
        if input_tensor.data_ptr() != slots[rank].data_ptr():
            slots[rank].copy_(input_tensor.view(-1))
        after, before = (rank + 1) % world_size, (rank - 1) % world_size
        # Step k: pass on the slot received in step k - 1 (this rank's own in step 0).
        for k in range(world_size - 1):
            # (all ranks participate): each sends to the next rank, and receives from the one before
            sent = dist.isend(slots[(rank - k) % world_size], group=group, group_dst=after)
            # (all ranks participate)
            dist.irecv(slots[(rank - k - 1) % world_size], group=group, group_src=before).wait()
            sent.wait()
        return None  # done: FSDP2 waits only on a returned Work


class RingReduceScatter:
    """FSDP2's reduce-scatter over gloo as a ring of point-to-point messages. gloo has no
    reduce-scatter of one tensor: `reduce_scatter_tensor` all-reduces the whole input, which
    sends every rank's gradient to every rank, and then copies its part out. A ring sends each
    rank's part once (faster: docs/fsdp.md). Sum (or mean) of the same values: at world size 2
    bit for bit what the all-reduce gives (a + b); at more ranks the order of the additions
    differs, so the last bit may.

    Every rank of `group` calls it in the same order (all ranks participate): FSDP2 reduces block
    by block as backward reaches them. The input, FSDP2's own scratch copy of the gradients, is
    summed into in place."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        """The ring, or gloo's own for another op (all ranks participate)."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # a pre-multiplied sum: gloo's own
            return dist.reduce_scatter_tensor(  # (all ranks participate)
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        world_size, rank = group.size(), group.rank()
        parts = input_tensor.view(world_size, -1)
        received = torch.empty_like(parts[0])
        after, before = (rank + 1) % world_size, (rank - 1) % world_size
        # Step k: send part (rank - k - 1), summed over the k ranks before this one; receive
        # part (rank - k - 2) summed likewise, and add this rank's own. After world_size - 1
        # steps this rank holds part `rank` summed over all.
        for k in range(world_size - 1):
            # (all ranks participate): each sends to the next rank, and receives from the one before
            sent = dist.isend(parts[(rank - k - 1) % world_size], group=group, group_dst=after)
            dist.irecv(received, group=group, group_src=before).wait()  # (all ranks participate)
            sent.wait()
            mine = parts[(rank - k - 2) % world_size]
            if k == world_size - 2:
                torch.add(mine, received, out=output_tensor.view(-1))
            else:
                mine.add_(received)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world_size)
        return None


class EmbeddingRows:
    """The state of `all_reduce_embedding_rows`: which parameters are embedding tables."""

    def __init__(self, weights):
        self.ids = {id(weight) for weight in weights}


def all_reduce_embedding_rows(state, bucket):
    """DDP communication hook: the mean over ranks of a bucket of gradients, as DDP's own
    all-reduce computes it, but sending only the rows of an embedding table that some rank used.

    An embedding's gradient is non-zero only in the rows its batch looked up: a few hundred of
    a vocabulary's 30k (BERT) to 250k (XLM-R) rows, which are most of the model's weights. So
    the ranks first agree on the rows any of them touched (a max over a byte per row), then
    all-reduce those rows and the bucket's other gradients in one message. A row no rank
    touched is zero everywhere, and zero is its mean: the result is exactly the dense mean.
    Every rank calls the same collectives (all ranks participate): DDP hands the buckets over in
    the same order on all of them, and the number of rows sent is agreed before it is sent."""
    flat = bucket.buffer()
    parameters = bucket.parameters()
    if not any(id(p) in state.ids for p in parameters):
        flat.div_(dist.get_world_size())  # DDP's own order: divide, then sum
        # (all ranks participate): a bucket without tables, as DDP's own hook
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0])
    pieces, offset = [], 0  # (gradient, is an embedding), in the bucket's own order
    for p in parameters:
        grad = flat[offset : offset + p.numel()]
        offset += p.numel()
        pieces.append((grad.view(p.shape[0], -1), True) if id(p) in state.ids else (grad, False))
    mean_over_ranks(pieces)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def mean_over_ranks(pieces):
    """In place, the mean over ranks of each gradient in `pieces`, a list of (gradient, is an
    embedding table), sending of a table only the rows some rank used, in one message. Two
    all_reduces (all ranks participate), each rank passing the same shapes in the same order."""
    world_size = dist.get_world_size()
    # A row is used when any of its entries is non-zero (or NaN): when its largest or its
    # smallest entry is. Two min/max passes read the table at memory speed; `ne(0).any(1)`
    # writes a boolean per entry first, several times slower (docs/fsdp.md).
    used = torch.cat([grad.amax(1).ne(0) | grad.amin(1).ne(0) for grad, is_table in pieces if is_table]).to(
        torch.uint8
    )
    # (all ranks participate): a row any rank touched is sent by every rank
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    rows, start = [], 0
    for grad, is_table in pieces:
        if is_table:
            rows.append(used[start : start + grad.shape[0]].nonzero().squeeze(1))
            start += grad.shape[0]
        else:
            rows.append(None)
    message = torch.cat(
        [grad if r is None else grad.index_select(0, r).view(-1) for (grad, _), r in zip(pieces, rows)]
    )
    # Divided before the sum, as DDP does (the same numbers, bit for bit), but only what is sent:
    # the rows no rank used are zero, and stay so (all ranks participate).
    dist.all_reduce(message.div_(world_size))
    start = 0
    for (grad, _), r in zip(pieces, rows):
        if r is None:
            grad.copy_(message[start : start + grad.numel()])
            start += grad.numel()
        else:
            grad.index_copy_(0, r, message[start : start + r.numel() * grad.shape[1]].view(-1, grad.shape[1]))
            start += r.numel() * grad.shape[1]


def send_files_to_rank0(folder, paths, senders, chunk_bytes=64 * 2**20):
    """Rank 0 receives into `folder` the files `paths` of every rank r with senders[r] (ranks on
    another host, whose disk rank 0 cannot read), over the process group, `chunk_bytes` at a
    time: no rank holds more than one chunk. Every rank calls it with the same `senders`
    (all ranks participate): rank 0 and the senders exchange messages, the others return at once.
    Each sender passes its own `paths`."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    device = device or torch.device("cpu")
    for source in [r for r, sends in enumerate(senders) if sends and r != 0]:  # the same order on all
        # below: each send of the source meets one recv of rank 0, in order
        if rank == source:
            header = json.dumps({os.path.basename(p): os.path.getsize(p) for p in paths}).encode()
            dist.send(torch.tensor([len(header)], device=device), dst=0)  # (all ranks participate)
            # (all ranks participate)
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst=0)
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(chunk_bytes):
                        # (all ranks participate)
                        dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8).to(device), dst=0)
        elif rank == 0:
            length = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(length, src=source)  # (all ranks participate)
            header = torch.empty(int(length), dtype=torch.uint8, device=device)
            dist.recv(header, src=source)  # (all ranks participate)
            for name, size in json.loads(bytes(header.cpu().numpy())).items():
                with open(os.path.join(folder, name), "wb") as f:
                    for start in range(0, size, chunk_bytes):
                        chunk = torch.empty(min(chunk_bytes, size - start), dtype=torch.uint8, device=device)
                        dist.recv(chunk, src=source)  # (all ranks participate)
                        f.write(chunk.cpu().numpy().tobytes())
