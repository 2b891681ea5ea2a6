// ramflow: Muon's host passes in one pass each over fp32 host buffers. Compiled as one
// translation unit after cpu_kernels.cpp and the lean kernels (see
// _cpu_kernels._read_source), whose helpers it uses (to_bf16_8, cpu_has_avx2,
// share_blocks). See kernels/muon_kernels.py, [Note: Muon's host passes bit for bit].
namespace {

// Mirrored by _BlendArgs (ctypes) in kernels/muon_kernels.py; keep both in the same order.
struct MuonBlendArgs {
  float* momentum;      // (n,) fp32, updated in place
  const float* grad;    // (n,) fp32
  uint16_t* out;        // (n,) bf16 bits: the blend the iteration starts from
  int64_t n;
  double momentum_weight;  // 1 - mu: m <- lerp(m, g, 1 - mu)
  double nesterov_weight;  // mu: u = lerp(g, m, mu)
  int32_t nesterov;
  int32_t torch_fma;     // PyTorch's lerp fuses its multiply-add (every SIMD build)
  int32_t force_scalar;  // 1: skip the SIMD loop (tests)
  int32_t num_threads;   // <= 0: ATen's
};

// Mirrored by _ApplyArgs (ctypes) in kernels/muon_kernels.py.
struct MuonApplyArgs {
  float* param;               // (n,) fp32, updated in place
  const uint16_t* orthogonal;  // (n,) bf16 bits
  int64_t n;
  double decay;  // 1 - lr * wd, as Python computes it
  double alpha;  // -adjusted lr
  int32_t torch_fma;
  int32_t force_scalar;
  int32_t num_threads;
};

// at::lerp's weight, as its kernel holds it: (coefficient, base is self) where
// lerp(self, end, w) = coefficient * (end - self) + (small ? self : end).
struct Lerp {
  float coeff;
  bool small;
  explicit Lerp(double weight) {
    const float w = static_cast<float>(weight);
    small = std::abs(w) < 0.5f;
    coeff = small ? w : w - 1.0f;
  }
};

inline float lerp1(float self, float end, const Lerp& l, bool fma) {
  const float d = end - self;
  const float base = l.small ? self : end;
  return fma ? std::fma(l.coeff, d, base) : l.coeff * d + base;
}

inline uint16_t bf16_bits(float x) {
  const c10::BFloat16 h(x);  // nearest even; NaN -> 0x7FC0
  return h.x;
}

void blend_scalar(const MuonBlendArgs& a, int64_t begin, int64_t end) {
  const Lerp lm(a.momentum_weight), ln(a.nesterov_weight);
  const bool fma = a.torch_fma != 0;
  for (int64_t i = begin; i < end; ++i) {
    const float g = a.grad[i];
    const float m = lerp1(a.momentum[i], g, lm, fma);
    a.momentum[i] = m;
    a.out[i] = bf16_bits(a.nesterov ? lerp1(g, m, ln, fma) : m);
  }
}

void apply_scalar(const MuonApplyArgs& a, int64_t begin, int64_t end) {
  const float decay = static_cast<float>(a.decay);
  const float alpha = static_cast<float>(a.alpha);
  const bool fma = a.torch_fma != 0;
  for (int64_t i = begin; i < end; ++i) {
    uint32_t bits = static_cast<uint32_t>(a.orthogonal[i]) << 16;
    float o;
    std::memcpy(&o, &bits, sizeof(o));
    const float p = a.param[i] * decay;
    a.param[i] = fma ? std::fma(o, alpha, p) : p + alpha * o;
  }
}

#if RAMFLOW_X86
RAMFLOW_AVX2 inline __m256 lerp8(__m256 self, __m256 end, __m256 coeff, bool small) {
  return _mm256_fmadd_ps(coeff, _mm256_sub_ps(end, self), small ? self : end);
}

// [begin, end): a multiple of 8 elements. Only built for PyTorch's fused arithmetic.
RAMFLOW_AVX2 void blend_avx2(const MuonBlendArgs& a, int64_t begin, int64_t end, bool stream) {
  const Lerp lm(a.momentum_weight), ln(a.nesterov_weight);
  const __m256 cm = _mm256_set1_ps(lm.coeff), cn = _mm256_set1_ps(ln.coeff);
  for (int64_t i = begin; i < end; i += 8) {
    const __m256 g = _mm256_loadu_ps(a.grad + i);
    const __m256 m = lerp8(_mm256_loadu_ps(a.momentum + i), g, cm, lm.small);
    _mm256_storeu_ps(a.momentum + i, m);
    const __m128i h = to_bf16_8(a.nesterov ? lerp8(g, m, cn, ln.small) : m);
    __m128i* dst = reinterpret_cast<__m128i*>(a.out + i);
    if (stream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
  if (stream) _mm_sfence();
}

RAMFLOW_AVX2 void apply_avx2(const MuonApplyArgs& a, int64_t begin, int64_t end) {
  const __m256 decay = _mm256_set1_ps(static_cast<float>(a.decay));
  const __m256 alpha = _mm256_set1_ps(static_cast<float>(a.alpha));
  for (int64_t i = begin; i < end; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.orthogonal + i));
    const __m256 o = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.param + i), decay);
    _mm256_storeu_ps(a.param + i, _mm256_fmadd_ps(o, alpha, p));
  }
}
#endif

// The SIMD loop is used when PyTorch fuses (the AVX2 loop always does) and the CPU has it.
bool muon_simd(int32_t torch_fma, int32_t force_scalar) {
#if RAMFLOW_X86
  return torch_fma && !force_scalar && cpu_has_avx2();
#else
  (void)torch_fma;
  (void)force_scalar;
  return false;
#endif
}

// Runs ``simd_part(begin, end)`` over each block's whole 8-lane groups (when ``simd``) and
// ``scalar_part`` over the rest, the blocks shared over ``num_threads``.
template <typename Simd, typename Scalar>
void for_blocks(int64_t n, int32_t num_threads, bool simd, Simd simd_part, Scalar scalar_part) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  share_blocks(num_blocks, kGrainBlocks, num_threads, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * kBlock, end = std::min(b1 * kBlock, n);
    int64_t i = begin;
    if (simd) {
      const int64_t simd_end = begin + (end - begin) / 8 * 8;
      if (simd_end > begin) simd_part(begin, simd_end);
      i = simd_end;
    }
    scalar_part(i, end);
  });
}

}  // namespace

extern "C" int ramflow_muon_blend(const MuonBlendArgs* args) {
  const MuonBlendArgs a = *args;
  if (a.n <= 0) return 0;
  const bool simd = muon_simd(a.torch_fma, a.force_scalar);
  // The blend is write-only and leaves for the device (or the iteration) next: no need
  // to read it into the cache first.
  const bool stream = a.n >= kStreamingMinElements && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  for_blocks(
      a.n, a.num_threads, simd,
      [&](int64_t b, int64_t e) {
#if RAMFLOW_X86
        blend_avx2(a, b, e, stream);
#endif
      },
      [&](int64_t b, int64_t e) { blend_scalar(a, b, e); });
  return 0;
}

extern "C" int ramflow_muon_apply(const MuonApplyArgs* args) {
  const MuonApplyArgs a = *args;
  if (a.n <= 0) return 0;
  const bool simd = muon_simd(a.torch_fma, a.force_scalar);
  for_blocks(
      a.n, a.num_threads, simd,
      [&](int64_t b, int64_t e) {
#if RAMFLOW_X86
        apply_avx2(a, b, e);
#endif
      },
      [&](int64_t b, int64_t e) { apply_scalar(a, b, e); });
  return 0;
}
