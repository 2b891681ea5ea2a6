"""One-pass AdamW step over flat fp32 host buffers: upcast, (accumulate), step, downcast.

ramflow keeps fp32 master weights and AdamW states in host RAM and steps them on the CPU
while the GPU computes. Done with stock PyTorch, a step makes three passes over DRAM per
unit: upcast the bf16 gradient that landed from the GPU into an fp32 buffer, run PyTorch's
fused CPU AdamW, then cast the new master to the bf16 "wire" buffer copied to the GPU
next: about 40 bytes of DRAM traffic per parameter, and the step is DRAM-bound. The
kernel here does it in one pass (28 bytes per parameter with a bf16 gradient and a bf16
wire copy), and its results are bit-identical to PyTorch's.

See [Note: matching PyTorch's fused AdamW bit for bit] for how.

The C++ source, ``cpu_kernels.cpp``, the lean steps' ``lean_kernels.cpp`` and Muon's host
passes' ``muon_kernels.cpp`` (package data beside this module, read with
``importlib.resources``, compiled as one file), is
compiled before the first step (``make setup``, else in the background from
``ramflow.offload``: [Note: building before the first step]) with torch's
``torch.utils.cpp_extension.load_inline`` (about 6 s on a 2-core machine, 2 s on a 16-core one; a PyTorch without ``load_inline``'s ``no_implicit_headers`` adds torch/extension.h and
takes a minute). It is built without ``-march=native``, so a cached build is portable
between machines sharing a home directory: its AVX2/FMA/F16C loop is compiled with a
per-function target and chosen at run time from CPUID (the lean steps of ``kernels.lean_kernels``
also have an AVX-512 loop, chosen the same way). When no compiler is available, the
build fails, the CPU is not x86-64, the native kernel does not reproduce PyTorch on a probe
at load time, or ``RAMFLOW_DISABLE_CPU_KERNELS=1`` is set, the same results come from a
pure-PyTorch path (three passes, one warning, never an error).

Build cache: ``$TORCH_EXTENSIONS_DIR/ramflow/`` when that is set, else
``~/.cache/torch_extensions/ramflow/`` (torch's default extensions root), one library
``ramflow_cpu_kernels_<key>.so`` per key. The key (``build_key``, 16 hex digits of a
SHA-256) covers everything that changes the library: the .cpp text, the compiler and linker
flags, torch's version and git commit, the Python implementation and ABI tag, the machine
and ``$CXX``. Delete the folder to force a rebuild. See [Note: the kernel's build cache].
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import inspect
import json
import operator
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Sequence

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


# [Note: the kernel's build cache]
# The key holds every input of the build, so two environments on one machine (another
# torch, another Python) use two files and never rebuild each other's, as they did when
# torch's build folder, named by the source hash alone, was shared. A process finds its
# file and loads it, or takes an exclusive ``flock`` on ``<name>.lock`` (the OS drops
# it when the holder dies, unlike torch's lock file, which a killed build leaves behind for
# every later process to wait on forever), looks again, builds in ``<name>.build/`` and
# renames the library into place (atomic: a reader sees the whole file or none). Processes
# that start at once all run: one builds, the others wait for the lock and load its file.

ENV_DISABLE = "RAMFLOW_DISABLE_CPU_KERNELS"

# The lanes of PyTorch's CPU AdamW vector loop. Its dispatch has no AVX512 entry for this
# kernel (REGISTER_DISPATCH, not ALSO_REGISTER_AVX512_DISPATCH), so AVX512 CPUs run the
# AVX2 build; the DEFAULT build also uses 32-byte Vectorized<float>.
_TORCH_VEC_WIDTH = 8

# [Note: each parameter's own tail]
# PyTorch's fused CPU AdamW steps each parameter on its own: 8-lane vectors, then a scalar
# loop for its last numel % 8 elements, which fuses the second moment's multiply-add
# differently ([Note: matching PyTorch's fused AdamW bit for bit]). The flat step covers a
# unit's parameters in one call, so a parameter whose size is not a multiple of 8 (a
# 5-class head's bias) would get the vector form on its tail and drift from PyTorch by an
# ulp a step. The flat step therefore cuts its range at those tails: the kernel, which
# gives the last n % 8 elements of a call the tail form, takes each tail as a call of its
# own. The padding after a tail (to the next multiple of 8, where the next parameter
# starts) is left out: it holds zeros and is never read.
_TAIL_LANES = _TORCH_VEC_WIDTH


def odd_tails(offsets: Sequence[int], numels: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[begin, end)`` element ranges of the scalar tails of the parameters at
    ``offsets`` (of a flat buffer) with ``numels`` elements whose size is not a multiple of
    8, in order. See [Note: each parameter's own tail]."""
    tails = []
    for off, n in zip(offsets, numels):
        r = n % _TAIL_LANES
        if r:
            tails.append((off + n - r, off + n))
    return tails


