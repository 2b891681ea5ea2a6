"""The one-pass CPU AdamW step is bit-identical to PyTorch's fused CPU AdamW.

Every comparison is of bit patterns (``torch.equal`` on an integer view), so a last-bit
difference, a flipped sign of zero or a different NaN fails. Both implementations are
checked: the native kernel (``impl="native"``, skipped where it is not available) and the
pure-PyTorch path used without a compiler (``impl="torch"``).
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.optim import adam as torch_adam

from bit_compare import assert_bits_equal
from lean_isa import LEAN_ISAS, use_lean_isa
from ramflow.kernels import cpu_kernels as _cpu_kernels
from ramflow.kernels import lean_kernels as _lean_kernels
from ramflow.kernels.cpu_kernels import fused_adamw_step_

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def reference_step(state, grad, *, step, grad_scale=1.0, accumulate=None, **hyper):
    """Upcast (+ accumulate) (* grad_scale), then torch.optim.adam.adam(fused=True) AdamW."""
    param, exp_avg, exp_avg_sq = state
    g32 = grad.to(torch.float32)
    if accumulate is not None:
        g32 = accumulate + g32
    if grad_scale != 1.0:
        g32 = g32 * grad_scale
    torch_adam.adam(
        params=[param],
        grads=[g32],
        exp_avgs=[exp_avg],
        exp_avg_sqs=[exp_avg_sq],
        max_exp_avg_sqs=[],
        state_steps=[torch.tensor(float(step - 1))],
        foreach=False,
        fused=True,
        decoupled_weight_decay=True,
        amsgrad=False,
        maximize=False,
        **hyper,
    )
    return g32


def run(impl: str, param, grad, exp_avg, exp_avg_sq, **kwargs) -> None:
    streaming = kwargs.pop("streaming", -1)
    force_scalar = kwargs.pop("force_scalar", False)
    if impl == "torch":
        _cpu_kernels._step_torch(param, grad, exp_avg, exp_avg_sq, **kwargs)
    elif impl == "native":
        if not _cpu_kernels.native_kernel_available():
            pytest.skip(f"native kernel not available: {_cpu_kernels.NATIVE.reason}")
        _cpu_kernels._step_native(
            _cpu_kernels.NATIVE,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            streaming=streaming,
            force_scalar=force_scalar,
            **kwargs,
        )
    else:  # the public entry point, whichever implementation it picks
        fused_adamw_step_(param, grad, exp_avg, exp_avg_sq, **kwargs)


def check_steps(
    impl,
    n,
    *,
    grad_dtype=torch.bfloat16,
    mode="plain",
    wire_dtype=None,
    grad_scale=1.0,
    weight_decay=0.1,
    num_steps=3,
    hyper=HYPER,
    seed=0,
    make=torch.empty,
    **extra,
):
    """Step ours and the reference ``num_steps`` times in a row on the same random data."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    ours = [make(n, dtype=torch.float32) for _ in range(3)]
    ref = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
    for x, y in zip(ours, ref):
        x.zero_()
        y.zero_()
    ours[0].copy_(p0)
    ref[0].copy_(p0)
    acc = acc_ref = grad_out = wire = None
    if mode == "accumulate":
        acc = make(n, dtype=torch.float32)
        acc.copy_(torch.randn(n, generator=gen))
        acc_ref = acc.clone()
    if mode == "grad_out":
        grad_out = make(n, dtype=torch.float32)
    if wire_dtype is not None:
        wire = make(n, dtype=wire_dtype)
    for step in range(1, num_steps + 1):
        grad = (torch.randn(n, generator=gen) * 10 ** (step - 2)).to(grad_dtype)
        grad_before = grad.clone()
        kwargs = dict(hyper, weight_decay=weight_decay, grad_scale=grad_scale, step=step)
        g32 = reference_step(ref, grad, accumulate=acc_ref, **kwargs)
        outputs = dict(accumulate=acc, grad_out=grad_out, wire_out=wire)
        run(impl, ours[0], grad, ours[1], ours[2], **outputs, **kwargs, **extra)
        what = (
            f"{impl} n={n} {grad_dtype} {mode} wire={wire_dtype} scale={grad_scale} "
            f"wd={weight_decay} step={step}"
        )
        for name, x, y in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
            assert_bits_equal(x, y, f"{what}: {name}")
        assert_bits_equal(grad, grad_before, f"{what}: grad must not change")
        if acc is not None:
            assert_bits_equal(acc, g32, f"{what}: accumulate")
            acc_ref = acc.clone()
        if grad_out is not None:
            assert_bits_equal(grad_out, g32, f"{what}: grad_out")
        if wire is not None:
            assert_bits_equal(wire, ref[0].to(wire_dtype), f"{what}: wire_out")


