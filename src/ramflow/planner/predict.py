"""The step-time model: how long one training (or inference) step of an offloaded model takes.

Pure functions of plain numbers, standard library only, so that the benchmark's report (which
never imports torch) can load this file and ``planner/task_graph.py`` (the list scheduler) by
path. Units: seconds (``*_s``), bytes
(``*_bytes``), bytes per second (``*_bytes_per_s``), parameters per second
(``*_params_per_s``), FLOPs and FLOP/s.

[Note: the step as a pipeline]
A step is four resources working on one dependency graph of per-unit tasks, in forward
order i = 0..n-1 and backward order n-1..0:

- H2D link: the forward load of each streamed unit (after the unit's optimizer step of the
  previous training step has rewritten its wire copy, and once the window has a slot: the
  unit ``prefetch_depth + 2`` places earlier has finished computing); the backward reload of
  the streamed units that are no longer in the window at the turn-around; after each CPU step
  of a resident unit, its refresh. Copies run in the order they become ready.
- GPU: forward of each unit in order (after its load), then backward in reverse order
  (``BACKWARD_PER_FORWARD`` x its forward time, attention's share at
  ``ATTENTION_BACKWARD_PER_FORWARD``, plus one more forward when the unit is
  activation-checkpointed: ``UnitCost.backward_s``). A unit's backward waits for the gradient copy of the unit two
  before it (ramflow keeps two gradient buffers in flight).
- D2H link: each trainable unit's gradients in the wire dtype, after its backward.
- Activation offload (``ramflow.memory.CheckpointOffload``): a checkpointed unit with
  ``offload_bytes`` sends its input to pinned host memory when its forward starts (a D2H
  after the previous unit's forward; the forward does not wait for it) and gets it back in
  backward (an H2D issued when the unit after it in forward starts its backward, one unit
  ahead as ``BoundaryOffloader``'s prefetch of 1; the last unit's own at its backward),
  which its backward waits for. They are tasks on the same links as the weights' loads and
  the gradients, so they share PCIe with the weight streaming (in order of readiness), at
  the both-ways rates where weights stream too; their bytes cost host DRAM time as every
  copy's do.
- CPU: the optimizer steps each unit as soon as its gradients have landed (eager steps, the
  steady state of ``ramflow.optim``), one unit at a time, the earliest unit in forward order
  first among those ready; the next forward of that unit waits for its step. A unit stepped
  on the device (resident) has no copy, CPU step or refresh: a GPU task after its backward. The step is
  bound by host memory bandwidth, which it shares with the PCIe copies: their DMA reads the
  wire copies from, and writes the gradients into, the same DRAM. Each step's copy bytes are
  charged to the optimizer at its own DRAM rate (``Rates.cpu_optimizer_dram_bytes_per_param``),
  spread over the units by their parameters.

While a backward pass runs both links are busy; each then gets half of the measured both-ways
rate when that is given. The graph is simulated for several consecutive steps (each step's
host loop ends when the gradients have landed, as the benchmark's loop does after
``torch.cuda.synchronize``), and the last step's length is the prediction: per-unit maxima
chain through the pipeline, so a slow optimizer shows up in the next forward and a slow link
in the compute it delays. The critical path through that last step says how much of the step
each resource accounts for; the resource with the largest share is the one that binds.

Inference is the forward alone. From one forward to the next the window keeps the last units
used, least recently used evicted first, and no step changes the weights, so a unit still in
the window when the next forward reaches it is not loaded again. ``_inference_loads`` replays
that window over two forwards (each unit with the tied units it reads): with the units visited
in the same order every time, nothing useful survives unless every streamed unit fits in the
window at once (then nothing is loaded at all), except a tied owner read at both ends of the
forward (an embedding whose weight the head reuses: loaded for the head, it is still there for
the next forward's first unit, so it crosses once per forward, not twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .task_graph import RESOURCES, Task, TaskGraph, critical_path  # noqa: F401 (RESOURCES: re-exported)

if TYPE_CHECKING:  # this file stays standard-library only when run
    from ..formats.host import HostPrecision

# ----------------------------------------------------------------------------- constants
# Calibrated against a measured run on the GPU box: docs/speed.md, "Step-time model
# constants", gives the figures; tests/test_predict.py reproduces those step times from their
# recorded inputs.

BACKWARD_PER_FORWARD = 2.0
"""GPU time of a unit's backward over its forward (2 FLOPs of backward per FLOP of forward)."""

RECOMPUTE_PER_FORWARD = 1.0
"""Extra GPU time of an activation-checkpointed unit's backward, in forwards (the recomputation)."""

