"""Loading pretrained weights straight into the shards: no rank holds the whole model.

The model is built on the meta device (shapes, no storage), sharded by sharding.wrap_model, and
then every rank reads, from the safetensors files, the slices its own shards cover, through
torch.distributed.checkpoint's reader of the Hugging Face layout (it reads a slice with
safetensors' `get_slice`). Under FSDP2 no rank ever materialises a whole parameter; FSDP1
all-gathers each wrapped unit once while loading (its sharded state dict is by parameter, its
storage by flattened unit), the same memory its forward needs.

  - `safetensors_keys`: which file of a folder holds each tensor;
  - `load_pretrained_sharded`: fill a sharded meta model from such a folder;
  - `build_on_meta`: a transformers model on the meta device, and where each tensor is read from;
  - `read_tensors`: tensors read whole; `init_non_persistent_buffers`: what no checkpoint holds;
  - `fill_sharded_weights`: the same, for a model embedding_model.load_model built on meta.

Needs torch, transformers, safetensors, and fsdp_embed/checkpoint_warnings.py (which needs nothing of the
project): copy the two.
Usage (all ranks participate):
    with torch.device("meta"):
        raw_model = AutoModel.from_config(config)
    model = sharding.wrap_model(raw_model, "fsdp", device, sharding="full_shard")
    names = {name: name for name in shard_loading.safetensors_keys(folder)}
    shard_loading.load_pretrained_sharded(model, folder, names, {})

Left out on purpose: .bin (pickle) checkpoints, and a folder with one tensor in two files
(`safetensors_keys` returns None: the caller loads it whole).
"""

import inspect
import os

import torch
import transformers

from fsdp_embed import checkpoint_warnings


def safetensors_keys(folder):
    """{tensor name: file} over the *.safetensors files directly in `folder`, or None when a name
    is in two files: the checkpoint reader reads every such file, so the folder is ambiguous."""
    from safetensors import safe_open

    keys = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors") and os.path.isfile(os.path.join(folder, file)):
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for key in f.keys():
                    if key in keys:
                        return None
                    keys[key] = file
    return keys


def load_pretrained_sharded(model, folder, file_names, fresh_tensors):
    """Fill a model that `wrap_model` sharded while it was on the meta device. The checkpoint
    reader and FSDP's loading are collectives (all ranks participate).

    `file_names` maps state-dict names to the tensor names in the safetensors files of `folder`
    (read slice by slice: each rank reads what its shards hold). `fresh_tensors` holds the whole
    value of every other entry (a new head, adapters: small, drawn from the seeded RNG, the same
    on every rank), of which each rank keeps its own part. Non-persistent buffers are not in a
    state dict; the caller initialises them."""
    import torch.distributed.checkpoint as dcp  # (imported here: see the top of checkpoints.py)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    with checkpoint_warnings.quiet_checkpoint_warnings():
        state = get_model_state_dict(model)  # this rank's shards, uninitialised (all ranks participate)
        unknown = set(state) - set(file_names) - set(fresh_tensors)
        if unknown:
            raise ValueError(f"no value for {sorted(unknown)[:3]}: neither in {folder} nor new")
        # Loaded in place, into the shards' own storage, read under the files' names: each rank
        # reads the slices its shards hold (all ranks participate).
        dcp.load(
            {file_names[name]: state[name] for name in file_names},
            storage_reader=dcp.HuggingFaceStorageReader(folder),
        )
        set_model_state_dict(  # (all ranks participate)
            model, {name: state[name] for name in file_names}, options=StateDictOptions(strict=False)
        )
        if fresh_tensors:  # the same on every rank
            set_model_state_dict(  # (all ranks participate): each rank keeps its part
                model, fresh_tensors, options=StateDictOptions(full_state_dict=True, strict=False)
            )


def build_on_meta(path, subfolder, train_config, remote):
    """build_encoder on the meta device: ((encoder, missing keys, {tensor name: name in the
    safetensors files}), "") when the files can fill it slice by slice, else (None, why not)."""
    folder = os.path.join(path, subfolder) if subfolder else path
    file_keys = safetensors_keys(folder) if os.path.isdir(folder) else None
    if not file_keys:
        return None, f"{path} is not a local folder whose safetensors files each hold different tensors"
    with torch.device("meta"):
        encoder = transformers.AutoModel.from_config(train_config, **remote).float()
    # A task model's checkpoint (Qwen2ForCausalLM: model.layers...) holds the base model
    # under its prefix.
    file_names = {}
    for key in encoder.state_dict():
        file_names[key] = next(
            (name for name in (key, f"{encoder.base_model_prefix}.{key}") if name in file_keys), None
        )
    missing = [key for key, name in file_names.items() if name is None]
    poolerless = "add_pooling_layer" in inspect.signature(type(encoder).__init__).parameters
    # a missing pooler is dropped anyway
    if all(key.startswith("pooler.") and poolerless for key in missing):
        return (encoder, missing, file_names), ""
    return None, f"its safetensors files lack {missing[0]}"


def read_tensors(folder, file_names):
    """{name: tensor} read whole from the safetensors files of `folder` ({name: name in the files})."""
    from safetensors import safe_open

    files = safetensors_keys(folder)
    tensors = {}
    for name, file_name in file_names.items():
        with safe_open(os.path.join(folder, files[file_name]), framework="pt") as f:
            tensors[name] = f.get_tensor(file_name)
    return tensors


def init_non_persistent_buffers(encoder):
    """Rotary frequencies, position ids: buffers no checkpoint holds, which a model built on the
    meta device lacks. transformers' own `_init_weights` computes them (its from_pretrained does
    the same); the RNG is set back after, so dropout masks stay those of a full load."""
    with torch.random.fork_rng(devices=[]):
        for module in encoder.modules():
            if module._non_persistent_buffers_set:
                encoder._init_weights(module)


def fill_sharded_weights(model, loaded):
    """After a model that embedding_model.load_model built on the meta device (`loaded.pretrained_dir`
    set) is wrapped in FSDP (`model`): each rank reads the slices of the weights its shards hold, and the
    buffers no checkpoint holds are computed. (all ranks participate) Nothing to do otherwise."""
    if loaded.pretrained_dir:
        init_non_persistent_buffers(loaded.model.encoder)
        load_pretrained_sharded(model, loaded.pretrained_dir, loaded.pretrained_names, loaded.fresh_tensors)
        loaded.fresh_tensors = {}
