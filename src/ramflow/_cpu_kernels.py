"""One-pass AdamW step over flat fp32 host buffers: upcast, (accumulate), step, downcast.

ramflow keeps fp32 master weights and AdamW states in host RAM and steps them on the CPU
while the GPU computes. Done with stock PyTorch, a step makes three passes over DRAM per
unit: upcast the bf16 gradient that landed from the GPU into an fp32 buffer, run PyTorch's
fused CPU AdamW, then cast the new master to the bf16 "wire" buffer copied to the GPU
next: about 40 bytes of DRAM traffic per parameter, and the step is DRAM-bound. The
kernel here does it in one pass (28 bytes per parameter with a bf16 gradient and a bf16
wire copy), and its results are bit-identical to PyTorch's.

See [Note: matching PyTorch's fused AdamW bit for bit] for how.

The C++ source below is compiled on first use with ``torch.utils.cpp_extension.load_inline``
(about 6 s on a 2-core machine, 2 s on a 16-core one; a PyTorch without ``load_inline``'s
``no_implicit_headers`` adds torch/extension.h and takes a minute; cached in torch's
extensions directory, normally ``~/.cache/torch_extensions``, keyed by a hash of the source). It is built without ``-march=native``, so a cached build is
portable between machines sharing a home directory: its AVX2/FMA/F16C loop is compiled
with a per-function target and chosen at run time from CPUID. When no compiler is
available, the build fails, the CPU is not x86-64, the native kernel does not reproduce
PyTorch on a probe at load time, or ``RAMFLOW_DISABLE_CPU_KERNELS=1`` is set, the same
results come from a pure-PyTorch path (three passes, one warning, never an error).
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import operator
import os
import platform
import threading
import warnings

import torch

__all__ = ["fused_adamw_step_", "native_kernel_available"]

# [Note: matching PyTorch's fused AdamW bit for bit]
# The reference is ``torch._fused_adamw_`` on CPU (what ``torch.optim.adam.adam(...,
# fused=True, decoupled_weight_decay=True)`` calls, after it increments ``state_steps``),
# aten/src/ATen/native/cpu/FusedAdamKernel.cpp. What it does, and the kernel below copies:
#   * Scalars in double, each cast to float once: bias_correction{1,2} = 1 - pow(beta, step)
#     with ``step`` read as float; step_size = lr / bias_correction1; denominators use
#     sqrt(bias_correction2); weight decay multiplies the parameter by (1 - lr * wd) first
#     and only when wd != 0 (AdamW, decoupled).
#   * exp_avg.lerp_(grad, w), w = 1 - beta1: exp_avg + w * (grad - exp_avg) if |w| < 0.5,
#     else grad + (w - 1) * (grad - exp_avg), as one fused multiply-add (vec::fmadd).
#   * denom = sqrt(exp_avg_sq) / sqrt(bias_correction2) + eps (two roundings, no rsqrt);
#     param = param + (-step_size * exp_avg) / denom.
#   * PyTorch registers no AVX512 build of this kernel, so on every x86-64 CPU with AVX2 it
#     runs its AVX2 build: 8-lane vectors over chunks that start at multiples of 16
#     elements, so only the last n % 8 elements take its scalar tail loop.
#   * That AVX2 build is compiled by GCC with -ffp-contract=fast, which fuses more than the
#     source asks for (read from the disassembly of libtorch_cpu.so 2.13, and checked by
#     the tests): 1 - lr * wd becomes fma(-lr, wd, 1.0) in double; exp_avg_sq * beta2 +
#     (1 - beta2) * g * g becomes fma(g, (1 - beta2) * g, exp_avg_sq * beta2) in the vector
#     loop but fma(exp_avg_sq, beta2, ((1 - beta2) * g) * g) in the scalar tail. Its
#     DEFAULT build (CPUs without AVX2, or ATEN_CPU_CAPABILITY=default) fuses nothing.
# The kernel is compiled with -ffp-contract=off and writes every fused multiply-add
# explicitly, choosing the tail form for the last n % 8 elements. Because PyTorch's
# arithmetic depends on how it was compiled, the native kernel is checked against
# ``torch._fused_adamw_`` on a probe when it is loaded and is not used if they differ.

_CPP_SOURCE = r"""
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
"""

_ENV_DISABLE = "RAMFLOW_DISABLE_CPU_KERNELS"

# The lanes of PyTorch's CPU AdamW vector loop. Its dispatch has no AVX512 entry for this
# kernel (REGISTER_DISPATCH, not ALSO_REGISTER_AVX512_DISPATCH), so AVX512 CPUs run the
# AVX2 build; the DEFAULT build also uses 32-byte Vectorized<float>.
_TORCH_VEC_WIDTH = 8

_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WIRE_DTYPES = (torch.bfloat16, torch.float16)


class _Args(ctypes.Structure):
    """The C ``Args`` struct of ``_CPP_SOURCE``, field for field."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("accumulate", ctypes.c_void_p),
        ("grad_out", ctypes.c_void_p),
        ("wire_out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("grad_scale", ctypes.c_double),
        ("grad_dtype", ctypes.c_int32),
        ("wire_dtype", ctypes.c_int32),
        ("torch_fma", ctypes.c_int32),
        ("torch_vec_width", ctypes.c_int32),
        ("streaming", ctypes.c_int32),
        ("force_scalar", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


class _NativeKernel:
    """The compiled kernel, loaded once per process, or the reason it is not used.

    Attributes:
        fn: the C entry point ``ramflow_fused_adamw_step``, or None when the PyTorch path is
            used. ctypes releases the GIL for the duration of the call.
        simd_level: 2 when the AVX2/FMA/F16C loop runs on this CPU, 0 for scalar code.
        torch_fma: whether PyTorch's kernel, as dispatched on this CPU, fuses multiply-adds.
        reason: why the PyTorch path is used (empty when ``fn`` is set).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.fn = None
        self.simd_level = 0
        self.torch_fma = True
        self.reason = ""

    def get(self):
        """Build and check the kernel on first use; return the entry point or None."""
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self._load()
                    self._loaded = True
        return self.fn

    def _load(self) -> None:
        if os.environ.get(_ENV_DISABLE, "") not in ("", "0"):
            self.reason = f"{_ENV_DISABLE} is set"
            return
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self._give_up(f"it is only verified on x86-64, not {platform.machine()}")
            return
        try:
            lib = ctypes.CDLL(_build())
        except Exception as err:  # any build failure means: use PyTorch, do not crash
            self._give_up(f"it could not be built ({type(err).__name__}: {err})".strip())
            return
        fn = lib.ramflow_fused_adamw_step
        fn.argtypes = [ctypes.POINTER(_Args)]
        fn.restype = ctypes.c_int
        self.simd_level = int(lib.ramflow_simd_level())
        self.torch_fma = torch.backends.cpu.get_cpu_capability() != "DEFAULT"
        self.fn = fn
        try:
            mismatch = _probe_mismatch(self)
        except Exception as err:  # e.g. a PyTorch without a CPU torch._fused_adamw_
            mismatch = f"the probe failed: {type(err).__name__}: {err}"
        if mismatch:
            self.fn = None
            self._give_up(f"it does not reproduce torch._fused_adamw_ here ({mismatch})")

    def _give_up(self, why: str) -> None:
        self.reason = why
        warnings.warn(
            f"ramflow: the native CPU AdamW kernel is not used because {why}; stepping with "
            "PyTorch's fused AdamW in three passes instead (same results, slower). "
            f"Set {_ENV_DISABLE}=1 to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


_NATIVE = _NativeKernel()


def _build() -> str:
    """Compile ``_CPP_SOURCE`` (or find it cached) and return the shared library's path."""
    from torch.utils.cpp_extension import load_inline

    cflags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    digest = hashlib.sha256((_CPP_SOURCE + " ".join(cflags)).encode()).hexdigest()[:16]
    kwargs = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:
        # torch/extension.h and its pybind11 would triple the build time for nothing here.
        kwargs["no_implicit_headers"] = True
    path = load_inline(
        name=f"ramflow_cpu_kernels_{digest}",
        cpp_sources=[_CPP_SOURCE],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
        **kwargs,
    )
    if not isinstance(path, str):  # older torch returns None for a plain library
        from torch.utils.cpp_extension import _get_build_directory

        name = f"ramflow_cpu_kernels_{digest}"
        path = os.path.join(_get_build_directory(name, False), f"{name}.so")
    return path


# lr * wd rounds to exactly 3 * 2**-25 - 2**-54 in double, so 1 - lr * wd is a double tie
# that lands on the other side of a float32 tie than fma(-lr, wd, 1.0) does.
DECAY_PROBE_LR = 1.0647487020643466e-06
DECAY_PROBE_WD = 0.08397001746443228


def _probe_mismatch(native: _NativeKernel) -> str:
    """Step random probes with the native kernel and with PyTorch; describe any difference.

    Covers both lerp branches, weight decay on and off, a bf16 gradient and wire copy, and
    a length with a tail that PyTorch steps with scalar code.
    """
    gen = torch.Generator().manual_seed(0)
    n = 16 * 9 + 13  # PyTorch's scalar tail is its last 5 elements; it would be 13 with 16 lanes
    # The last pair makes float32(1 - lr * wd) depend on whether the product is fused.
    for lr, beta1, weight_decay in (
        (1e-2, 0.9, 0.1),
        (1e-2, 0.3, 0.0),
        (DECAY_PROBE_LR, 0.9, DECAY_PROBE_WD),
    ):
        hyper = dict(lr=lr, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        states = []
        for _ in range(2):
            p = torch.randn(n, generator=gen)
            states.append([p, torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)])
        ours, ref = states[0], states[1]
        ref[0].copy_(ours[0])
        for step in (1, 2):
            grad = torch.randn(n, generator=gen).to(torch.bfloat16)
            _step_native(
                native, ours[0], grad, ours[1], ours[2], step=step, wire_out=ours[3], **hyper
            )
            _step_torch(ref[0], grad, ref[1], ref[2], step=step, wire_out=ref[3], **hyper)
        for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "wire"), ours, ref):
            if not torch.equal(
                x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32),
            ):
                return f"{name} differs with lr={lr}, beta1={beta1}, weight_decay={weight_decay}"
    return ""


