"""Several ranks: ``ramflow.distributed``.

Owns the engine under torch.distributed (gradient reduction, ZeRO-1/2 ownership of optimizer
states and gradients, the one host store that the ranks of a host share, its files in shared
memory) and the public functions for loops that build their own per-rank optimizers
(``zero_param_groups``, ``shard_gradients``, ``broadcast_params``).

May import: ``optim``, ``layers``, ``engine`` and everything below them.
"""

from .data_parallel import RankParamGroups, broadcast_params, shard_gradients, zero_param_groups

__all__ = ["RankParamGroups", "broadcast_params", "shard_gradients", "zero_param_groups"]
