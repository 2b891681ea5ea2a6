"""Measurement primitives: step timing, peak memory, copy bandwidth, matmul and CPU rates.

Every function works on the CPU too (no CUDA), so that ``bench.py --tiny`` exercises the same
code; GPU-only figures come back as None there. Rates are per second; sizes are bytes.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20


def proc_status_bytes(key: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (VmHWM: peak RSS, VmRSS: RSS); None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last ``reset_peak``; None on the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def time_steps(
    step: Callable[[], Any],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    drain: Callable[[], None] | None = None,
    counter: CopyCounter | None = None,
    on_timed_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run ``warmup`` then ``steps`` calls of ``step``; time each timed step.

    Each step's time is the wall clock between the ends of consecutive steps, each end taken
    after ``torch.cuda.synchronize``: in steady state this is the time per step of a loop,
    including host work that an engine overlaps with the next step (which therefore waits for
    it). ``drain`` (e.g. ``ramflow.synchronize``) runs after the last timed step and before
    its end is read, so work still in flight is charged to the run. Peak memory is read over
    the timed steps only. ``on_timed_start`` runs after the warm-ups (and their drain), just
    before timing.

    Returns: ``step_s`` (the median), ``step_times_s`` (all), ``peak_bytes``, and with a
    ``counter`` the bytes it counted per timed step, ``h2d_bytes_counted`` and
    ``d2h_bytes_counted`` (None when it could not be installed), and
    ``h2d_refresh_bytes_counted``, the resident units' share of the H2D bytes (None
    unless the counter ``watch``-es the model).
    """
    for _ in range(warmup):
        step()
    if drain is not None:
        drain()
    reset_peak(device)
    if on_timed_start is not None:
        on_timed_start()
    counted0 = counter.snapshot() if counter is not None else (0, 0, 0)
    times = []
    start = time.perf_counter()
    for i in range(steps):
        step()
        if i == steps - 1 and drain is not None:
            drain()
        sync(device)
        end = time.perf_counter()
        times.append(end - start)
        start = end
    out: dict[str, Any] = {
        "step_s": statistics.median(times),
        "step_times_s": times,
        "peak_bytes": peak_bytes(device),
    }
    if counter is not None:
        counted1 = counter.snapshot()
        ok = counter.installed and steps > 0
        out["h2d_bytes_counted"] = (counted1[0] - counted0[0]) // steps if ok else None
        out["d2h_bytes_counted"] = (counted1[1] - counted0[1]) // steps if ok else None
        split = ok and counter.split
        out["h2d_refresh_bytes_counted"] = (counted1[2] - counted0[2]) // steps if split else None
    return out