ATTENTION_BACKWARD_PER_FORWARD = 2.5
"""GPU time of attention's backward over its forward (the score and value products of a flash
kernel, ``UnitCost.attention_s``): the backward recomputes the scores from the saved
log-sum-exp and runs five products against the forward's two (Dao, 2023, "FlashAttention-2",
section 4, counts the backward as 2.5 forwards). The matmuls' backward stays at
``BACKWARD_PER_FORWARD``."""

TRAIN_MATMUL_EFFICIENCY = 0.80
"""Share of the measured bf16 matmul rate that a training forward sustains (bf16 weights on
the device, autocast, norms and activations in between), from a trace of the reference
model's forward (docs/speed.md, "Step-time model constants")."""

INFER_MATMUL_EFFICIENCY = 0.75
"""The same for an inference forward (resident bf16 at 1x2048 and 8x2048).

Both are the reference model's (plain PyTorch, width 4096). A model whose forward spends more
of its time outside the matmuls (Hugging Face Llama 3.2 3B: unfused fp32 RMSNorm, rotary
embedding, SiLU and residual kernels over a narrower width, 28 layers) runs below them: give
``forward_seconds`` that model's own inference efficiency, measured on a resident inference
step (``measured_efficiency``); its training forward then runs at that times
``TRAIN_MATMUL_EFFICIENCY / INFER_MATMUL_EFFICIENCY``."""

RAMFLOW_ADAMW_PER_TORCH_FUSED = 0.855
"""ramflow's one-pass CPU AdamW rate over torch's fused CPU AdamW rate as the floors measure it
(one more output, the bf16 wire copy, and a whole model's states instead of a 268 M-parameter
slice)."""

RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM = 30.0
"""Host DRAM bytes per parameter of ramflow's one-pass AdamW step as its rate is measured (the
benchmark's CPU optimizer case): fp32 parameter, gradient and both states read, parameter and
states written, bf16 wire copy written. The optimizer's DRAM rate is its parameter rate times
this; PCIe copy bytes cost host DRAM time at that rate (CPU-bound steps grow with the bytes
streamed: docs/speed.md, "Step-time model constants")."""

HOST_SECONDS_PER_UNIT = 0.002
"""Host worker time per unit and step besides the optimizer's arithmetic: landing the unit's
gradients and the Python around its step (from a trace: docs/speed.md)."""

BOTH_WAYS_PER_ONE_WAY = 1.83
"""H2D and D2H at once, total, over one direction alone (the default rates' ratio):
what ``Rates.from_pcie`` assumes when only a one-way rate is known."""

DEFAULT_H2D_BYTES_PER_S = 55.3e9
DEFAULT_D2H_BYTES_PER_S = 55.3e9
DEFAULT_BOTH_BYTES_PER_S = 101.2e9
DEFAULT_MATMUL_FLOPS_PER_S = 790e12
DEFAULT_CPU_OPTIMIZER_PARAMS_PER_S = 3.72e9
DEFAULT_DEVICE_OPTIMIZER_PARAMS_PER_S = 50e9
"""The defaults of ``ramflow plan``: one H200 box's rates (PCIe 5.0 x16, 16 CPU threads;
docs/speed.md, "Step-time model constants"); give your machine's own
(``--pcie-gbps``, ``--gpu-tflops``, ``--cpu-adamw-gparams``). The device optimizer's rate is
a floor, not measured: 30 bytes per parameter (fp32; lean moves about 10) at 1.5 TB/s."""

STEPS_SIMULATED = 3
"""Training steps simulated before the last one is read (the first starts with every wire
copy ready; by the third the pipeline has settled)."""


# ----------------------------------------------------------------------------- FLOPs


def attention_flops(
    *, batch: int, seq: int, attention_layers: int, hidden: int, causal: bool = False
) -> float:
    """FLOPs of attention's score and value products (Q K^T and the weighted sum of V) in one
    forward over ``batch`` sequences of ``seq`` tokens: 4 x seq^2 x hidden per attention layer
    and sequence for the full square, half of it when ``causal`` (a causal flash kernel skips
    the blocks above the diagonal: FlashAttention-2, Dao 2023, counts causal FLOPs so).

    Args:
        batch: sequences (B).
        seq: tokens per sequence (T).
        attention_layers: attention layers in the unit.
        hidden: the width the products run over (``costs.attention_width``).
        causal: count half the square.

    Returns:
        FLOPs (a float).
    """
    square = 4.0 * attention_layers * batch * seq * seq * hidden
    return square / 2 if causal else square


