"""One-pass CPU AdamW steps for the lean host formats (see ``formats.host.HostPrecision``).

The master weights are fp32, or bf16 written with stochastic rounding, or bf16 plus a bf16
compensation; the AdamW states fp32, bf16 or 8-bit block-wise. Each step reads the gradient
(fp32, bf16 or fp16: the staging buffer the GPU's gradient landed in), the master and the
states once, computes in fp32 and writes them back once. The native code is the
``ramflow_lean_adamw_step`` entry point of ``lean_kernels_avx512.cpp`` (the loops are in it,
``lean_kernels.cpp`` and ``lean_kernels_avx2.cpp``), built with ``cpu_kernels.cpp`` and
cached as the fp32 kernel is (see ``kernels.cpu_kernels``); where it is not available (no compiler,
not x86-64, ``RAMFLOW_DISABLE_CPU_KERNELS=1``) a PyTorch path gives the same bits, slower. It runs
the best of three loops the CPU has, all with the same bits (``lean_isa``): AVX-512 (F, BW,
DQ and VL: Skylake-SP and later Xeons, Zen 4), AVX2 with FMA and F16C, or scalar code;
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
stochastically rounded (see kernels/random_bits.py, [Note: counter-based stochastic rounding]); or, Kahan, ``hi =
bf16(p)`` (nearest even) and ``compensation = bf16(p - hi)``: master + compensation carry
about 16 significant bits, so updates far below the bf16 spacing of a weight still add up
(the compensated summation of optimi and Collage, Yu et al. 2024). The scalar constants are
float32 values computed once per call in ``_coefficients`` (the same as PyTorch's AdamW:
bias corrections in double, each cast once). This is not bit-identical to
``torch.optim.AdamW`` (its lerp and fused multiply-adds differ in the last bit); the fp32
format that must be stays on ``kernels.cpu_kernels.fused_adamw_step_``.

8-bit states: each block of 256 elements keeps one fp32 scale, a power of two, and 256
one-byte FP8 E4M3 codes: of ``exp_avg / scale`` for the first moment, of ``sqrt(exp_avg_sq)
/ scale`` for the second. A step decodes a block, updates it, takes the new block's scale
and encodes each element with stochastic rounding, in integer bit operations (no table, no
search). Blocks start at multiples of 256 of the buffer given, and the threads take whole
blocks. See [Note: 8-bit states in FP8 with power-of-two block scales] and [Note:
stochastic rounding of the 8-bit states].
"""

from __future__ import annotations

import ctypes
import itertools
import math
import warnings

import torch

from . import cpu_kernels as _cpu_kernels
from . import lean_triton as _lean_triton
from .cpu_kernels import check_no_overlap, check_tensor, check_threads
from .library import KernelLibrary
from .random_bits import (
    MASK32,
    bf16_stochastic,
    round_bf16_torch,
    rounding_key,
    state_bits,
)

__all__ = [
    "QBLOCK",
    "dequantize_blockwise",
    "lean_adamw_step_",
    "lean_kernel_available",
    "quantize_blockwise",
    "round_to_bf16_native",
    "rounding_key",
    "stochastic_round_bf16",
]

QBLOCK = 256  # elements per 8-bit block, one fp32 scale each

_MASTER_F32, _MASTER_SR, _MASTER_KAHAN = 0, 1, 2
_STATE_F32, _STATE_BF16, _STATE_Q8 = 0, 1, 2
_STATE_FORMAT = {torch.float32: _STATE_F32, torch.bfloat16: _STATE_BF16, torch.uint8: _STATE_Q8}