def cut_at_tails(lo: int, hi: int, tails: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut so that each tail in ``tails`` is a range of its own and every
    other range is whole vectors; the padding after a tail is skipped."""
    out = []
    cur = lo
    for a, b in tails:
        if b <= lo or a >= hi:
            continue
        if a > cur:
            out.append((cur, a))
        out.append((a, b))
        cur = min(hi, -(-b // _TAIL_LANES) * _TAIL_LANES)
    if cur < hi:
        out.append((cur, hi))
    return out


DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WIRE_DTYPES = (torch.bfloat16, torch.float16)


class _Args(ctypes.Structure):
    """The C ``Args`` struct of ``cpu_kernels.cpp``, field for field."""

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
        if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
            self.reason = f"{ENV_DISABLE} is set"
            return
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self._give_up(f"it is only verified on x86-64, not {platform.machine()}")
            return
        try:
            lib = ctypes.CDLL(build_library())
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
            f"Set {ENV_DISABLE}=1 to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


NATIVE = _NativeKernel()


# package data beside this module, compiled as one translation unit in this order (the lean
# step uses the fp32 kernel's helpers)
_SOURCES = (
    "cpu_kernels.cpp",
    "lean_kernels.cpp",
    "lean_kernels_avx2.cpp",
    "lean_kernels_avx512.cpp",
    "muon_kernels.cpp",
)
_CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def build_key(
    *,
    source: str,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    torch_version: str,
    torch_git_version: str,
    python_tag: str,
    machine: str,
    compiler: str,
) -> str:
    """The cache key of one build of the kernel: 16 hex digits of a SHA-256 over everything
    that changes the library (see [Note: the kernel's build cache]).

    Args:
        source: the C++ text. cflags, ldflags: the compiler's and linker's flags.
        torch_version, torch_git_version: ``torch.__version__`` and
            ``torch.version.git_version`` (the headers and the ABI compiled against).
        python_tag: e.g. ``"cpython-311"`` (``sys.implementation.cache_tag`` + abiflags).
        machine: ``platform.machine()``. compiler: the ``CXX`` torch builds with.
    """
    fields = {
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch_version": torch_version,
        "torch_git_version": torch_git_version,
        "python_tag": python_tag,
        "machine": machine,
        "compiler": compiler,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _read_source() -> str:
    files = importlib.resources.files(__package__)
    return "\n".join(files.joinpath(name).read_text(encoding="ascii") for name in _SOURCES)


def cache_dir() -> str:
    """Where built kernels are kept: ``$TORCH_EXTENSIONS_DIR/ramflow``, else
    ``~/.cache/torch_extensions/ramflow`` (torch's default extensions root)."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.path.join(
        os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), "ramflow"
    )


# [Note: building before the first step]
# A first build takes seconds to a minute, and inside a step it made a 12B model's second
# step take 114 s. So the library is built ahead: by ``make setup``
# (``python -m ramflow.build_kernels``), and otherwise by ``ramflow.offload``, which starts
# ``start_background_build`` when this environment's library is not in the cache yet: one
# line on stderr, the build in a daemon thread while the model loads. ``build_library`` (the
# loaders' first use, in the first step) joins that thread if it still runs and raises its
# error if it failed, so a build is attempted once per process. Never at import: importing
# ramflow stays cheap and starts nothing.


class _BackgroundBuild:
    """The build started by ``start_background_build`` (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> bool:
        """Start the build unless it ran already, the library is cached or native code
        is off here; return whether it started."""
        with self._lock:
            if self._thread is not None or NATIVE._loaded or not native_wanted():
                return False
            if os.path.exists(_library()[0]):
                return False
            self._thread = threading.Thread(
                target=self._run, name="ramflow-build-kernels", daemon=True
            )
            self._thread.start()
        print(
            "ramflow: building ramflow's CPU kernels in the background (once per machine, "
            f"about {_build_estimate_s()} s)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _run(self) -> None:
        try:
            build_library()
        except BaseException as err:  # noqa: BLE001 - the loaders raise it and fall back
            self._error = err

    @property
    def started(self) -> bool:
        return self._thread is not None

    def join(self) -> None:
        """Wait for the build if another thread runs it; raise its error if it failed."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join()
        if self._error is not None:
            raise self._error


_BACKGROUND = _BackgroundBuild()


def start_background_build() -> bool:
    """Build the native kernels in a background thread if this environment's library is not
    in the cache (see [Note: building before the first step]); print one line to stderr
    when it starts. Returns whether a build started (False: cached, loaded, started before,
    or native code is off here: ``RAMFLOW_DISABLE_CPU_KERNELS``, not x86-64)."""
    return _BACKGROUND.start()


def native_wanted() -> bool:
    return os.environ.get(ENV_DISABLE, "") in ("", "0") and platform.machine().lower() in (
        "x86_64",
        "amd64",
    )


def _build_estimate_s() -> int:
    """About how long a first build takes: seconds with ``no_implicit_headers`` (one .cpp,
    about 7 s on 2 cores), a minute without it (torch/extension.h and pybind11)."""
    from torch.utils.cpp_extension import load_inline

    return 10 if "no_implicit_headers" in inspect.signature(load_inline).parameters else 60


def _library() -> tuple[str, str, str, str]:
    """This environment's library: (path, name, source, cache folder)."""
    source = _read_source()
    key = build_key(
        source=source,
        cflags=_CFLAGS,
        ldflags=_LDFLAGS,
        torch_version=torch.__version__,
        torch_git_version=str(torch.version.git_version),
        python_tag=sys.implementation.cache_tag + getattr(sys, "abiflags", ""),
        machine=platform.machine(),
        compiler=os.environ.get("CXX", "c++"),
    )
    directory = cache_dir()
    name = f"ramflow_cpu_kernels_{key}"
    return os.path.join(directory, f"{name}.so"), name, source, directory


def build_library() -> str:
    """Find the kernel of this environment in the cache, or build it there; return its path.

    See [Note: the kernel's build cache] and [Note: building before the first step].
    Raises whatever the build raises (the caller falls back to PyTorch).
    """
    import fcntl  # POSIX only; elsewhere the ImportError means: no native kernel

    _BACKGROUND.join()
    path, name, source, directory = _library()
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the OS releases it if this process dies
        if os.path.exists(path):  # another process built it while this one waited
            return path
        building = os.path.join(directory, f"{name}.build")
        shutil.rmtree(building, ignore_errors=True)  # left by a build that died
        os.makedirs(building)
        try:
            os.replace(_compile(name, source, building), path)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return path


def _compile(name: str, source: str, directory: str) -> str:
    """Compile ``source`` in ``directory`` with torch's JIT builder; return the library."""
    from torch.utils.cpp_extension import load_inline

    kwargs = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:
        # torch/extension.h and its pybind11 would triple the build time for nothing here.
        kwargs["no_implicit_headers"] = True
    load_inline(
        name=name,
        cpp_sources=[source],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=directory,
        is_python_module=False,
        verbose=False,
        **kwargs,
    )
    return os.path.join(directory, f"{name}.so")


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
    return NATIVE.get() is not None


def ptr_of(t: torch.Tensor | None) -> int | None:
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
        accumulate=ptr_of(accumulate),
        grad_out=ptr_of(grad_out) if accumulate is None else None,
        wire_out=ptr_of(wire_out),
        n=param.numel(),
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        grad_dtype=DTYPE_CODE[grad.dtype],
        wire_dtype=0 if wire_out is None else DTYPE_CODE[wire_out.dtype],
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


def check_threads(num_threads: object) -> None:
    """``num_threads`` must be None or an int >= 1 (ValueError, TypeError otherwise)."""
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int or None, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 (or None for torch's), got {num_threads}")


def check_tensor(
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    numel: int,
    device: torch.device | None = None,
) -> None:
    """``t`` is a contiguous tensor of one of ``dtypes`` with ``numel`` elements on
    ``device`` (None: the CPU); TypeError or ValueError saying what is wrong."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if device is None and t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} with the master weights, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass {name}.contiguous() or a flat buffer")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}; they must match")


def check_no_overlap(named: list[tuple[str, torch.Tensor]]) -> None:
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
    check_threads(num_threads)
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    fp32 = (torch.float32,)
    check_tensor("param", param, fp32, n)
    check_tensor("grad", grad, _GRAD_DTYPES, n)
    check_tensor("exp_avg", exp_avg, fp32, n)
    check_tensor("exp_avg_sq", exp_avg_sq, fp32, n)
    written = [("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if accumulate is not None:
        check_tensor("accumulate", accumulate, fp32, n)
        written.append(("accumulate", accumulate))
    if grad_out is not None:
        if accumulate is not None:
            raise ValueError(
                "pass accumulate or grad_out, not both: with accumulate, the gradient used is "
                "written to accumulate"
            )
        check_tensor("grad_out", grad_out, fp32, n)
        written.append(("grad_out", grad_out))
    if wire_out is not None:
        check_tensor("wire_out", wire_out, _WIRE_DTYPES, n)
        written.append(("wire_out", wire_out))
    check_no_overlap(written)
    grad_is_grad_out = (
        grad_out is not None
        and grad_out.data_ptr() == grad.data_ptr()
        and grad.dtype == torch.float32
    )
    if not grad_is_grad_out:
        check_no_overlap(written[:1] + [("grad", grad)] + written[1:])
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
    if NATIVE.get() is not None:
        _step_native(NATIVE, param, grad, exp_avg, exp_avg_sq, num_threads=num_threads, **hyper)
    else:
        _step_torch(param, grad, exp_avg, exp_avg_sq, **hyper)
