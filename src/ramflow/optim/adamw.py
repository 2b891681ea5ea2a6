"""CPU optimizers over the fp32 master weights of offloaded models.

``AdamW``, ``SGD``, ``Lion``, ``Adafactor`` and ``Muon`` are ``torch.optim.Optimizer`` subclasses: param groups, LR schedulers,
``state_dict``/``load_state_dict`` and ``zero_grad`` work as usual. For parameters of a
model given to ``ramflow.offload`` they step the host masters on a worker thread, unit by
unit, overlapped with the GPU (see [Note: when the step runs] in ``engine/stepper.py``); other
parameters are stepped in ``step()`` like a plain optimizer would. The arithmetic is
PyTorch's own: its fused CPU kernels (``torch.optim.adam.adam(..., fused=True)``), with a
fallback to the single-tensor path where fused is not available. ``Lion`` (``optim.lion``) and
``Adafactor`` (``optim.adafactor``) are PyTorch ops per parameter; ``Muon`` (``optim.muon``) steps 2-D
hidden matrices with their Newton-Schulz iteration on the model's device and the rest with
AdamW; AdamW and Lion step the lean
host formats, the others refuse them (``check_optimizer_formats``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import sgd as _sgd

from ..engine.engine import Engine
from ..formats.host import holds_moments, moments_into, moments_to_plain
from ..formats.steps import LEAN, AdamWSettings, FlatStep, adamw_for
from ..kernels.cpu_kernels import check_threads, odd_tails
from ..units.registry import engine_of_param
from ..units.unit import Unit
from .host_optimizer import HostOptimizer
from .unit_states import format_of


class AdamW(HostOptimizer):
    """AdamW (Loshchilov & Hutter, 2019) over host fp32 master weights.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``; typically
            ``model.parameters()`` of a model given to ``ramflow.offload``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (defaults equal).
        overlap: allow stepping units during backward once the loop is seen to take one
            backward per step without touching the gradients (see ``no_step``). False
            steps only in ``step()`` (still asynchronously, overlapped with the next forward).
        keep_grads: when a unit is stepped during backward, also write its fp32 gradients
            to ``p.grad`` on the host (True, the default). False leaves ``p.grad`` None for
            those steps: 4 fewer bytes of DRAM traffic per parameter (about an eighth of
            the step, which bounds small-batch training) for loops that never read the
            gradients. Steps that are not applied during backward (the first, clipping,
            accumulation) always fill ``p.grad``. Under the gradient ring of the lean host
            formats (a ``HostPrecision`` whose gradients are a ring) steps during backward leave
            ``p.grad`` None either way: the ring keeps no full gradient buffer. There, with
            masters that are not fp32 (``lean``, ``bf16``, ``kahan``), a step not applied
            during backward leaves ``p.grad`` None too and holds each unit's gradient in 8-bit
            block-wise codes, about 1.02 bytes per parameter (see [Note: the compact
            deferred gradient] in ``ramflow.formats.deferred_grad``); clip it with
            ``ramflow.clip_grad_norm_`` (2-norm), which reads the norm from the device
            gradients and scales the held gradients.
        clips: the loop clips the gradients (``ramflow.clip_grad_norm_`` or
            ``torch.nn.utils.clip_grad_norm_`` with a finite ``max_norm``) before every
            ``step()``, the first included. With ``keep_grads=False`` under the gradient
            ring, the first backward then holds its gradients for the clip instead of
            stepping during backward (which a clip after it would refuse); without it, a
            clip after the first backward raises a loop-pattern RuntimeError.
        threads: CPU threads of the step over the host masters (ramflow's native AdamW
            kernel), an int >= 1; None (the default) is ``torch.get_num_threads()``. The
            step is bound by DRAM, so leaving a core or two to a data loader costs little;
            see docs/speed.md, "CPU kernel work sharing and threads". The result
            does not depend on it.

    State per parameter: ``step`` (float32 scalar), ``exp_avg`` and ``exp_avg_sq`` (fp32, the
    parameter's shape, on the host). Raises ``ValueError`` for out-of-range settings and
    ``TypeError`` for a ``threads`` that is not an int.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        overlap: bool = True,
        keep_grads: bool = True,
        clips: bool = False,
        threads: int | None = None,
    ) -> None:
        check_threads(threads)
        self.threads = threads
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"invalid epsilon: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, overlap=overlap, keep_grads=keep_grads, clips=clips)

    def flat_runs(self, unit: Unit) -> list[tuple[int, int, int]] | None:
        params = unit.owned[: unit.num_trainable]
        if not params:
            return None
        groups = [self._group_of.get(id(p)) for p in params]
        if None in groups:
            return None
        steps = {float(self.state[p]["step"]) if self.state.get(p) else 0.0 for p in params}
        if len(steps) != 1:
            return None
        starts = [k for k in range(len(params)) if k == 0 or groups[k] != groups[k - 1]]
        ends = [unit.offsets[k] for k in starts[1:]] + [unit.trainable_numel]
        return [(groups[k], unit.offsets[k], end) for k, end in zip(starts, ends)]

    def flat_step(
        self,
        unit: Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        accumulate: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        wire_out: torch.Tensor | None = None,
        pieces: list[tuple[int, int]] | None = None,
        after_piece: Callable[[int, int], None] | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        runs = self.flat_runs(unit)
        assert runs is not None
        params = unit.owned[: unit.num_trainable]
        fmt = format_of(unit)
        adamw_for(fmt).host_step(
            fmt,
            unit.master,
            grad,
            self._flats_with_states(unit),
            FlatStep(
                pieces=pieces or [(0, unit.trainable_numel)],
                runs=runs,
                settings=[AdamWSettings.of(group) for group in hyper],
                step=int(self.state[params[0]]["step"]) + 1,
                tails=odd_tails(unit.offsets, [p.numel() for p in params]),
                seed=unit.rounding_seed,
                threads=self.threads,
                after_piece=after_piece,
                grad_scale=grad_scale,
            ),
            accumulate=accumulate,
            grad_out=grad_out,
            wire_out=wire_out,
        )
        for p in params:
            self.state[p]["step"].add_(1)

    def _flats_with_states(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The flat host states of ``unit`` (trainable prefix, in its host format; see
        ``_state_names``), with every parameter's state made first if it has none yet."""
        names = _state_names(unit)
        for p in unit.owned[: unit.num_trainable]:
            if not self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p].update(self.unit_states.views(p, names, self._new_flats))
        return self.unit_states[unit]

    def _states_to_unit(self, p: torch.Tensor, engine: Engine) -> None:
        """``p`` joined ``engine`` with states (stepped before ``offload``, or before an
        ``undo`` and a new ``offload``): they move into its unit's flat buffers, in the
        unit's host format. See [Note: parameters that change hands]."""
        st = self.state.get(p)
        unit = engine.unit_of(p)
        if not st or unit is None or not any(q is p for q in unit.owned[: unit.num_trainable]):
            return  # no state, or a frozen parameter: never stepped by the unit
        st.update(
            moments_into(
                format_of(unit), st, self.unit_states.views(p, _state_names(unit), self._new_flats)
            )
        )

    def _states_to_plain(self, p: torch.Tensor) -> None:
        """``p``'s engine was removed (``ramflow.undo``): its moments become plain tensors.
        See [Note: parameters that change hands]."""
        st = self.state.get(p)
        if st and holds_moments(st):
            moments_to_plain(st, p, plain=engine_of_param(p) is None)

    def _new_flats(self, unit: Unit, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """New flat states of ``unit`` in its host format (``HostPrecision.new_state``).

        Raises:
            ValueError: a name the format does not keep (a state dict saved with another
                host format, whose states have names of their own, e.g. 4-bit's).
        """
        fmt = format_of(unit)
        foreign = [name for name in names if name not in fmt.state_names]
        if foreign:
            raise ValueError(
                f"optimizer states {foreign} are not kept by this model's host format "
                f"({fmt.spelled}, states {list(fmt.state_names)}): load a state saved with "
                "the same host_precision (ramflow.offload(..., host_precision=...))"
            )
        return {name: fmt.new_state(name, unit.trainable_numel) for name in names}

    def _unit_state_names(self, unit: Unit) -> tuple[str, ...]:
        """AdamW's states in ``unit``'s host format, made when it is built: see [Note:
        states made before the first step] in ``ramflow.optim.unit_states``."""
        return _state_names(unit)

    def device_state(self, unit: Unit, device: torch.device) -> dict[str, torch.Tensor]:
        """Device copies of ``unit``'s master weights and AdamW states (the unit's trainable
        flat range, on ``device``), for a unit stepped on the device
        (``ramflow.offload(device_optimizer=True)``); the host states are made first if the
        unit was never stepped. Each state ``name`` has its host buffer, which it is copied
        back into, as ``"host_" + name``.

        fp32 masters: ``"master"`` (fp32) and the states in the unit's format. bf16 masters:
        the states (8-bit codes with their scales, bf16, a Kahan compensation) and no
        ``"master"``: the bf16 master is the wire copy, so the unit's device copy is the
        master and is stepped in place. Lean formats step with the host kernel's arithmetic
        in PyTorch ops (the same bits; ``lean_adamw_step_``)."""
        flats = self._flats_with_states(unit)
        n = unit.trainable_numel
        out: dict[str, torch.Tensor] = {}
        if unit.master.dtype == torch.float32:
            out["master"] = unit.master[:n].to(device, copy=True)
        for name in _state_names(unit):
            out[name] = flats[name].to(device, copy=True)
            out["host_" + name] = flats[name]
        return out

    def device_flat_step(
        self,
        unit: Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        weights_out: torch.Tensor,
        piece: int,
        grad_scale: float = 1.0,
    ) -> None:
        """One AdamW step of ``unit`` on the device, run by run of ``flat_runs`` (each with
        its param group's hyperparameters), ``piece`` elements at a time: fp32 masters with
        PyTorch's fused kernel (``torch._fused_adamw_``, as ``torch.optim.AdamW(fused=True)``),
        lean formats with ``lean_adamw_step_`` (the host kernel's bits). ``grad`` (the unit's
        flat gradient: the device's wire-dtype buffer or the host's) is copied to the device
        per piece, and the new weights are written to ``weights_out`` (the unit's device
        copy, wire dtype). ``grad_scale`` (a clip's coefficient, an fp32 value) multiplies
        the gradient first, in fp32: the bits of a step from the scaled gradient."""
        runs = self.flat_runs(unit)
        assert runs is not None
        params = unit.owned[: unit.num_trainable]
        fmt = format_of(unit)
        adamw_for(fmt).device_step(
            fmt,
            state,
            runs=runs,
            settings=[AdamWSettings.of(group) for group in hyper],
            grad=grad,
            weights_out=weights_out,
            piece=piece,
            step=int(self.state[params[0]]["step"]) + 1,
            seed=unit.rounding_seed,
            threads=self.threads,
            grad_scale=grad_scale,
        )
        for p in params:
            self.state[p]["step"].add_(1)

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        lean = [_lean_param(p) for p in params]
        if any(lean):  # parameters of units kept in a lean host format: one at a time
            for p, g, is_lean in zip(params, grads, lean):
                if is_lean:
                    self._lean_param_step(p, g, group)
            keep = [(p, g) for p, g, is_lean in zip(params, grads, lean) if not is_lean]
            params, grads = [p for p, _ in keep], [g for _, g in keep]
            if not params:
                return
        self._adamw(
            params, grads, group, lambda p: self._state_buffers(p, ("exp_avg", "exp_avg_sq"))
        )

    def _lean_param_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """Step one managed parameter of a unit in a lean host format: its range of the
        unit's flat buffers (it starts on a whole block, ``units.unit.ALIGN``), so the bits are
        those of a flat step of the unit. The wire copy follows in the unit's refresh."""
        unit = engine_of_param(p).unit_of(p)
        assert unit is not None
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st.update(self.unit_states.views(p, _state_names(unit), self._new_flats))
        flats = self.unit_states[unit]
        k = next(i for i, q in enumerate(unit.owned) if q is p)
        lo = unit.offsets[k]
        g = grad.detach().reshape(-1)
        if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            g = g.float()
        LEAN.piece(
            format_of(unit),
            unit.master,
            g.contiguous(),
            flats,
            lo,
            lo + p.numel(),
            settings=AdamWSettings.of(group),
            step=int(st["step"]) + 1,
            wire_out=None,
            seed=unit.rounding_seed,
            threads=self.threads,
        )
        st["step"].add_(1)


def _exact(unit: Unit) -> bool:
    """Whether ``unit`` keeps fp32 masters and fp32 states (PyTorch's exact AdamW)."""
    return format_of(unit).is_exact


def _lean_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a managed parameter kept in a lean host format."""
    engine = engine_of_param(p)
    if engine is None:
        return False
    unit = engine.unit_of(p)
    return unit is not None and not _exact(unit)


def _state_names(unit: Unit) -> tuple[str, ...]:
    """Names of AdamW's per-parameter state tensors in ``unit``'s host format."""
    return format_of(unit).state_names


class SGD(HostOptimizer):
    """SGD with optional momentum, dampening and Nesterov momentum (Sutskever et al., 2013),
    over host fp32 master weights, overlapped with backward; PyTorch's fused CPU kernel
    (``torch.optim.SGD(fused=True)``), so its steps are that optimizer's bit for bit.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD`` (the weight
            decay is coupled, L2 added to the gradient).
        overlap: as for ``AdamW``.

    State per parameter: ``momentum_buffer`` (fp32, host) when ``momentum > 0``. Only the
    exact host formats (``host_precision='fp32'``) are stepped; others are refused with a
    ValueError when the optimizer meets the model's parameters. Raises ``ValueError`` for
    out-of-range settings.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        overlap: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"invalid momentum {momentum} or weight_decay {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults, overlap=overlap)

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        momentum = group["momentum"]
        buffers: list[torch.Tensor | None] = []
        for p in params:
            buffers.append(self.state[p].get("momentum_buffer") if momentum else None)
        self._run_kernel(
            _sgd.sgd,
            params=params,
            d_p_list=grads,
            momentum_buffer_list=buffers,
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=False,
        )
        if momentum:
            for p, buf in zip(params, buffers):
                self.state[p]["momentum_buffer"] = buf


__all__ = ["AdamW", "SGD"]
