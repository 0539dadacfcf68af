"""The run's plan: every value the run derives from its flags, its data and its world, resolved once.

A Plan is filled in two steps, both on every rank, inside the start-up checks (startup_checks.py):
  1. `resolve_flags`: the flags' text read once (prompts, column lengths, Matryoshka sizes, MNRL
     directions, the per-file settings, the trackers, LoRA's names: config.py's parsers, which
     raise ValueError naming the flag) and the launch (world size, strategy, global batch);
  2. `add_train_sets`, `add_schedule`: the data sets, each with its global batch and LossPlan,
     every step's rows (the schedule, batches.py) and the counts that follow from them (total and
     warm-up steps, the Softmax head's classes).
main() prints `record(plan, loaded)`; every checkpoint and export saves it beside the config.
Every helper reads the plan, none re-reads a flag's text: bench/check_layout.py fails when one of
config.py's parsers is called anywhere but here.

Needs config.py.
"""

import dataclasses
import math
from dataclasses import dataclass

import config


@dataclass(frozen=True)
class LossPlan:
    """How one micro-batch's loss is computed from its column embeddings (train.embeddings_loss)."""

    name: str = "mnrl"  # config.LOSS_NAMES
    scale: float = 20.0  # MNRL's and CoSENT's inverse temperature
    matryoshka: tuple | None = None  # (dims, weights): the loss summed over truncated sizes
    directions: tuple = ("query_to_doc",)  # MNRL's (losses.MNRL_DIRECTIONS)
    partition: str = "joint"  # MNRL's softmax over all directions at once, or per direction
    temperatures: tuple = (1.0, 1.0)  # distill_kl's (student, teacher)
    gather: bool = False  # MNRL's candidates from every rank: a collective (all ranks participate)
    symmetric: bool = False  # MNRL also ranks the anchors for each positive
    own_negatives: bool = False  # MNRL against each row's own positive and hard negatives only
    false_negatives: tuple | None = None  # MNRL's (strategy, margin): candidates above it left out,
    # by the guide model's scores where the micro-batch brings them, else by the model's own
    hardness: tuple | None = None  # MNRL's (mode, strength): harder negatives weighted more
    idle_head: bool = False  # the model has a Softmax head that this loss leaves unused


@dataclass
class Plan:
    """What the run trains on and how: resolved once at start-up, read by every helper."""

    # the launch and the flags' text, read once (resolve_flags)
    world_size: int
    device: object  # the torch.device this rank computes on
    strategy: str  # single, ddp or fsdp (--strategy auto resolved)
    global_batch: int  # rows an optimizer step, over all ranks and micro-steps
    grad_accum_steps: int  # micro-batches a step: the flag's, or what keeps a resumed run's global batch
    prompts: dict  # --prompts: {column: prefix}
    max_seq_length: int  # every column's (0: the model's own) but those in column_lengths
    column_lengths: dict  # --max-seq-length as JSON: {column: tokens}
    matryoshka: tuple | None  # (dims, weights), or None
    mnrl: dict  # MNRL's directions and partition
    losses: list  # --loss: one name, one per --train-data file, or none (each file's columns)
    dataset_settings: dict  # --dataset-settings: {file stem: {setting: value}}
    report_tools: list  # --report-to's trackers, in order
    lora_alpha: float  # LoRA's scaling numerator (default 2 x rank)
    lora_leaf_names: list  # the Linear layers' names LoRA adapts
    length_buckets: int  # forwards per micro-batch without packing; 0: chosen for each
    layer_classes: list | None = None  # the FSDP block classes (model_checks.py), None when not sharding
    sharding: str = ""  # FSDP's --sharding, "auto" resolved when the model is wrapped (train.build_model)
    # the data (add_train_sets, add_schedule)
    train_sets: list = dataclasses.field(default_factory=list)  # data.TrainSet, each with its LossPlan
    eval_sets: list = dataclasses.field(default_factory=list)  # data.EvalSet
    schedule: object = ()  # batches.Schedule: every step's (epoch, set index, rows), drawn an epoch at a time
    total_steps: int = 0
    warmup_steps: int = 0
    steps_per_epoch: int = 0
    num_labels: int = 0  # classes of the Softmax head (0: none)
    data_fingerprint: str = ""  # row counts and hashes of the training data: a resume refuses other data
    # the output folder (startup_checks.py)
    resume_dir: str | None = None  # the checkpoint this run continues from
    resume_note: str = ""  # what resumed_batches changed to keep its global batch, for the log
    finished: bool = False  # --output-dir already holds this run's export
    sees_output_dir: list = dataclasses.field(default_factory=lambda: [True])  # by rank: rank 0's disk


