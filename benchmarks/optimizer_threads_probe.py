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
import gc
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


def _variants(spec: str, threads: list[int], repeat: int) -> list[dict]:
    """``--variants`` entries "threads:piece_mib:spin|block:locked|unlocked" (engine
    settings compared in one process), else one per thread count with the defaults;
    the whole list ``repeat`` times (alternating, to see drift)."""
    out = []
    for item in filter(None, spec.split(",")):
        n, piece, wait, lock = item.split(":")
        out.append(
            {
                "threads": int(n),
                "piece_mib": int(piece),
                "spin_events": wait == "spin",
                "locked_evict": lock == "locked",
            }
        )
    if not out:
        out = [
            {"threads": n, "piece_mib": None, "spin_events": False, "locked_evict": False}
            for n in threads
        ]
    return out * repeat


def _apply(variant: dict) -> None:
    """Set the engine's module-level switches for one variant (read at each use)."""
    from ramflow import _engine, _streams

    if variant["piece_mib"] is not None:
        _engine.REFRESH_PIECE_BYTES = (variant["piece_mib"] << 20) or (1 << 62)
    _streams._BLOCKING = not variant["spin_events"]
    _engine._WAIT_UNLOCKED = not variant["locked_evict"]


def _thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process, by native thread id,
    with its name (``/proc/self/task``; Linux only, empty elsewhere)."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # fields 3.. of proc(5): utime, stime at 14, 15
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _thread_use(before: dict, after: dict, steps: int) -> list[tuple[str, float]]:
    """Per-step CPU seconds of each thread that used more than 5 ms a step, busiest first;
    Python threads by their names (the main thread: "main")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "main"
    rows = []
    for tid, (comm, cpu) in after.items():
        used = (cpu - before.get(tid, (comm, 0.0))[1]) / steps
        if used > 0.005:
            rows.append((f"{names.get(tid, comm)}:{tid}", round(used, 3)))
    return sorted(rows, key=lambda r: -r[1])


def _case_model(group: str, steps: int, *, tiny: bool):
    """The reference model's 4x2048 training case of ``bench.py``'s ``group`` ("ramflow":
    the 12 GiB cap; "kofn": k of n resident), built on the host: (case, device, offload
    arguments, model, input ids, labels)."""
    built = cases.build_cases(
        [group],
        model="reference",
        tiny=tiny,
        warmup=2,
        steps=steps,
        out_dir=".",
        tag="",
        scaling_depths=[12],
    )
    pick = ".cap12gib-ckpt" if group == "ramflow" else ""
    case = next(c for c in built if c["id"].endswith(pick) and c["id"].startswith(group))
    device = runners.compute_device()
    model_checkpoints, offload_kwargs = runners._offload_kwargs(case)
    model = runners._model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    return case, device, offload_kwargs, model, ids, labels


def _kofn_budgets(case, model, device, offload_kwargs, fractions) -> list[tuple[int, int | None]]:
    """(k, gpu_memory) keeping round(f x n) blocks resident, as ``bench.py --kofn``."""
    import ramflow

    shapes = runners._unit_shapes(model)
    ramflow.offload(model, gpu_memory=None, device=device, **offload_kwargs)
    budgets = runners._kofn_budgets(ramflow.get_plan(model), shapes, fractions)
    ramflow.undo(model)
    return budgets


def _kofn_rounds(steps: int, rounds: int, emit, *, tiny: bool) -> None:
    """The k-of-n training step (k = 0, 3, 6, 9 of 12 blocks resident, as ``bench.py
    --kofn``) ``rounds`` times over in one process: does the step move as much between
    rounds of one k as between the k's? Per k and round: the median step, the optimizer's
    rate in the step and alone on the same tensors right after (``runners._optimizer_alone``)."""
    import ramflow
    from ramflow._engine import ENGINE_OF_MODEL

    case, device, offload_kwargs, model, ids, labels = _case_model("kofn", steps, tiny=tiny)
    budgets = _kofn_budgets(case, model, device, offload_kwargs, case["fractions"])
    counter = measure.CopyCounter()
    for r in range(rounds):
        for k, budget in budgets:
            ramflow.offload(model, gpu_memory=budget, device=device, **offload_kwargs)
            opt = ramflow.optim.AdamW(model.parameters(), **runners.RAMFLOW_OPTIMIZER)
            res = runners._time_ramflow_training(model, opt, ids, labels, device, case, counter)
            emit(
                what="kofn_round",
                round=r,
                k=k,
                step_times_s=res["step_times_s"],
                median_s=res["step_s"],
                optimizer_in_step_params_per_s=res["optimizer_in_step_params_per_s"],
                optimizer_alone_params_per_s=res.get("optimizer_alone_params_per_s"),
                resident_units=len(ENGINE_OF_MODEL[model].plan.resident),
            )
            ramflow.undo(model)
            del opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _in_step(settings, steps: int, emit, *, tiny: bool, case_name: str) -> None:
    import ramflow

    group = "ramflow" if case_name == "cap12" else "kofn"
    case, device, offload_kwargs, model, ids, labels = _case_model(group, steps, tiny=tiny)
    if case_name == "cap12":
        budget, _ = runners._ramflow_budget(case, model, ids, labels, device)
    else:  # "kofn<k>": the budget that keeps k of the blocks resident, as the k-of-n case
        k = int(case_name[4:])
        blocks = sum(1 for sh in runners._unit_shapes(model) if sh.block)
        budget = dict(_kofn_budgets(case, model, device, offload_kwargs, [k / blocks]))[k]
    ramflow.offload(model, gpu_memory=budget, device=device, **offload_kwargs)
    opt = ramflow.optim.AdamW(model.parameters(), **runners.RAMFLOW_OPTIMIZER)
    step = runners._train_step(model, opt, ids, labels, device)
    spans = _Spans()
    num = sum(p.numel() for p in model.parameters())
    emit(what="setup", budget_bytes=budget, plan=ramflow.get_plan(model).describe(), params=num)
    for _ in range(2):
        step()
    for variant in settings:
        threads = variant["threads"]
        opt.threads = threads
        _apply(variant)
        step()
        measure.sync(device)
        times, starts = [], []
        cpu_before = _thread_cpu_s()
        start = time.perf_counter()
        for _ in range(steps):
            starts.append(start)
            step()
            measure.sync(device)
            end = time.perf_counter()
            times.append(end - start)
            start = end
        cpu_after = _thread_cpu_s()
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
            **variant,
            step_times_s=times,
            median_s=statistics.median(times),
            optimizer_busy_s_per_step=busy_s / steps,
            optimizer_params_per_s=num * steps / busy_s if busy_s else None,
            longest_gaps_s=gaps,
            units_stepped=len(window),
            timeline_ms=timeline,
            step_ms=round((t1 - t0) * 1e3, 1),
            thread_cpu_s_per_step=_thread_use(cpu_before, cpu_after, steps),
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="optimizer-threads-probe.json")
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-step", action="store_true", help="only the optimizer alone")
    ap.add_argument("--threads", default="", help='thread counts, e.g. "16,14" (default: several)')
    ap.add_argument("--tiny", action="store_true", help="small model, runs on the CPU (smoke test)")
    ap.add_argument(
        "--case",
        default="cap12",
        help='"cap12": training 4x2048 at the 12 GiB cap; "kofn<k>": k blocks resident; '
        '"kofn-rounds": k = 0, 3, 6, 9 in turn, --repeat rounds',
    )
    ap.add_argument(
        "--variants",
        default="",
        help='engine settings in the step, "threads:piece_mib:spin|block:locked|unlocked,..."'
        " (piece_mib: resident refresh pieces, 0 = one copy after the step; spin: host waits"
        " spin; locked: evictions wait for the GPU holding the engine lock)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run the variants this many times")
    args = ap.parse_args(argv)
    cores = torch.get_num_threads()
    threads = [int(x) for x in args.threads.split(",") if x] or _default_threads(cores)
    variants = _variants(args.variants, threads, args.repeat)
    rows: list[dict] = []

    def emit(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))

    emit(
        what="machine",
        torch_threads=cores,
        case=args.case,
        thp_env=os.environ.get("THP_MEM_ALLOC_ENABLE"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    _alone(args.params, threads, emit)
    if not args.skip_step:
        if args.case == "kofn-rounds":
            _kofn_rounds(args.steps, args.repeat, emit, tiny=args.tiny)
        else:
            _in_step(variants, args.steps, emit, tiny=args.tiny, case_name=args.case)
        _alone(args.params, threads[:1], emit)  # again: has the machine's DRAM rate drifted?
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
