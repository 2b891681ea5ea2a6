"""Adafactor over host fp32 master weights (``ramflow.optim.Adafactor``).

Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost", 2018) keeps no first moment and factors the second moment of each matrix into a
row and a column statistic: ``rows + cols`` fp32 numbers for a ``rows x cols`` weight
instead of ``rows * cols``. The arithmetic is PyTorch's own ``torch.optim.Adafactor``
(torch >= 2.5; its single-tensor functional, the default of that class), so a step is
bit-identical to it, with its departures from the paper: ``lr`` caps the relative step
size and scales the decoupled weight decay, ``eps1`` is applied to the variance estimate.
Parameters of two or more dimensions are factored over their last two; vectors keep a
full second moment.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import _adafactor as _torch_adafactor

from .host_optimizer import HostOptimizer

# states whose shape is not the parameter's: a row and a column statistic per matrix
_FACTORED = ("row_var", "col_var")


class Adafactor(HostOptimizer):
    """Adafactor (Shazeer & Stern, 2018) as ``torch.optim.Adafactor``, over host fp32
    master weights, overlapped with backward.

    Args:
        params: parameters or param groups, as for ``torch.optim.Adafactor``.
        lr: the cap of the relative step size ``rho_t = min(lr, 1 / sqrt(t))`` and the
            weight decay's scale; the step is ``rho_t * max(eps2, RMS(p))`` times the
            clipped normalised gradient, so it is relative to the weights' size.
        beta2_decay: the second moment's decay is ``1 - t ** beta2_decay``; <= 0.
        eps: ``(eps1, eps2)``: eps1 floors the variance estimate (None: the machine
            epsilon of fp32), eps2 floors the weights' RMS in the step size.
        d: update clipping threshold (>= 1): the update's RMS is clipped to ``d``.
        weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``.
        overlap: as for ``ramflow.optim.AdamW``.

    Defaults are ``torch.optim.Adafactor``'s. State per parameter: ``step`` (float32
    scalar); ``row_var`` (shape ``(..., rows, 1)``) and ``col_var`` (``(..., 1, cols)``)
    for parameters of two or more dimensions, ``variance`` (the parameter's shape) for
    vectors; all fp32 on the host. Only the exact host formats
    (``host_precision='fp32'``) are stepped; others are refused with a ValueError when
    the optimizer meets the model's parameters (``check_optimizer_formats``).

    Raises:
        ValueError: an out-of-range setting (as ``torch.optim.Adafactor``).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        overlap: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}, must be >= 0")
        if not beta2_decay <= 0.0:
            raise ValueError(f"invalid beta2_decay: {beta2_decay}, must be <= 0")
        if eps[0] is not None and not eps[0] >= 0.0:
            raise ValueError(f"invalid eps1: {eps[0]}, must be >= 0 or None")
        if not eps[1] >= 0.0:
            raise ValueError(f"invalid eps2: {eps[1]}, must be >= 0")
        if not (d >= 1.0 and math.isfinite(d)):
            raise ValueError(f"invalid clipping threshold d: {d}, must be a number >= 1")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}, must be >= 0")
        defaults = dict(
            lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d, weight_decay=weight_decay
        )
        super().__init__(params, defaults, overlap=overlap)

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        row_vars, col_vars, variances, steps = [], [], [], []
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
        for p, g in zip(params, grads):
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                if g.dim() > 1:
                    st["row_var"] = g.new_zeros((*g.shape[:-1], 1))
                    st["col_var"] = g.new_zeros((*g.shape[:-2], 1, g.shape[-1]))
                else:
                    st.update(self._state_buffers(p, ("variance",)))
            row_vars.append(st.get("row_var"))
            col_vars.append(st.get("col_var"))
            variances.append(st.get("variance"))
            steps.append(st["step"])
        eps1, eps2 = group["eps"]
        _torch_adafactor.adafactor(
            params,
            grads,
            row_vars,
            col_vars,
            variances,
            steps,
            foreach=False,
            d=group["d"],
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            weight_decay=group["weight_decay"],
            eps1=eps1,
            eps2=eps2,
            maximize=False,
        )

    def _flat_names(self, p: torch.Tensor, state: dict[str, Any]) -> tuple[str, ...]:
        """Only a vector's ``variance`` has the parameter's shape and lives in the flat
        buffers; the factored statistics stay plain fp32 host tensors."""
        return tuple(n for n in super()._flat_names(p, state) if n not in _FACTORED)

    def state_shape(self, name: str, param_shape: torch.Size) -> tuple[int, ...]:
        """``row_var``: ``(..., rows, 1)``; ``col_var``: ``(..., 1, cols)``; else the
        parameter's shape."""
        shape = tuple(param_shape)
        if name == "row_var" and len(shape) > 1:
            return (*shape[:-1], 1)
        if name == "col_var" and len(shape) > 1:
            return (*shape[:-2], 1, shape[-1])
        return super().state_shape(name, param_shape)


__all__ = ["Adafactor"]
