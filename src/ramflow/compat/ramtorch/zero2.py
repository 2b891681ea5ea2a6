"""``ramtorch.zero2`` on ``ramflow.distributed``."""

from __future__ import annotations

from typing import Any

from ...distributed import RankParamGroups, shard_gradients


def setup_grad_sharding_hooks(rank_param_groups: RankParamGroups, current_rank: int) -> list[Any]:
    """ZeRO-2: each gradient is reduced to the rank that owns it; the others drop it
    (``ramflow.distributed.shard_gradients``). Returns hook handles."""
    return shard_gradients(rank_param_groups, current_rank)


__all__ = ["setup_grad_sharding_hooks"]