IMPLS = ["native", "torch"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "grad_out"])
def test_matches_torch_fused_adamw(impl, grad_dtype, mode):
    for n, wire_dtype, grad_scale, weight_decay in itertools.product(
        (1, 7, 8, 9, 64, 1003), (None, torch.bfloat16, torch.float16), (1.0, 0.37), (0.0, 0.1)
    ):
        check_steps(
            impl,
            n,
            grad_dtype=grad_dtype,
            mode=mode,
            wire_dtype=wire_dtype,
            grad_scale=grad_scale,
            weight_decay=weight_decay,
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [10**6, 10**6 + 3])
def test_large(impl, n):
    check_steps(impl, n, mode="grad_out", wire_dtype=torch.bfloat16)
    check_steps(
        impl,
        n,
        grad_dtype=torch.float32,
        mode="accumulate",
        grad_scale=0.5,
        weight_decay=0.0,
        num_steps=2,
        seed=1,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "hyper",
    [
        dict(lr=3e-4, beta1=0.3, beta2=0.95, eps=1e-6),  # 1 - beta1 >= 0.5: the other lerp form
        dict(lr=1.0, beta1=0.0, beta2=0.0, eps=0.0),
        dict(lr=1e-3, beta1=0.99, beta2=0.9999, eps=1e-12),
    ],
)
def test_other_hyperparameters(impl, hyper):
    for n in (5, 1003):
        check_steps(impl, n, wire_dtype=torch.bfloat16, hyper=hyper, num_steps=4)
        check_steps(impl, n, grad_dtype=torch.float32, hyper=hyper, weight_decay=0.0, seed=2)


def test_scalar_loop_matches():
    """The portable loop (CPUs without AVX2) gives the same bits as the SIMD loop."""
    for mode, wire in (("grad_out", torch.bfloat16), ("accumulate", torch.float16)):
        check_steps("native", 1003, mode=mode, wire_dtype=wire, force_scalar=True)


@pytest.mark.parametrize("streaming", [0, 1])
def test_unaligned_views_and_streaming(streaming):
    """Buffers at odd addresses (views into larger ones), with and without non-temporal stores."""

    def odd_view(n, dtype):
        return torch.empty(n + 3, dtype=dtype)[3:]

    for n in (37, 4099):
        for make in (torch.empty, odd_view):
            check_steps(
                "native",
                n,
                mode="grad_out",
                wire_dtype=torch.bfloat16,
                make=make,
                streaming=streaming,
            )


