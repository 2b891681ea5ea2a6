"""What the step-time model needs to know about each unit of a real model.

``unit_shapes`` reads the module tree (meta tensors are fine: nothing is allocated): each
unit's parameter counts as the engine lays them out, the weights its forward multiplies
each token's activations with, its attention layers and the units whose tied parameters it
reads. ``unit_costs`` turns those into ``planner.predict.UnitCost`` for a micro-batch and a
GPU rate.

[Note: mixtures of experts count what a token reads]
A mixture-of-experts layer holds ``num_experts`` routed experts and sends each token to
``num_active`` of them (``ExpertRouting``, read from the Hugging Face config). Host RAM, disk
and PCIe move every expert, so a unit's ``numel`` counts them all; compute runs a token
through its active experts only, so ``matmul_params`` (the FLOPs' count) takes a routed
expert's weights at ``num_active / num_experts`` (a balanced router's mean). What else a token
reads counts whole: the router, the shared experts (``n_shared_experts``), and the dense MLPs
of the layers that have no experts (``first_k_dense_replace``, ``mlp_only_layers``,
``decoder_sparse_step``); these are read from the module tree, where they are ordinary
modules, not from the config's numbers. The routed experts are the modules named
``experts`` (or of a class named ``...Experts``) that hold ``num_experts`` experts: stacked
3-D weights of leading size ``num_experts`` (transformers 5's layout; their 2-D per-expert
biases are not matmul weights) or a list of ``num_experts`` expert modules.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from ..units.unit import ALIGN, UnitSpec, find_units, repeated_block_modules
from .predict import UnitCost, attention_flops, forward_flops, forward_seconds


@dataclass(frozen=True)
class UnitShape:
    """One unit as the step-time model sees it.

    Attributes:
        name: the unit's name (the plan's).
        numel: elements of the parameters it owns, padded as the engine lays them out.
        trainable_numel: the trainable prefix of those (what the optimizer steps).
        matmul_params: elements of the weights its forward multiplies each token's
            activations with (matrices outside embedding tables; tied weights read through
            slots count; routed experts at their active share: See [Note: mixtures of
            experts count what a token reads]).
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


_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_ACTIVE_COUNT_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


@dataclass(frozen=True)
class ExpertRouting:
    """How a mixture of experts routes each token. See [Note: mixtures of experts count what
    a token reads].

    Attributes:
        num_experts: routed experts in each sparse layer.
        num_active: routed experts each token goes through (the router's top-k).
    """

    num_experts: int
    num_active: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_active <= self.num_experts:
            raise ValueError(
                f"a token goes through {self.num_active} of {self.num_experts} experts: give "
                "1 <= experts per token <= experts"
            )

    @property
    def active_share(self) -> float:
        """The share of a layer's routed experts that one token runs through."""
        return self.num_active / self.num_experts

    @classmethod
    def from_config(cls, config: Any) -> ExpertRouting | None:
        """The routing a Hugging Face config describes (its text model's, for a multimodal
        one): the experts under ``num_experts``, ``n_routed_experts``, ``num_local_experts``
        or ``moe_num_experts``, the top-k under ``num_experts_per_tok``,
        ``num_experts_per_token`` or ``moe_topk``. None for a dense model (no such keys, or
        at most one expert) and for ``config=None``.

        Raises:
            ValueError: the config names experts but no top-k, or a top-k outside
                1..experts.
        """
        if config is None:
            return None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_experts = next(
            (getattr(text, k) for k in _EXPERT_COUNT_KEYS if getattr(text, k, None)), 0
        )
        if num_experts <= 1:
            return None
        top_k = next((getattr(text, k) for k in _ACTIVE_COUNT_KEYS if getattr(text, k, None)), None)
        if top_k is None:
            raise ValueError(
                f"the config has {num_experts} experts but no experts per token; set one of "
                f"{', '.join(_ACTIVE_COUNT_KEYS)}"
            )
        return cls(num_experts=int(num_experts), num_active=int(top_k))


