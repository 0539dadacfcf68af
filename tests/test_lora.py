"""LoRA (--lora-rank), against peft itself and against full runs of `python -m fsdp_embed`:

- our layer's forward and gradients equal peft's LoRA layer with the same A and B, and a fresh
  adapter (B = 0) leaves the model's outputs bitwise unchanged;
- after training, every frozen tensor (the embedding matrix too) is bitwise the base model's,
  the optimizer holds state for the adapters only, the merged export gives the in-memory
  model's embeddings in sentence-transformers, and the PEFT adapter folder (--export-adapter)
  loads in peft on the base model with the same embeddings;
- world 2 under DDP, FSDP1 and FSDP2 (with GradCache) trains as one process with 2
  accumulation steps (per-step losses, gradient norms, merged weights <= 1e-5), and under FSDP2
  with gathered negatives as one process with the whole batch;
- a run killed after a checkpoint and resumed ends bitwise equal to a straight one.
Tiny random Qwen2 (byte-level BPE tokenizer trained in the test, EOS, last-token pooling) and
BERT models.

Run: python -m pytest tests/test_lora.py
"""

import json

import pytest
import torch
import transformers
from conftest import assert_same_training, data_file, read_metrics, run_train, tiny_decoder, warm_run
from safetensors import safe_open
from safetensors.torch import load_file

from fsdp_embed import config

from fsdp_embed import embedding_model

import fsdp_utils
from fsdp_embed import lora
from fsdp_embed import __main__ as full_train


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny_decoder(tmp_path_factory.mktemp("qwen2"), "qwen2", padding_side="left")


def block_linears(encoder):
    return lora.linear_names(encoder, fsdp_utils.resolve_layer_classes(encoder))


def test_our_layer_is_peft_s_layer(qwen2):
    import peft

    torch.manual_seed(0)
    ours = transformers.AutoModel.from_pretrained(qwen2)
    theirs = transformers.AutoModel.from_pretrained(qwen2)
    ids = torch.randint(0, 300, (3, 11))
    with torch.no_grad():
        base_out = ours(input_ids=ids).last_hidden_state
    names = block_linears(ours)
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    lora.add_lora(ours, names, rank=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).last_hidden_state, base_out)  # B = 0: the base model, bitwise
    theirs = peft.get_peft_model(
        theirs, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=names)
    )
    for name in names:  # the same A, and a B that is not zero
        layer = ours.get_submodule(name)
        torch.nn.init.normal_(layer.lora_B, std=0.1)
        theirs_layer = theirs.base_model.model.get_submodule(name)
        theirs_layer.lora_A["default"].weight.data.copy_(layer.lora_A.data)
        theirs_layer.lora_B["default"].weight.data.copy_(layer.lora_B.data)
    out, out_peft = ours(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state
    assert (out - out_peft).abs().max().item() <= 1e-6 and (out - base_out).abs().max().item() > 1e-3
    (out**2).sum().backward()
    (out_peft**2).sum().backward()
    for name in names:
        layer, theirs_layer = ours.get_submodule(name), theirs.base_model.model.get_submodule(name)
        assert (
            layer.lora_A.grad - theirs_layer.lora_A["default"].weight.grad
        ).abs().max().item() <= 1e-5 * layer.lora_A.grad.abs().max().item()
        assert (
            layer.lora_B.grad - theirs_layer.lora_B["default"].weight.grad
        ).abs().max().item() <= 1e-5 * layer.lora_B.grad.abs().max().item()
        assert layer.base.weight.grad is None  # frozen
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith((".lora_A", ".lora_B")) for n in trained)


