"""Host formats: how master weights, optimizer states and gradients are kept in host RAM.

``HostPrecision`` is the policy; ``_lean_kernels`` steps its formats on the CPU. See
docs/design.md, "Host formats", for what each stores and why stochastic rounding needs a
counter-based generator.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from ._lean_kernels import QBLOCK

__all__ = ["HostPrecision", "check_optimizer_formats"]

MASTERS = ("fp32", "bf16-sr", "bf16-kahan")
OPTIMIZER_STATES = ("fp32", "bf16", "int8")

# fp32 master weights, exp_avg and exp_avg_sq of a unit stepped on the device
DEVICE_STEP_BYTES_PER_PARAM = 12
# elements per piece of a device step (the gradient is upcast to fp32 one piece at a time)
DEVICE_STEP_PIECE = 16 * 2**20
DEVICE_STEP_SCRATCH_BYTES = DEVICE_STEP_PIECE * 4
# a lean unit's device step without Triton runs the host kernel's arithmetic in PyTorch
# ops: its fp32 and int64 temporaries take about 96 bytes per element of a piece. With
# Triton (one kernel, no temporaries) a piece is DEVICE_STEP_PIECE elements and its only
# scratch is a host gradient's upload (4 bytes each), within this reserve
LEAN_DEVICE_STEP_PIECE = 2 * 2**20
LEAN_DEVICE_STEP_SCRATCH_BYTES = LEAN_DEVICE_STEP_PIECE * 96
GRADIENTS = ("full", "ring")
# the named policies (``HostPrecision.parse``; the classmethods of the same names)
PRESETS = ("fp32", "bf16", "lean", "kahan")

# Optimizers with a CPU kernel for each format; the fp32 formats go with every optimizer.
_LEAN_OPTIMIZERS = ("adamw",)


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass(frozen=True)
class HostPrecision:
    """How each trained parameter is kept in host RAM (a policy, chosen once at set-up).

    Attributes:
        master: the master weights. ``"fp32"`` (default): fp32, stepped exactly as
            ``torch.optim.AdamW`` steps them, plus a separate wire copy when the wire dtype
            is not fp32. ``"bf16-sr"``: bf16, written with stochastic rounding (Zamirai et
            al. 2020); with a bf16 wire the master is the wire copy, one buffer.
            ``"bf16-kahan"``: bf16 plus a bf16 compensation buffer holding what rounding
            dropped (compensated summation, as optimi and Collage do).
        optimizer_states: the AdamW states ``exp_avg``/``exp_avg_sq``. ``"fp32"`` (default),
            ``"bf16"`` (rounded to nearest even), or ``"int8"``: 8-bit block-wise codes
            with one fp32 absmax per block of 256 elements (Dettmers et al. 2022).
        gradients: host gradients. ``"full"`` (default): a gradient buffer for the whole
            model in the master's dtype plus a staging buffer in the wire dtype; needed for
            gradient accumulation, clipping and ``keep_grads``. ``"ring"``: units are
            stepped during backward and only the units in flight hold staging, a fixed
            cost that does not grow with the model (counted as 0 bytes per parameter). A
            full buffer (in the master's dtype) is still made for the steps that need one
            (the first, accumulation, clipping) and dropped once steps run during backward;
            with ``AdamW(keep_grads=False)`` the first step runs during backward too, and
            it is never made.
        seed: the seed of the stochastic rounding (an int in [0, 2**63)); unit ``i`` rounds
            with ``unit_seed(i)``, so a run is reproducible and resumes exactly.

    Presets: ``fp32()`` (today's, 20 bytes per parameter), ``bf16()`` (bf16-sr masters,
    bf16 states, ring: 6), ``lean()`` (bf16-sr masters, 8-bit states, ring: about 4.03),
    ``kahan()`` (bf16-kahan masters, 8-bit states, ring: about 6.03). ``parse`` takes their
    names.

    Raises:
        ValueError: a field has a value not listed above (the message lists those that are).
    """

    master: str = "fp32"
    optimizer_states: str = "fp32"
    gradients: str = "full"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"HostPrecision(seed=...) must be an int, got {self.seed!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"HostPrecision(seed={self.seed}) must be in [0, 2**63)")
        for name, value, allowed in (
            ("master", self.master, MASTERS),
            ("optimizer_states", self.optimizer_states, OPTIMIZER_STATES),
            ("gradients", self.gradients, GRADIENTS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"HostPrecision({name}={value!r}) is not a format; {name} is one of "
                    f"{_choices(allowed)}"
                )

    @classmethod
    def fp32(cls) -> HostPrecision:
        """fp32 masters, fp32 states, full gradients: today's, exact."""
        return cls(master="fp32", optimizer_states="fp32", gradients="full")

    @classmethod
    def bf16(cls) -> HostPrecision:
        """bf16 masters with stochastic rounding, bf16 states, a gradient ring."""
        return cls(master="bf16-sr", optimizer_states="bf16", gradients="ring")

    @classmethod
    def lean(cls) -> HostPrecision:
        """bf16 masters with stochastic rounding, 8-bit states, a gradient ring."""
        return cls(master="bf16-sr", optimizer_states="int8", gradients="ring")

    @classmethod
    def kahan(cls) -> HostPrecision:
        """bf16 masters with a bf16 compensation (Kahan), 8-bit states, a gradient ring."""
        return cls(master="bf16-kahan", optimizer_states="int8", gradients="ring")

    @classmethod
    def parse(cls, value: HostPrecision | str | None) -> HostPrecision:
        """A policy from a preset's name (``"fp32"``, ``"bf16"``, ``"lean"``, ``"kahan"``),
        a policy (returned as is) or None (``fp32()``).

        Raises:
            ValueError: an unknown name (the message lists the presets).
            TypeError: neither a string nor a HostPrecision.
        """
        if value is None:
            return cls.fp32()
        if isinstance(value, HostPrecision):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"host_precision must be a HostPrecision or a preset's name, got {value!r}"
            )
        if value not in PRESETS:
            raise ValueError(
                f"host_precision={value!r} is not a preset; use one of {_choices(PRESETS)} "
                "or a ramflow.HostPrecision(master=..., optimizer_states=..., gradients=...)"
            )
        return getattr(cls, value)()

    @property
    def name(self) -> str:
        """The preset's name when this policy is one (seed aside), else its fields."""
        for preset in PRESETS:
            p = getattr(HostPrecision, preset)()
            if (p.master, p.optimizer_states, p.gradients) == (
                self.master,
                self.optimizer_states,
                self.gradients,
            ):
                return preset
        return f"{self.master}/{self.optimizer_states}/{self.gradients}"

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the host master weights (and of the host gradients)."""
        return torch.float32 if self.master == "fp32" else torch.bfloat16

    def unit_seed(self, index: int) -> int:
        """The stochastic rounding's seed of unit ``index``: the policy's seed mixed with it."""
        return (self.seed * 0x9E3779B97F4A7C15 + index + 1) % 2**64

    @property
    def spelled(self) -> str:
        """This policy as a user writes it: ``host_precision='lean'`` for a preset (seed
        aside), else ``HostPrecision(master=..., optimizer_states=..., gradients=...)``; for
        error messages."""
        if "/" not in self.name:
            return f"host_precision={self.name!r}"
        return (
            f"HostPrecision(master={self.master!r}, optimizer_states="
            f"{self.optimizer_states!r}, gradients={self.gradients!r})"
        )

    def wire_for(self, wire_dtype: torch.dtype | None, *, default: torch.dtype) -> torch.dtype:
        """The wire dtype of a run: ``wire_dtype`` when the user gave one, else the
        master's own when the master is the wire copy (bf16), else ``default`` (the
        device's: bf16 on CUDA, fp32 on the CPU)."""
        if wire_dtype is not None:
            return wire_dtype
        return torch.bfloat16 if self.master != "fp32" else default

    def check_wire(self, wire_dtype: torch.dtype) -> None:
        """Raise ValueError when these masters cannot serve a wire copy of ``wire_dtype``.

        A bf16 master is the wire copy itself, so it needs a bf16 wire: an fp32 wire would
        send twice the bytes with no more precision than the master has, an fp16 wire
        would be a second copy that loses bf16's range on every refresh. The message names
        the arguments the user typed (``host_precision=``, ``wire_dtype=``).
        """
        if wire_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"wire_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
                f"wire_dtype={wire_dtype}"
            )
        if self.master != "fp32" and wire_dtype != torch.bfloat16:
            raise ValueError(
                f"{self.spelled} keeps bf16 master weights, which are the wire copy, so it "
                f"needs a bfloat16 wire dtype, got wire_dtype={wire_dtype}. Leave wire_dtype "
                "out (the wire then follows the master) or pass wire_dtype=torch.bfloat16. "
                "Combinations that work: host_precision='fp32' with any wire_dtype; "
                "host_precision='bf16', 'lean' or 'kahan' with a bfloat16 wire"
            )

    @property
    def device_step_bytes_per_parameter(self) -> float:
        """Device bytes per trainable parameter of a unit stepped on the device
        (``ramflow.offload(device_optimizer=True)``): fp32 masters keep an fp32 master and
        fp32 states there (12); a bf16 master is the unit's device copy, so only the states
        (8-bit: 2 plus the absmax; bf16: 4) and a Kahan compensation (2) are added; an fp32
        master with lean states adds its fp32 copy (4)."""
        if self.is_exact:
            return float(DEVICE_STEP_BYTES_PER_PARAM)
        master = 4.0 if self.master == "fp32" else 0.0
        return self.optimizer_state_bytes_per_parameter + master

    @property
    def device_step_scratch_bytes(self) -> int:
        """Device scratch of one piece of a device step (``_plan``'s constants)."""
        return DEVICE_STEP_SCRATCH_BYTES if self.is_exact else LEAN_DEVICE_STEP_SCRATCH_BYTES

    def bytes_per_parameter(self, *, trainable: bool, wire_dtype: torch.dtype) -> float:
        """Host RAM per parameter, in bytes, under this policy with a wire of ``wire_dtype``.

        Trained: master (fp32 4 plus the wire copy; bf16-sr 2, it is the wire copy;
        bf16-kahan 2) + states (fp32 8; bf16 4; int8 2 + 2 x 4 / 256 for the absmax; a Kahan
        master's compensation, 2, is counted here as the optimizer keeps it) +
        gradients (full: 4 with fp32 masters, else 2, plus staging in the wire dtype; ring:
        0). Frozen
        (``trainable=False``): stored once in the wire dtype, except with fp32 masters,
        which keep today's fp32 master and wire copy.

        Raises:
            ValueError: ``check_wire`` fails for ``wire_dtype``.
        """
        self.check_wire(wire_dtype)
        wire = torch.empty((), dtype=wire_dtype).element_size()
        wire_copy = 0 if wire_dtype == torch.float32 else wire
        if not trainable:
            return float(4 + wire_copy if self.master == "fp32" else wire)
        master = {"fp32": 4 + wire_copy, "bf16-sr": 2, "bf16-kahan": 2}[self.master]
        states = self.optimizer_state_bytes_per_parameter
        grad = 4 if self.master == "fp32" else 2
        gradients = grad + wire if self.gradients == "full" else 0
        return master + states + gradients

    @property
    def optimizer_state_bytes_per_parameter(self) -> float:
        """AdamW's states per trained parameter, in bytes (fp32 8; bf16 4; int8 2 plus two
        fp32 absmax per 256 elements), plus a Kahan master's bf16 compensation (2), which
        the optimizer keeps with its states."""
        states = {"fp32": 8.0, "bf16": 4.0, "int8": 2 + 2 * 4 / QBLOCK}[self.optimizer_states]
        return states + (2 if self.master == "bf16-kahan" else 0)

    @property
    def is_exact(self) -> bool:
        """Whether steps are bit-identical to torch's fused AdamW (fp32 masters and states)."""
        return self.master == "fp32" and self.optimizer_states == "fp32"


