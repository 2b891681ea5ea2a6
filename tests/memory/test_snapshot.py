"""Allocator snapshots (CUDA) and the PNG timeline of a tracker's records."""

from __future__ import annotations

import pickle

import pytest
import torch

from ramflow.memory import MemoryTracker, memory_snapshot, plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_timeline_of_cpu_records(tmp_path):
    with MemoryTracker(device="cpu") as tracker:
        x = torch.randn(256, 256, requires_grad=True)
        tracker.snapshot("forward")
        (x @ x).sum().backward()
        tracker.snapshot("backward")
    path = plot_timeline(tracker.records, tmp_path / "plots" / "timeline.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_timeline_of_device_records(tmp_path):
    mib = 2**20
    records = [
        {
            "label": label,
            "time_s": t,
            "device_allocated_bytes": a * mib,
            "device_reserved_bytes": 64 * mib,
            "device_peak_bytes": p * mib,
            "host_rss_bytes": 100 * mib,
            "pinned_bytes": None,
        }
        for label, t, a, p in [
            ("start", 0.0, 10, 10),
            ("forward", 0.1, 40, 41),
            ("end", 0.3, 12, 50),
        ]
    ]
    path = plot_timeline(records, tmp_path / "device.png", title="one step")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_timeline_needs_records(tmp_path):
    with pytest.raises(ValueError, match="at least one record"):
        plot_timeline([], tmp_path / "empty.png")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_snapshot_without_cuda_says_what_to_use(tmp_path):
    with pytest.raises(RuntimeError, match="MemoryTracker"):
        with memory_snapshot(tmp_path / "snap.pickle"):
            pass
    assert not (tmp_path / "snap.pickle").exists()


@pytest.mark.gpu
def test_snapshot_file_is_written(tmp_path):
    with memory_snapshot(tmp_path / "deep" / "snap.pickle") as path:
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        del x, y
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert "segments" in snapshot and "device_traces" in snapshot
    assert any(trace for trace in snapshot["device_traces"])  # the allocations were recorded


def _device_records(n: int) -> list[dict]:
    mib = 2**20
    return [
        {
            "label": f"step {k // 3 + 1} " + ("forward", "backward", "optimizer step")[k % 3],
            "time_s": 0.001 * k,  # a millisecond apart: too close to tell apart in time
            "device_allocated_bytes": (10 + k % 7) * mib,
            "device_reserved_bytes": 64 * mib,
            "device_peak_bytes": (20 + k % 5) * mib,
            "host_rss_bytes": 100 * mib,
            "pinned_bytes": None,
        }
        for k in range(n)
    ]


@pytest.mark.parametrize("n", [3, 30, 200])
def test_timeline_labels_do_not_overlap(n):
    """Readings a millisecond apart still get labels side by side, each with its time."""
    from ramflow.memory.snapshot import timeline_figure

    fig = timeline_figure(_device_records(n), title="close readings")
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    every = -(-n // 80)  # past 80 readings, every k-th is labelled
    assert len(labels) == len(range(0, n, every))
    assert labels[0].get_text() == "step 1 forward (0.00 s)"
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:]))
    assert all(b.x0 >= 0 and b.x1 <= fig.bbox.width for b in boxes)  # none cut off
