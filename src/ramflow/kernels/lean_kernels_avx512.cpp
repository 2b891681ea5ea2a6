// ramflow: the lean step's AVX-512 loop, the choice of loop and the entry points. Compiled
// as one translation unit after cpu_kernels.cpp and lean_kernels.cpp (see
// _cpu_kernels._read_source), whose helpers it uses. See [Note: the lean step in SIMD].
namespace {

#if RAMFLOW_X86
#define RAMFLOW_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define I16(x) _mm512_set1_epi32(static_cast<int>(x))

template <int kGrad>
RAMFLOW_AVX512 inline __m512 load_grad16(const void* grad, int64_t i) {
  if constexpr (kGrad == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (kGrad == kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

RAMFLOW_AVX512 inline __m512 bf16x16_to_f32(const void* base, int64_t i) {
  return load_grad16<kBF16>(base, i);
}

// float -> bfloat16 bits, nearest even; NaN -> 0x7FC0 (as to_bf16_8).
RAMFLOW_AVX512 inline __m256i to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), I16(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, I16(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), I16(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

RAMFLOW_AVX512 inline __m512i hash32_16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, I16(kHashC1));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, I16(kHashC2));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// As hash32_8_pre and hash32_8_top: hash32 up to its last multiply, and with the top 16
// bits right, which are all the master's stochastic rounding reads.
RAMFLOW_AVX512 inline __m512i hash32_16_pre(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, I16(kHashC1));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

RAMFLOW_AVX512 inline __m512i hash32_16_top(__m512i x) { return _mm512_mullo_epi32(hash32_16_pre(x), I16(kHashC2)); }

// fp8_decode of the 16 codes at q.
RAMFLOW_AVX512 inline __m512 fp8x16_to_f32(const uint8_t* q) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i mag = _mm512_and_si512(c, I16(0x7F));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, I16(8));
  __m512i b = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), I16(kFp8Rebase));
  b = _mm512_mask_add_epi32(b, sub, b, I16(1u << 23));
  __m512 x = _mm512_castsi512_ps(b);
  x = _mm512_mask_sub_ps(x, sub, x, _mm512_set1_ps(0.015625f));
  b = _mm512_mask_or_epi32(_mm512_castps_si512(x), _mm512_cmpeq_epi32_mask(mag, I16(0x7F)),
                           _mm512_castps_si512(x), I16(0x7F800000));
  b = _mm512_or_si512(b, _mm512_and_si512(_mm512_slli_epi32(c, 24), I16(0x80000000u)));
  return _mm512_castsi512_ps(b);
}

// fp8x16_to_f32 times 2^-120 of codes that are neither subnormal, zero nor NaN (as
// fp8x8_to_f32_normal).
RAMFLOW_AVX512 inline __m512 fp8x16_to_f32_normal(const uint8_t* q) {
  const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(c, 20), I16(kFp8SignMag)));
}

// As block_has_special8, 64 codes at a time.
RAMFLOW_AVX512 inline bool block_has_special16(const uint8_t* q) {
  __mmask64 any = 0;
  for (int64_t j = 0; j < kQBlock; j += 64) {
    const __m512i b = _mm512_loadu_si512(q + j);
    const __m512i t = _mm512_and_si512(_mm512_sub_epi8(b, _mm512_set1_epi8(8)), _mm512_set1_epi8(0x7F));
    any |= _mm512_cmpgt_epi8_mask(t, _mm512_set1_epi8(118));
  }
  return any != 0;
}

// As fp8x8_special, for the lanes of `special`. Out of line: rare.
RAMFLOW_AVX512 __attribute__((noinline)) __m512i fp8x16_special(__m512i a, __m512i r) {
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(I16(kFp8Denorm)))), I16(kFp8Denorm));
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(a, I16(kFp8MinNormal)), sub);
  return _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(a, I16(kFp8Inf)), I16(0x7F));
}

// fp8_encode_state of 16 lanes: y = x * rcp; the codes, one per int32 lane.
template <bool kSecond>
RAMFLOW_AVX512 inline __m512i f32x16_to_fp8(__m512 x, __m512 rcp) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, rcp));
  const __m512i a = _mm512_and_si512(u, I16(0x7FFFFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), I16(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, I16(0x7FFFFu - kFp8Rebase)), odd), 20);
  // below 2^-6 or not finite: (a - 2^-6's bits) as unsigned at or above (inf - 2^-6)'s
  const __mmask16 special = _mm512_cmpge_epu32_mask(_mm512_sub_epi32(a, I16(kFp8MinNormal)),
                                                    I16(kFp8Inf - kFp8MinNormal));
  if (special != 0) {
    r = fp8x16_special(a, r);
    if (kSecond) r = _mm512_max_epi32(r, _mm512_min_epi32(a, I16(1)));  // positive: never code 0
  }
  // r | (u >> 24 & 0x80): the sign
  if (!kSecond) r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(u, 24), I16(0x80), 0xF8);
  return r;
}

