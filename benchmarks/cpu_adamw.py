"""Host AdamW step throughput: the three-pass PyTorch path against the one-pass kernel.

On the same tensors, in one run, for each size N (fp32 masters and states, bf16 gradient
and wire copy, as ramflow's host step uses them):

  memcpy        ``dst.copy_(src)`` of N fp32: the machine's copy bandwidth, for scale
  three-pass    upcast bf16 grad -> fp32, ``torch.optim.adam.adam(fused=True)`` AdamW,
                cast the new param -> bf16 wire (what ramflow does today)
  torch fused   ``torch.optim.adam.adam(fused=True)`` AdamW alone, fp32 grad
  ours          ``fused_adamw_step_`` with bf16 grad and ``wire_out``
  ours+grad_out the same, also writing the fp32 gradient to ``grad_out``
  ours+accum    bf16 grad added into an fp32 ``accumulate``, with ``wire_out``
  (no NT)       rows marked so use ordinary stores for the write-only outputs

"GB/s" counts the bytes each case must read plus the bytes it must write (a write that
misses the cache also costs a read of the line unless the store is non-temporal; that
traffic is not counted). Numbers depend on threads and memory channels: run it on the
machine you care about.

    python benchmarks/cpu_adamw.py --sizes 50e6 200e6 --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch.optim import adam as torch_adam

from ramflow import _cpu_kernels
from ramflow._cpu_kernels import fused_adamw_step_

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def time_it(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median and best wall time of ``fn`` in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def torch_fused_adamw(param, grad32, exp_avg, exp_avg_sq, step: int) -> None:
    torch_adam.adam(
        params=[param],
        grads=[grad32],
        exp_avgs=[exp_avg],
        exp_avg_sqs=[exp_avg_sq],
        max_exp_avg_sqs=[],
        state_steps=[torch.tensor(float(step - 1))],
        foreach=False,
        fused=True,
        decoupled_weight_decay=True,
        amsgrad=False,
        maximize=False,
        **HYPER,
    )


def bench_size(n: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-6
    grad_bf16 = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    grad32 = grad_bf16.float()
    accumulate = grad32.clone()
    grad_out = torch.empty(n)
    wire = torch.empty(n, dtype=torch.bfloat16)
    step = [1]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    def three_pass() -> None:
        grad32.copy_(grad_bf16)
        torch_fused_adamw(param, grad32, exp_avg, exp_avg_sq, next_step())
        wire.copy_(param)

    def ours(streaming: int = -1, **extra) -> Callable[[], None]:
        def fn() -> None:
            if _cpu_kernels.native_kernel_available():
                _cpu_kernels._step_native(
                    _cpu_kernels._NATIVE,
                    param,
                    grad_bf16,
                    exp_avg,
                    exp_avg_sq,
                    step=next_step(),
                    streaming=streaming,
                    wire_out=wire,
                    **HYPER,
                    **extra,
                )
            else:
                fused_adamw_step_(
                    param,
                    grad_bf16,
                    exp_avg,
                    exp_avg_sq,
                    step=next_step(),
                    wire_out=wire,
                    **HYPER,
                    **extra,
                )

        return fn

    src, dst = torch.empty(n), torch.empty(n)
    src.fill_(1.0)
    # (name, fn, bytes read + written per element)
    cases = [
        ("memcpy (fp32 copy_)", lambda: dst.copy_(src), 8),
        ("three-pass torch", three_pass, 6 + 28 + 6),
        (
            "torch fused adamw alone",
            lambda: torch_fused_adamw(param, grad32, exp_avg, exp_avg_sq, next_step()),
            28,
        ),
        ("ours bf16 grad + wire", ours(), 28),
        ("ours bf16 grad + wire (no NT)", ours(streaming=0), 28),
        ("ours + grad_out", ours(grad_out=grad_out), 32),
        ("ours + grad_out (no NT)", ours(streaming=0, grad_out=grad_out), 32),
        ("ours + accumulate", ours(accumulate=accumulate), 36),
    ]
    print(f"\nN = {n / 1e6:.0f}M parameters")
    print(
        f"  {'case':32s} {'median ms':>10s} {'best ms':>9s} {'Gparam/s':>9s} {'GB/s':>7s} {'B/param':>8s}"
    )
    for name, fn, per_param in cases:
        med, best = time_it(fn, repeats)
        print(
            f"  {name:32s} {med * 1e3:10.1f} {best * 1e3:9.1f} {n / med / 1e9:9.3f} "
            f"{n * per_param / med / 1e9:7.1f} {per_param:8d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[50e6, 200e6],
        help="parameter counts N (default: 50e6 200e6)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    native = _cpu_kernels.native_kernel_available()
    build_s = time.perf_counter() - t0
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    if native:
        print(
            f"native kernel: yes (SIMD level {_cpu_kernels._NATIVE.simd_level}; "
            f"load/build took {build_s:.1f} s)"
        )
    else:
        print(
            f"native kernel: NO ({_cpu_kernels._NATIVE.reason}); 'ours' rows run the PyTorch path"
        )
    for size in args.sizes:
        bench_size(int(size), args.repeats)


if __name__ == "__main__":
    main()
