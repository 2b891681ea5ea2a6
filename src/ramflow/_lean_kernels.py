"""One-pass CPU AdamW steps for the lean host formats (see ``_host_formats.HostPrecision``).

The master weights are fp32, or bf16 written with stochastic rounding, or bf16 plus a bf16
compensation; the AdamW states fp32, bf16 or 8-bit block-wise. Each step reads the gradient
(fp32, bf16 or fp16: the staging buffer the GPU's gradient landed in), the master and the
states once, computes in fp32 and writes them back once. The native code is the
``ramflow_lean_adamw_step`` entry point of ``_cpu_kernels.cpp``, built and cached as the fp32
kernel is (see ``_cpu_kernels``); where it is not available (no compiler, not x86-64,
``RAMFLOW_DISABLE_CPU_KERNELS=1``) a PyTorch path gives the same bits, slower. It runs
the best of three loops the CPU has, all with the same bits (``lean_isa``): AVX-512 (F, BW,
DQ, VL and VBMI: Ice Lake and later Xeons, Zen 4), AVX2 with FMA and F16C, or scalar code;
``RAMFLOW_LEAN_ISA=avx2`` or ``scalar`` caps it (tests and benchmarks compare them).

[Note: lean formats, one pass]
Per element, in fp32 and in this order (both implementations; no fused multiply-adds)::

    g = grad * grad_scale                       (the multiply only when grad_scale != 1)
    p = master                                  (+ compensation with a Kahan master)
    p = p * decay                               (decay = float32(1 - lr * wd); only wd != 0)
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * (1 - beta2)) * g
    p = p + (m * -step_size) / (sqrt(v) / sqrt(bias_correction2) + eps)

then the master is written: fp32 as is (and the wire copy rounded to nearest even); bf16
stochastically rounded (see [Note: counter-based stochastic rounding]); or, Kahan, ``hi =
bf16(p)`` (nearest even) and ``compensation = bf16(p - hi)``: master + compensation carry
about 16 significant bits, so updates far below the bf16 spacing of a weight still add up
(the compensated summation of optimi and Collage, Yu et al. 2024). The scalar constants are
float32 values computed once per call in ``_coefficients`` (the same as PyTorch's AdamW:
bias corrections in double, each cast once). This is not bit-identical to
``torch.optim.AdamW`` (its lerp and fused multiply-adds differ in the last bit); the fp32
format that must be stays on ``_cpu_kernels.fused_adamw_step_``.

8-bit states (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"): each
block of 256 elements keeps one fp32 absmax and 256 one-byte indices into a 256-entry code
of the "dynamic" (dynamic exponent) type, signed for ``exp_avg``, unsigned for
``exp_avg_sq``. A step dequantizes a block (``code[q] * absmax``), updates it, takes the new
absmax, and stores each element as the code nearest to ``x / absmax``. Blocks start at
multiples of 256 of the buffer given, and the threads take whole blocks.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import platform
import threading
import warnings

import torch

from . import _cpu_kernels, _lean_triton
from ._cpu_kernels import _check_no_overlap, _check_tensor, _check_threads

__all__ = [
    "QBLOCK",
    "dequantize_blockwise",
    "dynamic_code",
    "lean_adamw_step_",
    "lean_kernel_available",
    "quantize_blockwise",
    "rounding_key",
    "stochastic_round_bf16",
]

QBLOCK = 256  # elements per 8-bit block, one fp32 absmax each

_MASTER_F32, _MASTER_SR, _MASTER_KAHAN = 0, 1, 2
_STATE_F32, _STATE_BF16, _STATE_Q8 = 0, 1, 2
_STATE_FORMAT = {torch.float32: _STATE_F32, torch.bfloat16: _STATE_BF16, torch.uint8: _STATE_Q8}
_MASK32 = 0xFFFFFFFF


# [Note: counter-based stochastic rounding]
# Stochastic rounding writes x as the bf16 just above it with probability (x - lo) / (hi -
# lo), else the one below, so the rounding error has mean zero and updates smaller than
# the bf16 spacing of a weight still move it on average (Zamirai et al. 2020; Ozkara et al.
# 2025). In bits: add 16 random bits to the fp32 pattern's low half and truncate. The random
# bits are a hash of (key, element index), the key a hash of (seed, step): no generator
# state, so any thread can round any element, the result does not depend on how the work
# is split across threads or pieces (``counter_offset`` places a piece in its unit), and a
# run is reproducible from its seed. A stateful generator (torch.Generator, one per
# thread) would give other bits at another thread count. The hash is "lowbias32" (C.
# Wellons), a bijection on 32 bits: the indices of a unit get distinct words, and the top
# 16 bits are close to uniform. The PyTorch path computes it in int64 without overflow.


def _hash32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of the stochastic rounding of step ``step`` with seed ``seed`` (any
    ints >= 0; ``seed`` up to 64 bits): a unit should get its own seed, e.g. the run's seed
    hashed with the unit's index. See [Note: counter-based stochastic rounding]."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    return _hash32_int(_hash32_int(_hash32_int(lo) ^ hi) + (step & _MASK32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _sr_bits(
    key: int, counter_offset: int, n: int, device: torch.device | None = None
) -> torch.Tensor:
    """The 32 random bits (n,) int64 of elements counter_offset .. counter_offset + n - 1."""
    index = torch.arange(counter_offset, counter_offset + n, dtype=torch.int64, device=device)
    return _hash32((_hash32((index & _MASK32) ^ key) + (index >> 32)) & _MASK32)


def _round_bf16_torch(x: torch.Tensor, key: int, counter_offset: int) -> torch.Tensor:
    u = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    b = ((u + (_sr_bits(key, counter_offset, x.numel(), x.device) >> 16)) >> 16) & 0xFFFF
    b = torch.where(torch.isnan(x), 0x7FC0, b)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def stochastic_round_bf16(
    x: torch.Tensor,
    *,
    seed: int,
    step: int,
    counter_offset: int = 0,
    num_threads: int | None = None,
) -> torch.Tensor:
    """``x`` rounded to bf16 stochastically, with the bits the lean step uses.

    Args:
        x: fp32, on the CPU, any shape (flattened in memory order).
        seed, step: the key of the rounding (see ``rounding_key``).
        counter_offset: the element index of ``x``'s first element in the counter; a piece
            of a unit passes its offset and rounds exactly as the whole unit would.
        num_threads: threads of the native code (None: ``torch.get_num_threads()``); the
            result does not depend on it.

    Returns: a new bf16 tensor of ``x``'s shape. NaN becomes 0x7FC0; values that round up
    past the largest bf16 become infinity.
    """
    _check_threads(num_threads)
    _check_tensor("x", x, (torch.float32,), x.numel() if isinstance(x, torch.Tensor) else 0)
    key = rounding_key(seed, step)
    lib = _LEAN.get()
    if lib is None:
        return _round_bf16_torch(x, key, counter_offset).view(x.shape)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    rc = lib.ramflow_bf16_stochastic_round(
        x.data_ptr(), out.data_ptr(), x.numel(), counter_offset, key, num_threads or 0
    )
    assert rc == 0, rc
    return out


def dynamic_code(*, signed: bool) -> torch.Tensor:
    """The 256 values (ascending, fp32) of the 8-bit "dynamic" type of Dettmers et al. 2022.

    Seven decades 10**-6 .. 10**0 below 1: decade d (0 for the smallest) holds 2**d values
    (signed: and their negatives) or 2**(d + 1) values (unsigned), the midpoints of a
    linear grid from 0.1 to 1 times the decade's scale; plus 1, and 0 (signed) or half the
    smallest value (unsigned). Dense near zero, so the small states of a block whose absmax
    is large keep their magnitude.

    The unsigned code, the second moment's, has no zero (the "zero-point problem" of Li et
    al. 2023, "Memory Efficient Optimizers with 4-bit States"): an element whose second
    moment is below 1.2e-7 of its block's absmax would read back as 0 while its first
    moment, on its own code, does not, and AdamW's update m / (sqrt(v) + eps) would become
    m / eps, steps of thousands. Its lowest value, 1.625e-7, bounds the update instead. An
    all-zero block still reads back as zeros (its absmax is 0).
    """
    smallest = 10.0**-6 * (0.1 + 0.9 / 4)  # the lowest mean: (0.1 + (0.1 + 0.9 / 2)) / 2
    values = [0.0 if signed else smallest / 2, 1.0]
    for d in range(7):
        count = 2**d if signed else 2 ** (d + 1)
        scale = 10.0 ** (d - 6)
        edges = [0.1 + 0.9 * k / count for k in range(count + 1)]
        means = [scale * (lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
        values += means + ([-v for v in means] if signed else [])
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


class _Code:
    """The codes, their 255 fp32 midpoints and the native quantizer's tables, made once."""

    def __init__(self) -> None:
        self.signed = dynamic_code(signed=True)
        self.unsigned = dynamic_code(signed=False)
        self.signed_mid = (self.signed[:-1] + self.signed[1:]) / 2
        self.unsigned_mid = (self.unsigned[:-1] + self.unsigned[1:]) / 2
        self.signed_table = _code_table(self.signed_mid)
        self.unsigned_table = _code_table(self.unsigned_mid)
        self._on: dict[object, tuple[torch.Tensor, ...]] = {}  # by device (, what)

    def tables_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(signed, unsigned, signed_table, unsigned_table) on ``device`` (copied once),
        for the Triton step."""
        if ("tables", device) not in self._on:
            self._on[("tables", device)] = tuple(
                t.to(device)
                for t in (self.signed, self.unsigned, self.signed_table, self.unsigned_table)
            )
        return self._on[("tables", device)]

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(signed, unsigned, signed_mid, unsigned_mid) on ``device`` (copied once)."""
        if device.type == "cpu":
            return self.signed, self.unsigned, self.signed_mid, self.unsigned_mid
        if device not in self._on:
            self._on[device] = tuple(
                t.to(device)
                for t in (self.signed, self.unsigned, self.signed_mid, self.unsigned_mid)
            )
        return self._on[device]


