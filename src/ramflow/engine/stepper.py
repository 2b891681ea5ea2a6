"""The stepper: when and where each unit is stepped.

Runs what the step policy decides (``engine.step_policy.StepPolicy``: eager during backward or
deferred to ``opt.step()``, loop-pattern errors and their recovery, refused partial steps)
and owns the optimizers attached to the engine, the units' forward positions (the worker's
priorities), the gradient norms and clip coefficients of a pass, and the data-parallel
state (``DataParallel``). It hands each step to the part that runs it: the host stepper
(``engine.host_stepper``, on the worker) or the device stepper (``engine.device_stepper``).

[Note: when the step runs]
The first optimizer step is applied by ``opt.step()`` (deferred). If that step saw exactly
one backward and nobody changed the gradients in between (no clipping, no unscaling; seen
through the gradients' version counters), later backward passes step each unit as soon as
its gradients have landed (eager, see [Note: optimizer overlap]). A loop that changes
pattern afterwards gets a RuntimeError, never a silently wrong step. Deferred steps run on
the worker too: ``opt.step()`` returns at once and each unit's next forward waits for that
unit's step only.

[Note: an optimizer of another model]
The engine holds its optimizers weakly, so one the program has dropped counts until it is
freed, which for one caught in a reference cycle (an ``exec`` namespace, a traceback kept
by ``pytest.raises``, a trainer that refers to itself) is when the garbage collector runs.
The layer engines of ``ramflow.Linear`` also serve every model of the process. So a pass
steps during backward only when the one optimizer trains its first unit: a backward of
another model, or of one whose optimizer was dropped for a plain ``torch.optim`` one or
none, must not become eager on an optimizer that may be garbage (its passes would then
raise "a second backward pass ran before opt.step()", or, had the dropped optimizer held
the model's parameters, step them). A new optimizer collects the garbage before it
attaches, so that a dropped one neither keeps the passes deferred (eager needs one
optimizer) nor keeps its states in memory. What is left: a dropped optimizer, not yet
collected, whose model goes on training without a new ramflow optimizer still steps it
during backward; drop it with ``del opt; gc.collect()``.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Iterable

import torch

from ..units.unit import Unit
from .device_stepper import DeviceStepper
from .grad_norms import PassNorms
from .grad_scale import apply_grad_scale, raise_if_written, scale_for_step
from .host_stepper import HostStepper
from .host_store import HostStore
from .interfaces import DataParallel, StepOptimizer
from .step_policy import StepItem, StepPolicy, step_items
from .window import DeviceWindow
from .worker import STEP, HostWorker


class Stepper:
    """The optimizer steps of one engine's units.

    Args:
        device: the compute device (the gradient norms are read there).
        units: the engine's unit list (shared; the engine appends to it).
        worker: the host worker that runs host steps.
        window: the device window (a unit's host copies are rewritten).
        host: the host store (its gradient format).
        host_steps: the host stepper (the steps on the worker).
        device_steps: the device stepper (the steps of device-stepped units).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        units: list[Unit],
        worker: HostWorker,
        window: DeviceWindow,
        host: HostStore,
        host_steps: HostStepper,
        device_steps: DeviceStepper,
    ) -> None:
        self.device = device
        self.units = units
        self.worker = worker
        self._window = window
        self._host = host
        self._host_steps = host_steps
        self._device_steps = device_steps
        self.dist: DataParallel | None = None
        # forward position of each unit, the priority of its step on the worker
        self._positions: dict[Unit, int] = {}
        self._optimizers: list[weakref.ref[StepOptimizer]] = []
        # when units step, see [Note: when the step runs]; its recovery state, see [Note: a
        # failed backward] in ``ramflow.engine.schedule``
        self.policy = StepPolicy()
        # see [Note: the norm from the device gradients] in ``ramflow.engine.grad_norms``
        self.norms = PassNorms()

    # ------------------------------------------------------------------ optimizers, order

    def attach(self, opt: StepOptimizer) -> None:
        """Step ``opt``'s parameters of this engine (held weakly). An optimizer that is
        garbage but not yet collected is collected first, so that it no longer counts
        (see [Note: an optimizer of another model])."""
        if self.optimizers and opt not in self.optimizers:
            gc.collect()
        if opt not in self.optimizers:
            self._optimizers.append(weakref.ref(opt))
            self.policy.new_optimizer()

    @property
    def optimizers(self) -> list[StepOptimizer]:
        """The live ramflow optimizers holding parameters of this engine (held weakly)."""
        alive = [opt for ref in self._optimizers if (opt := ref()) is not None]
        if len(alive) != len(self._optimizers):
            self._optimizers = [weakref.ref(opt) for opt in alive]
        return alive

    def note_position(self, u: Unit, position: int) -> None:
        """``u``'s place in the forward order (the schedule records it)."""
        self._positions[u] = position

    def priority(self, u: Unit) -> int:
        """Worker priority of ``u``'s step: steps run in forward order."""
        return self._positions.get(u, u.index)

    def live_dist(self) -> DataParallel | None:
        """The distributed state while its process group lives; a destroyed group ends
        data parallelism for this engine (later runs in the process are single ones)."""
        if self.dist is not None and not self.dist.alive():
            self.dist = None
        return self.dist

    def steps_here(self, u: Unit) -> bool:
        """Whether this process steps ``u`` (under ZeRO, only the unit's owner does)."""
        dist = self.live_dist()
        return dist is None or dist.owns(u)

    # ------------------------------------------------------------------ step policy

    def decide_eager(self, u: Unit) -> bool:
        """Whether this backward pass steps units as their gradients land (decided at its
        first dispatched unit, ``u``). See [Note: when the step runs] and [Note: an
        optimizer of another model]."""
        first = self.policy.eager_now is None
        optimizers = self.optimizers
        eager = self.policy.begin_pass(
            optimizers,
            ring=self._host.precision.gradient_format.ring,
            trains_first=first and len(optimizers) == 1 and self._trains(optimizers[0], u),
            holding=first and self.holds_compact(),
        )
        if first:
            self.norms.begin_pass()
        return eager

    def _trains(self, opt: StepOptimizer, u: Unit) -> bool:
        """Whether ``opt`` trains ``u``: it holds one of ``u``'s trainable parameters, or
        (under ZeRO) another rank's optimizer steps ``u``."""
        return not self.steps_here(u) or any(opt.holds(p) for p in u.owned[: u.num_trainable])

    def end_pass(self) -> None:
        """A backward pass finished: count it for the step policy."""
        self.policy.end_pass(self.optimizers)

    def failed_pass(self, *, stepped: Iterable[Unit], partial_grads: bool) -> None:
        """A backward pass raised after it had stepped ``stepped`` (refused until a reload
        or ``accept_partial_step``) and, with ``partial_grads``, added to accumulated
        gradients (refused until ``zero_grad``)."""
        names = {u.name for u in stepped}
        self.policy.failed_pass(
            [u.name for u in self.units if u.name in names], partial_grads=partial_grads
        )

    def zero_grad(self) -> None:
        """``opt.zero_grad()``: the gradients are whole again, and after a loop-pattern
        error the step policy starts afresh (the optimizer's states stay as they are).

        Raises:
            RuntimeError: the last backward pass stepped during backward and no
                ``opt.step()`` followed it: the loop skipped a step that ramflow had
                already applied (a loop-pattern error; a second call goes on).
        """
        self.policy.zero_grad()
        self.norms.invalidate()
        for u in self.units:  # dropped with the gradients
            u.grad_scale = None
            if u.compact_grad is not None:
                u.compact_grad.held = False

    def holds_compact(self) -> bool:
        """Whether some unit holds a gradient in 8-bit codes for its deferred step (see
        [Note: the compact deferred gradient] in ``ramflow.formats.deferred_grad``)."""
        return any(u.compact_grad is not None and u.compact_grad.held for u in self.units)

    def note_clip(self, *, norm_only: bool = False) -> None:
        """Called by ``ramflow.clip_grad_norm_`` before it reads the gradients: they are
        scaled by an earlier clip's coefficient first (``apply_grad_scales``). ``norm_only``:
        the 2-norm is read and the gradients are left as they are, so steps may still run
        during backward. See [Note: the norm from the device gradients] in
        ``ramflow.engine.grad_norms``."""
        self.apply_grad_scales()
        if not norm_only:
            self.policy.note_clip()

    def note_grad_norm(
        self,
        u: Unit,
        grad: torch.Tensor,
        *,
        after: object | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Dispatch of ``u`` in a backward pass: keep the 2-norms of its parameters' flat
        device gradients ``grad`` (``PassNorms.note``); a coefficient of an earlier clip
        goes (fresh gradients) or is applied first (gradients added to)."""
        # gradients held in 8-bit codes leave p.grad None: these add to them
        held = u.compact_grad is not None and u.compact_grad.held
        fresh = not held and all(p.grad is None for p in u.owned[: u.num_trainable])
        if fresh:
            u.grad_scale = None
        elif u.grad_scale is not None:
            self.worker.wait_idle()  # a step that reads them
            apply_grad_scale(u)
        self.norms.note(u, grad, fresh=fresh, after=after, stream=stream)

    def pass_param_norms(self) -> dict[Unit, torch.Tensor] | None:
        """After ``note_clip``: per unit of the last backward pass, the 2-norms of its
        trainable parameters' gradients ((num_trainable,) fp32 on the device, ordered on
        the calling stream), when they are the gradients of this step (see [Note: the norm
        from the device gradients] in ``ramflow.engine.grad_norms``). None: read the host
        gradients, which are complete (a pass that stepped during backward onto gradients
        left from before waits here for its steps, which write them).

        Raises:
            RuntimeError: an eager pass added to gradients left from before, and also gave
                gradients to units that had none, which the optimizer's
                ``keep_grads=False`` leaves out of ``p.grad``.
        """
        if self.policy.last_eager:
            if not self.norms.whole:
                if self.norms.fresh and not all(opt.keep_grads for opt in self.optimizers):
                    raise self.policy.pattern(
                        "the gradient norm was read after a backward pass that added to "
                        "gradients left from before while ramflow stepped during backward, and "
                        "the optimizer was built with keep_grads=False, so p.grad misses the "
                        "units that had none before. Call opt.zero_grad() after each step, or "
                        "use keep_grads=True."
                    )
                self.worker.wait_idle()
                return None
            return self.norms.ready(self.device)
        if not self.norms.whole:
            return None
        kept = set(self.norms.units())
        for u in self.units:
            params = u.owned[: u.num_trainable]
            if u in kept and u.compact_grad is not None and u.compact_grad.held:
                if u.compact_grad.scale is not None:  # clipped already: the device norms are stale
                    return None
                continue
            if u in kept:  # the host gradients are still those that landed
                same = len(u.grad_versions) == len(params) and all(
                    p.grad is v and v._version == version
                    for p, v, version in zip(params, u.host_grad_views, u.grad_versions)
                )
                if not same:
                    return None
            elif any(p.grad is not None for p in params):  # left from before the pass
                return None
        return self.norms.ready(self.device)

    # ------------------------------------------------------------------ the clip's scale

    def apply_grad_scales(self) -> None:
        """Every unit's pending clip coefficient applied to its host gradients, once the
        steps that read them are done (``synchronize``, a clip). See [Note: folding the
        clip into the step] in ``ramflow.engine.grad_scale``."""
        pending = [u for u in self.units if u.grad_scale is not None]
        if pending:
            self.worker.wait_idle()
        for u in pending:
            apply_grad_scale(u)

    def _take_grad_scale(self, u: Unit, items: list[StepItem], *, flat: bool) -> float:
        """At ``opt.step()``: the clip coefficient ``u``'s step applies (1.0: none), or,
        where the step is not ``flat`` (one flat step of the whole unit) or a gradient was
        written since the clip, 1.0 with the gradients scaled in place first (``items``
        captured again)."""
        scale = scale_for_step(u, items[0].grads, flat=flat)
        if scale is None:
            apply_grad_scale(u)
            items[:] = step_items(u, [item.optimizer for item in items])  # new versions
            return 1.0
        return scale

    def schedule_step(self, opt: StepOptimizer) -> None:
        """``opt.step()`` (the last backward pass settled): check or schedule the step of
        every unit ``opt`` holds."""
        self.worker.raise_error()
        modified = self._grads_modified(opt)
        if self.policy.check_step(opt.hyperparameters(), modified=modified):
            for u in self.units:  # before any unit is stepped
                raise_if_written(u)
            for u in sorted(self.units, key=self.priority):
                if not self.steps_here(u):
                    continue
                if u.compact_grad is not None and u.compact_grad.held:
                    self._step_compact(u, opt)
                    continue
                items = step_items(u, [opt])
                if items:
                    self.step_from_host(u, items)
            self._device_steps.wait_host_grad_reads()
            if self.policy.final_backwards == 0:
                # no backward since the last step (step() twice, gradients set by hand): the
                # next backward's gradients would land in the buffers this step still reads
                self.worker.wait_idle()
        self.policy.after_step(opt, modified=modified)

    def _grads_modified(self, opt: StepOptimizer) -> bool:
        for u in self.units:
            params = u.owned[: u.num_trainable]
            if not u.grad_versions:
                continue
            for p, view, version in zip(params, u.host_grad_views, u.grad_versions):
                if p.grad is None or not opt.holds(p):
                    continue
                if p.grad is not view or p.grad._version != version:
                    return True
        return False

    # ------------------------------------------------------------------ host or device

    def _step_compact(self, u: Unit, opt: StepOptimizer) -> None:
        """Schedule ``u``'s step from its compact gradient on the worker (the gradient
        taken now: a ``zero_grad`` right after ``step()`` does not drop it). See [Note: the
        compact deferred gradient] in ``ramflow.formats.deferred_grad``."""
        grad = u.compact_grad
        grad.held = False
        self._device_steps.drop_state(u)
        self._window.begin_host_write([u])
        self.worker.submit(
            STEP,
            self.priority(u),
            functools.partial(self._host_steps.step_compact, u, grad, opt, opt.hyperparameters()),
        )

    def step_from_host(self, u: Unit, items: list[StepItem]) -> None:
        """Step ``u`` from its host gradients: on the device if it is stepped there and one
        optimizer steps it whole, else on the worker (a device-stepped unit then gives its
        state back to the host first, and uploads it again at its next device step)."""
        if not items:
            return
        device = self._device_steps
        if (
            len(items) == 1
            and device.steppable(u, items[0].optimizer)
            and self.steps_here(u)
            and items[0].all_host_grads(u)
        ):
            assert u.host_grad is not None
            scale = self._take_grad_scale(u, items, flat=True)
            device.step(
                u,
                items[0].optimizer,
                items[0].hyper,
                u.host_grad,
                grad_scale=scale,
                write_back=self.live_dist() is not None,
            )
            return
        scale = self._take_grad_scale(u, items, flat=len(items) == 1 and items[0].whole_unit(u))
        device.drop_state(u)
        self._window.begin_host_write([u])
        self.worker.submit(
            STEP,
            self.priority(u),
            functools.partial(self._host_steps.step_unit, u, items, grad_scale=scale),
        )
