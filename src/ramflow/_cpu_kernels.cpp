// ramflow: fused AdamW step over flat fp32 host buffers. See _cpu_kernels.py,
// [Note: matching PyTorch's fused AdamW bit for bit]. Compile with -ffp-contract=off:
// every fused multiply-add here is deliberate and every other one would break exactness.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define RAMFLOW_X86 1
#endif

namespace {

enum DType : int32_t { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

// Mirrored by _Args (ctypes) in _cpu_kernels.py; keep both in the same order.
struct Args {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* accumulate;  // may be null
  float* grad_out;    // may be null; unused when accumulate is given
  void* wire_out;     // may be null
  int64_t n;
  int64_t step;
  double lr, beta1, beta2, eps, weight_decay, grad_scale;
  int32_t grad_dtype;
  int32_t wire_dtype;
  int32_t torch_fma;        // PyTorch's kernel fuses multiply-adds (its AVX2 build)
  int32_t torch_vec_width;  // elements per vector in PyTorch's kernel (8)
  int32_t streaming;        // 1: non-temporal stores for write-only outputs, 0: never, -1: auto
  int32_t force_scalar;     // 1: skip the SIMD loop (tests)
  int32_t num_threads;      // threads of the step; <= 0: ATen's (torch.get_num_threads())
};

// The per-call constants, in float, computed exactly as PyTorch computes them.
struct Coeffs {
  float decay;
  bool apply_decay;
  float lerp_coeff;  // w if lerp_small else w - 1
  bool lerp_small;
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;
  float eps;
  float neg_step_size;
  float grad_scale;
  bool apply_scale;
  bool fma;
};

Coeffs make_coeffs(const Args& a) {
  Coeffs c;
  // PyTorch reads the step with state_step.item<float>().
  const double step = static_cast<double>(static_cast<float>(a.step));
  const double bias_correction1 = 1 - std::pow(a.beta1, step);
  const double bias_correction2 = 1 - std::pow(a.beta2, step);
  const double step_size = a.lr / bias_correction1;
  c.fma = a.torch_fma != 0;
  c.apply_decay = a.weight_decay != 0.0;
  c.decay = static_cast<float>(c.fma ? std::fma(-a.lr, a.weight_decay, 1.0) : 1 - a.lr * a.weight_decay);
  const float w = static_cast<float>(1 - a.beta1);
  c.lerp_small = std::abs(w) < 0.5f;
  c.lerp_coeff = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - a.beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(a.eps);
  c.neg_step_size = -static_cast<float>(step_size);
  c.grad_scale = static_cast<float>(a.grad_scale);
  c.apply_scale = a.grad_scale != 1.0;
  return c;
}

inline float grad_at(const Args& a, int64_t i) {
  switch (a.grad_dtype) {
    case kBF16: return static_cast<float>(static_cast<const c10::BFloat16*>(a.grad)[i]);
    case kF16: return static_cast<float>(static_cast<const c10::Half*>(a.grad)[i]);
    default: return static_cast<const float*>(a.grad)[i];
  }
}

// One element. `tail` selects PyTorch's scalar-tail arithmetic (the last n % 8 elements).
inline void step_scalar(const Args& a, const Coeffs& c, int64_t i, bool tail) {
  float g = grad_at(a, i);
  if (a.accumulate) g = a.accumulate[i] + g;
  if (c.apply_scale) g = g * c.grad_scale;
  if (a.accumulate) {
    a.accumulate[i] = g;
  } else if (a.grad_out) {
    a.grad_out[i] = g;
  }
  float p = a.param[i];
  if (c.apply_decay) p = p * c.decay;
  float m = a.exp_avg[i];
  const float d = g - m;
  const float base = c.lerp_small ? m : g;
  m = c.fma ? std::fma(c.lerp_coeff, d, base) : c.lerp_coeff * d + base;
  float v = a.exp_avg_sq[i];
  const float cg = c.one_minus_beta2 * g;
  if (!c.fma) {
    v = v * c.beta2 + cg * g;
  } else if (tail) {
    v = std::fma(v, c.beta2, cg * g);
  } else {
    v = std::fma(g, cg, v * c.beta2);
  }
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step_size * m) / denom;
  a.exp_avg[i] = m;
  a.exp_avg_sq[i] = v;
  a.param[i] = p;
  if (a.wire_dtype == kBF16) {
    static_cast<c10::BFloat16*>(a.wire_out)[i] = c10::BFloat16(p);  // round to nearest even
  } else if (a.wire_dtype == kF16) {
    static_cast<c10::Half*>(a.wire_out)[i] = c10::Half(p);
  }
}

#if RAMFLOW_X86
// A per-function target rather than -mavx2 for the whole file: the build stays portable
// and the loop is picked at run time (cpu_has_avx2).
#define RAMFLOW_AVX2 __attribute__((target("avx2,fma,f16c")))

template <int kGrad>
RAMFLOW_AVX2 inline __m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (kGrad == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (kGrad == kF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(h);
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

// float -> bfloat16, round to nearest even like c10::BFloat16(float); NaN -> 0x7FC0.
RAMFLOW_AVX2 inline __m128i to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// [begin, end): a multiple of 8 elements, all in PyTorch's vector loop.
template <int kGrad, int kWire>
RAMFLOW_AVX2 void step_avx2(const Args& a, const Coeffs& c, int64_t begin, int64_t end, bool stream_wire, bool stream_grad) {
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 lerp_coeff = _mm256_set1_ps(c.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  const __m256 neg_step_size = _mm256_set1_ps(c.neg_step_size);
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  for (int64_t i = begin; i < end; i += 8) {
    __m256 g = load_grad8<kGrad>(a.grad, i);
    if (a.accumulate) g = _mm256_add_ps(_mm256_loadu_ps(a.accumulate + i), g);
    if (c.apply_scale) g = _mm256_mul_ps(g, grad_scale);
    if (a.accumulate) {
      _mm256_storeu_ps(a.accumulate + i, g);
    } else if (a.grad_out) {
      if (stream_grad) {
        _mm256_stream_ps(a.grad_out + i, g);
      } else {
        _mm256_storeu_ps(a.grad_out + i, g);
      }
    }
    __m256 p = _mm256_loadu_ps(a.param + i);
    if (c.apply_decay) p = _mm256_mul_ps(p, decay);
    __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    const __m256 d = _mm256_sub_ps(g, m);
    const __m256 base = c.lerp_small ? m : g;
    __m256 v = _mm256_loadu_ps(a.exp_avg_sq + i);
    const __m256 cg = _mm256_mul_ps(one_minus_beta2, g);
    if (c.fma) {
      m = _mm256_fmadd_ps(lerp_coeff, d, base);
      v = _mm256_fmadd_ps(g, cg, _mm256_mul_ps(v, beta2));
    } else {
      m = _mm256_add_ps(_mm256_mul_ps(lerp_coeff, d), base);
      v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(cg, g));
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    _mm256_storeu_ps(a.param + i, p);
    if constexpr (kWire != kNone) {
      __m128i h;
      if constexpr (kWire == kBF16) {
        h = to_bf16_8(p);
      } else {
        h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.wire_out) + i);
      if (stream_wire) {
        _mm_stream_si128(dst, h);
      } else {
        _mm_storeu_si128(dst, h);
      }
    }
  }
  if (stream_wire || stream_grad) _mm_sfence();
}

using Avx2Fn = void (*)(const Args&, const Coeffs&, int64_t, int64_t, bool, bool);

template <int kGrad>
Avx2Fn pick_wire(int wire) {
  switch (wire) {
    case kBF16: return &step_avx2<kGrad, kBF16>;
    case kF16: return &step_avx2<kGrad, kF16>;
    default: return &step_avx2<kGrad, kNone>;
  }
}

Avx2Fn pick_avx2(int grad, int wire) {
  switch (grad) {
    case kBF16: return pick_wire<kBF16>(wire);
    case kF16: return pick_wire<kF16>(wire);
    default: return pick_wire<kF32>(wire);
  }
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return ok;
}
#endif  // RAMFLOW_X86

// Non-temporal stores skip the read-for-ownership of write-only outputs, but only pay off
// when the buffers do not fit in the caches anyway.
constexpr int64_t kStreamingMinElements = int64_t(1) << 21;
// Work items of 64 elements: every thread's range starts on a cache line of every buffer
// whose base is cache-line aligned.
constexpr int64_t kBlock = 64;
constexpr int64_t kGrainBlocks = 256;

}  // namespace

extern "C" int ramflow_simd_level() {
#if RAMFLOW_X86
  return cpu_has_avx2() ? 2 : 0;
#else
  return 0;
#endif
}

extern "C" int ramflow_fused_adamw_step(const Args* args) {
  const Args a = *args;
  if (a.n <= 0) return 0;
  const Coeffs c = make_coeffs(a);
  const int64_t width = std::max<int32_t>(a.torch_vec_width, 1);
  const int64_t tail_start = a.n - a.n % width;
  bool use_simd = false;
  bool stream_wire = false;
  bool stream_grad = false;
#if RAMFLOW_X86
  Avx2Fn simd = nullptr;
  if (!a.force_scalar && width % 8 == 0 && cpu_has_avx2()) {
    use_simd = true;
    simd = pick_avx2(a.grad_dtype, a.wire_dtype);
    const bool big = a.streaming > 0 || (a.streaming < 0 && a.n >= kStreamingMinElements);
    stream_wire = big && a.wire_out && reinterpret_cast<uintptr_t>(a.wire_out) % 16 == 0;
    stream_grad = big && a.grad_out && !a.accumulate && reinterpret_cast<uintptr_t>(a.grad_out) % 32 == 0;
  }
#endif
  const int64_t num_blocks = (a.n + kBlock - 1) / kBlock;
  auto body = [&](int64_t block_begin, int64_t block_end) {
    const int64_t begin = block_begin * kBlock;
    const int64_t end = std::min(block_end * kBlock, a.n);
    int64_t i = begin;
#if RAMFLOW_X86
    if (use_simd) {
      const int64_t simd_end = begin + (std::min(end, tail_start) - begin) / 8 * 8;
      if (simd_end > begin) simd(a, c, begin, simd_end, stream_wire, stream_grad);
      i = std::max(begin, simd_end);
    }
#endif
    for (; i < end; ++i) step_scalar(a, c, i, i >= tail_start);
  };
  // [Note: dynamic work sharing] Each thread takes kGrainBlocks blocks at a time from a
  // shared counter, so a thread that the OS deschedules (the training loop's own thread,
  // the CUDA driver's) holds up one chunk, not a sixteenth of the unit as with
  // at::parallel_for's one range per thread (10-15% slower on the GPU box, alone and in a
  // training step: benchmarks/results/2026-11-22-nvidia-h200-optimizer-threads).
  const int threads = a.num_threads > 0 ? a.num_threads : at::get_num_threads();
  const int team = static_cast<int>(std::min<int64_t>(threads, (num_blocks + kGrainBlocks - 1) / kGrainBlocks));
  if (team <= 1) {
    body(0, num_blocks);
    return 0;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(team)
  {
    for (;;) {
      const int64_t b = next.fetch_add(kGrainBlocks, std::memory_order_relaxed);
      if (b >= num_blocks) break;
      body(b, std::min(b + kGrainBlocks, num_blocks));
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------
// Lean host formats: AdamW over a bf16 master (stochastic rounding or a bf16 Kahan
// compensation) and fp32, bf16 or 8-bit block-wise states. See _lean_kernels.py,
// [Note: lean formats, one pass] and [Note: counter-based stochastic rounding]. Plain
// scalar code with every operation in the same order as the PyTorch path there, so both
// give the same bits (-ffp-contract=off keeps the compiler from fusing any of it).
namespace {

enum MasterFormat : int32_t { kMasterF32 = 0, kMasterSR = 1, kMasterKahan = 2 };
enum StateFormat : int32_t { kStateF32 = 0, kStateBF16 = 1, kStateQ8 = 2 };
constexpr int64_t kQBlock = 256;       // elements per 8-bit block (one absmax each)
constexpr int64_t kLeanGrainQBlocks = 64;  // 16384 elements per work item

// Mirrored by _LeanArgs (ctypes) in _lean_kernels.py; keep both in the same order.
struct LeanArgs {
  void* master;                 // fp32 or bf16, updated in place
  c10::BFloat16* compensation;  // kMasterKahan only
  const void* grad;
  void* exp_avg;                // fp32, bf16 or uint8 codes
  void* exp_avg_sq;
  float* exp_avg_absmax;        // kStateQ8: one per block of kQBlock
  float* exp_avg_sq_absmax;
  const float* signed_code;     // kStateQ8: the 256 codes, ascending
  const float* unsigned_code;
  const uint32_t* signed_table;  // kStateQ8: 65536 entries, see [Note: 8-bit codes in one lookup]
  const uint32_t* unsigned_table;
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
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
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

// [Note: 8-bit codes in one lookup]
// The code nearest to x is the number of midpoints (between neighbouring codes) below x.
// Any two midpoints differ in their upper 16 bits, so the floats sharing the upper half
// of their bit pattern (a bf16-wide bucket) lie below or above one midpoint at most. The
// table, made in _lean_kernels.py (_code_table), holds for each bucket the count below the
// bucket (bits 0-7) and that midpoint's lower 16 bits as an order key (bits 16-31; 0xFFFF
// where the bucket holds none): the count is start + (key(x) > key(midpoint)), an exact
// integer compare. The key is the lower half, inverted for negative floats, whose bit
// patterns grow as they fall. One lookup and no float compare: NaN, infinities, signed
// zeros and subnormals (under any flush mode) get the count of the bucket's smallest
// float, as a search over the midpoints gives them. A binary search costs 8 unpredictable
// branches per element and made the 8-bit step 7x slower than the bf16 one; the table
// before this one (a byte per bucket, then a gather of the midpoint and a float compare)
// cost two dependent gathers per 8 elements in the AVX2 step.
inline uint8_t quantize_code(const uint32_t* table, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t entry = table[u >> 16];
  const uint32_t key = (u ^ (0u - (u >> 31))) & 0xFFFFu;
  return static_cast<uint8_t>((entry & 0xFFu) + (key > (entry >> 16) ? 1u : 0u));
}

inline float load_state(const LeanArgs& a, const void* s, const float* absmax, const float* code,
                        int64_t i) {
  switch (a.state_format) {
    case kStateBF16: return bf16_to_float(static_cast<const c10::BFloat16*>(s)[i]);
    case kStateQ8: return code[static_cast<const uint8_t*>(s)[i]] * absmax[i / kQBlock];
    default: return static_cast<const float*>(s)[i];
  }
}

// Writes x[0, len) as block `block` of the state s: bf16 (nearest even), fp32, or codes
// and the block's absmax.
inline void store_state(const LeanArgs& a, void* s, float* absmax, const uint32_t* table,
                        int64_t begin, int64_t len, const float* x) {
  if (a.state_format == kStateF32) {
    std::memcpy(static_cast<float*>(s) + begin, x, len * sizeof(float));
  } else if (a.state_format == kStateBF16) {
    auto* out = static_cast<c10::BFloat16*>(s) + begin;
    for (int64_t j = 0; j < len; ++j) out[j] = c10::BFloat16(x[j]);
  } else {
    float amax = 0.0f;
    for (int64_t j = 0; j < len; ++j) amax = std::max(amax, std::abs(x[j]));
    absmax[begin / kQBlock] = amax;
    const float scale = amax > 0.0f ? amax : 1.0f;
    auto* out = static_cast<uint8_t*>(s) + begin;
    for (int64_t j = 0; j < len; ++j) out[j] = quantize_code(table, x[j] / scale);
  }
}

// One block of at most kQBlock elements starting at `begin` (a multiple of kQBlock).
void lean_block(const LeanArgs& a, int64_t begin, int64_t len) {
  float m_new[kQBlock];
  float v_new[kQBlock];
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
    float m = load_state(a, a.exp_avg, a.exp_avg_absmax, a.signed_code, i);
    float v = load_state(a, a.exp_avg_sq, a.exp_avg_sq_absmax, a.unsigned_code, i);
    m = m * a.beta1 + g * a.one_minus_beta1;
    v = v * a.beta2 + (g * a.one_minus_beta2) * g;
    const float denom = std::sqrt(v) / a.bc2_sqrt + a.eps;
    p = p + (m * a.neg_step_size) / denom;
    m_new[j] = m;
    v_new[j] = v;
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
  store_state(a, a.exp_avg, a.exp_avg_absmax, a.signed_table, begin, len, m_new);
  store_state(a, a.exp_avg_sq, a.exp_avg_sq_absmax, a.unsigned_table, begin, len, v_new);
}

#if RAMFLOW_X86
// [Note: the lean step in AVX2]
// lean_block's arithmetic 8 lanes at a time, in the same order and without fused
// multiply-adds (division and square root are correctly rounded in both), so the bits are
// the scalar block's; tests compare the two (RAMFLOW_LEAN_SCALAR=1 forces the scalar one).
// One pass over the block's memory: fp32 and bf16 states are stored as they are computed;
// 8-bit ones go to two 1 KiB arrays (in L1) while the block's absmax is taken in
// registers, and are quantized from there. A code is dequantized with a gather from the
// 256-entry code (1 KiB, in L1) and quantized with one gather from the table of [Note:
// 8-bit codes in one lookup] and integer compares, so a block costs 4 gathers per 8
// elements (there were 6, two of them dependent). The constants and pointers are read
// into locals once per work item: the intrinsics' unaligned stores may alias anything, so
// the compiler would read fields of the arguments again after each. Whole blocks of
// kQBlock only; a last partial block takes the scalar path.
RAMFLOW_AVX2 inline __m256 bf16x8_to_f32(const void* base, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

RAMFLOW_AVX2 inline __m256i hash32_8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The 8 codes at q dequantized: code[q] * absmax.
RAMFLOW_AVX2 inline __m256 dequantize8(const uint8_t* q, const float* code, __m256 absmax) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(_mm256_i32gather_ps(code, _mm256_cvtepu8_epi32(b), 4), absmax);
}

// quantize_code of 8 lanes: the codes, one per int32 lane.
RAMFLOW_AVX2 inline __m256i quantize8(const uint32_t* table, __m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i entry =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_srli_epi32(u, 16), 4);
  const __m256i key =
      _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(u, 31)), _mm256_set1_epi32(0xFFFF));
  const __m256i above = _mm256_cmpgt_epi32(key, _mm256_srli_epi32(entry, 16));  // -1 or 0
  return _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)), above);
}

// [Note: quantizing without a division]
// The code of x is taken from y = x / absmax, correctly rounded. A division costs as much
// as the rest of quantize8 (the divider is the busiest unit of the step: the square root
// and two divisions of AdamW use it already), so y0 = x * (1 / absmax) is used instead
// where it cannot change the code: with r = RN(1 / absmax) (a normal float),
// |x * r - x / absmax| < 1 ulp of x / absmax, and rounding adds at most an ulp of the
// result, so y0 and y are at most 3 floats apart (5 where they straddle a power of 2).
// Both get the same code unless a midpoint lies between them: unless y0's order key is
// within 8 of the midpoint key of its bucket or within 8 of the bucket's edges. Those 8
// lanes (about 1 in 2000) are divided; so is a block whose absmax or reciprocal is not a
// normal float. The result is the division's, bit for bit (tests: _quantize_blockwise_native
// against quantize_blockwise on values next to every midpoint).
RAMFLOW_AVX2 inline __m256i quantize8_key(__m256i u) {
  return _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(u, 31)), _mm256_set1_epi32(0xFFFF));
}

