// ramflow: the lean host formats' one-pass AdamW step. Compiled as one translation unit with
// cpu_kernels.cpp (appended to it, see _cpu_kernels._read_source), whose helpers it uses
// (grad_at, load_grad8, to_bf16_8, RAMFLOW_AVX2). AdamW over a bf16 master (stochastic
// rounding or a bf16 Kahan compensation) or an fp32 one, and fp32, bf16 or 8-bit block-wise
// states. See kernels/lean_kernels.py, [Note: lean formats, one pass], kernels/random_bits.py, [Note: counter-based
// stochastic rounding] and [Note: 8-bit states in FP8 with power-of-two block scales]. Every
// loop does the operations of the PyTorch path there in the same order, so all give the same
// bits (-ffp-contract=off keeps the compiler from fusing any of it).
namespace {

enum MasterFormat : int32_t { kMasterF32 = 0, kMasterSR = 1, kMasterKahan = 2 };
enum StateFormat : int32_t { kStateF32 = 0, kStateBF16 = 1, kStateQ8 = 2 };
constexpr int64_t kQBlock = 256;           // elements per 8-bit block (one scale each)
constexpr int64_t kLeanGrainQBlocks = 64;  // 16384 elements per work item

// Mirrored by _LeanArgs (ctypes) in kernels/lean_kernels.py; keep both in the same order.
struct LeanArgs {
  void* master;                 // fp32 or bf16, updated in place
  c10::BFloat16* compensation;  // kMasterKahan only
  const void* grad;
  void* exp_avg;                // fp32, bf16 or uint8 E4M3 codes
  void* exp_avg_sq;
  float* exp_avg_scale;         // kStateQ8: one power of two per block of kQBlock
  float* exp_avg_sq_scale;
  void* wire_out;               // kMasterF32 only, may be null: bf16/fp16 copy, nearest even
  int64_t n;
  int64_t counter_offset;       // element index of master[0] in the rounding counter
  uint32_t key;                 // the rounding key of (seed, step), from Python
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  float grad_scale;
  int32_t apply_decay, apply_scale;
  int32_t master_format, state_format;
  int32_t grad_dtype, wire_dtype;
  int32_t num_threads;
};

// A 32-bit integer hash, a bijection ("lowbias32", C. Wellons, 2018).
constexpr uint32_t kHashC1 = 0x7feb352dU;
constexpr uint32_t kHashC2 = 0x846ca68bU;

inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= kHashC1;
  x ^= x >> 15;
  x *= kHashC2;
  x ^= x >> 16;
  return x;
}

// 32 random bits for element `index` of a rounding with `key`: depends on nothing else.
inline uint32_t sr_bits(uint32_t key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  return hash32(hash32(static_cast<uint32_t>(i) ^ key) + static_cast<uint32_t>(i >> 32));
}

// float -> bf16 bits, stochastically: round up with probability (dropped bits) / 2^16.
inline uint16_t bf16_stochastic(float x, uint32_t bits) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + (bits >> 16)) >> 16);
}

inline float bf16_to_float(c10::BFloat16 b) { return static_cast<float>(b); }

inline uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// [Note: FP8 conversions in bits]
// E4M3 (OCP "e4m3fn": bias 7, no infinities, S.1111.111 is NaN, largest 448) both ways in
// integer operations, as c10::Float8_e4m3fn does them, so the PyTorch path's
// .to(torch.float8_e4m3fn) gives the same bits (tests cover every rounding case):
// * encode: below 2^-6, adding 2^14 rounds |y| to a multiple of 2^-9 (the smallest
//   subnormal: 2^14's ulp) in the FPU's nearest-even mode, and the sum's low bits are the
//   code; otherwise the exponent is rebased (-120 << 23) and the 20 dropped mantissa bits
//   rounded to nearest even by adding 0x7FFFF plus the kept lsb. A finite y never rounds
//   above 448 here (the block scale keeps |y| <= 448); infinity and NaN are coded 0x7F,
//   NaN (torch saturates infinity to 448 since 2.13 and made it NaN before; the PyTorch
//   path sets 0x7F for them itself, so every version agrees).
// * The SIMD loops take the subnormal and non-finite cases only for the 16 (or 8) lanes
//   that have one, and decode a block with the 4-operation normal decoder unless one of its
//   codes is subnormal, zero or NaN (block_has_special*): most blocks of AdamW's moments
//   have none.
// * decode: the 7 magnitude bits shifted into the fp32 exponent and mantissa, exponent
//   rebased (+120); a subnormal code (below 8) is rebased by 121 and 2^-6 subtracted, which
//   leaves code * 2^-9 exactly; 0x7F gets the exponent all ones (c10's NaN, 0x7FF00000).
constexpr uint32_t kFp8Inf = 0x7F800000u;
constexpr uint32_t kFp8SignMag = 0x87F00000u;  // sign and magnitude of a code << 20
constexpr uint32_t kFp8MinNormal = 121u << 23;  // 2^-6
constexpr uint32_t kFp8Denorm = 141u << 23;     // 2^14
constexpr uint32_t kFp8Rebase = 120u << 23;

