"""The routed experts inside a unit: which ranges of its flat buffer each expert owns.

Legend: E = a layer's routed experts, N = the unit's flat element count.

[Note: experts as slices of a unit]
transformers keeps a mixture-of-experts layer's routed experts as fused parameters whose
first dimension is the expert (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), their
biases (E, ...)) in one experts module (``Qwen3MoeExperts``, ``MixtralExperts``,
``GptOssExperts``, ``DeepseekV3Experts``...). Each such parameter is one contiguous view of
its unit's flat buffer, so expert ``e``'s share of it is the contiguous range
``[offset + e * n, offset + (e + 1) * n)`` with ``n = numel / E``: one expert of one
parameter is one DMA. ``ExpertSlices`` holds those ranges for one unit, the ranges of
everything else that the unit's load copies (its "rest"), and which experts its device copy
holds now. Only parameters that the unit owns, keeps uncompressed (a compressed frozen
format copies whole parameters, see ``ramflow.formats.frozen``) and reads in no other module
are sliced; an experts module with any other parameter is left whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

# experts implementations (``config._experts_implementation``) that read only the experts
# the router chose: eager indexes ``gate_up_proj[e]`` for each expert hit, batched_mm
# gathers ``gate_up_proj[expert_ids]``, grouped_mm passes the whole tensor but its groups
# of unchosen experts are empty (no row of output depends on them). None: the class's own
# forward, eager. Others (deepgemm, sonicmoe, hub kernels) load every expert.
ROUTED_IMPLEMENTATIONS = frozenset({None, "eager", "batched_mm", "grouped_mm"})


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module: made by
    ``transformers.integrations.moe.use_experts_implementation`` (``has_gate``,
    ``is_transposed``, a ``config``) with an integer ``num_experts`` and a parameter whose
    first dimension is the expert."""
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or num < 2:
        return False
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "config")):
        return False
    return any(
        p is not None and p.dim() >= 1 and p.shape[0] == num for p in module._parameters.values()
    )


def experts_implementation(module: nn.Module) -> str | None:
    """The experts implementation ``module``'s forward dispatches to now (it may change
    with ``model.set_experts_implementation``)."""
    return getattr(module.config, "_experts_implementation", None)


@dataclass(eq=False)
class ExpertGroup:
    """The routed experts of one experts module inside a unit.

    Attributes:
        module: the experts module.
        num_experts: E.
        params: its parameters, each (E, ...), as the unit owns them (host parameters).
        ranges: (offset, elements per expert) of each parameter in the unit's flat buffer.
        loaded: the experts whose slices the unit's device copy holds now (window's).
        event: the H2D event of the last copy of its experts (None on the CPU), which every
            reader of them waits for (window's).
    """

    module: nn.Module
    num_experts: int
    params: list[nn.Parameter]
    ranges: list[tuple[int, int]]
    loaded: set[int] = field(default_factory=set)
    event: Any = None

    @property
    def trainable(self) -> bool:
        """Whether any of its parameters is trained (then a backward reads every expert's
        gradient slot, and a forward under grad loads them all)."""
        return any(p.requires_grad for p in self.params)

    def expert_numel(self) -> int:
        """Elements of one expert over all its parameters."""
        return sum(n for _, n in self.ranges)

    def runs(self, experts: list[int]) -> list[tuple[int, int]]:
        """Flat element ranges [lo, hi) that hold ``experts`` (sorted, distinct), one per
        parameter and run of consecutive experts."""
        out = []
        i = 0
        while i < len(experts):
            j = i
            while j + 1 < len(experts) and experts[j + 1] == experts[j] + 1:
                j += 1
            for off, n in self.ranges:
                out.append((off + experts[i] * n, off + (experts[j] + 1) * n))
            i = j + 1
        return out


@dataclass(eq=False)
class ExpertSlices:
    """The sliceable experts of one unit and the rest of what its load copies.

    Attributes:
        groups: one ``ExpertGroup`` per experts module, in module order.
        rest: flat element ranges [lo, hi) of the unit's kept elements outside every
            group's parameters (attention, norms, router, shared experts, padding).
        expert_elements_loaded: expert elements copied H2D so far (a counter for tests and
            benchmarks; times the wire's item size for bytes).
    """

    groups: list[ExpertGroup]
    rest: list[tuple[int, int]]
    expert_elements_loaded: int = 0

    def group_of(self, module: nn.Module) -> ExpertGroup | None:
        """The group of experts module ``module``, or None."""
        return next((g for g in self.groups if g.module is module), None)

    def forget(self) -> None:
        """The device copy holds no expert (a new load, or its storage went)."""
        for g in self.groups:
            g.loaded.clear()


def find_expert_slices(
    modules: list[nn.Module],
    owned: list[nn.Parameter],
    offsets: list[int],
    num_kept: int,
    kept_numel: int,
    slots: list[tuple[nn.Module, str]],
) -> ExpertSlices | None:
    """The experts of a unit whose layout is ``owned`` at ``offsets`` (its first
    ``num_kept`` parameters uncompressed, in ``kept_numel`` elements), found under its root
    ``modules``; ``slots`` are the (module, parameter name) entries the unit reads (a
    parameter read by another module too is not sliced). Returns None when the unit has none. See
    [Note: experts as slices of a unit]."""
    index = {id(p): i for i, p in enumerate(owned)}
    readers: dict[int, int] = {}
    for m, name in slots:
        p = m._parameters[name]
        readers[id(p)] = readers.get(id(p), 0) + 1
    groups: list[ExpertGroup] = []
    seen: set[int] = set()
    for root in modules:
        for m in root.modules():
            if id(m) in seen or not is_experts_module(m):
                continue
            seen.add(id(m))
            params = [p for p in m._parameters.values() if p is not None]
            num = m.num_experts
            ok = all(
                p.dim() >= 1
                and p.shape[0] == num
                and id(p) in index
                and index[id(p)] < num_kept
                and readers.get(id(p), 0) == 1
                for p in params
            )
            if not ok or _parametrized(m):
                continue
            ranges = [(offsets[index[id(p)]], p.numel() // num) for p in params]
            groups.append(ExpertGroup(m, num, params, ranges))
    if not groups:
        return None
    taken = sorted((off, off + n * g.num_experts) for g in groups for off, n in g.ranges)
    rest: list[tuple[int, int]] = []
    lo = 0
    for a, b in taken:
        if a > lo:
            rest.append((lo, a))
        lo = max(lo, b)
    if lo < kept_numel:
        rest.append((lo, kept_numel))
    return ExpertSlices(groups, rest)


def _parametrized(module: nn.Module) -> bool:
    """A parametrization (PEFT's LoRA on fused experts, ``torch.nn.utils.parametrize``)
    computes from the whole parameter: such a module is loaded whole."""
    return bool(getattr(module, "parametrizations", None))