RAMFLOW_AVX2 inline __m256i quantize8_fast(const uint32_t* table, __m256 x, __m256 rcp, __m256 scale) {
  __m256i u = _mm256_castps_si256(_mm256_mul_ps(x, rcp));
  __m256i entry =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_srli_epi32(u, 16), 4);
  __m256i key = quantize8_key(u);
  const __m256i margin = _mm256_set1_epi32(8);
  const __m256i near_mid = _mm256_cmpgt_epi32(
      _mm256_set1_epi32(9), _mm256_abs_epi32(_mm256_sub_epi32(key, _mm256_srli_epi32(entry, 16))));
  const __m256i near_edge = _mm256_or_si256(_mm256_cmpgt_epi32(margin, key),
                                            _mm256_cmpgt_epi32(key, _mm256_set1_epi32(0xFFFF - 8)));
  if (!_mm256_testz_si256(_mm256_or_si256(near_mid, near_edge), _mm256_or_si256(near_mid, near_edge))) {
    u = _mm256_castps_si256(_mm256_div_ps(x, scale));
    entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_srli_epi32(u, 16), 4);
    key = quantize8_key(u);
  }
  const __m256i above = _mm256_cmpgt_epi32(key, _mm256_srli_epi32(entry, 16));  // -1 or 0
  return _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)), above);
}

