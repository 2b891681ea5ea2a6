"""Global-norm clipping of offloaded gradients, and its route from ``torch.nn.utils``.

[Note: clipping through torch.nn.utils]
Hugging Face's ``Trainer`` clips, and with ``max_grad_norm=0`` still reads the norm to log
``grad_norm``, through accelerate's ``Accelerator.clip_grad_norm_``. A loop that reads
``p.grad`` itself is wrong on an offloaded model: a step during backward leaves ``p.grad``
None (``keep_grads=False``) or writes it while the worker steps (the fused step), and
PyTorch's function would scale the gradients by 1 in place (a change the step policy must
assume is a clip). So both doors lead to ``ramflow.clip_grad_norm_``, which first settles
the backward pass (every D2H landed) and returns what PyTorch's function returns (within
fp32 rounding on CUDA, see [Note: the norm from the device gradients] in
``ramflow.engine.grad_norms``) and clips the same gradients (in the step, see [Note:
folding the clip into the step] in ``ramflow.engine.grad_scale``):
- ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.clip_grad_norm_``)
  is replaced by a route at the first offloaded model: parameters of no offloaded model go
  to PyTorch's function unchanged. A module that bound the function by name before ramflow
  was imported (``from torch.nn.utils import clip_grad_norm_``) keeps PyTorch's: it still
  trains right, with every step deferred.
- ``accelerate.Accelerator.clip_grad_norm_`` is replaced by a route too, once accelerate is
  imported (checked at each offload and before each forward, so an import after
  ``offload`` is seen before the first backward). accelerate 1.0 to 1.10 reached
  ``torch.nn.utils.clip_grad_norm_``; later versions (1.16 at least) compute the norm from
  ``p.grad`` with ``torch.nn.utils.get_total_norm`` and scale with
  ``clip_grads_with_norm_``, which reads none of the above: eager passes logged a norm of 0
  (``keep_grads=False``) or one read while the units still stepped. The route sends any
  call with an offloaded parameter, after accelerate's ``unscale_gradients`` (as accelerate
  does), to ``ramflow.clip_grad_norm_``, whatever accelerate would do for a single process
  or DDP; FSDP, DeepSpeed and XLA keep accelerate's own clip.
``remove_clip_route`` puts both functions back.

[Note: norms in pieces on the CPU]
A CPU reduction into a wider dtype than its input's (``g.double()``, ``vector_norm(g,
dtype=torch.float32)`` of a bf16 gradient) first copies the whole input in that dtype;
CUDA's reads bf16 in place. So the norm of a host gradient under ZeRO-2 clipping takes
``NORM_PIECE`` elements at a time (``squared_norm``): its scratch is one piece (8 MiB in
fp64), not the tensor. Whole, it made an fp64 copy of each host gradient and of its square
(16 bytes per element of the largest: 17 GB for a 70B model's embedding, on its owner, at
every step). The norms each dispatch keeps ([Note: the norm from the device gradients] in
``ramflow.engine.grad_norms``) are per parameter, as PyTorch's clip takes them: on a CPU run they
upcast one parameter at a time (PyTorch's bits; before, a unit's norm made an fp32 copy of
the whole unit's gradients). A tensor of at most one piece is reduced whole, to the same
bits as before.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _torch_clip_module

from ..units.registry import engine_of_param
from .grad_scale import fold_grad_scale

_TORCH_CLIP_GRAD_NORM = _torch_clip_module.clip_grad_norm_

# elements per piece of a norm taken on the CPU, see [Note: norms in pieces on the CPU]
NORM_PIECE = 1 << 20


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` flat, in pieces of ``NORM_PIECE`` elements on the CPU, whole elsewhere."""
    flat = t.reshape(-1)
    if t.device.type != "cpu" or flat.numel() <= NORM_PIECE:
        return [flat]
    return list(flat.split(NORM_PIECE))


