"""Muon's one-pass host passes give ``torch.optim.Muon``'s ops bit for bit.

The reference is the code of ``torch.optim._muon._single_tensor_muon`` on whole tensors:
``buf.lerp_(g, 1 - mu)``; ``g.lerp(buf, mu)`` (Nesterov) or ``buf``, then
``.bfloat16()`` (the iteration's first op); ``p.mul_(1 - lr * wd)``; ``p.add_(O,
alpha=-lr_adj)``. Comparisons are of bit patterns, so a last-bit difference or a flipped
sign of zero fails. Both implementations are checked: the native passes (skipped where
the library cannot be built) and the chunked PyTorch path used without them.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import ramflow
from bit_compare import assert_bits_equal
from models import MLPStack
from ramflow.kernels import muon_kernels as _muon_kernels
from ramflow.kernels.cpu_kernels import DECAY_PROBE_LR, DECAY_PROBE_WD
from ramflow.kernels.muon_kernels import TORCH_CHUNK, muon_apply_, muon_blend_

IMPLS = ["native", "torch"]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """``native``: the library's passes (each call also once with the scalar loop);
    ``torch``: a loader that found no library, as without a compiler."""
    if request.param == "native":
        if not _muon_kernels.muon_kernel_available():
            pytest.skip(f"native Muon passes not available: {_muon_kernels._LIB.reason}")
    else:
        monkeypatch.setenv("RAMFLOW_DISABLE_CPU_KERNELS", "1")
        loader = _muon_kernels._MuonLibrary()
        monkeypatch.setattr(_muon_kernels, "_LIB", loader)
        assert not _muon_kernels.muon_kernel_available()
        assert "RAMFLOW_DISABLE_CPU_KERNELS" in loader.reason
    return request.param


def reference_blend(m, g, mu, nesterov):
    m.lerp_(g, 1 - mu)
    return (g.lerp(m, mu) if nesterov else m).bfloat16()


def tensors(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=gen) * 1e-3
    g = torch.randn(shape, generator=gen) * 1e-3
    g.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-40])  # zeros and a subnormal
    return m, g


# Large enough for several threads' blocks and two chunks of the PyTorch path, with a
# tail past the last full vector; and a small one with a scalar tail only.
SHAPES = [(TORCH_CHUNK // 1000 + 1, 1003), (5, 13)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "mu, nesterov", [(0.95, True), (0.9, False), (0.3, True), (0.5, True), (0.0, True)]
)
def test_blend_is_torch_muons_bit_for_bit(impl, shape, mu, nesterov):
    """Both lerp branches (weights below and at or above 0.5), with and without Nesterov,
    over two steps (the second from a momentum that is not zero)."""
    m, g = tensors(shape)
    ref_m = m.clone()
    for step in range(2):
        out = torch.empty(shape, dtype=torch.bfloat16)
        muon_blend_(m, g, out, momentum_coef=mu, nesterov=nesterov)
        want = reference_blend(ref_m, g, mu, nesterov)
        assert_bits_equal(m, ref_m, f"momentum, step {step}")
        assert_bits_equal(out, want, f"blend, step {step}")
        g = g.flip(0).contiguous()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "lr, wd, adj",
    [(0.02, 0.1, 0.02 * 0.2 * 1003**0.5), (1e-3, 0.0, 1e-3), (DECAY_PROBE_LR, DECAY_PROBE_WD, 0.3)],
)
def test_apply_is_torch_muons_bit_for_bit(impl, shape, lr, wd, adj):
    """Weight decay on and off, and a decay whose float32 rounding depends on how ``1 - lr
    * wd`` is computed (Python's double, then float32, as ``mul_`` reads it)."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(shape, generator=gen)
    o = torch.randn(shape, generator=gen).bfloat16()
    ref = p.clone()
    muon_apply_(p, o, lr=lr, weight_decay=wd, adjusted_lr=adj)
    ref.mul_(1 - lr * wd)
    ref.add_(o, alpha=-adj)
    assert_bits_equal(p, ref, "param")


@pytest.mark.parametrize("threads", [1, 3])
def test_native_result_does_not_depend_on_threads_or_simd(threads):
    """Threads take blocks from a shared counter and the SIMD loop is the scalar loop's
    arithmetic: any thread count, and the scalar loop alone, give the same bits."""
    if not _muon_kernels.muon_kernel_available():
        pytest.skip(f"native Muon passes not available: {_muon_kernels._LIB.reason}")
    lib, fma = _muon_kernels._LIB.lib, _muon_kernels._LIB.torch_fma
    m, g = tensors((300_007,))
    runs = []
    for n_threads, scalar in ((threads, False), (0, True)):
        mm, out, p = m.clone(), torch.empty(m.shape, dtype=torch.bfloat16), g.clone()
        _muon_kernels._blend_native(lib, fma, mm, g, out, 0.95, True, n_threads, scalar)
        _muon_kernels._apply_native(lib, fma, p, out, 1 - 2e-3, -0.05, n_threads, scalar)
        runs.append((mm, out, p))
    for a, b, what in zip(*runs, ("momentum", "blend", "param")):
        assert_bits_equal(a, b, what)


def test_offloaded_matrices_take_the_host_passes(monkeypatch):
    """An offloaded model's Muon matrices are blended and updated by the one-pass host
    passes, once per matrix per step, and the steps equal ``torch.optim.Muon``'s bit for
    bit (test_muon.py checks training runs in full)."""
    from ramflow.optim import muon as _muon

    calls = {"blend": 0, "apply": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(_muon, "muon_blend_", counted("blend", muon_blend_))
    monkeypatch.setattr(_muon, "muon_apply_", counted("apply", muon_apply_))
    torch.manual_seed(0)
    model = MLPStack(depth=2)
    ref = copy.deepcopy(model)
    hidden = [p for b in model.blocks for p in (b.up.weight, b.down.weight)]
    ref_hidden = [p for b in ref.blocks for p in (b.up.weight, b.down.weight)]
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.Muon([{"params": hidden, "use_muon": True}], lr=2e-2, threads=2)
    ref_opt = torch.optim.Muon(
        ref_hidden, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert calls == {"blend": 3 * len(hidden), "apply": 3 * len(hidden)}
    for p, q in zip(hidden, ref_hidden):
        assert_bits_equal(p.detach(), q.detach(), "weight")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(grad=torch.zeros(8, 8, dtype=torch.bfloat16)), TypeError, "grad must be float32"),
        (dict(out=torch.empty(8, 8)), TypeError, "out must be bfloat16"),
        (dict(grad=torch.zeros(8, 7)), ValueError, "grad has 56 elements"),
        (dict(grad=torch.zeros(8, 16)[:, ::2]), ValueError, "grad must be contiguous"),
        (dict(num_threads=0), ValueError, "num_threads must be >= 1"),
        (dict(num_threads=2.0), TypeError, "num_threads must be an int"),
    ],
)
def test_blend_refuses_bad_arguments(change, error, match):
    kwargs = dict(
        momentum=torch.zeros(8, 8),
        grad=torch.zeros(8, 8),
        out=torch.empty(8, 8, dtype=torch.bfloat16),
        momentum_coef=0.95,
        nesterov=True,
    )
    kwargs.update(change)
    with pytest.raises(error, match=match):
        muon_blend_(**kwargs)


