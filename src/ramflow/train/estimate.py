"""Memory plans without allocating the model: GPU, CPU RAM (pinned and pageable) and disk.

Legend: B = sequences per micro-batch, T = tokens per sequence, N = B * T, H = hidden
size, V = vocabulary size, L = decoder layers.

[Note: measuring activations on the meta device]
Parameters, gradients and optimizer states follow from the units that ``ramflow.offload``
would form: the estimate builds the model on the meta device, splits it with the engine's
own ``find_units`` and sizes (padding included), and asks the engine's planner
(``ramflow._plan.make_plan``) for the plan. Activations are measured rather than derived
from a formula: the decoder's pieces run on meta tensors of the real (B, T) shapes in the
compute dtype, and a ``saved_tensors_hooks`` pair adds up the bytes of every distinct
storage autograd saves for backward (weights excluded). Meta tensors have no fused
attention kernel, so a ``TorchFunctionMode`` stands in for ``scaled_dot_product_attention``
with a function that saves what a fused (flash) kernel saves: q, k, v, the output and the
fp32 log-sum-exp, never the (T, T) attention matrix. With activation checkpointing, each
layer keeps only its input, and one layer's activations are rebuilt at a time in backward.
Backward also needs working memory that is never saved: the gradient of the fp32 logits
and of one layer's activations; the estimate adds ``N * V * (4 + 4)`` bytes for the
first and one layer's saved bytes for the second.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._costs import unit_costs, unit_shapes
from .._plan import OffloadPlan, PlanTiming, format_bytes, make_plan
from .._predict import (
    DEFAULT_MATMUL_FLOPS_PER_S,
    TRAIN_MATMUL_EFFICIENCY,
    Rates,
    StepPrediction,
    predict_step,
)
from .._units import _Unit, find_units, plan_inputs
from .modeling import meta_model

RUNTIME_OVERHEAD_BYTES = (
    1 << 30
)  # Python, torch and transformers themselves, measured at about 0.7 GiB
CHECKPOINTING_MODES = ("auto", "on", "off")


class _FusedAttention(torch.autograd.Function):
    """Stands in for a fused attention kernel: saves (q, k, v, out, lse), returns out."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # (B, heads, T, head_dim) as a view of a (B, T, heads, head_dim) buffer: the layout
        # fused kernels return, so the caller's transpose-and-reshape is free, as on a device
        b, heads, t, _ = q.shape
        out = q.new_empty((b, t, heads, v.shape[-1])).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (B, heads, T)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        raise RuntimeError("the memory estimate runs forward only")


class _FusedAttentionMode(TorchFunctionMode):
    """See [Note: measuring activations on the meta device]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd saves for backward in one training forward of (B, T) tokens.

    Attributes:
        layer_bytes: saved by each decoder layer (its input included), layer order.
        layer_input_bytes: one layer's input, what a checkpointed layer keeps (N * H * dtype).
        other_bytes: saved outside the layers (embedding, final norm, head, loss).
        logits_workspace_bytes: working memory of the loss's backward (N * V * 8).
        measured: False where the model's structure was unknown and a formula stood in.
    """

    layer_bytes: tuple[int, ...]
    layer_input_bytes: int
    other_bytes: int
    logits_workspace_bytes: int
    measured: bool

    def saved_bytes(self, *, checkpointing: bool) -> int:
        """Bytes held between forward and backward."""
        if checkpointing:
            return self.other_bytes + self.layer_input_bytes * len(self.layer_bytes)
        return self.other_bytes + sum(self.layer_bytes)

    def peak_bytes(self, *, checkpointing: bool) -> int:
        """Saved bytes plus backward working memory: the activations' share of the peak."""
        largest = max(self.layer_bytes, default=0)
        return self.saved_bytes(checkpointing=checkpointing) + largest + self.logits_workspace_bytes


def _decoder_parts(model: nn.Module):
    inner = getattr(model, "model", None)
    parts = (
        getattr(inner, "embed_tokens", None),
        getattr(inner, "layers", None),
        getattr(inner, "rotary_emb", None),
        getattr(inner, "norm", None),
        getattr(model, "lm_head", None),
    )
    return None if any(p is None for p in parts) else parts


