"""Muon's host passes, each in one pass over memory: the momentum and Nesterov blend, and
the update of the master weights by the orthogonalized blend.

``torch.optim.Muon`` writes these as PyTorch ops (``buf.lerp_(g, 1 - mu)``; ``u =
g.lerp(buf, mu)``; ``u.bfloat16()`` inside the iteration; ``p.mul_(1 - lr * wd)``;
``p.add_(O, alpha=-lr_adj)``). Over host tensors of a Llama-3-8B layer (218 M parameters)
those took about six times as long as PyTorch's fused CPU AdamW (docs/speed.md, "Muon's
host passes"): the out-of-place ``lerp`` and ``bfloat16()`` allocate a fresh fp32 and bf16 tensor per
matrix (new pages: the kernel faults every one of them in), and ``add_`` of a bf16 tensor
to an fp32 one first makes an fp32 copy of it (PyTorch's CPU TensorIterator promotes
mixed-dtype inputs by a temporary), so each pass went over DRAM several times and
through the page-fault path. Here each is one pass (the blend reads ``g`` and ``m`` and
writes ``m`` and the bf16 blend: 14 bytes per element; the update reads the bf16 result
and reads and writes ``p``: 10), multithreaded, with no temporaries; the caller gives the
output buffers (pinned, on CUDA, so the blend goes to the device by DMA as written).

[Note: Muon's host passes bit for bit]
The native passes (``muon_kernels.cpp``, in the library of ``kernels.cpu_kernels``) give
PyTorch's bits:
  * ``lerp(self, end, w)`` with a scalar weight is, in every SIMD build of ATen's lerp
    kernel, ``fma(w, end - self, self)`` if ``|w| < 0.5`` else ``fma(w - 1, end - self,
    end)``, with ``w`` cast to float once (``weight.to<float>()``); its scalar tail,
    compiled with contraction, fuses the same way (checked: a tensor stepped whole equals
    it stepped seven elements at a time). ``1 - mu`` is computed in Python's double first.
  * ``.bfloat16()`` rounds to nearest even (NaN's bits may differ; it is NaN either way).
  * ``p.mul_(s)`` multiplies by ``float(s)``; ``p.add_(O, alpha=a)`` is ``fma(float(O),
    float(a), p)`` (``vec::fmadd(other, alpha, self)``; the bf16 ``O`` widens exactly).
The library is loaded once and checked against PyTorch on a probe (both lerp branches,
with and without Nesterov, a length with a scalar tail); where it is missing or differs
(no compiler, not x86-64, ``RAMFLOW_DISABLE_CPU_KERNELS=1``, another ATen), the same ops
run through PyTorch in cache-sized chunks into preallocated buffers: the same bits,
slower.
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from . import cpu_kernels as _cpu_kernels
from .cpu_kernels import check_no_overlap, check_tensor, check_threads
from .library import KernelLibrary

__all__ = ["muon_apply_", "muon_blend_", "muon_kernel_available"]

# Elements per chunk of the PyTorch path: 4 MB of fp32, so a chunk's second pass reads
# it from the cache; a multiple of every SIMD width, so no element moves from ATen's
# vector loop to its scalar tail.
TORCH_CHUNK = 1 << 20


class _BlendArgs(ctypes.Structure):
    """``MuonBlendArgs`` of ``muon_kernels.cpp``, field for field."""

    _fields_ = [
        ("momentum", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("momentum_weight", ctypes.c_double),
        ("nesterov_weight", ctypes.c_double),
        ("nesterov", ctypes.c_int32),
        ("torch_fma", ctypes.c_int32),
        ("force_scalar", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


class _ApplyArgs(ctypes.Structure):
    """``MuonApplyArgs`` of ``muon_kernels.cpp``, field for field."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("orthogonal", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("decay", ctypes.c_double),
        ("alpha", ctypes.c_double),
        ("torch_fma", ctypes.c_int32),
        ("force_scalar", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


class _MuonLibrary(KernelLibrary):
    """The native entry points (the ``kernels.cpu_kernels`` build), checked once, or None."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_fma = True

    def _declare(self, lib: ctypes.CDLL) -> ctypes.CDLL | None:
        lib.ramflow_muon_blend.argtypes = [ctypes.POINTER(_BlendArgs)]
        lib.ramflow_muon_blend.restype = ctypes.c_int
        lib.ramflow_muon_apply.argtypes = [ctypes.POINTER(_ApplyArgs)]
        lib.ramflow_muon_apply.restype = ctypes.c_int
        self.torch_fma = torch.backends.cpu.get_cpu_capability() != "DEFAULT"
        mismatch = _probe_mismatch(lib, self.torch_fma)
        if mismatch:
            self.reason = f"it does not reproduce PyTorch's ops here ({mismatch})"
            self._warn()
            return None
        return lib

    def _on_build_error(self, err: Exception) -> None:
        self._warn()

    def _warn(self) -> None:
        warnings.warn(
            f"ramflow: the native Muon host passes are not used because {self.reason}; "
            f"running PyTorch's ops in chunks instead (same results, slower). Set "
            f"{_cpu_kernels.ENV_DISABLE}=1 to silence this.",
            RuntimeWarning,
            stacklevel=6,
        )


_LIB = _MuonLibrary()


def muon_kernel_available() -> bool:
    """Whether ``muon_blend_`` and ``muon_apply_`` run native code (building and checking
    it on first call); False: PyTorch's ops, with the same results."""
    return _LIB.get() is not None


def _probe_mismatch(lib, torch_fma: bool) -> str:
    """Run the native passes and PyTorch's ops on a probe; describe the first difference."""
    gen = torch.Generator().manual_seed(0)
    n = 16 * 9 + 13  # a scalar tail after 8- and 16-lane vectors
    for mu, nesterov in ((0.95, True), (0.3, True), (0.7, False)):
        m = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen)
        ours = (m.clone(), torch.empty(n, dtype=torch.bfloat16))
        ref = (m.clone(), torch.empty(n, dtype=torch.bfloat16))
        _blend_native(lib, torch_fma, ours[0], g, ours[1], mu, nesterov, 0, False)
        _blend_torch(ref[0], g, ref[1], mu, nesterov)
        if not (_same_bits(ours[0], ref[0]) and _same_bits(ours[1], ref[1])):
            return f"the blend differs with momentum={mu}, nesterov={nesterov}"
    o = torch.randn(n, generator=gen).bfloat16()
    for lr, wd, adj in ((0.02, 0.1, 0.02 * 12.8), (1e-3, 0.0, 1e-3)):
        p = torch.randn(n, generator=gen)
        ours, ref = p.clone(), p.clone()
        _apply_native(lib, torch_fma, ours, o, 1 - lr * wd, -adj, 0, False)
        _apply_torch(ref, o, 1 - lr * wd, -adj)
        if not _same_bits(ours, ref):
            return f"the update differs with lr={lr}, weight_decay={wd}"
    return ""


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    ints = torch.int16 if x.element_size() == 2 else torch.int32
    return torch.equal(x.view(ints), y.view(ints))


