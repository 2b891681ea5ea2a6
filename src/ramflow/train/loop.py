"""The loop of ``ramflow train`` once everything is set up: steps, validation, checkpoints,
the log and the summary (``trainer.py`` checks, builds and calls it).

Legend: B = sequences per micro-batch, T = tokens per sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import ramflow

from ..sizes import format_bytes
from .backoff import RunCheckpointing, accumulate_step
from .data import validation_batches
from .flops import model_flops_per_token, model_flops_utilisation, peak_flops
from .loss import lm_loss
from .modeling import count_parameters
from .precision import ComputePolicy
from .ranks import Ranks
from .report import format_duration, loss_summary, summary_table
from .run_checkpoint import fault_point, save_checkpoint


class LossDiverged(FloatingPointError):
    """The training loss became NaN or infinite (``ramflow train`` exits 2 with its
    message: the step, the LR, what to change, and the checkpoint that is kept)."""


@dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        run_dir: the run folder.
        checkpoint: the last checkpoint written (None if none).
        steps_done: optimizer steps done in total (the resumed ones included).
        interrupted: stopped early by Ctrl-C, SIGTERM or ``stop``.
        first_loss / last_loss: training loss of the first step logged and the mean of the
            last ten steps (of all when fewer; ``report.loss_summary``).
        val_loss: the last validation loss (None if none ran).
        elapsed_s: wall time of this process's loop (seconds).
        tokens_per_s: training tokens per second of this process (of all ranks, in a run
            of several: see [Note: several ranks from the CLI] in ``ranks.py``).
        peak_gpu_bytes: ``torch.cuda.max_memory_allocated`` (None on the CPU).
        peak_host_bytes: peak resident memory of this process.
        summary: the summary table as printed.
        stop_signal: the signal that stopped the run early (``signal.SIGINT`` or
            ``signal.SIGTERM``), None when it finished or ``stop`` was set.
    """

    run_dir: Path
    checkpoint: Path | None
    steps_done: int
    interrupted: bool
    first_loss: float
    last_loss: float
    val_loss: float | None
    elapsed_s: float
    tokens_per_s: float
    peak_gpu_bytes: int | None
    peak_host_bytes: int
    summary: str
    stop_signal: int | None = None


def steps_in_backward(model: torch.nn.Module) -> bool | None:
    """Whether the last ``opt.step()`` of ``model``'s optimizer found its units stepped during
    backward (see [Note: when the step runs] in ``ramflow.engine.stepper``); None for a model
    ramflow does not offload."""
    from ..units.registry import engine_of_model

    engines = {id(e): e for e in map(engine_of_model, model.modules()) if e is not None}
    if not engines:
        return None
    return all(e.stepper.policy.step_was_eager for e in engines.values())


def _peak_host_bytes() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return psutil.Process().memory_info().rss


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    policy: ComputePolicy,
    batch_size: int,
    seq_len: int,
    max_batches: int,
    ranks: Ranks | None = None,
    labels: torch.Tensor | None = None,
) -> float:
    """Mean cross-entropy (nats per token) of ``model`` on held-out (N,) ``tokens``, over
    at most ``max_batches`` (B, T) batches; with ``ranks``, each rank computes its rows of
    every batch of B x ranks (see [Note: several ranks from the CLI] in ``ranks.py``) and
    every rank returns the mean over all of them. ``labels``: (N,) targets beside the
    tokens (-100: none; ``Corpus.val_labels``), None: the tokens."""
    ranks = ranks if ranks is not None else Ranks()
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        picked = dict(
            batch_size=batch_size,
            seq_len=seq_len,
            max_batches=max_batches,
            rank=ranks.rank,
            num_ranks=ranks.world_size,
        )
        for batch, target in zip(
            validation_batches(tokens, **picked),
            validation_batches(labels, **picked) if labels is not None else repeat(None),
        ):
            batch = batch.to(policy.device)
            target = target.to(policy.device) if target is not None else None
            with policy.autocast():
                loss = lm_loss(model, batch, target)
            total += loss.float().item() * batch.shape[0]
            count += batch.shape[0]
    finally:
        model.train(was_training)
    total, count = ranks.sum([total, count])
    return total / max(count, 1)


