"""Checkpointing policies checkpoint exactly the blocks they name, and change no gradient.

A checkpointed block runs its forward a second time during backward; the tests count, for
each block, the calls of its first submodule made during backward (the block's own forward
is re-run by checkpoint directly, past its hooks; the submodules it calls go through theirs). Recomputation on the CPU repeats the same
kernels on the same inputs, so gradients are compared bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ramflow
from models import MLPStack, tiny_llama
from ramflow.activations.checkpointing import resolve_over_units
from ramflow.memory import (
    CheckpointAll,
    CheckpointEveryKth,
    CheckpointPlan,
    CheckpointSegments,
    CheckpointToBudget,
    SelectiveCheckpoint,
    activation_report,
    apply_checkpointing,
    find_blocks,
)


def backward_forward_calls(model: nn.Module, probes: list[nn.Module], x: torch.Tensor) -> list[int]:
    """For each probe (a block's first submodule), its calls made during backward; leaves
    the gradients."""
    counts = [0] * len(probes)
    in_backward = False

    def counter(i: int):
        def hook(module, args):
            if in_backward:
                counts[i] += 1

        return hook

    handles = [b.register_forward_pre_hook(counter(i)) for i, b in enumerate(probes)]
    try:
        loss = model(x).square().mean()
        in_backward = True
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return counts


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "policy,expected",
    [
        (CheckpointAll(), [0, 1, 2, 3, 4, 5]),
        (CheckpointEveryKth(2), [0, 2, 4]),
        (CheckpointEveryKth(4), [0, 4]),
        (SelectiveCheckpoint(), [0, 1, 2, 3, 4, 5]),
        (SelectiveCheckpoint(within=CheckpointEveryKth(3)), [0, 3]),
    ],
)
def test_policy_checkpoints_exactly_its_blocks(policy, expected):
    torch.manual_seed(0)
    model = MLPStack(dim=16, depth=6)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    backward_forward_calls(reference, [b.norm for b in reference.blocks], x)

    handle = apply_checkpointing(model, policy)
    assert handle.plan.blocks == tuple(f"blocks.{i}" for i in expected)
    counts = backward_forward_calls(model, [b.norm for b in model.blocks], x)
    assert counts == [1 if i in expected else 0 for i in range(6)]
    want = grads(reference)
    for name, got in grads(model).items():
        assert torch.equal(got, want[name]), name

    handle.undo()
    assert not handle.active
    assert all("forward" not in b.__dict__ for b in model.blocks)
    model.zero_grad()
    assert backward_forward_calls(model, [b.norm for b in model.blocks], x) == [0] * 6


def expand_block(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))


class WidthStack(nn.Module):
    """Blocks of different widths (hence different activation bytes) in a ModuleList."""

    def __init__(self, dim: int, hiddens: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(expand_block(dim, h) for h in hiddens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_budget_policy_takes_the_largest_savings_first():
    torch.manual_seed(0)
    batch, dim, hiddens = 4, 8, [8, 64, 16, 32]
    model = WidthStack(dim, hiddens)
    probes = [b[0] for b in model.blocks]
    x = torch.randn(batch, dim)
    report = activation_report(model, x)
    # a block saves its input (first Linear) and its hidden activation (ReLU's output,
    # saved again by the second Linear); checkpointing it keeps the input: it saves the
    # hidden activation, 4 * batch * hidden bytes
    for i, h in enumerate(hiddens):
        row = report[f"blocks.{i}"]
        assert row.saved_bytes - row.input_bytes == 4 * batch * h
    budget = report.total_saved_bytes - 4 * batch * (64 + 32)
    handle = apply_checkpointing(model, CheckpointToBudget(budget, report=report))
    assert handle.plan.blocks == ("blocks.1", "blocks.3")
    assert backward_forward_calls(model, probes, x) == [0, 1, 0, 1]
    handle.undo()

    plan = CheckpointToBudget(report.total_saved_bytes, report=report).resolve(
        model, find_blocks(model)
    )
    assert plan.blocks == ()  # already within budget
    with pytest.raises(ValueError, match="every block"):
        apply_checkpointing(model, CheckpointToBudget(4 * batch * dim, report=report))
    assert all("forward" not in b.__dict__ for b in model.blocks)  # nothing half-applied


def test_segments_follow_checkpoint_sequential():
    torch.manual_seed(0)
    model = nn.Sequential(*(expand_block(8, 16) for _ in range(7)))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    backward_forward_calls(reference, [b[0] for b in reference], x)
    handle = apply_checkpointing(model, CheckpointSegments(3))
    # 7 // 3 = 2 blocks a segment; the last segment (blocks 4-6) is not checkpointed
    assert handle.plan.segments == (("0", "1"), ("2", "3"))
    assert backward_forward_calls(model, [b[0] for b in model], x) == [1, 1, 1, 1, 0, 0, 0]
    want = grads(reference)
    for name, got in grads(model).items():
        assert torch.equal(got, want[name]), name
    handle.undo()
    assert "forward" not in model.__dict__


def test_segments_refuse_blocks_of_a_module_list():
    with pytest.raises(ValueError, match="nn.Sequential"):
        apply_checkpointing(MLPStack(dim=8, depth=4), CheckpointSegments(2))


class ResidualStack(nn.Sequential):
    """A Sequential subclass with its own forward: a chain of its children is another function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = x + block(x)
        return x


def test_segments_refuse_a_sequential_subclass_with_its_own_forward():
    torch.manual_seed(0)
    model = ResidualStack(*(nn.Linear(8, 8) for _ in range(4)))
    with pytest.raises(ValueError, match="overrides nn.Sequential.forward.*CheckpointAll"):
        apply_checkpointing(model, CheckpointSegments(2))
    assert "forward" not in model.__dict__
    # the same refusal on offload's path, before anything is offloaded
    with pytest.raises(ValueError, match="overrides nn.Sequential.forward"):
        resolve_over_units(CheckpointSegments(2), model, list(model.named_children()))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="overrides nn.Sequential.forward"):
        ramflow.offload(
            model,
            device="cpu",
            wire_dtype=torch.float32,
            activation_checkpointing=CheckpointSegments(2),
        )
    assert torch.equal(model(x), reference(x))
    # per-block checkpointing keeps the subclass's forward
    handle = apply_checkpointing(model, CheckpointAll())
    assert torch.equal(model(x), reference(x))
    handle.undo()


