"""The planner knows mixtures of experts (issue 47, point 2) and every MFU counts active
weights and attention (point 3): parameters in total and active per token against hand
counts of tiny configs, a Qwen3-30B-A3B plan's compute from its active experts, and the
FLOPs per token at long sequences."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_models import FAMILIES, HAND_COUNTS, moe_config

pytest.importorskip("transformers")

from ramflow.planner.costs import (  # noqa: E402
    ExpertRouting,
    attention_width,
    parameter_counts,
    unit_costs,
    unit_shapes,
)
from ramflow.planner.predict import DEFAULT_MATMUL_FLOPS_PER_S  # noqa: E402
from ramflow.train.flops import model_flops_per_token, training_flops_per_token  # noqa: E402
from ramflow.train.modeling import meta_model  # noqa: E402
from ramflow.train.presets import get_preset  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_active_parameters_are_the_hand_count(family: str) -> None:
    model = meta_model(moe_config(family))
    counts = parameter_counts(model)
    assert (counts.total, counts.active) == HAND_COUNTS[family]
    assert counts.routing is not None and counts.routing.num_active == 2
    # the units' FLOP weights are the model's active matrices, embedding table aside
    assert sum(s.matmul_params for s in unit_shapes(model)) == counts.active_matmul
    assert counts.active_matmul == counts.active_trained_matmul < counts.active
    # host bytes move every expert
    assert sum(s.numel for s in unit_shapes(model)) >= counts.total


def test_qwen3_moe_matmul_weights_by_hand() -> None:
    counts = parameter_counts(meta_model(moe_config("qwen3_moe")))
    d = 64
    # per layer q, k, v, o; the router; 2 of 8 experts (gate, up, down of width 32); the head
    layer = d * 64 + 2 * d * 32 + 64 * d + 8 * d + 2 * 3 * d * 32
    assert counts.active_matmul == 2 * layer + 272 * d


def test_a_dense_model_is_all_active() -> None:
    model = meta_model(get_preset("llama-1b").to_config())
    counts = parameter_counts(model)
    assert counts.routing is None and counts.active == counts.total == 1_235_814_400


def test_routing_from_the_config() -> None:
    assert ExpertRouting.from_config(moe_config("deepseek_v3")) == ExpertRouting(8, 2)
    assert ExpertRouting.from_config(get_preset("llama-8b").to_config()) is None
    config = moe_config("mixtral")
    config.num_experts_per_tok = 0
    with pytest.raises(ValueError, match="experts per token"):
        ExpertRouting.from_config(config)
    with pytest.raises(ValueError, match="1 <= experts per token <= experts"):
        ExpertRouting(num_experts=4, num_active=5)


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
        ("deepseek-v2-lite", 15_706_484_224, 2_661_150_208),
        # the model card's 116.8 B and 5.1 B active, plus the 0.58 B embedding's rows read
        ("gpt-oss-120b", 116_829_156_672, 5_711_982_912),
    ],
)
def test_moe_presets_are_the_public_shapes(name: str, total: int, active: int) -> None:
    counts = parameter_counts(meta_model(get_preset(name).to_config()))
    assert (counts.total, counts.active) == (total, active)


def _gpu_compute_s(model: torch.nn.Module, shapes, *, batch: int, seq: int) -> float:
    costs = unit_costs(
        shapes,
        batch=batch,
        seq=seq,
        hidden=attention_width(model.config),
        wire_itemsize=2,
        matmul_flops_per_s=DEFAULT_MATMUL_FLOPS_PER_S,
        causal=True,
    )
    return sum(c.forward_s + c.backward_s for c in costs)


def test_plan_compute_scales_with_active_experts() -> None:
    """Qwen3-30B-A3B at 16 x 4096: the GPU's work is that of its 8 active experts of 128."""
    model = meta_model(get_preset("qwen3-30b-a3b").to_config())
    active = unit_shapes(model)
    every_expert = unit_shapes(model, routing=None)
    assert [s.numel for s in active] == [s.numel for s in every_expert]  # bytes: all experts
    counts = parameter_counts(model)
    dense = parameter_counts(model, routing=None)
    assert dense.active_matmul > 8 * counts.active_matmul
    with_active = _gpu_compute_s(model, active, batch=16, seq=4096)
    with_all = _gpu_compute_s(model, every_expert, batch=16, seq=4096)
    no_weights = [dataclasses.replace(s, matmul_params=0) for s in active]
    attention = _gpu_compute_s(model, no_weights, batch=16, seq=4096)
    # the weights' share scales with the active weights; attention is the same
    ratio = (with_active - attention) / (with_all - attention)
    assert ratio == pytest.approx(counts.active_matmul / dense.active_matmul, rel=1e-9)
    # seconds, without recomputation: about 3, where counting every expert gave 19
    assert 2.0 < with_active < 4.0 < 15.0 < with_all


def test_mfu_counts_attention_at_long_sequences() -> None:
    """Llama 3.1-8B at 128k tokens: attention costs more than twice the weights."""
    model = meta_model(get_preset("llama-8b").to_config())
    n = parameter_counts(model).active_matmul
    seq = 131072
    per_token = model_flops_per_token(model, seq_len=seq)
    assert per_token == pytest.approx(6 * n + 6 * 32 * 32 * 128 * seq, rel=1e-12)
    assert per_token > 3 * 6 * n  # an MFU of 6 N alone would read under a third of this
    # short sequences: the weights dominate
    assert model_flops_per_token(model, seq_len=512) < 1.05 * 6 * n


def test_mfu_of_a_mixture_counts_its_active_experts() -> None:
    model = meta_model(get_preset("qwen3-30b-a3b").to_config())
    counts = parameter_counts(model)
    per_token = model_flops_per_token(model, seq_len=4096)
    assert per_token == pytest.approx(
        6 * counts.active_matmul + 6 * 48 * 32 * 128 * 4096, rel=1e-12
    )


def test_frozen_weights_cost_four_flops_per_token() -> None:
    model = meta_model(get_preset("llama-1b").to_config())
    full = model_flops_per_token(model, seq_len=1024)
    frozen = model.model.layers[0].mlp.down_proj.weight
    frozen.requires_grad_(False)
    assert model_flops_per_token(model, seq_len=1024) == pytest.approx(
        full - 2 * frozen.numel(), rel=1e-12
    )
    assert training_flops_per_token(
        matmul_params=10, trained_matmul_params=0, seq_len=8, attention_layers=0, attention_width=0
    ) == pytest.approx(40)


def test_latent_attention_width() -> None:
    """DeepSeek's latent attention: query-key heads of 128 + 64, value heads of 128."""
    assert attention_width(get_preset("deepseek-v2-lite").to_config()) == 16 * (192 + 128) // 2
    assert attention_width(get_preset("qwen3-30b-a3b").to_config()) == 32 * 128
