"""The drop-in entry points: ``offload``, ``undo``, ``synchronize``, ``clip_grad_norm_``."""

from __future__ import annotations

import os
from collections.abc import Iterable

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
) -> nn.Module:
    """Keep ``model``'s weights in CPU RAM and stream them through the device per unit.

    Returns the same module, ready for an ordinary loop (``model(x)``, ``loss.backward()``,
    ``opt.step()`` with a ``ramflow.optim`` optimizer). Parameters keep their identity: each
    becomes an fp32 view into its unit's flat master buffer on the host. Buffers move to
    the device and stay there. Inputs on another device are moved to ``device``; with a
    low-precision wire dtype and no autocast active, floating-point inputs are cast to it
    (the model then computes in that dtype, as after ``model.to(wire_dtype)``).

    Args:
        model: any ``nn.Module`` with floating-point parameters, on the CPU or a GPU.
        gpu_memory: cap on what ramflow itself allocates on the device (window slots,
            resident units, gradient buffers; activations are the caller's), in bytes or as a
            string like ``"12GiB"``. Units that fit in what is left stay resident. None: no
            unit is kept resident beyond the window.
        device: compute device; default ``cuda`` (current device) when available, else CPU.
        units: modules (or dotted names) to use as units instead of the automatic rule
            (repeated ``ModuleList``/``Sequential`` children; embeddings, final norm and
            head on their own; see ``ramflow.units.unit.find_units``).
        wire_dtype: dtype of the weights on the wire and on the device. By default it
            follows the master weights: bfloat16 with bf16 masters (``host_precision``
            other than fp32, on any device), else bfloat16 on CUDA and float32 on the CPU. float32 gives the resident model's results
            bit for bit; bfloat16 halves the PCIe bytes and rounds weights to bf16.
        prefetch_depth: how many units ahead to load (>= 1; 2 is the default).
        activation_checkpointing: recompute each unit's activations in backward instead of
            keeping them (``torch.utils.checkpoint``, non-reentrant): activation memory falls
            to about one unit's plus the unit boundaries, for about one more forward of
            compute. The root and the rest unit are not wrapped. True: every unit (Hugging
            Face models: every decoder layer, by their own switch); unit names (e.g.
            ``OffloadPlan.checkpointed`` from ``ramflow plan``): only those units. A name
            the model does not have raises ValueError. A policy of ``ramflow.memory``
            (``CheckpointAll()``, ``CheckpointEveryKth(k)``, ``CheckpointToBudget(budget,
            report=...)``, ``CheckpointSegments(n)``, ``SelectiveCheckpoint(...)``,
            ``CheckpointOffload(...)``, which also keeps the chosen units' inputs in pinned
            host memory, prefetched back in backward): the units it chooses among the units that are the model's repeated blocks (all
            units where none is), as ``ramflow.memory.apply_checkpointing`` chooses on the
            plain model, with its options; a policy that cannot apply to this model (no
            unit to choose from, a report without its units, segments outside one
            ``nn.Sequential``) raises ValueError.
        zero_stage: data parallelism over the initialized torch.distributed process group
            (launch with ``torchrun``; every rank calls ``offload`` on the same model). 1:
            gradients are averaged over the ranks, each unit is stepped by one rank per host
            (optimizer states sharded); 2: also only that rank copies the unit's gradients
            down and keeps them. The ranks of a host share one host copy of the master
            weights and of the wire copy (shared memory, ``$RAMFLOW_SHM_DIR``, default
            /dev/shm); each rank streams over its own PCIe link. None: one process.
            See [Note: data parallelism on the engine] in ``ramflow.distributed.zero``.
        device_optimizer: with ``gpu_memory``, what the budget leaves after the plan holds
            the master weights and AdamW states of resident units, first units first; those
            are stepped on the GPU (no gradient copy, no CPU step for them), which shortens
            a step bound by the CPU optimizer (partial optimizer offload, as DeepSpeed's
            ZeRO-Offload++). None (the default): the planner chooses the units whose device
            step shortens the predicted step (with ``zero_stage``: among the units this rank
            steps, on its share of the host's cores), and none on the CPU, without
            ``gpu_memory``, with trainable parameters on the device (LoRA) or with fp32
            masters (whose device step is not the CPU step's bits);
            ``get_plan(model).device_optimizer_reason`` says why (see [Note: the device
            optimizer's default] in ``ramflow.planner.plan``). True: every resident unit whose
            states fit. False: none. fp32 host formats: an fp32 master and states, 12 bytes per
            parameter, stepped by PyTorch's fused AdamW. Lean host formats: the unit's
            device copy is its bf16 master, so only its states in their format (about 2
            bytes per parameter with 8-bit states) are added, stepped with the host
            kernel's arithmetic (the same bits). Needs a ``ramflow.optim.AdamW``; other
            steps of those units run on the host. The host copies are current after
            ``ramflow.synchronize`` and in every ``state_dict``.
            ``ramflow.get_plan(model).device_stepped`` names the units. With
            ``zero_stage``, True steps on each rank's GPU the resident units that rank owns
            (only their states are on its device: 1/N of them per GPU), the others take
            the new weights from the shared host store or the owner's device (see [Note:
            the device optimizer under ZeRO] in ``ramflow.engine.stepper``).
        host_precision: how master weights, AdamW states and host gradients are kept in
            host RAM (``ramflow.HostPrecision``, or a preset's name): ``"fp32"`` (the
            default, None: fp32 masters, exact, about 20 bytes per trained parameter with a
            bf16 wire), ``"bf16"`` (bf16 masters written with stochastic rounding, bf16
            states, a gradient ring: 6), ``"lean"`` (as bf16 with 8-bit block-wise states:
            about 4.03), ``"kahan"`` (bf16 masters with a Kahan compensation, 8-bit states:
            about 6.03), or ``"auto"`` (fp32 when it and AdamW's states fit in 75% of the
            available RAM, else lean; ``get_plan(model).host_precision_reason`` says why).
            Non-fp32 masters are the wire copy: they need ``wire_dtype=torch.bfloat16``, and
            the host parameters are bf16 views (so are their ``.grad``). Lean masters or
            states step with ``ramflow.optim.AdamW`` only. See docs/design-host.md, "Host
            formats".
        weights: the values of a model built on the meta device (``with
            torch.device("meta"): model = ...``; shapes only, no memory): a ``.safetensors``
            file, a folder (its ``model.safetensors.index.json``, else
            ``model.safetensors``, else its ``*.safetensors`` files), or an index file; or
            a function ``weights(name, out)`` that writes the parameter ``name`` (as in
            ``model.named_parameters()``; persistent meta buffers too) into ``out`` (a CPU
            tensor of its shape), e.g. a random init for a benchmark. Each unit's tensors
            are read (one tensor at a time, one file open at a time) and cast into its
            master as the host store builds it, so loading peaks at about the store plus
            one unit plus one file, never a full-precision copy of the model (see [Note:
            loading without a full-precision peak] in ``ramflow.io.loading``). A tied
            parameter is read under whichever of its names the files hold; a
            ``transformers`` model's checkpoint names are converted as its
            ``from_pretrained`` does, and its non-persistent buffers (rotary ``inv_freq``)
            are recomputed by its ``_init_weights``. Files are checked from their headers
            before anything is allocated; on any error the model stays on the meta device.
            With ``zero_stage``, every rank builds the model on the meta device and the
            host's shared copy is filled once: each rank reads (or, with a function, draws)
            the units it owns straight into the shared masters, in parallel, so no rank
            holds a full model and the host peaks at the store plus one tensor's read per
            rank; every host reads the files itself. A failure on any rank raises on every
            rank (see [Note: loading once per host] in ``ramflow.distributed.zero``). A function must
            then give the same values whichever rank calls it (a seeded init keyed by the
            name, as ``ramflow.train.initialization.SeededInit``).
        frozen_format: keep frozen matrices (``requires_grad=False``, two or more
            dimensions, not embeddings: a LoRA base) compressed in host RAM and over PCIe,
            dequantized on the device into the wire dtype: ``"int8"`` (block-wise absmax,
            64 elements per bf16 absmax: about 1.03 bytes per parameter) or ``"nf4"``
            (QLoRA's 4-bit NormalFloat, Dettmers et al. 2023, through torchao: about 0.52).
            None (default): in the wire dtype. Trainable parameters are never compressed.
            The host parameters of compressed weights are meta tensors in the wire dtype
            (reading their values fails; ``state_dict()`` gives them dequantized,
            ``load_state_dict`` compresses them, ``undo`` gives them back dequantized).
            Loading with ``weights=`` compresses each one as it is read. See [Note:
            compressed frozen weights] in ``ramflow.formats.frozen``.
        trainable_on_device: keep the trainable parameters on the device as ordinary
            device parameters, out of the units: adapters (LoRA) are stepped there by the
            optimizer (``ramflow.optim.AdamW`` runs PyTorch's fused AdamW on them; a torch
            optimizer works too) with no host round trip, and the plan counts them with
            their gradients and AdamW states (four times their bytes). None (the default):
            PEFT's adapters (the parameters of its tuner layers' adapter containers, which
            cast their input to their own dtype), when they are at most 10% of the
            parameters (by elements) and, with ``gpu_memory``, take at most half of it;
            other trainable parameters (a head) stream with their units; never with
            ``zero_stage``. True: every trainable parameter, always (a ValueError with
            ``zero_stage`` or no trainable parameter). False: they stream with their units. Parameters added after ``offload``
            (``peft.get_peft_model`` on the offloaded model) are kept on the device from
            the next forward on. See [Note: adapters on the device] in
            ``ramflow.engine.adapters``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``wire_dtype`` is not floating point;
            ``activation_checkpointing`` is none of the above.
        ValueError: no parameters; parameters on the meta device without ``weights``, or
            ``weights`` for parameters that hold data already; tensors missing from
            ``weights`` or of another shape (the first few are named); already offloaded; ``gpu_memory`` too small (the message gives
            the smallest budget that works).
        FileNotFoundError: ``weights`` names no safetensors weights.
        MemoryError: the host lacks the RAM or pinned memory for the host store.
        RuntimeError: ``zero_stage`` without an initialized process group; with
            ``zero_stage``, set-up or loading failed on another rank (the message names it
            and its error; that rank raises its own).
        ValueError: ``host_precision`` not a preset or a HostPrecision, or lean masters
            with a wire dtype other than bf16 (the message names what works);
            ``zero_stage`` on a GPU with ``$RAMFLOW_SHM_DIR`` on a filesystem that is not
            memory-backed (tmpfs).
        MemoryError: ``host_precision="auto"`` and not even the leanest fits (the message
            gives each preset's size).
        ValueError: ``frozen_format`` not a format, with ``zero_stage``, or for a model
            with no frozen matrix to compress (every parameter trainable).
        ImportError: ``frozen_format="nf4"`` without torchao.
        RuntimeError (later, at a forward with gradients or ``opt.step()``): a compressed
            weight was made trainable (``requires_grad=True``) after ``offload``.
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
    budget = None if gpu_memory is None else parse_bytes(gpu_memory)
    activation_checkpointing = checkpointing_choice(activation_checkpointing)
    frozen_format = parse_frozen_format(frozen_format)
    on_device = choose_on_device(
        model,
        trainable_on_device=trainable_on_device,
        gpu_memory_bytes=budget,
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
                gpu_memory_bytes=budget,
                prefetch_depth=prefetch_depth,
                activation_checkpointing=activation_checkpointing,
                device_optimizer=device_optimizer,
                host_precision=precision,
                host_precision_reason=precision_reason,
                frozen_format=frozen_format,
                owners=None if owners is None else tuple(owners),
                rank=None if owners is None else dist.get_rank(),
            )
            engine = Engine(
                model,
                specs,
                options,
                fill=None if loader is None else loader.fill,
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
