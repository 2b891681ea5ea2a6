"""The training loop of ``ramflow train``: an ordinary PyTorch loop over an offloaded model.

Legend: B = sequences per micro-batch, T = tokens per sequence.

Everything that can be refused is checked before anything is written or allocated: the
settings, the checkpoint to resume (its manifest), the data, the tokenizer, and the memory
plan (device budget, RAM, disk). Only then is the run folder created and the model built.
The loop itself is what DESIGN.md promises a user can write: ``ramflow.offload``,
``ramflow.optim.AdamW``, a ``LambdaLR`` schedule, ``torch.autocast``, a ``GradScaler``
for fp16, ``opt.no_step()`` for the non-final micro-batches of gradient accumulation,
``ramflow.clip_grad_norm_`` and the model's own activation checkpointing.

[Note: stopping and resuming]
Ctrl-C (SIGINT) only sets a flag; the loop finishes the step in flight, writes a checkpoint
and returns (a second Ctrl-C aborts at once, keeping the last checkpoint). A checkpoint
holds everything the next step depends on: fp32 master weights, optimizer states, the LR
schedule, the GradScaler, RNG states and the data position (see [Note: data position] in
``data.py``). A resumed run therefore computes the same steps as the uninterrupted one:
on the CPU, and on one GPU with the same settings, the loss curve and weights match bit
for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import torch

import ramflow

from .._plan import format_bytes, parse_bytes
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    load_optimizer_state,
    open_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from .data import BatchStream, Corpus, build_corpus, find_documents, stdlib_root, validation_batches
from .estimate import CHECKPOINTING_MODES, MemoryEstimate, default_gpu_budget, estimate_memory
from .generation import resolve_model_dir
from .modeling import (
    build_model,
    check_weights,
    count_parameters,
    load_model,
    model_config,
    read_config,
)
from .precision import PRECISIONS, ComputePolicy, planned_compute, resolve_compute
from .presets import get_preset
from .report import RunReport, format_duration, mean_tail, summary_table
from .schedule import make_scheduler, warmup_cosine
from .tokenizer import Tokenizer, has_tokenizer, load_tokenizer

# Settings a resumed run may change: they decide how long it runs, where, and how it uses
# memory, not what a step computes.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "save_every",
        "keep_checkpoints",
        "eval_every",
        "eval_batches",
        "device",
        "gpu_memory",
        "checkpointing",
    }
)


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run (what ``ramflow train``'s options become).

    Build it with ``TrainConfig.from_options``, which fills the preset's defaults.

    Attributes:
        preset: name of a model preset (``ramflow.train.presets.PRESETS``), or None with ``model``.
        model: a Hugging Face checkpoint folder to start from, or None with ``preset``.
        tokenizer: a local Hugging Face tokenizer folder; None: the model folder's own
            tokenizer if it has one, else the byte tokenizer.
        data: text file, folder or JSON lines; None: the Python standard library sources.
        steps: optimizer steps to reach (a resumed run counts the steps already done).
        batch_size: sequences per micro-batch (B).
        seq_len: tokens per sequence (T).
        grad_accum: micro-batches per optimizer step (tokens per step = grad_accum * B * T).
        lr: peak learning rate.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warmup steps.
        weight_decay: AdamW decoupled weight decay of matrices (norm weights get none).
        beta1, beta2, eps: AdamW's.
        clip_grad: global gradient-norm limit; 0 turns clipping off.
        precision: ``auto`` (bf16 on CUDA, fp32 on the CPU), ``bf16``, ``fp16`` (with a
            GradScaler) or ``fp32``.
        checkpointing: activation checkpointing ``on``, ``off`` or ``auto`` (on when the
            activations would not fit in the device budget beside ramflow's smallest plan).
        seed: seeds the model's initialisation and the data order.
        device: ``cuda``, ``cuda:N`` or ``cpu``; None: CUDA when available.
        gpu_memory: the device budget for the whole run (weights, gradients, activations),
            e.g. ``"12GiB"``; None: 90% of the free memory of a CUDA device, no cap on the CPU.
        save_every: write a checkpoint every this many steps (0: only at the end and on Ctrl-C).
        keep_checkpoints: finished checkpoints kept on disk.
        eval_every: validation every this many steps (0: only at the end).
        eval_batches: micro-batches of held-out text per validation.
        val_fraction: share of the corpus held out for validation.
    """

    preset: str | None = "tiny"
    model: str | None = None
    tokenizer: str | None = None
    data: str | None = None
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "auto"
    checkpointing: str = "auto"
    seed: int = 0
    device: str | None = None
    gpu_memory: str | None = None
    save_every: int = 500
    keep_checkpoints: int = 1
    eval_every: int = 60
    eval_batches: int = 8
    val_fraction: float = 0.01

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.model is None):
            raise ValueError("give either --preset or --model DIR, not both")
        if self.preset is not None:
            get_preset(self.preset)
        positive = (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "eval_batches",
            "keep_checkpoints",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        for name in ("warmup_steps", "save_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}"
                )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.clip_grad < 0:
            raise ValueError(
                f"--clip-grad must be >= 0 (0 turns clipping off), got {self.clip_grad}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}"
            )
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(
                f"--checkpointing {self.checkpointing!r}: choose one of {', '.join(CHECKPOINTING_MODES)}"
            )
        if self.gpu_memory is not None:
            parse_bytes(self.gpu_memory, what="--gpu-memory")

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.batch_size * self.seq_len

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """A config from command-line style options; None (or absent) means the default.

        Defaults that depend on the model: ``batch_size``, ``seq_len``, ``lr`` and
        ``steps`` come from the preset (``tiny`` when neither preset nor model is given);
        a ``model`` folder gets B=4, T=min(2048, its context), lr=2e-5 and 100 steps.
        ``warmup_steps`` defaults to a fifth of the steps (at most 200), ``eval_every`` to
        a fifth.

        Raises:
            ValueError: an unknown option or an invalid value (see the attributes).
        """
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown training options: {', '.join(sorted(unknown))}")
        given = {k: v for k, v in options.items() if v is not None}
        if "model" in given:
            given.setdefault("preset", None)
            if given["preset"] is not None:
                raise ValueError("give either --preset or --model DIR, not both")
            given["model"] = str(
                resolve_model_dir(given["model"])
            )  # a run folder: its latest checkpoint
            ctx = getattr(read_config(given["model"]), "max_position_embeddings", 2048)
            base = {"batch_size": 4, "seq_len": min(2048, ctx), "lr": 2e-5, "steps": 100}
        else:
            preset = get_preset(given.setdefault("preset", "tiny"))
            base = {
                "batch_size": preset.batch_size,
                "seq_len": preset.seq_len,
                "lr": preset.lr,
                "steps": preset.steps,
            }
        for k, v in base.items():
            given.setdefault(k, v)
        steps = given["steps"]
        given.setdefault("warmup_steps", min(200, steps // 5))
        given.setdefault("eval_every", max(1, steps // 5))
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resume_config(checkpoint: Checkpoint, **options: Any) -> TrainConfig:
    """The settings of the run that wrote ``checkpoint``, with the changes in ``options``
    (None means unchanged).

    Raises:
        ValueError: an option differs from the checkpoint's and is not one of
            ``RESUMABLE_CHANGES`` (e.g. another preset: a checkpoint of another model shape).
    """
    stored = dict(checkpoint.state["train_config"])
    for key, value in options.items():
        if value is None or key not in stored or stored[key] == value:
            continue
        if key in ("preset", "model"):
            raise CheckpointError(
                f"--{key} {value} does not match the checkpoint {checkpoint.path}, which is of "
                f"{'preset ' + str(stored['preset']) if stored['preset'] else 'the model in ' + str(stored['model'])} "
                "(another model shape). Resume without --preset/--model, or start a new run."
            )
        if key not in RESUMABLE_CHANGES:
            raise ValueError(
                f"--{key.replace('_', '-')} {value} differs from the checkpoint's {stored[key]!r}; a resumed "
                f"run keeps the settings that decide its steps (it may change only "
                f"{', '.join('--' + k.replace('_', '-') for k in sorted(RESUMABLE_CHANGES))}). "
                "Start a new run to change it."
            )
        stored[key] = value
    return TrainConfig(**stored)


@dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        run_dir: the run folder.
        checkpoint: the last checkpoint written (None if none).
        steps_done: optimizer steps done in total (the resumed ones included).
        interrupted: stopped early by Ctrl-C (or ``stop``).
        first_loss / last_loss: training loss of the first step of this run and the mean
            of its last ten steps.
        val_loss: the last validation loss (None if none ran).
        elapsed_s: wall time of this process's loop (seconds).
        tokens_per_s: training tokens per second of this process.
        peak_gpu_bytes: ``torch.cuda.max_memory_allocated`` (None on the CPU).
        peak_host_bytes: peak resident memory of this process.
        summary: the summary table as printed.
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


@dataclass
class _Setup:
    """Everything checked before the run folder exists."""

    policy: ComputePolicy
    tokenizer: Tokenizer
    model_config: Any
    corpus: Corpus
    estimate: MemoryEstimate
    ramflow_budget: int | None
    checkpoint: Checkpoint | None


def _peak_host_bytes() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return psutil.Process().memory_info().rss


def _model_name(config: TrainConfig) -> str:
    return config.preset if config.preset is not None else str(config.model)


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
) -> MemoryEstimate:
    ctx = getattr(mconfig, "max_position_embeddings", None)
    if ctx is not None and config.seq_len > ctx:
        raise ValueError(f"--seq-len {config.seq_len} exceeds the model's context of {ctx} tokens")
    return estimate_memory(
        mconfig,
        model_name=_model_name(config),
        device_type=device_type,
        precision=precision,
        compute_dtype=compute_dtype,
        wire_dtype=wire_dtype,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        gpu_memory_bytes=budget,
        checkpointing=config.checkpointing,
        out_dir=out_dir if out_dir is not None else Path("runs"),
    )


def plan_run(config: TrainConfig, *, out_dir: str | os.PathLike | None = None) -> MemoryEstimate:
    """The memory plan of a training run, without allocating the model (``ramflow plan``).

    Unlike ``train``, the device need not be present: ``device="cuda"`` plans a GPU run
    on a machine without one (with no budget unless ``gpu_memory`` is given).

    Raises:
        ValueError, FileNotFoundError: as ``train``'s checks (settings, model, tokenizer,
            a device budget too small).
    """
    device_type, precision, compute, wire = planned_compute(
        device=config.device, precision=config.precision
    )
    _, mconfig = _tokenizer_and_config(config, None)
    if config.gpu_memory is not None:
        budget = parse_bytes(config.gpu_memory, what="--gpu-memory")
    elif device_type == "cuda" and torch.cuda.is_available():
        budget = default_gpu_budget(
            resolve_compute(device=config.device, precision=config.precision).device
        )
    else:
        budget = None
    return _estimate(
        config,
        mconfig,
        device_type=device_type,
        precision=precision,
        compute_dtype=compute,
        wire_dtype=wire,
        budget=budget,
        out_dir=Path(out_dir) if out_dir is not None else None,
    )


def _check_machine(estimate: MemoryEstimate, *, corpus_bytes: int) -> None:
    """Refuse a run this machine's RAM or disk cannot hold (MemoryError / OSError)."""
    need = estimate.ram_needed_bytes + corpus_bytes
    if need > estimate.ram_available_bytes:
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
    if not estimate.fits_disk:
        raise OSError(
            f"a checkpoint of this model takes {format_bytes(estimate.checkpoint_bytes)}, but only "
            f"{format_bytes(estimate.disk_free_bytes or 0)} is free where the run folder goes; "
            "give --out on a larger disk"
        )


def _prepare(config: TrainConfig, checkpoint: Checkpoint | None, out_dir: Path | None) -> _Setup:
    policy = resolve_compute(device=config.device, precision=config.precision)
    tokenizer, mconfig = _tokenizer_and_config(config, checkpoint)
    weights_dir = checkpoint.path if checkpoint is not None else config.model
    if weights_dir is not None:
        # shapes from the file headers, before anything is written
        check_weights(weights_dir, mconfig)
    budget = (
        parse_bytes(config.gpu_memory, what="--gpu-memory")
        if config.gpu_memory is not None
        else default_gpu_budget(policy.device)
    )
    estimate = _estimate(
        config,
        mconfig,
        device_type=policy.device.type,
        precision=policy.precision,
        compute_dtype=policy.compute_dtype,
        wire_dtype=policy.wire_dtype,
        budget=budget,
        out_dir=out_dir,
    )
    _check_machine(estimate, corpus_bytes=0)  # before reading the data: fail fast
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
    _check_machine(estimate, corpus_bytes=corpus.num_tokens * 4)
    ramflow_budget = None if budget is None else budget - estimate.device_activation_bytes
    return _Setup(policy, tokenizer, mconfig, corpus, estimate, ramflow_budget, checkpoint)


def _new_run_dir() -> Path:
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


@contextlib.contextmanager
def _sigint_sets(stop: threading.Event, say: Callable[[str], None]) -> Iterator[None]:
    """While inside, the first SIGINT sets ``stop``; the second raises KeyboardInterrupt.
    See [Note: stopping and resuming]. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        say(
            "interrupted: finishing this step and saving a checkpoint (Ctrl-C again to abort without saving)"
        )

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _param_groups(
    model: torch.nn.Module, weight_decay: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """Decay matrices, not norm weights or biases (the usual LLM recipe). Returns the
    groups and the parameter names in the optimizer's order."""
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() >= 2:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return groups, decay_names + no_decay_names


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    policy: ComputePolicy,
    batch_size: int,
    seq_len: int,
    max_batches: int,
) -> float:
    """Mean cross-entropy (nats per token) of ``model`` on held-out (N,) ``tokens``, over
    at most ``max_batches`` (B, T) batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in validation_batches(
            tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches
        ):
            batch = batch.to(policy.device)
            with policy.autocast():
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            total += loss.float().item() * batch.shape[0]
            count += batch.shape[0]
    finally:
        model.train(was_training)
    return total / max(count, 1)


def train(
    config: TrainConfig,
    *,
    out: str | os.PathLike | None = None,
    resume: str | os.PathLike | Checkpoint | None = None,
    progress: bool = True,
    stop: threading.Event | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    handle_sigint: bool = True,
) -> TrainResult:
    """Train a causal language model with ramflow and write the run folder.

    The run folder gets ``run.json`` (settings), ``log.jsonl`` (see ``report.py``),
    ``loss.png`` and ``checkpoints/`` (see [Note: checkpoint layout] in ``checkpoint.py``).

    Args:
        config: the settings (``TrainConfig.from_options`` or ``resume_config``).
        out: the run folder; default ``runs/<timestamp>``, or the resumed run's folder.
        resume: a checkpoint, run or checkpoints folder to continue from; ``config``
            must agree with it (see ``resume_config``).
        progress: show the progress bar.
        stop: set it to stop after the current step (a checkpoint is written).
        on_step: called with each step's log record (for callers that watch the run).
        handle_sigint: in the main thread, Ctrl-C stops after the current step and saves.

    Returns:
        A ``TrainResult``.

    Raises:
        ValueError: invalid settings, data, tokenizer or model folder; a device budget too
            small (the message gives the smallest that works).
        CheckpointError: the checkpoint is missing, corrupt, truncated, or of another model.
        FileNotFoundError: a path that does not exist.
        MemoryError: the machine's RAM cannot hold the run.
        OSError: the disk cannot hold two checkpoints.
        KeyboardInterrupt: a second Ctrl-C (the last checkpoint stays).
        Nothing is written before these checks pass.
    """
    ckpt = resume if isinstance(resume, Checkpoint) or resume is None else open_checkpoint(resume)
    if ckpt is not None:
        resume_config(ckpt, **config.to_dict())  # refuses settings that would change the steps
    run_dir = Path(out) if out is not None else (ckpt.run_dir if ckpt is not None else None)
    setup = _prepare(config, ckpt, run_dir)
    run_dir = run_dir if run_dir is not None else _new_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = stop if stop is not None else threading.Event()
    start_step = ckpt.step if ckpt is not None else 0
    report = RunReport(
        run_dir,
        total_steps=config.steps,
        start_step=start_step,
        keep_until=start_step if ckpt is not None else None,
        progress=progress,
    )
    sigint = _sigint_sets(stop, report.message) if handle_sigint else contextlib.nullcontext()
    try:
        with sigint:
            return _train(config, setup, run_dir, report, stop, on_step)
    finally:
        report.close()


def _write_run_json(run_dir: Path, config: TrainConfig, setup: _Setup) -> None:
    import json

    info = {
        "config": config.to_dict(),
        "device": str(setup.policy.device),
        "precision": setup.policy.precision,
        "checkpointing": setup.estimate.checkpointing,
        "num_parameters": setup.estimate.num_parameters,
        "tokenizer": setup.tokenizer.name,
        "corpus": {
            "source": setup.corpus.source,
            "documents": setup.corpus.num_documents,
            "train_tokens": setup.corpus.train_tokens.numel(),
            "val_tokens": setup.corpus.val_tokens.numel(),
            "fingerprint": setup.corpus.fingerprint,
        },
        "versions": {
            "ramflow": ramflow.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    tmp = run_dir / f".run.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, run_dir / "run.json")


def _train(
    config: TrainConfig,
    setup: _Setup,
    run_dir: Path,
    report: RunReport,
    stop: threading.Event,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> TrainResult:
    policy, corpus, est, ckpt = setup.policy, setup.corpus, setup.estimate, setup.checkpoint
    _write_run_json(run_dir, config, setup)
    say = report.message
    say(
        f"model {_model_name(config)}: {est.num_parameters / 1e6:,.2f} M parameters | device {policy.device}, "
        f"{policy.precision}, activation checkpointing {'on' if est.checkpointing else 'off'}"
    )
    say(
        f"data {corpus.source}: documents {corpus.num_documents:,}, {corpus.train_tokens.numel():,} training "
        f"and {corpus.val_tokens.numel():,} validation tokens ({setup.tokenizer.name} tokenizer)"
    )
    say(
        f"memory: device {format_bytes(est.device_total_bytes)} planned, host "
        f"{format_bytes(est.host_pinned_bytes + est.host_pageable_bytes)} "
        f"({format_bytes(est.host_pinned_bytes)} pinned) | run folder {run_dir}"
    )

    # ---- model, offload, optimizer, schedule
    if ckpt is not None:
        model = load_model(ckpt.path, config=setup.model_config)
    elif config.model is not None:
        model = load_model(config.model, config=setup.model_config)
    else:
        model = build_model(setup.model_config, seed=config.seed)
    if est.checkpointing:
        enable = (
            getattr(model, "activation_checkpointing_enable", None)
            or model.gradient_checkpointing_enable
        )
        enable()
    model.train()
    ramflow.offload(
        model, gpu_memory=setup.ramflow_budget, device=policy.device, wire_dtype=policy.wire_dtype
    )
    try:
        plan = ramflow.get_plan(model)
        if plan.resident != est.plan.resident or plan.window_bytes != est.plan.window_bytes:
            warnings.warn(
                "ramflow chose another plan than the estimate; `ramflow plan` may be off",
                stacklevel=2,
            )
        groups, param_names = _param_groups(model, config.weight_decay)
        opt = ramflow.optim.AdamW(
            groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps
        )
        sched = make_scheduler(
            opt,
            warmup_steps=config.warmup_steps,
            total_steps=config.steps,
            min_lr_ratio=config.min_lr_ratio,
        )
        scaler = torch.amp.GradScaler(policy.device.type, enabled=policy.use_grad_scaler)
        batches = BatchStream(
            corpus.train_tokens,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            seed=config.seed,
        )
        step, tokens_seen = 0, 0
        if ckpt is not None:
            state = ckpt.state
            load_optimizer_state(ckpt, opt, param_names)
            sched.load_state_dict(dict(state["scheduler"]))
            # the schedule may have a new length (--steps changed): the next LR follows it
            fn = warmup_cosine(
                warmup_steps=config.warmup_steps,
                total_steps=config.steps,
                min_lr_ratio=config.min_lr_ratio,
            )
            for g, base in zip(opt.param_groups, sched.base_lrs):
                g["lr"] = base * fn(sched.last_epoch)
            if state["grad_scaler"]:
                scaler.load_state_dict(state["grad_scaler"])
            restore_rng_state(ckpt)
            step, tokens_seen = ckpt.step, state["tokens_seen"]
            batches.position = state["data_position"]
            if state["corpus"]["fingerprint"] != corpus.fingerprint:
                say(
                    "warning: the data differ from the checkpoint's; the data position may point elsewhere"
                )
            report.log({"event": "resume", "step": step, "checkpoint": str(ckpt.path)})
        else:
            torch.manual_seed(config.seed)
            report.log(
                {
                    "event": "start",
                    "step": 0,
                    "config": config.to_dict(),
                    "device": str(policy.device),
                }
            )
        return _loop(
            config,
            setup,
            run_dir,
            report,
            stop,
            on_step,
            model,
            opt,
            sched,
            scaler,
            batches,
            param_names,
            step,
            tokens_seen,
        )
    finally:
        with contextlib.suppress(Exception):  # leave no optimizer step running at exit
            ramflow.synchronize(model)


def _loop(
    config,
    setup,
    run_dir,
    report,
    stop,
    on_step,
    model,
    opt,
    sched,
    scaler,
    batches,
    param_names,
    step,
    tokens_seen,
) -> TrainResult:
    policy, corpus = setup.policy, setup.corpus
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
    t_start = time.perf_counter()

    def save(step_now: int) -> Path:
        t0 = time.perf_counter()
        path = save_checkpoint(
            run_dir / "checkpoints",
            step=step_now,
            model=model,
            optimizer=opt,
            param_names=param_names,
            tokenizer=setup.tokenizer,
            keep=config.keep_checkpoints,
            state={
                "data_position": batches.position,
                "tokens_seen": tokens_seen,
                "scheduler": sched.state_dict(),
                "grad_scaler": scaler.state_dict(),
                "train_config": config.to_dict(),
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
        return path

    val_step = 0

    def run_eval(step_now: int) -> float:
        nonlocal val_step
        val_step = step_now
        loss = evaluate(
            model,
            corpus.val_tokens,
            policy=policy,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            max_batches=config.eval_batches,
        )
        report.log({"event": "eval", "step": step_now, "val_loss": loss})
        say(f"step {step_now}: validation loss {loss:.4f}")
        return loss

    if step == 0 and config.eval_every:
        val_loss = run_eval(0)
    while step < config.steps:
        if stop.is_set():
            interrupted = True
            break
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=policy.device)
        for micro in range(config.grad_accum):
            x = batches.next_batch().to(policy.device)  # (B, T)
            # non-final micro-batches only accumulate: see ramflow.optim.HostOptimizer.no_step
            accumulate = (
                opt.no_step() if micro < config.grad_accum - 1 else contextlib.nullcontext()
            )
            with accumulate:
                with policy.autocast():
                    loss = model(input_ids=x, labels=x, use_cache=False).loss
                scaler.scale(loss / config.grad_accum).backward()
            loss_sum += loss.detach().float()
        scaler.unscale_(opt)
        grad_norm = (
            ramflow.clip_grad_norm_(params, config.clip_grad).item() if config.clip_grad else None
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
        step_loss = (loss_sum / config.grad_accum).item()
        step += 1
        tokens_seen += config.tokens_per_step
        dt = time.perf_counter() - t0
        train_time += dt
        if not math.isfinite(step_loss) and not policy.use_grad_scaler:
            raise FloatingPointError(
                f"the training loss became {step_loss} at step {step}; lower --lr or use --precision fp32 "
                f"(the last checkpoint is kept in {run_dir / 'checkpoints'})"
            )
        record = {
            "step": step,
            "loss": step_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "tokens": tokens_seen,
            "step_s": dt,
            "tokens_per_s": config.tokens_per_step / dt,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(policy.device) if cuda else None,
            "host_rss_bytes": process.memory_info().rss,
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
            and not stop.is_set()
        ):
            last_ckpt = save(step)
    else:
        val_loss = run_eval(step)
    if stop.is_set():
        interrupted = True
    last_ckpt = save(step)
    elapsed = time.perf_counter() - t_start
    done = step - first_step
    tps = done * config.tokens_per_step / train_time if train_time > 0 else 0.0
    peak_gpu = torch.cuda.max_memory_allocated(policy.device) if cuda else None
    peak_host = _peak_host_bytes()
    report.log(
        {
            "event": "end",
            "step": step,
            "interrupted": interrupted,
            "elapsed_s": elapsed,
            "tokens_per_s": tps,
        }
    )
    plot = report.write_plot(
        title=f"ramflow train: {_model_name(config)}, {config.tokens_per_step:,} tokens per step"
    )
    all_losses = [r["loss"] for r in report.step_records()]
    first_loss = all_losses[0] if all_losses else math.nan
    last_loss = mean_tail(all_losses, 10)
    rows = [
        (
            "model",
            f"{_model_name(config)} ({setup.estimate.num_parameters / 1e6:,.2f} M parameters), "
            f"{count_parameters(model) / 1e6:,.2f} M trained",
        ),
        (
            "device",
            f"{policy.device}, {policy.precision}, activation checkpointing "
            f"{'on' if setup.estimate.checkpointing else 'off'}",
        ),
        (
            "steps",
            f"{step} of {config.steps}"
            + (" (interrupted)" if interrupted else "")
            + (f", {done} in this process" if first_step else ""),
        ),
        (
            "tokens",
            f"{tokens_seen:,} ({config.tokens_per_step:,} per step, epoch {batches.epoch:.2f})",
        ),
        (
            "training loss",
            f"{first_loss:.4f} at step 1 -> {last_loss:.4f} (mean of the last 10 steps)",
        ),
        ("validation loss", "-" if val_loss is None else f"{val_loss:.4f} (at step {val_step})"),
        ("time", f"{format_duration(elapsed)} ({tps:,.0f} tokens/s while training)"),
        ("peak GPU memory", "- (CPU run)" if peak_gpu is None else format_bytes(peak_gpu)),
        ("peak host memory", format_bytes(peak_host)),
        ("run folder", str(run_dir)),
        ("checkpoint", str(last_ckpt)),
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


__all__ = [
    "RESUMABLE_CHANGES",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "plan_run",
    "resume_config",
    "train",
]