def squared_norm(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of the squares of ``t``'s elements (any shape and float dtype, any device),
    accumulated in ``dtype``: a ``dtype`` scalar on ``t``'s device. On the CPU it upcasts
    one piece at a time (see [Note: norms in pieces on the CPU]).

    Args:
        t: a floating-point tensor of any shape, on any device.
        dtype: the accumulation dtype, at least as wide as ``t``'s (float64 for a
            global norm).

    Returns:
        ``sum(t**2)`` as a 0-dim ``dtype`` tensor on ``t``'s device (PyTorch's bits for
        ``t.to(dtype).pow(2).sum()`` when ``t`` is one piece; summed by piece otherwise).
    """
    total = None
    for piece in _pieces(t):
        part = piece.to(dtype).pow(2).sum()
        total = part if total is None else total + part
    return total


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``t``'s elements as an fp64 scalar on the CPU, without
    a whole ``abs`` copy of ``t`` on the CPU."""
    return torch.stack([p.abs().max() for p in _pieces(t)]).max().double().cpu()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    fold: bool | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm exactly, as ``torch.nn.utils.clip_grad_norm_``.

    For parameters of offloaded models it first waits for every gradient to land on the
    host and clips them there, in place, as PyTorch does. A finite ``max_norm`` tells the
    engine that this loop clips, so later steps are not applied during backward (the norm
    must be known first). ``max_norm=inf`` with ``norm_type=2`` only reads the norm and
    leaves the gradients as they are, so steps still run during backward; its norm comes
    from each parameter's device gradients as the backward pass made them (see [Note: the
    norm from the device gradients] in ``ramflow.engine.grad_norms``).

    ``fold=True`` (or ``RAMFLOW_CLIP_FOLD=1`` where ``fold`` is None; ``ramflow train``
    passes it) makes a real clip cheaper: the 2-norm comes from the device gradients too,
    and each unit's optimizer step applies PyTorch's coefficient ``min(max_norm / (norm +
    1e-6), 1)`` as it reads the gradients, so no pass over the host gradients runs here.
    The gradients then stay unscaled in ``p.grad`` until ``ramflow.synchronize`` (or
    ``zero_grad``): only for a loop that does not read them between the clip and the
    step (see [Note: folding the clip into the step] in ``ramflow.engine.grad_scale``). The
    steps give the same bits as with the gradients scaled first.

    Args:
        parameters: a tensor or an iterable of tensors whose gradients are clipped
            together: offloaded parameters (gradients on the host) and plain ones (any
            device) may be mixed.
        max_norm: the largest total norm allowed (``inf``: only read the norm).
        norm_type: the p of the p-norm (``inf`` for the max norm), as PyTorch's.
        error_if_nonfinite: raise when the total norm is nan or inf, as PyTorch's.
        foreach: passed to PyTorch's function for the plain parameters' gradients.
        fold: apply the coefficient in each unit's step instead of in place (above);
            None: ``RAMFLOW_CLIP_FOLD``.

    Returns:
        the total norm of the gradients, an fp32 scalar: on the device when read from the
        device gradients, else on the CPU (from the host gradients). On the CPU the same
        bits as PyTorch's function; on CUDA within fp32 rounding of them.

    Raises:
        RuntimeError: the step was already applied during backward (clipping started after
            the first step); clip from the first step on, or use ``overlap=False``.
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
        RuntimeError: with ``fold``, a gradient was written in place after an earlier clip
            whose coefficient is still pending (call ``ramflow.synchronize`` between them).
        RuntimeError: a second clip in one step of gradients held in 8-bit codes (an
            AdamW with ``keep_grads=False`` under ``host_precision="lean"``).
        ValueError: gradients held in 8-bit codes and a ``norm_type`` other than 2, or
            only part of such a unit's parameters given.
        NotImplementedError: under ZeRO-2 (gradients sharded over the ranks, whose norms
            are combined with an all-reduce), a ``norm_type`` other than 2 or inf.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engines: list[Any] = []
    for p in params:
        engine = engine_of_param(p)
        if engine is not None and engine not in engines:
            engines.append(engine)
    norm_only = float(max_norm) == math.inf and float(norm_type) == 2.0
    for engine in engines:
        engine.note_clip(norm_only=norm_only)
    total = None
    if fold is None:
        fold = _FOLD
    compact = any(engine.stepper.holds_compact() for engine in engines)
    if compact:  # p.grad is None there: the norm and the scale go through the units
        if float(norm_type) != 2.0:
            raise ValueError(
                f"clip_grad_norm_ with norm_type={norm_type} while the gradients are held in "
                "8-bit codes (an AdamW with keep_grads=False under host_precision='lean'); use "
                "norm_type=2.0, or build the optimizer with keep_grads=True"
            )
        fold = True
    if engines and float(norm_type) == 2.0 and (norm_only or fold):
        total = _norm_from_device(params, engines)
        if total is None and compact:
            total = _norm_from_codes(params)
            if total is None:
                raise RuntimeError(
                    "clip_grad_norm_ ran twice on gradients held in 8-bit codes (an AdamW "
                    "with keep_grads=False under host_precision='lean'), whose norm is read "
                    "from the device gradients before the first clip; clip once per step"
                )
        if error_if_nonfinite and total is not None and not torch.isfinite(total):
            raise RuntimeError(
                "the total norm of order 2.0 of the gradients is non-finite, so it cannot "
                "be clipped; set error_if_nonfinite=False to go on"
            )
    if total is None:
        sharded = [
            e.stepper.dist
            for e in engines
            if e.stepper.dist is not None and e.stepper.dist.zero_stage == 2
        ]
        if sharded:
            return _clip_sharded(params, max_norm, float(norm_type), sharded[0], error_if_nonfinite)
        if not norm_only and not (fold and engines):
            return _TORCH_CLIP_GRAD_NORM(
                params,
                max_norm,
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
                foreach=foreach,
            )
        # gradients left as they are (norm only), or scaled by their steps
        total = torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None],
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )
    if not norm_only:
        _scale(params, float(max_norm), total)
    return total


