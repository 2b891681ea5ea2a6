"""Read a torch.profiler Chrome trace of one training step and say how much overlapped.

Spans, all in the trace's microseconds:
- compute: CUDA kernels (category ``kernel``);
- H2D / D2H: CUDA memory copies host-to-device / device-to-host (``gpu_memcpy``);
- optimizer / landing: ramflow's host worker stepping a unit or adding its gradients into the
  host gradients. The profiler records ``record_function`` only on the threads it was entered
  from, so ``HostSpans`` times those calls itself and ``finish`` writes them into the trace on
  a thread of their own (``ramflow host worker (added)``), placed with clock marks.

Phases are the benchmark's own ``record_function`` spans on the main thread (``bench.forward``,
``bench.backward``, ``bench.optimizer_step``, ``bench.drain``). A GPU span belongs to the phase
during which the host launched it (matched through the CUDA runtime call's correlation id).
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import threading
import time
from typing import Any

PHASES = ("bench.forward", "bench.backward", "bench.optimizer_step", "bench.drain")
ADDED_TID = 990_001  # a thread id of the trace's own for the added spans
ADDED_THREAD_NAME = "ramflow host worker (added)"


class HostSpans:
    """Times ramflow's worker tasks (each unit's optimizer step and gradient landing) by
    wrapping the worker tasks of ramflow's engine parts: ``HostStepper.step_unit`` and
    ``HostStepper.step_staged`` (optimizer) and ``GradientPath.land`` (landing), whichever
    exist. If none does, no spans are recorded and the summary says so."""

    METHODS = (
        ("ramflow.engine.host_stepper", "HostStepper", "step_unit", "optimizer"),
        ("ramflow.engine.host_stepper", "HostStepper", "step_staged", "optimizer"),
        ("ramflow.engine.gradients", "GradientPath", "land", "landing"),
    )

    def __init__(self) -> None:
        self._spans: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self.installed = False

    def install(self) -> None:
        for module_name, class_name, attr, label in self.METHODS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            cls = getattr(module, class_name, None)
            orig = getattr(cls, attr, None)
            if orig is not None:
                setattr(cls, attr, self._wrap(orig, label))
                self.installed = True

    def _wrap(self, orig: Any, label: str) -> Any:
        spans, lock = self._spans, self._lock

        def wrapped(engine: Any, unit: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic_ns()
            try:
                return orig(engine, unit, *args, **kwargs)
            finally:
                t1 = time.monotonic_ns()
                with lock:
                    spans.append((f"{label}:{getattr(unit, 'name', unit)}", t0, t1))

        return wrapped

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def spans(self) -> list[tuple[str, int, int]]:
        with self._lock:
            return list(self._spans)


def clock_marks(n: int = 5) -> list[tuple[str, int]]:
    """Short marked spans with the monotonic clock read inside each, to map host times onto
    the trace's clock. Call inside the profiled region."""
    from torch.profiler import record_function

    marks = []
    for i in range(n):
        name = f"bench.clock_mark.{i}"
        with record_function(name):
            marks.append((name, time.monotonic_ns()))
    return marks


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def summarize(events: list[dict[str, Any]], host: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Overlap per phase from trace events and host worker spans (trace microseconds)."""
    phase_windows = []
    for e in events:
        if e.get("ph") == "X" and e.get("name") in PHASES and e.get("cat") == "user_annotation":
            phase_windows.append((e["name"], e["ts"], e["ts"] + e["dur"]))
    phase_windows.sort(key=lambda w: w[1])
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]

    def phase_of(ts: float | None) -> str | None:
        if ts is None:
            return None
        for name, a, b in phase_windows:
            if a <= ts <= b:
                return name
        return None

    gpu: dict[str, dict[str, list[tuple[float, float]]]] = {
        p: {"compute": [], "h2d": [], "d2h": []} for p in PHASES
    }
    all_kernels = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name", "")
        if cat == "kernel":
            kind = "compute"
        elif cat == "gpu_memcpy" and "HtoD" in name:
            kind = "h2d"
        elif cat == "gpu_memcpy" and "DtoH" in name:
            kind = "d2h"
        else:
            continue
        span = (e["ts"], e["ts"] + e["dur"])
        if kind == "compute":
            all_kernels.append(span)
        phase = phase_of(launch_ts.get(e.get("args", {}).get("correlation")))
        if phase is not None:
            gpu[phase][kind].append(span)
    kernels = _union(all_kernels)
    phases = []
    for name in PHASES:
        spans = {k: _union(v) for k, v in gpu[name].items()}
        flat = [s for v in spans.values() for s in v]
        if not flat:
            continue
        lo, hi = min(a for a, _ in flat), max(b for _, b in flat)
        h2d, d2h, comp = _length(spans["h2d"]), _length(spans["d2h"]), _length(spans["compute"])
        phases.append(
            {
                "phase": name.removeprefix("bench."),
                "gpu_span_ms": (hi - lo) / 1e3,
                "compute_ms": comp / 1e3,
                "h2d_ms": h2d / 1e3,
                "d2h_ms": d2h / 1e3,
                "h2d_under_compute": _intersect(spans["h2d"], kernels) / h2d if h2d else None,
                "d2h_under_compute": _intersect(spans["d2h"], kernels) / d2h if d2h else None,
                "gpu_idle_ms": (hi - lo - _length(_clip(kernels, lo, hi))) / 1e3,
            }
        )
    out: dict[str, Any] = {"phases": phases}
    opt = _union([(a, b) for n, a, b in host if n.startswith("optimizer:")])
    land = _union([(a, b) for n, a, b in host if n.startswith("landing:")])
    if opt:
        end_compute = max((b for _, b in kernels), default=None)
        backward = [w for w in phase_windows if w[0] == "bench.backward"]
        out["optimizer"] = {
            "busy_ms": _length(opt) / 1e3,
            "under_gpu_compute_ms": _intersect(opt, kernels) / 1e3,
            "during_backward_ms": _length(_clip(opt, backward[0][1], backward[0][2])) / 1e3
            if backward
            else None,
            # host work left after the GPU's last kernel: what the next forward would wait for
            "exposed_after_last_kernel_ms": (
                None if end_compute is None else max(0.0, opt[-1][1] - end_compute) / 1e3
            ),
            "units_stepped": sum(1 for n, _, _ in host if n.startswith("optimizer:")),
        }
    if land:
        out["landing"] = {
            "busy_ms": _length(land) / 1e3,
            "under_gpu_compute_ms": _intersect(land, kernels) / 1e3,
        }
    return out


def finish(
    raw_path: str, marks: list[tuple[str, int]], host_ns: list[tuple[str, int, int]]
) -> tuple[str, dict[str, Any]]:
    """Add the host worker spans to the exported trace, gzip it (Perfetto opens .json.gz),
    delete the raw file, and return the gzipped path and the overlap summary."""
    with open(raw_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    by_name = {
        e.get("name"): e for e in events if str(e.get("name", "")).startswith("bench.clock_mark.")
    }
    offsets = []
    for name, mono_ns in marks:
        e = by_name.get(name)
        if e is not None:
            offsets.append((e.get("dur", 0), e["ts"] + e.get("dur", 0) / 2 - mono_ns / 1e3))
    host: list[tuple[str, float, float]] = []
    if offsets:
        offset = min(offsets)[1]  # the tightest mark
        pid = next((e["pid"] for e in events if e.get("name") == "bench.forward"), 0)
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": ADDED_TID,
                "args": {"name": ADDED_THREAD_NAME},
            }
        )
        for name, a, b in host_ns:
            ts = a / 1e3 + offset
            host.append((name, ts, b / 1e3 + offset))
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ramflow.{name}",
                    "pid": pid,
                    "tid": ADDED_TID,
                    "ts": ts,
                    "dur": (b - a) / 1e3,
                }
            )
    summary = summarize(events, host)
    summary["host_spans_recorded"] = bool(host_ns)
    path = raw_path + ".gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    os.remove(raw_path)
    return path, summary


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a markdown table and a few lines."""
    lines = [
        "| phase | GPU span (ms) | compute (ms) | H2D (ms) | D2H (ms) | H2D under compute | D2H under compute | GPU idle (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    for p in summary.get("phases", []):
        lines.append(
            f"| {p['phase']} | {p['gpu_span_ms']:.1f} | {p['compute_ms']:.1f} | {p['h2d_ms']:.1f} | "
            f"{p['d2h_ms']:.1f} | {pct(p['h2d_under_compute'])} | {pct(p['d2h_under_compute'])} | "
            f"{p['gpu_idle_ms']:.1f} |"
        )
    opt = summary.get("optimizer")
    if opt:
        during, exposed = opt["during_backward_ms"], opt["exposed_after_last_kernel_ms"]
        lines.append("")
        lines.append(
            f"CPU optimizer: {opt['busy_ms']:.1f} ms busy over {opt['units_stepped']} units, "
            f"{opt['under_gpu_compute_ms']:.1f} ms of it while GPU kernels ran, "
            f"{'-' if during is None else f'{during:.1f}'} ms during backward; "
            f"{'-' if exposed is None else f'{exposed:.1f}'} ms after the step's last kernel."
        )
    land = summary.get("landing")
    if land:
        lines.append(
            f"Gradient landing on the host: {land['busy_ms']:.1f} ms busy, "
            f"{land['under_gpu_compute_ms']:.1f} ms while GPU kernels ran."
        )
    if not summary.get("host_spans_recorded", True):
        lines.append(
            "(ramflow's host worker spans could not be recorded: its private methods changed.)"
        )
    return "\n".join(lines)
