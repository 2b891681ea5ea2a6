"""Activation checkpointing policies for plain models: which blocks recompute their forward.

Activation checkpointing (Chen et al., 2016, "Training Deep Nets with Sublinear Memory
Cost") keeps only a block's inputs in forward and runs its forward again during backward to
rebuild what backward needs: activation memory falls from every block's activations to the
blocks' inputs plus one block's activations, for one more forward of the checkpointed blocks.

A policy is a small frozen dataclass that, given a model and its blocks, resolves to a
``CheckpointPlan``: the blocks to checkpoint, by name. ``apply_checkpointing`` installs the
plan with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` and returns a
handle that undoes it. Policies hold no model, so one policy serves many models:
``ramflow.offload(model, activation_checkpointing=policy)`` takes the same objects and
resolves them over the offloaded model's units (``resolve_over_units``).

Hugging Face models have their own switch, ``model.gradient_checkpointing_enable(
gradient_checkpointing_kwargs={"use_reentrant": False})``; wrapping their decoder layers
with ``apply_checkpointing`` works as well (``find_blocks`` finds them). Either way, train
with ``use_cache=False``: a key-value cache updated inside a checkpointed layer would be
updated again by the recomputation.

The same holds for any state a block's forward updates: the recomputation runs the forward
again in train mode (``torch.utils.checkpoint`` does not restore module state), so a
``BatchNorm`` inside a checkpointed block updates its running statistics twice per step
(``num_batches_tracked`` grows by 2, and the running mean and variance move twice).
Gradients are unaffected; the batch-norm buffers differ from a run without checkpointing.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from ..sizes import format_bytes, parse_bytes
from ..units.unit import repeated_block_modules
from .boundary_offload import BoundaryOffloader
from .report import ActivationReport

__all__ = [
    "CheckpointAll",
    "CheckpointEveryKth",
    "CheckpointHandle",
    "CheckpointOffload",
    "CheckpointPlan",
    "CheckpointPolicyLike",
    "CheckpointSegments",
    "CheckpointToBudget",
    "SelectiveCheckpoint",
    "apply_checkpointing",
    "find_blocks",
    "resolve_over_units",
]

Blocks = Sequence[tuple[str, nn.Module]]

# matrix products and fused attention: expensive to recompute, so selective checkpointing
# saves their outputs and recomputes the cheap pointwise ops around them
DEFAULT_SAVE_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


@dataclass(frozen=True)
class CheckpointPlan:
    """A resolved policy.

    Attributes:
        blocks: names of the checkpointed blocks, in block order.
        segments: for ``CheckpointSegments``, the groups of blocks that run as one
            checkpointed segment (``blocks`` is their union); empty otherwise.
        context_fn: the ``context_fn`` passed to ``torch.utils.checkpoint.checkpoint`` (the
            selective policy's), or None for full recomputation.
        offload_prefetch: 0 (default): the blocks' inputs stay on the device; n >= 1
            (``CheckpointOffload``): they go to pinned host memory in forward and come back
            in backward, n blocks ahead of their recomputation.
    """

    blocks: tuple[str, ...]
    segments: tuple[tuple[str, ...], ...] = ()
    context_fn: Callable[[], Any] | None = field(default=None, compare=False)
    offload_prefetch: int = 0


class CheckpointPolicyLike(Protocol):
    """What ``apply_checkpointing`` needs of a policy."""

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan: ...


@dataclass(frozen=True)
class CheckpointAll:
    """Checkpoint every block: least activation memory, one extra forward of every block."""

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        return CheckpointPlan(blocks=tuple(name for name, _ in blocks))


@dataclass(frozen=True)
class CheckpointEveryKth:
    """Checkpoint blocks 0, k, 2k, ... (in block order): about 1/k of the recomputation and
    of the activation savings of ``CheckpointAll``.

    Attributes:
        k: the stride, at least 1 (1 checkpoints every block).
    """

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"CheckpointEveryKth: k must be an int >= 1, got {self.k!r}")

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        return CheckpointPlan(
            blocks=tuple(name for i, (name, _) in enumerate(blocks) if i % self.k == 0)
        )


@dataclass(frozen=True)
class CheckpointToBudget:
    """Checkpoint the fewest blocks that bring the saved activations under a budget,
    using measured activation bytes.

    Checkpointing a block removes its saved activations but keeps its inputs, so it saves
    ``saved_bytes - input_bytes`` of ``report`` (``ramflow.memory.activation_report`` on the
    same model, inputs and batch size as training). Blocks are taken by that saving, largest
    first, until ``report.total_saved_bytes`` minus the savings is at most the budget. This is
    an estimate from one measured step: it does not count the one block's activations that
    exist again while it is recomputed during backward.

    Attributes:
        budget_bytes: the most bytes of saved activations to allow (an int, or a size such
            as ``"2GiB"``).
        report: the measured ``ActivationReport``.

    Raises (from ``resolve``):
        ValueError: the report has no row for a block (measure it on this model), or even
            checkpointing every block leaves more than the budget (lower the micro-batch or
            sequence length, or raise the budget).
    """

    budget_bytes: int | str
    report: ActivationReport = field(compare=False, repr=False)

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        budget = parse_bytes(self.budget_bytes, what="budget_bytes")
        total = self.report.total_saved_bytes
        savings = []
        for position, (name, _) in enumerate(blocks):
            try:
                row = self.report[name]
            except KeyError:
                raise ValueError(
                    f"CheckpointToBudget: the activation report has no row for block {name!r}; "
                    "measure it with activation_report on this model"
                ) from None
            savings.append((max(row.saved_bytes - row.input_bytes, 0), position, name))
        savings.sort(key=lambda s: (-s[0], s[1]))
        chosen: list[tuple[int, str]] = []
        for saving, position, name in savings:
            if total <= budget:
                break
            total -= saving
            chosen.append((position, name))
        if total > budget:
            raise ValueError(
                f"CheckpointToBudget: checkpointing every block still leaves about "
                f"{format_bytes(total)} of saved activations, over the budget of "
                f"{format_bytes(budget)}; lower the micro-batch or sequence length, or raise "
                "the budget"
            )
        return CheckpointPlan(blocks=tuple(name for _, name in sorted(chosen)))


@dataclass(frozen=True)
class CheckpointSegments:
    """Split the blocks into ``num_segments`` runs and checkpoint each run but the last as
    one region, as ``torch.utils.checkpoint.checkpoint_sequential`` does (and through it):
    only the segments' inputs are kept, and backward recomputes one segment at a time.

    The blocks must be all the children, in order, of one ``nn.Sequential`` that keeps
    ``nn.Sequential``'s own ``forward`` (the chain ``checkpoint_sequential`` runs); for
    blocks a model's own loop calls (Hugging Face layers, a subclass with its own
    ``forward``) use ``CheckpointAll`` or ``CheckpointEveryKth``.

    Attributes:
        num_segments: how many segments, 1 to the number of blocks. Segments have
            ``len(blocks) // num_segments`` blocks; the last takes the rest and is not
            checkpointed.

    Raises (from ``resolve``):
        ValueError: the blocks are not the children of one ``nn.Sequential``, that
            ``nn.Sequential`` is a subclass overriding ``forward``, or ``num_segments`` is
            out of range.
    """

    num_segments: int

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        sequential_parent(model, blocks)
        n = len(blocks)
        if (
            not isinstance(self.num_segments, int)
            or isinstance(self.num_segments, bool)
            or not 1 <= self.num_segments <= n
        ):
            raise ValueError(
                f"CheckpointSegments: num_segments must be between 1 and the {n} blocks, "
                f"got {self.num_segments!r}"
            )
        size = n // self.num_segments
        names = [name for name, _ in blocks]
        segments = tuple(
            tuple(names[start : start + size])
            for start in range(0, size * (self.num_segments - 1), size)
        )
        return CheckpointPlan(
            blocks=tuple(name for segment in segments for name in segment), segments=segments
        )


def _saving_policy(
    save_ops: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    if op.overloadpacket in save_ops:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class SelectiveCheckpoint:
    """Selective activation checkpointing: in the blocks that ``within`` names, save the
    outputs of matrix products and fused attention and recompute the pointwise ops (norms,
    activations, residual adds) in backward. Less recomputation than full checkpointing for
    some more memory (PyTorch docs: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``,
    and the PyTorch blog post "Current and New Activation Checkpointing Techniques").

    Attributes:
        within: the policy choosing the blocks (default: all).
        save_ops: names of ``torch.ops.aten`` operators whose outputs are saved (default:
            ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and the fused SDPA kernels); every other
            operator is recomputed. Names this PyTorch does not have are ignored.
    """

    within: CheckpointPolicyLike = field(default_factory=CheckpointAll)
    save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        plan = self.within.resolve(model, blocks)
        if plan.segments:
            raise ValueError(
                "SelectiveCheckpoint: 'within' must choose single blocks, not segments; use "
                "CheckpointAll or CheckpointEveryKth"
            )
        ops = frozenset(
            getattr(torch.ops.aten, n) for n in self.save_ops if hasattr(torch.ops.aten, n)
        )
        policy_fn = functools.partial(_saving_policy, ops)
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
        return CheckpointPlan(blocks=plan.blocks, context_fn=context_fn)


@dataclass(frozen=True)
class CheckpointOffload:
    """Activation offload: checkpoint the blocks that ``within`` chooses, and keep their
    inputs (the one tensor per block that checkpointing still holds on the device) in pinned
    host memory instead; backward copies each back one block ahead of its recomputation
    (ZeRO-Infinity's activation checkpoint offload, Rajbhandari et al. 2021). Device
    memory falls by the checkpointed blocks' inputs for one D2H and one H2D of each per
    step, on side streams. See [Note: offloaded checkpoint boundaries] in
    ``ramflow.activations.boundary_offload``.

    It wraps another policy (as ``SelectiveCheckpoint`` does) rather than being a flag on
    each one: what to recompute and where the inputs live are separate choices, and one
    wrapper composes with every block-choosing policy, custom ones included.

    Attributes:
        within: the policy choosing the blocks (default ``CheckpointAll()``); it must
            choose single blocks (``CheckpointSegments`` is refused: its last segment runs
            plainly, and its saved tensors would be offloaded too). A selective policy's
            ``context_fn`` is kept.
        prefetch: boundaries copied back ahead of the block being recomputed (default 1).

    Raises (from ``resolve``):
        ValueError: ``within`` chose segments, or ``prefetch`` is not an int >= 1.
    """

    within: CheckpointPolicyLike = field(default_factory=CheckpointAll)
    prefetch: int = 1

    def __post_init__(self) -> None:
        if (
            not isinstance(self.prefetch, int)
            or isinstance(self.prefetch, bool)
            or self.prefetch < 1
        ):
            raise ValueError(
                f"CheckpointOffload: prefetch must be an int >= 1, got {self.prefetch!r}"
            )

    def resolve(self, model: nn.Module, blocks: Blocks) -> CheckpointPlan:
        plan = self.within.resolve(model, blocks)
        if not isinstance(plan, CheckpointPlan):
            return plan  # _checked_plan names the policy that returned it
        if plan.segments:
            raise ValueError(
                "CheckpointOffload: 'within' must choose single blocks, not segments; use "
                "CheckpointAll, CheckpointEveryKth, CheckpointToBudget or SelectiveCheckpoint"
            )
        return CheckpointPlan(
            blocks=plan.blocks, context_fn=plan.context_fn, offload_prefetch=self.prefetch
        )


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, named: the children of the ``nn.ModuleList`` or
    ``nn.Sequential`` whose repeated same-class children hold the most parameters (Hugging
    Face decoder layers, a stack of MLP blocks), or every stack of the block classes a
    diffusers model declares (Flux's two), the rule ``ramflow.offload`` uses for units.

    Raises:
        ValueError: the model has no repeated blocks; pass ``blocks=`` to
            ``apply_checkpointing``.
    """
    found = {id(m) for m in repeated_block_modules(model)}
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (children of a ModuleList or "
            "Sequential of one class); pass blocks=[...] (modules or dotted names)"
        )
    return [(name, m) for name, m in model.named_modules() if id(m) in found]


def _given_blocks(
    model: nn.Module, blocks: Iterable[nn.Module | str]
) -> list[tuple[str, nn.Module]]:
    by_name = dict(model.named_modules())
    names = {id(m): n for n, m in by_name.items()}
    out = []
    for item in blocks:
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"blocks: the model has no submodule named {item!r}")
            out.append((item, by_name[item]))
        elif isinstance(item, nn.Module):
            if id(item) not in names:
                raise ValueError(f"blocks: {type(item).__name__} is not a submodule of the model")
            out.append((names[id(item)], item))
        else:
            raise TypeError(f"blocks: expected modules or dotted names, got {type(item).__name__}")
    if len({id(m) for _, m in out}) != len(out):
        raise ValueError("blocks: the same module is given twice")
    return out


