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

from ..choices import AUTO
from ..engine.host_store import resolve_precision
from ..formats.host import HostPrecision
from ..memory.estimate import BudgetTooSmall, offload_units
from ..memory.fit import BatchFit, fit_batch, micro_batch_candidates
from ..planner.predict import Rates
from ..sizes import format_bytes, parse_bytes
from .chat_data import build_chat_corpus, is_chat_data
from .config import TrainConfig
from .data import Corpus, build_corpus, find_documents, stdlib_root
from .estimate import (
    OFFLOAD_WINS_BY,
    LoraSizing,
    MemoryEstimate,
    RunDescription,
    SpeedInputs,
    default_device_budget,
    estimate_run_memory,
    predict_global_step,
)
from .gradient_holding import GradientHolding
from .lora import check_lora_targets, parse_targets
from .modeling import check_weights, meta_model, model_config, read_config
from .optimizers import OPTIMIZER_DEFAULTS
from .plan_report import disk_shortfall
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
        gpu_memory_bytes: ramflow's share of the device budget, what ``ramflow.offload``
            gets as ``gpu_memory`` (the budget less the activations), bytes; None for no cap.
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
    gpu_memory_bytes: int | None
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


def runs_unit_major(*, several_ranks: bool) -> bool:
    """Whether ``train`` runs a step's micro-batches unit-major (``ramflow.accumulate``,
    each unit's weights loaded once per phase of the step): on one rank (data parallelism
    is not supported there yet). An MoE's router auxiliary loss runs there too (see [Note:
    the router's auxiliary loss under the unit-major step] in
    ``ramflow.engine.router_logits``)."""
    return not several_ranks


