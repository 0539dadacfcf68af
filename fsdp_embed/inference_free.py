"""Inference-free SPLADE: queries are not run through the model. Each query is the learned weight of
every vocabulary entry among its tokens (sentence-transformers' SparseStaticEmbedding, on the
"query" route of a Router); only documents go through the masked LM and SpladePooling (splade.py).
A search engine then encodes a query by a table lookup.

    e_q[v] = w[v] if token v is among the query's tokens (attention mask 1), else 0     (B, V)

The query is tokenized without special tokens (no [CLS] / [SEP] entry), as
SparseStaticEmbedding.preprocess does, and cut at the query column's length (the export writes the
model's max_seq_length as its tokenizer's model_max_length, where SparseStaticEmbedding cuts).
The weights start at ones, or from an IDF file ({token: weight} JSON, read as
SparseStaticEmbedding.from_json reads it: entries it does not name start at 0), or as a Router
folder saved them; a folder saved with frozen: true keeps them.

In training (embedding_model.EmbeddingModel.forward with `static_ids`): the query column's rows are
looked up, the other columns' rows run the encoder, in one forward of the wrapped model, so FSDP
gathers the weights with the root's other parameters. The weights train at their own learning rate
(--static-lr, 1e-3 beside a base of 2e-5 in sentence-transformers' recipe) and with weight decay,
as the Hugging Face Trainer decays them (its rule exempts biases and LayerNorm weights by name, not
1-D tensors). The recipe trains without the query regulariser: it is off here unless
--query-regularizer-weight is given.

Needs torch, safetensors and transformers (the tokenizer's vocabulary); nothing from the project.
"""

import json
import os

import torch
from safetensors.torch import load_file


class StaticEmbedding(torch.nn.Module):
    """SparseStaticEmbedding's forward: token ids (B, T) and their attention mask -> (B, V), the
    weight of each vocabulary entry present in the row. A token that occurs twice counts once."""

    def __init__(self, weight_V, frozen=False):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_V.float(), requires_grad=not frozen)
        self.frozen = frozen

    def forward(self, ids_BT, mask_BT):
        # amax, not scatter's overwrite: a padding id that is also a real token keeps its 1
        presence_BV = torch.zeros(ids_BT.shape[0], self.weight.shape[0], device=ids_BT.device)
        presence_BV = presence_BV.scatter_reduce(1, ids_BT, mask_BT.float(), reduce="amax")
        return presence_BV.to(self.weight.dtype) * self.weight


def static_embedding(spec, st_config, path, tokenizer):
    """The StaticEmbedding of an inference-free SPLADE model (ModelSpec `spec`), else None: a Router
    folder's saved weights (`st_config["static_queries"]`: its folder and frozen), or with
    --inference-free-queries ones, or the --idf-file's weights."""
    saved = st_config.get("static_queries")
    if saved:
        file = os.path.join(path, saved["folder"], "model.safetensors")
        return StaticEmbedding(load_file(file)["weight"], saved["frozen"])
    inference_free, idf_file = spec.static_queries
    if not inference_free:
        return None
    vocab_size = len(tokenizer.get_vocab())  # SparseStaticEmbedding's size, as it counts it
    return StaticEmbedding(
        idf_weights(idf_file, tokenizer, vocab_size) if idf_file else torch.ones(vocab_size)
    )


def idf_weights(idf_file, tokenizer, vocab_size):
    """(V,) weights from an IDF file, {token: weight}, as SparseStaticEmbedding.from_json reads it:
    each token's id by the tokenizer, 0 for the entries the file does not name. Raises ValueError
    for a file that is not such a JSON object, or names a token the vocabulary lacks."""
    try:
        with open(idf_file, encoding="utf8") as f:
            idf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--idf-file {idf_file}: cannot read it as JSON ({e}); pass a {{token: weight}} file"
        )
    if not isinstance(idf, dict) or not all(isinstance(w, (int, float)) for w in idf.values()):
        raise ValueError(f"--idf-file {idf_file}: must be a JSON object of token: weight numbers")
    vocab = tokenizer.get_vocab()
    unknown = [token for token in idf if token not in vocab]
    if unknown:
        raise ValueError(
            f"--idf-file {idf_file}: {len(unknown)} tokens are not in the tokenizer's vocabulary "
            f"(first: {unknown[0]!r}); write the file with this model's tokenizer"
        )
    weight_V = torch.zeros(vocab_size)
    weight_V[[vocab[token] for token in idf]] = torch.tensor(list(idf.values()), dtype=torch.float32)
    return weight_V


def tokenize_for_evaluation(loaded, query_column):
    """tokenize(texts, columns) for eval_dist's retrieval: the queries' (`query_column`'s texts)
    token ids as static_ids / static_mask, which EmbeddingModel.forward looks up without running
    the encoder; the corpus' as documents. A model without static queries: loaded.tokenize."""
    if not loaded.static_queries:
        return loaded.tokenize

    def tokenize(texts, columns):
        tasks = ["query" if column == query_column else "document" for column in columns]
        assert len(set(tasks)) == 1, "eval_dist encodes the queries and the corpus apart"
        tokens = loaded.tokenize(texts, columns, tasks=tasks)
        if tasks[0] == "document":
            return tokens
        return {"static_ids": tokens["input_ids"], "static_mask": tokens["attention_mask"]}

    return tokenize
