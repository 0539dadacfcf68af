"""The export's model card (README.md): the run's base model, data, loss, settings and last
evaluation, and how to use the model with sentence-transformers and with plain transformers.

    text = model_card.card(plan, loaded, {**run_plan.record(plan, loaded), **summary})

Needs nothing from the project: it reads the Plan (run_plan.py: its settings, and the flags as
given, which the card lists) and the LoadedModel (embedding_model.py) it is given.
"""

import json
import math
import os


def public_name(name):
    """How the model card names a model or a data file: a hub id as it is, a local path by its
    last component only (the training machine's folders mean nothing to a reader)."""
    if name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        return "sentence-transformers/all-MiniLM-L6-v2"
    return os.path.basename(os.path.normpath(name)) if os.path.exists(name) else name


# Lowercasing by hand, for the card's plain-transformers example of a do_lower_case model: a
# Lowercase normaliser in the tokenizer, as sentence-transformers 6 adds it (Python's str.lower differs
# for a few letters, such as a final sigma). The export saves it, but transformers may rebuild a
# tokenizer class's normaliser on loading; where it is kept, a second Lowercase changes nothing.
LOWERCASE_BY_HAND = """# do_lower_case: the tokenizer lowercases, as in sentence-transformers 6
from tokenizers.normalizers import Lowercase, Sequence
steps = [tokenizer.backend_tokenizer.normalizer] if tokenizer.backend_tokenizer.normalizer else []
tokenizer.backend_tokenizer.normalizer = Sequence([Lowercase(), *steps])
"""

# Pooling by hand, for the model card's plain-transformers example: what `pool` does.
POOLING_BY_HAND = {
    "mean": (
        'mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)\n'
        "embeddings = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)"
    ),
    "cls": "embeddings = states[:, 0]",
    "max": (
        'mask = batch["attention_mask"].unsqueeze(-1)\n'
        "embeddings = states.masked_fill(mask == 0, -1e9).max(1).values"
    ),
    "lasttoken": (
        'mask = batch["attention_mask"]\n'
        "last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # the last real token, left or right padding\n"
        "embeddings = states[torch.arange(len(last)), last]"
    ),
}


def last_evaluation(output_dir):
    """The newest evaluation in OUTPUT_DIR/metrics.jsonl (rank 0 wrote it), or None."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        evals = [row["eval"] for row in map(json.loads, f) if "eval" in row]
    return evals[-1] if evals else None


# The model card (README.md), filled in by `model_card` with str.format.
MODEL_CARD = """---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags: [sentence-transformers, feature-extraction, sentence-similarity, fsdp-embed]
{base_model}
---
# Sentence embedding model trained with fsdp-embed

- Base model: `{base}`
- Training data: `{train_data}` ({train_rows} rows)
- Loss: {losses}; pooling: `{pooling}`{normalised}; texts truncated at {max_seq_length} tokens{column_lengths}
- Steps: {total_steps} of global batch {global_batch} on {world_size} process(es)
- Final training loss: {final_loss:.4f}{notes}
{evaluation}
{usage}## Hyper-parameters
```json
{settings}
```
"""


# How to use the model, for a dense model (the fields: `card`'s), a sparse (SPLADE) and a multi-vector one.
DENSE_USE = """## Use with sentence-transformers
```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/this/folder")
embeddings = model.encode(["A sentence.", "Another one."]){prompted}{truncated}
```

## Use with plain transformers
```python
import torch
from transformers import AutoModel, AutoTokenizer

texts = ["A sentence.", "Another one."]
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")  # truncates at {max_seq_length} tokens
model = AutoModel.from_pretrained("path/to/this/folder").eval()
{lowercase}batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")  # texts as written
with torch.no_grad():
    states = model(**batch).last_hidden_state
{pooling_by_hand}{normalize}
```

"""
SPARSE_USE = """## Use with sentence-transformers (5.0 or later)
```python
from sentence_transformers import SparseEncoder
model = SparseEncoder("path/to/this/folder")
embeddings = model.encode(["A sentence.", "Another one."])  # sparse, one weight per vocabulary entry
```