def _estimate(
    config: TrainConfig,
    mconfig: Any,
    *,
    device_type: str,
    precision: str,
    compute_dtype: torch.dtype,
    host: HostFormats,
    device_budget_bytes: int | None,
    out_dir: Path | None,
    checkpoint: Checkpoint | None = None,
    several_ranks: bool = False,
    local_ranks: tuple[int, int | None] = (1, None),
    speed: SpeedInputs | None = None,
) -> tuple[MemoryEstimate, BatchFit | None]:
    """The run's estimate under the host formats ``host`` (``host_formats``: auto is
    decided there, once); with ``--batch-size auto``, at the largest micro-batch (and the
    lightest checkpointing) whose estimate fits the budget, and that fit. Its disk figures
    count the checkpoints the run (resuming ``checkpoint``, if given) holds at once in
    ``out_dir`` (``disk_checkpoints``). ``local_ranks``: the ranks on this host and their
    ZeRO stage, whose RAM the verdict's alternative must fit (``_with_machine_fix``)."""
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

    on_disk = disk_checkpoints(config, checkpoint, out_dir)

    def at(
        batch_size: int,
        checkpointing: str,
        host: HostFormats = host,
        speed: SpeedInputs | None = None,
        budget: int | None = device_budget_bytes,
    ) -> MemoryEstimate:
        """The estimate at ``batch_size`` and ``checkpointing`` under ``host`` (the run's
        host formats, or a verdict's alternative) and the device budget ``budget`` (the
        run's, or a verdict's alternative), with the gradients its steps hold
        (see [Note: the gradients of a CLI step] in ``gradient_holding.py``)."""
        holding = GradientHolding.of(
            config,
            host.precision,
            several_ranks=several_ranks,
            unit_major=runs_unit_major(several_ranks=several_ranks),
        )
        est = estimate_run_memory(
            mconfig,
            run=RunDescription(
                batch_size=batch_size,
                seq_len=config.seq_len,
                model_name=config.model_name,
                precision=precision,
                # no checkpoint written (--keep-checkpoints 0): the disk is not asked
                out_dir=(out_dir if out_dir is not None else Path("runs")) if on_disk else None,
            ),
            device_type=device_type,
            compute_dtype=compute_dtype,
            wire_dtype=host.wire_dtype,
            device_budget_bytes=budget,
            checkpointing=checkpointing,
            host_precision=host.precision,
            optimizer_states=OPTIMIZER_DEFAULTS[config.optimizer].num_states,
            held_gradients=holding.held_gradients,
            speed=speed,
            lora=None
            if config.lora_rank is None
            else LoraSizing(
                config.lora_rank, parse_targets(config.lora_targets), config.frozen_format
            ),
        )
        est = dataclasses.replace(est, host_precision_reason=host.reason, disk_checkpoints=on_disk)
        micro_batches = config.global_batch // batch_size
        if est.prediction is not None and micro_batches > 1:
            # the step the user waits for is the optimizer step of all its micro-batches
            figures = speed or SpeedInputs()
            whole = predict_global_step(
                mconfig,
                est,
                micro_batches=micro_batches,
                unit_major=runs_unit_major(several_ranks=several_ranks),
                timing_rates=figures.timing_rates,
                matmul_flops_per_s=figures.matmul_flops_per_s,
            )
            est = dataclasses.replace(est, prediction=whole)
        return est

    if not config.auto_batch_size:
        try:
            est = at(config.batch_size, config.checkpointing, speed=speed)
        except BudgetTooSmall as err:
            raise BudgetTooSmall(
                f"{err}{_device_fix(config, at, device_budget_bytes)}",
                needed_bytes=err.needed_bytes,
            ) from None
        return _with_machine_fix(config, est, at, host, local_ranks), None
    levels = {"auto": (False, True), "off": (False,), "on": (True,), "offload": (True,)}
    # checkpointing on means offload where asked for it
    on = "offload" if config.checkpointing == "offload" else "on"

    def fit_with(on: str, levels: tuple[bool, ...]) -> BatchFit:
        return fit_batch(
            global_batch=config.global_batch,
            device_budget_bytes=device_budget_bytes,
            estimate=lambda b, ckpt: at(b, on if ckpt else "off").device_total_bytes,
            checkpointing=levels,
        )

    reason = None
    try:
        try:
            fit = fit_with(on, levels[config.checkpointing])
        except BudgetTooSmall:
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
    except BudgetTooSmall:
        # a verdict, as for a fixed micro-batch: see [Note: a verdict names the change that fits]
        raise BudgetTooSmall(
            _no_micro_batch_fits(config, at, fit_with, device_budget_bytes)
        ) from None
    if (
        config.checkpointing == "auto"
        and on == "on"
        and fit.checkpointing
        and device_type == "cuda"
    ):
        unit_major = runs_unit_major(several_ranks=several_ranks)
        offloaded, why = _offload_fit(config, mconfig, fit, fit_with, at, speed, unit_major)
        if offloaded is not None:
            fit, on, reason = offloaded, "offload", why
    est = at(fit.micro_batch, on if fit.checkpointing else "off", speed=speed)
    if reason is not None:
        est = dataclasses.replace(est, checkpointing_reason=reason)
    return _with_machine_fix(config, est, at, host, local_ranks), fit


# [Note: a verdict names the change that fits]
# A run refused for its size leaves the user to guess what to change, so every "does not
# fit" says which one change fits, where there is one, as a flag to paste, with its figure
# from the same estimate that gave the verdict (``plan`` and ``train`` print the same):
# - the device budget (``BudgetTooSmall``): heavier activation checkpointing at the same
#   micro-batch (on, then offload), else the largest smaller micro-batch, with the
#   accumulation that keeps the global batch, under the lightest checkpointing that fits.
#   ``--batch-size auto`` with no micro-batch that fits: heavier checkpointing than the
#   run allows, else the smallest ``--gpu-memory`` for a micro-batch of 1 under the
#   heaviest it allows (checked by the estimate at that budget). Never a host format: they
#   change RAM and disk and never lower the device's bytes (the window holds wire copies,
#   whatever the master), so none can be the change that fits a device budget;
# - RAM or disk: the lean host formats (bf16 masters, 8-bit states: about a fifth of fp32's
#   host bytes, and a smaller checkpoint). Where only the disk is short: first saving only
#   at the end (``--save-every 0``: one checkpoint on disk at a time instead of the new one
#   beside the kept ones, the same training), then lean, then writing no checkpoint
#   (``--keep-checkpoints 0``). ``--host-precision auto`` took lean already, so it gets no
#   alternative. The disk's count is ``disk_checkpoints``, for both commands.