inline uint8_t fp8_encode(float y) {
  const uint32_t u = f2u(y);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u ^ sign;
  uint32_t r;
  if (a >= kFp8Inf) {
    r = 0x7F;
  } else if (a < kFp8MinNormal) {
    r = f2u(u2f(a) + u2f(kFp8Denorm)) - kFp8Denorm;
  } else {
    r = (a - kFp8Rebase + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

inline float fp8_decode(uint8_t c) {
  const uint32_t mag = c & 0x7Fu;
  float x;
  if (mag < 8) {
    x = u2f((mag << 20) + kFp8Rebase + (1u << 23)) - 0.015625f;
  } else {
    x = u2f((mag << 20) + kFp8Rebase);
  }
  uint32_t b = f2u(x);
  if (mag == 0x7F) b |= 0x7F800000u;
  return u2f(b | (static_cast<uint32_t>(c & 0x80u) << 24));
}

// [Note: 8-bit states in FP8 with power-of-two block scales] (the Python note has the why)
// A block's scale is 2^e with e the least integer such that amax / 2^e <= 448: from the
// bits of amax, e = exponent(amax) - 8, plus 1 where amax's mantissa passes 1.75 (adding
// 0x1FFFFF carries into the exponent exactly then), at least -126 so that 2^e and 2^-e are
// normal floats. Multiplying by 2^-e and 2^e is exact (short of underflow), so the scale
// costs no rounding and needs no division.
struct Fp8Scale {
  float scale, rcp;
};

inline int32_t fp8_scale_exp(uint32_t amax_bits) {
  const int32_t e = static_cast<int32_t>((amax_bits + 0x1FFFFFu) >> 23) - 135;
  return e < -126 ? -126 : e;
}

inline Fp8Scale fp8_scale(float amax) {
  const int32_t e = fp8_scale_exp(f2u(amax));
  return {u2f(static_cast<uint32_t>(e + 127) << 23), u2f(static_cast<uint32_t>(127 - e) << 23)};
}

// The largest |x[j]| of a block, a NaN left out (std::max(running, NaN) is running): the
// scale's amax wherever the block holds a NaN or an infinity.
inline float block_amax(const float* x, int64_t len) {
  float amax = 0.0f;
  for (int64_t j = 0; j < len; ++j) amax = std::max(amax, std::abs(x[j]));
  return amax;
}

// [Note: the FP8 encoder's fast blocks]
// The SIMD loops encode a block in fewer operations when all of its values are finite,
// which they learn for free: the step keeps the block's largest |x| as an integer maximum
// of the bits (for finite floats of one sign, integer and float order agree; a NaN or an
// infinity makes it 0x7F800000 or more, and such a block takes the exact encoder above).
// Then, with 2^e the block's scale:
// * y = x * 2^-e only moves the exponent, so the bits of |y| are |x|'s minus e << 23, and
//   the multiply folds into the rounding's constant: code = (|x| + bias + odd) >> 20 with
//   bias = 0x7FFFF - (120 << 23) - (e << 23) mod 2^32 and odd = bit 20 of |x| (which the
//   exponent's shift leaves alone), as fp8_encode's normal case computes it from |y|;
// * that holds where y is a normal E4M3 (|y| >= 2^-6) and x a normal float, i.e. where
//   |x| >= low = max((121 + e) << 23, 1 << 23) as integers (one compare per group of four
//   vectors, on their least |x|); a group with a lane below `low` (zero, tiny, or a
//   subnormal x) takes the exact encoder, all of it;
// * no lane can round above 448 (|y| <= amax * 2^-e <= 448), and the codes, at most 0xFF
//   with the sign, pack to bytes with unsigned saturation (which leaves them as they are);
// * the step rounds stochastically ([Note: stochastic rounding of the 8-bit states]): the
//   add is then bias - 0x7FFFF + u16 * 2^4 (u16 the lane's 16 random bits), which carries
//   into the code exactly where fp8_stochastic's floor(t + u) rounds up; the lanes of a
//   group with one below `low`, and a block with a NaN or an infinity, take fp8_stochastic's
//   float formula (fp8x8_stochastic), then the exact encoder at scale 1.
struct Fp8Fast {
  float scale, rcp;
  uint32_t bias, low;
};

inline Fp8Fast fp8_fast(uint32_t amax_bits) {
  const int32_t e = fp8_scale_exp(amax_bits);
  const uint32_t shift = static_cast<uint32_t>(e) << 23;  // mod 2^32
  const int32_t low = std::max((121 + e) * (1 << 23), 1 << 23);
  return {u2f(static_cast<uint32_t>(e + 127) << 23), u2f(static_cast<uint32_t>(127 - e) << 23),
          0x7FFFFu - kFp8Rebase - shift, static_cast<uint32_t>(low)};
}

// The second moment is kept as sqrt(v), without a sign bit; a code of 0 for a positive y
// becomes 1 (the smallest subnormal), so that v never reads back as 0 while m keeps a code.
// See the note.
inline uint8_t fp8_encode_state(float y, bool second) {
  const uint8_t c = fp8_encode(y);
  if (!second) return c;
  return (c & 0x7F) == 0 && y > 0.0f ? 1 : c & 0x7F;
}

// [Note: stochastic rounding of the 8-bit states] (the Python note has the why)
// y = x / scale rounded onto the E4M3 grid stochastically: with Ey = max(exponent(|y|), -6)
// the grid's spacing at y is 2^(Ey - 3) (2^-9 for E4M3's subnormals), t = |y| / spacing is
// exact, and k = floor(t + u) with u = u16 / 2^16 is floor(t) + 1 with probability frac(t)
// (to 2^-16), so k * spacing is y in the mean. t + u is one fp32 addition, exact below 16
// and never carried past an integer above it, so floor gives every loop the same k. The
// result is a point of the grid (at most 448, since |y| <= 448 and 448 is one), which the
// nearest-even encoder then codes exactly. The second moment keeps a positive y off code 0
// (k = 0 becomes 1, as fp8_encode_state does). NaN and infinity are left as they are.
// The 16 bits come from the master's rounding bits h of the element by one multiply
// (state_bits): w = (h ^ h >> 16) * kStateMul mod 2^32, the top half for the first moment,
// the bottom half for the second (h ^ h >> 16 undoes hash32's last step). The Python note
// says why the master's, the first moment's and the second's 16 bits are pairwise
// independent. bf16 states round with the same 16 bits by bf16_stochastic (bf16_state_bits
// puts them where it reads them), with any master.
constexpr uint32_t kStateMul = 0x9E3779B9u;  // 2^32 over the golden ratio, odd
// hash32's last multiply and kStateMul in one (mod 2^32): the SIMD loops have y, hash32's
// value before its last multiply (hash32_8_pre), where h ^ h >> 16 = y * kHashC2, so
// state_bits is y * kStateMulC2, one multiply as the master's bits y * kHashC2 are.
constexpr uint32_t kStateMulC2 = kHashC2 * kStateMul;

inline uint32_t state_bits_of(uint32_t h) { return (h ^ (h >> 16)) * kStateMul; }

inline uint32_t state_bits(uint32_t key, int64_t index) { return state_bits_of(sr_bits(key, index)); }

inline float fp8_stochastic(float y, uint32_t u16, bool second) {
  const uint32_t a = f2u(y) & 0x7FFFFFFFu;
  if (a >= kFp8Inf) return y;
  const uint32_t eb = std::max(a >> 23, 121u);  // biased exponent, at least -6's
  const float t = u2f(a) * u2f((257u - eb) << 23);  // |y| * 2^(3 - Ey)
  float k = std::floor(t + static_cast<float>(u16) * 0x1p-16f);
  if (second && t > 0.0f && k == 0.0f) k = 1.0f;
  return u2f(f2u(k * u2f((eb - 3u) << 23)) | (f2u(y) & 0x80000000u));
}

inline float load_state(const LeanArgs& a, const void* s, const float* scale, int64_t i, bool second) {
  switch (a.state_format) {
    case kStateBF16: return bf16_to_float(static_cast<const c10::BFloat16*>(s)[i]);
    case kStateQ8: {
      const float u = fp8_decode(static_cast<const uint8_t*>(s)[i]) * scale[i / kQBlock];
      return second ? u * u : u;
    }
    default: return static_cast<const float*>(s)[i];
  }
}

// The bits of a bf16 state's stochastic rounding in bf16_stochastic's place (its top 16):
// state_bits `w` as they are for the first moment, shifted up for the second (its u is the
// bottom 16). See [Note: stochastic rounding of the 8-bit states].
inline uint32_t bf16_state_bits(uint32_t w, bool second) { return second ? w << 16 : w; }

// Writes x[0, len) as block `block` of the state s: fp32, bf16, or E4M3 codes and the
// block's scale (x is sqrt(v) for the second moment's codes). bf16 and the codes round
// stochastically with state_bits `bits` (the first moment its top 16, the second its bottom
// 16; see [Note: stochastic rounding of the 8-bit states]) or, without, to nearest even.
inline void store_state(const LeanArgs& a, void* s, float* scale, int64_t begin, int64_t len,
                        const float* x, bool second, const uint32_t* bits) {
  if (a.state_format == kStateF32) {
    std::memcpy(static_cast<float*>(s) + begin, x, len * sizeof(float));
  } else if (a.state_format == kStateBF16) {
    auto* out = static_cast<c10::BFloat16*>(s) + begin;
    if (bits == nullptr) {
      for (int64_t j = 0; j < len; ++j) out[j] = c10::BFloat16(x[j]);
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const uint16_t b = bf16_stochastic(x[j], bf16_state_bits(bits[j], second));
        std::memcpy(out + j, &b, 2);
      }
    }
  } else {
    float amax = 0.0f;
    for (int64_t j = 0; j < len; ++j) amax = std::max(amax, std::abs(x[j]));
    const Fp8Scale sc = fp8_scale(amax);
    scale[begin / kQBlock] = sc.scale;
    auto* out = static_cast<uint8_t*>(s) + begin;
    if (bits == nullptr) {
      for (int64_t j = 0; j < len; ++j) out[j] = fp8_encode_state(x[j] * sc.rcp, second);
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const uint32_t u16 = second ? bits[j] & 0xFFFFu : bits[j] >> 16;
        out[j] = fp8_encode_state(fp8_stochastic(x[j] * sc.rcp, u16, second), second);
      }
    }
  }
}

// One block of at most kQBlock elements starting at `begin` (a multiple of kQBlock).
void lean_block(const LeanArgs& a, int64_t begin, int64_t len) {
  const bool q8 = a.state_format == kStateQ8;
  float m_new[kQBlock];
  float v_new[kQBlock];  // sqrt(v) for 8-bit states
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = begin + j;
    Args ga{};
    ga.grad = a.grad;
    ga.grad_dtype = a.grad_dtype;
    float g = grad_at(ga, i);
    if (a.apply_scale) g = g * a.grad_scale;
    float p;
    if (a.master_format == kMasterF32) {
      p = static_cast<float*>(a.master)[i];
    } else {
      p = bf16_to_float(static_cast<c10::BFloat16*>(a.master)[i]);
      if (a.master_format == kMasterKahan) p = p + bf16_to_float(a.compensation[i]);
    }
    if (a.apply_decay) p = p * a.decay;
    float m = load_state(a, a.exp_avg, a.exp_avg_scale, i, false);
    float v = load_state(a, a.exp_avg_sq, a.exp_avg_sq_scale, i, true);
    m = m * a.beta1 + g * a.one_minus_beta1;
    v = v * a.beta2 + (g * a.one_minus_beta2) * g;
    const float sq = std::sqrt(v);
    const float denom = sq / a.bc2_sqrt + a.eps;
    p = p + (m * a.neg_step_size) / denom;
    m_new[j] = m;
    v_new[j] = q8 ? sq : v;
    if (a.master_format == kMasterF32) {
      static_cast<float*>(a.master)[i] = p;
      if (a.wire_dtype == kBF16) {
        static_cast<c10::BFloat16*>(a.wire_out)[i] = c10::BFloat16(p);
      } else if (a.wire_dtype == kF16) {
        static_cast<c10::Half*>(a.wire_out)[i] = c10::Half(p);
      }
    } else if (a.master_format == kMasterSR) {
      const uint16_t b = bf16_stochastic(p, sr_bits(a.key, a.counter_offset + i));
      std::memcpy(static_cast<c10::BFloat16*>(a.master) + i, &b, 2);
    } else {
      const c10::BFloat16 hi(p);
      static_cast<c10::BFloat16*>(a.master)[i] = hi;
      a.compensation[i] = c10::BFloat16(p - bf16_to_float(hi));
    }
  }
  // bf16 and 8-bit states round stochastically: [Note: stochastic rounding of the 8-bit states]
  const bool state_sr = a.state_format != kStateF32;
  uint32_t bits[kQBlock];
  if (state_sr) {
    for (int64_t j = 0; j < len; ++j) bits[j] = state_bits(a.key, a.counter_offset + begin + j);
  }
  store_state(a, a.exp_avg, a.exp_avg_scale, begin, len, m_new, false, state_sr ? bits : nullptr);
  store_state(a, a.exp_avg_sq, a.exp_avg_sq_scale, begin, len, v_new, true, state_sr ? bits : nullptr);
}