def _as_float32(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values of 32-bit patterns given as int64 in [0, 2**32)."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _order_key(bits: torch.Tensor) -> torch.Tensor:
    """The lower 16 bits of fp32 patterns (int64 in [0, 2**32)), inverted for negative
    floats: among the floats of one upper half, larger keys are larger floats."""
    return (bits ^ torch.where(bits >= 1 << 31, 0xFFFF, 0)) & 0xFFFF


def _code_table(mid: torch.Tensor) -> torch.Tensor:
    """(65536,) int32, the native quantizer's table (see [Note: 8-bit codes in one lookup]
    in ``_cpu_kernels.cpp``): for each upper half of an fp32 bit pattern (a bucket), bits
    0-7 hold the number of midpoints below the bucket's smallest float, bits 16-31 the
    order key (``_order_key``) of the one midpoint inside the bucket, or 0xFFFF where there
    is none. The quantizer gives ``start + (key(x) > that key)``, which is
    ``torch.bucketize(x, mid)`` for every fp32 x (``_quantize_with_table`` models it)."""
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    negative = upper >= 1 << 31
    smallest = _as_float32(torch.where(negative, upper | 0xFFFF, upper))  # of each bucket
    largest = _as_float32(torch.where(negative, upper, upper | 0xFFFF))
    start = torch.where(torch.isnan(smallest), 0, torch.bucketize(smallest, mid, right=False))
    end = torch.where(torch.isnan(largest), start, torch.bucketize(largest, mid, right=False))
    # Two midpoints in one bucket would need a second compare; the dynamic codes' nearest
    # midpoints differ by far more than a bucket's width (2**-7 relative).
    assert int((end - start).max()) <= 1, "two midpoints share an upper half"
    mid_bits = mid.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    inside = _order_key(mid_bits)[start.clamp(max=mid.numel() - 1)]
    threshold = torch.where(end > start, inside, 0xFFFF)
    entry = start | (threshold << 16)
    return torch.where(entry >= 1 << 31, entry - (1 << 32), entry).to(torch.int32).contiguous()


def lean_isa() -> str | None:
    """The instruction set of the native lean step here: "avx512", "avx2" or "scalar"
    (capped by ``RAMFLOW_LEAN_ISA``, read at each call), or None without the native code."""
    lib = _LEAN.get()
    if lib is None:
        return None
    return {3: "avx512", 2: "avx2"}.get(lib.ramflow_lean_isa(), "scalar")


def _quantize_with_table(table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The native quantizer's codes (int64) of fp32 ``y``, computed as it does: a model for
    the tests, which compare it with ``torch.bucketize`` on every bucket."""
    bits = y.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    entry = table.to(torch.int64)[bits >> 16] & 0xFFFFFFFF
    return (entry & 0xFF) + (_order_key(bits) > (entry >> 16)).to(torch.int64)


@functools.cache
def _code() -> _Code:
    """The codes and tables, made at first use: never at import, where torch's parallel ops
    would start the OpenMP thread pool in a process that may then fork (a forkserver
    preloading ramflow), and the forked children would hang at their first parallel op."""
    return _Code()


def quantize_blockwise(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (n,) fp32 as 8-bit codes (n,) uint8 and one fp32 absmax per block of 256
    (ceil(n / 256),): each element is the code nearest to ``x / absmax`` of its block.
    ``signed``: the signed code (for ``exp_avg``) or the unsigned one (``exp_avg_sq``,
    never negative)."""
    n = x.numel()
    mid = _code().on(x.device)[2 if signed else 3]
    pad = -n % QBLOCK
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, pad)).view(-1, QBLOCK)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, 1.0)
    q = torch.bucketize(blocks / scale[:, None], mid, right=False)
    return q.view(-1)[:n].to(torch.uint8), absmax