def _device_fix(config: TrainConfig, at: Any, budget: int | None) -> str:
    """The sentence that names what fits the device budget the run's micro-batch does not
    (empty where nothing does). See [Note: a verdict names the change that fits]."""
    heavier = {"off": ["on", "offload"], "on": ["offload"]}.get(config.checkpointing, [])
    tried: list[tuple[int, str]] = [(config.batch_size, m) for m in heavier]
    modes = [config.checkpointing, *heavier]
    smaller = (
        micro_batch_candidates(config.global_batch, max_micro_batch=config.batch_size - 1)
        if config.batch_size > 1
        else []
    )
    for b in smaller:
        tried += [(b, m) for m in modes]
    for b, mode in tried:
        try:
            est = at(b, mode)
        except BudgetTooSmall:
            continue
        smaller = b != config.batch_size
        flags = [f"--batch-size {b}", f"--grad-accum {config.global_batch // b}"] * smaller
        flags += [f"--checkpointing {mode}"] * (mode != config.checkpointing)
        same = f", the same global batch of {config.global_batch}" if smaller else ""
        return (
            f" It fits with {' '.join(flags)}: GPU {format_bytes(est.device_total_bytes)} of "
            f"the {format_bytes(budget or 0)} budget{same}."
        )
    return ""


def _no_micro_batch_fits(config: TrainConfig, at: Any, fit_with: Any, budget: int | None) -> str:
    """``--batch-size auto`` where no micro-batch fits the device budget ``budget``: why,
    and the change that fits: heavier activation checkpointing than the run allows, else
    the smallest ``--gpu-memory`` that holds a micro-batch of 1 under the heaviest it
    allows. See [Note: a verdict names the change that fits]."""
    heaviest = "offload" if config.checkpointing == "auto" else config.checkpointing
    head = (
        f"--batch-size auto: no micro-batch of the global batch of {config.global_batch} "
        f"fits the {format_bytes(budget or 0)} budget, not even 1 with activation "
        f"checkpointing {heaviest}"
    )
    for mode in {"off": ["on", "offload"], "on": ["offload"]}.get(config.checkpointing, []):
        try:
            fit = fit_with(mode, (True,))
        except BudgetTooSmall:
            continue
        est = at(fit.micro_batch, mode)
        return (
            f"{head}. It fits with --checkpointing {mode}: micro-batch {fit.micro_batch} x "
            f"{fit.grad_accum} accumulated, GPU {format_bytes(est.device_total_bytes)} of "
            "the budget."
        )
    needed = None
    try:
        at(1, heaviest)  # raises with the budget this micro-batch needs
    except BudgetTooSmall as err:
        needed = err.needed_bytes
    if needed is not None:
        larger = _size_at_least(needed * 1.05)
        est = at(1, heaviest, budget=parse_bytes(larger))
        if est.device_total_bytes <= parse_bytes(larger):
            return (
                f"{head}: that needs about {format_bytes(needed)}. It fits with "
                f"--gpu-memory {larger}: micro-batch 1 x {config.global_batch} accumulated, "
                f"the plan takes {format_bytes(est.device_total_bytes)} of it."
            )
    return f"{head}. Give a larger --gpu-memory or a shorter --seq-len."


def _size_at_least(num_bytes: float) -> str:
    """``num_bytes`` as a size string for ``--gpu-memory``, rounded up (``"12.35MiB"``):
    a budget suggested by a verdict must hold what it was computed for."""
    unit, size = ("GiB", 2**30) if num_bytes >= 2**30 else ("MiB", 2**20)
    return f"{math.ceil(num_bytes / size * 100) / 100:.2f}{unit}"