#if RAMFLOW_X86
// [Note: the lean step in SIMD]
// lean_block's arithmetic 8 (AVX2) or 16 (AVX-512) lanes at a time, in the same order and
// without fused multiply-adds (division and square root are correctly rounded in all), so
// the bits are the scalar block's; tests compare the three (RAMFLOW_LEAN_ISA caps the
// choice). One pass over the block's memory: fp32 and bf16 states are stored as they are
// computed; 8-bit ones go to two 1 KiB arrays (in L1) while the block's absmax is taken in
// registers (an integer maximum of the bits), and are encoded from there once the block's
// scale is known: a block without NaN or infinity by [Note: the FP8 encoder's fast
// blocks], any other by the integer operations of [Note: FP8 conversions in bits], with
// blends for the subnormal and NaN cases: no table, no gather, no division. The codes'
// random bits (state_bits, [Note: stochastic rounding of the 8-bit states]) go to a third
// 1 KiB array in the loop, one multiply from the master's rounding bits before their last
// multiply (which the loop has anyway for a stochastically rounded master; Kahan and fp32
// masters compute them too, less that last multiply). The codes of
// four vectors are packed to bytes at once (two 32-to-16 packs, one 16-to-8, one permute
// to undo the packs' interleaving of 128-bit lanes). The constants and
// pointers are read into locals once per work item (the intrinsics' unaligned stores may
// alias anything, so the compiler would read fields of the arguments again after each).
// Whole blocks of kQBlock only; a last partial block takes the scalar path. With bf16
// gradients and a bf16 master the AVX2 step takes lean_blocks_avx2_split instead
// ([Note: the lean step in even and odd lanes], lean_kernels_avx2.cpp).
RAMFLOW_AVX2 inline __m256 bf16x8_to_f32(const void* base, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define I8(x) _mm256_set1_epi32(static_cast<int>(x))

RAMFLOW_AVX2 inline __m256i hash32_8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, I8(kHashC1));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, I8(kHashC2));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// hash32 up to its last multiply (y): y * kHashC2 is hash32 less its last x ^= x >> 16,
// which leaves the top half as it is (all the master's stochastic rounding reads, bits >>
// 16), and y * kStateMulC2 is state_bits.
RAMFLOW_AVX2 inline __m256i hash32_8_pre(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, I8(kHashC1));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

