"""A mixture of experts' router logits, cut out of their layers for the unit-major step.

[Note: the router's auxiliary loss under the unit-major step]
transformers' MoE causal LMs (Qwen3-MoE, Mixtral, gpt-oss, Qwen2-MoE; DeepSeek-V3 records the
logits but has no auxiliary loss) add ``router_aux_loss_coef * load_balancing_loss_func(
outputs.router_logits, ...)`` to the loss when ``output_router_logits`` is on (Switch
Transformer's load-balancing loss, Fedus et al. 2021). The logits, one (tokens, experts)
tensor per MoE layer, leave the layers through transformers' output recorder: the base
model's ``_can_record_outputs["router_logits"]`` names the router class and the index of its
output that a forward hook appends to the base model's ``router_logits``. The loss thus
reads a tensor computed inside every layer past the layer's outputs, so its backward would
run through every layer's router before that layer's turn in the unit-major order (see
[Note: one weight pass per optimizer step] in ``engine.unit_major``).

``RouterLogits`` cuts them: a forward hook on each router hands the logits it outputs to
``UnitMajorStep.cut``, which keeps them with a detached leaf for the unit call now running,
and a forward hook on the base model puts the leaves in the place of the logits in its
output. The router's own use of its logits (softmax, top-k) keeps its graph inside the unit;
the auxiliary loss reads the leaves. ``loss.backward()`` then stops at the leaves, and the
pass that runs the layer's backward sends each leaf's gradient back into its logits, beside
the layer's output gradient: the router's weight gets the same two contributions as in the
ordinary graph (their sum is exact in either order, as two floating-point terms commute), so
the gradients equal an ordinary loop's up to the order of the sum over micro-batches, for
any loss that reads the recorded logits (the families' own, ``train.loss.lm_loss``, a
user's). Nothing here knows the loss's formula.

What it refuses: a base model whose recorded logits are not the tensors its routers output
(a family that post-processes them) is named in a one-line error at the forward; any other
tensor that leaves a unit past its outputs still fails at backward with
``UnitMajorStep``'s message. Cost: each cut keeps the logits and, from the loss's backward
to its layer's, their gradient, (tokens, experts) per MoE layer and micro-batch on the
device (a few per cent of a layer's boundary activation, hidden size against the number of
experts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ROUTER_LOGITS = "router_logits"


def _specs(base: nn.Module) -> list[tuple[type | None, str | None, int]]:
    """(router class, router class name, output index) of each recorder that
    ``base``'s ``_can_record_outputs`` lists under ``router_logits``, with transformers'
    defaults (a bare class or name records output 1)."""
    record = getattr(base, "_can_record_outputs", None)
    entry = record.get(ROUTER_LOGITS) if isinstance(record, dict) else None
    if entry is None:
        return []
    out = []
    for spec in entry if isinstance(entry, list) else [entry]:
        if isinstance(spec, str):
            out.append((None, spec, 1))
        elif isinstance(spec, type):
            out.append((spec, None, 1))
        else:  # transformers' OutputRecorder
            out.append((spec.target_class, spec.class_name, spec.index))
    return out


def _router_indices(base: nn.Module) -> list[tuple[nn.Module, int]]:
    """The routers under ``base`` whose output the recorder takes, each with the index it
    takes (a superset of transformers' own matching, which also checks ``layer_name``: a
    router matched here and not there is cut and never read, which changes nothing)."""
    specs = _specs(base)
    found = []
    for name, module in base.named_modules():
        for cls, class_name, index in specs:
            if (cls is not None and isinstance(module, cls)) or (
                class_name is not None and name.endswith(class_name)
            ):
                found.append((module, index))
                break
    return found


class RouterLogits:
    """The hooks that cut a model's recorded router logits out of their layers during a
    unit-major step. See [Note: the router's auxiliary loss under the unit-major step].

    Args:
        model: the model the step's loss function calls (a ``peft.PeftModel`` or another
            wrapper included); every module inside it whose ``_can_record_outputs`` lists
            ``router_logits`` is a base model whose routers are hooked.
    """

    def __init__(self, model: nn.Module) -> None:
        # the base models (the causal LM around one lists the same recorder: its hook
        # finds leaves already), and each router once
        self._bases = [m for m in model.modules() if _specs(m)]
        self._routers: dict[int, tuple[nn.Module, int]] = {}
        for base in self._bases:
            for router, index in _router_indices(base):
                self._routers.setdefault(id(router), (router, index))

    def __bool__(self) -> bool:
        return bool(self._routers)

    def install(
        self, cut: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook the routers and base models for one step; remove the handles after it.

        Args:
            cut: ``UnitMajorStep.cut``: takes logits computed in the unit call now running
                on this thread and returns the leaf that stands for them (None outside a
                micro-batch's forward, where nothing is cut).

        Returns:
            The hooks' handles.
        """
        leaves: dict[int, torch.Tensor] = {}  # id of the logits -> their leaf
        handles = []

        def on_router(index: int, module: nn.Module, args: tuple, output: Any) -> None:
            logits = output[index] if isinstance(output, tuple | list) else output
            if isinstance(logits, torch.Tensor) and logits.requires_grad:
                leaf = cut(logits)
                if leaf is not None:
                    leaves[id(logits)] = leaf

        def on_base(module: nn.Module, args: tuple, output: Any) -> None:
            recorded = getattr(output, ROUTER_LOGITS, None)
            if not isinstance(recorded, tuple) or not recorded:
                return
            swapped = []
            for t in recorded:
                if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf:
                    leaf = leaves.get(id(t))
                    if leaf is None:
                        raise RuntimeError(
                            f"ramflow.accumulate: {type(module).__name__}'s router_logits "
                            "are not the tensors its routers output, so the unit-major "
                            "step cannot cut them out of their layers: accumulate this "
                            "model with an ordinary loop (or turn output_router_logits off)"
                        )
                    t = leaf
                swapped.append(t)
            setattr(output, ROUTER_LOGITS, tuple(swapped))

        for base in self._bases:
            handles.append(base.register_forward_hook(on_base))
        for router, index in self._routers.values():
            handles.append(router.register_forward_hook(functools.partial(on_router, index)))
        return handles
