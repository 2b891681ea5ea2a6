"""The Triton kernel of ``_lean_triton`` (imported by it on first use: it imports Triton,
which CPU-only PyTorch installs do not have). See [Note: the same bits on the GPU]."""

import triton
import triton.language as tl


@triton.jit
def _hash32(x):
    # "lowbias32" (C. Wellons) on uint32, as _cpu_kernels.cpp's hash32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _bf16_nearest(x):
    # fp32 -> bf16 rounded to nearest even, in integer bits as c10::BFloat16 does (NaN to
    # 0x7FC0); written out so that the interpreter (TRITON_INTERPRET=1, the CPU tests) and
    # the GPU give the same bits
    u = x.to(tl.uint32, bitcast=True)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC0, tl.uint16), b)
    return b.to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize(x, table_ptr):
    # the native quantizer: see [Note: 8-bit codes in one lookup] in _cpu_kernels.cpp
    u = x.to(tl.uint32, bitcast=True)
    entry = tl.load(table_ptr + (u >> 16)).to(tl.uint32, bitcast=True)
    neg = tl.where((u >> 31) != 0, tl.full(u.shape, 0xFFFF, tl.uint32), 0)
    order = (u ^ neg) & 0xFFFF
    return ((entry & 0xFF) + tl.where(order > (entry >> 16), 1, 0).to(tl.uint32)).to(tl.uint8)


@triton.jit(do_not_specialize=["n", "counter_offset", "key"])
def lean_adamw_kernel(
    master_ptr, comp_ptr, grad_ptr, m_ptr, v_ptr, m_absmax_ptr, v_absmax_ptr,
    signed_code_ptr, unsigned_code_ptr, signed_table_ptr, unsigned_table_ptr, wire_ptr,
    n, counter_offset, key,
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
    neg_step_size, grad_scale,
    MASTER: tl.constexpr,  # 0 fp32, 1 bf16 stochastic rounding, 2 bf16 Kahan
    STATE: tl.constexpr,  # 0 fp32, 1 bf16, 2 8-bit block-wise
    WIRE: tl.constexpr,  # 0 none, 1 bf16, 2 fp16 (fp32 masters only)
    APPLY_SCALE: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = idx < n
    row_mask = rows * BLOCK < n

    g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if APPLY_SCALE:
        g = g * grad_scale
    p = tl.load(master_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if MASTER == 2:
        p = p + tl.load(comp_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if APPLY_DECAY:
        p = p * decay
    if STATE == 2:
        mq = tl.load(m_ptr + idx, mask=mask, other=0).to(tl.int32)
        vq = tl.load(v_ptr + idx, mask=mask, other=0).to(tl.int32)
        ma = tl.load(m_absmax_ptr + rows, mask=row_mask, other=0.0)
        va = tl.load(v_absmax_ptr + rows, mask=row_mask, other=0.0)
        m = tl.load(signed_code_ptr + mq) * ma[:, None]
        v = tl.load(unsigned_code_ptr + vq) * va[:, None]
    else:
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * one_minus_beta2) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(m * neg_step_size, denom)

    if STATE == 2:
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
        m_amax = tl.max(tl.abs(m), axis=1)
        v_amax = tl.max(tl.abs(v), axis=1)
        tl.store(m_absmax_ptr + rows, m_amax, mask=row_mask)
        tl.store(v_absmax_ptr + rows, v_amax, mask=row_mask)
        m_scale = tl.where(m_amax > 0.0, m_amax, 1.0)
        v_scale = tl.where(v_amax > 0.0, v_amax, 1.0)
        mq = _quantize(tl.div_rn(m, m_scale[:, None]), signed_table_ptr)
        vq = _quantize(tl.div_rn(v, v_scale[:, None]), unsigned_table_ptr)
        tl.store(m_ptr + idx, mq, mask=mask)
        tl.store(v_ptr + idx, vq, mask=mask)
    elif STATE == 1:
        tl.store(m_ptr + idx, _bf16_nearest(m), mask=mask)
        tl.store(v_ptr + idx, _bf16_nearest(v), mask=mask)
    else:
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)

    if MASTER == 0:
        tl.store(master_ptr + idx, p, mask=mask)
        if WIRE == 1:
            tl.store(wire_ptr + idx, _bf16_nearest(p), mask=mask)
        elif WIRE == 2:
            tl.store(wire_ptr + idx, p.to(tl.float16), mask=mask)
    elif MASTER == 1:
        # stochastic rounding: see [Note: counter-based stochastic rounding]
        counter = idx + counter_offset
        k = key.to(tl.uint32)
        bits = _hash32(_hash32(counter.to(tl.uint32) ^ k) + (counter >> 32).to(tl.uint32))
        u = p.to(tl.uint32, bitcast=True)
        b = ((u + (bits >> 16)) >> 16).to(tl.uint16)
        b = tl.where(p != p, tl.full(b.shape, 0x7FC0, tl.uint16), b)
        tl.store(master_ptr + idx, b.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        hi = _bf16_nearest(p)
        tl.store(master_ptr + idx, hi, mask=mask)
        tl.store(comp_ptr + idx, _bf16_nearest(p - hi.to(tl.float32)), mask=mask)
