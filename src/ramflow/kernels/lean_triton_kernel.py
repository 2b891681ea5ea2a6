"""The Triton kernel of ``kernels.lean_triton`` (imported by it on first use: it imports Triton,
which CPU-only PyTorch installs do not have). See [Note: the same bits on the GPU]."""

import triton
import triton.language as tl


@triton.jit
def _hash32(x):
    # "lowbias32" (C. Wellons) on uint32, as cpu_kernels.cpp's hash32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def bf16_nearest(x):
    # fp32 -> bf16 rounded to nearest even, in integer bits as c10::BFloat16 does (NaN to
    # 0x7FC0); written out so that the interpreter (TRITON_INTERPRET=1, the CPU tests) and
    # the GPU give the same bits
    u = x.to(tl.uint32, bitcast=True)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC0, tl.uint16), b)
    return b.to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_stochastic(x, u16):
    # fp32 -> bf16 rounded stochastically with the 16 random bits u16 (uint32), as
    # lean_kernels.cpp's bf16_stochastic: up with probability (dropped bits) / 2**16, NaN
    # to 0x7FC0
    u = x.to(tl.uint32, bitcast=True)
    b = ((u + u16) >> 16).to(tl.uint16)
    b = tl.where(x != x, tl.full(b.shape, 0x7FC0, tl.uint16), b)
    return b.to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_decode(c):
    # E4M3 code (uint8) -> fp32, exact: see [Note: FP8 conversions in bits] in
    # lean_kernels.cpp (a subnormal code is rebased by 121 and 2**-6 taken off; 0x7F NaN)
    c = c.to(tl.uint32)
    mag = c & 0x7F
    sub = mag < 8
    bits = (mag << 20) + tl.where(sub, 121 << 23, 120 << 23).to(tl.uint32)
    x = bits.to(tl.float32, bitcast=True)
    x = tl.where(sub, x - 0.015625, x)
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(mag == 0x7F, bits | 0x7F800000, bits)
    return (bits | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_encode(y, SECOND: tl.constexpr):
    # fp32 y -> E4M3 code (uint8), nearest even, infinity and NaN 0x7F; with SECOND without
    # the sign and a code of 0 for a positive y made 1. See [Note: FP8 conversions in bits].
    u = y.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    denorm = tl.full(a.shape, 141 << 23, tl.uint32)
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - denorm
    nrm = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    r = tl.where(a < (121 << 23), sub, nrm)
    r = tl.where(a >= 0x7F800000, tl.full(r.shape, 0x7F, tl.uint32), r)
    if SECOND:
        r = tl.where((r == 0) & (a > 0), tl.full(r.shape, 1, tl.uint32), r)
    else:
        r = r | ((u >> 24) & 0x80)
    return r.to(tl.uint8)


@triton.jit
def _fp8_stochastic(y, u16, SECOND: tl.constexpr):
    # y rounded onto the E4M3 grid stochastically with the 16 random bits u16 (uint32), as
    # lean_kernels.cpp's fp8_stochastic: see [Note: stochastic rounding of the 8-bit
    # states] in kernels/lean_kernels.py. Powers of two from their bits; t exact; one fp32 add
    # (a fused multiply-add would give the same: u16 * 2**-16 is exact)
    yb = y.to(tl.uint32, bitcast=True)
    a = yb & 0x7FFFFFFF
    eb = tl.maximum(a >> 23, tl.full(a.shape, 121, tl.uint32))
    t = a.to(tl.float32, bitcast=True) * ((257 - eb) << 23).to(tl.float32, bitcast=True)
    k = tl.floor(t + u16.to(tl.float32) * 1.52587890625e-05)
    if SECOND:
        k = tl.where((t > 0.0) & (k == 0.0), 1.0, k)
    r = (k * ((eb - 3) << 23).to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True)
    r = (r | (yb & tl.full(yb.shape, 0x80000000, tl.uint32))).to(tl.float32, bitcast=True)
    return tl.where(a >= 0x7F800000, y, r)


@triton.jit
def _fp8_scale_exponent(amax):
    # the block scale's exponent: see [Note: 8-bit states in FP8 with power-of-two block
    # scales] in kernels/lean_kernels.py
    e = ((amax.to(tl.uint32, bitcast=True) + 0x1FFFFF) >> 23).to(tl.int32) - 135
    return tl.maximum(e, -126)


@triton.jit(do_not_specialize=["n", "counter_offset", "key"])
def lean_adamw_kernel(
    # one row per group (pointers, sizes, hyperparameters, constants); the launch in
    # kernels.lean_triton passes the same rows
    master_ptr, comp_ptr, grad_ptr, m_ptr, v_ptr, m_scale_ptr, v_scale_ptr,
    wire_ptr,
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
        mq = tl.load(m_ptr + idx, mask=mask, other=0)
        vq = tl.load(v_ptr + idx, mask=mask, other=0)
        ms = tl.load(m_scale_ptr + rows, mask=row_mask, other=0.0)
        vs = tl.load(v_scale_ptr + rows, mask=row_mask, other=0.0)
        m = _fp8_decode(mq) * ms[:, None]
        u = _fp8_decode(vq) * vs[:, None]
        v = u * u
    else:
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * one_minus_beta2) * g
    sq = tl.sqrt_rn(v)
    denom = tl.div_rn(sq, bc2_sqrt) + eps
    p = p + tl.div_rn(m * neg_step_size, denom)

    if STATE != 0:
        # bf16 and 8-bit states round stochastically: see [Note: stochastic rounding of the
        # 8-bit states]; 32 bits per element, the master's rounding bits h as (h ^ h >> 16)
        # * C, the first moment's u the top 16, the second's the bottom 16
        counter = idx + counter_offset
        k = key.to(tl.uint32)
        h = _hash32(_hash32(counter.to(tl.uint32) ^ k) + (counter >> 32).to(tl.uint32))
        state_bits = (h ^ (h >> 16)) * tl.full(h.shape, 0x9E3779B9, tl.uint32)
    if STATE == 2:
        m = tl.where(mask, m, 0.0)
        sq = tl.where(mask, sq, 0.0)
        # NaN left out of the absmax, as the CPU's running max leaves it (written out: a
        # reduction's NaN handling differs between the GPU and the interpreter)
        me = _fp8_scale_exponent(tl.max(tl.where(m != m, 0.0, tl.abs(m)), axis=1))
        ve = _fp8_scale_exponent(tl.max(tl.where(sq != sq, 0.0, sq), axis=1))
        # 2**e and 2**-e from their bits (exact): see the note
        tl.store(m_scale_ptr + rows, ((me + 127) << 23).to(tl.float32, bitcast=True), mask=row_mask)
        tl.store(v_scale_ptr + rows, ((ve + 127) << 23).to(tl.float32, bitcast=True), mask=row_mask)
        m_rcp = ((127 - me) << 23).to(tl.float32, bitcast=True)
        v_rcp = ((127 - ve) << 23).to(tl.float32, bitcast=True)
        y_m = _fp8_stochastic(m * m_rcp[:, None], state_bits >> 16, False)
        y_v = _fp8_stochastic(sq * v_rcp[:, None], state_bits & 0xFFFF, True)
        mq = _fp8_encode(y_m, False)
        vq = _fp8_encode(y_v, True)
        tl.store(m_ptr + idx, mq, mask=mask)
        tl.store(v_ptr + idx, vq, mask=mask)
    elif STATE == 1:
        tl.store(m_ptr + idx, _bf16_stochastic(m, state_bits >> 16), mask=mask)
        tl.store(v_ptr + idx, _bf16_stochastic(v, state_bits & 0xFFFF), mask=mask)
    else:
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)

    if MASTER == 0:
        tl.store(master_ptr + idx, p, mask=mask)
        if WIRE == 1:
            tl.store(wire_ptr + idx, bf16_nearest(p), mask=mask)
        elif WIRE == 2:
            tl.store(wire_ptr + idx, p.to(tl.float16), mask=mask)
    elif MASTER == 1:
        # stochastic rounding: see [Note: counter-based stochastic rounding]
        counter = idx + counter_offset
        k = key.to(tl.uint32)
        bits = _hash32(_hash32(counter.to(tl.uint32) ^ k) + (counter >> 32).to(tl.uint32))
        tl.store(master_ptr + idx, _bf16_stochastic(p, bits >> 16), mask=mask)
    else:
        hi = bf16_nearest(p)
        tl.store(master_ptr + idx, hi, mask=mask)
        tl.store(comp_ptr + idx, bf16_nearest(p - hi.to(tl.float32)), mask=mask)