def forward_flops(
    matmul_params: int,
    *,
    batch: int,
    seq: int,
    attention_layers: int = 0,
    hidden: int = 0,
    causal: bool = False,
) -> float:
    """FLOPs of one forward of a unit over ``batch`` x ``seq`` tokens.

    2 per multiply-add of every weight that multiplies activations (``matmul_params``; not an
    embedding table, which is a lookup), plus ``attention_flops`` for its attention layers
    (the full square, or half of it when ``causal``). The calibrated efficiencies were
    measured at 2048 tokens, where the full square's extra half is 4% of a width-4096 layer's
    forward; at 128k tokens it would be 80% of it, so causal models pass ``causal=True``.

    Args:
        matmul_params: the unit's weights that multiply activations.
        batch: sequences (B).
        seq: tokens per sequence (T).
        attention_layers, hidden, causal: as for ``attention_flops`` (0: no attention).

    Returns:
        FLOPs (a float).
    """
    tokens = batch * seq
    attention = attention_flops(
        batch=batch, seq=seq, attention_layers=attention_layers, hidden=hidden, causal=causal
    )
    return 2.0 * matmul_params * tokens + attention


def forward_seconds(
    flops: float,
    matmul_flops_per_s: float,
    *,
    mode: str = "train",
    infer_efficiency: float | None = None,
) -> float:
    """GPU time of a forward of ``flops`` at the measured bf16 matmul rate (FLOP/s), with the
    calibrated efficiency of a training (``mode="train"``) or inference forward.

    ``infer_efficiency``: this model's own inference forward rate over the matmul rate
    (``measured_efficiency`` of a resident inference step), in place of
    ``INFER_MATMUL_EFFICIENCY``; a training forward runs at that times
    ``TRAIN_MATMUL_EFFICIENCY / INFER_MATMUL_EFFICIENCY``.

    Args:
        flops: the forward's FLOPs (``forward_flops``).
        matmul_flops_per_s: the GPU's dense bf16 matmul rate, FLOP/s.
        mode: ``"train"`` or ``"infer"``.
        infer_efficiency: see above; None: the calibrated one.

    Returns:
        Seconds.
    """
    eff = TRAIN_MATMUL_EFFICIENCY if mode == "train" else INFER_MATMUL_EFFICIENCY
    if infer_efficiency is not None:
        eff *= infer_efficiency / INFER_MATMUL_EFFICIENCY
    return flops / (eff * matmul_flops_per_s)


def measured_efficiency(flops: float, seconds: float, matmul_flops_per_s: float) -> float:
    """A model's forward efficiency from a timed forward.

    Args:
        flops: its FLOPs (``forward_flops`` summed over its units).
        seconds: the forward's measured time.
        matmul_flops_per_s: the GPU's measured dense bf16 matmul rate, FLOP/s.

    Returns:
        ``flops / seconds / matmul_flops_per_s``: a share of the matmul rate.
    """
    return flops / (seconds * matmul_flops_per_s)


def ramflow_adamw_rate(torch_fused_params_per_s: float) -> float:
    """ramflow's CPU AdamW rate from torch's fused CPU AdamW rate.

    Args:
        torch_fused_params_per_s: torch's fused CPU AdamW rate, parameters per second.

    Returns:
        ramflow's rate, parameters per second (``RAMFLOW_ADAMW_PER_TORCH_FUSED`` times it).
    """
    return torch_fused_params_per_s * RAMFLOW_ADAMW_PER_TORCH_FUSED


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class UnitCost:
    """What the model needs to know about one unit (forward order).

    Attributes:
        name: the unit's name (for the report).
        wire_bytes: bytes of the parameters it owns, in the wire dtype: one H2D per load.
        trainable_params: parameters the CPU optimizer steps; their gradients cross D2H in
            the wire dtype (``grad_bytes_per_param`` each).
        forward_s: GPU time of its forward, seconds.
        resident: kept on the device (no loads; refreshed by one H2D after each CPU step).
        checkpointed: activation-checkpointed (its backward recomputes its forward).
        deps: indices of other units whose device copies its forward reads (tied
            parameters: a head that shares the embedding's weight).
        device_stepped: resident and stepped on the device: no gradient copy, CPU step or
            refresh; a GPU task of ``trainable_params / Rates.device_optimizer_params_per_s``.
        offload_bytes: bytes of its input kept in pinned host memory between forward and
            backward (activation offload of a checkpointed unit; 0: none): one D2H and one
            H2D per training step. See [Note: the step as a pipeline].
        attention_s: the part of ``forward_s`` that is attention's score and value
            products (``attention_flops``), whose backward is
            ``ATTENTION_BACKWARD_PER_FORWARD`` forwards; 0: not known (all of the forward
            backs up at ``BACKWARD_PER_FORWARD``).
    """

    name: str
    wire_bytes: int
    trainable_params: int
    forward_s: float
    resident: bool = False
    checkpointed: bool = False
    deps: tuple[int, ...] = ()
    device_stepped: bool = False
    offload_bytes: int = 0
    attention_s: float = 0.0

    @property
    def host_stepped_params(self) -> int:
        return 0 if self.device_stepped else self.trainable_params

    @property
    def backward_s(self) -> float:
        """GPU time of its backward: the matmuls' at ``BACKWARD_PER_FORWARD``, attention's
        at ``ATTENTION_BACKWARD_PER_FORWARD``, and one more forward when checkpointed."""
        matmuls = self.forward_s - self.attention_s
        own = BACKWARD_PER_FORWARD * matmuls + ATTENTION_BACKWARD_PER_FORWARD * self.attention_s
        return own + (RECOMPUTE_PER_FORWARD * self.forward_s if self.checkpointed else 0.0)


