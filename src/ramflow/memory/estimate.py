"""Memory estimates: where a training run's bytes live, before anything is allocated.

``estimate_memory`` takes any model (best on the meta device, where building it allocates
nothing) and the activations of one micro-batch (an ``ActivationProfile``) and returns a
``MemoryEstimate``: parameters, gradients, optimizer states and activations on the device
and in host RAM (pinned and pageable), for a precision, optimizer, activation checkpointing
and offload choice. Parameters, gradients and optimizer states follow from the units that
``ramflow.offload`` would form: the estimate splits the model with the engine's own
``find_units`` and sizes (padding included) and asks the engine's planner
(``ramflow.planner.plan.make_plan``) for the plan. ``ramflow plan`` and ``ramflow train`` call this
function (``ramflow.train.estimate`` measures a language model's activations on the meta
device and adds a step-time prediction); this package never imports ``ramflow.train``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..activations.report import ActivationReport
from ..choices import CHECKPOINTING_MODES
from ..engine.host_store import host_ram_available, resolve_precision
from ..formats.host import HostPrecision
from ..planner.costs import ParameterCounts, parameter_counts
from ..planner.plan import OFFLOAD_BOUNDARIES_ON_DEVICE, OffloadPlan
from ..planner.predict import TRAIN_MATMUL_EFFICIENCY, Rates, StepPrediction
from ..planner.unit_plan import plan_units
from ..sizes import format_bytes, parse_bytes
from ..transfer.streams import caching_host_block_bytes
from ..units.unit import Unit, find_units

__all__ = [
    "CUDA_RUNTIME_OVERHEAD_BYTES",
    "RUNTIME_OVERHEAD_BYTES",
    "runtime_overhead_bytes",
    "ActivationProfile",
    "MemoryEstimate",
    "RunDescription",
    "estimate_memory",
    "size_string",
]

RUNTIME_OVERHEAD_BYTES = 1 << 30  # Python, torch and transformers themselves, measured ~0.7 GiB
# a process with a CUDA context (and, under torch.distributed, NCCL's host buffers): 3.3 GB
# before loading on the H100 box (docs/memory.md, "Where the extra bytes went")
CUDA_RUNTIME_OVERHEAD_BYTES = 7 << 29


def runtime_overhead_bytes(device_type: str) -> int:
    """Host RAM one process takes before its model: ``CUDA_RUNTIME_OVERHEAD_BYTES`` (3.5
    GiB) with a CUDA device, else ``RUNTIME_OVERHEAD_BYTES`` (1 GiB)."""
    return CUDA_RUNTIME_OVERHEAD_BYTES if device_type == "cuda" else RUNTIME_OVERHEAD_BYTES


ADAPTER_DEVICE_BYTES_PER_PARAMETER = 16
"""A LoRA adapter parameter on the device (PEFT keeps adapters in fp32): its weight, its
gradient and AdamW's two states, 4 bytes each."""

ADAPTER_CHECKPOINT_BYTES_PER_PARAMETER = 12
"""A LoRA adapter parameter in a checkpoint, which holds only the adapters: its fp32
weight and AdamW's two fp32 states."""