def native_kernel_available() -> bool:
    """Whether ``fused_adamw_step_`` runs the one-pass native kernel (building it if needed).

    False means it runs the pure-PyTorch path; ``RAMFLOW_DISABLE_CPU_KERNELS=1``, a missing
    compiler, a failed build, a non-x86-64 CPU or a failed exactness probe lead there.
    """
    return _NATIVE.get() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _step_native(
    native: _NativeKernel,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    accumulate: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    streaming: int = -1,
    force_scalar: bool = False,
) -> None:
    """The native kernel on validated arguments. ``streaming``: -1 auto, 0 never, 1 always
    use non-temporal stores for ``grad_out``/``wire_out``; ``force_scalar`` skips the SIMD
    loop (both for tests and benchmarks; the results do not change)."""
    assert native.fn is not None
    args = _Args(
        param=param.data_ptr(),
        grad=grad.data_ptr(),
        exp_avg=exp_avg.data_ptr(),
        exp_avg_sq=exp_avg_sq.data_ptr(),
        accumulate=_ptr(accumulate),
        grad_out=_ptr(grad_out) if accumulate is None else None,
        wire_out=_ptr(wire_out),
        n=param.numel(),
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        grad_dtype=_DTYPE_CODE[grad.dtype],
        wire_dtype=0 if wire_out is None else _DTYPE_CODE[wire_out.dtype],
        torch_fma=int(native.torch_fma),
        torch_vec_width=_TORCH_VEC_WIDTH,
        streaming=streaming,
        force_scalar=int(force_scalar),
        num_threads=num_threads or 0,
    )
    rc = native.fn(ctypes.byref(args))
    assert rc == 0, rc


