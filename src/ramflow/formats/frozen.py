"""Compressed frozen weights: int8 block-wise absmax, NF4 and MXFP4
(``offload(frozen_format=...)``).

A unit's frozen matrices (``requires_grad=False``, two or more dimensions, not an
embedding's) can be kept on the host compressed instead of in the master's dtype; the H2D
copy moves the compressed bytes and the device dequantizes them into the unit's slot. See
[Note: compressed frozen weights].

Legend: n = a parameter's element count padded to ``units.unit.ALIGN`` (its slot in the unit's
flat layout), B = n / block.

[Note: compressed frozen weights]
Each compressed unit has one flat uint8 host buffer (pinned on a GPU) holding, parameter
after parameter, every component of its format, each on a 64-byte boundary:
- ``"int8"``: codes int8 (n,) and one bf16 absmax per block of 64 (B,). The absmax is
  rounded *up* to bf16, so no element exceeds it and ``q = round(w / (absmax / 127))`` needs
  no clamp; ``|w - q * absmax / 127| <= absmax / 254`` (plus fp32 rounding) for the stored
  absmax, which is at most ``1 + 2**-7`` times the block's true one. 1.03 bytes per element.
- ``"nf4"``: torchao's ``NF4Tensor`` (QLoRA, Dettmers et al. 2023: 4-bit NormalFloat codes
  in blocks of 64, their absmax double-quantized to int8 in blocks of 256 absmax), made by
  ``torchao``'s ``to_nf4`` from the values in the wire dtype: codes (n/2,), int8 scalers
  (B,), the scaler blocks' factors and the scalers' mean in the wire dtype. 0.52 bytes per
  element. Dequantized by torchao's own ``get_original_weight``, in chunks of whole scaler
  blocks so that its temporaries stay small.
- ``"mxfp4"``: OCP MX v1.0's MXFP4 (``ramflow.formats.mxfp4``): E2M1 codes (n/2,) and one
  E8M0 scale per block of 32 (n/32,), 0.53 bytes (4.25 bits) per element; dequantized by
  PyTorch ops into the wire dtype (one fp32 product per element, rounded once). Made by
  ``mxfp4.quantize`` from any weight (blocks along its last dimension), or kept as they
  come from a gpt-oss checkpoint's packed experts (``write_mxfp4``: blocks along
  dimension -2, the checkpoint's codes and scales unchanged), so a gpt-oss model computes
  with the values transformers dequantizes, bit for bit, from 4.25 bits a weight in RAM.
The unit's master and wire copy hold only the elements before the compressed parameters
(``Unit.kept_numel``), so a compressed weight never exists on the host in full precision,
not even while it is loaded from the meta device (one parameter at a time is read, then
compressed). The window copies the buffer into a device staging buffer on the H2D stream
and dequantizes it there, into the unit's device tensor after the kept elements, before it
records the unit's H2D event; on the CPU the same code dequantizes from the host buffer.
The host parameters of compressed weights are on the meta device (shape and dtype, no
data): whatever reads their values fails as a meta tensor does, never silently wrong;
``state_dict()`` dequantizes them, ``load_state_dict`` compresses what it is given (but
keeps a parameter's bytes when given exactly its dequantized values, so that a model's own
``state_dict()`` loads back bit for bit: re-quantizing is no fixed point), and
``ramflow.undo`` gives them back dequantized in their original dtype.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable

import torch
from torch import nn

from ..choices import FROZEN_FORMATS
from . import mxfp4

INT8_BLOCK = 64
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
# every component of the host buffer starts on a multiple of this many bytes
_BYTE_ALIGN = 64
# elements dequantized at a time by torchao's NF4 code (its temporaries: about 20 bytes each)
_NF4_CHUNK = NF4_BLOCK * NF4_SCALER_BLOCK * 64


def parse_frozen_format(value: str | None) -> str | None:
    """Check ``offload(frozen_format=...)``: None, ``"int8"``, ``"nf4"`` or ``"mxfp4"``.

    Raises:
        ValueError: another value (the message lists the formats).
        TypeError: not a string.
        ImportError: ``"nf4"`` without torchao (the message says how to install it).
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"frozen_format must be None, 'int8', 'nf4' or 'mxfp4', got {value!r}")
    if value not in FROZEN_FORMATS:
        raise ValueError(
            f"frozen_format={value!r} is not a format; use 'int8' (block-wise absmax, about "
            "1.03 bytes per frozen parameter), 'nf4' (QLoRA's 4-bit NormalFloat through "
            "torchao, about 0.52), 'mxfp4' (OCP MX 4-bit floats, as gpt-oss ships its experts, "
            "about 0.53), or None (frozen parameters in the wire dtype)"
        )
    if value == "nf4":
        _nf4_module()
    return value


