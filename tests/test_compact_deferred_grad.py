"""The compact deferred gradient of the lean formats (``ramflow.formats.deferred_grad``): its
rounding, and a clipped loop whose steps hold their gradients in 8-bit codes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import ramflow
from models import MLPStack
from ramflow.engine.host_store import RING_BUFFERS
from ramflow.formats.deferred_grad import (
    COMPACT_GRAD_BYTES_PER_PARAM,
    PIECE,
    CompactGradient,
    compact_nbytes,
)
from ramflow.kernels.lean_kernels import QBLOCK
from ramflow.sizes import format_bytes
from ramflow.units.registry import engine_of_model
from test_lean_store import LR, KernelReference, batches, loss_of, offloaded


def test_codes_are_unbiased_within_one_e4m3_spacing():
    """Each value decodes to one of its two neighbours on the block's E4M3 grid (spacing
    2**-3 of its magnitude, 2**-9 of the block scale below the normal range), the mean of
    many encodes is the value, and the pieces (``PIECE``) do not change the codes."""
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(PIECE + 3 * QBLOCK + 7, generator=g)
        * torch.logspace(-4, 0, 7).repeat((PIECE + 3 * QBLOCK + 7) // 7 + 1)[
            : PIECE + 3 * QBLOCK + 7
        ]
    )
    c = CompactGradient(x.numel(), seed=5)
    total = torch.zeros_like(x)
    runs = 64
    for step in range(runs):  # each step rounds with its own bits
        c.encode(x, step=step)
        v = c.values()
        scale = c.scales.repeat_interleave(QBLOCK)[: x.numel()]
        spacing = torch.maximum(x.abs() * 2.0**-3, scale * 2.0**-9)
        assert bool(((v - x).abs() <= spacing).all())
        total += v
    mean_err = (total / runs - x).abs().mean() / x.abs().mean()
    one_err = (c.values() - x).abs().mean() / x.abs().mean()
    assert mean_err < one_err / 4  # errors average out: unbiased
    assert c.nbytes == compact_nbytes(x.numel()) <= x.numel() * COMPACT_GRAD_BYTES_PER_PARAM + 4
    assert COMPACT_GRAD_BYTES_PER_PARAM < 1.03


def test_a_bf16_gradient_decodes_exactly_into_bf16():
    """The step reads the decoded gradient from a bf16 staging buffer: codes times a power
    of two are bf16 values, so nothing is rounded there."""
    x = torch.randn(4 * QBLOCK, generator=torch.Generator().manual_seed(1)).bfloat16()
    c = CompactGradient(x.numel(), seed=0)
    c.encode(x, step=0)
    out = c.decode_into(torch.empty(x.numel(), dtype=torch.bfloat16))
    assert torch.equal(out.float(), c.values())


def clipped_loop(model, opt, device, steps: int, *, torch_clip: bool = False):
    """``steps`` clipped steps; returns the norms the clips returned."""
    clip = torch.nn.utils.clip_grad_norm_ if torch_clip else ramflow.clip_grad_norm_
    norms = []
    for x, y in batches(steps, device):
        loss_of(model, x, y).backward()
        norms.append(float(clip(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    return norms


def test_a_clipped_lean_step_holds_compact_gradients_and_steps_them(device):
    """keep_grads=False with clips=True: every backward, the first included, holds each
    unit's gradient in 8-bit codes (no full host gradient, p.grad None); the clip's norm is
    that of the exact gradients (a reference run that keeps bf16 p.grad gets it within bf16
    rounding), and
    each step is the lean kernel's step from the held values times the clip's coefficient,
    bit for bit."""
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = offloaded(a, device, "lean", keep_grads=False, clips=True)
    opt_b = offloaded(b, device, "lean", overlap=False)
    ref = KernelReference(a, "lean")
    engine = engine_of_model(a)
    trained = [u for u in engine.units if u.num_trainable]
    for step, (x, y) in enumerate(batches(3, device), start=1):
        loss_of(a, x, y).backward()
        loss_of(b, x, y).backward()
        assert all(u.compact_grad is not None and u.compact_grad.held for u in trained)
        assert all(u.host_grad is None for u in engine.units)
        assert all(p.grad is None for p in a.parameters())
        norm_a = ramflow.clip_grad_norm_(a.parameters(), 0.05)
        if step == 1:  # the same weights: the same gradients and norm
            norm_b = ramflow.clip_grad_norm_(b.parameters(), 0.05)
            torch.testing.assert_close(norm_a.cpu(), norm_b.cpu().float(), rtol=1e-2, atol=0)
        held = {}
        for u in trained:
            values = u.compact_grad.values()
            for k, p in enumerate(u.owned[: u.num_trainable]):
                held[id(p)] = values[u.offsets[k] : u.offsets[k] + p.numel()]
        ref.step([held[id(p)] for p in a.parameters()], step)
        opt_a.step()
        opt_a.zero_grad()
        opt_b.step()
        opt_b.zero_grad()
    ramflow.synchronize(a)
    for p, st in zip(a.parameters(), ref.params):
        assert torch.equal(p.detach().reshape(-1).cpu(), st["w"])
    assert not engine.stepper.holds_compact()


def test_torch_clip_routes_to_the_compact_gradients_and_trains_close_to_bf16(device):
    """torch.nn.utils.clip_grad_norm_ reaches the held gradients too; the weights stay
    close to those of the bf16 deferred gradients (the codes round, without bias)."""
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = offloaded(a, device, "lean", keep_grads=False, clips=True)
    opt_b = offloaded(b, device, "lean", overlap=False)
    clipped_loop(a, opt_a, device, 6, torch_clip=True)
    clipped_loop(b, opt_b, device, 6, torch_clip=True)
    with torch.no_grad():
        moved = sum((q - p).abs().sum() for p, q in zip(base.parameters(), b.parameters()))
        diff = sum((q - p).abs().sum() for p, q in zip(a.parameters(), b.parameters()))
    assert float(diff) < 0.1 * float(moved)


def test_keep_grads_false_without_clips_still_refuses_a_late_clip(device):
    """Without clips=True the first backward steps during backward (keep_grads=False's
    promise): a clip after it is refused, and the error names clips=True."""
    torch.manual_seed(0)
    model = MLPStack()
    opt = offloaded(model, device, "lean", keep_grads=False)
    x, y = batches(1, device)[0]
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="clips=True"):
        ramflow.clip_grad_norm_(model.parameters(), 1.0)
    opt.zero_grad()


@pytest.mark.parametrize("no_step", [False, True])
def test_accumulation_adds_to_the_held_codes(device, no_step):
    """Micro-batches before the step (under ``no_step`` or not) add to the held codes: no
    buffer in the master's dtype, p.grad None; the held values are the sum of the
    micro-batches' gradients within the codes' rounding, the clip reads their norm, and
    training goes on."""
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt = offloaded(a, device, "lean", keep_grads=False, clips=True)
    opt_b = offloaded(b, device, "lean", overlap=False)
    engine = engine_of_model(a)
    trained = [u for u in engine.units if u.num_trainable]
    for _ in range(2):
        micro = batches(2, device)
        with opt.no_step() if no_step else contextlib.nullcontext():
            loss_of(a, *micro[0]).backward()
        loss_of(a, *micro[1]).backward()
        for x, y in micro:
            loss_of(b, x, y).backward()
        assert all(u.compact_grad.held and u.host_grad is None for u in trained)
        assert all(p.grad is None for p in a.parameters())
        for u in trained:
            exact = torch.cat(
                [
                    q.grad.reshape(-1).float()
                    for p, q in zip(a.parameters(), b.parameters())
                    if engine.unit_of(p) is u
                ]
            )
            held = torch.cat(
                [
                    u.compact_grad.values()[u.offsets[k] : u.offsets[k] + p.numel()]
                    for k, p in enumerate(u.owned[: u.num_trainable])
                ]
            )
            assert float((held - exact).abs().max()) <= 0.25 * float(exact.abs().max())
        # the clip's norm is the accumulated gradient's (read from the codes: the device
        # norms are of the last micro-batch only), within the codes' rounding: each
        # element within one E4M3 spacing (2**-3 of it), unbiased, so the squares' errors
        # average out far below 1% over thousands of elements
        exact_norm = torch.nn.utils.get_total_norm([q.grad.float() for q in b.parameters()])
        norm = ramflow.clip_grad_norm_(a.parameters(), 0.05)
        assert abs(float(norm) - float(exact_norm)) <= 1e-2 * float(exact_norm)
        opt.step()
        opt.zero_grad()
        opt_b.zero_grad()  # b only gives the micro-batches' exact sums
        ramflow.synchronize(b)
        b.load_state_dict(a.state_dict())
    ramflow.synchronize(a)


def test_the_clip_refuses_part_of_a_unit_and_other_norms(device):
    torch.manual_seed(0)
    model = MLPStack()
    opt = offloaded(model, device, "lean", keep_grads=False, clips=True)
    x, y = batches(1, device)[0]
    loss_of(model, x, y).backward()
    with pytest.raises(ValueError, match="norm_type=2.0"):
        ramflow.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    with pytest.raises(ValueError, match="clip all of the model's trained parameters"):
        ramflow.clip_grad_norm_([next(model.parameters())], 1.0)
    opt.zero_grad()
    assert not engine_of_model(model).stepper.holds_compact()


def test_fp32_keeps_exact_deferred_gradients(device):
    """fp32 masters (exact) never hold their gradients in codes."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(
        model,
        device=device,
        wire_dtype=torch.bfloat16,
        host_precision=ramflow.HostPrecision(gradients="ring"),
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, keep_grads=False, clips=True)
    x, y = batches(1, device)[0]
    loss_of(model, x, y).backward()
    engine = engine_of_model(model)
    assert all(u.compact_grad is None for u in engine.units)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    ramflow.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ramflow.synchronize(model)