// As fp8x8_stochastic, 16 lanes.
template <bool kSecond>
RAMFLOW_AVX512 inline __m512 fp8x16_stochastic(__m512 y, __m512i u16) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(y), I16(0x7FFFFFFF));
  const __m512i eb = _mm512_max_epi32(_mm512_srli_epi32(a, 23), I16(121));
  const __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(I16(257), eb), 23)));
  __m512 k = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(u16), _mm512_set1_ps(0x1p-16f))),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  if (kSecond) k = _mm512_mask_max_ps(k, _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GT_OQ), k, _mm512_set1_ps(1.0f));
  __m512i r = _mm512_castps_si512(_mm512_mul_ps(k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(eb, I16(3)), 23))));
  r = _mm512_ternarylogic_epi32(r, _mm512_castps_si512(y), I16(0x80000000u), 0xF8);  // r | (y & sign)
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmpge_epu32_mask(a, I16(kFp8Inf)), y);
}

// As f32x8_to_fp8_sr, 16 lanes.
template <bool kSecond, bool kSR>
RAMFLOW_AVX512 inline __m512i f32x16_to_fp8_sr(__m512 x, __m512 rcp, const uint32_t* bits) {
  if constexpr (!kSR) {
    return f32x16_to_fp8<kSecond>(x, rcp);
  } else {
    const __m512i b = _mm512_loadu_si512(bits);
    const __m512i u16 = kSecond ? _mm512_and_si512(b, I16(0xFFFF)) : _mm512_srli_epi32(b, 16);
    return f32x16_to_fp8<kSecond>(fp8x16_stochastic<kSecond>(_mm512_mul_ps(x, rcp), u16), _mm512_set1_ps(1.0f));
  }
}

// x[0, kQBlock) as codes at out[0, kQBlock) with the scale of `amax` (rounded
// stochastically with kSR, bits as x); returns the scale. Any block; the step takes it for
// a block with a NaN or an infinity.
template <bool kSecond, bool kSR>
RAMFLOW_AVX512 float encode_block16_exact(const float* x, float amax, uint8_t* out, const uint32_t* bits) {
  const Fp8Scale sc = fp8_scale(amax);
  const __m512 rcp = _mm512_set1_ps(sc.rcp);
  for (int64_t j = 0; j < kQBlock; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm512_cvtepi32_epi8(f32x16_to_fp8_sr<kSecond, kSR>(_mm512_load_ps(x + j), rcp, bits + j)));
  }
  return sc.scale;
}

// As encode32_exact, 64 codes.
template <bool kSecond, bool kSR>
RAMFLOW_AVX512 __attribute__((noinline)) void encode64_exact(const float* x, float rcp, uint8_t* out,
                                                             const uint32_t* bits) {
  const __m512 r = _mm512_set1_ps(rcp);
  for (int j = 0; j < 64; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm512_cvtepi32_epi8(f32x16_to_fp8_sr<kSecond, kSR>(_mm512_load_ps(x + j), r, bits + j)));
  }
}

struct Fp8FastConsts16 {
  __m512i bias, abs, one, bit20, sign;
};

// As f32x8_to_fp8_fast, 16 lanes.
template <bool kSecond, bool kSR>
RAMFLOW_AVX512 inline __m512i f32x16_to_fp8_fast(const float* x, const Fp8FastConsts16& c, __m512i& amin,
                                                 const uint32_t* bits) {
  const __m512i u = _mm512_load_si512(x);
  const __m512i a = kSecond ? u : _mm512_and_si512(u, c.abs);  // sqrt(v) >= +0
  const __m512i t = _mm512_add_epi32(a, c.bias);
  __m512i r;
  if constexpr (kSR) {  // + u16 * 2^4
    const __m512i b = _mm512_load_si512(bits);
    const __m512i add = kSecond ? _mm512_slli_epi32(_mm512_and_si512(b, I16(0xFFFF)), 4)
                                : _mm512_and_si512(_mm512_srli_epi32(b, 12), I16(0xFFFF0));
    r = _mm512_srli_epi32(_mm512_add_epi32(t, add), 20);
  } else {  // + 1 where bit 20 is set (the kept lsb: ties to even), by a masked add, not a shift
    r = _mm512_srli_epi32(_mm512_mask_add_epi32(t, _mm512_test_epi32_mask(a, c.bit20), t, c.one), 20);
  }
  amin = _mm512_min_epu32(amin, a);
  if (kSecond) return r;
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(u, 24), c.sign, 0xF8);  // the sign
}