def _with_machine_fix(
    config: TrainConfig,
    est: MemoryEstimate,
    at: Any,
    host: HostFormats,
    local_ranks: tuple[int, int | None] = (1, None),
) -> MemoryEstimate:
    """``est`` (under the run's host formats ``host``) with its ``machine_fix`` where this machine's RAM (of ``local_ranks``'
    ranks and ZeRO stage, as ``plan_ranks`` counts it) or disk cannot hold it. See [Note:
    a verdict names the change that fits]."""
    num_ranks, zero_stage = local_ranks

    def ram(e: MemoryEstimate) -> tuple[int, bool]:
        if num_ranks == 1:
            return e.ram_needed_bytes, e.fits_ram
        ranks = plan_ranks(e, num_ranks=num_ranks, zero_stage=zero_stage)
        return ranks.ram_needed_bytes, ranks.fits_ram

    fits_ram = ram(est)[1]
    if fits_ram and est.fits_disk:
        return est
    fix = None
    if fits_ram and est.disk_checkpoints > 1 and est.checkpoint_bytes <= (est.disk_free_bytes or 0):
        # only the cadence is short of disk: the same run, saved once at its end
        one = dataclasses.replace(est, disk_checkpoints=1)
        fix = f"--save-every 0 (save only at the end): {_checkpoints_text(one)} at a time"
    elif config.host_precision != AUTO and config.host_precision.name != "lean":
        precision = HostPrecision.lean()
        formats = HostFormats(precision, precision.wire_for(None, default=host.wire_dtype))
        lean = at(est.batch_size, est.checkpointing_mode, host=formats)
        need, lean_fits_ram = ram(lean)
        if lean_fits_ram and lean.fits_disk:
            fix = (
                f"--host-precision lean: RAM {format_bytes(need)}"
                + (f" ({num_ranks} ranks)" if num_ranks > 1 else "")
                + f" of {format_bytes(lean.ram_available_bytes)} available"
                + ("" if est.fits_disk else f", {_checkpoints_text(lean)} at a time")
            )
    if fix is None and fits_ram:
        fix = "--keep-checkpoints 0 (no checkpoint written), or --out on a larger disk"
    return dataclasses.replace(est, machine_fix=fix)


def _checkpoints_text(est: MemoryEstimate) -> str:
    """``"a checkpoint of 40.54 MiB"`` or ``"2 checkpoints of 40.54 MiB"``: the estimate's
    ``disk_checkpoints``."""
    n, size = est.disk_checkpoints, format_bytes(est.checkpoint_bytes)
    return f"a checkpoint of {size}" if n == 1 else f"{n} checkpoints of {size}"


def _offload_fit(
    config: TrainConfig,
    mconfig: Any,
    fit: BatchFit,
    fit_with: Any,
    at: Any,
    speed: SpeedInputs | None,
    unit_major: bool,
) -> tuple[BatchFit | None, str | None]:
    """``--batch-size auto --checkpointing auto`` where checkpointing every layer fits: the
    fit with the layers' inputs offloaded, and why, where it takes a larger micro-batch
    whose global batch is predicted faster; else (None, None). ``unit_major``: the steps
    run unit-major (``runs_unit_major``). See [Note: when auto offloads the layers'
    inputs] in ``estimate.py``."""
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
        return predict_global_step(
            mconfig, est, micro_batches=f.grad_accum, unit_major=unit_major, **speed_kw
        ).step_s

    on_s, off_s = global_batch_s(fit, "on"), global_batch_s(offloaded, "offload")
    if off_s >= on_s * (1 - OFFLOAD_WINS_BY):
        return None, None
    return offloaded, (
        f"with the layers' inputs offloaded a micro-batch of {offloaded.micro_batch} fits "
        f"instead of {fit.micro_batch}: predicted {off_s:.2f} s per global batch of "
        f"{config.global_batch} against {on_s:.2f} s"
    )


@dataclass(frozen=True)
class HostFormats:
    """A run's host formats, decided once at set-up for its plan and its run.

    Attributes:
        precision: the host formats (``auto`` decided).
        wire_dtype: the dtype of the weights' device copies under them.
        reason: why ``--host-precision auto`` chose them (None when they were given).
    """

    precision: HostPrecision
    wire_dtype: torch.dtype
    reason: str | None = None


