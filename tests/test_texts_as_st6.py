"""Texts reach the tokenizer as sentence-transformers 6 gives them: as written, never stripped
(2.x-5.x stripped them; a byte-level BPE tokenizer gives a leading, trailing or doubled space a
token of its own), lowercased by the tokenizer itself where a folder says do_lower_case.

- a decoder with a byte-level BPE tokenizer, trained by the full trainer on pairs whose texts have
  leading, trailing and doubled spaces, then exported: our model embeds such texts as
  `SentenceTransformer(export).encode` does, to 1e-6, without a prompt, with each column's prompt
  (`prompt_name`), with --no-include-prompt, and from a do_lower_case folder; the export's model
  card, its plain-transformers example run as written, embeds them so too (1e-5); and the spaces
  are seen (stripped texts embed otherwise), so the test fails if stripping comes back;
- the token file and tokenizing on the fly give the same ids for such texts, and a token file
  written under the old rule (its key without "texts") is not read;
- a lowercasing folder lowercases inside its tokenizer, as sentence-transformers 6 does (not
  Python's str.lower, which differs on a final sigma): the same ids as its tokenize, in the full
  trainer's model and in the one-file loop's (train.py);
- --batch-sampler no_duplicates and --mask-duplicates tell texts apart as sentence-transformers'
  NoDuplicatesBatchSampler does: as written, a space or a capital more is another text.

Run: python -m pytest tests/test_texts_as_st6.py
"""

import hashlib
import json
import os

import pytest
import torch
from conftest import data_file, load_model, start_up, tiny_decoder, warm_run

from fsdp_embed import batches
from fsdp_embed import config
from fsdp_embed import export
import train
from fsdp_embed import token_cache

PROMPTS = {"anchor": "query: ", "positive": "passage: "}
# Greek capitals with a final sigma: the tokenizer's Lowercase gives "οδοσ", Python's str.lower "οδος"
FINAL_SIGMA = "ΟΔΟΣ  ΣΑΣ "


def spaced(text, i):
    """SICK's text with spaces at its edges or doubled, by row."""
    return [f" {text}", f"{text} ", f"  {text}  ", text.replace(" ", "  ", 2), text][i % 5]


def spaced_pairs(folder, num_rows=64):
    """SICK pairs whose texts have leading, trailing and doubled spaces, as a JSON Lines file."""
    with open(data_file("sick-pairs-train.jsonl")) as f:
        rows = [json.loads(line) for line in f][:num_rows]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spaced-pairs.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(
                json.dumps({"anchor": spaced(r["anchor"], i), "positive": spaced(r["positive"], i + 1)})
                + "\n"
            )
    return path, [spaced(r["anchor"], i) for i, r in enumerate(rows)][:16]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return str(tiny_decoder(tmp_path_factory.mktemp("bpe-decoder")))


def lowercasing(decoder, folder):
    """`decoder` copied to `folder` as a SentenceTransformer folder that says do_lower_case."""
    import shutil

    shutil.copytree(decoder, folder)
    st_files = export.sentence_transformer_files(64, pooling_mode="mean", normalize=False, max_seq_length=32)
    st_files["sentence_bert_config.json"]["do_lower_case"] = True
    for name, content in st_files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(json.dumps(content))
    return str(folder)


def card_embeddings(folder, texts):
    """The export's model card: its plain-transformers example, run as written on `texts`."""
    card = (folder / "README.md").read_text()
    code = card.split("## Use with plain transformers\n```python\n")[1].split("```")[0]
    code = code.replace("path/to/this/folder", str(folder))
    namespace = {}
    exec(code.replace('texts = ["A sentence.", "Another one."]', f"texts = {texts!r}"), namespace)
    assert namespace["texts"] == texts
    return namespace["embeddings"]


