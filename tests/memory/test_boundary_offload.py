"""``CheckpointOffload``: checkpointed blocks' inputs go to host memory and come back one
block ahead, and nothing else changes.

On the CPU the copies are synchronous and the recomputation repeats the same kernels on
bit-identical inputs (a host copy of a tensor is the same bits), so losses and gradients
are compared bit for bit against checkpointing alone. The GPU tests check the same
parity with asynchronous copies, with blocks small enough that the copies dominate (which
exposes a missing wait), and that the boundaries leave the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import MLPStack, tiny_llama
from ramflow.activations.boundary_offload import BoundaryOffloader
from ramflow.memory import (
    CheckpointAll,
    CheckpointEveryKth,
    CheckpointOffload,
    CheckpointSegments,
    SelectiveCheckpoint,
    apply_checkpointing,
)


def grads_after_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_bitwise(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for ga, gb in zip(a[1], b[1], strict=True):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize(
    "within", [CheckpointAll(), CheckpointEveryKth(2), SelectiveCheckpoint()], ids=repr
)
def test_offload_matches_checkpointing_bit_for_bit_on_a_plain_model(within):
    torch.manual_seed(0)
    model = MLPStack(dim=32, depth=4)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16)
    plain = apply_checkpointing(model, within)
    handle = apply_checkpointing(twin, CheckpointOffload(within))
    assert handle.plan.blocks == plain.plan.blocks
    assert_bitwise(grads_after_step(model, x), grads_after_step(twin, x))
    stats = handle.offloader.stats
    num_blocks = len(handle.plan.blocks)
    assert stats.num_packed == num_blocks
    assert stats.packed_bytes == num_blocks * 8 * 32 * 4  # (8, 32) fp32 per block


def test_backward_prefetches_the_next_boundary():
    """Every boundary but the first that backward needs (the last block's) was requested
    while the block after it recomputed; with prefetch=2 as well."""
    for prefetch in (1, 2):
        model = MLPStack(dim=16, depth=5)
        handle = apply_checkpointing(model, CheckpointOffload(prefetch=prefetch))
        grads_after_step(model, torch.randn(4, 16))
        stats = handle.offloader.stats
        assert (stats.num_packed, stats.num_prefetched, stats.num_fetched_late) == (5, 4, 1)


def test_undo_and_no_grad_leave_nothing_offloaded():
    model = MLPStack(dim=16, depth=3)
    handle = apply_checkpointing(model, CheckpointOffload())
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert handle.offloader.stats.num_packed == 0
    handle.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_retained_graph_backward_twice():
    """A second backward through a retained graph copies each boundary back again."""
    torch.manual_seed(0)
    model = MLPStack(dim=16, depth=3)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16)
    apply_checkpointing(model, CheckpointAll())
    apply_checkpointing(twin, CheckpointOffload())
    for m in (model, twin):
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        CheckpointOffload(prefetch=0)
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        BoundaryOffloader(prefetch=True)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    with pytest.raises(ValueError, match="not segments"):
        apply_checkpointing(model, CheckpointOffload(CheckpointSegments(2)))


def count_packs(monkeypatch) -> list[int]:
    """Counts ``BoundaryOffloader``'s packs (the engine's offloader is private)."""
    packs = [0]
    pack = BoundaryOffloader._pack

    def counting(self, tensor):
        packs[0] += 1
        return pack(self, tensor)

    monkeypatch.setattr(BoundaryOffloader, "_pack", counting)
    return packs


def test_offloaded_model_with_offload_policy_matches_checkpointing(monkeypatch):
    """``ramflow.offload(activation_checkpointing=CheckpointOffload(...))``: the same loss and
    gradients as the same offload with plain checkpointing."""
    packs = count_packs(monkeypatch)
    torch.manual_seed(0)
    base = MLPStack(dim=32, depth=4)
    x = torch.randn(8, 16)
    results = []
    for policy in (CheckpointEveryKth(2), CheckpointOffload(CheckpointEveryKth(2))):
        model = copy.deepcopy(base)
        ramflow.offload(model, device="cpu", activation_checkpointing=policy)
        results.append(grads_after_step(model, x))
        ramflow.undo(model)
    assert_bitwise(*results)
    assert packs[0] == 2  # blocks 0 and 2


def test_hugging_face_model_offloaded_with_boundary_offload(monkeypatch):
    """A Hugging Face model takes our wrapper (not its own switch) under CheckpointOffload;
    the loss and gradients equal Hugging Face checkpointing's; only the hidden states are
    offloaded (the rotary tables and mask are keyword arguments)."""
    packs = count_packs(monkeypatch)
    torch.manual_seed(0)
    base = tiny_llama(tie=False, layers=2).train()
    ids = torch.randint(0, 128, (2, 16))
    results = []
    for policy in (CheckpointAll(), CheckpointOffload()):
        model = copy.deepcopy(base)
        ramflow.offload(model, device="cpu", activation_checkpointing=policy)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        ramflow.undo(model)
    assert_bitwise(*results)
    assert packs[0] == 2  # one hidden state per layer


def _hf_step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    for p in model.parameters():
        p.grad = None
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_set_activation_checkpointing_switches_a_built_model_to_offload(monkeypatch):
    """``ramflow.set_activation_checkpointing``: a Hugging Face model offloaded with its own
    checkpointing switch (True) takes our offload wrapper after a step, computes what a
    model offloaded with ``CheckpointOffload()`` from the start computes, bit for bit, and
    can go back to no checkpointing (Hugging Face's flags off, no wrapper left)."""
    from ramflow.units.registry import engine_of_model

    packs = count_packs(monkeypatch)
    torch.manual_seed(0)
    base = tiny_llama(tie=False, layers=2).train()
    ids = torch.randint(0, 128, (2, 16))
    reference = copy.deepcopy(base)
    ramflow.offload(reference, device="cpu", activation_checkpointing=CheckpointOffload())
    expected = _hf_step(reference, ids)
    packs[0] = 0
    model = copy.deepcopy(base)
    ramflow.offload(model, device="cpu", activation_checkpointing=True)
    checkpointer = engine_of_model(model).checkpointer
    assert_bitwise(expected, _hf_step(model, ids))  # checkpointing alone: the same bits
    assert packs[0] == 0 and checkpointer.boundary_offloader is None
    ramflow.set_activation_checkpointing(model, CheckpointOffload())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert_bitwise(expected, _hf_step(model, ids))
    assert packs[0] == 2 and checkpointer.boundary_offloader is not None  # one input per layer
    ramflow.set_activation_checkpointing(model, False)
    assert checkpointer.boundary_offloader is None and not checkpointer.checkpointed
    assert_bitwise(expected, _hf_step(model, ids))
    assert packs[0] == 2
    ramflow.undo(model)
    assert "forward" not in model.model.layers[0].__dict__


def test_set_activation_checkpointing_after_a_failed_backward_and_its_errors():
    """A backward that raised is cleaned up by the switch (the next step is a whole one);
    inside a forward the switch is refused, and a choice that cannot apply leaves the
    previous checkpointing in place."""
    from ramflow.units.registry import engine_of_model

    torch.manual_seed(0)
    base = MLPStack(dim=32, depth=4)
    x = torch.randn(8, 16)
    reference = copy.deepcopy(base)
    ramflow.offload(reference, device="cpu", activation_checkpointing=CheckpointOffload())
    expected = grads_after_step(reference, x)
    model = copy.deepcopy(base)
    ramflow.offload(model, device="cpu", activation_checkpointing=CheckpointAll())

    def fail(_: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("injected")

    out = model(x)
    out.register_hook(fail)
    with pytest.raises(torch.OutOfMemoryError):
        out.square().mean().backward()
    del out
    ramflow.set_activation_checkpointing(model, CheckpointOffload())
    for p in model.parameters():
        p.grad = None
    assert_bitwise(expected, grads_after_step(model, x))

    def inside(module, args):
        ramflow.set_activation_checkpointing(model, True)

    handle = model.blocks[0].register_forward_pre_hook(inside)
    with pytest.raises(RuntimeError, match="between passes"):
        model(x)
    handle.remove()
    with pytest.raises(ValueError, match="CheckpointSegments"):
        ramflow.set_activation_checkpointing(model, CheckpointOffload(CheckpointSegments(2)))
    assert engine_of_model(model).checkpointer.boundary_offloader is not None
    for p in model.parameters():
        p.grad = None
    assert_bitwise(expected, grads_after_step(model, x))
    with pytest.raises(TypeError, match="activation_checkpointing takes"):
        ramflow.set_activation_checkpointing(model, 3)
    with pytest.raises(ValueError, match="not offloaded"):
        ramflow.set_activation_checkpointing(nn.Linear(2, 2), True)
    ramflow.undo(model)


def test_disabled_offloader_checkpoints_alone_and_can_be_enabled_again():
    """``BoundaryOffloader.enabled = False`` (the engine's, ``checkpointer.boundary_offloader``):
    nothing is packed and the step is checkpointing's; enabled again, the inputs move."""
    from ramflow.units.registry import engine_of_model

    torch.manual_seed(0)
    base = MLPStack(dim=32, depth=4)
    x = torch.randn(8, 16)
    plain = copy.deepcopy(base)
    ramflow.offload(plain, device="cpu", activation_checkpointing=CheckpointAll())
    expected = grads_after_step(plain, x)
    model = copy.deepcopy(base)
    ramflow.offload(model, device="cpu", activation_checkpointing=CheckpointOffload())
    offloader = engine_of_model(model).checkpointer.boundary_offloader
    assert offloader is not None and offloader.enabled
    offloader.enabled = False
    for p in model.parameters():
        p.grad = None
    assert_bitwise(expected, grads_after_step(model, x))
    assert offloader.stats.num_packed == 0
    offloader.enabled = True
    for p in model.parameters():
        p.grad = None
    assert_bitwise(expected, grads_after_step(model, x))
    assert offloader.stats.num_packed == 4
    assert engine_of_model(plain).checkpointer.boundary_offloader is None


def test_empty_saved_tensors_are_kept_not_offloaded():
    """An empty tensor saved beside a block's input (torch 2.11's non-reentrant checkpoint
    saves such a placeholder per call) stays where it is and is not counted: only the
    input moves, and the gradients are checkpointing's own."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    empty = torch.empty(0, requires_grad=True)

    def fn(h, e):
        return lin(h).tanh() + e.sum()

    checkpoint(fn, x, empty, use_reentrant=False).square().sum().backward()
    expected = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.weight.grad = None
    offloader = BoundaryOffloader()
    with offloader.saving():
        out = checkpoint(fn, x, empty, use_reentrant=False)
    out.square().sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(lin.weight.grad, expected[1])
    stats = offloader.stats
    assert (stats.num_packed, stats.packed_bytes) == (1, 4 * 8 * 4)


# --------------------------------------------------------------------------- GPU


def _wide_stack() -> nn.Module:
    # narrow blocks over a long batch: the boundaries' copies dominate the blocks' compute
    return MLPStack(dim=64, depth=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offload_matches_checkpointing_and_frees_the_boundaries():
    torch.manual_seed(0)
    model = _wide_stack().cuda()
    twin = copy.deepcopy(model)
    x = torch.randn(1 << 16, 16, device="cuda")
    apply_checkpointing(model, CheckpointAll())
    handle = apply_checkpointing(twin, CheckpointOffload())
    expected = grads_after_step(model, x)
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    peaks = []
    for m in (model, twin):
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = m(x)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.memory_allocated() - start)
        del out
    boundary_bytes = (1 << 16) * 64 * 4  # a block's (N, 64) fp32 input
    # the offloaded forward keeps none of the 6 blocks' inputs on the device; the caching
    # allocator may count a record_stream-ed source until its copy's event is seen
    assert peaks[0] - peaks[1] >= 4 * boundary_bytes
    got = grads_after_step(twin, x)
    torch.cuda.synchronize()
    assert_bitwise(expected, got)
    assert handle.offloader.stats.num_prefetched == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offloaded_engine_with_boundary_offload_matches():
    torch.manual_seed(0)
    base = _wide_stack()
    x = torch.randn(1 << 15, 16)
    results = []
    for policy in (CheckpointAll(), CheckpointOffload()):
        model = copy.deepcopy(base)
        ramflow.offload(model, activation_checkpointing=policy, wire_dtype=torch.float32)
        loss, grads = grads_after_step(model, x)
        results.append((loss.cpu(), grads))
        ramflow.undo(model)
    assert_bitwise(*results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "ramflow.offload"])
def test_gpu_llama_steps_with_offload_are_bit_identical_to_checkpointing(offloaded: bool):
    """A Hugging Face Llama under bf16 autocast, 3 optimizer steps on the GPU: the losses
    and the weights after them are bit-identical with the layers' inputs offloaded and with
    checkpointing alone, on a resident model (``apply_checkpointing``, torch's AdamW) and on
    an offloaded one (``ramflow.offload`` and ``ramflow.optim.AdamW``, fp32 wire)."""
    torch.manual_seed(0)
    base = tiny_llama(tie=False, layers=4, hidden=256, intermediate=512).train()
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    runs = []
    for policy in (CheckpointAll(), CheckpointOffload()):
        model = copy.deepcopy(base)
        if offloaded:
            ramflow.offload(model, activation_checkpointing=policy, wire_dtype=torch.float32)
            opt = ramflow.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            model.cuda()
            apply_checkpointing(model, policy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().cpu())
        if offloaded:
            ramflow.synchronize(model)
            ramflow.undo(model)
        torch.cuda.synchronize()
        runs.append((losses, [p.detach().cpu().clone() for p in model.parameters()]))
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_second_step_reuses_the_pinned_boundaries():
    """The boundaries' pinned buffers come from PyTorch's caching host allocator, which keeps
    them when the graph is freed: a second step at the same length creates no pinned block
    (no ``cudaHostAlloc``; ``host_memory_stats()["num_host_alloc"]``), so only the first
    step at a new length pays for them. A warm-up that allocates and frees blocks of the
    rounded size (the long-context benchmark's ``warm_pinned_pool``) makes the first step
    reuse them too."""
    torch.manual_seed(0)
    model = _wide_stack().cuda()
    handle = apply_checkpointing(model, CheckpointOffload())
    x = torch.randn(1 << 15, 16, device="cuda")  # a block's input: (N, 64) fp32, 8 MiB
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or (
        torch._C._host_emptyCache
    )

    def new_blocks_in_a_step() -> int:
        before = torch.cuda.host_memory_stats()["num_host_alloc"]
        grads_after_step(model, x)
        torch.cuda.synchronize()
        return torch.cuda.host_memory_stats()["num_host_alloc"] - before

    empty_host_cache()
    assert new_blocks_in_a_step() == 6  # one per block's input: the first step pays
    assert new_blocks_in_a_step() == 0  # the second reuses them
    assert handle.offloader.stats.num_packed == 12
    empty_host_cache()
    blocks = [torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(6)]
    del blocks  # the warm-up: six 8 MiB blocks, kept by the allocator
    assert new_blocks_in_a_step() == 0