// x[0, kQBlock) / amax as codes at out[0, kQBlock), 32 at a time.
// See [Note: quantizing without a division].
RAMFLOW_AVX2 inline void quantize_block(const uint32_t* table, const float* x, float amax,
                                        uint8_t* out) {
  const float scale1 = amax > 0.0f ? amax : 1.0f;
  const float rcp1 = 1.0f / scale1;
  const bool fast = std::isnormal(scale1) && std::isnormal(rcp1);
  const __m256 scale = _mm256_set1_ps(scale1);
  const __m256 rcp = _mm256_set1_ps(rcp1);
  // the packs interleave the 128-bit lanes: 4-byte groups k0lo k1lo k2lo k3lo k0hi k1hi ...
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < kQBlock; j += 32) {
    __m256i k[4];
    for (int r = 0; r < 4; ++r) {
      const __m256 xr = _mm256_load_ps(x + j + 8 * r);
      k[r] = fast ? quantize8_fast(table, xr, rcp, scale) : quantize8(table, _mm256_div_ps(xr, scale));
    }
    const __m256i b =
        _mm256_packus_epi16(_mm256_packus_epi32(k[0], k[1]), _mm256_packus_epi32(k[2], k[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(b, order));
  }
}

// The largest lane; NaN lanes cannot occur (see the absmax in lean_blocks_avx2).
RAMFLOW_AVX2 inline float max_lane(__m256 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float amax = 0.0f;
  for (float l : lanes) amax = std::max(amax, l);
  return amax;
}

// One whole block x[0, kQBlock) quantized as lean_blocks_avx2 does it: the absmax (a NaN
// |x| leaves it as it is, as std::max does in the scalar block) and the codes.
RAMFLOW_AVX2 inline void quantize_block_avx2(const uint32_t* table, const float* x, uint8_t* q,
                                             float* absmax) {
  alignas(32) float xs[kQBlock];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < kQBlock; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    _mm256_store_ps(xs + j, v);
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v), amax8);
  }
  *absmax = max_lane(amax8);
  quantize_block(table, xs, *absmax, q);
}