// hash32 with the top 16 bits right and the others not (see hash32_8_pre).
RAMFLOW_AVX2 inline __m256i hash32_8_top(__m256i x) { return _mm256_mullo_epi32(hash32_8_pre(x), I8(kHashC2)); }

// bf16_stochastic of 8 lanes with their random bits (the top 16 of each lane read), in the
// top half of each lane (the low half is not cleared); NaN gives 0x7FC0.
RAMFLOW_AVX2 inline __m256i bf16_stochastic_top(__m256 p, __m256i bits) {
  const __m256i r = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_srli_epi32(bits, 16));
  return _mm256_blendv_epi8(r, I8(0x7FC00000u), _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q)));
}

// The top halves of the 8 lanes as 8 bf16 in order: one byte shuffle and one qword permute
// (no shift, no pack); top_halves: the shuffle's control (top_halves8_control).
RAMFLOW_AVX2 inline __m128i top_halves8(__m256i r, __m256i top_halves) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, top_halves), 0x08));
}

RAMFLOW_AVX2 inline __m256i top_halves8_control() {
  return _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                          2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
}

// The low words of the rounding counter of 8 elements from `index` (mod 2^32). Built where
// a loop needs them (the full hash's rare blocks), not stepped along in a register.
RAMFLOW_AVX2 inline __m256i counter_lanes8(int64_t index) {
  return _mm256_add_epi32(I8(static_cast<uint32_t>(index)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// fp8_decode of 8 codes, one per 32-bit lane (zero-extended).
RAMFLOW_AVX2 inline __m256 fp8_codes_to_f32(__m256i c) {
  const __m256i mag = _mm256_and_si256(c, I8(0x7F));
  const __m256i sub = _mm256_cmpgt_epi32(I8(8), mag);
  const __m256i bias = _mm256_add_epi32(I8(kFp8Rebase), _mm256_and_si256(sub, I8(1u << 23)));
  __m256 x = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), bias));
  x = _mm256_sub_ps(x, _mm256_and_ps(_mm256_castsi256_ps(sub), _mm256_set1_ps(0.015625f)));
  __m256i b = _mm256_castps_si256(x);
  b = _mm256_or_si256(b, _mm256_and_si256(_mm256_cmpeq_epi32(mag, I8(0x7F)), I8(kFp8Inf)));
  b = _mm256_or_si256(b, _mm256_and_si256(_mm256_slli_epi32(c, 24), I8(0x80000000u)));
  return _mm256_castsi256_ps(b);
}

