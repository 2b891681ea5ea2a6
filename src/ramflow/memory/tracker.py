"""Where memory goes over a step: labelled readings of device and host memory.

``MemoryTracker`` is a context manager. Each ``snapshot(label)`` reads, at that moment, the
caching allocator's counters of the device (allocated, reserved, and the peak since the
previous reading), the process's resident host memory, and the pinned host bytes. The
readings are plain dicts (``records``), printable as a table (``summary()``) and drawable as
a timeline (``ramflow.memory.plot_timeline``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from ..sizes import format_bytes
from ..transfer.streams import registered_bytes

__all__ = ["MemoryTracker", "cuda_pinned_bytes"]


def cuda_pinned_bytes() -> int | None:
    """Bytes of pinned host memory: PyTorch's caching host allocator's plus what ramflow
    page-locked in place, or None.

    PyTorch's part is what ``torch.empty(..., pin_memory=True)`` and ``Tensor.pin_memory()``
    draw from, read from ``torch.cuda.host_memory_stats()["allocated_bytes.current"]``
    (block sizes rounded up to a power of two, cached free blocks included). ramflow's host
    store (masters, wire copies, gradient staging, compressed weights) maps its buffers
    itself and page-locks exactly their pages with ``cudaHostRegister``, as it does shared
    masters (see [Note: pinned memory of its own size] in ``ramflow.transfer.streams``): those
    bytes are added from ramflow's own count.

    Returns:
        The byte count, or None when CUDA is not available or not yet initialized (no
        pinned memory can exist then, but None says "not measured" rather than 0).
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.current", 0)) + registered_bytes()


def _checked_device(device: torch.device | str | int) -> torch.device:
    """``MemoryTracker``'s ``device`` argument as a CPU or CUDA ``torch.device`` (an int is
    a CUDA index), checked against this machine."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise ValueError(
            f"MemoryTracker: device must be a torch.device, a string or a CUDA index, got "
            f"{device!r}"
        )
    try:
        # torch.device(0) means "the current accelerator", which fails without one
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"MemoryTracker: cannot read device {device!r} ({err})") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(
            f"MemoryTracker reads CUDA or CPU memory; got device {resolved}. "
            "Pass device='cuda' (or 'cuda:N'), or 'cpu' for host memory only."
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"MemoryTracker(device={str(resolved)!r}) reads the CUDA allocator and needs a "
                "CUDA device, and this machine has none; on the CPU use "
                "MemoryTracker(device='cpu') (host RSS) or tensor_census."
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"MemoryTracker: device {resolved} does not exist; this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved


class MemoryTracker:
    """Record labelled memory readings over a block of code.

    Usage::

        with MemoryTracker() as tracker:
            loss = model(x).sum()
            tracker.snapshot("after forward")
            loss.backward()
            tracker.snapshot("after backward")
        print(tracker.summary())

    Entering takes a reading labelled ``"start"`` and exiting one labelled ``"end"``. On
    CUDA, entering resets the device's peak counter (``torch.cuda.reset_peak_memory_stats``)
    and every reading resets it again after reading it, so each record's
    ``device_peak_bytes`` is the peak since the previous record and ``peak_bytes`` is the
    peak over the whole block. Code that reads ``torch.cuda.max_memory_allocated`` itself
    inside the block sees these resets.

    Each record is a dict with keys:

    - ``label`` (str) and ``time_s`` (float, seconds since entering, host clock; the device
      may still run queued kernels, the allocator counters do not wait for them);
    - ``device_allocated_bytes``, ``device_reserved_bytes``, ``device_peak_bytes`` (int,
      from ``torch.cuda.memory_allocated``, ``memory_reserved`` and
      ``max_memory_allocated``), or None on a CPU device, where only host memory is read;
    - ``host_rss_bytes`` (int, resident set size of this process, from psutil);
    - ``pinned_bytes`` (int or None, from the ``pinned_bytes`` callable).

    Args:
        device: the CUDA device to read (``"cuda"``, ``"cuda:N"`` or an index ``N``), or a
            CPU device (host readings only). Default:
            the current CUDA device when CUDA is available, else the CPU.
        pinned_bytes: a callable returning the pinned host bytes to record (or None for
            "not measured"). Default: ``cuda_pinned_bytes`` (PyTorch's pinned allocator).

    Raises:
        ValueError: ``device`` is neither CPU nor CUDA, or names a CUDA device this machine
            does not have (on construction).
        RuntimeError: ``device`` is a CUDA device and CUDA is not available (on
            construction), or ``snapshot`` is called outside the ``with`` block.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | int | None = None,
        pinned_bytes: Callable[[], int | None] | None = None,
    ) -> None:
        self._device_arg = _checked_device(device) if device is not None else None
        self._pinned_bytes = pinned_bytes if pinned_bytes is not None else cuda_pinned_bytes
        self._process = psutil.Process()
        self.device: torch.device | None = None
        self.records: list[dict[str, Any]] = []
        self._t0: float | None = None

    def __enter__(self) -> MemoryTracker:
        device = self._device_arg
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.records = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._t0 = time.perf_counter()
        self.snapshot("start")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.snapshot("end")
        self._t0 = None

    def snapshot(self, label: str) -> dict[str, Any]:
        """Take one reading now, labelled ``label``; returns the record (also appended to
        ``records``). Raises RuntimeError outside the ``with`` block."""
        if self._t0 is None or self.device is None:
            raise RuntimeError(
                "MemoryTracker.snapshot needs an active tracker: call it inside "
                "'with MemoryTracker() as tracker:'."
            )
        record: dict[str, Any] = {"label": str(label), "time_s": time.perf_counter() - self._t0}
        if self.device.type == "cuda":
            record["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            record["device_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            record["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            record["device_allocated_bytes"] = None
            record["device_reserved_bytes"] = None
            record["device_peak_bytes"] = None
        record["host_rss_bytes"] = self._process.memory_info().rss
        record["pinned_bytes"] = self._pinned_bytes()
        self.records.append(record)
        return record

    @property
    def peak_bytes(self) -> int | None:
        """The device's peak allocated bytes over the records so far (None on a CPU device)."""
        peaks = [r["device_peak_bytes"] for r in self.records if r["device_peak_bytes"] is not None]
        return max(peaks) if peaks else None

    def summary(self) -> str:
        """The records as a fixed-width table, one row per reading, sizes in binary units."""
        header = (
            "label",
            "time s",
            "allocated",
            "reserved",
            "peak since prev",
            "host RSS",
            "pinned",
        )

        def size(value: int | None) -> str:
            return "-" if value is None else format_bytes(value)

        rows = [header]
        for r in self.records:
            rows.append(
                (
                    r["label"],
                    f"{r['time_s']:.3f}",
                    size(r["device_allocated_bytes"]),
                    size(r["device_reserved_bytes"]),
                    size(r["device_peak_bytes"]),
                    size(r["host_rss_bytes"]),
                    size(r["pinned_bytes"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
            for row in rows
        ]
        device = self.device if self.device is not None else "not entered"
        return f"memory on {device}\n" + "\n".join(lines)
