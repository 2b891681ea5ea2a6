"""Global-norm clipping of offloaded gradients, and its route from ``torch.nn.utils``.

[Note: clipping through torch.nn.utils]
Hugging Face's ``Trainer`` clips, and with ``max_grad_norm=0`` still reads the norm to log
``grad_norm``, through accelerate's ``Accelerator.clip_grad_norm_``, which calls
``torch.nn.utils.clip_grad_norm_`` (transformers 5, accelerate 1.x; with ``max_norm=inf``
for the norm alone). PyTorch's function would scale the gradients by 1 in place (a change
the step policy must assume is a clip) and read ``p.grad`` while steps run during backward
write it. So the first offloaded model replaces ``torch.nn.utils.clip_grad_norm_`` (and
``torch.nn.utils.clip_grad.clip_grad_norm_``) with a route: parameters of no offloaded
model go to PyTorch's function unchanged; any offloaded parameter sends the call to
``ramflow.clip_grad_norm_``, which returns what PyTorch's function returns (within fp32
rounding on the fast path, see [Note: the norm without clipping] in ``ramflow._stepper``)
and clips the same gradients. A module that bound the function by name before ramflow was
imported (``from torch.nn.utils import clip_grad_norm_``) keeps PyTorch's: it still trains
right, with every step deferred. ``remove_clip_route`` puts PyTorch's function back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _torch_clip_module

from ._registry import engine_of_param

_TORCH_CLIP_GRAD_NORM = _torch_clip_module.clip_grad_norm_


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm exactly, as ``torch.nn.utils.clip_grad_norm_``.

    For parameters of offloaded models it first waits for every gradient to land on the
    host. A finite ``max_norm`` tells the engine that this loop clips, so later steps are
    not applied during backward (the norm must be known first). ``max_norm=inf`` with
    ``norm_type=2`` only reads the norm and leaves the gradients as they are, so steps
    still run during backward: after such a pass the norm comes from each unit's device
    gradients (see [Note: the norm without clipping] in ``ramflow._stepper``).

    Returns:
        the total norm of the gradients, an fp32 scalar: on the device when read from the
        device gradients, else on the CPU (from the host gradients).

    Raises:
        RuntimeError: the step was already applied during backward (clipping started after
            the first step); clip from the first step on, or use ``overlap=False``.
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
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
    if norm_only and engines:
        total = _norm_from_device(params, engines)
        if total is not None:
            if error_if_nonfinite and not torch.isfinite(total):
                raise RuntimeError(
                    "the total norm of order 2.0 of the gradients is non-finite, so it cannot "
                    "be clipped; set error_if_nonfinite=False to go on"
                )
            return total
    sharded = [e.dist for e in engines if e.dist is not None and e.dist.zero_stage == 2]
    if sharded:
        return _clip_sharded(params, max_norm, float(norm_type), sharded[0], error_if_nonfinite)
    if norm_only:  # gradients left as they are, so the step policy sees no clip
        return torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None],
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )
    return _TORCH_CLIP_GRAD_NORM(
        params,
        max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
    )


def _norm_from_device(params: list[torch.Tensor], engines: list[Any]) -> torch.Tensor | None:
    """The 2-norm of ``params``' gradients from the units' device gradient norms of the
    last pass, when every engine has them and ``params`` holds all of each engine's
    trainable parameters; None: read the host gradients."""
    norms = [engine.pass_grad_norm() for engine in engines]
    if any(norm is None for norm in norms):
        return None
    given = {id(p) for p in params}
    for k, engine in enumerate(engines):
        trainable = [p for u in engine.units for p in u.owned[: u.num_trainable]]
        if not all(id(p) in given for p in trainable):
            return None  # a part of the model's gradients: read those on the host
        state = engine.dist
        if state is not None and state.zero_stage == 2:  # each rank holds its own units
            norms[k] = _sum_over_ranks(norms[k], state)
    devices = {n.device for n in norms}
    plain = [p.grad for p in params if engine_of_param(p) is None and p.grad is not None]
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain).float())
        devices.add(norms[-1].device)
    if len(devices) > 1:
        norms = [n.cpu() for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


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
    ``ramflow._dist.DistributedState``): the local norms are combined over the ranks (each
    host holds one full set), then every rank scales its own share."""
    grads = [p.grad for p in params if p.grad is not None]
    if norm_type == 2.0:
        local = sum(
            (g.double().pow(2).sum().cpu() for g in grads), torch.zeros((), dtype=torch.float64)
        )
        dist.all_reduce(local, group=state.cpu_group)
        total = (local / state.copies).sqrt().float()
    elif norm_type == float("inf"):
        local = max(
            (g.abs().max().double().cpu() for g in grads),
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


def install_clip_route() -> None:
    """Send ``torch.nn.utils.clip_grad_norm_`` calls for offloaded parameters to
    ``ramflow.clip_grad_norm_`` (idempotent). See [Note: clipping through torch.nn.utils]."""
    torch.nn.utils.clip_grad_norm_ = _routed_clip_grad_norm_
    _torch_clip_module.clip_grad_norm_ = _routed_clip_grad_norm_


def remove_clip_route() -> None:
    """Put PyTorch's ``torch.nn.utils.clip_grad_norm_`` back (``install_clip_route``'s undo)."""
    torch.nn.utils.clip_grad_norm_ = _TORCH_CLIP_GRAD_NORM
    _torch_clip_module.clip_grad_norm_ = _TORCH_CLIP_GRAD_NORM
