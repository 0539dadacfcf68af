"""DDP's all-reduce sends only the embedding rows some rank used (sharding.wrap_model's
communication hook, sharding.all_reduce_embedding_rows), and the gradients it leaves are the
dense mean over ranks, the one DDP's own all-reduce gives. The same under FSDP2's shard_grad_op,
which leaves the trainable embedding tables whole on every rank, out of its collectives
(sharding.wrap_fsdp2), and averages their gradients by the rows used once a step
(sharding.all_reduce_replicated); its other weights (and a frozen table) stay sharded.

Two gloo processes, each with its own token ids: rows only rank 0 used, rows only rank 1 used,
rows both used, and rows neither used. The reference is independent of DDP: each rank's
gradient computed by a plain model copy, gathered and averaged by hand. Three steps: the first
runs DDP's initial bucket (every parameter in one), the later ones the buckets it rebuilds, and
the second accumulates two micro-batches under no_sync. Some rows get a gradient with a single
non-zero entry, negative in some rows and positive in others: a row is used when its largest
*or* its smallest entry is non-zero, and a scan that looked at one of them only would miss those.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_embed import sharding  # noqa: E402
from conftest import exit_without_teardown, warm_run  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

VOCAB, DIM = 5000, 16
TABLES = ["positions.weight", "words.weight"]  # the trainable embedding tables of Tiny


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.words = torch.nn.Embedding(VOCAB, DIM)
        self.positions = torch.nn.Embedding(8, DIM)
        self.frozen = torch.nn.Embedding(50, DIM)  # no gradient: never in a bucket
        self.frozen.weight.requires_grad_(False)
        self.mix = torch.nn.Linear(DIM, DIM)

    def forward(self, ids):
        x = self.words(ids) + self.positions(torch.arange(ids.shape[1])) + self.frozen(ids % 50)
        # Rows 4000-4099 and 4500-4599 (never in ids), chosen by rank and step: the gradient of a
        # row 4000 + k is negative in entry 0 and zero elsewhere (its largest entry is 0), that
        # of a row 4500 + k positive in entry 1 and zero elsewhere (its smallest entry is 0).
        one_signed = (
            self.words(ids[:1, :2] % 500 + 4000)[..., 0].sum()
            - self.words(ids[:1, 2:4] % 500 + 4500)[..., 1].sum()
        )
        return torch.tanh(self.mix(x)).pow(2).sum() - one_signed


def batch(rank, step, micro):
    """Token ids: 0-99 shared by both ranks, 1000-1999 rank 0's own, 2000-2999 rank 1's own;
    nothing in 3000-3999 is ever used (Tiny adds its one-signed rows, 4000-4999)."""
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    shared = torch.randint(0, 100, (4, 4), generator=g)
    own = torch.randint(1000 * (rank + 1), 1000 * (rank + 2), (4, 4), generator=g)
    return torch.cat([shared, own], dim=1)


def worker(rank, folder):
    """One rank: writes what it found to FOLDER/rank{R}.json, then ends the process."""
    dist.init_process_group("gloo", rank=rank, world_size=2)  # MASTER_ADDR/PORT: the launcher's
    sent = []  # elements each all-reduce carried
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: sent.append(tensor.numel()) or all_reduce(tensor, *a, **k)
    found = {}
    for strategy in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        reference = Tiny()
        model = Tiny()
        model.load_state_dict(reference.state_dict())
        if strategy == "ddp":
            wrapped = sharding.wrap_model(model, "ddp", torch.device("cpu"))
        else:  # the root alone (Tiny has no repeated block), as wrap_model's FSDP2 does it
            wrapped = sharding.wrap_fsdp2(model, torch.device("cpu"), [], "shard_grad_op", None, False)
            found["whole"] = sorted(n for n, p in model.named_parameters() if not sharding.is_sharded(p))
        worst, sent_per_step = [0.0, 0.0], []  # [the other weights, the tables (words, positions)]
        for step, micro_batches in enumerate([1, 2, 1]):
            sent.clear()
            for micro in range(micro_batches):
                ids = batch(rank, step, micro)
                if strategy == "ddp" and micro < micro_batches - 1:
                    with wrapped.no_sync():
                        wrapped(ids).backward()
                else:
                    wrapped(ids).backward()
                reference(ids).backward()
            sharding.all_reduce_replicated(wrapped)  # FSDP2: the whole tables; DDP: nothing
            # The reference: each rank's own gradient, gathered, averaged by hand.
            for name, p in reference.named_parameters():
                if p.grad is None:
                    continue
                grads = [torch.empty_like(p.grad) for _ in range(2)]
                dist.all_gather(grads, p.grad)
                expected = (grads[0] + grads[1]) / 2
                got = dict(model.named_parameters())[name].grad
                got = got.full_tensor() if sharding.is_sharded(got) else got
                # relative to the gradient's scale (FSDP2 reduce-scatters `mix` in each micro-step:
                # the same sum in another order); the tables' are compared on their own below
                error = ((got - expected).abs().max() / expected.abs().max()).item()
                worst[name in TABLES] = max(worst[name in TABLES], error)
            sent_per_step.append(sum(sent))
            for m in (model, reference):
                for p in m.parameters():
                    p.grad = None
        found[strategy] = {"worst": worst, "sent": sent_per_step}
    found["dense"] = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(found))
    exit_without_teardown()  # no DDP or gloo teardown: see conftest


def test_ddp_and_fsdp2_send_only_used_embedding_rows_and_give_the_dense_mean(tmp_path):
    # This file at 2 ranks, started by the warm launcher (conftest.warm_run: torchrun's worker
    # environment); each rank writes what it found to rank{R}.json.
    warm_run([tmp_path], nproc=2, script=__file__, train_flags=False, timeout=300)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The tables: the mean each rank's own gradients give; the rest to float32's rounding.
        assert r["ddp"]["worst"][1] <= 1e-7 and r["fsdp2"]["worst"][1] <= 1e-7, r
        assert r["ddp"]["worst"][0] <= 1e-6 and r["fsdp2"]["worst"][0] <= 1e-6, r
        # At most the 2100 word rows any rank used in ids and the 16 one-signed rows (2 of each
        # kind per rank and micro-batch), of 5000; every other gradient; and the byte-per-row
        # agreement on which rows: far less than the dense gradient.
        most = 2116 * DIM + 8 * DIM + DIM * DIM + DIM + VOCAB + 8
        assert (
            len(r["ddp"]["sent"]) == 3
            and all(sent <= most for sent in r["ddp"]["sent"])
            and most < r["dense"]
        )
        # FSDP2: the tables alone are all-reduced (the rest is reduce-scattered), and only them.
        assert r["whole"] == TABLES, r
        tables = 2116 * DIM + 8 * DIM + VOCAB + 8
        assert len(r["fsdp2"]["sent"]) == 3 and all(0 < sent <= tables for sent in r["fsdp2"]["sent"]), r


if __name__ == "__main__":  # one rank of the test
    worker(int(os.environ["RANK"]), sys.argv[1])
