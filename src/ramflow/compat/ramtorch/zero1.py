"""``ramtorch.zero1`` on ``ramflow.distributed``."""

from __future__ import annotations

from typing import Any

from ...distributed import RankParamGroups, broadcast_params, zero_param_groups


def create_zero_param_groups(param_groups: Any, world_size: int) -> RankParamGroups:
    """RamTorch's ZeRO-1 split (``{rank: [group, ...]}``), balanced by size, with the
    parameters of one ``Linear`` on one rank; gradients are summed over the ranks (see
    ``ramflow.distributed.zero_param_groups``)."""
    return zero_param_groups(param_groups, world_size, average=False)


def broadcast_zero_params(rank_param_groups: RankParamGroups, async_op: bool = True) -> None:
    """After the step, bring ordinary parameters in sync from their owners; ``Linear``
    layers are already current. ``async_op`` is accepted; the call returns when done."""
    broadcast_params(rank_param_groups)


__all__ = ["broadcast_zero_params", "create_zero_param_groups"]
