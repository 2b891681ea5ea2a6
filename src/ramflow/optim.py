"""CPU optimizers over the fp32 master weights of offloaded models.

``AdamW`` and ``SGD`` are ``torch.optim.Optimizer`` subclasses: param groups, LR schedulers,
``state_dict``/``load_state_dict`` and ``zero_grad`` work as usual. For parameters of a
model given to ``ramflow.offload`` they step the host masters on a worker thread, unit by
unit, overlapped with the GPU (see [Note: when the step runs] in ``_stepper.py``); other
parameters are stepped in ``step()`` like a plain optimizer would. The arithmetic is
PyTorch's own: its fused CPU kernels (``torch.optim.adam.adam(..., fused=True)``), with a
fallback to the single-tensor path where fused is not available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import adam as _adam
from torch.optim import sgd as _sgd

from ._cpu_kernels import _check_threads, odd_tails
from ._engine import Engine
from ._format_steps import LEAN, AdamWSettings, adamw_for
from ._host_formats import (
    FP32,
    HostPrecision,
    check_optimizer_formats,
    moments_into,
    moments_to_plain,
)
from ._linear import attach_pending
from ._registry import engine_of_param
from ._units import _Unit


class HostOptimizer(torch.optim.Optimizer):
    """Shared machinery of ramflow's optimizers; use ``AdamW`` or ``SGD``."""

    _ramflow_host_optimizer = True  # the engine's plain-optimizer hooks leave it alone

    def __init__(
        self, params: Iterable, defaults: dict[str, Any], *, overlap: bool, keep_grads: bool = True
    ) -> None:
        self.overlap = overlap
        self.keep_grads = keep_grads
        self._no_step_depth = 0
        self._group_of: dict[int, int] = {}
        # See [Note: parameters that change hands]
        self._engines: list[Engine] = []
        self._probes: list[torch.Tensor] = []  # one parameter of each engine, in its order
        self._unmanaged: list[torch.Tensor] = []
        self._unit_state: dict[_Unit, dict[str, torch.Tensor]] = {}
        self._fused_ok = True
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):
            param_group["params"] = list(params)  # read twice below
        attach_pending([param_group])  # ramflow.Linear layers that have not run yet
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        params = self.param_groups[-1]["params"]
        for p in params:
            self._group_of[id(p)] = index
        self._unmanaged.extend(params)  # until sorted, just below
        self._sort_params(params)

    # [Note: parameters that change hands]
    # A parameter keeps its identity through ``ramflow.offload`` and ``ramflow.undo``, so
    # this optimizer may outlive the engine that held its parameters when it was built, or
    # be built before one takes them. Before it steps, zeroes or saves, it checks that each
    # engine it knows still holds its parameters (one registry look-up per engine: ``undo``
    # releases all of an engine's parameters at once) and that no engine took one of the
    # unmanaged parameters (one look-up each; those are stepped here anyway). If either
    # changed, it sorts every parameter again: a new engine is attached, and the states of
    # a parameter that changed hands are moved (``_states_to_unit``, ``_states_to_plain``),
    # so that it steps on exactly as an optimizer built after the change would.

    def _follow_engines(self) -> None:
        """Sort the parameters again if an engine released some or took an unmanaged one
        (see [Note: parameters that change hands]). Raises ValueError as ``_sort_params``."""
        released = any(engine_of_param(p) is not e for e, p in zip(self._engines, self._probes))
        if released or any(engine_of_param(p) is not None for p in self._unmanaged):
            self._sort_params()

    def _sort_params(self, params: list[torch.Tensor] | None = None) -> None:
        """Sort the parameters into those of engines (stepped by the engine, states in
        its units' flat buffers) and unmanaged ones (stepped in ``step()``), moving the
        states of those that changed hands. ``params``: only these, unmanaged so far (a
        new param group), while every engine known holds its parameters; None: all.

        Raises:
            ValueError: a new engine keeps its parameters in host formats this optimizer
                has no step for (``check_optimizer_formats``); nothing is changed then.
        """
        kept = [(e, p) for e, p in zip(self._engines, self._probes) if engine_of_param(p) is e]
        kept_ids = {id(e) for e, _ in kept}
        was_unmanaged = {id(p) for p in self._unmanaged}
        if params is None or len(kept) < len(self._engines):
            params = [p for g in self.param_groups for p in g["params"]]
        owners = [engine_of_param(p) for p in params]
        new: dict[int, tuple[Engine, torch.Tensor]] = {}
        for p, engine in zip(params, owners):
            if engine is not None and id(engine) not in kept_ids:
                new.setdefault(id(engine), (engine, p))
        for engine, _ in new.values():
            check_optimizer_formats(engine.host.precision, self)
        for engine in self._engines:
            if id(engine) not in kept_ids:  # removed by ramflow.undo
                for u in engine.units:
                    self._unit_state.pop(u, None)
        self._engines = [e for e, _ in kept] + [e for e, _ in new.values()]
        self._probes = [p for _, p in kept] + [p for _, p in new.values()]
        resorted = {id(p) for p in params}
        self._unmanaged = [p for p in self._unmanaged if id(p) not in resorted]
        for p, engine in zip(params, owners):
            moved = id(p) in was_unmanaged or engine is None or id(engine) not in kept_ids
            if moved and id(p) not in was_unmanaged:
                self._states_to_plain(p)  # its engine was removed
            if engine is None:
                self._unmanaged.append(p)
            elif moved:
                self._states_to_unit(p, engine)
        for engine, _ in new.values():
            engine.attach(self)

    def _states_to_unit(self, p: torch.Tensor, engine: Engine) -> None:
        """``p`` joined ``engine``: its states (kept as plain tensors) move into its
        unit's flat buffers, in the unit's host format. Nothing to do by default."""

    def _states_to_plain(self, p: torch.Tensor) -> None:
        """``p``'s engine was removed: its states become plain tensors of its dtype and
        device, as a plain optimizer keeps them. Nothing to do by default."""

    # ------------------------------------------------------------------ used by the engine

    def _holds(self, p: torch.Tensor) -> bool:
        return id(p) in self._group_of

    def _hyperparameters(self) -> list[dict[str, Any]]:
        """A copy of every group's settings, taken when a step is scheduled, so that an LR
        scheduler stepping on the main thread never races the worker."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _step_params(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], hyper: list[dict[str, Any]]
    ) -> None:
        by_group: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p, g in zip(params, grads):
            ps, gs = by_group.setdefault(self._group_of[id(p)], ([], []))
            ps.append(p)
            gs.append(g)
        with torch.no_grad():
            for index, (ps, gs) in sorted(by_group.items()):
                self._update(ps, gs, hyper[index])

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        raise NotImplementedError

    def flat_group(self, unit: _Unit) -> int | None:
        """The param group index if this optimizer can step ``unit``'s trainable prefix as
        one flat buffer (it holds all of them, in one group, at one step count), else None."""
        return None

    def flat_runs(self, unit: _Unit) -> list[tuple[int, int, int]] | None:
        """``unit``'s trainable prefix as runs of consecutive parameters of one param group,
        ``(group index, begin, end)`` in elements, covering it in order (each begin is a
        parameter's offset, so a whole 8-bit block), if this optimizer holds all of them at
        one step count; else None. A device step takes each run with its group's
        hyperparameters (a block's norm weights without weight decay, its matrices with)."""
        return None

    def flat_step(
        self,
        unit: _Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        accumulate: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        wire_out: torch.Tensor | None = None,
        pieces: list[tuple[int, int]] | None = None,
        after_piece: Callable[[int, int], None] | None = None,
    ) -> None:
        """Step ``unit``'s trainable prefix in one pass (see ``ramflow._cpu_kernels``).

        ``pieces``: ``(begin, end)`` element ranges covering the prefix in order, each
        begin a multiple of 64; the kernel runs once per range and ``after_piece(begin,
        end)`` is called after each, so the caller can send the new wire copy of a range
        while the next is stepped. The result does not depend on the pieces."""
        raise NotImplementedError

    def _run_kernel(self, fn: Callable[..., None], **kwargs: Any) -> None:
        """Call a torch.optim functional with the fused kernel, or without it where the
        build has none for these tensors (decided once)."""
        if self._fused_ok:
            try:
                fn(fused=True, foreach=False, **kwargs)
                return
            except RuntimeError as err:
                if "fused" not in str(err).lower() and "support" not in str(err).lower():
                    raise
                self._fused_ok = False
        fn(fused=False, foreach=False, **kwargs)

    def _flat_state(self, p: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """State tensors of a managed parameter: views into one flat buffer per unit and
        name, so that a unit's optimizer states are contiguous like its masters. A buffer
        of ``unit.trainable_numel`` elements gives the parameter's shape; a per-block one
        (the absmax of 8-bit states) gives the parameter's blocks, 1-D (parameters start on
        whole blocks, ``_units._ALIGN``): ``HostPrecision.state_view``."""
        engine = engine_of_param(p)
        unit = engine.unit_of(p)
        assert unit is not None
        flats = self._unit_state.get(unit)
        if flats is None:
            flats = self._unit_state[unit] = {}
        missing = tuple(n for n in names if n not in flats)
        if missing:
            flats.update(self._new_flats(unit, missing))
        k = next(i for i, q in enumerate(unit.owned) if q is p)
        off = unit.offsets[k]
        out = {}
        for n in names:
            flat = flats[n]
            if flat.numel() == unit.trainable_numel:
                out[n] = flat[off : off + p.numel()].view(p.shape)
            else:
                out[n] = _format(unit).state_view(n, flat, off, off + p.numel())
        return out

    def _new_flats(self, unit: _Unit, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """New flat state buffers of ``unit`` (zeros, fp32, trainable prefix) per name."""
        return {n: torch.zeros(unit.trainable_numel, dtype=torch.float32) for n in names}

    def _state_buffers(self, p: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if engine_of_param(p) is not None:
            return self._flat_state(p, names)
        return {n: torch.zeros_like(p, memory_format=torch.preserve_format) for n in names}

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply (or, for offloaded units, schedule) one step.

        Offloaded units are stepped on the worker thread; ``step`` returns before they are
        done, and each unit's next forward waits for its own step. Call
        ``ramflow.synchronize(model)`` (or ``model.state_dict()``) to read the new weights.
        Parameters offloaded after this optimizer was built, or given back by
        ``ramflow.undo``, are stepped as by an optimizer built now, with their states.

        Raises:
            ValueError: parameters were offloaded since this optimizer was built in host
                formats it has no step for (``ramflow.optim.SGD`` on lean formats).
            RuntimeError: the loop broke a rule of the overlapped step (see
                [Note: when the step runs]), or a worker step failed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_engines()
        for engine in self._engines:
            engine.schedule_step(self)
        params = [p for p in self._unmanaged if p.grad is not None]
        if params:
            self._step_params(params, [p.grad for p in params], self._hyperparameters())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Zeroing in place first waits for the
        steps in flight, which read the gradients. Nothing of the last backward pass lands
        afterwards, a failed one included; after a loop-pattern ``RuntimeError`` (a second
        backward before ``step``, clipping begun late) it also lets training go on, with
        the optimizer's states as they are. Raises ValueError as ``step`` does for
        parameters offloaded since in host formats this optimizer has no step for."""
        self._follow_engines()
        for engine in self._engines:
            engine.on_zero_grad()
        if not set_to_none:
            for engine in self._engines:
                engine.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients: use it for the non-final
        micro-batches of gradient accumulation (like DDP's ``no_sync``), so that the final
        backward can still step each unit as soon as its gradients land."""
        self._no_step_depth += 1
        try:
            yield
        finally:
            self._no_step_depth -= 1

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``, once the steps in flight are done.
        Raises ValueError as ``step`` does for parameters offloaded since in host formats
        this optimizer has no step for."""
        self._follow_engines()
        for engine in self._engines:
            engine.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; managed states are copied into the
        flat per-unit buffers so they stay contiguous, from the tensors given (PyTorch's
        load casts floating-point states to their parameter's dtype, which would round
        fp32 states of bf16 master weights). As in PyTorch, a parameter without state in
        ``state_dict`` starts afresh at its next step (zero moments, step 0).

        Raises:
            ValueError: as ``torch.optim.Optimizer.load_state_dict`` (other param groups),
                or a managed state's dtype or shape is not the one its host format keeps
                (a state saved with another ``host_precision``).
        """
        self._follow_engines()
        for engine in self._engines:
            engine.synchronize()
        saved_ids = [i for g in state_dict.get("param_groups", ()) for i in g["params"]]
        current = [p for g in self.param_groups for p in g["params"]]
        given = {
            p: state_dict["state"][i]
            for i, p in zip(saved_ids, current)
            if i in state_dict.get("state", {})
        }
        super().load_state_dict(state_dict)
        # new flat buffers: the old ones hold the states of parameters the loaded dict has
        # none for, which must start from zero (the tensors in ``given`` keep theirs alive)
        self._unit_state.clear()
        for p, st in self.state.items():
            if engine_of_param(p) is None:
                continue
            raw = given.get(p, st)
            names = tuple(k for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor))
            views = self._flat_state(p, names)
            for n, view in views.items():
                if tuple(raw[n].shape) != tuple(view.shape) or raw[n].dtype != view.dtype:
                    raise ValueError(
                        f"optimizer state {n!r} of a parameter of shape {tuple(p.shape)} is "
                        f"{raw[n].dtype} {tuple(raw[n].shape)}, but this model's host format "
                        f"keeps it as {view.dtype} {tuple(view.shape)}: load a state saved "
                        "with the same host_precision (ramflow.offload(..., host_precision=...))"
                    )
                view.copy_(raw[n])
                st[n] = view
        for engine in self._engines:
            engine.drop_device_states()  # the next device step uploads the loaded states


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
            ``p.grad`` None either way: the ring keeps no full gradient buffer.
        threads: CPU threads of the step over the host masters (ramflow's native AdamW
            kernel), an int >= 1; None (the default) is ``torch.get_num_threads()``. The
            step is bound by DRAM, so leaving a core or two to a data loader costs little;
            see benchmarks/results/2026-11-22-nvidia-h200-optimizer-threads. The result
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
        threads: int | None = None,
    ) -> None:
        _check_threads(threads)
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
        super().__init__(params, defaults, overlap=overlap, keep_grads=keep_grads)

    def flat_group(self, unit: _Unit) -> int | None:
        params = unit.owned[: unit.num_trainable]
        if not params:
            return None
        groups = {self._group_of.get(id(p)) for p in params}
        if len(groups) != 1 or None in groups:
            return None
        steps = {float(self.state[p]["step"]) if self.state.get(p) else 0.0 for p in params}
        return groups.pop() if len(steps) == 1 else None

    def flat_runs(self, unit: _Unit) -> list[tuple[int, int, int]] | None:
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
        unit: _Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        accumulate: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        wire_out: torch.Tensor | None = None,
        pieces: list[tuple[int, int]] | None = None,
        after_piece: Callable[[int, int], None] | None = None,
    ) -> None:
        index = self.flat_group(unit)
        assert index is not None
        params = unit.owned[: unit.num_trainable]
        fmt = _format(unit)
        adamw_for(fmt).host_step(
            fmt,
            unit.master,
            grad,
            self._unit_states(unit),
            pieces=pieces or [(0, unit.trainable_numel)],
            settings=AdamWSettings.of(hyper[index]),
            step=int(self.state[params[0]]["step"]) + 1,
            accumulate=accumulate,
            grad_out=grad_out,
            wire_out=wire_out,
            tails=odd_tails(unit.offsets, [p.numel() for p in params]),
            seed=unit.rounding_seed,
            threads=self.threads,
            after_piece=after_piece,
        )
        for p in params:
            self.state[p]["step"].add_(1)

    def _unit_states(self, unit: _Unit) -> dict[str, torch.Tensor]:
        """The flat host states of ``unit`` (trainable prefix, in its host format; see
        ``_state_names``), with every parameter's state made first if it has none yet."""
        names = _state_names(unit)
        for p in unit.owned[: unit.num_trainable]:
            if not self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p].update(self._flat_state(p, names))
        return self._unit_state[unit]

    def _states_to_unit(self, p: torch.Tensor, engine: Engine) -> None:
        """``p`` joined ``engine`` with states (stepped before ``offload``, or before an
        ``undo`` and a new ``offload``): they move into its unit's flat buffers, in the
        unit's host format. See [Note: parameters that change hands]."""
        st = self.state.get(p)
        unit = engine.unit_of(p)
        if not st or unit is None or not any(q is p for q in unit.owned[: unit.num_trainable]):
            return  # no state, or a frozen parameter: never stepped by the unit
        st.update(moments_into(_format(unit), st, self._flat_state(p, _state_names(unit))))

    def _states_to_plain(self, p: torch.Tensor) -> None:
        """``p``'s engine was removed (``ramflow.undo``): its moments become plain tensors.
        See [Note: parameters that change hands]."""
        st = self.state.get(p)
        if st and "exp_avg" in st:
            moments_to_plain(st, p, plain=engine_of_param(p) is None)

    def _new_flats(self, unit: _Unit, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """New flat states of ``unit`` in its host format (``HostPrecision.new_state``)."""
        fmt = _format(unit)
        return {name: fmt.new_state(name, unit.trainable_numel) for name in names}

    def device_state(self, unit: _Unit, device: torch.device) -> dict[str, torch.Tensor]:
        """Device copies of ``unit``'s master weights and AdamW states (the unit's trainable
        flat range, on ``device``), for a unit stepped on the device
        (``ramflow.offload(device_optimizer=True)``); the host states are made first if the
        unit was never stepped. Each state ``name`` has its host buffer, which it is copied
        back into, as ``"host_" + name``.

        fp32 masters: ``"master"`` (fp32) and the states in the unit's format. bf16 masters:
        the states (8-bit codes with their absmax, bf16, a Kahan compensation) and no
        ``"master"``: the bf16 master is the wire copy, so the unit's device copy is the
        master and is stepped in place. Lean formats step with the host kernel's arithmetic
        in PyTorch ops (the same bits; ``lean_adamw_step_``)."""
        flats = self._unit_states(unit)
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
        unit: _Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        weights_out: torch.Tensor,
        piece: int,
    ) -> None:
        """One AdamW step of ``unit`` on the device, run by run of ``flat_runs`` (each with
        its param group's hyperparameters), ``piece`` elements at a time: fp32 masters with
        PyTorch's fused kernel (``torch._fused_adamw_``, as ``torch.optim.AdamW(fused=True)``),
        lean formats with ``lean_adamw_step_`` (the host kernel's bits). ``grad`` (the unit's
        flat gradient: the device's wire-dtype buffer or the host's) is copied to the device
        per piece, and the new weights are written to ``weights_out`` (the unit's device
        copy, wire dtype)."""
        runs = self.flat_runs(unit)
        assert runs is not None
        params = unit.owned[: unit.num_trainable]
        fmt = _format(unit)
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
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st.update(self._state_buffers(p, ("exp_avg", "exp_avg_sq")))
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        beta1, beta2 = group["betas"]
        self._run_kernel(
            _adam.adam,
            params=params,
            grads=grads,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=[],
            state_steps=steps,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _lean_param_step(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """Step one managed parameter of a unit in a lean host format: its range of the
        unit's flat buffers (it starts on a whole block, ``_units._ALIGN``), so the bits are
        those of a flat step of the unit. The wire copy follows in the unit's refresh."""
        unit = engine_of_param(p).unit_of(p)
        assert unit is not None
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st.update(self._flat_state(p, _state_names(unit)))
        flats = self._unit_state[unit]
        k = next(i for i, q in enumerate(unit.owned) if q is p)
        lo = unit.offsets[k]
        g = grad.detach().reshape(-1)
        if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            g = g.float()
        LEAN.piece(
            _format(unit), unit.master, g.contiguous(), flats, lo, lo + p.numel(),
            settings=AdamWSettings.of(group), step=int(st["step"]) + 1, wire_out=None,
            seed=unit.rounding_seed, threads=self.threads,
        )  # fmt: skip
        st["step"].add_(1)


def _format(unit: _Unit) -> HostPrecision:
    """``unit``'s host formats (fp32 for a unit no store has built yet)."""
    return FP32 if unit.precision is None else unit.precision


def _exact(unit: _Unit) -> bool:
    """Whether ``unit`` keeps fp32 masters and fp32 states (PyTorch's exact AdamW)."""
    return _format(unit).is_exact


def _lean_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a managed parameter kept in a lean host format."""
    engine = engine_of_param(p)
    if engine is None:
        return False
    unit = engine.unit_of(p)
    return unit is not None and not _exact(unit)


def _state_names(unit: _Unit) -> tuple[str, ...]:
    """Names of AdamW's per-parameter state tensors in ``unit``'s host format."""
    return _format(unit).state_names


class SGD(HostOptimizer):
    """SGD with optional momentum and Nesterov, over host fp32 master weights.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        overlap: as for ``AdamW``.

    State per parameter: ``momentum_buffer`` (fp32, host) when ``momentum > 0``.
    Raises ``ValueError`` for out-of-range settings.
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


__all__ = ["AdamW", "SGD", "HostOptimizer"]
