"""Global-norm clipping of offloaded gradients (``ramflow.engine.clip``): reading the norm alone
keeps the steps during backward, a real clip defers them, and both match PyTorch's
``clip_grad_norm_`` on a resident deepcopy.

Whether a step ran during backward is read from the gradients: with
``AdamW(keep_grads=False)`` such a step leaves ``p.grad`` None, a deferred one fills it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ramflow
from models import tiny_llama

LR = 1e-3
STEPS = 4


def batches(n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=g).to(device) for _ in range(n)]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def ref_adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    """PyTorch's fused AdamW on the CPU (ramflow's CPU step is bit-identical to it)."""
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cpu" or None)


def offloaded_pair(device: torch.device, **opt_kwargs):
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, **opt_kwargs)
    return model, opt, ref, ref_adamw(ref, device)


def grads_present(model: torch.nn.Module) -> bool:
    return all(p.grad is not None for p in model.parameters() if p.requires_grad)


# On CUDA the per-parameter norms of the device gradients are reduced in another order than
# the CPU reduces the host gradients (see [Note: the norm from the device gradients] in
# ramflow.engine.grad_norms): fp32 rounding, a few ulps. On the CPU they are the same bits.
NORM_RTOL = 1e-5


def assert_norm(norm: torch.Tensor, ref_norm: torch.Tensor) -> None:
    if norm.device.type == "cpu" and ref_norm.device.type == "cpu":
        assert torch.equal(norm, ref_norm), (norm, ref_norm)
    else:
        torch.testing.assert_close(norm.cpu(), ref_norm.cpu(), rtol=NORM_RTOL, atol=0)


@pytest.mark.parametrize("clip", ["ramflow", "torch"])
def test_norm_only_keeps_steps_in_backward_and_matches_torch(device, clip):
    """``max_norm=inf`` (through ``ramflow.clip_grad_norm_`` or PyTorch's routed function,
    as accelerate calls it): from the second step on the units step during backward, the
    norm equals PyTorch's on the resident model, and the run trains as the resident one."""
    model, opt, ref, ref_opt = offloaded_pair(device, keep_grads=False)
    clip_fn = ramflow.clip_grad_norm_ if clip == "ramflow" else torch.nn.utils.clip_grad_norm_
    stepped_in_backward, losses, ref_losses = [], [], []
    for ids in batches(STEPS, device):
        loss = lm_loss(model, ids)
        loss.backward()
        stepped_in_backward.append(not grads_present(model))
        norm = clip_fn(model.parameters(), math.inf)
        ref_loss = lm_loss(ref, ids)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)
        assert_norm(norm, ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert stepped_in_backward == [False, True, True, True]
    ramflow.synchronize(model)
    if device.type == "cpu":  # the gradients were not touched: bit for bit the same run
        assert losses == ref_losses
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)


def test_finite_clip_defers_steps_and_matches_torch(device):
    """A real clip scales the gradients before any step: every step waits for
    ``opt.step()`` and the run equals PyTorch's clipping on the resident model."""
    model, opt, ref, ref_opt = offloaded_pair(device, keep_grads=False)
    max_norm = 0.05  # below the tiny model's norms (about 1), so every step clips
    deferred = []
    for ids in batches(STEPS, device):
        lm_loss(model, ids).backward()
        deferred.append(grads_present(model))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lm_loss(ref, ids).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert ref_norm > max_norm
        assert_norm(norm, ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert deferred == [True] * STEPS
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        if device.type == "cpu":
            assert torch.equal(p, q)
        else:  # CUDA AdamW against ramflow's CPU AdamW: float rounding per step
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("no_step", [False, True])
def test_norm_only_with_accumulation_is_the_accumulated_norm(device, no_step):
    """Two micro-batches per step: the norm is the accumulated gradient's, which one pass's
    norms cannot give. Without ``no_step`` every step is deferred; with it the final
    micro-batch steps during backward and the norm is read from the accumulated host
    gradients once those steps have written them."""
    model, opt, ref, ref_opt = offloaded_pair(device)
    data = batches(2 * STEPS, device)
    for step in range(STEPS):
        for k, ids in enumerate(data[2 * step : 2 * step + 2]):
            if no_step and k == 0:
                with opt.no_step():
                    lm_loss(model, ids).backward()
            else:
                lm_loss(model, ids).backward()
            lm_loss(ref, ids).backward()
        norm = ramflow.clip_grad_norm_(model.parameters(), math.inf)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)
        assert_norm(norm, ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    if device.type == "cpu":
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)


def test_norm_of_part_of_the_model():
    """The device norms are per parameter: the norm of a subset of the parameters after a
    step during backward is theirs (PyTorch's bits on the CPU)."""
    model, opt, ref, ref_opt = offloaded_pair(torch.device("cpu"))
    device = torch.device("cpu")
    for ids in batches(3, device):
        lm_loss(model, ids).backward()
        lm_loss(ref, ids).backward()
        head = [model.lm_head.weight]
        norm = ramflow.clip_grad_norm_(head, math.inf)
        ref_norm = torch.nn.utils.clip_grad_norm_([ref.lm_head.weight], math.inf)
        assert torch.equal(norm, ref_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def test_plain_parameters_keep_torch_clip():
    """The route leaves parameters of models ramflow did not offload to PyTorch's function."""
    ramflow.offload(tiny_llama(tie=False), device="cpu")  # installs the route
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 4)
    plain(torch.randn(3, 4)).sum().backward()
    before = plain.weight.grad._version
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    assert plain.weight.grad._version > before  # PyTorch's own clip scaled in place
    assert torch.linalg.vector_norm(plain.weight.grad) < 1e-3 + 1e-6 < norm


def _largest_allocation(fn) -> int:
    """The largest single CPU allocation ``fn()`` makes, in bytes (PyTorch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


def test_a_cpu_norm_upcasts_one_piece_at_a_time():
    """The squared norm of a bf16 host gradient on the CPU (ZeRO-2 clipping) upcasts
    ``NORM_PIECE`` elements at a time, never the whole tensor, which PyTorch's CPU
    reduction into a wider dtype copies first (see [Note: norms in pieces on the CPU]); its
    value is the fp64 norm's within fp64 rounding, and a tensor of one piece gives the
    whole reduction's bits."""
    from ramflow.engine.clip import NORM_PIECE, squared_norm

    g = torch.randn(5 * NORM_PIECE + 3, generator=torch.Generator().manual_seed(0))
    g = g.to(torch.bfloat16)
    exact = torch.linalg.vector_norm(g, dtype=torch.float64)
    norm = lambda: squared_norm(g, torch.float64).sqrt()  # noqa: E731
    whole = lambda: g.double().pow(2).sum().sqrt()  # noqa: E731
    assert norm().dtype == torch.float64
    # fp64 sums of 5M bf16 squares: far inside 1e-12 relative
    torch.testing.assert_close(norm(), exact, rtol=1e-12, atol=0)
    piece_bytes = NORM_PIECE * torch.float64.itemsize
    assert _largest_allocation(whole) > 4 * piece_bytes  # the control: a whole copy
    assert _largest_allocation(norm) <= piece_bytes
    small = g[:1000]
    assert torch.equal(squared_norm(small, torch.float64), small.double().pow(2).sum())
