"""MemoryTracker: labelled readings in order, host memory on the CPU, peaks on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ramflow.memory import MemoryTracker


def step(model: nn.Module, x: torch.Tensor, tracker: MemoryTracker) -> None:
    loss = model(x).square().mean()
    tracker.snapshot("after forward")
    loss.backward()
    tracker.snapshot("after backward")


def test_records_have_labels_and_increasing_times():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    with MemoryTracker(device="cpu") as tracker:
        step(model, torch.randn(32, 64), tracker)
    labels = [r["label"] for r in tracker.records]
    assert labels == ["start", "after forward", "after backward", "end"]
    times = [r["time_s"] for r in tracker.records]
    assert all(a <= b for a, b in zip(times, times[1:])) and times[-1] > times[0]
    for r in tracker.records:
        assert r["device_allocated_bytes"] is None and r["device_peak_bytes"] is None
        assert r["host_rss_bytes"] > 0
    assert tracker.peak_bytes is None
    text = tracker.summary()
    assert "after forward" in text and "host RSS" in text


def test_pinned_bytes_hook_is_recorded():
    readings = iter(range(100, 200))
    with MemoryTracker(device="cpu", pinned_bytes=lambda: next(readings)) as tracker:
        tracker.snapshot("middle")
    assert [r["pinned_bytes"] for r in tracker.records] == [100, 101, 102]


def test_snapshot_outside_the_block_raises():
    tracker = MemoryTracker(device="cpu")
    with pytest.raises(RuntimeError, match="inside"):
        tracker.snapshot("too early")
    with tracker:
        pass
    with pytest.raises(RuntimeError, match="inside"):
        tracker.snapshot("too late")


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="cuda"):
        with MemoryTracker(device="meta"):
            pass


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0)])
def test_cuda_without_cuda_is_refused_clearly(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*device='cpu'"):
        MemoryTracker(device=device)


def test_bad_device_arguments_are_refused():
    with pytest.raises(ValueError, match="device must be"):
        MemoryTracker(device=True)
    with pytest.raises(ValueError, match="cannot read device"):
        MemoryTracker(device="gpu")


@pytest.mark.gpu
def test_cuda_peaks_match_max_memory_allocated():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    # the same step untracked, after one warm-up step, read with PyTorch's own counter
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).square().mean().backward()
        want = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as tracker:
        step(model, x, tracker)
    assert tracker.device.type == "cuda"
    assert tracker.peak_bytes == want
    for r in tracker.records:
        assert r["device_peak_bytes"] >= r["device_allocated_bytes"]
        assert r["device_reserved_bytes"] >= r["device_allocated_bytes"]
    after_forward = tracker.records[1]
    assert after_forward["device_allocated_bytes"] > tracker.records[0]["device_allocated_bytes"]
