"""The run's plan: every value the run reads, from its flags, its data and its world, checked and
resolved once, here. The Config (config.py) stops at main() and here: every other file reads the
Plan, or the values main() hands it, and no helper changes a Plan, TrainSet or EvalSet it is given
(they are frozen; a fact found later, such as the sharding after the model loads, is a new record
made in main() with dataclasses.replace).

main() makes the Plan in two steps, each run on every rank and agreed on by collectives
(startup_checks.agreed), so bad input stops every rank with one message before any weights load:
  1. `flags_plan`: the flags (each field's bounds: config.check_field_rules, then the settings
     that involve several fields or the launch), their text read once (prompts, column lengths,
     Matryoshka sizes, MNRL directions, per-file settings, trackers, LoRA's names: config.py's
     parsers, which raise ValueError naming the flag); the model's files (model_checks.py) and the
     output folder;
  2. `data_plan`: the training and evaluation data (training_data.py), checked against the flags; the
     checkpoint a resume continues from (checkpoints.py; at another world size with its global
     batches kept: `resumed_batches`); every step's rows (batches.Schedule) and the counts that
     follow (total and warm-up steps, the Softmax head's classes).
main() prints `record(plan, loaded)`; every checkpoint and export saves it. bench/check_layout.py
fails when one of config.py's parsers is called anywhere but here, and when a function outside
config.py, run_plan.py and main() is handed the Config.

Needs config.py, training_data.py, batches.py, checkpoints.py, embedding_model.py (`ModelSpec`),
export.py (`max_shard_bytes`) and model_checks.py, all in fsdp_embed/: it is where the flags meet the
files, not a file to copy alone. Its whole copy set: eval_dist.py, fsdp_utils.py and, in fsdp_embed/,
batches.py, checkpoint_warnings.py, checkpoints.py, config.py, embedding_model.py, export.py,
faults.py, guide_model.py, inference_free.py, lora.py, model_card.py, model_checks.py, random_state.py,
shard_loading.py, sharding.py, splade.py, st_folder.py, token_cache.py, training_data.py.
"""

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from fsdp_embed import batches
from fsdp_embed import checkpoints
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import export
from fsdp_embed import model_checks
from fsdp_embed import training_data


@dataclass(frozen=True)
class LossPlan:
    """How one micro-batch's loss is computed from its column embeddings (__main__.embeddings_loss)."""

    name: str = "mnrl"  # config.LOSS_NAMES
    scale: float = 20.0  # MNRL's and CoSENT's inverse temperature
    matryoshka: tuple | None = None  # (dims, weights): the loss summed over truncated sizes
    directions: tuple = ("query_to_doc",)  # MNRL's (losses.MNRL_DIRECTIONS)
    partition: str = "joint"  # MNRL's softmax over all directions at once, or per direction
    temperatures: tuple = (1.0, 1.0)  # distill_kl's (student, teacher)
    gather: bool = False  # MNRL's candidates from every rank: a collective
    symmetric: bool = False  # MNRL also ranks the anchors for each positive
    own_negatives: bool = False  # MNRL against each row's own positive and hard negatives only
    false_negatives: tuple | None = None  # MNRL's (strategy, margin): candidates above it left out,
    # by the guide model's scores where the micro-batch brings them, else by the model's own
    hardness: tuple | None = None  # MNRL's (mode, strength): harder negatives weighted more
    idle_head: bool = False  # the model has a Softmax head that this loss leaves unused
    splade: dict | None = None  # a sparse model's SpladeLoss: its flags (splade.loss_arguments)
    multi_vector: str = ""  # ColBERT: token matrices scored by "maxsim" or "meanmaxsim" (multivector.py)