@dataclass(frozen=True)
class Rates:
    """Measured (or assumed) rates of the machine.

    Attributes:
        h2d_bytes_per_s: pinned host-to-device copy rate, one direction alone.
        d2h_bytes_per_s: pinned device-to-host copy rate, one direction alone.
        both_bytes_per_s: both directions at once, total (None: the links are independent).
        cpu_optimizer_params_per_s: the host optimizer's rate (ramflow's AdamW), measured
            alone.
        cpu_optimizer_dram_bytes_per_param: host DRAM bytes per parameter of the optimizer
            step whose rate that is (``RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM``): its DRAM rate is
            the product, and each byte the PCIe copies move to or from host memory takes
            optimizer time at that rate. None: the copies do not slow the optimizer.
        host_precision: the host formats (a ``ramflow.HostPrecision``; None: fp32) the
            optimizer's rate and bytes are of; ``planner.cpu_rates.rates_for`` converts them.
        device_optimizer_params_per_s: the optimizer's rate on the device, for units
            stepped there (``DEFAULT_DEVICE_OPTIMIZER_PARAMS_PER_S``, a floor).
    """

    h2d_bytes_per_s: float = DEFAULT_H2D_BYTES_PER_S
    d2h_bytes_per_s: float = DEFAULT_D2H_BYTES_PER_S
    both_bytes_per_s: float | None = DEFAULT_BOTH_BYTES_PER_S
    cpu_optimizer_params_per_s: float = DEFAULT_CPU_OPTIMIZER_PARAMS_PER_S
    cpu_optimizer_dram_bytes_per_param: float | None = RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM
    host_precision: HostPrecision | None = None
    device_optimizer_params_per_s: float = DEFAULT_DEVICE_OPTIMIZER_PARAMS_PER_S

    def copies_on_host_dram_s(self, nbytes: float) -> float:
        """Optimizer time lost to ``nbytes`` of PCIe copies through host DRAM."""
        if not self.cpu_optimizer_dram_bytes_per_param:
            return 0.0
        return nbytes / (self.cpu_optimizer_params_per_s * self.cpu_optimizer_dram_bytes_per_param)

    @classmethod
    def from_pcie(
        cls,
        bytes_per_s: float,
        *,
        cpu_optimizer_params_per_s: float = DEFAULT_CPU_OPTIMIZER_PARAMS_PER_S,
    ) -> Rates:
        """Rates from one pinned one-way copy rate (bytes/s), the same each way; both ways at
        once get ``BOTH_WAYS_PER_ONE_WAY`` times it in total."""
        return cls(
            h2d_bytes_per_s=bytes_per_s,
            d2h_bytes_per_s=bytes_per_s,
            both_bytes_per_s=bytes_per_s * BOTH_WAYS_PER_ONE_WAY,
            cpu_optimizer_params_per_s=cpu_optimizer_params_per_s,
        )

    def duplex(self) -> tuple[float, float]:
        """H2D and D2H rates while both directions run (backward)."""
        if not self.both_bytes_per_s:
            return self.h2d_bytes_per_s, self.d2h_bytes_per_s
        half = self.both_bytes_per_s / 2
        return min(self.h2d_bytes_per_s, half), min(self.d2h_bytes_per_s, half)


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step and its parts.

    Attributes:
        mode: ``"train"`` or ``"infer"``.
        step_s: the step time (steady state for training).
        forward_s: from the step's start to the end of its last forward kernel (includes
            waiting for loads and for the previous step's optimizer).
        backward_s: from there until the last gradients have landed on the host.
        optimizer_tail_s: CPU optimizer work left when the step's gradients have all landed;
            the next step's forward overlaps it (0 for inference).
        busy_s: per resource (``RESOURCES``), its busy time per step: each one's floor.
        critical_s: per resource, its share of the step on the critical path (sums to
            ``step_s``).
        bound: the resource with the largest critical share: the floor that binds.
        h2d_bytes: bytes host-to-device per step: ``h2d_stream_bytes + h2d_refresh_bytes``.
        h2d_stream_bytes: loads of streamed units (forward and backward).
        h2d_forward_bytes: the forward's share of those (each streamed unit once).
        h2d_refresh_bytes: refreshes of resident units after their CPU steps.
        d2h_bytes: gradient bytes device-to-host per step.
        offload_bytes: activation offload's bytes each way per step (the checkpointed
            units' inputs), not in ``h2d_bytes`` or ``d2h_bytes``.
        copies_on_cpu_s: the part of the CPU optimizer's busy time that is the copies' host
            memory traffic (``Rates.copies_on_host_dram_s`` of all bytes each way).
        first_step_s: the first simulated step, which starts with every step done (no
            optimizer to wait for): the benchmark's first timed step, which follows a drain
            (training; for inference the step itself).
        first_drained_s: that first step and then the rest of its optimizer work (a loop
            that synchronizes the host worker every step; 0 for inference).
    """

    mode: str
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_tail_s: float
    busy_s: dict[str, float] = field(default_factory=dict)
    critical_s: dict[str, float] = field(default_factory=dict)
    bound: str = ""
    h2d_bytes: int = 0
    h2d_stream_bytes: int = 0
    h2d_forward_bytes: int = 0
    h2d_refresh_bytes: int = 0
    d2h_bytes: int = 0
    offload_bytes: int = 0
    copies_on_cpu_s: float = 0.0
    first_step_s: float = 0.0
    first_drained_s: float = 0.0

    @property
    def floor_s(self) -> float:
        """The largest busy time: no schedule can beat it."""
        return max(self.busy_s.values(), default=0.0)

    def describe(self) -> str:
        """One line for people: total, parts, the binding floor."""
        ms = 1e3
        parts = f"forward {self.forward_s * ms:.0f} + backward {self.backward_s * ms:.0f} ms"
        if self.mode == "train":
            parts += (
                f"; optimizer tail {self.optimizer_tail_s * ms:.0f} ms (overlaps the next forward)"
            )
        busy = ", ".join(f"{k} {v * ms:.0f}" for k, v in self.busy_s.items())
        offload = (
            f"; activation offload {self.offload_bytes / 1e9:.2f} GB each way"
            if self.offload_bytes
            else ""
        )
        return (
            f"{self.step_s * ms:.0f} ms per step ({parts}); bound by {self.bound}; "
            f"busy per step (ms): {busy}{offload}"
        )

    def as_dict(self) -> dict:
        """JSON-able."""
        return {
            "mode": self.mode,
            "step_s": self.step_s,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_tail_s": self.optimizer_tail_s,
            "busy_s": dict(self.busy_s),
            "critical_s": dict(self.critical_s),
            "bound": self.bound,
            "floor_s": self.floor_s,
            "h2d_bytes": self.h2d_bytes,
            "h2d_stream_bytes": self.h2d_stream_bytes,
            "h2d_forward_bytes": self.h2d_forward_bytes,
            "h2d_refresh_bytes": self.h2d_refresh_bytes,
            "d2h_bytes": self.d2h_bytes,
            "offload_bytes": self.offload_bytes,
            "copies_on_cpu_s": self.copies_on_cpu_s,
            "first_step_s": self.first_step_s,
            "first_drained_s": self.first_drained_s,
        }


# ----------------------------------------------------------------------------- simulation


def _turnaround_cached(units: Sequence[UnitCost], window_bytes: int) -> set[int]:
    """Streamed units still in the window when backward starts: the last ones of forward
    whose loads fit in the window together (they need no reload)."""
    cached: set[int] = set()
    used = 0
    for i in reversed(range(len(units))):
        nbytes = _load_bytes(units, i)
        if nbytes == 0:
            continue
        if used + nbytes > window_bytes:
            break
        used += nbytes
        cached.add(i)
    return cached


def window_bytes_of(units: Sequence[UnitCost], prefetch_depth: int) -> int:
    """The plan's device window.

    Args:
        units: every unit (resident ones are not streamed).
        prefetch_depth: units loaded ahead of the running one.

    Returns:
        Bytes: ``(prefetch_depth + 2) x`` the largest streamed unit.
    """
    streamed = [u.wire_bytes for u in units if not u.resident]
    return (prefetch_depth + 2) * max(streamed, default=0)


def _optimizer_s(u: UnitCost, rates: Rates, copies_per_param_s: float = 0.0) -> float:
    """Host worker time of one unit's step: landing, then the optimizer over its parameters,
    plus its share (``copies_per_param_s`` per parameter) of the copies' DRAM traffic; 0 for
    a unit stepped on the device."""
    if u.host_stepped_params <= 0:
        return 0.0
    per_param = 1.0 / rates.cpu_optimizer_params_per_s + copies_per_param_s
    return HOST_SECONDS_PER_UNIT + u.host_stepped_params * per_param


def _device_step_s(u: UnitCost, rates: Rates) -> float:
    """GPU time of a device-stepped unit's optimizer step (0 for the others)."""
    on_device = u.trainable_params if u.device_stepped else 0
    return on_device / rates.device_optimizer_params_per_s


