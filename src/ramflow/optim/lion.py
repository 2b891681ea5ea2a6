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

[Note: Lion on the lean host formats]
Lion's one state is AdamW's first moment, so it is kept as the unit's host format keeps
that moment (fp32, bf16 rounded to nearest, or 8-bit signed block-wise codes with their
scales: ``StateFormat.encode``/``decode``), and the master is written back as AdamW's lean
step writes it: a bf16-sr master with ``stochastic_round_bf16``, the lean kernel's
counter-based rounding keyed by the unit's seed, the parameter's step count and each
element's index in its unit; a bf16-kahan master with its bf16 compensation. The update
itself is computed in fp32, in PyTorch ops over the parameter's range of the unit's flat
buffers (each parameter starts a block, ``units.unit.ALIGN``, so its 8-bit blocks and its
rounding counters are the unit's own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..formats.host import OPTIMIZER_STATES, HostPrecision, StateFormat
from ..kernels.lean_kernels import stochastic_round_bf16
from ..units.registry import engine_of_param
from ..units.unit import Unit
from .host_optimizer import HostOptimizer
from .unit_states import format_of

MOMENTUM = "exp_avg"  # AdamW's first moment's name: the host formats know how to keep it


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

    State per parameter: ``exp_avg`` (the parameter's shape; for offloaded parameters a
    view of one flat host buffer per unit, fp32, or in a lean host format as that format
    keeps AdamW's first moment: bf16, or 8-bit codes with ``exp_avg_scale``); on lean
    formats also ``step`` (float32 scalar, the stochastic rounding's key) and a Kahan
    master's ``master_compensation``. Every host format is stepped (see [Note: Lion on the
    lean host formats]); on fp32 the steps are the reference's bit for bit.

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
            unit = _lean_unit(p)
            if unit is not None:
                self._lean_step(p, g, unit, lr=lr, wd=wd, beta1=beta1, beta2=beta2)
                continue
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

    def _lean_step(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        unit: Unit,
        *,
        lr: float,
        wd: float,
        beta1: float,
        beta2: float,
    ) -> None:
        """One step of managed parameter ``p`` of a unit in a lean host format, over its
        range of the unit's flat buffers. See [Note: Lion on the lean host formats]."""
        fmt = format_of(unit)
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st.update(self.unit_states.views(p, _state_names(fmt), self._new_flats))
        step = int(st["step"]) + 1
        k = next(i for i, q in enumerate(unit.owned) if q is p)
        lo = unit.offsets[k]
        hi = lo + p.numel()
        views = {n: fmt.state_view(n, self.unit_states[unit][n], lo, hi) for n in st if n != "step"}
        g = grad.detach().reshape(-1).to(torch.float32)
        m = fmt.state_format.decode(MOMENTUM, dict(views)).to(torch.float32)
        master = unit.master[lo:hi]
        w = master.to(torch.float32)
        compensation = views.get(fmt.master_format.COMPENSATION)
        if compensation is not None:
            w = w + compensation.to(torch.float32)
        w = w * (1.0 - lr * wd)
        w = w - lr * (m * beta1 + g * (1.0 - beta1)).sign()
        m = m * beta2 + g * (1.0 - beta2)
        fmt.state_format.encode(MOMENTUM, m, views)
        if master.dtype == torch.float32:
            master.copy_(w)
        elif compensation is None:  # bf16-sr: the lean kernel's rounding
            master.copy_(
                stochastic_round_bf16(w, seed=unit.rounding_seed, step=step, counter_offset=lo)
            )
        else:  # bf16-kahan
            high = w.to(torch.bfloat16)
            master.copy_(high)
            compensation.copy_(w - high.to(torch.float32))
        st["step"].add_(1)

    def _new_flats(self, unit: Unit, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """New flat states of ``unit`` in its host format (``HostPrecision.new_state``)."""
        fmt = format_of(unit)
        return {name: fmt.new_state(name, unit.trainable_numel) for name in names}

    def _states_to_unit(self, p: torch.Tensor, engine: Any) -> None:
        """``p`` joined ``engine`` with a plain momentum: it moves into its unit's flat
        buffers, in the unit's host format (see [Note: parameters that change hands])."""
        st = self.state.get(p)
        unit = engine.unit_of(p)
        if not st or unit is None or not any(q is p for q in unit.owned[: unit.num_trainable]):
            return
        fmt = format_of(unit)
        value = st[MOMENTUM].detach().to("cpu", torch.float32).reshape(-1)
        views = self.unit_states.views(p, _state_names(fmt), self._new_flats)
        fmt.state_format.encode(MOMENTUM, value, views)
        st.update(views)
        st.setdefault("step", torch.zeros((), dtype=torch.float32))

    def _states_to_plain(self, p: torch.Tensor) -> None:
        """``p``'s engine was removed: its momentum, decoded, becomes a plain tensor of its
        dtype and device (a Kahan compensation is dropped)."""
        st = self.state.get(p)
        if not st or MOMENTUM not in st:
            return
        fmt = next(
            (f for f in OPTIMIZER_STATES.values() if f.block and MOMENTUM + f.SCALE in st),
            OPTIMIZER_STATES["fp32"],
        )
        value = fmt.decode(MOMENTUM, st)
        st[MOMENTUM] = value.to(torch.float32).view(p.shape).to(p.device, p.dtype, copy=True)
        for name in [n for n in st if n not in (MOMENTUM, "step")]:
            del st[name]


def _lean_unit(p: torch.Tensor) -> Unit | None:
    """``p``'s unit if ``p`` is a managed parameter kept in a lean host format, else None."""
    engine = engine_of_param(p)
    unit = None if engine is None else engine.unit_of(p)
    return None if unit is None or format_of(unit).is_exact else unit


def _state_names(fmt: HostPrecision) -> tuple[str, ...]:
    """Lion's state tensors in host formats ``fmt``: the momentum (with its scales when
    block-wise) and the master's own (a Kahan compensation)."""
    mine = (MOMENTUM, MOMENTUM + StateFormat.SCALE)
    moment = tuple(n for n in fmt.state_format.state_names if n in mine)
    return moment + fmt.master_format.state_names


__all__ = ["Lion"]
