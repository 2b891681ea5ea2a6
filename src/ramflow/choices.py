"""The names a user picks from, each list written once.

The command's ``choices=`` and the library's own checks read them here. Standard library
only, so that ``ramflow --help`` and a usage error answer before PyTorch is imported.
"""

from __future__ import annotations

AUTO = "auto"
"""The choice that the run decides for itself (host formats, checkpointing, precision)."""

HOST_PRECISION_PRESETS = ("fp32", "bf16", "lean", "kahan", "lean4")
"""``ramflow.HostPrecision``'s presets, by name (``HostPrecision.parse``)."""

HOST_PRECISIONS = (*HOST_PRECISION_PRESETS, AUTO)
"""``--host-precision`` and ``offload(host_precision=...)``: a preset or ``auto``."""

COMPUTE_PRECISIONS = (AUTO, "bf16", "fp16", "fp32")
"""``--precision``: the autocast dtype (auto: bf16 on CUDA, fp32 on the CPU)."""

CHECKPOINTING_MODES = (AUTO, "on", "off", "offload")
"""``--checkpointing``: activation checkpointing of every layer, its inputs offloaded or not."""

FROZEN_FORMATS = ("int8", "nf4", "mxfp4")
"""``--frozen-format`` and ``offload(frozen_format=...)``: compressed frozen weights."""

NUMA_BINDINGS = ("exclusive", "node", "socket", "core-complex", "none")
"""``--numa-binding``: how a rank's threads are bound to its GPU's CPUs."""

DEFAULT_NUMA_BINDING = "exclusive"

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""``--report-to``: tracker name -> the package it needs."""

DEVICE_OPTIMIZER = {AUTO: None, "on": True, "off": False}
"""``--device-optimizer``: the choice -> ``offload(device_optimizer=...)``'s value."""

__all__ = [
    "AUTO",
    "CHECKPOINTING_MODES",
    "COMPUTE_PRECISIONS",
    "DEFAULT_NUMA_BINDING",
    "DEVICE_OPTIMIZER",
    "FROZEN_FORMATS",
    "HOST_PRECISIONS",
    "HOST_PRECISION_PRESETS",
    "NUMA_BINDINGS",
    "TRACKERS",
]