@dataclass(frozen=True)
class Plan:
    """What the run trains on and how: made once at start-up (flags_plan, data_plan), read by every
    helper, changed by none (main() makes the extended records: the sharding, who sees the output)."""

    # the launch and the flags (flags_plan)
    world_size: int
    device: object  # the torch.device this rank computes on
    strategy: str  # single, ddp or fsdp (--strategy auto resolved)
    global_batch: int  # rows an optimizer step, over all ranks and micro-steps
    grad_accum_steps: int  # micro-batches a step: the flag's, or what keeps a resumed run's global batch
    model: embedding_model.ModelSpec  # which model loads and how: path, pooling, lengths, prompts, LoRA
    matryoshka: tuple | None  # (dims, weights), or None
    mnrl: dict  # MNRL's directions and partition
    scale: float  # MNRL's and CoSENT's (config.loss_scales)
    gist: tuple | None  # MNRL's with --guide-model: (scale, contrast_anchors, contrast_positives)
    losses: list  # --loss: one name, one per --train-data file, or none (each file's columns)
    dataset_settings: dict  # --dataset-settings: {file stem: {setting: value}}
    report_tools: list  # --report-to's trackers, in order
    length_buckets: int  # forwards per micro-batch without packing; 0: chosen for each
    packing_refused: str  # why the flags rule packed rows out ("" : the model decides)
    cache_chunk_size: int  # GradCache's rows a chunk (0: off)
    mask_duplicates: bool  # MNRL leaves out candidates whose text is the positive's
    guide_model: str  # a frozen model's folder ("" : none): MNRL's false negatives
    teacher_model: str  # a frozen model's folder: --loss mse's targets
    precision: str  # fp32, bf16 or fp16
    tf32: str  # on: CUDA's fp32 matmuls may use TensorFloat-32 (process_settings.set_tf32)
    fsdp_version: int
    seed: int  # the data order, grouped rows' draws and new heads' initialisation
    tokenize: str  # on_the_fly, or once (a token file per set)
    tokenize_workers: int  # processes that tokenize on the fly (0: the reader thread)
    train_data: str  # --train-data as given, for messages
    output_dir: str
    overwrite: bool  # start over: an earlier run's checkpoints go
    save_steps: int  # a checkpoint every N steps (0: none)
    eval_only: bool  # evaluate --model, train nothing
    eval_batch_size: int
    metric_for_best: str  # the metric whose best value keeps best/ ("" : none)
    save_total_limit: int  # checkpoints kept (0: all)
    export_dtype: str
    export_max_shard_bytes: int  # --export-max-shard-size in bytes
    export_adapter: bool  # also write the LoRA adapters for peft
    flags: dict  # the Config as given (dataclasses.asdict): printed, saved with each checkpoint and export
    layer_classes: list | None = None  # the FSDP block classes (model_checks.py), None when not sharding
    sharding: str = ""  # FSDP's --sharding; main() replaces "auto" with what the ranks agree on
    # the data (data_plan)
    # training_data.TrainSet, each with its LossPlan
    train_sets: list = dataclasses.field(default_factory=list)
    eval_sets: list = dataclasses.field(default_factory=list)  # training_data.EvalSet
    schedule: object = ()  # batches.Schedule: every step's (epoch, set index, rows), drawn an epoch at a time
    total_steps: int = 0
    warmup_steps: int = 0
    steps_per_epoch: int = 0
    num_labels: int = 0  # classes of the Softmax head (0: none)
    data_fingerprint: str = ""  # row counts and hashes of the training data: a resume refuses other data
    resume_dir: str | None = None  # the checkpoint this run continues from
    resume_note: str = ""  # what resumed_batches changed to keep its global batch, for the log
    finished: bool = False  # --output-dir already holds this run's export
    # the output folder: added once the ranks agreed (startup_checks.agreed_plan_locking_output)
    sees_output_dir: tuple = (True,)  # by rank: whether it sees rank 0's disk


# ----------------------------------------------------------------------------------------------
# Step 1: the flags and the launch


def flags_plan(cfg, world_size, device):
    """Step 1, no collective: every check of the flags, the model's files and the output folder;
    returns the Plan of the flags and the launch. Raises ValueError naming the flag."""
    config.check_field_rules(cfg)
    check_launch(cfg, world_size, device)
    plan = resolve_flags(cfg, world_size, device)  # a flag's bad text raises here
    unknown = [name for name in plan.losses if name not in config.LOSS_NAMES]
    if unknown:
        raise ValueError(
            f"--loss {cfg.loss}: unknown {unknown}; choose from {', '.join(config.LOSS_NAMES)} "
            "(one, or one per --train-data file)"
        )
    check_run_mode_flags(cfg, plan)
    checkpoints.check_output_dir(cfg.output_dir)
    if cfg.eval_only:
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path) and not cfg.overwrite:
            raise ValueError(
                f"{metrics_path} already exists; pass --overwrite to replace it, or another --output-dir"
            )
    layer_classes, folder = model_checks.check_model(plan.model, plan)  # the model's folder, read once
    if plan.guide_model or plan.teacher_model:
        model_checks.check_frozen_models(plan)
    model = dataclasses.replace(plan.model, folder=folder)
    if model.sparse:  # SPLADE: a masked-LM head, and no option SpladeLoss does not take here
        model_checks.check_sparse(model, plan)
        model_checks.check_inference_free(model, plan)  # and its static queries
    elif model.multi_vector or folder["pooling"] == "multivector":  # ColBERT: a layout read here
        model_checks.check_multi_vector(model, plan)
    if not model.sparse and (splade_flags := model_checks.flags_given(plan, model_checks.SPLADE_FLAGS)):
        raise ValueError(
            f"{splade_flags[0]} is a SPLADE setting, and --model {model.path} does not train SPLADE; "
            "drop it, or pass --pooling splade with a masked-LM model"
        )
    return dataclasses.replace(plan, model=model, layer_classes=layer_classes)


