"""The offload plan: which units stay resident on the GPU and how large the window is.

Byte counts are ``*_bytes`` throughout; they turn into GiB only for display.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(value: int | float | str, *, what: str = "gpu_memory") -> int:
    """``12884901888``, ``"12GiB"``, ``"12 GB"`` (decimal), ``"512MiB"`` -> bytes.

    Raises:
        ValueError: the value is negative or not a size.
        TypeError: the value is neither a number nor a string.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected bytes or a size like '12GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r}; write bytes or a size like '12GiB'")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise TypeError(
            f"{what}: expected bytes or a size like '12GiB', got {type(value).__name__}"
        )
    if n < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    """Bytes as a short human string in binary units (``1.50 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


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

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the resident units."""
        res = set(self.resident)
        return sum(b for n, b in zip(self.unit_names, self.unit_bytes) if n in res)

    @property
    def planned_bytes(self) -> int:
        """Everything ramflow itself may allocate on the device (activations excluded)."""
        return self.window_bytes + self.grad_bytes + self.fixed_bytes + self.resident_bytes

    @property
    def streamed_bytes_per_pass(self) -> int:
        """H2D bytes of one forward pass (a training step moves about twice this)."""
        res = set(self.resident)
        return sum(b for n, b in zip(self.unit_names, self.unit_bytes) if n not in res)

    def describe(self) -> str:
        """A few lines for people: budget, window, resident units."""
        budget = "no cap" if self.gpu_memory_bytes is None else format_bytes(self.gpu_memory_bytes)
        return "\n".join(
            [
                f"device {self.device}, wire dtype {self.wire_dtype}, budget {budget}",
                f"units: {len(self.unit_names)}, resident: {len(self.resident)}, "
                f"prefetch depth: {self.prefetch_depth}",
                f"window {format_bytes(self.window_bytes)} + gradients "
                f"{format_bytes(self.grad_bytes)} + fixed {format_bytes(self.fixed_bytes)} + "
                f"resident {format_bytes(self.resident_bytes)} = {format_bytes(self.planned_bytes)}",
                f"streamed per forward: {format_bytes(self.streamed_bytes_per_pass)} "
                f"(smallest budget that works: {format_bytes(self.min_gpu_memory_bytes)})",
            ]
        )


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
) -> OffloadPlan:
    """Choose resident units greedily within the budget; stream the rest.

    Units that must stay resident (``always_resident``) are always kept. With a budget,
    the remaining units are made resident from the last one backwards (the last units of
    forward are the first of backward, so keeping them saves the turn-around) while the
    window, gradient buffers and residents still fit.

    Raises:
        ValueError: the budget is smaller than the smallest plan (largest unit times the
            window, gradient buffers and fixed bytes); the message gives that figure.
    """
    if prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
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
        used = forced_bytes
        for name, nbytes in reversed(list(zip(unit_names, unit_bytes))):
            if name in resident:
                continue
            trial = resident | {name}
            if window(trial) + grad_bytes + fixed_bytes + used + nbytes <= gpu_memory_bytes:
                resident, used = trial, used + nbytes
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
