"""The engine's hooks on the user's modules, and what changes in the model they take in.

``ModelHooks`` installs and removes what an engine puts on the modules it offloads: the
root's forward pre-hook that takes in changes made since ``offload`` (``adopt_changes``),
the state-dict hooks (saving waits for the host; loading brings the new weights to the
device), the hooks of compressed weights (see [Note: compressed frozen weights] in
``ramflow.formats.frozen``), the root's ``zero_grad`` and the guards of PEFT's merges (see
[Note: merging adapters into an offloaded base] in ``ramflow.engine.adapters``). Every hook
reaches the engine weakly (see [Note: lifetime] in ``ramflow.units.registry``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from ..units.registry import weak_method
from ..units.unit import Unit, UnitSpec
from .adapters import (
    DeviceParameters,
    GuardedMerge,
    guard_adapter_merges,
    materialize_meta_adapters,
)
from .clip import route_accelerate_clip
from .device_stepper import DeviceStepper
from .hooks import ModuleCall
from .host_store import HostStore
from .schedule import Schedule
from .stepper import Stepper
from .worker import HostWorker


class Coordinator(Protocol):
    """What the hooks need of their engine (``ramflow.engine.engine.Engine``)."""

    device: torch.device
    units: list[Unit]
    adapters: DeviceParameters
    host: HostStore
    stepper: Stepper
    device_stepper: DeviceStepper
    schedule: Schedule
    worker: HostWorker

    @property
    def model(self) -> nn.Module | None: ...

    def unit_of(self, p: torch.Tensor) -> Unit | None: ...

    def synchronize(self) -> None: ...

    def refresh_from_host(self) -> None: ...

    def raise_if_trained(self) -> None: ...

    def on_zero_grad(self) -> None: ...

    def replan(self, new: list[nn.Parameter]) -> None: ...


class ModelHooks:
    """The hooks one engine puts on the user's modules; ``remove`` takes them all off.

    Args:
        engine: the engine they serve, held weakly.
    """

    def __init__(self, engine: Coordinator) -> None:
        self._engine = weakref.ref(engine)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _coordinator(self) -> Coordinator:
        engine = self._engine()
        assert engine is not None, "the engine is gone"
        return engine

    # ------------------------------------------------------------------ installing

    def install_root(self, root: nn.Module) -> None:
        """The root's hooks: taking in changes before each forward (after the schedule's
        root hooks are in: this one is prepended and runs first), the state-dict hooks and
        ``zero_grad``; PEFT's merges are guarded."""
        self._handles.append(
            root.register_forward_pre_hook(weak_method(self._adopt_hook), prepend=True)
        )
        self.install_state_dict(root, before_load=True)
        root.__dict__["zero_grad"] = ModuleCall(self._module_zero_grad, root)
        guard_adapter_merges(root, weak_method(self.refresh_param))

    def install_state_dict(self, module: nn.Module, *, before_load: bool) -> None:
        """``module.state_dict()`` waits for the host; ``load_state_dict`` rewrites the
        wire and device copies after (``before_load``: and brings device-stepped states to
        the host first)."""
        sync = weak_method(self._synchronize_hook)
        self._handles.append(module.register_state_dict_pre_hook(sync))
        if before_load:
            # a partial load keeps the other weights: bring device-stepped ones to the host
            self._handles.append(module.register_load_state_dict_pre_hook(sync))
        self._handles.append(
            module.register_load_state_dict_post_hook(weak_method(self._after_load_state_dict))
        )

    def install_compressed(self, units: list[Unit], specs: list[UnitSpec]) -> None:
        """State-dict hooks on the modules that hold compressed weights: saving gives them
        dequantized, loading compresses them. See [Note: compressed frozen weights] in
        ``ramflow.formats.frozen``."""
        host = self._coordinator().host
        for u, spec in zip(units, specs):
            index = {id(p): i for i, p in enumerate(u.compressed)}
            by_module: dict[nn.Module, list[tuple[str, int]]] = {}
            for module, name in spec.slots:
                i = index.get(id(module._parameters[name]))
                if i is not None:
                    by_module.setdefault(module, []).append((name, i))
            for module, entries in by_module.items():
                hook = _CompressedStateDict(host, u, entries)
                # partials: torch marks the hooks it is given with an attribute
                save, load = functools.partial(hook.save), functools.partial(hook.load)
                self._handles.append(module.register_state_dict_post_hook(save))
                self._handles.append(module.register_load_state_dict_pre_hook(load))

    def remove(self, model: nn.Module | None) -> None:
        """Take off every hook, the root's ``zero_grad`` and the merge guards."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in model.modules() if model is not None else ():
            module.__dict__.pop("zero_grad", None)
            for name in ("merge", "unmerge"):  # guard_adapter_merges' wrappers
                if isinstance(module.__dict__.get(name), GuardedMerge):
                    del module.__dict__[name]

    # ------------------------------------------------------------------ what they do

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
            RuntimeError: a compressed weight was made trainable after ``offload``.
        """
        engine = self._coordinator()
        model = engine.model
        if model is None:
            return
        on_device = engine.adapters.ids()
        new = [
            p for p in model.parameters() if id(p) not in on_device and engine.unit_of(p) is None
        ]
        frozen: list[Unit] = []
        # requires_grad matters to a forward that records gradients only: under no_grad
        # (inference) a flag changed since offload trains nothing and is let be
        training = torch.is_grad_enabled()
        if training:
            engine.raise_if_trained()  # a compressed weight made trainable: its own message
        for u in engine.units if training else ():
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
        new = materialize_meta_adapters(model, new, engine.device)
        engine.synchronize()
        for u in frozen:
            self._freeze(engine, u)
        engine.replan(new)
        guard_adapter_merges(model, weak_method(self.refresh_param))

    @staticmethod
    def _freeze(engine: Coordinator, u: Unit) -> None:
        """``u``'s trainable parameters were all frozen after ``offload``: it takes no
        gradients and no step from now on (engine idle: ``synchronize`` first)."""
        engine.device_stepper.drop_state(u)
        u.device_stepped = False
        for p, dp in zip(u.owned[: u.num_trainable], u.device_params):
            p.grad = None
            dp.grad = None
            dp.requires_grad_(False)
        engine.host.release_staging(u)
        u.host_grad = None
        u.host_grad_views = []
        u.grad_versions = []
        u.num_trainable = 0
        u.trainable_numel = 0

    def refresh_param(self, p: torch.Tensor) -> None:
        """``p``'s host values were written outside ramflow (a PEFT merge): its data back in
        its unit's master if it was replaced, then the unit's wire and device copies."""
        engine = self._engine()
        u = None if engine is None else engine.unit_of(p)
        if u is None or u.master is None:
            return
        engine.schedule.settle()
        engine.worker.wait_idle()
        k = next(i for i, q in enumerate(u.owned) if q is p)
        if (
            k < u.num_kept
            and p.untyped_storage().data_ptr() != u.master.untyped_storage().data_ptr()
        ):
            view = u.views(u.master, kept_only=True)[k]
            with torch.no_grad():
                view.copy_(p.detach())
                p.data = view
        engine.device_stepper.refresh_from_host(u)

    def _adopt_hook(self, module: nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward: the pass began with this structure
        # accelerate may be imported since offload: See [Note: clipping through torch.nn.utils]
        route_accelerate_clip()
        self.adopt_changes()

    def _synchronize_hook(self, *args: Any, **kwargs: Any) -> None:
        self._coordinator().synchronize()

    def _after_load_state_dict(self, module: nn.Module, incompatible: Any) -> None:
        # a checkpoint was loaded: see [Note: a failed backward] in ramflow.engine.schedule
        engine = self._coordinator()
        engine.stepper.policy.accept_partial_step()
        engine.refresh_from_host()

    def _module_zero_grad(self, module: nn.Module, set_to_none: bool = True) -> None:
        """``model.zero_grad()``: as ``opt.zero_grad()``, nothing of the last backward pass
        lands after it."""
        engine = self._coordinator()
        engine.on_zero_grad()
        if not set_to_none:
            engine.synchronize()
        type(module).zero_grad(module, set_to_none=set_to_none)


class _CompressedStateDict:
    """The state-dict hooks of one module's compressed weights (held by the hook handles;
    they reach the host store and the unit weakly)."""

    def __init__(self, host: HostStore, u: Unit, entries: list[tuple[str, int]]) -> None:
        self._host = weakref.ref(host)
        self._unit = weakref.ref(u)
        self._entries = entries

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """``state_dict``: each compressed weight dequantized, in the wire dtype (the
        values the device computes with), instead of its meta stand-in."""
        host, u = self._host(), self._unit()
        if host is None or u is None:
            return
        for name, i in self._entries:
            if prefix + name in state_dict:
                dtype = module._parameters[name].dtype
                state_dict[prefix + name] = host.read_compressed(u, i, dtype)

    def load(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """``load_state_dict``: compress the given values into the store (the root's
        post-hook then reloads every unit), and hand the default loader a meta tensor in
        their place, so that its copy into the meta stand-in is the no-op it is, silently."""
        host, u = self._host(), self._unit()
        if host is None or u is None:
            return
        for name, i in self._entries:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                if tuple(value.shape) != tuple(module._parameters[name].shape):
                    continue  # the default loader reports the mismatch
                host.write_compressed(u, i, value)
                state_dict[prefix + name] = torch.empty_like(value, device="meta")