def _diverged(
    loss: float, step: int, lr: float, policy: ComputePolicy, kept: Path | None
) -> LossDiverged:
    """The error of a loss that became NaN or infinite: one true line (a hint of fp32
    only where the run is not in fp32 already; the checkpoint only where one exists)."""
    fix = "lower --lr" + ("" if policy.precision == "fp32" else " or use --precision fp32")
    where = (
        f"the last checkpoint, {kept}, is kept (--resume it with a lower --lr)"
        if kept is not None and kept.exists()
        else "no checkpoint of this run was written"
    )
    return LossDiverged(
        f"the training loss became {loss} at step {step} with a learning rate of {lr:g} "
        f"({policy.precision}): {fix}; {where}"
    )


@dataclass(frozen=True)
class LoopRun:
    """What a training loop runs within: the run's settings and where its output goes.

    Attributes:
        config: the run's ``TrainConfig``.
        setup: what ``prepare_run`` built (policy, tokenizer, corpus, estimate).
        run_dir: the run folder (``Path``).
        report: progress, log and plot (``RunReport``).
        stop: the Ctrl-C / SIGTERM flag the loop polls between steps.
        on_step: called with each step's log record, or None.
        ranks: this process's rank, world size and process group (``Ranks``).
        checkpointing: the activation checkpointing in force and its back-off.
    """

    config: Any
    setup: Any
    run_dir: Path
    report: Any
    stop: Any
    on_step: Callable[[dict], None] | None
    ranks: Any
    checkpointing: RunCheckpointing


@dataclass(frozen=True)
class LoopState:
    """The training state a loop starts from (fresh, or as a resume restored it).

    Attributes:
        model: the offloaded (or resident) model.
        opt: its optimizer; sched: its LR scheduler; scaler: a GradScaler or None.
        batches: the resumable batch stream.
        param_names: parameter -> name, for checkpoints.
        step: steps done so far; tokens_seen: tokens trained on so far (every rank's).
    """

    model: nn.Module
    opt: Any
    sched: Any
    scaler: Any
    batches: Any
    param_names: Any
    step: int
    tokens_seen: int


