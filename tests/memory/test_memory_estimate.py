"""``estimate_memory`` on any model: the figures follow from its shapes and the plan that
``ramflow.offload`` really makes; ``ramflow plan`` goes through the same function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ramflow
from ramflow.memory import ActivationProfile, activation_report, estimate_memory

B, D, NUM_BLOCKS = 4, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _profile() -> ActivationProfile:
    torch.manual_seed(0)
    return ActivationProfile.from_report(activation_report(Net(), torch.randn(B, D)))


def test_profile_from_a_report_splits_blocks_from_the_rest() -> None:
    torch.manual_seed(0)
    report = activation_report(Net(), torch.randn(B, D))
    profile = ActivationProfile.from_report(report)
    names = [f"blocks.{i}" for i in range(NUM_BLOCKS)]
    assert profile.layer_bytes == tuple(report[n].saved_bytes for n in names)
    # each block saves its input (up), the ReLU output (down's input): 4 * B * (D + 4D) fp32
    assert profile.layer_bytes == (4 * B * 5 * D,) * NUM_BLOCKS
    assert profile.layer_input_bytes == 4 * B * D
    assert profile.other_bytes == report.total_saved_bytes - sum(profile.layer_bytes)
    assert profile.saved_bytes(checkpointing=True) < profile.saved_bytes(checkpointing=False)


def test_figures_follow_the_shapes_and_match_the_real_plan() -> None:
    profile = _profile()
    with torch.device("meta"):
        meta = Net()
    meta.head.weight.requires_grad_(False)
    est = estimate_memory(
        meta, activations=profile, batch_size=B, seq_len=1, device_type="cpu",
        wire_dtype=torch.float32,
    )  # fmt: skip
    numel = sum(p.numel() for p in meta.parameters())
    trainable = numel - D * D
    assert est.num_parameters == numel and est.num_trainable == trainable
    # host buffers are flat per unit, each parameter padded to 256 elements (the engine's
    # alignment): what the estimate counts, so the figures are exact sums of padded sizes
    padded = sum(-(-p.numel() // 256) * 256 for p in meta.parameters())
    padded_trainable = padded - D * D
    assert est.host_optimizer_bytes == 2 * padded_trainable * 4  # AdamW: two fp32 states
    assert est.host_parameter_pageable_bytes == padded * 4  # fp32 masters, no wire copy
    assert est.checkpoint_bytes == numel * 4 + 2 * trainable * 4  # unpadded on disk
    assert est.device_activation_bytes == profile.peak_bytes(checkpointing=False)
    assert not est.checkpointing  # auto without a budget: off
    assert "parameters" in est.describe() and "activations" in est.describe()

    torch.manual_seed(0)
    real = Net()
    real.head.weight.requires_grad_(False)
    ramflow.offload(real, device="cpu", wire_dtype=torch.float32)
    try:
        plan = ramflow.get_plan(real)
        assert plan.resident == est.plan.resident
        assert plan.window_bytes == est.plan.window_bytes
        assert plan.grad_bytes == est.device_gradient_bytes
    finally:
        ramflow.undo(real)


def test_a_budget_turns_checkpointing_on_and_a_smaller_one_is_refused() -> None:
    profile = _profile()
    with torch.device("meta"):
        meta = Net()
    common = dict(activations=profile, batch_size=B, seq_len=1, wire_dtype=torch.float32)
    free = estimate_memory(meta, **common)
    need = free.device_total_bytes
    est = estimate_memory(meta, gpu_memory=need - 1, **common)
    assert est.checkpointing
    assert est.device_activation_bytes == profile.peak_bytes(checkpointing=True)
    assert est.device_total_bytes <= need - 1
    with pytest.raises(ValueError, match="too small for this run"):
        estimate_memory(meta, gpu_memory=1024, **common)
    with pytest.raises(ValueError, match="choose one of"):
        estimate_memory(meta, checkpointing="sometimes", **common)