def _blend_native(lib, torch_fma, momentum, grad, out, mu, nesterov, threads, force_scalar):
    args = _BlendArgs(
        momentum=momentum.data_ptr(),
        grad=grad.data_ptr(),
        out=out.data_ptr(),
        n=momentum.numel(),
        momentum_weight=1 - mu,
        nesterov_weight=mu,
        nesterov=int(nesterov),
        torch_fma=int(torch_fma),
        force_scalar=int(force_scalar),
        num_threads=threads,
    )
    rc = lib.ramflow_muon_blend(ctypes.byref(args))
    assert rc == 0, rc


def _apply_native(lib, torch_fma, param, orthogonal, decay, alpha, threads, force_scalar):
    args = _ApplyArgs(
        param=param.data_ptr(),
        orthogonal=orthogonal.data_ptr(),
        n=param.numel(),
        decay=decay,
        alpha=alpha,
        torch_fma=int(torch_fma),
        force_scalar=int(force_scalar),
        num_threads=threads,
    )
    rc = lib.ramflow_muon_apply(ctypes.byref(args))
    assert rc == 0, rc


@torch.no_grad()
def _blend_torch(
    momentum: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, mu: float, nesterov: bool
) -> None:
    """``torch.optim.Muon``'s ops, chunk by chunk through one fp32 scratch buffer."""
    m, g, u = momentum.view(-1), grad.view(-1), out.view(-1)
    n = m.numel()
    scratch = torch.empty(min(n, TORCH_CHUNK), dtype=torch.float32) if nesterov else None
    for lo in range(0, n, TORCH_CHUNK):
        hi = min(lo + TORCH_CHUNK, n)
        m[lo:hi].lerp_(g[lo:hi], 1 - mu)
        if scratch is None:
            u[lo:hi].copy_(m[lo:hi])
        else:
            blend = torch.lerp(g[lo:hi], m[lo:hi], mu, out=scratch[: hi - lo])
            u[lo:hi].copy_(blend)


