"""Which engine owns a model or a parameter, without keeping either alive.

[Note: lifetime]
An offloaded model owns its engine: the root module holds it (``_ramflow_engine``), and
nothing else does strongly. Every hook ramflow installs (on the model's modules, on the
device parameters, the checkpoint wrappers) reaches the engine through a weak reference,
and this registry maps parameters to engines weakly as well. So when the last reference
to the model goes, the engine goes with it at once (reference counting, no garbage
collection pass needed), and its finalizer stops the host worker thread and unpins what it
page-locked; the host store, pinned buffers and device storage are plain tensors the engine
owned. ``ramflow.undo`` is still the way to get an ordinary module back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

ENGINE_ATTR = "_ramflow_engine"

# parameter -> weakref to the engine that owns it (host parameter identity is kept)
_ENGINE_OF_PARAM: WeakIdKeyDictionary = WeakIdKeyDictionary()


def engine_of_model(model: Any) -> Any | None:
    """The engine of an offloaded model, or None."""
    if not isinstance(model, nn.Module):
        return None
    return model.__dict__.get(ENGINE_ATTR)


def set_engine_of_model(model: nn.Module, engine: Any | None) -> None:
    """Make ``model`` own ``engine`` (None: forget it). While it does, ``pickle`` and
    ``torch.save`` of the model raise ``refuse_copy``'s TypeError (an instance
    ``__reduce_ex__``, which the pickler looks up before it meets a hook it cannot pickle
    and raises an AttributeError about a local object)."""
    if engine is None:
        model.__dict__.pop(ENGINE_ATTR, None)
        model.__dict__.pop("__reduce_ex__", None)
    else:
        model.__dict__[ENGINE_ATTR] = engine
        model.__dict__["__reduce_ex__"] = _refuse_pickle


def _refuse_pickle(protocol: int) -> Any:
    from .unit import refuse_copy

    refuse_copy()


def engine_of_param(p: Any) -> Any | None:
    """The live engine managing parameter ``p``, or None."""
    ref = _ENGINE_OF_PARAM.get(p)
    return None if ref is None else ref()


def set_engine_of_param(p: Any, engine: Any | None) -> None:
    if engine is None:
        _ENGINE_OF_PARAM.pop(p, None)
    else:
        _ENGINE_OF_PARAM[p] = weakref.ref(engine)


def live_engines() -> list[Any]:
    """Every live engine that manages a parameter (for the exit-time drain)."""
    out: dict[int, Any] = {}
    for ref in list(_ENGINE_OF_PARAM.values()):
        engine = ref()
        if engine is not None:
            out[id(engine)] = engine
    return list(out.values())


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that calls bound ``method`` while its object lives and does nothing
    after: hooks hold the engine this way. See [Note: lifetime]."""
    ref = weakref.WeakMethod(method)

    @torch.compiler.disable  # as ``ramflow.engine.hooks.UnitHook``: hooks run outside the graph
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call