def resolve_flags(cfg, world_size, device):
    """The Plan of the flags and the launch, each flag's text read once. ValueError: a flag's bad text."""
    strategy = cfg.strategy if cfg.strategy != "auto" else "ddp"
    if world_size == 1:
        strategy = "single"  # one process: nothing to synchronise or shard
    packing_refused = ""
    if cfg.packing == "off" or cfg.length_buckets or cfg.cache_chunk_size:
        packing_refused = (
            "--packing off" if cfg.packing == "off" else "--length-buckets or --cache-chunk-size set"
        )
    return Plan(
        world_size=world_size,
        device=device,
        strategy=strategy,
        global_batch=cfg.per_device_batch_size * world_size * cfg.grad_accum_steps,
        grad_accum_steps=cfg.grad_accum_steps,
        model=model_spec(cfg),
        matryoshka=config.matryoshka_sizes(cfg) if cfg.matryoshka_dims or cfg.matryoshka_weights else None,
        mnrl=config.mnrl_options(cfg),
        **config.loss_scales(cfg),
        losses=[name.strip() for name in cfg.loss.split(",")] if cfg.loss else [],
        dataset_settings=config.dataset_settings_of(cfg) if cfg.dataset_settings else {},
        report_tools=config.report_tools(cfg) if cfg.report_to else [],
        # Under FSDP every rank must run as many forwards (each is a collective): one.
        length_buckets=cfg.length_buckets or (1 if strategy == "fsdp" else 0),
        packing_refused=packing_refused,
        cache_chunk_size=cfg.cache_chunk_size,
        mask_duplicates=cfg.mask_duplicates,
        guide_model=cfg.guide_model,
        teacher_model=cfg.teacher_model,
        precision=cfg.precision,
        tf32=cfg.tf32,
        fsdp_version=cfg.fsdp_version,
        seed=cfg.seed,
        tokenize=cfg.tokenize,
        tokenize_workers=batches.tokenize_workers(cfg.tokenize_workers, device),
        train_data=cfg.train_data,
        output_dir=cfg.output_dir,
        overwrite=cfg.overwrite,
        save_steps=cfg.save_steps,
        eval_only=cfg.eval_only,
        eval_batch_size=cfg.eval_batch_size,
        metric_for_best=cfg.metric_for_best,
        save_total_limit=cfg.save_total_limit,
        export_dtype=cfg.export_dtype,
        export_max_shard_bytes=export.max_shard_bytes(cfg.export_max_shard_size),
        export_adapter=cfg.export_adapter,
        flags=dataclasses.asdict(cfg),
        sharding=cfg.sharding,
    )


def model_spec(cfg):
    """The student's ModelSpec (embedding_model.py): which model loads, and how."""
    max_seq_length, column_lengths = config.column_lengths(cfg)
    return embedding_model.ModelSpec(
        path=cfg.model,
        trust_remote_code=cfg.trust_remote_code,
        pooling=cfg.pooling,
        normalize=cfg.normalize,
        include_prompt=cfg.include_prompt,
        append_eos=cfg.append_eos,
        bidirectional=cfg.bidirectional,
        dropout=cfg.dropout,
        max_seq_length=max_seq_length,
        column_lengths=column_lengths,
        prompts=config.prompts_of(cfg) if cfg.prompts else {},
        lora_rank=cfg.lora_rank,
        lora_alpha=config.lora_alpha(cfg),
        lora_dropout=cfg.lora_dropout,
        lora_leaf_names=tuple(config.lora_leaf_names(cfg)),
        activation_checkpointing=cfg.activation_checkpointing,
        fsdp_layer_cls=cfg.fsdp_layer_cls,
        splade=(cfg.splade_pooling_strategy, cfg.splade_activation_function, cfg.splade_chunk_size),
        static_queries=(cfg.inference_free_queries, cfg.idf_file),
    )


def check_launch(cfg, world_size, device):
    """The settings that involve the launch or the machine: the strategy for this many processes,
    bf16 on this GPU, something to train."""
    if cfg.strategy == "single" and world_size > 1:
        raise ValueError(
            f"--strategy single with {world_size} processes would train {world_size} unrelated models; "
            "use --strategy ddp"
        )
    if cfg.strategy == "fsdp" and cfg.sharding == "no_shard" and cfg.fsdp_version == 2:
        raise ValueError(
            "--sharding no_shard has no FSDP2 form (FSDP2 is the default --fsdp-version); "
            "use --strategy ddp (the same thing) or --fsdp-version 1"
        )
    if device.type == "cuda" and cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "--precision bf16: this GPU has no bf16 support (it needs Ampere or newer); use --precision fp16"
        )
    if cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs} trains nothing; use --epochs 1 or more, or --max-steps")


def check_run_mode_flags(cfg, plan):
    """The flags that choose what the run does: resume or overwrite, evaluate only or first;
    --resume PATH must name a complete checkpoint."""
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues a run and --overwrite starts it over: choose one")
    if cfg.export_adapter and not cfg.lora_rank:
        raise ValueError(
            "--export-adapter writes LoRA adapters, and there are none without --lora-rank R; "
            "pass one, or drop --export-adapter"
        )
    if (cfg.eval_only or cfg.eval_on_start) and not cfg.eval_data:
        raise ValueError(
            f"--{'eval-only' if cfg.eval_only else 'eval-on-start'} evaluates on "
            "--eval-data FILE[,FILE]; pass one"
        )
    if cfg.eval_only and cfg.resume:
        raise ValueError(
            "--eval-only evaluates --model and trains nothing, so --resume has nothing to continue: drop one"
        )
    if cfg.resume not in ("", "auto") and (problem := checkpoints.checkpoint_problem(cfg.resume)):
        raise ValueError(
            f"--resume {cfg.resume}: not a complete checkpoint ({problem}); "
            "pass a complete OUTPUT_DIR/checkpoints/step-N folder, or --resume auto, "
            "which takes the newest complete one"
        )