## Use with plain transformers
```python
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

texts = ["A sentence.", "Another one."]
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")  # truncates at {max_seq_length} tokens
model = AutoModelForMaskedLM.from_pretrained("path/to/this/folder").eval()
{lowercase}batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")  # texts as written
with torch.no_grad():
    logits = model(**batch).logits
weights = torch.log1p(torch.relu(logits * batch["attention_mask"].unsqueeze(-1))){log1p_again}
embeddings = weights.{reduce}(1)  # SpladePooling: {strategy} over the tokens
```

"""
INFERENCE_FREE_USE = """## Use with sentence-transformers (6.0 or later)
Inference-free SPLADE: a query is a learned weight per token it holds, looked up with no model
forward (SparseStaticEmbedding); documents go through the masked LM (document_0_Transformer).
```python
from sentence_transformers import SparseEncoder
model = SparseEncoder("path/to/this/folder")
queries = model.encode_query(["What plays music?"])
documents = model.encode_document(["A man plays a guitar.", "A cat sleeps."])
scores = model.similarity(queries, documents)  # dot product
```

"""
MULTI_VECTOR_USE = """## Use with sentence-transformers (6.0 or later)
A multi-vector (ColBERT) model: one vector per token, queries and documents scored by {similarity}.
```python
from sentence_transformers import MultiVectorEncoder
model = MultiVectorEncoder("path/to/this/folder")
queries = model.encode_query(["What plays music?"])  # a (tokens, {dim}) tensor per text
documents = model.encode_document(["A man plays a guitar.", "A cat sleeps."])
scores = model.similarity(queries, documents)  # (1, 2): the sum over query tokens of the best match
```