def run_loop(run: LoopRun, state: LoopState) -> TrainResult:
    """Train from ``state`` to ``run.config.steps``: steps, validation, checkpoints, the
    summary; stops early (saving a checkpoint) when ``run.stop`` is set.

    Args:
        run: what stays fixed for the run (config, set-up, run folder, report, ranks).
        state: where it starts (model, optimizer, scheduler, scaler, batches, step count).

    Returns:
        The run's ``TrainResult`` (losses, tokens, times, the last checkpoint).

    Raises:
        LossDiverged: a training loss that is not finite.
    """
    config, setup, run_dir, report = run.config, run.setup, run.run_dir, run.report
    stop, on_step, ranks, checkpointing = run.stop, run.on_step, run.ranks, run.checkpointing
    model, opt, sched, scaler = state.model, state.opt, state.sched, state.scaler
    batches, param_names = state.batches, state.param_names
    step, tokens_seen = state.step, state.tokens_seen
    policy, corpus = setup.policy, setup.corpus
    # every rank's tokens: see [Note: several ranks from the CLI] in ranks.py
    tokens_per_step = config.tokens_per_step * ranks.world_size
    params = [p for g in opt.param_groups for p in g["params"]]
    say = report.message
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(policy.device)
    process = psutil.Process()
    first_step = step
    train_time = 0.0
    last_ckpt: Path | None = None
    val_loss: float | None = None
    interrupted = False
    num_trained = sum(p.numel() for p in params)
    peak = peak_flops(policy.device, policy.compute_dtype)
    flops_per_token = model_flops_per_token(model, seq_len=config.seq_len)
    t_start = time.perf_counter()

    saved_step = -1

    def save(step_now: int) -> Path | None:
        nonlocal saved_step
        if config.keep_checkpoints == 0:  # the run writes none
            saved_step = step_now
            return None
        t0 = time.perf_counter()
        path = save_checkpoint(
            run_dir / "checkpoints",
            step=step_now,
            model=model,
            optimizer=opt,
            param_names=param_names,
            tokenizer=setup.tokenizer,
            keep=config.keep_checkpoints,
            adapters_only=config.lora_rank is not None,
            ranks=ranks,
            state={
                "data_position": batches.position,
                "tokens_seen": tokens_seen,
                "scheduler": sched.state_dict(),
                "grad_scaler": scaler.state_dict(),
                # after auto went heavier, its --checkpointing: see backoff.py
                "train_config": checkpointing.saved_config(config).to_dict(),
                "corpus": {
                    "fingerprint": corpus.fingerprint,
                    "num_tokens": corpus.num_tokens,
                    "num_documents": corpus.num_documents,
                    "source": corpus.source,
                },
            },
        )
        report.log(
            {
                "event": "checkpoint",
                "step": step_now,
                "path": str(path),
                "save_s": time.perf_counter() - t0,
            }
        )
        say(
            f"checkpoint of step {step_now} saved in {format_duration(time.perf_counter() - t0)}: {path}"
        )
        saved_step = step_now
        return path

    val_step = 0

    def run_eval(step_now: int) -> float:
        nonlocal val_step
        val_step = step_now
        loss = evaluate(
            model,
            corpus.val_tokens,
            policy=policy,
            # the same sequences whatever the micro-batch has backed off to
            batch_size=batches.batch_size,
            seq_len=config.seq_len,
            max_batches=-(-config.eval_batches * config.batch_size // batches.batch_size),
            ranks=ranks,
            labels=corpus.val_labels,
        )
        report.eval(step_now, loss)
        say(f"step {step_now}: validation loss {loss:.4f}")
        return loss

    if step == 0 and config.eval_every:
        val_loss = run_eval(0)
    while step < config.steps:
        # a signal may reach some ranks only: all stop after the same step
        if ranks.any(stop.is_set()):
            stop.set()
            interrupted = True
            break
        fault_point("step")  # test-only: see [Note: test faults] in checkpoint.py
        t0 = time.perf_counter()
        loss_sum = accumulate_step(
            config, report, model, opt, scaler, batches, policy, step, checkpointing
        )
        grad_accum = config.global_batch // batches.batch_size
        scaler.unscale_(opt)
        # fold: this loop never reads the gradients between the clip and the step, so each
        # unit's step applies the coefficient (see ramflow.clip_grad_norm_)
        grad_norm = (
            ramflow.clip_grad_norm_(params, config.clip_grad, fold=True).item()
            if config.clip_grad
            else None
        )
        lr = opt.param_groups[0]["lr"]
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)
        scaler.update()
        # fp16: the scaler skips the step when gradients overflowed (it lowers the scale);
        # the schedule follows the steps actually taken
        skipped = scaler.is_enabled() and scaler.get_scale() < scale
        if not skipped:
            sched.step()
        opt.zero_grad(set_to_none=True)
        # the mean over the ranks: the loss of one process on the global batch
        step_loss = ranks.sum([(loss_sum / grad_accum).item()])[0] / ranks.world_size
        step += 1
        tokens_seen += tokens_per_step
        dt = time.perf_counter() - t0
        train_time += dt
        if not math.isfinite(step_loss) and not policy.use_grad_scaler:
            resumed = setup.checkpoint.path if setup.checkpoint is not None else None
            raise _diverged(step_loss, step, lr, policy, last_ckpt or resumed)
        record = {
            "step": step,
            "loss": step_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "micro_batch": batches.batch_size,
            "tokens": tokens_seen,
            "step_s": dt,
            "tokens_per_s": tokens_per_step / dt,
            # each GPU's share of the tokens over its own peak: the MFU of all of them
            "mfu": model_flops_utilisation(
                flops_per_token=flops_per_token,
                tokens_per_s=config.tokens_per_step / dt,
                peak=peak,
            ),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(policy.device) if cuda else None,
            "host_rss_bytes": process.memory_info().rss,
            # the optimizer overlapped the backward (steps during it), or ran after it
            "steps_in_backward": steps_in_backward(model),
        }
        report.step(record)
        if on_step is not None:
            on_step(record)
        if config.eval_every and step % config.eval_every == 0 and step < config.steps:
            val_loss = run_eval(step)
        if (
            config.save_every
            and step % config.save_every == 0
            and step < config.steps
            and not ranks.any(stop.is_set())
        ):
            last_ckpt = save(step)
    else:
        val_loss = run_eval(step)
    if ranks.any(stop.is_set()):
        interrupted = True
    if last_ckpt is None or saved_step != step:  # a signal during a save: that one holds
        last_ckpt = save(step)
    elapsed = time.perf_counter() - t_start
    done = step - first_step
    tps = done * tokens_per_step / train_time if train_time > 0 else 0.0
    peak_gpu = torch.cuda.max_memory_allocated(policy.device) if cuda else None
    peak_host = _peak_host_bytes()
    peak_gpu_per_rank = ranks.all_gather(peak_gpu)
    report.log(
        {
            "event": "end",
            "peak_gpu_bytes_per_rank": peak_gpu_per_rank,
            "peak_host_bytes_per_rank": ranks.all_gather(peak_host),
            "step": step,
            "interrupted": interrupted,
            # the activation checkpointing the run ended with ("off", "on", "offload")
            "checkpointing": checkpointing.mode,
            "elapsed_s": elapsed,
            "tokens_per_s": tps,
            "mfu": model_flops_utilisation(
                flops_per_token=flops_per_token, tokens_per_s=tps / ranks.world_size, peak=peak
            ),
        }
    )
    plot = report.write_plot(
        title=f"ramflow train: {config.model_name}, {tokens_per_step:,} tokens per step"
    )
    first_loss, last_loss, loss_text = loss_summary(report.step_records())
    rows = [
        (
            "model",
            f"{config.model_name} ({count_parameters(model) / 1e6:,.2f} M parameters), "
            f"{num_trained / 1e6:,.2f} M trained",
        ),
        (
            "device",
            (f"{ranks.world_size} ranks (ZeRO), " if ranks.several else "")
            + f"{policy.device}, {policy.precision}, activation checkpointing "
            f"{checkpointing.describe()}",
        ),
        (
            "steps",
            f"{step} of {config.steps}"
            + (" (interrupted)" if interrupted else "")
            + (f", {done} in this process" if first_step else ""),
        ),
        (
            "tokens",
            f"{tokens_seen:,} ({tokens_per_step:,} per step"
            + (f" over {ranks.world_size} ranks" if ranks.several else "")
            + f", epoch {batches.epoch:.2f})",
        ),
        ("training loss", loss_text),
        ("validation loss", "-" if val_loss is None else f"{val_loss:.4f} (at step {val_step})"),
        ("time", f"{format_duration(elapsed)} ({tps:,.0f} tokens/s while training)"),
    ]
    mfu = model_flops_utilisation(
        flops_per_token=flops_per_token, tokens_per_s=tps / ranks.world_size, peak=peak
    )
    if mfu is not None and peak is not None:
        rows.append(
            (
                "MFU",
                f"{mfu:.1%} ({flops_per_token / 1e9:,.2f} GFLOP per token x tokens/s: the "
                f"active weights and causal attention at {config.seq_len} tokens, "
                + (f"over {ranks.world_size} x " if ranks.several else "over the ")
                + f"{peak.description})",
            )
        )
    rows += [
        (
            "peak GPU memory",
            "- (CPU run)"
            if peak_gpu is None
            else format_bytes(max(peak_gpu_per_rank))
            + (f" (the largest of {ranks.world_size} ranks)" if ranks.several else ""),
        ),
        ("peak host memory", format_bytes(peak_host)),
        ("run folder", str(run_dir)),
        ("checkpoint", str(last_ckpt) if last_ckpt else "none written (--keep-checkpoints 0)"),
        ("log / plot", f"{report.log_path} / {plot}"),
    ]
    summary = summary_table(rows)
    say(summary)
    return TrainResult(
        run_dir=run_dir,
        checkpoint=last_ckpt,
        steps_done=step,
        interrupted=interrupted,
        first_loss=first_loss,
        last_loss=last_loss,
        val_loss=val_loss,
        elapsed_s=elapsed,
        tokens_per_s=tps,
        peak_gpu_bytes=peak_gpu,
        peak_host_bytes=peak_host,
        summary=summary,
    )


__all__ = ["LossDiverged", "TrainResult", "evaluate", "run_loop"]
