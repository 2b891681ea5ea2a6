"""The drop-in entry points: ``offload``, ``undo``, ``synchronize``, ``clip_grad_norm_``,
``accumulate``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .activations.checkpointing import CheckpointPolicyLike, checkpointing_choice
from .distributed.zero import (
    DistributedState,
    agree_on_precision,
    check_shm_directory_pins,
    raise_if_any_failed,
    remove_stale_store_files,
    require_initialized,
    shared_host_store,
    shm_directory,
)
from .engine.adapters import choose_on_device
from .engine.clip import clip_grad_norm_ as clip_grad_norm_  # public here
from .engine.engine import Engine
from .engine.host_store import resolve_precision
from .engine.options import EngineOptions
from .formats.frozen import check_frozen_format, parse_frozen_format
from .formats.host import HostPrecision
from .io.loading import MetaLoader, Weights
from .kernels.cpu_kernels import start_background_build
from .planner.plan import OffloadPlan
from .sizes import parse_bytes
from .units.registry import engine_of_model, engine_of_param
from .units.unit import Unit, find_units


def offload(
    model: nn.Module,
    *,
    gpu_memory: int | str | None = None,
    device: torch.device | str | None = None,
    units: Iterable[nn.Module | str] | None = None,
    wire_dtype: torch.dtype | None = None,
    prefetch_depth: int = 2,
    activation_checkpointing: bool | Iterable[str] | CheckpointPolicyLike = False,
    zero_stage: int | None = None,
    device_optimizer: bool | None = None,
    host_precision: HostPrecision | str | None = None,
    weights: Weights | None = None,
    frozen_format: str | None = None,
    trainable_on_device: bool | None = None,
    routed_experts: bool = True,
) -> nn.Module:
    """Keep ``model``'s weights in CPU RAM and stream them through the device unit by unit.

    Returns the same module, ready for an ordinary loop (``model(x)``, ``loss.backward()``,
    ``opt.step()`` with a ``ramflow.optim`` optimizer); ``ramflow.undo`` gives it back.
    Parameters keep their identity, as views into their unit's host master buffer; buffers
    move to the device. docs/offload.md has the loop and, under "Options", each option at
    length.

    Args:
        model: any ``nn.Module`` with floating-point parameters, on the CPU or a GPU.
        gpu_memory: cap on ramflow's device memory, bytes or ``"12GiB"``; None: no cap.
        device: compute device; default the current CUDA device, else the CPU.
        units: modules (or dotted names) to use as units; default ``find_units``'s rule.
        wire_dtype: dtype over PCIe and on the device; default bf16 on CUDA, fp32 on CPU.
        prefetch_depth: how many units ahead to load (>= 1); default 2.
        activation_checkpointing: True, unit names or a ``ramflow.memory`` policy; False.
        zero_stage: ZeRO stage 1 or 2 over the process group; default None: one process.
        device_optimizer: step resident units on the GPU: True, False, None (planner's).
        host_precision: ``HostPrecision`` or ``"fp32"`` (default), ``"bf16"``, ``"lean"``...
        weights: values for a meta-device model: safetensors path or ``weights(name, out)``.
        frozen_format: compress frozen matrices: ``"int8"``, ``"nf4"``; default None.
        trainable_on_device: keep trainable parameters (LoRA) on the device; None: PEFT's.
        routed_experts: load an MoE layer's routed experts by the router's choice where
            the result is unchanged (no grad, frozen experts); False: every expert, always.

    Raises (every case: docs/offload.md, "Errors"):
        TypeError: ``model``, ``wire_dtype``, ``device_optimizer`` or a checkpointing choice
            of the wrong type.
        ValueError: an option that does not apply to this model (the message says what to
            change), or ``gpu_memory`` below the smallest budget that works (named).
        FileNotFoundError: ``weights`` names no safetensors weights.
        MemoryError: the host lacks the RAM or pinned memory for the host store.
        ImportError: ``frozen_format="nf4"`` without torchao.
        RuntimeError: ``zero_stage`` without a process group or failed on another rank;
            later, a compressed weight made trainable.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ramflow.offload expects an nn.Module, got {type(model).__name__}")
    if engine_of_model(model) is not None:
        raise ValueError("this model is already offloaded; call ramflow.undo(model) first")
    params = list(model.parameters())
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameters: there is nothing to offload. "
            "Run it as it is."
        )
    num_meta = sum(p.is_meta for p in params)
    if num_meta and weights is None:
        raise ValueError(
            "the model has parameters on the meta device (no data): give their values with "
            "weights= (a safetensors file, folder or index, or a function weights(name, out)), "
            "or load them first (model.to_empty(device='cpu'), model.load_state_dict(...))"
        )
    if weights is not None and num_meta < len(params):
        raise ValueError(
            "weights= loads a model built on the meta device, but "
            + (
                "its parameters hold data already: offload it without weights= (and load a "
                "checkpoint with model.load_state_dict after offloading)"
                if num_meta == 0
                else f"only {num_meta} of its {len(params)} parameters are on the meta device: "
                "build the whole model there (with torch.device('meta'): ...)"
            )
        )
    wide = sorted({str(p.dtype) for p in params if p.dtype in (torch.float64, torch.complex128)})
    if wide:
        raise ValueError(
            f"the model has {', '.join(wide)} parameters; ramflow keeps float32 master weights "
            "and would round them silently. Cast the model first (model.float()), or keep it "
            "resident."
        )
    if any(engine_of_param(p) is not None for p in params):
        raise ValueError("some parameters already belong to another offloaded model")
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device}: this PyTorch sees no CUDA device (torch.cuda.is_available() is "
            "False); leave device out to run on the CPU, or install a CUDA build of PyTorch"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device} is not supported; use a CUDA device or the CPU")
    default_wire = torch.bfloat16 if device.type == "cuda" else torch.float32
    if wire_dtype is not None and (
        not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point
    ):
        raise TypeError(f"wire_dtype must be a floating-point torch.dtype, got {wire_dtype!r}")
    gpu_memory_bytes = None if gpu_memory is None else parse_bytes(gpu_memory)
    activation_checkpointing = checkpointing_choice(activation_checkpointing)
    frozen_format = parse_frozen_format(frozen_format)
    on_device = choose_on_device(
        model,
        trainable_on_device=trainable_on_device,
        gpu_memory_bytes=gpu_memory_bytes,
        zero_stage=zero_stage,
    )
    specs = find_units(model, units, skip=on_device)
    if frozen_format is not None:
        check_frozen_format(frozen_format, specs, zero_stage=zero_stage)
    precision, wire_dtype, precision_reason = resolve_precision(
        host_precision,
        lambda: [Unit(i, spec, frozen_format=frozen_format) for i, spec in enumerate(specs)],
        wire_dtype=wire_dtype,
        default_wire=default_wire,
    )
    remove_stale_store_files(shm_directory())  # of ranks that died: see [Note: host store files]
    start_background_build()  # see [Note: building before the first step]
    owners = None
    if not isinstance(routed_experts, bool):
        raise TypeError(f"routed_experts must be True or False, got {routed_experts!r}")
    if device_optimizer not in (None, True, False):
        raise TypeError(f"device_optimizer must be None, True or False, got {device_optimizer!r}")
    if zero_stage is not None:
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1, 2 or None, got {zero_stage!r}")
        require_initialized("ramflow.offload(..., zero_stage=...)")
        if device.type == "cuda":
            check_shm_directory_pins(shm_directory())
    loader = None
    engine = None
    try:
        if weights is not None:
            error = None
            try:
                loader = MetaLoader(model, weights)  # checks the headers, allocates nothing
                loader.materialize()
            except Exception as err:  # noqa: BLE001 - raised below, after the ranks agree
                error = err
            if zero_stage is not None:  # every rank raises, or none: no rank hangs
                raise_if_any_failed("checking weights=", error)
            elif error is not None:
                raise error
        if zero_stage is not None:
            precision, precision_reason = agree_on_precision(
                precision, precision_reason, auto=precision_reason is not None
            )
            layout = [Unit(i, spec) for i, spec in enumerate(specs)]
            owners, local = shared_host_store(
                specs,
                wire_dtype=wire_dtype,
                numels=[u.numel for u in layout],
                offsets=[u.offsets for u in layout],
                master_dtype=precision.master_dtype,
                zero_stage=zero_stage,
                fill=None if loader is None else loader.fill,
            )
        error = None
        try:
            if loader is not None:
                _fill_on_device(loader, on_device)
            options = EngineOptions(
                device=device,
                wire_dtype=wire_dtype,
                gpu_memory_bytes=gpu_memory_bytes,
                prefetch_depth=prefetch_depth,
                activation_checkpointing=activation_checkpointing,
                device_optimizer=device_optimizer,
                host_precision=precision,
                host_precision_reason=precision_reason,
                frozen_format=frozen_format,
                owners=None if owners is None else tuple(owners),
                rank=None if owners is None else dist.get_rank(),
                routed_experts=routed_experts,
            )
            engine = Engine(
                model,
                specs,
                options,
                fill=None if loader is None else loader.fill,
                packed=None if loader is None else loader.packed,
                on_device=on_device,
            )
        except Exception as err:  # noqa: BLE001 - raised below, after the ranks agree
            error = err
        if zero_stage is not None:
            raise_if_any_failed("building the engine", error)
        elif error is not None:
            raise error
    except BaseException:
        if engine is not None:
            engine.remove()  # another rank failed: this one gives its model back too
        if loader is not None:
            loader.restore()  # back on the meta device, as it came
        raise
    finally:
        if loader is not None:
            loader.close()
    if owners is not None:
        single_host = len(local) == dist.get_world_size()
        state = DistributedState(zero_stage=zero_stage, average=True, reduce_to_owner=single_host)
        state.copies = dist.get_world_size() // len(local)  # hosts (equal ranks each)
        engine.stepper.dist = state
        if os.environ.get("RAMFLOW_REFRESH_BY_BROADCAST", "1").strip() != "0":
            state.refresh_by_broadcast(engine)  # see [Note: refresh by broadcast]
        state.open_communicators(engine.device)
    engine.prepare_first_step()
    return model