def measure_activations(
    config, *, batch_size: int, seq_len: int, dtype: torch.dtype
) -> ActivationProfile:
    """Activation bytes of one training forward on the meta device.

    See [Note: measuring activations on the meta device]. Works for Llama-like models
    (``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``, ``model.norm``,
    ``lm_head``); for other structures a formula stands in (``measured=False``).

    Args:
        config: the model's ``transformers`` config.
        batch_size, seq_len: B and T.
        dtype: the compute dtype (what the device weights and matmul outputs are).
    """
    n = batch_size * seq_len
    size = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    workspace = n * config.vocab_size * 8
    model = meta_model(config).to(dtype)
    parts = _decoder_parts(model)
    if parts is None:
        per_layer = n * (12 * hidden + 3 * config.intermediate_size) * size
        return ActivationProfile(
            (per_layer,) * config.num_hidden_layers,
            n * hidden * size,
            n * (hidden * (size + 4) + config.vocab_size * (size + 4)),
            workspace,
            False,
        )
    embed, layers, rotary, norm, head = parts
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    bucket = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(t) in params or id(base) in params:
            return t
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            keep.append(t)  # keeps the storage alive, so its address is not reused
            bucket[0] += storage.nbytes()
        return t

    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    positions = torch.arange(seq_len, device="meta").expand(batch_size, seq_len)
    layer_bytes = []
    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        _FusedAttentionMode(),
    ):
        h = embed(ids)  # (B, T, H)
        cos_sin = rotary(h, positions)
        other = bucket[0]
        for layer in layers:
            bucket[0] = 0
            out = layer(
                h,
                attention_mask=None,
                position_ids=positions,
                position_embeddings=cos_sin,
                use_cache=False,
            )
            h = out[0] if isinstance(out, tuple) else out
            layer_bytes.append(bucket[0])
        bucket[0] = other
        logits = head(norm(h))  # (B, T, V)
        model.loss_function(logits=logits, labels=ids, vocab_size=config.vocab_size)
        other = bucket[0]
    return ActivationProfile(tuple(layer_bytes), n * hidden * size, other, workspace, True)


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
        gpu_memory_bytes: the device budget (None: no cap).
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
        prediction: the predicted step time of ``plan`` as ``train`` runs it (GPU runs, when
            asked; ``ramflow._predict``), from estimated inputs: ``timing_rates`` and
            ``matmul_flops_per_s``.
        timed_plan: the plan with the least predicted step time for the same budget
            (residents, prefetch depth, per-unit checkpointing; ``make_plan`` with timing).
        timing_rates: the copy and CPU optimizer rates assumed.
        matmul_flops_per_s: the GPU bf16 matmul rate assumed, FLOP/s.
        device_note: why this device was planned, where the user named none (printed
            under the device line), or None.
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
    gpu_memory_bytes: int | None
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

    @property
    def device_total_bytes(self) -> int:
        return (
            self.device_parameter_bytes + self.device_gradient_bytes + self.device_activation_bytes
        )

    @property
    def host_pinned_bytes(self) -> int:
        return self.host_parameter_pinned_bytes + self.host_gradient_pinned_bytes

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
        return self.host_pinned_bytes + self.host_pageable_bytes + device + RUNTIME_OVERHEAD_BYTES

    @property
    def fits_ram(self) -> bool:
        return self.ram_needed_bytes <= self.ram_available_bytes

    @property
    def fits_disk(self) -> bool:
        """Room for one checkpoint (``describe`` warns when two, as while a new one is
        written beside the old, do not fit)."""
        return self.disk_free_bytes is None or self.checkpoint_bytes <= self.disk_free_bytes

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
            ("activations", self.device_activation_bytes, 0, 0, None),
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
        budget = "no cap" if self.gpu_memory_bytes is None else format_bytes(self.gpu_memory_bytes)
        act = self.activations
        lines = [
            f"model {self.model_name}: {self.num_parameters / 1e6:,.2f} M parameters, "
            f"{len(act.layer_bytes)} layers",
            f"device {self.device_type}, precision {self.precision} (weights on the device in "
            f"{self.wire_dtype}), budget {budget}",
            *([f"  ({self.device_note})"] if self.device_note else []),
            f"micro-batch {self.batch_size} x {self.seq_len} tokens, activation checkpointing "
            f"{'on' if self.checkpointing else 'off'}"
            + ("" if act.measured else " (activations from a formula: unknown model structure)"),
            "",
            self.table(),
            "",
            "ramflow plan: " + self.plan.describe().replace("\n", "\n  "),
            "",
            f"activations: {format_bytes(act.saved_bytes(checkpointing=self.checkpointing))} saved for "
            f"backward + {format_bytes(act.peak_bytes(checkpointing=self.checkpointing) - act.saved_bytes(checkpointing=self.checkpointing))} "
            "backward working memory",
            f"RAM: needs about {format_bytes(self.ram_needed_bytes)} (including "
            f"{format_bytes(RUNTIME_OVERHEAD_BYTES)} for the runtime), "
            f"{format_bytes(self.ram_available_bytes)} available: "
            + ("fits" if self.fits_ram else "DOES NOT FIT"),
        ]
        if self.disk_free_bytes is not None:
            lines.append(
                f"disk: a checkpoint takes {format_bytes(self.checkpoint_bytes)}, two at a time while "
                f"saving; {format_bytes(self.disk_free_bytes)} free: "
                + (
                    "fits"
                    if 2 * self.checkpoint_bytes <= self.disk_free_bytes
                    else "one fits, two do not: save only at the end (--save-every 0)"
                    if self.fits_disk
                    else "DOES NOT FIT"
                )
            )
        lines += self.speed_lines()
        return "\n".join(lines)

    def speed_lines(self) -> list[str]:
        """The predicted step time and the fastest plan, with the rates assumed."""
        if self.prediction is None or self.timing_rates is None:
            return []
        r = self.timing_rates
        both = f", both ways {r.both_bytes_per_s / 1e9:.1f} GB/s" if r.both_bytes_per_s else ""
        lines = [
            "",
            f"step time (predicted, estimated inputs): {self.prediction.describe()}",
            f"  assumed: pinned PCIe {r.h2d_bytes_per_s / 1e9:.1f} GB/s H2D, "
            f"{r.d2h_bytes_per_s / 1e9:.1f} GB/s D2H{both}; GPU bf16 matmul "
            f"{(self.matmul_flops_per_s or 0) / 1e12:.0f} TFLOP/s ({TRAIN_MATMUL_EFFICIENCY:.0%} of "
            f"it in a training forward); CPU AdamW {r.cpu_optimizer_params_per_s / 1e9:.2f} G params/s",
            "  (defaults: the H200 box's measurements; override with --pcie-gbps, --gpu-tflops, "
            "--cpu-adamw-gparams; benchmarks/bench.py --floors measures them)",
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
                + (repr(ckpt) if len(ckpt or []) <= 4 else f"[{len(ckpt)} units above]")
                + ")",
            ]
        return lines