@pytest.mark.parametrize(
    "include_prompt,lowercase",
    [(True, False), (False, False), (True, True)],
    ids=["prompt-pooled", "no-include-prompt", "do-lower-case"],
)
def test_spaced_texts_embed_as_sentence_transformers_6_encodes_the_export(
    tmp_path, decoder, include_prompt, lowercase
):
    from sentence_transformers import SentenceTransformer

    data, texts = spaced_pairs(tmp_path / "data")
    texts = [*texts, FINAL_SIGMA]
    base = lowercasing(decoder, tmp_path / "lowercasing") if lowercase else decoder
    args = ["--model", base, "--train-data", data, "--max-steps", 2, "--per-device-batch-size", 8]
    args += ["--prompts", json.dumps(PROMPTS), "--output-dir", tmp_path / "out", "--lr", 1e-3]
    warm_run([*args, *([] if include_prompt else ["--no-include-prompt"])])
    export = str(tmp_path / "out" / "final")
    loaded = load_model(config.Config(model=export, prompts=json.dumps(PROMPTS)))
    assert (loaded.include_prompt, loaded.lowercase) == (include_prompt, lowercase)
    model, st = loaded.model.eval(), SentenceTransformer(export, device="cpu")

    def ours(texts, column=None):
        prompted = batches.with_prompt(texts, loaded.prompts, column) if column else texts
        with torch.no_grad():
            return model(**loaded.tokenize(prompted, [column] * len(texts)))

    for column in [None, *PROMPTS]:
        theirs = st.encode(texts, prompt_name=column, convert_to_tensor=True)
        assert (ours(texts, column) - theirs).abs().max().item() <= 1e-6, column
    stripped = st.encode([t.strip() for t in texts], convert_to_tensor=True)
    assert (ours(texts) - stripped).abs().max().item() > 1e-3  # the spaces reach the tokenizer
    by_hand = card_embeddings(tmp_path / "out" / "final", texts)
    assert (by_hand - st.encode(texts, convert_to_tensor=True)).abs().max().item() <= 1e-5


@pytest.mark.quick
def test_the_token_file_holds_the_ids_of_texts_as_written_and_an_old_file_is_not_read(tmp_path, decoder):
    data, _ = spaced_pairs(tmp_path / "data")
    args = ["--model", decoder, "--train-data", str(data), "--output-dir", str(tmp_path / "out")]
    args += ["--prompts", json.dumps(PROMPTS), "--per-device-batch-size", "8"]
    cfg = config.parse_config(args)
    plan = start_up(cfg)
    loaded, ts = load_model(cfg), plan.train_sets[0]
    fallback = str(tmp_path / "fallback")
    # A file at the name the old rule's key gives (stripped texts' ids): never read.
    old_key = {k: v for k, v in token_cache.cache_key(ts, loaded, "f").items() if k != "texts"}
    old_name = hashlib.sha256(json.dumps(old_key, sort_keys=True).encode()).hexdigest()[:20]
    new_path = token_cache.cache_path(ts, loaded, fallback, "f")
    old_path = os.path.join(os.path.dirname(new_path), f"tokens-{ts.name}-{old_name}.arrow")
    assert old_path != new_path
    with open(old_path, "wb") as f:
        f.write(b"stripped ids, written before")
    table, path, wrote = token_cache.write_or_read_token_table(ts, loaded, fallback, "f")
    assert wrote and path == new_path
    indices = torch.arange(16)
    rows = ts.ds[indices]
    want, _ = batches.collate(rows, ts.text_columns, ts.target, ts.loss, loaded.tokenize, "cpu", ts.prompts)
    got = token_cache.features(table, indices, ts.text_columns, loaded)
    for g, w in zip(got, want):
        assert all(torch.equal(g[k], w[k]) for k in w)
    # Against the tokenizer itself, called on each prompted text as written: the stored ids.
    for i, text in enumerate(rows["anchor"]):
        written = loaded.tokenizer(
            PROMPTS["anchor"] + text, truncation=True, max_length=loaded.max_seq_length
        )
        assert table.column("anchor")[i].as_py() == written["input_ids"], (i, text)
    stripped = loaded.tokenize([PROMPTS["anchor"] + t.strip() for t in rows["anchor"]])
    assert not torch.equal(stripped["input_ids"], want[0]["input_ids"])  # the spaces are in the ids