def _fill_on_device(loader: MetaLoader, params: list[nn.Parameter]) -> None:
    """Give the parameters kept on the device (built on the meta device) their values
    from ``weights``, on the CPU; the engine moves them."""
    if not params:
        return
    views = [torch.empty(p.shape, dtype=torch.float32) for p in params]
    loader.fill(params, views)
    with torch.no_grad():
        for p, view in zip(params, views):
            p.data = view.to(p.dtype)


def _engine(model: nn.Module) -> Engine:
    """The engine of ``model``, or of the one offloaded module inside it (a
    ``peft.PeftModel`` wraps the model that was offloaded)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    engine = engine_of_model(model)
    if engine is None:
        inner = {id(e): e for e in map(engine_of_model, model.modules()) if e is not None}
        if len(inner) == 1:
            return next(iter(inner.values()))
    if engine is None:
        raise ValueError("this model is not offloaded by ramflow (call ramflow.offload first)")
    return engine


def undo(model: nn.Module) -> nn.Module:
    """Give back an ordinary module with the current weights, on the CPU, in the
    parameters' original dtypes; hooks removed, device memory freed. Pending optimizer
    steps finish first. Raises ValueError if ``model`` is not offloaded."""
    _engine(model).remove()
    return model


def _engines_of(model: nn.Module) -> list[Engine]:
    """The engines holding ``model``'s parameters: its own (``offload``) or the layer
    engines of its ``ramflow.Linear`` layers. Raises ValueError when there are none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    engines: list[Engine] = []
    for p in model.parameters():
        engine = engine_of_param(p)
        if engine is not None and engine not in engines:
            engines.append(engine)
    if not engines:
        raise ValueError(
            "this model has no parameters managed by ramflow (call ramflow.offload, or use "
            "ramflow.Linear layers and run the model once)"
        )
    return engines


