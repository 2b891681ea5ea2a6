"""ramflow: train and run PyTorch models whose weights live in CPU RAM, streamed through the GPU."""

# _quiet first: its filters must be in place before anything imports torchao
from . import _quiet, distributed, helpers, memory, optim  # noqa: F401 (_quiet: its filters)
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

__all__ = [
    "HostPrecision",
    "Linear",
    "OffloadPlan",
    "accept_partial_step",
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