@torch.no_grad()
def _step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    accumulate: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
) -> None:
    """The same step with PyTorch ops, on validated arguments: the reference semantics."""
    if accumulate is not None:
        g32 = accumulate.add_(grad)
    elif grad_out is not None:
        g32 = grad_out.copy_(grad)
    elif grad.dtype != torch.float32 or grad_scale != 1.0:
        g32 = grad.to(torch.float32, copy=True)  # never scale the caller's gradient in place
    else:
        g32 = grad
    if grad_scale != 1.0:
        g32.mul_(grad_scale)
    # torch.optim.adam.adam(fused=True) increments the step, then calls this.
    state_step = torch.tensor(float(step), dtype=torch.float32)
    torch._fused_adamw_(
        [param.view(-1)],
        [g32.view(-1)],
        [exp_avg.view(-1)],
        [exp_avg_sq.view(-1)],
        [],
        [state_step],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )
    if wire_out is not None:
        wire_out.copy_(param.view(wire_out.shape))


def _check_threads(num_threads: object) -> None:
    """``num_threads`` must be None or an int >= 1 (ValueError, TypeError otherwise)."""
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int or None, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 (or None for torch's), got {num_threads}")


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous() or a flat buffer")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}; they must match")


def _check_no_overlap(named: list[tuple[str, torch.Tensor]]) -> None:
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in named
        if t.numel()
    ]
    for i, (name_a, lo_a, hi_a) in enumerate(spans):
        for name_b, lo_b, hi_b in spans[i + 1 :]:
            if lo_a < hi_b and lo_b < hi_a:
                raise ValueError(
                    f"{name_a} and {name_b} overlap in memory; they must be separate buffers"
                )