def check_optimizer_formats(precision: HostPrecision, optimizer: Any) -> None:
    """Raise ValueError when ``optimizer`` has no CPU step for ``precision``'s formats.

    Args:
        precision: the policy.
        optimizer: a name (``"AdamW"``, ``"SGD"``, case ignored), an optimizer class or an
            optimizer instance (named by its class).

    Raises:
        ValueError: lean masters or states (anything but fp32) with an optimizer other than
            AdamW; the message names the combinations that work.
    """
    if isinstance(optimizer, str):
        name = optimizer
    elif isinstance(optimizer, type):
        name = optimizer.__name__
    else:
        name = type(optimizer).__name__
    if precision.is_exact or name.lower() in _LEAN_OPTIMIZERS:
        return
    raise ValueError(
        f"{name} has no CPU step for {precision.spelled} (master={precision.master!r}, "
        f"optimizer_states={precision.optimizer_states!r}). Combinations that work: any "
        "optimizer with host_precision='fp32' (HostPrecision.fp32()); ramflow.optim.AdamW "
        "with any host_precision (e.g. host_precision='lean')"
    )


OPTIMIZER_SPEED_BY_ISA = {
    "avx512": {"fp32": 1.0, "bf16": 1.64, "lean": 1.13, "kahan": 1.06},
    "avx2": {"fp32": 1.0, "bf16": 1.32, "lean": 0.78, "kahan": 0.64},
}
"""Each preset's CPU AdamW parameter rate over the fp32 one, by the instruction set its lean
step runs (``_lean_kernels.lean_isa``), measured on the H100 box of 2026-11-26 with all 16
threads in one run (``bench.py --cpu-optimizer``: ramflow's fp32 AdamW 4.89 G params/s; its
``host_formats`` rates, AVX-512 bf16 8.04, lean 5.53, kahan 5.16, AVX2 6.47, 3.82, 3.13;
benchmarks/results/2026-11-26-nvidia-h100-lean-avx512). The bf16 step moves fewer bytes;
the 8-bit ones are bound by their lookups and arithmetic, not by DRAM."""