def resolve_flags(cfg, world_size, device):
    """Step 1: the Plan of the flags and the launch. Raises ValueError for a flag's bad text."""
    strategy = cfg.strategy if cfg.strategy != "auto" else "ddp"
    if world_size == 1:
        strategy = "single"  # one process: nothing to synchronise or shard
    max_seq_length, column_lengths = config.column_lengths(cfg)
    return Plan(
        world_size=world_size,
        device=device,
        strategy=strategy,
        global_batch=cfg.per_device_batch_size * world_size * cfg.grad_accum_steps,
        grad_accum_steps=cfg.grad_accum_steps,
        prompts=config.prompts_of(cfg),
        max_seq_length=max_seq_length,
        column_lengths=column_lengths,
        matryoshka=config.matryoshka_sizes(cfg),
        mnrl=config.mnrl_options(cfg),
        losses=[name.strip() for name in cfg.loss.split(",")] if cfg.loss else [],
        dataset_settings=config.dataset_settings_of(cfg),
        report_tools=config.report_tools(cfg),
        lora_alpha=config.lora_alpha(cfg),
        lora_leaf_names=config.lora_leaf_names(cfg),
        # Under FSDP every rank must run as many forwards (each is a collective): one.
        length_buckets=cfg.length_buckets or (1 if strategy == "fsdp" else 0),
    )


def add_train_sets(plan, cfg, train_sets):
    """Step 2a: the training sets (data.load_train_sets), each with its global batch and LossPlan,
    and the Softmax head's classes (at most one set has them)."""
    num_labels = max((ts.num_labels for ts in train_sets), default=0)
    for ts in train_sets:
        ts.global_batch = ts.per_device_batch_size * plan.world_size * plan.grad_accum_steps
        ts.loss_plan = loss_plan(plan, cfg, ts.loss, ts.own_negatives, num_labels, cfg.gather_negatives)
    return dataclasses.replace(plan, train_sets=train_sets, num_labels=num_labels)


def resumed_batches(plan, cfg, train_sets, saved):
    """The accumulation and each set's per-device batch of a run resuming from a checkpoint whose
    trainer state is `saved` (its config, and the plan `record` it was written with): each set's
    global batch must stay the checkpoint's, so every step ahead takes the rows the unbroken run
    would have taken. Returns (the Plan with its grad_accum_steps, a line saying what changed, or
    ""), and sets each TrainSet's per_device_batch_size. Raises ValueError naming values that keep
    the global batch.

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
    for ts, b in zip(train_sets, per_device):
        ts.per_device_batch_size = b
    global_batch = per_device[0] * plan.world_size * accumulation
    return dataclasses.replace(plan, grad_accum_steps=accumulation, global_batch=global_batch), note


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
    """Step 2b: every step's rows (batches.Schedule), the steps they make, and the
    evaluation sets (data.load_eval_sets), each scored by --eval-type loss with its LossPlan."""
    for es in eval_sets:  # the training loss, of one rank's rows at a time: nothing gathered, no guide
        es.loss_plan = loss_plan(plan, cfg, es.loss, False, plan.num_labels, gather=False, guided=False)
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
    --guide-model's rule (its embeddings come with each micro-batch: train.forward_backward)."""
    false_negatives = None
    if cfg.guide_model and guided:
        false_negatives = (cfg.guide_margin_strategy, cfg.guide_margin)
    elif cfg.false_negative_margin is not None:
        # the model's own scores, no guide: s_ij > s_i+ + M is strategy "absolute" with margin -M
        false_negatives = ("absolute", -cfg.false_negative_margin)
    return LossPlan(
        name=name,
        scale=cfg.scale,
        matryoshka=plan.matryoshka,
        directions=plan.mnrl["directions"],
        partition=plan.mnrl["partition"],
        temperatures=(cfg.student_temperature, cfg.teacher_temperature),
        gather=gather and not own_negatives,
        symmetric=cfg.symmetric,
        own_negatives=own_negatives,
        idle_head=num_labels > 0 and name != "softmax",
        false_negatives=false_negatives,
        hardness=(cfg.hardness_mode, cfg.hardness_strength) if cfg.hardness_mode else None,
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
            "loss": ts.loss,
            "text_columns": ts.text_columns,
            "target_column": ts.target,
            "per_device_batch_size": ts.per_device_batch_size,
            "global_batch": ts.global_batch,
            "weight": ts.weight,
            "own_negatives": ts.own_negatives,
            "prompts": ts.prompts,
            "steps": plan.schedule.steps_of_set(index),
        }
        for index, ts in enumerate(plan.train_sets)
    ]
    values["num_labels"] = plan.num_labels
    return values
