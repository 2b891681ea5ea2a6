"""The CPU optimizer's rate for each host format, as the step-time model reads it.

``rates_for`` converts a machine's measured rate (taken with one host format) to another
format by the ratios in ``OPTIMIZER_SPEED_BY_ISA``; the planner, ``ramflow plan`` and the
engine's timed plan all ask here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..formats.host import LEGACY_8BIT_NAME

OPTIMIZER_SPEED_BY_ISA = {
    "avx512": {"fp32": 1.0, "bf16": 2.09, "lean": 2.05, "kahan": 1.63, "lean4": 0.011},
    "avx2": {"fp32": 1.0, "bf16": 2.05, "lean": 1.82, "kahan": 1.42, "lean4": 0.011},
}
"""Each preset's CPU AdamW parameter rate over the fp32 one, by the instruction set its lean
step runs (``kernels.lean_kernels.lean_isa``). Measured by ``benchmarks/cpu_optimizer_runner.py``
on 16 threads of the GPU box, every format against ramflow's fp32 AdamW in one run; where
and when is in docs/speed.md ("The CPU optimizer's rates"). Every step there rounds its bf16
or 8-bit states stochastically and is bound by its arithmetic, not by DRAM. ``lean4`` (4-bit
states, coded by PyTorch ops around the lean kernel, no native code yet) is not from the GPU
box: ``benchmarks/host_formats/adam4bit_rate.py`` on 2 threads of the development machine,
the fastest of 5 steps of 16M parameters (docs/host-precision.md, "4-bit states")."""


def _cpu_lean_isa() -> str:
    """The instruction set the lean step will run here, read from /proc/cpuinfo's flags
    (without building the native code, which a plan does not need): "avx512" where the
    CPU has AVX-512 F, BW, DQ and VL, else "avx2"; ``RAMFLOW_LEAN_ISA=avx2`` caps it
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
    need = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    return "avx512" if need <= set(flags) else "avx2"


OPTIMIZER_SPEED = OPTIMIZER_SPEED_BY_ISA[_cpu_lean_isa()]
"""``OPTIMIZER_SPEED_BY_ISA`` of this CPU: the predictor's (``rates_for``)."""


def rated_as(name: str) -> str:
    """The preset whose CPU optimizer rate stands for some host formats.

    Args:
        name: the host formats' name (``HostPrecision.name``: a preset, or
            ``master/states/gradients``).

    Returns:
        The preset's name: ``name`` itself, or the preset with the same optimizer states.
    """
    if name in OPTIMIZER_SPEED:
        return name
    master, states = ([*name.split("/"), "", ""])[:2]
    if states in ("fp8", LEGACY_8BIT_NAME):
        return "kahan" if master == "bf16-kahan" else "lean"
    if states == "4bit":
        return "lean4"
    return "bf16" if states == "bf16" else "fp32"


def optimizer_speed(name: str) -> float:
    """The relative CPU optimizer speed of some host formats.

    Args:
        name: the host formats' name (``HostPrecision.name``).

    Returns:
        ``OPTIMIZER_SPEED`` of the preset that ``name`` is rated as (``rated_as``).
    """
    return OPTIMIZER_SPEED[rated_as(name)]


def rates_for(rates: Any, name: str) -> Any:
    """``rates`` (a ``planner.predict.Rates``) with the CPU optimizer's rate for the host formats
    ``name`` (``HostPrecision.name``: a preset, or ``master/states/gradients``, rated as the
    preset with the same optimizer states), converted from the formats the rate was measured
    with (``rates.host_precision``) by ``OPTIMIZER_SPEED``. The host DRAM rate the PCIe
    copies are charged at stays the machine's: the 8-bit steps are bound by their lookups,
    not by DRAM, so it is not their parameter rate times their bytes.

    Args:
        rates: the machine's ``planner.predict.Rates``.
        name: the host formats' name (``HostPrecision.name``).

    Returns:
        A ``Rates``; ``rates`` itself when the formats rate alike.
    """
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