def _cpu_lean_isa() -> str:
    """The instruction set the lean step will run here, read from /proc/cpuinfo's flags
    (without building the native code, which a plan does not need): "avx512" where the
    CPU has AVX-512 F, BW, DQ, VL and VBMI, else "avx2"; ``RAMFLOW_LEAN_ISA=avx2`` caps it
    as it caps the step."""
    if os.environ.get("RAMFLOW_LEAN_ISA", "") in ("avx2", "scalar"):
        return "avx2"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return "avx2"
    need = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi"}
    return "avx512" if need <= set(flags) else "avx2"


OPTIMIZER_SPEED = OPTIMIZER_SPEED_BY_ISA[_cpu_lean_isa()]
"""``OPTIMIZER_SPEED_BY_ISA`` of this CPU: the predictor's (``rates_for``)."""


def rated_as(name: str) -> str:
    """The preset whose CPU optimizer rate stands for the host formats ``name``
    (``HostPrecision.name``): itself, or the preset with the same optimizer states."""
    if name in OPTIMIZER_SPEED:
        return name
    master, states = ([*name.split("/"), "", ""])[:2]
    if states == "int8":
        return "kahan" if master == "bf16-kahan" else "lean"
    return "bf16" if states == "bf16" else "fp32"


def optimizer_speed(name: str) -> float:
    """``OPTIMIZER_SPEED`` of the preset that ``name`` is rated as."""
    return OPTIMIZER_SPEED[rated_as(name)]


def rates_for(rates: Any, name: str) -> Any:
    """``rates`` (a ``_predict.Rates``) with the CPU optimizer's rate for the host formats
    ``name`` (``HostPrecision.name``: a preset, or ``master/states/gradients``, rated as the
    preset with the same optimizer states), converted from the formats the rate was measured
    with (``rates.host_precision``) by ``OPTIMIZER_SPEED``. The host DRAM rate the PCIe
    copies are charged at stays the machine's: the 8-bit steps are bound by their lookups,
    not by DRAM, so it is not their parameter rate times their bytes. The same rates when
    the formats rate alike."""
    name = rated_as(name)
    if name == rated_as(rates.host_precision):
        return rates
    rate = (
        rates.cpu_optimizer_params_per_s
        * optimizer_speed(name)
        / optimizer_speed(rates.host_precision)
    )
    dram = rates.cpu_optimizer_dram_bytes_per_param
    return dataclasses.replace(
        rates,
        cpu_optimizer_params_per_s=rate,
        cpu_optimizer_dram_bytes_per_param=(
            dram * rates.cpu_optimizer_params_per_s / rate if dram else None
        ),
        host_precision=name,
    )
