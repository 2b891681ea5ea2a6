"""The streaming engine: the coordinator of one offloaded model's parts.

An ``Engine`` builds its parts and hands each the peers it calls (docs/design.md has the
picture): the host store (``engine.host_store``), the device window (``engine.window``), the stepper
(``engine.stepper``), the gradient path (``engine.gradients``) and the schedule (``engine.schedule``). It
adds units and plans, and it is the door for everything outside: ``ramflow.optim``,
``ramflow.api``, ``ramflow.distributed.zero``, ``ramflow.layers.linear`` call the methods below, which cross
parts in the order each part's Notes require. Its lifetime is ``ramflow.units.registry``'s.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..activations.checkpointing import CheckpointPolicyLike
from ..formats.frozen import raise_if_trained
from ..formats.host import HostPrecision
from ..kernels.lean_kernels import warm_up_device_step
from ..planner.cpu_rates import rates_for
from ..planner.plan import OffloadPlan, auto_device_optimizer, make_plan, with_device_optimizer
from ..planner.predict import Rates
from ..transfer.streams import CopyStreams, StagingBuffers, unpin
from ..units.registry import (
    live_engines,
    set_engine_of_model,
    set_engine_of_param,
    weak_method,
)
from ..units.unit import Unit, UnitSpec, plan_inputs, refuse_copy
from .adapters import (
    DeviceParameters,
    GuardedMerge,
    device_bytes,
    guard_adapter_merges,
    materialize_meta_adapters,
)
from .checkpointer import ActivationCheckpointer
from .clip import install_clip_route, route_accelerate_clip
from .device_stepper import DeviceStepper
from .grad_scale import fold_grad_scale
from .gradients import GradientPath
from .hooks import ModuleCall
from .host_stepper import HostStepper
from .host_store import FillMaster, HostStore, optimizer_state_bytes
from .interfaces import DataParallel, StepOptimizer
from .plain_optim import install_optimizer_hooks
from .schedule import Schedule
from .stepper import Stepper
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
    """Owns one offloaded model: its units and the parts that move and step them.

    Built by ``ramflow.offload``; see its docstring for the arguments.
    """

    def __init__(
        self,
        model: nn.Module | None,
        specs: list[UnitSpec],
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        gpu_memory_bytes: int | None,
        prefetch_depth: int,
        activation_checkpointing: bool = False,
        worker: HostWorker | None = None,
        streams: CopyStreams | None = None,
        device_optimizer: bool | None = False,
        device_optimizer_reason: str | None = None,
        host_precision: HostPrecision | None = None,
        host_precision_reason: str | None = None,
        fill: FillMaster | None = None,
        frozen_format: str | None = None,
        on_device: Iterable[nn.Parameter] = (),
        owners: Sequence[int] | None = None,
        rank: int | None = None,
    ) -> None:
        # model None: a layer engine (see ``ramflow.layers.linear``): no root module, units are
        # added one by one with ``add_units``, worker and streams are shared per device.
        # The model owns the engine, never the other way round: see [Note: lifetime].
        self._model_ref = None if model is None else weakref.ref(model)
        self._layer_engine = model is None
        self.device = device
        self.wire_dtype = wire_dtype
        self.prefetch_depth = prefetch_depth
        # None: the planner chooses (see [Note: the device optimizer's default] in _plan)
        self.device_optimizer = device_optimizer
        self._device_optimizer_reason = device_optimizer_reason
        # under ZeRO (``ramflow.offload(zero_stage=...)``): each unit's owner rank and this
        # process's, so that only the units it steps are planned for its device optimizer
        self._owners = None if owners is None else list(owners)
        self._rank = rank
        self.streams = streams if streams is not None else CopyStreams(device)
        self.worker = worker if worker is not None else HostWorker(device)
        self._owns_worker = worker is None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._gpu_memory_bytes = gpu_memory_bytes
        self._host_precision_reason = host_precision_reason
        self.frozen_format = frozen_format
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
            device=device, wire_dtype=wire_dtype, streams=self.streams, worker=self.worker
        )
        self.host = HostStore(
            device=device, wire_dtype=wire_dtype, window=self.window, precision=host_precision
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
            prefetch_depth=prefetch_depth,
            layer_engine=self._layer_engine,
            units=self.units,
            worker=self.worker,
            window=self.window,
            gradients=self.gradients,
            stepper=self.stepper,
        )
        self.checkpointer = ActivationCheckpointer(units=self.units, window=self.window)

        install_optimizer_hooks()
        install_clip_route()
        self._finalizer = weakref.finalize(
            self,
            _release_engine,
            self.worker if self._owns_worker else None,
            self.host.pinned_in_place,
        )
        try:
            self.add_units(specs, fill=fill)
        except BaseException:
            self.adapters.give_back()
            raise
        self._warm_up_device_step()
        if model is not None:
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.device != self.device:
                        module._buffers[name] = buf.to(self.device)
            self._install_root_hooks(model)
            guard_adapter_merges(model, weak_method(self.refresh_param))
            if activation_checkpointing:
                try:
                    self.checkpointer.checkpoint_units(model, activation_checkpointing)
                except ValueError:
                    self.remove()  # the model is given back as it was
                    raise
            set_engine_of_model(model, self)

    @property
    def model(self) -> nn.Module | None:
        """The root module (None for a layer engine or once the model is gone)."""
        return None if self._model_ref is None else self._model_ref()

    @property
    def dist(self) -> DataParallel | None:
        """The data-parallel state (``ramflow.distributed.zero``), None on one process."""
        return self.stepper.dist

    @dist.setter
    def dist(self, state: DataParallel | None) -> None:
        self.stepper.dist = state

    def add_units(self, specs: list[UnitSpec], *, fill: FillMaster | None = None) -> list[Unit]:
        """Build the host store, device views and hooks of new units and plan again.

        Called once by the constructor, and by ``ramflow.Linear`` for each layer that joins
        a layer engine. ``fill``: see ``HostStore.build``. Raises MemoryError (host RAM) or
        ValueError (GPU budget)."""
        new = [
            Unit(len(self.units) + i, s, frozen_format=self.frozen_format)
            for i, s in enumerate(specs)
        ]
        if self._owners is not None:
            for u in new:
                u.owner = self._owners[u.index]
        self.host.check_memory(new)
        all_units = self.units + new
        plan = self._make_plan(all_units)
        if self.units and set(plan.resident) != {u.name for u in self.units if u.resident}:
            raise ValueError("adding units would change which units are resident")
        self._set_plan(plan, new)
        plan = self.plan
        resident = set(plan.resident)
        for u in new:
            u.resident = u.name in resident
            u.device_stepped = u.name in plan.device_stepped
            for p in u.owned:
                self._unit_of_param[id(p)] = u
            self.stepper.note_position(u, u.index)
        self.units.extend(new)
        self.host.build(new, fill=fill)
        self.window.build(new, specs, self._unit_of_param)
        self.gradients.install_hooks(new)
        self.window.set_capacity(plan.window_bytes)
        for u in new:
            if u.resident:
                self.window.load_resident(u)
        self.schedule.add_units(new)
        self._install_compressed_hooks(new, specs)
        if self._layer_engine:  # a layer: its own state dict is the way in and out
            for u in new:
                for m in u.modules:
                    self._install_state_dict_hooks(m, before_load=False)
        for u in new:
            for p in u.owned:
                set_engine_of_param(p, self)
        return new

    def _install_compressed_hooks(self, units: list[Unit], specs: list[UnitSpec]) -> None:
        """State-dict hooks on the modules that hold compressed weights: saving gives them
        dequantized, loading compresses them. See [Note: compressed frozen weights] in
        ``ramflow.formats.frozen``."""
        for u, spec in zip(units, specs):
            index = {id(p): i for i, p in enumerate(u.compressed)}
            by_module: dict[nn.Module, list[tuple[str, int]]] = {}
            for module, name in spec.slots:
                i = index.get(id(module._parameters[name]))
                if i is not None:
                    by_module.setdefault(module, []).append((name, i))
            for module, entries in by_module.items():
                hook = _CompressedStateDict(self, u, entries)
                # partials: torch marks the hooks it is given with an attribute
                save, load = functools.partial(hook.save), functools.partial(hook.load)
                self._hooks.append(module.register_state_dict_post_hook(save))
                self._hooks.append(module.register_load_state_dict_pre_hook(load))

    def raise_if_trained(self) -> None:
        """Raise RuntimeError if a compressed weight was made trainable after offload."""
        for u in self.units:
            raise_if_trained(u.compressed, u.frozen_format)

    def _make_plan(self, all_units: list[Unit], *, extra_bytes: int = 0) -> OffloadPlan:
        """The device plan of ``all_units`` with ``extra_bytes`` more kept on the device
        (raises ValueError when the budget is too small)."""
        # compressed weights are staged on the device, two units' at most (ramflow.transfer.streams)
        staging = 0
        if self.device.type == "cuda":
            largest = max((u.packed_bytes(self.wire_dtype) for u in all_units), default=0)
            staging = StagingBuffers.COUNT * largest
        return make_plan(
            device=str(self.device),
            **plan_inputs(all_units, self.wire_dtype),
            fixed_bytes=self._buffer_bytes + self.adapters.nbytes + staging + extra_bytes,
            gpu_memory_bytes=self._gpu_memory_bytes,
            prefetch_depth=self.prefetch_depth,
        )

    def _set_plan(self, plan: OffloadPlan, new: list[Unit]) -> None:
        """Complete ``plan`` with the device optimizer and the host formats, and keep it."""
        all_units = self.units + new
        precision = self.host.precision
        plan = dataclasses.replace(
            plan,
            host_precision=precision.name,
            host_bytes_per_parameter=precision.bytes_per_parameter(
                trainable=True, wire_dtype=self.wire_dtype
            ),
            host_bytes=self.host.store_bytes(all_units)
            + optimizer_state_bytes(all_units, precision),
            host_deferred_bytes=precision.host_bytes(all_units, self.wire_dtype).deferred_gradients,
            host_precision_reason=self._host_precision_reason,
            frozen_format=self.frozen_format,
            unit_h2d_bytes=tuple(u.h2d_bytes(self.wire_dtype) for u in all_units),
        )
        self.plan: OffloadPlan = self._with_device_optimizer(plan, all_units)

    def _with_device_optimizer(self, plan: OffloadPlan, all_units: list[Unit]) -> OffloadPlan:
        """``plan`` with the units stepped on the device: all that fit when forced (True),
        none when refused (False), the planner's choice when None; with the reason."""
        precision = self.host.precision
        sizes = dict(
            bytes_per_param=precision.device_step_bytes_per_parameter,
            scratch_bytes=precision.device_step_scratch_bytes,
        )
        # under ZeRO only the units this rank owns (see [Note: the device optimizer under
        # ZeRO] in ramflow.engine.stepper): a unit of no trainable elements is never chosen
        numels = [
            u.trainable_numel if u.owner is None or u.owner == self._rank else 0 for u in all_units
        ]
        if self.device_optimizer is True:
            plan = with_device_optimizer(plan, numels, **sizes)
            fits = "" if plan.device_stepped else ", but no unit's states fit the budget"
            if self._owners is not None:
                fits = f" (the units rank {self._rank} owns){fits}"
            return dataclasses.replace(plan, device_optimizer_reason=f"device_optimizer=True{fits}")
        if self.device_optimizer is False:
            why = self._device_optimizer_reason or "device_optimizer=False"
            return dataclasses.replace(plan, device_optimizer_reason=why)
        # see [Note: the device optimizer's default] in ramflow.planner.plan
        refusal = self._device_optimizer_refusal()
        if refusal is not None:
            return dataclasses.replace(plan, device_optimizer_reason=f"none: {refusal}")
        rates = rates_for(Rates(), precision.name)
        if self._owners is not None:
            # per rank: its own units, on its share of the host's cores (the ranks of a
            # host split them), see [Note: the device optimizer under ZeRO] in _stepper
            ranks = len(set(self._owners))
            rates = dataclasses.replace(
                rates, cpu_optimizer_params_per_s=rates.cpu_optimizer_params_per_s / ranks
            )
        plan = auto_device_optimizer(
            plan,
            numels,
            **sizes,
            rates=rates,
            grad_bytes_per_param=torch.empty((), dtype=self.wire_dtype).element_size(),
        )
        if self._owners is None:
            return plan
        why = (
            f"{plan.device_optimizer_reason} (under ZeRO: among the units rank {self._rank} "
            f"owns, its CPU optimizer at 1/{ranks} of the host's rate; the other ranks take "
            "them from the shared host store or its device)"
        )
        return dataclasses.replace(plan, device_optimizer_reason=why)

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
            state_dtype=precision.state_format.dtype,
            compensated=precision.master_format.compensated,
        )

    def prepare_first_step(self) -> None:
        """Make now the host buffers the first backward would make: the gradient ring's,
        one per unit whose gradients this process lands on the host (under ZeRO-2, the
        units it owns; not those stepped on the device), up to the ring's size. Call it
        once the distributed state is set. See [Note: states made before the first step]
        in ``ramflow.optim.host_optimizer``."""
        dist = self.dist
        landed = sum(
            1
            for u in self.units
            if u.num_trainable
            and not u.device_stepped
            and (dist is None or dist.keeps_gradients(u))
        )
        self.host.make_ring(landed)

    def _device_optimizer_refusal(self) -> str | None:
        """Why ``device_optimizer=None`` steps no unit on the device before any prediction
        (None: the planner predicts)."""
        if self.device.type != "cuda":
            return "the device is the CPU"
        if self._gpu_memory_bytes is None:
            return "no gpu_memory budget"
        if any(p.requires_grad for p in self.adapters.params):
            return "trainable parameters are kept on the device (LoRA adapters step there)"
        if self.host.precision.is_exact:
            return (
                "fp32 masters: their device step does not give the CPU step's bits, so the "
                "run would depend on the plan (device_optimizer=True forces it)"
            )
        return None

    def _install_state_dict_hooks(self, module: nn.Module, *, before_load: bool) -> None:
        sync = weak_method(self._synchronize_hook)
        self._hooks.append(module.register_state_dict_pre_hook(sync))
        if before_load:
            # a partial load keeps the other weights: bring device-stepped ones to the host
            self._hooks.append(module.register_load_state_dict_pre_hook(sync))
        self._hooks.append(
            module.register_load_state_dict_post_hook(weak_method(self._after_load_state_dict))
        )

    def _install_root_hooks(self, root: nn.Module) -> None:
        self.schedule.install_root_hooks(root)
        # prepended after the schedule's: runs first, before a forward pass takes anything
        self._hooks.append(
            root.register_forward_pre_hook(weak_method(self._adopt_hook), prepend=True)
        )
        self._install_state_dict_hooks(root, before_load=True)
        root.__dict__["zero_grad"] = ModuleCall(self._module_zero_grad, root)

    def _synchronize_hook(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize()

    def _adopt_hook(self, module: nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward: the pass began with this structure
        # accelerate may be imported since offload: See [Note: clipping through torch.nn.utils]
        route_accelerate_clip()
        self.adopt_changes()

    def adopt_changes(self) -> None:
        """Take in what changed in the model since ``offload`` (called before each forward).

        New parameters (``peft.get_peft_model`` on an offloaded model adds adapters to
        modules inside units) move to the device and stay there, as the adapters that
        ``offload`` found (see [Note: adapters on the device] in ``ramflow.engine.adapters``). A
        unit whose trainable parameters were all frozen since (PEFT freezes the base)
        becomes a frozen unit: no gradients, no step; its host memory stays as laid out
        (applying the adapters before ``offload`` stores the frozen base leaner).

        Raises:
            ValueError: a unit's parameters were made trainable, or only some of them
                frozen, after ``offload`` (its host layout keeps the trainable ones first);
                the new parameters do not fit in ``gpu_memory`` beside the plan (they stay
                where they are).
        """
        model = self.model
        if model is None:
            return
        known = self.adapters.ids() | self._unit_of_param.keys()
        new = [p for p in model.parameters() if id(p) not in known]
        frozen: list[Unit] = []
        # requires_grad matters to a forward that records gradients only: under no_grad
        # (inference) a flag changed since offload trains nothing and is let be
        training = torch.is_grad_enabled()
        if training:
            self.raise_if_trained()  # a compressed weight made trainable: its own message
        for u in self.units if training else ():
            flags = [p.requires_grad for p in u.owned]
            if flags == [k < u.num_trainable for k in range(len(flags))]:
                continue
            if any(flags[u.num_trainable :]) or any(flags[: u.num_trainable]):
                raise ValueError(
                    f"parameters of unit {u.name!r} changed requires_grad after "
                    "ramflow.offload, and not all of them to False: ramflow lays out each "
                    "unit's trainable parameters when it offloads the model. Set "
                    "requires_grad before ramflow.offload (ramflow.undo(model), change it, "
                    "offload again)."
                )
            frozen.append(u)
        if not new and not frozen:
            return
        new = materialize_meta_adapters(model, new, self.device)
        self.synchronize()
        for u in frozen:
            self._freeze(u)
        plan = self._make_plan(self.units, extra_bytes=device_bytes(new))
        if plan.resident != self.plan.resident:
            raise ValueError(
                f"{len(new)} parameters were added to the model after ramflow.offload "
                f"({device_bytes(new) / 2**20:.1f} MiB on the device with gradients and AdamW "
                "states), more than its gpu_memory leaves beside the units it keeps resident: "
                "add them before ramflow.offload (e.g. peft.get_peft_model first), or give a "
                "larger gpu_memory"
            )
        self.adapters.adopt(new)
        guard_adapter_merges(model, weak_method(self.refresh_param))
        self._set_plan(plan, [])
        self.window.set_capacity(plan.window_bytes)

    def _freeze(self, u: Unit) -> None:
        """``u``'s trainable parameters were all frozen after ``offload``: it takes no
        gradients and no step from now on (engine idle: ``synchronize`` first)."""
        self.device_stepper.drop_state(u)
        u.device_stepped = False
        for p, dp in zip(u.owned[: u.num_trainable], u.device_params):
            p.grad = None
            dp.grad = None
            dp.requires_grad_(False)
        self.host.release_staging(u)
        u.host_grad = None
        u.host_grad_views = []
        u.grad_versions = []
        u.num_trainable = 0
        u.trainable_numel = 0

    def _module_zero_grad(self, module: nn.Module, set_to_none: bool = True) -> None:
        """``model.zero_grad()``: as ``opt.zero_grad()``, nothing of the last backward pass
        lands after it."""
        self.on_zero_grad()
        if not set_to_none:
            self.synchronize()
        type(module).zero_grad(module, set_to_none=set_to_none)

    def __deepcopy__(self, memo: dict) -> Engine:
        refuse_copy()

    def __reduce__(self) -> Any:
        refuse_copy()

    # ------------------------------------------------------------------ the optimizer's calls

    def attach(self, opt: StepOptimizer) -> None:
        """``opt`` holds parameters of this engine: the stepper steps them with it."""
        self.schedule.settle()
        self.stepper.attach(opt)

    @property
    def optimizers(self) -> list[StepOptimizer]:
        """The live ramflow optimizers holding parameters of this engine (held weakly)."""
        return self.stepper.optimizers

    def unit_of(self, p: torch.Tensor) -> Unit | None:
        return self._unit_of_param.get(id(p))

    def refresh_param(self, p: torch.Tensor) -> None:
        """``p``'s host values were written outside ramflow (a PEFT merge): its data back in
        its unit's master if it was replaced, then the unit's wire and device copies."""
        u = self._unit_of_param.get(id(p))
        if u is None or u.master is None:
            return
        self.schedule.settle()
        self.worker.wait_idle()
        k = next(i for i, q in enumerate(u.owned) if q is p)
        if (
            k < u.num_kept
            and p.untyped_storage().data_ptr() != u.master.untyped_storage().data_ptr()
        ):
            view = u.views(u.master, kept_only=True)[k]
            with torch.no_grad():
                view.copy_(p.detach())
                p.data = view
        self.device_stepper.refresh_from_host(u)

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

    def pass_param_norms(self) -> dict[Unit, torch.Tensor] | None:
        """See ``Stepper.pass_param_norms`` (after ``note_clip``)."""
        return self.stepper.pass_param_norms()

    def fold_grad_scale(self, u: Unit, scale: float) -> bool:
        """See ``ramflow.engine.grad_scale.fold_grad_scale`` (a clip, after ``note_clip``)."""
        return fold_grad_scale(u, scale)

    def accept_partial_step(self) -> None:
        """Go on from the weights a failed backward left partly stepped."""
        self.schedule.settle()
        self.stepper.policy.accept_partial_step()

    def host_step_totals(self) -> tuple[int, float]:
        """See ``HostStepper.host_step_totals``."""
        return self.host_stepper.host_step_totals()

    def drop_device_states(self) -> None:
        """Every device-stepped unit's state back to the host (``load_state_dict``)."""
        self.synchronize()
        for u in self.units:
            self.device_stepper.drop_state(u)

    # ------------------------------------------------------------------ host copies

    def mark_stale(self, units: Iterable[Unit]) -> None:
        """Another process is stepping these units' master weights (ZeRO): their next use
        waits until ``refresh_wire`` runs for them (see ``ramflow.distributed.zero``)."""
        self.window.begin_host_write(units)

    def refresh_wire(
        self,
        u: Unit,
        *,
        written: bool = False,
        received: tuple[torch.cuda.Event | None] | None = None,
    ) -> None:
        """Worker: ``u``'s master is current (``written``: so is its wire copy); bring the
        wire and device copies up to date (see ``HostStore.refresh_wire``; ``received``:
        the device copy came from the unit's owner)."""
        self.host.refresh_wire(u, written=written, received=received)

    def write_back_events(self) -> list[tuple[Unit, torch.cuda.Event]]:
        """At ``opt.step()``, under ZeRO: see ``DeviceStepper.write_back_events``."""
        return self.device_stepper.write_back_events()

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

    def _after_load_state_dict(self, module: nn.Module, incompatible: Any) -> None:
        # a checkpoint was loaded: see [Note: a failed backward]
        self.stepper.policy.accept_partial_step()
        self.refresh_from_host()

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
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.gradients.remove_hooks()
        model = self.model
        self.checkpointer.uncheckpoint_units(model)
        self.schedule.restore(model)
        for module in model.modules() if model is not None else ():
            module.__dict__.pop("zero_grad", None)
            for name in ("merge", "unmerge"):  # guard_adapter_merges' wrappers
                if isinstance(module.__dict__.get(name), GuardedMerge):
                    del module.__dict__[name]
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


class _CompressedStateDict:
    """The state-dict hooks of one module's compressed weights (held by the engine's
    hook handles; they reach the engine weakly)."""

    def __init__(self, engine: Engine, u: Unit, entries: list[tuple[str, int]]) -> None:
        self._engine = weakref.ref(engine)
        self._unit = weakref.ref(u)
        self._entries = entries

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """``state_dict``: each compressed weight dequantized, in the wire dtype (the
        values the device computes with), instead of its meta stand-in."""
        engine, u = self._engine(), self._unit()
        if engine is None or u is None:
            return
        for name, i in self._entries:
            if prefix + name in state_dict:
                dtype = module._parameters[name].dtype
                state_dict[prefix + name] = engine.host.read_compressed(u, i, dtype)

    def load(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """``load_state_dict``: compress the given values into the store (the root's
        post-hook then reloads every unit), and hand the default loader a meta tensor in
        their place, so that its copy into the meta stand-in is the no-op it is, silently."""
        engine, u = self._engine(), self._unit()
        if engine is None or u is None:
            return
        for name, i in self._entries:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                if tuple(value.shape) != tuple(module._parameters[name].shape):
                    continue  # the default loader reports the mismatch
                engine.host.write_compressed(u, i, value)
                state_dict[prefix + name] = torch.empty_like(value, device="meta")
