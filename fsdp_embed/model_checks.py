"""The model, checked from its folder and config before any weights load, in a second or two.

`check_model(spec, plan)` (run_plan.py calls it on every rank, no collective) loads
--model's config without weights (`model_config_of`) and checks: the folder holds tokenizer
files and weights that look whole (`check_model_files`; `weights_problem` reads the weight
files' headers alone: a safetensors file as long as its header says, a pickle file of tensors
alone, every shard an index names); --append-eos has a fast tokenizer with an EOS token; the
Matryoshka sizes and the sequence lengths fit the model; and, on a copy built on the meta
device (`check_meta_model`: no memory, no time), the FSDP block class, activation
checkpointing and the LoRA target modules. It returns the FSDP block class names, or None.
`check_sparse(spec, plan)`: a SPLADE model's head and flags; `flags_given`: which flags a run sets.

    layer_classes, folder = model_checks.check_model(plan.model, plan)  # ValueError naming the fix
    model_checks.check_frozen_models(plan)                      # --guide-model, --teacher-model
    problem = model_checks.weights_problem(folder)              # None: the weights look whole

Left out on purpose: loading the weights (embedding_model.py does, once every check passed),
and checking the values in them (the loss and the weights are checked while training).

Needs transformers, and fsdp_embed/config.py, fsdp_embed/training_data.py (`root_cause`),
fsdp_embed/embedding_model.py, fsdp_embed/st_folder.py (`read_sentence_transformer_config`),
fsdp_utils.py (`resolve_layer_classes`), fsdp_embed/lora.py, fsdp_embed/splade.py (`head_of`) and
fsdp_embed/guide_model.py (`frozen_spec`).
Its whole copy set (what it needs, directly or through another): eval_dist.py, fsdp_utils.py,
fsdp_embed/batches.py, fsdp_embed/checkpoint_warnings.py, fsdp_embed/config.py,
fsdp_embed/embedding_model.py, fsdp_embed/guide_model.py, fsdp_embed/inference_free.py, fsdp_embed/lora.py,
fsdp_embed/shard_loading.py, fsdp_embed/sharding.py, fsdp_embed/splade.py, fsdp_embed/st_folder.py,
fsdp_embed/token_cache.py, fsdp_embed/training_data.py.
"""

import dataclasses
import functools
import json
import os

import torch
import transformers

import fsdp_utils
from fsdp_embed import config
from fsdp_embed import embedding_model
from fsdp_embed import guide_model
from fsdp_embed import lora
from fsdp_embed import splade
from fsdp_embed import st_folder
from fsdp_embed import training_data


def check_model(spec, plan):
    """The model checks that need no weights, in a second or two, of the model ModelSpec `spec`
    names (embedding_model.py) in the run `plan` (its strategy, Matryoshka sizes and the
    --dataset-settings prompts: run_plan.py): the folder or hub id exists
    and its config loads (read here once more, without the weights, so a bad --model fails
    before anything heavy); under FSDP, the block class to wrap is found (in a copy built on
    the meta device: no memory, no time). Returns (the FSDP block class names or None, what its
    SentenceTransformer folder says: st_folder.read_sentence_transformer_config, read once here)."""
    path, st_config, model_config = model_config_of(spec)
    subfolder = st_config["subfolder"]
    check_model_files(spec, os.path.normpath(os.path.join(path, subfolder)))
    if spec.append_eos:
        check_eos_tokenizer(spec, path, subfolder)
    if spec.bidirectional:
        check_bidirectional(spec, model_config)
    if not (st_config["include_prompt"] if spec.include_prompt is None else spec.include_prompt):
        check_prompts_leave_text(spec, plan, path, subfolder, st_config)
    width = embedding_width(model_config, st_config)
    if width and plan.matryoshka and max(plan.matryoshka[0]) > width:
        dims = ",".join(map(str, plan.matryoshka[0]))
        raise ValueError(
            f"--matryoshka-dims {dims}: {spec.path} gives {width}-dimensional embeddings; "
            f"use sizes up to {width}"
        )
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions and max([spec.max_seq_length, *spec.column_lengths.values()]) > positions:
        lengths = json.dumps(spec.column_lengths) if spec.column_lengths else spec.max_seq_length
        raise ValueError(
            f"--max-seq-length {lengths} is beyond the {positions} positions {spec.path} has; "
            f"use at most {positions}"
        )
    if plan.strategy != "fsdp" and not spec.lora_rank and not spec.activation_checkpointing:
        return None, st_config
    return check_meta_model(spec, plan, model_config), st_config