// As encode_block8: the fast encoder unless the block holds a NaN or an infinity.
template <bool kSecond, bool kSR>
RAMFLOW_AVX512 inline float encode_block16(const float* x, uint32_t amax_bits, uint8_t* out, const uint32_t* bits) {
  if (amax_bits >= kFp8Inf) return encode_block16_exact<kSecond, kSR>(x, block_amax(x, kQBlock), out, bits);
  const Fp8Fast f = fp8_fast(amax_bits);
  const Fp8FastConsts16 c{I16(kSR ? f.bias - 0x7FFFFu : f.bias), I16(0x7FFFFFFF), I16(1), I16(1u << 20), I16(0x80)};
  const __m512i low = I16(f.low);
  // the packs interleave the 128-bit lanes: 4-byte groups k0 k1 k2 k3 of lane 0, then lane 1...
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t j = 0; j < kQBlock; j += 64) {
    __m512i k[4];
    __m512i amin = I16(0xFFFFFFFFu);
    for (int r = 0; r < 4; ++r) k[r] = f32x16_to_fp8_fast<kSecond, kSR>(x + j + 16 * r, c, amin, bits + j + 16 * r);
    if (__builtin_expect(_mm512_cmplt_epu32_mask(amin, low) != 0, 0)) {
      encode64_exact<kSecond, kSR>(x + j, f.rcp, out + j, bits + j);
      continue;
    }
    const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(k[0], k[1]), _mm512_packus_epi32(k[2], k[3]));
    _mm512_storeu_si512(out + j, _mm512_permutexvar_epi32(order, b));
  }
  return f.scale;
}

// The rounding bits of [Note: the rounding bits in fewer operations] from x1 = K + T[t], up
// to the last multiply (y of hash32_16_pre), and with the top 16 bits right.
RAMFLOW_AVX512 inline __m512i sr_bits_pre_from_x1_16(__m512i x1) {
  x1 = _mm512_xor_si512(x1, _mm512_srli_epi32(x1, 15));
  const __m512i y = _mm512_mullo_epi32(x1, I16(kHashC21));
  return _mm512_xor_si512(y, _mm512_srli_epi32(y, 15));
}

RAMFLOW_AVX512 inline __m512i sr_bits_from_x1_16(__m512i x1) {
  return _mm512_mullo_epi32(sr_bits_pre_from_x1_16(x1), I16(kHashC2));
}

// bf16_stochastic of 16 lanes with their random bits (the top 16 of each lane read), as
// 16 bf16 in order: the top half of p's bits + bits / 2^16 (0x7FC0 for NaN), gathered by one
// word permute (a shift and a 32-to-16 pack cost a uop more); top_halves: its indices.
RAMFLOW_AVX512 inline __m256i bf16x16_stochastic(__m512 p, __m512i bits, __m512i top_halves) {
  __m512i r = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_srli_epi32(bits, 16));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), I16(0x7FC00000u));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(top_halves, r));
}

