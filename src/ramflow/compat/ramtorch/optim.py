"""RamTorch's ``AdamW`` signature on ``ramflow.optim.AdamW``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ... import optim


class AdamW(optim.AdamW):
    """``ramtorch.AdamW``: ``ramflow.optim.AdamW`` (fp32 states, fused CPU kernel).

    ``chunk_size``, ``dtype`` (RamTorch's state dtype, with stochastic rounding) and
    ``storage_device`` are accepted and not used: states are fp32 on the host.
    ``centralization`` (gradient centralization) other than 0 raises ``NotImplementedError``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        centralization: float = 0,
        chunk_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        storage_device: str = "cpu",
    ) -> None:
        if centralization:
            raise NotImplementedError(
                "gradient centralization is not implemented by ramflow; use centralization=0"
            )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