# What only a sparse (SPLADE) model takes, and what it does not take yet.
SPLADE_FLAGS = (
    "query_regularizer_weight", "document_regularizer_weight", "query_regularizer_threshold",
    "document_regularizer_threshold", "use_document_regularizer_only", "regularizer_scheduler_type",
    "regularizer_warmup_ratio", "splade_pooling_strategy", "splade_activation_function", "splade_chunk_size",
    "inference_free_queries", "static_lr", "idf_file",
)  # fmt: skip
NOT_SPARSE_YET = (
    "symmetric", "mask_duplicates", "mnrl_directions", "guide_model", "false_negative_margin",
    "hardness_mode", "teacher_model",
)  # fmt: skip


# MNRL's options that the multi-vector loss does not take yet.
NOT_MULTI_VECTOR_YET = NOT_SPARSE_YET + ("mnrl_partition", "matryoshka_dims")


def check_multi_vector(spec, plan):
    """A multi-vector (ColBERT) model, before any weights load: a layout this trainer reads (a
    Stanford ColBERT or PyLate v3 one too, not a *ForRetrieval checkpoint), a MultiVectorEncoder
    folder only with its own pooling, no Matryoshka sizes, none of MNRL's options the MaxSim loss
    does not take yet, and for query expansion, a tokenizer that pads on the right and an
    expansion token that is not its padding, and tokenizing on the fly (queries and documents are
    tokenized apart, each with its own length and prompt)."""
    given = flags_given(plan, NOT_MULTI_VECTOR_YET)
    if given:
        raise ValueError(f"{given[0]} does not train a multi-vector (ColBERT) model yet; drop it")
    path, st_config, model_config = model_config_of(spec)
    architectures = getattr(model_config, "architectures", None) or []
    if any(a.endswith("ForRetrieval") for a in architectures):
        raise ValueError(
            f"--model {spec.path}: a {architectures[0]} checkpoint is not read here yet; load it once with "
            "sentence_transformers.MultiVectorEncoder and save it, then train that folder"
        )
    if st_config["pooling"] == "multivector" and spec.pooling not in ("", "multivector"):
        raise ValueError(
            f"--pooling {spec.pooling}: {spec.path} is a MultiVectorEncoder (a vector per token); "
            "drop --pooling, or start from its base model"
        )
    settings = st_config["multivector"] or {}
    per_task = (
        settings.get("query_expansion")
        or settings.get("query_length")
        or settings.get("document_length")
        or any(st_config["prompts"].get(task) for task in ("query", "document"))  # [Q] / [D] markers
    )
    if per_task and plan.flags["tokenize"] == "once":  # a token file's ids know no task
        raise ValueError(
            f"--tokenize once: {spec.path} tokenizes queries and documents apart (its query expansion, "
            "per-task lengths or prompts); drop --tokenize once"
        )
    if settings.get("query_expansion"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            path, subfolder=st_config["subfolder"], trust_remote_code=spec.trust_remote_code
        )
        token = settings["query_expansion"]["token"] or tokenizer.mask_token or tokenizer.eos_token
        if tokenizer.padding_side != "right" or token in (None, tokenizer.pad_token):
            raise ValueError(
                f"--model {spec.path}: query expansion needs a tokenizer that pads on the right and an "
                f"expansion token other than its padding ({token!r}); name one in query_expansion's token"
            )


# The losses a multi-vector model trains with: those sentence-transformers 6 has a MultiVector form of.
MULTI_VECTOR_LOSSES = ("mnrl", "margin_mse", "distill_kl")


# The losses a sparse model trains with: SpladeLoss around sentence-transformers' Sparse forms of these.
SPARSE_LOSSES = ("mnrl", "margin_mse", "distill_kl")


