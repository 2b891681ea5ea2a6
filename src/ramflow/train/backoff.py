"""The micro-batches of a training step, and the back-off after an out-of-memory error.

Legend: B = sequences per micro-batch, T = tokens per sequence.

[Note: backing off after an out-of-memory error]
A step is ``grad_accum`` micro-batches of the global batch, read from the data position
where the step began. When a forward or backward raises ``torch.OutOfMemoryError``, the
loop drops what the step accumulated (``opt.zero_grad()``: after a failed backward that
equals skipping it, see [Note: a failed backward] in ``engine/schedule.py``), rewinds the data to
the step's start, halves the micro-batch and doubles the accumulation
(``ramflow.memory.smaller_micro_batch``), logs an ``oom_backoff`` event and runs the step
again: the global batch, the data order and the schedule are unchanged, so the losses
that follow are those of a run that started at the smaller micro-batch (up to the order in
which accumulation sums). A failed backward cannot be undone where ramflow had already
stepped units during it (the eager overlap); eager steps never run when the gradients are
clipped (the default). Without clipping one process builds the optimizer with
``overlap=False`` in the exact formats, so every back-off is exact; in the lean formats
it steps during backward to keep no gradient buffer (see [Note: the gradients of a CLI
step] in ``gradient_holding.py``), so an out-of-memory error in a backward that had already
stepped units ends the run with what to pass (``--resume`` with a smaller micro-batch, or
``--clip-grad``); one in forward, or before any unit stepped, backs off as always (several
ranks step during backward: see ``TrainConfig.steps_during_backward``). A micro-batch of 1 that runs out of memory
ends the run with the error (nothing smaller is left), and so does any micro-batch of a run
of several ranks (see [Note: several ranks from the CLI] in ``ranks.py``). With ``--batch-size auto`` the
micro-batch the estimate chose is first tried on the data of the first step (forward and
backward, no step), backing off the same way (``ramflow.memory.fit_batch``).

[Note: a heavier checkpointing after an out-of-memory error]
Under ``--checkpointing auto`` the plan's choice rests on an estimate that can be off by a
few GiB (allocator fragmentation, kernels' workspaces). Where the back-off has reached a
micro-batch of 1 (nothing smaller is left) and the step still runs out of memory, auto
goes one rung up its own ladder, off -> on -> offload (``CHECKPOINTING_LADDER``, the
order ``ramflow.memory.estimate.choose_checkpointing`` tries), on the built model
(``ramflow.set_activation_checkpointing``: Hugging Face's switch or ramflow's wrapper is
taken off, the new one installed; units, plan and window stay), logs a
``checkpointing_<mode>`` event and runs the step again from its start, as the back-off
does. Checkpointing and activation offload recompute the same kernels on the same inputs,
so the run computes what a run started with that ``--checkpointing`` computes (bit for bit
on the CPU); only speed and device memory differ, and a run started with it would get a
plan made for it (more units resident where the activations shrank), hence the message
naming the flag. Checkpoints written after the switch record it as the run's
``--checkpointing``, so ``--resume`` goes on with it. A choice the user made (``on``,
``off``, ``offload``) is never changed: the error says what to pass instead. Several ranks
refuse it as they refuse the back-off (one rank cannot change course alone while the
others wait in a collective), naming ``--checkpointing offload``. With ``--batch-size
auto``, trial steps that find no micro-batch take the next rung too and fit again from
the largest micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ramflow

from ..memory import CheckpointOffload
from ..memory.fit import fit_batch, smaller_micro_batch
from ..optim import HostOptimizer
from ..units.registry import engine_of_model
from .config import TrainConfig
from .data import BatchStream
from .loss import lm_loss
from .precision import ComputePolicy
from .report import RunReport
from .setup import PreparedRun, runs_unit_major

__all__ = [
    "CHECKPOINTING_LADDER",
    "RunCheckpointing",
    "accumulate_step",
    "checkpointing_policy",
    "fit_micro_batch",
]

# --checkpointing auto's choices, lightest first: see [Note: a heavier checkpointing after
# an out-of-memory error]
CHECKPOINTING_LADDER = ("off", "on", "offload")
_WHAT = {
    "on": "activation checkpointing on (every layer recomputed in backward)",
    "offload": "activation offload (the layers' inputs in pinned host memory)",
}


def checkpointing_policy(mode: str) -> bool | CheckpointOffload:
    """``ramflow.offload``'s ``activation_checkpointing`` for a run's checkpointing
    (``"off"``, ``"on"`` or ``"offload"``, as ``MemoryEstimate.checkpointing_mode``).

    Raises:
        ValueError: another mode.
    """
    if mode not in CHECKPOINTING_LADDER:
        raise ValueError(f"checkpointing mode {mode!r}: one of {', '.join(CHECKPOINTING_LADDER)}")
    return CheckpointOffload() if mode == "offload" else mode == "on"


@dataclass
class RunCheckpointing:
    """The activation checkpointing a run computes with, and where ``--checkpointing auto``
    goes after an out-of-memory error at a micro-batch of 1. See [Note: a heavier
    checkpointing after an out-of-memory error].

    Attributes:
        mode: what the model runs with now: ``"off"``, ``"on"`` or ``"offload"``.
        auto: the run's ``--checkpointing`` is ``auto``: ``mode`` may go heavier.
        planned: what the plan chose (``mode`` before any switch); default ``mode``.
        switched_at: the step of the last switch (1-based), None before any.
        on_switch: called after a switch (the trainer rewrites ``run.json``).
    """

    mode: str
    auto: bool
    planned: str = ""
    switched_at: int | None = None
    on_switch: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        checkpointing_policy(self.mode)  # a known mode
        self.planned = self.planned or self.mode

    def heavier(self) -> str | None:
        """The next rung for auto, None for a choice the user made or at the top."""
        if not self.auto:
            return None
        at = CHECKPOINTING_LADDER.index(self.mode)
        return CHECKPOINTING_LADDER[at + 1] if at + 1 < len(CHECKPOINTING_LADDER) else None

    def switch(
        self,
        model: torch.nn.Module,
        report: RunReport,
        *,
        step: int,
        micro_batch: int,
        error: str,
    ) -> None:
        """Install the next rung on ``model`` between passes, log it and say how to start
        with it; ``step`` is the step that ran out of memory (1-based; 0: the trial steps
        of ``--batch-size auto``)."""
        heavier = self.heavier()
        assert heavier is not None
        ramflow.set_activation_checkpointing(model, checkpointing_policy(heavier))
        before, self.mode, self.switched_at = self.mode, heavier, step
        report.log(
            {
                "event": f"checkpointing_{heavier}",
                "step": step,
                "from": before,
                "micro_batch": micro_batch,
                "error": error,
            }
        )
        where = f"step {step}" if step else "--batch-size auto's trial steps"
        report.message(
            f"{where}: out of memory at a micro-batch of {micro_batch} with activation "
            f"checkpointing {before} (--checkpointing auto); going on with {_WHAT[heavier]} "
            f"and running the step again. To start with it, pass --checkpointing {heavier}"
        )
        if self.on_switch is not None:
            self.on_switch()

    def describe(self) -> str:
        """The summary's words: the mode, and the switch if there was one."""
        if self.switched_at is None:
            return self.mode
        return (
            f"{self.mode} (auto planned {self.planned}; {self.mode} from step "
            f"{self.switched_at} after an out-of-memory error)"
        )

    def saved_config(self, config: TrainConfig) -> TrainConfig:
        """The settings a checkpoint records: after a switch, its ``--checkpointing`` is
        the mode in use, which a resumed run goes on with."""
        if self.switched_at is None:
            return config
        return dataclasses.replace(config, checkpointing=self.mode)

    def refusal(
        self, err: torch.OutOfMemoryError, *, micro_batch: int, num_ranks: int
    ) -> torch.OutOfMemoryError | None:
        """The error that ends the run where a micro-batch of ``micro_batch`` (the smallest)
        ran out of memory: None where auto goes heavier (one process); ``err`` itself under
        offload (nothing heavier to name); else ``err`` with what to pass."""
        heavier = self.heavier()
        if heavier is not None and num_ranks == 1:
            return None
        if heavier is not None:
            return torch.OutOfMemoryError(
                f"{err} -- out of memory at a micro-batch of {micro_batch} with activation "
                f"checkpointing {self.mode} (--checkpointing auto); with {num_ranks} ranks "
                f"ramflow does not change the checkpointing during a run: pass "
                f"--checkpointing {CHECKPOINTING_LADDER[-1]}"
            )
        if self.mode == CHECKPOINTING_LADDER[-1]:
            return err
        return torch.OutOfMemoryError(
            f"{err} -- out of memory at a micro-batch of {micro_batch}, the smallest, with "
            f"--checkpointing {self.mode}: pass --checkpointing offload "
            "to keep the layers' inputs in pinned host memory (or --checkpointing auto, "
            "which goes there after such an error)"
        )


