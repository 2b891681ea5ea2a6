"""The offload plan: which units stay resident on the GPU and how large the window is.
Byte counts are ``*_bytes`` throughout; they turn into GiB only for display.

Without timing inputs the plan only fits the budget (what the engine does: residents from
the last unit backwards). With them (``PlanTiming``) the planner searches the resident units,
the prefetch depth and the per-unit activation checkpointing for the least predicted step
time (``ramflow.planner.predict``); see [Note: the timed planner].
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..formats.host import (  # noqa: F401 (the device step's sizes, used here and by tests)
    DEVICE_STEP_BYTES_PER_PARAM,
    DEVICE_STEP_PIECE,
    DEVICE_STEP_SCRATCH_BYTES,
    LEAN_DEVICE_STEP_PIECE,
    LEAN_DEVICE_STEP_SCRATCH_BYTES,
    HostPrecision,
)
from ..sizes import format_bytes
from .predict import Rates, StepPrediction, UnitCost, predict_step

OFFLOAD_BOUNDARIES_ON_DEVICE = 2  # offloaded inputs on the device: recomputing + prefetched


@dataclass(frozen=True)
class OffloadPlan:
    """What ramflow keeps on the GPU for one offloaded model.

    Attributes:
        device: the compute device, e.g. ``"cuda:0"`` or ``"cpu"``.
        wire_dtype: dtype of the copies that cross PCIe and of the weights on the device.
        unit_names: every unit, in module order.
        unit_bytes: wire bytes of each unit's parameters, same order.
        resident: names of the units that stay on the device and are never streamed.
        prefetch_depth: how many units ahead the schedule loads (>= 2).
        window_bytes: device bytes reserved for streamed units (current, prefetched, one
            spare for tied parameters): ``(prefetch_depth + 2) * largest streamed unit``.
        grad_bytes: device bytes reserved for gradient buffers (two units' worth).
        fixed_bytes: device bytes that are always there (buffers, the rest unit).
        gpu_memory_bytes: the budget the user gave, or None for no cap.
        min_gpu_memory_bytes: the smallest budget that works with nothing resident.
        checkpointed: units whose activations are recomputed in backward (timed plans:
            the planner's choice; ``ramflow.offload(activation_checkpointing=...)``).
        activation_bytes: activations at their peak under that policy (timed plans with
            activation sizes; None otherwise).
        prediction: the predicted step (timed plans only).
        offload_budget_bytes: the ``gpu_memory`` that makes ``ramflow.offload`` keep exactly
            these units (timed plans with a budget; at least ``planned_bytes``).
        device_stepped: resident units whose fp32 master weights and optimizer states live
            on the device and are stepped there (``ramflow.offload(device_optimizer=True)``;
            see ``with_device_optimizer``).
        device_step_bytes: device bytes of their masters and states plus the step's scratch.
        device_optimizer_reason: why these units (or none) are stepped on the device: the
            choice of ``device_optimizer=None`` (the planner's, see ``auto_device_optimizer``)
            or the option given; None for plans made without the engine.
        host_precision: the host formats (``ramflow.HostPrecision``; ``.name`` for display).
        host_bytes_per_parameter: host bytes per trained parameter under them, AdamW's
            states included (the gradient ring's fixed buffers not).
        host_bytes: host bytes of the store (masters, wire copies, gradients) plus AdamW's
            states plus ``host_deferred_bytes``, for the whole model: the host peak of a
            step (engine plans only; None for ``ramflow plan``'s timed plans, which give
            their own host estimate). The runtime (PyTorch, the loop's data) is not in it.
        host_deferred_bytes: ``HostBytes.deferred_gradients`` (what a step not applied
            during backward holds under the gradient ring: 8-bit codes in the lean formats
            where the optimizer keeps no ``p.grad``, else the master's dtype; see
            ``planner.unit_plan.with_deferred_gradients``); 0 without the ring, None as
            ``host_bytes``.
        host_precision_reason: why ``host_precision="auto"`` chose it (None otherwise).
        frozen_format: how frozen matrices are kept (``"int8"``, ``"nf4"``; None: in the
            wire dtype).
        unit_h2d_bytes: bytes one load of each unit moves over PCIe, where it differs from
            ``unit_bytes`` (compressed frozen weights, dequantized on the device); None:
            ``unit_bytes``.
    """

    device: str
    wire_dtype: str
    unit_names: tuple[str, ...]
    unit_bytes: tuple[int, ...]
    resident: tuple[str, ...]
    prefetch_depth: int
    window_bytes: int
    grad_bytes: int
    fixed_bytes: int
    gpu_memory_bytes: int | None
    min_gpu_memory_bytes: int
    checkpointed: tuple[str, ...] = ()
    activation_bytes: int | None = None
    prediction: StepPrediction | None = field(default=None, compare=False)
    offload_budget_bytes: int | None = None
    device_stepped: tuple[str, ...] = ()
    device_step_bytes: int = 0
    # the host side: not compared (an engine's plan and ``ramflow plan``'s agree on the
    # device and differ in what they know of the host)
    device_optimizer_reason: str | None = field(default=None, compare=False)
    host_precision: HostPrecision = field(default=HostPrecision.fp32(), compare=False)
    host_bytes_per_parameter: float | None = field(default=None, compare=False)
    host_bytes: int | None = field(default=None, compare=False)
    host_deferred_bytes: int | None = field(default=None, compare=False)
    host_precision_reason: str | None = field(default=None, compare=False)
    frozen_format: str | None = field(default=None, compare=False)
    unit_h2d_bytes: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the resident units."""
        res = set(self.resident)
        return sum(b for n, b in zip(self.unit_names, self.unit_bytes) if n in res)

    @property
    def planned_bytes(self) -> int:
        """Everything ramflow itself may allocate on the device (activations excluded)."""
        return (
            self.window_bytes
            + self.grad_bytes
            + self.fixed_bytes
            + self.resident_bytes
            + self.device_step_bytes
        )

    @property
    def streamed_bytes_per_pass(self) -> int:
        """H2D bytes of one forward pass (a training step moves about twice this)."""
        res = set(self.resident)
        sizes = self.unit_bytes if self.unit_h2d_bytes is None else self.unit_h2d_bytes
        return sum(b for n, b in zip(self.unit_names, sizes) if n not in res)

    def offload_kwargs(self) -> dict:
        """The ``ramflow.offload`` arguments that give this plan: ``gpu_memory`` (ramflow's
        own share, which makes the engine keep exactly these units), ``prefetch_depth`` and
        ``activation_checkpointing`` (the unit names)."""
        budget = self.offload_budget_bytes or self.planned_bytes
        return {
            "gpu_memory": None if self.gpu_memory_bytes is None else budget,
            "prefetch_depth": self.prefetch_depth,
            "activation_checkpointing": list(self.checkpointed) if self.checkpointed else False,
        }

    def describe(self) -> str:
        """A few lines for people: budget, window, resident units (and with timing inputs
        the checkpointed units and the predicted step)."""
        budget = "no cap" if self.gpu_memory_bytes is None else format_bytes(self.gpu_memory_bytes)
        lines = [
            f"device {self.device}, wire dtype {self.wire_dtype}, budget {budget}",
            f"units: {len(self.unit_names)}, resident: {len(self.resident)}, "
            f"prefetch depth: {self.prefetch_depth}",
            f"window {format_bytes(self.window_bytes)} + gradients "
            f"{format_bytes(self.grad_bytes)} + fixed {format_bytes(self.fixed_bytes)} + "
            f"resident {format_bytes(self.resident_bytes)} = {format_bytes(self.planned_bytes)}",
            f"streamed per forward: {format_bytes(self.streamed_bytes_per_pass)} "
            f"(smallest budget that works: {format_bytes(self.min_gpu_memory_bytes)})",
        ]
        if self.host_bytes_per_parameter is not None:
            host = (
                f"host formats: {self.host_precision.name}, "
                f"{self.host_bytes_per_parameter:.2f} bytes per trained parameter"
            )
            if self.host_bytes is not None:
                host += f", {format_bytes(self.host_bytes)} with AdamW's states"
            if self.host_deferred_bytes:  # the first step while p.grad is kept, clipping...
                host += (
                    f" and the {format_bytes(self.host_deferred_bytes)} of host gradients "
                    "that a step not applied during backward holds (clipping, accumulation)"
                )
            if self.host_precision_reason:
                host += f" (auto: {self.host_precision_reason})"
            if self.frozen_format is not None:
                host += f"; frozen matrices {self.frozen_format}, dequantized on the device"
            lines.append(host)
        if self.device_stepped:
            lines[2] = lines[2].replace(
                " = ", f" + optimizer on the device {format_bytes(self.device_step_bytes)} = "
            )
            lines.append(f"stepped on the device: {join_names(self.device_stepped)}")
        if self.device_optimizer_reason:
            lines.append(f"optimizer on the device: {self.device_optimizer_reason}")
        if self.prediction is not None:
            lines.append(f"resident units: {join_names(self.resident)}")
            lines.append(f"checkpointed units: {join_names(self.checkpointed)}")
            if self.activation_bytes is not None:
                lines.append(f"activations at their peak: {format_bytes(self.activation_bytes)}")
            lines.append(f"predicted step: {self.prediction.describe()}")
        return "\n".join(lines)


def with_device_optimizer(
    plan: OffloadPlan,
    trainable_numel: Sequence[int],
    *,
    bytes_per_param: float = DEVICE_STEP_BYTES_PER_PARAM,
    scratch_bytes: int = DEVICE_STEP_SCRATCH_BYTES,
) -> OffloadPlan:
    """``plan`` with the resident units, in forward order, whose master weights and AdamW
    states (``bytes_per_param`` per trainable parameter: ``DEVICE_STEP_BYTES_PER_PARAM``
    for fp32 ones; a lean host format's states only, ``HostPrecision.
    device_step_bytes_per_parameter``) fit in what the budget leaves after the plan, plus
    ``scratch_bytes`` for one piece of the step. Those units are stepped on the device: no
    gradient D2H, no CPU step, no refresh H2D (partial offload of the optimizer, as
    DeepSpeed's ZeRO-Offload++ "twin-flow"). Forward order first: the last units to
    receive gradients are the first the next forward needs, so stepping them on the device
    takes the most off the CPU's critical path. No budget: the plan unchanged.

    Args:
        plan: the engine's plan, without device steps.
        trainable_numel: per unit (the plan's order), the elements of its trainable flat
            buffer (alignment padding included).
        bytes_per_param: device bytes per trainable parameter of a device step.
        scratch_bytes: device bytes of one piece of the step's scratch.

    Returns:
        The ``OffloadPlan`` with ``device_stepped`` and ``device_step_bytes`` set.
    """
    if plan.gpu_memory_bytes is None:
        return plan
    left = plan.gpu_memory_bytes - plan.planned_bytes - scratch_bytes
    resident = set(plan.resident)
    chosen: list[str] = []
    used = 0
    for name, numel in zip(plan.unit_names, trainable_numel):
        need = int(numel * bytes_per_param)
        if name in resident and numel > 0 and used + need <= left:
            chosen.append(name)
            used += need
    if not chosen:
        return plan
    return replace(
        plan,
        device_stepped=tuple(chosen),
        device_step_bytes=used + scratch_bytes,
    )


# [Note: the device optimizer's default]
# ``ramflow.offload(device_optimizer=None)`` (the default) lets the planner choose the units
# stepped on the device (under ZeRO each rank among the units it owns, on its share of the
# host's cores: ``ramflow.planner.unit_plan.complete_plan``). It refuses where a device step cannot
# apply or would change the run (a reason in the plan): no budget, the CPU as the device,
# trainable parameters on the device (LoRA), fp32 masters (their device step is fused CUDA
# AdamW, not the CPU kernel's bits: a run would depend on which units fit; ``True`` forces it).
# For the lean formats the device step gives the host step's bits, so it changes the speed
# only. Then the candidates are ``with_device_optimizer``'s units (those whose states fit in
# what the budget leaves after the plan, first units first), and the planner keeps the
# number of them (a prefix, in forward order) with the least predicted step
# (``planner.predict.predict_step``, device steps as GPU tasks at a floor rate; ties: fewer; 16
# counts first, then every count between the best one's neighbours). At
# ``offload`` the forward's GPU time is not known (the micro-batch is not), so the prediction
# leaves compute out: the step as bound by the copies and the CPU optimizer, which is where an
# offloaded training step is. A step bound by the GPU loses at most the device steps' own
# time, ``device_optimizer_params_per_s`` (50 G parameters/s) of parameters stepped there.


def auto_device_optimizer(
    plan: OffloadPlan,
    trainable_numel: Sequence[int],
    *,
    bytes_per_param: float,
    scratch_bytes: int,
    rates: Rates,
    forward_s: Sequence[float] | None = None,
    grad_bytes_per_param: int = 2,
) -> OffloadPlan:
    """``plan`` with the units whose device step pays: see [Note: the device optimizer's
    default]. ``plan.device_optimizer_reason`` says which and why.

    Args:
        plan: the engine's plan, without device steps.
        trainable_numel: per unit (the plan's order), its trainable elements.
        bytes_per_param, scratch_bytes: as ``with_device_optimizer``.
        rates: the machine's rates (``planner.cpu_rates.rates_for`` of the host formats).
        forward_s: per unit, its forward's GPU time in seconds; None: not known (left out).
        grad_bytes_per_param: gradient bytes per parameter on the wire.

    Returns:
        The ``OffloadPlan`` with the chosen ``device_stepped`` units and the reason.
    """
    if plan.gpu_memory_bytes is None:
        return replace(plan, device_optimizer_reason="none: no gpu_memory budget")
    fitting = with_device_optimizer(
        plan, trainable_numel, bytes_per_param=bytes_per_param, scratch_bytes=scratch_bytes
    ).device_stepped
    if not fitting:
        left = plan.gpu_memory_bytes - plan.planned_bytes - scratch_bytes
        trained = [
            int(numel * bytes_per_param)
            for name, numel in zip(plan.unit_names, trainable_numel)
            if name in set(plan.resident) and numel > 0
        ]
        why = (
            "no resident unit has trainable parameters"
            if not trained
            else f"the budget leaves {format_bytes(max(left, 0))} after the plan, less than "
            f"the smallest resident unit's states on the device ({format_bytes(min(trained))})"
        )
        return replace(plan, device_optimizer_reason=f"none: {why}")
    times = list(forward_s) if forward_s is not None else [0.0] * len(plan.unit_names)
    unit_h2d = plan.unit_h2d_bytes or plan.unit_bytes
    resident, ckpt = set(plan.resident), set(plan.checkpointed)

    def predicted(on_device: set[str]) -> float:
        costs = [
            UnitCost(
                name=name,
                wire_bytes=unit_h2d[i],
                trainable_params=trainable_numel[i],
                forward_s=times[i],
                resident=name in resident,
                checkpointed=name in ckpt,
                device_stepped=name in on_device,
            )
            for i, name in enumerate(plan.unit_names)
        ]
        return predict_step(
            costs,
            rates=rates,
            prefetch_depth=plan.prefetch_depth,
            grad_bytes_per_param=grad_bytes_per_param,
        ).step_s

    numel = dict(zip(plan.unit_names, trainable_numel))
    steps: dict[int, float] = {}

    def best(counts: Sequence[int]) -> int:
        """The count with the least predicted step; fewer unless faster by over 0.5 %."""
        chosen = 0
        for k in sorted(set(counts)):
            if k not in steps:
                steps[k] = predicted(set(fitting[:k]))
            if steps[k] < steps[chosen] * 0.995:
                chosen = k
        return chosen

    # at most 16 counts, then every count between the best one's neighbours (a 70B model's
    # 80 units: about 26 predictions instead of 81)
    grid = sorted({0, *(round(len(fitting) * i / 16) for i in range(1, 17))})
    k = best(grid)
    at = grid.index(k)
    lo, hi = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
    best_k = best([*grid[: at + 1], *range(lo, hi + 1)])
    best_s, host_s = steps[best_k], steps[0]
    compute = "" if forward_s is not None else " (GPU compute not known at offload: left out)"
    if best_k == 0:
        return replace(
            plan,
            device_optimizer_reason=f"none: stepping any of the {len(fitting)} units whose "
            f"states fit on the device does not shorten the predicted step{compute}",
        )
    chosen = fitting[:best_k]
    params = sum(numel[n] for n in chosen)
    return replace(
        plan,
        device_stepped=tuple(chosen),
        device_step_bytes=sum(int(numel[n] * bytes_per_param) for n in chosen) + scratch_bytes,
        device_optimizer_reason=f"{best_k} of {len(plan.resident)} resident units "
        f"({params / 1e9:.2f} G parameters) step on the device: predicted "
        f"{best_s * 1e3:.0f} ms per step instead of {host_s * 1e3:.0f} ms{compute}",
    )


def join_names(names: Sequence[str]) -> str:
    """Unit names for a report, runs of numbered blocks folded (``layers.0-11``).

    Args:
        names: unit names, in order.

    Returns:
        One comma-separated string; ``"none"`` for no names.
    """
    if not names:
        return "none"
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if not run:
            return
        prefix, first, last = run[0][0], run[0][1], run[-1][1]
        out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")
        run.clear()

    for name in names:
        m = re.fullmatch(r"(.*\.)(\d+)", name)
        if m and run and run[-1][0] == m.group(1) and run[-1][1] + 1 == int(m.group(2)):
            run.append((m.group(1), int(m.group(2))))
            continue
        flush()
        if m:
            run.append((m.group(1), int(m.group(2))))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


@dataclass(frozen=True)
class PlanTiming:
    """Timing inputs of the planner: with them it minimises the predicted step time.

    Per-unit sequences are in the plan's unit order.

    Attributes:
        forward_s, attention_s: GPU time of each unit's forward and attention's part of it
            (``UnitCost.attention_s``; None: 0), seconds (measured, or ``forward_seconds``).
        trainable_params: parameters of each unit that the CPU optimizer steps.
        rates: the machine's copy rates and CPU optimizer rate.
        mode: ``"train"`` or ``"infer"`` (forward only: no checkpointing, no optimizer).
        deps: per unit, indices of other units its forward reads (tied parameters).
        activation_bytes: per unit, bytes its forward saves for backward when it is not
            checkpointed. Given, the budget covers activations too (see the Note).
        checkpoint_bytes: per unit, bytes it keeps when checkpointed (its input).
        checkpointable: per unit, whether it may be checkpointed (blocks; default: those
            with ``activation_bytes > checkpoint_bytes``).
        other_activation_bytes: activations that no policy changes (outside the units,
            backward workspace of the loss), bytes.
        checkpointed: a fixed policy (unit names) instead of the planner's choice.
        prefetch_depths: the depths to try.
        grad_bytes_per_param: gradient bytes per parameter on the wire (2: bf16).
        offload: the checkpointed units' inputs go to pinned host memory
            (``ramflow.memory.CheckpointOffload``): at most ``OFFLOAD_BOUNDARIES_ON_DEVICE``
            of them are on the device at once, and each (``checkpoint_bytes``) crosses PCIe
            once each way per step (``UnitCost.offload_bytes``). Default False.
        deferred_steps: host steps wait for the end of backward (see ``predict_step``).
        h2d_bytes: per unit, bytes one load moves over PCIe where they differ from its
            device bytes (compressed frozen weights, ``Unit.h2d_bytes``); None: the same.
    """

    forward_s: Sequence[float]
    trainable_params: Sequence[int]
    rates: Rates = field(default_factory=Rates)
    attention_s: Sequence[float] | None = None
    mode: str = "train"
    deps: Sequence[tuple[int, ...]] | None = None
    activation_bytes: Sequence[int] | None = None
    checkpoint_bytes: Sequence[int] | None = None
    checkpointable: Sequence[bool] | None = None
    other_activation_bytes: int = 0
    checkpointed: Sequence[str] | None = None
    prefetch_depths: Sequence[int] = (1, 2, 3, 4)
    grad_bytes_per_param: int = 2
    offload: bool = False
    deferred_steps: bool = False
    h2d_bytes: Sequence[int] | None = None

    def activation_peak_bytes(self, checkpointed: set[int]) -> int:
        """Activations at their peak when the units ``checkpointed`` (indices) recompute:
        what the others save, the inputs the checkpointed ones keep (with ``offload``: the
        largest ``OFFLOAD_BOUNDARIES_ON_DEVICE`` of them), the largest unit's activations
        once more (rebuilt or being differentiated in backward), and the rest."""
        act = self.activation_bytes or []
        kept = self.checkpoint_bytes or [0] * len(act)
        saved = sum(a for i, a in enumerate(act) if i not in checkpointed)
        inputs = sorted((kept[i] for i in checkpointed if i < len(act)), reverse=True)
        if self.offload:
            inputs = inputs[:OFFLOAD_BOUNDARIES_ON_DEVICE]
        return self.other_activation_bytes + saved + sum(inputs) + max(act, default=0)

    def offload_bytes(self, i: int, checkpointed: set[int]) -> int:
        """Bytes unit ``i`` offloads per step each way (0 unless ``offload`` and it is
        checkpointed)."""
        if not self.offload or i not in checkpointed or self.checkpoint_bytes is None:
            return 0
        return self.checkpoint_bytes[i]


def _greedy_resident(
    unit_names: Sequence[str],
    unit_bytes: Sequence[int],
    forced: set[str],
    budget: int,
    overhead: int,
    slots: int,
) -> set[str]:
    """The engine's rule: from the last unit backwards, keep each unit that still fits."""

    def window(resident: set[str]) -> int:
        streamed = [b for n, b in zip(unit_names, unit_bytes) if n not in resident]
        return slots * max(streamed, default=0)

    resident = set(forced)
    used = sum(b for n, b in zip(unit_names, unit_bytes) if n in forced)
    for name, nbytes in reversed(list(zip(unit_names, unit_bytes))):
        if name in resident:
            continue
        trial = resident | {name}
        if window(trial) + overhead + used + nbytes <= budget:
            resident, used = trial, used + nbytes
    return resident


def make_plan(
    *,
    device: str,
    wire_dtype: str,
    unit_names: Sequence[str],
    unit_bytes: Sequence[int],
    unit_grad_bytes: Sequence[int],
    always_resident: Sequence[bool],
    fixed_bytes: int,
    gpu_memory_bytes: int | None,
    prefetch_depth: int = 2,
    timing: PlanTiming | None = None,
) -> OffloadPlan:
    """Choose resident units greedily within the budget; stream the rest.

    Units that must stay resident (``always_resident``) are always kept. With a budget,
    the remaining units are made resident from the last one backwards (the last units of
    forward are the first of backward, so keeping them saves the turn-around) while the
    window, gradient buffers and residents still fit.

    With ``timing`` the planner instead searches for the least predicted step time; see
    [Note: the timed planner]; the smallest plan is then the one of the least depth tried.

    Args:
        device: the device type the plan is for (``"cuda"`` or ``"cpu"``), for the report.
        wire_dtype: the name of the device copies' dtype (``"bfloat16"``), for the report.
        unit_names: the units, in forward order.
        unit_bytes: each unit's device bytes of parameters in the wire dtype (padded as the
            host store lays them out), same order.
        unit_grad_bytes: each unit's device gradient buffer, bytes, same order.
        always_resident: per unit, True where it must stay on the device (tied or
            user-pinned parameters).
        fixed_bytes: device bytes the plan holds whatever it chooses (the model's buffers).
        gpu_memory_bytes: ramflow's share of the device, bytes (the budget less activations);
            None: no cap, every unit streams but the forced ones.
        prefetch_depth: units loaded ahead of the running one (>= 1); the window holds
            ``prefetch_depth + 2`` slots. With ``timing``, its ``prefetch_depths`` replace it.
        timing: per-unit costs and rates for the timed planner; None: the greedy rule above.

    Returns:
        The ``OffloadPlan``: residents, window depth, checkpointed units and the predicted
        bytes (``planned_bytes``, ``min_gpu_memory_bytes``).

    Raises:
        ValueError: ``prefetch_depth`` < 1; the budget is smaller than the smallest plan (largest unit times the
            window, gradient buffers and fixed bytes); the message gives that figure. With
            activation sizes in ``timing``: no depth and checkpointing policy fits.
    """
    if prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
    if timing is not None and timing.prefetch_depths:
        prefetch_depth = min(timing.prefetch_depths)
    slots = prefetch_depth + 2
    grad_bytes = 2 * max(unit_grad_bytes, default=0)
    forced = [n for n, keep in zip(unit_names, always_resident) if keep]
    forced_bytes = sum(b for b, keep in zip(unit_bytes, always_resident) if keep)

    def window(resident: set[str]) -> int:
        streamed = [b for n, b in zip(unit_names, unit_bytes) if n not in resident]
        return slots * max(streamed, default=0)

    min_bytes = window(set(forced)) + grad_bytes + fixed_bytes + forced_bytes
    resident = set(forced)
    if gpu_memory_bytes is not None:
        if gpu_memory_bytes < min_bytes:
            raise ValueError(
                f"gpu_memory={format_bytes(gpu_memory_bytes)} is too small: the largest unit "
                f"({format_bytes(max(unit_bytes))} in the wire dtype) times {slots} window slots, "
                f"gradient buffers and fixed buffers need at least {format_bytes(min_bytes)} "
                f"({min_bytes} bytes). Give gpu_memory >= {min_bytes}, or split the model into "
                "smaller units with units=[...]."
            )
    if timing is not None:
        return _timed_plan(
            device=device,
            wire_dtype=wire_dtype,
            unit_names=list(unit_names),
            unit_bytes=list(unit_bytes),
            forced=set(forced),
            grad_bytes=grad_bytes,
            fixed_bytes=fixed_bytes,
            gpu_memory_bytes=gpu_memory_bytes,
            min_bytes=min_bytes,
            timing=timing,
        )
    if gpu_memory_bytes is not None:
        resident = _greedy_resident(
            unit_names, unit_bytes, set(forced), gpu_memory_bytes, grad_bytes + fixed_bytes, slots
        )
    return OffloadPlan(
        device=device,
        wire_dtype=wire_dtype,
        unit_names=tuple(unit_names),
        unit_bytes=tuple(unit_bytes),
        resident=tuple(n for n in unit_names if n in resident),
        prefetch_depth=prefetch_depth,
        window_bytes=window(resident),
        grad_bytes=grad_bytes,
        fixed_bytes=fixed_bytes,
        gpu_memory_bytes=gpu_memory_bytes,
        min_gpu_memory_bytes=min_bytes,
    )


# [Note: the timed planner]
# Given timing inputs, ``make_plan`` tries every prefetch depth of ``timing.prefetch_depths``
# and, for each, every resident set that the engine's own rule (from the last unit backwards)
# gives for some budget: the last m units for m = 0, 1, ... while they fit. For each it picks
# the per-unit activation checkpointing: with activation sizes, the fewest checkpointed units
# (those that free the most bytes per second of recomputation first) that bring ramflow's
# bytes plus the activations within the budget, which then covers both; without them, the
# fixed policy given (none by default). It predicts each candidate's step
# (``planner.predict.predict_step``) and keeps the fastest (ties: fewer device bytes). Only resident
# sets the engine's rule can produce are tried, so ``OffloadPlan.offload_kwargs()`` (ramflow's
# share as ``gpu_memory``) gives exactly the plan that was predicted. Without a budget nothing
# is resident beyond the window, as in ``ramflow.offload(gpu_memory=None)``.


def _ramflow_bytes(
    unit_names: Sequence[str],
    unit_bytes: Sequence[int],
    resident: set[str],
    slots: int,
    overhead: int,
) -> int:
    """What ramflow allocates with these residents: window, residents and ``overhead``."""
    streamed = [b for n, b in zip(unit_names, unit_bytes) if n not in resident]
    kept = sum(b for n, b in zip(unit_names, unit_bytes) if n in resident)
    return slots * max(streamed, default=0) + overhead + kept


def _checkpoint_choice(
    timing: PlanTiming, room: int | None, n: int
) -> tuple[set[int], int | None] | None:
    """The fewest checkpointed units (indices) whose activations fit ``room`` bytes (None:
    no cap); returns them and the activations' peak, or None when nothing fits."""
    if timing.mode != "train":
        return set(), None
    if timing.activation_bytes is None:
        return set(), None
    peak = timing.activation_peak_bytes
    if room is None:
        return set(), peak(set())
    act = list(timing.activation_bytes)
    kept = list(timing.checkpoint_bytes or [0] * n)
    able = (
        list(timing.checkpointable)
        if timing.checkpointable is not None
        else [a > k for a, k in zip(act, kept)]
    )
    # most bytes freed per second of recomputation first; module order breaks ties
    order = sorted(
        (i for i in range(n) if able[i]),
        key=lambda i: (-(act[i] - kept[i]) / max(timing.forward_s[i], 1e-12), i),
    )
    chosen: set[int] = set()
    if peak(chosen) <= room:
        return chosen, peak(chosen)
    for i in order:
        chosen.add(i)
        if peak(chosen) <= room:
            return chosen, peak(chosen)
    return None


def _timed_plan(
    *,
    device: str,
    wire_dtype: str,
    unit_names: list[str],
    unit_bytes: list[int],
    forced: set[str],
    grad_bytes: int,
    fixed_bytes: int,
    gpu_memory_bytes: int | None,
    min_bytes: int,
    timing: PlanTiming,
) -> OffloadPlan:
    """See [Note: the timed planner]."""
    n = len(unit_names)
    for what in ("forward_s", "attention_s", "trainable_params"):
        seq = getattr(timing, what)
        if seq is not None and len(seq) != n:
            raise ValueError(f"timing.{what} has {len(seq)} entries for {n} units")
    index = {name: i for i, name in enumerate(unit_names)}
    fixed_ckpt = None
    if timing.checkpointed is not None:
        unknown = [c for c in timing.checkpointed if c not in index]
        if unknown:
            raise ValueError(f"timing.checkpointed names units the model does not have: {unknown}")
        fixed_ckpt = {index[c] for c in timing.checkpointed}
    deps = list(timing.deps) if timing.deps is not None else [()] * n
    with_acts = timing.activation_bytes is not None and fixed_ckpt is None
    overhead = grad_bytes + fixed_bytes
    best: tuple[tuple, OffloadPlan] | None = None
    for depth in sorted(set(timing.prefetch_depths)):
        if depth < 1:
            raise ValueError(f"prefetch depths must be >= 1, got {depth}")
        slots = depth + 2
        # (resident set, the least ramflow budget that makes the engine keep exactly it)
        candidates: list[tuple[set[str], int]] = []
        suffix: set[str] = set(forced)
        need = _ramflow_bytes(unit_names, unit_bytes, suffix, slots, overhead)
        candidates.append((set(suffix), need))
        if gpu_memory_bytes is not None:
            for name in reversed(unit_names):
                if name in suffix:
                    continue
                suffix = suffix | {name}
                need = max(need, _ramflow_bytes(unit_names, unit_bytes, suffix, slots, overhead))
                candidates.append((set(suffix), need))
        for resident, need in candidates:
            planned = _ramflow_bytes(unit_names, unit_bytes, resident, slots, overhead)
            window = (
                planned
                - overhead
                - sum(b for nm, b in zip(unit_names, unit_bytes) if nm in resident)
            )
            if gpu_memory_bytes is not None:
                room = gpu_memory_bytes - planned
                if room < 0 or need > gpu_memory_bytes:
                    continue
                # the engine, given ``need`` as its budget, must keep exactly these units
                if (
                    _greedy_resident(unit_names, unit_bytes, forced, need, overhead, slots)
                    != resident
                ):
                    continue
            else:
                room = None
            if fixed_ckpt is not None:
                ckpt, act_peak = (
                    fixed_ckpt,
                    (
                        timing.activation_peak_bytes(fixed_ckpt)
                        if timing.activation_bytes is not None
                        else None
                    ),
                )
                if act_peak is not None and room is not None and act_peak > room:
                    continue
            elif with_acts:
                choice = _checkpoint_choice(timing, room, n)
                if choice is None:
                    continue
                ckpt, act_peak = choice
            else:
                ckpt, act_peak = set(), None
            costs = [
                UnitCost(
                    name=unit_names[i],
                    wire_bytes=unit_bytes[i] if timing.h2d_bytes is None else timing.h2d_bytes[i],
                    trainable_params=timing.trainable_params[i],
                    forward_s=timing.forward_s[i],
                    resident=unit_names[i] in resident,
                    checkpointed=i in ckpt,
                    deps=tuple(deps[i]),
                    offload_bytes=timing.offload_bytes(i, ckpt),
                    attention_s=timing.attention_s[i] if timing.attention_s else 0.0,
                )
                for i in range(n)
            ]
            pred = predict_step(
                costs,
                rates=timing.rates,
                prefetch_depth=depth,
                mode=timing.mode,
                grad_bytes_per_param=timing.grad_bytes_per_param,
                deferred_steps=timing.deferred_steps,
            )
            plan = OffloadPlan(
                device=device,
                wire_dtype=wire_dtype,
                unit_names=tuple(unit_names),
                unit_bytes=tuple(unit_bytes),
                resident=tuple(nm for nm in unit_names if nm in resident),
                prefetch_depth=depth,
                window_bytes=window,
                grad_bytes=grad_bytes,
                fixed_bytes=fixed_bytes,
                gpu_memory_bytes=gpu_memory_bytes,
                min_gpu_memory_bytes=min_bytes,
                checkpointed=tuple(unit_names[i] for i in sorted(ckpt)),
                activation_bytes=act_peak,
                prediction=pred,
                offload_budget_bytes=need if gpu_memory_bytes is not None else None,
            )
            # fastest first; within 0.5 % the plan that takes fewer device bytes
            key = (pred.step_s, planned + (act_peak or 0))
            if best is None or _better(key, best[0]):
                best = (key, plan)
    if best is None:
        raise ValueError(
            f"gpu_memory={format_bytes(gpu_memory_bytes or 0)} is too small for this run: "
            "ramflow's smallest plan and the activations do not fit together even with every "
            "unit checkpointed. Give a larger budget or a smaller micro-batch."
        )
    return best[1]


def _better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Is candidate ``a`` (step seconds, device bytes) better than ``b``? Faster by more
    than 0.5 %, or as fast and smaller."""
    if a[0] < b[0] * 0.995:
        return True
    if a[0] <= b[0] * 1.005:
        return a[1] < b[1] or (a[1] == b[1] and a[0] < b[0])
    return False