def check_model_losses(spec, losses_used, gather_negatives=False):
    """The losses the training files use (`losses_used`), against a SPLADE or multi-vector model;
    `gather_negatives`: --gather-negatives, which a sparse model's MarginMSE and DistillKL have no use for
    (each query is scored against its own row's documents; the FLOPS terms are over every rank's rows)."""
    if spec.sparse and set(losses_used) - set(SPARSE_LOSSES):  # SPLADE: sentence-transformers' SpladeLoss
        raise ValueError(
            f"--loss {','.join(losses_used)}: a sparse (SPLADE) model trains with {', '.join(SPARSE_LOSSES)} "
            "(sentence-transformers' SpladeLoss around their Sparse forms); CoSENT, Softmax and MSE not yet"
        )
    if spec.sparse and gather_negatives and "mnrl" not in losses_used:
        raise ValueError(
            f"--gather-negatives works on MNRL's candidates, and --loss {','.join(losses_used)} scores each "
            "query against its own row's documents alone; drop --gather-negatives (a sparse model's FLOPS "
            "regularisers are over every rank's rows without it)"
        )
    if spec.multi_vector and set(losses_used) - set(MULTI_VECTOR_LOSSES):  # MaxSim's forms alone
        raise ValueError(
            f"--loss {','.join(losses_used)}: a multi-vector (ColBERT) model trains with "
            f"{', '.join(MULTI_VECTOR_LOSSES)} (sentence-transformers' MultiVector losses); CoSENT, Softmax "
            "and MSE compare one vector a text"
        )


def check_model_evaluation(spec, eval_sets):
    """The evaluation sets' kinds against a multi-vector model, which has no one vector a text, and
    an inference-free SPLADE model, whose two sides are not one embedding of a text."""
    bad = next((es for es in eval_sets if es.kind in ("sts", "nli")), None)
    if spec.inference_free and bad:
        raise ValueError(
            f"--eval-data {bad.name} ({bad.kind}): an inference-free SPLADE model encodes queries and "
            "documents apart, and an STS or NLI pair is neither; evaluate it by retrieval or loss"
        )
    if spec.multi_vector and bad:
        raise ValueError(
            f"--eval-data {bad.name} ({bad.kind}): a multi-vector (ColBERT) model has no single vector per "
            "text to compare; evaluate it with --eval-type retrieval (MaxSim) or loss"
        )


def flags_given(plan, names):
    """The flags among `names` (Config fields) that the run sets to other than their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(config.Config)}
    return [f"--{n.replace('_', '-')}" for n in names if plan.flags[n] != defaults[n]]


def check_sparse(spec, plan):
    """A sparse (SPLADE) model, before any weights load: a masked-LM head this project knows (built
    on the meta device: no memory, no time), no Matryoshka sizes (its dimensions are vocabulary
    entries, in no order) and none of MNRL's options that SpladeLoss does not take here yet."""
    given = functools.partial(flags_given, plan)
    if plan.matryoshka:
        raise ValueError(
            "--matryoshka-dims: a SPLADE model's dimensions are vocabulary entries, in no order; drop it"
        )
    if given(NOT_SPARSE_YET):
        raise ValueError(f"{given(NOT_SPARSE_YET)[0]} does not train a sparse (SPLADE) model yet; drop it")
    if given(["use_document_regularizer_only"]) and given(["query_regularizer_weight"]):
        raise ValueError(
            "--use-document-regularizer-only regularises the queries as documents: "
            "drop --query-regularizer-weight"
        )
    _, st_config, model_config = model_config_of(spec)
    try:
        with torch.device("meta"):
            masked_lm = transformers.AutoModelForMaskedLM.from_config(
                model_config, trust_remote_code=spec.trust_remote_code
            )
        splade.head_of(masked_lm, spec.splade, st_config["splade"])
    except ValueError as e:
        raise ValueError(
            f"--pooling splade: {spec.path} has no masked-LM head to load ({str(e).splitlines()[0]}); "
            "use a masked-LM model (BERT, RoBERTa, DistilBERT, ModernBERT) or another --pooling"
        ) from e


