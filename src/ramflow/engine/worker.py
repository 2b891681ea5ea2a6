"""The host worker: one thread that lands gradients and steps the optimizer on the CPU.

[Note: optimizer overlap]
Gradients of a unit leave the GPU as soon as the unit's backward is done (one D2H copy).
The worker waits on that copy's event, adds the gradients into the fp32 host gradients and,
when the step is already known to follow (see ``GradientPath.land``), steps the unit's fp32
master weights and refreshes its wire copy, while the GPU runs backward on earlier units
(the overlap of ZeRO-Offload, Ren et al. 2021). Tasks run by priority: landing gradients
first (backward waits on them at its end), then steps in forward order, so that the next
forward, which waits for each unit's step only, can start with the first unit.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

LAND = 0
STEP = 1


class HostWorker:
    """A daemon thread running prioritised tasks; started on the first submit."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._heap: list[
            tuple[int, int, int, Callable[[], None], Future, Callable[[], bool] | None]
        ] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending = 0
        self.error: BaseException | None = None

    def submit(
        self, kind: int, order: int, fn: Callable[[], None], ready: Callable[[], bool] | None = None
    ) -> Future:
        """Run ``fn`` on the worker; lower ``(kind, order)`` runs first among the tasks whose
        ``ready()`` is true (a gradient landing whose D2H copy is still in flight is not, so
        it does not hold up a step that could run meanwhile). Returns its future."""
        future: Future = Future()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ramflow-host", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (kind, order, next(self._seq), fn, future, ready))
            self._pending += 1
            self._cond.notify_all()
        return future

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                while not self._heap and not self._stopping:
                    self._cond.wait()
                if not self._heap:
                    return
                entry = self._pick()
                _, _, _, fn, future, _ = entry
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                with self._cond:
                    self.error = self.error or err
                future.set_exception(err)
            else:
                future.set_result(None)
            # the task may hold its engine: let it go before waiting for the next
            del entry, fn, future
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _pick(self) -> tuple:
        """Remove and return the first ready task in priority order; if none is ready, the
        first task (it will wait for its own event). Lock held."""
        for entry in sorted(self._heap):
            if entry[5] is None or entry[5]():
                break
        else:
            entry = self._heap[0]
        self._heap.remove(entry)
        heapq.heapify(self._heap)
        return entry

    def queued(self) -> int:
        """Tasks submitted and not yet started (the running one excluded)."""
        with self._cond:
            return len(self._heap)

    def wait_idle(self) -> None:
        """Block until every submitted task has run; re-raise the first task error."""
        with self._cond:
            while self._pending:
                self._cond.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"ramflow host worker failed: {err}") from err

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()  # (a finalizer may run on the worker itself: it just ends)
