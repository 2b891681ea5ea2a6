"""Hooks that reach a part of an engine weakly (see [Note: lifetime] in ``ramflow.units.registry``).

Hooks live in modules and device parameters that the units themselves hold; holding the
engine's parts weakly keeps the engine free of reference cycles, so it goes with its model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
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
