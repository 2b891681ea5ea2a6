"""Data parallelism with ZeRO-1/2 for models built from ``ramflow.Linear`` layers (or any
model with ordinary parameters beside them), in the style of RamTorch's ``zero1``/``zero2``.

A model given whole to ``ramflow.offload(model, zero_stage=...)`` needs none of this: the
engine reduces, shards and shares by itself. These functions are for loops that build their
own per-rank optimizers::

    rank_groups = ramflow.distributed.zero_param_groups(
        [{"params": model.parameters(), "lr": 1e-3}], world_size)      # ZeRO-1
    ramflow.distributed.shard_gradients(rank_groups, rank)             # ZeRO-2 (optional)
    opt = ramflow.optim.AdamW(rank_groups[rank])
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()
        ramflow.distributed.broadcast_params(rank_groups)
        model.zero_grad()

Sharding follows ZeRO (Rajbhandari et al., 2020): stage 1 keeps each parameter's optimizer
states on one rank; stage 2 also keeps its gradients on that rank only. Parameters of a
``ramflow.Linear`` layer are owned per layer (one DMA and one step per layer); after
``opt.step()`` the other ranks reload the layers they did not step, from host memory that
``share_memory()`` made common, or by a broadcast from the owner where it is not.
See [Note: data parallelism on the engine] in ``ramflow.distributed.zero``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..engine.engine import Engine
from ..layers.linear import attach_pending
from ..units.registry import engine_of_param
from .zero import DistributedState, assign_owners, require_initialized

RankParamGroups = dict[int, list[dict[str, Any]]]

# ordinary parameters under ZeRO -> their gradient synchroniser
_SYNCED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _GradientSync:
    """Reduces an ordinary parameter's gradient once it is accumulated (post-accumulate
    hook): all-reduce under ZeRO-1, reduce to the owner under ZeRO-2 (others drop it)."""

    def __init__(self, p: torch.Tensor, owner: int, average: bool) -> None:
        self.owner = owner
        self.average = average
        self.zero_stage = 1
        self.handle = p.register_post_accumulate_grad_hook(self)

    def __call__(self, p: torch.Tensor) -> None:
        grad = p.grad
        assert grad is not None
        world = dist.get_world_size()
        if self.average:
            grad.mul_(1.0 / world)
        if self.zero_stage == 2:
            dist.reduce(grad, dst=self.owner)
            if dist.get_rank() != self.owner:
                p.grad = None
        else:
            dist.all_reduce(grad)


def zero_param_groups(
    param_groups: Iterable[dict[str, Any]] | Iterable[torch.Tensor],
    world_size: int,
    *,
    average: bool = True,
) -> RankParamGroups:
    """Split param groups into one list of groups per rank (ZeRO-1) and, when
    torch.distributed is initialized, set up the gradient reduction that goes with it.

    Each rank's list has one group per input group, with the same settings (lr, weight
    decay, ...) and that rank's share of the parameters; build each rank's optimizer from
    its own list. Shares are balanced by element count, largest first, the same on every
    rank; the parameters of one ``ramflow.Linear`` (one offloaded unit) share an owner.

    From then on every gradient is reduced over the ranks as soon as it is complete
    (all-reduce; averaged over the ranks when ``average``, summed otherwise: RamTorch's
    loops divide the loss by the world size themselves), each ``ramflow.Linear`` is stepped
    only by its owner, and ``opt.step()`` brings the others' copies up to date. Ordinary
    parameters need ``broadcast_params`` after the step.

    Args:
        param_groups: param-group dicts (``{"params": ..., "lr": ...}``) or parameters.
        world_size: number of ranks (``torch.distributed.get_world_size()``).
        average: divide the reduced gradients by the world size (DDP's convention).

    Returns:
        ``{rank: [group, ...]}`` for every rank in ``range(world_size)``.

    Raises:
        ValueError: ``world_size`` < 1, or differs from the initialized process group's.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    groups = [dict(g) if isinstance(g, dict) else {"params": [g]} for g in param_groups]
    for g in groups:
        params = g["params"]
        g["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    attach_pending(groups)
    # items: an offloaded unit (all its parameters) or one ordinary parameter
    keys: list[Any] = []
    numel: dict[Any, int] = {}
    for g in groups:
        for p in g["params"]:
            engine = engine_of_param(p)
            unit = engine.unit_of(p) if engine is not None else None
            key = unit if unit is not None else p
            if key not in numel:
                keys.append(key)
                numel[key] = 0
            numel[key] += p.numel()
    owners = assign_owners([numel[k] for k in keys], list(range(world_size)))
    owner_of = dict(zip(map(id, keys), owners))
    out: RankParamGroups = {
        r: [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        for r in range(world_size)
    }
    for gi, g in enumerate(groups):
        for p in g["params"]:
            engine = engine_of_param(p)
            unit = engine.unit_of(p) if engine is not None else None
            out[owner_of[id(unit if unit is not None else p)]][gi]["params"].append(p)
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size={world_size} but the process group has {dist.get_world_size()} ranks"
            )
        _install(keys, owners, average)
    return out


def _install(keys: list[Any], owners: list[int], average: bool) -> None:
    engines: list[Engine] = []
    for key, owner in zip(keys, owners):
        if isinstance(key, torch.Tensor):
            sync = _SYNCED.get(key)
            if sync is None:
                _SYNCED[key] = _GradientSync(key, owner, average)
            else:
                sync.owner, sync.average = owner, average
            continue
        key.owner = owner
        engine = engine_of_param(key.owned[0])
        if engine not in engines:
            engines.append(engine)
    for engine in engines:
        if engine.stepper.dist is None:
            engine.stepper.dist = DistributedState(
                zero_stage=1, average=average, reduce_to_owner=True
            )
        else:
            engine.stepper.dist.average = average


def shard_gradients(rank_param_groups: RankParamGroups, rank: int) -> list[Any]:
    """ZeRO-2 on top of ``zero_param_groups``: each gradient is reduced to its owner rank
    only, and the other ranks drop it (no D2H copy, no host buffer for it).

    Args:
        rank_param_groups: what ``zero_param_groups`` returned.
        rank: this process's rank (checked against torch.distributed).

    Returns the hook handles of the ordinary parameters (``handle.remove()`` turns their
    reduction off altogether).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``rank`` is not this process's rank, or a parameter was not given to
            ``zero_param_groups``.
    """
    require_initialized("ramflow.distributed.shard_gradients")
    if rank != dist.get_rank():
        raise ValueError(f"rank={rank} but this process is rank {dist.get_rank()}")
    handles = []
    for groups in rank_param_groups.values():
        for g in groups:
            for p in g["params"]:
                engine = engine_of_param(p)
                if engine is not None:
                    if engine.stepper.dist is None:
                        raise ValueError("call zero_param_groups before shard_gradients")
                    engine.stepper.dist.zero_stage = 2
                    engine.stepper.dist.reduce_to_owner = True
                    continue
                sync = _SYNCED.get(p)
                if sync is None:
                    raise ValueError("call zero_param_groups before shard_gradients")
                sync.zero_stage = 2
                handles.append(sync.handle)
    return handles


@torch.no_grad()
def broadcast_params(rank_param_groups: RankParamGroups) -> None:
    """After ``opt.step()`` on every rank: send each ordinary parameter from its owner to
    the other ranks. Offloaded parameters are already current (``opt.step()`` did it).

    Raises RuntimeError when torch.distributed is not initialized."""
    require_initialized("ramflow.distributed.broadcast_params")
    works = []
    for owner, groups in rank_param_groups.items():
        for g in groups:
            for p in g["params"]:
                if engine_of_param(p) is None:
                    works.append(dist.broadcast(p.data, src=owner, async_op=True))
    for work in works:
        work.wait()


__all__ = ["RankParamGroups", "broadcast_params", "shard_gradients", "zero_param_groups"]