def check_inference_free(spec, plan):
    """An inference-free SPLADE model's flags (its queries a static weight per token: inference_free.py):
    what the static side cannot take, and the inference-free flags without it."""
    given = functools.partial(flags_given, plan)
    if not spec.inference_free and given(["static_lr", "idf_file"]):
        raise ValueError(
            f"{given(['static_lr', 'idf_file'])[0]} sets the static query weights of inference-free SPLADE; "
            "pass --inference-free-queries too (or a Router folder), or drop it"
        )
    if not spec.inference_free:
        return
    if spec.static_queries[1] and (spec.folder or {}).get("static_queries"):
        raise ValueError(f"--idf-file: {spec.path} holds its own query weights; drop --idf-file")
    refused = {
        "use_document_regularizer_only": "treats queries as documents, and static queries are not",
        "cache_chunk_size": "(GradCache) does not run the static query route yet",
    }
    for name, why in refused.items():
        if given([name]):
            raise ValueError(f"{given([name])[0]} with inference-free queries: it {why}; drop it")
    if plan.flags["tokenize"] == "once":  # a token file's ids know no task
        raise ValueError(
            "--tokenize once: inference-free queries are tokenized apart (no special tokens); drop it"
        )


def embedding_width(model_config, st_config):
    """How many numbers an embedding has: the last Dense layer's outputs, else the hidden size."""
    if st_config["dense"]:
        return st_config["dense"][-1]["out_features"]
    return getattr(model_config, "hidden_size", None)


def check_frozen_models(plan):
    """--guide-model and --teacher-model, checked as check_model checks --model (the folder, its
    config, tokenizer and weights; under FSDP, the block class to wrap), each error naming its flag;
    the teacher's embeddings as wide as the student's (--loss mse compares them number by number)."""
    frozen_plan = dataclasses.replace(plan, matryoshka=None)
    for flag, path in (("--guide-model", plan.guide_model), ("--teacher-model", plan.teacher_model)):
        if not path:
            continue
        try:
            check_model(guide_model.frozen_spec(plan.model, path), frozen_plan)
        except ValueError as e:
            raise ValueError(str(e).replace(f"--model {path}", f"{flag} {path}")) from e
    if plan.teacher_model:
        student, teacher = (
            model_width(guide_model.frozen_spec(plan.model, m)) for m in (plan.model.path, plan.teacher_model)
        )
        if student and teacher and student != teacher:
            raise ValueError(
                f"--teacher-model {plan.teacher_model} gives {teacher}-dimensional embeddings and --model "
                f"{plan.model.path} {student}: --loss mse compares them number by number; choose a teacher "
                "of the student's width"
            )


def model_width(spec):
    """The width of the embeddings of the model ModelSpec `spec` names (embedding_width), from its
    config alone."""
    _, st_config, model_config = model_config_of(spec)
    return embedding_width(model_config, st_config)


def model_config_of(spec):
    """(path, folder settings, config) of --model: its local folder or hub id, what its
    SentenceTransformer folder says (st_folder.read_sentence_transformer_config: the subfolder that
    holds the transformer, its pooling, ...), and its config, loaded without weights.
    Raises ValueError naming --model when the folder is empty or lacks config.json, or the
    config cannot be loaded (no such folder, unknown hub id, no network)."""
    path = embedding_model.resolve_model_path(spec.path)
    if os.path.isdir(path) and not os.listdir(path):
        raise ValueError(
            f"--model {spec.path}: the folder is empty; pass a folder written by save_pretrained "
            "(config.json, weights, tokenizer files)"
        )
    try:
        st_config = st_folder.read_sentence_transformer_config(path)
        subfolder = st_config["subfolder"]
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, subfolder, "config.json")):
            raise ValueError(
                f"the folder has no {os.path.join(subfolder, 'config.json')} "
                f"(it holds {sorted(os.listdir(os.path.join(path, subfolder)))}); "
                "pass a folder written by save_pretrained"
            )
        model_config = transformers.AutoConfig.from_pretrained(
            path, subfolder=subfolder, trust_remote_code=spec.trust_remote_code
        )
    except ValueError as e:
        raise ValueError(f"--model {spec.path}: {e}") from e
    except Exception as e:  # OSError, connection errors: no such folder, unknown id, no network
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--model {spec.path}: not a local model folder, and loading it from the hub failed ({reason}); "
            "pass a folder holding config.json, or a hub id where a hub is reachable"
        ) from e
    return path, st_config, model_config