template <int kGrad, int kMaster, int kState>
RAMFLOW_AVX2 void lean_blocks_avx2(const LeanArgs& a, int64_t block_begin, int64_t block_end) {
  const void* const grad = a.grad;
  void* const master = a.master;
  uint16_t* const compensation = reinterpret_cast<uint16_t*>(a.compensation);
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  float* const exp_avg_absmax = a.exp_avg_absmax;
  float* const exp_avg_sq_absmax = a.exp_avg_sq_absmax;
  const float* const signed_code = a.signed_code;
  const float* const unsigned_code = a.unsigned_code;
  const uint32_t* const signed_table = a.signed_table;
  const uint32_t* const unsigned_table = a.unsigned_table;
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
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float m_new[kQBlock];
  alignas(32) float v_new[kQBlock];
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t begin = block * kQBlock;
    __m256 m_absmax = _mm256_setzero_ps();
    __m256 v_absmax = _mm256_setzero_ps();
    if constexpr (kState == kStateQ8) {
      m_absmax = _mm256_set1_ps(exp_avg_absmax[block]);
      v_absmax = _mm256_set1_ps(exp_avg_sq_absmax[block]);
    }
    __m256 m_max = _mm256_setzero_ps();
    __m256 v_max = _mm256_setzero_ps();
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
        m = dequantize8(static_cast<const uint8_t*>(exp_avg) + i, signed_code, m_absmax);
        v = dequantize8(static_cast<const uint8_t*>(exp_avg_sq) + i, unsigned_code, v_absmax);
      }
      m = _mm256_add_ps(_mm256_mul_ps(m, beta1), _mm256_mul_ps(g, one_minus_beta1));
      v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(g, one_minus_beta2), g));
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(m, neg_step_size), denom));
      if constexpr (kState == kStateF32) {
        _mm256_storeu_ps(static_cast<float*>(exp_avg) + i, m);
        _mm256_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      } else if constexpr (kState == kStateBF16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(exp_avg) + i), to_bf16_8(m));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(exp_avg_sq) + i), to_bf16_8(v));
      } else {
        _mm256_store_ps(m_new + j, m);
        _mm256_store_ps(v_new + j, v);
        // max(|x|, running): a NaN |x| leaves the running max as it is, as std::max does
        // in the scalar block
        m_max = _mm256_max_ps(_mm256_andnot_ps(sign, m), m_max);
        v_max = _mm256_max_ps(_mm256_andnot_ps(sign, v), v_max);
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
        if (lo > 0xFFFFFFFFu - 7u) {  // the lanes cross a multiple of 2^32: as the scalar does
          alignas(32) float ps[8];
          alignas(16) uint16_t bs[8];
          _mm256_store_ps(ps, p);
          for (int l = 0; l < 8; ++l) bs[l] = bf16_stochastic(ps[l], sr_bits(key, index + l));
          b16 = _mm_load_si128(reinterpret_cast<const __m128i*>(bs));
        } else {
          const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo)), lane);
          const __m256i h = hash32_8(_mm256_xor_si256(idx, _mm256_set1_epi32(static_cast<int>(key))));
          const __m256i hi = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(
              static_cast<uint64_t>(index) >> 32)));
          const __m256i bits = hash32_8(_mm256_add_epi32(h, hi));
          const __m256i u = _mm256_castps_si256(p);
          __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(bits, 16)), 16);
          const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
          r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
          b16 = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(master) + i), b16);
      } else {
        const __m128i hi16 = to_bf16_8(p);
        const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi16), 16));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(master) + i), hi16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(compensation + i), to_bf16_8(_mm256_sub_ps(p, hi)));
      }
    }
    if constexpr (kState == kStateQ8) {
      const float m_amax = max_lane(m_max);
      const float v_amax = max_lane(v_max);
      exp_avg_absmax[block] = m_amax;
      exp_avg_sq_absmax[block] = v_amax;
      quantize_block(signed_table, m_new, m_amax, static_cast<uint8_t*>(exp_avg) + begin);
      quantize_block(unsigned_table, v_new, v_amax, static_cast<uint8_t*>(exp_avg_sq) + begin);
    }
  }
}

