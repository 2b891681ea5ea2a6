"""The Triton kernels of ``formats.frozen``' int8 and MXFP4 dequantize on a GPU (imported on
first use: it imports Triton, which CPU-only PyTorch installs do not have). See [Note: one
dequantize kernel] in ``formats.frozen``."""

import triton
import triton.language as tl

from .lean_triton_kernel import bf16_nearest


@triton.jit(do_not_specialize=["num_blocks"])
def int8_dequantize_kernel(
    codes_ptr,
    absmax_ptr,
    out_ptr,
    num_blocks,
    OUT: tl.constexpr,
    QBLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # ROWS quantization blocks of QBLOCK elements per program: codes (ROWS, QBLOCK) int8,
    # one bf16 absmax per row; out = code * (absmax / 127), the division correctly rounded
    # and once per block, the product rounded once to OUT (0 fp32, 1 bf16, 2 fp16)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_blocks
    scale = tl.div_rn(tl.load(absmax_ptr + rows, mask=row_ok, other=0).to(tl.float32), 127.0)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    ok = row_ok[:, None]
    x = tl.load(codes_ptr + offs, mask=ok, other=0).to(tl.float32) * scale[:, None]
    if OUT == 1:
        tl.store(out_ptr + offs, bf16_nearest(x), mask=ok)
    elif OUT == 2:
        tl.store(out_ptr + offs, x.to(tl.float16), mask=ok)
    else:
        tl.store(out_ptr + offs, x, mask=ok)


@triton.jit
def _e2m1_times_scale(code, scale):
    # an E2M1 code (int32, 0-15: sign, two exponent bits, one mantissa bit) as fp32 bits,
    # then one fp32 product with its scale (exact: a power of two)
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23) | (m << 22)  # (1 + m/2) * 2**(e - 1)
    half = m * 0x3F000000  # e = 0: 0 or 0.5
    bits = tl.where(e == 0, half, normal) | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit(do_not_specialize=["num_bytes", "width"])
def mxfp4_dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    num_bytes,
    width,
    OUT: tl.constexpr,
    BYTES: tl.constexpr,
):
    # BYTES code bytes (2 * BYTES elements, the low nibble first) per program; element i's
    # E8M0 scale is scales[(i // (32 * width)) * width + i % width] (width 1: blocks of 32
    # consecutive elements; C: blocks down the columns of a (M, R, C) weight), as fp32 from
    # its bits (0: 2**-127, fp32's subnormal 0x00400000). Each value is rounded once to OUT
    # (0 fp32, 1 bf16, 2 fp16), as ``formats.mxfp4.dequantize`` rounds it.
    b = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    ok = b < num_bytes
    byte = tl.load(codes_ptr + b, mask=ok, other=0).to(tl.int32)
    i = tl.interleave(2 * b, 2 * b + 1)
    code = tl.interleave(byte & 15, byte >> 4)
    ok2 = tl.interleave(ok, ok)
    group = 32 * width
    s = tl.load(scales_ptr + (i // group) * width + i % width, mask=ok2, other=127).to(tl.int32)
    scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    x = _e2m1_times_scale(code, scale)
    if OUT == 1:
        tl.store(out_ptr + i, bf16_nearest(x), mask=ok2)
    elif OUT == 2:
        tl.store(out_ptr + i, x.to(tl.float16), mask=ok2)
    else:
        tl.store(out_ptr + i, x, mask=ok2)
