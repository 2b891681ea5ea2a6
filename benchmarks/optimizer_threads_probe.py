"""Probe: how the CPU optimizer's threads are shared, alone and inside a training step.

Issue 4's 4x2048 training step (<= 12 GiB) is bound by the CPU optimizer. This probe asks
whether the optimizer runs as fast inside the step as alone, and what its thread count
(``AdamW(threads=...)``) changes, in one process:

1. alone: ``fused_adamw_step_`` over ``--params`` fp32 parameters (bf16 gradient, bf16 wire
   copy), per thread count, median of 3 after one warm-up;
2. in the step: the reference model's 4x2048 training case at its 12 GiB cap, as
   ``bench.py`` builds it; per thread count one untimed step, then ``--steps`` timed steps (each
   the wall clock between step ends after ``torch.cuda.synchronize``, as ``measure.time_steps``),
   with the worker's optimizer spans: busy time per step, the longest idle gaps, the rate,
   and the timeline of the last full step (unit steps and gradient dispatches).

The results of 2026-11-22 (benchmarks/results/2026-11-22-nvidia-h200-optimizer-threads) also
compare the split of a unit over threads that the kernel had before (one range per thread,
``at::parallel_for``), measured at commit cad5db8.

Run on the GPU box from the repository root::

    python benchmarks/optimizer_threads_probe.py --out $OUT/optimizer-threads-probe.json

Prints one line per measurement and writes them all as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases  # noqa: E402
import measure  # noqa: E402
import runners  # noqa: E402
from models import make_batch, model_shape  # noqa: E402


def _default_threads(cores: int) -> list[int]:
    return sorted({n for n in (cores, cores - 1, cores - 2, cores * 3 // 4, cores // 2) if n >= 1})[
        ::-1
    ]


def _alone(params: int, settings, emit) -> None:
    from ramflow import _cpu_kernels as k

    p = torch.randn(params)
    m, v = torch.zeros(params), torch.zeros(params)
    g = torch.randn(params).to(torch.bfloat16)
    wire = torch.empty(params, dtype=torch.bfloat16)
    step = 0
    for threads in settings:
        times = []
        for i in range(4):
            step += 1
            t0 = time.perf_counter()
            k.fused_adamw_step_(
                p,
                g,
                m,
                v,
                step=step,
                lr=1e-5,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                wire_out=wire,
                num_threads=threads,
            )
            if i:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        emit(
            what="alone",
            threads=threads,
            params=params,
            step_s=t,
            params_per_s=params / t,
            bytes_per_s=params * 28 / t,
        )


_STEPS = ("_step_staged", "_step_unit")  # the worker's unit steps
_TIMED = _STEPS + ("_pre_forward", "_dispatch_grads")  # + a unit's forward entry, its D2H


class _Spans:
    """Wall-clock spans of the engine's per-unit work: the worker's unit steps, each unit's
    forward entry (which waits for the unit's step and load) and gradient dispatch."""

    def __init__(self) -> None:
        from ramflow._engine import Engine

        self.spans: list[tuple[float, float, str, str]] = []
        self._lock = threading.Lock()
        for name in _TIMED:
            original = getattr(Engine, name)

            def timed(engine, u, *args, _original=original, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(engine, u, *args, **kwargs)
                finally:
                    with self._lock:
                        self.spans.append((t0, time.perf_counter(), u.name, _name))

            setattr(Engine, name, timed)

    def between(self, t0: float, t1: float, kinds=_STEPS) -> list[tuple[float, float, str, str]]:
        with self._lock:
            return [s for s in self.spans if t0 <= s[0] < t1 and s[3] in kinds]


def _in_step(settings, steps: int, emit, *, tiny: bool) -> None:
    import ramflow

    built = cases.build_cases(
        ["ramflow"],
        model="reference",
        tiny=tiny,
        warmup=2,
        steps=steps,
        out_dir=".",
        tag="",
        scaling_depths=[12],
    )
    case = next(c for c in built if c["id"].endswith(".cap12gib-ckpt"))
    device = runners.compute_device()
    model_checkpoints, offload_kwargs = runners._offload_kwargs(case)
    model = runners._model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    budget, _ = runners._ramflow_budget(case, model, ids, labels, device)
    ramflow.offload(model, gpu_memory=budget, device=device, **offload_kwargs)
    opt = ramflow.optim.AdamW(model.parameters(), **runners.RAMFLOW_OPTIMIZER)
    step = runners._train_step(model, opt, ids, labels, device)
    spans = _Spans()
    num = sum(p.numel() for p in model.parameters())
    emit(what="setup", budget_bytes=budget, plan=ramflow.get_plan(model).describe(), params=num)
    for _ in range(2):
        step()
    for threads in settings:
        opt.threads = threads
        step()
        measure.sync(device)
        times, starts = [], []
        start = time.perf_counter()
        for _ in range(steps):
            starts.append(start)
            step()
            measure.sync(device)
            end = time.perf_counter()
            times.append(end - start)
            start = end
        ramflow.synchronize(model)
        last = time.perf_counter()
        # optimizer spans of the timed steps, from the first timed step's start to the drain
        window = sorted(spans.between(starts[0], last))
        busy_s = sum(s[1] - s[0] for s in window)
        # the last full step (not the one the drain ends), every span relative to its start
        t0, t1 = starts[-2], starts[-1]
        timeline = [
            (round((a - t0) * 1e3, 1), round((b - t0) * 1e3, 1), name, kind.strip("_"))
            for a, b, name, kind in sorted(spans.between(t0 - 0.4, t1, _TIMED))
        ]
        gap = [window[i + 1][0] - window[i][1] for i in range(len(window) - 1)]
        gaps = sorted(gap, reverse=True)[: steps + 1]
        emit(
            what="in_step",
            threads=threads,
            step_times_s=times,
            median_s=statistics.median(times),
            optimizer_busy_s_per_step=busy_s / steps,
            optimizer_params_per_s=num * steps / busy_s if busy_s else None,
            longest_gaps_s=gaps,
            units_stepped=len(window),
            timeline_ms=timeline,
            step_ms=round((t1 - t0) * 1e3, 1),
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="optimizer-threads-probe.json")
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-step", action="store_true", help="only the optimizer alone")
    ap.add_argument("--threads", default="", help='thread counts, e.g. "16,14" (default: several)')
    ap.add_argument("--tiny", action="store_true", help="small model, runs on the CPU (smoke test)")
    args = ap.parse_args(argv)
    cores = torch.get_num_threads()
    settings = [int(x) for x in args.threads.split(",") if x] or _default_threads(cores)
    rows: list[dict] = []

    def emit(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))

    emit(
        what="machine",
        torch_threads=cores,
        thp_env=os.environ.get("THP_MEM_ALLOC_ENABLE"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    _alone(args.params, settings, emit)
    if not args.skip_step:
        _in_step(settings, args.steps, emit, tiny=args.tiny)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