def _inference_loads(units: Sequence[UnitCost], window_bytes: int) -> list[int]:
    """Bytes each unit's forward loads in steady-state inference: the window (least recently
    used evicted first, the units of the current call kept) replayed over two forwards, each
    unit reading itself and its tied owners; the second forward's misses."""
    lru: dict[int, int] = {}  # unit -> bytes, oldest first
    loads = [0] * len(units)
    for rnd in range(2):
        for i, u in enumerate(units):
            need = [d for d in dict.fromkeys((i, *u.deps)) if not units[d].resident]
            for d in need:
                if d in lru:
                    lru[d] = lru.pop(d)  # most recently used
                    continue
                nbytes = units[d].wire_bytes
                while lru and sum(lru.values()) + nbytes > window_bytes:
                    victim = next((v for v in lru if v not in need), None)
                    if victim is None:
                        break  # the call needs more than the window: it overflows
                    del lru[victim]
                lru[d] = nbytes
                if rnd == 1:
                    loads[i] += nbytes
    return loads


def _load_bytes(units: Sequence[UnitCost], i: int) -> int:
    """H2D bytes of loading unit ``i`` for its forward: its own and its deps', unless resident."""
    own = 0 if units[i].resident else units[i].wire_bytes
    return own + sum(units[d].wire_bytes for d in units[i].deps if not units[d].resident)