// As counter_lanes8, 16 lanes.
RAMFLOW_AVX512 inline __m512i counter_lanes16(int64_t index) {
  return _mm512_add_epi32(I16(static_cast<uint32_t>(index)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

template <int kGrad, int kMaster, int kState>
RAMFLOW_AVX512 void lean_blocks_avx512(const LeanArgs& a, int64_t block_begin, int64_t block_end) {
  const void* const grad = a.grad;
  void* const master = a.master;
  uint16_t* const compensation = reinterpret_cast<uint16_t*>(a.compensation);
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  float* const exp_avg_scale = a.exp_avg_scale;
  float* const exp_avg_sq_scale = a.exp_avg_sq_scale;
  uint16_t* const wire_out = static_cast<uint16_t*>(a.wire_out);
  const int32_t wire_dtype = a.wire_dtype;
  const int64_t counter_offset = a.counter_offset;
  const uint32_t key = a.key;
  const bool apply_scale = a.apply_scale != 0;
  const bool apply_decay = a.apply_decay != 0;
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale);
  const __m512 decay = _mm512_set1_ps(a.decay);
  const __m512 beta1 = _mm512_set1_ps(a.beta1);
  const __m512 one_minus_beta1 = _mm512_set1_ps(a.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(a.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bc2_sqrt = _mm512_set1_ps(a.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(a.eps);
  const __m512 neg_step_size = _mm512_set1_ps(a.neg_step_size);
  const __m512i key16 = I16(key);
  const __m512i top_halves = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011,
                                               0x00170015, 0x001B0019, 0x001F001D, 0, 0, 0, 0, 0, 0, 0, 0);
  alignas(64) float m_new[kQBlock];
  alignas(64) float s_new[kQBlock];  // sqrt(v)
  alignas(64) uint32_t bits_table[kQBlock];  // [Note: the rounding bits in fewer operations]
  alignas(64) uint32_t st_bits[kQBlock];  // [Note: stochastic rounding of the 8-bit states]
  // bf16 and 8-bit states round stochastically, with state_bits from the master's bits
  constexpr bool kStateSR = kState != kStateF32;
  uint32_t table_q = 0xFFFFFFFFu;  // none yet
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t begin = block * kQBlock;
    // the counter's high word is the block's but where a block crosses a multiple of 2^32
    // (a block of 8-bit states starts on a multiple of kQBlock: never; one of bf16 states
    // takes the scalar block); the lanes' low words are built where the full hash needs
    // them, not stepped along in a register
    const int64_t index0 = counter_offset + begin;
    const bool crosses = static_cast<uint32_t>(index0) > 0xFFFFFFFFu - (kQBlock - 1);
    if (kStateSR && crosses) {
      lean_block(a, begin, kQBlock);
      continue;
    }
    const bool short_bits = (kMaster == kMasterSR || kStateSR) &&
                            (static_cast<uint64_t>(index0) >> 32) == 0 && (index0 & (kQBlock - 1)) == 0;
    __m512i bits_base = _mm512_setzero_si512();
    if (short_bits) bits_base = I16(short_bits_base(index0, key, table_q, bits_table));
    const __m512i hi_word = I16(static_cast<uint32_t>(static_cast<uint64_t>(index0) >> 32));
    __m512 m_scale = _mm512_setzero_ps();
    __m512 v_scale = _mm512_setzero_ps();
    bool m_special = false;
    bool v_special = false;
    if constexpr (kState == kStateQ8) {
      const float ms = fast_scale(exp_avg_scale[block]);
      const float vs = fast_scale(exp_avg_sq_scale[block]);
      m_special = ms == 0.0f || block_has_special16(static_cast<const uint8_t*>(exp_avg) + begin);
      v_special = vs == 0.0f || block_has_special16(static_cast<const uint8_t*>(exp_avg_sq) + begin);
      m_scale = _mm512_set1_ps(m_special ? exp_avg_scale[block] : ms);
      v_scale = _mm512_set1_ps(v_special ? exp_avg_sq_scale[block] : vs);
    }
    __m512i m_max = _mm512_setzero_si512();  // [Note: the FP8 encoder's fast blocks]
    __m512i s_max = _mm512_setzero_si512();
    for (int64_t j = 0; j < kQBlock; j += 16) {
      const int64_t i = begin + j;
      __m512 g = load_grad16<kGrad>(grad, i);
      if (apply_scale) g = _mm512_mul_ps(g, grad_scale);
      __m512 p;
      if constexpr (kMaster == kMasterF32) {
        p = _mm512_loadu_ps(static_cast<const float*>(master) + i);
      } else {
        p = bf16x16_to_f32(master, i);
        if constexpr (kMaster == kMasterKahan) p = _mm512_add_ps(p, bf16x16_to_f32(compensation, i));
      }
      if (apply_decay) p = _mm512_mul_ps(p, decay);
      __m512 m;
      __m512 v;
      if constexpr (kState == kStateF32) {
        m = _mm512_loadu_ps(static_cast<const float*>(exp_avg) + i);
        v = _mm512_loadu_ps(static_cast<const float*>(exp_avg_sq) + i);
      } else if constexpr (kState == kStateBF16) {
        m = bf16x16_to_f32(exp_avg, i);
        v = bf16x16_to_f32(exp_avg_sq, i);
      } else {
        const uint8_t* const qm = static_cast<const uint8_t*>(exp_avg) + i;
        const uint8_t* const qv = static_cast<const uint8_t*>(exp_avg_sq) + i;
        m = _mm512_mul_ps(m_special ? fp8x16_to_f32(qm) : fp8x16_to_f32_normal(qm), m_scale);
        const __m512 u = _mm512_mul_ps(v_special ? fp8x16_to_f32(qv) : fp8x16_to_f32_normal(qv), v_scale);
        v = _mm512_mul_ps(u, u);
      }
      m = _mm512_add_ps(_mm512_mul_ps(m, beta1), _mm512_mul_ps(g, one_minus_beta1));
      v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(g, one_minus_beta2), g));
      const __m512 sq = _mm512_sqrt_ps(v);
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(sq, bc2_sqrt), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(m, neg_step_size), denom));
      if constexpr (kState == kStateF32) {
        _mm512_storeu_ps(static_cast<float*>(exp_avg) + i, m);
        _mm512_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      } else if constexpr (kState == kStateQ8) {
        _mm512_store_ps(m_new + j, m);
        _mm512_store_ps(s_new + j, sq);
        m_max = _mm512_max_epu32(m_max, _mm512_and_si512(_mm512_castps_si512(m), I16(0x7FFFFFFF)));
        s_max = _mm512_max_epu32(s_max, _mm512_castps_si512(sq));
      }
      // with bf16 or 8-bit states: y of hash32_16_pre, then state_bits and the master's
      // bits (top 16 right) one multiply each; bf16 states are stored here, 8-bit ones' bits
      // kept for the encoder
      __m512i state_sr_bits = _mm512_setzero_si512();  // the master's bits, from y
      if constexpr (kStateSR) {
        const __m512i y = short_bits ? sr_bits_pre_from_x1_16(_mm512_add_epi32(bits_base, _mm512_load_si512(bits_table + j)))
                                     : hash32_16_pre(_mm512_add_epi32(hash32_16(_mm512_xor_si512(counter_lanes16(counter_offset + i), key16)), hi_word));
        const __m512i w = _mm512_mullo_epi32(y, I16(kStateMulC2));  // state_bits
        if constexpr (kState == kStateQ8) {
          _mm512_store_si512(st_bits + j, w);
        } else {  // the first moment's u is w's top 16, the second's its bottom 16
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(exp_avg) + i),
                              bf16x16_stochastic(m, w, top_halves));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(exp_avg_sq) + i),
                              bf16x16_stochastic(v, _mm512_slli_epi32(w, 16), top_halves));
        }
        if constexpr (kMaster == kMasterSR) state_sr_bits = _mm512_mullo_epi32(y, I16(kHashC2));
      }
      if constexpr (kMaster == kMasterF32) {
        _mm512_storeu_ps(static_cast<float*>(master) + i, p);
        if (wire_dtype == kBF16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wire_out + i), to_bf16_16(p));
        } else if (wire_dtype == kF16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(wire_out + i),
                              _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
      } else if constexpr (kMaster == kMasterSR) {
        const int64_t index = counter_offset + i;
        const uint32_t lo = static_cast<uint32_t>(index);
        __m256i b16;
        if (crosses && lo > 0xFFFFFFFFu - 15u) {  // the lanes cross a multiple of 2^32: as the scalar does
          alignas(64) float ps[16];
          alignas(32) uint16_t bs[16];
          _mm512_store_ps(ps, p);
          for (int l = 0; l < 16; ++l) bs[l] = bf16_stochastic(ps[l], sr_bits(key, index + l));
          b16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs));
        } else {
          __m512i bits = state_sr_bits;  // with bf16 or 8-bit states: computed above
          if constexpr (!kStateSR) {
            if (short_bits) {
              bits = sr_bits_from_x1_16(_mm512_add_epi32(bits_base, _mm512_load_si512(bits_table + j)));
            } else {
              const __m512i h = hash32_16(_mm512_xor_si512(counter_lanes16(counter_offset + i), key16));
              const __m512i hi =
                  crosses ? I16(static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32)) : hi_word;
              bits = hash32_16_top(_mm512_add_epi32(h, hi));
            }
          }
          b16 = bf16x16_stochastic(p, bits, top_halves);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(master) + i), b16);
      } else {
        const __m256i hi16 = to_bf16_16(p);
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi16), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(master) + i), hi16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(compensation + i), to_bf16_16(_mm512_sub_ps(p, hi)));
      }
    }
    if constexpr (kState == kStateQ8) {
      uint8_t* const qm = static_cast<uint8_t*>(exp_avg) + begin;
      uint8_t* const qv = static_cast<uint8_t*>(exp_avg_sq) + begin;
      exp_avg_scale[block] = encode_block16<false, true>(m_new, _mm512_reduce_max_epu32(m_max), qm, st_bits);
      exp_avg_sq_scale[block] = encode_block16<true, true>(s_new, _mm512_reduce_max_epu32(s_max), qv, st_bits);
    }
  }
}

