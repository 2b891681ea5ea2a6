"""ramflow: train and run PyTorch models whose weights live in CPU RAM, streamed through the GPU.

The public names load on first use (PEP 562), so that ``import ramflow`` and ``ramflow
--help`` do not import PyTorch; ``from ramflow import offload`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# _quiet first: its filters must be in place before anything imports torchao (standard
# library only, so importing it here costs nothing)
from . import _quiet  # noqa: F401

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and the layout test
    from . import distributed, helpers, memory, optim
    from .api import (
        accept_partial_step,
        adopt,
        clip_grad_norm_,
        get_plan,
        is_offloaded,
        offload,
        refresh,
        set_activation_checkpointing,
        synchronize,
        undo,
    )
    from .formats.host import HostPrecision
    from .layers.linear import Linear
    from .planner.plan import OffloadPlan
    from .sizes import format_bytes, parse_bytes

__version__ = "0.1.0"

# public name -> the module that defines it (a submodule: the name itself)
_WHERE = {
    "HostPrecision": "ramflow.formats.host",
    "Linear": "ramflow.layers.linear",
    "OffloadPlan": "ramflow.planner.plan",
    "format_bytes": "ramflow.sizes",
    "parse_bytes": "ramflow.sizes",
    **dict.fromkeys(
        [
            "accept_partial_step",
            "accumulate",
            "adopt",
            "clip_grad_norm_",
            "get_plan",
            "is_offloaded",
            "offload",
            "refresh",
            "set_activation_checkpointing",
            "synchronize",
            "undo",
        ],
        "ramflow.api",
    ),
    **{name: None for name in ("distributed", "helpers", "memory", "optim")},
}

__all__ = [
    "HostPrecision",
    "Linear",
    "OffloadPlan",
    "accept_partial_step",
    "accumulate",
    "adopt",
    "clip_grad_norm_",
    "distributed",
    "format_bytes",
    "get_plan",
    "helpers",
    "is_offloaded",
    "memory",
    "offload",
    "optim",
    "parse_bytes",
    "refresh",
    "set_activation_checkpointing",
    "synchronize",
    "undo",
]
assert sorted(_WHERE) == __all__


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ramflow' has no attribute {name!r}")
    where = _WHERE[name]
    value = (
        importlib.import_module(f"ramflow.{name}")
        if where is None
        else getattr(importlib.import_module(where), name)
    )
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