def check_frozen_format(fmt: str, specs: list, *, zero_stage: int | None) -> None:
    """Refuse ``frozen_format`` where it cannot apply: with ``zero_stage`` (its shared
    host store holds full-precision weights), or with nothing to compress.

    Args:
        fmt: the parsed format.
        specs: the model's ``UnitSpec`` list (``find_units``).
        zero_stage: ``offload``'s.

    Raises:
        ValueError: as above; the message says what to do.
    """
    if zero_stage is not None:
        raise ValueError(
            f"frozen_format={fmt!r} cannot be combined with zero_stage yet (the ranks share "
            "a full-precision host store); leave one of them out"
        )
    params = [p for s in specs for p in s.owned]
    embeddings = set().union(*(embedding_params(s.slots) for s in specs))
    if not any(compresses(p, embeddings) for p in params):
        trainable = sum(p.requires_grad for p in params)
        raise ValueError(
            f"frozen_format={fmt!r} compresses frozen matrices only (requires_grad=False, "
            "two or more dimensions, not embeddings) and this model has none"
            + (
                f" ({trainable} of its {len(params)} parameters are trainable, and ramflow "
                "never quantizes a trainable parameter)"
                if trainable
                else ""
            )
            + ". Freeze the weights you do not train first (PEFT's get_peft_model does), "
            "or leave frozen_format out"
        )


def _nf4_module():
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ImportError(
            "frozen_format='nf4' uses torchao's NF4 format, and torchao is not importable "
            f"({err}). Install it (pip install torchao), or use frozen_format='int8'."
        ) from err
    return nf4_tensor


def embedding_params(slots: list[tuple[nn.Module, str]]) -> set[int]:
    """ids of the parameters that an ``nn.Embedding`` among ``slots`` holds: they stay
    uncompressed, as QLoRA leaves them (and ``model.device`` of a Hugging Face model is its
    first parameter's, the input embedding's)."""
    return {
        id(module._parameters[name])
        for module, name in slots
        if isinstance(module, nn.Embedding) and module._parameters.get(name) is not None
    }


def compresses(p: nn.Parameter, embeddings: set[int]) -> bool:
    """Whether ``p`` is compressed under a frozen format: frozen, a matrix (or more), and
    not an embedding's (norms and biases are tiny and lose most from 4 bits)."""
    return not p.requires_grad and p.dim() >= 2 and id(p) not in embeddings


def _up(nbytes: int) -> int:
    return -(-nbytes // _BYTE_ALIGN) * _BYTE_ALIGN


def _nf4_scaler_block(n: int) -> int:
    """torchao's scaler block for ``n`` padded elements: 256 absmax, or fewer where the
    parameter has fewer blocks (it must divide them)."""
    return math.gcd(n // NF4_BLOCK, NF4_SCALER_BLOCK)


def _components(fmt: str, n: int, wire_dtype: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, element count) of each component of one parameter of ``n`` elements."""
    if fmt == "int8":
        return [("codes", torch.int8, n), ("absmax", torch.bfloat16, n // INT8_BLOCK)]
    if fmt == "mxfp4":
        return [("codes", torch.uint8, n // 2), ("scales", torch.uint8, n // mxfp4.MX_BLOCK)]
    blocks = n // NF4_BLOCK
    return [
        ("quantized_data", torch.uint8, n // 2),
        ("quantized_scalers", torch.int8, blocks),
        ("quantization_factor", wire_dtype, blocks // _nf4_scaler_block(n)),
        ("scaler_mean", wire_dtype, 1),
    ]


def compressed_nbytes(fmt: str, n: int, wire_dtype: torch.dtype) -> int:
    """Host (and PCIe) bytes of one parameter of ``n`` padded elements under ``fmt``."""
    return sum(_up(k * dt.itemsize) for _, dt, k in _components(fmt, n, wire_dtype))


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise absmax int8 of ``x`` (n,), n a multiple of ``INT8_BLOCK``, any float dtype.

    Returns codes int8 (n,) and absmax bf16 (B,), each block's absmax rounded up to bf16
    (so ``|x| <= absmax`` and no code is clamped). See [Note: compressed frozen weights]."""
    blocks = x.detach().float().view(-1, INT8_BLOCK)
    amax = blocks.abs().amax(dim=1)
    # round up to bf16: add all ones below bf16's 16 bits, then drop them (amax >= 0)
    bits = (amax.view(torch.int32) + 0xFFFF) & ~0xFFFF
    amax = bits.view(torch.float32)
    scale = amax / 127
    codes = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None])
    return codes.to(torch.int8).view(-1), amax.to(torch.bfloat16)


