"""MXFP4: 4-bit floats in blocks of 32 sharing one power-of-two scale (OCP Microscaling
Formats (MX) v1.0, 2023: the E2M1 element type with an E8M0 scale), as gpt-oss ships its
experts.

Legend: n = elements (a multiple of ``MX_BLOCK``); for a parameter of shape (..., R, C):
M = the product of its leading dimensions.

[Note: MXFP4 bytes and their order]
An element is a 4-bit code: a sign bit and an E2M1 magnitude (``FP4_VALUES``: 0, 0.5, 1,
1.5, 2, 3, 4, 6); two codes share a byte, the first in the low nibble (gpt-oss's and
transformers' order). Each block of 32 elements shares a scale byte ``s``, the E8M0
exponent: the block's values are ``FP4_VALUES[code] * 2**(s - 127)`` (``s = 255``, the
spec's NaN, gives inf as transformers' does). 4.25 bits per element.

Blocks run one of two ways through a parameter, both with its codes in its own row-major
order (so the device dequantizes into contiguous memory, never through a transpose):
- *rows* (what ``quantize`` makes of any weight): 32 consecutive elements of the flat
  order, i.e. along the last dimension (an ``nn.Linear``'s input features); scales (n/32,).
- *columns* (what a gpt-oss checkpoint holds): 32 consecutive elements of dimension -2,
  scales (M, R/32, C). A gpt-oss checkpoint stores ``gate_up_proj`` (E, H, 2I) as
  ``gate_up_proj_blocks`` (E, 2I, H/32, 16) and ``_scales`` (E, 2I, H/32): the
  parameter's transpose over its last two dimensions, blocks along H.
  ``from_checkpoint_layout`` moves those codes and scales into the parameter's order
  without changing one of them (no bf16 round trip), once, while the checkpoint loads.

The quantizer (``quantize``) follows the spec's conversion: a block's shared exponent is
``floor(log2(amax)) - 2`` (2 is E2M1's largest exponent), clamped to E8M0's [-127, 127];
each element divided by the scale (exact: a power of two) is rounded to the nearest E2M1
value, ties to the even code (the one whose mantissa bit is 0), and values past 6 (up to
8 by construction) saturate to 6. Non-finite weights are refused.
"""

from __future__ import annotations

import math

import torch

MX_BLOCK = 32
E8M0_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The E2M1 magnitudes of codes 0-7; codes 8-15 are their negatives (bit 3 the sign)."""
_E2M1_EMAX = 2  # the exponent of E2M1's largest normal, 6 = 1.5 * 2**2
_SIGN = 8
# elements dequantized at a time: bounds the fp32 and index temporaries (about 8 bytes each)
_CHUNK = 1 << 22


def _rounding_bounds(device: torch.device) -> torch.Tensor:
    """The midpoints between consecutive E2M1 magnitudes, for ``torch.bucketize`` (which
    counts the bounds strictly below a value): a tie goes up only where the upper code is
    even, so the bound below an even code is moved one fp32 step down (``v > prev(t)``
    is ``v >= t``)."""
    mids = torch.tensor(FP4_VALUES, dtype=torch.float32)
    mids = (mids[1:] + mids[:-1]) / 2  # exact: halves of small dyadic numbers
    upper_even = torch.arange(1, 8) % 2 == 0
    below = torch.nextafter(mids, torch.tensor(-math.inf))
    return torch.where(upper_even, below, mids).to(device)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent (int32, in [-127, 128]) as fp32, exact, from its bits (2**-127 is
    fp32's subnormal 0x00400000; 2**128 is inf)."""
    biased = exponent + E8M0_BIAS
    bits = torch.where(biased <= 0, 0x00400000, biased.clamp(max=255) << 23)
    return bits.to(torch.int32).view(torch.float32)