def predict_step(
    units: Sequence[UnitCost],
    *,
    rates: Rates,
    prefetch_depth: int = 2,
    mode: str = "train",
    grad_bytes_per_param: int = 2,
    steps: int = STEPS_SIMULATED,
    deferred_steps: bool = False,
    micro_batches: int = 1,
) -> StepPrediction:
    """Predict one step. See [Note: the step as a pipeline].

    Args:
        units: every unit in forward order (resident and checkpointed flags set).
        rates: the machine's rates.
        prefetch_depth: as for ``ramflow.offload`` (the window holds ``depth + 2`` units).
        mode: ``"train"`` (forward, backward, CPU optimizer) or ``"infer"`` (forward only).
        grad_bytes_per_param: bytes per gradient element on the wire (2 for bf16).
        steps: training steps simulated; the last one is returned.
        deferred_steps: the host steps wait for the end of backward (a loop that clips or
            accumulates), then run in forward order beside the next forward; default: each
            unit steps as soon as its gradients land.
        micro_batches: micro-batches per optimizer step, run unit-major
            (``ramflow.accumulate``, see [Note: one weight pass per optimizer step] in
            ``ramflow.engine.unit_major``): each unit's compute and activation offload
            happen once per micro-batch, its loads, gradient copy and step once per step.
            ``units`` give one micro-batch's costs.

    Returns:
        The ``StepPrediction`` of the last step simulated: ``step_s`` (seconds), each
        resource's busy seconds (``busy_s``) and which one bounds the step (``bound``).

    Raises:
        ValueError: an unknown mode, a depth below 1, no units, a streamed device step,
            fewer than one micro-batch.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if micro_batches > 1:
        units = [
            replace(
                u,
                forward_s=u.forward_s * micro_batches,
                attention_s=u.attention_s * micro_batches,
                offload_bytes=u.offload_bytes * micro_batches,
            )
            for u in units
        ]
    streamed_stepped = [u.name for u in units if u.device_stepped and not u.resident]
    if streamed_stepped:
        raise ValueError(f"units stepped on the device must be resident: {streamed_stepped}")
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")
    if prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
    if not units:
        raise ValueError("no units")
    n = len(units)
    slots = prefetch_depth + 2
    h2d_fwd = rates.h2d_bytes_per_s
    h2d_bwd, d2h_bwd = rates.duplex()
    loads = [_load_bytes(units, i) for i in range(n)]
    streamed = [i for i in range(n) if loads[i] > 0]
    streamed_set = set(streamed)
    cached = _turnaround_cached(units, window_bytes_of(units, prefetch_depth))
    g = TaskGraph()
    if mode == "infer":
        # Two forwards back to back: at the end of a forward without grad the engine
        # prefetches the next one's first units, so their loads overlap the tail of the
        # previous forward's compute. The step is the second forward's, end to end.
        loads = _inference_loads(units, window_bytes_of(units, prefetch_depth))
        rates2 = (h2d_fwd, h2d_bwd)
        first = _forward(g, units, loads, slots, rates2, prev_opt=None, start=None, s=0)
        fwd = _forward(
            g,
            units,
            loads,
            slots,
            rates2,
            prev_opt=None,
            start=None,
            s=1,
            after=first[-1],
            slot_gates=[first[i] for i in range(n) if loads[i] > 0],
        )
        g.run()
        span = fwd[-1].end - first[-1].end
        h2d = sum(loads)
        busy = {
            "GPU compute": sum(u.forward_s for u in units),
            "PCIe H2D": h2d / h2d_fwd,
            "PCIe D2H": 0.0,
            "CPU optimizer": 0.0,
        }
        critical = critical_path(fwd[-1], first[-1].end)
        return StepPrediction(
            mode="infer",
            step_s=span,
            forward_s=span,
            backward_s=0.0,
            optimizer_tail_s=0.0,
            busy_s=busy,
            critical_s=critical,
            bound=max(critical, key=critical.get),
            h2d_bytes=h2d,
            h2d_stream_bytes=h2d,
            h2d_forward_bytes=h2d,
            d2h_bytes=0,
            first_step_s=first[-1].end,
        )

    steps = max(2, steps)
    h2d_stream = sum(loads) + sum(loads[j] for j in streamed if j not in cached)
    refresh = sum(u.wire_bytes for u in units if u.resident and u.host_stepped_params > 0)
    d2h_bytes = sum(u.host_stepped_params for u in units) * grad_bytes_per_param
    trainable = sum(u.host_stepped_params for u in units)
    offload = sum(u.offload_bytes for u in units)
    # the boundaries' copies share the links with the weights: See [Note: the step as a
    # pipeline]; in forward the D2H runs beside the loads where weights stream
    d2h_fwd = d2h_bwd if streamed else rates.d2h_bytes_per_s
    copies_on_cpu = rates.copies_on_host_dram_s(h2d_stream + refresh + d2h_bytes + 2 * offload)
    copies_per_param = copies_on_cpu / trainable if trainable else 0.0
    prev_opt: list[Task | None] | None = None
    barrier: Task | None = None
    ends: list[Task] = []
    fwd_ends: list[Task] = []
    opts: list[list[Task | None]] = []
    for s in range(steps):
        fwd = _forward(
            g, units, loads, slots, (h2d_fwd, h2d_bwd), prev_opt=prev_opt, start=barrier, s=s
        )
        fwd_ends.append(fwd[-1])
        packed = {
            i: g.add(
                "PCIe D2H",
                u.offload_bytes / d2h_fwd,
                [fwd[i - 1] if i else barrier],
                tag=f"s{s} offload {u.name}",
            )
            for i, u in enumerate(units)
            if u.offload_bytes
        }
        fetched: dict[int, Task] = {}
        offloaded_order = [i for i in reversed(range(n)) if i in packed]
        bwd: list[Task | None] = [None] * n
        d2h: list[Task | None] = [None] * n
        opt: list[Task | None] = [None] * n
        backward_order = list(reversed(range(n)))
        streamed_order = [i for i in backward_order if i in streamed_set]
        trainable_done: list[Task] = []
        prev = fwd[-1]
        for j in backward_order:
            u = units[j]
            deps = [prev]
            if j in streamed_set and j not in cached:
                k = streamed_order.index(j)
                gate = streamed_order[k - slots] if k >= slots else None
                load = g.add(
                    "PCIe H2D",
                    loads[j] / h2d_bwd,
                    [fwd[-1], bwd[gate] if gate is not None else None],
                    tag=f"s{s} reload {u.name}",
                )
                deps.append(load)
            if len(trainable_done) >= 2:
                deps.append(trainable_done[-2])
            if j in packed:
                # this unit's unpack requests its own input (late only for the first) and
                # the next one's (BoundaryOffloader's prefetch of 1)
                k = offloaded_order.index(j)
                for m in offloaded_order[k : k + 2]:
                    if m not in fetched:
                        fetched[m] = g.add(
                            "PCIe H2D",
                            units[m].offload_bytes / h2d_bwd,
                            [prev, packed[m]],
                            tag=f"s{s} fetch input {units[m].name}",
                        )
                deps.append(fetched[j])
            bwd[j] = g.add("GPU compute", u.backward_s, deps, tag=f"s{s} backward {u.name}")
            prev = bwd[j]
            if u.device_stepped and u.trainable_params > 0:
                opt[j] = g.add(
                    "GPU compute", _device_step_s(u, rates), [bwd[j]], tag=f"s{s} step {u.name}"
                )
                prev = opt[j]  # the GPU's stream runs it before the next backward
            elif u.trainable_params > 0:
                d2h[j] = g.add(
                    "PCIe D2H",
                    u.trainable_params * grad_bytes_per_param / d2h_bwd,
                    [bwd[j]],
                    tag=f"s{s} grads {u.name}",
                )
                trainable_done.append(d2h[j])
                if not deferred_steps:
                    opt[j] = g.add(
                        "CPU optimizer",
                        _optimizer_s(u, rates, copies_per_param),
                        [d2h[j]],
                        key=j,
                        tag=f"s{s} step {u.name}",
                    )
        barrier = g.add(None, 0.0, [prev, *[t for t in d2h if t is not None]], tag=f"s{s} end")
        for j in backward_order if deferred_steps else ():
            if d2h[j] is not None:  # the worker's priority: forward order (key)
                opt[j] = g.add(
                    "CPU optimizer",
                    _optimizer_s(units[j], rates, copies_per_param),
                    [d2h[j], barrier],
                    key=j,
                    tag=f"s{s} step {units[j].name}",
                )
        ends.append(barrier)
        opts.append(opt)
        prev_opt = opt
    g.run()

    t0, t1 = ends[-2].end, ends[-1].end
    last_opt = [t for t in opts[-1] if t is not None]
    fwd_s = sum(u.forward_s for u in units)
    bwd_s = sum(u.backward_s for u in units)
    stream_fwd = sum(loads)
    busy = {
        "GPU compute": fwd_s + bwd_s + sum(_device_step_s(u, rates) for u in units),
        "PCIe H2D": stream_fwd / h2d_fwd + (h2d_stream - stream_fwd + refresh + offload) / h2d_bwd,
        "PCIe D2H": d2h_bytes / d2h_bwd + offload / d2h_fwd,
        "CPU optimizer": sum(_optimizer_s(u, rates, copies_per_param) for u in units),
    }
    critical = critical_path(ends[-1], t0)
    return StepPrediction(
        mode="train",
        step_s=t1 - t0,
        forward_s=fwd_ends[-1].end - t0,
        backward_s=t1 - fwd_ends[-1].end,
        optimizer_tail_s=max(0.0, max((t.end for t in last_opt), default=t1) - t1),
        busy_s=busy,
        critical_s=critical,
        bound=max(critical, key=critical.get),
        h2d_bytes=h2d_stream + refresh,
        h2d_stream_bytes=h2d_stream,
        h2d_forward_bytes=stream_fwd,
        h2d_refresh_bytes=refresh,
        d2h_bytes=d2h_bytes,
        offload_bytes=offload,
        copies_on_cpu_s=copies_on_cpu,
        first_step_s=ends[0].end,
        first_drained_s=max((t.end for t in opts[0] if t is not None), default=ends[0].end),
    )


def _forward(
    g: TaskGraph,
    units: Sequence[UnitCost],
    loads: Sequence[int],
    slots: int,
    h2d_rates: tuple[float, float],
    *,
    prev_opt: list[Task | None] | None,
    start: Task | None,
    s: int,
    after: Task | None = None,
    slot_gates: Sequence[Task] = (),
) -> list[Task]:
    """Add one forward pass's tasks; returns the forward compute tasks in order.

    ``loads``: H2D bytes each unit's forward loads first (0: none). ``h2d_rates``: (loads,
    refreshes): loads run while only H2D is busy, refreshes mostly while the previous
    backward's gradients still cross D2H. ``start`` gates every task; ``after`` only the
    first compute (the previous forward's last), so loads may run ahead of it, each into the
    window slot that the compute in ``slot_gates`` (the previous forward's streamed units, in
    order) frees."""
    n = len(units)
    streamed = [i for i in range(n) if loads[i] > 0]
    h2d_rate, refresh_rate = h2d_rates
    fwd: list[Task] = []
    load_tasks: dict[int, Task] = {}
    refreshes: dict[int, Task] = {}
    position = {i: k for k, i in enumerate(streamed)}
    prev = start if after is None else after
    for i in range(n):
        u = units[i]
        deps: list[Task | None] = [prev]
        if i in position:
            k = position[i]
            if k >= slots:
                gate = fwd[streamed[k - slots]]
            elif len(slot_gates) >= slots - k:
                gate = slot_gates[len(slot_gates) - (slots - k)]
            else:
                gate = None
            wire = [prev_opt[d] for d in (i, *u.deps) if prev_opt is not None]
            load_tasks[i] = g.add(
                "PCIe H2D",
                loads[i] / h2d_rate,
                [start, gate, *wire],
                tag=f"s{s} load {u.name}",
            )
            deps.append(load_tasks[i])
        if prev_opt is not None:
            for d in (i, *u.deps):
                if units[d].device_stepped and prev_opt[d] is not None:
                    deps.append(prev_opt[d])  # stepped in place on the device: no refresh
                elif units[d].resident and prev_opt[d] is not None:
                    if d not in refreshes:
                        refreshes[d] = g.add(
                            "PCIe H2D",
                            units[d].wire_bytes / refresh_rate,
                            [prev_opt[d]],
                            tag=f"s{s} refresh {units[d].name}",
                        )
                    deps.append(refreshes[d])
        fwd.append(g.add("GPU compute", u.forward_s, deps, tag=f"s{s} forward {u.name}"))
        prev = fwd[-1]
    return fwd
