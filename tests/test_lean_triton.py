"""The fused Triton lean AdamW step (``kernels.lean_triton``) against the PyTorch-ops step.

Both implement [Note: lean formats, one pass] and must give the same bits (see [Note: the
same bits on the GPU]): every master, compensation, state, block scale and wire copy, over
several steps, for every master and state format, gradient dtype, size (blocks cut at the
end), counter offset (past 2**32: the hash's high word) and with a gradient scale and
weight decay. On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
in a subprocess: the variable is read when the kernel is defined); marked ``gpu``, it is
compiled for the device, where fused multiply-adds and approximate divisions would show.
"""

from __future__ import annotations

import pytest
import torch

from ramflow.kernels import lean_kernels as lk
from triton_interpreter import interpreted_mismatches

# (n, master, states, grad dtype, wire, grad_scale, weight_decay, counter_offset)
CASES = [
    (1000, "sr", torch.uint8, torch.bfloat16, None, 1.0, 0.1, 256 * 7),
    (4099, "kahan", torch.uint8, torch.float32, None, 0.5, 0.0, 0),
    (777, "sr", torch.bfloat16, torch.float16, None, 1.0, 0.01, 3),
    (1, "kahan", torch.bfloat16, torch.bfloat16, None, 1.0, 0.01, 0),
    (2048, "fp32", torch.float32, torch.float32, torch.bfloat16, 1.0, 0.01, 0),
    (300, "fp32", torch.uint8, torch.bfloat16, torch.float16, 0.7, 0.01, 0),
    (5000, "sr", torch.uint8, torch.bfloat16, None, 1.0, 0.0, (1 << 32) + 512),
    (1536, "sr", torch.float32, torch.float32, None, 1.0, 0.0, 0),
    # gradients of every kind of 8-bit block (_hard_grads): the codes' stochastic rounding
    # on subnormal codes, zeros, NaN, infinity, -0.0, fp32 subnormals, codes of 0, a tail
    (12 * 256 + 77, "sr", torch.uint8, torch.bfloat16, None, 1.0, 0.0, (1 << 32) + 256),
    (12 * 256 + 77, "fp32", torch.uint8, torch.float32, torch.bfloat16, 1.0, 0.01, 0),
    # bf16 states, rounded stochastically as the codes are: an fp32 master, and the hard
    # gradients (NaN and infinite states) with a counter that passes 2**32
    (3000, "fp32", torch.bfloat16, torch.float32, torch.bfloat16, 1.0, 0.01, (1 << 32) - 997),
    (12 * 256 + 77, "sr", torch.bfloat16, torch.bfloat16, None, 1.0, 0.0, (1 << 32) + 5),
]
HARD = 12 * 256 + 77  # the size of the cases with _hard_grads


def _hard_grads(n, gen):
    """Gradients (n,) fp32, one kind of 8-bit block each, then a tail (as
    test_cpu_kernels' hard blocks)."""
    blocks = [torch.randn(256, generator=gen) * 1e-2 for _ in range(12)]
    blocks[1][17] = 0.0
    blocks[2][::7] *= 2.0**-13  # subnormal codes next to normal ones
    blocks[3][100] = float("nan")
    blocks[4][5] = float("inf")
    blocks[5].zero_()
    blocks[6] *= 1e-36  # fp32 subnormal squares
    blocks[7][:] = -0.0
    blocks[8][::3] *= 2.0**-30  # codes of 0
    return torch.cat(blocks + [torch.randn(n - 12 * 256, generator=gen) * 1e-2])


def _tensors(n, master, states, grad_dtype, wire, gen):
    def randn(scale):
        return torch.randn(n, generator=gen) * scale

    w = randn(1.0)
    if master != "fp32":
        w = w.to(torch.bfloat16)
    comp = randn(1e-3).to(torch.bfloat16) if master == "kahan" else None
    m, v = randn(1e-3), randn(1e-3).square()
    if n > 300:
        m[256:512] = 0.0  # a block of zeros (the smallest scale)
        v[256:512] = 0.0
    if states == torch.uint8:
        (m, m_scale), (v, v_scale) = (
            lk.quantize_blockwise(m, signed=True),
            lk.quantize_blockwise(v, signed=False),
        )
    else:
        m, v, m_scale, v_scale = m.to(states), v.to(states), None, None
    wire_out = torch.empty(n, dtype=wire) if wire is not None else None
    return [w, comp, m, v, m_scale, v_scale, wire_out]