// fp8_decode of the 8 codes at q.
RAMFLOW_AVX2 inline __m256 fp8x8_to_f32(const uint8_t* q) {
  return fp8_codes_to_f32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// fp8x8_to_f32 times 2^-120 of codes that are neither subnormal, zero nor NaN: the
// sign-extended byte shifted so that its sign and magnitude land in place, and the exponent
// left unrebased: the caller multiplies by 2^120 times the block's scale, exact where that
// is a float (fast_scale).
RAMFLOW_AVX2 inline __m256 fp8x8_to_f32_normal(const uint8_t* q) {
  const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 20), I8(kFp8SignMag)));
}

// The factor of a block's normal decoder, 2^120 times its scale (exact, one rounding in the
// product as in code * scale), or 0 where the block takes the exact decoder: a scale above
// 2^7 (the factor would overflow), or 0.
inline float fast_scale(float scale) { return scale <= 128.0f ? scale * 0x1p120f : 0.0f; }

// Whether one of the kQBlock codes at q is subnormal, zero or NaN ((magnitude - 8) mod 128
// >= 119): its block then takes fp8x8_to_f32.
RAMFLOW_AVX2 inline bool block_has_special8(const uint8_t* q) {
  __m256i any = _mm256_setzero_si256();
  for (int64_t j = 0; j < kQBlock; j += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j));
    const __m256i t = _mm256_and_si256(_mm256_sub_epi8(b, _mm256_set1_epi8(8)), _mm256_set1_epi8(0x7F));
    any = _mm256_or_si256(any, _mm256_cmpgt_epi8(t, _mm256_set1_epi8(118)));
  }
  return !_mm256_testz_si256(any, any);
}

// The lanes of f32x8_to_fp8 whose |y| (bits a) is below 2^-6 or not finite, as fp8_encode
// codes them; r holds the normal lanes' codes. Out of line: rare.
RAMFLOW_AVX2 __attribute__((noinline)) __m256i fp8x8_special(__m256i a, __m256i r) {
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(I8(kFp8Denorm)))), I8(kFp8Denorm));
  r = _mm256_blendv_epi8(r, sub, _mm256_cmpgt_epi32(I8(kFp8MinNormal), a));
  return _mm256_blendv_epi8(r, I8(0x7F), _mm256_cmpgt_epi32(a, I8(kFp8Inf - 1)));
}

// fp8_encode_state of 8 lanes: y = x * rcp; the codes, one per int32 lane.
template <bool kSecond>
RAMFLOW_AVX2 inline __m256i f32x8_to_fp8(__m256 x, __m256 rcp) {
  const __m256i u = _mm256_castps_si256(_mm256_mul_ps(x, rcp));
  const __m256i a = _mm256_and_si256(u, I8(0x7FFFFFFF));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), I8(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, I8(0x7FFFFu - kFp8Rebase)), odd), 20);
  const __m256i special =
      _mm256_or_si256(_mm256_cmpgt_epi32(I8(kFp8MinNormal), a), _mm256_cmpgt_epi32(a, I8(kFp8Inf - 1)));
  if (!_mm256_testz_si256(special, special)) {
    r = fp8x8_special(a, r);
    if (kSecond) r = _mm256_max_epi32(r, _mm256_min_epi32(a, I8(1)));  // positive: never code 0
  }
  if (!kSecond) r = _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(u, 24), I8(0x80)));
  return r;
}

// fp8_stochastic of 8 lanes: y = x / scale; u16 the random bits, one per lane (below 2^16).
template <bool kSecond>
RAMFLOW_AVX2 inline __m256 fp8x8_stochastic(__m256 y, __m256i u16) {
  const __m256i a = _mm256_and_si256(_mm256_castps_si256(y), I8(0x7FFFFFFF));
  const __m256i eb = _mm256_max_epi32(_mm256_srli_epi32(a, 23), I8(121));
  const __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(I8(257), eb), 23)));
  __m256 k = _mm256_floor_ps(_mm256_add_ps(t, _mm256_mul_ps(_mm256_cvtepi32_ps(u16), _mm256_set1_ps(0x1p-16f))));
  if (kSecond) k = _mm256_max_ps(k, _mm256_and_ps(_mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.0f)));
  __m256i r = _mm256_castps_si256(_mm256_mul_ps(k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(eb, I8(3)), 23))));
  r = _mm256_or_si256(r, _mm256_andnot_si256(I8(0x7FFFFFFF), _mm256_castps_si256(y)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), y, _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, I8(kFp8Inf - 1))));
}

// f32x8_to_fp8, or with kSR its codes of fp8x8_stochastic(x * rcp) with the random bits of
// the 8 lanes at bits (state_bits; the first moment reads their top 16, the second their
// bottom 16): the grid's points, coded exactly at scale 1.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 inline __m256i f32x8_to_fp8_sr(__m256 x, __m256 rcp, const uint32_t* bits) {
  if constexpr (!kSR) {
    return f32x8_to_fp8<kSecond>(x, rcp);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
    const __m256i u16 = kSecond ? _mm256_and_si256(b, I8(0xFFFF)) : _mm256_srli_epi32(b, 16);
    return f32x8_to_fp8<kSecond>(fp8x8_stochastic<kSecond>(_mm256_mul_ps(x, rcp), u16), _mm256_set1_ps(1.0f));
  }
}