@torch.no_grad()
def _apply_torch(param: torch.Tensor, orthogonal: torch.Tensor, decay: float, alpha: float):
    """``p.mul_(decay); p.add_(O, alpha=alpha)``, chunk by chunk (``O`` widened into one
    fp32 scratch buffer, as PyTorch's mixed-dtype ``add_`` would into a whole-size one)."""
    p, o = param.view(-1), orthogonal.view(-1)
    n = p.numel()
    scratch = torch.empty(min(n, TORCH_CHUNK), dtype=torch.float32)
    for lo in range(0, n, TORCH_CHUNK):
        hi = min(lo + TORCH_CHUNK, n)
        wide = scratch[: hi - lo].copy_(o[lo:hi])
        p[lo:hi].mul_(decay)
        p[lo:hi].add_(wide, alpha=alpha)


def muon_blend_(
    momentum: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor,
    *,
    momentum_coef: float,
    nesterov: bool,
    num_threads: int | None = None,
) -> None:
    """Muon's momentum and Nesterov blend (Jordan et al., 2024), as ``torch.optim.Muon``
    computes them, in one pass: ``momentum.lerp_(grad, 1 - momentum_coef)``, then ``out =
    grad.lerp(momentum, momentum_coef)`` (``nesterov``) or ``out = momentum``, rounded to
    bf16 (nearest even: the Newton-Schulz iteration's first op). Bit for bit PyTorch's;
    see [Note: Muon's host passes bit for bit].

    Args:
        momentum: fp32 momentum buffer, any shape, updated in place.
        grad: fp32 gradient, ``momentum``'s number of elements; only read.
        out: bf16, ``momentum``'s number of elements: receives the blend (pinned memory
            for a DMA to the device, or any host buffer).
        momentum_coef: ``mu``, a float (``torch.optim.Muon``'s ``momentum``).
        nesterov: blend as Nesterov (True), or give the momentum itself.
        num_threads: CPU threads of the native pass, an int >= 1; None is
            ``torch.get_num_threads()``. The result does not depend on it.

    All tensors on the CPU, contiguous, not overlapping. Releases the GIL (native). The
    version counters of the tensors written are bumped, as by PyTorch's in-place ops.

    Raises:
        TypeError: a tensor has another dtype, or ``num_threads`` is not an int.
        ValueError: a tensor is not on the CPU, not contiguous, has another number of
            elements or overlaps another; ``num_threads`` < 1.
    """
    check_threads(num_threads)
    n = momentum.numel() if isinstance(momentum, torch.Tensor) else -1
    check_tensor("momentum", momentum, (torch.float32,), n)
    check_tensor("grad", grad, (torch.float32,), n)
    check_tensor("out", out, (torch.bfloat16,), n)
    check_no_overlap([("momentum", momentum), ("grad", grad), ("out", out)])
    if n == 0:
        return
    lib = _LIB.get()
    if lib is None:
        _blend_torch(momentum, grad, out, float(momentum_coef), bool(nesterov))
    else:
        _blend_native(
            lib,
            _LIB.torch_fma,
            momentum,
            grad,
            out,
            float(momentum_coef),
            bool(nesterov),
            num_threads or 0,
            False,
        )
        torch.autograd.graph.increment_version(momentum)  # written in place, as by lerp_


def muon_apply_(
    param: torch.Tensor,
    orthogonal: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjusted_lr: float,
    num_threads: int | None = None,
) -> None:
    """Muon's update of ``param`` in one pass, as ``torch.optim.Muon``: ``param.mul_(1 - lr
    * weight_decay)`` then ``param.add_(orthogonal, alpha=-adjusted_lr)``. Bit for bit
    PyTorch's; see [Note: Muon's host passes bit for bit].

    Args:
        param: fp32 master weights, any shape, updated in place.
        orthogonal: bf16, ``param``'s number of elements: the orthogonalized blend.
        lr, weight_decay: the group's learning rate and decoupled weight decay.
        adjusted_lr: the step's scale, ``torch.optim._muon._adjust_lr(lr, ...)``.
        num_threads: as for ``muon_blend_``.

    Raises:
        TypeError, ValueError: as ``muon_blend_`` does for its tensors.
    """
    check_threads(num_threads)
    n = param.numel() if isinstance(param, torch.Tensor) else -1
    check_tensor("param", param, (torch.float32,), n)
    check_tensor("orthogonal", orthogonal, (torch.bfloat16,), n)
    check_no_overlap([("param", param), ("orthogonal", orthogonal)])
    if n == 0:
        return
    decay, alpha = 1 - lr * weight_decay, -adjusted_lr
    lib = _LIB.get()
    if lib is None:
        _apply_torch(param, orthogonal, decay, alpha)
    else:
        _apply_native(lib, _LIB.torch_fma, param, orthogonal, decay, alpha, num_threads or 0, False)
        # as PyTorch's in-place ops do: autograd then refuses a backward through a graph
        # that saved the old weights, rather than using the new ones silently
        torch.autograd.graph.increment_version(param)
