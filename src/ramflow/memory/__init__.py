"""The memory toolkit: see where memory goes, and train inside a budget.

- ``MemoryTracker``: labelled readings of device and host memory over a step.
- ``activation_report``: per module, the bytes saved for backward, measured.
- ``tensor_census`` / ``census_diff``: the live tensors, and what grew (leaks).
- ``memory_snapshot`` / ``plot_timeline``: PyTorch's allocator history for
  https://pytorch.org/memory_viz, and a PNG of a tracker's readings.
- ``estimate_memory`` / ``MemoryEstimate``: parameters, gradients, optimizer states and
  activations per device and host, before anything is allocated (``ramflow plan``).
- ``fit_batch``: the largest micro-batch and lightest checkpointing that fit a budget.
- Checkpointing policies and ``apply_checkpointing``: which blocks recompute their forward
  (``CheckpointOffload``: and keep their inputs in pinned host memory).
- ``chunked_attention``, ``sdpa_backends_report``, ``use_sdpa``: attention's memory.

May import: ``api``, ``distributed``, ``optim`` and every folder below them; never
``ramflow.train`` or the CLI, which use it.
"""

from ..activations.checkpointing import (
    CheckpointAll,
    CheckpointEveryKth,
    CheckpointHandle,
    CheckpointOffload,
    CheckpointPlan,
    CheckpointPolicyLike,
    CheckpointSegments,
    CheckpointToBudget,
    SelectiveCheckpoint,
    apply_checkpointing,
    find_blocks,
)
from ..activations.report import ActivationReport, ModuleActivations, activation_report
from .attention import SDPAReport, chunked_attention, sdpa_backends_report, use_sdpa
from .census import CensusGroup, TensorCensus, census_diff, tensor_census
from .estimate import ActivationProfile, MemoryEstimate, RunDescription, estimate_memory
from .fit import BatchFit, BatchTrial, fit_batch, smaller_micro_batch
from .snapshot import memory_snapshot, plot_timeline
from .tracker import MemoryTracker, cuda_pinned_bytes

__all__ = [
    "ActivationProfile",
    "BatchFit",
    "BatchTrial",
    "ActivationReport",
    "CensusGroup",
    "CheckpointAll",
    "CheckpointEveryKth",
    "CheckpointHandle",
    "CheckpointOffload",
    "CheckpointPlan",
    "CheckpointPolicyLike",
    "CheckpointSegments",
    "CheckpointToBudget",
    "MemoryEstimate",
    "MemoryTracker",
    "ModuleActivations",
    "SDPAReport",
    "SelectiveCheckpoint",
    "TensorCensus",
    "activation_report",
    "apply_checkpointing",
    "census_diff",
    "chunked_attention",
    "cuda_pinned_bytes",
    "RunDescription",
    "estimate_memory",
    "find_blocks",
    "fit_batch",
    "memory_snapshot",
    "plot_timeline",
    "sdpa_backends_report",
    "smaller_micro_batch",
    "tensor_census",
    "use_sdpa",
]