@pytest.mark.quick
def test_a_lowercasing_folder_lowercases_in_its_tokenizer_as_sentence_transformers_6(tmp_path, decoder):
    """do_lower_case: texts and prompts are lowercased by the tokenizer itself (a Lowercase
    normaliser, as sentence-transformers 6 adds), not in Python before it: the same ids as
    sentence-transformers 6 gives the folder's texts, spaces kept, in the full trainer's model and
    in the one-file loop's (train.py)."""
    from sentence_transformers import SentenceTransformer

    folder = lowercasing(decoder, tmp_path / "lowercasing")
    loaded = load_model(config.Config(model=folder))
    assert loaded.lowercase
    texts = ["  A Man Plays ", "a man plays", "Ärger  ÜBER Öl", FINAL_SIGMA]
    st = SentenceTransformer(folder, device="cpu")
    theirs = st.preprocess(texts)["input_ids"]
    assert torch.equal(loaded.tokenize(texts)["input_ids"], theirs)
    _, loop_tokenize, _ = train.load_model(str(folder), dropout=None, max_seq_length=0, seed=12, num_labels=0)
    assert torch.equal(loop_tokenize(texts)["input_ids"], theirs)
    assert theirs[0].tolist() != theirs[1].tolist()  # the spaces stay
    # The final sigma tells the tokenizer's Lowercase from Python's str.lower.
    lowered = st.preprocess([FINAL_SIGMA.lower()])["input_ids"]
    assert lowered.tolist() != st.preprocess([FINAL_SIGMA])["input_ids"].tolist()
    assert (
        loaded.tokenize(["A MAN"])["input_ids"].tolist() == loaded.tokenize(["a man"])["input_ids"].tolist()
    )


@pytest.mark.quick
def test_duplicates_are_texts_as_written_as_in_the_no_duplicates_sampler_of_sentence_transformers():
    """--batch-sampler no_duplicates (batches.text_hashes, no_duplicate_batches) and
    --mask-duplicates (batches.text_ids) compare texts as sentence-transformers'
    NoDuplicatesBatchSampler does (str(value), as written): texts that differ by a space or a
    capital are other texts and may share a batch; an exact repeat may not."""
    from datasets import Dataset
    from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

    texts = ["A man plays.", "A man plays. ", " A man plays.", "A man  plays.", "a man plays."]
    rows = Dataset.from_dict({"anchor": texts, "positive": [f"Row {i}." for i in range(len(texts))]})
    ids = batches.text_ids(texts)
    assert len(set(ids.tolist())) == len(texts)
    assert torch.equal(batches.text_ids(texts[:1] * 2), ids[:1].repeat(2))
    hashes = batches.text_hashes(rows, ["anchor", "positive"])
    order = torch.arange(len(texts))
    ours = batches.no_duplicate_batches(hashes, order, len(texts)).tolist()
    theirs = list(NoDuplicatesBatchSampler(rows, batch_size=len(texts), drop_last=True))
    assert sorted(ours) == sorted(theirs[0]) == list(range(len(texts)))
    # An exact repeat (row 5's positive is row 0's anchor) never shares a batch with it, in either.
    positives = [f"Row {i}." for i in range(len(texts))] + [texts[0]]
    repeated = Dataset.from_dict({"anchor": [*texts, "Row 5."], "positive": positives})
    hashes = batches.text_hashes(repeated, ["anchor", "positive"])
    ours = batches.no_duplicate_batches(hashes, torch.arange(6), 3).view(-1, 3).tolist()
    theirs = list(NoDuplicatesBatchSampler(repeated, batch_size=3, drop_last=True))
    assert ours and theirs
    for batch in ours + theirs:
        assert not {0, 5} <= set(batch), batch