// out[i] = decoded q[i] times its block's scale (squared for `second`), i in [0, n / 16 * 16).
// out[i] = decoded q[i] times its block's scale (squared for `second`) for the whole blocks,
// each by the decoder the step uses for it; returns where the whole blocks end.
RAMFLOW_AVX512 int64_t decode_blocks16(const uint8_t* q, int64_t n, bool second, const float* scale, float* out) {
  int64_t i = 0;
  for (; i + kQBlock <= n; i += kQBlock) {
    const float fast = fast_scale(scale[i / kQBlock]);
    const bool special = fast == 0.0f || block_has_special16(q + i);
    const __m512 factor = _mm512_set1_ps(special ? scale[i / kQBlock] : fast);
    for (int64_t j = i; j < i + kQBlock; j += 16) {
      const __m512 u = _mm512_mul_ps(special ? fp8x16_to_f32(q + j) : fp8x16_to_f32_normal(q + j), factor);
      _mm512_storeu_ps(out + j, second ? _mm512_mul_ps(u, u) : u);
    }
  }
  return i;
}

RAMFLOW_AVX2 int64_t decode_blocks8(const uint8_t* q, int64_t n, bool second, const float* scale, float* out) {
  int64_t i = 0;
  for (; i + kQBlock <= n; i += kQBlock) {
    const float fast = fast_scale(scale[i / kQBlock]);
    const bool special = fast == 0.0f || block_has_special8(q + i);
    const __m256 factor = _mm256_set1_ps(special ? scale[i / kQBlock] : fast);
    for (int64_t j = i; j < i + kQBlock; j += 8) {
      const __m256 u = _mm256_mul_ps(special ? fp8x8_to_f32(q + j) : fp8x8_to_f32_normal(q + j), factor);
      _mm256_storeu_ps(out + j, second ? _mm256_mul_ps(u, u) : u);
    }
  }
  return i;
}

