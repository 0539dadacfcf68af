"""Models that do not fit one device: under FSDP no rank holds the whole model.

- Sharded loading: the model is built on the meta device, sharded, and each rank reads from the
  safetensors files only the slices its shards hold. Trained a few steps, it equals one process
  that loaded the model in full (conftest.assert_same_training: per-step losses, gradient norms
  and every exported tensor to 1e-5): a Qwen2 task checkpoint (its weights under `model.`, an
  lm_head to ignore) under FSDP2 at world 2, Llama under FSDP2 at world 4. (BERT:
  tests/test_equivalence.py, FSDP1 and FSDP2 at world 2, FSDP1 and hybrid at world 4, now all
  loaded this way.)
- Under FSDP2 a rank that does not write never makes a tensor as large as a whole parameter,
  while loading or while exporting: the largest it makes is the embedding's shard (watched from
  outside by tests/memory_worker.py); the writer does read the embedding whole, which shows the
  watch sees what it should.
- The export in files of at most --export-max-shard-size, with an index, in fp32, bf16 or fp16:
  sentence-transformers and AutoModel load it, its tensors are of that dtype, and its embeddings
  equal the trained model's in memory: fp32 to 1e-5; bf16 and fp16 to the rounding of their
  weights (8 and 11 significant bits; measured 3.6e-3 and 4.0e-4 on unit-length embeddings, held
  to 1e-2 and 1e-3).
- A bf16 checkpoint trains fp32 master weights (transformers 5 would load it in bf16, where
  small updates round away).
- A folder the slices cannot be read from (pytorch_model.bin) is loaded in full, with a note.

Run: python -m pytest tests/test_big_models.py
"""

import json
import math

import pytest
import torch
import transformers
from conftest import REPO_DIR, assert_same_training, data_file, export_weights, run_train, sentences, tiny_decoder
from safetensors import safe_open

import train

ARGS = ["--train-data", data_file("sick-pairs-train.jsonl"), "--loss", "mnrl", "--pooling", "lasttoken", "--append-eos",
        "--normalize", "--max-seq-length", 32, "--max-steps", 3, "--lr", 1e-3, "--dropout", 0, "--log-steps", 1,
        "--max-grad-norm", 0.1, "--seed", 5]
TEXTS = sentences(3000)[2990:]


