"""Sizes in bytes: reading ``"12GiB"`` and writing ``1.50 GiB``.

Every byte count in ramflow is an ``int`` of bytes (names end in ``_bytes``); these two
functions are where a size enters from a user (``parse_bytes``, once, where it enters) and
where one leaves for display (``format_bytes``). Standard library only: the bottom layer.
"""

from __future__ import annotations

import math
import re

# size suffixes, case-insensitive: decimal (k, MB, G...) and binary (KiB, GiB...)
_UNITS = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgt", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 10 ** (3 * _i)
    _UNITS[_prefix + "ib"] = 2 ** (10 * _i)


def parse_bytes(value: int | float | str, *, what: str = "gpu_memory") -> int:
    """``12884901888``, ``"12GiB"``, ``"12 GB"`` (decimal), ``"512MiB"`` -> bytes.

    Raises:
        ValueError: the value is negative (``-1``, ``"-12GiB"``), not finite (NaN or
            infinity, as a number or a string) or not a size.
        TypeError: the value is neither a number nor a string.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected bytes or a size like '12GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        number = r"([-+]?)\s*([0-9]*\.?[0-9]+|nan|infinity|inf)"  # read, then refused below
        m = re.fullmatch(rf"\s*{number}\s*([A-Za-z]*)\s*", value, re.IGNORECASE)
        if not m or m.group(3).lower() not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r}; write bytes or a size like '12GiB'")
        n = float(m.group(1) + m.group(2)) * _UNITS[m.group(3).lower()]
    else:
        raise TypeError(
            f"{what}: expected bytes or a size like '12GiB', got {type(value).__name__}"
        )
    if math.isnan(n) or math.isinf(n):
        raise ValueError(
            f"{what}: must be a finite size, got {value!r}; give bytes or a size like '12GiB'"
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
