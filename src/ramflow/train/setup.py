"""What a training run checks and builds before its run folder exists.

``prepare_run`` is ``train``'s first half and ``plan_run`` is ``ramflow plan``: both take
the same path through tokenizer, model config and memory estimate, so that ``train``
refuses exactly the runs that ``plan`` says will not fit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.host import HostPrecision
from ..memory.fit import BatchFit, fit_batch
from ..planner.predict import Rates
from ..sizes import format_bytes, parse_bytes
from .chat_data import build_chat_corpus, is_chat_data
from .config import TrainConfig
from .data import Corpus, build_corpus, find_documents, stdlib_root
from .estimate import (
    OFFLOAD_WINS_BY,
    MemoryEstimate,
    RunDescription,
    SpeedInputs,
    default_gpu_budget,
    estimate_run_memory,
    predict_plan_step,
)
from .lora import DEFAULT_TARGETS, check_lora_targets, parse_targets
from .modeling import check_weights, meta_model, model_config, read_config
from .optimizers import OPTIMIZER_DEFAULTS
from .precision import ComputePolicy, planned_compute, resolve_compute
from .run_checkpoint import Checkpoint, list_checkpoints
from .scale import RanksPlan, plan_ranks
from .tokenizer import Tokenizer, has_tokenizer, load_tokenizer


@dataclass
class PreparedRun:
    """Everything ``prepare_run`` checked and built before the run folder exists.

    Attributes:
        policy: device and precision.
        tokenizer: the run's tokenizer.
        model_config: the ``transformers`` config of the model.
        corpus: the tokenised training and validation text.
        estimate: the memory plan (``ramflow plan``'s figures), at the micro-batch the
            run starts with.
        ramflow_budget: what ``ramflow.offload`` may allocate on the device (the budget
            less the activations), bytes; None for no cap.
        checkpoint: the verified checkpoint to resume, or None.
        fit: with ``--batch-size auto``, the micro-batch the estimate chose (the trainer's
            trial steps may lower it); None otherwise.
        host_ranks: with several ranks on this host, their RAM (``ramflow plan
            --nproc-per-node``'s figures, which the run was checked against); None for one.
    """

    policy: ComputePolicy
    tokenizer: Tokenizer
    model_config: Any
    corpus: Corpus
    estimate: MemoryEstimate
    ramflow_budget: int | None
    checkpoint: Checkpoint | None
    fit: BatchFit | None = None
    host_ranks: RanksPlan | None = None


def _tokenizer_and_config(
    config: TrainConfig, checkpoint: Checkpoint | None
) -> tuple[Tokenizer, Any]:
    if checkpoint is not None:
        return load_tokenizer(checkpoint.path), read_config(checkpoint.path)
    tok_dir = config.tokenizer
    if tok_dir is None and config.model is not None and has_tokenizer(config.model):
        tok_dir = config.model
    tokenizer = load_tokenizer(tok_dir)
    return tokenizer, model_config(
        preset=config.preset, model_dir=config.model, tokenizer=tokenizer
    )


def base_weights(config: TrainConfig, checkpoint: Checkpoint | None) -> Path | str | None:
    """The folder whose weights a run starts from: the checkpoint's, else ``--model``'s;
    a LoRA run's checkpoints hold only the adapters, its base is always ``--model`` (None:
    the preset's fresh weights from the seed)."""
    if checkpoint is not None and config.lora_rank is None:
        return checkpoint.path
    return config.model


def _estimate(
    config: TrainConfig,
    mconfig: Any,
    *,
    device_type: str,
    precision: str,
    compute_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    budget: int | None,
    out_dir: Path | None,
    several_ranks: bool = False,
    speed: SpeedInputs | None = None,
) -> tuple[MemoryEstimate, BatchFit | None]:
    """The run's estimate; with ``--batch-size auto``, at the largest micro-batch (and the
    lightest checkpointing) whose estimate fits the budget, and that fit."""
    ctx = getattr(mconfig, "max_position_embeddings", None)
    if ctx is not None and config.seq_len > ctx:
        longer = (
            " (the llama-8b and llama-70b presets: 131072 tokens, with Llama 3.1's rope scaling)"
            if ctx < 131072
            else ""
        )
        raise ValueError(
            f"--seq-len {config.seq_len} exceeds the model's context of {ctx} tokens "
            "(max_position_embeddings, which its rotary embedding is set up for); give "
            f"--seq-len {ctx} or less, or a model whose config allows longer sequences{longer}"
        )

    def at(
        batch_size: int,
        checkpointing: str,
        host_precision: str = config.host_precision,
        **extra: Any,
    ) -> MemoryEstimate:
        return estimate_run_memory(
            mconfig,
            run=RunDescription(
                batch_size=batch_size,
                seq_len=config.seq_len,
                model_name=config.model_name,
                precision=precision,
                # no checkpoint written (--keep-checkpoints 0): the disk is not asked
                out_dir=(out_dir if out_dir is not None else Path("runs"))
                if config.keep_checkpoints > 0
                else None,
            ),
            device_type=device_type,
            compute_dtype=compute_dtype,
            wire_dtype=HostPrecision.parse(host_precision).wire_for(None, default=wire_dtype)
            if host_precision == "lean" and config.host_precision == "auto"
            else wire_dtype,
            gpu_memory_bytes=budget,
            checkpointing=checkpointing,
            host_precision=host_precision,
            optimizer_states=OPTIMIZER_DEFAULTS[config.optimizer].num_states,
            full_gradients=not config.steps_during_backward(several_ranks=several_ranks),
            **extra,
        )

    if config.host_precision == "auto":
        # when nothing fits, the plan of the leanest formats says by how much (``train``
        # then refuses it with the same figures); auto's own error gives no plan
        plain = at

        def at(batch_size: int, checkpointing: str, **extra: Any) -> MemoryEstimate:
            try:
                return plain(batch_size, checkpointing, **extra)
            except MemoryError:
                est = plain(batch_size, checkpointing, host_precision="lean", **extra)
                return dataclasses.replace(
                    est,
                    host_precision_reason="neither fp32 nor lean fits this machine's RAM; "
                    "planned with lean, the leanest",
                )

    if not config.auto_batch_size:
        return at(config.batch_size, config.checkpointing, speed=speed), None
    levels = {"auto": (False, True), "off": (False,), "on": (True,), "offload": (True,)}
    # checkpointing on means offload where asked for it
    on = "offload" if config.checkpointing == "offload" else "on"

    def fit_with(on: str, levels: tuple[bool, ...]) -> BatchFit:
        return fit_batch(
            global_batch=config.global_batch,
            budget_bytes=budget,
            estimate=lambda b, ckpt: at(b, on if ckpt else "off").device_total_bytes,
            checkpointing=levels,
        )

    reason = None
    try:
        fit = fit_with(on, levels[config.checkpointing])
    except ValueError:
        if config.checkpointing != "auto":
            raise
        # auto's last resort, as for a fixed micro-batch (``choose_checkpointing``): no
        # micro-batch fits with every layer's input on the device, so offload them
        on = "offload"
        fit = fit_with(on, (True,))
        reason = (
            "no micro-batch fits with checkpointing every layer, so the layers' inputs go "
            "to pinned host memory"
        )
    if (
        config.checkpointing == "auto"
        and on == "on"
        and fit.checkpointing
        and device_type == "cuda"
    ):
        offloaded, why = _offload_fit(config, mconfig, fit, fit_with, at, speed)
        if offloaded is not None:
            fit, on, reason = offloaded, "offload", why
    est = at(fit.micro_batch, on if fit.checkpointing else "off", speed=speed)
    if reason is not None:
        est = dataclasses.replace(est, checkpointing_reason=reason)
    return est, fit


def _offload_fit(
    config: TrainConfig,
    mconfig: Any,
    fit: BatchFit,
    fit_with: Any,
    at: Any,
    speed: SpeedInputs | None,
) -> tuple[BatchFit | None, str | None]:
    """``--batch-size auto --checkpointing auto`` where checkpointing every layer fits: the
    fit with the layers' inputs offloaded, and why, where it takes a larger micro-batch
    whose global batch is predicted faster; else (None, None). See [Note: when auto
    offloads the layers' inputs] in ``estimate.py``."""
    try:
        offloaded = fit_with("offload", (True,))
    except ValueError:
        return None, None
    if offloaded.micro_batch <= fit.micro_batch:
        return None, None
    figures = speed or SpeedInputs()
    speed_kw = {
        "timing_rates": figures.timing_rates,
        "matmul_flops_per_s": figures.matmul_flops_per_s,
    }

    def global_batch_s(f: BatchFit, checkpointing: str) -> float:
        est = at(f.micro_batch, checkpointing)
        last = predict_plan_step(mconfig, est, **speed_kw).step_s
        if f.grad_accum == 1:
            return last
        micro = predict_plan_step(mconfig, est, with_optimizer=False, **speed_kw).step_s
        return (f.grad_accum - 1) * micro + last

    on_s, off_s = global_batch_s(fit, "on"), global_batch_s(offloaded, "offload")
    if off_s >= on_s * (1 - OFFLOAD_WINS_BY):
        return None, None
    return offloaded, (
        f"with the layers' inputs offloaded a micro-batch of {offloaded.micro_batch} fits "
        f"instead of {fit.micro_batch}: predicted {off_s:.2f} s per global batch of "
        f"{config.global_batch} against {on_s:.2f} s"
    )


def host_wire(config: TrainConfig, device_type: str, wire: torch.dtype) -> torch.dtype:
    """The wire dtype of a run: bf16 on the CPU when ``--host-precision`` keeps bf16 master
    weights (they are the wire copy; a CUDA run's wire is bf16 already, an fp16 one is
    refused by the estimate with what works)."""
    if device_type != "cpu" or config.host_precision == "auto":
        return wire
    return HostPrecision.parse(config.host_precision).wire_for(None, default=wire)


def plan_run(
    config: TrainConfig,
    *,
    out_dir: str | os.PathLike | None = None,
    timing_rates: Rates | None = None,
    matmul_flops_per_s: float | None = None,
    num_ranks: int = 1,
) -> MemoryEstimate:
    """The memory plan of a training run, without allocating the model (``ramflow plan``),
    with its predicted step time on a GPU (``MemoryEstimate.prediction`` and ``timed_plan``).

    Unlike ``train``, the device need not be present: ``device="cuda"`` plans a GPU run
    on a machine without one (with no budget unless ``gpu_memory`` is given). With no
    device named, a ``gpu_memory`` budget also plans a GPU run: a budget is for a GPU. The
    estimate's ``device_note`` says which device was assumed and why.

    Args:
        config: the run's settings.
        out_dir: where checkpoints would go, for the disk check.
        timing_rates: copy and CPU optimizer rates for the prediction (default: the H200
            box's, see ``ramflow.planner.predict``).
        matmul_flops_per_s: the GPU's bf16 matmul rate, FLOP/s (default: the H200's).
        num_ranks: ranks of the run (``--nproc-per-node``): with several, a run without
            clipping or accumulation steps during backward and keeps no full host gradient
            buffer (``TrainConfig.steps_during_backward``).

    Raises:
        ValueError, FileNotFoundError: as ``train``'s checks (settings, model, tokenizer,
            a device budget too small), or a rate that is not a positive finite number.
    """
    rates = [(matmul_flops_per_s, "matmul_flops_per_s (--gpu-tflops)")]
    if timing_rates is not None:
        rates += [
            (timing_rates.h2d_bytes_per_s, "timing_rates.h2d_bytes_per_s (--pcie-gbps)"),
            (timing_rates.d2h_bytes_per_s, "timing_rates.d2h_bytes_per_s (--pcie-gbps)"),
            (
                timing_rates.cpu_optimizer_params_per_s,
                "timing_rates.cpu_optimizer_params_per_s (--cpu-adamw-gparams)",
            ),
        ]
    for value, what in rates:
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{what} must be a positive finite number, got {value}")
    device, note = config.device, None
    if device is None and not torch.cuda.is_available():
        if config.gpu_memory is not None:
            device = "cuda"
            note = (
                "this machine has no CUDA device: planned a run on a CUDA GPU, for which "
                "--gpu-memory gives the budget; --device cpu plans a CPU run"
            )
        else:
            note = (
                "this machine has no CUDA device: planned a CPU run; --device cuda "
                "--gpu-memory SIZE plans a GPU run"
            )
    device_type, precision, compute, wire = planned_compute(
        device=device, precision=config.precision
    )
    wire = host_wire(config, device_type, wire)
    _, mconfig = _tokenizer_and_config(config, None)
    if config.gpu_memory is not None:
        budget = parse_bytes(config.gpu_memory, what="--gpu-memory")
    elif device_type == "cuda" and torch.cuda.is_available():
        budget = default_gpu_budget(
            resolve_compute(device=device, precision=config.precision).device
        )
    else:
        budget = None
    estimate, fit = _estimate(
        config,
        mconfig,
        device_type=device_type,
        precision=precision,
        compute_dtype=compute,
        wire_dtype=wire,
        budget=budget,
        out_dir=Path(out_dir) if out_dir is not None else None,
        several_ranks=num_ranks > 1,
        speed=SpeedInputs(timing_rates=timing_rates, matmul_flops_per_s=matmul_flops_per_s),
    )
    if fit is not None:
        note = (
            (note + "; " if note else "")
            + "--batch-size auto: "
            + fit.describe().replace("\n", "\n  ")
        )
    return dataclasses.replace(estimate, device_note=note)


def _checkpoints_written(config: TrainConfig, checkpoint: Checkpoint | None) -> int:
    """How many checkpoints the run writes: one every ``--save-every`` steps before its
    last, and one at the end (a resumed run with nothing left to do saves its step again)."""
    if config.keep_checkpoints == 0:
        return 0
    start = checkpoint.step if checkpoint is not None else 0
    every = config.save_every
    periodic = max(0, (config.steps - 1) // every - start // every) if every else 0
    return periodic + 1


def _disk_problem(
    estimate: MemoryEstimate,
    config: TrainConfig,
    checkpoint: Checkpoint | None,
    out_dir: Path | None,
) -> str | None:
    """Why the disk cannot hold the checkpoints the run writes, or None. A save writes the
    new checkpoint beside the ``--keep-checkpoints`` kept ones and deletes the oldest only
    once it is in place ([Note: atomic checkpoints]), so up to ``keep + 1`` are on disk at
    once; those of a resumed run already there take no more of the free space."""
    written = _checkpoints_written(config, checkpoint)
    if written == 0 or estimate.disk_free_bytes is None:
        return None
    same_folder = checkpoint is not None and (
        out_dir is None or out_dir.resolve() == checkpoint.run_dir.resolve()
    )
    present = len(list_checkpoints(checkpoint.path.parent)) if same_folder else 0
    keep = config.keep_checkpoints
    new = max(0, min(present + written, keep + 1) - present)
    if new * estimate.checkpoint_bytes <= estimate.disk_free_bytes:
        return None
    at_once = (
        f"{new} more at once while saving (--keep-checkpoints {keep}, and the new one written "
        "beside them before the oldest is deleted)"
        if new > 1
        else "one more"
    )
    return (
        f"a checkpoint of this model takes {format_bytes(estimate.checkpoint_bytes)} and this "
        f"run needs room for {at_once}, but only {format_bytes(estimate.disk_free_bytes)} is "
        "free where the run folder goes; give --out on a larger disk, "
        + ("--save-every 0 (save only at the end), " if new > 1 else "")
        + "or --keep-checkpoints 0 to write none"
    )


def _check_machine(
    estimate: MemoryEstimate,
    *,
    corpus_bytes: int,
    disk_problem: str | None,
    host_ranks: RanksPlan | None = None,
) -> None:
    """Refuse a run this machine's RAM (of every rank on this host, ``host_ranks``) or
    disk (``disk_problem``, from ``_disk_problem``) cannot hold (MemoryError / OSError)."""
    num_ranks = host_ranks.num_ranks if host_ranks is not None else 1
    # every rank holds the corpus's tokens
    corpus_all = corpus_bytes * num_ranks
    need = (
        host_ranks.ram_needed_bytes if host_ranks is not None else estimate.ram_needed_bytes
    ) + corpus_all
    if need > estimate.ram_available_bytes:
        if host_ranks is not None:
            raise MemoryError(
                f"this run of {num_ranks} ranks on this host needs about {format_bytes(need)} "
                f"of RAM (host store and optimizer states once, {num_ranks} x "
                f"{format_bytes(host_ranks.per_rank_bytes)} per rank"
                + (f", corpus {format_bytes(corpus_all)}" if corpus_all else "")
                + f") but only {format_bytes(estimate.ram_available_bytes)} is available. Use "
                "fewer ranks (--nproc-per-node), a smaller model, batch or sequence, or free "
                "memory; `ramflow plan --nproc-per-node "
                f"{num_ranks}` shows where the bytes go."
            )
        raise MemoryError(
            f"this run needs about {format_bytes(need)} of RAM (host store "
            f"{format_bytes(estimate.host_pinned_bytes + estimate.host_pageable_bytes)}"
            + (
                f", device side on the CPU {format_bytes(estimate.device_total_bytes)}"
                if estimate.device_type == "cpu"
                else ""
            )
            + (f", corpus {format_bytes(corpus_bytes)}" if corpus_bytes else "")
            + f", runtime) but only {format_bytes(estimate.ram_available_bytes)} is available. "
            "Use a smaller model, batch or sequence, or free memory; `ramflow plan` shows where "
            "the bytes go."
        )
    if disk_problem is not None:
        raise OSError(disk_problem)


def prepare_run(
    config: TrainConfig,
    checkpoint: Checkpoint | None,
    out_dir: Path | None,
    *,
    device: str | None = None,
    several_ranks: bool = False,
    num_local_ranks: int = 1,
    zero_stage: int | None = None,
) -> PreparedRun:
    """Check everything that can be refused, in order of cost, before anything is written:
    device and precision, tokenizer and model config, the weights' shapes (file headers
    only), the memory plan against the device budget and this machine's RAM and disk, and
    the data.

    Args:
        device: the device this process computes on, when it is not ``config.device``
            (one rank's GPU, ``Ranks.device``); None: ``config.device``.
        several_ranks: the run has several ranks (see ``plan_run``'s ``num_ranks``).
        num_local_ranks: the ranks on this host: the RAM is checked for all of them, as
            ``ramflow plan --nproc-per-node`` counts it (``scale.plan_ranks``).
        zero_stage: the run's ZeRO stage with several ranks (None: the plan's choice).

    Raises:
        ValueError, FileNotFoundError, CheckpointError, MemoryError, OSError: see ``train``.
    """
    policy = resolve_compute(
        device=device if device is not None else config.device, precision=config.precision
    )
    policy = dataclasses.replace(
        policy, wire_dtype=host_wire(config, policy.device.type, policy.wire_dtype)
    )
    tokenizer, mconfig = _tokenizer_and_config(config, checkpoint)
    weights_dir = base_weights(config, checkpoint)
    if config.lora_rank is not None:
        check_lora_targets(
            meta_model(mconfig), parse_targets(config.lora_targets) or DEFAULT_TARGETS
        )
    if weights_dir is not None:
        # shapes from the file headers, before anything is written
        check_weights(weights_dir, mconfig)
    budget = (
        parse_bytes(config.gpu_memory, what="--gpu-memory")
        if config.gpu_memory is not None
        else default_gpu_budget(policy.device)
    )
    estimate, fit = _estimate(
        config,
        mconfig,
        device_type=policy.device.type,
        precision=policy.precision,
        compute_dtype=policy.compute_dtype,
        wire_dtype=policy.wire_dtype,
        budget=budget,
        out_dir=out_dir,
        several_ranks=several_ranks,
    )
    host_ranks = (
        plan_ranks(estimate, num_ranks=num_local_ranks, zero_stage=zero_stage)
        if num_local_ranks > 1
        else None
    )
    disk = _disk_problem(estimate, config, checkpoint, out_dir)
    # before reading the data: fail fast
    _check_machine(estimate, corpus_bytes=0, disk_problem=disk, host_ranks=host_ranks)
    if is_chat_data(config.data):  # conversations: see ramflow.train.chat_data
        corpus = build_chat_corpus(
            config.data, tokenizer, seq_len=config.seq_len, val_fraction=config.val_fraction
        )
    else:
        documents = find_documents(config.data)
        source = (
            f"Python {platform.python_version()} standard library ({stdlib_root()})"
            if config.data is None
            else str(config.data)
        )
        corpus = build_corpus(
            documents,
            tokenizer,
            seq_len=config.seq_len,
            val_fraction=config.val_fraction,
            source=source,
        )
    _check_machine(
        estimate, corpus_bytes=corpus.num_tokens * 4, disk_problem=disk, host_ranks=host_ranks
    )
    return PreparedRun(
        policy,
        tokenizer,
        mconfig,
        corpus,
        estimate,
        estimate.ramflow_budget_bytes,
        checkpoint,
        fit,
        host_ranks,
    )


__all__ = ["PreparedRun", "plan_run", "prepare_run"]