# ----------------------------------------------------------------------------------------------
# Step 2: the data and every step's rows


def data_plan(cfg, plan):
    """Step 2, no collective: the training and evaluation data read and checked against the flags,
    the checkpoint to continue from, every step's rows. Returns the Plan with its data (a new one:
    add_train_sets, add_schedule). Raises ValueError."""
    if cfg.eval_only:  # no training data, no checkpoints: the evaluation data
        return add_schedule(plan, cfg, [], 0, checked_eval_sets(cfg, plan, []), "")
    train_sets = training_data.load_train_sets(
        cfg.train_data.split(","),
        cfg.train_split,
        cfg.train_subset,
        cfg.group_size,
        cfg.per_device_batch_size,
        plan.losses,
        plan.dataset_settings,
        plan.model.prompts,
    )
    # One set: 'N rows, sha256 H', as before several sets could train together.
    fingerprint = "; ".join(training_data.data_fingerprint(ts.ds, ts.read_columns) for ts in train_sets)
    before_arrow = lambda: "; ".join(  # noqa: E731
        training_data.fingerprint_before_arrow(ts.ds, ts.read_columns) for ts in train_sets
    )
    resume_dir = checkpoints.checkpoint_to_resume(
        cfg.output_dir, cfg.resume, cfg.overwrite, plan.flags, fingerprint, before_arrow
    )
    if resume_dir == "finished":
        return dataclasses.replace(plan, finished=True)
    note = ""
    if resume_dir is not None:  # at another world size too: the checkpoint's global batches kept
        saved = checkpoints.saved_state(resume_dir)
        plan = dataclasses.replace(plan, **config.loss_scales(cfg, saved["config"]))  # as it was written
        plan, train_sets, note = resumed_batches(plan, cfg, train_sets, saved)
    check_losses(cfg, plan, train_sets)
    plan = add_train_sets(plan, cfg, train_sets)
    for ts in plan.train_sets:
        if len(ts.ds) < ts.global_batch:
            raise ValueError(
                f"--train-data {ts.name}: {len(ts.ds)} rows make no global batch of {ts.global_batch} "
                f"(= {ts.per_device_batch_size} per device x {plan.world_size} processes x "
                f"{plan.grad_accum_steps} accumulation); lower --per-device-batch-size"
            )
    schedule = batches.Schedule(
        plan.train_sets, cfg.seed, cfg.epochs, cfg.max_steps, cfg.mix, cfg.batch_sampler == "no_duplicates"
    )
    steps_per_epoch = len(schedule.set_orders[0])
    eval_sets = checked_eval_sets(cfg, plan, train_sets)
    plan = add_schedule(plan, cfg, schedule, steps_per_epoch, eval_sets, fingerprint)
    return dataclasses.replace(plan, resume_dir=resume_dir, resume_note=note)


def checked_eval_sets(cfg, plan, train_sets):
    """--eval-data's sets (training_data.load_eval_sets), checked with the training sets against the
    flags: their metric names and --metric-for-best, mse targets, the keys of --prompts and
    --max-seq-length. Each check only where its flag or its data is there."""
    eval_sets = []
    if cfg.eval_data or cfg.metric_for_best:
        eval_sets = training_data.load_eval_sets(
            cfg.eval_data, cfg.eval_type, cfg.eval_only, plan.losses, plan.num_labels
        )
        training_data.check_eval_names(eval_sets, plan.matryoshka, cfg.metric_for_best)
        check_target_vectors(plan.model, eval_sets, "--eval-data")
        model_checks.check_model_evaluation(plan.model, eval_sets)  # ColBERT's
    if plan.model.prompts or plan.model.column_lengths or plan.dataset_settings:
        check_prompt_columns(plan, train_sets, eval_sets)
    return eval_sets


