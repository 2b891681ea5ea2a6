"""Reading AdamW states saved in the 8-bit format that the FP8 code replaced.

Until the FP8 code (see [Note: 8-bit states in FP8 with power-of-two block scales] in
``kernels.lean_kernels``), the lean host formats kept 8-bit AdamW states as indices into the
256-entry "dynamic" code of Dettmers et al. 2022 ("8-bit Optimizers via Block-wise
Quantization"), one fp32 absmax per block of 256, saved as ``exp_avg``/``exp_avg_sq`` (uint8)
with ``exp_avg_absmax``/``exp_avg_sq_absmax``. The suffix tells the two apart: the FP8
code's scales are ``*_scale``. A state in the old format is decoded here to fp32 and then
stored in the unit's format as any moment is (``formats.host.moments_into``): a checkpoint
written before the change resumes, its moments rounded once more (to the FP8 code's
precision). Nothing here is written anymore.
"""

from __future__ import annotations

import torch

LEGACY_BLOCK = 256  # the old format's block, fixed: old checkpoints were written with it
LEGACY_SUFFIX = "_absmax"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def dynamic_code(*, signed: bool) -> torch.Tensor:
    """The 256 values (ascending, fp32) of the old 8-bit "dynamic" type (Dettmers et al.
    2022): seven decades 10**-6 .. 10**0 below 1, decade d (0 for the smallest) holding
    2**d values (signed: and their negatives) or 2**(d + 1) values (unsigned), the midpoints
    of a linear grid from 0.1 to 1 times the decade's scale; plus 1, and 0 (signed) or half
    the smallest value (unsigned: that code had no zero)."""
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


def dequantize_dynamic(q: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """The fp32 values (n,) of old codes ``q`` (n,) uint8 with one fp32 ``absmax`` per block
    of 256 (ceil(n / 256),): ``code[q] * absmax``, as the old step read them."""
    code = dynamic_code(signed=signed).to(q.device)
    q = q.reshape(-1)
    return code[q.long()] * absmax.reshape(-1).repeat_interleave(LEGACY_BLOCK)[: q.numel()]


def is_legacy_name(name: str) -> bool:
    """Whether ``name`` is an old-format absmax state (``exp_avg_absmax``...)."""
    return name.endswith(LEGACY_SUFFIX) and name[: -len(LEGACY_SUFFIX)] in _MOMENTS


def has_legacy_moments(state: dict) -> bool:
    """Whether one parameter's optimizer ``state`` holds moments in the old format."""
    return any(is_legacy_name(k) for k in state)


def pop_legacy_moments(state: dict) -> dict[str, torch.Tensor]:
    """The moments of one parameter's ``state`` in the old format, decoded to fp32 (flat),
    their absmax taken out of ``state``.

    Raises:
        ValueError: an absmax without its codes, or codes that are not uint8.
    """
    out = {}
    for name in _MOMENTS:
        absmax = state.pop(name + LEGACY_SUFFIX, None)
        if absmax is None:
            continue
        codes = state.get(name)
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            raise ValueError(
                f"optimizer state {name + LEGACY_SUFFIX!r} goes with uint8 codes in "
                f"{name!r}, got {getattr(codes, 'dtype', type(codes).__name__)}: the state "
                "is neither the 8-bit format of this version nor the one before it"
            )
        out[name] = dequantize_dynamic(codes, absmax, signed=name == "exp_avg")
    return out
