"""Lion over host fp32 master weights (``ramflow.optim.Lion``).

Lion (EvoLved Sign Momentum; Chen et al., "Symbolic Discovery of Optimization Algorithms",
2023) keeps one momentum per parameter and steps by the sign of an interpolation of it
and the gradient, so every element moves by exactly ``lr``. The arithmetic follows the
reference implementation (lucidrains/lion-pytorch, ``lion_pytorch.update_fn``) op for op,
so a step is bit-identical to it:

    p <- p * (1 - lr * wd)                       # decoupled weight decay, scaled by lr
    c  = beta1 * m + (1 - beta1) * g
    p <- p - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g

The paper's Program 1 writes the decay as ``p -= lr * (sign(c) + wd * p)``: the same step,
with the decay read from the weights before the sign step (one rounding apart).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ._host_optimizer import HostOptimizer


class Lion(HostOptimizer):
    """Lion (Chen et al., 2023) over host fp32 master weights, overlapped with backward.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate, the size of every element's step. The paper takes it 3-10x
            smaller than AdamW's (the sign update has a larger norm).
        betas: ``(beta1, beta2)``: the interpolation that is signed and the momentum's
            decay; the paper's defaults (0.9, 0.99).
        weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``;
            the paper takes it 3-10x larger than AdamW's, so ``lr * weight_decay`` stays.
        overlap: as for ``ramflow.optim.AdamW``.

    State per parameter: ``exp_avg`` (fp32, the parameter's shape; for offloaded
    parameters a view of one flat host buffer per unit). Only the exact host formats
    (``host_precision='fp32'``) are stepped; others are refused with a ValueError when
    the optimizer meets the model's parameters (``check_optimizer_formats``).

    Raises:
        ValueError: a negative ``lr`` or ``weight_decay``, or betas outside [0, 1).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        overlap: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}, each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, overlap=overlap)

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p, g in zip(params, grads):
            st = self.state[p]
            if not st:
                st.update(self._state_buffers(p, ("exp_avg",)))
            exp_avg = st["exp_avg"]
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            p.mul_(1.0 - lr * wd)
            update = exp_avg.clone().mul_(beta1).add(g, alpha=1.0 - beta1).sign_()
            p.add_(update, alpha=-lr)
            exp_avg.mul_(beta2).add_(g, alpha=1.0 - beta2)


__all__ = ["Lion"]
