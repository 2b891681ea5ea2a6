"""The lean CPU step's rate in one thread, counted in the thread's CPU time, for the native
libraries built from several source trees, in one process (the probe behind this folder's
README; not part of the benchmark harness).

Each tree's library is built (``python -m ramflow.build_kernels`` semantics: ramflow's own
cache) by a child process with that tree on ``PYTHONPATH``, then loaded here. Buffers are
made once. Then the instruction sets, formats and trees take turns, and each turn times
calls of ``ramflow_lean_adamw_step`` with the arguments ``lean_adamw_step_`` built. A
thread's CPU time does not count the time a busy machine takes the core away. It still
counts cache and memory traffic shared with other work.

    python benchmarks/host_formats/cpu_time_probe.py --trees /path/to/main/src /path/to/branch/src --params 4194304
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch


def _library(tree: str) -> str:
    code = "from ramflow.kernels import cpu_kernels as c; print(c.build_library())"
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"building the kernels of {tree} failed: {out.stderr}")
    return out.stdout.split()[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trees", nargs="+", required=True, help="src folders to compare")
    p.add_argument("--params", type=int, default=1 << 22, help="parameters per step")
    p.add_argument("--rounds", type=int, default=11, help="timed turns each (median kept)")
    p.add_argument("--formats", default="lean,bf16,kahan")
    p.add_argument("--isas", default="avx512,avx2")
    args = p.parse_args()
    libs = [_library(t) for t in args.trees]
    sys.path.insert(0, args.trees[-1])
    from ramflow.kernels import lean_kernels as lk

    n = args.params
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    calls = {}
    for fmt in args.formats.split(","):
        master = torch.randn(n, generator=gen).to(torch.bfloat16)
        comp = torch.zeros(n, dtype=torch.bfloat16) if fmt == "kahan" else None
        if fmt == "bf16":
            m, am = torch.zeros(n, dtype=torch.bfloat16), None
            v, av = torch.zeros(n, dtype=torch.bfloat16), None
        else:
            m, am = lk.quantize_blockwise(torch.zeros(n), signed=True)
            v, av = lk.quantize_blockwise(torch.zeros(n), signed=False)

        class Recorder:  # takes the argument block lean_adamw_step_ passes to the library
            def ramflow_lean_adamw_step(self, ref):
                self.args = lk._LeanArgs.from_buffer_copy(ref._obj)
                return 0

        rec = Recorder()
        lk._LEAN.lib, lk._LEAN._loaded = rec, True
        lk.lean_adamw_step_(
            master, grad, m, v, step=3, lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, exp_avg_scale=am, exp_avg_sq_scale=av, compensation=comp,
            num_threads=1,
        )  # fmt: skip
        calls[fmt] = (rec.args, (master, comp, m, v, am, av))
    loaded = [lk._LEAN._declare(ctypes.CDLL(path)) for path in libs]
    isas = args.isas.split(",")
    inner = max(1, (1 << 23) // n)
    keys = [(isa, fmt, t) for isa in isas for fmt in calls for t in range(len(libs))]
    for isa, fmt, t in keys:  # the states take real values first
        os.environ["RAMFLOW_LEAN_ISA"] = isa
        for _ in range(3):
            loaded[t].ramflow_lean_adamw_step(ctypes.byref(calls[fmt][0]))
    rates = {k: [] for k in keys}
    for _ in range(args.rounds):
        for isa, fmt, t in keys:
            os.environ["RAMFLOW_LEAN_ISA"] = isa
            step, ref = loaded[t].ramflow_lean_adamw_step, ctypes.byref(calls[fmt][0])
            t0 = time.thread_time()
            for _ in range(inner):
                step(ref)
            rates[isa, fmt, t].append(n * inner / (time.thread_time() - t0) / 1e9)
    print(f"{n} parameters, 1 thread, G params/s per thread-CPU second, median of {args.rounds}")
    print("| ISA | format | " + " | ".join(args.trees) + " |")
    print("| --- | --- |" + " --- |" * len(libs))
    for isa in isas:
        for fmt in calls:
            cells = [f"{statistics.median(rates[isa, fmt, t]):.3f}" for t in range(len(libs))]
            print(f"| {isa} | {fmt} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
