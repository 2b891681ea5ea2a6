"""What ``ramflow plan`` prints, verdict first, and the lines ``ramflow train`` starts with.

[Note: a plan read in five seconds]
A reader asks, in this order: does the run fit, under what budget, with what plan. So the
first line is the verdict and its reason (what does not fit, with both figures, or what it
takes of what there is); the next the one budget, the device memory the user gave (or the
default); then the plan ramflow will use; and only then the details: the memory table, the
activations, RAM and disk, the predicted step time and the fastest plan for the same budget.
ramflow's own share of the budget (what the activations leave, the ``gpu_memory`` that
``ramflow.offload`` gets) is a detail named as such, never a second "budget". ``train``
prints the same first lines before it starts (a run that does not fit is refused before).
"""

from __future__ import annotations

from typing import Protocol

from ..memory.estimate import MemoryEstimate, runtime_overhead_bytes, size_string
from ..planner.plan import OffloadPlan, join_names
from ..sizes import format_bytes


def _device(est: MemoryEstimate) -> str:
    return "GPU" if est.device_type == "cuda" else "CPU"


class HostRanks(Protocol):
    """Several ranks on this host (``ramflow plan --nproc-per-node N``): their RAM, which
    replaces one rank's in the verdict, and their lines for the details."""

    num_ranks: int
    ram_available_bytes: int

    @property
    def ram_needed_bytes(self) -> int: ...

    @property
    def fits_ram(self) -> bool: ...

    def describe(self) -> str: ...


def fits(est: MemoryEstimate, ranks: HostRanks | None = None) -> bool:
    """Whether this machine's RAM (for ``ranks`` ranks, when given) and disk hold the run
    (the device budget was checked when the estimate was made: a budget too small raises
    there)."""
    return (est.fits_ram if ranks is None else ranks.fits_ram) and est.fits_disk


def disk_shortfall(est: MemoryEstimate) -> str | None:
    """What the disk cannot hold, or None where it holds the run's checkpoints
    (``est.disk_checkpoints`` at once). ``plan``'s verdict and ``train``'s refusal say it
    in these words, from the same count (``ramflow.train.setup.disk_checkpoints``)."""
    if est.fits_disk:
        return None
    free = format_bytes(est.disk_free_bytes or 0)
    one = format_bytes(est.checkpoint_bytes)
    if est.disk_checkpoints <= 1:
        return f"a checkpoint takes {one} and {free} is free where the run folder goes"
    return (
        f"a checkpoint takes {one} and this run needs room for {est.disk_checkpoints} at "
        f"once while saving, {format_bytes(est.disk_needed_bytes)} (the new one is written "
        "beside the kept ones, --keep-checkpoints, before the oldest is deleted), but "
        f"{free} is free where the run folder goes"
    )


def verdict(est: MemoryEstimate, ranks: HostRanks | None = None) -> str:
    """The first line: whether the run fits this machine, and why."""
    need = est.ram_needed_bytes if ranks is None else ranks.ram_needed_bytes
    avail = est.ram_available_bytes if ranks is None else ranks.ram_available_bytes
    fits_ram = est.fits_ram if ranks is None else ranks.fits_ram
    who = "" if ranks is None else f" ({ranks.num_ranks} ranks)"
    problems = []
    if not fits_ram:
        problems.append(
            f"it needs about {format_bytes(need)} of RAM{who} and {format_bytes(avail)} is "
            "available"
        )
    short = disk_shortfall(est)
    if short is not None:
        problems.append(short)
    if problems:
        # See [Note: a verdict names the change that fits] in ``setup.py``
        fix = "" if est.machine_fix is None else f"; it fits with {est.machine_fix}"
        return f"{est.model_name}: DOES NOT FIT this machine: " + "; ".join(problems) + fix
    per_gpu = "" if ranks is None else " per GPU"
    if est.device_budget_bytes is None:
        device = f"{_device(est)} {format_bytes(est.device_total_bytes)}{per_gpu}, no cap"
    else:
        device = (
            f"{_device(est)} {format_bytes(est.device_total_bytes)} of the "
            f"{format_bytes(est.device_budget_bytes)} budget{per_gpu}"
        )
    ram = f"RAM {format_bytes(need)}{who} of {format_bytes(avail)} available"
    return f"{est.model_name}: fits this machine: {device}; {ram}"