def check_losses(cfg, plan, train_sets):
    """The flags that need a loss, against the losses the files train with."""
    losses_used = sorted({ts.loss for ts in train_sets})
    model_checks.check_model_losses(plan.model, losses_used, cfg.gather_negatives)  # SPLADE's, ColBERT's
    if (cfg.gather_negatives or cfg.symmetric or cfg.mask_duplicates) and "mnrl" not in losses_used:
        names = ("gather_negatives", "symmetric", "mask_duplicates")
        flag = "--" + next(name for name in names if getattr(cfg, name)).replace("_", "-")
        raise ValueError(
            f"{flag} works on MNRL's candidates, and no --train-data file trains with mnrl "
            f"(losses: {', '.join(losses_used)})"
        )
    given = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}  # not defaults
    false_negative_flags = ("false_negative_margin", "guide_model", "guide_margin", "guide_margin_strategy")
    if given & {*false_negative_flags, "hardness_mode", "contrast_anchors", "contrast_positives"}:
        check_false_negative_flags(cfg, losses_used)
    directions = config.gist_directions(plan.mnrl["directions"], plan.gist)
    if len(directions) > 1:
        check_mnrl_directions(cfg, plan, losses_used, directions)
    if cfg.teacher_model or "mse" in losses_used:
        check_distillation(cfg, plan, train_sets)
    if cfg.matryoshka_dims and "softmax" in losses_used:
        raise ValueError(
            "--matryoshka-dims: the Softmax head reads embeddings of one fixed size, "
            "so it cannot train truncated ones; "
            "use --loss mnrl, cosent, margin_mse or distill_kl"
        )
    grouped = [ts.name for ts in train_sets if ts.group_size]
    if grouped and cfg.batch_sampler == "no_duplicates":
        raise ValueError(
            f"--batch-sampler no_duplicates: the grouped rows of {', '.join(grouped)} draw their texts each "
            "step, so no batch can be checked in advance; use --mask-duplicates (mnrl) instead"
        )
    for ts in train_sets:
        if cfg.cache_chunk_size or ts.name in plan.dataset_settings:
            check_set_settings(cfg, ts)
        candidates = (
            ts.per_device_batch_size
            * (plan.world_size if cfg.gather_negatives and not ts.own_negatives else 1)
            * (len(ts.text_columns) - 1)
        )
        if ts.loss == "mnrl" and candidates == 1:
            raise ValueError(
                "--loss mnrl with one row per micro-batch and no hard-negative column ranks each anchor "
                "against its own positive alone: the loss is 0 and nothing trains. "
                "Raise --per-device-batch-size, add a negative column, or use --gather-negatives"
            )


def check_mnrl_directions(cfg, plan, losses_used, directions):
    """More MNRL `directions` than query_to_doc (--mnrl-directions, and --guide-model's blocks): an
    mnrl file to train, and the flags they combine with."""
    named = f"--mnrl-directions {','.join(directions)}"
    if directions != plan.mnrl["directions"]:
        named += " (--guide-model's blocks; --no-contrast-anchors --no-contrast-positives leave them out)"
    if "mnrl" not in losses_used:
        raise ValueError(
            "--mnrl-directions needs a --train-data file that trains with mnrl "
            f"(losses: {', '.join(losses_used)})"
        )
    if cfg.symmetric or cfg.mask_duplicates:
        flag = (
            "--symmetric (use --mnrl-directions query_to_doc,doc_to_query)"
            if cfg.symmetric
            else "--mask-duplicates"
        )
        raise ValueError(f"{named} does not combine with {flag}")
    if cfg.mnrl_partition == "per_direction" and not set(directions) <= {"query_to_doc", "doc_to_query"}:
        raise ValueError(
            f"{named}: --mnrl-partition per_direction needs every direction's candidates to hold the "
            "positive pair: query_to_query, doc_to_doc and positive_to_positive never do; use "
            "--mnrl-partition joint"
        )


def check_false_negative_flags(cfg, losses_used):
    """--false-negative-margin, --guide-model and --hardness-mode: an mnrl file that ranks against
    other rows; one rule for the false negatives; the guide's margin only with a guide."""
    flags = ["--false-negative-margin"] if cfg.false_negative_margin is not None else []
    flags += ["--guide-model"] if cfg.guide_model else []
    if len(flags) == 2:
        raise ValueError(
            "--false-negative-margin leaves out what the model itself scores above the positive, "
            "--guide-model what the guide does: choose one"
        )
    guide_flags = (cfg.guide_margin, cfg.guide_margin_strategy) != (0.0, "absolute")
    if guide_flags and not cfg.guide_model:
        raise ValueError(
            "--guide-margin and --guide-margin-strategy set the guide's rule; pass --guide-model"
        )
    if (cfg.contrast_anchors, cfg.contrast_positives) != (None, None) and not cfg.guide_model:
        raise ValueError(
            "--contrast-anchors and --contrast-positives switch --guide-model's blocks (GISTEmbedLoss's); "
            "pass --guide-model, or without one use --mnrl-directions query_to_query,positive_to_positive"
        )
    flags += ["--hardness-mode"] if cfg.hardness_mode else []
    if flags and "mnrl" not in losses_used:
        raise ValueError(
            f"{flags[0]} needs a --train-data file that trains with mnrl (losses: {', '.join(losses_used)})"
        )
    if cfg.hardness_mode and cfg.hardness_strength == 0:
        raise ValueError(
            f"--hardness-mode {cfg.hardness_mode} with --hardness-strength 0 weights nothing; "
            "set a strength above 0"
        )


