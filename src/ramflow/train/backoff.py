"""The micro-batches of a training step, and the back-off after an out-of-memory error.

Legend: B = sequences per micro-batch, T = tokens per sequence.

[Note: backing off after an out-of-memory error]
A step is ``grad_accum`` micro-batches of the global batch, read from the data position
where the step began. When a forward or backward raises ``torch.OutOfMemoryError``, the
loop drops what the step accumulated (``opt.zero_grad()``: after a failed backward that
equals skipping it, see [Note: a failed backward] in ``_schedule.py``), rewinds the data to
the step's start, halves the micro-batch and doubles the accumulation
(``ramflow.memory.smaller_micro_batch``), logs an ``oom_backoff`` event and runs the step
again: the global batch, the data order and the schedule are unchanged, so the losses
that follow are those of a run that started at the smaller micro-batch (up to the order in
which accumulation sums). A failed backward cannot be undone where ramflow had already
stepped units during it (the eager overlap); eager steps never run when the gradients are
clipped (the default), and without clipping one process builds the optimizer with
``overlap=False``, so every back-off is exact (several ranks step during backward: see
``TrainConfig.steps_during_backward``). A micro-batch of 1 that runs out of memory
ends the run with the error (nothing smaller is left), and so does any micro-batch of a run
of several ranks (see [Note: several ranks from the CLI] in ``ranks.py``). With ``--batch-size auto`` the
micro-batch the estimate chose is first tried on the data of the first step (forward and
backward, no step), backing off the same way (``ramflow.memory.fit_batch``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..memory.fit import fit_batch, smaller_micro_batch
from ..optim import HostOptimizer
from .config import TrainConfig
from .data import BatchStream
from .loss import lm_loss
from .precision import ComputePolicy
from .report import RunReport
from .setup import PreparedRun

__all__ = ["accumulate_step", "fit_micro_batch"]


def accumulate_step(
    config: TrainConfig,
    report: RunReport,
    model: torch.nn.Module,
    opt: HostOptimizer,
    scaler: torch.amp.GradScaler,
    batches: BatchStream,
    policy: ComputePolicy,
    step: int,
) -> torch.Tensor:
    """Forward and backward of one step's micro-batches (the gradients accumulate), backing
    off on out-of-memory errors; returns the sum of the micro-batches' mean losses (fp32
    scalar on the device). See [Note: backing off after an out-of-memory error].

    Raises:
        torch.OutOfMemoryError: a micro-batch of 1 does not fit.
    """
    start = batches.position
    while True:
        grad_accum = config.global_batch // batches.batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=policy.device)
        try:
            for micro in range(grad_accum):
                x = batches.next_batch().to(policy.device)  # (B, T)
                # non-final micro-batches only accumulate: see ramflow.optim.HostOptimizer.no_step
                accumulate = opt.no_step() if micro < grad_accum - 1 else contextlib.nullcontext()
                with accumulate:
                    with policy.autocast():
                        loss = lm_loss(model, x)
                    scaler.scale(loss / grad_accum).backward()
                loss_sum += loss.detach().float()
            return loss_sum
        except torch.OutOfMemoryError as err:
            smaller = smaller_micro_batch(batches.batch_size)
            if smaller is None:
                raise
            if batches.num_ranks > 1:
                # every rank would have to back off together, in step with the
                # collectives: not supported, see [Note: several ranks from the CLI]
                raise torch.OutOfMemoryError(
                    f"{err} -- with {batches.num_ranks} ranks ramflow does not back off "
                    f"after an out-of-memory error: give a smaller --batch-size than "
                    f"{batches.batch_size} and a larger --grad-accum"
                ) from err
            reason = str(err).splitlines()[0] if str(err) else ""
        # out of the except block: the traceback, and the failed pass's tensors, are gone
        x = loss = loss_sum = None
        opt.zero_grad(set_to_none=True)
        if policy.device.type == "cuda":
            torch.cuda.empty_cache()
        report.log(
            {
                "event": "oom_backoff",
                "step": step + 1,
                "from_micro_batch": batches.batch_size,
                "micro_batch": smaller,
                "grad_accum": config.global_batch // smaller,
                "global_batch": config.global_batch,
                "error": reason,
            }
        )
        report.message(
            f"step {step + 1}: out of memory at a micro-batch of {batches.batch_size}; "
            f"going on with {smaller} x {config.global_batch // smaller} accumulated "
            f"(global batch {config.global_batch} unchanged)"
        )
        batches.position, batches.batch_size = start, smaller


def fit_micro_batch(
    config: TrainConfig,
    setup: PreparedRun,
    report: RunReport,
    model: torch.nn.Module,
    opt: HostOptimizer,
    scaler: torch.amp.GradScaler,
    batches: BatchStream,
) -> None:
    """``--batch-size auto``: try the estimate's micro-batch on the first step's data and
    back off on out-of-memory errors; sets ``batches.batch_size``. See [Note: backing off
    after an out-of-memory error]."""
    policy = setup.policy
    start = batches.position

    def trial(micro_batch: int, checkpointing: bool) -> None:
        batches.position, batches.batch_size = start, micro_batch
        x = batches.next_batch().to(policy.device)  # (B, T)
        try:
            with opt.no_step():
                with policy.autocast():
                    loss = lm_loss(model, x)
                scaler.scale(loss).backward()
        finally:
            batches.position = start
            opt.zero_grad(set_to_none=True)

    fit = fit_batch(
        global_batch=config.global_batch,
        budget_bytes=None if setup.fit is None else setup.fit.budget_bytes,
        trial=trial,
        checkpointing=(setup.estimate.checkpointing,),
        max_micro_batch=batches.batch_size,
    )
    batches.batch_size = fit.micro_batch
    report.log(
        {
            "event": "batch_fit",
            "micro_batch": fit.micro_batch,
            "grad_accum": fit.grad_accum,
            "global_batch": fit.global_batch,
            "checkpointing": fit.checkpointing,
        }
    )
    tried = [*(setup.fit.trials[:-1] if setup.fit is not None else ()), *fit.trials]
    report.message("--batch-size auto: " + dataclasses.replace(fit, trials=tuple(tried)).describe())
