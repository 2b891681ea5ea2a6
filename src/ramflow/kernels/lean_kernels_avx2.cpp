// ramflow: the lean step's AVX2 loop for bf16 gradients and a bf16 master (the presets lean,
// bf16 and kahan), in even and odd lanes. Compiled as one translation unit after
// cpu_kernels.cpp and lean_kernels.cpp (see _cpu_kernels._read_source), whose helpers it
// uses; lean_kernels_avx512.cpp picks it. See [Note: the lean step in even and odd lanes].
namespace {

#if RAMFLOW_X86
// [Note: the lean step in even and odd lanes]
// lean_blocks_avx2 widens 8 bf16 values, or 8 one-byte codes, to 8 lanes of 32 bits with a
// cross-lane shuffle each (vpmovzxwd, vpmovsxbd), and narrows the stochastically rounded
// master back with two more (a byte shuffle and a qword permute). On Intel's cores these
// all take port 5, which the loop then waits on. This loop takes 16 elements at a time and
// keeps them in two vectors: the even elements (0, 2, .., 14) and the odd ones (1, 3, ..,
// 15). AdamW's arithmetic is the same in every lane, so only the loads, the stores and the
// rounding counter see the order, and all of them do it without a shuffle:
// * a 32-bit word of a bf16 array holds elements 2k (low half) and 2k+1 (high half): the
//   even one as fp32 is the word shifted left by 16, the odd one the word with its low half
//   cleared; back, the odd lane's top half and the even lane's top half shifted down blend
//   into one word (vpblendw);
// * 16 one-byte codes sign-extended to 16 bits (one vpmovsxbw) put codes 2k and 2k+1 in the
//   halves of word k: shifted left by 20 (even) or by 4 (odd), the masked word is the normal
//   decoder's fp32 (fp8x8_to_f32_normal); the exact decoder takes each half's low byte;
// * the counter of lane k is index0 + 2k (even) and index0 + 2k + 1 (odd);
// * the 8-bit states go to the L1 arrays in that order (8 even, then 8 odd), and the encoder
//   joins an even and an odd lane's codes into one 16-bit word (code_e | code_o << 8)
//   before one 32-to-16 pack and a qword permute; the block's scale (its absmax) and the
//   fast encoder's checks do not depend on the order.
// The arithmetic is that of lean_blocks_avx2 lane for lane, so the bits are too (the tests
// compare every loop with the scalar block). A block whose counter crosses a multiple of
// 2^32 (once per 16 G elements) takes the scalar block.
struct Split8 {
  __m256 e, o;  // elements 0, 2, .., 14 and 1, 3, .., 15 of 16
};

// The 16 bf16 values at base + i as fp32, split.
RAMFLOW_AVX2 inline Split8 bf16x16_split(const void* base, int64_t i, __m256i high_half) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), _mm256_castsi256_ps(_mm256_and_si256(w, high_half))};
}

// Two vectors of 32-bit lanes whose top halves are bf16 bits, as 16 bf16 values in element
// order (the split's inverse).
RAMFLOW_AVX2 inline void store_bf16x16(void* base, int64_t i, __m256i top_e, __m256i top_o) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                      _mm256_blend_epi16(_mm256_srli_epi32(top_e, 16), top_o, 0xAA));
}

// x rounded to bf16 to nearest even, in the top half of each lane (the low half is not
// cleared); NaN gives 0x7FC0, as to_bf16_8.
RAMFLOW_AVX2 inline __m256i bf16_nearest_top(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), I8(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, I8(0x7FFF)), lsb);
  return _mm256_blendv_epi8(r, I8(0x7FC00000u), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}


// The 16 codes at q, each sign-extended to 16 bits: word k holds codes 2k and 2k+1.
RAMFLOW_AVX2 inline __m256i fp8x16_words(const uint8_t* q) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}

// fp8x8_to_f32_normal of the words' codes, split.
RAMFLOW_AVX2 inline Split8 fp8_split_normal(__m256i w, __m256i sign_mag) {
  return {_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, 20), sign_mag)),
          _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, 4), sign_mag))};
}