def check_distillation(cfg, plan, train_sets):
    """--loss mse's targets: each mse file's 'embedding' (or 'label') column or --teacher-model, not
    both; every row's vector finite and as wide as the model's embeddings."""
    mse_sets = [ts for ts in train_sets if ts.loss == "mse"]
    if cfg.teacher_model and not mse_sets:
        raise ValueError(
            "--teacher-model computes --loss mse's targets, and no --train-data file trains with mse "
            f"(losses: {', '.join(sorted({ts.loss for ts in train_sets}))}); pass --loss mse"
        )
    for ts in mse_sets:
        where = f"--train-data {ts.name}"
        if ts.target is None and not cfg.teacher_model:
            raise ValueError(
                f"{where}: --loss mse needs each row's target: an 'embedding' column with the teacher's "
                "vector, or --teacher-model to compute it"
            )
        if ts.target is not None and cfg.teacher_model:
            raise ValueError(
                f"{where} holds the targets ({ts.target!r}) and --teacher-model computes them: drop one"
            )
    check_target_vectors(plan.model, mse_sets, "--train-data")


def check_target_vectors(spec, sets, flag):
    """Each mse set's target column (training, or evaluation scored by its loss) holds, in every row,
    as many finite numbers as the model's embeddings have: the teacher's embedding."""
    width = None
    for ts in sets:
        if ts.loss != "mse" or ts.target is None:
            continue
        width = width or model_checks.model_width(spec)
        for start, values in training_data.windows(ts.ds, ts.target):
            if (i := training_data.bad_score_list(values, width)) is not None:
                raise ValueError(
                    f"{flag} {ts.name}: row {start + i} has {ts.target} = {str(values[i].as_py())[:80]}; "
                    f"--loss mse needs a list of {width} finite numbers, the teacher's embedding "
                    f"({spec.path}'s width)"
                )


def check_set_settings(cfg, ts):
    """A training set's own settings (--dataset-settings), against its loss and columns."""
    if cfg.cache_chunk_size > ts.per_device_batch_size:
        raise ValueError(
            f"--cache-chunk-size {cfg.cache_chunk_size} must be between 1 and the per-device batch size "
            f"({ts.per_device_batch_size}, {ts.name}'s); 0 turns GradCache off"
        )
    if ts.own_negatives and (ts.loss != "mnrl" or len(ts.text_columns) < 3):
        raise ValueError(
            f"--dataset-settings {ts.name}: own_negatives ranks each anchor against its own positive and "
            f"hard negatives, so it needs --loss mnrl and a negative column (it has {ts.loss}, columns "
            f"{ts.text_columns})"
        )
    if ts.weight != 1 and cfg.mix == "round_robin":
        raise ValueError(
            f"--dataset-settings {ts.name}: a weight sets its share of a proportional mix; "
            "--mix round_robin takes the sets in turn (use --mix proportional)"
        )


def check_prompt_columns(plan, train_sets, eval_sets):
    """Every --prompts (and --max-seq-length) key names a text column of some training or
    evaluation file: a typo would otherwise train without the prompt (the length), silently."""
    columns = sorted(
        {c for s in train_sets for c in s.prompt_columns} | {c for s in eval_sets for c in s.text_columns}
    )
    for flag, keys in (
        ("--prompts", plan.model.prompts),
        ("--max-seq-length", plan.model.column_lengths),
    ):
        for column in keys:
            if column not in columns:
                raise ValueError(
                    f"{flag}: {column!r} is no text column of --train-data or --eval-data "
                    f"(they have: {', '.join(columns)}); key each by the column it is for"
                )
    for ts in train_sets:
        for column in plan.dataset_settings.get(ts.name, {}).get("prompts", {}):
            if column not in ts.prompt_columns:
                raise ValueError(
                    f"--dataset-settings {ts.name}: prompts names {column!r}, no text column of its file "
                    f"(it has: {', '.join(dict.fromkeys(ts.prompt_columns))})"
                )


def add_train_sets(plan, cfg, train_sets):
    """The training sets (training_data.load_train_sets), each with its global batch and LossPlan,
    and the Softmax head's classes (at most one set has them)."""
    num_labels = max((ts.num_labels for ts in train_sets), default=0)
    train_sets = [
        dataclasses.replace(
            ts,
            global_batch=ts.per_device_batch_size * plan.world_size * plan.grad_accum_steps,
            loss_plan=loss_plan(plan, cfg, ts.loss, ts.own_negatives, num_labels, cfg.gather_negatives),
        )
        for ts in train_sets
    ]
    return dataclasses.replace(plan, train_sets=train_sets, num_labels=num_labels)


