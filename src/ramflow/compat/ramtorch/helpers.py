"""``ramtorch.helpers.replace_linear_with_ramtorch`` on ``ramflow.helpers.replace_linear``."""

from __future__ import annotations

import torch
from torch import nn

from ..._linear import replace_linear


def replace_linear_with_ramtorch(module: nn.Module, device: str | int = "cuda") -> nn.Module:
    """Replace every ``nn.Linear`` of ``module`` by a ``ramflow.Linear`` with the same
    weights, computing on ``device`` (an int is a CUDA device index, as in RamTorch's
    ``replace_linear_with_ramtorch(model, rank)``). Without CUDA the layers compute on the
    CPU. The weights' dtype becomes the wire dtype; masters are fp32. Returns ``module``."""
    if isinstance(device, int):
        device = f"cuda:{device}"
    if not torch.cuda.is_available():
        device = "cpu"
    dtypes = {m.weight.dtype for m in module.modules() if type(m) is nn.Linear}
    wire = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return replace_linear(module, device=device, wire_dtype=wire)


__all__ = ["replace_linear_with_ramtorch"]