// x[0, kQBlock) as codes at out[0, kQBlock) with the scale of `amax` (rounded
// stochastically with kSR, bits as x); returns the scale. Any block; the step takes it for
// a block with a NaN or an infinity.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 float encode_block8_exact(const float* x, float amax, uint8_t* out, const uint32_t* bits) {
  const Fp8Scale sc = fp8_scale(amax);
  const __m256 rcp = _mm256_set1_ps(sc.rcp);
  // the packs interleave the 128-bit lanes: 4-byte groups k0lo k1lo k2lo k3lo k0hi k1hi ...
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < kQBlock; j += 32) {
    __m256i k[4];
    for (int r = 0; r < 4; ++r) k[r] = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + j + 8 * r), rcp, bits + j + 8 * r);
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(k[0], k[1]), _mm256_packus_epi32(k[2], k[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(b, order));
  }
  return sc.scale;
}

// The 32 codes of x[0, 32) at out[0, 32) as encode_block8_exact writes them, with the
// block's 1 / scale `rcp`: a fast block's group of vectors with a lane below `low`. Rare.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 __attribute__((noinline)) void encode32_exact(const float* x, float rcp, uint8_t* out, const uint32_t* bits) {
  const __m256 r = _mm256_set1_ps(rcp);
  const __m256i k0 = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x), r, bits);
  const __m256i k1 = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 8), r, bits + 8);
  const __m256i k2 = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 16), r, bits + 16);
  const __m256i k3 = f32x8_to_fp8_sr<kSecond, kSR>(_mm256_load_ps(x + 24), r, bits + 24);
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(k0, k1), _mm256_packus_epi32(k2, k3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The fast encoder's constants, in registers once per block.
struct Fp8FastConsts8 {
  __m256i bias, abs, one, sign;
};

// fp8_encode_state of the 8 floats at x of a block without NaN or infinity, in the fast
// block's integer operations ([Note: the FP8 encoder's fast blocks]); the codes, one per
// int32 lane, right where no lane is below the block's `low` (`amin` keeps the least |x|,
// which the caller compares once per group). With kSR rounded stochastically with the
// random bits at `bits`: the 20 dropped bits get u16 * 2^4 added in place of nearest
// even's 0x7FFFF + odd (c.bias leaves 0x7FFFF out then), which carries into the code
// exactly when floor(t + u) of [Note: stochastic rounding of the 8-bit states] rounds up.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 inline __m256i f32x8_to_fp8_fast(const float* x, const Fp8FastConsts8& c, __m256i& amin, const uint32_t* bits) {
  const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i a = kSecond ? u : _mm256_and_si256(u, c.abs);  // sqrt(v) >= +0
  __m256i add;
  if constexpr (kSR) {
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
    add = kSecond ? _mm256_slli_epi32(_mm256_and_si256(b, I8(0xFFFF)), 4) : _mm256_and_si256(_mm256_srli_epi32(b, 12), I8(0xFFFF0));
  } else {
    add = _mm256_and_si256(_mm256_srli_epi32(a, 20), c.one);
  }
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, c.bias), add), 20);
  amin = _mm256_min_epu32(amin, a);
  if (kSecond) return r;
  return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(u, 24), c.sign));
}

// x[0, kQBlock) (32-byte aligned) as codes at out[0, kQBlock); amax_bits: the largest
// |x| as an integer maximum of the bits (of x itself for the second moment, whose
// negative values, -0 and NaN included, then count as non-finite); returns the scale.
template <bool kSecond, bool kSR>
RAMFLOW_AVX2 inline float encode_block8(const float* x, uint32_t amax_bits, uint8_t* out, const uint32_t* bits) {
  if (amax_bits >= kFp8Inf) return encode_block8_exact<kSecond, kSR>(x, block_amax(x, kQBlock), out, bits);
  const Fp8Fast f = fp8_fast(amax_bits);
  const Fp8FastConsts8 c{I8(kSR ? f.bias - 0x7FFFFu : f.bias), I8(0x7FFFFFFF), I8(1), I8(0x80)};
  const __m256i low = I8(f.low);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // as encode_block8_exact
  for (int64_t j = 0; j < kQBlock; j += 32) {
    __m256i k[4];
    __m256i amin = I8(0xFFFFFFFFu);
    for (int r = 0; r < 4; ++r) k[r] = f32x8_to_fp8_fast<kSecond, kSR>(x + j + 8 * r, c, amin, bits + j + 8 * r);
    // a lane below `low` (signed compare: |x| < 2^31 in a finite block)
    if (__builtin_expect(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(low, amin))) != 0, 0)) {
      encode32_exact<kSecond, kSR>(x + j, f.rcp, out + j, bits + j);
      continue;
    }
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(k[0], k[1]), _mm256_packus_epi32(k[2], k[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(b, order));
  }
  return f.scale;
}

// The largest of 8 unsigned lanes.
RAMFLOW_AVX2 inline uint32_t max_lane_u32(__m256i x) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// [Note: the rounding bits in fewer operations] (lean_kernels_avx2.cpp): its constant,
// and the rounding bits from x1 = K + T[t] of the note.
constexpr uint32_t kHashC21 = kHashC2 * kHashC1;  // mod 2^32

// The note's K of the block whose first element is index0 (below 2^32); T (bits_table, in
// element order) is made again only where the low byte of the key's mix changes (table_q).
inline uint32_t short_bits_base(int64_t index0, uint32_t key, uint32_t& table_q, uint32_t* bits_table) {
  const uint32_t x0 = static_cast<uint32_t>(index0) ^ key;
  const uint32_t y = x0 ^ (x0 >> 16);
  if ((y & 0xFF) != table_q) {
    table_q = y & 0xFF;
    for (uint32_t t = 0; t < kQBlock; ++t) bits_table[t] = (t ^ table_q) * kHashC1;
  }
  return (y & ~0xFFu) * kHashC1;
}