def test_thread_count_does_not_change_results():
    """torch's thread count and ``num_threads`` (more threads than cores included) split the
    13 chunks of 200 003 elements differently; the bits stay PyTorch's."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_steps("native", 200_003, wire_dtype=torch.bfloat16, num_steps=2)
    finally:
        torch.set_num_threads(before)
    for num_threads in (1, 3, 5):
        check_steps(
            "native", 200_003, wire_dtype=torch.bfloat16, num_steps=2, num_threads=num_threads
        )


def test_adamw_threads_reach_the_kernel_and_keep_the_result(monkeypatch):
    """``AdamW(threads=1)`` steps an offloaded model with one kernel thread, and the weights
    equal those of the default thread count bit for bit."""
    import copy

    import ramflow
    from models import MLPStack

    if not _cpu_kernels.native_kernel_available():
        pytest.skip(f"native kernel not available: {_cpu_kernels.NATIVE.reason}")
    seen = []
    real = _cpu_kernels._step_native

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_cpu_kernels, "_step_native", spy)
    torch.manual_seed(0)
    models = [MLPStack(depth=3)]
    models.append(copy.deepcopy(models[0]))
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    for model, threads in zip(models, (1, None)):
        ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16)
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2, threads=threads)
        for _ in range(3):
            # the model computes in bf16 (a bf16 wire casts the input); the loss in fp32, as
            # torch 2.11's mse_loss backward rejects a bf16 input with an fp32 target
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(model)
    assert seen and set(seen[: len(seen) // 2]) == {1} and set(seen[len(seen) // 2 :]) == {None}
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        ramflow.optim.AdamW(models[0].parameters(), threads=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float16])
def test_wire_rounding_edge_cases(impl, wire_dtype):
    """With lr = 0 and no weight decay the step leaves param as is, so wire_out shows the
    rounding alone: ties, subnormals, overflow, signed zeros, infinities."""
    # bf16 ties (to even up / down) and near-ties, float max, the smallest subnormals, fp16
    # subnormal boundaries, fp16 max with its round-up tie and neighbours, +-inf, +-0, 0.1, -123.456
    edges = (
        "3F808000 3F818000 3F807FFF 3F808001 7F7FFFFF 00000001 80000001 33800000 33000000 "
        "387FC000 477FF000 477FEFFF 477FF001 7F800000 FF800000 80000000 00000000 3DCCCCCD "
        "C2F6E979"
    )
    u = torch.tensor([int(x, 16) for x in edges.split()], dtype=torch.int64).to(torch.int32)
    values = torch.cat([u.view(torch.float32), torch.randn(1000) * 1e4])
    param = values.clone()
    wire = torch.empty(param.numel(), dtype=wire_dtype)
    zeros = torch.zeros_like(param)
    hyper = dict(HYPER, lr=0.0, weight_decay=0.0)
    run(impl, param, zeros.clone(), zeros.clone(), zeros.clone(), step=1, wire_out=wire, **hyper)
    assert_bits_equal(param, values, "param")
    assert_bits_equal(wire, values.to(wire_dtype), "wire_out")


def test_grad_out_may_be_grad():
    """Writing the scaled gradient back over an fp32 gradient, as clipping does to p.grad."""
    n = 1003
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(n, generator=gen)
    ref = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    ours = [t.clone() for t in ref]
    g32 = reference_step(ref, grad, step=1, grad_scale=0.25, weight_decay=0.1, **HYPER)
    fused_adamw_step_(
        ours[0],
        grad,
        ours[1],
        ours[2],
        step=1,
        grad_scale=0.25,
        grad_out=grad,
        weight_decay=0.1,
        **HYPER,
    )
    assert_bits_equal(grad, g32, "grad")
    for x, y in zip(ours, ref):
        assert_bits_equal(x, y, "state")


def test_any_shape_and_empty():
    gen = torch.Generator().manual_seed(4)
    ref = [torch.randn(6, 7, generator=gen), torch.zeros(6, 7), torch.zeros(6, 7)]
    ours = [t.clone() for t in ref]
    grad = torch.randn(42, generator=gen).to(torch.bfloat16)
    reference_step(ref, grad.view(6, 7), step=1, weight_decay=0.1, **HYPER)
    fused_adamw_step_(ours[0], grad, ours[1], ours[2], step=1, weight_decay=0.1, **HYPER)
    for x, y in zip(ours, ref):
        assert_bits_equal(x, y, "state")
    empty = torch.empty(0)
    fused_adamw_step_(empty, empty, empty.clone(), empty.clone(), step=1, weight_decay=0.1, **HYPER)


# ---------------------------------------------------------------------- choosing the path


def test_env_var_forces_torch_path(monkeypatch):
    monkeypatch.setenv("RAMFLOW_DISABLE_CPU_KERNELS", "1")
    loader = _cpu_kernels._NativeKernel()
    monkeypatch.setattr(_cpu_kernels, "NATIVE", loader)
    assert not _cpu_kernels.native_kernel_available()
    assert "RAMFLOW_DISABLE_CPU_KERNELS" in loader.reason
    check_steps("public", 1003, mode="grad_out", wire_dtype=torch.bfloat16)


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken_build():
        raise RuntimeError("no compiler here")

    monkeypatch.delenv("RAMFLOW_DISABLE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(_cpu_kernels, "build_library", broken_build)
    loader = _cpu_kernels._NativeKernel()
    monkeypatch.setattr(_cpu_kernels, "NATIVE", loader)
    with pytest.warns(RuntimeWarning, match="could not be built.*no compiler here"):
        assert not _cpu_kernels.native_kernel_available()
    check_steps("public", 1003, mode="accumulate", wire_dtype=torch.float16)  # no second warning


def test_public_entry_uses_native_kernel_when_built():
    if not _cpu_kernels.native_kernel_available():
        pytest.skip(f"native kernel not available: {_cpu_kernels.NATIVE.reason}")
    assert _cpu_kernels.NATIVE.reason == ""
    check_steps("public", 4099, mode="grad_out", wire_dtype=torch.bfloat16)


# ---------------------------------------------------------------------- bad input


def good_args(n=8):
    return dict(
        param=torch.zeros(n),
        grad=torch.zeros(n, dtype=torch.bfloat16),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
    )


HP = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(param=[0.0] * 8), TypeError, "param must be a torch.Tensor"),
        (dict(param=torch.zeros(8, dtype=torch.float64)), TypeError, "param must be float32"),
        (
            dict(grad=torch.zeros(8, dtype=torch.float64)),
            TypeError,
            "grad must be float32 or bfloat16",
        ),
        (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "exp_avg must be float32"),
        (dict(wire_out=torch.zeros(8)), TypeError, "wire_out must be bfloat16 or float16"),
        (
            dict(grad_out=torch.zeros(8, dtype=torch.bfloat16)),
            TypeError,
            "grad_out must be float32",
        ),
        (dict(exp_avg_sq=torch.zeros(9)), ValueError, "exp_avg_sq has 9 elements"),
        (dict(exp_avg=torch.zeros(16)[::2]), ValueError, "exp_avg must be contiguous"),
        (dict(grad=torch.zeros(8, device="meta")), ValueError, "grad must be on the CPU"),
        (dict(accumulate=torch.zeros(8), grad_out=torch.zeros(8)), ValueError, "not both"),
        (dict(step=0), ValueError, "step must be >= 1"),
        (dict(step=1.0), TypeError, "step must be an int"),
        (dict(step=True), TypeError, "step must be an int"),
        (dict(num_threads=0), ValueError, "num_threads must be >= 1"),
        (dict(num_threads=2.0), TypeError, "num_threads must be an int"),
    ],
)
def test_bad_input(change, error, match):
    kwargs = {**good_args(), **HP, **change}
    with pytest.raises(error, match=match):
        fused_adamw_step_(**kwargs)


def test_overlapping_buffers_are_refused():
    buf = torch.zeros(12)
    args = good_args()
    args["exp_avg"], args["exp_avg_sq"] = buf[:8], buf[4:]
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        fused_adamw_step_(**args, **HP)
    args = good_args()
    args["grad"] = torch.zeros(8)
    with pytest.raises(ValueError, match="overlap"):
        fused_adamw_step_(**args, **HP, accumulate=args["grad"])


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_decay_factor_rounding(impl):
    """At these (lr, wd), float32(1 - lr * wd) depends on whether PyTorch fuses the product
    (its AVX2 build does): a zero gradient leaves param = 1 * that factor."""
    lr, wd = _cpu_kernels.DECAY_PROBE_LR, _cpu_kernels.DECAY_PROBE_WD
    for n in (16, 19):
        check_steps(impl, n, hyper=dict(HYPER, lr=lr), weight_decay=wd, wire_dtype=torch.bfloat16)
        ref = [torch.ones(n), torch.zeros(n), torch.zeros(n)]
        ours = [t.clone() for t in ref]
        grad = torch.zeros(n, dtype=torch.bfloat16)
        hyper = dict(HYPER, lr=lr, weight_decay=wd)
        reference_step(ref, grad, step=1, **hyper)
        run(impl, ours[0], grad, ours[1], ours[2], step=1, **hyper)
        assert_bits_equal(ours[0], ref[0], "param")


# ---------------------------------------------------------------------- the build cache

KEY_FIELDS = dict(
    source="int f() { return 1; }",
    cflags=("-O3",),
    ldflags=("-fopenmp",),
    torch_version="2.13.0",
    torch_git_version="abc",
    python_tag="cpython-311",
    machine="x86_64",
    compiler="c++",
)


def test_build_key_changes_with_every_input_of_the_build():
    """Two environments that differ in any input (another torch, Python, flag, compiler or
    source) get two keys, hence two cached libraries; the same inputs get the same key."""
    base = _cpu_kernels.build_key(**KEY_FIELDS)
    assert base == _cpu_kernels.build_key(**dict(KEY_FIELDS))
    changes = dict(
        source="int f() { return 2; }",
        cflags=("-O2",),
        ldflags=(),
        torch_version="2.12.0",
        torch_git_version="abd",
        python_tag="cpython-312",
        machine="aarch64",
        compiler="clang++",
    )
    keys = {base}
    for name, value in changes.items():
        keys.add(_cpu_kernels.build_key(**{**KEY_FIELDS, name: value}))
    assert len(keys) == 1 + len(changes)
    assert _cpu_kernels.build_key(**{**KEY_FIELDS, "cflags": ("-O3", "-g")}) != base


def test_kernel_source_is_package_data():
    source = _cpu_kernels._read_source()
    assert 'extern "C" int ramflow_fused_adamw_step(const Args* args)' in source


LOAD_KERNEL = (
    "from ramflow.kernels import cpu_kernels as k; "
    "ok = k.native_kernel_available(); print(ok, k.NATIVE.reason); raise SystemExit(not ok)"
)


def _kernel_process(cache: Path, **env: str) -> subprocess.Popen:
    """A fresh Python that builds (or loads) the kernel with ``cache`` as the extensions
    directory; it exits 0 once the native kernel runs."""
    src = str(Path(_cpu_kernels.__file__).parents[2])
    full_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONPATH": src, **env}
    full_env.pop("RAMFLOW_DISABLE_CPU_KERNELS", None)
    return subprocess.Popen(
        [sys.executable, "-c", LOAD_KERNEL],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, to kill it with its compilers
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)  # a build takes seconds; a stale lock, forever
    assert proc.returncode == 0, out
    return out


needs_compiler = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("c++") is None,
    reason="the native kernel builds on x86-64 with a C++ compiler",
)


@needs_compiler
def test_a_killed_build_blocks_no_one_and_environments_keep_their_builds(tmp_path):
    """Each step on one cache folder, in one test so that the folder is built cold twice
    (about 10 CPU-seconds a build), not four times:

    1. A process killed while its compiler runs (with the compiler) leaves no lock that
       the next process waits on.
    2. Two processes that then start at once both get the native kernel (one builds, the
       other waits and loads it), and nothing half-built stays behind.
    3. A second environment (here another compiler) builds its own library beside it and
       leaves the first one's untouched."""
    proc = _kernel_process(tmp_path)
    compilers = {"ninja", "c++", "g++", "cc1plus", "as", "ld", "collect2"}
    deadline = time.monotonic() + 240
    try:
        while not any(
            child.name() in compilers for child in psutil.Process(proc.pid).children(recursive=True)
        ):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no compiler started within 240 s"
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pytest.fail(f"the build ended before it could be killed: {proc.communicate()}")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    cache = tmp_path / "ramflow"  # see [Note: the kernel's build cache]
    assert not list(cache.glob("*.so"))  # killed before its library existed

    procs = [_kernel_process(tmp_path), _kernel_process(tmp_path)]
    for p in procs:
        assert "True" in _finish(p)
    first = sorted(cache.glob("*.so"))
    assert len(first) == 1, sorted(cache.iterdir())
    assert not list(cache.glob("*.build"))  # nothing half-built left
    before = first[0].stat()

    _finish(_kernel_process(tmp_path, CXX="g++"))
    _finish(_kernel_process(tmp_path))  # the first environment again
    libs = sorted(cache.glob("*.so"))
    assert len(libs) == 2 and first[0] in libs
    after = first[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


# ---- the lean kernels' 8-bit codes (_lean_kernels, [Note: 8-bit codes in one lookup]) -----


def _fp8_test_values() -> torch.Tensor:
    """fp32 values in [-448, 448] that decide E4M3 rounding: every pattern of the upper 12
    bits (sign, exponent, the 3 kept mantissa bits) with the lower 20 bits just below, at
    and just above the halfway point and at both ends; every multiple of 2**-11 below 2**-6
    (the subnormal codes and their halfway points) and its neighbours; random floats."""
    upper = torch.arange(1 << 12, dtype=torch.int64) << 20
    lows = [0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF]
    bits = torch.cat([upper | low for low in lows])
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    sub = torch.arange(-32, 33, dtype=torch.float32) * 2.0**-11
    sub = torch.cat([sub, torch.nextafter(sub, sub + 1), torch.nextafter(sub, sub - 1)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(1 << 16, generator=gen) * torch.exp(torch.randn(1 << 16, generator=gen) * 6)
    x = torch.cat([x, sub, rand, torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-126, 1e-45])])
    return x[x.abs() <= 448]


@pytest.mark.parametrize("isa", LEAN_ISAS)
def test_native_fp8_encoder_is_torchs_float8_e4m3fn_for_every_rounding_case(isa, monkeypatch):
    """The native E4M3 encoder (of the step's loop for ``isa``) gives the bits of torch's own
    conversion, ``.to(torch.float8_e4m3fn)`` (round to nearest even), on values that
    exercise every rounding case. Each block holds 448, so its scale is 2**0 and the codes
    are those of the values themselves."""
    use_lean_isa(isa, monkeypatch)
    x = _fp8_test_values()
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % 255)).view(-1, 255)
    x = torch.cat([blocks, torch.full((blocks.shape[0], 1), 448.0)], dim=1).flatten()
    q, scale = _lean_kernels._quantize_blockwise_native(x, signed=True)
    assert torch.all(scale == 1.0)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q, want), f"{int((q != want).sum())} codes differ"


