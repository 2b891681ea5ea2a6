"""The training loop of ``ramflow train``: an ordinary PyTorch loop over an offloaded model.

Legend: B = sequences per micro-batch, T = tokens per sequence.

Everything that can be refused is checked before anything is written or allocated: the
settings, the checkpoint to resume (its manifest), the data, the tokenizer, and the memory
plan (device budget, RAM, disk). Only then is the run folder created and the model built.
The loop itself is what DESIGN.md promises a user can write: ``ramflow.offload``,
``ramflow.optim.AdamW`` (or ``--optimizer``'s), a ``LambdaLR`` schedule, ``torch.autocast``, a ``GradScaler``
for fp16, ``opt.no_step()`` for the non-final micro-batches of gradient accumulation,
``ramflow.clip_grad_norm_`` and the model's own activation checkpointing.

[Note: stopping and resuming]
Ctrl-C (SIGINT) and SIGTERM (what schedulers and containers send) only set a flag; the loop
finishes the step in flight (and a save in flight), writes a checkpoint unless that step is
already saved, and returns; the command exits 130 or 143 (a second signal aborts at once,
keeping the last checkpoint). "Second" counts the signals this process received: with
several ranks, the loop also sets the flag when another rank was signalled (all stop after
the same step), and a rank's own signal arriving after that is still its first; were it
taken as a second, that rank would abort the save its peers wait in (a launcher killed
with SIGKILL signals its ranks half a second apart: see [Note: ranks die with their
launcher] in ``launch.py``). A checkpoint
holds everything the next step depends on: fp32 master weights, optimizer states, the LR
schedule, the GradScaler, RNG states and the data position (see [Note: data position] in
``data.py``). A resumed run therefore computes the same steps as the uninterrupted one:
on the CPU, and on one GPU with the same settings, the loss curve and weights match bit
for bit. A resumed run keeps the first run's LR schedule: a new ``--steps`` only moves
where it stops (after the decay's end the LR stays at its floor), unless ``--decay-steps``
is given anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import torch

import ramflow

from ..choices import DEFAULT_NUMA_BINDING
from ..optim import muon_param_groups
from .backoff import RunCheckpointing, checkpointing_policy, fit_micro_batch
from .config import TrainConfig, resume_config
from .data import BatchStream
from .gradient_holding import GradientHolding
from .loop import LoopRun, LoopState, TrainResult, evaluate, run_loop
from .lora import (
    apply_lora,
    count_lora_parameters,
    frozen_format_options,
    load_adapters,
    parse_targets,
)
from .loss import chunk_lm_head
from .lr_schedule import make_scheduler, warmup_cosine
from .modeling import (
    build_offloaded,
    load_offloaded,
    meta_model,
)
from .optimizers import make_optimizer
from .plan_report import preamble_lines
from .ranks import DEFAULT_TIMEOUT_S, Ranks, check_several_ranks
from .report import (
    QuietReport,
    RunReport,
    check_loggers,
)
from .restore import load_optimizer_state, restore_rng_state
from .run_checkpoint import (
    Checkpoint,
    CheckpointError,
    check_num_ranks,
    disk_full_error,
    find_checkpoint,
    open_checkpoint,
    remove_stale_temporaries,
    run_folder_of,
)
from .run_lock import RunLock
from .scale import choose_zero_stage
from .setup import PreparedRun, base_weights, prepare_run, runs_unit_major


def _new_run_dir() -> Path:
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_stop(
    stop: threading.Event, say: Callable[[str], None], received: list[int]
) -> Iterator[None]:
    """While inside, the first SIGINT or SIGTERM sets ``stop`` (and is appended to
    ``received``); a second one raises KeyboardInterrupt: the second this process
    receives, not the first after ``stop`` was set otherwise (another rank's signal). See
    [Note: stopping and resuming]. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        stop.set()
        say(
            f"interrupted ({signal.Signals(signum).name}): finishing this step and saving a "
            "checkpoint (a second Ctrl-C or SIGTERM aborts without saving)"
        )

    previous = {s: signal.signal(s, handler) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler_before in previous.items():
            signal.signal(s, handler_before)


def check_writable(run_dir: Path | None) -> None:
    """Refuse a run folder this process cannot create or write in, before anything is
    planned or built: a folder made and removed in its nearest existing parent is the test
    (permission bits say little for root, or on a read-only or virtual file system).

    Raises:
        ValueError: the folder, or the nearest existing parent of one to be made, cannot
            be written in; the message names it and says to give ``--out`` elsewhere.
    """
    if run_dir is None:
        return
    parent = Path(os.path.abspath(run_dir))
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{parent} is a file")
        os.rmdir(tempfile.mkdtemp(prefix=".ramflow-probe-", dir=parent))
    except OSError as err:
        why = err.strerror or str(err)
        raise ValueError(
            f"--out {run_dir}: cannot write in {parent} ({why.lower()}); give --out a "
            "folder you can write in"
        ) from None


def _refuse_other_run(run_dir: Path | None, ckpt: Checkpoint | None) -> None:
    """Refuse ``--out`` at a folder that holds a run other than the one resumed: starting
    over in it would overwrite its checkpoints and mix its log.

    Raises:
        FileExistsError: ``run_dir`` is a file, or holds ``run.json``, ``log.jsonl`` or
            ``checkpoints``.
    """
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"--out {run_dir} is a file, not a folder; give a folder for the run")
    if run_dir is None or not run_dir.is_dir():
        return
    if ckpt is not None and run_dir.resolve() == ckpt.run_dir.resolve():
        return
    if not any((run_dir / name).exists() for name in ("run.json", "log.jsonl", "checkpoints")):
        return
    try:
        found = f" with a checkpoint at {find_checkpoint(run_dir)}"
        hint = f"continue it with --resume {run_dir}, or give another --out to start a new run"
    except CheckpointError:
        found = " without a checkpoint"
        hint = "give another --out, or delete the folder to start over in it"
    raise FileExistsError(f"--out {run_dir} already holds a run{found}; {hint}")


def _param_groups(
    model: torch.nn.Module, weight_decay: float, *, optimizer: str = "adamw"
) -> tuple[list[dict[str, Any]], list[str]]:
    """Decay matrices, not norm weights or biases (the usual LLM recipe); for Muon, its
    hidden matrices, AdamW's embeddings and head, AdamW's vectors
    (``ramflow.optim.muon_param_groups``). Returns the groups and the parameter names in
    the optimizer's order."""
    if optimizer == "muon":
        groups = muon_param_groups(model, weight_decay=weight_decay)
        name_of = {id(p): name for name, p in model.named_parameters()}
        return groups, [name_of[id(p)] for g in groups for p in g["params"]]
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


def train(
    config: TrainConfig,
    *,
    out: str | os.PathLike | None = None,
    resume: str | os.PathLike | Checkpoint | None = None,
    progress: bool = True,
    stop: threading.Event | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    handle_sigint: bool = True,
    log_to: Sequence[str] = (),
    zero_stage: int | None = None,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
    numa_binding: str = DEFAULT_NUMA_BINDING,
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
        handle_sigint: in the main thread, Ctrl-C and SIGTERM stop after the current step
            and save (see [Note: stopping and resuming]).
        log_to: loggers beside ``log.jsonl``: ``"tensorboard"`` (see ``RunReport``).
        zero_stage: with several ranks (``torchrun``'s environment, or a process group
            already initialized): ZeRO stage 1 or 2 (``ramflow.offload``'s); None: the
            plan's choice, 2 (see ``scale.choose_zero_stage``). Ignored by one process.
            See [Note: several ranks from the CLI] in ``ranks.py``.
        dist_timeout_s: the process group's timeout (seconds) when this call creates it:
            how long a rank waits in a collective for a hung rank before it fails (for
            rank 0 writing a checkpoint, ``ranks.SAVE_TIMEOUT_S`` if longer).
        numa_binding: with several ranks on GPUs, the cores each rank is bound to
            (``ranks.bind_to_gpu_node``; default ``"exclusive"``: its own share of the
            cores of its GPU's NUMA node; ``"none"``: unbound).

    Returns:
        A ``TrainResult`` (every rank's own; rank 0's summary is the run's).

    Raises:
        ValueError: invalid settings, data, tokenizer or model folder; a device budget too
            small (the message gives the smallest that works).
        CheckpointError: the checkpoint is missing, corrupt, truncated, or of another model.
        FileNotFoundError: a path that does not exist.
        MemoryError: the machine's RAM cannot hold the run.
        FileExistsError: ``out`` holds another run (continue it with ``resume``).
        RunFolderInUse: another live process holds the run folder's lock (see [Note: the
            run folder's lock] in ``run_lock.py``).
        OSError: the disk cannot hold the checkpoints the run writes (two at once while
            saving, when it saves more than once); the disk filled up during a save or
            another write of the run (a log line, the plot): one line naming the file and
            the checkpoint that is kept.
        LossDiverged: the training loss became NaN or infinite (the last checkpoint is kept).
        ModuleNotFoundError: ``log_to`` names TensorBoard, which is not installed.
        KeyboardInterrupt: a second Ctrl-C or SIGTERM (the last checkpoint stays).
        RankSetupError: another rank failed one of these checks (its message says which).
        Nothing is written before these checks pass.
    """
    ranks = Ranks.from_environment()
    own_group = ranks.start(
        device=config.device, timeout_s=dist_timeout_s, numa_binding=numa_binding
    )
    try:
        return _train_ranks(
            config,
            ranks,
            out=out,
            resume=resume,
            progress=progress,
            stop=stop,
            on_step=on_step,
            handle_sigint=handle_sigint,
            log_to=log_to,
            zero_stage=zero_stage,
        )
    except OSError as err:  # a full disk outside a save: one line that says what is kept
        full = disk_full_error(err, Path(out) / "checkpoints") if out is not None else None
        if full is None:
            raise
        raise full from err
    finally:
        if own_group:
            ranks.stop()


def _train_ranks(
    config: TrainConfig,
    ranks: Ranks,
    *,
    out: str | os.PathLike | None,
    resume: str | os.PathLike | Checkpoint | None,
    progress: bool,
    stop: threading.Event | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    handle_sigint: bool,
    log_to: Sequence[str],
    zero_stage: int | None,
) -> TrainResult:
    """``train`` on each rank (one process: the only one). Rank 0 holds the run folder's
    lock from before the checkpoint is opened to the end (see [Note: the run folder's
    lock] in ``run_lock.py``)."""
    held: list[RunLock] = []  # rank 0's lock of the run folder, once taken

    def lock(folder: Path) -> None:
        if held and held[0].path.parent.resolve() == folder.resolve():
            return
        while held:
            held.pop().release()
        held.append(RunLock(folder).acquire())

    def check() -> tuple[Checkpoint | None, Path | None, PreparedRun]:
        check_loggers(log_to)
        if zero_stage not in (None, 1, 2):
            raise ValueError(f"--zero-stage must be 1 or 2, got {zero_stage}")
        if ranks.is_main:
            # before the checkpoint is read: another run may be saving into it
            early = _run_folder(out, resume)
            if early is not None and early.is_dir():
                lock(early)
        ckpt = (
            resume if isinstance(resume, Checkpoint) or resume is None else open_checkpoint(resume)
        )
        if ckpt is not None:
            check_num_ranks(ckpt, ranks.world_size)
            resume_config(ckpt, **config.to_dict())  # refuses settings that change the steps
        run_dir = Path(out) if out is not None else (ckpt.run_dir if ckpt is not None else None)
        if ranks.is_main:
            _refuse_other_run(run_dir, ckpt)
            check_writable(run_dir)
        setup = prepare_run(
            config,
            ckpt,
            run_dir,
            device=ranks.device(config.device),
            several_ranks=ranks.several,
            num_local_ranks=ranks.local_world_size,
            zero_stage=zero_stage,
        )
        check_several_ranks(
            world_size=ranks.world_size,
            precision=setup.policy.precision,
            lora=config.lora_rank is not None,
            auto_batch=config.auto_batch_size,
        )
        return ckpt, run_dir, setup

    try:
        ckpt, run_dir, setup = ranks.together(check)

        def make_run_dir() -> tuple[Path, list[str]]:
            folder = run_dir if run_dir is not None else _new_run_dir()
            folder.mkdir(parents=True, exist_ok=True)
            lock(folder)
            # a save killed midway left hidden temporaries: see [Note: atomic checkpoints]
            return folder, remove_stale_temporaries(folder / "checkpoints")

        run_dir, cleaned = ranks.broadcast(
            ranks.together(make_run_dir if ranks.is_main else lambda: None)
        )
        return _run(
            config,
            setup,
            run_dir,
            cleaned,
            ranks,
            progress=progress,
            stop=stop,
            on_step=on_step,
            handle_sigint=handle_sigint,
            log_to=log_to,
            zero_stage=zero_stage,
        )
    finally:
        while held:
            held.pop().release()


def _run_folder(
    out: str | os.PathLike | None, resume: str | os.PathLike | Checkpoint | None
) -> Path | None:
    """The run folder ``train`` will write, as far as it is known before the checkpoint is
    opened (None: a new folder)."""
    if out is not None:
        return Path(out)
    if isinstance(resume, Checkpoint):
        return resume.run_dir
    return run_folder_of(resume) if resume is not None else None


def _run(
    config: TrainConfig,
    setup: PreparedRun,
    run_dir: Path,
    cleaned: list[str],
    ranks: Ranks,
    *,
    progress: bool,
    stop: threading.Event | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    handle_sigint: bool,
    log_to: Sequence[str],
    zero_stage: int | None,
) -> TrainResult:
    """The run once its folder exists: the report, the signals, the loop."""
    ckpt = setup.checkpoint
    stop = stop if stop is not None else threading.Event()
    start_step = ckpt.step if ckpt is not None else 0
    report = (
        RunReport(
            run_dir,
            total_steps=config.steps,
            start_step=start_step,
            keep_until=start_step if ckpt is not None else None,
            progress=progress,
            log_to=log_to,
            run_config=config.to_dict(),  # for --report-to's trackers
        )
        if ranks.is_main
        else QuietReport(run_dir)
    )
    if cleaned:
        report.message(f"checkpoints: a save was cut short before; {'; '.join(cleaned)}")
    received: list[int] = []
    signals = (
        _signals_stop(stop, report.message, received) if handle_sigint else contextlib.nullcontext()
    )
    try:
        with signals:
            result = _train(config, setup, run_dir, report, stop, on_step, ranks, zero_stage)
        return dataclasses.replace(result, stop_signal=received[0] if received else None)
    finally:
        report.close()


def _write_run_json(
    run_dir: Path,
    config: TrainConfig,
    setup: PreparedRun,
    ranks: Ranks,
    zero_stage: int | None,
    checkpointing: RunCheckpointing,
) -> None:
    """``run.json``; written again when ``--checkpointing auto`` goes heavier (see [Note: a
    heavier checkpointing after an out-of-memory error] in ``backoff.py``)."""
    import json

    info = {
        "config": config.to_dict(),
        "num_ranks": ranks.world_size,
        "zero_stage": zero_stage,
        "device": str(setup.policy.device),
        "precision": setup.policy.precision,
        "checkpointing": checkpointing.mode != "off",
        # what the run computes with: "off", "on" or "offload"; planned: the plan's choice
        "checkpointing_mode": checkpointing.mode,
        "checkpointing_planned": checkpointing.planned,
        "checkpointing_switched_at_step": checkpointing.switched_at,
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
    setup: PreparedRun,
    run_dir: Path,
    report: RunReport,
    stop: threading.Event,
    on_step: Callable[[dict[str, Any]], None] | None,
    ranks: Ranks,
    zero_stage: int | None,
) -> TrainResult:
    policy, corpus, est, ckpt = setup.policy, setup.corpus, setup.estimate, setup.checkpoint
    zero_stage = choose_zero_stage(ranks.world_size, zero_stage).stage if ranks.several else None
    checkpointing = RunCheckpointing(
        mode=est.checkpointing_mode, auto=config.checkpointing == "auto"
    )
    if ranks.is_main:

        def write_run_json() -> None:
            _write_run_json(run_dir, config, setup, ranks, zero_stage, checkpointing)

        write_run_json()
        checkpointing.on_switch = write_run_json
    say = report.message
    lora = config.lora_rank is not None
    trained = None
    if lora:
        num = count_lora_parameters(
            meta_model(setup.model_config),
            rank=config.lora_rank,
            targets=parse_targets(config.lora_targets),
        )
        trained = f"{num / 1e6:,.2f} M trained: LoRA rank {config.lora_rank}, the base frozen"
    for line in preamble_lines(est, trained=trained, ranks=setup.host_ranks):
        say(line)
    if ranks.several:
        say(
            f"{ranks.world_size} ranks ({ranks.local_world_size} on this host), ZeRO-"
            f"{zero_stage} over {'NCCL' if policy.device.type == 'cuda' else 'gloo'}: "
            f"{config.batch_size} sequences per rank and micro-batch, "
            f"{config.global_batch * ranks.world_size} per step"
            + (f"; each rank bound to {len(ranks.cpus)} cores near its GPU" if ranks.cpus else "")
        )
    say(
        f"data {corpus.source}: documents {corpus.num_documents:,}, {corpus.train_tokens.numel():,} training "
        f"and {corpus.val_tokens.numel():,} validation tokens ({setup.tokenizer.name} tokenizer)"
    )
    steps = f"{config.steps} step" + ("s" if config.steps != 1 else "")
    # every rank's tokens: see [Note: several ranks from the CLI] in ranks.py
    tokens = config.tokens_per_step * ranks.world_size
    say(f"run folder {run_dir}: {steps} of {tokens:,} tokens")

    # ---- model, offload, optimizer, schedule
    offload_options = dict(
        gpu_memory=setup.gpu_memory_bytes,
        device=policy.device,
        wire_dtype=policy.wire_dtype,
        activation_checkpointing=checkpointing_policy(checkpointing.mode),
        host_precision=est.host_precision,  # "auto" was decided at set-up (host_formats)
        # only AdamW has a device step: auto must not plan one for the others
        device_optimizer=config.device_optimizer if config.optimizer == "adamw" else False,
        zero_stage=zero_stage,
    )
    offload_options.update(frozen_format_options(config.frozen_format))
    load_start = time.perf_counter()  # the model's build, load and offload: load_s
    weights_dir = base_weights(config, ckpt)
    # meta build, filled unit by unit into the host store (read from the folder, or the
    # preset's seeded init): no full fp32 model first; with zero_stage each rank fills the
    # units it owns into its host's shared copy (see [Note: loading once per host])
    if weights_dir is not None:
        model = load_offloaded(
            weights_dir, config=setup.model_config, requires_grad=not lora, **offload_options
        )
    else:
        model = build_offloaded(
            setup.model_config, seed=config.seed, requires_grad=not lora, **offload_options
        )
    try:
        plan = ramflow.get_plan(model)
        if config.device_optimizer is not False and not lora:
            say(
                f"optimizer on the device for {len(plan.device_stepped)} of "
                f"{len(plan.unit_names)} units: {plan.device_optimizer_reason}"
            )
        if lora:  # see ramflow.train.lora
            model = apply_lora(
                model,
                rank=config.lora_rank,
                targets=parse_targets(config.lora_targets),
                seed=config.seed,
            )
            if config.fuse_lora:
                ramflow.helpers.fuse_lora(model)
            if ckpt is not None:
                load_adapters(model, ckpt.path)
        elif plan.resident != est.plan.resident or plan.window_bytes != est.plan.window_bytes:
            warnings.warn(
                "ramflow chose another plan than the estimate; `ramflow plan` may be off",
                stacklevel=2,
            )
        try:  # the loss without full logits: see [Note: the loss in chunks] in loss.py
            chunk_lm_head(model)
        except ValueError as err:
            say(f"the loss is computed over the full logits: {err}")
        groups, param_names = _param_groups(model, config.weight_decay, optimizer=config.optimizer)
        # see [Note: the gradients of a CLI step] in gradient_holding.py and [Note: backing
        # off after an out-of-memory error] in backoff.py
        holding = GradientHolding.of(
            config,
            est.host_precision,
            several_ranks=ranks.several,
            unit_major=runs_unit_major(several_ranks=ranks.several),
        )
        opt = make_optimizer(
            config.optimizer,
            groups,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            overlap=holding.overlap,
            keep_grads=holding.keep_grads,
            clips=holding.clips,
        )
        sched = make_scheduler(
            opt,
            warmup_steps=config.warmup_steps,
            total_steps=config.schedule_steps,
            min_lr_ratio=config.min_lr_ratio,
        )
        scaler = torch.amp.GradScaler(policy.device.type, enabled=policy.use_grad_scaler)
        micro_batch = setup.fit.micro_batch if setup.fit is not None else config.batch_size
        batches = BatchStream(
            corpus.train_tokens,
            batch_size=micro_batch,
            seq_len=config.seq_len,
            seed=config.seed,
            rank=ranks.rank,
            num_ranks=ranks.world_size,
            labels=corpus.train_labels,  # chat data's loss mask, else None
        )
        step, tokens_seen = 0, 0
        if ckpt is not None:
            state = ckpt.state
            load_optimizer_state(ckpt, opt, param_names, rank=ranks.rank)
            sched.load_state_dict(dict(state["scheduler"]))
            # the schedule may have a new length (--decay-steps given anew): the next LR
            # follows it; the same schedule gives the same value LambdaLR would
            fn = warmup_cosine(
                warmup_steps=config.warmup_steps,
                total_steps=config.schedule_steps,
                min_lr_ratio=config.min_lr_ratio,
            )
            for g, base in zip(opt.param_groups, sched.base_lrs):
                g["lr"] = base * fn(sched.last_epoch)
            if state["grad_scaler"]:
                scaler.load_state_dict(state["grad_scaler"])
            restore_rng_state(ckpt, rank=ranks.rank)
            step, tokens_seen = ckpt.step, state["tokens_seen"]
            batches.position = state["data_position"]
            if state["corpus"]["fingerprint"] != corpus.fingerprint:
                say(
                    "warning: the data differ from the checkpoint's; the data position may point elsewhere"
                )
            say(f"resuming from step {step} of {config.steps}: {ckpt.path}")
            report.log({"event": "resume", "step": step, "checkpoint": str(ckpt.path)})
        if config.auto_batch_size:
            fit_micro_batch(config, setup, report, model, opt, scaler, batches, checkpointing)
        else:
            torch.manual_seed(config.seed)
            report.log(
                {
                    "event": "start",
                    "step": step,  # the checkpoint's, on a resumed run
                    "config": config.to_dict(),
                    "device": str(policy.device),
                    "num_ranks": ranks.world_size,
                    "zero_stage": zero_stage,
                    # the logical CPUs rank 0 is bound to (--numa-binding), None: unbound
                    "cpus": sorted(ranks.cpus) if ranks.cpus else None,
                    "threads": torch.get_num_threads(),
                    # the CUDA caching allocator's settings (`ramflow train` sets
                    # expandable segments unless the user set them)
                    "cuda_alloc_conf": os.environ.get(
                        "PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF")
                    ),
                    # build, load and offload of the model, and the optimizer (seconds)
                    "load_s": time.perf_counter() - load_start,
                    # this rank's process start to its first step (seconds)
                    "since_start_s": time.time() - psutil.Process().create_time(),
                }
            )
        return run_loop(
            LoopRun(config, setup, run_dir, report, stop, on_step, ranks, checkpointing),
            LoopState(model, opt, sched, scaler, batches, param_names, step, tokens_seen),
        )
    finally:
        with contextlib.suppress(Exception):  # leave no optimizer step running at exit
            ramflow.synchronize(model)


__all__ = ["TrainResult", "evaluate", "train"]
