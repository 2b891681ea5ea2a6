"""Finding the units of a model: the groups of modules whose parameters move together.

A unit is usually one transformer block; embeddings, the final norm and the head are units
of their own. See ``find_units`` for the rule, and docs/design.md for why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class UnitSpec:
    """One unit as found in the module tree, before any memory is allocated.

    Attributes:
        name: dotted module path of the unit ("" for the root), for messages and plans.
        modules: the modules whose forward calls load the unit (hooks go on these).
        slots: every (module, parameter name) entry that the unit's forward reads, tied
            parameters of other units included.
        owned: the parameters this unit owns (one owner per parameter), trainable first.
        rest: True for the unit that gathers parameters held directly by modules that also
            contain blocks (kept resident; usually empty or tiny).
        master: a flat fp32 CPU tensor that already holds ``owned`` at the engine's offsets
            (``ramflow.Linear`` lays its parameters out so); it becomes the unit's master
            instead of a copy. None: the engine allocates one.
        wire: likewise a flat CPU tensor in the wire dtype to use as the wire copy (ranks of
            one host share it under ``ramflow.offload(..., zero_stage=...)``); it must hold
            the master's values already.
    """

    name: str
    modules: list[nn.Module]
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    owned: list[nn.Parameter] = field(default_factory=list)
    rest: bool = False
    master: torch.Tensor | None = None
    wire: torch.Tensor | None = None


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of the ModuleList/Sequential whose repeated same-class children hold the
    most parameters (e.g. Hugging Face decoder layers). Empty if no container repeats."""
    best: list[nn.Module] = []
    best_numel = 0
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in module.children():
            if any(True for _ in child.parameters()):
                by_class.setdefault(type(child), []).append(child)
        for children in by_class.values():
            if len(children) < 2:
                continue
            numel = sum(p.numel() for c in children for p in c.parameters())
            if numel > best_numel:
                best, best_numel = children, numel
    return best


def _contains(module: nn.Module, targets: set[int]) -> bool:
    return any(id(m) in targets for m in module.modules())


def _auto_units(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    blocks = {id(m) for m in _repeated_blocks(model)}
    if not blocks:
        # No repeated structure: each top-level child that holds parameters is a unit.
        blocks = {id(c) for c in model.children() if any(True for _ in c.parameters())}
    units: list[tuple[str, nn.Module]] = []
    rest_modules: list[nn.Module] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in blocks:
            units.append((prefix, module))
            return
        if not _contains(module, blocks):
            if any(True for _ in module.parameters()):
                units.append((prefix, module))
            return
        if any(True for _ in module.parameters(recurse=False)):
            rest_modules.append(module)
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return units, rest_modules


def _given_units(
    model: nn.Module, given: Iterable[nn.Module | str]
) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    by_name = dict(model.named_modules())
    units: list[tuple[str, nn.Module]] = []
    for item in given:
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"units: the model has no submodule named {item!r}")
            item = by_name[item]
        if not isinstance(item, nn.Module):
            raise TypeError(f"units: expected modules or module names, got {type(item).__name__}")
        if id(item) not in names:
            raise ValueError(f"units: {type(item).__name__} is not a submodule of the model")
        units.append((names[id(item)], item))
    ids = [id(m) for _, m in units]
    if len(set(ids)) != len(ids):
        raise ValueError("units: the same module is given twice")
    for name, module in units:
        inner = {id(m) for m in module.modules()} - {id(module)}
        for other_name, other in units:
            if id(other) in inner:
                raise ValueError(
                    f"units: {other_name!r} lies inside {name!r}; units must not nest. "
                    "Give the outer module or the inner ones, not both."
                )
    unit_ids = set(ids)
    covered = {id(p) for _, m in units for p in m.parameters()}
    rest_modules = []
    for module in model.modules():
        if id(module) in unit_ids:
            continue
        if any(id(p) not in covered for p in module.parameters(recurse=False)):
            rest_modules.append(module)
    return units, rest_modules


def find_units(model: nn.Module, units: Iterable[nn.Module | str] | None = None) -> list[UnitSpec]:
    """Split ``model`` into units and give every parameter exactly one owner unit.

    Rule (when ``units`` is None): the children of the ``nn.ModuleList``/``nn.Sequential``
    whose repeated same-class children hold the most parameters are the blocks (Hugging
    Face decoder/encoder layers, a stack of MLP blocks). Every other subtree that holds
    parameters but no block is a unit of its own (embeddings, final norm, head). Parameters
    held directly by a module that also contains blocks go to one "rest" unit.

    Tied or shared parameters (``lm_head.weight is embed_tokens.weight``) are owned by the
    first unit in module order that reads them; later units list them in ``slots`` only.

    Args:
        model: the module to split.
        units: optional modules (or dotted names) to use as units instead of the rule.

    Returns:
        The units in module order, the rest unit (if any) last.

    Raises:
        ValueError: a given unit is not a submodule, is given twice, or nests in another;
            a parameter is not floating point.
    """
    if units is None:
        found, rest_modules = _auto_units(model)
    else:
        found, rest_modules = _given_units(model, units)
    specs = [UnitSpec(name, [module]) for name, module in found]
    if rest_modules:
        specs.append(UnitSpec("<rest>", [model], rest=True))

    owner: dict[int, UnitSpec] = {}
    for spec in specs:
        seen: set[tuple[int, str]] = set()
        if spec.rest:
            sources = [(m, False) for m in rest_modules]
        else:
            sources = [(m, False) for m in spec.modules[0].modules()]
        for module, _ in sources:
            for pname, param in module._parameters.items():
                if param is None or (id(module), pname) in seen:
                    continue
                if spec.rest and id(param) in owner:
                    continue
                if not torch.is_floating_point(param):
                    raise ValueError(
                        f"parameter {pname!r} of {type(module).__name__} is {param.dtype}; "
                        "ramflow offloads floating-point parameters only"
                    )
                seen.add((id(module), pname))
                spec.slots.append((module, pname))
                if id(param) not in owner:
                    owner[id(param)] = spec
                    spec.owned.append(param)
        spec.owned.sort(key=lambda p: not p.requires_grad)
    return [s for s in specs if s.slots]