@pytest.mark.parametrize("isa", LEAN_ISAS)
def test_native_fp8_decoder_is_torchs_for_every_code(isa, monkeypatch):
    """Every one of the 256 codes (NaN included) decodes as torch's float8_e4m3fn to fp32
    does, times the block's scale; the second moment's are squared. Blocks with and without
    special codes (subnormal, zero, NaN), which the step decodes two ways."""
    use_lean_isa(isa, monkeypatch)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    # blocks with no subnormal, zero or NaN code take the step's shorter decoder
    normal = every[((every & 0x7F) >= 8) & ((every & 0x7F) != 0x7F)]
    normal = normal[torch.randint(0, normal.numel(), (512,), generator=torch.Generator())]
    q = torch.cat([every.repeat(2), normal, every[:77]])  # and a partial block (scalar)
    scale = torch.tensor([1.0, 2.0**-20, 2.0**30, 0.5, 2.0**-126])
    for signed in (True, False):
        got = _lean_kernels._dequantize_blockwise_native(q, scale, signed=signed)
        want = _lean_kernels.dequantize_blockwise(q, scale, signed=signed)
        assert_bits_equal(got, want, f"signed={signed}")
    assert torch.isnan(want[0x7F]) and want[0x7E] == 448.0**2
    assert want[512:1024].isfinite().all() and (want[512:1024] != 0).all()