// (up to the last multiply: y of hash32_8_pre)
RAMFLOW_AVX2 inline __m256i sr_bits_pre_from_x1(__m256i x1) {
  x1 = _mm256_xor_si256(x1, _mm256_srli_epi32(x1, 15));
  const __m256i y = _mm256_mullo_epi32(x1, I8(kHashC21));
  return _mm256_xor_si256(y, _mm256_srli_epi32(y, 15));
}

// One block of 8-bit states, as both AVX2 loops read it: each state's scale (the fast
// decoder's, a float times 2^120, or the exact one's) and whether the block takes the
// exact decoder (a zero or huge scale, or a special code: block_has_special8).
struct Q8Block {
  __m256 m_scale, v_scale;
  bool m_special, v_special;
};

RAMFLOW_AVX2 inline Q8Block q8_block(const LeanArgs& a, int64_t block) {
  const int64_t begin = block * kQBlock;
  const float ms = fast_scale(a.exp_avg_scale[block]);
  const float vs = fast_scale(a.exp_avg_sq_scale[block]);
  Q8Block q;
  q.m_special = ms == 0.0f || block_has_special8(static_cast<const uint8_t*>(a.exp_avg) + begin);
  q.v_special = vs == 0.0f || block_has_special8(static_cast<const uint8_t*>(a.exp_avg_sq) + begin);
  q.m_scale = _mm256_set1_ps(q.m_special ? a.exp_avg_scale[block] : ms);
  q.v_scale = _mm256_set1_ps(q.v_special ? a.exp_avg_sq_scale[block] : vs);
  return q;
}