def adopt(model: nn.Module) -> None:
    """Take in parameters added to an offloaded model (``peft.get_peft_model`` after
    ``offload``) and units frozen since, now rather than at the next forward: the new
    parameters move to the device (see [Note: adapters on the device] in
    ``ramflow.engine.adapters``). Call it before loading an optimizer state for them, which
    PyTorch puts on its parameter's device. ``model``: the offloaded model or a module that
    wraps it (a ``PeftModel``).

    Raises:
        ValueError: ``model`` is not offloaded; as ``ModelHooks.adopt_changes`` (``ramflow.engine.model_hooks``) (a unit partly
            frozen or made trainable after ``offload``, new parameters over ``gpu_memory``).
    """
    _engine(model).hooks.adopt_changes()


def synchronize(model: nn.Module) -> None:
    """Wait until every gradient landing and optimizer step in flight on the host is done,
    so that the host master weights and ``p.grad`` can be read. Works for offloaded models
    and for models with ``ramflow.Linear`` layers. Raises ValueError for neither."""
    for engine in _engines_of(model):
        engine.synchronize()


def refresh(model: nn.Module) -> None:
    """The host master weights were changed outside ramflow (another optimizer, an in-place
    edit of ``p.data``): rewrite the wire and device copies before the next use. Not
    needed after ``load_state_dict`` or ``ramflow.optim`` steps. Raises as ``synchronize``."""
    for engine in _engines_of(model):
        engine.refresh_from_host()


