"""4-bit AdamW states: the codes and their (de)quantization (Li et al. 2023).

[Note: 4-bit AdamW states]
"Memory Efficient Optimizers with 4-bit States" (Li, Chen and Zhu, NeurIPS 2023) keeps
AdamW's moments in 4 bits per element with per-block absmax scales; torchao's ``AdamW4bit``
(``torchao.optim.subclass_4bit``) implements it, and its maps and (de)quantization are the
ones used here (``torchao.optim.quant_utils``), on flat host buffers:

- first moment (``exp_avg``): blocks of ``BLOCK_4BIT`` (128) elements, each divided by its
  absmax and coded with the signed dynamic-exponent map of 16 values (3 exponent bits,
  ``create_dynamic_map(True, 3, 4)``), which holds 0 exactly;
- second moment (``exp_avg_sq``): the same blocks of ``sqrt(v)``, coded with the linear map
  that excludes zero (``k / 16``, k = 1..16), so ``v`` itself on the map ``(k / 16)**2``
  (a "power-2" map in the paper's family, where torchao's is power-1, linear on ``v``).
  Excluding zero is the paper's fix of the "zero-point problem": a small ``v`` rounded to
  0 turns ``m / sqrt(v)`` into a huge update. The paper's best second-moment scheme is
  rank-1 normalization (row and column maxima of a 2-D parameter, a tight scale per
  element); a unit's flat buffer mixes parameters of many shapes, so torchao and this
  format use blocks of 128. With blocks, torchao's linear map on ``v`` raises every ``v``
  under ``absmax / 16`` of its block to ``absmax / 16``, which shrinks those elements'
  updates: in this project's accuracy runs it ended over the 1% target of fp32's loss
  in most runs (docs/host-precision.md, "4-bit states"). Coding
  ``sqrt(v)`` puts that floor at ``absmax / 256`` and spaces the codes evenly in the
  denominator the step divides by (as the 8-bit format codes ``sqrt(v)``); docs/
  host-precision.md ("4-bit states") links the runs.
- codes rounded to nearest, as the paper and torchao do (no stochastic rounding), the
  codes of torchao's functions bit for bit, found faster (``quantize_4bit``);
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
    try:
        from torchao.optim.subclass_4bit import get_qmap_signed, get_qmap_unsigned
    except ImportError as err:  # an optional dependency, as for frozen_format="nf4"
        raise ImportError(
            "the 4-bit AdamW states (host_precision='lean4') use torchao's maps: "
            "pip install torchao, or pick host_precision='lean'"
        ) from err

    values = get_qmap_signed() if signed else get_qmap_unsigned()
    return torch.tensor(values, dtype=torch.float32, device=device)


@functools.cache
def _thresholds(signed: bool) -> tuple[float, ...]:
    """The 15 fp32 thresholds (ascending) at which torchao's rounding moves up a code.

    torchao's ``quantize_4bit_with_qmap`` finds the last map value ``down`` at or below a
    scaled x by a binary search of int64 gathers, then takes the next code where ``x - down
    >= (up - down) * 0.5`` in fp32: about 1 us per element on this project's CPUs. That
    test is monotone in x, so each gap of the map has a least fp32 x that passes it,
    found here once among the fp32 neighbours of the gap's midpoint; then the code of x is
    the number of thresholds at or below it, the same codes (``tests/test_states_4bit.py``
    compares them)."""
    qmap = _qmap(signed, torch.device("cpu"))
    out = []
    for down, up in zip(qmap[:-1], qmap[1:]):
        half = (up - down) * 0.5
        near = [torch.tensor(float(down) + float(half), dtype=torch.float32)]
        for direction in (-2.0, 2.0):  # 64 fp32 neighbours on each side
            x = near[0]
            for _ in range(64):
                x = torch.nextafter(x, torch.tensor(direction))
                near.append(x)
        near = torch.stack(near).sort().values
        passing = near[(near - down) >= half]
        assert passing.numel() and passing[0] > near[0], "threshold outside the search"
        out.append(float(passing[0]))  # an fp32 value, exact as a Python float
    return tuple(out)


@functools.cache
def _pair_values(signed: bool, device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the map's values of a byte's two codes (high nibble first)."""
    qmap = _qmap(signed, torch.device("cpu"))
    byte = torch.arange(256)
    return torch.stack([qmap[byte >> 4], qmap[byte & 0b1111]], dim=1).to(device)


def quantize_4bit(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdamW moment ``x`` (n,) fp32 as 4-bit codes. See [Note: 4-bit AdamW states].

    The codes are those of torchao's ``quantize_4bit_with_qmap`` of ``scale_tensor``'s
    blocks, bit for bit, found by thresholds (``_thresholds``).

    Args:
        x: the moment's values, (n,) fp32, any device; finite.
        signed: True for the first moment (the dynamic-exponent map), False for the second
            (never negative: its square root on the linear map without zero).

    Returns:
        (codes, absmax): codes (64 * ceil(n / 128),) uint8, two per byte, the first in the
        high nibble, whole blocks: the elements past n are coded as zeros are (see [Note:
        4-bit AdamW states]); absmax (ceil(n / 128),) fp32, each block's largest magnitude
        of what is coded (of ``sqrt(x)`` for the second moment; at least 1e-12), on
        ``x``'s device.
    """
    from torchao.optim.quant_utils import scale_tensor

    n = x.numel()
    y = x.reshape(-1).to(torch.float32)
    if not signed:  # the fp64 root rounded to fp32 is correctly rounded on every CPU
        y = y.double().sqrt().float()
    y = torch.nn.functional.pad(y, (0, -n % BLOCK_4BIT))
    scaled, absmax = scale_tensor(y, BLOCK_4BIT)
    # the number of thresholds at or below each value: 15 compares added into bytes, 4x
    # the rate of torch.bucketize's search here
    thresholds = _thresholds(signed)
    codes = torch.ge(scaled, thresholds[0]).to(torch.uint8)
    for t in thresholds[1:]:
        codes.add_(torch.ge(scaled, t))
    return (codes[0::2] << 4) | codes[1::2], absmax


def dequantize_4bit(
    codes: torch.Tensor, absmax: torch.Tensor, n: int, *, signed: bool
) -> torch.Tensor:
    """The fp32 values (n,) of ``quantize_4bit``'s ``codes`` (64 * ceil(n / 128),) uint8
    and ``absmax`` (ceil(n / 128),) fp32, on their device: torchao's ``dequant_with_qmap``
    (map value times absmax; squared for the second moment), by a table of each byte's
    two values."""
    pairs = torch.nn.functional.embedding(codes.long(), _pair_values(signed, codes.device))
    values = (pairs.view(-1, BLOCK_4BIT) * absmax.view(-1, 1)).view(-1)[:n]
    return values if signed else values * values


def zero_code(*, signed: bool) -> int:
    """The byte of two codes of 0: the first moment's map holds 0; the second's has no
    zero, and 0 rounds to its smallest value, code 0 (what a step writes for zeros)."""
    codes, _ = quantize_4bit(torch.zeros(BLOCK_4BIT), signed=signed)
    return int(codes[0])