def test_overlapping_buffers_are_refused():
    m = torch.zeros(64)
    with pytest.raises(ValueError, match="momentum and grad overlap"):
        muon_blend_(m, m, torch.empty(64, dtype=torch.bfloat16), momentum_coef=0.9, nesterov=True)
    p = torch.zeros(64)
    with pytest.raises(ValueError, match="param and orthogonal overlap"):
        muon_apply_(p, p.view(torch.bfloat16)[:64], lr=1e-3, weight_decay=0.0, adjusted_lr=1e-3)


_DEFAULT_BUILD_CHECK = """
import torch
from ramflow.kernels import muon_kernels as k
from ramflow.kernels.muon_kernels import muon_apply_, muon_blend_
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
assert k.muon_kernel_available() and not k._LIB.torch_fma, k._LIB.reason
gen = torch.Generator().manual_seed(0)
m, g, p = (torch.randn(100_003, generator=gen) for _ in range(3))
ref_m, ref_p, out = m.clone(), p.clone(), torch.empty(m.shape, dtype=torch.bfloat16)
muon_blend_(m, g, out, momentum_coef=0.95, nesterov=True)
ref_m.lerp_(g, 0.05)
assert torch.equal(m.view(torch.int32), ref_m.view(torch.int32))
assert torch.equal(out.view(torch.int16), g.lerp(ref_m, 0.95).bfloat16().view(torch.int16))
muon_apply_(p, out, lr=0.02, weight_decay=0.1, adjusted_lr=0.3)
ref_p.mul_(1 - 0.02 * 0.1).add_(out, alpha=-0.3)
assert torch.equal(p.view(torch.int32), ref_p.view(torch.int32))
"""


def test_native_passes_follow_atens_default_build():
    """On a CPU without AVX2 (ATen's DEFAULT build, forced here) PyTorch's lerp and add do
    not fuse their multiply-adds; the native passes then take the unfused scalar loop,
    and still give PyTorch's bits."""
    if not _muon_kernels.muon_kernel_available():
        pytest.skip(f"native Muon passes not available: {_muon_kernels._LIB.reason}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run(
        [sys.executable, "-c", _DEFAULT_BUILD_CHECK], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_written_tensors_count_as_modified_in_place(impl):
    """As after PyTorch's in-place ops, a backward through a graph that saved the weights
    before the update is refused instead of using the new weights."""
    w = torch.randn(4, 4, requires_grad=True)
    loss = w.square().sum()  # saves w for its backward
    with torch.no_grad():
        muon_apply_(w, torch.ones(4, 4, dtype=torch.bfloat16), lr=0.1, weight_decay=0.0,
                    adjusted_lr=0.1)  # fmt: skip
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    m = torch.zeros(8)
    version = m._version
    muon_blend_(m, torch.ones(8), torch.empty(8, dtype=torch.bfloat16), momentum_coef=0.9,
                nesterov=True)  # fmt: skip
    assert m._version > version