class BudgetTooSmall(ValueError):
    """The device budget cannot hold the smallest plan and the activations together (or,
    from ``fit_batch``, no micro-batch fits it); the message gives the smallest budget that
    works where it is known. A ``ValueError``, so callers that treat it as bad input keep
    doing so; ``ramflow plan`` answers it as "does not fit".

    Attributes:
        needed_bytes: the smallest device budget that holds the run as asked, bytes (None:
            not known, as for ``fit_batch``'s, which tried several).
    """

    def __init__(self, message: str, *, needed_bytes: int | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd saves for backward in one training forward of a micro-batch.

    Attributes:
        layer_bytes: saved by each block (decoder layer; its input included), block order.
        layer_input_bytes: one block's input, what a checkpointed block keeps.
        other_bytes: saved outside the blocks (embedding, final norm, head, loss).
        logits_workspace_bytes: working memory of the loss's backward that is never saved
            (for a language model the gradient of the fp32 logits, N * V * 8); 0 if unknown.
        measured: False where a formula stood in for a measurement.
    """

    layer_bytes: tuple[int, ...]
    layer_input_bytes: int
    other_bytes: int
    logits_workspace_bytes: int
    measured: bool

    @classmethod
    def from_report(
        cls, report: ActivationReport, *, blocks: list[str] | None = None
    ) -> ActivationProfile:
        """The profile of a model measured by ``activation_report`` (on a real micro-batch).

        Args:
            report: the measured report.
            blocks: dotted names of the blocks, in order. Default: ``report.blocks``, the
                blocks ``ramflow.memory.find_blocks`` names on the measured model (the
                ``model.layers.N`` of a Hugging Face decoder; the same blocks that
                checkpointing and ``ramflow.offload`` use), none when the model has no
                repeated blocks. For a report built by hand (``report.blocks`` is None): the
                rows named ``<prefix>.<int>`` under the prefix that has the most of them.

        Raises:
            KeyError: a name in ``blocks`` did not run in the measured forward.
        """
        if blocks is None and report.blocks is not None:
            blocks = list(report.blocks)
        if blocks is None:
            groups: dict[str, list[str]] = {}
            for row in report.modules:
                prefix, _, last = row.name.rpartition(".")
                if last.isdigit():
                    groups.setdefault(prefix, []).append(row.name)
            names = max(groups.values(), key=len, default=[])
            blocks = sorted(names, key=lambda n: int(n.rpartition(".")[2]))
        rows = [report[name] for name in blocks]
        layer = tuple(r.saved_bytes for r in rows)
        return cls(
            layer_bytes=layer,
            layer_input_bytes=max((r.input_bytes for r in rows), default=0),
            other_bytes=max(report.total_saved_bytes - sum(layer), 0),
            logits_workspace_bytes=0,
            measured=True,
        )

    def saved_bytes(
        self, *, checkpointing: bool, offload: bool = False, micro_batches: int = 1
    ) -> int:
        """Bytes held on the device between forward and backward. With ``offload``
        (``CheckpointOffload``, checkpointing on) the layers' inputs are in host memory
        but for the ones backward has brought back (``OFFLOAD_BOUNDARIES_ON_DEVICE``).
        ``micro_batches``: a unit-major step of that many micro-batches
        (``ramflow.accumulate``), whose forwards all end before the first backward: every
        micro-batch's saved bytes are held at once, and under offload backward brings back
        the next layer's input of every micro-batch beside the one it recomputes (see
        [Note: one weight pass per optimizer step] in ``ramflow.engine.unit_major``)."""
        num_layers = len(self.layer_bytes) * micro_batches
        if checkpointing and offload:
            kept = min(micro_batches * (OFFLOAD_BOUNDARIES_ON_DEVICE - 1) + 1, num_layers)
            return self.other_bytes * micro_batches + self.layer_input_bytes * kept
        if checkpointing:
            return (self.other_bytes + self.layer_input_bytes * len(self.layer_bytes)) * (
                micro_batches
            )
        return (self.other_bytes + sum(self.layer_bytes)) * micro_batches

    def offloaded_bytes(self, *, pinned: bool = False, micro_batches: int = 1) -> int:
        """Host bytes of the layers' inputs under activation offload; ``pinned``: as the
        pinned memory that holds them takes them (``BoundaryOffloader`` allocates each from
        PyTorch's caching host allocator, which rounds a block up to a power of two:
        ``transfer.streams.caching_host_block_bytes``); ``micro_batches``: those of a
        unit-major step of that many micro-batches, all held at once."""
        each = (
            caching_host_block_bytes(self.layer_input_bytes) if pinned else self.layer_input_bytes
        )
        return each * len(self.layer_bytes) * micro_batches

    def peak_bytes(
        self, *, checkpointing: bool, offload: bool = False, micro_batches: int = 1
    ) -> int:
        """Saved bytes plus backward working memory: the activations' share of the peak
        (``micro_batches``: as ``saved_bytes``; the working memory is one micro-batch's,
        as their backwards run one after another)."""
        largest = max(self.layer_bytes, default=0)
        saved = self.saved_bytes(
            checkpointing=checkpointing, offload=offload, micro_batches=micro_batches
        )
        return saved + largest + self.logits_workspace_bytes


@dataclass(frozen=True)
class RunDescription:
    """The run a memory estimate is for, as its report names it.

    Attributes:
        batch_size: sequences per micro-batch (B), > 0.
        seq_len: tokens per sequence (T), > 0.
        model_name: what the estimate is for (a preset or folder); None: the model's class
            name.
        precision: the compute precision the report names (``bf16``/``fp16``/``fp32``);
            None: the wire dtype's name.
        out_dir: where checkpoints go, to report its free disk space; None: not reported.
        micro_batches: micro-batches per optimizer step run unit-major
            (``ramflow.accumulate``), whose activations are all held at once (see
            ``ActivationProfile.saved_bytes``); default 1: one micro-batch's.
    """

    batch_size: int
    seq_len: int
    model_name: str | None = None
    precision: str | None = None
    out_dir: str | os.PathLike | None = None
    micro_batches: int = 1


@dataclass(frozen=True)
class FrozenBase:
    """A LoRA run's frozen base and its adapters, as ``estimate_memory`` sizes them.

    Attributes:
        frozen_format: frozen weights kept compressed in host RAM (``"int8"``, ``"nf4"``;
            ``ramflow.offload``'s ``frozen_format``); None: in the wire dtype.
        num_adapter_parameters: LoRA adapter parameters trained on the device (the base
            frozen): ``ADAPTER_DEVICE_BYTES_PER_PARAMETER`` each come out of the budget
            before ramflow's share, and the checkpoint holds only them.
    """

    frozen_format: str | None = None
    num_adapter_parameters: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Where the bytes of one training run live, before anything is allocated.

    Device figures are per GPU (on a CPU run, the "device" is RAM too). Host figures
    split into pinned (page-locked, for DMA) and pageable RAM.

    Attributes:
        model_name: what the estimate is for (preset or folder).
        num_parameters: distinct parameter elements; num_trainable: those with gradients.
        device_type: ``"cuda"`` or ``"cpu"``; precision: ``bf16``/``fp16``/``fp32``.
        wire_dtype: dtype of the device copies of the weights.
        batch_size, seq_len: B and T of a micro-batch.
        checkpointing: activation checkpointing on.
        device_budget_bytes: the whole device's budget for the run (None: no cap).
        plan: the plan ``ramflow.offload`` would choose (window, resident units).
        activations: the measured profile.
        device_parameter_bytes: window slots + resident units + buffers on the device.
        device_gradient_bytes: device gradient buffers.
        device_activation_bytes: activations at their peak (saved + backward working memory).
        host_parameter_pinned_bytes / host_parameter_pageable_bytes: fp32 masters and wire copies.
        host_gradient_pinned_bytes / host_gradient_pageable_bytes: D2H staging and fp32 gradients.
        host_optimizer_bytes: optimizer states (pageable, fp32).
        checkpoint_bytes: one checkpoint on disk (fp32 weights and optimizer states).
        ram_available_bytes: RAM this machine has available now.
        disk_free_bytes: free bytes where checkpoints go (None when not asked).
        disk_checkpoints: checkpoints the free disk must hold at once (default 1): a run
            that saves more than once writes the new one beside those it keeps and deletes
            the oldest only once it is in place (``ramflow.train`` counts its cadence).
        prediction: the predicted step time of ``plan`` as ``train`` runs it (GPU runs, when
            asked; ``ramflow.planner.predict``), from estimated inputs: ``timing_rates`` and
            ``matmul_flops_per_s``.
        timed_plan: the plan with the least predicted step time for the same budget
            (residents, prefetch depth, per-unit checkpointing; ``make_plan`` with timing).
        timing_rates: the copy and CPU optimizer rates assumed.
        matmul_flops_per_s: the GPU bf16 matmul rate assumed, FLOP/s.
        device_note: why this device was planned, where the user named none (printed
            under the device line), or None.
        host_precision: the host formats (``ramflow.HostPrecision``; ``.name`` for display).
        host_precision_reason: why ``"auto"`` chose them (None when not asked for).
        full_gradients: the loop keeps a full host gradient buffer (counted in the host
            gradients), so its host steps wait for the end of backward.
        host_bytes_per_parameter: host bytes per trained parameter: the table's host
            total for parameters, gradients and optimizer states (a deferred step's
            gradients and the ring's buffers included) over the trained parameters; None
            for exact formats with other than AdamW's two states, or nothing trained.
        host_ring_bytes: the gradient ring's staging buffers (``RING_BUFFERS`` of the
            largest unit, in the wire dtype): part of the host total, a fixed cost that
            does not grow with the number of layers (0 without the ring).
        activation_offload: the checkpointed layers' inputs live in pinned host memory
            (``--checkpointing offload``, ``ramflow.memory.CheckpointOffload``).
        host_activation_pinned_bytes: those inputs' host bytes (0 without offload): on
            CUDA pinned, each input rounded up to a power of two as PyTorch's caching
            host allocator takes it (``ActivationProfile.offloaded_bytes``).
        checkpointing_reason: why ``"auto"`` chose the checkpointing it did (None when not
            asked for auto).
        parameter_counts: the parameters in total and those one token reads (a mixture of
            experts': ``ramflow.planner.costs.parameter_counts``); None: not counted.
        num_adapter_parameters: LoRA adapter parameters trained on the device beside the
            frozen base (0: none); with their gradients and optimizer states they take
            ``device_adapter_bytes`` of the budget, outside ramflow's share.
        machine_fix: for a run this machine's RAM or disk cannot hold, the change that
            fits, as a ready flag with its figures, computed by the same estimate
            (``"--host-precision lean: RAM 12.40 GiB of 22.61 GiB available"``); None
            where the run fits or no such change was found.
        micro_batches: the micro-batches of a unit-major step whose activations the
            figures hold at once (``RunDescription.micro_batches``); 1: one micro-batch's.
    """

    model_name: str
    num_parameters: int
    num_trainable: int
    device_type: str
    precision: str
    wire_dtype: str
    batch_size: int
    seq_len: int
    checkpointing: bool
    device_budget_bytes: int | None
    plan: OffloadPlan
    activations: ActivationProfile
    device_parameter_bytes: int
    device_gradient_bytes: int
    device_activation_bytes: int
    host_parameter_pinned_bytes: int
    host_parameter_pageable_bytes: int
    host_gradient_pinned_bytes: int
    host_gradient_pageable_bytes: int
    host_optimizer_bytes: int
    checkpoint_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int | None
    prediction: StepPrediction | None = None
    timed_plan: OffloadPlan | None = None
    timing_rates: Rates | None = None
    matmul_flops_per_s: float | None = None
    device_note: str | None = None
    host_precision: HostPrecision = HostPrecision.fp32()
    host_precision_reason: str | None = None
    full_gradients: bool = False
    host_bytes_per_parameter: float | None = None
    host_ring_bytes: int = 0
    activation_offload: bool = False
    host_activation_pinned_bytes: int = 0
    checkpointing_reason: str | None = None
    parameter_counts: ParameterCounts | None = None
    num_adapter_parameters: int = 0
    machine_fix: str | None = None
    disk_checkpoints: int = 1

    def host_bytes_text(self) -> str:
        """``", 4.55 bytes per trained parameter (4.03 per parameter and 3.91 GiB of
        fixed gradient staging)"``: the table's host total over the trained parameters,
        split into what grows with the model and the gradient ring's fixed buffers; ``""``
        where ``host_bytes_per_parameter`` is None."""
        if self.host_bytes_per_parameter is None or not self.num_trainable:
            return ""
        text = f", {self.host_bytes_per_parameter:.2f} bytes per trained parameter"
        if self.host_ring_bytes:
            per = self.host_bytes_per_parameter - self.host_ring_bytes / self.num_trainable
            text += (
                f" ({per:.2f} per parameter and {format_bytes(self.host_ring_bytes)} of fixed "
                "gradient staging)"
            )
        return text

    micro_batches: int = 1

    def parameters_text(self) -> str:
        """``"30,532.12 M parameters"``, with the active ones of a mixture of experts:
        ``"(3,353.03 M active per token: 8 of 128 experts)"``."""
        text = f"{self.num_parameters / 1e6:,.2f} M parameters"
        counts = self.parameter_counts
        if counts is None or counts.routing is None:
            return text
        r = counts.routing
        return (
            f"{text} ({counts.active / 1e6:,.2f} M active per token: {r.num_active} of "
            f"{r.num_experts} experts)"
        )

    @property
    def device_adapter_bytes(self) -> int:
        """The LoRA adapters' device bytes: weights, gradients and AdamW states."""
        return self.num_adapter_parameters * ADAPTER_DEVICE_BYTES_PER_PARAMETER

    @property
    def device_total_bytes(self) -> int:
        return (
            self.device_parameter_bytes
            + self.device_gradient_bytes
            + self.device_activation_bytes
            + self.device_adapter_bytes
        )

    @property
    def checkpointing_mode(self) -> str:
        """``"off"``, ``"on"`` or ``"offload"`` (on, with the inputs in host memory)."""
        if self.activation_offload:
            return "offload"
        return "on" if self.checkpointing else "off"

    @property
    def gpu_memory_bytes(self) -> int | None:
        """ramflow's share of the device budget: what ``ramflow.offload(gpu_memory=...)``
        may allocate on the device, the budget less the activations and the LoRA adapters
        (None: no cap)."""
        if self.device_budget_bytes is None:
            return None
        return self.device_budget_bytes - self.device_activation_bytes - self.device_adapter_bytes

    @property
    def host_pinned_bytes(self) -> int:
        return (
            self.host_parameter_pinned_bytes
            + self.host_gradient_pinned_bytes
            + self.host_activation_pinned_bytes
        )

    @property
    def host_pageable_bytes(self) -> int:
        return (
            self.host_parameter_pageable_bytes
            + self.host_gradient_pageable_bytes
            + self.host_optimizer_bytes
        )

    @property
    def ram_needed_bytes(self) -> int:
        """RAM the run needs: host store, optimizer states, the runtime itself, and on a
        CPU run the "device" side too."""
        device = self.device_total_bytes if self.device_type == "cpu" else 0
        runtime = runtime_overhead_bytes(self.device_type)
        return self.host_pinned_bytes + self.host_pageable_bytes + device + runtime

    @property
    def fits_ram(self) -> bool:
        return self.ram_needed_bytes <= self.ram_available_bytes

    @property
    def disk_needed_bytes(self) -> int:
        """The free disk the run's checkpoints take at once: ``disk_checkpoints`` of
        ``checkpoint_bytes``."""
        return self.disk_checkpoints * self.checkpoint_bytes

    @property
    def fits_disk(self) -> bool:
        """Room for ``disk_checkpoints`` checkpoints at once (True when the disk was not
        asked)."""
        return self.disk_free_bytes is None or self.disk_needed_bytes <= self.disk_free_bytes

    def table(self) -> str:
        """The estimate as a table for people."""
        dev = "GPU" if self.device_type == "cuda" else "device (CPU)"
        rows = [
            (
                "parameters",
                self.device_parameter_bytes,
                self.host_parameter_pinned_bytes,
                self.host_parameter_pageable_bytes,
                None,
            ),
            (
                "gradients",
                self.device_gradient_bytes,
                self.host_gradient_pinned_bytes,
                self.host_gradient_pageable_bytes,
                None,
            ),
            ("optimizer states", 0, 0, self.host_optimizer_bytes, None),
            *(
                [("LoRA adapters", self.device_adapter_bytes, 0, 0, None)]
                if self.num_adapter_parameters
                else []
            ),
            (
                "activations",
                self.device_activation_bytes,
                self.host_activation_pinned_bytes,
                0,
                None,
            ),
            ("checkpoint", None, None, None, self.checkpoint_bytes),
        ]
        total = (
            "total",
            self.device_total_bytes,
            self.host_pinned_bytes,
            self.host_pageable_bytes,
            self.checkpoint_bytes,
        )

        def cell(v: int | None) -> str:
            return "-" if not v else format_bytes(v)

        header = ("", dev, "CPU pinned", "CPU pageable", "disk")
        lines = [header, *[(r[0], *map(cell, r[1:])) for r in (*rows, total)]]
        widths = [max(len(line[i]) for line in lines) for i in range(5)]
        out = []
        for k, line in enumerate(lines):
            out.append(
                "  ".join(
                    c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(line)
                )
            )
            if k == 0 or k == len(lines) - 2:
                out.append("-" * len(out[-1]))
        return "\n".join(out)

    def describe(self) -> str:
        """Header, table, plan and verdicts: what ``ramflow plan`` prints."""
        budget = (
            "no cap" if self.device_budget_bytes is None else format_bytes(self.device_budget_bytes)
        )
        act = self.activations
        ckpt = {
            "checkpointing": self.checkpointing,
            "offload": self.activation_offload,
            "micro_batches": self.micro_batches,
        }
        lines = [
            f"model {self.model_name}: {self.parameters_text()}, {len(act.layer_bytes)} layers",
            f"device {self.device_type}, precision {self.precision} (weights on the device in "
            f"{self.wire_dtype}), budget {budget}",
            *([f"  ({self.device_note})"] if self.device_note else []),
            f"micro-batch {self.batch_size} x {self.seq_len} tokens, activation checkpointing "
            f"{self.checkpointing_mode}"
            + ("" if act.measured else " (activations from a formula: unknown model structure)"),
            *([f"  (auto: {self.checkpointing_reason})"] if self.checkpointing_reason else []),
            "",
            self.table(),
            "",
            "ramflow plan: " + self.plan.describe().replace("\n", "\n  "),
            f"host formats: {self.host_precision.name}"
            + self.host_bytes_text()
            + (f" (auto: {self.host_precision_reason})" if self.host_precision_reason else ""),
            "",
            f"activations: {format_bytes(act.saved_bytes(**ckpt))} saved on the device for "
            f"backward + {format_bytes(act.peak_bytes(**ckpt) - act.saved_bytes(**ckpt))} "
            "backward working memory"
            + (
                f"; {format_bytes(self.host_activation_pinned_bytes)} of layer inputs in "
                "pinned host memory"
                if self.activation_offload
                else ""
            ),
            f"RAM: needs about {format_bytes(self.ram_needed_bytes)} (including "
            f"{format_bytes(runtime_overhead_bytes(self.device_type))} for the runtime), "
            f"{format_bytes(self.ram_available_bytes)} available: "
            + ("fits" if self.fits_ram else "DOES NOT FIT"),
        ]
        if self.disk_free_bytes is not None:
            lines.append(
                f"disk: a checkpoint takes {format_bytes(self.checkpoint_bytes)}, "
                f"{self.disk_checkpoints} at a time while saving; "
                f"{format_bytes(self.disk_free_bytes)} free: "
                + ("fits" if self.fits_disk else "DOES NOT FIT")
            )
        lines += self.speed_lines()
        return "\n".join(lines)

    def rates_lines(self) -> list[str]:
        """The rates the step prediction assumed, and how to give others (two lines);
        empty without timing rates."""
        r = self.timing_rates
        if r is None:
            return []
        both = f", both ways {r.both_bytes_per_s / 1e9:.1f} GB/s" if r.both_bytes_per_s else ""
        return [
            f"  assumed: pinned PCIe {r.h2d_bytes_per_s / 1e9:.1f} GB/s H2D, "
            f"{r.d2h_bytes_per_s / 1e9:.1f} GB/s D2H{both}; GPU bf16 matmul "
            f"{(self.matmul_flops_per_s or 0) / 1e12:.0f} TFLOP/s ({TRAIN_MATMUL_EFFICIENCY:.0%} of "
            f"it in a training forward); CPU AdamW {r.cpu_optimizer_params_per_s / 1e9:.2f} G params/s",
            "  (defaults: the H200 box's measurements; override with --pcie-gbps, --gpu-tflops, "
            "--cpu-adamw-gparams; benchmarks/bench.py --floors measures them)",
        ]

    def speed_lines(self) -> list[str]:
        """The predicted step time and the fastest plan, with the rates assumed."""
        if self.prediction is None or self.timing_rates is None:
            return []
        lines = [
            "",
            f"step time (predicted, estimated inputs): {self.prediction.describe()}",
            *self.rates_lines(),
        ]
        best = self.timed_plan
        if best is not None and best.prediction is not None:
            kwargs = best.offload_kwargs()
            ckpt = kwargs["activation_checkpointing"]
            budget = kwargs["gpu_memory"]
            lines += [
                f"fastest plan for this budget: {best.prediction.step_s * 1e3:.0f} ms per step, "
                f"bound by {best.prediction.bound}",
                "  " + best.describe().replace("\n", "\n  "),
                "  ramflow.offload(model, gpu_memory="
                + ("None" if budget is None else repr(size_string(budget)))
                + f", prefetch_depth={kwargs['prefetch_depth']}, activation_checkpointing="
                + (
                    "ramflow.memory.CheckpointOffload()"
                    if self.activation_offload
                    else repr(ckpt)
                    if len(ckpt or []) <= 4
                    else f"[{len(ckpt)} units above]"
                )
                + ")",
            ]
        return lines


def size_string(num_bytes: int) -> str:
    """``num_bytes`` as a size string that ``ramflow.offload`` reads: GiB with two decimals
    (MiB below 1 GiB), rounded down so that it never grants more than ``num_bytes``
    (``8405385728`` -> ``"7.82GiB"``)."""
    unit, size = ("GiB", 2**30) if num_bytes >= 2**30 else ("MiB", 2**20)
    return f"{math.floor(num_bytes / size * 100) / 100:.2f}{unit}"


def _make_plan(
    units: list[Unit],
    buffer_bytes: int,
    *,
    device_type: str,
    wire_dtype: torch.dtype,
    gpu_memory_bytes: int | None,
    prefetch_depth: int,
) -> OffloadPlan:
    """The plan ``Engine.__init__`` makes for these units (same arguments): on CUDA with
    the staging buffers of compressed frozen weights, and their compressed bytes as what
    one load moves over PCIe."""
    plan = plan_units(
        units,
        device=torch.device(device_type),
        wire_dtype=wire_dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        prefetch_depth=prefetch_depth,
        fixed_bytes=buffer_bytes,
    )
    return dataclasses.replace(plan, unit_h2d_bytes=tuple(u.h2d_bytes(wire_dtype) for u in units))


def offload_units(model: nn.Module, *, frozen_format: str | None = None) -> tuple[list[Unit], int]:
    """The units ``ramflow.offload`` would form for ``model`` (its frozen weights kept
    under ``frozen_format``), and its buffers' bytes."""
    units = [Unit(i, spec, frozen_format=frozen_format) for i, spec in enumerate(find_units(model))]
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return units, buffer_bytes


def estimate_memory(
    model: nn.Module,
    *,
    activations: ActivationProfile,
    run: RunDescription,
    device_type: str = "cuda",
    wire_dtype: torch.dtype = torch.bfloat16,
    device_budget: int | str | None = None,
    checkpointing: str | bool = "auto",
    prefetch_depth: int = 2,
    optimizer_states: int = 2,
    host_precision: HostPrecision | str | None = None,
    held_gradients: str | None = None,
    frozen: FrozenBase | None = None,
) -> MemoryEstimate:
    """Estimate a training run's memory, per device and host, without running it.

    The device budget covers everything on the device: ramflow's own share (window,
    resident units, gradient buffers) is what is left after the activations, and that
    share (``MemoryEstimate.gpu_memory_bytes``, ``ramflow.offload``'s ``gpu_memory``) goes to
    the planner. Host figures assume ``ramflow.offload`` and a
    ``ramflow.optim`` optimizer: fp32 master weights, wire copies (pinned on CUDA), fp32
    host gradients with their D2H staging, and ``optimizer_states`` fp32 tensors per
    trainable parameter.

    Args:
        model: the model; on the meta device it allocates nothing (shapes and
            ``requires_grad`` are all that is read).
        activations: the activations of one micro-batch (``ActivationProfile``; from
            ``ActivationProfile.from_report`` for any model, or
            ``ramflow.train.estimate.measure_activations`` for a language model).
        run: the micro-batch's shape (B, T) and the report's names (``RunDescription``).
        device_type: ``"cuda"`` or ``"cpu"`` (on a CPU run the "device" is RAM too).
        wire_dtype: dtype of the device copies of the weights.
        device_budget: the whole device's budget for the run, bytes or a size string (``"12GiB"``); None:
            no cap.
        checkpointing: ``"on"``/True, ``"off"``/False, ``"offload"`` (on, with the layers'
            inputs in pinned host memory: ``CheckpointOffload``), or ``"auto"``: off when
            the activations fit in the budget beside ramflow's smallest plan, else on when
            that fits, else offload (see ``choose_checkpointing``; off without a budget).
        prefetch_depth: as for ``ramflow.offload``.
        optimizer_states: fp32 state tensors per trainable parameter (2 for AdamW, 1 for
            SGD with momentum, 0 for none).
        host_precision: the host formats (as ``ramflow.offload``'s ``host_precision``,
            ``"auto"`` included: decided on this machine's available RAM); None: fp32. With
            formats other than fp32 the optimizer is taken to be AdamW.
        held_gradients: how the loop holds its gradients for a step not applied during
            backward (clipping, accumulation, a first step; under a gradient ring only
            then, without one the store keeps them always). None: never (every step runs
            during backward). ``"grads"``: in ``p.grad``, the master's dtype (an optimizer
            that keeps them, ``keep_grads=True``). ``"codes"``: 8-bit codes where the host
            formats allow them (``AdamW(keep_grads=False)`` under the lean formats, see
            ``ramflow.formats.deferred_grad``), else the master's dtype. Counted in the host
            gradients as ``HostPrecision.host_bytes`` counts them, as the engine's plan
            (``ramflow.get_plan``) does.
        frozen: a LoRA run's frozen base and its adapters (``FrozenBase``); None: no
            adapters, frozen weights (if any) in the wire dtype.

    Returns:
        A ``MemoryEstimate``; ``describe()`` prints it.

    Raises:
        ValueError: ``checkpointing`` or ``device_type`` unknown; non-positive sizes; an
            unreadable or negative budget; the budget is too small for the activations and
            ramflow's smallest plan (the message gives the figures and the smallest budget
            that works).
        TypeError: ``device_budget`` is neither a number nor a string (a bool, say).
    """
    if isinstance(checkpointing, bool):
        checkpointing = "on" if checkpointing else "off"
    if checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(
            f"--checkpointing {checkpointing!r}: choose one of {', '.join(CHECKPOINTING_MODES)}"
        )
    batch_size, seq_len = run.batch_size, run.seq_len
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch size and sequence length must be positive, got {batch_size} and {seq_len}"
        )
    if held_gradients not in (None, "grads", "codes"):
        raise ValueError(f"held_gradients must be None, 'grads' or 'codes', got {held_gradients!r}")
    if run.micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {run.micro_batches}")
    num_micro = run.micro_batches
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"device_type must be 'cuda' or 'cpu' (a device type: 'cuda' for any GPU index), "
            f"got {device_type!r}"
        )
    device_budget_bytes = (
        None if device_budget is None else parse_bytes(device_budget, what="device_budget")
    )
    frozen = frozen or FrozenBase()
    frozen_format, num_adapter_parameters = frozen.frozen_format, frozen.num_adapter_parameters
    units, buffer_bytes = offload_units(model, frozen_format=frozen_format)
    acts = activations
    adapter_bytes = num_adapter_parameters * ADAPTER_DEVICE_BYTES_PER_PARAMETER
    smallest = _make_plan(
        units,
        buffer_bytes,
        device_type=device_type,
        wire_dtype=wire_dtype,
        gpu_memory_bytes=None,
        prefetch_depth=prefetch_depth,
    ).min_gpu_memory_bytes
    ckpt_reason = None
    if checkpointing == "auto":
        # the adapters take their room before the activations and ramflow
        checkpointing, ckpt_reason = choose_checkpointing(
            acts, smallest + adapter_bytes, device_budget_bytes, micro_batches=num_micro
        )
    ckpt, offload = checkpointing in ("on", "offload"), checkpointing == "offload"
    act_bytes = acts.peak_bytes(checkpointing=ckpt, offload=offload, micro_batches=num_micro)
    # ramflow's share: what the activations and the adapters leave of the device's budget
    gpu_memory_bytes = None
    if device_budget_bytes is not None:
        gpu_memory_bytes = device_budget_bytes - act_bytes - adapter_bytes
        if gpu_memory_bytes < smallest:
            need = smallest + act_bytes + adapter_bytes
            adapters = f", the LoRA adapters {format_bytes(adapter_bytes)}" if adapter_bytes else ""
            hint = (
                ""
                if offload
                else ", or --checkpointing offload"
                if ckpt
                else ", or --checkpointing on"
            )
            raise BudgetTooSmall(
                f"--gpu-memory {format_bytes(device_budget_bytes)} is too small for this run: activations "
                f"of {_micro_batches_text(num_micro, batch_size, seq_len)} need about "
                f"{format_bytes(act_bytes)} and "
                f"ramflow's smallest plan (streaming every unit) {format_bytes(smallest)}{adapters}, together "
                f"{format_bytes(need)}. Give --gpu-memory {format_bytes(need * 1.05)} or more, or a "
                f"smaller --batch-size / --seq-len{hint}.",
                needed_bytes=need,
            )
    plan = _make_plan(
        units,
        buffer_bytes,
        device_type=device_type,
        wire_dtype=wire_dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        prefetch_depth=prefetch_depth,
    )

    cuda = device_type == "cuda"
    host, wire_dtype, reason = resolve_precision(
        host_precision, lambda: units, wire_dtype=wire_dtype, default_wire=wire_dtype
    )
    parts = host.host_bytes(
        units,
        wire_dtype,
        num_states=optimizer_states,
        full_gradients=held_gradients is not None,
        kept_grads=held_gradients == "grads",
    )
    # a master that is the wire copy (or fp32 with an fp32 wire) is pinned, as a wire is
    master_pinned = cuda and host.master_format.wire_copy_bytes(wire_dtype) == 0
    distinct = {id(p): p for p in model.parameters()}.values()
    num_parameters = sum(p.numel() for p in distinct)
    num_trainable = sum(p.numel() for p in distinct if p.requires_grad)
    disk_free = None
    if run.out_dir is not None:
        probe = Path(run.out_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        disk_free = shutil.disk_usage(probe).free
    wire_name = str(wire_dtype).replace("torch.", "")
    return MemoryEstimate(
        model_name=run.model_name if run.model_name is not None else type(model).__name__,
        num_parameters=num_parameters,
        num_trainable=num_trainable,
        device_type=device_type,
        precision=run.precision if run.precision is not None else wire_name,
        wire_dtype=wire_name,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpointing=ckpt,
        device_budget_bytes=device_budget_bytes,
        plan=plan,
        activations=acts,
        device_parameter_bytes=plan.window_bytes + plan.resident_bytes + plan.fixed_bytes,
        device_gradient_bytes=plan.grad_bytes,
        device_activation_bytes=act_bytes,
        # compressed frozen weights are loaded as the wire copies are: pinned on CUDA
        host_parameter_pinned_bytes=(parts.master if master_pinned else 0)
        + (parts.wire + parts.compressed if cuda else 0),
        host_parameter_pageable_bytes=(0 if master_pinned else parts.master)
        + (0 if cuda else parts.wire + parts.compressed),
        host_gradient_pinned_bytes=parts.staging if cuda else 0,
        host_gradient_pageable_bytes=parts.gradients + (0 if cuda else parts.staging),
        host_optimizer_bytes=parts.states,
        # on disk: unpadded parameters and their states; a LoRA run's adapters only
        checkpoint_bytes=num_adapter_parameters * ADAPTER_CHECKPOINT_BYTES_PER_PARAMETER
        if num_adapter_parameters
        else num_parameters * host.master_dtype.itemsize
        + host.state_bytes(num_trainable, num_states=optimizer_states),
        ram_available_bytes=host_ram_available(),
        disk_free_bytes=disk_free,
        host_precision=host,
        host_precision_reason=reason,
        full_gradients=held_gradients is not None,
        parameter_counts=parameter_counts(model),
        # AdamW's (two states): the figure is for it
        # the table's host total per trained parameter, so the header says what it sums
        host_bytes_per_parameter=None
        if (host.is_exact and optimizer_states != 2) or not num_trainable
        else parts.total / num_trainable,
        host_ring_bytes=parts.staging if host.gradient_format.ring else 0,
        activation_offload=offload,
        host_activation_pinned_bytes=acts.offloaded_bytes(pinned=cuda, micro_batches=num_micro)
        if offload
        else 0,
        checkpointing_reason=ckpt_reason,
        num_adapter_parameters=num_adapter_parameters,
        micro_batches=num_micro,
    )


def _micro_batches_text(num_micro: int, batch_size: int, seq_len: int) -> str:
    """What the activations figure is of: one micro-batch, or a unit-major step's."""
    if num_micro == 1:
        return f"a {batch_size} x {seq_len} micro-batch"
    return f"{num_micro} micro-batches of {batch_size} x {seq_len} (one unit-major step)"


def choose_checkpointing(
    acts: ActivationProfile,
    smallest_plan_bytes: int,
    device_budget_bytes: int | None,
    *,
    micro_batches: int = 1,
) -> tuple[str, str | None]:
    """What ``--checkpointing auto`` runs, and why (one line for the plan, or None).

    Each step down costs step time, so the lightest that fits beside ramflow's smallest
    plan wins: off (no recomputation); on (every layer recomputes, its input kept on the
    device); offload (the same recomputation, and the inputs in pinned host memory for one
    D2H and one H2D of each per step, which overlap compute where the link has room).
    Offload is chosen only where checkpointing every layer does not fit: then it is what
    lets this sequence length or micro-batch run at all, where the alternative is a smaller
    micro-batch (more steps per token) and there is nothing left to recompute.

    Args:
        acts: the micro-batch's activations.
        smallest_plan_bytes: ramflow's smallest plan on the device (every unit streamed).
        device_budget_bytes: the whole device's budget (None: no cap, checkpointing off).
        micro_batches: a unit-major step of that many micro-batches, whose activations
            are all held at once (``ActivationProfile.saved_bytes``).

    Returns:
        ``("off" | "on" | "offload", reason)``; with none fitting, ``"offload"`` (the
        caller's error then gives the figures).
    """
    if device_budget_bytes is None:
        return "off", None
    room = device_budget_bytes - smallest_plan_bytes
    on = acts.peak_bytes(checkpointing=True, micro_batches=micro_batches)
    if acts.peak_bytes(checkpointing=False, micro_batches=micro_batches) <= room:
        return "off", None
    if on <= room:
        return "on", None
    kept = on - acts.peak_bytes(checkpointing=True, offload=True, micro_batches=micro_batches)
    return "offload", (
        f"checkpointing every layer leaves {format_bytes(on)} "
        f"of activations on the device, over the {format_bytes(max(room, 0))} the budget leaves; "
        f"so the layers' inputs ({format_bytes(kept)}) go to pinned host memory"
    )