def sequential_parent(model: nn.Module, blocks: Blocks) -> nn.Sequential:
    """The ``nn.Sequential`` whose children, in order, are exactly ``blocks``, and whose
    ``forward`` is ``nn.Sequential``'s own (it runs the children one after another, which is
    what segmented checkpointing replaces it with).

    Raises:
        ValueError: there is none (the blocks sit in a ``ModuleList``, or the
            ``nn.Sequential`` has other children as well), or the parent is a subclass
            that overrides ``forward`` (a residual stack, extra inputs): running its
            children in a chain would compute another function.
    """
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    parent = model.get_submodule(parents.pop()) if len(parents) == 1 else None
    if not isinstance(parent, nn.Sequential) or [id(c) for c in parent] != [
        id(m) for _, m in blocks
    ]:
        raise ValueError(
            "CheckpointSegments needs blocks that are all the children, in order, of one "
            "nn.Sequential; use CheckpointAll or CheckpointEveryKth for other models"
        )
    if type(parent).forward is not nn.Sequential.forward:
        raise ValueError(
            f"CheckpointSegments: {type(parent).__name__} overrides nn.Sequential.forward, "
            "and segmented checkpointing would run its children in a plain chain instead, "
            "computing another function; use CheckpointAll or CheckpointEveryKth, which keep "
            "the model's own forward and checkpoint each block"
        )
    return parent