def test_lora_trains_only_the_adapters_and_exports_merged_and_as_a_peft_adapter(qwen2, tmp_path):
    import peft
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "out"
    model = full_train.main(
        config.parse_config(
            [
                str(a)
                for a in [
                    "--model",
                    qwen2,
                    "--pooling",
                    "lasttoken",
                    "--train-data",
                    data_file("sick-pairs-train.jsonl"),
                    "--loss",
                    "mnrl",
                    "--max-steps",
                    4,
                    "--per-device-batch-size",
                    16,
                    "--max-seq-length",
                    32,
                    "--lr",
                    1e-2,
                    "--lora-rank",
                    4,
                    "--lora-dropout",
                    0.1,
                    "--export-adapter",
                    "--save-steps",
                    4,
                    "--output-dir",
                    out,
                ]
            ]
        )
    )

    base = load_file(qwen2 / "model.safetensors")
    state = {k.removeprefix("encoder."): v for k, v in model.state_dict().items()}
    adapters = [k for k in state if k.endswith((".lora_A", ".lora_B"))]
    frozen = {k.replace(".base.", "."): v for k, v in state.items() if k not in adapters}
    assert frozen.keys() == base.keys() and all(
        torch.equal(frozen[k], base[k]) for k in base
    )  # embeddings, norms, every base weight
    assert all(state[k].abs().max() > 0 for k in adapters if k.endswith(".lora_B"))  # the adapters trained
    with safe_open(
        out / "checkpoints" / "step-4" / "shard-00001-model-00001-of-00001.safetensors", "pt"
    ) as shard:
        optimizer_state = [k for k in shard.keys() if k.startswith("optim.state.")]
    assert optimizer_state and all(".lora_A." in k or ".lora_B." in k for k in optimizer_state)

    texts = [json.loads(line)["anchor"] for line in open(data_file("sick-pairs-train.jsonl"))][-12:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "final")
    batch = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        ours = model.eval()(**batch)
        theirs = SentenceTransformer(str(out / "final"), device="cpu").encode(texts, convert_to_tensor=True)
        assert (theirs - ours).abs().max().item() <= 1e-5  # the merged export
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModel.from_pretrained(qwen2), out / "final" / "adapter"
        ).eval()
        states = with_adapter(**batch).last_hidden_state
        pooled = (
            torch.nn.functional.normalize(
                embedding_model.pool(states, batch["attention_mask"], "lasttoken"), dim=-1
            )
            if model.normalize
            else embedding_model.pool(states, batch["attention_mask"], "lasttoken")
        )
        assert (pooled - ours).abs().max().item() <= 1e-5  # the PEFT adapter on the base model
    assert json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())["r"] == 4


LORA = ["--lora-rank", 4, "--lora-alpha", 16]


@pytest.mark.parametrize(
    "model, strategy",
    [
        ("bert", ["--strategy", "ddp"]),
        ("qwen2", ["--strategy", "fsdp", "--fsdp-version", 1]),
        ("qwen2", ["--strategy", "fsdp", "--fsdp-version", 2, "--cache-chunk-size", 3]),
    ],
    ids=["ddp-bert", "fsdp1-qwen2", "fsdp2-gradcache-qwen2"],
)
def test_lora_at_world_2_trains_as_one_process(model, strategy, tmp_path, tiny_model, qwen2):
    folder = tiny_model if model == "bert" else qwen2
    args = [
        "--model",
        folder,
        "--train-data",
        data_file("sick-triplets-train.jsonl"),
        "--loss",
        "mnrl",
        "--max-steps",
        3,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--lr",
        1e-2,
        "--dropout",
        0,
        *LORA,
        *(["--pooling", "lasttoken"] if model == "qwen2" else []),
    ]
    warm_run([*args, *strategy, "--per-device-batch-size", 6, "--output-dir", tmp_path / "world2"], nproc=2)
    warm_run(
        [*args, "--per-device-batch-size", 6, "--grad-accum-steps", 2, "--output-dir", tmp_path / "single"]
    )
    assert_same_training(tmp_path / "world2", tmp_path / "single", num_steps=3)


def test_lora_resumes_exactly(tmp_path, qwen2):
    args = [
        "--model",
        qwen2,
        "--pooling",
        "lasttoken",
        "--train-data",
        data_file("sick-triplets-train.jsonl"),
        "--max-steps",
        4,
        "--save-steps",
        2,
        "--per-device-batch-size",
        4,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--lr",
        1e-2,
        "--lora-dropout",
        0.1,
        *LORA,
    ]
    warm_run([*args, "--output-dir", tmp_path / "straight"])
    run_train(
        [*args, "--output-dir", tmp_path / "broken", "--resume", "auto"], kill="after-save:2:0", check=False
    )
    assert [r["step"] for r in read_metrics(tmp_path / "broken")] == [1, 2]
    warm_run([*args, "--output-dir", tmp_path / "broken", "--resume", "auto"])
    got, want = read_metrics(tmp_path / "broken"), read_metrics(tmp_path / "straight")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in want
    ]
    got_w, want_w = (
        load_file(tmp_path / "broken" / "final" / "model.safetensors"),
        load_file(tmp_path / "straight" / "final" / "model.safetensors"),
    )
    assert got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)


def test_lora_with_gathered_negatives_at_world_2_trains_as_one_process_with_the_whole_batch(tmp_path, qwen2):
    args = [
        "--model",
        qwen2,
        "--pooling",
        "lasttoken",
        "--train-data",
        data_file("sick-triplets-train.jsonl"),
        "--loss",
        "mnrl",
        "--max-steps",
        3,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--lr",
        1e-2,
        "--dropout",
        0,
        *LORA,
    ]
    warm_run(
        [
            *args,
            "--strategy",
            "fsdp",
            "--fsdp-version",
            2,
            "--gather-negatives",
            "--per-device-batch-size",
            6,
            "--output-dir",
            tmp_path / "world2",
        ],
        nproc=2,
    )
    warm_run([*args, "--per-device-batch-size", 12, "--output-dir", tmp_path / "single"])
    assert_same_training(tmp_path / "world2", tmp_path / "single", num_steps=3)