@pytest.mark.parametrize("isa", LEAN_ISAS)
@pytest.mark.parametrize("signed", [True, False])
def test_native_quantizer_equals_quantize_blockwise(signed, isa, monkeypatch):
    """The native quantizer (scale from the block's absmax, then the codes) gives the PyTorch
    path's bits for blocks of every magnitude: absmax at and next to the scale's steps
    (1.75 * 2**k), subnormal, huge, zero, and with elements too small for a code."""
    use_lean_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    amaxes = [1.0, 1.75, 448.0, 3e-39, 1e-45, 3e38, 1e-20, 7e10, 0.0]
    amaxes += [float(torch.nextafter(torch.tensor(a), torch.tensor(a * 2))) for a in (1.75, 448.0)]
    amaxes += (torch.rand(12, generator=gen, dtype=torch.float64) * 40 - 20).exp().tolist()
    x = _fp8_test_values()[: 255 * 40].view(40, 255) / 448.0
    blocks = []
    for i, a in enumerate(amaxes):
        row = x[i % 40] * a
        if i % 3 == 0:
            row = row * torch.exp(torch.randn(255, generator=gen) * 10)  # codes of 0 too
        blocks.append(torch.cat([row.clamp(-a, a), torch.tensor([a])]))
    odd = torch.randn(256, generator=gen)  # NaN (left out of the absmax) and infinities
    odd[[3, 100, 200]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    blocks.append(odd)
    x = torch.cat(blocks + [torch.randn(1000, generator=gen)])  # and a partial block
    if not signed:
        x = x.square()
    got_q, got_scale = _lean_kernels._quantize_blockwise_native(x, signed=signed)
    want_q, want_scale = _lean_kernels.quantize_blockwise(x, signed=signed)
    assert_bits_equal(got_scale, want_scale, "scales")
    assert torch.equal(got_q, want_q), f"{int((got_q != want_q).sum())} codes differ"
    if not signed:  # a positive second moment never gets code 0
        assert not torch.any((got_q == 0) & (x > 0))
    assert torch.all(got_q[-1256:-1000][[3, 100, 200]] & 0x7F == 0x7F)  # NaN, infinity: NaN


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("master", ["bf16-sr", "bf16-kahan", "fp32"])
def test_lean_step_simd_equals_the_scalar_block(master, isa, monkeypatch):
    use_lean_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(2)
    n = 20 * 256 + 77
    p32 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(3)]
    results = []
    for cap in (isa, "scalar"):
        monkeypatch.setenv("RAMFLOW_LEAN_ISA", cap)
        s = {"master": p32.clone() if master == "fp32" else p32.to(torch.bfloat16)}
        s["compensation"] = torch.zeros(n, dtype=torch.bfloat16) if master == "bf16-kahan" else None
        s["wire_out"] = torch.empty(n, dtype=torch.bfloat16) if master == "fp32" else None
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            s[name], s[f"{name}_scale"] = _lean_kernels.quantize_blockwise(
                torch.zeros(n), signed=signed
            )
        for step, g in enumerate(grads, start=1):
            _lean_kernels.lean_adamw_step_(
                s["master"], g, s["exp_avg"], s["exp_avg_sq"], step=step, lr=1e-2, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5 if step == 2 else 1.0,
                compensation=s["compensation"], exp_avg_scale=s["exp_avg_scale"],
                exp_avg_sq_scale=s["exp_avg_sq_scale"], wire_out=s["wire_out"], seed=5,
            )  # fmt: skip
        results.append(s)
    for key, value in results[0].items():
        if value is not None:
            assert_bits_equal(value, results[1][key], key)


