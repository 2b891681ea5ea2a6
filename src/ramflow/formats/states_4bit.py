"""4-bit AdamW states: the codes and their (de)quantization (Li et al. 2023).

[Note: 4-bit AdamW states]
"Memory Efficient Optimizers with 4-bit States" (Li, Chen and Zhu, NeurIPS 2023) keeps
AdamW's moments in 4 bits per element with per-block absmax scales; torchao's ``AdamW4bit``
(``torchao.optim.subclass_4bit``) implements it, and its maps and (de)quantization are the
ones used here (``torchao.optim.quant_utils``), on flat host buffers:

- first moment (``exp_avg``): blocks of ``BLOCK_4BIT`` (128) elements, each divided by its
  absmax and coded with the signed dynamic-exponent map of 16 values (3 exponent bits,
  ``create_dynamic_map(True, 3, 4)``), which holds 0 exactly;
- second moment (``exp_avg_sq``): the same blocks, coded with the linear map that excludes
  zero (``k / 16``, k = 1..16). Excluding zero is the paper's fix of the "zero-point
  problem": a small ``v`` rounded to 0 turns ``m / sqrt(v)`` into a huge update. The paper's
  best second-moment scheme is rank-1 normalization (row and column maxima of a 2-D
  parameter); torchao, and this format, use blocks of 128 instead, as a unit's flat buffer
  mixes parameters of many shapes and a block never crosses a parameter's start.
- codes rounded to nearest, as the paper and torchao do (no stochastic rounding);
- two codes per byte, element ``2i`` in the high nibble (torchao's packing);
- codes of whole blocks: a parameter's last block is partly padding (parameters start on
  multiples of 256, ``units.unit.ALIGN``), and the padding's codes are written, as zeros,
  by every step and kept by the checkpoint, so a resumed run holds the bytes of the run it
  continues (the second moment's map has no zero: a padding element left at another code
  would read as a value and change its block's absmax).

So a moment takes 0.5 + 4 / 128 bytes per element: 1.0625 bytes per trained parameter for
both, against 2.03 for the 8-bit FP8 states. A step decodes a piece of each moment to fp32
(``STEP_CHUNK`` elements at a time, which bounds the temporaries), runs the lean kernel's
one-pass AdamW over it (so the master's stochastic rounding, Kahan compensation, weight
decay and gradient scale are the lean formats' own bits) and codes the new moments back.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["BLOCK_4BIT", "STEP_CHUNK", "dequantize_4bit", "quantize_4bit", "zero_code"]

BLOCK_4BIT = 128  # elements per block of a 4-bit moment, one fp32 absmax each
# elements of a 4-bit step decoded to fp32 at a time: a multiple of the lean step's
# alignment (256), about 40 bytes of temporaries each (the fp32 moments, the codes' int64
# search), 40 MiB in all
STEP_CHUNK = 1 << 20


@functools.cache
def _qmap(signed: bool, device: torch.device) -> torch.Tensor:
    """torchao's 16 values (ascending, fp32) of the first (``signed``) or second moment."""
    from torchao.optim.subclass_4bit import get_qmap_signed, get_qmap_unsigned

    values = get_qmap_signed() if signed else get_qmap_unsigned()
    return torch.tensor(values, dtype=torch.float32, device=device)


def quantize_4bit(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdamW moment ``x`` (n,) fp32 as 4-bit codes. See [Note: 4-bit AdamW states].

    Args:
        x: the moment's values, (n,) fp32, any device.
        signed: True for the first moment (the dynamic-exponent map), False for the second
            (never negative: the linear map without zero).

    Returns:
        (codes, absmax): codes (64 * ceil(n / 128),) uint8, two per byte, the first in the
        high nibble, whole blocks: the elements past n are coded as zeros are (see [Note:
        4-bit AdamW states]); absmax (ceil(n / 128),) fp32, each block's largest magnitude
        (at least 1e-12), on ``x``'s device.
    """
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, scale_tensor

    n = x.numel()
    y = torch.nn.functional.pad(x.reshape(-1).to(torch.float32), (0, -n % BLOCK_4BIT))
    scaled, absmax = scale_tensor(y, BLOCK_4BIT)
    codes = quantize_4bit_with_qmap(scaled, _qmap(signed, y.device))
    return (codes[0::2] << 4) | codes[1::2], absmax


def dequantize_4bit(
    codes: torch.Tensor, absmax: torch.Tensor, n: int, *, signed: bool
) -> torch.Tensor:
    """The fp32 values (n,) of ``quantize_4bit``'s ``codes`` (64 * ceil(n / 128),) uint8
    and ``absmax`` (ceil(n / 128),) fp32, on their device."""
    from torchao.optim.quant_utils import dequant_with_qmap

    unpacked = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    return dequant_with_qmap(unpacked, _qmap(signed, codes.device), absmax)[:n]


def zero_code(*, signed: bool) -> int:
    """The byte of two codes of 0: the first moment's map holds 0; the second's has no
    zero, and 0 rounds to its smallest value, code 0 (what a step writes for zeros)."""
    codes, _ = quantize_4bit(torch.zeros(BLOCK_4BIT), signed=signed)
    return int(codes[0])
