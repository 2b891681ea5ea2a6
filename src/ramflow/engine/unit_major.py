"""The unit-major step order: every micro-batch passes a unit before the next unit runs.

``UnitMajorStep`` is the order itself, on any model and any list of unit modules;
``UnitMajorAccumulation`` is the engine's part: each offloaded unit loads once for forward
and once for backward per optimizer step, and its gradient crosses D2H once, when it is
complete, and is stepped then. ``ramflow.accumulate`` calls it; "One weight pass per
optimizer step" in docs/design.md has the design.

[Note: one weight pass per optimizer step]
With M micro-batches per optimizer step the ordinary loop runs micro-batch after
micro-batch, so an offloaded unit's weights cross PCIe M times in forward and M times in
backward. ``UnitMajorStep.run`` runs the same computation unit by unit (FlexGen's zig-zag
block schedule, Sheng et al. 2023, applied to training):

- Forward: each micro-batch's forward runs in its own thread, and one token passes between
  the threads at every unit call: all M micro-batches make their c-th unit call, in
  micro-batch order, before any makes its (c+1)-th. One thread runs at a time, so the order
  is deterministic. Each floating input of a unit call that requires grad is swapped for a
  boundary (``_Boundary``: the same values, where backward stops and leaves the gradient
  in the call's record), between this call's graph and the one before it; the step keeps
  the input's gradient edge, not the tensor, so it holds no boundary's memory. Activation
  checkpointing is the model's own (the engine's, installed by ``offload``): a checkpointed
  unit keeps only its inputs, and its recomputation runs inside the unit's backward, which
  the engine loads and pins (``engine.schedule``).
- Backward, on the caller's thread only: first ``loss_m.backward()`` for every m, which
  ends at the last unit call's boundaries; then, for each earlier call c from the last,
  ``torch.autograd.backward(edges of call c+1's inputs, their boundaries' gradients)`` for
  every m, which runs the code between the two calls and call c's recompute and backward,
  and ends at call c's boundaries. A unit's parameter gradients are complete once the M micro-batches have passed
  its last call: ``on_unit_done(unit)`` is called then, once per unit.
  (Threads cannot wait for each other inside backward: on CUDA the autograd engine runs every
  backward's device work on one thread per device, so such a wait would deadlock.)
- The engine (``UnitMajorAccumulation``): the schedule records the unit order from the first
  micro-batch only (the others make the same calls), so prefetches predict the next unit,
  not the same unit again; a unit stays in the window between its micro-batches (it was
  used last), so it loads once per phase. The gradient path adds each micro-batch's
  gradients into the unit's device gradient buffer (``GradientPath.hold``) and sends the
  buffer D2H once, when every unit call that reads the unit is done; the step policy sees
  the whole step as one backward pass, so an eager pass steps the unit as it lands and no
  full-model host gradient buffer is made (with ``keep_grads=False`` under the gradient
  ring, the first step included; a loop that clips gets deferred steps, as today).

The result equals the ordinary accumulation up to the order of summation: each parameter's
gradient sums the same M contributions, in micro-batch order (bit for bit in fp32 where the
ordinary loop also sums on the device; ramflow's ordinary loop sums in fp32 on the host,
this order in the wire dtype on the device).
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

from ..activations.boundary_offload import BoundaryOffloader
from ..units.unit import Unit
from .gradients import GradientPath
from .router_logits import RouterLogits
from .schedule import Schedule, in_backward
from .stepper import Stepper


@dataclass
class _Call:
    """One unit call of one micro-batch: its unit, where its original inputs that require
    grad sit in the graph before it (their gradient edges: the tensors themselves are not
    kept, so nothing here holds a boundary's memory), and the gradients that reached the
    boundaries standing in for them (None until backward reaches one)."""

    unit: nn.Module
    edges: list[Any] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    # the boundaries' (device type, data pointer): a tensor the call's graph saves that is
    # one of them goes to host memory where the step offloads boundaries
    boundary_ptrs: set[tuple[str, int]] = field(default_factory=set)


class _Boundary(torch.autograd.Function):
    """A unit call's input, cut from the graph before it: the same values (a view, no
    copy), whose gradient is kept in the call's ``grads`` rather than passed on, so a
    backward pass ends here. ``anchor`` is a 0-dim leaf that requires grad, on ``x``'s
    device, so that the output does; it never gets a gradient. Unlike a detached leaf, nothing but the graph
    (what the unit's own operations saved) holds the output's memory: autograd keeps a
    leaf alive in its gradient accumulator."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, call: _Call, i: int):  # type: ignore[override]
        ctx.call = call
        ctx.i = i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grads = ctx.call.grads
        # reached again in a later pass (a later unit read this input too): the sum, in the
        # order a gradient accumulator would add them
        grads[ctx.i] = grad if grads[ctx.i] is None else grads[ctx.i] + grad
        return None, None, None, None


@dataclass
class _Cut:
    """A tensor cut out of the graph in one micro-batch's forward (``UnitMajorStep.cut``):
    the number of unit calls that micro-batch had entered then, the tensor and its leaf."""

    calls_entered: int
    tensor: torch.Tensor
    leaf: torch.Tensor


class _Stopped(Exception):
    """Another micro-batch's forward raised: this one stops at its next turn."""


class _TurnTaker:
    """Lets one thread run at a time, the one waiting at the lowest (round, micro-batch).

    A thread waits at its start (round -1) and before each unit call (round c for its c-th
    call); the runnable thread is chosen only when every live thread waits, so the order
    does not depend on the thread scheduler. Once a thread ``fail``s, the others stop at
    their next turn (``_Stopped``): nothing they would compute is used."""

    def __init__(self, num_threads: int) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[int, int] = {}
        self._live = num_threads
        self._running: int | None = None
        self._failed = False

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
            if self._failed:
                raise _Stopped

    def finish(self, m: int, *, failed: bool = False) -> None:
        with self._cond:
            self._failed = self._failed or failed
            if self._running == m:
                self._running = None
            self._waiting.pop(m, None)
            self._live -= 1
            self._pick()


def _boundaries(value: Any, call: _Call, anchors: dict[torch.device, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
        call.edges.append(torch.autograd.graph.get_gradient_edge(value))
        call.grads.append(None)
        call.boundary_ptrs.add((value.device.type, value.data_ptr()))
        anchor = anchors.get(value.device)
        if anchor is None:
            anchor = anchors[value.device] = torch.zeros(
                (), device=value.device, requires_grad=True
            )
        return _Boundary.apply(value.detach(), anchor, call, len(call.grads) - 1)
    if isinstance(value, tuple | list):
        return type(value)(_boundaries(v, call, anchors) for v in value)
    if isinstance(value, dict):
        return {k: _boundaries(v, call, anchors) for k, v in value.items()}
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
        on_thread: called in each micro-batch's thread with its index before its forward,
            and with None after it.
        install_cuts: called at the start of each ``run`` with ``cut``; installs the hooks
            that cut tensors out of their unit calls (``engine.router_logits``) and returns
            their handles, removed when the forwards end.
        offloader: where given, a unit call's boundaries that its graph saves (a
            checkpointed unit's inputs; in fp32, the first norm's input) go to host memory
            through it (pinned on CUDA, D2H at the save and H2D before the unit's
            backward, each with its event: see [Note: offloaded checkpoint boundaries] in
            ``ramflow.activations.boundary_offload``); None: they stay where they are.

    Raises:
        ValueError: at construction, when ``units`` is empty or holds a module twice.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        on_unit_done: Callable[[nn.Module], None] | None = None,
        on_thread: Callable[[int | None], None] | None = None,
        install_cuts: Callable[[Callable], list] | None = None,
        offloader: BoundaryOffloader | None = None,
    ) -> None:
        if not units:
            raise ValueError("UnitMajorStep: give at least one unit module")
        if len({id(u) for u in units}) != len(units):
            raise ValueError("UnitMajorStep: a unit module is listed twice; list each once")
        self.units = list(units)
        self.on_unit_done = on_unit_done
        self.on_thread = on_thread
        self.install_cuts = install_cuts
        self.offloader = offloader
        # per run: the micro-batch of this thread, each micro-batch's unit calls and cuts
        self._local = threading.local()
        self._calls: list[list[_Call]] = []
        self._cuts: list[list[_Cut]] = []

    def cut(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Cut ``tensor``, computed by the unit call now running on this thread, out of the
        graph: for a tensor that reaches the loss other than through the unit's outputs (an
        MoE's router logits, see [Note: the router's auxiliary loss under the unit-major
        step] in ``engine.router_logits``). Use the returned leaf in its place past the
        unit; its gradient goes back into ``tensor`` in the backward pass that runs this
        unit call.

        Args:
            tensor: a floating tensor that requires grad, on any device.

        Returns:
            A detached leaf that requires grad and shares ``tensor``'s storage, or None
            outside a micro-batch's forward of a ``run`` (nothing is cut).
        """
        m = getattr(self._local, "m", None)
        if m is None:
            return None
        leaf = tensor.detach().requires_grad_(True)
        self._cuts[m].append(_Cut(len(self._calls[m]), tensor, leaf))
        return leaf

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
                micro-batches made different unit calls.
            ValueError: a loss is not a scalar tensor that requires grad.
        """
        if not micro_batches:
            raise ValueError("give at least one micro-batch")
        num = len(micro_batches)
        turns = _TurnTaker(num)
        calls: list[list[_Call]] = [[] for _ in range(num)]
        self._calls = calls
        self._cuts = [[] for _ in range(num)]
        losses: list[torch.Tensor | None] = [None] * num
        errors: list[BaseException | None] = [None] * num
        local = self._local
        anchors: dict[torch.device, torch.Tensor] = {}  # See _Boundary
        unit_ids = {id(u) for u in self.units}

        def pre_hook(module, args, kwargs):
            m = getattr(local, "m", None)
            if m is None or id(module) not in unit_ids:
                return None
            turns.wait_turn(m, len(calls[m]))
            call = _Call(module)
            calls[m].append(call)
            return _boundaries(args, call, anchors), _boundaries(kwargs, call, anchors)

        handles = [
            u.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
            for u in self.units
        ]
        if self.install_cuts is not None:
            handles += self.install_cuts(self.cut)

        # autocast, the current CUDA device and stream are thread-local: the caller's carry
        # into every micro-batch's thread
        autocast = [
            (d, torch.get_autocast_dtype(d))
            for d in ("cuda", "cpu")
            if torch.is_autocast_enabled(d)
        ]
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

        def body(m: int) -> None:
            local.m = m
            if self.on_thread is not None:
                self.on_thread(m)
            try:
                turns.wait_turn(m, -1)
                with contextlib.ExitStack() as stack:
                    if stream is not None:
                        stack.enter_context(torch.cuda.device(stream.device))
                        stack.enter_context(torch.cuda.stream(stream))
                    for device_type, dtype in autocast:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype))
                    if self.offloader is not None:
                        stack.enter_context(
                            torch.autograd.graph.saved_tensors_hooks(
                                functools.partial(self._pack, m), self._unpack
                            )
                        )
                    losses[m] = forward(micro_batches[m])
            except _Stopped:
                pass  # an earlier micro-batch raised: its error is the one reported
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                errors[m] = err
            finally:
                local.m = None
                if self.on_thread is not None:
                    self.on_thread(None)
                turns.finish(m, failed=errors[m] is not None)

        threads = [threading.Thread(target=body, args=(m,), daemon=True) for m in range(num)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for h in handles:
                h.remove()
        for m, err in enumerate(errors):
            if isinstance(err, torch.OutOfMemoryError):
                raise err  # as it is: a training loop backs off on it
            if err is not None:
                raise RuntimeError(f"micro-batch {m}'s forward raised: {err}") from err
        for m in range(1, num):
            if [c.unit for c in calls[m]] != [c.unit for c in calls[0]]:
                raise RuntimeError(
                    f"micro-batch {m} called other units than micro-batch 0 (or in another "
                    "order); the unit-major order needs the same unit calls in every "
                    "micro-batch: accumulate such a model with an ordinary loop"
                )
        for m, loss in enumerate(losses):
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError(
                    f"the loss function returned {type(loss).__name__} "
                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''} for "
                    f"micro-batch {m}; it must return a scalar loss tensor that requires grad "
                    "(reduce it, e.g. .mean(), and compute it with gradients enabled)"
                )
        try:
            self._backward(calls, losses, self._cuts)
        except RuntimeError as err:
            if "backward through the graph a second time" not in str(err):
                raise
            raise RuntimeError(
                "a tensor computed inside a unit call reaches the loss, or a later unit, "
                "other than through the unit's outputs (a connection that skips a unit), so "
                "backward would run through that unit before its turn: the unit-major order "
                "cannot run this model. Accumulate with an ordinary loop."
            ) from err
        finally:
            self._calls, self._cuts = [], []
        return [loss.detach() for loss in losses]

    def _pack(self, m: int, tensor: torch.Tensor) -> Any:
        """Micro-batch ``m``'s saved-tensor hook: a boundary of its running unit call goes
        to host memory, any other saved tensor stays where it is, detached (a hook that
        returns a saved output itself makes a reference cycle through its ``grad_fn``
        that only its backward breaks: a graph never run backward, after a forward that
        raised, would keep its device memory)."""
        calls = self._calls[m]
        if (
            calls
            and tensor.numel()
            and (tensor.device.type, tensor.data_ptr()) in calls[-1].boundary_ptrs
        ):
            return self.offloader.pack(tensor)
        return tensor.detach()

    def _unpack(self, packed: Any) -> torch.Tensor:
        return packed if isinstance(packed, torch.Tensor) else self.offloader.unpack(packed)

    def _backward(
        self, calls: list[list[_Call]], losses: list[torch.Tensor], cuts: list[list[_Cut]]
    ) -> None:
        num_rounds = len(calls[0])
        first_call: dict[int, int] = {}  # a unit's first call is the last that backward meets
        for r, c in enumerate(calls[0]):
            first_call.setdefault(id(c.unit), r)
        # the cuts of each micro-batch by the pass that runs their unit call: the one that
        # ends at the next call's leaves (r + 1 calls entered when cut: call r's backward
        # runs in the pass through call r + 1), the loss's pass for the last call's
        cut_at: list[dict[int, list[_Cut]]] = []
        for mine in cuts:
            by_pass: dict[int, list[_Cut]] = {}
            for c in mine:
                by_pass.setdefault(c.calls_entered, []).append(c)
            cut_at.append(by_pass)
        for m, loss in enumerate(losses):
            self._loss_backward(loss, cut_at[m].get(num_rounds, []))
        self._done(calls, num_rounds - 1, first_call)
        for r in range(num_rounds - 1, 0, -1):
            for m in range(len(losses)):
                self._through(calls[m][r], cut_at[m].get(r, []))
            self._done(calls, r - 1, first_call)
        for m in range(len(losses)):  # the first call's inputs: gradients for the caller
            self._through(calls[m][0], cut_at[m].get(0, []))

    @staticmethod
    def _loss_backward(loss: torch.Tensor, cuts: list[_Cut]) -> None:
        """``loss.backward()``, and into the tensors cut in the last unit call (or after
        it), whose leaves' gradients come from this same loss: asked for first, over the
        part of the graph between the loss and those leaves (kept for the full pass)."""
        if not cuts:
            loss.backward()
            return
        grads = torch.autograd.grad(
            loss, [c.leaf for c in cuts], retain_graph=True, allow_unused=True
        )
        pairs = [(c.tensor, g) for c, g in zip(cuts, grads) if g is not None]
        torch.autograd.backward([loss, *(t for t, _ in pairs)], [None, *(g for _, g in pairs)])

    @staticmethod
    def _through(call: _Call, cuts: list[_Cut]) -> None:
        """The backward pass from ``call``'s inputs (its boundaries' gradients), and from
        the tensors cut in the call before it (their leaves' gradients): it runs that
        call's backward and ends at its boundaries."""
        pairs = [(e, g) for e, g in zip(call.edges, call.grads) if g is not None]
        pairs += [(c.tensor, c.leaf.grad) for c in cuts if c.leaf.grad is not None]
        if pairs:
            torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
        call.edges.clear()
        call.grads.clear()
        cuts.clear()

    def _done(self, calls: list[list[_Call]], r: int, first_call: dict[int, int]) -> None:
        unit = calls[0][r].unit
        if self.on_unit_done is not None and first_call[id(unit)] == r:
            self.on_unit_done(unit)


