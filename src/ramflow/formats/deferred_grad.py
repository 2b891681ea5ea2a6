"""The compact deferred host gradient of the lean host formats: one unit's gradient held
between backward and ``opt.step()`` as 8-bit block-wise codes.

[Note: the compact deferred gradient]
Under the gradient ring (``HostPrecision(gradients="ring")``) a unit's gradient is stepped
as it lands, so no host gradient buffer grows with the model. A step that cannot run
during backward (a global-norm clip needs every gradient first) holds each unit's gradient
from its landing to ``opt.step()``: in the master's dtype that is 2 bytes per parameter
under bf16 masters, half again the lean store's 4.03. Where the masters are already
approximate (``MasterFormat.exact`` False: bf16 with stochastic rounding or Kahan
compensation), the gradient is held as the 8-bit states are held: per block of ``QBLOCK``
(256) elements one fp32 power-of-two scale taken from the block's absmax and 256 FP8 E4M3
codes, rounded stochastically with the counter-based random bits of the states
(``kernels.random_bits``; key from the unit's rounding seed, its optimizer step and the
micro-batch, so a run is reproducible and resumes with the same bits). That is ``1 + 4 / 256`` bytes per parameter. The rounding is
unbiased (E[decode(encode(g))] = g), each element within one E4M3 spacing (2**-3 of its
magnitude; for values below 2**-6 of the block's scale, 2**-9 of the scale). fp32 masters
keep the exact buffer in their own dtype.

Written from the ring's staging buffer as the unit's gradient lands (``encode``), so the
clip's norm, which is read from the device gradients before their D2H (see [Note: the
norm from the device gradients] in ``engine.grad_norms``), is the norm of the exact
gradients; read back by the unit's deferred step (``decode_into`` a ring staging buffer,
exact in bf16), which applies the clip's coefficient as it reads it (see [Note: folding the clip into the
step] in ``engine.grad_scale``). Both run in pieces of ``PIECE`` elements, so their
temporaries are a fixed few MB whatever the unit's size. Its accuracy against fp32 masters:
docs/host-precision.md, "The compact deferred gradient (clipping, accumulation)".
"""

from __future__ import annotations

import torch

from ..kernels.lean_kernels import QBLOCK, dequantize_blockwise, quantize_blockwise_sr, rounding_key
from ..kernels.random_bits import stochastic_rounding_bits

__all__ = ["COMPACT_GRAD_BYTES_PER_PARAM", "CompactGradient"]

# codes (1 byte) and one fp32 scale per block, per element
COMPACT_GRAD_BYTES_PER_PARAM = 1 + 4 / QBLOCK
# elements per piece of ``encode``/``decode_into`` (a multiple of QBLOCK): their temporaries
# (fp32 values, int64 random bits and codes) take about 40 bytes per element of a piece
PIECE = 1 << 16
# mixed into the unit's rounding seed, so the gradient's random bits are not those of the
# master's or the states' rounding in the same step
_SALT = 0x5DEECE66D