def allocated_host_bytes(engine, opt) -> int:
    """What the host store and the optimizer really hold now: masters, separate wire
    copies, the ring's staging buffers made so far, held gradients (codes or the master's
    dtype) and the flat optimizer states."""
    total = 0
    for u in engine.units:
        total += u.master.nbytes + (0 if u.wire is u.master else u.wire.nbytes)
        if u.compact_grad is not None:
            total += u.compact_grad.nbytes
        if u.host_grad is not None:
            total += u.host_grad.nbytes
    host = engine.host
    total += host._ring_made * host._ring_numel * host.wire_dtype.itemsize
    total += sum(t.nbytes for state in opt.unit_states.values() for t in state.values())
    return total


@pytest.mark.parametrize("keep_grads", [False, True])
def test_the_plan_counts_every_host_byte_of_a_clipped_lean_step(device, keep_grads):
    """Issue 48, point 2: after a clipped lean step's backward and clip (its peak: every
    unit holds its gradient), what the store, the held gradients and the optimizer
    allocate is ``get_plan(model).host_bytes`` less the ring buffers not made yet (a fixed
    cost: at most RING_BUFFERS of the largest unit). The held gradients are 8-bit codes
    where the optimizer keeps no p.grad, the master's dtype where it does; the plan says
    which once the optimizer is built."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, device=device, wire_dtype=torch.bfloat16, host_precision="lean")
    engine = engine_of_model(model)
    compact = sum(compact_nbytes(u.trainable_numel) for u in engine.units)
    assert ramflow.get_plan(model).host_deferred_bytes == compact  # the lean recipe's
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, keep_grads=keep_grads, clips=True)
    plan = ramflow.get_plan(model)
    trainable = sum(u.trainable_numel for u in engine.units)
    assert plan.host_deferred_bytes == (trainable * 2 if keep_grads else compact)
    for x, y in batches(2, device):
        loss_of(model, x, y).backward()
        ramflow.clip_grad_norm_(model.parameters(), 0.05)
        held = allocated_host_bytes(engine, opt)
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    host = engine.host
    not_made = (RING_BUFFERS - host._ring_made) * host._ring_numel * 2
    assert 0 <= plan.host_bytes - held <= not_made, (plan.host_bytes, held, not_made)
    assert f"{format_bytes(plan.host_deferred_bytes)} of host gradients" in plan.describe()


@pytest.mark.parametrize("preset", ["lean", "fp32"])
def test_ramflow_plans_header_is_its_tables_host_total(preset):
    """Issue 48, point 2: ``ramflow plan``'s bytes per trained parameter is the table's host
    total (parameters, gradients, optimizer states) over the trained parameters; with a
    loop that holds a deferred step's gradients in p.grad (``ramflow train`` on one
    process), lean counts them in bf16 beside the ring's staging, fp32 its full
    gradients."""
    from ramflow.memory import ActivationProfile, RunDescription, activation_report, estimate_memory

    model = MLPStack()
    profile = ActivationProfile.from_report(activation_report(model, torch.randn(4, 16)))
    est = estimate_memory(
        model,
        activations=profile,
        run=RunDescription(4, 1),
        device_type="cpu",
        wire_dtype=torch.bfloat16,
        host_precision=preset,
        held_gradients="grads",
    )
    host_total = est.host_pinned_bytes + est.host_pageable_bytes
    assert est.host_bytes_per_parameter * est.num_trainable == pytest.approx(host_total)
    assert f"{est.host_bytes_per_parameter:.2f} bytes per trained parameter" in est.describe()
    twin = copy.deepcopy(model)
    ramflow.offload(twin, device="cpu", wire_dtype=torch.bfloat16, host_precision=preset)
    units = engine_of_model(twin).units
    gradients = est.host_gradient_pinned_bytes + est.host_gradient_pageable_bytes
    staging = RING_BUFFERS * max(u.trainable_numel for u in units) * 2
    trainable = sum(u.trainable_numel for u in units)
    if preset == "lean":
        assert gradients == trainable * 2 + staging
    else:
        assert gradients == trainable * (4 + 2)  # fp32 gradients and bf16 staging


def test_a_clipped_compact_run_resumes_bit_for_bit(device):
    """The codes' rounding is keyed by the unit's optimizer step (and micro-batch), not by
    a count in the process: state dicts saved mid-run continue bit for bit."""
    torch.manual_seed(0)
    base = MLPStack()
    data = batches(6, device)

    def train(m, o, part):
        for x, y in part:
            loss_of(m, x, y).backward()
            ramflow.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            o.zero_grad()

    model = copy.deepcopy(base)
    opt = offloaded(model, device, "lean", keep_grads=False, clips=True)
    train(model, opt, data[:3])
    ramflow.synchronize(model)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, data[3:])

    resumed = copy.deepcopy(base)
    ropt = offloaded(resumed, device, "lean", keep_grads=False, clips=True)
    resumed.load_state_dict(saved_model)
    ropt.load_state_dict(saved_opt)
    train(resumed, ropt, data[3:])
    ramflow.synchronize(model)
    ramflow.synchronize(resumed)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p.detach(), q.detach())
