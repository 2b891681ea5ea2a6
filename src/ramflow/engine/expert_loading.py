"""Routed experts: a mixture-of-experts layer's experts cross PCIe only when the router
sends them tokens, wherever that leaves the result unchanged.

[Note: experts loaded by the router]
An MoE decoder layer is one unit, but its routed experts are slices of it that can move on
their own (see [Note: experts as slices of a unit] in ``ramflow.units.experts``). Where a
unit has such experts and is not kept on the device, its load (``DeviceWindow._issue_h2d``,
prefetch as usual) copies everything but the experts: attention, norms, the router, shared
experts. The layer's forward runs its router first and calls its experts module with the
chosen expert ids (``experts(hidden_states, top_k_index, top_k_weights)``); a forward
pre-hook on that module reads the ids (one small D2H copy and a host sync with the compute
stream per layer and call), copies the slices of the chosen experts that the device copy
lacks on the H2D stream, and makes the compute stream wait for that copy's event before
the experts' kernels. Slices loaded stay until the unit's next load, so the later tokens
of a prompt, or of ``generate``, reuse them while the unit stays in the window.

When only the chosen experts load (otherwise all of them do, as before):
- the experts' forward reads nothing else: the experts implementation is eager (indexes
  the experts hit), ``batched_mm`` (gathers the chosen rows) or ``grouped_mm`` (its groups
  of unchosen experts are empty). Any other (``deepgemm``, ``sonicmoe``, a hub kernel)
  loads every expert. ``tests/test_expert_loading.py`` fills the experts left out with NaN
  and checks that the logits are bit-identical, for each implementation;
- and no gradient is asked of the experts: a forward without grad (``torch.no_grad``,
  ``torch.inference_mode``, ``generate``), or experts that are not trained (frozen experts
  under LoRA). Trained experts load whole with their unit (prefetched, as before) when the
  load is issued under grad, in backward or by the host worker after a step
  (``DeviceWindow._slices_experts``): their backward writes every expert's gradient and the
  optimizer steps them all. A unit left in the window by a no-grad forward with some
  experts only gets the rest from the pre-hook of the next forward under grad.
A forward under grad that will be followed by a backward registers a hook on the experts'
output; its gradient arrives before the experts' backward runs (the unit is pinned for
backward by then, and possibly loaded again, without experts), and the hook loads the
experts of that call again where they are missing. Checkpointed recomputation goes through
the pre-hook like any forward.

Cost: the host waits for the GPU to finish the router before it can queue the layer's
experts, so the CPU no longer runs ahead of the GPU across MoE layers, and the copy of the
chosen experts (a few MB for Qwen3-30B-A3B at batch 1) sits between the router and the
experts with nothing to hide it; the next layer's non-expert weights still prefetch. At
batch 1 a token of Qwen3-30B-A3B chooses 8 of 128 experts per layer, so each layer moves
about 1/16 of its expert bytes; with long prompts most experts are chosen and the load
approaches the whole unit, in more, smaller copies.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..units.experts import ROUTED_IMPLEMENTATIONS, ExpertGroup, experts_implementation
from ..units.unit import Unit
from .schedule import in_backward
from .window import DeviceWindow

# where the experts' forward receives the router's choice: (position, keyword names)
_INDEX_POSITION = 1
_INDEX_KEYWORDS = ("top_k_index", "router_indices", "topk_indices", "selected_experts")


def chosen_experts(args: tuple, kwargs: dict, num_experts: int) -> list[int] | None:
    """The sorted distinct expert ids of an experts module's call, read on the host (a
    D2H copy and a sync with the compute stream on a GPU).

    Args:
        args, kwargs: the experts module's call, as a forward pre-hook gets them;
            transformers passes the router's top-k index, an integer tensor (tokens, k) on
            the device, second or by keyword.
        num_experts: the module's experts; ids outside ``[0, num_experts)`` (expert
            parallelism's sentinels) are dropped.

    Returns:
        The chosen ids, ascending; None when the call carries no integer index tensor where
        transformers puts it.
    """
    index = args[_INDEX_POSITION] if len(args) > _INDEX_POSITION else None
    if index is None:
        index = next((kwargs[k] for k in _INDEX_KEYWORDS if k in kwargs), None)
    if not isinstance(index, torch.Tensor) or index.is_floating_point():
        return None
    with torch.profiler.record_function("ramflow.router_choice"):
        ids = torch.unique(index).tolist()
    # ids out of range are expert parallelism's sentinels, which no expert reads
    return [i for i in ids if 0 <= i < num_experts]


class RoutedExperts:
    """The hooks that load a unit's experts by the router's choice, for one engine.

    Args:
        window: the device window (its ``load_experts`` copies the slices).
    """

    def __init__(self, *, window: DeviceWindow) -> None:
        self._window = window
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._units: list[Unit] = []
        # per experts module (by id): the experts each of its calls in flight loaded
        self._calls: dict[int, list[list[int] | None]] = {}

    def add_units(self, units: list[Unit]) -> None:
        """Hooks on the experts modules of new ``units`` that have sliceable experts."""
        for u in units:
            if u.expert_slices is None:
                continue
            self._units.append(u)
            for g in u.expert_slices.groups:
                self._hooks.append(
                    g.module.register_forward_pre_hook(
                        functools.partial(self._pre_forward, u, g), with_kwargs=True
                    )
                )
                self._hooks.append(
                    g.module.register_forward_hook(
                        functools.partial(self._post_forward, u, g), always_call=True
                    )
                )

    def count_units(self, units: list[Unit]) -> None:
        """Count the expert bytes of new ``units`` that load every expert (no hooks)."""
        self._units.extend(u for u in units if u.expert_slices is not None)

    def remove(self) -> None:
        """Take off every hook."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._calls.clear()

    def expert_bytes_loaded(self) -> int:
        """Bytes of routed experts copied H2D so far, over every unit (whole loads
        included; also with ``routed_experts=False``, for comparison)."""
        return sum(
            u.expert_slices.expert_elements_loaded * u.wire.element_size() for u in self._units
        )

    def _pre_forward(
        self, u: Unit, group: ExpertGroup, module: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        stack = self._calls.setdefault(id(module), [])
        if u.swaps == 0:
            stack.append(None)  # called outside the unit's forward: it reads host weights
            return
        experts = None
        if experts_implementation(module) in ROUTED_IMPLEMENTATIONS and (
            not torch.is_grad_enabled() or not group.trainable
        ):
            experts = chosen_experts(args, kwargs, group.num_experts)
        with torch.profiler.record_function(f"ramflow.experts:{u.name}"):
            self._window.load_experts(u, group, experts)
        stack.append(experts)

    def _post_forward(
        self, u: Unit, group: ExpertGroup, module: nn.Module, args: tuple, output: Any
    ) -> None:
        stack = self._calls.get(id(module))
        if not stack:
            return  # a hook before ours raised: our pre-forward never ran
        experts = stack.pop()
        if u.swaps == 0 or in_backward() or not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._before_backward, u, group, experts))

    def _before_backward(
        self, u: Unit, group: ExpertGroup, experts: list[int] | None, grad: torch.Tensor
    ) -> None:
        """The gradient of an experts call's output: its backward comes next and reads
        the experts that call loaded, which a reload for backward left out."""
        self._window.load_experts(u, group, experts)
