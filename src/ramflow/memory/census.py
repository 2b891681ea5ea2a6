"""Tensor census: the live tensors of the process, grouped, and what grew between two.

``tensor_census`` walks the objects the garbage collector tracks (``gc.get_objects``) and
groups the tensors it finds by device, dtype, shape and, where a model is given, the name of
the parameter or buffer they are. ``census_diff`` compares two censuses: a group whose count
or bytes grew between them is where a leak lives (a list that keeps losses with their graph,
a cache that is never cleared).

Only tensors that have a Python object are found: tensors that autograd saved for backward
and that nothing in Python refers to live in C++ and are not counted (see
``ramflow.memory.activation_report`` for those).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..sizes import format_bytes

__all__ = ["CensusGroup", "TensorCensus", "census_diff", "tensor_census"]


@dataclass(frozen=True)
class CensusGroup:
    """Live tensors that share device, dtype, shape and name.

    Attributes:
        device: e.g. ``"cpu"``, ``"cuda:0"``.
        dtype: e.g. ``"torch.float32"``.
        shape: the tensors' shape.
        name: the parameter or buffer name in the given model (``"blocks.0.up.weight"``),
            ``"<parameter>"`` for a parameter of no given model, "" otherwise.
        count: how many tensors.
        bytes: ``count * numel * element_size``: the bytes the tensors span (views of one
            storage are each counted here; ``TensorCensus.total_bytes`` counts storages once).
    """

    device: str
    dtype: str
    shape: tuple[int, ...]
    name: str
    count: int
    bytes: int

    @property
    def key(self) -> tuple[str, str, tuple[int, ...], str]:
        return (self.device, self.dtype, self.shape, self.name)


@dataclass(frozen=True)
class TensorCensus:
    """One count of the live tensors.

    Attributes:
        groups: the groups, largest ``bytes`` first.
        total_bytes: per device, the bytes of the distinct storages of the tensors found.
        pinned_bytes: bytes of the distinct pinned host storages found (pinned with
            ``pin_memory`` or page-locked in place), or None when CUDA is not initialized
            (no pinned memory can exist then).
    """

    groups: tuple[CensusGroup, ...]
    total_bytes: dict[str, int]
    pinned_bytes: int | None

    def format(self, *, top: int | None = 20) -> str:
        """A fixed-width table of the ``top`` largest groups (all when None)."""
        groups = self.groups if top is None else self.groups[:top]
        return _table(
            ("device", "dtype", "shape", "name", "count", "bytes"),
            [
                (
                    g.device,
                    g.dtype,
                    str(tuple(g.shape)),
                    g.name,
                    str(g.count),
                    format_bytes(g.bytes),
                )
                for g in groups
            ],
        )


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in table
    )


def _live_tensors() -> Iterable[torch.Tensor]:
    for obj in gc.get_objects():
        # the object's real type, not ``obj.__class__``: proxies and deprecated module
        # attributes answer that one with warnings or errors
        if issubclass(type(obj), torch.Tensor):
            yield obj


def _measure(t: torch.Tensor) -> tuple[tuple[int, ...], int, torch.UntypedStorage | None]:
    """(shape, bytes spanned, storage) of a tensor; ``((), 0, None)`` for one without
    sizes or storage of its own (nested tensors, whose shape is ragged: the jagged layout's
    values are a tensor of their own and are counted as such)."""
    if t.is_nested:
        return (), 0, None
    try:
        shape = tuple(t.shape)
        if t.layout != torch.strided or t.device.type == "meta":
            return shape, 0, None
        return shape, t.numel() * t.element_size(), t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        # a tensor subclass (a functional or fake tensor...) that has no sizes or storage:
        # the census must not fail on whatever another library keeps alive
        return (), 0, None


def tensor_census(model: nn.Module | None = None) -> TensorCensus:
    """Count the live tensors of this process.

    Args:
        model: optional; its parameters and buffers are named by their dotted path
            (``named_parameters`` / ``named_buffers``) in the census.

    Returns:
        A ``TensorCensus``. It holds only counts and names, no tensor, so keeping it does
        not keep anything alive.

    Raises:
        Nothing: tensors that cannot be measured (meta, sparse) are counted with 0 bytes;
        nested tensors, and tensor subclasses without sizes, with 0 bytes and shape ``()``.
    """
    names: dict[int, str] = {}
    if model is not None:
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            names.setdefault(id(t), name)
    check_pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
    groups: dict[tuple, list[int]] = {}
    storages: dict[str, dict[int, int]] = {}
    pinned: dict[int, int] = {}
    for t in _live_tensors():
        name = names.get(id(t), "<parameter>" if isinstance(t, nn.Parameter) else "")
        device = str(t.device)
        shape, nbytes, storage = _measure(t)
        key = (device, str(t.dtype), shape, name)
        entry = groups.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        if storage is not None:
            storages.setdefault(device, {})[storage.data_ptr()] = storage.nbytes()
            if check_pinned and t.device.type == "cpu" and t.is_pinned():
                pinned[storage.data_ptr()] = storage.nbytes()
    found = [CensusGroup(*key, count=c, bytes=b) for key, (c, b) in groups.items()]
    found.sort(key=lambda g: (-g.bytes, g.key))
    return TensorCensus(
        groups=tuple(found),
        total_bytes={d: sum(s.values()) for d, s in storages.items()},
        pinned_bytes=sum(pinned.values()) if check_pinned else None,
    )


def census_diff(before: TensorCensus, after: TensorCensus) -> tuple[CensusGroup, ...]:
    """What grew from ``before`` to ``after``.

    Returns:
        One ``CensusGroup`` per group whose count or bytes grew, holding the growth (``count``
        and ``bytes`` are ``after - before``), the largest byte growth first. Groups that
        shrank or vanished are left out: a leak is what stays and grows.
    """
    old = {g.key: g for g in before.groups}
    grown = []
    for g in after.groups:
        prev = old.get(g.key)
        d_count = g.count - (prev.count if prev else 0)
        d_bytes = g.bytes - (prev.bytes if prev else 0)
        if d_count > 0 or d_bytes > 0:
            grown.append(CensusGroup(*g.key, count=d_count, bytes=d_bytes))
    grown.sort(key=lambda g: (-g.bytes, g.key))
    return tuple(grown)
