"""What an engine is built with: ``EngineOptions``, set once by ``ramflow.offload`` (or a
layer engine of ``ramflow.layers.linear``) and read by the engine and its planner calls."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..activations.checkpointing import CheckpointPolicyLike
from ..formats.host import HostPrecision


@dataclass(frozen=True)
class EngineOptions:
    """The settings of one engine, parsed and checked by ``ramflow.offload`` (its docstring
    and docs/offload.md say what each option does).

    Attributes:
        device: the compute device (``cuda:N`` or ``cpu``).
        wire_dtype: dtype of the weights on the wire and on the device.
        gpu_memory_bytes: cap on what ramflow allocates on the device, in bytes; default
            None: no cap (no unit resident beyond the window).
        prefetch_depth: how many units ahead the schedule loads (>= 1); default 2.
        activation_checkpointing: which units recompute their activations in backward
            (``Schedule.checkpoint_units``'s ``which``); default False: none.
        device_optimizer: which units step on the device: True every resident unit whose
            states fit, None the planner's choice, default False none (see
            ``ramflow.planner.unit_plan.DeviceOptimizerChoice``).
        device_optimizer_reason: with ``device_optimizer=False``, why (shown in the plan);
            default None.
        host_precision: the host formats; default None: fp32 masters and states.
        host_precision_reason: why these host formats (``host_precision="auto"``); default
            None.
        frozen_format: format of compressed frozen weights (``"int8"``, ``"nf4"``); default
            None: frozen weights in the wire dtype.
        owners: under ZeRO, each unit's owner rank, by unit index; default None: one
            process.
        rank: this process's rank under ZeRO; default None.
        routed_experts: load a mixture-of-experts layer's routed experts by the router's
            choice where the result is unchanged (see [Note: experts loaded by the router]
            in ``ramflow.engine.expert_loading``); default True.
    """

    device: torch.device
    wire_dtype: torch.dtype
    gpu_memory_bytes: int | None = None
    prefetch_depth: int = 2
    activation_checkpointing: bool | Iterable[str] | CheckpointPolicyLike = False
    device_optimizer: bool | None = False
    device_optimizer_reason: str | None = None
    host_precision: HostPrecision | None = None
    host_precision_reason: str | None = None
    frozen_format: str | None = None
    owners: tuple[int, ...] | None = None
    rank: int | None = None
    routed_experts: bool = True