# "1": clip_grad_norm_'s fold when its caller does not say (a clip's coefficient applied by
# each unit's step, [Note: folding the clip into the step] in ``ramflow.engine.grad_scale``, and
# its norm read from the device gradients); "0" (the default): PyTorch's clip on the host
# gradients, in place, so ``p.grad`` reads as clipped right after the call. Off by default
# until its GPU A/B (benchmarks/trainer_step/clip_phases.py) says what it saves
_FOLD = os.environ.get("RAMFLOW_CLIP_FOLD", "0") == "1"


@torch.no_grad()
def _scale(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Multiply the gradients of ``params`` by PyTorch's clip coefficient for ``total``:
    each offloaded unit whose trainable parameters are all given has its step apply it
    (``fold_grad_scale``), other gradients are scaled in place as PyTorch's
    ``_clip_grads_with_norm_`` does (an fp32 multiply, the same bits)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # PyTorch's arithmetic
    value = float(coef)
    units: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    compact: dict[int, tuple[Any, set[int]]] = {}
    in_place: list[torch.Tensor] = []
    for p in params:
        engine = engine_of_param(p)
        u = engine.unit_of(p) if engine is not None else None
        if u is not None and u.compact_grad is not None and u.compact_grad.held:
            compact.setdefault(id(u), (u, set()))[1].add(id(p))
            continue
        if p.grad is None:
            continue
        if u is None:
            in_place.append(p.grad)
        else:
            units.setdefault(id(u), (u, []))[1].append(p)
    for u, given in units.values():
        if value == 1.0:  # x * 1 is x: nothing to apply
            continue
        whole = len({id(p) for p in given}) == u.num_trainable
        if not (whole and fold_grad_scale(u, value)):
            in_place.extend(p.grad for p in given)
    for u, given in compact.values():
        if len(given) != u.num_trainable:
            raise ValueError(
                f"clip_grad_norm_ was given part of unit {u.name!r}'s parameters, whose "
                "gradients are held together in 8-bit codes (an AdamW with keep_grads=False "
                "under host_precision='lean'): clip all of the model's trained parameters "
                "together, or build the optimizer with keep_grads=True"
            )
        u.compact_grad.scale = value  # the step multiplies as it reads (fp32)
    for g in in_place:
        g.mul_(coef.to(g.device))


def _norm_from_codes(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm of ``params``' gradients where some are held in 8-bit codes and the
    device norms are not this step's (the codes accumulated several backward passes, see
    ``CompactGradient.accumulate``): each held parameter's norm read from its codes (the
    gradient as its step will read it: the codes' rounding, within one E4M3 spacing per
    element and unbiased, is in it), the others' from ``p.grad``, stacked in the order of
    ``params`` as PyTorch stacks its per-tensor norms. None: a held gradient was clipped
    already (its norm is stale)."""
    held: dict[int, dict[int, torch.Tensor]] = {}  # id(unit) -> id(p) -> its norm
    norms: list[torch.Tensor] = []
    for p in params:
        engine = engine_of_param(p)
        u = engine.unit_of(p) if engine is not None else None
        if u is not None and u.compact_grad is not None and u.compact_grad.held:
            if u.compact_grad.scale is not None:
                return None
            if id(u) not in held:
                trained = u.owned[: u.num_trainable]
                spans = [(off, off + t.numel()) for off, t in zip(u.offsets, trained)]
                order = sorted(range(len(spans)), key=lambda k: spans[k])
                found = u.compact_grad.span_norms([spans[k] for k in order])
                held[id(u)] = {id(trained[k]): found[i] for i, k in enumerate(order)}
            norms.append(held[id(u)][id(p)])
        elif p.grad is not None:
            norms.append(torch.linalg.vector_norm(p.grad, dtype=torch.float32).cpu())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def _norm_from_device(params: list[torch.Tensor], engines: list[Any]) -> torch.Tensor | None:
    """The 2-norm of ``params``' gradients from the per-parameter norms of the units'
    device gradients in the last pass (stacked in the order of ``params``, as PyTorch
    stacks its per-tensor norms), when every engine has them; None: read the host
    gradients. Under ZeRO-2 (each rank keeps its own units) ``params`` must hold all of
    the engine's trainable parameters, whose norms are summed over the ranks."""
    found = [engine.stepper.pass_param_norms() for engine in engines]
    if any(norms is None for norms in found):
        return None
    where: dict[int, tuple[Any, torch.Tensor, int]] = {}  # id(p) -> (engine, norms, index)
    for engine, norms in zip(engines, found):
        for u, vec in norms.items():
            for k, p in enumerate(u.owned[: u.num_trainable]):
                where[id(p)] = (engine, vec, k)
    sharded = {
        id(e) for e in engines if e.stepper.dist is not None and e.stepper.dist.zero_stage == 2
    }
    for engine in engines:
        if id(engine) in sharded:
            given = {id(p) for p in params}
            if not all(id(p) in given for u in engine.units for p in u.owned[: u.num_trainable]):
                return None  # a part of the model's gradients: read those on the host
    parts: list[torch.Tensor] = []
    per_rank: dict[int, list[torch.Tensor]] = {}  # ZeRO-2: this rank's parts per engine
    for p in params:
        hit = where.get(id(p))
        if hit is not None:
            engine, vec, k = hit
            (per_rank.setdefault(id(engine), []) if id(engine) in sharded else parts).append(vec[k])
        elif engine_of_param(p) is None:
            if p.grad is not None:
                parts.append(torch.linalg.vector_norm(p.grad, 2.0).float())
        elif p.grad is not None:  # gradients the pass's norms do not cover: read on the
            for engine in engines:  # host, once steps during backward have written them
                engine.worker.wait_idle()
            return None
    for engine in engines:
        if id(engine) in sharded:
            mine = per_rank.get(id(engine), [])
            local = (
                torch.linalg.vector_norm(torch.stack(mine))
                if mine
                else torch.zeros((), dtype=torch.float32, device=engine.device)
            )
            parts.append(_sum_over_ranks(local, engine.stepper.dist))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=engines[0].device)
    first = parts[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in parts]))