def host_formats(
    config: TrainConfig, mconfig: Any, *, device_type: str, wire_dtype: torch.dtype
) -> HostFormats:
    """The run's host formats and wire dtype, from ``config.host_precision`` and the
    device's wire dtype ``wire_dtype``: ``"auto"`` is decided here (``resolve_precision``
    over the model's units on the meta device and this machine's RAM), once for both the
    plan and the run. On the CPU the wire follows the master (bf16 masters are the wire
    copy); a CUDA run's wire is the device's (an fp16 one under bf16 masters is refused with
    what works). Where auto finds nothing that fits, the plan of the leanest formats says by
    how much (``train`` then refuses it with the same figures).

    Raises:
        ValueError: masters that cannot serve the device's wire (``HostPrecision.check_wire``).
    """
    auto = config.host_precision == AUTO
    try:
        precision, wire, reason = resolve_precision(
            config.host_precision,
            lambda: offload_units(meta_model(mconfig))[0],
            wire_dtype=wire_dtype if auto or device_type != "cpu" else None,
            default_wire=wire_dtype,
        )
    except MemoryError:
        if not auto:
            raise
        lean = HostPrecision.lean()
        return HostFormats(
            lean,
            lean.wire_for(None, default=wire_dtype),
            "neither fp32 nor lean fits this machine's RAM; planned with lean, the leanest",
        )
    return HostFormats(precision, wire, reason)


