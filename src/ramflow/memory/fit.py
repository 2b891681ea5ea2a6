"""Training within a budget: the largest micro-batch, and the lightest activation
checkpointing, that fit a device budget, with the gradient accumulation that keeps the
global batch.

[Note: fitting the micro-batch]
The global batch (sequences per optimizer step) is the training recipe and never changes;
the micro-batch is how it is cut, ``global_batch = micro_batch * grad_accum``, so only the
divisors of the global batch are candidates (a step is then exactly ``grad_accum`` equal
micro-batches, and the mean of their mean losses is the global batch's mean loss). Levels
of activation checkpointing are tried lightest first: checkpointing costs about a third
more compute at every micro-batch, so it is used only where no micro-batch fits without
it. Within a level the candidates go from the largest down. Each candidate is first
checked against the estimate (cheap: nothing is allocated), then, where a trial is given,
by a real forward and backward that may raise ``torch.OutOfMemoryError``: estimates are
off by allocator fragmentation and kernels' workspaces, and only a trial step says for
sure. During training, an out-of-memory error takes the next smaller candidate
(``smaller_micro_batch``: half, or the largest divisor below half for an odd size), and the
accumulation grows by the same factor, so the global batch stays what it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..sizes import format_bytes, parse_bytes
from .estimate import BudgetTooSmall

__all__ = ["BatchFit", "BatchTrial", "fit_batch", "micro_batch_candidates", "smaller_micro_batch"]


@dataclass(frozen=True)
class BatchTrial:
    """One candidate ``fit_batch`` looked at.

    Attributes:
        micro_batch: sequences per micro-batch.
        checkpointing: activation checkpointing on.
        estimate_bytes: the estimated device bytes (None: no estimate, or it refused).
        outcome: ``"fits"``, ``"over budget (estimate)"`` or ``"out of memory (trial)"``.
    """

    micro_batch: int
    checkpointing: bool
    estimate_bytes: int | None
    outcome: str


@dataclass(frozen=True)
class BatchFit:
    """What ``fit_batch`` chose.

    Attributes:
        micro_batch: sequences per micro-batch (B).
        grad_accum: micro-batches per optimizer step.
        checkpointing: activation checkpointing on.
        global_batch: sequences per optimizer step, ``micro_batch * grad_accum``.
        device_budget_bytes: the device budget it fitted to (None: no cap).
        trials: every candidate looked at, in order, the chosen one last.
    """

    micro_batch: int
    grad_accum: int
    checkpointing: bool
    global_batch: int
    device_budget_bytes: int | None
    trials: tuple[BatchTrial, ...]

    def describe(self) -> str:
        """One line for the chosen fit, then one per candidate tried. A fit is to the
        device budget only: the lines say so, since the RAM may still refuse the run."""
        budget = (
            "no cap" if self.device_budget_bytes is None else format_bytes(self.device_budget_bytes)
        )
        lines = [
            f"micro-batch {self.micro_batch} x {self.grad_accum} accumulated = global batch "
            f"{self.global_batch}, activation checkpointing "
            f"{'on' if self.checkpointing else 'off'} (device budget {budget})"
        ]
        for t in self.trials:
            est = "" if t.estimate_bytes is None else f", estimate {format_bytes(t.estimate_bytes)}"
            outcome = "fits the device budget" if t.outcome == "fits" else t.outcome
            lines.append(
                f"  tried {t.micro_batch} (checkpointing {'on' if t.checkpointing else 'off'}"
                f"{est}): {outcome}"
            )
        return "\n".join(lines)


def micro_batch_candidates(global_batch: int, *, max_micro_batch: int | None = None) -> list[int]:
    """The divisors of ``global_batch`` up to ``max_micro_batch``, largest first.

    Raises:
        ValueError: ``global_batch`` or ``max_micro_batch`` below 1.
    """
    if global_batch < 1:
        raise ValueError(f"the global batch must be at least 1 sequence, got {global_batch}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise ValueError(f"max_micro_batch must be at least 1, got {max_micro_batch}")
    top = global_batch if max_micro_batch is None else min(global_batch, max_micro_batch)
    return [b for b in range(top, 0, -1) if global_batch % b == 0]


def smaller_micro_batch(micro_batch: int) -> int | None:
    """The micro-batch to back off to after an out-of-memory error: the largest divisor of
    ``micro_batch`` that is at most half of it (so the accumulation grows by a whole
    factor); None for a micro-batch of 1. See [Note: fitting the micro-batch]."""
    for b in range(micro_batch // 2, 0, -1):
        if micro_batch % b == 0:
            return b
    return None


def fit_batch(
    *,
    global_batch: int,
    device_budget_bytes: int | str | None = None,
    estimate: Callable[[int, bool], int] | None = None,
    trial: Callable[[int, bool], None] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    max_micro_batch: int | None = None,
) -> BatchFit:
    """The largest micro-batch, under the lightest activation checkpointing, that fits.

    See [Note: fitting the micro-batch]. Works on any model: the caller says what a
    candidate costs (``estimate``) and how to try one (``trial``).

    Args:
        global_batch: sequences per optimizer step; micro-batches are its divisors.
        device_budget_bytes: the device budget the estimate is held to, bytes or a size string
            (``"12GiB"``); None: no cap, the estimate rules nothing out.
        estimate: ``(micro_batch, checkpointing) -> device bytes``, e.g. from
            ``estimate_memory(...).device_total_bytes``; a ``ValueError`` from it counts
            as over budget. None: no estimate.
        trial: ``(micro_batch, checkpointing) -> None``: a step of micro-batches of that
            size, leaving no gradients behind; it raises ``torch.OutOfMemoryError`` when it
            does not fit. Where gradients accumulate on the device (a plain model), run two
            micro-batches' forward and backward without zeroing between them: the second
            backward holds the first's gradients, as every later micro-batch does. None:
            the estimate decides.
        checkpointing: the levels to try, lightest first (``(False,)`` or ``(True,)`` to
            fix one).
        max_micro_batch: the largest micro-batch to try (default: the global batch).

    Returns:
        A ``BatchFit`` with ``trials`` listing what was looked at.

    Raises:
        BudgetTooSmall: nothing fits (not even a micro-batch of 1 under the heaviest
            checkpointing; the message lists the candidates tried). A ``ValueError``.
        ValueError: bad sizes (an unreadable or negative budget included), no levels.
        TypeError: ``device_budget_bytes`` is neither a number nor a string.
    """
    if device_budget_bytes is not None:
        device_budget_bytes = parse_bytes(device_budget_bytes, what="device_budget_bytes")
    if not checkpointing:
        raise ValueError("give at least one checkpointing level to try, e.g. (False, True)")
    candidates = micro_batch_candidates(global_batch, max_micro_batch=max_micro_batch)
    trials: list[BatchTrial] = []
    for ckpt in checkpointing:
        for b in candidates:
            need = None
            if estimate is not None:
                try:
                    need = estimate(b, ckpt)
                except ValueError:
                    trials.append(BatchTrial(b, ckpt, None, "over budget (estimate)"))
                    continue
                if device_budget_bytes is not None and need > device_budget_bytes:
                    trials.append(BatchTrial(b, ckpt, need, "over budget (estimate)"))
                    continue
            if trial is not None:
                try:
                    trial(b, ckpt)
                except torch.OutOfMemoryError:
                    trials.append(BatchTrial(b, ckpt, need, "out of memory (trial)"))
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    continue
            trials.append(BatchTrial(b, ckpt, need, "fits"))
            return BatchFit(
                micro_batch=b,
                grad_accum=global_batch // b,
                checkpointing=ckpt,
                global_batch=global_batch,
                device_budget_bytes=device_budget_bytes,
                trials=tuple(trials),
            )
    tried = "; ".join(
        f"{t.micro_batch} ({'checkpointed' if t.checkpointing else 'plain'}): {t.outcome}"
        for t in trials
    )
    budget = "" if device_budget_bytes is None else f" of {format_bytes(device_budget_bytes)}"
    # checkpointing is worth suggesting only where no checkpointed level was tried
    hint = "" if any(checkpointing) else ", or turn --checkpointing on"
    raise BudgetTooSmall(
        f"no micro-batch of a global batch of {global_batch} fits the device budget{budget} "
        f"(tried {tried}). Give a larger --gpu-memory or a shorter --seq-len{hint}."
    )
