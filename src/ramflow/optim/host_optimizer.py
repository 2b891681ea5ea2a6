"""The machinery every ramflow optimizer shares: param groups over offloaded and plain
parameters (which engine holds each, see [Note: parameters that change hands]), the engine's
hooks (``StepOptimizer``) and the state round trip. The flat per-unit state buffers are a
``UnitStates`` (``optim/unit_states.py``) that the optimizer holds. ``ramflow.optim.AdamW``,
``SGD``, ``Lion``, ``Adafactor`` and ``Muon`` subclass ``HostOptimizer`` and give it their
arithmetic (``_update``, and for AdamW a flat step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import adam as _adam

from ..engine.engine import Engine
from ..formats.host import check_optimizer_formats, saved_state_shape, upgrade_legacy_state
from ..layers.linear import attach_pending
from ..units.registry import engine_of_param
from ..units.unit import Unit
from .unit_states import UnitStates, format_of


class HostOptimizer(torch.optim.Optimizer):
    """Shared machinery of ramflow's optimizers; use ``AdamW``, ``SGD``, ``Lion``,
    ``Adafactor`` or ``Muon``."""

    _ramflow_host_optimizer = True  # the engine's plain-optimizer hooks leave it alone

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        overlap: bool,
        keep_grads: bool = True,
        clips: bool = False,
    ) -> None:
        self.overlap = overlap
        self.keep_grads = keep_grads
        self.clips = clips
        self.no_step_depth = 0
        self._group_of: dict[int, int] = {}
        # See [Note: parameters that change hands]
        self._engines: list[Engine] = []
        self._probes: list[torch.Tensor] = []  # one parameter of each engine, in its order
        self._unmanaged: list[torch.Tensor] = []
        self.unit_states = UnitStates()  # the offloaded units' flat optimizer states
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
        for engine in self._engines:
            self._make_unit_states(engine)

    def _unit_state_names(self, unit: Unit) -> tuple[str, ...]:
        """Names of the flat states this optimizer keeps for ``unit`` and makes when it
        is built (see [Note: states made before the first step] in
        ``ramflow.optim.unit_states``); () (the default) makes them at the first step."""
        return ()

    def _make_unit_states(self, engine: Engine) -> None:
        """Make the flat states of ``engine``'s units that this process steps and this
        optimizer holds parameters of, unless made already (taking those an older
        optimizer made and never used). See [Note: states made before the first step]
        in ``ramflow.optim.unit_states``."""
        donors = [
            o for o in engine.stepper.optimizers if o is not self and isinstance(o, HostOptimizer)
        ]
        for u in engine.units:
            if u in self.unit_states or not u.num_trainable or not engine.stepper.steps_here(u):
                continue
            params = u.owned[: u.num_trainable]
            if not any(self.holds(p) for p in params):
                continue
            names = self._unit_state_names(u)
            if not names:
                continue
            flats = next(
                (
                    f
                    for o in donors
                    if (f := o.unit_states.give_unused(u, names, o.state)) is not None
                ),
                None,
            )
            self.unit_states.put(u, flats if flats is not None else self._new_flats(u, names))

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
                self.unit_states.drop(engine.units)
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
            self._warn_no_device_step(engine)
            engine.attach(self)

    def _warn_no_device_step(self, engine: Engine) -> None:
        """Warn when the user asked ``engine`` to step units on the device
        (``device_optimizer=True``) and this optimizer has no device step (only AdamW has
        one): those units are stepped on the CPU instead, once their gradients are on the
        host, and the device memory planned for their states goes unused. Under the
        planner's choice (``device_optimizer=None``, the default) the same happens without
        a word: nothing the user asked for is ignored."""
        if hasattr(self, "device_flat_step"):  # as the stepper asks (``DeviceStepper.steppable``)
            return
        if engine.options.device_optimizer is not True:
            return
        planned = sum(u.device_stepped for u in engine.units)
        if planned:
            warnings.warn(
                f"{type(self).__name__} has no device step: the {planned} units that "
                "ramflow.offload planned to step on the device (device_optimizer) are stepped "
                "on the CPU, and the device memory planned for their states goes unused. "
                "Offload with device_optimizer=False, or use ramflow.optim.AdamW, which steps "
                "them on the device",
                stacklevel=4,
            )

    def _states_to_unit(self, p: torch.Tensor, engine: Engine) -> None:
        """``p`` joined ``engine``: its states (kept as plain tensors) move into its
        unit's flat buffers, in the unit's host format. Nothing to do by default."""

    def _states_to_plain(self, p: torch.Tensor) -> None:
        """``p``'s engine was removed: its states become plain tensors of its dtype and
        device, as a plain optimizer keeps them (fp32 host states copied there; a step
        count stays as it is)."""
        st = self.state.get(p)
        for name, value in list((st or {}).items()):
            if name != "step" and isinstance(value, torch.Tensor):
                st[name] = value.to(p.device, p.dtype, copy=True)

    def _flat_names(self, p: torch.Tensor, state: dict[str, Any]) -> tuple[str, ...]:
        """Names of the states of managed parameter ``p`` that live in its unit's flat
        buffers (``UnitStates.views``), so that ``load_state_dict`` copies them there: by
        default every tensor state but the step count, each of ``p``'s shape or its
        blocks'. An optimizer whose states have other shapes (Adafactor's factored
        second moment) keeps those as plain host tensors."""
        return tuple(k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor))

    def state_shape(self, name: str, param_shape: torch.Size) -> tuple[int, ...]:
        """The shape of state ``name`` of a parameter of ``param_shape`` in a saved state
        (a checkpoint's check): the parameter's, or its blocks' for an 8-bit scale."""
        return saved_state_shape(name, param_shape)

    # ------------------------------------------------------------------ used by the engine

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is in one of this optimizer's param groups."""
        return id(p) in self._group_of

    def hyperparameters(self) -> list[dict[str, Any]]:
        """A copy of every group's settings, taken when a step is scheduled, so that an LR
        scheduler stepping on the main thread never races the worker."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def step_params(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], hyper: list[dict[str, Any]]
    ) -> None:
        """Step ``params`` (host masters this optimizer holds) with ``grads`` (same shapes),
        each with its group's settings in ``hyper`` (``hyperparameters()``, taken earlier)."""
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

    def flat_runs(self, unit: Unit) -> list[tuple[int, int, int]] | None:
        """``unit``'s trainable prefix as runs of consecutive parameters of one param group,
        ``(group index, begin, end)`` in elements, covering it in order (each begin is a
        parameter's offset, so a whole 8-bit block), if this optimizer holds all of them at
        one step count and can step them flat (``flat_step``); else None (the default: the
        optimizer steps parameter by parameter). A flat step, on the host or the device,
        takes each run with its group's hyperparameters (a block's norm weights without
        weight decay, its matrices with)."""
        return None

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
        """Step ``unit``'s trainable prefix in one pass (see ``ramflow.kernels.cpu_kernels``).

        ``pieces``: ``(begin, end)`` element ranges covering the prefix in order, each
        begin a multiple of 64; the kernel runs once per range and ``after_piece(begin,
        end)`` is called after each, so the caller can send the new wire copy of a range
        while the next is stepped. The result does not depend on the pieces.
        ``grad_scale`` (a clip's coefficient, an fp32 value) multiplies the gradient as it
        is read: the bits of a step from ``grad * grad_scale`` (fp32); not with
        ``accumulate`` or ``grad_out``."""
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

    def _adamw(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        group: dict[str, Any],
        new_moments: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    ) -> None:
        """PyTorch's AdamW functional (``_run_kernel``: fused where the build has it) over
        ``params`` with fp32 states; a parameter without states gets a step counter and
        ``new_moments(p)`` (its ``exp_avg`` and ``exp_avg_sq``)."""
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st.update(new_moments(p))
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

    def _new_flats(self, unit: Unit, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """New flat state buffers of ``unit`` (zeros, fp32, trainable prefix) per name."""
        return {n: torch.zeros(unit.trainable_numel, dtype=torch.float32) for n in names}

    def _state_buffers(self, p: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if engine_of_param(p) is not None:
            return self.unit_states.views(p, names, self._new_flats)
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
            self.step_params(params, [p.grad for p in params], self.hyperparameters())
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
        self.no_step_depth += 1
        try:
            yield
        finally:
            self.no_step_depth -= 1

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
        ``state_dict`` starts afresh at its next step (zero moments, step 0). 8-bit
        moments saved before the FP8 code (``exp_avg_absmax``...) are converted to the
        unit's format (``upgrade_legacy_state``).

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
        self.unit_states.clear()
        for p, st in self.state.items():
            if engine_of_param(p) is None:
                continue
            raw = given.get(p, st)
            upgraded = upgrade_legacy_state(format_of(engine_of_param(p).unit_of(p)), raw)
            if upgraded is not raw:  # 8-bit moments saved before the FP8 code: converted
                st.clear()
                st.update(upgraded)
                raw = upgraded
            names = self._flat_names(p, st)
            views = self.unit_states.views(p, names, self._new_flats)
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
            self._make_unit_states(engine)  # units the dict has no states for: zeros