def mismatches(device: str) -> list[str]:
    """Runs every case three steps with both implementations on ``device``; returns what
    differed (empty: all bits equal)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for case in CASES:
        n, master, states, grad_dtype, wire, scale, wd, offset = case
        ref = [t.to(device) if t is not None else None for t in _tensors(*case[:5], gen)]
        new = [t.clone() if t is not None else None for t in ref]
        if master == "sr" and states == torch.float32:
            ref[0][5] = new[0][5] = float("nan")  # NaN rounds to 0x7FC0 in both
        for step in (1, 2, 7):
            g = torch.randn(n, generator=gen) * 1e-2
            if n == HARD:
                g = _hard_grads(n, gen)
            g = g.to(grad_dtype).to(device)
            if n > 300 and n != HARD:
                g[256:512] = 0.0
            c = lk._coefficients(
                step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd
            )
            key = lk.rounding_key(12345678901, step)
            for impl, t in ((lk._step_torch, ref), (lk._step_triton, new)):
                w, comp, m, v, m_scale, v_scale, wire_out = t
                impl(
                    w, g, m, v, comp, m_scale, v_scale, wire_out, key=key, counter_offset=offset,
                    grad_scale=scale, apply_decay=wd != 0, c=c,
                )  # fmt: skip
            names = ["master", "compensation", "exp_avg", "exp_avg_sq", "m_scale", "v_scale"]
            for name, a, b in zip(names + ["wire"], ref, new):
                if a is not None and name in ("master", "compensation", "wire"):
                    # NaN payloads: the PyTorch path's nearest-even casts (Kahan's hi, the
                    # wire copy) and its arithmetic keep NaN's sign and payload where the
                    # kernel writes its own; the states and scales are compared as they are
                    both = a.isnan() & b.isnan()
                    a, b = a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)
                if a is not None and not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    out.append(f"{case[:4]} step {step}: {name} differs")
    return out


def test_interpreted_kernel_gives_the_pytorch_steps_bits():
    assert interpreted_mismatches("test_lean_triton", "mismatches") == []


@pytest.mark.gpu
def test_compiled_kernel_gives_the_pytorch_steps_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ramflow.kernels import lean_triton as _lean_triton

    assert _lean_triton.available(torch.device("cuda")), "Triton is not importable"
    assert mismatches("cuda") == []


@pytest.mark.gpu
def test_compiled_kernel_gives_the_native_cpu_steps_bits():
    """The device step (Triton, compiled) and the host step (the native CPU kernel, or its
    PyTorch path where it cannot be built) give the same bits, every tensor, three steps:
    a unit's states may move between the two at any step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(1)
    for case in CASES:
        n, master, states, grad_dtype, wire, scale, wd, offset = case
        host = _tensors(*case[:5], gen)
        dev = [t.cuda() if t is not None else None for t in host]
        for step in (1, 2, 7):
            g = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
            for t, grad in ((host, g), (dev, g.cuda())):
                w, comp, m, v, m_scale, v_scale, wire_out = t
                lk.lean_adamw_step_(
                    w, grad, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=wd, grad_scale=scale, compensation=comp,
                    exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale, wire_out=wire_out,
                    seed=12345678901, counter_offset=offset,
                )  # fmt: skip
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(host, dev)):
                if a is not None:
                    assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), (
                        f"{case[:4]} step {step}: tensor {i} differs"
                    )


@pytest.mark.gpu
def test_device_lean_step_runs_the_triton_kernel():
    """``lean_adamw_step_`` on CUDA tensors goes to the kernel (not the PyTorch ops): the
    profiler sees one kernel launch for one call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = 1 << 20
    w = torch.randn(n, device="cuda").to(torch.bfloat16)
    g = torch.randn(n, device="cuda").to(torch.bfloat16)
    m, m_scale = lk.quantize_blockwise(torch.zeros(n, device="cuda"), signed=True)
    v, v_scale = lk.quantize_blockwise(torch.zeros(n, device="cuda"), signed=False)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, seed=1)
    kw.update(exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale)
    lk.lean_adamw_step_(w, g, m, v, **kw)  # compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        lk.lean_adamw_step_(w, g, m, v, **kw)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["lean_adamw_kernel"], kernels