def attention_width(config: Any) -> int:
    """The width attention's score and value products run over, summed over the query heads:
    ``num_attention_heads x head_dim`` (``head_dim`` from the config, else
    ``hidden_size / num_attention_heads``); with multi-head latent attention (DeepSeek's
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) the mean of the query-key and
    the value head widths, times the heads. ``planner.predict.attention_flops`` takes it as
    its ``hidden``.

    Args:
        config: a ``transformers`` model config (read with ``getattr``).

    Returns:
        The width in elements (an int).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    if getattr(text, "qk_nope_head_dim", None) is not None and getattr(text, "v_head_dim", None):
        qk = text.qk_nope_head_dim + text.qk_rope_head_dim
        return heads * (qk + text.v_head_dim) // 2
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads * head_dim


def _expert_modules(model: nn.Module, routing: ExpertRouting | None) -> dict[int, bool]:
    """id of every module inside a routed-experts module -> whether its weights are stacked
    per expert (3-D). See [Note: mixtures of experts count what a token reads]."""
    if routing is None:
        return {}
    found: dict[int, bool] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != "experts" and not type(module).__name__.endswith("Experts"):
            continue
        own = list(module.parameters(recurse=False))
        stacked = any(p.dim() >= 3 and p.shape[0] == routing.num_experts for p in own)
        listed = isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
            len(module) == routing.num_experts
        )
        if stacked or listed:
            for sub in module.modules():
                found[id(sub)] = stacked
    return found


def _weights(
    roots: Sequence[nn.Module], experts: dict[int, bool], share: float
) -> Iterator[tuple[nn.Parameter, int, int]]:
    """Each distinct parameter under ``roots`` once, with its elements that one token's
    forward reads (a routed expert's at ``share``) and, of those, the ones that multiply
    activations (0 for an embedding table, a norm or a bias)."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            stacked = experts.get(id(module))
            for p in module._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                active = p.numel() if stacked is None else round(p.numel() * share)
                matrix = p.dim() >= (3 if stacked else 2) and not isinstance(module, nn.Embedding)
                yield p, active, active if matrix else 0


@dataclass(frozen=True)
class ParameterCounts:
    """A model's parameters, in total and those one token's forward reads.

    Attributes:
        total: distinct parameter elements (a tied weight once): what host RAM, disk and
            PCIe hold and move.
        active: those a token reads: routed experts at ``num_active / num_experts``
            (equal to ``total`` for a dense model).
        active_matmul: the active weights that multiply activations (no embedding table,
            norm or bias).
        active_trained_matmul: those of them that are trained (``requires_grad``): a
            trained weight costs 6 FLOPs per token in a training step, a frozen one 4 (no
            weight gradient).
        routing: the experts' routing (None: dense).
    """

    total: int
    active: int
    active_matmul: int
    active_trained_matmul: int
    routing: ExpertRouting | None = None


def parameter_counts(
    model: nn.Module, *, routing: ExpertRouting | None | Literal["config"] = "config"
) -> ParameterCounts:
    """``ParameterCounts`` of ``model`` (meta tensors are fine).

    Args:
        model: any module; a Hugging Face model's ``config`` gives its routing.
        routing: an ``ExpertRouting``, None (count every expert), or ``"config"``:
            ``ExpertRouting.from_config(model.config)``.

    Returns:
        The ``ParameterCounts``: total and active (per token) parameters.
    """
    if routing == "config":
        routing = ExpertRouting.from_config(getattr(model, "config", None))
    experts = _expert_modules(model, routing)
    share = routing.active_share if routing is not None else 1.0
    total = active = matmul = trained = 0
    for p, a, m in _weights([model], experts, share):
        total += p.numel()
        active += a
        matmul += m
        trained += m if p.requires_grad else 0
    return ParameterCounts(
        total=total,
        active=active,
        active_matmul=matmul,
        active_trained_matmul=trained,
        routing=routing,
    )


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _attention_modules(module: nn.Module) -> int:
    """Modules named like attention that hold no attention module themselves."""
    found = [m for m in module.modules() if "attention" in type(m).__name__.lower()]
    ids = {id(m) for m in found}
    return sum(1 for m in found if not any(id(c) in ids for c in m.modules() if c is not m))


def unit_shapes(
    model: nn.Module,
    specs: Sequence[UnitSpec] | None = None,
    *,
    routing: ExpertRouting | None | Literal["config"] = "config",
) -> list[UnitShape]:
    """The units of ``model`` (``find_units``' rule unless ``specs`` are given), in order.

    Args:
        model: any module (meta tensors are fine).
        specs: the units' specs; None: ``find_units(model)``.
        routing: as for ``parameter_counts`` (default: the model's config's); the routed
            experts' ``matmul_params`` are their active share. See [Note: mixtures of
            experts count what a token reads].

    Returns:
        One ``UnitShape`` per unit, in forward order.
    """
    if routing == "config":
        routing = ExpertRouting.from_config(getattr(model, "config", None))
    experts = _expert_modules(model, routing)
    share = routing.active_share if routing is not None else 1.0
    specs = list(find_units(model)) if specs is None else list(specs)
    blocks = {id(m) for m in repeated_block_modules(model)}
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
        roots = [] if spec.rest else spec.modules
        for p, _, m in _weights(roots, experts, share):
            matmul += m
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

    Returns:
        One ``UnitCost`` per shape, same order (seconds and bytes per micro-batch).
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
