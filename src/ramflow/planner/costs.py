"""What the step-time model needs to know about each unit of a real model.

``unit_shapes`` reads the module tree (meta tensors are fine: nothing is allocated): each
unit's parameter counts as the engine lays them out, the weights its forward multiplies
activations with, its attention layers and the units whose tied parameters it reads.
``unit_costs`` turns those into ``planner.predict.UnitCost`` for a micro-batch and a GPU rate.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn

from ..units.unit import _ALIGN, UnitSpec, _repeated_blocks, find_units
from .predict import UnitCost, attention_flops, forward_flops, forward_seconds


@dataclass(frozen=True)
class UnitShape:
    """One unit as the step-time model sees it.

    Attributes:
        name: the unit's name (the plan's).
        numel: elements of the parameters it owns, padded as the engine lays them out.
        trainable_numel: the trainable prefix of those (what the optimizer steps).
        matmul_params: elements of the weights its forward multiplies activations with
            (matrices outside embedding tables; tied weights read through slots count).
        attention_layers: attention modules in the unit.
        block: one of the repeated blocks (what activation checkpointing recomputes).
        rest: the rest unit (always resident).
        deps: indices of the units that own tied parameters it reads.
    """

    name: str
    numel: int
    trainable_numel: int
    matmul_params: int
    attention_layers: int
    block: bool
    rest: bool
    deps: tuple[int, ...] = ()


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _attention_modules(module: nn.Module) -> int:
    """Modules named like attention that hold no attention module themselves."""
    found = [m for m in module.modules() if "attention" in type(m).__name__.lower()]
    ids = {id(m) for m in found}
    return sum(1 for m in found if not any(id(c) in ids for c in m.modules() if c is not m))


def unit_shapes(model: nn.Module, specs: Sequence[UnitSpec] | None = None) -> list[UnitShape]:
    """The units of ``model`` (``find_units``' rule unless ``specs`` are given), in order."""
    specs = list(find_units(model)) if specs is None else list(specs)
    blocks = {id(m) for m in _repeated_blocks(model)}
    owner = {id(p): k for k, s in enumerate(specs) for p in s.owned}
    shapes = []
    for k, spec in enumerate(specs):
        numel = trainable = 0
        for p in spec.owned:
            numel += _padded(p.numel())
            if p.requires_grad:
                trainable = numel
        matmul = 0
        deps: list[int] = []
        seen: set[int] = set()
        roots = [] if spec.rest else spec.modules
        for root in roots:
            for module in root.modules():
                for p in module._parameters.values():
                    if p is None or id(p) in seen:
                        continue
                    seen.add(id(p))
                    if p.dim() >= 2 and not isinstance(module, nn.Embedding):
                        matmul += p.numel()
                    o = owner.get(id(p))
                    if o is not None and o != k and o not in deps:
                        deps.append(o)
        shapes.append(
            UnitShape(
                name=spec.name,
                numel=numel,
                trainable_numel=trainable,
                matmul_params=matmul,
                attention_layers=sum(_attention_modules(m) for m in roots),
                block=any(id(m) in blocks for m in spec.modules),
                rest=spec.rest,
                deps=tuple(deps),
            )
        )
    return shapes


def unit_costs(
    shapes: Sequence[UnitShape],
    *,
    batch: int,
    seq: int,
    hidden: int,
    wire_itemsize: int,
    matmul_flops_per_s: float,
    mode: str = "train",
    resident: Collection[str] = (),
    checkpointed: Collection[str] = (),
    offload_bytes: int = 0,
    causal: bool = False,
) -> list[UnitCost]:
    """``UnitCost`` of each unit for a ``batch`` x ``seq`` micro-batch.

    Args:
        shapes: from ``unit_shapes``.
        batch, seq: the micro-batch (sequences, tokens per sequence).
        hidden: the width that attention's score and value products run over (the model
            width for multi-head attention).
        wire_itemsize: bytes per element on the wire (2 for bf16).
        matmul_flops_per_s: the GPU's measured (or assumed) bf16 matmul rate, FLOP/s.
        mode: ``"train"`` or ``"infer"`` (the calibrated efficiency differs).
        resident, checkpointed: unit names.
        offload_bytes: under activation offload, the bytes of each checkpointed block's
            input that go to host memory and back every step (0: no offload).
        causal: the attention is causal (a decoder LM's): its products count half the
            square (``planner.predict.attention_flops``). Default False: the full square.
    """
    out = []
    for s in shapes:
        flops = forward_flops(
            s.matmul_params,
            batch=batch,
            seq=seq,
            attention_layers=s.attention_layers,
            hidden=hidden,
            causal=causal,
        )
        attention = attention_flops(
            batch=batch, seq=seq, attention_layers=s.attention_layers, hidden=hidden, causal=causal
        )
        out.append(
            UnitCost(
                name=s.name,
                wire_bytes=s.numel * wire_itemsize,
                trainable_params=s.trainable_numel,
                forward_s=forward_seconds(flops, matmul_flops_per_s, mode=mode),
                resident=s.rest or s.name in resident,
                checkpointed=s.name in checkpointed,
                deps=s.deps,
                offload_bytes=offload_bytes if s.block and s.name in checkpointed else 0,
                attention_s=forward_seconds(attention, matmul_flops_per_s, mode=mode),
            )
        )
    return out