def _quantize_blockwise_native(
    x: torch.Tensor, *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_blockwise`` by the native code a lean step stores its 8-bit states with
    (that of ``lean_isa()``), or None where it is not available. For the
    tests, which compare the two bit for bit."""
    lib = _LEAN.get()
    if lib is None:
        return None
    x = x.reshape(-1).contiguous()
    n = x.numel()
    q = torch.empty(n, dtype=torch.uint8)
    absmax = torch.empty(-(-n // QBLOCK), dtype=torch.float32)
    codes = _code()
    table = codes.signed_table if signed else codes.unsigned_table
    rc = lib.ramflow_quantize_blocks(
        x.data_ptr(), n, table.data_ptr(), q.data_ptr(), absmax.data_ptr()
    )
    assert rc == 0, rc
    return q, absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """The fp32 values (n,) of codes ``q`` (n,) uint8 with per-block ``absmax``."""
    code = _code().on(q.device)[0 if signed else 1]
    n = q.numel()
    scale = absmax.repeat_interleave(QBLOCK)[:n]
    return code[q.long()] * scale


class _LeanArgs(ctypes.Structure):
    """The C ``LeanArgs`` struct of ``_cpu_kernels.cpp``, field for field."""

    _fields_ = [
        ("master", ctypes.c_void_p),
        ("compensation", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("exp_avg_absmax", ctypes.c_void_p),
        ("exp_avg_sq_absmax", ctypes.c_void_p),
        ("signed_code", ctypes.c_void_p),
        ("unsigned_code", ctypes.c_void_p),
        ("signed_table", ctypes.c_void_p),
        ("unsigned_table", ctypes.c_void_p),
        ("wire_out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("counter_offset", ctypes.c_int64),
        ("key", ctypes.c_uint32),
        ("decay", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
        ("grad_scale", ctypes.c_float),
        ("apply_decay", ctypes.c_int32),
        ("apply_scale", ctypes.c_int32),
        ("master_format", ctypes.c_int32),
        ("state_format", ctypes.c_int32),
        ("grad_dtype", ctypes.c_int32),
        ("wire_dtype", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


class _LeanLibrary:
    """The library with the lean entry points (the fp32 kernel's build), or None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.lib = None

    def get(self):
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self.lib = self._load()
                    self._loaded = True
        return self.lib

    @staticmethod
    def _load():
        if os.environ.get(_cpu_kernels._ENV_DISABLE, "") not in ("", "0"):
            return None
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        try:
            lib = ctypes.CDLL(_cpu_kernels._build())
        except Exception as err:  # any build failure means: use PyTorch, do not crash
            warnings.warn(
                f"ramflow: the native lean CPU AdamW kernels could not be built ({err}); "
                "stepping with PyTorch instead (same results, slower).",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        lib.ramflow_lean_adamw_step.argtypes = [ctypes.POINTER(_LeanArgs)]
        lib.ramflow_lean_adamw_step.restype = ctypes.c_int
        lib.ramflow_bf16_stochastic_round.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_uint32,
            ctypes.c_int32,
        ]
        lib.ramflow_bf16_stochastic_round.restype = ctypes.c_int
        lib.ramflow_quantize_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [
            ctypes.c_void_p
        ] * 3
        lib.ramflow_quantize_blocks.restype = ctypes.c_int
        lib.ramflow_lean_isa.argtypes = []
        lib.ramflow_lean_isa.restype = ctypes.c_int
        return lib


_LEAN = _LeanLibrary()


def lean_kernel_available() -> bool:
    """Whether the lean steps run native code (building it if needed); False: PyTorch."""
    return _LEAN.get() is not None


def _f32(x: float) -> float:
    """x rounded to float32, as a Python float (exact in double)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _coefficients(
    *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> dict[str, float]:
    """The per-call float32 constants, computed as PyTorch's AdamW computes them."""
    step_f = float(_f32(float(step)))
    bc1 = 1 - math.pow(beta1, step_f)
    bc2 = 1 - math.pow(beta2, step_f)
    return dict(
        decay=_f32(1 - lr * weight_decay),
        beta1=_f32(beta1),
        one_minus_beta1=_f32(1 - beta1),
        beta2=_f32(beta2),
        one_minus_beta2=_f32(1 - beta2),
        bc2_sqrt=_f32(math.sqrt(bc2)),
        eps=_f32(eps),
        neg_step_size=-_f32(lr / bc1),
    )


def _load_state(s: torch.Tensor, absmax: torch.Tensor | None, *, signed: bool) -> torch.Tensor:
    if s.dtype == torch.uint8:
        return dequantize_blockwise(s, absmax, signed=signed)
    return s.to(torch.float32)


def _store_state(s: torch.Tensor, absmax: torch.Tensor | None, x: torch.Tensor, *, signed: bool):
    if s.dtype == torch.uint8:
        q, amax = quantize_blockwise(x, signed=signed)
        s.copy_(q)
        absmax.copy_(amax)
    else:
        s.copy_(x)


@torch.no_grad()
def _step_torch(
    master, grad, exp_avg, exp_avg_sq, compensation, m_absmax, v_absmax, wire_out,
    *, key, counter_offset, grad_scale, apply_decay, c,
) -> None:  # fmt: skip
    g = grad.view(-1).to(torch.float32)
    if grad_scale != 1.0:
        g = g * _f32(grad_scale)
    p = master.view(-1).to(torch.float32)
    if compensation is not None:
        p = p + compensation.view(-1).to(torch.float32)
    if apply_decay:
        p = p * c["decay"]
    m = _load_state(exp_avg.view(-1), m_absmax, signed=True)
    v = _load_state(exp_avg_sq.view(-1), v_absmax, signed=False)
    m = m * c["beta1"] + g * c["one_minus_beta1"]
    v = v * c["beta2"] + (g * c["one_minus_beta2"]) * g
    # torch's fp32 sqrt is not correctly rounded on every CPU (AVX2 builds differ from
    # IEEE in about 1 of 6 elements); the fp64 square root rounded to fp32 is, as C++'s is.
    # PyTorch's CUDA division by a Python scalar multiplies by its reciprocal (one more
    # rounding); a 0-dim tensor on the device is divided by, correctly rounded
    bc2_sqrt = c["bc2_sqrt"] if v.device.type == "cpu" else v.new_tensor(c["bc2_sqrt"])
    denom = v.double().sqrt().float() / bc2_sqrt + c["eps"]
    p = p + (m * c["neg_step_size"]) / denom
    _store_state(exp_avg.view(-1), m_absmax, m, signed=True)
    _store_state(exp_avg_sq.view(-1), v_absmax, v, signed=False)
    if master.dtype == torch.float32:
        master.view(-1).copy_(p)
        if wire_out is not None:
            wire_out.view(-1).copy_(p)
    elif compensation is None:
        master.view(-1).copy_(_round_bf16_torch(p, key, counter_offset))
    else:
        hi = p.to(torch.bfloat16)
        master.view(-1).copy_(hi)
        compensation.view(-1).copy_(p - hi.to(torch.float32))


def _master_format(master: torch.Tensor, compensation: torch.Tensor | None) -> int:
    if master.dtype == torch.float32:
        return _MASTER_F32
    return _MASTER_SR if compensation is None else _MASTER_KAHAN


def _step_triton(
    master, grad, exp_avg, exp_avg_sq, compensation, m_absmax, v_absmax, wire_out,
    *, key, counter_offset, grad_scale, apply_decay, c,
) -> None:  # fmt: skip
    """``_step_torch``'s step as one Triton kernel (CUDA tensors; the same bits)."""
    _lean_triton.lean_adamw_step(
        master, grad, exp_avg, exp_avg_sq, compensation, m_absmax, v_absmax, wire_out,
        _code().tables_on(master.device), master_format=_master_format(master, compensation),
        state_format=_STATE_FORMAT[exp_avg.dtype], key=key, counter_offset=counter_offset,
        grad_scale=_f32(grad_scale), apply_decay=apply_decay, c=c, block=QBLOCK,
    )  # fmt: skip


def lean_adamw_step_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    compensation: torch.Tensor | None = None,
    exp_avg_absmax: torch.Tensor | None = None,
    exp_avg_sq_absmax: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
    seed: int = 0,
    counter_offset: int = 0,
    num_threads: int | None = None,
) -> None:
    """One AdamW step (Loshchilov & Hutter, 2019) in place over lean host formats.

    See [Note: lean formats, one pass] for the arithmetic. The formats follow the dtypes:

    * ``master`` fp32: stepped in fp32 (``wire_out``, bf16 or fp16, gets the new value
      rounded to nearest even). bf16 without ``compensation``: the new value is written
      with stochastic rounding keyed by (``seed``, ``step``) and the element's counter
      ``counter_offset + i`` (see [Note: counter-based stochastic rounding]). bf16 with
      ``compensation`` (bf16): Kahan-compensated, no randomness.
    * ``exp_avg``/``exp_avg_sq`` fp32 or bf16 (stored rounded to nearest even), or uint8
      codes of 8-bit block-wise states with ``exp_avg_absmax``/``exp_avg_sq_absmax`` fp32
      (ceil(n / 256),), one per block of 256 elements (see ``quantize_blockwise``). Both
      states have one format.

    Args:
        master: (n,) master weights, any shape, updated in place.
        grad: the gradient, fp32, bf16 or fp16; only read.
        exp_avg, exp_avg_sq: the AdamW states, updated in place.
        step: the step number, already incremented (1 on the first step), an int >= 1.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled decay).
        grad_scale: multiplies the gradient first (e.g. a clipping coefficient); 1.0: none.
        compensation, exp_avg_absmax, exp_avg_sq_absmax, wire_out: as above.
        seed: the stochastic rounding's seed, an int in [0, 2**64); one per unit.
        counter_offset: the index of ``master[0]`` in its unit (a piece of a unit rounds as
            the whole unit would); with 8-bit states a multiple of 256.
        num_threads: threads of the native code; None is ``torch.get_num_threads()``. The
            result does not depend on it.

    All tensors on the CPU (the native kernel, which releases the GIL), or all on one CUDA
    device (one fused Triton kernel, ``_lean_triton``, or without Triton the same
    arithmetic in PyTorch ops; either gives the CPU's bits, see [Note: the same bits on the
    GPU]: ``ramflow.offload(device_optimizer=True)`` steps units there), contiguous, not
    overlapping.

    Raises:
        TypeError: a tensor has a dtype not listed above.
        ValueError: sizes differ; the states' formats differ; 8-bit states without their
            absmax buffers (or with wrong sizes); ``compensation`` or ``wire_out`` with a
            master they do not go with; ``step`` < 1; ``counter_offset`` < 0 or, with 8-bit
            states, not a multiple of 256.
    """
    _check_threads(num_threads)
    if not isinstance(master, torch.Tensor):
        raise TypeError(f"master must be a torch.Tensor, got {type(master).__name__}")
    n = master.numel()
    dev = master.device if master.device.type == "cuda" else None
    _check_tensor("master", master, (torch.float32, torch.bfloat16), n, dev)
    _check_tensor("grad", grad, (torch.float32, torch.bfloat16, torch.float16), n, dev)
    states = tuple(_STATE_FORMAT)
    _check_tensor("exp_avg", exp_avg, states, n, dev)
    _check_tensor("exp_avg_sq", exp_avg_sq, states, n, dev)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(
            f"exp_avg is {exp_avg.dtype} and exp_avg_sq {exp_avg_sq.dtype}; give both states "
            "one format (float32, bfloat16, or uint8 8-bit codes)"
        )
    written = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    quantized = exp_avg.dtype == torch.uint8
    num_blocks = -(-n // QBLOCK)
    if quantized:
        if exp_avg_absmax is None or exp_avg_sq_absmax is None:
            raise ValueError(
                "8-bit states need exp_avg_absmax and exp_avg_sq_absmax, fp32 "
                f"({num_blocks},): one per block of {QBLOCK}"
            )
        _check_tensor("exp_avg_absmax", exp_avg_absmax, (torch.float32,), num_blocks, dev)
        _check_tensor("exp_avg_sq_absmax", exp_avg_sq_absmax, (torch.float32,), num_blocks, dev)
        written += [("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)]
        if counter_offset % QBLOCK:
            raise ValueError(
                f"with 8-bit states a piece must start on a block: counter_offset must be a "
                f"multiple of {QBLOCK}, got {counter_offset}"
            )
    elif exp_avg_absmax is not None or exp_avg_sq_absmax is not None:
        raise ValueError("absmax buffers go with 8-bit (uint8) states only")
    if compensation is not None:
        if master.dtype != torch.bfloat16:
            raise ValueError("compensation goes with a bf16 master; an fp32 master needs none")
        _check_tensor("compensation", compensation, (torch.bfloat16,), n, dev)
        written.append(("compensation", compensation))
    if wire_out is not None:
        if master.dtype != torch.float32:
            raise ValueError(
                "wire_out goes with an fp32 master; a bf16 master is its own wire copy"
            )
        _check_tensor("wire_out", wire_out, (torch.bfloat16, torch.float16), n, dev)
        written.append(("wire_out", wire_out))
    _check_no_overlap(written + [("grad", grad)])
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step count after incrementing), got {step}")
    if counter_offset < 0:
        raise ValueError(f"counter_offset must be >= 0, got {counter_offset}")
    if n == 0:
        return
    c = _coefficients(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay
    )
    key = rounding_key(seed, step)
    apply_decay = weight_decay != 0.0
    lib = _LEAN.get() if master.device.type == "cpu" else None
    if lib is None:
        step = _step_triton if _lean_triton.available(master.device) else _step_torch
        step(
            master, grad, exp_avg, exp_avg_sq, compensation, exp_avg_absmax,
            exp_avg_sq_absmax, wire_out, key=key, counter_offset=counter_offset,
            grad_scale=grad_scale, apply_decay=apply_decay, c=c,
        )  # fmt: skip
        return
    ptr = _cpu_kernels._ptr
    master_format = _master_format(master, compensation)
    codes = _code()
    args = _LeanArgs(
        master=master.data_ptr(),
        compensation=ptr(compensation),
        grad=grad.data_ptr(),
        exp_avg=exp_avg.data_ptr(),
        exp_avg_sq=exp_avg_sq.data_ptr(),
        exp_avg_absmax=ptr(exp_avg_absmax),
        exp_avg_sq_absmax=ptr(exp_avg_sq_absmax),
        signed_code=codes.signed.data_ptr(),
        unsigned_code=codes.unsigned.data_ptr(),
        signed_table=codes.signed_table.data_ptr(),
        unsigned_table=codes.unsigned_table.data_ptr(),
        wire_out=ptr(wire_out),
        n=n,
        counter_offset=counter_offset,
        key=key,
        grad_scale=_f32(grad_scale),
        apply_decay=int(apply_decay),
        apply_scale=int(grad_scale != 1.0),
        master_format=master_format,
        state_format=_STATE_FORMAT[exp_avg.dtype],
        grad_dtype=_cpu_kernels._DTYPE_CODE[grad.dtype],
        wire_dtype=0 if wire_out is None else _cpu_kernels._DTYPE_CODE[wire_out.dtype],
        num_threads=num_threads or 0,
        **c,
    )
    rc = lib.ramflow_lean_adamw_step(ctypes.byref(args))
    assert rc == 0, rc


def warm_up_device_step(
    device: torch.device, *, master_dtype: torch.dtype, state_dtype: torch.dtype, compensated: bool
) -> bool:
    """Compile the device step's Triton kernel (``_lean_triton``) for one host format on
    ``device`` before the first step: a step of one block of zeros for each variant a step
    can launch, on the current stream. Triton compiles one per weight decay on and off, a
    gradient scale of 1 and another (clipping), a rounding key that fits int32 and one that
    does not (Triton types an int argument by its value), and, with 8-bit states, absmax
    buffers on and off a 16-byte boundary (a param group's run starts at any block). Triton
    keeps the binaries in its per-machine cache, so a later process loads them. Returns
    whether it ran (False where the kernel is not used, see ``_lean_triton.available``).
    See [Note: building before the first step] in ``ramflow._cpu_kernels``."""
    if not _lean_triton.available(device):
        return False

    def zeros(dtype: torch.dtype, n: int = QBLOCK) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    seeds: dict[bool, int] = {}  # key >= 2**31 -> a seed whose step-1 key is so
    for seed in range(64):
        seeds.setdefault(rounding_key(seed, 1) >= 2**31, seed)
    quantized = state_dtype == torch.uint8
    for weight_decay, grad_scale, seed, shift in itertools.product(
        (0.0, 0.1), (1.0, 0.5), seeds.values(), (0, 1) if quantized else (0,)
    ):
        absmax = [zeros(torch.float32, 2)[shift : shift + 1] for _ in range(2)]
        lean_adamw_step_(
            zeros(master_dtype), zeros(torch.bfloat16), zeros(state_dtype), zeros(state_dtype),
            step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
            grad_scale=grad_scale, compensation=zeros(torch.bfloat16) if compensated else None,
            exp_avg_absmax=absmax[0] if quantized else None,
            exp_avg_sq_absmax=absmax[1] if quantized else None, seed=seed,
        )  # fmt: skip
    return True
