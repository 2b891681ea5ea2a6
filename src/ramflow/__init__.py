"""ramflow: train and run PyTorch models whose weights live in CPU RAM, streamed through the GPU."""

from . import optim
from ._plan import OffloadPlan, format_bytes, parse_bytes
from .api import clip_grad_norm_, get_plan, is_offloaded, offload, synchronize, undo

__version__ = "0.1.0"

__all__ = [
    "OffloadPlan",
    "clip_grad_norm_",
    "format_bytes",
    "get_plan",
    "is_offloaded",
    "offload",
    "optim",
    "parse_bytes",
    "synchronize",
    "undo",
]