def accumulate(
    model: nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    boundaries_on_host: bool | None = None,
) -> list[torch.Tensor]:
    """Forward and backward of one optimizer step's micro-batches, unit by unit: each
    offloaded unit's weights cross PCIe once for forward and once for backward per step,
    not once per micro-batch, and its gradient crosses D2H once, when complete.

    The unit-major order of FlexGen (Sheng et al. 2023, "FlexGen: High-Throughput
    Generative Inference of Large Language Models with a Single GPU", the zig-zag block
    schedule) applied to training; see [Note: one weight pass per optimizer step] in
    ``ramflow.engine.unit_major``. The gradients equal an ordinary accumulation loop's
    (``loss_fn(b).backward()`` for each micro-batch) up to the order of summation. Then
    call ``opt.step()`` and ``opt.zero_grad()`` as usual. Once the loop is known to step
    after each call (the second step on; the first too with ``keep_grads=False`` under the
    gradient ring of a lean ``host_precision``), each unit is stepped as its gradient
    lands, and no full-model host gradient buffer is made. A loop that clips gets steps
    at ``opt.step()`` from the full host gradients, as an ordinary loop does.

    Example::

        losses = ramflow.accumulate(model, batches, lambda b: model(**b).loss / len(batches))
        opt.step()
        opt.zero_grad()

    Args:
        model: the offloaded model (or a module wrapping it, a ``PeftModel``).
        micro_batches: the M micro-batches of the step, anything ``loss_fn`` takes (tensors
            on the host or the device), in the order their gradients sum.
        loss_fn: maps one micro-batch to its scalar loss (any dtype, on the compute
            device), computed by calling ``model``; scale it by 1/M for a mean over the
            micro-batches, as an ordinary accumulation loop does. Called once per
            micro-batch, each in a thread of its own (one runs at a time; the caller's
            autocast carries over). Every micro-batch must make the same unit calls. An
            MoE's router auxiliary loss (``output_router_logits``) is fine: the router
            logits that transformers records are cut out of their layers (see [Note: the
            router's auxiliary loss under the unit-major step] in
            ``ramflow.engine.router_logits``).
        boundaries_on_host: keep each unit call's input (its boundary), where the unit's
            graph saves it (a checkpointed unit's input; in fp32 the first norm's), in
            host memory between the forwards and the backwards: pinned on CUDA, copied
            D2H as it is saved and back H2D one layer ahead of its backward, each copy on
            a side stream with an event (see [Note: offloaded checkpoint boundaries] in
            ``ramflow.activations.boundary_offload``). The results are the same bit for
            bit. None (default): on CUDA, not on the CPU (where the boundaries already
            are in host memory).

    Returns:
        The M losses ``loss_fn`` returned, detached, in micro-batch order.

    Raises:
        ValueError: ``model`` is not offloaded; no micro-batches; a loss is not a scalar
            tensor that requires grad; gradients are disabled; data parallelism.
        TypeError: no ramflow optimizer holds the model's parameters (and some unit has
            trainable ones: a frozen base under device-side LoRA adapters needs none).
        RuntimeError: a micro-batch's forward raised (named by its index; no gradient is
            left); the micro-batches made different unit calls (an MoE whose experts are
            units of their own: use an ordinary loop); inside a forward or backward.
    """
    return _engine(model).unit_major.run(
        loss_fn, micro_batches, model=model, boundaries_on_host=boundaries_on_host
    )


