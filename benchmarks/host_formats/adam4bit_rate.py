"""The CPU AdamW rate of the 4-bit states (``lean4``) against fp32 and lean, on this CPU.

Times one host step over ``--numel`` parameters of flat buffers, all threads, fastest of
``--repeats`` after one untimed, the formats taking turns: ``fp32`` (``kernels.cpu_kernels.fused_adamw_step_``, fp32
master and states), ``lean`` (``lean_adamw_step_``: bf16 master, 8-bit states) and
``lean4`` (``formats.steps.LEAN.piece``: bf16 master, 4-bit states decoded and coded by
PyTorch ops around the lean kernel, ``STEP_CHUNK`` elements at a time). Prints parameters
per second, the bytes each step reads and writes per second (the host formats' bytes per
parameter: master, states, a bf16 gradient), and each rate over fp32's, which is what
``planner.cpu_rates.OPTIMIZER_SPEED_BY_ISA`` holds. Writes ``--out`` (JSON) when given:

    PYTHONPATH=src python benchmarks/host_formats/adam4bit_rate.py \\
        --out benchmarks/results/2026-12-07-cpu-adam4bit/rate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ramflow import HostPrecision
from ramflow.formats.steps import LEAN, AdamWSettings
from ramflow.kernels.cpu_kernels import fused_adamw_step_
from ramflow.kernels.lean_kernels import lean_adamw_step_, lean_isa, quantize_blockwise

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def steps(n: int) -> dict:
    """Each format's step over ``n`` parameters, as a callable of the step count."""
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    w32, m32, v32 = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
    w16 = w32.bfloat16()
    q = {k: quantize_blockwise(torch.zeros(n), signed=k == "m") for k in ("m", "v")}
    lean4 = HostPrecision.lean4()
    st4 = {name: lean4.new_state(name, n) for name in lean4.state_names}
    w4 = w32.bfloat16()
    settings = AdamWSettings(*HYPER.values())
    return {
        "fp32": lambda step: fused_adamw_step_(w32, grad, m32, v32, step=step, **HYPER),
        "lean": lambda step: lean_adamw_step_(
            w16,
            grad,
            q["m"][0],
            q["v"][0],
            step=step,
            exp_avg_scale=q["m"][1],
            exp_avg_sq_scale=q["v"][1],
            **HYPER,
        ),  # fmt: skip
        "lean4": lambda step: LEAN.piece(
            lean4,
            w4,
            grad,
            st4,
            0,
            n,
            settings=settings,
            step=step,
            wire_out=None,
            seed=1,
            threads=None,
        ),  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args(argv)
    # bytes read and written per parameter: the master and the states both ways, the
    # gradient (bf16) read
    bytes_per_param = {
        "fp32": 2 * (4 + 8) + 2,
        "lean": 2 * (2 + 2 + 8 / 256) + 2,
        "lean4": 2 * (2 + 1 + 8 / 128) + 2,
    }
    rows = {}
    made = steps(args.numel)
    times: dict[str, list[float]] = {name: [] for name in made}
    for step in made.values():
        step(1)
    # the formats take turns, and each keeps its fastest: on a shared machine the other
    # jobs' load comes and goes, and the fastest step is the one least disturbed
    for k in range(2, 2 + args.repeats):
        for name, step in made.items():
            times[name].append(_timed(step, k))
    for name in made:
        best = min(times[name])
        rate = args.numel / best
        rows[name] = {
            "seconds": best,
            "params_per_s": rate,
            "gb_per_s": rate * bytes_per_param[name] / 1e9,
        }
    for name, r in rows.items():
        r["over_fp32"] = r["params_per_s"] / rows["fp32"]["params_per_s"]
        print(
            f"{name:6s} {r['params_per_s'] / 1e6:8.1f} M params/s  {r['gb_per_s']:6.2f} GB/s  "
            f"{r['over_fp32']:.2f} x fp32"
        )
    if args.out:
        result = {
            "numel": args.numel,
            "threads": torch.get_num_threads(),
            "lean_isa": lean_isa(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _timed(step, k: int) -> float:
    start = time.perf_counter()
    step(k)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
