"""``estimate_memory`` on any model: the figures follow from its shapes and the plan that
``ramflow.offload`` really makes; ``ramflow plan`` goes through the same function."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ramflow
from ramflow.memory import (
    ActivationProfile,
    RunDescription,
    activation_report,
    estimate_memory,
    find_blocks,
)
from ramflow.transfer.streams import caching_host_block_bytes

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


class ExpertBlock(nn.Module):
    """A block holding a numbered ModuleList of its own, with more members than the model
    has blocks (experts, heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, 4) for _ in range(8))
        self.out = nn.Linear(32, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.cat([torch.tanh(e(x)) for e in self.experts], -1))


def test_profile_default_layers_are_the_blocks_find_blocks_names() -> None:
    torch.manual_seed(0)
    model = Net()
    model.blocks = nn.ModuleList(ExpertBlock() for _ in range(NUM_BLOCKS))
    report = activation_report(model, torch.randn(B, D))
    names = [name for name, _ in find_blocks(model)]
    assert report.blocks == tuple(names) == ("blocks.0", "blocks.1", "blocks.2")
    profile = ActivationProfile.from_report(report)
    # not the 8 experts of blocks.0, the prefix with the most numbered rows
    assert profile == ActivationProfile.from_report(report, blocks=names)
    assert profile.layer_bytes == tuple(report[n].saved_bytes for n in names)
    # a model without repeated blocks: no layers, everything is "other"
    flat = nn.Sequential(nn.Linear(D, D), nn.ReLU())
    flat_report = activation_report(flat, torch.randn(B, D))
    assert flat_report.blocks == ()
    assert ActivationProfile.from_report(flat_report).other_bytes == flat_report.total_saved_bytes


