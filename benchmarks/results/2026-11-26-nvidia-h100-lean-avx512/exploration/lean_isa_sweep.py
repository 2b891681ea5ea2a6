"""The exploration sweep of this folder: each lean host format's CPU AdamW step per
instruction set and thread count, and the quantizer alone, after one host copy rate.

    PYTHONPATH=src python lean_isa_sweep.py avx2,avx512 lean,kahan,bf16 1,8,16

Arguments: instruction sets (``RAMFLOW_LEAN_ISA``), formats, thread counts. 2**25
parameters below 8 threads, 2**28 from 8; the fastest of 6 steps after one untimed. The
first sweep (``sweep-compact-vs-whole-table.txt``) ran an earlier form of this script with a
third set, ``avx512full``, which gave the step empty compact tables so that every lookup went
to the whole table; the compact tables are not in ramflow (see README.md).
"""

import os
import sys
import time

import torch

from ramflow.kernels import lean_kernels as lean
from ramflow.kernels.lean_kernels import QBLOCK, lean_adamw_step_, quantize_blockwise


def step_rate(n: int, threads: int, fmt: str, steps: int = 6) -> float:
    """G params/s of one format's step over n parameters."""
    grad = torch.randn(n).to(torch.bfloat16)
    master = torch.randn(n).to(torch.bfloat16)
    comp = torch.zeros(n, dtype=torch.bfloat16) if fmt == "kahan" else None
    if fmt == "bf16":
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        am = av = None
    else:
        m = quantize_blockwise(torch.zeros(n), signed=True)[0]
        v = quantize_blockwise(torch.zeros(n), signed=False)[0]
        am, av = torch.zeros(-(-n // QBLOCK)), torch.zeros(-(-n // QBLOCK))
    times = []
    for step in range(1, steps + 2):
        t0 = time.perf_counter()
        lean_adamw_step_(
            master, grad, m, v, step=step, lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, compensation=comp, exp_avg_absmax=am, exp_avg_sq_absmax=av,
            num_threads=threads,
        )  # fmt: skip
        times.append(time.perf_counter() - t0)
    return n / min(times[1:]) / 1e9


def quantize_ns(n: int) -> float:
    """ns per element of the native quantizer alone (one thread, signed code)."""
    x = torch.randn(n) * 1e-3
    lean._quantize_blockwise_native(x, signed=True)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        lean._quantize_blockwise_native(x, signed=True)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def main() -> None:
    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    print(f"copy GB/s {2 * 4 * (1 << 28) / best / 1e9:.1f}", flush=True)
    del src, dst
    for isa in sys.argv[1].split(","):
        os.environ["RAMFLOW_LEAN_ISA"] = isa
        print(isa, lean.lean_isa(), f"quantize 1 thread ns/elem {quantize_ns(1 << 22):.2f}")
        for fmt in sys.argv[2].split(","):
            for threads in map(int, sys.argv[3].split(",")):
                n = 1 << 28 if threads >= 8 else 1 << 25
                rate = step_rate(n, threads, fmt)
                print(isa, fmt, threads, f"threads {rate:.3f} Gparam/s", flush=True)


if __name__ == "__main__":
    main()