// [Note: the lean step in AVX-512]
// lean_blocks_avx2 16 lanes at a time, with the same operations in the same order, so the
// bits are the scalar block's (tests compare all three, RAMFLOW_LEAN_ISA). Besides the
// width: lane masks replace blends, and 8-bit states are dequantized a block at a time
// with byte permutes instead of gathers ([Note: dequantizing with byte permutes]), which
// needs AVX-512 VBMI (Ice Lake and later, Zen 4). The quantizer keeps its one gather per
// 16 lanes from the whole table of [Note: 8-bit codes in one lookup]: a compact table of
// the buckets in [1e-7, 1] (45 KiB for both codes, in L1) measured 3% slower on the
// H100 box's Xeon, where the whole tables (512 KiB) stay in its 2 MiB L2 (measured while
// the dequantizer still gathered; benchmarks/results/2026-11-26-nvidia-h100-lean-avx512).
#define RAMFLOW_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma,f16c")))

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
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

RAMFLOW_AVX512 inline __m512i hash32_16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// [Note: dequantizing with byte permutes]
// A gather of 16 codes costs as much as the rest of a lane's AdamW. AVX-512 VBMI looks up
// 64 bytes at once in a 128-byte table held in two registers (vpermt2b), so the 256 fp32
// codes are kept as four byte planes (plane b: byte b of each code, 256 bytes), and 64
// codes are dequantized with two lookups and a blend (on the index's top bit) per plane,
// then the planes are interleaved into fp32 (two rounds of unpacks). The unpacks work
// within 128-bit lanes, so the 64 indices are first put in the order that makes the
// floats come out in memory order (kDequantOrder). About 22 instructions per 64 codes
// against four gathers; the values are the codes' own bits, so the result is the
// gather's.
struct CodePlanes {
  alignas(64) uint8_t byte[4][256];
};

