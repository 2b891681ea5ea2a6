"""The Triton kernel of ``formats.frozen``' int8 dequantize on a GPU (imported on first
use: it imports Triton, which CPU-only PyTorch installs do not have). See [Note: one
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