def pinned_bandwidth(
    device: torch.device, *, nbytes: int = GiB, piece_bytes: int = 8 * MiB, repeats: int = 3
) -> dict[str, float | None]:
    """Pinned-memory copy bandwidth between host and ``device``, bytes per second.

    ``h2d``/``d2h``: one ``nbytes`` copy each way (best of ``repeats``); ``both``: an H2D and
    a D2H of ``nbytes`` each at once on two streams, total bytes over the time of both;
    ``h2d_pieces``: the same H2D as ``piece_bytes`` copies back to back on one stream (the
    way a streaming engine copies units), and ``d2h_pieces`` likewise. Each time is taken on
    the host between two ``torch.cuda.synchronize`` calls, after about a second of copies
    (an idle GPU's PCIe link can run slower until it has been busy a while: one cold
    measurement gave 34 GB/s on a link that streamed 50). All None on the CPU.
    """
    keys = ("h2d", "d2h", "both", "h2d_pieces", "d2h_pieces")
    if device.type != "cuda":
        return dict.fromkeys(keys)
    numel = nbytes // 2
    host_src = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True).fill_(1)
    host_dst = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    dev_a = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dev_b = torch.ones(numel, dtype=torch.bfloat16, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    piece = piece_bytes // 2

    def timed(fn: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev_a.copy_(host_src, non_blocking=True)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:  # wakes the link up
        h2d()
        torch.cuda.synchronize(device)

    def d2h() -> None:
        with torch.cuda.stream(s2):
            host_dst.copy_(dev_b, non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    def h2d_pieces() -> None:
        with torch.cuda.stream(s1):
            for start in range(0, numel, piece):
                dev_a[start : start + piece].copy_(
                    host_src[start : start + piece], non_blocking=True
                )

    def d2h_pieces() -> None:
        with torch.cuda.stream(s2):
            for start in range(0, numel, piece):
                host_dst[start : start + piece].copy_(
                    dev_b[start : start + piece], non_blocking=True
                )

    out = {
        "h2d": nbytes / timed(h2d),
        "d2h": nbytes / timed(d2h),
        "both": 2 * nbytes / timed(both),
        "h2d_pieces": nbytes / timed(h2d_pieces),
        "d2h_pieces": nbytes / timed(d2h_pieces),
    }
    return out


def matmul_flops(
    device: torch.device, *, m: int = 8192, k: int = 4096, n: int = 11008, repeats: int = 20
) -> float:
    """bf16 matmul rate (FLOP/s) of an (m, k) @ (k, n) product on ``device`` (the benchmarks' shape).
    On the CPU the shape is scaled down 16x each way so that it takes a moment."""
    if device.type != "cuda":
        m, k, n, repeats = m // 16, k // 16, n // 16, 3
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2.0 * m * k * n * repeats / (time.perf_counter() - t0)


def cpu_adamw_rate(
    numel: int, *, fused: bool = True, repeats: int = 3, num_tensors: int = 16
) -> float:
    """torch's CPU AdamW over ``numel`` fp32 parameters in ``num_tensors`` tensors, in
    parameters per second (median of ``repeats`` steps after one warm-up, which also
    allocates the states). ``fused=False`` uses the foreach path."""
    size = numel // num_tensors
    params = [
        torch.zeros(size, dtype=torch.float32, requires_grad=True) for _ in range(num_tensors)
    ]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=None if fused else True)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return size * num_tensors / statistics.median(times)


def dram_copy_bandwidth(*, nbytes: int = GiB, repeats: int = 3) -> float:
    """Host memory copy rate (``dst.copy_(src)``, all threads), bytes read plus written per second."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


class CopyCounter:
    """Counts the bytes ramflow copies host-to-device and device-to-host.

    It wraps ``ramflow.transfer.streams.CopyStreams.h2d`` and ``.d2h`` (a private module: if that
    changes, ``installed`` is False and the counts stay None) and adds the source tensor's
    bytes on every call. Install before ``ramflow.offload`` and keep for the process.
    ``watch(model)`` after ``ramflow.offload`` also splits H2D into the refreshes of
    resident units (after their CPU steps) and the loads of streamed units.
    """

    def __init__(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.h2d_refresh_bytes = 0
        self._resident_targets: set[int] = set()
        self._lock = threading.Lock()
        self.installed = False
        self.split = False
        try:
            from ramflow.transfer import streams as _streams
        except ImportError:
            return
        cls = getattr(_streams, "CopyStreams", None)
        if cls is None or not hasattr(cls, "h2d") or not hasattr(cls, "d2h"):
            return
        counter = self
        orig_h2d, orig_d2h = cls.h2d, cls.d2h

        def h2d(
            streams: Any, dst: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            nbytes = src.numel() * src.element_size()
            target = dst.untyped_storage().data_ptr()  # a refresh in pieces copies into views
            with counter._lock:
                counter.h2d_bytes += nbytes
                if target in counter._resident_targets:
                    counter.h2d_refresh_bytes += nbytes
            return orig_h2d(streams, dst, src, *args, **kwargs)

        def d2h(
            streams: Any, dst: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            with counter._lock:
                counter.d2h_bytes += src.numel() * src.element_size()
            return orig_d2h(streams, dst, src, *args, **kwargs)

        cls.h2d, cls.d2h = h2d, d2h
        self.installed = True

    def watch(self, model: Any) -> None:
        """Tell resident units' copies apart for ``model`` (offloaded); a no-op where the
        engine's private layout is not what this expects (``split`` stays False)."""
        try:
            from ramflow.units.registry import engine_of_model

            units = engine_of_model(model).units
            # a resident unit's device storage stays allocated: its address names it
            targets = {
                u.device_alias.untyped_storage().data_ptr() for u in units if u.resident and u.numel
            }
        except (ImportError, KeyError, AttributeError):
            return
        with self._lock:
            self._resident_targets = targets
            self.split = True

    def snapshot(self) -> tuple[int, int, int]:
        """(H2D, D2H, H2D refresh of resident units) bytes counted so far."""
        with self._lock:
            return self.h2d_bytes, self.d2h_bytes, self.h2d_refresh_bytes


def matmul_rate(device: torch.device, *, seconds: float = 1.0, n: int = 8192) -> float | None:
    """bf16 ``n x n x n`` matmul rate of ``device`` in FLOP/s, timed over about ``seconds``;
    None on the CPU (no GPU rate to compare with)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize(device)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.matmul(a, b)
        torch.cuda.synchronize(device)
        reps += 10
    rate = 2 * n**3 * reps / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return rate