def fused_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    accumulate: torch.Tensor | None = None,
    grad_out: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One AdamW step (Loshchilov & Hutter, 2019) in place, in one pass over memory.

    Bit-identical to PyTorch's fused CPU AdamW, ``torch.optim.adam.adam([param], [g32],
    [exp_avg], [exp_avg_sq], [], [torch.tensor(step - 1.0)], fused=True,
    decoupled_weight_decay=True, amsgrad=False, maximize=False, ...)``, where ``g32`` is
    the gradient upcast to fp32, plus ``accumulate`` if given, then times ``grad_scale``
    if it is not 1 (an fp32 multiply by ``float32(grad_scale)``, as ``g32.mul_(grad_scale)``).
    See [Note: matching PyTorch's fused AdamW bit for bit].

    Args:
        param: fp32 master weights, updated in place.
        grad: the gradient, fp32, bf16 or fp16 (for example the pinned staging buffer the
            GPU's bf16 gradient landed in); only read.
        exp_avg, exp_avg_sq: fp32 AdamW states, updated in place.
        step: the step number, already incremented (1 on the first step); an int >= 1.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW``; weight decay is
            decoupled (the parameter is multiplied by ``1 - lr * weight_decay``).
        grad_scale: multiplies the (accumulated) gradient before the step, e.g. the
            ``clip_coef`` of global-norm clipping. Default 1.0 (no multiply).
        accumulate: fp32 host gradient; if given, the gradient used is ``accumulate + grad``
            (times ``grad_scale``), and it is written back to ``accumulate``: the last
            micro-batch's gradient is added in and stepped in the same pass.
        grad_out: fp32; if given, the gradient used (upcast and scaled) is written here, so
            it can be exposed as ``p.grad``. It may be ``grad`` itself when ``grad`` is fp32.
            Not together with ``accumulate``, which already receives it.
        wire_out: bf16 or fp16; if given, receives the new ``param`` rounded to nearest even,
            equal to ``param.to(wire_out.dtype)`` (NaN is written as a quiet NaN).
        num_threads: CPU threads of the native kernel, an int >= 1; None (the default) is
            ``torch.get_num_threads()``. The threads take 16384-element chunks from a shared
            counter, so the result does not depend on the count. The PyTorch path (no native
            kernel) ignores it and uses ``torch.get_num_threads()``.

    All tensors must be on the CPU, contiguous, have ``param``'s number of elements (any
    shape) and not overlap, except ``grad_out`` with ``grad`` as said. Releases the GIL.

    Raises:
        TypeError: a tensor argument is not a tensor or has a dtype not listed above, or
            ``step`` is not an int.
        ValueError: a tensor is not on the CPU, not contiguous, has a different number of
            elements or overlaps another; both ``accumulate`` and ``grad_out`` are given;
            ``step`` < 1; ``num_threads`` is not None and < 1.
    """
    _check_threads(num_threads)
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    fp32 = (torch.float32,)
    _check_tensor("param", param, fp32, n)
    _check_tensor("grad", grad, _GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, fp32, n)
    _check_tensor("exp_avg_sq", exp_avg_sq, fp32, n)
    written = [("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if accumulate is not None:
        _check_tensor("accumulate", accumulate, fp32, n)
        written.append(("accumulate", accumulate))
    if grad_out is not None:
        if accumulate is not None:
            raise ValueError(
                "pass accumulate or grad_out, not both: with accumulate, the gradient used is "
                "written to accumulate"
            )
        _check_tensor("grad_out", grad_out, fp32, n)
        written.append(("grad_out", grad_out))
    if wire_out is not None:
        _check_tensor("wire_out", wire_out, _WIRE_DTYPES, n)
        written.append(("wire_out", wire_out))
    _check_no_overlap(written)
    grad_is_grad_out = (
        grad_out is not None
        and grad_out.data_ptr() == grad.data_ptr()
        and grad.dtype == torch.float32
    )
    if not grad_is_grad_out:
        _check_no_overlap(written[:1] + [("grad", grad)] + written[1:])
    if isinstance(step, bool):
        raise TypeError("step must be an int, got bool")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int, got {type(step).__name__}") from None
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step count after incrementing), got {step}")
    hyper = dict(
        step=step,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        grad_scale=float(grad_scale),
        accumulate=accumulate,
        grad_out=grad_out,
        wire_out=wire_out,
    )
    if n == 0:
        return
    if _NATIVE.get() is not None:
        _step_native(_NATIVE, param, grad, exp_avg, exp_avg_sq, num_threads=num_threads, **hyper)
    else:
        _step_torch(param, grad, exp_avg, exp_avg_sq, **hyper)