def test_figures_follow_the_shapes_and_match_the_real_plan() -> None:
    profile = _profile()
    with torch.device("meta"):
        meta = Net()
    meta.head.weight.requires_grad_(False)
    est = estimate_memory(
        meta, activations=profile, run=RunDescription(B, 1), device_type="cpu",
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
    common = dict(activations=profile, run=RunDescription(B, 1), wire_dtype=torch.float32)
    free = estimate_memory(meta, **common)
    need = free.device_total_bytes
    est = estimate_memory(meta, device_budget=need - 1, **common)
    assert est.checkpointing
    assert est.device_activation_bytes == profile.peak_bytes(checkpointing=True)
    assert est.device_total_bytes <= need - 1
    with pytest.raises(ValueError, match="too small for this run"):
        estimate_memory(meta, device_budget=1024, **common)
    with pytest.raises(ValueError, match="choose one of"):
        estimate_memory(meta, checkpointing="sometimes", **common)


@pytest.mark.parametrize("device_type", ["cuda:0", "mps", "gpu"])
def test_device_type_must_be_cuda_or_cpu(device_type: str) -> None:
    with pytest.raises(ValueError, match="device_type must be 'cuda' or 'cpu'"):
        estimate_memory(
            Net(), activations=_profile(), run=RunDescription(B, 1), device_type=device_type
        )


def test_a_numeric_budget_is_checked_as_a_size_string_is() -> None:
    common = dict(activations=_profile(), run=RunDescription(B, 1), wire_dtype=torch.float32)
    for bad in (-1, "-1"):
        with pytest.raises(ValueError, match="must not be negative"):
            estimate_memory(Net(), device_budget=bad, **common)
    with pytest.raises(TypeError, match="device_budget"):
        estimate_memory(Net(), device_budget=True, **common)
    est = estimate_memory(Net(), device_budget=float(1 << 30), **common)
    assert est.device_budget_bytes == 1 << 30 and isinstance(est.device_budget_bytes, int)


# activation offload (CheckpointOffload, --checkpointing offload): planned figures, one
# layer's input 1 MiB, 8 layers of 16 MiB each


def _long_context_profile() -> ActivationProfile:
    mib = 1 << 20
    return ActivationProfile(
        layer_bytes=(16 * mib,) * 8,
        layer_input_bytes=mib,
        other_bytes=2 * mib,
        logits_workspace_bytes=0,
        measured=True,
    )


def _estimate(checkpointing: str, device_budget=None):
    with torch.device("meta"):
        model = Net()
    return estimate_memory(
        model,
        activations=_long_context_profile(),
        run=RunDescription(1, 4096),
        device_type="cuda",
        device_budget=device_budget,
        checkpointing=checkpointing,
    )


def test_offload_moves_the_layer_inputs_to_pinned_host_memory() -> None:
    mib = 1 << 20
    on, offload = _estimate("on"), _estimate("offload")
    assert on.checkpointing and offload.checkpointing and offload.activation_offload
    # on the device: 8 inputs, then 2 (the one recomputing and the one prefetched)
    assert on.device_activation_bytes - offload.device_activation_bytes == 6 * mib
    assert offload.host_activation_pinned_bytes == 8 * mib
    assert offload.host_pinned_bytes - on.host_pinned_bytes == 8 * mib
    assert "activation checkpointing offload" in offload.describe()
    assert "8.00 MiB of layer inputs in pinned host memory" in offload.describe()


def test_a_unit_major_step_holds_every_micro_batchs_activations() -> None:
    """``RunDescription(micro_batches=M)``: a unit-major step (``ramflow.accumulate``) ends
    all M forwards before the first backward, so the device holds M micro-batches' saved
    activations (one's working memory); under offload the host holds the M x 8 layer
    inputs and the device M + 1 of them (backward brings back the next layer's input of
    every micro-batch beside the one it recomputes). M = 1 is one micro-batch's."""
    mib, num = 1 << 20, 3
    with torch.device("meta"):
        model = Net()

    def at(checkpointing: str, micro_batches: int):
        return estimate_memory(
            model,
            activations=_long_context_profile(),
            run=RunDescription(1, 4096, micro_batches=micro_batches),
            device_type="cuda",
            checkpointing=checkpointing,
        )

    off = at("off", num)
    assert off.device_activation_bytes == num * (8 * 16 + 2) * mib + 16 * mib
    on = at("on", num)
    assert on.device_activation_bytes == num * (8 + 2) * mib + 16 * mib
    offload = at("offload", num)
    assert offload.device_activation_bytes == num * 2 * mib + (num + 1) * mib + 16 * mib
    assert offload.host_activation_pinned_bytes == num * 8 * mib
    for mode in ("off", "on", "offload"):
        one, plain = at(mode, 1), _estimate(mode)
        assert one.device_activation_bytes == plain.device_activation_bytes
        assert one.host_activation_pinned_bytes == plain.host_activation_pinned_bytes
    assert "activations: " in on.describe()
    with pytest.raises(ValueError, match="3 micro-batches of 1 x 4096"):
        estimate_memory(
            model,
            activations=_long_context_profile(),
            run=RunDescription(1, 4096, micro_batches=num),
            device_type="cuda",
            checkpointing="on",
            device_budget=on.plan.min_gpu_memory_bytes + 1,
        )
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        at("on", 0)


def test_auto_chooses_offload_only_where_checkpointing_every_layer_does_not_fit() -> None:
    smallest = _estimate("off").plan.min_gpu_memory_bytes
    acts = _long_context_profile()
    on_peak = acts.peak_bytes(checkpointing=True)
    offload_peak = acts.peak_bytes(checkpointing=True, offload=True)
    plain_peak = acts.peak_bytes(checkpointing=False)
    assert offload_peak < on_peak < plain_peak
    for room, mode in [
        (plain_peak, "off"),
        (on_peak, "on"),
        (on_peak - 1, "offload"),
        (offload_peak, "offload"),
    ]:
        est = _estimate("auto", device_budget=smallest + room)
        assert est.checkpointing_mode == mode, (room, mode)
        assert (est.checkpointing_reason is not None) == (mode == "offload")
    est = _estimate("auto", device_budget=smallest + offload_peak)
    assert "offload\n  (auto: checkpointing every layer leaves" in est.describe()
    with pytest.raises(ValueError, match="too small for this run"):
        _estimate("auto", device_budget=smallest + offload_peak - 1)
    with pytest.raises(ValueError, match="or --checkpointing offload"):
        _estimate("on", device_budget=smallest + on_peak - 1)


def test_offloaded_inputs_take_pinned_blocks_of_a_power_of_two() -> None:
    """BoundaryOffloader's pinned buffers come from PyTorch's caching host allocator, which
    rounds each block up to a power of two: 8 inputs of 1.5 MiB take 8 x 2 MiB pinned on
    CUDA; a CPU run pins nothing and counts them as they are."""
    mib = 1 << 20
    acts = dataclasses.replace(_long_context_profile(), layer_input_bytes=3 * mib // 2)
    assert acts.offloaded_bytes() == 12 * mib
    assert acts.offloaded_bytes(pinned=True) == 16 * mib
    assert [caching_host_block_bytes(n) for n in (0, 1, 4096, 4097, 3 << 29)] == [
        0,
        1,
        4096,
        8192,
        2 << 30,
    ]
    with torch.device("meta"):
        model = Net()
    common = dict(activations=acts, run=RunDescription(1, 4096), checkpointing="offload")
    cuda = estimate_memory(model, device_type="cuda", **common)
    cpu = estimate_memory(model, device_type="cpu", **common)
    assert cuda.host_activation_pinned_bytes == 16 * mib
    assert cpu.host_activation_pinned_bytes == 12 * mib


def test_a_report_built_by_hand_takes_the_most_numbered_rows_as_blocks() -> None:
    """Without ``report.blocks`` (a report not made by ``activation_report``), the blocks
    are the ``<prefix>.<int>`` rows under the prefix that has the most, in number order."""
    from ramflow.activations.report import ActivationReport, ModuleActivations

    def row(name: str, saved: int, inputs: int = 0) -> ModuleActivations:
        return ModuleActivations(name, "Linear", saved, 1, inputs, None, None, 1)

    rows = (
        row("layers.10", 300, 7),
        row("layers.2", 200, 5),
        row("layers.9", 100, 6),
        row("heads.0", 50),
        row("heads.1", 50),
        row("embed", 40),
    )
    report = ActivationReport(rows, total_saved_bytes=1000, device=torch.device("cpu"))
    profile = ActivationProfile.from_report(report)
    assert profile.layer_bytes == (200, 100, 300)  # layers.2, layers.9, layers.10
    assert profile.layer_input_bytes == 7
    assert profile.other_bytes == 1000 - 600


def test_checkpointing_as_a_bool_and_impossible_shapes() -> None:
    with torch.device("meta"):
        meta = Net()
    common = dict(activations=_profile(), wire_dtype=torch.float32)
    on = estimate_memory(meta, run=RunDescription(B, 1), checkpointing=True, **common)
    assert on.checkpointing and on.device_activation_bytes == _profile().peak_bytes(
        checkpointing=True
    )
    assert not estimate_memory(
        meta, run=RunDescription(B, 1), checkpointing=False, **common
    ).checkpointing
    with pytest.raises(
        ValueError, match=r"^batch size and sequence length must be positive, got 0"
    ):
        estimate_memory(meta, run=RunDescription(0, 1), **common)
    with pytest.raises(ValueError, match=r"^optimizer_states must be >= 0, got -1$"):
        estimate_memory(meta, run=RunDescription(B, 1), optimizer_states=-1, **common)