inline void make_code_planes(const float* code, CodePlanes* out) {
  for (int i = 0; i < 256; ++i) {
    uint32_t u;
    std::memcpy(&u, code + i, 4);
    for (int b = 0; b < 4; ++b) out->byte[b][i] = static_cast<uint8_t>(u >> (8 * b));
  }
}

// Byte i of the 128-bit lane L of the k-th unpacked result holds element 16k + 4L + i of
// the 64; so source position 16L + 4k + i must hold that element (i < 4).
alignas(64) constexpr uint8_t kDequantOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

// The 64 codes at q as fp32 code values (not yet times the absmax), out[0, 64).
RAMFLOW_AVX512 inline void dequantize64(const uint8_t* q, const CodePlanes& c, float* out) {
  const __m512i order = _mm512_load_si512(kDequantOrder);
  const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(q));
  const __mmask64 upper = _mm512_movepi8_mask(idx);  // index >= 128
  __m512i plane[4];
  for (int b = 0; b < 4; ++b) {
    const __m512i* t = reinterpret_cast<const __m512i*>(c.byte[b]);
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), idx, _mm512_load_si512(t + 1));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 2), idx, _mm512_load_si512(t + 3));
    plane[b] = _mm512_mask_blend_epi8(upper, lo, hi);
  }
  const __m512i w01_lo = _mm512_unpacklo_epi8(plane[0], plane[1]);
  const __m512i w01_hi = _mm512_unpackhi_epi8(plane[0], plane[1]);
  const __m512i w23_lo = _mm512_unpacklo_epi8(plane[2], plane[3]);
  const __m512i w23_hi = _mm512_unpackhi_epi8(plane[2], plane[3]);
  _mm512_store_si512(out, _mm512_unpacklo_epi16(w01_lo, w23_lo));
  _mm512_store_si512(out + 16, _mm512_unpackhi_epi16(w01_lo, w23_lo));
  _mm512_store_si512(out + 32, _mm512_unpacklo_epi16(w01_hi, w23_hi));
  _mm512_store_si512(out + 48, _mm512_unpackhi_epi16(w01_hi, w23_hi));
}