class UnitMajorAccumulation:
    """The unit-major step of one offloaded model: its micro-batches through
    ``UnitMajorStep`` with each unit loaded once per phase and its gradient sent and stepped
    once. See [Note: one weight pass per optimizer step].

    Args:
        units: the engine's unit list (shared; the engine appends to it).
        schedule: the engine's schedule (the order, the pass).
        gradients: the engine's gradient path (held gradients, sent when complete).
        stepper: the engine's stepper (its optimizers and data-parallel state).
    """

    def __init__(
        self, *, units: list[Unit], schedule: Schedule, gradients: GradientPath, stepper: Stepper
    ) -> None:
        self.units = units
        self._schedule = schedule
        self._gradients = gradients
        self._stepper = stepper
        self._offloader: BoundaryOffloader | None = None  # made at the first use

    def run(
        self,
        loss_fn: Callable[[Any], torch.Tensor],
        micro_batches: Sequence[Any],
        *,
        model: nn.Module | None = None,
        boundaries_on_host: bool | None = None,
    ) -> list:
        """Forward and backward of ``micro_batches`` unit-major; see ``ramflow.accumulate``.
        ``model``: what ``loss_fn`` calls; the router logits its MoE layers record are cut
        out of them (see [Note: the router's auxiliary loss under the unit-major step] in
        ``engine.router_logits``). ``boundaries_on_host``: the boundaries the units' graphs
        save go to host memory (``UnitMajorStep``'s ``offloader``); None: on CUDA only.

        Raises:
            TypeError: no ramflow optimizer holds the model's parameters, and a unit
                has trainable ones.
            ValueError: no micro-batches; a loss that is not a scalar; gradients disabled;
                several ranks (data parallel).
            RuntimeError: as ``UnitMajorStep.run``; inside a forward or backward pass.
        """
        # units with nothing to train (a frozen base under LoRA adapters kept on the
        # device, which autograd accumulates as usual) need no ramflow optimizer
        # (read now: PEFT freezes the base after ``offload`` counted its trainable ones)
        if not self._stepper.optimizers and any(
            p.requires_grad for u in self.units for p in u.owned
        ):
            raise TypeError(
                "ramflow.accumulate needs a ramflow optimizer (ramflow.optim.AdamW, ...) built "
                "on the offloaded model's parameters before it is called: it steps each unit "
                "as its gradient is complete"
            )
        if self._stepper.live_dist() is not None:
            raise ValueError(
                "ramflow.accumulate does not support data parallelism yet: accumulate with "
                "an ordinary loop (the non-final micro-batches under opt.no_step())"
            )
        if not torch.is_grad_enabled():
            raise ValueError("ramflow.accumulate trains: call it with gradients enabled")
        if self._schedule.in_pass or in_backward():
            raise RuntimeError("ramflow.accumulate cannot run inside a forward or backward pass")
        if not micro_batches:
            raise ValueError("ramflow.accumulate: give at least one micro-batch")
        units = [u for u in self.units if not u.rest]
        modules = [m for u in units for m in u.modules]
        # a unit's gradient is complete once every module that reads it is done (a unit
        # whose parameters are tied into another unit is read by that unit's modules too)
        readers: dict[Unit, set[int]] = {u: set() for u in units}
        for v in units:
            for d in v.deps:
                readers.setdefault(d, set()).update(id(m) for m in v.modules)
        done: set[int] = set()
        sent: set[Unit] = set()

        def on_module_done(module: nn.Module) -> None:
            done.add(id(module))
            for u, reading in readers.items():
                if u not in sent and reading <= done:
                    sent.add(u)
                    self._gradients.send_held(u)

        routers = RouterLogits(model) if model is not None else None
        if boundaries_on_host is None:
            boundaries_on_host = self._schedule.device.type == "cuda"
        if boundaries_on_host and self._offloader is None:
            self._offloader = BoundaryOffloader()
        step = UnitMajorStep(
            modules,
            on_unit_done=on_module_done,
            on_thread=self._schedule.enter_micro_batch,
            install_cuts=routers.install if routers else None,
            offloader=self._offloader if boundaries_on_host else None,
        )
        self._schedule.begin_unit_major()
        failed = True
        try:
            losses = step.run(loss_fn, micro_batches)
            failed = False
        finally:
            self._schedule.end_unit_major(failed=failed)
        return losses