def _sum_over_ranks(norm: torch.Tensor, state: Any) -> torch.Tensor:
    """Under ZeRO-2: the 2-norm over the units of every rank from this rank's ``norm`` (of
    the units it keeps); each host holds one full set (``state.copies`` hosts)."""
    total = norm.double().pow(2).cpu()
    dist.all_reduce(total, group=state.cpu_group)
    return (total / state.copies).sqrt().float()


@torch.no_grad()
def _clip_sharded(
    params: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    state: Any,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """Clipping when each rank holds only its share of the gradients (ZeRO-2,
    ``ramflow.distributed.zero.DistributedState``): the local norms are combined over the ranks (each
    host holds one full set), then every rank scales its own share."""
    grads = [p.grad for p in params if p.grad is not None]
    if norm_type == 2.0:
        local = sum(
            (squared_norm(g, torch.float64).cpu() for g in grads),
            torch.zeros((), dtype=torch.float64),
        )
        dist.all_reduce(local, group=state.cpu_group)
        total = (local / state.copies).sqrt().float()
    elif norm_type == float("inf"):
        local = max(
            (_abs_max(g) for g in grads),
            default=torch.zeros((), dtype=torch.float64),
        )
        local = torch.as_tensor(local, dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=state.cpu_group)
        total = local.float()
    else:
        raise NotImplementedError(
            f"clip_grad_norm_ with norm_type={norm_type} under ZeRO-2; use 2.0 or inf"
        )
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


@functools.wraps(_TORCH_CLIP_GRAD_NORM)
def _routed_clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` while ramflow is imported and a model was
    offloaded. See [Note: clipping through torch.nn.utils]."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    route = clip_grad_norm_ if any(engine_of_param(p) is not None for p in params) else None
    return (route or _TORCH_CLIP_GRAD_NORM)(
        params,
        max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
    )


# accelerate's distributed types whose clip is their own (sharded gradients): not routed
_ACCELERATE_OWN_CLIP = ("FSDP", "DEEPSPEED", "XLA")


def _route_accelerate_clip(accelerate_clip: Any) -> Any:
    """``Accelerator.clip_grad_norm_`` that sends offloaded parameters to
    ``ramflow.clip_grad_norm_``. See [Note: clipping through torch.nn.utils]."""

    @functools.wraps(accelerate_clip)
    def routed(accelerator: Any, parameters: Any, max_norm: float, norm_type: float = 2):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        offloaded = any(engine_of_param(p) is not None for p in params)
        if not offloaded or accelerator.distributed_type in _ACCELERATE_OWN_CLIP:
            return accelerate_clip(accelerator, params, max_norm, norm_type=norm_type)
        accelerator.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type=norm_type)

    routed._ramflow_route_of = accelerate_clip  # type: ignore[attr-defined]
    return routed


def install_clip_route() -> None:
    """Send ``torch.nn.utils.clip_grad_norm_`` and, once accelerate is imported,
    ``accelerate.Accelerator.clip_grad_norm_`` calls for offloaded parameters to
    ``ramflow.clip_grad_norm_`` (idempotent; at each offload). See [Note: clipping through
    torch.nn.utils]."""
    torch.nn.utils.clip_grad_norm_ = _routed_clip_grad_norm_
    _torch_clip_module.clip_grad_norm_ = _routed_clip_grad_norm_
    route_accelerate_clip()


def route_accelerate_clip() -> None:
    """Route ``accelerate.Accelerator.clip_grad_norm_`` if accelerate is imported and its
    clip is not routed yet (idempotent and cheap: called before each forward, so an import
    after ``offload`` is seen before the first backward). See [Note: clipping through
    torch.nn.utils]."""
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    current = getattr(accelerator, "clip_grad_norm_", None)
    if current is not None and not hasattr(current, "_ramflow_route_of"):
        accelerator.clip_grad_norm_ = _route_accelerate_clip(current)


def remove_clip_route() -> None:
    """Put PyTorch's ``torch.nn.utils.clip_grad_norm_`` and accelerate's
    ``Accelerator.clip_grad_norm_`` back (``install_clip_route``'s undo)."""
    torch.nn.utils.clip_grad_norm_ = _TORCH_CLIP_GRAD_NORM
    _torch_clip_module.clip_grad_norm_ = _TORCH_CLIP_GRAD_NORM
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    current = getattr(accelerator, "clip_grad_norm_", None)
    if current is not None and hasattr(current, "_ramflow_route_of"):
        accelerator.clip_grad_norm_ = current._ramflow_route_of