// fp8x8_to_f32 of the words' codes, split.
RAMFLOW_AVX2 inline Split8 fp8_split_exact(__m256i w) {
  return {fp8_codes_to_f32(_mm256_and_si256(w, I8(0xFF))),
          fp8_codes_to_f32(_mm256_and_si256(_mm256_srli_epi32(w, 16), I8(0xFF)))};
}

// Codes (one per 32-bit lane, at most 0xFF) of elements 2k (e0, e1) and 2k+1 (o0, o1) of two
// groups of 16, as 32 bytes in element order.
RAMFLOW_AVX2 inline void store_codes_split(uint8_t* out, __m256i e0, __m256i o0, __m256i e1, __m256i o1) {
  const __m256i w0 = _mm256_or_si256(e0, _mm256_slli_epi32(o0, 8));
  const __m256i w1 = _mm256_or_si256(e1, _mm256_slli_epi32(o1, 8));
  // the pack interleaves the 128-bit lanes: qwords w0lo w1lo w0hi w1hi
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packus_epi32(w0, w1), 0xD8));
}

// encode_block8_exact of a block in split order (x and bits: 16 groups of 8 even, then 8
// odd values).
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 float encode_split_exact(const float* x, float amax, uint8_t* out, const uint32_t* bits) {
  const Fp8Scale sc = fp8_scale(amax);
  const __m256 rcp = _mm256_set1_ps(sc.rcp);
  for (int64_t j = 0; j < kQBlock; j += 32) {
    __m256i k[4];
    for (int r = 0; r < 4; ++r) k[r] = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + j + 8 * r), rcp, bits + j + 8 * r);
    store_codes_split(out + j, k[0], k[1], k[2], k[3]);
  }
  return sc.scale;
}

// encode32_exact in split order. Rare.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 __attribute__((noinline)) void encode32_split_exact(const float* x, float rcp, uint8_t* out,
                                                                 const uint32_t* bits) {
  const __m256 r = _mm256_set1_ps(rcp);
  store_codes_split(out, f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x), r, bits),
                    f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 8), r, bits + 8),
                    f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 16), r, bits + 16),
                    f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 24), r, bits + 24));
}

// encode_block8 in split order: the fast encoder unless the block holds a NaN or an
// infinity ([Note: the FP8 encoder's fast blocks]).
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 inline float encode_split(const float* x, uint32_t amax_bits, uint8_t* out, const uint32_t* bits) {
  if (amax_bits >= kFp8Inf) return encode_split_exact<kSecond, kSR>(x, block_amax(x, kQBlock), out, bits);
  const Fp8Fast f = fp8_fast(amax_bits);
  const Fp8FastConsts8 c{I8(kSR ? f.bias - 0x7FFFFu : f.bias), I8(0x7FFFFFFF), I8(1), I8(0x80)};
  const __m256i low = I8(f.low);
  for (int64_t j = 0; j < kQBlock; j += 32) {
    __m256i k[4];
    __m256i amin = I8(0xFFFFFFFFu);
    for (int r = 0; r < 4; ++r) k[r] = f32x8_to_fp8_fast<kSecond, kSR>(x + j + 8 * r, c, amin, bits + j + 8 * r);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(low, amin))) != 0, 0)) {
      encode32_split_exact<kSecond, kSR>(x + j, f.rcp, out + j, bits + j);
      continue;
    }
    store_codes_split(out + j, k[0], k[1], k[2], k[3]);
  }
  return f.scale;
}

