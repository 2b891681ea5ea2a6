"""Pictures of memory over time: PyTorch's allocator snapshots, and a PNG timeline.

``memory_snapshot`` records every CUDA allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``) and writes the pickle that PyTorch's viewer
at https://pytorch.org/memory_viz draws (see PyTorch's "Understanding CUDA Memory Usage"
page). ``plot_timeline`` draws a ``MemoryTracker``'s records as a PNG, one phase between
two labelled readings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["memory_snapshot", "plot_timeline"]


@contextlib.contextmanager
def memory_snapshot(path: str | Path, *, max_entries: int = 100_000) -> Iterator[Path]:
    """Record CUDA allocator events inside the block and write them to ``path`` at its end.

    Open the file at https://pytorch.org/memory_viz (drag and drop): the "Active Memory
    Timeline" shows every live allocation over time with the stack that made it. Built on
    ``torch.cuda.memory._record_memory_history`` and ``torch.cuda.memory._dump_snapshot``
    (PyTorch docs, "Understanding CUDA Memory Usage"); recording slows allocation, so
    record a step or two, not a run.

    Args:
        path: the pickle file to write (parent folders are created).
        max_entries: how many allocator events to keep (the oldest are dropped past it).

    Yields:
        ``path`` as a ``Path``; the file exists once the block has ended (also after an
        exception inside it, which then propagates).

    Raises:
        RuntimeError: CUDA is not available (the allocator history is CUDA's; on the CPU
            use ``MemoryTracker`` or ``tensor_census``).
        ValueError: ``max_entries`` is not positive.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "memory_snapshot records the CUDA caching allocator and needs a CUDA device; on "
            "the CPU use ramflow.memory.MemoryTracker (host RSS) or tensor_census instead."
        )
    if max_entries <= 0:
        raise ValueError(f"max_entries must be positive, got {max_entries}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


# Each reading gets an equal slot on the x axis, wide enough for its label: readings taken
# milliseconds apart (a backward and the optimizer step after it) would otherwise print their
# labels on top of each other. The time of each reading is in its label.
_LABEL_SLOT_INCHES = 0.32
_MAX_LABELS = 80  # past this many readings, every k-th is labelled


def plot_timeline(
    records: Sequence[dict[str, Any]], path: str | Path, *, title: str = "memory over a step"
) -> Path:
    """Draw a ``MemoryTracker``'s records as a PNG: memory at each reading, phases marked.

    With device readings, the device's allocated bytes (a line through the readings), its
    peak in each phase (a step from one reading to the next) and reserved bytes are drawn;
    without them (a CPU tracker) the host RSS. The readings are evenly spaced along the x
    axis, in order, each labelled below the plot with its label and its time since the
    first reading, so that no two labels overlap however close in time the readings are;
    the span between two readings is the phase that the later label names. Drawn with
    matplotlib's Agg backend, without pyplot's global state.

    Args:
        records: ``MemoryTracker.records`` (dicts with ``label``, ``time_s`` and the
            ``*_bytes`` keys), at least one.
        path: the PNG to write (parent folders are created).
        title: the figure's title.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``records`` is empty.
    """
    fig = timeline_figure(records, title=title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def timeline_figure(records: Sequence[dict[str, Any]], *, title: str):
    """The ``matplotlib.figure.Figure`` that ``plot_timeline`` writes (see there)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not records:
        raise ValueError(
            "plot_timeline needs at least one record; take snapshots with a MemoryTracker"
        )
    peak = max(
        max((v for k, v in r.items() if k.endswith("_bytes") and v is not None), default=0)
        for r in records
    )
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    n = len(records)
    xs = list(range(n))
    every = -(-n // _MAX_LABELS)
    fig = Figure(figsize=(max(9.0, 2.5 + _LABEL_SLOT_INCHES * -(-n // every)), 6.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if records[0].get("device_allocated_bytes") is not None:
        ax.plot(xs, [r["device_allocated_bytes"] / scale for r in records], "o-", label="allocated")
        ax.step(
            xs,
            [r["device_peak_bytes"] / scale for r in records],
            where="pre",
            label="peak in phase",
        )
        ax.plot(xs, [r["device_reserved_bytes"] / scale for r in records], ":", label="reserved")
        ax.set_ylabel(f"device memory ({unit})")
    else:
        ax.plot(xs, [r["host_rss_bytes"] / scale for r in records], "o-", label="host RSS")
        ax.set_ylabel(f"host memory ({unit})")
    for x in xs:
        ax.axvline(x, color="grey", linestyle="--", linewidth=0.6)
    t0 = records[0]["time_s"]
    shown = xs[::every]
    ax.set_xticks(shown)
    ax.set_xticklabels(
        [f"{records[i]['label']} ({records[i]['time_s'] - t0:.2f} s)" for i in shown],
        rotation=90,
        fontsize=8,
    )
    ax.set_xlim(-0.5, n - 0.5)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_xlabel("readings, in order (time since the first)")
    ax.set_title(title)
    ax.legend(loc="best")
    fig.tight_layout()
    return fig
