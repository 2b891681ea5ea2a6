"""Presets have the public shapes they are named after."""

from __future__ import annotations

import pytest

from ramflow.train.modeling import count_parameters, meta_model
from ramflow.train.presets import PRESETS, get_preset


@pytest.mark.parametrize(
    ("name", "num_parameters"),
    [
        ("llama-1b", 1_235_814_400),
        ("llama-3b", 3_212_749_824),
        ("llama-8b", 8_030_261_248),
        ("llama-70b", 70_553_706_496),
        ("anchor-2.7b", 2_690_748_416),
    ],
)
def test_public_parameter_counts(name: str, num_parameters: int) -> None:
    preset = get_preset(name)
    assert preset.num_parameters() == num_parameters
    assert count_parameters(meta_model(preset.to_config())) == num_parameters


def test_anchor_is_the_reference_model() -> None:
    config = get_preset("anchor-2.7b").to_config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        4096,
        11008,
        12,
    )
    assert (config.num_attention_heads, config.vocab_size, config.tie_word_embeddings) == (
        32,
        32000,
        False,
    )
    assert not config.attention_bias and not config.mlp_bias


def test_tiny_takes_the_tokenizer_vocabulary() -> None:
    config = get_preset("tiny").to_config(vocab_size=259)
    assert config.vocab_size == 259
    assert 2e6 < get_preset("tiny").num_parameters(vocab_size=259) < 5e6
    with pytest.raises(ValueError, match="embedding rows"):
        get_preset("anchor-2.7b").to_config(vocab_size=50000)
    with pytest.raises(ValueError, match="choose one of"):
        get_preset("gpt-5")
    with pytest.raises(ValueError, match=r"^preset 'tiny' takes its vocabulary size from the"):
        get_preset("tiny").num_parameters()
    with pytest.raises(ValueError, match=r"^preset 'tiny' needs the tokenizer's vocab_size$"):
        get_preset("tiny").to_config()
    with pytest.raises(ValueError, match=r"is a qwen3_moe model; count its meta model's param"):
        get_preset("qwen3-30b-a3b").num_parameters()
    assert set(PRESETS) == {
        "tiny", "llama-1b", "llama-3b", "llama-8b", "llama-70b", "anchor-2.7b", "qwen3-30b-a3b",
        "deepseek-v2-lite", "gpt-oss-120b",
    }  # fmt: skip


def test_llama_70b_is_llama_3_1_70b() -> None:
    """The numbers of Meta's Llama-3.1-70B config.json."""
    config = get_preset("llama-70b").to_config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        8192,
        28672,
        80,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 128)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.vocab_size == 128256 and not config.tie_word_embeddings
