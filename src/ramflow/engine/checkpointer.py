"""The activation checkpointer: which units of an offloaded model recompute their forward in
backward, and how.

Owns what ``checkpoint_units`` installs on the model: our checkpoint wrappers in units'
modules or in an ``nn.Sequential`` of units (``ramflow.activations.checkpointing``'s
``checkpointed_unit_forward`` and ``segmented_unit_forward``), Hugging Face's own switch,
and the boundary offloader of ``CheckpointOffload`` (``ramflow.activations.boundary_offload``),
and it takes them off again. The hooks that load and pin the units during the recomputation
are the schedule's (``engine.schedule``, [Note: parameters during backward]).

[Note: checkpointed segments of units]
``CheckpointSegments`` on an offloaded model checkpoints runs of units (children of one
``nn.Sequential``) as one region each. In forward the region calls the units as modules, so
their hooks load, pin and order them as usual. Its recomputation during backward starts at
the segment's last unit, when only that one is pinned for backward: it acquires every unit
of the segment, swaps their device parameters in, runs their ``forward`` directly (past the
hooks, which would open calls that no backward closes) and releases them. The tensors it
saves that view device parameters stay valid: each unit's own backward acquires it again
before its gradients run (see [Note: units and views] in ``ramflow.units.unit``). A segment's
units are on the device together while it recomputes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..activations.boundary_offload import BoundaryOffloader
from ..activations.checkpointing import (
    CheckpointPlan,
    CheckpointPolicyLike,
    checkpointed_unit_forward,
    is_checkpoint_policy,
    resolve_over_units,
    segmented_unit_forward,
)
from ..units.registry import weak_method
from ..units.unit import Unit
from .hooks import UnitHook
from .schedule import in_backward, swap_parameters, unit_deps
from .window import DeviceWindow


class ActivationCheckpointer:
    """The activation checkpointing of one engine's model.

    Args:
        units: the engine's unit list (shared; the engine appends to it).
        window: the device window (a segment's units are acquired for its recomputation).

    Attributes:
        checkpointing: what ``checkpoint_units`` installed last (False: nothing).
        boundary_offloader: ``CheckpointOffload``'s offloader, None without one (its
            ``enabled`` switch turns the offload off between steps).
    """

    def __init__(self, *, units: list[Unit], window: DeviceWindow) -> None:
        self.units = units
        self._window = window
        self._checkpointed: list[nn.Module] = []
        self._hf_checkpointing = False
        self.checkpointing: bool | Iterable[str] | CheckpointPolicyLike = False
        self.boundary_offloader: BoundaryOffloader | None = None

    @property
    def checkpointed(self) -> list[nn.Module]:
        """The modules whose forward runs under our checkpoint wrapper."""
        return self._checkpointed

    def checkpoint_units(
        self, model: nn.Module, which: bool | Iterable[str] | CheckpointPolicyLike = True
    ) -> None:
        """Recompute activations in backward instead of keeping them
        (``torch.utils.checkpoint``, non-reentrant; Chen et al. 2016): every block
        (``which=True``), the units named in ``which`` (a plan's ``checkpointed``), or the
        units a policy of ``ramflow.memory`` chooses (``resolve_over_units``), with its
        options (a selective policy's ``context_fn``; segments).

        A Hugging Face model gets its own switch (it also turns the KV cache off, which a
        recomputation would otherwise extend twice); with names, the layers of the other
        units have theirs turned off again. Other models (and named units that hold no
        Hugging Face layer) get a wrapper inside the unit's forward, so the unit's hooks
        still run once per call and the recomputation finds the unit pinned and its device
        parameters in place. Segments wrap their ``nn.Sequential`` instead: see
        [Note: checkpointed segments of units]. ``CheckpointOffload`` always takes the
        wrapper (Hugging Face models included; train them with ``use_cache=False``): the
        offload hooks must surround the checkpoint call.

        Raises:
            ValueError: ``which`` names a unit the model does not have, or the policy
                cannot apply to this model (nothing changed).
        """
        self.checkpointing = which
        names: set[str] | None = None
        context_fn = None
        offloader = None
        if is_checkpoint_policy(which):
            candidates = [
                (u.name, u.modules[0])
                for u in self.units
                if not u.rest and len(u.modules) == 1 and u.modules[0] is not model
            ]
            plan = resolve_over_units(which, model, candidates)  # type: ignore[arg-type]
            if plan.segments:
                self._checkpoint_segments(model, plan, candidates)
                return
            if not plan.blocks:
                return  # the policy chose nothing (e.g. already within its budget)
            names, context_fn = set(plan.blocks), plan.context_fn
            if plan.offload_prefetch:
                # our wrapper, not Hugging Face's switch: the offload hooks go around
                # the checkpoint call. See [Note: offloaded checkpoint boundaries]
                offloader = BoundaryOffloader(prefetch=plan.offload_prefetch)
                self.boundary_offloader = offloader
        elif which is not True:
            names = {which} if isinstance(which, str) else set(which)  # type: ignore[arg-type]
            known = [u.name for u in self.units if not u.rest]
            unknown = sorted(names - set(known))
            if unknown:
                raise ValueError(
                    f"activation_checkpointing names units this model does not have: {unknown}. "
                    f"Its units: {known}"
                )
        if offloader is None and getattr(model, "supports_gradient_checkpointing", False):
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if context_fn is not None:
                kwargs["context_fn"] = context_fn
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            self._hf_checkpointing = True
            if names is None:
                return
            for u in self.units:
                flagged = [
                    m
                    for root in u.modules
                    if root is not model
                    for m in root.modules()
                    if getattr(m, "gradient_checkpointing", False) is True
                ]
                if u.name not in names:
                    for m in flagged:
                        m.gradient_checkpointing = False
                elif flagged:
                    names.discard(u.name)  # Hugging Face recomputes it
        for u in self.units:
            if u.rest or len(u.modules) != 1 or u.modules[0] is model:
                continue
            if names is not None and u.name not in names:
                continue
            module = u.modules[0]
            if "forward" in module.__dict__:
                continue  # already wrapped by someone else; leave it alone
            # the wrapper lives in the module: it holds the module and the schedule weakly
            forward = functools.partial(
                checkpointed_unit_forward,
                weakref.ref(module),
                type(module).forward,
                UnitHook(self._call_swapped, u.index),
                context_fn,
                offloader,
            )
            module.forward = forward
            self._checkpointed.append(module)

    def _checkpoint_segments(
        self, model: nn.Module, plan: CheckpointPlan, candidates: list[tuple[str, nn.Module]]
    ) -> None:
        """Wrap the ``nn.Sequential`` whose children are the units of ``plan.segments``.
        See [Note: checkpointed segments of units].

        Raises:
            ValueError: the ``nn.Sequential``'s forward is already replaced (nothing changed).
        """
        by_name = dict(candidates)
        # resolve_over_units checked that the segments are runs of one nn.Sequential's children
        parent = model.get_submodule(plan.segments[0][0].rpartition(".")[0])
        assert isinstance(parent, nn.Sequential)
        if "forward" in parent.__dict__:
            raise ValueError(
                f"activation_checkpointing: {type(parent).__name__}.forward is already "
                "replaced (by apply_checkpointing?); undo that first"
            )
        position = {id(child): i for i, child in enumerate(parent)}
        runs = []
        for segment in plan.segments:
            at = [position[id(by_name[name])] for name in segment]
            runs.append((at[0], at[-1] + 1))
        parent.forward = functools.partial(
            segmented_unit_forward,
            weakref.ref(parent),
            functools.partial(weak_method(self._run_segment), weakref.ref(parent)),
            tuple(sorted(runs)),
        )
        self._checkpointed.append(parent)

    def _run_segment(self, parent_ref: weakref.ref, start: int, stop: int, input: Any) -> Any:
        """The children ``start:stop`` of a checkpointed ``nn.Sequential``: as modules in
        forward; in the recomputation with their units acquired and swapped in. See
        [Note: checkpointed segments of units]."""
        children = list(parent_ref())[start:stop]
        if not in_backward():
            for child in children:
                input = child(input)
            return input
        unit_of = {id(u.modules[0]): u for u in self.units if len(u.modules) == 1}
        units = [unit_of[id(child)] for child in children]
        deps = unit_deps(units)
        self._window.acquire(deps)
        try:
            for u in units:
                swap_parameters(u, to_device=True)
            try:
                for child in children:
                    input = child.forward(input)
            finally:
                for u in units:
                    swap_parameters(u, to_device=False)
        finally:
            self._window.release(deps)
        return input

    def uncheckpoint_units(self, model: nn.Module | None) -> None:
        """Take off what ``checkpoint_units`` installed: our wrappers, Hugging Face's
        switch, the boundary offloader. Call it between passes (a graph built before keeps
        unpacking through the offloader it saved with)."""
        for module in self._checkpointed:
            del module.forward
        self._checkpointed.clear()
        if self._hf_checkpointing:
            assert model is not None
            disable = (
                getattr(model, "activation_checkpointing_disable", None)
                or model.gradient_checkpointing_disable
            )
            disable()
            self._hf_checkpointing = False
        self.boundary_offloader = None
        self.checkpointing = False

    def _call_swapped(self, u: Unit, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` with ``u``'s module slots on the device parameters: the checkpoint
        wrapper's recomputation calls the unit's own forward, not its hooks."""
        swap_parameters(u, to_device=True)
        try:
            return fn(*args, **kwargs)
        finally:
            swap_parameters(u, to_device=False)