def plan_run(
    config: TrainConfig,
    *,
    out_dir: str | os.PathLike | None = None,
    timing_rates: Rates | None = None,
    matmul_flops_per_s: float | None = None,
    num_ranks: int = 1,
    zero_stage: int | None = None,
) -> MemoryEstimate:
    """The memory plan of a training run, without allocating the model (``ramflow plan``),
    with its predicted step time on a GPU (``MemoryEstimate.prediction`` and ``timed_plan``).

    Unlike ``train``, the device need not be present: ``device="cuda"`` plans a GPU run
    on a machine without one (with no budget unless ``device_budget_bytes`` is given). With no
    device named, a ``device_budget_bytes`` budget also plans a GPU run: a budget is for a GPU. The
    estimate's ``device_note`` says which device was assumed and why.

    Args:
        config: the run's settings.
        out_dir: where checkpoints would go, for the disk check.
        timing_rates: copy and CPU optimizer rates for the prediction (default: the H200
            box's, see ``ramflow.planner.predict``).
        matmul_flops_per_s: the GPU's bf16 matmul rate, FLOP/s (default: the H200's).
        num_ranks: ranks of the run (``--nproc-per-node``): with several, a run without
            clipping or accumulation steps during backward and keeps no full host gradient
            buffer (``TrainConfig.steps_during_backward``); the verdict's alternative
            (``machine_fix``) fits the RAM of all of them.
        zero_stage: their ZeRO stage (None: the plan's choice), for that RAM.

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
        if config.device_budget_bytes is not None:
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
    _, mconfig = _tokenizer_and_config(config, None)
    host = host_formats(config, mconfig, device_type=device_type, wire_dtype=wire)
    device_budget_bytes = config.device_budget_bytes
    if device_budget_bytes is None and device_type == "cuda" and torch.cuda.is_available():
        device_budget_bytes = default_device_budget(
            resolve_compute(device=device, precision=config.precision).device
        )
    estimate, fit = _estimate(
        config,
        mconfig,
        device_type=device_type,
        precision=precision,
        compute_dtype=compute,
        host=host,
        device_budget_bytes=device_budget_bytes,
        out_dir=Path(out_dir) if out_dir is not None else None,
        several_ranks=num_ranks > 1,
        local_ranks=(num_ranks, zero_stage),
        speed=SpeedInputs(timing_rates=timing_rates, matmul_flops_per_s=matmul_flops_per_s),
    )
    if fit is not None:
        note = (
            (note + "; " if note else "")
            + "--batch-size auto: "
            + fit.describe().replace("\n", "\n  ")
        )
    return dataclasses.replace(estimate, device_note=note)


def disk_checkpoints(
    config: TrainConfig, checkpoint: Checkpoint | None, out_dir: Path | None
) -> int:
    """How many new checkpoints the free disk must hold at once for this run (0: it writes
    none, ``--keep-checkpoints 0``): ``ramflow plan`` and ``train`` count them here, so
    that they agree. The run writes one every ``--save-every`` steps before its last and
    one at the end (a resumed run with nothing left to do saves its step again). A save
    writes the new checkpoint beside the ``--keep-checkpoints`` kept ones and deletes the
    oldest only once it is in place ([Note: atomic checkpoints]), so up to ``keep + 1``
    are on disk at once; those of a resumed run already in ``out_dir`` take no more of
    the free space."""
    keep = config.keep_checkpoints
    if keep == 0:
        return 0
    start = checkpoint.step if checkpoint is not None else 0
    every = config.save_every
    written = (max(0, (config.steps - 1) // every - start // every) if every else 0) + 1
    same_folder = checkpoint is not None and (
        out_dir is None or out_dir.resolve() == checkpoint.run_dir.resolve()
    )
    present = len(list_checkpoints(checkpoint.path.parent)) if same_folder else 0
    return max(0, min(present + written, keep + 1) - present)


def _check_machine(
    estimate: MemoryEstimate,
    *,
    corpus_bytes: int,
    host_ranks: RanksPlan | None = None,
) -> None:
    """Refuse a run this machine's RAM (of every rank on this host, ``host_ranks``) or
    disk (its ``disk_checkpoints``, in ``plan``'s words: ``disk_shortfall``) cannot hold
    (MemoryError / OSError)."""
    num_ranks = host_ranks.num_ranks if host_ranks is not None else 1
    # every rank holds the corpus's tokens
    corpus_all = corpus_bytes * num_ranks
    need = (
        host_ranks.ram_needed_bytes if host_ranks is not None else estimate.ram_needed_bytes
    ) + corpus_all
    if need > estimate.ram_available_bytes:
        # the estimate's own RAM over the machine's: its fix is a host format (where its RAM
        # fits, the fix is the disk's; see [Note: a verdict names the change that fits])
        over = not (host_ranks.fits_ram if host_ranks is not None else estimate.fits_ram)
        fix = (
            f"It fits with {estimate.machine_fix}; else use"
            if over and estimate.machine_fix is not None
            else "Use"
        )
        if host_ranks is not None:
            raise MemoryError(
                f"this run of {num_ranks} ranks on this host needs about {format_bytes(need)} "
                f"of RAM (host store and optimizer states once, {num_ranks} x "
                f"{format_bytes(host_ranks.per_rank_bytes)} per rank"
                + (f", corpus {format_bytes(corpus_all)}" if corpus_all else "")
                + f") but only {format_bytes(estimate.ram_available_bytes)} is available. "
                + fix
                + " fewer ranks (--nproc-per-node), a smaller model, batch or sequence, or free "
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
            + fix
            + " a smaller model, batch or sequence, or free memory; `ramflow plan` shows where "
            "the bytes go."
        )
    short = disk_shortfall(estimate)
    if short is not None:
        fix = (
            estimate.machine_fix or "--out on a larger disk, or --keep-checkpoints 0 to write none"
        )
        raise OSError(f"{short}; it fits with {fix}")


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
    tokenizer, mconfig = _tokenizer_and_config(config, checkpoint)
    host = host_formats(
        config, mconfig, device_type=policy.device.type, wire_dtype=policy.wire_dtype
    )
    policy = dataclasses.replace(policy, wire_dtype=host.wire_dtype)
    weights_dir = base_weights(config, checkpoint)
    if config.lora_rank is not None:
        check_lora_targets(meta_model(mconfig), parse_targets(config.lora_targets))
    if weights_dir is not None:
        # shapes from the file headers, before anything is written
        check_weights(weights_dir, mconfig)
    device_budget_bytes = (
        config.device_budget_bytes
        if config.device_budget_bytes is not None
        else default_device_budget(policy.device)
    )
    estimate, fit = _estimate(
        config,
        mconfig,
        device_type=policy.device.type,
        precision=policy.precision,
        compute_dtype=policy.compute_dtype,
        host=host,
        device_budget_bytes=device_budget_bytes,
        out_dir=out_dir,
        checkpoint=checkpoint,
        several_ranks=several_ranks,
        local_ranks=(num_local_ranks, zero_stage),
    )
    host_ranks = (
        plan_ranks(estimate, num_ranks=num_local_ranks, zero_stage=zero_stage)
        if num_local_ranks > 1
        else None
    )
    # before reading the data: fail fast
    _check_machine(estimate, corpus_bytes=0, host_ranks=host_ranks)
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
    _check_machine(estimate, corpus_bytes=corpus.num_tokens * 4, host_ranks=host_ranks)
    return PreparedRun(
        policy,
        tokenizer,
        mconfig,
        corpus,
        estimate,
        estimate.gpu_memory_bytes,
        checkpoint,
        fit,
        host_ranks,
    )


__all__ = ["PreparedRun", "plan_run", "prepare_run"]
