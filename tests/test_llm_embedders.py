"""The LLM-embedder recipe: instruction prompts and an EOS that survives truncation.

- `--prompts` trains and evaluates exactly as data with the prefixes written into its texts
  (per-step losses, evaluation metrics and final weights equal), and the export's named prompts
  give, in sentence-transformers, the in-memory model's embeddings of the prompted texts;
- `--append-eos`: every text the encoder sees in training ends with EOS, also texts longer than
  --max-seq-length (cut to the limit, EOS last); the exported tokenizer appends it too, in
  transformers and in sentence-transformers, whose embeddings equal the in-memory model's;
  last-token pooling gives the same embeddings with left and right padding. Tiny Qwen2 and
  Llama models with a byte-level BPE tokenizer trained in the test (EOS, no special tokens
  added by the tokenizer itself).

Run: python -m pytest tests/test_llm_embedders.py
"""

import json

import pytest
import torch
import transformers
from conftest import assert_same_training, data_file, sentences, tiny_decoder

from fsdp_embed import config

from fsdp_embed import embedding_model

from fsdp_embed import __main__ as full_train

PROMPTS = {"anchor": "Instruct: Given a sentence, find its paraphrase\nQuery: ", "positive": "passage: "}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(args):
    """The full trainer in-process (one process): the trained model, still in memory."""
    return full_train.main(config.parse_config([str(a) for a in args]))


def embed(model, tokenizer, texts):
    with torch.no_grad():
        return model.eval()(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))


def test_prompts_train_and_evaluate_as_prefixed_texts_and_reach_the_export(tmp_path, tiny_model):
    from sentence_transformers import SentenceTransformer

    pairs = [json.loads(line) for line in open(data_file("sick-pairs-train.jsonl"))]
    prefixed = [{c: PROMPTS[c] + r[c] for c in r} for r in pairs]
    for name, rows in (("plain", pairs), ("prefixed", prefixed)):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "train.jsonl", rows[:96])
        write_jsonl(tmp_path / name / "dev.jsonl", rows[96:160])  # retrieval: (anchor, positive)
    common = [
        "--model",
        tiny_model,
        "--loss",
        "mnrl",
        "--max-steps",
        4,
        "--per-device-batch-size",
        16,
        "--dropout",
        0,
        "--lr",
        1e-3,
        "--log-steps",
        1,
        "--eval-steps",
        2,
    ]
    model = run(
        [
            *common,
            "--train-data",
            tmp_path / "plain" / "train.jsonl",
            "--eval-data",
            tmp_path / "plain" / "dev.jsonl",
            "--prompts",
            json.dumps(PROMPTS),
            "--output-dir",
            tmp_path / "with-prompts",
        ]
    )
    run(
        [
            *common,
            "--train-data",
            tmp_path / "prefixed" / "train.jsonl",
            "--eval-data",
            tmp_path / "prefixed" / "dev.jsonl",
            "--output-dir",
            tmp_path / "prefixed-data",
        ]
    )

    assert_same_training(tmp_path / "with-prompts", tmp_path / "prefixed-data", num_steps=4)
    evaluations = [
        [
            (r["step"], r["eval"])
            for r in map(json.loads, (tmp_path / out / "metrics.jsonl").read_text().splitlines())
            if "eval" in r
        ]
        for out in ("with-prompts", "prefixed-data")
    ]
    assert [step for step, _ in evaluations[0]] == [2, 4] and "dev/mrr@10" in evaluations[0][0][1]
    assert evaluations[0] == evaluations[1]  # evaluated on the prompted texts

    export = tmp_path / "with-prompts" / "final"
    st = SentenceTransformer(str(export), device="cpu")
    assert {
        name: st.prompts.get(name) for name in PROMPTS
    } == PROMPTS  # (sentence-transformers 6 adds empty "query" and "document")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    texts = [p["anchor"] for p in pairs[200:216]]
    for column, prefix in PROMPTS.items():
        theirs = st.encode(texts, prompt_name=column, convert_to_tensor=True)
        ours = embed(model, tokenizer, [prefix + t for t in texts])
        assert (theirs - ours).abs().max().item() <= 1e-5, column
    assert (
        st.encode(texts, convert_to_tensor=True) - embed(model, tokenizer, texts)
    ).abs().max().item() <= 1e-5  # no prompt: none
    assert 'prompt_name="anchor"' in (export / "README.md").read_text()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_append_eos_ends_every_text_with_eos_in_training_and_in_the_export(arch, tmp_path, monkeypatch):
    from sentence_transformers import SentenceTransformer

    base = tiny_decoder(tmp_path / "base", arch, padding_side="left")
    eos = transformers.AutoTokenizer.from_pretrained(base).eos_token_id
    texts = sentences(4000)[2000:2064]
    long_texts = [" ".join(texts[i : i + 6]) for i in range(0, 60, 6)]  # far beyond 24 tokens
    data = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"anchor": a, "positive": p}
            for a, p in zip(texts[:32] + long_texts, texts[32:] + long_texts[::-1])
        ],
    )
    seen = []
    load_model = embedding_model.load_model

    def load_and_watch(*args, **options):
        loaded = load_model(*args, **options)
        # The tokens of each micro-batch's pool of rows, as the model is called with them.
        loaded.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((kwargs["input_ids"], kwargs["attention_mask"])),
            with_kwargs=True,
        )
        return loaded

    monkeypatch.setattr(embedding_model, "load_model", load_and_watch)
    model = run(
        [
            "--model",
            base,
            "--train-data",
            data,
            "--loss",
            "mnrl",
            "--pooling",
            "lasttoken",
            "--append-eos",
            "--max-seq-length",
            24,
            "--max-steps",
            3,
            "--per-device-batch-size",
            14,
            "--lr",
            1e-3,
            "--output-dir",
            tmp_path / "out",
        ]
    )

    # Training: the last real token of every row is EOS; the long texts were cut to 24 tokens with it.
    assert len(seen) == 3  # 3 steps, both columns together in one call
    lengths = []
    for input_ids, mask in seen:
        last = input_ids.shape[1] - 1 - mask.flip(1).argmax(1)  # left or right padding alike
        assert (input_ids[torch.arange(len(last)), last] == eos).all()
        assert ((input_ids == eos) & mask.bool()).sum(1).eq(1).all()  # one EOS per row, its last token
        lengths += mask.sum(1).tolist()
    assert (
        len(lengths) == 2 * 42 and max(lengths) == 24 and lengths.count(24) >= 2 * len(long_texts)
    )  # long texts cut to 24, EOS kept
    # The export's tokenizer appends it too, after truncation, in transformers and sentence-transformers.
    export = tmp_path / "out" / "final"
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    ids = tokenizer(long_texts + texts[:4], truncation=True)["input_ids"]
    assert all(row[-1] == eos and row.count(eos) == 1 for row in ids) and max(map(len, ids)) == 24
    st = SentenceTransformer(str(export), device="cpu")
    mixed = long_texts[:3] + texts[:5]
    ours_left = embed(model, tokenizer, mixed)
    assert (st.encode(mixed, convert_to_tensor=True) - ours_left).abs().max().item() <= 1e-5
    tokenizer.padding_side = "right"
    ours_right = embed(model, tokenizer, mixed)
    assert (ours_right - ours_left).abs().max().item() <= 1e-5  # last-token pooling finds EOS on either side
    assert not torch.equal(ours_left[0], ours_left[1])