// Steps the whole blocks [block_begin, block_end).
using LeanBlocksFn = void (*)(const LeanArgs&, int64_t, int64_t);

enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 2, kIsaAvx512 = 3 };

template <int kIsa, int kGrad, int kMaster>
LeanBlocksFn pick_state(int32_t state) {
  if constexpr (kIsa == kIsaAvx512) {
    switch (state) {
      case kStateBF16: return &lean_blocks_avx512<kGrad, kMaster, kStateBF16>;
      case kStateQ8: return &lean_blocks_avx512<kGrad, kMaster, kStateQ8>;
      default: return &lean_blocks_avx512<kGrad, kMaster, kStateF32>;
    }
  } else {
    if constexpr (kGrad == kBF16 && kMaster != kMasterF32) {  // the presets' loop
      switch (state) {
        case kStateBF16: return &lean_blocks_avx2_split<kMaster, kStateBF16>;
        case kStateQ8: return &lean_blocks_avx2_split<kMaster, kStateQ8>;
        default: break;
      }
    }
    switch (state) {
      case kStateBF16: return &lean_blocks_avx2<kGrad, kMaster, kStateBF16>;
      case kStateQ8: return &lean_blocks_avx2<kGrad, kMaster, kStateQ8>;
      default: return &lean_blocks_avx2<kGrad, kMaster, kStateF32>;
    }
  }
}

template <int kIsa, int kGrad>
LeanBlocksFn pick_master(int32_t master, int32_t state) {
  switch (master) {
    case kMasterSR: return pick_state<kIsa, kGrad, kMasterSR>(state);
    case kMasterKahan: return pick_state<kIsa, kGrad, kMasterKahan>(state);
    default: return pick_state<kIsa, kGrad, kMasterF32>(state);
  }
}

template <int kIsa>
LeanBlocksFn pick_grad(const LeanArgs& a) {
  switch (a.grad_dtype) {
    case kBF16: return pick_master<kIsa, kBF16>(a.master_format, a.state_format);
    case kF16: return pick_master<kIsa, kF16>(a.master_format, a.state_format);
    default: return pick_master<kIsa, kF32>(a.master_format, a.state_format);
  }
}

// The instruction set the lean step runs: the best this CPU has (AVX-512 F/BW/DQ/VL, else
// AVX2/FMA/F16C, else scalar code), capped by RAMFLOW_LEAN_ISA=scalar|avx2|avx512 (tests
// compare the three).
int lean_isa() {
  static const int best = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
                              ? kIsaAvx512
                          : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c"))
                              ? kIsaAvx2
                              : kIsaScalar;
  const char* cap = std::getenv("RAMFLOW_LEAN_ISA");
  if (cap == nullptr || cap[0] == '\0') return best;
  if (std::strcmp(cap, "scalar") == 0) return kIsaScalar;
  if (std::strcmp(cap, "avx2") == 0) return std::min(best, static_cast<int>(kIsaAvx2));
  return best;
}