class OpCounter(TorchDispatchMode):
    """Counts the aten operators that actually run (selective checkpointing answers the
    saved ones from its cache, below this mode, so they are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(policy) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*(expand_block(8, 16) for _ in range(3)))
    if policy is not None:
        apply_checkpointing(model, policy, blocks=list(model))
    loss = model(torch.randn(4, 8)).sum()
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_checkpointing_saves_matmuls_and_recomputes_pointwise():
    plain, full, selective = (
        backward_ops(p) for p in (None, CheckpointAll(), SelectiveCheckpoint())
    )
    matmuls = ("mm", "addmm")

    def count(ops, names):
        return sum(ops.get(n, 0) for n in names)

    # full checkpointing runs each block's first Linear again (non-reentrant checkpoint
    # stops recomputing once backward has what it needs, and nothing saves the second
    # Linear's output); selective checkpointing takes the saved matmul outputs instead
    assert count(full, matmuls) == count(plain, matmuls) + 3
    assert count(selective, matmuls) == count(plain, matmuls)
    # both recompute the ReLUs, which a plain backward never runs
    assert plain.get("relu", 0) == 0
    assert full["relu"] == selective["relu"] == 3


def test_given_blocks_and_bad_input():
    model = MLPStack(dim=8, depth=4)
    handle = apply_checkpointing(model, CheckpointAll(), blocks=["blocks.1", model.blocks[3]])
    assert handle.plan.blocks == ("blocks.1", "blocks.3")
    with pytest.raises(ValueError, match="already replaced"):
        apply_checkpointing(model, CheckpointAll())
    handle.undo()
    handle.undo()  # a second undo does nothing
    with pytest.raises(ValueError, match="no submodule"):
        apply_checkpointing(model, CheckpointAll(), blocks=["blocks.9"])
    with pytest.raises(ValueError, match="no repeated blocks"):
        apply_checkpointing(nn.Linear(3, 3), CheckpointAll())
    with pytest.raises(ValueError, match="k must be"):
        CheckpointEveryKth(0)
    with pytest.raises(ValueError, match="k must be"):
        CheckpointEveryKth(True)  # a bool is not a stride


class NamesNoBlock:
    def resolve(self, model, blocks):
        return CheckpointPlan(blocks=("nope",))


class SegmentOfNoBlock:
    def resolve(self, model, blocks):
        return CheckpointPlan(blocks=("0",), segments=(("0", "nope"),))


class ReturnsAList:
    def resolve(self, model, blocks):
        return [name for name, _ in blocks]


def test_custom_policy_mistakes_get_clear_errors():
    model = MLPStack(dim=8, depth=3)
    with pytest.raises(ValueError, match=r"chose \['nope'\], which are not blocks.*blocks\.0"):
        apply_checkpointing(model, NamesNoBlock())
    with pytest.raises(TypeError, match="returned list, not a CheckpointPlan"):
        apply_checkpointing(model, ReturnsAList())
    sequential = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    with pytest.raises(ValueError, match=r"chose \['nope'\]"):
        apply_checkpointing(sequential, SegmentOfNoBlock())
    for m in (model, sequential):
        assert all("forward" not in sub.__dict__ for sub in m.modules())  # nothing applied


def test_report_charges_a_checkpointed_block_its_inputs_only():
    torch.manual_seed(0)
    model = MLPStack(dim=16, depth=4)
    x = torch.randn(4, 16)
    plain = activation_report(model, x)
    handle = apply_checkpointing(model, CheckpointEveryKth(2))
    checkpointed = activation_report(model, x)
    for i in range(4):
        row, before = checkpointed[f"blocks.{i}"], plain[f"blocks.{i}"]
        if i % 2 == 0:  # checkpoint keeps the block's input for the recomputation
            assert row.saved_bytes == row.input_bytes == 4 * 4 * 16
        else:
            assert row.saved_bytes == before.saved_bytes > row.input_bytes
    handle.undo()


def test_batch_norm_in_a_checkpointed_block_updates_its_statistics_twice():
    """What the module docstring and the README warn about: the recomputation runs the
    block's forward again in train mode."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2)))
    handle = apply_checkpointing(model, CheckpointAll())
    model(torch.randn(8, 4)).sum().backward()
    assert [int(block[1].num_batches_tracked) for block in model] == [2, 2]
    handle.undo()


def test_no_recompute_without_grad():
    model = MLPStack(dim=8, depth=3)
    handle = apply_checkpointing(model, CheckpointAll())
    with torch.no_grad():
        out = model(torch.randn(2, 16))
    assert out.grad_fn is None
    handle.undo()


def test_hugging_face_decoder_layers():
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 12))
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    handle = apply_checkpointing(model, CheckpointAll())
    assert handle.plan.blocks == ("model.layers.0", "model.layers.1", "model.layers.2")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    want = grads(reference)
    for name, got in grads(model).items():
        assert torch.equal(got, want[name]), name