"""


def card(plan, loaded, record):
    """The export's README.md: the run's base model, data, loss, settings and last evaluation,
    and how to use the model with sentence-transformers and with plain transformers. `record`:
    what the run derived (run_plan.record) and its summary (final_loss, the last evaluation)."""
    base, pooling = public_name(plan.model.path), loaded.model.pooling
    base_is_hub = not os.path.exists(plan.model.path) or base == "sentence-transformers/all-MiniLM-L6-v2"
    settings = card_settings(plan.flags)
    sizes = plan.matryoshka
    multiple_sets = len(record["train_sets"]) > 1
    usage = DENSE_USE if loaded.model.sparse is None else sparse_use(loaded)  # the latter filled in already
    usage = multi_vector_use(loaded) if loaded.model.multivector else usage  # filled in too
    return MODEL_CARD.replace("{usage}", usage).format(
        base_model=f"base_model: {base}" if base_is_hub else "",
        base=base,
        train_data=settings["train_data"],
        train_rows=record["train_rows"],
        losses=", ".join(
            f"`{s['loss']}`" + (f" on {s['name']}" if multiple_sets else "") for s in record["train_sets"]
        ),
        pooling=pooling,
        normalised=", L2-normalised" if loaded.model.normalize else "",
        max_seq_length=loaded.max_seq_length,
        column_lengths=(
            " (in training: " + ", ".join(f"{c} at {n}" for c, n in loaded.column_lengths.items()) + ")"
            if loaded.column_lengths
            else ""
        ),
        total_steps=record["total_steps"],
        global_batch=record["global_batch"],
        world_size=record["world_size"],
        final_loss=record["final_loss"],
        notes=card_notes(plan, loaded),
        evaluation=evaluation_section(
            record.get("eval") or last_evaluation(plan.output_dir),
            record.get("step", record["total_steps"]),
        ),
        prompted="".join(
            f'\n{name}_embeddings = model.encode(["A text."], prompt_name="{name}")'
            for name in loaded.prompts
        ),
        truncated=(
            f"\n# Smaller embeddings, as trained: the first {min(sizes[0])} dimensions\n"
            f'small = SentenceTransformer("path/to/this/folder", truncate_dim={min(sizes[0])})'
            if sizes
            else ""
        ),
        lowercase=LOWERCASE_BY_HAND if loaded.lowercase else "",
        pooling_by_hand=POOLING_BY_HAND.get(pooling, "")
        + (
            "\n# then the Dense layers (2_Dense/, ...), as sentence-transformers applies them"
            if loaded.model.dense
            else ""
        ),
        normalize=(
            "\nembeddings = torch.nn.functional.normalize(embeddings, dim=-1)"
            if loaded.model.normalize
            else ""
        ),
        settings=json.dumps(settings, indent=2),
    )


def sparse_use(loaded):
    """SPARSE_USE filled in for the SpladeHead of `loaded` (splade.SpladeHead.settings), or with
    static queries INFERENCE_FREE_USE."""
    if loaded.model.static is not None:
        return INFERENCE_FREE_USE
    strategy, activation, _ = loaded.model.sparse.settings
    return SPARSE_USE.format(
        max_seq_length=loaded.max_seq_length,
        lowercase=LOWERCASE_BY_HAND if loaded.lowercase else "",
        log1p_again="\nweights = torch.log1p(weights)  # log1p_relu" if activation == "log1p_relu" else "",
        reduce="amax" if strategy == "max" else "sum",
        strategy=strategy,
    )


def multi_vector_use(loaded):
    """MULTI_VECTOR_USE filled in for the multi-vector model of `loaded`: its similarity and width."""
    dim = loaded.model.dense[-1].linear.out_features
    return MULTI_VECTOR_USE.format(similarity=loaded.model.multivector["similarity"], dim=dim)


def card_settings(flags):
    """The model card's hyper-parameters: the run's flags as given (a dict: the Plan's `flags`),
    with local paths by their last component only (`public_name`)."""
    return {
        **flags,
        "model": public_name(flags["model"]),
        "train_data": ",".join(public_name(p) for p in flags["train_data"].split(",")),
        "output_dir": public_name(flags["output_dir"]),
        "eval_data": ",".join(public_name(p) for p in flags["eval_data"].split(",") if p),
        "resume": public_name(flags["resume"]) if flags["resume"] else "",
    }


def card_notes(plan, loaded):
    """The model card's lines after the final loss, each starting with a newline: Matryoshka
    sizes, prompts, the appended EOS token and LoRA."""
    notes, sizes = "", plan.matryoshka
    if sizes:
        notes += (
            f"\n- Matryoshka: trained at sizes {', '.join(map(str, sizes[0]))} "
            f"(weights {', '.join(f'{w:g}' for w in sizes[1])}): "
            "the first d dimensions of an embedding are an embedding too"
        )
    if loaded.prompts:
        notes += (
            "\n- Prompts, prepended to each column's texts in training (pass `prompt_name`): "
            + ", ".join(f"`{name}`: {json.dumps(prefix)}" for name, prefix in loaded.prompts.items())
        )
    if plan.model.append_eos:
        notes += "\n- Every text ends with the EOS token: the tokenizer appends it (after truncation)"
    if loaded.model.dense:
        sizes = [loaded.model.dense[0].linear.in_features] + [
            d.linear.out_features for d in loaded.model.dense
        ]
        notes += f"\n- Dense layers after pooling ({' -> '.join(map(str, sizes))}), trained with the model"
    if plan.model.bidirectional:
        notes += (
            "\n- Bidirectional attention (config.json: use_bidirectional_attention), in training and here"
        )
    if not loaded.include_prompt:
        notes += "\n- Pooling leaves out the prompt's tokens (1_Pooling: include_prompt false)"
    if plan.model.lora_rank:
        spec = plan.model
        notes += f"\n- LoRA: rank {spec.lora_rank}, alpha {spec.lora_alpha:g}, merged into these weights"
        if plan.export_adapter:
            notes += " (the adapters alone, for peft on the base model: `adapter/`)"
    return notes


def evaluation_section(evaluation, step):
    """The model card's table of the last evaluation ({metric: value}) at `step`; "" without one."""
    if not evaluation:
        return ""
    rows = "\n".join(
        f"| {name} | {value:.4f} |"
        if value is not None and math.isfinite(value)
        else f"| {name} | not computable |"
        for name, value in evaluation.items()
    )
    return f"\n## Evaluation (step {step})\n| metric | value |\n|---|---|\n{rows}\n"
