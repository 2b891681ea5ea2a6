"""The unit-major step order: every micro-batch passes a unit before the next unit runs.

See [Note: one weight pass per optimizer step] below and "One weight pass per optimizer
step" in docs/design.md. This module holds the order itself, on any model and any list of
unit modules; the engine's part (loading each unit once per phase, stepping a unit when
``on_unit_done`` says its gradient is complete, boundaries in pinned host memory) builds on
it.

[Note: one weight pass per optimizer step]
With M micro-batches per optimizer step the ordinary loop runs micro-batch after
micro-batch, so an offloaded unit's weights cross PCIe M times in forward and M times in
backward. ``UnitMajorStep.run`` runs the same computation unit by unit (FlexGen's zig-zag
block schedule, Sheng et al. 2023, applied to training):

- Forward: each micro-batch's forward runs in its own thread, and one token passes between
  the threads at every unit call: all M micro-batches make their c-th unit call, in
  micro-batch order, before any makes its (c+1)-th. One thread runs at a time, so the order
  is deterministic. Each unit call is checkpointed (non-reentrant): it keeps only its
  inputs, and each floating input that requires grad is swapped for a detached leaf, the
  boundary between this call's graph and the one before it.
- Backward, on the caller's thread only: first ``loss_m.backward()`` for every m, which
  ends at the last unit call's leaves; then, for each earlier call c from the last,
  ``torch.autograd.backward(inputs of call c+1, their leaves' gradients)`` for every m, which
  runs the code between the two calls and call c's recompute and backward, and ends at call
  c's leaves. A unit's parameter gradients are complete once the M micro-batches have passed
  its last call: ``on_unit_done(unit)`` is called then, once per unit.
  (Threads cannot wait for each other inside backward: on CUDA the autograd engine runs every
  backward's device work on one thread per device, so such a wait would deadlock.)

The result equals the ordinary accumulation up to the order of summation: each parameter's
gradient sums the same M contributions, in micro-batch order.

Not yet wired into the engine: here a unit call is checkpointed by wrapping the unit's
``forward`` in ``torch.utils.checkpoint``, whose recompute calls the unwrapped ``forward``
and so does not run the unit's own forward pre-hooks (the engine's H2D wait). The engine's
checkpointing (``activations/``) loads units for their recompute, and is what the wiring
must use; the boundaries then go to pinned host memory as ``CheckpointOffload`` sends them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class _Call:
    """One unit call of one micro-batch: its unit, its original inputs that require grad
    and the leaves that stood in for them."""

    unit: nn.Module
    inputs: list[torch.Tensor] = field(default_factory=list)
    leaves: list[torch.Tensor] = field(default_factory=list)


class _TurnTaker:
    """Lets one thread run at a time, the one waiting at the lowest (round, micro-batch).

    A thread waits at its start (round -1) and before each unit call (round c for its c-th
    call); the runnable thread is chosen only when every live thread waits, so the order
    does not depend on the thread scheduler."""

    def __init__(self, num_threads: int) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[int, int] = {}
        self._live = num_threads
        self._running: int | None = None

    def _pick(self) -> None:
        if self._running is None and self._waiting and len(self._waiting) == self._live:
            self._running = min(self._waiting, key=lambda m: (self._waiting[m], m))
            del self._waiting[self._running]
            self._cond.notify_all()

    def wait_turn(self, m: int, round_: int) -> None:
        with self._cond:
            if self._running == m:
                self._running = None
            self._waiting[m] = round_
            self._pick()
            self._cond.wait_for(lambda: self._running == m)

    def finish(self, m: int) -> None:
        with self._cond:
            if self._running == m:
                self._running = None
            self._waiting.pop(m, None)
            self._live -= 1
            self._pick()


def _leafify(value: Any, call: _Call) -> Any:
    if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
        leaf = value.detach().requires_grad_(True)
        call.inputs.append(value)
        call.leaves.append(leaf)
        return leaf
    if isinstance(value, tuple | list):
        return type(value)(_leafify(v, call) for v in value)
    if isinstance(value, dict):
        return {k: _leafify(v, call) for k, v in value.items()}
    return value


class UnitMajorStep:
    """Forward and backward of several micro-batches, unit by unit.

    See [Note: one weight pass per optimizer step].

    Args:
        units: the unit modules, each called at least once by every micro-batch's forward
            (e.g. a transformer's embedding, blocks, final norm and head). A unit called
            several times is fine; every micro-batch must make the same number of unit
            calls.
        on_unit_done: called with a unit once every micro-batch's backward has passed all
            of its calls (its parameter gradients are complete), in backward order, once per
            unit per ``run``.

    Raises:
        ValueError: at construction, when ``units`` is empty or holds a module twice.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        on_unit_done: Callable[[nn.Module], None] | None = None,
    ) -> None:
        if not units:
            raise ValueError("UnitMajorStep: give at least one unit module")
        if len({id(u) for u in units}) != len(units):
            raise ValueError("UnitMajorStep: a unit module is listed twice; list each once")
        self.units = list(units)
        self.on_unit_done = on_unit_done

    def run(self, forward: Callable[[Any], torch.Tensor], micro_batches: Sequence[Any]) -> list:
        """Run ``forward(batch)`` for every micro-batch unit-major, then backward likewise.

        Args:
            forward: maps one micro-batch to a scalar loss tensor (scale it by 1/M yourself
                for a mean over micro-batches, as in an ordinary accumulation loop).
            micro_batches: the M micro-batches, in the order their gradients sum.

        Returns:
            The M losses, detached, in micro-batch order.

        Raises:
            RuntimeError: a micro-batch's forward raised (re-raised with its index; the
                other micro-batches' graphs are dropped and no gradient is written), or the
                micro-batches made different numbers of unit calls.
        """
        num = len(micro_batches)
        turns = _TurnTaker(num)
        calls: list[list[_Call]] = [[] for _ in range(num)]
        losses: list[torch.Tensor | None] = [None] * num
        errors: list[BaseException | None] = [None] * num
        local = threading.local()
        unit_ids = {id(u) for u in self.units}

        def pre_hook(module, args, kwargs):
            m = getattr(local, "m", None)
            if m is None or id(module) not in unit_ids:
                return None
            turns.wait_turn(m, len(calls[m]))
            call = _Call(module)
            calls[m].append(call)
            return _leafify(args, call), _leafify(kwargs, call)

        originals = {}
        for unit in self.units:
            originals[unit] = unit.forward
            unit.forward = functools.partial(checkpoint, originals[unit], use_reentrant=False)
        handles = [
            u.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
            for u in self.units
        ]

        # autocast is thread-local: the caller's carries into every micro-batch's thread
        autocast = [
            (d, torch.get_autocast_dtype(d))
            for d in ("cuda", "cpu")
            if torch.is_autocast_enabled(d)
        ]

        def body(m: int) -> None:
            local.m = m
            try:
                turns.wait_turn(m, -1)
                with contextlib.ExitStack() as stack:
                    for device_type, dtype in autocast:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype))
                    losses[m] = forward(micro_batches[m])
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                errors[m] = err
            finally:
                local.m = None
                turns.finish(m)

        threads = [threading.Thread(target=body, args=(m,), daemon=True) for m in range(num)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for h in handles:
                h.remove()
            for unit, fwd in originals.items():
                unit.forward = fwd
        for m, err in enumerate(errors):
            if err is not None:
                raise RuntimeError(f"micro-batch {m}'s forward raised: {err}") from err
        rounds = {len(c) for c in calls}
        if len(rounds) != 1:
            raise RuntimeError(
                "UnitMajorStep: the micro-batches made different numbers of unit calls "
                f"({sorted(rounds)}); the unit-major order needs the same calls in each"
            )
        self._backward(calls, losses)
        return [loss.detach() for loss in losses]

    def _backward(self, calls: list[list[_Call]], losses: list[torch.Tensor]) -> None:
        num_rounds = len(calls[0])
        first_call: dict[int, int] = {}  # a unit's first call is the last that backward meets
        for r, c in enumerate(calls[0]):
            first_call.setdefault(id(c.unit), r)
        for loss in losses:
            loss.backward()
        self._done(calls, num_rounds - 1, first_call)
        for r in range(num_rounds - 1, 0, -1):
            for m in range(len(losses)):
                self._through(calls[m][r])
            self._done(calls, r - 1, first_call)
        for m in range(len(losses)):  # the first call's inputs: gradients for the caller
            self._through(calls[m][0])

    @staticmethod
    def _through(call: _Call) -> None:
        pairs = [
            (x, leaf.grad) for x, leaf in zip(call.inputs, call.leaves) if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
        call.inputs.clear()
        call.leaves.clear()

    def _done(self, calls: list[list[_Call]], r: int, first_call: dict[int, int]) -> None:
        unit = calls[0][r].unit
        if self.on_unit_done is not None and first_call[id(unit)] == r:
            self.on_unit_done(unit)