// [Note: the rounding bits in fewer operations]
// sr_bits(key, i) is hash32(hash32(lo ^ key) + hi) with lo, hi the counter's words, and the
// rounding reads its top 16 bits: 4 multiplies and 9 shifts a lane. Where a block starts on
// a multiple of 256 below 2^32 (hi = 0: every block of a unit under 4 G elements with 8-bit
// states), three identities of 32-bit integers give the same bits with 2 multiplies and
// 3 shifts:
// * x ^= x >> 16 is its own inverse, so the first hash's last step and the second's first
//   cancel when nothing is added between them (hi = 0);
// * multiplication mod 2^32 associates: (x * C2) * C1 is x * (C2 * C1 mod 2^32);
// * with lo = b + t (b a multiple of 256, t < 256) and y = (b ^ key) ^ ((b ^ key) >> 16),
//   the first multiply (lo ^ key ^ (lo ^ key) >> 16) * C1 is (y & ~0xFF) * C1 + T[t] with
//   T[t] = ((y & 0xFF) ^ t) * C1: a block's constant plus a 1 KiB table, which changes with
//   bits 16-23 of b only (once per 256 blocks) and is kept in the split order.
// So x1 = K + T[t], x1 ^= x1 >> 15, y = x1 * (C2 * C1), y ^= y >> 15, bits = y * C2.
// With 8-bit or bf16 states every loop takes it for the states' bits (state_bits: y * (C2 *
// kStateMul) in place of bits = y * C2), whatever the master, where a block starts on a
// multiple of 256 (8-bit states' blocks always do).
// (kHashC21 and sr_bits_pre_from_x1 are in lean_kernels.cpp, whose loop uses them too)

// T of the note for the low byte q of y, in split order: entry g * 16 + l (l < 8) is lane
// l of the even vector of group g (t = 16 g + 2 l), entry g * 16 + 8 + l the odd one's.
inline void fill_bits_table(uint32_t q, uint32_t* table) {
  for (uint32_t g = 0; g < kQBlock; g += 16) {
    for (uint32_t l = 0; l < 8; ++l) {
      table[g + l] = ((g + 2 * l) ^ q) * kHashC1;
      table[g + 8 + l] = ((g + 2 * l + 1) ^ q) * kHashC1;
    }
  }
}

// AdamW's arithmetic of lean_block on 8 lanes (the same operations in the same order).
struct AdamConsts8 {
  __m256 beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

RAMFLOW_AVX2 inline __m256 adam8(const AdamConsts8& k, __m256 g, __m256 p, __m256& m, __m256& v, __m256& sq) {
  m = _mm256_add_ps(_mm256_mul_ps(m, k.beta1), _mm256_mul_ps(g, k.one_minus_beta1));
  v = _mm256_add_ps(_mm256_mul_ps(v, k.beta2), _mm256_mul_ps(_mm256_mul_ps(g, k.one_minus_beta2), g));
  sq = _mm256_sqrt_ps(v);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(sq, k.bc2_sqrt), k.eps);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(m, k.neg_step_size), denom));
}

