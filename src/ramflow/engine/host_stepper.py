"""The host stepper: optimizer steps of whole units on the host worker, and the refresh of
resident units in pieces.

Owns the steps that run on the worker (the unit's master weights, states and wire copy in
one flat pass where one optimizer steps it whole, parameter by parameter otherwise; a land
and step in one pass from the staged gradients), the check that their gradients were not
written meanwhile, the refresh pieces, and the totals of the optimizer kernels. When a unit
steps, and where, is the stepper's (``engine.stepper``).

[Note: the refresh follows the step]
A resident unit's device copy is refreshed by one H2D after its host step. The forward
that needs the unit waits for that copy, so the copy of the last unit stepped before the
next step's forward reaches it is on the critical path (8 ms for a 0.4 GB block at PCIe 5
speed, and in a step bound by the CPU optimizer nothing else runs then). So the step of a
resident unit runs in pieces (``REFRESH_PIECE_BYTES`` of wire copy each), and each piece's
H2D is issued as soon as the kernel has written it: only the last piece's copy is left
when the step ends. The pieces cover the trainable prefix; the frozen rest of the device
copy is current when the unit was exactly one version behind (checked), and the last
piece's event is the unit's load event (one stream, copies in order).
Each piece costs the worker a kernel call and a copy issued from Python, which waits for the
GIL while the training loop runs Python code: a few percent of the optimizer's rate when
every unit is cut (docs/speed.md, "Refresh pieces").
So only a step that starts with nothing else queued on the worker is cut: the one whose
refresh the next forward is waiting for.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from ..formats.deferred_grad import CompactGradient
from ..units.unit import ALIGN, Unit
from .host_store import HostStore
from .interfaces import StepOptimizer
from .step_policy import StepItem
from .window import DeviceWindow
from .worker import HostWorker

# A resident unit's refresh is sent in pieces of this many wire bytes, each as soon as the
# step has written it. See [Note: the refresh follows the step].
REFRESH_PIECE_BYTES = 64 << 20


class HostStepper:
    """The worker's optimizer steps of one engine's units (run on the worker thread).

    Args:
        worker: the host worker (whether other tasks wait behind a step).
        window: the device window (versions of the device copies, pieces of the refresh).
        host: the host store (masters, wire copies, staging buffers).
    """

    def __init__(self, *, worker: HostWorker, window: DeviceWindow, host: HostStore) -> None:
        self.worker = worker
        self._window = window
        self._host = host
        # the worker's optimizer kernels so far: parameters stepped, seconds (host_step_totals)
        self._host_steps = [0, 0.0]

    def step_unit(self, u: Unit, items: list[StepItem], *, grad_scale: float = 1.0) -> None:
        """Worker: step ``u``'s master weights with each optimizer, then refresh its wire
        copy (in the same pass when one optimizer steps the whole unit flat, which then
        multiplies the gradients by ``grad_scale`` as it reads them: a clip's coefficient,
        see [Note: folding the clip into the step] in ``ramflow.engine.grad_scale``)."""
        self._host.before_host_write(u)
        wire_written = False
        pieces = None
        start = time.perf_counter()
        with torch.profiler.record_function(f"ramflow.optimizer:{u.name}"):
            if len(items) == 1 and items[0].whole_unit(u):
                pieces = self._refresh_pieces(u)
                items[0].optimizer.flat_step(
                    u,
                    items[0].hyper,
                    grad=u.host_grad,
                    grad_scale=grad_scale,
                    wire_out=self._host.wire_prefix(u),
                    pieces=pieces,
                    after_piece=functools.partial(self._window.send_piece, u) if pieces else None,
                )
                wire_written = True
            else:
                assert grad_scale == 1.0  # applied in place (``Stepper._take_grad_scale``)
                for item in items:
                    item.optimizer.step_params(item.params, item.grads, item.hyper)
        self._count_host_step(sum(p.numel() for item in items for p in item.params), start)
        self._host.refresh_wire(u, written=wire_written, sent=wire_written and bool(pieces))
        self._check_grads_unwritten(u, items)

    @staticmethod
    def _check_grads_unwritten(u: Unit, items: list[StepItem]) -> None:
        """Worker, after a host step: the gradients it read were not written in place
        between ``step()`` and now (``p.grad.zero_()``, ``zero_grad(set_to_none=False)``
        right after ``step()``), which would have stepped with what was written. Raised on
        the worker, so at the loop's next ramflow call."""
        for item in items:
            written = [
                p for p, g, v in zip(item.params, item.grads, item.versions) if g._version != v
            ]
            if written:
                raise RuntimeError(
                    f"the gradients of unit {u.name!r} were written in place (e.g. "
                    "p.grad.zero_() or zero_grad(set_to_none=False)) while ramflow's CPU "
                    "optimizer was still reading them for the step just taken, so that step "
                    "may have used the new values. Use zero_grad() (set_to_none=True, "
                    "PyTorch's default), or call ramflow.synchronize(model) before writing "
                    "gradients in place; reload a checkpoint to undo this step."
                )

    def step_staged(
        self,
        u: Unit,
        opt: StepOptimizer,
        hyper: list[dict],
        *,
        accumulate: bool,
        keep_grads: bool = True,
    ) -> None:
        """Worker: land and step ``u`` in one pass from the staged gradients. See
        ``GradientPath.land``."""
        self._host.before_host_write(u)
        self._flat_step(
            u,
            opt,
            hyper,
            grad=u.staging,
            accumulate=u.host_grad if accumulate else None,
            grad_out=None if accumulate or not keep_grads else u.host_grad,
        )

    def step_compact(
        self, u: Unit, grad: CompactGradient, opt: StepOptimizer, hyper: list[dict]
    ) -> None:
        """Worker: step ``u`` in one pass from its compact deferred gradient ``grad``, decoded
        into a staging buffer of the gradient ring (a fixed cost, see [Note: the gradient
        ring] in ``ramflow.engine.host_store``), times a clip's coefficient
        (``grad.scale``) as the kernel reads it. See [Note: the compact deferred gradient] in
        ``ramflow.formats.deferred_grad``."""
        self._host.before_host_write(u)
        staging = self._host.staging(u)
        self._flat_step(
            u,
            opt,
            hyper,
            grad=staging,
            decode=functools.partial(grad.decode_into, staging),
            grad_scale=1.0 if grad.scale is None else grad.scale,
        )

    def _flat_step(
        self, u: Unit, opt: StepOptimizer, hyper: list[dict], *, decode=None, **step: Any
    ) -> None:
        """Worker: ``opt.flat_step`` of ``u`` from a staging buffer of the gradient ring
        (``step`` holds its gradient arguments), after ``decode`` fills it when given; the
        staging buffer is released and the unit's wire copy refreshed (sent piece by piece
        where ``_refresh_pieces`` says so)."""
        pieces = self._refresh_pieces(u)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"ramflow.optimizer:{u.name}"):
                if decode is not None:
                    decode()
                opt.flat_step(
                    u,
                    hyper,
                    wire_out=self._host.wire_prefix(u),
                    pieces=pieces,
                    after_piece=(functools.partial(self._window.send_piece, u) if pieces else None),
                    **step,
                )
        finally:
            self._host.release_staging(u)
        self._count_host_step(u.trainable_numel, start)
        self._host.refresh_wire(u, written=True, sent=bool(pieces))

    def _refresh_pieces(self, u: Unit) -> list[tuple[int, int]] | None:
        """Worker, before a flat step of ``u``: the element ranges to step and send one by
        one, or None to send the unit after its step as usual. See [Note: the refresh
        follows the step]."""
        if not u.resident or u.wire is u.master or self.worker.queued():
            return None
        # pieces start on multiples of ALIGN: whole blocks of 8-bit states, and each piece
        # rounds stochastically as the whole unit would (its counter offset)
        step = max(ALIGN, REFRESH_PIECE_BYTES // u.wire.element_size() // ALIGN * ALIGN)
        n = u.trainable_numel
        # the device copy lacks this step only, so the frozen rest needs no copy
        if not self._window.one_version_behind(u) or n <= step:
            return None
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _count_host_step(self, params: int, start: float) -> None:
        self._host_steps[0] += params
        self._host_steps[1] += time.perf_counter() - start

    def host_step_totals(self) -> tuple[int, float]:
        """(parameters stepped, seconds) of the worker's optimizer kernels since the engine
        was made, summed over units: their rate is the CPU optimizer's rate inside the
        training loop, beside the copies and the loop's own threads. Read between steps
        (after ``synchronize``) for exact figures."""
        return self._host_steps[0], self._host_steps[1]