def size_string(num_bytes: int) -> str:
    """``num_bytes`` as a size string that ``ramflow.offload`` reads: GiB with two decimals
    (MiB below 1 GiB), rounded down so that it never grants more than ``num_bytes``
    (``8405385728`` -> ``"7.82GiB"``)."""
    unit, size = ("GiB", 2**30) if num_bytes >= 2**30 else ("MiB", 2**20)
    return f"{math.floor(num_bytes / size * 100) / 100:.2f}{unit}"


def _unit_figures(model: nn.Module) -> tuple[list[_Unit], int]:
    units = [_Unit(i, spec) for i, spec in enumerate(find_units(model))]
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return units, buffer_bytes


def _make_plan(
    units: list[_Unit],
    buffer_bytes: int,
    *,
    device_type: str,
    wire_dtype: torch.dtype,
    gpu_memory_bytes: int | None,
    prefetch_depth: int,
) -> OffloadPlan:
    """The plan ``Engine.__init__`` makes for these units (same arguments)."""
    return make_plan(
        device=device_type,
        **plan_inputs(units, wire_dtype),
        fixed_bytes=buffer_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
        prefetch_depth=prefetch_depth,
    )


def estimate_memory(
    config,
    *,
    model_name: str,
    device_type: str,
    precision: str,
    compute_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    batch_size: int,
    seq_len: int,
    gpu_memory_bytes: int | None,
    checkpointing: str = "auto",
    prefetch_depth: int = 2,
    optimizer_states: int = 2,
    out_dir: str | os.PathLike | None = None,
    predict: bool = False,
    timing_rates: Rates | None = None,
    matmul_flops_per_s: float | None = None,
) -> MemoryEstimate:
    """Estimate a training run's memory without allocating the model.

    See [Note: measuring activations on the meta device]. The device budget covers
    everything on the device: ramflow's own share (window, resident units, gradient
    buffers) is what is left after the activations, and that share goes to the planner.

    Args:
        config: the model's ``transformers`` config.
        model_name: for the report.
        device_type: ``"cuda"`` or ``"cpu"``.
        precision: ``bf16``/``fp16``/``fp32``, for the report.
        compute_dtype: dtype of activations (autocast dtype, or float32).
        wire_dtype: dtype of the device copies of the weights.
        batch_size, seq_len: B and T of one micro-batch.
        gpu_memory_bytes: the whole device budget (bytes), or None for no cap.
        checkpointing: ``"on"``, ``"off"``, or ``"auto"``: off when the activations fit in
            the budget beside ramflow's smallest plan, on otherwise (off without a budget).
        prefetch_depth: as for ``ramflow.offload``.
        optimizer_states: fp32 state tensors per parameter (2 for AdamW).
        out_dir: where checkpoints go, to report its free disk space (None: not reported).
        predict: also predict the step time (CUDA runs; ``prediction``, ``timed_plan``).
        timing_rates: copy and CPU optimizer rates for the prediction (default: the H200
            box's, ``ramflow._predict``).
        matmul_flops_per_s: the GPU's bf16 matmul rate, FLOP/s (default: the H200's).

    Raises:
        ValueError: ``checkpointing`` unknown; non-positive sizes; the budget is too small
            for the activations and ramflow's smallest plan (the message gives the figures).
    """
    if checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(
            f"--checkpointing {checkpointing!r}: choose one of {', '.join(CHECKPOINTING_MODES)}"
        )
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch size and sequence length must be positive, got {batch_size} and {seq_len}"
        )
    model = meta_model(config)
    units, buffer_bytes = _unit_figures(model)
    acts = measure_activations(config, batch_size=batch_size, seq_len=seq_len, dtype=compute_dtype)
    smallest = _make_plan(
        units,
        buffer_bytes,
        device_type=device_type,
        wire_dtype=wire_dtype,
        gpu_memory_bytes=None,
        prefetch_depth=prefetch_depth,
    ).min_gpu_memory_bytes
    if checkpointing == "auto":
        ckpt = (
            gpu_memory_bytes is not None
            and smallest + acts.peak_bytes(checkpointing=False) > gpu_memory_bytes
        )
    else:
        ckpt = checkpointing == "on"
    act_bytes = acts.peak_bytes(checkpointing=ckpt)
    ramflow_budget = None
    if gpu_memory_bytes is not None:
        ramflow_budget = gpu_memory_bytes - act_bytes
        if ramflow_budget < smallest:
            need = smallest + act_bytes
            hint = "" if ckpt else ", or --checkpointing on"
            raise ValueError(
                f"--gpu-memory {format_bytes(gpu_memory_bytes)} is too small for this run: activations "
                f"of a {batch_size} x {seq_len} micro-batch need about {format_bytes(act_bytes)} and "
                f"ramflow's smallest plan (streaming every unit) {format_bytes(smallest)}, together "
                f"{format_bytes(need)}. Give --gpu-memory {format_bytes(need * 1.05)} or more, or a "
                f"smaller --batch-size / --seq-len{hint}."
            )
    plan = _make_plan(
        units,
        buffer_bytes,
        device_type=device_type,
        wire_dtype=wire_dtype,
        gpu_memory_bytes=ramflow_budget,
        prefetch_depth=prefetch_depth,
    )

    wire_size = torch.empty((), dtype=wire_dtype).element_size()
    numel = sum(u.numel for u in units)
    trainable = sum(u.trainable_numel for u in units)
    cuda = device_type == "cuda"
    master = numel * 4
    wire = numel * wire_size if wire_dtype != torch.float32 else 0
    master_pinned = cuda and wire_dtype == torch.float32
    distinct = {id(p): p for p in model.parameters()}.values()
    num_parameters = sum(p.numel() for p in distinct)
    num_trainable = sum(p.numel() for p in distinct if p.requires_grad)
    disk_free = None
    if out_dir is not None:
        probe = Path(out_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        disk_free = shutil.disk_usage(probe).free
    timing: dict = {}
    if predict and device_type == "cuda":
        timing = _predict_speed(
            model,
            acts,
            plan,
            config=config,
            batch_size=batch_size,
            seq_len=seq_len,
            wire_size=torch.empty((), dtype=wire_dtype).element_size(),
            checkpointing=checkpointing,
            ckpt=ckpt,
            gpu_memory_bytes=gpu_memory_bytes,
            ramflow_budget=ramflow_budget,
            units=units,
            buffer_bytes=buffer_bytes,
            device_type=device_type,
            wire_dtype=wire_dtype,
            rates=timing_rates or Rates(),
            matmul_flops_per_s=matmul_flops_per_s or DEFAULT_MATMUL_FLOPS_PER_S,
        )
    return MemoryEstimate(
        model_name=model_name,
        num_parameters=num_parameters,
        num_trainable=num_trainable,
        device_type=device_type,
        precision=precision,
        wire_dtype=str(wire_dtype).replace("torch.", ""),
        batch_size=batch_size,
        seq_len=seq_len,
        checkpointing=ckpt,
        gpu_memory_bytes=gpu_memory_bytes,
        plan=plan,
        activations=acts,
        device_parameter_bytes=plan.window_bytes + plan.resident_bytes + plan.fixed_bytes,
        device_gradient_bytes=plan.grad_bytes,
        device_activation_bytes=act_bytes,
        host_parameter_pinned_bytes=(master if master_pinned else 0) + (wire if cuda else 0),
        host_parameter_pageable_bytes=(0 if master_pinned else master) + (0 if cuda else wire),
        host_gradient_pinned_bytes=trainable * wire_size if cuda else 0,
        host_gradient_pageable_bytes=trainable * 4 + (0 if cuda else trainable * wire_size),
        host_optimizer_bytes=optimizer_states * trainable * 4,
        checkpoint_bytes=num_parameters * 4 + optimizer_states * num_trainable * 4,
        ram_available_bytes=psutil.virtual_memory().available,
        disk_free_bytes=disk_free,
        **timing,
    )


def _predict_speed(
    model: nn.Module,
    acts: ActivationProfile,
    plan: OffloadPlan,
    *,
    config,
    batch_size: int,
    seq_len: int,
    wire_size: int,
    checkpointing: str,
    ckpt: bool,
    gpu_memory_bytes: int | None,
    ramflow_budget: int | None,
    units: list[_Unit],
    buffer_bytes: int,
    device_type: str,
    wire_dtype: torch.dtype,
    rates: Rates,
    matmul_flops_per_s: float,
) -> dict:
    """The step-time prediction of ``plan`` as ``train`` runs it, and the timed planner's
    fastest plan for the same budget (``MemoryEstimate`` fields).

    Blocks are the decoder layers, in order, with ``acts.layer_bytes``; with
    ``checkpointing="auto"`` the timed planner chooses per-unit checkpointing within the
    whole budget, otherwise it keeps the run's policy (all blocks or none)."""
    shapes = unit_shapes(model)
    blocks = [s.name for s in shapes if s.block]
    hidden = config.hidden_size
    costs = unit_costs(
        shapes,
        batch=batch_size,
        seq=seq_len,
        hidden=hidden,
        wire_itemsize=wire_size,
        matmul_flops_per_s=matmul_flops_per_s,
        resident=plan.resident,
        checkpointed=blocks if ckpt else (),
    )
    prediction = predict_step(
        costs, rates=rates, prefetch_depth=plan.prefetch_depth, grad_bytes_per_param=wire_size
    )
    layer = iter(acts.layer_bytes)
    act_bytes = [next(layer, 0) if s.block else 0 for s in shapes]
    auto = checkpointing == "auto"
    timing = PlanTiming(
        forward_s=[c.forward_s for c in costs],
        trainable_params=[c.trainable_params for c in costs],
        rates=rates,
        deps=[s.deps for s in shapes],
        activation_bytes=act_bytes,
        checkpoint_bytes=[acts.layer_input_bytes if s.block else 0 for s in shapes],
        checkpointable=[s.block for s in shapes],
        other_activation_bytes=acts.other_bytes + acts.logits_workspace_bytes,
        checkpointed=None if auto else (blocks if ckpt else []),
        grad_bytes_per_param=wire_size,
    )
    try:
        timed = make_plan(
            device=device_type,
            **plan_inputs(units, wire_dtype),
            fixed_bytes=buffer_bytes,
            # auto: the budget covers ramflow and the activations, the planner splits it
            gpu_memory_bytes=gpu_memory_bytes if auto else ramflow_budget,
            timing=timing,
        )
    except ValueError:
        timed = None
    return {
        "prediction": prediction,
        "timed_plan": timed,
        "timing_rates": rates,
        "matmul_flops_per_s": matmul_flops_per_s,
    }


def default_gpu_budget(device: torch.device) -> int | None:
    """The device budget when the user gives none: 90% of the free memory of a CUDA
    device (the rest for the CUDA context and allocator slack), no cap on the CPU."""
    if device.type != "cuda":
        return None
    with contextlib.suppress(RuntimeError):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return None


__all__ = [
    "CHECKPOINTING_MODES",
    "RUNTIME_OVERHEAD_BYTES",
    "ActivationProfile",
    "MemoryEstimate",
    "default_gpu_budget",
    "estimate_memory",
    "size_string",
    "measure_activations",
]