// The SIMD blocks for these formats, or null (scalar code).
LeanBlocksFn lean_blocks_simd(const LeanArgs& a) {
  switch (lean_isa()) {
    case kIsaAvx512: return pick_grad<kIsaAvx512>(a);
    case kIsaAvx2: return pick_grad<kIsaAvx2>(a);
    default: return nullptr;
  }
}
#else
using LeanBlocksFn = void (*)(const LeanArgs&, int64_t, int64_t);
int lean_isa() { return 0; }
LeanBlocksFn lean_blocks_simd(const LeanArgs&) { return nullptr; }
#endif

// Runs body(first_block, end_block) over [0, num_blocks) on `threads` threads taking
// `grain` blocks at a time. See [Note: dynamic work sharing].
template <typename Body>
void share_blocks(int64_t num_blocks, int64_t grain, int32_t threads_arg, const Body& body) {
  const int threads = threads_arg > 0 ? threads_arg : at::get_num_threads();
  const int team = static_cast<int>(std::min<int64_t>(threads, (num_blocks + grain - 1) / grain));
  if (team <= 1) {
    body(0, num_blocks);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(team)
  {
    for (;;) {
      const int64_t b = next.fetch_add(grain, std::memory_order_relaxed);
      if (b >= num_blocks) break;
      body(b, std::min(b + grain, num_blocks));
    }
  }
}

}  // namespace

extern "C" int ramflow_lean_adamw_step(const LeanArgs* args) {
  const LeanArgs a = *args;
  if (a.n <= 0) return 0;
  const int64_t num_blocks = (a.n + kQBlock - 1) / kQBlock;
  const LeanBlocksFn simd = lean_blocks_simd(a);
  const int64_t num_whole = a.n / kQBlock;
  share_blocks(num_blocks, kLeanGrainQBlocks, a.num_threads, [&](int64_t lo, int64_t hi) {
    int64_t b = lo;
    if (simd != nullptr && std::min(hi, num_whole) > lo) {
      b = std::min(hi, num_whole);
      simd(a, lo, b);
    }
    for (; b < hi; ++b) lean_block(a, b * kQBlock, std::min(kQBlock, a.n - b * kQBlock));
  });
  return 0;
}

// x (n,) as E4M3 codes q and one scale per block of kQBlock, as a lean step stores a state
// (`second`: the second moment, x = v, coded as sqrt(v)): the SIMD encoder of lean_isa() on
// whole blocks, the scalar one on a last partial block. For the tests.
extern "C" int ramflow_fp8_quantize_blocks(const float* x, int64_t n, int32_t second, uint8_t* q,
                                           float* scale) {
  LeanArgs a{};
  a.state_format = kStateQ8;
  const int isa = lean_isa();
  alignas(64) float y[kQBlock];
  for (int64_t begin = 0; begin < n; begin += kQBlock) {
    const int64_t len = std::min(kQBlock, n - begin);
    for (int64_t j = 0; j < len; ++j) y[j] = second ? std::sqrt(x[begin + j]) : x[begin + j];
#if RAMFLOW_X86
    if (len == kQBlock && isa != kIsaScalar) {
      uint32_t amax = 0;  // as the step takes it: [Note: the FP8 encoder's fast blocks]
      for (int64_t j = 0; j < len; ++j) amax = std::max(amax, second ? f2u(y[j]) : f2u(y[j]) & 0x7FFFFFFFu);
      float* const sc = scale + begin / kQBlock;
      if (isa == kIsaAvx512) {
        *sc = second ? encode_block16<true, false>(y, amax, q + begin, nullptr)
                     : encode_block16<false, false>(y, amax, q + begin, nullptr);
      } else {
        *sc = second ? encode_block8<true, false>(y, amax, q + begin, nullptr)
                     : encode_block8<false, false>(y, amax, q + begin, nullptr);
      }
      continue;
    }
#endif
    store_state(a, q, scale, begin, len, y, second != 0, nullptr);
  }
  return 0;
}