def quantize(x: torch.Tensor, *, columns: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``x``, any float dtype (computed in fp32), on its device. See [Note: MXFP4
    bytes and their order] for the rounding.

    Args:
        x: (n,) for blocks along rows; (M, R, C) with R a multiple of 32 for ``columns``.
        columns: blocks along dimension -2 (the layout of a gpt-oss checkpoint's experts).

    Returns:
        codes uint8 (n/2,) (two per byte, the first low) and scales uint8 E8M0: (n/32,),
        or (M, R/32, C) flattened for ``columns``.

    Raises:
        ValueError: ``x`` holds inf or NaN.
    """
    if columns:
        m, r, c = x.shape
        v = x.detach().float().reshape(m, r // MX_BLOCK, MX_BLOCK, c)
        dim = 2
    else:
        v = x.detach().float().reshape(-1, MX_BLOCK)
        dim = 1
    amax = v.abs().amax(dim=dim, keepdim=True)
    if not torch.isfinite(amax).all():
        raise ValueError(
            "MXFP4 cannot hold inf or NaN weights; find where they came from, or keep "
            "this weight in another frozen format"
        )
    _, e = torch.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2 amax) = e - 1
    # an all-zero block takes the smallest scale (floor(log2 0) is -inf)
    shared = torch.where(amax > 0, e - 1 - _E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = v * _pow2(-shared)  # exact: a power of two, and no result overflows
    codes = torch.bucketize(scaled.abs(), _rounding_bounds(v.device)).to(torch.uint8)
    codes |= torch.signbit(scaled).to(torch.uint8) * _SIGN
    codes = codes.reshape(-1)
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed, (shared + E8M0_BIAS).to(torch.uint8).reshape(-1)


def pair_table(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32 on ``device``: the two E2M1 values of each byte, low nibble first."""
    values = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=1).to(device)


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    table: torch.Tensor,
    width: int = 1,
) -> None:
    """Write MXFP4 ``codes`` (n/2,) uint8 with their E8M0 ``scales`` (n/32,) uint8 into
    ``out`` (n,), fp32, bf16 or fp16, all on one device: each value one fp32 product of
    an E2M1 value and a power of two, rounded once to ``out``'s dtype (the same bits on
    every device, and transformers' ``convert_moe_packed_tensors``'s).

    Args:
        table: ``pair_table(out.device)``.
        width: 1 for blocks along rows; C for blocks along the columns of a (M, R, C)
            parameter (the scales (M, R/32, C)).
    """
    group = MX_BLOCK * width  # the elements that one row of ``width`` scales covers
    num_groups = out.numel() // group
    assert codes.numel() * 2 == out.numel() == scales.numel() * MX_BLOCK == num_groups * group
    step = max(1, _CHUNK // group)
    for g0 in range(0, num_groups, step):
        g1 = min(num_groups, g0 + step)
        pairs = torch.nn.functional.embedding(
            codes[g0 * group // 2 : g1 * group // 2].int(), table
        )  # (k/2, 2): the chunk's values in order
        scale = _pow2(scales[g0 * width : g1 * width].int() - E8M0_BIAS)
        torch.mul(
            pairs.view(g1 - g0, MX_BLOCK, width),
            scale.view(g1 - g0, 1, width),
            out=out[g0 * group : g1 * group].view(g1 - g0, MX_BLOCK, width),
        )


def checkpoint_shape(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...] | None:
    """The parameter shape (..., R, C) that a checkpoint's packed pair ``blocks`` (..., C,
    R/32, 16) and ``scales`` (..., C, R/32) makes (transformers' ``convert_moe_packed_tensors``:
    experts, three dimensions or more), or None where the shapes are no such pair."""
    if len(blocks) < 4 or blocks[-1] != MX_BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
        return None
    *lead, c, g, _ = blocks
    return (*lead, g * MX_BLOCK, c)


def from_checkpoint_layout(
    blocks: torch.Tensor, scales: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor
) -> None:
    """Move a checkpoint's packed pair (``checkpoint_shape``) into the parameter's order with
    blocks along columns: each code and scale unchanged, only moved. CPU, uint8.

    Args:
        blocks: (M, C, R/32, 16) (leading dimensions flattened into M or not).
        scales: (M, C, R/32).
        codes_out: (M * R * C / 2,) uint8, the codes in the parameter's (M, R, C) order.
        scales_out: (M * R/32 * C,) uint8, the scales as (M, R/32, C).
    """
    *_, c, g, half = blocks.shape
    assert c % 2 == 0, "C pairs of the checkpoint's rows make one byte of the output's"
    blocks = blocks.reshape(-1, c // 2, 2, g * half)  # (M, C/2, 2, R/2): rows 2j and 2j + 1
    scales = scales.reshape(-1, c, g)
    m, r = blocks.shape[0], g * MX_BLOCK
    # (M, R/2, 2, C/2): output rows 2k and 2k + 1, bytes of columns 2j and 2j + 1
    out = codes_out.view(m, r // 2, 2, c // 2)
    for e in range(m):
        # byte (j, k) of rows 2j, 2j + 1 holds codes (2j, 2k), (2j, 2k+1) and (2j+1, 2k),
        # (2j+1, 2k+1): the output's row 2k takes both low nibbles, row 2k+1 both high ones
        a0, a1 = blocks[e, :, 0], blocks[e, :, 1]  # (C/2, R/2)
        even = (a0 & 15) | ((a1 & 15) << 4)
        odd = (a0 >> 4) | (a1 & 0xF0)
        # 2-D transposes (PyTorch copies those in cache-sized tiles)
        out[e, :, 0].copy_(even.t())
        out[e, :, 1].copy_(odd.t())
        scales_out.view(m, g, c)[e].copy_(scales[e].t())


__all__ = [
    "E8M0_BIAS",
    "FP4_VALUES",
    "MX_BLOCK",
    "checkpoint_shape",
    "dequantize",
    "from_checkpoint_layout",
    "pair_table",
    "quantize",
]
