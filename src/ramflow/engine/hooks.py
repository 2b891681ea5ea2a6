"""Hooks that reach a part of an engine weakly (see [Note: lifetime] in ``ramflow.units.registry``).

Hooks live in modules and device parameters that the units themselves hold; holding the
engine's parts weakly keeps the engine free of reference cycles, so it goes with its model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ..units.unit import refuse_copy


class UnitHook:
    """A hook that calls ``method(unit, *extra, *args)`` for one unit, holding the method's
    object (a part of an engine, with a ``units`` list) weakly and the unit by index."""

    __slots__ = ("_method", "_index", "_extra")

    def __init__(self, method: Any, index: int, *extra: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._index = index
        self._extra = extra

    # never traced by torch.compile: a compiled module runs its hooks eagerly, as calls
    # out of its graph (they move storage, take locks and wait for events)
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        unit = method.__self__.units[self._index]
        return method(unit, *self._extra, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> UnitHook:
        refuse_copy()


class ModuleCall:
    """``module.<method>(...)`` routed to a bound method ``fn(module, ...)``, holding both
    weakly (it lives in the module's ``__dict__``)."""

    __slots__ = ("_fn", "_module")

    def __init__(self, fn: Any, module: nn.Module) -> None:
        self._fn = weakref.WeakMethod(fn)
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn, module = self._fn(), self._module()
        assert fn is not None and module is not None, "the offloaded model is gone"
        return fn(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> ModuleCall:
        refuse_copy()


def checkpointed_unit_forward(
    module_ref: weakref.ref,
    forward: Any,
    call_swapped: Any,
    context_fn: Callable[[], Any] | None,
    offloader: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A unit's forward under ``torch.utils.checkpoint`` (non-reentrant, with a policy's
    ``context_fn`` for selective checkpointing); the recomputation runs with the unit's
    parameters swapped in (see ``Schedule._call_swapped``). With ``offloader`` (a
    ``ramflow.activations.boundary_offload.BoundaryOffloader``) the unit's input goes to pinned
    host memory: see [Note: offloaded checkpoint boundaries] there."""
    module = module_ref()
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    if offloader is None:
        return torch.utils.checkpoint.checkpoint(
            call_swapped, forward, module, *args, use_reentrant=False, **extra, **kwargs
        )
    # call_swapped, forward and module are not tensors: only the unit's tensor inputs
    # are saved through the offloader's hooks
    with offloader.saving():
        return torch.utils.checkpoint.checkpoint(
            call_swapped, forward, module, *args, use_reentrant=False, **extra, **kwargs
        )


def segmented_unit_forward(
    parent_ref: weakref.ref,
    run_segment: Callable[..., Any],
    segments: tuple[tuple[int, int], ...],
    input: Any,
) -> Any:
    """An ``nn.Sequential``'s forward with the children ``start:stop`` of each segment run
    as one checkpointed region (as ``torch.utils.checkpoint.checkpoint_sequential``), the
    other children plainly. See [Note: checkpointed segments of units]."""
    parent = parent_ref()
    if not torch.is_grad_enabled():
        return type(parent).forward(parent, input)
    children = list(parent)
    done = 0
    for start, stop in segments:
        for child in children[done:start]:
            input = child(input)
        input = torch.utils.checkpoint.checkpoint(
            run_segment, start, stop, input, use_reentrant=False
        )
        done = stop
    for child in children[done:]:
        input = child(input)
    return input
