"""The CPU optimizer's rate for each host format, as the step-time model reads it.

``rates_for`` converts a machine's measured rate (taken with one host format) to another
format by the ratios in ``OPTIMIZER_SPEED_BY_ISA``; the planner, ``ramflow plan`` and the
engine's timed plan all ask here. Formats are read from a ``HostPrecision``'s fields, never
from its name (which is for display).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..formats.host import HostPrecision
from .predict import Rates

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


def rated_as(precision: HostPrecision | None) -> str:
    """The preset whose CPU optimizer rate stands for some host formats, read from their
    fields: the optimizer states decide the step's arithmetic (8-bit states with a Kahan
    master are ``"kahan"``'s).

    Args:
        precision: the host formats; None: fp32 (``Rates.host_precision``'s default).

    Returns:
        The key of ``OPTIMIZER_SPEED``: ``"fp32"``, ``"bf16"``, ``"lean"``, ``"kahan"`` or
        ``"lean4"``.
    """
    if precision is None:
        return "fp32"
    states = precision.state_format
    if states.step_chunk is not None:  # 4-bit codes, decoded around the lean kernel
        return "lean4"
    if states.block:  # 8-bit codes with per-block scales
        return "kahan" if precision.master_format.compensated else "lean"
    return "bf16" if states.dtype == torch.bfloat16 else "fp32"


def optimizer_speed(precision: HostPrecision | None) -> float:
    """The relative CPU optimizer speed of some host formats.

    Args:
        precision: the host formats; None: fp32.

    Returns:
        ``OPTIMIZER_SPEED`` of the preset that ``precision`` is rated as (``rated_as``): its
        AdamW parameter rate over the fp32 one on this CPU.
    """
    return OPTIMIZER_SPEED[rated_as(precision)]


def rates_for(rates: Rates, precision: HostPrecision) -> Rates:
    """``rates`` with the CPU optimizer's rate for the host formats ``precision`` (rated as
    the preset with the same optimizer states, ``rated_as``), converted from the formats
    the rate was measured with (``rates.host_precision``) by ``OPTIMIZER_SPEED``. The host
    DRAM rate the PCIe copies are charged at stays the machine's: the 8-bit steps are bound
    by their lookups, not by DRAM, so it is not their parameter rate times their bytes.

    Args:
        rates: the machine's ``planner.predict.Rates``.
        precision: the host formats the plan steps with.

    Returns:
        A ``Rates`` of ``precision`` (its ``host_precision``); ``rates`` itself when the
        formats are the same, and ``rates`` with only ``host_precision`` changed when they
        rate alike.
    """
    if precision == rates.host_precision:
        return rates
    speed, measured = optimizer_speed(precision), optimizer_speed(rates.host_precision)
    if speed == measured:
        return dataclasses.replace(rates, host_precision=precision)
    rate = rates.cpu_optimizer_params_per_s * speed / measured
    dram = rates.cpu_optimizer_dram_bytes_per_param
    return dataclasses.replace(
        rates,
        cpu_optimizer_params_per_s=rate,
        cpu_optimizer_dram_bytes_per_param=(
            dram * rates.cpu_optimizer_params_per_s / rate if dram else None
        ),
        host_precision=precision,
    )