# [Note: one dequantize kernel]
# On a GPU the int8 dequantize of every unit runs beside the model's kernels (on the
# decompression stream). As PyTorch ops (an int8 tensor times a broadcast fp32 scale, into
# bf16) it is PyTorch's generic strided elementwise kernel: milliseconds per 70B layer, the
# SMs taken from the LoRA step's matmuls for as long, and the last layer's dequantize a tail
# no copy hides (docs/speed.md, "One dequantize kernel").
# Where Triton is importable, one kernel (``kernels.dequant_triton_kernel``) reads each code and
# absmax once and writes each output once. Same arithmetic, same bits: the scale is
# absmax / 127 correctly rounded in fp32 (``tl.div_rn``), the product one fp32 multiply
# rounded once to the output dtype, bf16 rounded to nearest even in integer bits as the
# lean kernel does. Tests compare the two (interpreted in CI, compiled on the GPU).
# MXFP4 likewise: as PyTorch ops (a table gather into fp32 pairs, then the scale's
# multiply) it reads and writes about 18 bytes per weight where one kernel
# (``mxfp4_dequantize_kernel``) reads 0.53 and writes 2; the same products, rounded once.
# ``RAMFLOW_DISABLE_TRITON=1`` keeps the PyTorch ops.
_TRITON_ROWS = 32  # blocks of 64 per program: 2048 elements
_TRITON_MXFP4_BYTES = 1024  # code bytes per program: 2048 elements
_TRITON_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _triton_dequantize():
    """The jitted int8 dequantize kernel, or None where Triton cannot be imported."""
    try:
        from ..kernels.dequant_triton_kernel import int8_dequantize_kernel
    except ImportError:
        return None
    return int8_dequantize_kernel


@functools.cache
def _triton_mxfp4():
    """The jitted MXFP4 dequantize kernel, or None where Triton cannot be imported."""
    try:
        from ..kernels.dequant_triton_kernel import mxfp4_dequantize_kernel
    except ImportError:
        return None
    return mxfp4_dequantize_kernel