RAMFLOW_AVX512 inline __m512i quantize16_key(__m512i u) {
  return _mm512_and_si512(_mm512_xor_si512(u, _mm512_srai_epi32(u, 31)), _mm512_set1_epi32(0xFFFF));
}

// The table entries of the buckets of the fp32 patterns u.
RAMFLOW_AVX512 inline __m512i table_entry16(const uint32_t* table, __m512i u) {
  return _mm512_i32gather_epi32(_mm512_srli_epi32(u, 16), reinterpret_cast<const int*>(table), 4);
}

// quantize8_fast (or, with fast false, quantize8 of x / scale) on 16 lanes: the codes, one
// per int32 lane. See [Note: quantizing without a division].
RAMFLOW_AVX512 inline __m512i quantize16(const uint32_t* t, __m512 x, __m512 rcp, __m512 scale, bool fast) {
  __m512i u = _mm512_castps_si512(fast ? _mm512_mul_ps(x, rcp) : _mm512_div_ps(x, scale));
  __m512i entry = table_entry16(t, u);
  __m512i key = quantize16_key(u);
  if (fast) {
    const __mmask16 near_mid = _mm512_cmplt_epi32_mask(
        _mm512_abs_epi32(_mm512_sub_epi32(key, _mm512_srli_epi32(entry, 16))), _mm512_set1_epi32(9));
    const __mmask16 near_edge = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(8)) |
                                _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(0xFFFF - 8));
    if ((near_mid | near_edge) != 0) {
      u = _mm512_castps_si512(_mm512_div_ps(x, scale));
      entry = table_entry16(t, u);
      key = quantize16_key(u);
    }
  }
  const __mmask16 above = _mm512_cmpgt_epi32_mask(key, _mm512_srli_epi32(entry, 16));
  const __m512i start = _mm512_and_si512(entry, _mm512_set1_epi32(0xFF));
  return _mm512_mask_add_epi32(start, above, start, _mm512_set1_epi32(1));
}

// The divisor of a block's quantizer: its absmax (1 for an all-zero block), the
// reciprocal, and whether x * reciprocal may stand in for x / absmax.
struct QScale {
  __m512 scale, rcp;
  bool fast;
};

RAMFLOW_AVX512 inline QScale qscale(float amax) {
  const float scale1 = amax > 0.0f ? amax : 1.0f;
  const float rcp1 = 1.0f / scale1;
  return {_mm512_set1_ps(scale1), _mm512_set1_ps(rcp1), std::isnormal(scale1) && std::isnormal(rcp1)};
}

// x[0, kQBlock) / amax as codes at out[0, kQBlock), as quantize_block does.
RAMFLOW_AVX512 inline void quantize_block16(const uint32_t* t, const float* x, float amax, uint8_t* out) {
  const QScale s = qscale(amax);
  for (int64_t j = 0; j < kQBlock; j += 16) {
    const __m512i k = quantize16(t, _mm512_load_ps(x + j), s.rcp, s.scale, s.fast);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(k));
  }
}

// quantize_block16 of both states in one loop: two independent chains of gathers in
// flight instead of one.
RAMFLOW_AVX512 inline void quantize_blocks16(const uint32_t* mt, const float* m, float m_amax, uint8_t* m_out,
                                             const uint32_t* vt, const float* v, float v_amax, uint8_t* v_out) {
  const QScale ms = qscale(m_amax);
  const QScale vs = qscale(v_amax);
  for (int64_t j = 0; j < kQBlock; j += 16) {
    const __m512i mk = quantize16(mt, _mm512_load_ps(m + j), ms.rcp, ms.scale, ms.fast);
    const __m512i vk = quantize16(vt, _mm512_load_ps(v + j), vs.rcp, vs.scale, vs.fast);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m_out + j), _mm512_cvtepi32_epi8(mk));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v_out + j), _mm512_cvtepi32_epi8(vk));
  }
}

// One whole block x[0, kQBlock) quantized as lean_blocks_avx512 does it.
RAMFLOW_AVX512 inline void quantize_block_avx512(const uint32_t* t, const float* x, uint8_t* q, float* absmax) {
  alignas(64) float xs[kQBlock];
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 amax16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < kQBlock; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    _mm512_store_ps(xs + j, v);
    amax16 = _mm512_max_ps(_mm512_andnot_ps(sign, v), amax16);
  }
  *absmax = _mm512_reduce_max_ps(amax16);
  quantize_block16(t, xs, *absmax, q);
}

