"""LoRA: low-rank adapters on a model's Linear layers, in one small layer of our own.

    y = W x + b + B(A(dropout(x))) * alpha / r        A: (r, in), B: (out, r)

`add_lora` swaps the named nn.Linear modules for LoRALinear, which keeps the original layer
inside, frozen (no gradient, so no optimizer state and no gradient reduction), and trains only
A and B. Call it before DDP/FSDP wrap the model: the wrappers then see the adapters as ordinary
parameters (FSDP1 needs use_orig_params=True to mix frozen and trained ones in a block). The
initialisation is PEFT's default (A: Kaiming-uniform with a = sqrt(5), as nn.Linear; B: zeros),
so a fresh adapter leaves the model's outputs bitwise unchanged.

For the export, `merge_lora` folds every adapter into its base weight (W + B A alpha / r under
the base layer's own names: a plain model anyone can load), and `save_peft_adapter` writes the
adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), which
`peft.PeftModel.from_pretrained(base_model, folder)` loads. This file imports only torch and
safetensors: copy it alone. Left out: bias training, DoRA, rank-stabilised scaling, and
adapters on embeddings or convolutions.
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


class LoRALinear(torch.nn.Module):
    def __init__(self, base, rank, alpha, dropout=0.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        # Beside a base waiting on the meta device (to be loaded into shards), the adapters are
        # still made, and drawn from the RNG, here: the same adapters as beside a loaded base.
        device = None if base.weight.is_meta else base.weight.device
        self.lora_A = torch.nn.Parameter(
            torch.empty(rank, base.in_features, dtype=base.weight.dtype, device=device)
        )
        self.lora_B = torch.nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=base.weight.dtype, device=device)
        )
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def forward(self, x):
        # PEFT's order of operations, so that its forward and gradients are ours to the last bit.
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling


def linear_names(model, block_classes, leaf_names=()):
    """The dotted names of the nn.Linear modules inside the blocks (instances of `block_classes`),
    optionally only those whose last name part is in `leaf_names` (q_proj, v_proj, ...)."""
    names = []
    for block_name, block in model.named_modules():
        if isinstance(block, tuple(block_classes)):
            for name, module in block.named_modules():
                if isinstance(module, torch.nn.Linear) and (
                    not leaf_names or name.rsplit(".", 1)[-1] in leaf_names
                ):
                    names.append(f"{block_name}.{name}")
    return names


def add_lora(model, names, rank, alpha, dropout=0.0):
    """Freeze every parameter of `model`, then put a trainable adapter on each named Linear.
    Draws A from torch's RNG: seed it alike on every rank."""
    model.requires_grad_(False)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), rank, alpha, dropout))
    return model


def adapted_modules(state_dict):
    """The names of the adapted modules in a state dict (those with a `.lora_A`)."""
    return sorted(name.removesuffix(".lora_A") for name in state_dict if name.endswith(".lora_A"))


def plain_name(name, adapted):
    """A tensor's name in the model without adapters: `q_proj.base.weight` -> `q_proj.weight` for
    an adapted module (one of `adapted`); any other name unchanged."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(".base") and module.removesuffix(".base") in adapted:
        return f"{module.removesuffix('.base')}.{leaf}"
    return name


def merge_lora(state_dict, scaling):
    """A state dict with adapters -> the plain one: each adapted module's weight becomes
    W + (B @ A) * scaling under its own name (`q_proj.weight`, not `q_proj.base.weight`), its
    bias unchanged; the adapters themselves are dropped. Computed in the tensors' dtype (fp32).
    A part of a state dict will do, if it holds each adapted module's adapters."""
    adapted = adapted_modules(state_dict)
    merged = {}
    for name, tensor in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if plain_name(name, adapted) != name and leaf == "weight":
            module = module.removesuffix(".base")
            tensor = tensor + (state_dict[f"{module}.lora_B"] @ state_dict[f"{module}.lora_A"]) * scaling
        merged[plain_name(name, adapted)] = tensor
    return merged


def save_peft_adapter(folder, state_dict, *, rank, alpha, dropout, base_model):
    """Write the adapters of `state_dict` (names relative to the model PEFT will wrap) as a PEFT
    LoRA adapter folder: adapter_model.safetensors holds base_model.model.NAME.lora_A.weight and
    .lora_B.weight, adapter_config.json lists every adapted module by its full name (PEFT
    matches a listed name exactly or as a suffix, so no other Linear is touched)."""
    adapted = adapted_modules(state_dict)
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for module in adapted:
        for part in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{module}.{part}.weight"] = (
                state_dict[f"{module}.{part}"].detach().cpu().contiguous().clone()
            )
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": adapted,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf8") as f:
        json.dump(config, f, indent=2)