// The moments m and v (n,) as a lean step stores them (codes and scales, with stochastic
// rounding keyed by `key` and the counter from `counter_offset`, a multiple of kQBlock): by
// the store of lean_isa()'s loop on whole blocks (AVX2's split loop's with `split`), the
// scalar one on a last partial block. For the tests.
extern "C" int ramflow_fp8_stochastic_blocks(const float* m, const float* v, int64_t n, uint32_t key,
                                             int64_t counter_offset, int32_t split, uint8_t* qm, uint8_t* qv,
                                             float* m_scale, float* v_scale) {
  LeanArgs a{};
  a.state_format = kStateQ8;
  a.exp_avg = qm;
  a.exp_avg_sq = qv;
  a.exp_avg_scale = m_scale;
  a.exp_avg_sq_scale = v_scale;
  a.key = key;
  a.counter_offset = counter_offset;
  const int isa = lean_isa();
  alignas(64) float mb[kQBlock];
  alignas(64) float sb[kQBlock];
  alignas(64) uint32_t bits[kQBlock];
  for (int64_t begin = 0; begin < n; begin += kQBlock) {
    const int64_t len = std::min(kQBlock, n - begin);
    const bool permute = split && len == kQBlock && isa == 2;  // kIsaAvx2: its split loop
    for (int64_t j = 0; j < len; ++j) {  // 8 even, then 8 odd elements of each 16
      const int64_t at = permute ? (j & ~int64_t{15}) + (j & 7) * 2 + ((j & 8) != 0) : j;
      mb[j] = m[begin + at];
      sb[j] = std::sqrt(v[begin + at]);
      bits[j] = state_bits(key, counter_offset + begin + at);
    }
#if RAMFLOW_X86
    if (len == kQBlock && isa != kIsaScalar) {
      uint32_t m_bits = 0;  // as the step takes them: [Note: the FP8 encoder's fast blocks]
      uint32_t s_bits = 0;
      for (int64_t j = 0; j < len; ++j) {
        m_bits = std::max(m_bits, f2u(mb[j]) & 0x7FFFFFFFu);
        s_bits = std::max(s_bits, f2u(sb[j]));
      }
      const int64_t block = begin / kQBlock;
      if (isa == kIsaAvx512) {
        m_scale[block] = encode_block16<false, true>(mb, m_bits, qm + begin, bits);
        v_scale[block] = encode_block16<true, true>(sb, s_bits, qv + begin, bits);
      } else if (split) {
        m_scale[block] = encode_split<false, true>(mb, m_bits, qm + begin, bits);
        v_scale[block] = encode_split<true, true>(sb, s_bits, qv + begin, bits);
      } else {
        m_scale[block] = encode_block8<false, true>(mb, m_bits, qm + begin, bits);
        v_scale[block] = encode_block8<true, true>(sb, s_bits, qv + begin, bits);
      }
      continue;
    }
#endif
    store_state(a, qm, m_scale, begin, len, mb, false, bits);
    store_state(a, qv, v_scale, begin, len, sb, true, bits);
  }
  return 0;
}

// The values of E4M3 codes q (n,) with one scale per block of kQBlock, as a lean step reads
// a state (`second`: the second moment, squared), by the decoder of lean_isa(): the normal
// decoder for each whole block without special codes. For the tests.
extern "C" int ramflow_fp8_dequantize_blocks(const uint8_t* q, int64_t n, int32_t second,
                                             const float* scale, float* out) {
  int64_t i = 0;
#if RAMFLOW_X86
  const int isa = lean_isa();
  if (isa == kIsaAvx512) i = decode_blocks16(q, n, second != 0, scale, out);
  if (isa == kIsaAvx2) i = decode_blocks8(q, n, second != 0, scale, out);
#endif
  for (; i < n; ++i) {
    const float u = fp8_decode(q[i]) * scale[i / kQBlock];
    out[i] = second ? u * u : u;
  }
  return 0;
}

// The instruction set of the lean step: 0 scalar, 2 AVX2, 3 AVX-512 (see lean_isa).
extern "C" int ramflow_lean_isa() { return lean_isa(); }

extern "C" int ramflow_bf16_stochastic_round(const float* x, uint16_t* out, int64_t n,
                                             int64_t counter_offset, uint32_t key,
                                             int32_t num_threads) {
  if (n <= 0) return 0;
  const int64_t num_blocks = (n + kQBlock - 1) / kQBlock;
  share_blocks(num_blocks, kLeanGrainQBlocks, num_threads, [&](int64_t lo, int64_t hi) {
    const int64_t end = std::min(hi * kQBlock, n);
    for (int64_t i = lo * kQBlock; i < end; ++i) {
      out[i] = bf16_stochastic(x[i], sr_bits(key, counter_offset + i));
    }
  });
  return 0;
}
