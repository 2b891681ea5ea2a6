"""Where a ``ramflow train`` step holds its gradients between backward and the step, and
so how its optimizer is built and what its plan counts.

[Note: the gradients of a CLI step]
A unit's gradient lands on the host and is stepped at once (during backward, the eager
overlap) or held until ``opt.step()`` (a deferred step: the clip needs every gradient
first). What the run holds decides the host peak, so the optimizer's flags and the plan's
host bytes come from one decision, ``GradientHolding.of``:

- Lean host formats (masters not exact under the gradient ring,
  ``HostPrecision.compact_deferred``), AdamW, one process, bf16 or fp32 compute: the
  optimizer is ``AdamW(keep_grads=False, clips=...)``. A clipped run holds each unit's
  gradient in 8-bit codes (``formats.deferred_grad``, 1 + 4/256 bytes per parameter) from
  the first step on. An unclipped run steps every unit as its gradient lands, the first
  step included, and keeps no gradient buffer: with ``--grad-accum`` through the unit-major
  order (``setup.runs_unit_major``), whose passes end each unit's gradient before it lands.
  Where that order is not taken (MoE router logits recorded for an auxiliary loss: the
  micro-batches then accumulate in ``opt.no_step()``) or where ``--batch-size auto`` runs
  trial passes under ``no_step``, the run says it clips (``clips=True``: no pass is eager)
  and holds codes, which the plan counts: accumulating codes and then stepping eagerly
  would widen them into the master's dtype. The lean formats are approximate already; the
  codes' accuracy is measured in docs/host-precision.md.
- Otherwise (exact fp32 masters, another optimizer, several ranks, fp16's loss scaling,
  LoRA): as before, steps during backward only where ``TrainConfig.steps_during_backward``
  allows them (several ranks, no clipping, no accumulation, no fp16), else a full buffer in
  the master's dtype (``p.grad``) that the plan counts.

An eager step cannot be taken back, so on one process an out-of-memory error in a backward
that had already stepped units ends the run with what to pass (see [Note: backing off after
an out-of-memory error] in ``backoff.py``); one in forward, or before any unit stepped,
backs off as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.host import HostPrecision
from .config import TrainConfig

__all__ = ["GradientHolding"]


@dataclass(frozen=True)
class GradientHolding:
    """How a run's AdamW (or other ``ramflow.optim`` optimizer) is built and which
    gradients its steps hold. See [Note: the gradients of a CLI step].

    Attributes:
        overlap: the optimizer may step units during backward (``overlap``).
        keep_grads: the optimizer writes ``p.grad`` (AdamW's ``keep_grads``).
        clips: the optimizer is told that the loop clips (AdamW's ``clips``): no pass is
            eager from the first step, each unit's gradient is held in 8-bit codes.
        deferred: the run holds its gradients between backward and the step at least once
            (clipping, accumulation, a first step, trial passes): counted in the plan's host
            bytes, in codes where not ``keep_grads``, in the master's dtype where it is.
    """

    overlap: bool
    keep_grads: bool
    clips: bool
    deferred: bool

    @property
    def held_gradients(self) -> str | None:
        """``estimate_memory``'s ``held_gradients``: None, ``"grads"`` or ``"codes"``."""
        if not self.deferred:
            return None
        return "grads" if self.keep_grads else "codes"

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        precision: HostPrecision,
        *,
        several_ranks: bool,
        unit_major: bool,
    ) -> GradientHolding:
        """The holding of a run of ``config`` under the host formats ``precision`` (auto
        decided), on several ranks or one, whose accumulation runs unit-major
        (``setup.runs_unit_major``) or not."""
        compact = (
            precision.compact_deferred
            and config.optimizer == "adamw"
            and not several_ranks
            and config.precision != "fp16"
            and config.lora_rank is None
        )
        if compact:
            eager = config.clip_grad == 0 and unit_major and not config.auto_batch_size
            return cls(overlap=True, keep_grads=False, clips=not eager, deferred=not eager)
        eager = config.steps_during_backward(several_ranks=several_ranks)
        return cls(
            overlap=config.clip_grad > 0 or eager,
            keep_grads=not eager,
            clips=False,
            deferred=not eager,
        )
