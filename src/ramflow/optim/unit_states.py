"""The flat per-unit optimizer states of a ramflow optimizer (``UnitStates``).

A managed parameter's optimizer states are views into one flat host buffer per unit and
state name, so that a unit's states are contiguous like its masters (one buffer for the flat
step's kernels and for a device step's upload). ``HostOptimizer`` holds one ``UnitStates``
and decides which states to make, in which formats; this object owns the buffers.

[Note: states made before the first step]
A unit's flat optimizer states are made (zeros, written: their pages faulted in by
the intra-op threads) when the optimizer is built, for every unit this process steps
(under ZeRO, the units it owns), not by the worker inside the first step. Making them
there was the largest new memory of the first step (2 bytes per parameter in lean
formats, 8 in fp32: 33 GiB per rank for a 70B model on 4 ranks, beside the gradient
ring's 8 GiB), paid on the worker while backward waits for its steps: the first run on
a 4-GPU box took 26 s over its median there, likely a VM backing its RAM at first touch
(docs/design.md, "Host memory is made before the first step"). ``opt.state``
stays empty until a step, as for a torch optimizer: a step, ``load_state_dict`` or a
device step finds the flats made and takes views of them (``UnitStates.views``). An
optimizer built over units whose states an older optimizer made but never used
(never stepped, nothing loaded) takes those (``UnitStates.give_unused``), so that building
a second optimizer before dropping the first costs no second set. ``offload`` does the same
for the rest of what a first step made: the gradient ring's buffers
(``Engine.prepare_first_step``) and, under ``zero_stage``, NCCL's communicators
(``DistributedState.open_communicators``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..formats.host import FP32, HostPrecision
from ..units.registry import engine_of_param
from ..units.unit import Unit

# makes a unit's missing flat states, by name, in the optimizer's formats
NewFlats = Callable[[Unit, tuple[str, ...]], dict[str, torch.Tensor]]


def format_of(unit: Unit) -> HostPrecision:
    """``unit``'s host formats (fp32 for a unit no store has built yet)."""
    return FP32 if unit.precision is None else unit.precision


class UnitStates(Mapping[Unit, dict[str, torch.Tensor]]):
    """One optimizer's flat states of offloaded units: ``states[unit][name]`` is a flat
    host buffer over ``unit``'s trainable prefix (``unit.trainable_numel`` elements, or the
    blocks that cover them for an 8-bit scale), in the dtype the optimizer made it in.
    Read as a mapping; changed only through the methods below. See [Note: states made
    before the first step].
    """

    def __init__(self) -> None:
        self._flats: dict[Unit, dict[str, torch.Tensor]] = {}

    def __getitem__(self, unit: Unit) -> dict[str, torch.Tensor]:
        return self._flats[unit]

    def __iter__(self) -> Iterator[Unit]:
        return iter(self._flats)

    def __len__(self) -> int:
        return len(self._flats)

    def put(self, unit: Unit, flats: dict[str, torch.Tensor]) -> None:
        """Keep ``flats`` (flat host buffers by state name) as ``unit``'s states."""
        self._flats[unit] = flats

    def drop(self, units: Iterable[Unit]) -> None:
        """Forget the states of ``units`` (their engine was removed by ``ramflow.undo``)."""
        for u in units:
            self._flats.pop(u, None)

    def clear(self) -> None:
        """Forget every unit's states (``load_state_dict`` makes new buffers)."""
        self._flats.clear()

    def give_unused(
        self, unit: Unit, names: tuple[str, ...], state: Mapping[torch.Tensor, Any]
    ) -> dict[str, torch.Tensor] | None:
        """Give up ``unit``'s flat states if they are exactly ``names`` and hold nothing:
        made when the optimizer was built, never stepped or loaded into.

        Args:
            unit: the unit another optimizer is about to make states for.
            names: the state names that optimizer makes.
            state: this optimizer's ``state`` (per parameter): a parameter of ``unit``
                with an entry there has been stepped or loaded.

        Returns:
            The flat buffers (now the caller's, forgotten here), or None when they are
            other names or in use.
        """
        flats = self._flats.get(unit)
        if flats is None or tuple(flats) != tuple(names):
            return None
        if any(state.get(p) for p in unit.owned[: unit.num_trainable]):
            return None
        return self._flats.pop(unit)

    def views(
        self, p: torch.Tensor, names: tuple[str, ...], new: NewFlats
    ) -> dict[str, torch.Tensor]:
        """The states ``names`` of managed parameter ``p`` as views of its unit's flat
        buffers, making the buffers missing.

        Args:
            p: a trainable parameter of an offloaded unit (its engine knows its unit).
            names: the state names wanted.
            new: makes the missing buffers of a unit (the optimizer's ``_new_flats``).

        Returns:
            ``{name: view}``: of ``p``'s shape for a buffer of ``unit.trainable_numel``
            elements, else ``p``'s blocks, 1-D (parameters start on whole blocks,
            ``units.unit.ALIGN``; ``HostPrecision.state_view``).
        """
        engine = engine_of_param(p)
        unit = engine.unit_of(p)
        assert unit is not None
        flats = self._flats.setdefault(unit, {})
        missing = tuple(n for n in names if n not in flats)
        if missing:
            flats.update(new(unit, missing))
        k = next(i for i, q in enumerate(unit.owned) if q is p)
        off = unit.offsets[k]
        out = {}
        for n in names:
            flat = flats[n]
            if flat.numel() == unit.trainable_numel:
                out[n] = flat[off : off + p.numel()].view(p.shape)
            else:
                out[n] = format_of(unit).state_view(n, flat, off, off + p.numel())
        return out
