// ramflow: fused AdamW step over flat fp32 host buffers. See kernels/cpu_kernels.py,
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

// Mirrored by _Args (ctypes) in kernels/cpu_kernels.py; keep both in the same order.
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

// The elements of [0, n) a multiple of 8 that ramflow_round_to_bf16 rounds with AVX2.
RAMFLOW_AVX2 int64_t round_to_bf16_avx2(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), to_bf16_8(_mm256_loadu_ps(x + i)));
  }
  return i;
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

// x (n,) fp32 -> out (n,) bf16 bits, rounded to nearest even as c10::BFloat16(float) and
// PyTorch's copy_ round (NaN -> 0x7FC0), on the calling thread only: the seeded init rounds
// each chunk on the thread that drew it (a PyTorch copy_ there would start an OpenMP team
// per thread). See [Note: drawing a unit's chunks at once] in train/initialization.py.
extern "C" int ramflow_round_to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if RAMFLOW_X86
  if (cpu_has_avx2()) i = round_to_bf16_avx2(x, out, n);
#endif
  for (; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;
  return 0;
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
  // at::parallel_for's one range per thread (slower alone and in a training step:
  // docs/speed.md, "CPU kernel work sharing and threads").
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

// The lean host formats' step follows in lean_kernels.cpp (one translation unit).