// lean_blocks_avx2 for bf16 gradients, a bf16 master (stochastic rounding or Kahan) and
// bf16 or 8-bit states, in even and odd lanes.
template <int kMaster, int kState>
RAMFLOW_AVX2 void lean_blocks_avx2_split(const LeanArgs& a, int64_t block_begin, int64_t block_end) {
  static_assert(kMaster != kMasterF32 && kState != kStateF32, "lean_blocks_avx2 steps these");
  const void* const grad = a.grad;
  void* const master = a.master;
  const uint16_t* const compensation = reinterpret_cast<const uint16_t*>(a.compensation);
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  const int64_t counter_offset = a.counter_offset;
  const bool apply_scale = a.apply_scale != 0;
  const bool apply_decay = a.apply_decay != 0;
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale);
  const __m256 decay = _mm256_set1_ps(a.decay);
  const AdamConsts8 k{_mm256_set1_ps(a.beta1), _mm256_set1_ps(a.one_minus_beta1), _mm256_set1_ps(a.beta2),
                      _mm256_set1_ps(a.one_minus_beta2), _mm256_set1_ps(a.bc2_sqrt), _mm256_set1_ps(a.eps),
                      _mm256_set1_ps(a.neg_step_size)};
  const __m256i key = I8(a.key);
  const __m256i high_half = I8(0xFFFF0000u);
  const __m256i sign_mag = I8(kFp8SignMag);
  const __m256i abs_mask = I8(0x7FFFFFFF);
  const __m256i even_lanes = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  alignas(32) float m_new[kQBlock];  // split order: 8 even, then 8 odd of each 16
  alignas(32) float s_new[kQBlock];  // sqrt(v)
  alignas(32) uint32_t bits_table[kQBlock];  // [Note: the rounding bits in fewer operations]
  alignas(32) uint32_t st_bits[kQBlock];  // [Note: stochastic rounding of the 8-bit states]
  // the rounding bits: the master's, and the states' from them (one multiply); bf16 and
  // 8-bit states round stochastically ([Note: stochastic rounding of the 8-bit states])
  constexpr bool kBits = kMaster == kMasterSR || kState != kStateF32;
  uint32_t table_q = 0xFFFFFFFFu;  // none yet
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t begin = block * kQBlock;
    const int64_t index0 = counter_offset + begin;
    // (8-bit states start a block on a multiple of kQBlock: never here)
    if (kBits && static_cast<uint32_t>(index0) > 0xFFFFFFFFu - (kQBlock - 1)) {
      lean_block(a, begin, kQBlock);  // the lanes' counters cross a multiple of 2^32
      continue;
    }
    const bool short_bits = kBits && (static_cast<uint64_t>(index0) >> 32) == 0 && (index0 & (kQBlock - 1)) == 0;
    __m256i bits_base = _mm256_setzero_si256();
    if (short_bits) {
      const uint32_t x0 = static_cast<uint32_t>(index0) ^ a.key;
      const uint32_t y = x0 ^ (x0 >> 16);
      if ((y & 0xFF) != table_q) {
        table_q = y & 0xFF;
        fill_bits_table(table_q, bits_table);
      }
      bits_base = I8((y & ~0xFFu) * kHashC1);
    }
    const __m256i hi_word = I8(static_cast<uint32_t>(static_cast<uint64_t>(index0) >> 32));
    Q8Block q{};  // zeros: unused unless the states are 8-bit
    if constexpr (kState == kStateQ8) q = q8_block(a, block);
    const __m256 m_scale = q.m_scale;
    const __m256 v_scale = q.v_scale;
    const bool m_special = q.m_special;
    const bool v_special = q.v_special;
    __m256i m_max = _mm256_setzero_si256();  // [Note: the FP8 encoder's fast blocks]
    __m256i s_max = _mm256_setzero_si256();
    for (int64_t j = 0; j < kQBlock; j += 16) {
      const int64_t i = begin + j;
      Split8 g = bf16x16_split(grad, i, high_half);
      if (apply_scale) g = {_mm256_mul_ps(g.e, grad_scale), _mm256_mul_ps(g.o, grad_scale)};
      Split8 p = bf16x16_split(master, i, high_half);
      if constexpr (kMaster == kMasterKahan) {
        const Split8 c = bf16x16_split(compensation, i, high_half);
        p = {_mm256_add_ps(p.e, c.e), _mm256_add_ps(p.o, c.o)};
      }
      if (apply_decay) p = {_mm256_mul_ps(p.e, decay), _mm256_mul_ps(p.o, decay)};
      Split8 m;
      Split8 v;
      if constexpr (kState == kStateBF16) {
        m = bf16x16_split(exp_avg, i, high_half);
        v = bf16x16_split(exp_avg_sq, i, high_half);
      } else {
        const __m256i wm = fp8x16_words(static_cast<const uint8_t*>(exp_avg) + i);
        const __m256i wv = fp8x16_words(static_cast<const uint8_t*>(exp_avg_sq) + i);
        m = m_special ? fp8_split_exact(wm) : fp8_split_normal(wm, sign_mag);
        v = v_special ? fp8_split_exact(wv) : fp8_split_normal(wv, sign_mag);
        m = {_mm256_mul_ps(m.e, m_scale), _mm256_mul_ps(m.o, m_scale)};
        const __m256 ue = _mm256_mul_ps(v.e, v_scale);
        const __m256 uo = _mm256_mul_ps(v.o, v_scale);
        v = {_mm256_mul_ps(ue, ue), _mm256_mul_ps(uo, uo)};
      }
      Split8 sq;
      p.e = adam8(k, g.e, p.e, m.e, v.e, sq.e);
      p.o = adam8(k, g.o, p.o, m.o, v.o, sq.o);
      if constexpr (kState == kStateQ8) {
        _mm256_store_ps(m_new + j, m.e);
        _mm256_store_ps(m_new + j + 8, m.o);
        _mm256_store_ps(s_new + j, sq.e);
        _mm256_store_ps(s_new + j + 8, sq.o);
        m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m.e), abs_mask));
        m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m.o), abs_mask));
        s_max = _mm256_max_epu32(s_max, _mm256_max_epu32(_mm256_castps_si256(sq.e), _mm256_castps_si256(sq.o)));
      }
      // the rounding bits: y of hash32_8_pre, then the master's (top 16 right) and
      // state_bits one multiply each
      __m256i bits_e = _mm256_setzero_si256();
      __m256i bits_o = _mm256_setzero_si256();
      if constexpr (kBits) {
        __m256i y_e;
        __m256i y_o;
        if (short_bits) {
          y_e = sr_bits_pre_from_x1(_mm256_add_epi32(bits_base, _mm256_load_si256(reinterpret_cast<const __m256i*>(bits_table + j))));
          y_o = sr_bits_pre_from_x1(_mm256_add_epi32(bits_base, _mm256_load_si256(reinterpret_cast<const __m256i*>(bits_table + j + 8))));
        } else {
          // the counter's low words, built here rather than stepped along in a register
          const __m256i idx = _mm256_add_epi32(I8(static_cast<uint32_t>(index0 + j)), even_lanes);
          const __m256i x = _mm256_xor_si256(idx, key);
          const __m256i x_o = _mm256_xor_si256(_mm256_add_epi32(idx, I8(1)), key);
          y_e = hash32_8_pre(_mm256_add_epi32(hash32_8(x), hi_word));
          y_o = hash32_8_pre(_mm256_add_epi32(hash32_8(x_o), hi_word));
        }
        if constexpr (kMaster == kMasterSR) {
          bits_e = _mm256_mullo_epi32(y_e, I8(kHashC2));
          bits_o = _mm256_mullo_epi32(y_o, I8(kHashC2));
        }
        // state_bits: [Note: stochastic rounding of the 8-bit states]
        const __m256i w_e = _mm256_mullo_epi32(y_e, I8(kStateMulC2));
        const __m256i w_o = _mm256_mullo_epi32(y_o, I8(kStateMulC2));
        if constexpr (kState == kStateQ8) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(st_bits + j), w_e);
          _mm256_store_si256(reinterpret_cast<__m256i*>(st_bits + j + 8), w_o);
        } else {  // bf16: the first moment's u is w's top 16, the second's its bottom 16
          store_bf16x16(exp_avg, i, bf16_stochastic_top(m.e, w_e), bf16_stochastic_top(m.o, w_o));
          store_bf16x16(exp_avg_sq, i, bf16_stochastic_top(v.e, _mm256_slli_epi32(w_e, 16)),
                        bf16_stochastic_top(v.o, _mm256_slli_epi32(w_o, 16)));
        }
      }
      if constexpr (kMaster == kMasterSR) {
        store_bf16x16(master, i, bf16_stochastic_top(p.e, bits_e), bf16_stochastic_top(p.o, bits_o));
      } else {
        const __m256i hi_e = bf16_nearest_top(p.e);
        const __m256i hi_o = bf16_nearest_top(p.o);
        store_bf16x16(master, i, hi_e, hi_o);
        const __m256 rest_e = _mm256_sub_ps(p.e, _mm256_castsi256_ps(_mm256_and_si256(hi_e, high_half)));
        const __m256 rest_o = _mm256_sub_ps(p.o, _mm256_castsi256_ps(_mm256_and_si256(hi_o, high_half)));
        store_bf16x16(a.compensation, i, bf16_nearest_top(rest_e), bf16_nearest_top(rest_o));
      }
    }
    if constexpr (kState == kStateQ8) {
      uint8_t* const qm = static_cast<uint8_t*>(exp_avg) + begin;
      uint8_t* const qv = static_cast<uint8_t*>(exp_avg_sq) + begin;
      a.exp_avg_scale[block] = encode_split<false, true>(m_new, max_lane_u32(m_max), qm, st_bits);
      a.exp_avg_sq_scale[block] = encode_split<true, true>(s_new, max_lane_u32(s_max), qv, st_bits);
    }
  }
}
#endif  // RAMFLOW_X86

}  // namespace