@pytest.mark.parametrize("counter_offset", [0, 3, (1 << 32) - 20 * 256 + 5])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("master", ["bf16-sr", "bf16-kahan", "fp32"])
def test_lean_step_simd_equals_the_scalar_block_with_bf16_states(
    master, isa, counter_offset, monkeypatch
):
    """bf16 states (rounded stochastically, [Note: stochastic rounding of the 8-bit
    states]) over three steps of bf16 gradients, equal to the scalar block bit for bit: the
    AVX2 loop in even and odd lanes ([Note: the lean step in even and odd lanes]) for a
    bf16 master, the loop in element order for an fp32 one, with their two ways to the
    rounding bits ([Note: the rounding bits in fewer operations]): the short one (counter
    0), the full hash where a block does not start on a multiple of 256 (offset 3) and where
    the counter passes 2**32 (the last offset, which also has a block whose lanes cross it:
    the scalar block)."""
    use_lean_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(4)
    n = 40 * 256 + 77
    master0 = torch.randn(n, generator=gen)
    if master != "fp32":
        master0 = master0.to(torch.bfloat16)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(3)]
    grads[1][[5, 300]] = torch.tensor([float("nan"), float("inf")], dtype=torch.bfloat16)
    results = []
    for cap in (isa, "scalar"):
        monkeypatch.setenv("RAMFLOW_LEAN_ISA", cap)
        s = {"master": master0.clone()}
        s["compensation"] = torch.zeros(n, dtype=torch.bfloat16) if master == "bf16-kahan" else None
        s["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16)
        s["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, start=1):
            _lean_kernels.lean_adamw_step_(
                s["master"], g, s["exp_avg"], s["exp_avg_sq"], step=step, lr=1e-2, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=0.5 if step == 3 else 1.0,
                compensation=s["compensation"], seed=9, counter_offset=counter_offset,
            )  # fmt: skip
        results.append(s)
    for key, value in results[0].items():
        if value is not None:
            assert_bits_equal(value, results[1][key], key)
    assert results[0]["master"].isnan().any()  # the NaN's lanes took the NaN path


def _hard_block_grads(gen: torch.Generator) -> torch.Tensor:
    """bf16 gradients, one kind of 8-bit block each: plain; one zero lane; lanes 2**13 below
    the rest (subnormal codes in a block the fast encoder takes); a NaN; an infinity; all
    zero; fp32-subnormal values (their scale's exponent clamped at -126); -0.0; lanes 2**30
    below the rest (codes of 0); and plain blocks between."""
    blocks = [torch.randn(256, generator=gen) for _ in range(12)]
    blocks[1][17] = 0.0
    blocks[2][::7] *= 2.0**-13
    blocks[3][100] = float("nan")
    blocks[4][5] = float("inf")
    blocks[5].zero_()
    blocks[6] *= 1e-40
    blocks[7][:] = -0.0
    blocks[8][::3] *= 2.0**-30
    return torch.cat(blocks).to(torch.bfloat16)


@pytest.mark.parametrize("counter_offset", [0, (1 << 32) - 5 * 256])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_lean_step_simd_equals_the_scalar_block_on_hard_blocks(isa, counter_offset, monkeypatch):
    """The SIMD step's 8-bit blocks equal the scalar block's bit for bit where the fast
    encoder must hand over ([Note: the FP8 encoder's fast blocks]): lanes below E4M3's
    normal range, NaN and infinity, zeros, fp32 subnormals, -0.0; over three steps, so the
    states decoded in steps 2 and 3 hold those codes too. With a rounding counter that
    passes 2**32 after five blocks, the later blocks' random bits take the high word."""
    use_lean_isa(isa, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    grads = [_hard_block_grads(gen) for _ in range(3)]
    n = grads[0].numel()
    master0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for cap in (isa, "scalar"):
        monkeypatch.setenv("RAMFLOW_LEAN_ISA", cap)
        s = {"master": master0.clone()}
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            s[name], s[f"{name}_scale"] = _lean_kernels.quantize_blockwise(
                torch.zeros(n), signed=signed
            )
        for step, g in enumerate(grads, start=1):
            _lean_kernels.lean_adamw_step_(
                s["master"], g, s["exp_avg"], s["exp_avg_sq"], step=step, lr=1e-3,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                exp_avg_scale=s["exp_avg_scale"], exp_avg_sq_scale=s["exp_avg_sq_scale"],
                seed=7, counter_offset=counter_offset,
            )  # fmt: skip
        results.append(s)
    for key, value in results[0].items():
        assert_bits_equal(value, results[1][key], key)
    # the cases happened: a block under the normal range kept codes below 8 next to larger
    codes = results[0]["exp_avg"].view(-1, 256) & 0x7F
    assert ((codes[2] < 8) & (codes[2] > 0)).any() and (codes[2] >= 8).any()
    assert (results[0]["exp_avg"].view(-1, 256)[3] & 0x7F == 0x7F).any()  # the NaN block
