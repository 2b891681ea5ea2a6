"""Units: finding them in a model (``find_units``) and their runtime record (``Unit``).

A unit is usually one transformer block; embeddings, the final norm and the head are units
of their own. See ``find_units`` for the rule, and docs/design.md for why.

Legend: N = a unit's flat element count (padded), T = its trainable prefix.

[Note: units and views]
Each unit owns one flat fp32 master buffer on the host (N,), one flat pinned wire buffer in
the wire dtype (N,) (the master itself when the dtypes agree), and one flat device tensor
(N,) whose storage is allocated while the unit is on the device and resized to zero while
it is not. The module's host parameters are views into the master; the device parameters
are tensors on the device tensor's storage, created once, each with its own version counter
(see [Note: one version counter per device parameter] in ``ramflow.engine.window``).
Autograd saves those device parameters for backward; because the storage object never
changes (only its allocation), a reload before backward makes every saved one valid again
(the trick of FSDP2's unsharded parameters). Copies into the device tensor go through a
second tensor on the same storage with its own version counter, so that a reload does not
trip autograd's in-place check.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import nn

from ..formats.frozen import compressed_nbytes, compresses, embedding_params
from ..kernels.lean_kernels import QBLOCK

# elements: every parameter's view starts on a multiple of the 8-bit optimizer states'
# block (256), which keeps views 512-byte aligned in fp32 and puts each parameter on whole
# blocks, so a parameter can be stepped on its own in every host format
ALIGN = QBLOCK


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


def _declared_block_classes(model: nn.Module) -> set[str]:
    """Class names the model declares as its repeated blocks: diffusers' ``_repeated_blocks``
    (``ModelMixin``, read by its ``compile_repeated_blocks``), e.g. Flux's
    ``["FluxTransformerBlock", "FluxSingleTransformerBlock"]``. Empty where none is declared."""
    declared = getattr(type(model), "_repeated_blocks", None)
    if not isinstance(declared, (list, tuple)):
        return set()
    return {name for name in declared if isinstance(name, str)}


def repeated_block_modules(model: nn.Module) -> list[nn.Module]:
    """Children of the ModuleList/Sequential whose repeated same-class children hold the
    most parameters (e.g. Hugging Face decoder layers). Empty if no container repeats.

    A model that declares its block classes (diffusers' ``_repeated_blocks``), the largest
    stack among them, gets every repeated child of those classes, in module order: a
    diffusion transformer has two
    stacks (Flux's double-stream ``transformer_blocks`` and single-stream
    ``single_transformer_blocks``), and the larger-stack rule would leave the other stack
    out of checkpointing policies and activation reports."""
    best: list[nn.Module] = []
    best_numel = 0
    declared = _declared_block_classes(model)
    stacks: list[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in module.children():
            if any(True for _ in child.parameters()):
                by_class.setdefault(type(child), []).append(child)
        for cls, children in by_class.items():
            if len(children) < 2:
                continue
            if cls.__name__ in declared:
                stacks.extend(children)
            numel = sum(p.numel() for c in children for p in c.parameters())
            if numel > best_numel:
                best, best_numel = children, numel
    if stacks and any(m is best[0] for m in stacks):
        return stacks
    return best


def _contains(module: nn.Module, targets: set[int]) -> bool:
    return any(id(m) in targets for m in module.modules())


def never_called(module: nn.Module) -> bool:
    """A container without a ``forward`` of its own (``nn.ModuleList``, ``nn.ModuleDict``,
    ``nn.ParameterList``...): its owner calls its children, never the container, so its
    forward hooks never fire and it cannot be a unit."""
    return type(module).forward is nn.Module.forward


def _auto_units(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    blocks = {id(m) for m in repeated_block_modules(model)}
    if not blocks:
        # No repeated structure: each top-level child that holds parameters is a unit.
        blocks = {id(c) for c in model.children() if any(True for _ in c.parameters())}
    units: list[tuple[str, nn.Module]] = []
    rest_modules: list[nn.Module] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if never_called(module):
            # its children are the units; parameters it holds itself go to the rest unit
            if any(True for _ in module.parameters(recurse=False)):
                rest_modules.append(module)
            for name, child in module.named_children():
                visit(f"{prefix}.{name}" if prefix else name, child)
            return
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
    # every name, those of a module the model holds at several places included
    by_name = dict(model.named_modules(remove_duplicate=False))
    units: list[tuple[str, nn.Module]] = []
    given_keys: set[object] = set()
    for item in given:
        key = item if isinstance(item, str) else id(item)
        if key in given_keys:
            raise ValueError("units: the same module is given twice")
        given_keys.add(key)
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"units: the model has no submodule named {item!r}")
            item = by_name[item]
        if not isinstance(item, nn.Module):
            raise TypeError(f"units: expected modules or module names, got {type(item).__name__}")
        if id(item) not in names:
            raise ValueError(f"units: {type(item).__name__} is not a submodule of the model")
        if never_called(item):
            name = names[id(item)] or "the model"
            raise ValueError(
                f"units: {name!r} is a {type(item).__name__}, a container that is never called "
                "itself (its owner calls its children), so ramflow could not see it run. Give "
                f"its children instead (e.g. {name + '.0'!r}), or leave units out."
            )
        if any(m is item for _, m in units):
            continue  # one module under two names (nn.ModuleList([b, b])): one unit
        units.append((names[id(item)], item))
    ids = [id(m) for _, m in units]
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


def find_units(
    model: nn.Module,
    units: Iterable[nn.Module | str] | None = None,
    *,
    skip: Iterable[nn.Parameter] = (),
) -> list[UnitSpec]:
    """Split ``model`` into units and give every parameter exactly one owner unit.

    Rule (when ``units`` is None): the children of the ``nn.ModuleList``/``nn.Sequential``
    whose repeated same-class children hold the most parameters are the blocks (Hugging
    Face decoder/encoder layers, a stack of MLP blocks); a diffusers model that declares
    its block classes (``_repeated_blocks``: Flux's double- and single-stream blocks) gets
    the children of all its stacks of them. Every other subtree that holds
    parameters but no block is a unit of its own (embeddings, final norm, head). Parameters
    held directly by a module that also contains blocks go to one "rest" unit. A container
    without a forward of its own (``nn.ModuleDict``, a ``nn.ModuleList`` of different
    classes) is never a unit: its owner calls its children, which become the units.

    Tied or shared parameters (``lm_head.weight is embed_tokens.weight``) are owned by the
    first unit in module order that reads them; later units list them in ``slots`` only.
    A module the model holds at several places (``nn.ModuleList([block, block])``, a
    block applied twice) is one unit, loaded by each of its calls, whether found by the
    rule or given under several of its names.

    Args:
        model: the module to split.
        units: optional modules (or dotted names) to use as units instead of the rule.
        skip: parameters that belong to no unit (kept on the device for good: see [Note:
            adapters on the device] in ``ramflow.engine.adapters``); a unit left with no
            parameter is dropped.

    Returns:
        The units in module order, the rest unit (if any) last.

    Raises:
        ValueError: a given unit is not a submodule, is given twice (the same object or
            name; the names of a module the model repeats are one unit), nests in another, or
            is a container without a forward (``nn.ModuleList``, ``nn.ModuleDict``); a
            parameter is not floating point.
    """
    if units is None:
        found, rest_modules = _auto_units(model)
    else:
        found, rest_modules = _given_units(model, units)
    specs = [UnitSpec(name, [module]) for name, module in found]
    if rest_modules:
        specs.append(UnitSpec("<rest>", [model], rest=True))

    skipped = {id(p) for p in skip}
    owner: dict[int, UnitSpec] = {}
    for spec in specs:
        seen: set[tuple[int, str]] = set()
        if spec.rest:
            sources = [(m, False) for m in rest_modules]
        else:
            sources = [(m, False) for m in spec.modules[0].modules()]
        for module, _ in sources:
            for pname, param in module._parameters.items():
                if param is None or (id(module), pname) in seen or id(param) in skipped:
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


def refuse_copy() -> NoReturn:
    """What ``copy.deepcopy`` and ``pickle`` of an engine, a unit or a hook do."""
    raise TypeError(
        "an offloaded model cannot be copied with copy.deepcopy or pickled (its weights live "
        "in ramflow's host store and its hooks belong to its engine). Deep-copy the model "
        "before ramflow.offload, save model.state_dict(), or call ramflow.undo(model) first. "
        "PEFT's modules_to_save copies the modules it names (copy.deepcopy) inside "
        "peft.get_peft_model: with modules_to_save, call get_peft_model before ramflow.offload."
    )


class Unit:
    """Runtime state of one unit. See [Note: units and views].

    One record per unit; each group of fields below is written by one part of the engine
    only (the others read it): the layout by the constructor, the host store by
    ``engine.host_store``, the device side by ``engine.window``, the gradients by ``engine.gradients``, the
    calls by ``engine.schedule`` and the device step by ``engine.device_stepper``. See docs/design.md.
    """

    def __deepcopy__(self, memo: dict) -> Unit:
        refuse_copy()

    def __reduce__(self) -> Any:
        refuse_copy()

    def __init__(self, index: int, spec: UnitSpec, *, frozen_format: str | None = None) -> None:
        # layout (fixed at construction): trainable parameters, then the frozen ones kept
        # in the master's dtype, then those compressed under ``frozen_format`` (see
        # [Note: compressed frozen weights] in ``ramflow.formats.frozen``)
        self.index = index
        self.name = spec.name
        self.rest = spec.rest
        self.modules = spec.modules
        self.frozen_format = frozen_format
        if frozen_format is None:
            self.owned = spec.owned
            self.num_kept = len(spec.owned)
        else:
            embeddings = embedding_params(spec.slots)
            self.owned = sorted(
                spec.owned, key=lambda p: (not p.requires_grad, compresses(p, embeddings))
            )
            self.num_kept = sum(1 for p in self.owned if not compresses(p, embeddings))
        self.num_trainable = sum(1 for p in spec.owned if p.requires_grad)
        self.offsets: list[int] = []
        n = 0
        self.kept_numel = 0
        for p in self.owned:
            self.offsets.append(n)
            n += -(-p.numel() // ALIGN) * ALIGN
            if len(self.offsets) == self.num_trainable:
                self.trainable_numel = n
            if len(self.offsets) == self.num_kept:
                self.kept_numel = n
        if self.num_trainable == 0:
            self.trainable_numel = 0
        self.numel = n
        self.resident = False
        self.other_deps: list[Unit] = []  # owners of tied parameters this unit reads
        # (module, name, host parameter, device parameter) for every slot the forward reads
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.orig_dtypes = [p.dtype for p in self.owned]
        self.given_master = spec.master
        self.given_wire = spec.wire
        self.owner: int | None = None  # the rank that steps this unit (ZeRO), None: every rank
        # host store (``engine.host_store``)
        self.master: torch.Tensor
        self.wire: torch.Tensor
        self.staging: torch.Tensor | None = None
        self.frozen: Any = None  # the compressed parameters' ``FrozenStore``, if any
        self.precision: Any = None  # the store's HostPrecision
        self.rounding_seed = 0  # the stochastic rounding's seed of this unit
        # device side (``engine.window``)
        self.device_flat: torch.Tensor
        self.device_alias: torch.Tensor
        self.device_params: list[nn.Parameter] = []
        self.allocated = False
        self.device_version = -1
        self.host_version = 0
        self.h2d_event: torch.cuda.Event | None = None
        # h2d_event follows a collective (an owner's broadcast): a forward polls it first
        self.load_follows_collective = False
        self.wire_read_event: torch.cuda.Event | None = None
        self.used_streams: set[torch.cuda.Stream] = set()
        self.idle_events: list[torch.cuda.Event] = []  # recorded when the last pin went
        self.pins = 0
        self.backward_pins = 0
        self.wire_ready = threading.Event()
        self.wire_ready.set()
        self.h2d_issued = threading.Event()
        self.h2d_issued.set()
        self.load_requested = False
        # the routed experts a load may leave out, and which the device copy holds (an
        # ``ExpertSlices``, None: loaded whole). See [Note: experts as slices of a unit] in
        # ``ramflow.units.experts``
        self.expert_slices: Any = None
        # gradients (``engine.gradients``)
        self.host_grad: torch.Tensor | None = None
        self.host_grad_views: list[torch.Tensor] = []
        # a deferred step's gradient in 8-bit codes (``formats.deferred_grad.CompactGradient``),
        # kept for the unit's life once made; holds a gradient while ``compact_grad.held``
        self.compact_grad: Any = None
        self.grad_versions: list[int] = []
        self.device_grad: torch.Tensor | None = None
        self.fired = 0
        self.dispatched_this_backward = False
        self.land_future: Future | None = None
        self.staging_reader: Future | None = None  # a step that reads the staging buffer
        # calls (``engine.schedule``): frames of forward calls, slot calls, swap depth
        self.call_stack: list[Any] = []
        self.slot_stack: list[tuple[nn.Module, bool]] = []
        self.swaps = 0
        # stepped on the device (``engine.device_stepper``, see [Note: the optimizer on the device])
        self.device_stepped = False
        self.device_state: dict[str, torch.Tensor] | None = None
        self.device_step_event: torch.cuda.Event | None = None
        self.host_stale = False  # the device state is newer than the host's copies
        # under ZeRO the weights of each device step are written back to the shared host
        # store at once (see [Note: the device optimizer under ZeRO] in ``engine.device_stepper``):
        # whether they were, and the event that ends the copies (None on the CPU)
        self.weights_written = False
        self.write_back_event: torch.cuda.Event | None = None
        self.device_step_pending = False
        # a device step that uploads the host gradients: their pinned buffer (kept for the
        # unit's life) and the event after which the upload has read it
        self.pinned_host_grad: torch.Tensor | None = None
        self.host_grad_read: torch.cuda.Event | None = None
        # a clip's coefficient that the unit's step applies to its host gradients, and their
        # version counters at the clip (see [Note: folding the clip into the step] in
        # ``engine.grad_scale``)
        self.grad_scale: float | None = None
        self.grad_scale_versions: list[int] = []

    @property
    def deps(self) -> list[Unit]:
        """The units a call of this one needs on the device: itself first, then the owners
        of tied parameters it reads (a property, so that a unit holds no cycle to itself)."""
        return [self, *self.other_deps]

    @property
    def nbytes(self) -> int:
        """Device bytes of the unit (its full flat tensor in the wire dtype)."""
        return self.numel * self.wire.element_size()

    @property
    def compressed(self) -> list[nn.Parameter]:
        """The parameters kept compressed (empty without a frozen format)."""
        return self.owned[self.num_kept :]

    def compressed_numels(self) -> list[int]:
        """The compressed parameters' padded element counts, in order."""
        ends = [*self.offsets[self.num_kept + 1 :], self.numel]
        return [end - off for off, end in zip(self.offsets[self.num_kept :], ends)]

    def packed_bytes(self, wire_dtype: torch.dtype) -> int:
        """Bytes of the compressed parameters (host buffer, device staging)."""
        fmt = self.frozen_format
        return sum(compressed_nbytes(fmt, n, wire_dtype) for n in self.compressed_numels())

    def h2d_bytes(self, wire_dtype: torch.dtype) -> int:
        """Bytes one load moves over PCIe: the kept elements in ``wire_dtype`` plus the
        compressed parameters' bytes."""
        return self.kept_numel * wire_dtype.itemsize + self.packed_bytes(wire_dtype)

    def views(
        self, flat: torch.Tensor, *, trainable_only: bool = False, kept_only: bool = False
    ) -> list[torch.Tensor]:
        """Views of ``flat`` shaped as the owned parameters: all of them (the device
        tensor), the trainable ones, or those kept uncompressed (a master of
        ``kept_numel``)."""
        if trainable_only:
            params = self.owned[: self.num_trainable]
        elif kept_only:
            params = self.owned[: self.num_kept]
        else:
            params = self.owned
        return [flat[off : off + p.numel()].view(p.shape) for off, p in zip(self.offsets, params)]

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r})"


def plan_inputs(units: list[Unit], wire_dtype: torch.dtype) -> dict[str, Any]:
    """What ``make_plan`` needs to know of the units: names, wire bytes, gradient bytes and
    which must stay resident (the engine's plan and ``ramflow plan``'s use the same)."""
    wire_size = torch.empty((), dtype=wire_dtype).element_size()
    return {
        "wire_dtype": str(wire_dtype).replace("torch.", ""),
        "unit_names": [u.name for u in units],
        "unit_bytes": [u.numel * wire_size for u in units],  # device bytes (the window)
        "unit_grad_bytes": [u.trainable_numel * wire_size for u in units],
        "always_resident": [u.rest for u in units],
    }
