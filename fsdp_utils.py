"""Wrapping, state-dict gathering and SentenceTransformer export for distributed training.

This file holds what sits between a plain `nn.Module` and the distributed world:
  - `wrap_model`: DDP around the model (or nothing, for one process);
  - `gather_full_state_dict`: the full, unsharded weights, entered by every rank;
  - `export_sentence_transformer`: rank 0 writes a folder that `SentenceTransformer(path)`
    (sentence-transformers 2.x to 6.x) and `AutoModel.from_pretrained(path)` both load.

It imports only the standard library, torch, transformers and safetensors, never the other
files of this project, so it can be copied into another pipeline alone.

Usage (from train.py; every rank calls the first two, rank 0 alone the third):
    model = fsdp_utils.wrap_model(raw_model, strategy="ddp", device=device)
    state = fsdp_utils.gather_full_state_dict(model)           # all ranks
    if rank == 0:
        fsdp_utils.export_sentence_transformer(out_dir, state, config, tokenizer, ...)

Left out on purpose (for now): FSDP wrapping, mixed precision and resumable checkpoints.
"""

import importlib.metadata
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

# ----------------------------------------------------------------------------------------------
# Wrapping


def wrap_model(model, strategy, device):
    """Return the module the training loop calls: `model` itself, or DDP around it.

    The wrapped module must own every trainable parameter (encoder, pooling, heads), and every
    forward must go through it: that is how DDP knows which gradients to all-reduce.
    """
    if strategy == "single":
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        # find_unused_parameters stays False: the model is built with no unused parameters
        # (no BERT pooler), which DDP would otherwise refuse at the second step.
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    raise ValueError(f"unknown strategy {strategy!r}: expected 'single' or 'ddp'")


# ----------------------------------------------------------------------------------------------
# Gathering the full state dict


def gather_full_state_dict(model):
    """Full (unsharded) state dict of `model` with the original parameter names.

    A collective under DDP/FSDP: EVERY rank must call it, even those that will not write. The
    `torch.distributed.checkpoint.state_dict` API strips the wrappers' name prefixes
    ("module.", "_fsdp_wrapped_module.") and serves single, DDP, FSDP1 and FSDP2 alike.
    """
    params = list(model.parameters())
    on_accelerator = bool(params) and params[0].device.type != "cpu"
    # CPU offload only when the parameters live on an accelerator: with CPU parameters, FSDP1's
    # full-state-dict offload kills rank 0 with SIGSEGV (DESIGN.md, known traps).
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator)
    state = get_model_state_dict(model, options=options)
    return {name: tensor.detach().cpu() for name, tensor in state.items()}


# ----------------------------------------------------------------------------------------------
# Export to the SentenceTransformer folder format

POOLING_MODES = ("mean", "cls", "max", "lasttoken")


def pooling_config(pooling_mode, dim):
    """1_Pooling/config.json. Only the keys every sentence-transformers version since 2.0
    understands, plus `pooling_mode_lasttoken` when it is the mode (2.3+ knows it)."""
    config = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling_mode == "cls",
        "pooling_mode_mean_tokens": pooling_mode == "mean",
        "pooling_mode_max_tokens": pooling_mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    if pooling_mode == "lasttoken":
        config["pooling_mode_lasttoken"] = True
    return config


def export_sentence_transformer(
    out_dir,
    encoder_state_dict,
    encoder_config,
    tokenizer,
    *,
    pooling_mode,
    normalize,
    max_seq_length,
    model_card="",
    training_config=None,
    extra_tensor_files=None,
):
    """Write a SentenceTransformer folder at `out_dir` (rank 0 only; no collective inside).

    `encoder_state_dict` holds the transformer's weights with plain HF names (no "encoder."
    prefix), so the folder is also a plain HF model: config.json + model.safetensors +
    tokenizer files. On top of that, the sentence-transformers files:
        modules.json                      Transformer (path "") -> Pooling -> [Normalize]
        sentence_bert_config.json         max_seq_length, do_lower_case
        1_Pooling/config.json             pooling mode and dimension
        2_Normalize/                      (empty) when the model normalises
        config_sentence_transformers.json versions, similarity function
        README.md                         the model card
    The folder is written next to `out_dir` and renamed into place at the end, so a crash
    never leaves a half-written export, and an older export is replaced only by a whole one.
    """
    if pooling_mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {pooling_mode!r} cannot be exported; use one of {POOLING_MODES}")
    out_dir = os.path.abspath(out_dir)
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)

    # Plain HF layout. safetensors refuses tensors that share memory or are not contiguous.
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in encoder_state_dict.items()}
    save_file(tensors, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
    encoder_config.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    for filename, file_tensors in (extra_tensor_files or {}).items():
        file_tensors = {name: t.detach().cpu().contiguous().clone() for name, t in file_tensors.items()}
        save_file(file_tensors, os.path.join(tmp_dir, filename))

    # sentence-transformers module list: the classic `sentence_transformers.models.*` names,
    # which 2.x loads natively and 3.x-6.x map to their current classes.
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(tmp_dir, "2_Normalize"))
    os.makedirs(os.path.join(tmp_dir, "1_Pooling"))
    dim = encoder_config.hidden_size
    files = {
        "modules.json": modules,
        "1_Pooling/config.json": pooling_config(pooling_mode, dim),
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "config_sentence_transformers.json": {
            # The oldest sentence-transformers version that reads this layout; a newer number
            # would make older versions print an "update your library" warning.
            "__version__": {"sentence_transformers": "2.0.0", "transformers": importlib.metadata.version("transformers"), "pytorch": torch.__version__},
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }
    if training_config is not None:
        files["training_config.json"] = training_config
    for name, content in files.items():
        with open(os.path.join(tmp_dir, name), "w", encoding="utf8") as f:
            json.dump(content, f, indent=2)
    with open(os.path.join(tmp_dir, "README.md"), "w", encoding="utf8") as f:
        f.write(model_card)

    # Swap into place: the old export (if any) is removed only once the new one is complete.
    old_dir = f"{out_dir}.old-{os.getpid()}"
    if os.path.exists(out_dir):
        os.rename(out_dir, old_dir)
    os.rename(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)