template <int kGrad, int kMaster, int kState>
RAMFLOW_AVX2 void lean_blocks_avx2(const LeanArgs& a, int64_t block_begin, int64_t block_end) {
  const void* const grad = a.grad;
  void* const master = a.master;
  uint16_t* const compensation = reinterpret_cast<uint16_t*>(a.compensation);
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  uint16_t* const wire_out = static_cast<uint16_t*>(a.wire_out);
  const int32_t wire_dtype = a.wire_dtype;
  const int64_t counter_offset = a.counter_offset;
  const uint32_t key = a.key;
  const bool apply_scale = a.apply_scale != 0;
  const bool apply_decay = a.apply_decay != 0;
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale);
  const __m256 decay = _mm256_set1_ps(a.decay);
  const __m256 beta1 = _mm256_set1_ps(a.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(a.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(a.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(a.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(a.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(a.eps);
  const __m256 neg_step_size = _mm256_set1_ps(a.neg_step_size);
  const __m256i top_halves = top_halves8_control();
  // bf16 and 8-bit states round stochastically: [Note: stochastic rounding of the 8-bit states]
  constexpr bool kStateSR = kState != kStateF32;
  alignas(32) float m_new[kQBlock];
  alignas(32) float s_new[kQBlock];  // sqrt(v)
  alignas(32) uint32_t st_bits[kQBlock];  // [Note: stochastic rounding of the 8-bit states]
  alignas(32) uint32_t bits_table[kQBlock];  // [Note: the rounding bits in fewer operations]
  uint32_t table_q = 0xFFFFFFFFu;  // none yet
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t begin = block * kQBlock;
    // the rounding counter's lanes (idx), stepped by 8: their low words wrap by themselves,
    // and only a block that crosses a multiple of 2^32 (once per 16 G elements) reads them
    // afresh. bf16 and 8-bit states take the short bits below 2^32 from a multiple of
    // kQBlock (8-bit states' blocks always are: never crossing) and build the lanes only for
    // the full hash otherwise; a block of bf16 states that crosses takes the scalar block.
    const int64_t index0 = counter_offset + begin;
    const bool crosses = static_cast<uint32_t>(index0) > 0xFFFFFFFFu - (kQBlock - 1);
    if (kStateSR && crosses) {
      lean_block(a, begin, kQBlock);
      continue;
    }
    const bool short_bits =
        kStateSR && (static_cast<uint64_t>(index0) >> 32) == 0 && (index0 & (kQBlock - 1)) == 0;
    __m256i bits_base = _mm256_setzero_si256();
    if (short_bits) bits_base = I8(short_bits_base(index0, key, table_q, bits_table));
    const __m256i hi_word = I8(static_cast<uint32_t>(static_cast<uint64_t>(index0) >> 32));
    __m256i idx = counter_lanes8(index0);
    Q8Block q{};  // zeros: unused unless the states are 8-bit
    if constexpr (kState == kStateQ8) q = q8_block(a, block);
    const __m256 m_scale = q.m_scale;
    const __m256 v_scale = q.v_scale;
    const bool m_special = q.m_special;
    const bool v_special = q.v_special;
    __m256i m_max = _mm256_setzero_si256();  // [Note: the FP8 encoder's fast blocks]
    __m256i s_max = _mm256_setzero_si256();
    for (int64_t j = 0; j < kQBlock; j += 8) {
      const int64_t i = begin + j;
      __m256 g = load_grad8<kGrad>(grad, i);
      if (apply_scale) g = _mm256_mul_ps(g, grad_scale);
      __m256 p;
      if constexpr (kMaster == kMasterF32) {
        p = _mm256_loadu_ps(static_cast<const float*>(master) + i);
      } else {
        p = bf16x8_to_f32(master, i);
        if constexpr (kMaster == kMasterKahan) p = _mm256_add_ps(p, bf16x8_to_f32(compensation, i));
      }
      if (apply_decay) p = _mm256_mul_ps(p, decay);
      __m256 m;
      __m256 v;
      if constexpr (kState == kStateF32) {
        m = _mm256_loadu_ps(static_cast<const float*>(exp_avg) + i);
        v = _mm256_loadu_ps(static_cast<const float*>(exp_avg_sq) + i);
      } else if constexpr (kState == kStateBF16) {
        m = bf16x8_to_f32(exp_avg, i);
        v = bf16x8_to_f32(exp_avg_sq, i);
      } else {
        const uint8_t* const qm = static_cast<const uint8_t*>(exp_avg) + i;
        const uint8_t* const qv = static_cast<const uint8_t*>(exp_avg_sq) + i;
        m = _mm256_mul_ps(m_special ? fp8x8_to_f32(qm) : fp8x8_to_f32_normal(qm), m_scale);
        const __m256 u = _mm256_mul_ps(v_special ? fp8x8_to_f32(qv) : fp8x8_to_f32_normal(qv), v_scale);
        v = _mm256_mul_ps(u, u);
      }
      m = _mm256_add_ps(_mm256_mul_ps(m, beta1), _mm256_mul_ps(g, one_minus_beta1));
      v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(g, one_minus_beta2), g));
      const __m256 sq = _mm256_sqrt_ps(v);
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(sq, bc2_sqrt), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(m, neg_step_size), denom));
      if constexpr (kState == kStateF32) {
        _mm256_storeu_ps(static_cast<float*>(exp_avg) + i, m);
        _mm256_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      } else if constexpr (kState == kStateQ8) {
        _mm256_store_ps(m_new + j, m);
        _mm256_store_ps(s_new + j, sq);
        m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(m), I8(0x7FFFFFFF)));
        s_max = _mm256_max_epu32(s_max, _mm256_castps_si256(sq));
      }
      // with bf16 or 8-bit states: y of hash32_8_pre, then state_bits and the master's bits
      // (top 16 right) one multiply each; bf16 states are stored here, 8-bit ones' bits kept
      __m256i state_sr_bits = _mm256_setzero_si256();  // the master's bits, from y
      if constexpr (kStateSR) {
        const __m256i y = short_bits ? sr_bits_pre_from_x1(_mm256_add_epi32(bits_base, _mm256_load_si256(reinterpret_cast<const __m256i*>(bits_table + j))))
                                     : hash32_8_pre(_mm256_add_epi32(hash32_8(_mm256_xor_si256(counter_lanes8(counter_offset + i), I8(key))), hi_word));
        const __m256i w = _mm256_mullo_epi32(y, I8(kStateMulC2));  // state_bits
        if constexpr (kState == kStateQ8) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(st_bits + j), w);
        } else {  // the first moment's u is w's top 16, the second's its bottom 16
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(exp_avg) + i),
                           top_halves8(bf16_stochastic_top(m, w), top_halves));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(exp_avg_sq) + i),
                           top_halves8(bf16_stochastic_top(v, _mm256_slli_epi32(w, 16)), top_halves));
        }
        if constexpr (kMaster == kMasterSR) state_sr_bits = _mm256_mullo_epi32(y, I8(kHashC2));
      }
      if constexpr (kMaster == kMasterF32) {
        _mm256_storeu_ps(static_cast<float*>(master) + i, p);
        if (wire_dtype == kBF16) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(wire_out + i), to_bf16_8(p));
        } else if (wire_dtype == kF16) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(wire_out + i),
                           _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
      } else if constexpr (kMaster == kMasterSR) {
        const int64_t index = counter_offset + i;
        const uint32_t lo = static_cast<uint32_t>(index);
        __m128i b16;
        if (crosses && lo > 0xFFFFFFFFu - 7u) {  // the lanes cross a multiple of 2^32: as the scalar does
          alignas(32) float ps[8];
          alignas(16) uint16_t bs[8];
          _mm256_store_ps(ps, p);
          for (int l = 0; l < 8; ++l) bs[l] = bf16_stochastic(ps[l], sr_bits(key, index + l));
          b16 = _mm_load_si128(reinterpret_cast<const __m128i*>(bs));
        } else {
          __m256i bits = state_sr_bits;  // with bf16 or 8-bit states: computed above
          if constexpr (!kStateSR) {
            const __m256i h = hash32_8(_mm256_xor_si256(crosses ? counter_lanes8(index) : idx, I8(key)));
            const __m256i hi =
                crosses ? I8(static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32)) : hi_word;
            bits = hash32_8_top(_mm256_add_epi32(h, hi));
          }
          // the bf16 is the top half of p's bits + bits / 2^16 (0x7FC0 for NaN)
          b16 = top_halves8(bf16_stochastic_top(p, bits), top_halves);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(master) + i), b16);
      } else {
        const __m128i hi16 = to_bf16_8(p);
        const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi16), 16));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(master) + i), hi16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(compensation + i), to_bf16_8(_mm256_sub_ps(p, hi)));
      }
      if constexpr (!kStateSR) idx = _mm256_add_epi32(idx, I8(8));
    }
    if constexpr (kState == kStateQ8) {
      uint8_t* const qm = static_cast<uint8_t*>(exp_avg) + begin;
      uint8_t* const qv = static_cast<uint8_t*>(exp_avg_sq) + begin;
      a.exp_avg_scale[block] = encode_block8<false, true>(m_new, max_lane_u32(m_max), qm, st_bits);
      a.exp_avg_sq_scale[block] = encode_block8<true, true>(s_new, max_lane_u32(s_max), qv, st_bits);
    }
  }
}
#endif  // RAMFLOW_X86

}  // namespace

// The AVX-512 loop, the dispatch and the entry points follow in lean_kernels_avx512.cpp.
