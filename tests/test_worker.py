"""The host worker on its own (``ramflow.engine.worker``): the order it runs tasks in."""

from __future__ import annotations

import threading

import pytest
import torch

from ramflow.engine.worker import LAND, STEP, HostWorker


def test_landings_first_then_steps_in_order_ready_tasks_before_waiting_ones():
    worker = HostWorker(torch.device("cpu"))
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def hold() -> None:  # holds the worker while the others queue
        started.set()
        gate.wait()

    worker.submit(STEP, -1, hold)
    started.wait()
    ready = threading.Event()
    worker.submit(STEP, 2, lambda: ran.append("step 2"))
    worker.submit(STEP, 0, lambda: ran.append("step 0"))
    worker.submit(LAND, 1, lambda: ran.append("land 1"), ready=ready.is_set)
    worker.submit(LAND, 0, lambda: ran.append("land 0"))
    assert worker.queued() == 4
    gate.set()
    worker.wait_idle()
    # land 1 is not ready while others are: they go first; picked once nothing else is
    assert ran == ["land 0", "step 0", "step 2", "land 1"]
    worker.stop()


def test_a_failed_task_is_raised_once_at_the_next_wait():
    worker = HostWorker(torch.device("cpu"))

    def fail() -> None:
        raise ValueError("boom")

    future = worker.submit(STEP, 0, fail)
    with pytest.raises(RuntimeError, match="boom"):
        worker.wait_idle()
    assert isinstance(future.exception(), ValueError)
    worker.wait_idle()  # raised once
    worker.stop()