def check_model_files(spec, folder):
    """A local model `folder` (a hub id has none) holds tokenizer files, and weights that look
    whole (see `weights_problem`)."""
    if os.path.isdir(folder) and not any(
        os.path.isfile(os.path.join(folder, name))
        for name in ("tokenizer.json", *st_folder.SLOW_TOKENIZER_FILES[:6])
    ):
        # Without them transformers builds a tokenizer that maps every word to [UNK], and
        # training "works".
        raise ValueError(
            f"--model {spec.path}: no tokenizer files in {folder} (tokenizer.json, vocab.txt, ...); "
            "save the base model's tokenizer there (tokenizer.save_pretrained)"
        )
    if os.path.isdir(folder) and (problem := weights_problem(folder)):
        raise ValueError(f"--model {spec.path}: {problem}")


def check_eos_tokenizer(spec, path, subfolder):
    """--append-eos: the model's tokenizer is a fast one (a tokenizer.json), with an EOS token."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, subfolder=subfolder, trust_remote_code=spec.trust_remote_code
    )
    if tokenizer.eos_token is None:
        raise ValueError(
            f"--append-eos: the tokenizer of {spec.path} has no EOS token; "
            "set one (tokenizer.eos_token = ..., save_pretrained) or drop --append-eos"
        )
    if not tokenizer.is_fast:
        raise ValueError(
            f"--append-eos needs a fast tokenizer (a tokenizer.json); "
            f"{spec.path} has a {type(tokenizer).__name__}"
        )


def check_prompts_leave_text(spec, plan, path, subfolder, st_config):
    """--no-include-prompt (or a folder whose pooling leaves the prompt out): every prompt, in
    --prompts and --dataset-settings, is shorter than its column's --max-seq-length, so that
    pooling keeps at least one token of each text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, subfolder=subfolder, trust_remote_code=spec.trust_remote_code
    )
    if st_config["do_lower_case"]:
        st_folder.lowercase_inside(tokenizer)  # as the model's tokenizer lowercases (load_model)
    default = spec.max_seq_length or st_config["max_seq_length"] or tokenizer.model_max_length
    settings = [spec.prompts] + [s.get("prompts", {}) for s in plan.dataset_settings.values()]
    for column, prompt in ((c, p) for prompts in settings for c, p in prompts.items()):
        tokens = embedding_model.prompt_token_count(tokenizer, prompt)
        length = spec.column_lengths.get(column, default)
        if tokens >= length:
            raise ValueError(
                f"--prompts: the prompt of {column} takes {tokens} tokens, and its texts are cut at "
                f"{length}: pooling without the prompt's tokens (--no-include-prompt) would keep none "
                "of the text; shorten the prompt or raise --max-seq-length"
            )


def check_bidirectional(spec, model_config):
    """--bidirectional: the model is a decoder whose config carries use_bidirectional_attention
    (saved in the export's config.json, so it loads bidirectional everywhere), and whose model
    code in this transformers honours it: a tiny random model of the same class attends to later
    tokens, with and without padding (transformers builds its mask differently for each). An
    encoder (BERT) attends both ways already: the flag changes nothing there."""
    kind, version = model_config.model_type, transformers.__version__
    with torch.device("meta"):
        encoder = transformers.AutoModel.from_config(model_config, trust_remote_code=spec.trust_remote_code)
    carries = "use_bidirectional_attention" in model_config.to_dict()
    if not carries and not any(getattr(m, "is_causal", False) is True for m in encoder.modules()):
        return
    if not carries:
        raise ValueError(
            f"--bidirectional: the config of {kind} models ({type(model_config).__name__}) cannot carry "
            f"use_bidirectional_attention in transformers {version}, so the export would load causal; "
            "drop --bidirectional, or train a model type whose config has it (Gemma3)"
        )
    try:
        ahead = attends_ahead(embedding_model.bidirectional_config(model_config))
    except Exception as e:  # a config this shrinking does not fit
        ahead = f"a tiny {kind} model could not be built to check it ({type(e).__name__}: {e})"
    if ahead is not True:
        raise ValueError(
            f"--bidirectional: {kind} models in transformers {version} do not attend both ways "
            f"with use_bidirectional_attention ({ahead}); drop --bidirectional"
        )