def accept_partial_step(model: nn.Module) -> None:
    """Go on training from the weights that a failed backward pass left partly stepped.

    When a backward pass raises after ramflow had already stepped some units during it (see
    [Note: a failed backward] in ``ramflow.engine.engine``), the next forward and ``opt.step()``
    raise ``RuntimeError`` until a checkpoint is loaded (``model.load_state_dict``) or this
    is called: the units stepped keep their new weights and optimizer states, the others
    are as before the failed pass. Raises ValueError if ``model`` is not offloaded."""
    _engine(model).accept_partial_step()


def set_activation_checkpointing(
    model: nn.Module, activation_checkpointing: bool | Iterable[str] | CheckpointPolicyLike
) -> None:
    """Change an offloaded model's activation checkpointing between passes: what
    ``offload``'s ``activation_checkpointing`` would have installed is installed instead
    of what it did (False: none). Units, plan and device window stay as they are. This is
    how ``ramflow train --checkpointing auto`` goes to activation offload
    (``ramflow.memory.CheckpointOffload()``) after an out-of-memory error at a micro-batch
    of 1 (see [Note: a heavier checkpointing after an out-of-memory error] in
    ``ramflow.train.backoff``). A backward that raised is cleaned up first, as the next
    forward would (see [Note: a failed backward] in ``ramflow.engine.schedule``). With
    ``zero_stage``, every rank must change it alike.

    Args:
        model: the offloaded model, or a module wrapping it (a ``peft.PeftModel``).
        activation_checkpointing: as ``offload``'s.

    Raises:
        ValueError: ``model`` is not offloaded; the choice cannot apply to this model (as
            ``offload``; the previous checkpointing stays).
        TypeError: ``activation_checkpointing`` is none of what ``offload`` takes.
        RuntimeError: called inside a forward or backward pass.
    """
    choice = checkpointing_choice(activation_checkpointing)
    _engine(model).set_activation_checkpointing(choice)


def get_plan(model: nn.Module) -> OffloadPlan:
    """The plan ramflow chose for an offloaded model (resident units, window, budget, the
    units stepped on the device and ``device_optimizer_reason``, why)."""
    return _engine(model).plan


def is_offloaded(model: nn.Module) -> bool:
    """True if ``model`` is currently offloaded by ramflow, or wraps the one module that is
    (a ``peft.PeftModel``, an ``nn.Sequential`` around it): the models ``get_plan``,
    ``adopt`` and ``undo`` accept."""
    if engine_of_model(model) is not None:
        return True
    try:
        _engine(model)
    except (TypeError, ValueError):
        return False
    return True
