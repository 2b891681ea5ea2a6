"""``ramtorch.helpers.replace_linear_with_ramtorch`` on ``ramflow.helpers.replace_linear``."""

from __future__ import annotations

import torch
from torch import nn

from ...layers.linear import replace_linear
from .linear import Linear


def replace_linear_with_ramtorch(
    module: nn.Module,
    device: str | int = "cuda",
    *,
    rank: int | None = None,
    skip: tuple[str, ...] = (),
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``module`` by a ``ramflow.Linear`` with the same
    weights, computing on ``device`` (an int is a CUDA device index, as in RamTorch's
    ``replace_linear_with_ramtorch(model, rank)``; ``rank=`` is accepted too). Without CUDA the layers compute on the
    CPU. The weights' dtype becomes the wire dtype; masters are fp32. ``skip``: names of
    layers to leave as they are (a head tied to the embeddings: ``("lm_head",)``), as in
    ``ramflow.helpers.replace_linear``. Returns ``module``."""
    if rank is not None:  # RamTorch's README writes replace_linear_with_ramtorch(model, rank)
        device = rank
    if isinstance(device, int):
        device = f"cuda:{device}"
    if not torch.cuda.is_available():
        device = "cpu"
    dtypes = {m.weight.dtype for m in module.modules() if type(m) is nn.Linear}
    wire = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return replace_linear(module, device=device, wire_dtype=wire, layer_class=_Layer, skip=skip)


class _Layer(Linear):
    """RamTorch's Linear built with ramflow's keywords (what ``replace_linear`` passes)."""

    def __init__(self, in_features, out_features, bias=True, *, device=None, wire_dtype=None):
        super().__init__(in_features, out_features, bias, dtype=wire_dtype, device=device)


__all__ = ["replace_linear_with_ramtorch"]
