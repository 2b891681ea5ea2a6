"""Counter-based random bits for ramflow's stochastic rounding, and the PyTorch references of
the roundings that read them: the bf16 master's and states' (``bf16_stochastic``) and the
8-bit states' bits (``state_bits``). The native loops (``lean_kernels.cpp`` and its AVX2
and AVX-512 files) and the Triton kernel (``kernels/lean_triton_kernel.py``) compute the same bits;
``kernels.lean_kernels`` says how each rounding uses them ([Note: stochastic rounding of the 8-bit
states]).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_STATE_MUL = 0x9E3779B9  # [Note: stochastic rounding of the 8-bit states]


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
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of the stochastic rounding of step ``step`` with seed ``seed`` (any
    ints >= 0; ``seed`` up to 64 bits): a unit should get its own seed, e.g. the run's seed
    hashed with the unit's index. See [Note: counter-based stochastic rounding]."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return _hash32_int(_hash32_int(_hash32_int(lo) ^ hi) + (step & MASK32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_rounding_bits(
    key: int, counter_offset: int, n: int, device: torch.device | None = None
) -> torch.Tensor:
    """The 32 random bits (n,) int64 of elements counter_offset .. counter_offset + n - 1."""
    index = torch.arange(counter_offset, counter_offset + n, dtype=torch.int64, device=device)
    return _hash32((_hash32((index & MASK32) ^ key) + (index >> 32)) & MASK32)


def bf16_stochastic(x: torch.Tensor, u16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically with 16 random bits ``u16`` (int64 in [0,
    2**16), same shape) each, as the native ``bf16_stochastic``: up with probability (the
    dropped bits) / 2**16; NaN becomes 0x7FC0, infinity stays (its dropped bits are 0)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
    b = ((u + u16) >> 16) & 0xFFFF
    b = torch.where(torch.isnan(x), 0x7FC0, b)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def round_bf16_torch(x: torch.Tensor, key: int, counter_offset: int) -> torch.Tensor:
    return bf16_stochastic(
        x, stochastic_rounding_bits(key, counter_offset, x.numel(), x.device) >> 16
    )


def _state_bits_of(h: torch.Tensor) -> torch.Tensor:
    """The 8-bit states' 32 random bits (int64, in [0, 2**32)) of an element whose master
    rounding bits (``stochastic_rounding_bits``) are ``h`` (int64, in [0, 2**32), any shape): ``(h ^ h >>
    16) * _STATE_MUL`` mod 2**32, the first moment's u in the top 16, the second's in the
    bottom 16. See [Note: stochastic rounding of the 8-bit states]."""
    return _mul32(h ^ (h >> 16), _STATE_MUL)


def state_bits(key: int, counter_offset: int, n: int, device: torch.device | None) -> torch.Tensor:
    """The 32 random bits (n,) int64 of the 8-bit states' rounding of elements
    counter_offset .. counter_offset + n - 1, from the master's (``_state_bits_of``)."""
    return _state_bits_of(stochastic_rounding_bits(key, counter_offset, n, device))