def _unit_major(
    model: torch.nn.Module,
    scaler: torch.amp.GradScaler,
    batches: BatchStream,
    policy: ComputePolicy,
    grad_accum: int,
) -> list[torch.Tensor]:
    """Forward and backward of one step's ``grad_accum`` micro-batches through
    ``ramflow.accumulate`` (see [Note: one weight pass per optimizer step] in
    ``ramflow.engine.unit_major``); returns their mean losses (fp32 scalars on the device),
    in micro-batch order."""
    micro_batches = [batches.next_labeled_batch() for _ in range(grad_accum)]  # (B, T) each
    losses: list[torch.Tensor | None] = [None] * grad_accum

    def loss_fn(item: tuple[int, tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        m, (x, labels) = item
        x = x.to(policy.device)
        labels = labels.to(policy.device) if labels is not None else None
        with policy.autocast():
            loss = lm_loss(model, x, labels)
        losses[m] = loss.detach().float()
        return scaler.scale(loss / grad_accum)

    ramflow.accumulate(model, list(enumerate(micro_batches)), loss_fn)
    return losses  # type: ignore[return-value]


def accumulate_step(
    config: TrainConfig,
    report: RunReport,
    model: torch.nn.Module,
    opt: HostOptimizer,
    scaler: torch.amp.GradScaler,
    batches: BatchStream,
    policy: ComputePolicy,
    step: int,
    checkpointing: RunCheckpointing,
) -> torch.Tensor:
    """Forward and backward of one step's micro-batches (the gradients accumulate; several
    micro-batches on one rank run unit-major, ``setup.runs_unit_major``), backing off on
    out-of-memory errors, and at a micro-batch of 1 under ``--checkpointing auto``
    going to a heavier checkpointing; returns the sum of the micro-batches' mean losses
    (fp32 scalar on the device). See [Note: backing off after an out-of-memory error] and
    [Note: a heavier checkpointing after an out-of-memory error].

    Raises:
        torch.OutOfMemoryError: a micro-batch of 1 does not fit under the heaviest
            checkpointing allowed (the message names ``--checkpointing offload`` where it
            was not used); with several ranks, any micro-batch that does not fit.
    """
    start = batches.position
    while True:
        grad_accum = config.global_batch // batches.batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=policy.device)
        try:
            unit_major = runs_unit_major(several_ranks=batches.num_ranks > 1)
            if grad_accum > 1 and unit_major:
                for loss in _unit_major(model, scaler, batches, policy, grad_accum):
                    loss_sum += loss
                return loss_sum
            for micro in range(grad_accum):
                x, labels = batches.next_labeled_batch()  # (B, T); labels: chat data's
                x = x.to(policy.device)
                labels = labels.to(policy.device) if labels is not None else None
                # non-final micro-batches only accumulate: see ramflow.optim.HostOptimizer.no_step
                accumulate = opt.no_step() if micro < grad_accum - 1 else contextlib.nullcontext()
                with accumulate:
                    with policy.autocast():
                        loss = lm_loss(model, x, labels)
                    scaler.scale(loss / grad_accum).backward()
                loss_sum += loss.detach().float()
            return loss_sum
        except torch.OutOfMemoryError as err:
            smaller = smaller_micro_batch(batches.batch_size)
            if smaller is None:
                refusal = checkpointing.refusal(
                    err, micro_batch=batches.batch_size, num_ranks=batches.num_ranks
                )
                if refusal is err:
                    raise
                if refusal is not None:
                    raise refusal from err
            elif batches.num_ranks > 1:
                # every rank would have to back off together, in step with the
                # collectives: not supported, see [Note: several ranks from the CLI]
                raise torch.OutOfMemoryError(
                    f"{err} -- with {batches.num_ranks} ranks ramflow does not back off "
                    f"after an out-of-memory error: give a smaller --batch-size than "
                    f"{batches.batch_size} and a larger --grad-accum"
                ) from err
            reason = str(err).splitlines()[0] if str(err) else ""
        # out of the except block: the traceback, and the failed pass's tensors, are gone
        x = labels = loss = loss_sum = None
        opt.zero_grad(set_to_none=True)
        engine = engine_of_model(model)
        stepped = engine.partly_stepped() if engine is not None else []
        if stepped:
            # see [Note: the gradients of a CLI step] in gradient_holding.py
            raise torch.OutOfMemoryError(
                f"step {step + 1}: out of memory in backward at a micro-batch of "
                f"{batches.batch_size} after ramflow had stepped {len(stepped)} unit(s) as "
                "their gradients landed (the lean host formats without clipping keep no "
                "gradient buffer), so the step cannot be run again at a smaller micro-batch. "
                "Resume from the last checkpoint (ramflow train --resume RUN_DIR) with a "
                "smaller --batch-size and a larger --grad-accum, or train with --clip-grad "
                "(the steps then wait for the clip and can be backed off, holding 8-bit "
                f"gradients: about 1 byte per parameter more). The error: {reason}"
            )
        if policy.device.type == "cuda":
            torch.cuda.empty_cache()
        if smaller is None:
            checkpointing.switch(
                model, report, step=step + 1, micro_batch=batches.batch_size, error=reason
            )
            batches.position = start
            continue
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
    checkpointing: RunCheckpointing,
) -> None:
    """``--batch-size auto``: try the estimate's micro-batch on the first step's data and
    back off on out-of-memory errors; sets ``batches.batch_size``. Where not even a
    micro-batch of 1 fits, ``--checkpointing auto`` goes heavier and fits again. See
    [Note: backing off after an out-of-memory error] and [Note: a heavier checkpointing
    after an out-of-memory error].

    Raises:
        ValueError: no micro-batch fits under the heaviest checkpointing allowed.
    """
    policy = setup.policy
    start = batches.position
    oom: list[str] = []

    def trial(micro_batch: int, checkpointing: bool) -> None:
        batches.position, batches.batch_size = start, micro_batch
        x = batches.next_batch().to(policy.device)  # (B, T)
        try:
            with opt.no_step():
                with policy.autocast():
                    loss = lm_loss(model, x)
                scaler.scale(loss).backward()
        except torch.OutOfMemoryError as err:
            oom.append(str(err).splitlines()[0] if str(err) else "")
            raise
        finally:
            batches.position = start
            opt.zero_grad(set_to_none=True)

    max_micro_batch = batches.batch_size
    while True:
        oom.clear()
        try:
            fit = fit_batch(
                global_batch=config.global_batch,
                device_budget_bytes=None if setup.fit is None else setup.fit.device_budget_bytes,
                trial=trial,
                checkpointing=(checkpointing.mode != "off",),
                max_micro_batch=max_micro_batch,
            )
            break
        except ValueError as err:
            # fit_batch was given no estimate: every candidate ran out of memory
            if checkpointing.heavier() is None or batches.num_ranks > 1 or not oom:
                if checkpointing.mode == CHECKPOINTING_LADDER[-1]:
                    raise
                raise ValueError(
                    f"{err} With activation checkpointing {checkpointing.mode}: "
                    "--checkpointing offload keeps the layers' inputs in pinned host memory."
                ) from err
            checkpointing.switch(model, report, step=0, micro_batch=1, error=oom[-1])
    batches.batch_size = fit.micro_batch
    report.log(
        {
            "event": "batch_fit",
            "micro_batch": fit.micro_batch,
            "grad_accum": fit.grad_accum,
            "global_batch": fit.global_batch,
            "checkpointing": fit.checkpointing,
            "checkpointing_mode": checkpointing.mode,
        }
    )
    tried = [*(setup.fit.trials[:-1] if setup.fit is not None else ()), *fit.trials]
    report.message("--batch-size auto: " + dataclasses.replace(fit, trials=tuple(tried)).describe())
