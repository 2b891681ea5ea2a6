"""The gradient path: device gradient buffers, their D2H copies and landing on the host.

Owns the hooks on the device parameters, each unit's flat device gradient buffer, the
throttle on buffers in flight (the plan's two), the landings on the worker (adding the
staged gradients into the fp32 host gradients, or handing them to a fused step), and what
the running backward pass has landed and stepped, so that a failed pass can be undone
(``abort_pass``, see [Note: a failed backward] in ``ramflow.engine.schedule``).
"""

from __future__ import annotations

import functools
from collections import deque
from concurrent.futures import Future

import torch
from torch import nn

from ..formats.deferred_grad import CompactGradient
from ..transfer.streams import CopyStreams
from ..units.unit import Unit
from .device_stepper import DeviceStepper
from .hooks import UnitHook
from .host_stepper import HostStepper
from .host_store import HostStore
from .step_policy import step_items
from .stepper import Stepper
from .window import DeviceWindow
from .worker import LAND, STEP, HostWorker


class GradientPath:
    """The gradients of one engine's units, from autograd to the host.

    Args:
        device: the compute device.
        wire_dtype: dtype of the device gradient buffers and the staging buffers.
        units: the engine's unit list (shared; the engine appends to it).
        streams: the copy streams of ``device``.
        worker: the host worker that lands gradients.
        window: the device window (versions of units stepped as they land).
        host: the host store (staging buffers).
        stepper: decides and runs the steps that follow a landing.
        host_steps: runs the steps on the worker that follow a landing.
        device_steps: steps device-stepped units as their gradients are complete.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        units: list[Unit],
        streams: CopyStreams,
        worker: HostWorker,
        window: DeviceWindow,
        host: HostStore,
        stepper: Stepper,
        host_steps: HostStepper,
        device_steps: DeviceStepper,
    ) -> None:
        self.device = device
        self.wire_dtype = wire_dtype
        self.units = units
        self.streams = streams
        self.worker = worker
        self._window = window
        self._host = host
        self._stepper = stepper
        self._host_steps = host_steps
        self._device_steps = device_steps
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._pass_open = False  # a backward pass has started and not ended
        self._landing: list[Future] = []
        self._grads_in_flight: deque[torch.cuda.Event | None] = deque()
        self._pass_landed: list[tuple[Unit, bool]] = []  # (unit, gradients were fresh)
        self._pass_stepped: list[Unit] = []
        # a unit-major step: gradients add up on the device until ``send_held``, see
        # [Note: one weight pass per optimizer step] in ``ramflow.engine.unit_major``
        self.hold = False

    def install_hooks(self, units: list[Unit]) -> None:
        """A post-accumulate hook on every trainable device parameter of ``units``."""
        for u in units:
            for k, (dp, p) in enumerate(zip(u.device_params, u.owned)):
                if p.requires_grad:
                    self._hooks.append(
                        dp.register_post_accumulate_grad_hook(UnitHook(self.on_grad, u.index, k))
                    )

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def open_pass(self) -> None:
        """A backward pass runs (its first gradient or pin): it must be ended or undone."""
        self._pass_open = True

    @property
    def pass_open(self) -> bool:
        """Whether a backward pass started and was neither ended nor undone."""
        return self._pass_open

    # ------------------------------------------------------------------ to the host

    def on_grad(self, u: Unit, k: int, dparam: nn.Parameter) -> None:
        """Post-accumulate hook of device parameter ``k`` of ``u``: into the flat buffer."""
        self._pass_open = True
        if u.device_grad is None:
            while len(self._grads_in_flight) >= 2:  # the plan's two gradient buffers
                done = self._grads_in_flight.popleft()
                if done is not None:
                    self._wait_collective(done, "waiting for an earlier unit's gradients")
            u.device_grad = torch.zeros(
                u.trainable_numel, dtype=self.wire_dtype, device=self.device
            )
        off = u.offsets[k]
        into = u.device_grad[off : off + dparam.numel()].view(dparam.shape)
        if self.hold:  # the micro-batches' gradients sum here, in micro-batch order
            into.add_(dparam.grad)
        else:
            into.copy_(dparam.grad)
        dparam.grad = None
        u.fired += 1
        if u.fired == u.num_trainable and not self.hold:
            self.dispatch(u)

    def send_held(self, u: Unit) -> None:
        """A unit-major step: ``u``'s gradients are complete (every micro-batch's backward
        has passed every call that reads it): one D2H copy, and its step if eager."""
        if u.fired:
            self.dispatch(u)

    def dispatch(self, u: Unit) -> None:
        """One D2H copy of ``u``'s gradients, then landing (and maybe the step) on the worker."""
        stepper = self._stepper
        eager = stepper.decide_eager(u)
        if u.dispatched_this_backward and eager:
            raise stepper.policy.pattern(
                f"unit {u.name!r} received gradients twice in one backward pass (a unit called "
                "in two reentrant checkpoint regions), so its step cannot run during backward. "
                "Construct the ramflow optimizer with overlap=False."
            )
        u.dispatched_this_backward = True
        reduced = None
        dist = stepper.live_dist()
        if dist is not None:  # data parallel: sum (or average) over ranks first
            reduced = dist.reduce_gradients(u, u.device_grad)
            if not dist.keeps_gradients(u):  # ZeRO-2: another rank steps this unit
                self._grads_in_flight.append(self.streams.retire(u.device_grad, after=reduced))
                u.device_grad = None
                u.fired = 0
                return
        # its parameters' norms, see [Note: the norm from the device gradients] in _grad_norms
        side = self.streams.d2h_stream if reduced is not None and self.streams.is_cuda else None
        stepper.note_grad_norm(u, u.device_grad, after=reduced, stream=side)
        if eager and u.device_stepped and stepper.steps_here(u):
            eager = False  # no host step follows: the gradients only land (if kept)
            params = u.owned[: u.num_trainable]
            optimizers = stepper.optimizers
            if (
                len(optimizers) == 1
                and self._device_steps.steppable(u, optimizers[0])
                and all(p.grad is None for p in params)
            ):
                opt = optimizers[0]
                hyper = opt.hyperparameters()
                on_side_stream = self._device_steps.step(
                    u, opt, hyper, u.device_grad, after=reduced, write_back=dist is not None
                )
                if on_side_stream:
                    # its own stream holds the gradient buffer: count it in the throttle
                    self._grads_in_flight.append(u.device_step_event)
                self._pass_stepped.append(u)
                if not opt.keep_grads:
                    u.device_grad = None
                    u.fired = 0
                    u.grad_versions = []
                    return
            else:  # accumulated on the host: stepped from there at the end of backward
                u.device_step_pending = True
        for reader in (u.land_future, u.staging_reader):
            if reader is not None and not reader.done():
                reader.result()  # the staging buffer is still being read
        u.staging_reader = None
        staging = self._host.staging(u)
        with torch.profiler.record_function(f"ramflow.d2h_grads:{u.name}"):
            event = self.streams.d2h(staging, u.device_grad, after=reduced)
        self._grads_in_flight.append(event)
        u.device_grad = None
        u.fired = 0
        eager = eager and stepper.steps_here(u)
        if eager:
            self._window.begin_host_write([u])
        u.land_future = self.worker.submit(
            LAND,
            len(self._landing),
            functools.partial(self.land, u, event, eager),
            ready=None if event is None else event.query,
        )
        self._landing.append(u.land_future)

    def _wait_collective(self, event: torch.cuda.Event, what: str) -> None:
        """Wait for a device event that may follow a gradient reduction: through the
        data-parallel state when there is one (See [Note: a rank that dies] in
        ``ramflow.distributed.zero``), else plainly."""
        dist = self._stepper.live_dist()
        if dist is None:
            event.synchronize()
        else:
            dist.wait_event(event, what)

    def land(self, u: Unit, event: torch.cuda.Event | None, eager: bool) -> None:
        """Worker: add the staged gradients into the fp32 host gradients of ``u``.

        When the step follows at once and one optimizer steps the whole unit in one pass
        (``flat_runs``: any param groups, one step count), landing is folded into that pass:
        the kernel reads the staged gradients and writes the fp32 gradients (``p.grad``) as
        it steps. ``p.grad`` points at them already, so a change by the user is still seen
        by the version check; their contents are complete once the step is
        (``ramflow.synchronize``)."""
        stepper = self._stepper
        if event is not None:
            self._wait_collective(event, f"landing the gradients of unit {u.name!r}")
        params = u.owned[: u.num_trainable]
        staging = u.staging
        assert staging is not None
        held = u.compact_grad is not None and u.compact_grad.held
        if held and (eager or not self._holds_compact(u)):
            self._expand_compact(u)  # accumulated from here in the master's dtype
            held = False
        fresh = all(p.grad is None for p in params)
        if held or (fresh and not eager and self._holds_compact(u)):
            if held:  # gradient accumulation: a second backward before the step
                u.compact_grad.accumulate(staging)
            else:
                state = self._stepper.optimizers[0].state.get(params[0])
                step = int(state["step"]) if state and "step" in state else 0
                u.compact_grad.encode(staging, step=step)
            u.host_grad = None  # a full buffer of earlier steps is not needed any more
            u.host_grad_views = []
            u.grad_versions = []
            self._host.release_staging(u)
            self._pass_landed.append((u, True))
            return
        ours = (
            not fresh
            and u.host_grad is not None
            and all(p.grad is v for p, v in zip(params, u.host_grad_views))
        )
        optimizers = stepper.optimizers
        fused = (
            eager
            and stepper.steps_here(u)
            and (fresh or ours)
            and len(optimizers) == 1
            and optimizers[0].flat_runs(u) is not None
        )
        # the optimizer's keep_grads=False, or the gradient ring: the fused step does not
        # write p.grad at all (see [Note: the gradient ring] in ``ramflow.engine.host_store``)
        ring = self._host.precision.gradient_format.ring
        drop = fused and fresh and (ring or not optimizers[0].keep_grads)
        if drop and ring:
            u.host_grad = None  # the full buffer of earlier steps is not needed any more
            u.host_grad_views = []
        elif u.host_grad is None:
            u.host_grad = self._host.host_gradients(u, pinned=u.device_stepped)
            u.host_grad_views = u.views(u.host_grad, trainable_only=True)
        self._device_steps.wait_host_grad_read(u)  # a device step's upload of the last ones
        with torch.no_grad():
            if fused:
                pass  # See the docstring: the step writes the gradients.
            elif fresh:
                u.host_grad.copy_(staging)
            elif ours:
                u.host_grad.add_(staging)
            else:
                for p, view, s in zip(
                    params, u.host_grad_views, u.views(staging, trainable_only=True)
                ):
                    if p.grad is None:
                        view.copy_(s)
                        p.grad = view
                    else:
                        p.grad.add_(s)
            if fresh and not drop:
                for p, view in zip(params, u.host_grad_views):
                    p.grad = view
        u.grad_versions = [] if drop else [p.grad._version for p in params]
        if not fused:
            self._host.release_staging(u)  # read into the host gradients
        self._pass_landed.append((u, fresh))
        if fused or (eager and stepper.steps_here(u)):
            self._pass_stepped.append(u)
        if fused:
            opt = optimizers[0]
            u.staging_reader = self.worker.submit(
                STEP,
                stepper.priority(u),
                functools.partial(
                    self._host_steps.step_staged,
                    u,
                    opt,
                    opt.hyperparameters(),
                    accumulate=ours,
                    keep_grads=not drop,
                ),
            )
        elif eager and stepper.steps_here(u):
            self.worker.submit(
                STEP,
                stepper.priority(u),
                functools.partial(self._host_steps.step_unit, u, step_items(u, optimizers)),
            )

    def _holds_compact(self, u: Unit) -> bool:
        """Worker, at the landing of fresh gradients of ``u`` in a pass that does not step
        during backward: whether they are held in 8-bit codes until ``opt.step()``
        (making ``u.compact_grad`` at its first use). Where the host formats allow it
        (``HostPrecision.compact_deferred``), the one optimizer steps the whole unit flat
        and keeps no gradients (``keep_grads=False``), for a unit this process steps on
        the host, without data parallelism. Later passes before the step (gradient
        accumulation, under ``no_step`` or not) add to the codes. See [Note: the compact deferred gradient] in
        ``ramflow.formats.deferred_grad``."""
        stepper = self._stepper
        optimizers = stepper.optimizers
        if not (
            self._host.precision.compact_deferred
            and len(optimizers) == 1
            and not optimizers[0].keep_grads
            and optimizers[0].flat_runs(u) is not None
            and not u.device_stepped
            and stepper.live_dist() is None
        ):
            return False
        if u.compact_grad is None:
            u.compact_grad = CompactGradient(u.trainable_numel, seed=u.rounding_seed)
        return True

    def _expand_compact(self, u: Unit) -> None:
        """Worker: ``u``'s held compact gradient becomes its host gradient in the master's
        dtype (``p.grad``), which the landing then adds to: a pass that steps during
        backward, or a settings change since (another optimizer), cannot add to codes."""
        compact = u.compact_grad
        if u.host_grad is None:
            u.host_grad = self._host.host_gradients(u, pinned=False)
            u.host_grad_views = u.views(u.host_grad, trainable_only=True)
        compact.decode_into(u.host_grad)
        compact.held = False
        for p, view in zip(u.owned[: u.num_trainable], u.host_grad_views):
            p.grad = view

    # ------------------------------------------------------------------ end of a pass

    def finish_pass(self) -> None:
        """End of a backward pass (its units released): send leftover gradients, wait until
        every gradient has landed in the host gradients (so ``p.grad`` is complete), and
        step the device-stepped units whose gradients were accumulated on the host."""
        stepper = self._stepper
        self.hold = False
        for u in self.units:
            if u.fired:
                self.dispatch(u)
            u.dispatched_this_backward = False
        landing, self._landing = self._landing, []
        for fut in landing:
            fut.result()
        for u in self.units:
            if u.device_step_pending:
                u.device_step_pending = False
                stepper.step_from_host(u, step_items(u, stepper.optimizers))
        self._device_steps.wait_host_grad_reads()
        self._pass_open = False
        self._pass_landed.clear()
        self._pass_stepped.clear()

    def abort_pass(self) -> tuple[BaseException | None, list[Unit], bool]:
        """Undo what a backward pass that raised left (its units released): drop the device
        gradients of units whose backward had not finished, wait for the landings and the
        steps they started, and drop the gradients that landed where there were none.

        Returns:
            the first error of a landing or a step (to raise after the clean-up), the units
            the pass stepped, and whether it added to gradients accumulated before it.
        """
        self.hold = False
        for u in self.units:
            u.device_grad = None  # gradients of units whose backward had not finished
            u.fired = 0
            u.dispatched_this_backward = False
            u.device_step_pending = False
        landing, self._landing = self._landing, []
        error: BaseException | None = None
        for fut in landing:
            try:
                fut.result()
            except BaseException as err:  # noqa: BLE001 - returned, raised after clean-up
                error = error or err
        try:
            self.worker.wait_idle()  # the steps the landings started
        except RuntimeError as err:
            error = error or err
        self._grads_in_flight.clear()
        for u in self.units:
            self._host.release_staging(u)  # nothing reads them any more
        partial_grads = False
        for u, fresh in self._pass_landed:
            if fresh:  # nothing was accumulated before this pass: drop what it left
                for p in u.owned[: u.num_trainable]:
                    p.grad = None
                if u.compact_grad is not None:
                    u.compact_grad.held = False
            else:
                partial_grads = True
            u.grad_versions = []
        stepped = list(self._pass_stepped)
        self._pass_landed.clear()
        self._pass_stepped.clear()
        self._pass_open = False
        return error, stepped, partial_grads