def attends_ahead(model_config):
    """True when a tiny random model (1 layer of each kind, 16 wide) with `model_config`'s
    settings lets position 0 see the last token, in a batch without padding and in one with a
    padded row; else a word on where it does not."""
    small = model_config.to_dict()
    layer_kinds = sorted(set(small.get("layer_types") or [])) or None
    small.update(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    small.update(num_key_value_heads=1, head_dim=8, num_hidden_layers=len(layer_kinds or [0]))
    if layer_kinds:
        small["layer_types"] = layer_kinds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(type(model_config).from_dict(small)).eval()
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        unpadded = model(input_ids=ids[:2]).last_hidden_state[:, 0]
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state[:2, 0]
    if torch.allclose(unpadded[0], unpadded[1]):
        return "not without padding"
    if torch.allclose(padded[0], padded[1]):
        return "not with padding"
    return True


def check_meta_model(spec, plan, model_config):
    """The checks that need the model's modules, on a copy built on the meta device (no memory,
    no time): --activation-checkpointing is supported, the block class is found (or
    --fsdp-layer-cls names one), and --lora-target-modules names Linear layers in it. Returns
    the FSDP block class names, or None when not sharding."""
    with torch.device("meta"):
        encoder = transformers.AutoModel.from_config(model_config, trust_remote_code=spec.trust_remote_code)
    if spec.activation_checkpointing and not encoder.supports_gradient_checkpointing:
        raise ValueError(
            f"--activation-checkpointing: {type(encoder).__name__} ({spec.path}) does not support it "
            "in transformers; drop the flag"
        )
    blocks = fsdp_utils.resolve_layer_classes(encoder, spec.fsdp_layer_cls)
    if spec.lora_rank and not lora.linear_names(encoder, blocks, spec.lora_leaf_names):
        inside = sorted({name.rsplit(".", 1)[-1] for name in lora.linear_names(encoder, blocks)})
        raise ValueError(
            f"--lora-target-modules {','.join(spec.lora_leaf_names)}: no Linear layer of that name "
            f"in {spec.path}'s block ({', '.join(sorted(c.__name__ for c in blocks))}); "
            f"its Linear layers: {', '.join(inside)}"
        )
    return sorted(c.__name__ for c in blocks) if plan.strategy == "fsdp" else None


# The weight files transformers loads, in the order it prefers them.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def weights_problem(folder):
    """Why the weights in a local model folder cannot load (None: they look whole), from file
    headers alone: a safetensors file must be exactly as long as its header says; a pickle file
    (pytorch_model.bin) must unpickle as tensors alone, as transformers loads it (mapped, so
    only its pickle is read). Sharded weights: every shard the index names."""
    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present:
        return (
            f"no weights in {folder} (looked for {', '.join(WEIGHT_FILES)}); "
            "pass a folder written by save_pretrained"
        )
    index = present[0]
    shards = [index]
    if index.endswith(".index.json"):
        try:
            with open(os.path.join(folder, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{index} is unreadable ({e}); save the model again"
    for shard in shards:
        file = os.path.join(folder, shard)
        if not os.path.isfile(file):
            return f"{shard}, named in {index}, is missing from {folder}; copy it there"
        problem = safetensors_problem(file) if shard.endswith(".safetensors") else pickle_problem(file)
        if problem:
            return f"{file} {problem}"
    return None


def safetensors_problem(file):
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if size < 8 or header_size > size - 8:
            return f"is truncated ({size} bytes, not even its header); copy or save it again"
        try:
            header = json.loads(f.read(header_size))
        except ValueError:
            return "is not a safetensors file (its header is not JSON); copy or save it again"
    expected = (
        8
        + header_size
        + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    )
    if size != expected:
        return (
            f"has {size} bytes where its header describes {expected} (truncated, or cut off in a copy); "
            "copy or save it again"
        )
    return None


def pickle_problem(file):
    try:
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            torch.load(file, map_location="cpu", weights_only=True)  # the pre-2019 format cannot be mapped
    except Exception as e:
        return (
            f"cannot be loaded as tensors alone ({training_data.root_cause(e)[:200]}): "
            "it is truncated, or its pickle holds code; "
            "re-save the model as safetensors from a copy you trust"
        )
    return None
