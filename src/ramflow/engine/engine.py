"""The streaming engine: the coordinator of one offloaded model's parts.

An ``Engine`` builds its parts and hands each the peers it calls (docs/design.md has the
picture): the host store (``engine.host``), the device window (``engine.window``), the
stepper (``engine.stepper``), the gradient path (``engine.gradients``), the schedule
(``engine.schedule``), the unit-major step (``engine.unit_major``) and the hooks on the
user's modules (``engine.hooks``,
``ramflow.engine.model_hooks``). It adds units and keeps their plan (made by
``ramflow.planner.unit_plan``). Callers outside (``ramflow.optim``, ``ramflow.api``,
``ramflow.distributed``, ``ramflow.layers.linear``) call a part directly for what one part
does, and the methods below for what crosses parts, in the order each part's Notes require.
Its lifetime is ``ramflow.units.registry``'s.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..activations.checkpointing import CheckpointPolicyLike
from ..formats.frozen import raise_if_trained
from ..kernels.lean_kernels import warm_up_device_step
from ..planner.plan import OffloadPlan
from ..planner.unit_plan import (
    DeviceOptimizerChoice,
    complete_plan,
    device_optimizer_refusal,
    plan_units,
    with_deferred_gradients,
)
from ..transfer.streams import CopyStreams, unpin
from ..units.registry import live_engines, set_engine_of_model, set_engine_of_param
from ..units.unit import Unit, UnitSpec, refuse_copy
from .adapters import DeviceParameters, device_bytes, materialize_meta_adapters
from .checkpointer import ActivationCheckpointer
from .clip import install_clip_route
from .device_stepper import DeviceStepper
from .expert_loading import RoutedExperts
from .gradients import GradientPath
from .host_stepper import HostStepper
from .host_store import FillMaster, HostStore, PackedSource, optimizer_state_bytes
from .interfaces import StepOptimizer
from .model_hooks import ModelHooks
from .options import EngineOptions
from .plain_optim import install_optimizer_hooks
from .schedule import Schedule
from .stepper import Stepper
from .unit_major import UnitMajorAccumulation
from .window import DeviceWindow
from .worker import HostWorker


@atexit.register
def _drain_at_exit() -> None:
    """Let optimizer steps in flight finish before the interpreter tears torch down under
    the worker thread (which aborts the process)."""
    for engine in live_engines():
        try:
            engine.worker.wait_idle()
        except RuntimeError:
            pass  # the error was the user's to see earlier; exiting anyway
        engine.worker.stop()


def _release_engine(worker: HostWorker | None, pinned: list[torch.Tensor]) -> None:
    """Finalizer of an engine (see [Note: lifetime] in ``ramflow.units.registry``): stop the
    worker thread it owned and unpin what it page-locked. Holds no reference to the engine."""
    if worker is not None:
        worker.stop()
    for t in pinned:
        unpin(t)
    pinned.clear()


class Engine:
    """Owns one offloaded model: its units, their plan and the parts that move and step
    them.

    Built by ``ramflow.offload`` (and ``ramflow.layers.linear`` for a layer engine).

    Args:
        model: the root module; None for a layer engine (no root module: units join one by
            one with ``add_units``, worker and streams are shared per device).
        specs: the units, in module order (``ramflow.units.unit.find_units``); their
            parameters are on the CPU (or meta, with ``fill``).
        options: the settings (``EngineOptions``).
        fill: writes the values of parameters built on the meta device into their masters
            (``HostStore.build``); None: the parameters hold their values.
        packed: a checkpoint's packed MXFP4 pairs of parameters (``HostStore.build``).
        on_device: parameters kept on the device, out of the units (LoRA adapters; see
            [Note: adapters on the device] in ``ramflow.engine.adapters``).
        worker: the host worker thread to share (layer engines); None: a new one, stopped
            with the engine.
        streams: the copy streams to share; None: new ones.

    Raises:
        MemoryError: the host lacks the RAM for the host store.
        ValueError: ``options.gpu_memory_bytes`` is too small (the message gives the
            smallest that works); the activation checkpointing cannot apply to the model
            (the model is given back as it was).
    """

    def __init__(
        self,
        model: nn.Module | None,
        specs: list[UnitSpec],
        options: EngineOptions,
        *,
        fill: FillMaster | None = None,
        packed: PackedSource | None = None,
        on_device: Iterable[nn.Parameter] = (),
        worker: HostWorker | None = None,
        streams: CopyStreams | None = None,
    ) -> None:
        # The model owns the engine, never the other way round: see [Note: lifetime].
        self._model_ref = None if model is None else weakref.ref(model)
        self._layer_engine = model is None
        self.options = options
        device, wire_dtype = options.device, options.wire_dtype
        self.device = device
        self.wire_dtype = wire_dtype
        self._device_optimizer = DeviceOptimizerChoice(
            forced=options.device_optimizer,
            reason=options.device_optimizer_reason,
            owners=options.owners,
            rank=options.rank,
        )
        self.streams = streams if streams is not None else CopyStreams(device)
        self.worker = worker if worker is not None else HostWorker(device)
        self._owns_worker = worker is None
        # fixed device bytes: buffers stay on the device (tiny, and BatchNorm-style running
        # statistics are updated in forward); so do adapters, see [Note: adapters on the device]
        self._buffer_bytes = (
            0 if model is None else sum(b.numel() * b.element_size() for b in model.buffers())
        )
        self.adapters = DeviceParameters(device)
        if model is not None:  # PEFT applied on the meta device: see the function
            on_device = materialize_meta_adapters(model, list(on_device), device)
        self.adapters.adopt(on_device)
        self.units: list[Unit] = []
        self._unit_of_param: dict[int, Unit] = {}
        # the parts, each given the peers it calls (no cycle: see docs/design.md)
        self.window = DeviceWindow(
            device=device,
            wire_dtype=wire_dtype,
            streams=self.streams,
            worker=self.worker,
            routed_experts=options.routed_experts,
        )
        self.routed_experts = RoutedExperts(window=self.window)
        self.host = HostStore(
            device=device,
            wire_dtype=wire_dtype,
            window=self.window,
            precision=options.host_precision,
        )
        self.device_stepper = DeviceStepper(
            device=device,
            units=self.units,
            window=self.window,
            host=self.host,
            streams=self.streams,
        )
        self.host_stepper = HostStepper(worker=self.worker, window=self.window, host=self.host)
        self.stepper = Stepper(
            device=device,
            units=self.units,
            worker=self.worker,
            window=self.window,
            host=self.host,
            host_steps=self.host_stepper,
            device_steps=self.device_stepper,
        )
        self.gradients = GradientPath(
            device=device,
            wire_dtype=wire_dtype,
            units=self.units,
            streams=self.streams,
            worker=self.worker,
            window=self.window,
            host=self.host,
            stepper=self.stepper,
            host_steps=self.host_stepper,
            device_steps=self.device_stepper,
        )
        self.schedule = Schedule(
            device=device,
            wire_dtype=wire_dtype,
            prefetch_depth=options.prefetch_depth,
            layer_engine=self._layer_engine,
            units=self.units,
            worker=self.worker,
            window=self.window,
            gradients=self.gradients,
            stepper=self.stepper,
        )
        self.checkpointer = ActivationCheckpointer(units=self.units, window=self.window)
        self.unit_major = UnitMajorAccumulation(
            units=self.units, schedule=self.schedule, gradients=self.gradients, stepper=self.stepper
        )
        self.hooks = ModelHooks(self)

        install_optimizer_hooks()
        install_clip_route()
        self._finalizer = weakref.finalize(
            self,
            _release_engine,
            self.worker if self._owns_worker else None,
            self.host.pinned_in_place,
        )
        try:
            self.add_units(specs, fill=fill, packed=packed)
        except BaseException:
            self.adapters.give_back()
            raise
        self._warm_up_device_step()
        if model is not None:
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.device != self.device:
                        module._buffers[name] = buf.to(self.device)
            self.schedule.install_root_hooks(model)
            self.hooks.install_root(model)  # after the schedule's: its pre-hook runs first
            if options.activation_checkpointing:
                try:
                    self.checkpointer.checkpoint_units(model, options.activation_checkpointing)
                except ValueError:
                    self.remove()  # the model is given back as it was
                    raise
            set_engine_of_model(model, self)

    @property
    def model(self) -> nn.Module | None:
        """The root module (None for a layer engine or once the model is gone)."""
        return None if self._model_ref is None else self._model_ref()

    def add_units(
        self,
        specs: list[UnitSpec],
        *,
        fill: FillMaster | None = None,
        packed: PackedSource | None = None,
    ) -> list[Unit]:
        """Build the host store, device views and hooks of new units and plan again.

        Called once by the constructor, and by ``ramflow.Linear`` for each layer that joins
        a layer engine. ``fill``, ``packed``: see ``HostStore.build``. Raises MemoryError (host RAM) or
        ValueError (GPU budget)."""
        owners = self.options.owners
        new = [
            Unit(len(self.units) + i, s, frozen_format=self.options.frozen_format)
            for i, s in enumerate(specs)
        ]
        if owners is not None:
            for u in new:
                u.owner = owners[u.index]
        self.host.check_memory(new)
        all_units = self.units + new
        plan = self._plan_units(all_units)
        if self.units and set(plan.resident) != {u.name for u in self.units if u.resident}:
            raise ValueError("adding units would change which units are resident")
        self._keep_plan(plan, all_units)
        plan = self.plan
        resident = set(plan.resident)
        for u in new:
            u.resident = u.name in resident
            u.device_stepped = u.name in plan.device_stepped
            for p in u.owned:
                self._unit_of_param[id(p)] = u
            self.stepper.note_position(u, u.index)
        self.units.extend(new)
        self.host.build(new, fill=fill, packed=packed)
        self.window.build(new, specs, self._unit_of_param)
        self.gradients.install_hooks(new)
        self.window.set_capacity(plan.window_bytes)
        for u in new:
            if u.resident:
                self.window.load_resident(u)
        self.schedule.add_units(new)
        if self.options.routed_experts:
            self.routed_experts.add_units(new)
        else:
            self.routed_experts.count_units(new)
        self.hooks.install_compressed(new, specs)
        if self._layer_engine:  # a layer: its own state dict is the way in and out
            for u in new:
                for m in u.modules:
                    self.hooks.install_state_dict(m, before_load=False)
        for u in new:
            for p in u.owned:
                set_engine_of_param(p, self)
        return new

    def replan(self, new: list[nn.Parameter]) -> None:
        """Plan again after units were frozen or parameters joined the model
        (``ModelHooks.adopt_changes``, engine idle): ``new`` moves to the device and stays.

        Raises:
            ValueError: ``new`` does not fit in ``gpu_memory`` beside the units the plan
                keeps resident (nothing changes).
        """
        plan = self._plan_units(self.units, extra_bytes=device_bytes(new))
        if plan.resident != self.plan.resident:
            raise ValueError(
                f"{len(new)} parameters were added to the model after ramflow.offload "
                f"({device_bytes(new) / 2**20:.1f} MiB on the device with gradients and AdamW "
                "states), more than its gpu_memory leaves beside the units it keeps resident: "
                "add them before ramflow.offload (e.g. peft.get_peft_model first), or give a "
                "larger gpu_memory"
            )
        self.adapters.adopt(new)
        self._keep_plan(plan, self.units)
        self.window.set_capacity(plan.window_bytes)

    def _plan_units(self, units: list[Unit], *, extra_bytes: int = 0) -> OffloadPlan:
        """The device plan of ``units`` with ``extra_bytes`` more kept on the device
        (raises ValueError when the budget is too small)."""
        o = self.options
        return plan_units(
            units,
            device=self.device,
            wire_dtype=self.wire_dtype,
            gpu_memory_bytes=o.gpu_memory_bytes,
            prefetch_depth=o.prefetch_depth,
            fixed_bytes=self._buffer_bytes + self.adapters.nbytes + extra_bytes,
        )

    def _keep_plan(self, plan: OffloadPlan, units: list[Unit]) -> None:
        """Complete ``plan`` (of ``units``) with the host formats and the device optimizer,
        and keep it as ``self.plan``."""
        o, precision = self.options, self.host.precision
        refusal = device_optimizer_refusal(
            device=self.device,
            gpu_memory_bytes=o.gpu_memory_bytes,
            trainable_on_device=any(p.requires_grad for p in self.adapters.params),
            precision=precision,
        )
        self.plan: OffloadPlan = complete_plan(
            plan,
            units,
            wire_dtype=self.wire_dtype,
            precision=precision,
            precision_reason=o.host_precision_reason,
            host_bytes=self.host.store_bytes(units) + optimizer_state_bytes(units, precision),
            frozen_format=o.frozen_format,
            device_optimizer=self._device_optimizer,
            refusal=refusal,
        )

    def raise_if_trained(self) -> None:
        """Raise RuntimeError if a compressed weight was made trainable after offload."""
        for u in self.units:
            raise_if_trained(u.compressed, u.frozen_format)

    def _warm_up_device_step(self) -> None:
        """Compile the lean device step's Triton kernel now when the plan steps units on
        the device, not inside the first step (see [Note: building before the first
        step] in ``ramflow.kernels.cpu_kernels``)."""
        precision = self.host.precision
        if not self.plan.device_stepped or precision.is_exact:
            return
        warm_up_device_step(
            self.device,
            master_dtype=precision.master_format.dtype,
            state_dtype=precision.state_format.kernel_dtype,
            compensated=precision.master_format.compensated,
        )

    def prepare_first_step(self) -> None:
        """Make now the host buffers the first backward would make: the gradient ring's,
        one per unit whose gradients this process lands on the host (under ZeRO-2, the
        units it owns; not those stepped on the device), up to the ring's size. Call it
        once the distributed state is set. See [Note: states made before the first step]
        in ``ramflow.optim.unit_states``."""
        dist = self.stepper.dist
        landed = sum(
            1
            for u in self.units
            if u.num_trainable
            and not u.device_stepped
            and (dist is None or dist.keeps_gradients(u))
        )
        self.host.make_ring(landed)

    def __deepcopy__(self, memo: dict) -> Engine:
        refuse_copy()

    def __reduce__(self) -> Any:
        refuse_copy()

    # ------------------------------------------------------------------ the optimizer's calls

    def attach(self, opt: StepOptimizer) -> None:
        """``opt`` holds parameters of this engine: the stepper steps them with it, and the
        plan counts the deferred gradients it makes (``with_deferred_gradients``): none
        where every pass steps during backward (see ``StepPolicy._eager_from_the_start``)."""
        self.schedule.settle()
        self.stepper.attach(opt)
        self.plan = with_deferred_gradients(
            self.plan,
            self.units,
            wire_dtype=self.wire_dtype,
            precision=self.host.precision,
            kept_grads=opt.keep_grads,
            eager_from_start=opt.overlap and not opt.keep_grads and not opt.clips,
        )

    def unit_of(self, p: torch.Tensor) -> Unit | None:
        """The unit that holds ``p`` (None: not a unit's parameter, e.g. kept on the device)."""
        return self._unit_of_param.get(id(p))

    def schedule_step(self, opt: StepOptimizer) -> None:
        """Called by ``opt.step()``: check or schedule the step of every unit it holds."""
        self.schedule.settle()
        self.raise_if_trained()
        self.stepper.schedule_step(opt)
        dist = self.stepper.live_dist()
        if dist is not None:
            dist.after_step(self)

    def on_zero_grad(self) -> None:
        """Called by ``opt.zero_grad()`` (and the root's ``zero_grad``) before gradients are
        cleared: nothing from the last backward lands afterwards, and after a loop-pattern
        error the step policy starts afresh (the optimizer's states stay as they are)."""
        self.schedule.settle()
        self.stepper.zero_grad()

    def note_clip(self, *, norm_only: bool = False) -> None:
        """Called by ``ramflow.clip_grad_norm_`` before it reads the gradients (see
        ``Stepper.note_clip``)."""
        self.schedule.settle()
        self.stepper.note_clip(norm_only=norm_only)

    def partly_stepped(self) -> list[str]:
        """The units that a failed backward stepped before it raised, in order (empty:
        none, the step may run again). See [Note: a failed backward] in ``schedule.py``."""
        self.schedule.settle()
        return list(self.stepper.policy.partial_step)

    def accept_partial_step(self) -> None:
        """Go on from the weights a failed backward left partly stepped."""
        self.schedule.settle()
        self.stepper.policy.accept_partial_step()

    def drop_device_states(self) -> None:
        """Every device-stepped unit's state back to the host (``load_state_dict``)."""
        self.synchronize()
        for u in self.units:
            self.device_stepper.drop_state(u)

    def synchronize(self) -> None:
        """Wait for every pending gradient landing and optimizer step on the host; a clip's
        pending coefficient is applied to the host gradients."""
        self.schedule.settle()
        self.worker.wait_idle()
        for u in self.units:
            self.device_stepper.pull_state(u)
        self.stepper.apply_grad_scales()  # p.grad as PyTorch's clip leaves it

    def set_activation_checkpointing(
        self, which: bool | Iterable[str] | CheckpointPolicyLike
    ) -> None:
        """Replace the model's activation checkpointing (``which`` of
        ``ActivationCheckpointer.checkpoint_units``; False: none) between passes (see
        ``ramflow.set_activation_checkpointing``); a failed backward is cleaned up first.
        Units, plan and window are unchanged.

        Raises:
            ValueError: a layer engine (no model), or as
                ``ActivationCheckpointer.checkpoint_units`` (the previous checkpointing is
                back).
            RuntimeError: inside a forward or backward pass.
        """
        model = self.model
        if model is None:
            raise ValueError("activation checkpointing needs an offloaded model, not its layers")
        schedule = self.schedule
        if schedule.in_pass:
            raise RuntimeError(
                "activation checkpointing can change only between passes, not inside a "
                "forward or backward"
            )
        schedule.settle()  # a failed backward's leftovers: see [Note: a failed backward]
        checkpointer = self.checkpointer
        previous = checkpointer.checkpointing
        checkpointer.uncheckpoint_units(model)
        if which is False:
            return
        try:
            checkpointer.checkpoint_units(model, which)
        except ValueError:
            checkpointer.uncheckpoint_units(model)
            if previous is not False:
                checkpointer.checkpoint_units(model, previous)
            raise

    def refresh_from_host(self) -> None:
        """The host master weights changed outside ramflow: rewrite wire and device copies."""
        self.worker.wait_idle()
        for u in self.units:
            self.device_stepper.refresh_from_host(u)

    # ------------------------------------------------------------------ undo

    def remove(self) -> None:
        """Undo everything: hooks off, device memory freed, plain parameters back."""
        self.synchronize()
        if self._owns_worker:
            self.worker.stop()
        self.host.unpin_all()
        model = self.model
        self.hooks.remove(model)
        self.gradients.remove_hooks()
        self.checkpointer.uncheckpoint_units(model)
        self.schedule.restore(model)
        self.routed_experts.remove()
        for u in self.units:
            self.device_stepper.drop_state(u)
            if u.compressed:
                for p in u.compressed:  # swap_tensors refuses a tensor weakly referenced
                    set_engine_of_param(p, None)
                self.host.restore_compressed(u)
        self.window.free_all(self.units)
        with torch.no_grad():
            for u in self.units:
                for p, dtype in zip(u.owned, u.orig_dtypes):
                    grad = p.grad
                    p.data = p.data.to(dtype=dtype, copy=True)
                    p.grad = None if grad is None else grad.to(dtype=dtype, copy=True)
        if model is not None:
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.cpu()
            set_engine_of_model(model, None)
        for u in self.units:
            for p in u.owned:
                set_engine_of_param(p, None)
        self.adapters.give_back()