def causal_lm(base, folder):
    """The tiny Qwen2 as a task checkpoint, as LLMs ship: Qwen2ForCausalLM, weights under `model.`."""
    transformers.Qwen2ForCausalLM.from_pretrained(base).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def test_fsdp2_loads_and_exports_without_a_whole_parameter_on_the_other_rank(tmp_path):
    model = causal_lm(tiny_decoder(tmp_path / "base", "qwen2"), tmp_path / "lm")
    with safe_open(model / "model.safetensors", framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" in f.keys()
        vocab, dim = f.get_slice("model.embed_tokens.weight").get_shape()
    # Shards of at most 40 KB: the embedding (vocab x 64 x 4 bytes, ~100 KB) alone, the rest grouped.
    proc = run_train(["--model", model, *ARGS, "--per-device-batch-size", 4, "--strategy", "fsdp", "--fsdp-version", 2,
                      "--export-max-shard-size", "40KB", "--output-dir", tmp_path / "fsdp2"], nproc=2, script=REPO_DIR / "tests" / "memory_worker.py")
    assert "loads the whole model" not in proc.stdout + proc.stderr
    other = json.loads((tmp_path / "fsdp2" / "largest-tensor-rank-1.json").read_text())
    writer = json.loads((tmp_path / "fsdp2" / "largest-tensor-rank-0.json").read_text())
    shard = math.ceil(vocab / 2) * dim * 4  # bytes of the embedding's shard, the largest there is
    assert other["load"] <= shard and other["export"] <= shard, (other, shard, vocab * dim * 4)
    assert writer["export"] >= vocab * dim * 4  # the writer reads it whole: the watch sees reads

    index = json.loads((tmp_path / "fsdp2" / "final" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (tmp_path / "fsdp2" / "final" / "model.safetensors").exists()
    for file in files:
        with safe_open(tmp_path / "fsdp2" / "final" / file, framework="pt") as f:
            sizes = [math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (file, sizes)
    run_train(["--model", model, *ARGS, "--per-device-batch-size", 4, "--grad-accum-steps", 2, "--output-dir", tmp_path / "one"])
    assert_same_training(tmp_path / "fsdp2", tmp_path / "one", num_steps=3)


def test_llama_at_world_4_loaded_into_shards_trains_as_one_process(tmp_path):
    """FSDP2; FSDP1 at world 4 loads the same way in tests/test_equivalence.py (BERT)."""
    tiny_decoder(tmp_path / "base", "llama", padding_side="right")
    run_train(["--model", tmp_path / "base", *ARGS, "--per-device-batch-size", 2, "--grad-accum-steps", 4, "--output-dir", tmp_path / "one"])
    proc = run_train(["--model", tmp_path / "base", *ARGS, "--per-device-batch-size", 2, "--strategy", "fsdp", "--fsdp-version", 2,
                      "--output-dir", tmp_path / "fsdp2"], nproc=4)
    assert "loads the whole model" not in proc.stdout + proc.stderr
    assert_same_training(tmp_path / "fsdp2", tmp_path / "one", num_steps=3)


def embeddings(model, tokenizer, texts):
    with torch.no_grad():
        return model.eval()(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))


@pytest.mark.parametrize("dtype,tolerance", [("fp32", 1e-5), ("bf16", 1e-2), ("fp16", 1e-3)])
def test_sharded_export_loads_in_sentence_transformers_and_automodel(dtype, tolerance, tmp_path):
    from sentence_transformers import SentenceTransformer

    base = tiny_decoder(tmp_path / "base", "qwen2")
    cfg = train.parse_config([str(a) for a in ["--model", base, *ARGS, "--per-device-batch-size", 8, "--export-max-shard-size", "40KB",
                                                "--export-dtype", dtype, "--output-dir", tmp_path / "out"]])
    model = train.main(cfg)
    final = tmp_path / "out" / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert len(set(index["weight_map"].values())) >= 3
    assert {t.dtype for t in export_weights(final).values()} == {torch_dtype}

    tokenizer = transformers.AutoTokenizer.from_pretrained(final)  # it appends EOS, as in training
    ours = embeddings(model, tokenizer, TEXTS)
    st = SentenceTransformer(str(final), device="cpu")
    assert (st.encode(TEXTS, convert_to_tensor=True).float() - ours).abs().max().item() <= tolerance
    auto = transformers.AutoModel.from_pretrained(final)
    assert auto.dtype == torch_dtype
    with torch.no_grad():
        for text, want in zip(TEXTS, ours):  # one text at a time: its last token is its EOS
            got = auto(**tokenizer([text], truncation=True, return_tensors="pt")).last_hidden_state[0, -1].float()
            assert (torch.nn.functional.normalize(got, dim=0) - want).abs().max().item() <= tolerance


def test_a_bf16_checkpoint_trains_fp32_master_weights(tmp_path):
    base = tiny_decoder(tmp_path / "base", "llama")
    transformers.LlamaModel.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    # lr 1e-6: an update far below bf16's resolution, which bf16 weights would round away.
    model = train.main(train.parse_config([str(a) for a in ["--model", base, *ARGS, "--per-device-batch-size", 8, "--lr", 1e-6,
                                                            "--max-grad-norm", 0, "--output-dir", tmp_path / "out"]]))
    trained = export_weights(tmp_path / "out" / "final")
    with safe_open(base / "model.safetensors", framework="pt") as f:
        start = {k: f.get_tensor(k) for k in f.keys()}
    assert {p.dtype for p in model.parameters()} == {t.dtype for t in trained.values()} == {torch.float32}
    weight = "layers.0.mlp.up_proj.weight"
    assert start[weight].dtype == torch.bfloat16
    moved = (trained[weight] != start[weight].float()).float().mean().item()
    assert moved > 0.9 and (trained[weight] - start[weight].float()).abs().max().item() < 1e-4


def test_weights_that_cannot_be_read_by_slices_are_loaded_in_full_with_a_note(tmp_path, capsys):
    base = tiny_decoder(tmp_path / "base", "qwen2")
    (tmp_path / "bin").mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bin" / file).write_bytes((base / file).read_bytes())
    with safe_open(base / "model.safetensors", framework="pt") as f:  # the older pickle format, which has no slices to read
        torch.save({k: f.get_tensor(k) for k in f.keys()}, tmp_path / "bin" / "pytorch_model.bin")
    on_meta = train.load_model(train.Config(model=str(base)), 0, on_meta=True)
    assert on_meta.pretrained_dir == str(base) and all(p.is_meta for p in on_meta.model.parameters())
    assert on_meta.pretrained_names["encoder.layers.1.mlp.down_proj.weight"] == "layers.1.mlp.down_proj.weight"
    in_full = train.load_model(train.Config(model=str(tmp_path / "bin")), 0, on_meta=True)
    assert in_full.pretrained_dir is None and "note: every rank loads the whole model" in capsys.readouterr().out
    want = train.load_model(train.Config(model=str(base)), 0).model.state_dict()
    assert all(torch.equal(in_full.model.state_dict()[k], v) for k, v in want.items())
