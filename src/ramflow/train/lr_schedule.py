"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

Cosine decay after warmup as in Loshchilov & Hutter, "SGDR" (2017), without restarts; the
shape most LLM recipes use (e.g. the Llama papers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def default_warmup_steps(total_steps: int) -> int:
    """Warmup steps when none are given: a fifth of the run, at most 200, and never 0 (a
    model from random weights takes at most half the peak learning rate at step 1)."""
    return max(1, min(200, total_steps // 5))


def warmup_cosine(
    *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """The LR multiplier for step index ``s`` (0-based: the multiplier of step ``s + 1``).

    Rises linearly over ``warmup_steps`` steps below the peak, ``1 / (warmup_steps + 1)``
    at the first, so that the first step of a model from random weights never takes the
    full learning rate when there is any warmup (with ``warmup_steps=1`` it takes half);
    then 1 at step ``warmup_steps + 1``, falling along a half cosine to ``min_lr_ratio`` at
    ``total_steps``, and staying there.

    Raises:
        ValueError: negative warmup, non-positive total, or a ratio outside [0, 1].
    """
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def multiplier(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        span = max(total_steps - warmup_steps, 1)
        progress = min((s - warmup_steps) / span, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` with the ``warmup_cosine`` multiplier; call its
    ``step()`` after each optimizer step."""
    fn = warmup_cosine(
        warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


__all__ = ["make_scheduler", "warmup_cosine"]