def compact_nbytes(numel: int) -> int:
    """Bytes of a compact gradient of ``numel`` elements: codes and block scales."""
    return numel + 4 * -(-numel // QBLOCK)


class CompactGradient:
    """One unit's gradient between its landing and its deferred step, in 8-bit block-wise
    codes. See [Note: the compact deferred gradient].

    Args:
        numel: the unit's trainable elements (its flat gradient's length).
        seed: the unit's rounding seed (``Unit.rounding_seed``, an int in [0, 2**64)).

    Attributes:
        codes: (numel,) uint8 FP8 E4M3 codes, on the host.
        scales: (ceil(numel / QBLOCK),) fp32 power-of-two block scales, on the host.
        step: the optimizer step (of the unit's states) whose gradient it holds, and
            micro: the micro-batches added to it since ``encode`` (the rounding key's).
        held: it holds a gradient not stepped yet (``encode`` sets it; the step that takes
            it, or ``zero_grad``, clears it).
        scale: a clip's coefficient (an fp32 value; None: no clip since the last
            ``encode``), which the step multiplies the decoded gradient by as it reads it
            (its ``grad_scale``, see [Note: folding the clip into the step] in
            ``engine.grad_scale``).
    """

    def __init__(self, numel: int, *, seed: int) -> None:
        self.codes = torch.empty(numel, dtype=torch.uint8)
        self.scales = torch.empty(-(-numel // QBLOCK), dtype=torch.float32)
        self.step = 0
        self.micro = 0
        self.held = False
        self.scale: float | None = None
        self._seed = (seed ^ _SALT) % 2**64

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def nbytes(self) -> int:
        return compact_nbytes(self.numel)

    @torch.no_grad()
    def encode(self, grad: torch.Tensor, *, step: int) -> None:
        """Write ``grad`` ((numel,) fp32, bf16 or fp16 on the host: a staging buffer) as
        codes with stochastic rounding; ``step``: the unit's optimizer step count (an int
        >= 0), part of the rounding key.

        Raises:
            ValueError: ``grad`` has another number of elements.
        """
        n = self.numel
        if grad.numel() != n:
            raise ValueError(f"a gradient of {grad.numel()} elements for a buffer of {n}")
        self.step, self.micro = step, 0
        key = self._key()
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            u16 = stochastic_rounding_bits(key, lo, hi - lo) >> 16
            codes, scales = quantize_blockwise_sr(grad[lo:hi], signed=True, u16=u16)
            self.codes[lo:hi] = codes
            self.scales[lo // QBLOCK : -(-hi // QBLOCK)] = scales
        self.held = True
        self.scale = None

    @torch.no_grad()
    def accumulate(self, grad: torch.Tensor) -> None:
        """Add ``grad`` (as for ``encode``) to the held gradient: each piece decoded, added
        in fp32 and encoded again with stochastic rounding (unbiased, as ``encode``), so
        gradient accumulation holds no buffer in the master's dtype.

        Raises:
            ValueError: ``grad`` has another number of elements.
        """
        n = self.numel
        if grad.numel() != n:
            raise ValueError(f"a gradient of {grad.numel()} elements for a buffer of {n}")
        assert self.held, "accumulate onto a held gradient"
        # clipped before this gradient came: PyTorch scaled p.grad in place, then added
        factor = None if self.scale is None else torch.tensor(self.scale, dtype=torch.float32)
        self.scale = None
        self.micro += 1
        key = self._key()
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            blocks = slice(lo // QBLOCK, -(-hi // QBLOCK))
            total = dequantize_blockwise(self.codes[lo:hi], self.scales[blocks], signed=True)
            if factor is not None:
                total *= factor
            total += grad[lo:hi].to(torch.float32)
            u16 = stochastic_rounding_bits(key, lo, hi - lo) >> 16
            codes, scales = quantize_blockwise_sr(total, signed=True, u16=u16)
            self.codes[lo:hi] = codes
            self.scales[blocks] = scales

    def _key(self) -> int:
        """The rounding key of (step, micro-batch): 16 bits of micro-batches per step."""
        return rounding_key(self._seed, (self.step << 16) + min(self.micro, 0xFFFF))

    @torch.no_grad()
    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """The gradient's values written into ``out`` ((numel,) float tensor on the host, e.g.
        a staging buffer in the wire dtype; FP8 codes times a power of two are exact in
        bf16 and fp32), without the clip's ``scale``. Returns ``out``."""
        n = self.numel
        assert out.numel() == n, (out.numel(), n)
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            scales = self.scales[lo // QBLOCK : -(-hi // QBLOCK)]
            out[lo:hi] = dequantize_blockwise(self.codes[lo:hi], scales, signed=True)
        return out

    @torch.no_grad()
    def span_norms(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The 2-norms of the held gradient's slices ``[lo, hi)`` (``spans``: element
        offsets in the flat gradient, in increasing order, not overlapping), without the
        clip's ``scale``: (len(spans),) fp32 on the host. Decoded piece by piece, as
        ``decode_into``, so the temporaries stay a few MB whatever the unit's size; the
        squares are summed in fp32 per piece, the pieces' sums in fp64."""
        sums = torch.zeros(len(spans), dtype=torch.float64)
        n = self.numel
        first = 0  # the first span that may still overlap a piece
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            while first < len(spans) and spans[first][1] <= lo:
                first += 1
            if first == len(spans):
                break
            if spans[first][0] >= hi:
                continue
            scales = self.scales[lo // QBLOCK : -(-hi // QBLOCK)]
            piece = dequantize_blockwise(self.codes[lo:hi], scales, signed=True)
            for k in range(first, len(spans)):
                a, b = spans[k]
                if a >= hi:
                    break
                part = piece[max(a, lo) - lo : min(b, hi) - lo]
                sums[k] += float(torch.dot(part, part))
        return sums.sqrt().to(torch.float32)

    def values(self) -> torch.Tensor:
        """The gradient's values as its step reads them, a clip's ``scale`` applied (an
        fp32 multiply): a new (numel,) fp32 tensor (for tests and inspection)."""
        out = self.decode_into(torch.empty(self.numel, dtype=torch.float32))
        return out if self.scale is None else out * torch.tensor(self.scale, dtype=out.dtype)