def _checkpointed_forward(
    original: Callable, context_fn: Callable | None, offloader: BoundaryOffloader | None
) -> Callable:
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)  # nothing is saved, nothing to recompute
        if offloader is None:
            return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)
        with offloader.saving():  # See [Note: offloaded checkpoint boundaries]
            return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)

    return forward


def _segmented_forward(original: Callable, parent: nn.Sequential, num_segments: int) -> Callable:
    def forward(input: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(input)
        return checkpoint_sequential(parent, num_segments, input, use_reentrant=False)

    return forward


def checkpointed_unit_forward(
    module_ref: weakref.ref,
    forward: Callable[..., Any],
    call_swapped: Callable[..., Any],
    context_fn: Callable[[], Any] | None,
    offloader: BoundaryOffloader | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """An offloaded unit's forward under ``torch.utils.checkpoint`` (non-reentrant, with a
    policy's ``context_fn`` for selective checkpointing), installed in the unit's module by
    ``ramflow.engine.checkpointer``: ``forward`` is the module class's own, and
    ``call_swapped(forward, module, *args, **kwargs)`` runs it with the unit's device
    parameters in its module slots (the recomputation does not pass the unit's hooks). With
    ``offloader`` the unit's input goes to pinned host memory: see [Note: offloaded
    checkpoint boundaries] in ``ramflow.activations.boundary_offload``."""
    module = module_ref()
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    if offloader is None:
        return checkpoint(
            call_swapped, forward, module, *args, use_reentrant=False, **extra, **kwargs
        )
    # call_swapped, forward and module are not tensors: only the unit's tensor inputs
    # are saved through the offloader's hooks
    with offloader.saving():
        return checkpoint(
            call_swapped, forward, module, *args, use_reentrant=False, **extra, **kwargs
        )


def segmented_unit_forward(
    parent_ref: weakref.ref,
    run_segment: Callable[..., Any],
    segments: tuple[tuple[int, int], ...],
    input: Any,
) -> Any:
    """An ``nn.Sequential``'s forward with the children ``start:stop`` of each segment run
    as one checkpointed region (as ``torch.utils.checkpoint.checkpoint_sequential``), the
    other children plainly; ``run_segment(start, stop, input)`` runs one segment (in the
    recomputation with its units' device parameters in place). See [Note: checkpointed
    segments of units] in ``ramflow.engine.checkpointer``."""
    parent = parent_ref()
    if not torch.is_grad_enabled():
        return type(parent).forward(parent, input)
    children = list(parent)
    done = 0
    for start, stop in segments:
        for child in children[done:start]:
            input = child(input)
        input = checkpoint(run_segment, start, stop, input, use_reentrant=False)
        done = stop
    for child in children[done:]:
        input = child(input)
    return input


class CheckpointHandle:
    """Checkpointing installed by ``apply_checkpointing``; ``undo()`` removes it.

    Attributes:
        plan: the resolved ``CheckpointPlan``.
        offloader: the ``BoundaryOffloader`` of a ``CheckpointOffload`` policy (its
            ``stats`` count the copies), or None.
    """

    def __init__(
        self,
        plan: CheckpointPlan,
        wrapped: list[nn.Module],
        offloader: BoundaryOffloader | None = None,
    ) -> None:
        self.plan = plan
        self.offloader = offloader
        self._wrapped = wrapped

    @property
    def active(self) -> bool:
        return bool(self._wrapped)

    def undo(self) -> None:
        """Give the wrapped modules their own forward back (a second call does nothing)."""
        for module in self._wrapped:
            del module.forward
        self._wrapped = []


def apply_checkpointing(
    model: nn.Module,
    policy: CheckpointPolicyLike,
    *,
    blocks: Iterable[nn.Module | str] | None = None,
) -> CheckpointHandle:
    """Checkpoint the blocks that ``policy`` chooses, on ``torch.utils.checkpoint`` (non-reentrant).

    Each chosen block's ``forward`` is replaced (an instance attribute, so hooks on the
    block keep working) by one that runs the original under ``checkpoint(...,
    use_reentrant=False)``; under ``torch.no_grad`` it runs the original directly.
    ``CheckpointSegments`` wraps the parent ``nn.Sequential`` instead. The model's outputs
    and gradients are unchanged; backward runs the chosen blocks' forward again
    (Chen et al., 2016), in train mode, so state a forward updates is updated twice: a
    ``BatchNorm`` in a checkpointed block updates its running statistics twice per step,
    and a key-value cache must be off (``use_cache=False``).

    Args:
        model: any ``nn.Module``, on any device.
        policy: ``CheckpointAll()``, ``CheckpointEveryKth(k)``, ``CheckpointToBudget(...)``,
            ``CheckpointSegments(n)``, ``SelectiveCheckpoint(...)``, ``CheckpointOffload(...)``
            (the chosen blocks' inputs in pinned host memory) or an object with the same
            ``resolve(model, blocks) -> CheckpointPlan`` method.
        blocks: the blocks to choose from, as modules or dotted names, in execution order.
            Default: ``find_blocks(model)``.

    Returns:
        A ``CheckpointHandle``; ``handle.plan.blocks`` names the checkpointed blocks and
        ``handle.undo()`` restores the model.

    Raises:
        ValueError: no blocks are found or given, a given block is not in the model, the
            policy cannot resolve (see each policy) or chose names that are not among the
            blocks, or a chosen module's ``forward`` is already replaced (checkpointed
            before, or offloaded with checkpointing: undo that first).
        TypeError: the policy's ``resolve`` did not return a ``CheckpointPlan``.
    """
    found = find_blocks(model) if blocks is None else _given_blocks(model, blocks)
    if not found:
        raise ValueError("apply_checkpointing: no blocks given")
    plan = _checked_plan(
        policy,
        policy.resolve(model, found),
        found,
        who=f"apply_checkpointing: {policy!r}",
        where="blocks",
    )
    by_name = dict(found)
    offloader = BoundaryOffloader(prefetch=plan.offload_prefetch) if plan.offload_prefetch else None
    if plan.segments:
        if offloader is not None:
            raise ValueError(
                f"apply_checkpointing: {policy!r} asks to offload the inputs of segments; "
                "offload single blocks (CheckpointOffload refuses segments)"
            )
        parent = sequential_parent(model, found)
        targets = [(parent, _segmented_forward(parent.forward, parent, len(plan.segments) + 1))]
    else:
        targets = [
            (
                by_name[name],
                _checkpointed_forward(by_name[name].forward, plan.context_fn, offloader),
            )
            for name in plan.blocks
        ]
    for module, _ in targets:
        if "forward" in module.__dict__:
            raise ValueError(
                f"apply_checkpointing: {type(module).__name__}.forward is already replaced "
                "(checkpointed before, or by ramflow.offload); undo that first"
            )
    for module, forward in targets:
        module.forward = forward
    return CheckpointHandle(plan, [module for module, _ in targets], offloader)


def _checked_plan(
    policy: CheckpointPolicyLike, plan: Any, blocks: Blocks, *, who: str, where: str
) -> CheckpointPlan:
    """``plan``, which ``policy.resolve`` returned, checked against the ``blocks`` it was
    given (a custom policy's mistakes become clear errors here, not a KeyError later).

    Raises:
        TypeError: ``plan`` is not a ``CheckpointPlan``.
        ValueError: it names blocks, or segments of blocks, that are not among ``blocks``.
    """
    if not isinstance(plan, CheckpointPlan):
        raise TypeError(
            f"{type(policy).__name__}.resolve returned {type(plan).__name__}, not a "
            "CheckpointPlan; return CheckpointPlan(blocks=(names...))"
        )
    names = [name for name, _ in blocks]
    chosen = {*plan.blocks, *(name for segment in plan.segments for name in segment)}
    unknown = sorted(chosen - set(names), key=str)
    if unknown:
        raise ValueError(
            f"{who} chose {unknown}, which are not {where}; the names to choose from: {names}"
        )
    return plan


def resolve_over_units(
    policy: CheckpointPolicyLike, model: nn.Module, units: Blocks
) -> CheckpointPlan:
    """Resolve ``policy`` over the units of an offloaded model (``ramflow.offload``).

    The policy chooses among the units that are the model's repeated blocks (the rule of
    ``find_blocks``, so a policy names the same blocks on the plain and the offloaded model);
    where no unit is one (``offload(units=...)`` given, or a model without repeated blocks),
    it chooses among all ``units``.

    Args:
        policy: a checkpointing policy (``CheckpointAll()``, ``CheckpointEveryKth(k)``,
            ``CheckpointToBudget(...)``, ``CheckpointSegments(n)``,
            ``SelectiveCheckpoint(...)``, or an object with their ``resolve`` method).
        model: the offloaded model.
        units: the units that can be checkpointed, named, in unit (execution) order: each
            one module, not the model itself.

    Returns:
        The ``CheckpointPlan``; its ``blocks`` are unit names.

    Raises:
        ValueError: there is no unit to choose from (the whole model is one unit: give
            ``offload(units=...)``), the policy cannot resolve on this model (see each
            policy), or it names modules that are not units, or segments that are not runs
            of consecutive children of one ``nn.Sequential``.
        TypeError: ``resolve`` did not return a ``CheckpointPlan``.
    """
    if not units:
        raise ValueError(
            f"activation_checkpointing={policy!r}: the offloaded {type(model).__name__} has "
            "no unit to checkpoint (the whole model is one unit); give offload(units=[...]) "
            "to split it"
        )
    repeated = {id(m) for m in repeated_block_modules(model)}
    blocks = [(name, m) for name, m in units if id(m) in repeated] or list(units)
    plan = _checked_plan(
        policy,
        policy.resolve(model, blocks),
        blocks,
        who=f"activation_checkpointing={policy!r}",
        where="units of the offloaded model",
    )
    if plan.segments:
        parent = sequential_parent(model, blocks)
        position = {id(child): i for i, child in enumerate(parent)}
        by_name = dict(blocks)
        for segment in plan.segments:
            at = [position[id(by_name[name])] for name in segment]
            if not at or at != list(range(at[0], at[0] + len(at))):
                raise ValueError(
                    f"activation_checkpointing={policy!r}: the segment {list(segment)} is not "
                    "a run of consecutive children of the nn.Sequential"
                )
    return plan


def is_checkpoint_policy(value: Any) -> bool:
    """True for a checkpointing policy of ``ramflow.memory`` (anything with ``resolve``)."""
    return callable(getattr(value, "resolve", None))


def checkpointing_choice(value: Any) -> bool | tuple[str, ...] | CheckpointPolicyLike:
    """``offload``'s ``activation_checkpointing`` checked and made plain, before anything
    changes: a bool, a policy, or unit names as a tuple (a generator is read once).

    Raises:
        TypeError: anything else (the message lists what is accepted).
    """
    if isinstance(value, bool) or is_checkpoint_policy(value):
        return value
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable):
        names = tuple(value)
        if all(isinstance(n, str) for n in names):
            return names
    raise TypeError(
        "activation_checkpointing takes True/False, unit names (e.g. ['model.layers.3']) or a "
        "policy of ramflow.memory (CheckpointAll(), CheckpointEveryKth(k), CheckpointToBudget"
        "(...), CheckpointSegments(n), SelectiveCheckpoint(...), CheckpointOffload(...)); "
        f"got {value!r}"
    )