def budget_lines(est: MemoryEstimate) -> list[str]:
    """The one budget: the device memory the run may use, and which device was assumed
    when the user named none."""
    if est.device_budget_bytes is not None:
        line = f"budget: {format_bytes(est.device_budget_bytes)} of {_device(est)} memory"
    elif est.device_type == "cpu":
        line = "budget: no cap (a CPU run: the device side is RAM)"
    else:
        line = "budget: no cap (no --gpu-memory)"
    return [line] + ([f"  ({est.device_note})"] if est.device_note else [])


def plan_lines(est: MemoryEstimate, *, trained: str | None = None) -> list[str]:
    """The chosen plan: model, device and precision, micro-batch, what stays on the
    device, host formats. ``trained`` says what is trained where the estimate cannot know
    (a LoRA run's adapters); default: from the estimate."""
    plan = est.plan
    auto = f" (auto: {est.host_precision_reason})" if est.host_precision_reason else ""
    per_param = est.host_bytes_text()
    if trained is None and est.num_adapter_parameters:
        trained = (
            f"{est.num_adapter_parameters / 1e6:,.2f} M trained: LoRA adapters on the "
            "device, the base frozen"
        )
    elif trained is None:
        trained = (
            "all trained"
            if est.num_trainable == est.num_parameters
            else f"{est.num_trainable / 1e6:,.2f} M trained"
        )
    return [
        f"plan: {est.model_name}, {est.parameters_text()} ({trained}), "
        f"{len(est.activations.layer_bytes)} layers, on {est.device_type} in {est.precision} "
        f"(weights on the device in {est.wire_dtype})",
        f"  micro-batch {est.batch_size} x {est.seq_len} tokens, activation checkpointing "
        f"{est.checkpointing_mode}"
        + (f" (auto: {est.checkpointing_reason})" if est.checkpointing_reason else ""),
        f"  {_residency(plan, est.device_type)}",
        f"  host formats {est.host_precision.name}{per_param}{auto}",
    ]


def _residency(plan: OffloadPlan, device_type: str) -> str:
    """What stays on the device and what streams through it. On a CPU run there is no
    device memory: the "device" copies are working slots in RAM, filled by synchronous
    copies from the host store (``transfer.streams``), so the line says that instead."""
    n, k = len(plan.unit_names), len(plan.resident)
    per_forward = format_bytes(plan.streamed_bytes_per_pass)
    if device_type == "cpu":
        if k == n:
            return f"a CPU run: all {n} units keep a working copy in RAM, none is copied per step"
        copied = (
            f"each of the {n} units is"
            if k == 0
            else f"{k} of {n} units keep a working copy in RAM, the other {n - k} are"
        )
        return (
            f"a CPU run has no device memory: {copied} copied from the host store into a "
            f"working slot in RAM before use ({per_forward} per forward, synchronous copies)"
        )
    if k == n:
        return f"all {n} units stay on the device"
    return (
        f"{k} of {n} units stay on the device, the rest stream through it "
        f"({per_forward} per forward, prefetch depth {plan.prefetch_depth})"
    )


def _share_line(est: MemoryEstimate) -> str:
    plan = est.plan
    parts = (
        f"window {format_bytes(plan.window_bytes)} + gradients {format_bytes(plan.grad_bytes)} "
        f"+ fixed {format_bytes(plan.fixed_bytes)} + resident {format_bytes(plan.resident_bytes)}"
    )
    if plan.device_stepped:
        parts += f" + optimizer on the device {format_bytes(plan.device_step_bytes)}"
    share = est.gpu_memory_bytes
    of = (
        ""
        if share is None
        else f" of its {format_bytes(share)} share (the budget less the activations)"
    )
    return (
        f"ramflow on the device: {parts} = {format_bytes(plan.planned_bytes)}{of}; the "
        f"smallest that works, streaming every unit: {format_bytes(plan.min_gpu_memory_bytes)}"
    )