def mxfp4_dequantize_triton(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, width: int = 1
) -> None:
    """``mxfp4.dequantize`` (same arguments, no table) as one Triton launch, on any device
    Triton runs on (the CPU interpreter in the tests). See [Note: one dequantize kernel]."""
    num_bytes = codes.numel()
    assert out.numel() == 2 * num_bytes == scales.numel() * mxfp4.MX_BLOCK
    grid = (-(-num_bytes // _TRITON_MXFP4_BYTES),)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _triton_mxfp4()[grid](
            codes,
            scales,
            out,
            num_bytes,
            width,
            OUT=_TRITON_OUT[out.dtype],
            BYTES=_TRITON_MXFP4_BYTES,
            num_warps=4,
            enable_fp_fusion=False,
        )


def int8_dequantize(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``codes`` (n,) int8 times their block's ``absmax`` (B,) / 127 into ``out`` (n,),
    fp32, bf16 or fp16, on their device: one multiply in fp32 per element, rounded once to
    ``out``'s dtype (so the CPU and a GPU give the same bits). On a CUDA device, one Triton
    kernel where Triton is importable (see [Note: one dequantize kernel])."""
    if out.is_cuda and _use_triton(out):
        _dequantize_triton(codes, absmax, out)
        return
    # a divisor on the tensors' device: PyTorch's CUDA division by a Python or CPU scalar
    # multiplies by its reciprocal, which is not correctly rounded (not the CPU's bits)
    scale = absmax.float() / torch.full((), 127.0, device=absmax.device)
    torch.mul(codes.view(-1, INT8_BLOCK), scale[:, None], out=out.view(-1, INT8_BLOCK))


def _use_triton(out: torch.Tensor) -> bool:
    if os.environ.get("RAMFLOW_DISABLE_TRITON", "") not in ("", "0"):
        return False
    return out.dtype in _TRITON_OUT and _triton_dequantize() is not None


def _dequantize_triton(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> None:
    """``int8_dequantize`` as one Triton launch (any device Triton runs on: the CPU
    interpreter in the tests)."""
    num_blocks = absmax.numel()
    assert codes.numel() == out.numel() == num_blocks * INT8_BLOCK
    grid = (-(-num_blocks // _TRITON_ROWS),)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _triton_dequantize()[grid](
            codes,
            absmax,
            out,
            num_blocks,
            OUT=_TRITON_OUT[out.dtype],
            QBLOCK=INT8_BLOCK,
            ROWS=_TRITON_ROWS,
            num_warps=4,
            enable_fp_fusion=False,
        )


class FrozenStore:
    """One unit's compressed frozen parameters: a flat uint8 host buffer and its layout.

    Args:
        fmt: ``"int8"``, ``"nf4"`` or ``"mxfp4"``.
        params: the compressed parameters, in the unit's order.
        numels: their padded element counts (``units.unit.ALIGN``).
        wire_dtype: the dtype they are dequantized into (NF4 is quantized from it).
        alloc: ``alloc(nbytes)``: a flat uint8 host tensor (pinned on a GPU).
    """

    def __init__(
        self,
        fmt: str,
        params: list[nn.Parameter],
        numels: list[int],
        *,
        wire_dtype: torch.dtype,
        alloc: Callable[[int], torch.Tensor],
    ) -> None:
        self.fmt = fmt
        self.wire_dtype = wire_dtype
        self.shapes = [p.shape for p in params]
        self.numels = numels
        # per parameter: whether its MXFP4 blocks run along dimension -2 (a checkpoint's)
        self.columns = [False] * len(numels)
        # per parameter: {component: (byte offset, dtype, count)}
        self._layout: list[dict[str, tuple[int, torch.dtype, int]]] = []
        nbytes = 0
        for n in numels:
            entry = {}
            for name, dtype, count in _components(fmt, n, wire_dtype):
                entry[name] = (nbytes, dtype, count)
                nbytes += _up(count * dtype.itemsize)
            self._layout.append(entry)
        self.nbytes = nbytes
        self._tables: dict[torch.device, torch.Tensor] = {}
        self.host = alloc(nbytes)
        self.host.zero_()

    def _part(self, buf: torch.Tensor, i: int, name: str) -> torch.Tensor:
        off, dtype, count = self._layout[i][name]
        return buf[off : off + count * dtype.itemsize].view(dtype)

    def write(self, i: int, values: torch.Tensor) -> None:
        """Compress ``values`` (the shape of parameter ``i``, any float dtype, CPU) into
        the host buffer. The caller waits for a DMA that reads the buffer first."""
        n = self.numels[i]
        if self.fmt == "mxfp4":
            self._write_mxfp4_values(i, values)
            return
        flat = torch.zeros(n, dtype=torch.float32 if self.fmt == "int8" else self.wire_dtype)
        flat[: values.numel()] = values.detach().reshape(-1)
        if self.fmt == "int8":
            codes, absmax = int8_quantize(flat)
            self._part(self.host, i, "codes").copy_(codes)
            self._part(self.host, i, "absmax").copy_(absmax)
            return
        nf4 = _nf4_module().to_nf4(flat, NF4_BLOCK, _nf4_scaler_block(n))
        for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
            self._part(self.host, i, name).copy_(getattr(nf4, name).reshape(-1))
        self._part(self.host, i, "scaler_mean").copy_(nf4.scaler_mean.reshape(-1))

    def _write_mxfp4_values(self, i: int, values: torch.Tensor) -> None:
        """``write`` under MXFP4: blocks along the rows, or along the columns where the
        parameter came so from a checkpoint (``write_mxfp4``)."""
        codes, scales = self._part(self.host, i, "codes"), self._part(self.host, i, "scales")
        if self.columns[i]:
            shape = self.shapes[i]
            x = values.detach().reshape(-1, shape[-2], shape[-1])
            numel = x.numel()
            q_codes, q_scales = mxfp4.quantize(x, columns=True)
            codes[: numel // 2].copy_(q_codes)
            scales[: numel // mxfp4.MX_BLOCK].copy_(q_scales)
            return
        flat = torch.zeros(self.numels[i], dtype=torch.float32)
        flat[: values.numel()] = values.detach().reshape(-1)
        q_codes, q_scales = mxfp4.quantize(flat)
        codes.copy_(q_codes)
        scales.copy_(q_scales)

    def write_mxfp4(self, i: int, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Store parameter ``i`` from a checkpoint's packed MXFP4 pair (uint8, CPU; shapes
        as ``mxfp4.checkpoint_shape`` reads them, making this parameter's shape): under
        ``"mxfp4"`` the codes and scales as they are, only moved into the parameter's
        order (blocks along dimension -2); under another format their exact values,
        compressed as ``write`` does. See [Note: MXFP4 bytes and their order] in
        ``ramflow.formats.mxfp4``."""
        shape = self.shapes[i]
        assert mxfp4.checkpoint_shape(tuple(blocks.shape), tuple(scales.shape)) == tuple(shape)
        if self.fmt != "mxfp4":
            values = torch.empty(shape, dtype=torch.float32)
            mxfp4_to_values(blocks, scales, values)
            self.write(i, values)
            return
        numel = math.prod(shape)
        self.columns[i] = True
        codes, scale_part = self._part(self.host, i, "codes"), self._part(self.host, i, "scales")
        codes.zero_()
        scale_part.zero_()
        mxfp4.from_checkpoint_layout(
            blocks, scales, codes[: numel // 2], scale_part[: numel // mxfp4.MX_BLOCK]
        )

    def dequantize(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize every parameter from ``src`` (this store's bytes, on any device) into
        ``out``: the unit's flat tensor from its first compressed parameter on
        (sum of ``numels``,) in the wire dtype, on ``src``'s device."""
        lo = 0
        for i, n in enumerate(self.numels):
            self._dequantize_one(src, i, out[lo : lo + n])
            lo += n

    def _dequantize_one(self, src: torch.Tensor, i: int, out: torch.Tensor) -> None:
        if self.fmt == "int8":
            int8_dequantize(self._part(src, i, "codes"), self._part(src, i, "absmax"), out)
            return
        if self.fmt == "mxfp4":
            self._dequantize_mxfp4(src, i, out)
            return
        nf4_tensor = _nf4_module()
        n = self.numels[i]
        sb = _nf4_scaler_block(n)
        data = self._part(src, i, "quantized_data")
        scalers = self._part(src, i, "quantized_scalers")
        factor = self._part(src, i, "quantization_factor")
        mean = self._part(src, i, "scaler_mean").reshape(())
        table = self._nf4_table(src.device)
        chunk = max(NF4_BLOCK * sb, _NF4_CHUNK // (NF4_BLOCK * sb) * (NF4_BLOCK * sb))
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            blocks = (hi - lo) // NF4_BLOCK
            meta = nf4_tensor.SubclassTensorArgs(
                torch.Size([hi - lo]), (1,), 0, self.wire_dtype, src.device, False
            )
            part = nf4_tensor.NF4Tensor(
                meta,
                NF4_BLOCK,
                blocks,
                sb,
                scalers[lo // NF4_BLOCK : hi // NF4_BLOCK],
                factor[lo // (NF4_BLOCK * sb) : hi // (NF4_BLOCK * sb)],
                mean,
                data[lo // 2 : hi // 2],
                table,
            )
            out[lo:hi].copy_(part.get_original_weight())

    def _dequantize_mxfp4(self, src: torch.Tensor, i: int, out: torch.Tensor) -> None:
        codes, scales = self._part(src, i, "codes"), self._part(src, i, "scales")
        numel, width = out.numel(), 1
        if self.columns[i]:
            numel, width = math.prod(self.shapes[i]), self.shapes[i][-1]
            codes, scales = codes[: numel // 2], scales[: numel // mxfp4.MX_BLOCK]
            out[numel:].zero_()
        if out.is_cuda and _use_triton(out) and _triton_mxfp4() is not None:
            mxfp4_dequantize_triton(codes, scales, out[:numel], width=width)
            return
        table = self._tables.get(src.device)
        if table is None:
            table = self._tables[src.device] = mxfp4.pair_table(src.device)
        mxfp4.dequantize(codes, scales, out[:numel], table=table, width=width)

    def _nf4_table(self, device: torch.device) -> torch.Tensor:
        """torchao's 16 NF4 values in the wire dtype on ``device`` (it makes them inside
        ``to_nf4``; one block of ones gives them without a copy of the list here)."""
        table = self._tables.get(device)
        if table is None:
            ones = torch.ones(NF4_BLOCK, dtype=self.wire_dtype, device=device)
            table = self._tables[device] = _nf4_module().to_nf4(ones, NF4_BLOCK, 1).nf4
        return table

    def holds(self, i: int, values: torch.Tensor) -> bool:
        """Whether ``values`` equal parameter ``i`` dequantized, compared in a dtype that
        holds both exactly (no rounding can make them equal).

        ``load_state_dict`` keeps the bytes of a parameter given its own dequantized values
        (its ``state_dict()`` loaded back: a checkpoint resumed): re-quantizing them is no
        fixed point (int8's absmax rounded up to bf16 picks another scale, NF4's double
        quantization moves), so a reload would change the weights. See [Note: compressed
        frozen weights]."""
        if not values.is_floating_point():
            return False
        dtype = torch.promote_types(values.dtype, self.wire_dtype)
        return torch.equal(self.read(i, dtype), values.detach().to("cpu", dtype))

    def read(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``i`` dequantized on the host, a new tensor of its shape in ``dtype``:
        the values the device computes with (``state_dict``, ``undo``)."""
        n = self.numels[i]
        out = torch.empty(n, dtype=self.wire_dtype)
        self._dequantize_one(self.host, i, out)
        shape = self.shapes[i]
        return out[: math.prod(shape)].view(shape).to(dtype, copy=True)


def mxfp4_to_values(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Dequantize a checkpoint's packed MXFP4 pair (``mxfp4.checkpoint_shape``; uint8, CPU)
    into ``out``, the parameter's shape in fp32, bf16 or fp16 (transformers'
    ``convert_moe_packed_tensors``'s values, bit for bit)."""
    numel = out.numel()
    codes = torch.empty(numel // 2, dtype=torch.uint8)
    scale_cols = torch.empty(numel // mxfp4.MX_BLOCK, dtype=torch.uint8)
    mxfp4.from_checkpoint_layout(blocks, scales, codes, scale_cols)
    flat = out.view(-1)
    mxfp4.dequantize(
        codes, scale_cols, flat, table=mxfp4.pair_table(flat.device), width=out.shape[-1]
    )


def meta_stand_in(p: nn.Parameter, dtype: torch.dtype) -> None:
    """Make ``p`` (the same object: optimizers and ties keep it) a meta tensor of its shape
    in ``dtype``: a compressed weight's host parameter. See [Note: compressed frozen
    weights]."""
    holder = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=False)
    torch.utils.swap_tensors(p, holder)


def give_back(p: nn.Parameter, values: torch.Tensor) -> None:
    """Make a meta stand-in ``p`` an ordinary CPU parameter holding ``values`` (``undo``)."""
    holder = nn.Parameter(values, requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, holder)


def raise_if_trained(params: list[nn.Parameter], fmt: str | None) -> None:
    """Raise RuntimeError when a compressed parameter was made trainable after ``offload``:
    its gradient would be dropped silently (the device keeps no gradient for it)."""
    for p in params:
        if p.requires_grad:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} is kept compressed "
                f"(frozen_format={fmt!r}) and was made trainable (requires_grad=True) after "
                "ramflow.offload; ramflow never trains a quantized weight. Set requires_grad "
                "before offloading (undo, change it, offload again), or train an adapter "
                "beside it (LoRA) instead"
            )
