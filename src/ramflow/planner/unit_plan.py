"""The plan of an engine's units: residents and window for the budget, the host figures of
its host formats, and the units stepped on the device.

The engine (``ramflow.engine.engine``) calls ``plan_units`` when its units or the
parameters it keeps on the device change, and ``complete_plan`` on the plan it keeps. Both
are pure: they read the units and the formats, and change nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..formats.host import HostPrecision
from ..transfer.streams import StagingBuffers
from ..units.unit import Unit, plan_inputs
from .cpu_rates import rates_for
from .plan import OffloadPlan, auto_device_optimizer, make_plan, with_device_optimizer
from .predict import Rates


@dataclass(frozen=True)
class DeviceOptimizerChoice:
    """Which units an engine asks to step on the device (``ramflow.offload``'s
    ``device_optimizer``).

    Attributes:
        forced: True: every resident unit whose states fit the budget; False (default):
            none; None: the planner chooses (see [Note: the device optimizer's default] in
            ``ramflow.planner.plan``).
        reason: with ``forced=False``, why none (the plan's ``device_optimizer_reason``);
            default None: ``"device_optimizer=False"``.
        owners: under ZeRO, the owner rank of each unit, by unit index; default None: one
            process, every unit is this process's.
        rank: this process's rank under ZeRO; default None.
    """

    forced: bool | None = False
    reason: str | None = None
    owners: tuple[int, ...] | None = None
    rank: int | None = None


def plan_units(
    units: list[Unit],
    *,
    device: torch.device,
    wire_dtype: torch.dtype,
    gpu_memory_bytes: int | None,
    prefetch_depth: int,
    fixed_bytes: int,
) -> OffloadPlan:
    """The device plan of ``units`` (in module order) under ``gpu_memory_bytes`` (None: no
    cap), with ``fixed_bytes`` always on the device besides the units (buffers, adapters);
    on CUDA the staging buffers of compressed weights (``ramflow.transfer.streams``) are
    added. Host fields and device steps are left for ``complete_plan``.

    Args:
        units: the engine's units, in module order.
        device: the device the units run on.
        wire_dtype: the device copies' dtype.
        gpu_memory_bytes: ramflow's share of the device, bytes; None: no cap.
        prefetch_depth: units loaded ahead of the running one.
        fixed_bytes: device bytes besides the units.

    Returns:
        The device side of the ``OffloadPlan``.

    Raises:
        ValueError: the budget is too small (the message gives the smallest that works).
    """
    return make_plan(
        device=str(device),
        **plan_inputs(units, wire_dtype),
        fixed_bytes=fixed_bytes + staging_bytes(units, device=device, wire_dtype=wire_dtype),
        gpu_memory_bytes=gpu_memory_bytes,
        prefetch_depth=prefetch_depth,
    )


def staging_bytes(units: list[Unit], *, device: torch.device, wire_dtype: torch.dtype) -> int:
    """Device bytes of the staging buffers that compressed frozen weights land in before
    they are dequantized: two units' at most, on CUDA (``ramflow.transfer.streams``).

    Args:
        units: the engine's units.
        device: the device the units run on.
        wire_dtype: the device copies' dtype.

    Returns:
        Bytes; 0 off CUDA or without compressed weights.
    """
    if device.type != "cuda":
        return 0
    return StagingBuffers.COUNT * max((u.packed_bytes(wire_dtype) for u in units), default=0)


def device_optimizer_refusal(
    *,
    device: torch.device,
    gpu_memory_bytes: int | None,
    trainable_on_device: bool,
    precision: HostPrecision,
) -> str | None:
    """Why ``device_optimizer=None`` steps no unit on the device before any prediction.

    Args:
        device: the engine's device.
        gpu_memory_bytes: ramflow's share of the device, bytes; None: no cap.
        trainable_on_device: trainable parameters (LoRA adapters) are kept on the device.
        precision: the units' host formats.

    Returns:
        The reason, one line; None: the planner predicts.
    """
    if device.type != "cuda":
        return "the device is the CPU"
    if gpu_memory_bytes is None:
        return "no gpu_memory budget"
    if trainable_on_device:
        return "trainable parameters are kept on the device (LoRA adapters step there)"
    if precision.is_exact:
        return (
            "fp32 masters: their device step does not give the CPU step's bits, so the "
            "run would depend on the plan (device_optimizer=True forces it)"
        )
    return None


def complete_plan(
    plan: OffloadPlan,
    units: list[Unit],
    *,
    wire_dtype: torch.dtype,
    precision: HostPrecision,
    precision_reason: str | None,
    host_bytes: int,
    frozen_format: str | None,
    device_optimizer: DeviceOptimizerChoice,
    refusal: str | None,
) -> OffloadPlan:
    """``plan`` (of ``units``, from ``plan_units``) with its host figures under
    ``precision`` (with ``precision_reason``, why these formats; ``host_bytes``: the host
    store's and the optimizer states' bytes, as the engine's host store counts them, to
    which the deferred gradients are added: see ``with_deferred_gradients``) and
    the units stepped on the device as ``device_optimizer`` asks, with the reason;
    ``refusal`` (``device_optimizer_refusal``) answers ``forced=None`` before any
    prediction.

    Args:
        plan: from ``plan_units``.
        units: the engine's units, the plan's order.
        wire_dtype: the device copies' dtype.
        precision: the host formats.
        precision_reason: why ``"auto"`` chose these formats; None: not chosen by auto.
        host_bytes: host store and optimizer state bytes.
        frozen_format: how frozen weights are kept (``"int8"``, ``"nf4"``); None: as is.
        device_optimizer: the user's choice of device steps.
        refusal: from ``device_optimizer_refusal``.

    Returns:
        The finished ``OffloadPlan``.
    """
    plan = dataclasses.replace(
        plan,
        host_precision=precision,
        host_bytes_per_parameter=precision.bytes_per_parameter(
            trainable=True, wire_dtype=wire_dtype
        ),
        host_bytes=host_bytes,
        host_deferred_bytes=0,
        host_precision_reason=precision_reason,
        frozen_format=frozen_format,
        unit_h2d_bytes=tuple(u.h2d_bytes(wire_dtype) for u in units),
    )
    plan = with_deferred_gradients(
        plan, units, wire_dtype=wire_dtype, precision=precision, kept_grads=False
    )
    return _with_device_optimizer(
        plan,
        units,
        wire_dtype=wire_dtype,
        precision=precision,
        choice=device_optimizer,
        refusal=refusal,
    )


def with_deferred_gradients(
    plan: OffloadPlan,
    units: list[Unit],
    *,
    wire_dtype: torch.dtype,
    precision: HostPrecision,
    kept_grads: bool,
    eager_from_start: bool = False,
) -> OffloadPlan:
    """``plan`` with the deferred gradients of ``units`` counted in ``host_bytes``
    (``host_deferred_bytes``, ``HostBytes.deferred_gradients``): under the gradient ring
    every loop may hold them (the first step of an optimizer that keeps ``p.grad`` or
    clips, clipping, accumulation), so the plan's host bytes are a step's peak. In 8-bit
    codes under masters that are not exact, unless the optimizer keeps ``p.grad``
    (``kept_grads``, known once one is built: the engine re-counts then; before, the
    plan assumes it keeps none, the lean recipe's ``keep_grads=False``), else in the
    master's dtype; 0 without the ring (the store holds its gradients), and 0 for an
    optimizer whose every pass steps during backward, the first included
    (``eager_from_start``: ``overlap``, ``keep_grads=False`` and ``clips=False``, a promise
    that the loop neither reads nor clips the gradients; it accumulates through
    ``ramflow.accumulate``, whose passes hold none, not through ``opt.no_step()``).

    Args:
        plan: an ``OffloadPlan`` of ``units`` (``make_plan``).
        units: the model's units, whose trainable parameters the gradients are of.
        wire_dtype: the device copies' dtype (the ring's staging is in it).
        precision: the host formats (their master dtype, whether exact, the ring).
        kept_grads: the optimizer keeps ``p.grad`` (``keep_grads=True``).
        eager_from_start: every pass of the optimizer steps during backward (see above).

    Returns:
        ``plan`` with ``host_bytes`` the steady bytes plus the deferred gradients' and
        ``host_deferred_bytes`` those (bytes); ``plan`` itself when it has no host bytes.
    """
    if plan.host_bytes is None:
        return plan
    deferred = precision.host_bytes(units, wire_dtype, kept_grads=kept_grads).deferred_gradients
    if eager_from_start:
        deferred = 0
    steady = plan.host_bytes - (plan.host_deferred_bytes or 0)
    return dataclasses.replace(plan, host_bytes=steady + deferred, host_deferred_bytes=deferred)


def _with_device_optimizer(
    plan: OffloadPlan,
    units: list[Unit],
    *,
    wire_dtype: torch.dtype,
    precision: HostPrecision,
    choice: DeviceOptimizerChoice,
    refusal: str | None,
) -> OffloadPlan:
    """``plan`` with the units stepped on the device: all that fit when forced (True),
    none when refused (False), the planner's choice when None; with the reason."""
    sizes = dict(
        bytes_per_param=precision.device_step_bytes_per_parameter,
        scratch_bytes=precision.device_step_scratch_bytes,
    )
    owners, rank = choice.owners, choice.rank
    # under ZeRO only the units this rank owns (see [Note: the device optimizer under
    # ZeRO] in ramflow.engine.stepper): a unit of no trainable elements is never chosen
    numels = [u.trainable_numel if u.owner is None or u.owner == rank else 0 for u in units]
    if choice.forced is True:
        plan = with_device_optimizer(plan, numels, **sizes)
        fits = "" if plan.device_stepped else ", but no unit's states fit the budget"
        if owners is not None:
            fits = f" (the units rank {rank} owns){fits}"
        return dataclasses.replace(plan, device_optimizer_reason=f"device_optimizer=True{fits}")
    if choice.forced is False:
        why = choice.reason or "device_optimizer=False"
        return dataclasses.replace(plan, device_optimizer_reason=why)
    # see [Note: the device optimizer's default] in ramflow.planner.plan
    if refusal is not None:
        return dataclasses.replace(plan, device_optimizer_reason=f"none: {refusal}")
    rates = rates_for(Rates(), precision)
    if owners is not None:
        # per rank: its own units, on its share of the host's cores (the ranks of a
        # host split them), see [Note: the device optimizer under ZeRO] in ramflow.engine.stepper
        ranks = len(set(owners))
        rates = dataclasses.replace(
            rates, cpu_optimizer_params_per_s=rates.cpu_optimizer_params_per_s / ranks
        )
    plan = auto_device_optimizer(
        plan,
        numels,
        **sizes,
        rates=rates,
        grad_bytes_per_param=torch.empty((), dtype=wire_dtype).element_size(),
    )
    if owners is None:
        return plan
    why = (
        f"{plan.device_optimizer_reason} (under ZeRO: among the units rank {rank} "
        f"owns, its CPU optimizer at 1/{ranks} of the host's rate; the other ranks take "
        "them from the shared host store or its device)"
    )
    return dataclasses.replace(plan, device_optimizer_reason=why)