def _speed_lines(est: MemoryEstimate) -> list[str]:
    if est.prediction is None or est.timing_rates is None:
        return []
    lines = [
        "",
        f"step time (predicted): {est.prediction.describe()}",
        *est.rates_lines(),
    ]
    best = est.timed_plan
    if best is not None and best.prediction is not None:
        kwargs = best.offload_kwargs()
        ckpt_arg = kwargs["activation_checkpointing"]
        ckpt = ckpt_arg or []
        share = kwargs["gpu_memory"]
        lines += [
            f"fastest plan for the same budget: {best.prediction.step_s * 1e3:.0f} ms per step "
            f"(bound by {best.prediction.bound}): {_residency(best, est.device_type)}; "
            f"{len(ckpt)} of {len(best.unit_names)} units checkpointed"
            + (
                f", activations at their peak {format_bytes(best.activation_bytes)}"
                if best.activation_bytes is not None
                else ""
            ),
            f"  resident units: {join_names(best.resident)}; checkpointed units: {join_names(ckpt)}",
            "  in Python (gpu_memory is ramflow's share, the activations not included): "
            "ramflow.offload(model, gpu_memory="
            + ("None" if share is None else repr(size_string(share)))
            + f", prefetch_depth={kwargs['prefetch_depth']}, activation_checkpointing="
            + (
                "ramflow.memory.CheckpointOffload()"
                if est.activation_offload
                else repr(ckpt_arg)
                if len(ckpt) <= 4
                else f"[{len(ckpt)} unit names]"
            )
            + ")",
        ]
    return lines


def preamble_lines(
    est: MemoryEstimate, *, trained: str | None = None, ranks: HostRanks | None = None
) -> list[str]:
    """The lines ``ramflow train`` starts with: verdict, budget, plan (see ``plan_lines``
    for ``trained``). See [Note: a plan read in five seconds]."""
    return [verdict(est, ranks), *budget_lines(est), *plan_lines(est, trained=trained)]


def describe_plan(est: MemoryEstimate, ranks: HostRanks | None = None) -> str:
    """What ``ramflow plan`` prints (with ``ranks``: for several ranks on this host). See
    [Note: a plan read in five seconds]."""
    act = est.activations
    ckpt = {
        "checkpointing": est.checkpointing,
        "offload": est.activation_offload,
        "micro_batches": est.micro_batches,
    }
    saved = act.saved_bytes(**ckpt)
    working = act.peak_bytes(**ckpt) - saved
    lines = [*preamble_lines(est, ranks=ranks), "", "details:"]
    if not act.measured:
        lines.append("  activations from a formula: unknown model structure")
    lines += [
        est.table(),
        "",
        f"{_device(est)} memory: activations {format_bytes(est.device_activation_bytes)} "
        f"({format_bytes(saved)} saved for backward + {format_bytes(working)} backward working "
        "memory)",
        _share_line(est),
        f"RAM: about {format_bytes(est.ram_needed_bytes)} (including "
        f"{format_bytes(runtime_overhead_bytes(est.device_type))} for the runtime), "
        f"{format_bytes(est.ram_available_bytes)} available",
    ]
    if est.disk_free_bytes is not None:
        lines.append(
            f"disk: a checkpoint takes {format_bytes(est.checkpoint_bytes)}, "
            f"{est.disk_checkpoints} at a time while saving (--save-every, "
            f"--keep-checkpoints); {format_bytes(est.disk_free_bytes)} free"
        )
    lines += _speed_lines(est)
    if ranks is not None:
        lines += ["", ranks.describe()]
    return "\n".join(lines)


__all__ = [
    "HostRanks",
    "budget_lines",
    "describe_plan",
    "disk_shortfall",
    "fits",
    "plan_lines",
    "preamble_lines",
    "verdict",
]
