"""A real clip's coefficient applied by each unit's step (``ramflow.engine.grad_scale``) and its
norm read from the device gradients (``ramflow.engine.grad_norms``), as ``clip_grad_norm_(...,
fold=True)`` (``ramflow train``) or ``RAMFLOW_CLIP_FOLD=1`` do: the same bits as scaling
the host gradients in place first (the default, PyTorch's own clip), in every host format,
on the host and the device step; ``p.grad`` as PyTorch leaves it once synchronized; writes
after the clip kept or refused, never silently misapplied. Without fold, ``p.grad`` is
clipped when the call returns, as PyTorch's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import ramflow
from bit_compare import assert_bits_equal
from models import MLPStack, tiny_llama
from ramflow.engine import clip as _clip
from ramflow.kernels import lean_kernels as _lean_kernels
from ramflow.kernels.cpu_kernels import fused_adamw_step_
from ramflow.kernels.lean_kernels import QBLOCK, lean_adamw_step_, quantize_blockwise

LR = 1e-3
MAX_NORM = 0.05  # below the tiny models' gradient norms (about 1): every step clips
# a coefficient whose products with the gradients round (a power of two would not)
SCALE = 0.3711
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def folded(monkeypatch):
    """These tests are the fold's: as ``RAMFLOW_CLIP_FOLD=1`` (tests that compare both set
    it per run)."""
    monkeypatch.setattr(_clip, "_FOLD", True)


# ---------------------------------------------------------------------- the kernels


def test_fp32_step_with_grad_scale_equals_the_step_from_scaled_gradients():
    """The native fp32 kernel multiplies first and rounds (built without contraction)."""
    n = 4099
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    init = [
        torch.randn(n, generator=gen),
        torch.rand(n, generator=gen),
        torch.rand(n, generator=gen),
    ]
    folded, scaled = [t.clone() for t in init], [t.clone() for t in init]
    wires = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    fused_adamw_step_(
        *folded[:1], grad, *folded[1:], step=3, grad_scale=SCALE, wire_out=wires[0], **HYPER
    )
    fused_adamw_step_(*scaled[:1], grad * SCALE, *scaled[1:], step=3, wire_out=wires[1], **HYPER)
    for x, y, what in zip(folded + wires[:1], scaled + wires[1:], ("master", "m", "v", "wire")):
        assert_bits_equal(x, y, what)


@pytest.fixture(params=["avx512", "avx2", "torch"])
def lean_impl(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(_lean_kernels._LEAN, "get", lambda: None)
        return request.param
    if not _lean_kernels.lean_kernel_available():
        pytest.skip("the native lean kernels are not available here")
    monkeypatch.setenv("RAMFLOW_LEAN_ISA", request.param)
    if _lean_kernels.lean_isa() != request.param:
        pytest.skip(f"this CPU runs the lean step in {_lean_kernels.lean_isa()}")
    return request.param


def _lean_state(master: str, states: torch.dtype, p32: torch.Tensor) -> dict:
    n = p32.numel()
    s = {"master": p32.clone() if master == "fp32" else p32.to(torch.bfloat16)}
    if master == "kahan":
        s["compensation"] = torch.zeros(n, dtype=torch.bfloat16)
    if master == "fp32":
        s["wire_out"] = torch.empty(n, dtype=torch.bfloat16)
    if states == torch.uint8:
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            s[name], s[f"{name}_scale"] = quantize_blockwise(torch.rand(n) * 1e-3, signed=signed)
    else:
        s["exp_avg"] = (torch.rand(n) * 1e-3).to(states)
        s["exp_avg_sq"] = (torch.rand(n) * 1e-6).to(states)
    return s


@pytest.mark.parametrize(
    "master,states", itertools.product(("sr", "kahan", "fp32"), (torch.uint8, torch.bfloat16))
)
def test_lean_step_with_grad_scale_equals_the_step_from_scaled_gradients(lean_impl, master, states):
    """The lean kernels (each instruction set, and PyTorch's ops) multiply first and round:
    a step from fp32 gradients with ``grad_scale`` equals one from the scaled gradients."""
    n = 2 * QBLOCK * 9 + 37
    gen = torch.Generator().manual_seed(1)
    p32, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    torch.manual_seed(2)
    folded = _lean_state(master, states, p32)
    scaled = copy.deepcopy(folded)
    for s, g, scale in ((folded, grad, SCALE), (scaled, grad * SCALE, 1.0)):
        lean_adamw_step_(
            s["master"], g, s["exp_avg"], s["exp_avg_sq"], step=2, grad_scale=scale,
            compensation=s.get("compensation"), exp_avg_scale=s.get("exp_avg_scale"),
            exp_avg_sq_scale=s.get("exp_avg_sq_scale"), wire_out=s.get("wire_out"), seed=5,
            **HYPER,
        )  # fmt: skip
    for name in folded:
        assert_bits_equal(folded[name], scaled[name], name)


# ---------------------------------------------------------------------- the clip


def batches(n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=g).to(device) for _ in range(n)]


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def offloaded(device: torch.device, host_precision: str, device_optimizer: bool):
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    ramflow.offload(
        model,
        device=device,
        host_precision=host_precision,
        device_optimizer=device_optimizer,
        gpu_memory=10**9 if device_optimizer else None,
    )
    return model, ramflow.optim.AdamW(model.parameters(), lr=LR)


def clipped_run(device, host_precision, device_optimizer, *, fold: bool, monkeypatch):
    """Four clipped steps; the norms, the weights and the optimizer's states."""
    monkeypatch.setattr(_clip, "_FOLD", fold)
    model, opt = offloaded(device, host_precision, device_optimizer)
    engine = ramflow.api._engine(model)
    norms = []
    for ids in batches(4, device):
        lm_loss(model, ids).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        assert fold == any(u.grad_scale is not None for u in engine.units)
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    states = [t.clone() for st in opt.state_dict()["state"].values() for t in st.values()]
    return torch.stack(norms).cpu(), [p.detach().clone() for p in model.parameters()], states


@pytest.mark.parametrize("device_optimizer", [False, True])
def test_folded_clip_equals_the_clip_in_place(device_optimizer, monkeypatch):
    """fp32 host formats: bit for bit the run of PyTorch's clip on the host gradients (the
    norm from the device's per-parameter norms, the coefficient in each unit's host or
    device step)."""
    device = torch.device("cpu")
    ours = clipped_run(device, "fp32", device_optimizer, fold=True, monkeypatch=monkeypatch)
    ref = clipped_run(device, "fp32", device_optimizer, fold=False, monkeypatch=monkeypatch)
    assert_bits_equal(ours[0], ref[0], "norms")
    for what, xs, ys in (("weights", ours[1], ref[1]), ("states", ours[2], ref[2])):
        for x, y in zip(xs, ys):
            assert_bits_equal(x, y, what)


def test_folded_clip_in_lean_formats_is_the_fp32_clip():
    """Lean host formats keep ``p.grad`` in bf16 (the master's dtype), where PyTorch's clip
    rounds the norm, the coefficient and each scaled gradient to bf16. The folded clip
    keeps all three in fp32 (the kernels read the gradient in fp32): the norm is the fp32
    norm of the same gradients, bit for bit, and after ``synchronize`` ``p.grad`` is each
    gradient times the fp32 coefficient, rounded once to bf16. Host and device steps give
    the same bits."""
    device = torch.device("cpu")
    runs = []
    for device_optimizer in (False, True):
        model, opt = offloaded(device, "lean", device_optimizer)
        for step, ids in enumerate(batches(3, device)):
            lm_loss(model, ids).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            ref_norm = torch.nn.utils.get_total_norm([g.float() for g in grads])
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert_bits_equal(norm, ref_norm, "norm")
            opt.step()
            if step == 2:
                ramflow.synchronize(model)
                coef = torch.clamp(MAX_NORM / (ref_norm + 1e-6), max=1.0)
                for p, g in zip(model.parameters(), grads):
                    assert_bits_equal(p.grad, (g.float() * coef).to(g.dtype), "p.grad")
            opt.zero_grad()
        ramflow.synchronize(model)
        runs.append([p.detach().clone() for p in model.parameters()])
    for x, y in zip(*runs):
        assert_bits_equal(x, y, "weights, host against device steps")


@pytest.mark.gpu
@pytest.mark.parametrize("device_optimizer", [False, True])
def test_folded_clip_on_cuda(device_optimizer, monkeypatch):
    """On CUDA, fp32 masters, within one run (two runs are not compared: CUDA's backward
    accumulates some gradients with atomics, so two runs of one command differ in their
    last bits, and AdamW carries that into the next steps; measured on an H200, 2026-11-28):
    at each of four steps the folded clip's norm, summed from the per-parameter device
    norms on their own stream, is the fp64 norm of the same host gradients within fp32
    rounding of a sum over the parameters (rtol 1e-6; measured at most 1.1e-7), and after
    ``synchronize`` each ``p.grad`` holds the gradient times PyTorch's coefficient
    computed from that norm, bit for bit: the coefficient reached every unit's host or
    device step, after the norms it was computed from."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU box)")
    device = torch.device("cuda")
    monkeypatch.setattr(_clip, "_FOLD", True)
    model, opt = offloaded(device, "fp32", device_optimizer)
    engine = ramflow.api._engine(model)
    params = list(model.parameters())
    for ids in batches(4, device):
        lm_loss(model, ids).backward()
        grads = [p.grad.clone() for p in params]
        ref = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        assert any(u.grad_scale is not None for u in engine.units)
        torch.testing.assert_close(norm.double().cpu(), ref.cpu(), rtol=1e-6, atol=0)
        opt.step()
        ramflow.synchronize(model)
        coef = torch.clamp(MAX_NORM / (norm.float() + 1e-6), max=1.0)
        for p, g in zip(params, grads):
            assert_bits_equal(p.grad, g * coef.to(g.device), "p.grad after the folded step")
        opt.zero_grad()


def test_clip_matches_torch_and_leaves_pytorchs_gradients_once_synchronized():
    """Against PyTorch's clip and AdamW on a deepcopy: the norm bit for bit (it came from
    the device gradients: the host gradients stay unscaled until ``synchronize``), and
    then ``p.grad`` holds PyTorch's clipped gradients, bit for bit."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    ref = copy.deepcopy(model)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    for ids in batches(3, device):
        lm_loss(model, ids).backward()
        lm_loss(ref, ids).backward()
        unscaled = [p.grad.clone() for p in model.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert_bits_equal(norm, ref_norm, "norm")
        for p, g in zip(model.parameters(), unscaled):
            assert_bits_equal(p.grad, g, "p.grad before synchronize")
        opt.step()
        ref_opt.step()
        ramflow.synchronize(model)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_bits_equal(p.grad, q.grad, "p.grad after synchronize")
            assert_bits_equal(p.detach(), q.detach(), "weights")
        opt.zero_grad()
        ref_opt.zero_grad()


def test_without_fold_the_gradients_are_clipped_when_the_call_returns(monkeypatch):
    """The default (no ``fold``, ``RAMFLOW_CLIP_FOLD`` unset): PyTorch's clip in place, so a
    loop that reads ``p.grad`` right after the call reads PyTorch's clipped gradients, bit
    for bit, and no unit holds a coefficient; ``fold=True`` folds whatever the default."""
    monkeypatch.setattr(_clip, "_FOLD", False)
    model, ref, opt, ref_opt = mlp_pair(False)
    engine = ramflow.api._engine(model)
    for seed in range(2):
        mse(model, seed).backward()
        mse(ref, seed).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert_bits_equal(norm, ref_norm, "norm")
        assert all(u.grad_scale is None for u in engine.units)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_bits_equal(p.grad, q.grad, "p.grad right after the clip")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    mse(model, 2).backward()
    ramflow.clip_grad_norm_(model.parameters(), MAX_NORM, fold=True)
    assert any(u.grad_scale is not None for u in engine.units)


def mlp_pair(device_optimizer: bool):
    torch.manual_seed(0)
    model = MLPStack(depth=3)
    ref = copy.deepcopy(model)
    ramflow.offload(
        model,
        device="cpu",
        wire_dtype=torch.float32,
        device_optimizer=device_optimizer,
        gpu_memory=10**9 if device_optimizer else None,
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)


def mse(model: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.zeros(8, 8))


@pytest.mark.parametrize("device_optimizer", [False, True])
def test_gradients_zeroed_after_the_clip_are_zeros(device_optimizer):
    """``p.grad.zero_()`` between the clip and the step, or after the step (PyTorch then
    accumulates into the zeros; device steps let the loop write at once, host steps once
    synchronized): zeros whether scaled or not, so the run equals PyTorch's."""
    model, ref, opt, ref_opt = mlp_pair(device_optimizer)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            (mse(m, step) * 30).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            if step == 1:  # before the step: it steps from zeros
                for p in m.parameters():
                    p.grad.zero_()
            o.step()
            if m is model and not device_optimizer:  # host steps read p.grad after step()
                ramflow.synchronize(model)
            for p in m.parameters():
                p.grad.zero_()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bits_equal(p.detach(), q.detach(), "weights")
        assert_bits_equal(p.grad, q.grad, "p.grad")


def test_gradients_changed_after_the_clip_raise_unless_synchronized():
    """A write in place after the clip would be scaled with the clipped values or not at
    all: ``step()`` refuses it before it steps any unit and names ``ramflow.synchronize``;
    after that call the write is PyTorch's (its clip scaled the gradients before it)."""
    model, ref, opt, ref_opt = mlp_pair(False)
    before = [p.detach().clone() for p in model.parameters()]
    (mse(model, 0) * 30).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    model.head.weight.grad.add_(1.0)  # the last unit: the others would be scheduled first
    with pytest.raises(RuntimeError, match="ramflow.synchronize"):
        opt.step()
    opt.zero_grad()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), before):
        assert_bits_equal(p.detach(), q, "weights after the refused step")
    for m, o in ((model, opt), (ref, ref_opt)):
        (mse(m, 1) * 30).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        if m is model:
            ramflow.synchronize(model)
        m.head.weight.grad.add_(1.0)
        o.step()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bits_equal(p.detach(), q.detach(), "weights")


def test_a_replaced_gradient_is_the_loops_own():
    """A gradient the loop replaced after the clip is stepped as it is (PyTorch's clip
    scaled the tensor the loop dropped); the unit's other gradients are still clipped."""
    model, ref, opt, ref_opt = mlp_pair(False)
    for m, o in ((model, opt), (ref, ref_opt)):
        (mse(m, 0) * 30).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        m.head.weight.grad = torch.full_like(m.head.weight, 0.01)
        o.step()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bits_equal(p.detach(), q.detach(), "weights")
        assert_bits_equal(p.grad, q.grad, "p.grad")