def round_to_bf16_native(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Write ``x`` rounded to nearest even into ``out`` (the bits of ``out.copy_(x)``) with
    the native loop, on the calling thread only (no OpenMP team: threads that each round
    their own piece scale, where a PyTorch ``copy_`` on each would start a team per
    thread). The GIL is released while it runs.

    Args:
        x: fp32, contiguous, on the CPU.
        out: bf16, contiguous, on the CPU, ``x.numel()`` elements.

    Returns: True, or False (nothing written) where the native library is not available
    (``lean_kernel_available``; the caller rounds with PyTorch).
    """
    assert x.dtype == torch.float32 and out.dtype == torch.bfloat16, (x.dtype, out.dtype)
    assert x.is_contiguous() and out.is_contiguous() and x.numel() == out.numel()
    assert x.device.type == "cpu" and out.device.type == "cpu"
    lib = _LEAN.get()
    if lib is None:
        return False
    rc = lib.ramflow_round_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    assert rc == 0, rc
    return True


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
    check_threads(num_threads)
    check_tensor("x", x, (torch.float32,), x.numel() if isinstance(x, torch.Tensor) else 0)
    key = rounding_key(seed, step)
    lib = _LEAN.get()
    if lib is None:
        return round_bf16_torch(x, key, counter_offset).view(x.shape)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    rc = lib.ramflow_bf16_stochastic_round(
        x.data_ptr(), out.data_ptr(), x.numel(), counter_offset, key, num_threads or 0
    )
    assert rc == 0, rc
    return out


# [Note: 8-bit states in FP8 with power-of-two block scales]
# AdamW's moments are kept in 8 bits as OCP FP8 E4M3 ("e4m3fn": 4 exponent bits, 3 mantissa
# bits, largest 448, subnormals down to 2**-9) with one fp32 scale per block of 256, as FP8
# training keeps them (Fishman et al., ICLR 2025, "Scaling FP8 training to trillion-token
# LLMs": E4M3 first moment; COAT, Xi et al., ICLR 2025, per-group scaled E4M3 states).
# * The first moment m is coded as m / scale, signed.
# * The second moment v is coded as sqrt(v) / scale. The square root is what the step needs
#   for its denominator anyway (so it costs nothing), it halves v's dynamic range, and the
#   E4M3 of sqrt(v) has the relative precision in sqrt(v) of an E5M2 v (Fishman et al.'s
#   second moment) with a wider range (2**18 in sqrt(v) within a block). Its sign bit is
#   unused (0). A code of 0 for a positive sqrt(v) is stored as 1, the smallest subnormal: with
#   a zero an element whose v fell below 2**-36 of its block's largest would read back v = 0
#   while m kept a code, and AdamW would step it by m / eps (the "zero-point problem" of Li
#   et al. 2023); the smallest code bounds that step instead.
# * The scale is a power of two, 2**e with e the least integer such that the block's absmax
#   / 2**e <= 448 (computed from the absmax's bits; at least 2**-126). Scaling by a power of
#   two is exact, so coding is one multiply and one rounding, and reading is one multiply.
#   The OCP microscaling formats (MX, 2023) share power-of-two scales the same way.
# * Both conversions are integer bit operations that round to nearest even exactly as
#   c10::Float8_e4m3fn does (see [Note: FP8 conversions in bits] in lean_kernels.cpp), so
#   the PyTorch path is ``(x * 2**-e).to(torch.float8_e4m3fn)`` and gives the native bits
#   (infinities and NaN are coded 0x7F, NaN, in both).
# The table-defined "dynamic" code of Dettmers et al. 2022 this replaces needed a lookup
# per element to quantize and ran the CPU step at about 0.5 of the host copy rate; old
# checkpoints are converted when loaded (``formats.legacy_states``).

# [Note: stochastic rounding of the 8-bit states]
# A step writes each new code with stochastic rounding (Gupta et al. 2015, "Deep learning
# with limited numerical precision"), not to nearest. With 3 mantissa bits, nearest even
# moves a stored value only when the new one is half a spacing (1/32 to 1/16 of it) away,
# and an EMA moves by (1 - beta) of its distance to the new term a step: at beta2 = 0.95
# sqrt(v) falls by at most 2.5% a step, so a stored v could never decrease, and small
# rises rounded back too ("state staleness", Topollai & Choromanska 2026, arXiv
# 2603.16731; docs/design-host.md has a simulation's figures, and
# tests/test_lean_state_rounding.py runs it).
# * y = x / scale (the scale from the unrounded block, as ``quantize_blockwise``'s), Ey =
#   max(exponent(|y|), -6) from its bits (2**(Ey - 3) is E4M3's spacing at y, 2**-9 for
#   the subnormals), t = |y| * 2**(3 - Ey) (exact), k = floor(t + u), the stored value
#   sign(y) * k * 2**(Ey - 3): a point of the grid (k = 16 is the next binade's 8), at most
#   448 since |y| <= 448 and 448 is one, which the nearest-even encoder codes exactly. It is
#   floor(t) + 1 with probability frac(t), to the 2**-16 that u resolves, so the stored
#   value is y in the mean. t + u is one fp32 addition (exact where t < 16, and never
#   carried past an integer above), so every implementation gets the same k.
# * The second moment codes sqrt(v): sqrt(v) is unbiased and v = code**2 is high by the
#   code's variance, at most a quarter spacing squared (2**-8 of v in the normal range). A
#   positive value is never code 0 (k = 0 becomes 1, as nearest even's code 0 became 1).
#   NaN and infinity keep their code 0x7F.
# * u: 16 random bits per state and element, from the master's rounding bits h (``stochastic_rounding_bits``,
#   same key and index: see [Note: counter-based stochastic rounding]) by one multiply: w =
#   (h ^ h >> 16) * C mod 2**32 with C = 0x9E3779B9 (2**32 over the golden ratio), the
#   first moment's u = (w >> 16) / 2**16, the second's (w & 0xFFFF) / 2**16; the result
#   does not depend on threads or pieces. Over keys h is uniform (hash32 is a bijection),
#   and so is h ^ h >> 16 = a * 2**16 + b, with a = h >> 16 the master's 16 bits and b
#   independent of a. With C = c1 * 2**16 + c0:
#   - the second moment's u is b * c0 mod 2**16, a bijection of b (c0 is odd): uniform, and
#     independent of the master's a, exactly;
#   - the first moment's is (a * c0 + g(b)) mod 2**16 with g(b) = (b * C mod 2**32) >> 16:
#     given b, a bijection of a, so uniform and independent of the second's, exactly; given
#     a, g(b) shifted, and g's 2**16 values fill every interval of [0, 2**16) to within 4
#     of its length (b * C / 2**32 mod 1 is a golden-ratio Weyl sequence, whose points
#     spread about as evenly as any), so given the master's bits the first moment still
#     rounds up with its probability to within 2**-14.
#   Three 16-bit numbers from 32 bits cannot be jointly independent (two of them fix the
#   third); the multiply makes the third a mixing function of the two where a sum or an xor
#   of the halves would not (with a and b both below 2**15, a ^ b always is too). A
#   product's low 16 bits depend only on its input's low 16 bits: the second moment's u is
#   b's image, and b is no other stream's u. 16 bits each, not 8: at beta2 = 0.999 the EMA
#   moves a stored sqrt(v) by about 1/2000 of itself a step, 1/250 to 1/125 of its
#   spacing; u in steps of 2**-8 would bias a rounding by up to 1/256 of a spacing, as
#   much as that drift, where 2**-16 biases it by under 1% of it. (An earlier version
#   hashed h once more, hash32(h ^ salt): two multiplies and 8 more operations per vector;
#   docs/design-host.md has what that cost. tests/test_lean_state_rounding.py checks the
#   three streams' independence.)
# * The SIMD loops have y, hash32's value before its last multiply, with h ^ h >> 16 = y *
#   C2 (hash32's last constant; h ^ h >> 16 undoes hash32's last step): w = y * (C2 * C mod
#   2**32), one multiply from y, as the master's bits y * C2 are.
# * The SIMD loops' fast encoder does it in its integer add: for a normal y, k rounds up
#   exactly when the 20 dropped mantissa bits plus u * 2**20 carry, so it adds u16 * 2**4
#   where nearest even adds 0x7FFFF plus the kept lsb (same op count); the other lanes take
#   the formula above (``lean_kernels.cpp``: fp8_stochastic, fp8x8_stochastic).
# * bf16 states (the bf16 preset's, with any master) round stochastically too, with the
#   same u: the first moment's the top 16 of w, the second's the bottom 16, each in place of
#   the master's 16 bits in bf16_stochastic (up with probability dropped bits / 2**16; NaN
#   made 0x7FC0, infinity kept). bf16 keeps 8 significant bits, half a spacing 2**-9 to
#   2**-8 of v, while at beta2 = 0.999 the EMA moves v by 1/1000 of it a step: rounded to
#   nearest, a v that should fall stayed (with shrinking gradients 2.0x fp32's after 1000
#   steps, updates 0.71x; docs/host-precision.md has the figures before and after). Every
#   lean step has the key and counter, whatever the master, so every master with bf16
#   states rounds them so. The loops that take the short rounding bits for 8-bit states
#   take them for bf16 states where a block starts on a multiple of 256 below 2**32, the
#   full hash elsewhere, and the scalar block where a block's counters cross 2**32.
# ``quantize_blockwise`` (conversions, checkpoints, legacy states) still rounds to nearest
# even; the codes' format does not change, nor do bf16 states' (bf16 tensors), so old
# checkpoints load as before.


def _scale_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """The block scales' exponents e (int64) of fp32 ``absmax`` (>= 0): the least e with
    absmax / 2**e <= 448 (448 = 1.75 * 2**8: exponent(absmax) - 8, plus 1 where the
    mantissa passes 1.75, which adding 0x1FFFFF carries into the exponent), at least -126."""
    bits = absmax.contiguous().view(torch.int32).to(torch.int64) & MASK32
    return (((bits + 0x1FFFFF) >> 23) - 135).clamp(min=-126)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32 for int64 e in [-126, 127], from its bits."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def lean_isa() -> str | None:
    """The instruction set of the native lean step here: "avx512", "avx2" or "scalar"
    (capped by ``RAMFLOW_LEAN_ISA``, read at each call), or None without the native code."""
    lib = _LEAN.get()
    if lib is None:
        return None
    return {3: "avx512", 2: "avx2"}.get(lib.ramflow_lean_isa(), "scalar")


def quantize_blockwise(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdamW moment ``x`` (n,) fp32, any device, as the lean format's 8-bit codes: (n,)
    uint8 E4M3 codes and one fp32 power-of-two scale per block of 256 (ceil(n / 256),).
    See [Note: 8-bit states in FP8 with power-of-two block scales].

    Args:
        x: the moment's values, fp32.
        signed: True for the first moment (``exp_avg``, coded as x / scale); False for the
            second (``exp_avg_sq``, never negative, coded as sqrt(x) / scale, and a positive
            value never as code 0).

    Returns: (codes, scales) on ``x``'s device; codes round to nearest even (a lean step
    rounds its states' codes stochastically instead, see [Note: stochastic rounding of the
    8-bit states]; conversions and checkpoints use this).
    """
    return quantize_blockwise_sr(x, signed=signed, u16=None)


def _fp8_stochastic(y: torch.Tensor, u16: torch.Tensor, *, second: bool) -> torch.Tensor:
    """fp32 ``y`` rounded onto the E4M3 grid stochastically with 16 random bits ``u16``
    (int64, same shape) each, as the native ``fp8_stochastic``: a point of the grid, NaN
    and infinity as they are. See [Note: stochastic rounding of the 8-bit states]."""
    a = y.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    ey = ((a >> 23) - 127).clamp(min=-6)  # the grid's spacing at y is 2**(ey - 3)
    t = a.to(torch.int32).view(torch.float32) * _pow2(3 - ey)  # exact
    k = torch.floor(t + u16.to(torch.float32) * 2.0**-16)  # one fp32 addition, then floor
    if second:  # a positive value never code 0
        k = torch.where((t > 0) & (k == 0), 1.0, k)
    r = k * _pow2(ey - 3)  # exact, >= +0
    r = r.view(torch.int32) | (y.view(torch.int32) & torch.iinfo(torch.int32).min)  # y's sign
    return torch.where(a >= 0x7F800000, y, r.view(torch.float32))


def quantize_blockwise_sr(
    x: torch.Tensor, *, signed: bool, u16: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blockwise``, the codes rounded to nearest even (``u16`` None) or
    stochastically with ``u16`` (n,) int64, 16 random bits per element."""
    n = x.numel()
    y = x.reshape(-1).to(torch.float32)
    if not signed:  # the fp64 root rounded to fp32 is correctly rounded, as C++'s sqrt
        y = y.double().sqrt().float()
    blocks = torch.nn.functional.pad(y, (0, -n % QBLOCK)).view(-1, QBLOCK)
    # NaN left out of the absmax, as the native code's running max and Triton's leave it
    e = _scale_exponents(torch.where(blocks.isnan(), 0.0, blocks.abs()).amax(dim=1))
    y = blocks * _pow2(-e)[:, None]  # |y| <= 448 where finite
    if u16 is not None:  # the scale is the unrounded block's; the rounded y stays <= 448
        u16 = torch.nn.functional.pad(u16, (0, -n % QBLOCK)).view(-1, QBLOCK)
        y = _fp8_stochastic(y, u16, second=not signed)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    # infinity and NaN as 0x7F: torch 2.13 saturates infinity to 448, older ones made it NaN
    q = torch.where(torch.isfinite(y), q, q | 0x7F)
    if not signed:  # no sign; a positive value never code 0
        q = torch.where(((q & 0x7F) == 0) & (y > 0), 1, q & 0x7F).to(torch.uint8)
    return q.view(-1)[:n], _pow2(e)


def _quantize_blockwise_native(
    x: torch.Tensor, *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_blockwise`` by the native code a lean step stores its 8-bit states with
    (that of ``lean_isa()``), or None where it is not available. For the tests, which
    compare the two bit for bit."""
    lib = _LEAN.get()
    if lib is None:
        return None
    x = x.reshape(-1).to(torch.float32).contiguous()
    n = x.numel()
    q = torch.empty(n, dtype=torch.uint8)
    scale = torch.empty(-(-n // QBLOCK), dtype=torch.float32)
    rc = lib.ramflow_fp8_quantize_blocks(
        x.data_ptr(), n, int(not signed), q.data_ptr(), scale.data_ptr()
    )
    assert rc == 0, rc
    return q, scale


def _quantize_stochastic_native(
    m: torch.Tensor, v: torch.Tensor, *, key: int, counter_offset: int, split: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The moments ``m`` and ``v`` (n,) fp32 as a lean step's native code stores them, with
    stochastic rounding: (m codes, m scales, v codes, v scales); ``split``: by AVX2's loop in
    even and odd lanes. None where the native code is not available. For the tests, which
    compare it with ``quantize_blockwise_sr`` bit for bit."""
    lib = _LEAN.get()
    if lib is None:
        return None
    m = m.reshape(-1).to(torch.float32).contiguous()
    v = v.reshape(-1).to(torch.float32).contiguous()
    n = m.numel()
    assert v.numel() == n and counter_offset % QBLOCK == 0
    qm, qv = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    ms, vs = (torch.empty(-(-n // QBLOCK), dtype=torch.float32) for _ in range(2))
    rc = lib.ramflow_fp8_stochastic_blocks(
        m.data_ptr(),
        v.data_ptr(),
        n,
        key,
        counter_offset,
        int(split),
        qm.data_ptr(),
        qv.data_ptr(),
        ms.data_ptr(),
        vs.data_ptr(),
    )
    assert rc == 0, rc
    return qm, ms, qv, vs


def _dequantize_blockwise_native(
    q: torch.Tensor, scale: torch.Tensor, *, signed: bool
) -> torch.Tensor | None:
    """``dequantize_blockwise`` by the native code a lean step reads its 8-bit states with
    (that of ``lean_isa()``), or None where it is not available. For the tests."""
    lib = _LEAN.get()
    if lib is None:
        return None
    q = q.reshape(-1).contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    out = torch.empty(q.numel(), dtype=torch.float32)
    rc = lib.ramflow_fp8_dequantize_blocks(
        q.data_ptr(), q.numel(), int(not signed), scale.data_ptr(), out.data_ptr()
    )
    assert rc == 0, rc
    return out


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """The fp32 values (n,) of codes ``q`` (n,) uint8 with per-block ``scale``
    (``quantize_blockwise``'s): the first moment's (``signed``), or the second's (the
    decoded square root, squared)."""
    n = q.numel()
    u = q.reshape(-1).view(torch.float8_e4m3fn).to(torch.float32)
    u = u * scale.repeat_interleave(QBLOCK)[:n]
    return u if signed else u * u


class _LeanArgs(ctypes.Structure):
    """The C ``LeanArgs`` struct of ``cpu_kernels.cpp``, field for field."""

    _fields_ = [
        ("master", ctypes.c_void_p),
        ("compensation", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("exp_avg_scale", ctypes.c_void_p),
        ("exp_avg_sq_scale", ctypes.c_void_p),
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


class _LeanLibrary(KernelLibrary):
    """The library with the lean entry points (the fp32 kernel's build), or None."""

    def _on_build_error(self, err: Exception) -> None:
        warnings.warn(
            f"ramflow: the native lean CPU AdamW kernels could not be built ({err}); "
            "stepping with PyTorch instead (same results, slower).",
            RuntimeWarning,
            stacklevel=5,
        )

    def _declare(self, lib: ctypes.CDLL) -> ctypes.CDLL:
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
        lib.ramflow_fp8_quantize_blocks.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.ramflow_fp8_quantize_blocks.restype = ctypes.c_int
        lib.ramflow_fp8_stochastic_blocks.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_uint32,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.ramflow_fp8_stochastic_blocks.restype = ctypes.c_int
        lib.ramflow_fp8_dequantize_blocks.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.ramflow_fp8_dequantize_blocks.restype = ctypes.c_int
        lib.ramflow_lean_isa.argtypes = []
        lib.ramflow_lean_isa.restype = ctypes.c_int
        lib.ramflow_round_to_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.ramflow_round_to_bf16.restype = ctypes.c_int
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


def _load_state(s: torch.Tensor, scale: torch.Tensor | None, *, signed: bool) -> torch.Tensor:
    if s.dtype == torch.uint8:
        return dequantize_blockwise(s, scale, signed=signed)
    return s.to(torch.float32)


def _store_state(
    s: torch.Tensor,
    scale: torch.Tensor | None,
    x: torch.Tensor,
    *,
    signed: bool,
    bits: torch.Tensor | None,
):
    if bits is None:  # fp32
        s.copy_(x)
        return
    # [Note: stochastic rounding of the 8-bit states]: the first moment's u is the top 16
    # of the state bits, the second's the bottom 16, for 8-bit and bf16 states alike
    u16 = (bits >> 16) if signed else (bits & 0xFFFF)
    if s.dtype == torch.uint8:
        q, sc = quantize_blockwise_sr(x, signed=signed, u16=u16)
        s.copy_(q)
        scale.copy_(sc)
    else:
        s.copy_(bf16_stochastic(x, u16))


@torch.no_grad()
def _step_torch(
    master,
    grad,
    exp_avg,
    exp_avg_sq,
    compensation,
    m_scale,
    v_scale,
    wire_out,
    *,
    key,
    counter_offset,
    grad_scale,
    apply_decay,
    c,
) -> None:
    g = grad.view(-1).to(torch.float32)
    if grad_scale != 1.0:
        g = g * _f32(grad_scale)
    p = master.view(-1).to(torch.float32)
    if compensation is not None:
        p = p + compensation.view(-1).to(torch.float32)
    if apply_decay:
        p = p * c["decay"]
    m = _load_state(exp_avg.view(-1), m_scale, signed=True)
    v = _load_state(exp_avg_sq.view(-1), v_scale, signed=False)
    m = m * c["beta1"] + g * c["one_minus_beta1"]
    v = v * c["beta2"] + (g * c["one_minus_beta2"]) * g
    # torch's fp32 sqrt is not correctly rounded on every CPU (AVX2 builds differ from
    # IEEE in about 1 of 6 elements); the fp64 square root rounded to fp32 is, as C++'s is.
    # PyTorch's CUDA division by a Python scalar multiplies by its reciprocal (one more
    # rounding); a 0-dim tensor on the device is divided by, correctly rounded
    bc2_sqrt = c["bc2_sqrt"] if v.device.type == "cpu" else v.new_tensor(c["bc2_sqrt"])
    denom = v.double().sqrt().float() / bc2_sqrt + c["eps"]
    p = p + (m * c["neg_step_size"]) / denom
    bits = None  # bf16 and 8-bit states round stochastically
    if exp_avg.dtype != torch.float32:
        bits = state_bits(key, counter_offset, m.numel(), m.device)
    _store_state(exp_avg.view(-1), m_scale, m, signed=True, bits=bits)
    _store_state(exp_avg_sq.view(-1), v_scale, v, signed=False, bits=bits)
    if master.dtype == torch.float32:
        master.view(-1).copy_(p)
        if wire_out is not None:
            wire_out.view(-1).copy_(p)
    elif compensation is None:
        master.view(-1).copy_(round_bf16_torch(p, key, counter_offset))
    else:
        hi = p.to(torch.bfloat16)
        master.view(-1).copy_(hi)
        compensation.view(-1).copy_(p - hi.to(torch.float32))


def _master_format(master: torch.Tensor, compensation: torch.Tensor | None) -> int:
    if master.dtype == torch.float32:
        return _MASTER_F32
    return _MASTER_SR if compensation is None else _MASTER_KAHAN


def _step_triton(
    master,
    grad,
    exp_avg,
    exp_avg_sq,
    compensation,
    m_scale,
    v_scale,
    wire_out,
    *,
    key,
    counter_offset,
    grad_scale,
    apply_decay,
    c,
) -> None:
    """``_step_torch``'s step as one Triton kernel (CUDA tensors; the same bits)."""
    _lean_triton.lean_adamw_step(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        compensation,
        m_scale,
        v_scale,
        wire_out,
        master_format=_master_format(master, compensation),
        state_format=_STATE_FORMAT[exp_avg.dtype],
        key=key,
        counter_offset=counter_offset,
        grad_scale=_f32(grad_scale),
        apply_decay=apply_decay,
        c=c,
        block=QBLOCK,
    )


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
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
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
    * ``exp_avg``/``exp_avg_sq`` fp32, bf16, or uint8 E4M3 codes of 8-bit block-wise
      states with ``exp_avg_scale``/``exp_avg_sq_scale`` fp32 (ceil(n / 256),), one power of
      two per block of 256 elements (see ``quantize_blockwise``). bf16 values and the codes
      are rounded stochastically with the master's key and counter (see [Note: stochastic
      rounding of the 8-bit states]), whatever the master. Both states have one format.

    Args:
        master: (n,) master weights, any shape, updated in place.
        grad: the gradient, fp32, bf16 or fp16; only read.
        exp_avg, exp_avg_sq: the AdamW states, updated in place.
        step: the step number, already incremented (1 on the first step), an int >= 1.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled decay).
        grad_scale: multiplies the gradient first (e.g. a clipping coefficient); 1.0: none.
        compensation, exp_avg_scale, exp_avg_sq_scale, wire_out: as above.
        seed: the stochastic rounding's seed, an int in [0, 2**64); one per unit.
        counter_offset: the index of ``master[0]`` in its unit (a piece of a unit rounds as
            the whole unit would); with 8-bit states a multiple of 256.
        num_threads: threads of the native code; None is ``torch.get_num_threads()``. The
            result does not depend on it.

    All tensors on the CPU (the native kernel, which releases the GIL), or all on one CUDA
    device (one fused Triton kernel, ``kernels.lean_triton``, or without Triton the same
    arithmetic in PyTorch ops; either gives the CPU's bits, see [Note: the same bits on the
    GPU]: ``ramflow.offload(device_optimizer=True)`` steps units there), contiguous, not
    overlapping.

    Raises:
        TypeError: a tensor has a dtype not listed above.
        ValueError: sizes differ; the states' formats differ; 8-bit states without their
            scale buffers (or with wrong sizes); ``compensation`` or ``wire_out`` with a
            master they do not go with; ``step`` < 1; ``counter_offset`` < 0 or, with 8-bit
            states, not a multiple of 256.
    """
    check_threads(num_threads)
    if not isinstance(master, torch.Tensor):
        raise TypeError(f"master must be a torch.Tensor, got {type(master).__name__}")
    n = master.numel()
    dev = master.device if master.device.type == "cuda" else None
    check_tensor("master", master, (torch.float32, torch.bfloat16), n, dev)
    check_tensor("grad", grad, (torch.float32, torch.bfloat16, torch.float16), n, dev)
    states = tuple(_STATE_FORMAT)
    check_tensor("exp_avg", exp_avg, states, n, dev)
    check_tensor("exp_avg_sq", exp_avg_sq, states, n, dev)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(
            f"exp_avg is {exp_avg.dtype} and exp_avg_sq {exp_avg_sq.dtype}; give both states "
            "one format (float32, bfloat16, or uint8 8-bit codes)"
        )
    written = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    quantized = exp_avg.dtype == torch.uint8
    num_blocks = -(-n // QBLOCK)
    if quantized:
        if exp_avg_scale is None or exp_avg_sq_scale is None:
            raise ValueError(
                "8-bit states need exp_avg_scale and exp_avg_sq_scale, fp32 "
                f"({num_blocks},): one per block of {QBLOCK}"
            )
        check_tensor("exp_avg_scale", exp_avg_scale, (torch.float32,), num_blocks, dev)
        check_tensor("exp_avg_sq_scale", exp_avg_sq_scale, (torch.float32,), num_blocks, dev)
        written += [("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)]
        if counter_offset % QBLOCK:
            raise ValueError(
                f"with 8-bit states a piece must start on a block: counter_offset must be a "
                f"multiple of {QBLOCK}, got {counter_offset}"
            )
    elif exp_avg_scale is not None or exp_avg_sq_scale is not None:
        raise ValueError("scale buffers go with 8-bit (uint8) states only")
    if compensation is not None:
        if master.dtype != torch.bfloat16:
            raise ValueError("compensation goes with a bf16 master; an fp32 master needs none")
        check_tensor("compensation", compensation, (torch.bfloat16,), n, dev)
        written.append(("compensation", compensation))
    if wire_out is not None:
        if master.dtype != torch.float32:
            raise ValueError(
                "wire_out goes with an fp32 master; a bf16 master is its own wire copy"
            )
        check_tensor("wire_out", wire_out, (torch.bfloat16, torch.float16), n, dev)
        written.append(("wire_out", wire_out))
    check_no_overlap(written + [("grad", grad)])
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
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            compensation,
            exp_avg_scale,
            exp_avg_sq_scale,
            wire_out,
            key=key,
            counter_offset=counter_offset,
            grad_scale=grad_scale,
            apply_decay=apply_decay,
            c=c,
        )
        return
    ptr = _cpu_kernels.ptr_of
    master_format = _master_format(master, compensation)
    args = _LeanArgs(
        master=master.data_ptr(),
        compensation=ptr(compensation),
        grad=grad.data_ptr(),
        exp_avg=exp_avg.data_ptr(),
        exp_avg_sq=exp_avg_sq.data_ptr(),
        exp_avg_scale=ptr(exp_avg_scale),
        exp_avg_sq_scale=ptr(exp_avg_sq_scale),
        wire_out=ptr(wire_out),
        n=n,
        counter_offset=counter_offset,
        key=key,
        grad_scale=_f32(grad_scale),
        apply_decay=int(apply_decay),
        apply_scale=int(grad_scale != 1.0),
        master_format=master_format,
        state_format=_STATE_FORMAT[exp_avg.dtype],
        grad_dtype=_cpu_kernels.DTYPE_CODE[grad.dtype],
        wire_dtype=0 if wire_out is None else _cpu_kernels.DTYPE_CODE[wire_out.dtype],
        num_threads=num_threads or 0,
        **c,
    )
    rc = lib.ramflow_lean_adamw_step(ctypes.byref(args))
    assert rc == 0, rc


def warm_up_device_step(
    device: torch.device, *, master_dtype: torch.dtype, state_dtype: torch.dtype, compensated: bool
) -> bool:
    """Compile the device step's Triton kernel (``kernels.lean_triton``) for one host format on
    ``device`` before the first step: a step of one block of zeros for each variant a step
    can launch, on the current stream. Triton compiles one per weight decay on and off, a
    gradient scale of 1 and another (clipping), a rounding key that fits int32 and one that
    does not (Triton types an int argument by its value), and, with 8-bit states, scale
    buffers on and off a 16-byte boundary (a param group's run starts at any block). Triton
    keeps the binaries in its per-machine cache, so a later process loads them. Returns
    whether it ran (False where the kernel is not used, see ``kernels.lean_triton.available``).
    See [Note: building before the first step] in ``ramflow.kernels.cpu_kernels``."""
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
        scales = [zeros(torch.float32, 2)[shift : shift + 1] for _ in range(2)]
        lean_adamw_step_(
            zeros(master_dtype),
            zeros(torch.bfloat16),
            zeros(state_dtype),
            zeros(state_dtype),
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=weight_decay,
            grad_scale=grad_scale,
            compensation=zeros(torch.bfloat16) if compensated else None,
            exp_avg_scale=scales[0] if quantized else None,
            exp_avg_sq_scale=scales[1] if quantized else None,
            seed=seed,
        )
    return True