template <int kGrad, int kMaster, int kState>
RAMFLOW_AVX512 void lean_blocks_avx512(const LeanArgs& a, int64_t block_begin, int64_t block_end) {
  const void* const grad = a.grad;
  void* const master = a.master;
  uint16_t* const compensation = reinterpret_cast<uint16_t*>(a.compensation);
  void* const exp_avg = a.exp_avg;
  void* const exp_avg_sq = a.exp_avg_sq;
  float* const exp_avg_absmax = a.exp_avg_absmax;
  float* const exp_avg_sq_absmax = a.exp_avg_sq_absmax;
  const float* const signed_code = a.signed_code;
  const float* const unsigned_code = a.unsigned_code;
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
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i key16 = _mm512_set1_epi32(static_cast<int>(key));
  const uint32_t* const signed_table = a.signed_table;
  const uint32_t* const unsigned_table = a.unsigned_table;
  alignas(64) float m_new[kQBlock];
  alignas(64) float v_new[kQBlock];
  alignas(64) float m_code[kQBlock];  // the block's codes as code values
  alignas(64) float v_code[kQBlock];
  CodePlanes signed_planes, unsigned_planes;
  if constexpr (kState == kStateQ8) {
    make_code_planes(signed_code, &signed_planes);
    make_code_planes(unsigned_code, &unsigned_planes);
  }
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t begin = block * kQBlock;
    __m512 m_absmax = _mm512_setzero_ps();
    __m512 v_absmax = _mm512_setzero_ps();
    if constexpr (kState == kStateQ8) {
      m_absmax = _mm512_set1_ps(exp_avg_absmax[block]);
      v_absmax = _mm512_set1_ps(exp_avg_sq_absmax[block]);
      for (int64_t j = 0; j < kQBlock; j += 64) {
        dequantize64(static_cast<const uint8_t*>(exp_avg) + begin + j, signed_planes, m_code + j);
        dequantize64(static_cast<const uint8_t*>(exp_avg_sq) + begin + j, unsigned_planes, v_code + j);
      }
    }
    __m512 m_max = _mm512_setzero_ps();
    __m512 v_max = _mm512_setzero_ps();
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
        m = _mm512_mul_ps(_mm512_load_ps(m_code + j), m_absmax);
        v = _mm512_mul_ps(_mm512_load_ps(v_code + j), v_absmax);
      }
      m = _mm512_add_ps(_mm512_mul_ps(m, beta1), _mm512_mul_ps(g, one_minus_beta1));
      v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(g, one_minus_beta2), g));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(m, neg_step_size), denom));
      if constexpr (kState == kStateF32) {
        _mm512_storeu_ps(static_cast<float*>(exp_avg) + i, m);
        _mm512_storeu_ps(static_cast<float*>(exp_avg_sq) + i, v);
      } else if constexpr (kState == kStateBF16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(exp_avg) + i), to_bf16_16(m));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(exp_avg_sq) + i), to_bf16_16(v));
      } else {
        _mm512_store_ps(m_new + j, m);
        _mm512_store_ps(v_new + j, v);
        // max(|x|, running): a NaN |x| leaves the running max as it is (as std::max)
        m_max = _mm512_max_ps(_mm512_andnot_ps(sign, m), m_max);
        v_max = _mm512_max_ps(_mm512_andnot_ps(sign, v), v_max);
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
        if (lo > 0xFFFFFFFFu - 15u) {  // the lanes cross a multiple of 2^32: as the scalar does
          alignas(64) float ps[16];
          alignas(32) uint16_t bs[16];
          _mm512_store_ps(ps, p);
          for (int l = 0; l < 16; ++l) bs[l] = bf16_stochastic(ps[l], sr_bits(key, index + l));
          b16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs));
        } else {
          const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo)), lane);
          const __m512i h = hash32_16(_mm512_xor_si512(idx, key16));
          const __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(
              static_cast<uint64_t>(index) >> 32)));
          const __m512i bits = hash32_16(_mm512_add_epi32(h, hi));
          const __m512i u = _mm512_castps_si512(p);
          __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_srli_epi32(bits, 16)), 16);
          r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
          b16 = _mm512_cvtepi32_epi16(r);
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
      const float m_amax = _mm512_reduce_max_ps(m_max);
      const float v_amax = _mm512_reduce_max_ps(v_max);
      exp_avg_absmax[block] = m_amax;
      exp_avg_sq_absmax[block] = v_amax;
      quantize_blocks16(signed_table, m_new, m_amax, static_cast<uint8_t*>(exp_avg) + begin,
                        unsigned_table, v_new, v_amax, static_cast<uint8_t*>(exp_avg_sq) + begin);
    }
  }
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

// The instruction set the lean step runs: the best this CPU has (AVX-512 F/BW/DQ/VL/VBMI, else
// AVX2/FMA/F16C, else scalar code), capped by RAMFLOW_LEAN_ISA=scalar|avx2|avx512 (tests
// compare the three).
int lean_isa() {
  static const int best = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512vbmi"))
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

// x (n,) as 8-bit codes q and one absmax per block of kQBlock, as a lean step stores a
// state: the SIMD quantizer of lean_isa() on whole blocks, the scalar one on a last
// partial block. For the tests of [Note: quantizing without a division].
extern "C" int ramflow_quantize_blocks(const float* x, int64_t n, const uint32_t* table,
                                       uint8_t* q, float* absmax) {
  LeanArgs a{};
  a.state_format = kStateQ8;
  a.grad_dtype = kF32;
  const int isa = lean_isa();
  for (int64_t begin = 0; begin < n; begin += kQBlock) {
    const int64_t len = std::min(kQBlock, n - begin);
#if RAMFLOW_X86
    if (isa == kIsaAvx512 && len == kQBlock) {
      quantize_block_avx512(table, x + begin, q + begin, absmax + begin / kQBlock);
      continue;
    }
    if (isa == kIsaAvx2 && len == kQBlock) {
      quantize_block_avx2(table, x + begin, q + begin, absmax + begin / kQBlock);
      continue;
    }
#endif
    store_state(a, q, absmax, table, begin, len, x + begin);
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