def resumed_batches(plan, cfg, train_sets, saved):
    """The accumulation and each set's per-device batch of a run resuming from a checkpoint whose
    trainer state is `saved` (its config, and the plan `record` it was written with): each set's
    global batch must stay the checkpoint's, so every step ahead takes the rows the unbroken run
    would have taken. Returns (the Plan with its grad_accum_steps, the TrainSets with their
    per_device_batch_size, a line saying what changed, or ""). Raises ValueError naming values
    that keep the global batch.

    The flags are kept when they give the checkpoint's global batches at this world size. The same
    command at another world size (an elastic restart on fewer or more hosts) starts from what the
    checkpoint used and scales one of the two by (its world / this world): with --gather-negatives
    the per-device batch first (the gathered batch each loss sees stays the same, so the run
    continues exactly), else the accumulation first (each micro-batch stays the same); the other
    where the first gives no whole number."""
    world, accum, saved_sets = saved_batches(saved)
    wanted = [s["global_batch"] for s in saved_sets]

    def global_batches(per_device, accumulation):
        return [b * plan.world_size * accumulation for b in per_device]

    flags = [ts.per_device_batch_size for ts in train_sets]
    choice = None
    if global_batches(flags, cfg.grad_accum_steps) == wanted:
        choice = flags, cfg.grad_accum_steps
    same_command = (cfg.per_device_batch_size, cfg.grad_accum_steps) == (
        saved["config"]["per_device_batch_size"],
        saved["config"].get("grad_accum_steps", 1),
    )
    if choice is None and same_command and plan.world_size != world:
        used = [s["per_device_batch_size"] for s in saved_sets]
        options = [
            ([b * world // plan.world_size for b in used], accum),  # per-device batch scaled
            (used, accum * world // plan.world_size),  # accumulation scaled
        ]
        for per_device, accumulation in options[:: 1 if cfg.gather_negatives else -1]:
            if (
                accumulation >= 1
                and min(per_device) >= 1
                and global_batches(per_device, accumulation) == wanted
            ):
                choice = per_device, accumulation
                break
    if choice is None:
        given = global_batches(flags, cfg.grad_accum_steps)
        raise ValueError(
            other_global_batch(plan, cfg, saved, given, same_command and plan.world_size != world)
        )
    per_device, accumulation = choice
    note = resume_note(plan, cfg, saved, per_device, accumulation)
    train_sets = [dataclasses.replace(ts, per_device_batch_size=b) for ts, b in zip(train_sets, per_device)]
    global_batch = per_device[0] * plan.world_size * accumulation
    plan = dataclasses.replace(plan, grad_accum_steps=accumulation, global_batch=global_batch)
    return plan, train_sets, note


def resume_note(plan, cfg, saved, per_device, accumulation):
    """The log line of a resume whose batches differ from the flags' or the checkpoint's, or ""."""
    world, _, saved_sets = saved_batches(saved)
    note = ""
    if per_device != [ts["per_device_batch_size"] for ts in saved_sets] or world != plan.world_size:
        note = (
            f"resuming at {plan.world_size} processes (the checkpoint: {world}): per-device batch "
            f"{', '.join(map(str, per_device))}, accumulation {accumulation}, global batch "
            f"{', '.join(str(s['global_batch']) for s in saved_sets)} as before"
        )
    # The rows one loss sees together (its in-batch negatives): a micro-batch, or with gathered
    # negatives every rank's. Kept, the run continues exactly; else the same rows, grouped anew.
    ranks = (plan.world_size, world) if cfg.gather_negatives else (1, 1)
    seen = [(b * ranks[0], s["per_device_batch_size"] * ranks[1]) for b, s in zip(per_device, saved_sets)]
    if any(now != before for now, before in seen):
        note += (
            f"{'; ' if note else ''}note: each loss now sees {seen[0][0]} rows together where it saw "
            f"{seen[0][1]}: the same rows, other in-batch negatives"
        )
    return note


def saved_batches(saved):
    """(world size, accumulation, [{per_device_batch_size, global_batch} of each set]) of a saved
    trainer state; a checkpoint written before these were recorded: from its config."""
    world = saved["world_size"]
    accum = saved.get("grad_accum_steps_used", saved["config"].get("grad_accum_steps", 1))
    per_device = saved["config"]["per_device_batch_size"]
    default = [{"per_device_batch_size": per_device, "global_batch": per_device * world * accum}]
    return world, accum, saved.get("train_sets") or default


def other_global_batch(plan, cfg, saved, given, elastic):
    """resumed_batches' refusal: the checkpoint's global batches, and values that keep them.
    `elastic`: the same command at another world size, which no whole number could adjust."""
    world, accum, saved_sets = saved_batches(saved)
    wanted = ", ".join(str(s["global_batch"]) for s in saved_sets)
    saved_as = ", ".join(
        f"{s['global_batch']} ({s['per_device_batch_size']} per device x {world} processes x "
        f"{accum} accumulation)"
        for s in saved_sets
    )
    if elastic:
        why = (
            f"no whole per-device batch or accumulation gives the global batch {wanted} at "
            f"{plan.world_size} processes"
        )
    else:
        why = (
            f"--per-device-batch-size {cfg.per_device_batch_size} and --grad-accum-steps "
            f"{cfg.grad_accum_steps} give global batch {', '.join(map(str, given))}, and another global "
            "batch would take other rows"
        )
    return (
        f"cannot resume from a checkpoint with global batch {saved_as} at {plan.world_size} processes: "
        f"{why}. Pass values whose per-device batch x accumulation x {plan.world_size} "
        f"processes is {wanted}, resume at {world} processes, or start a fresh --output-dir"
    )


def add_schedule(plan, cfg, schedule, steps_per_epoch, eval_sets, fingerprint):
    """Every step's rows (batches.Schedule), the steps they make, and the
    evaluation sets (training_data.load_eval_sets), each scored by --eval-type loss with its LossPlan."""
    eval_sets = [  # the training loss, of one rank's rows at a time: nothing gathered, no guide
        dataclasses.replace(
            es, loss_plan=loss_plan(plan, cfg, es.loss, False, plan.num_labels, gather=False, guided=False)
        )
        for es in eval_sets
    ]
    total_steps = len(schedule)
    return dataclasses.replace(
        plan,
        eval_sets=eval_sets,
        schedule=schedule,
        total_steps=total_steps,
        warmup_steps=math.ceil(cfg.warmup_ratio * total_steps),
        steps_per_epoch=steps_per_epoch,
        data_fingerprint=fingerprint,
    )


def loss_plan(plan, cfg, name, own_negatives, num_labels, gather, guided=True):
    """The LossPlan of a set that trains (or is scored) with loss `name`; `guided`: with the
    --guide-model's rule (its embeddings come with each micro-batch: __main__.forward_backward)."""
    false_negatives, scale, directions = None, plan.scale, plan.mnrl["directions"]
    if (plan.model.sparse or plan.model.multi_vector) and cfg.scale is None:
        # sentence-transformers' Sparse and MultiVector MNRL's: scores (dot products of sparse vectors,
        scale = 1.0  # MaxSim's sums over query tokens) that are not bounded by 1
    if cfg.guide_model and guided and name == "mnrl":  # GISTEmbedLoss's scale and blocks
        false_negatives = (cfg.guide_margin_strategy, cfg.guide_margin)
        scale, directions = plan.gist[0], config.gist_directions(directions, plan.gist)
    elif cfg.false_negative_margin is not None:
        # the model's own scores, no guide: s_ij > s_i+ + M is strategy "absolute" with margin -M
        false_negatives = ("absolute", -cfg.false_negative_margin)
    # SpladeLoss's flags by name (splade.loss_arguments), its FLOPS over every rank's rows in training
    splade_flags = {f: getattr(cfg, f) for f in model_checks.SPLADE_FLAGS} | {"over_ranks": guided}
    if plan.model.inference_free and not model_checks.flags_given(plan, ["query_regularizer_weight"]):
        splade_flags["query_regularizer_weight"] = 0  # the recipe's: static queries, no regulariser
    return LossPlan(
        name=name,
        scale=scale,
        matryoshka=plan.matryoshka,
        directions=directions,
        partition=plan.mnrl["partition"],
        temperatures=(cfg.student_temperature, cfg.teacher_temperature),
        gather=gather and not own_negatives,
        symmetric=cfg.symmetric,
        own_negatives=own_negatives,
        idle_head=num_labels > 0 and name != "softmax",
        false_negatives=false_negatives,
        hardness=(cfg.hardness_mode, cfg.hardness_strength) if cfg.hardness_mode else None,
        splade=splade_flags if plan.model.sparse else None,
        multi_vector=plan.model.multi_vector,
    )


def record(plan, loaded=None):
    """What the run derived, as rank 0 prints it at start and every checkpoint and export saves it
    beside the config; `loaded` (embedding_model.LoadedModel) adds what the model decided."""
    values = {
        "world_size": plan.world_size,
        "strategy_used": plan.strategy,
        "fsdp_layer_classes": plan.layer_classes,
        "sharding_used": plan.sharding if plan.strategy == "fsdp" else None,
        "device": str(plan.device),
        "global_batch": plan.global_batch,
        "grad_accum_steps_used": plan.grad_accum_steps,
        "train_rows": sum(len(ts.ds) for ts in plan.train_sets),
        "train_data_fingerprint": plan.data_fingerprint,
        "steps_per_epoch": plan.steps_per_epoch,
        "total_steps": plan.total_steps,
        "warmup_steps": plan.warmup_steps,
        "tokenize_workers_used": plan.tokenize_workers,  # --tokenize-workers resolved (batches.py)
    }
    if loaded is not None:
        values["max_seq_length_used"] = loaded.max_seq_length
        values["pooling_used"] = loaded.model.pooling
        values["normalize_used"] = loaded.model.normalize
        values["include_prompt_used"] = loaded.include_prompt
        values["dense_layers"] = [
            f"{d.linear.in_features}->{d.linear.out_features} {d.activation_name.rsplit('.', 1)[-1]}"
            for d in loaded.model.dense
        ]
        values["attention"] = "causal" if loaded.model.causal else "bidirectional"
    values["train_sets"] = [
        {
            "name": ts.name,
            "rows": len(ts.ds),
            "arrow_cache": os.path.dirname(ts.ds.cache_files[0]["filename"]) if ts.ds.cache_files else None,
            "loss": ts.loss,
            "text_columns": ts.text_columns,
            "target_column": ts.target,
            "per_device_batch_size": ts.per_device_batch_size,
            "global_batch": ts.global_batch,
            "weight": ts.weight,
            "own_negatives": ts.own_negatives,
            "scale": ts.loss_plan.scale,  # --scale resolved (config.loss_scales)
            "directions": ts.loss_plan.directions if ts.loss == "mnrl" else None,
            "prompts": ts.prompts,
            "steps": plan.schedule.steps_of_set(index),
        }
        for index, ts in enumerate(plan.train_sets)
    ]
    values["num_labels"] = plan.num_labels
    return values
