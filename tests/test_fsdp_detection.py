"""Wrap-class detection for FSDP's auto-wrap policy, on tiny randomly initialised models of each
architecture we support (built from a config: nothing is downloaded), the error a wrong
--fsdp-layer-cls gives before any wrapping, and what --sharding auto chooses.

Run: python -m pytest tests/test_fsdp_detection.py
"""

import pytest
import torch
import torch.distributed as dist
import transformers
from conftest import REPO_DIR, free_port  # noqa: F401  (REPO_DIR puts the repository on sys.path)

from fsdp_embed import embedding_model

import fsdp_utils


from fsdp_embed import sharding

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)

ARCHITECTURES = {  # config -> the block class FSDP must wrap
    "bert": (transformers.BertConfig(**TINY), "BertLayer"),
    "xlm-roberta": (transformers.XLMRobertaConfig(**TINY), "XLMRobertaLayer"),
    "roberta": (transformers.RobertaConfig(**TINY), "RobertaLayer"),
    "mpnet": (transformers.MPNetConfig(**TINY), "MPNetLayer"),
    "distilbert": (
        transformers.DistilBertConfig(vocab_size=128, dim=32, n_layers=3, n_heads=2, hidden_dim=64),
        "TransformerBlock",
    ),
    "modernbert": (
        transformers.ModernBertConfig(
            **TINY,
            global_attn_every_n_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        "ModernBertEncoderLayer",
    ),
    "qwen2": (transformers.Qwen2Config(**TINY, num_key_value_heads=1), "Qwen2DecoderLayer"),
    "llama": (transformers.LlamaConfig(**TINY, num_key_value_heads=1), "LlamaDecoderLayer"),
}


def tiny_model(name):
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(ARCHITECTURES[name][0])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_detects_the_repeated_block(name):
    model = tiny_model(name)
    expected = ARCHITECTURES[name][1]
    assert fsdp_utils.detect_layer_classes(model) == [expected]
    assert {c.__name__ for c in fsdp_utils.resolve_layer_classes(model)} == {expected}
    # The block holds most of the model: wrapping it is what makes sharding pay off.
    blocks = [m for m in model.modules() if type(m).__name__ == expected]
    assert len(blocks) == 3


def test_detection_does_not_trust_no_split_modules():
    """Some models list only the attention class, or nothing, in _no_split_modules."""
    model = tiny_model("xlm-roberta")
    for wrong in (["XLMRobertaAttention"], None, []):
        model._no_split_modules = wrong
        assert fsdp_utils.detect_layer_classes(model) == ["XLMRobertaLayer"]


def test_detection_sees_through_a_wrapper_module():
    """Our EmbeddingModel holds the encoder as `.encoder`: detection runs on the whole model."""

    wrapped = embedding_model.EmbeddingModel(
        tiny_model("qwen2"), pooling="lasttoken", normalize=True, num_labels=3
    )
    assert fsdp_utils.detect_layer_classes(wrapped) == ["Qwen2DecoderLayer"]


def test_explicit_override_is_used_when_present():
    model = tiny_model("bert")
    classes = fsdp_utils.resolve_layer_classes(model, "BertLayer, BertEmbeddings")
    assert {c.__name__ for c in classes} == {"BertLayer", "BertEmbeddings"}


def test_wrong_override_fails_before_wrapping_naming_the_real_classes():
    """The BCEmbedding case: BertLayer given for an XLM-R model. No process group exists here,
    so reaching any FSDP code would fail differently: the error must come first."""
    model = tiny_model("xlm-roberta")
    with pytest.raises(ValueError) as error:
        sharding.wrap_model(model, "fsdp", torch.device("cpu"), layer_cls="BertLayer")
    message = str(error.value)
    assert "BertLayer" in message and "no such layer class" in message
    assert "['XLMRobertaLayer']" in message  # the block it does contain
    assert not any(type(m).__name__.startswith("FullySharded") for m in model.modules())


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_auto_sharding_keeps_gathered_weights_only_for_a_model_small_against_free_memory(
    one_process_group, monkeypatch
):
    """shard_grad_op when a gathered copy of the weights, in the compute dtype, takes at most 10%
    of the free memory; full_shard above that, and when free memory cannot be read."""
    model = transformers.AutoModel.from_config(ARCHITECTURES["bert"][0])
    fp32 = 4 * sum(p.numel() for p in model.parameters())
    cpu = torch.device("cpu")
    for free, low, expected in [
        (10 * fp32 + 10, None, "shard_grad_op"),
        (10 * fp32 - 10, None, "full_shard"),
        (5 * fp32 + 10, torch.bfloat16, "shard_grad_op"),  # bf16 weights: half the bytes
        (5 * fp32 - 10, torch.bfloat16, "full_shard"),
        (None, None, "full_shard"),
    ]:
        monkeypatch.setattr(sharding, "free_memory_per_process", lambda device, free=free: free)
        chosen, why = sharding.auto_sharding(model, cpu, low)
        assert chosen == expected and why.startswith(f"sharding: auto -> {expected}"), (free, low, why)
    monkeypatch.undo()  # this machine's own free memory: a tiny model is small against it
    assert sharding.auto_sharding(model, cpu, None)[0] == "shard_grad_op"
