"""Memory plans of language models without allocating them: GPU, CPU RAM and disk.

The figures are ``ramflow.memory.estimate_memory``'s; this module builds the model on the
meta device, measures its activations there and adds the step-time prediction.

Legend: B = sequences per micro-batch, T = tokens per sequence, N = B * T, H = hidden
size, V = vocabulary size, L = decoder layers.

[Note: measuring activations on the meta device]
Activations are measured rather than derived from a formula: the decoder's pieces run on
meta tensors of the real (B, T) shapes in the compute dtype, and a ``saved_tensors_hooks``
pair adds up the bytes of every distinct storage autograd saves for backward (weights
excluded). Meta tensors have no fused attention kernel, so a ``TorchFunctionMode`` stands
in for ``scaled_dot_product_attention`` with a function that saves what a fused (flash)
kernel saves: q, k, v, the output and the fp32 log-sum-exp, never the (T, T) attention
matrix. A mixture-of-experts layer's experts run grouped, whatever implementation the config
names (see [Note: the experts on the meta device]). With activation checkpointing, each layer
keeps only its input, and one layer's
activations are rebuilt at a time in backward. The loss is ``ramflow train``'s, in chunks
of C tokens (see [Note: the loss in chunks] in ``loss.py``): it keeps the final norm's
output, and one chunk's logits (in the compute dtype and in fp32) and their fp32
gradient exist at a time; the estimate adds those ``C * V * (size + 4 + 4)`` bytes and one
layer's saved bytes (the working memory of a layer's backward) to the peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..choices import CHECKPOINTING_MODES
from ..formats.host import HostPrecision
from ..memory.estimate import (
    RUNTIME_OVERHEAD_BYTES,
    ActivationProfile,
    FrozenBase,
    MemoryEstimate,
    RunDescription,
    estimate_memory,
    offload_units,
    size_string,
)
from ..planner.costs import attention_width, unit_costs, unit_shapes
from ..planner.cpu_rates import rates_for
from ..planner.plan import PlanTiming, make_plan
from ..planner.predict import DEFAULT_MATMUL_FLOPS_PER_S, Rates, StepPrediction, predict_step
from ..planner.unit_plan import staging_bytes
from ..units.unit import plan_inputs
from .lora import count_lora_parameters
from .loss import chunk_tokens_for
from .modeling import meta_model


class _FusedAttention(torch.autograd.Function):
    """Stands in for a fused attention kernel: saves (q, k, v, out, lse), returns out."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # (B, heads, T, head_dim) as a view of a (B, T, heads, head_dim) buffer: the layout
        # fused kernels return, so the caller's transpose-and-reshape is free, as on a device
        b, heads, t, _ = q.shape
        out = q.new_empty((b, t, heads, v.shape[-1])).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (B, heads, T)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        raise RuntimeError("the memory estimate runs forward only")


# [Note: the experts on the meta device]
# ``transformers`` runs a mixture-of-experts layer's experts by the implementation that
# ``config._experts_implementation`` names: ``eager`` (a loop over the experts that the routing
# hits, found with ``nonzero``: a data-dependent shape, which meta tensors cannot give),
# ``grouped_mm`` (``F.grouped_mm``, whose meta function takes bf16 inputs only), ``batched_mm``
# (each token-expert pair gathers its expert's weights), or a kernel. The meta pass sets every
# experts module to ``grouped_mm`` (``set_experts_implementation``) and stands in for the grouped
# matmul with ``_GroupedMatmul``, which saves what the kernel saves (its input and offsets; its
# weight is a parameter), in any dtype. The grouped forward gathers the ``num_experts_per_tok``
# copies of each token and runs every one through its expert, so the bytes it saves do not
# depend on the routing (tests/train/test_moe_cli.py compares them with a real run's); ``eager``
# saves the same activations expert by expert, and the indices of each. ``ramflow train`` runs
# ``transformers``' default (``grouped_mm`` where it dispatches, ``eager`` otherwise); a
# ``batched_mm`` run would also keep every pair's gathered weights, which this does not count.


class _GroupedMatmul(torch.autograd.Function):
    """Stands in for ``F.grouped_mm(a, b, offs=offs)`` with a 2-D ``a`` (S, K), a 3-D ``b``
    (E, K, N) and ``offs`` (E,) int32: saves the three, as the kernel does, and returns an
    empty (S, N) output of ``a``'s dtype."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b, offs)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        raise RuntimeError("the memory estimate runs forward only")


_GROUPED_MATMULS = tuple(
    f
    for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
    if f is not None
)


class _MetaKernelsMode(TorchFunctionMode):
    """See [Note: measuring activations on the meta device] and [Note: the experts on the
    meta device]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        if func in _GROUPED_MATMULS and args[0].dim() == 2 and args[1].dim() == 3:
            return _GroupedMatmul.apply(args[0], args[1], (kwargs or {}).get("offs"))
        return func(*args, **(kwargs or {}))


def _run_experts_grouped(model: nn.Module) -> None:
    """Sets ``model``'s experts (if it has any ``transformers`` can switch) to ``grouped_mm``.
    See [Note: the experts on the meta device]."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is not None and can_set():
        model.set_experts_implementation("grouped_mm")


def _decoder_parts(model: nn.Module):
    inner = getattr(model, "model", None)
    parts = (
        getattr(inner, "embed_tokens", None),
        getattr(inner, "layers", None),
        getattr(inner, "rotary_emb", None),
        getattr(inner, "norm", None),
        getattr(model, "lm_head", None),
    )
    return None if any(p is None for p in parts) else parts


def measure_activations(
    config, *, batch_size: int, seq_len: int, dtype: torch.dtype
) -> ActivationProfile:
    """Activation bytes of one training forward on the meta device.

    See [Note: measuring activations on the meta device]. Works for Llama-like models
    (``model.embed_tokens``, ``model.layers``, ``model.rotary_emb``, ``model.norm``,
    ``lm_head``); for other structures a formula stands in (``measured=False``).

    Args:
        config: the model's ``transformers`` config.
        batch_size, seq_len: B and T.
        dtype: the compute dtype (what the device weights and matmul outputs are).
    """
    n = batch_size * seq_len
    size = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    # one chunk of the loss: logits in the compute dtype and in fp32, and their fp32 grad
    chunk = min(n, chunk_tokens_for(config.vocab_size))
    workspace = chunk * config.vocab_size * (size + 4 + 4)
    model = meta_model(config).to(dtype)
    _run_experts_grouped(model)
    parts = _decoder_parts(model)
    if parts is None:
        # the MLP's width under the names configs give it (GPT-2: n_inner, None for 4 x
        # hidden; OPT: ffn_dim; Bloom: none, 4 x hidden)
        widths = (getattr(config, k, None) for k in ("intermediate_size", "n_inner", "ffn_dim"))
        mlp = next((w for w in widths if w), 4 * hidden)
        per_layer = n * (12 * hidden + 3 * mlp) * size
        return ActivationProfile(
            (per_layer,) * config.num_hidden_layers,
            n * hidden * size,
            n * hidden * (2 * size + 4),
            workspace,
            False,
        )
    embed, layers, rotary, norm, _head = parts
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    bucket = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(t) in params or id(base) in params:
            return t
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            keep.append(t)  # keeps the storage alive, so its address is not reused
            bucket[0] += storage.nbytes()
        return t

    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    positions = torch.arange(seq_len, device="meta").expand(batch_size, seq_len)
    layer_bytes = []
    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        _MetaKernelsMode(),
    ):
        h = embed(ids)  # (B, T, H)
        cos_sin = rotary(h, positions)
        other = bucket[0]
        for layer in layers:
            bucket[0] = 0
            out = layer(
                h,
                attention_mask=None,
                position_ids=positions,
                position_embeddings=cos_sin,
                use_cache=False,
            )
            h = out[0] if isinstance(out, tuple) else out
            layer_bytes.append(bucket[0])
        bucket[0] = other
        normed = norm(h)  # (B, T, H): the chunked loss keeps it, and no logits
        other = bucket[0] + normed.untyped_storage().nbytes()
    return ActivationProfile(tuple(layer_bytes), n * hidden * size, other, workspace, True)


@dataclasses.dataclass(frozen=True)
class LoraSizing:
    """A LoRA run as ``estimate_run_memory`` sizes it: the base frozen in the host store,
    the adapters (``count_lora_parameters``) trained on the device.

    Attributes:
        rank: the adapters' rank (``--lora``).
        targets: the adapted modules' names (``--lora-targets``); None: the default.
        frozen_format: the frozen weights compressed in host RAM (``--frozen-format``).
    """

    rank: int
    targets: tuple[str, ...] | None = None
    frozen_format: str | None = None


@dataclasses.dataclass(frozen=True)
class SpeedInputs:
    """The machine's figures for a step-time prediction (``estimate_run_memory``'s
    ``speed``; ``predict_plan_step`` takes the same two).

    Attributes:
        timing_rates: copy and CPU optimizer rates; None: ``planner.predict.Rates()``'s
            defaults.
        matmul_flops_per_s: the GPU's dense bf16 matmul rate, FLOP/s; None:
            ``planner.predict.DEFAULT_MATMUL_FLOPS_PER_S``.
    """

    timing_rates: Rates | None = None
    matmul_flops_per_s: float | None = None


def estimate_run_memory(
    config,
    *,
    run: RunDescription,
    device_type: str,
    compute_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    device_budget_bytes: int | None,
    checkpointing: str = "auto",
    optimizer_states: int = 2,
    host_precision: HostPrecision | None = None,
    held_gradients: str | None = None,
    speed: SpeedInputs | None = None,
    lora: LoraSizing | None = None,
) -> MemoryEstimate:
    """Estimate a language model's training memory without allocating the model.

    ``ramflow.memory.estimate_memory`` on the model built on the meta device, with the
    activations measured there (see [Note: measuring activations on the meta device]),
    plus the step-time prediction when asked.

    Args:
        config: the model's ``transformers`` config.
        run: the micro-batch's shape (B, T) and the report's names (``RunDescription``).
        device_type: ``"cuda"`` or ``"cpu"``.
        compute_dtype: dtype of activations (autocast dtype, or float32).
        wire_dtype: dtype of the device copies of the weights.
        device_budget_bytes: the whole device's budget for the run (bytes), or None for no cap.
        checkpointing: ``"on"``, ``"off"``, ``"offload"`` or ``"auto"``: off when the
            activations fit in the budget beside ramflow's smallest plan, on otherwise
            (off without a budget).
        optimizer_states: fp32 state tensors per parameter (2 for AdamW).
        host_precision: the host formats (``setup.host_formats``'s, auto decided); None: fp32.
        held_gradients: how the loop holds its gradients for a deferred step (None:
            never; ``"grads"``, ``"codes"``: see ``ramflow.memory.estimate_memory``).
        speed: predict the step time with these figures too (CUDA runs; ``prediction``,
            ``timed_plan``); None: no prediction (``"auto"`` checkpointing still weighs
            offload with the default figures).
        lora: a LoRA run (``--lora``, ``--lora-targets``, ``--frozen-format``); None: full
            training.

    Returns:
        A ``MemoryEstimate``; ``describe()`` prints it.

    Raises:
        ValueError: ``checkpointing`` unknown; non-positive sizes; the budget is too small
            for the activations and ramflow's smallest plan (the message gives the figures).
    """
    batch_size, seq_len = run.batch_size, run.seq_len
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch size and sequence length must be positive, got {batch_size} and {seq_len}"
        )
    if checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(
            f"--checkpointing {checkpointing!r}: choose one of {', '.join(CHECKPOINTING_MODES)}"
        )
    model = meta_model(config)
    frozen = None
    if lora is not None:
        model.requires_grad_(False)  # the base, as ``train`` offloads it
        frozen = FrozenBase(
            lora.frozen_format,
            count_lora_parameters(model, rank=lora.rank, targets=lora.targets),
        )
    acts = measure_activations(config, batch_size=batch_size, seq_len=seq_len, dtype=compute_dtype)

    def memory(checkpointing: str) -> MemoryEstimate:
        return estimate_memory(
            model,
            activations=acts,
            run=run,
            device_type=device_type,
            wire_dtype=wire_dtype,
            device_budget=device_budget_bytes,
            checkpointing=checkpointing,
            optimizer_states=optimizer_states,
            host_precision=host_precision,
            held_gradients=held_gradients,
            frozen=frozen,
        )

    estimate = memory(checkpointing)
    figures = speed or SpeedInputs()
    timing_rates, matmul_flops_per_s = figures.timing_rates, figures.matmul_flops_per_s
    speed_kw = {"timing_rates": timing_rates, "matmul_flops_per_s": matmul_flops_per_s}
    if checkpointing == "auto" and device_type == "cuda" and estimate.checkpointing_mode == "on":
        # See [Note: when auto offloads the layers' inputs]
        offloaded = memory("offload")
        on_s, off_s = (
            predict_plan_step(config, e, **speed_kw).step_s for e in (estimate, offloaded)
        )
        if off_s < on_s * (1 - OFFLOAD_WINS_BY):
            estimate = dataclasses.replace(
                offloaded,
                checkpointing_reason=(
                    f"offloading the layers' inputs leaves room for {len(offloaded.plan.resident)} "
                    f"units on the device instead of {len(estimate.plan.resident)}: predicted "
                    f"{off_s * 1e3:.0f} ms per step against {on_s * 1e3:.0f} ms with the "
                    "inputs on the device"
                ),
            )
    if not (speed is not None and device_type == "cuda"):
        return estimate
    timing = _predict_speed(
        model,
        acts,
        estimate,
        config=config,
        checkpointing=checkpointing,
        wire_dtype=wire_dtype,
        rates=rates_for(timing_rates or Rates(), estimate.host_precision),
        matmul_flops_per_s=matmul_flops_per_s or DEFAULT_MATMUL_FLOPS_PER_S,
        frozen_format=None if lora is None else lora.frozen_format,
    )
    return dataclasses.replace(estimate, **timing)


# [Note: when auto offloads the layers' inputs]
# ``--checkpointing auto`` takes the lightest checkpointing that fits (off, then every layer),
# and activation offload where checkpointing every layer does not fit: then it is what lets
# the sequence run at all (``ramflow.memory.estimate.choose_checkpointing``). Where
# checkpointing alone fits, offload has the same recomputation, costs one D2H and one H2D of
# each layer's input per step on the links that stream the weights, and frees those inputs'
# device memory for ramflow's share; auto offloads only where the step-time model
# (``planner.predict``, which counts those copies) predicts the plan with more units resident
# faster by more than ``OFFLOAD_WINS_BY``, and says so in one line. With ``--batch-size
# auto`` the same holds per global batch: offload is taken where it fits a larger
# micro-batch whose global batch is predicted faster (``setup._estimate``): a global batch
# of ``k`` micro-batches run unit-major (one rank, ``setup.runs_unit_major``) is one step
# that loads the weights once and computes ``k`` times; otherwise it is counted as ``k - 1``
# micro-steps without the optimizer's work and one with it (the optimizer steps once per
# global batch).

OFFLOAD_WINS_BY = 0.02
"""The share of predicted step time by which offload must beat checkpointing alone for
``--checkpointing auto`` to take it (the model's error is larger than a hair's breadth;
ties keep the inputs on the device, which costs no PCIe)."""


def predict_plan_step(
    config,
    estimate: MemoryEstimate,
    *,
    timing_rates: Rates | None = None,
    matmul_flops_per_s: float | None = None,
    with_optimizer: bool = True,
    micro_batches: int = 1,
) -> StepPrediction:
    """The predicted training step of ``estimate``'s plan on a CUDA GPU, as ``train`` runs
    it (the run's checkpointing and activation offload), seconds in ``step_s``.

    Args:
        config: the model's ``transformers`` config.
        estimate: from ``estimate_run_memory``.
        timing_rates, matmul_flops_per_s: as for ``estimate_run_memory`` (defaults: the H200
            box's).
        with_optimizer: False: a micro-step of gradient accumulation, whose gradients land
            but whose units are not stepped (the optimizer's rate taken as unbounded).
        micro_batches: a step of this many micro-batches run unit-major (``predict_step``'s
            ``micro_batches``), the whole global batch.
    """
    model = meta_model(config)
    if estimate.num_adapter_parameters:
        # a LoRA run: the base is frozen (no gradient copies, no host steps), as ``train``
        # offloads it and as ``estimate_run_memory`` sized it
        model.requires_grad_(False)
    rates = rates_for(timing_rates or Rates(), estimate.host_precision)
    if not with_optimizer:
        rates = dataclasses.replace(rates, cpu_optimizer_params_per_s=math.inf)
    wire_size = getattr(torch, estimate.wire_dtype).itemsize
    shapes = unit_shapes(model)
    costs = unit_costs(
        shapes,
        batch=estimate.batch_size,
        seq=estimate.seq_len,
        hidden=attention_width(config),
        wire_itemsize=wire_size,
        matmul_flops_per_s=matmul_flops_per_s or DEFAULT_MATMUL_FLOPS_PER_S,
        resident=estimate.plan.resident,
        checkpointed=[s.name for s in shapes if s.block] if estimate.checkpointing else (),
        offload_bytes=estimate.activations.layer_input_bytes if estimate.activation_offload else 0,
        causal=True,  # the decoder LMs that ``train`` runs
    )
    return predict_step(
        costs,
        rates=rates,
        prefetch_depth=estimate.plan.prefetch_depth,
        grad_bytes_per_param=wire_size,
        deferred_steps=estimate.full_gradients,
        micro_batches=micro_batches,
    )


def predict_global_step(
    config,
    estimate: MemoryEstimate,
    *,
    micro_batches: int,
    unit_major: bool,
    timing_rates: Rates | None = None,
    matmul_flops_per_s: float | None = None,
) -> StepPrediction:
    """The predicted optimizer step of ``micro_batches`` micro-batches of ``estimate``'s
    plan, as ``train`` runs it (``setup.runs_unit_major``): unit-major, one step that loads
    the weights once and computes ``micro_batches`` times (``predict_plan_step``'s
    ``micro_batches``); otherwise ``micro_batches - 1`` micro-steps whose units land their
    gradients without a step, then one that steps. The second's ``step_s``, ``busy_s``,
    forward and backward times and bytes are those sums; the rest (``bound``,
    ``critical_s``, the optimizer tail) are the last micro-step's.

    Args:
        config, estimate, timing_rates, matmul_flops_per_s: as for ``predict_plan_step``.
        micro_batches: micro-batches per optimizer step (``--grad-accum``), >= 1.
        unit_major: the micro-batches run unit-major (``ramflow.accumulate``).

    Returns:
        The ``StepPrediction`` of the whole optimizer step (seconds, bytes).
    """
    speed = {"timing_rates": timing_rates, "matmul_flops_per_s": matmul_flops_per_s}
    if unit_major or micro_batches == 1:
        return predict_plan_step(config, estimate, micro_batches=micro_batches, **speed)
    last = predict_plan_step(config, estimate, **speed)
    micro = predict_plan_step(config, estimate, with_optimizer=False, **speed)
    k = micro_batches - 1

    def total(name: str):
        return k * getattr(micro, name) + getattr(last, name)

    return dataclasses.replace(
        last,
        step_s=total("step_s"),
        forward_s=total("forward_s"),
        backward_s=total("backward_s"),
        busy_s={name: k * micro.busy_s[name] + v for name, v in last.busy_s.items()},
        h2d_bytes=total("h2d_bytes"),
        h2d_stream_bytes=total("h2d_stream_bytes"),
        h2d_forward_bytes=total("h2d_forward_bytes"),
        h2d_refresh_bytes=total("h2d_refresh_bytes"),
        d2h_bytes=total("d2h_bytes"),
        offload_bytes=total("offload_bytes"),
    )


def _predict_speed(
    model: nn.Module,
    acts: ActivationProfile,
    estimate: MemoryEstimate,
    *,
    config,
    checkpointing: str,
    wire_dtype: torch.dtype,
    rates: Rates,
    matmul_flops_per_s: float,
    frozen_format: str | None = None,
) -> dict:
    """The step-time prediction of ``estimate``'s plan as ``train`` runs it, and the timed
    planner's fastest plan for the same budget (``MemoryEstimate`` fields). ``wire_dtype``
    is the one the run asked for (the estimate's may be its host formats' own).

    Blocks are the decoder layers, in order, with ``acts.layer_bytes``; with
    ``checkpointing="auto"`` the timed planner chooses per-unit checkpointing within the
    whole budget, otherwise it keeps the run's policy (all blocks or none)."""
    plan, ckpt, offload = estimate.plan, estimate.checkpointing, estimate.activation_offload
    wire_size = torch.empty((), dtype=wire_dtype).element_size()
    deferred_steps = estimate.full_gradients
    units, buffer_bytes = offload_units(model, frozen_format=frozen_format)
    shapes = unit_shapes(model)
    blocks = [s.name for s in shapes if s.block]
    costs = unit_costs(
        shapes,
        batch=estimate.batch_size,
        seq=estimate.seq_len,
        hidden=attention_width(config),
        wire_itemsize=wire_size,
        matmul_flops_per_s=matmul_flops_per_s,
        resident=plan.resident,
        checkpointed=blocks if ckpt else (),
        offload_bytes=acts.layer_input_bytes if offload else 0,
        causal=True,  # the decoder LMs that ``train`` runs
    )
    # a load moves compressed frozen weights as they are kept (``Unit.h2d_bytes``)
    assert [c.name for c in costs] == [u.name for u in units]
    h2d_bytes = [u.h2d_bytes(wire_dtype) for u in units]
    costs = [dataclasses.replace(c, wire_bytes=b) for c, b in zip(costs, h2d_bytes)]
    prediction = predict_step(
        costs,
        rates=rates,
        prefetch_depth=plan.prefetch_depth,
        grad_bytes_per_param=wire_size,
        deferred_steps=deferred_steps,
    )
    layer = iter(acts.layer_bytes)
    act_bytes = [next(layer, 0) if s.block else 0 for s in shapes]
    # under offload the run checkpoints every layer (CheckpointOffload(CheckpointAll())): the
    # fastest plan keeps that policy and chooses residents and depth
    auto = checkpointing == "auto" and not offload
    timing = PlanTiming(
        forward_s=[c.forward_s for c in costs],
        attention_s=[c.attention_s for c in costs],
        trainable_params=[c.trainable_params for c in costs],
        rates=rates,
        deps=[s.deps for s in shapes],
        activation_bytes=act_bytes,
        checkpoint_bytes=[acts.layer_input_bytes if s.block else 0 for s in shapes],
        checkpointable=[s.block for s in shapes],
        other_activation_bytes=acts.other_bytes + acts.logits_workspace_bytes,
        checkpointed=None if auto else (blocks if ckpt else []),
        grad_bytes_per_param=wire_size,
        offload=offload,
        deferred_steps=deferred_steps,
        h2d_bytes=h2d_bytes,
    )
    try:
        timed = make_plan(
            device=estimate.device_type,
            **plan_inputs(units, wire_dtype),
            fixed_bytes=buffer_bytes
            + staging_bytes(
                units, device=torch.device(estimate.device_type), wire_dtype=wire_dtype
            ),
            # auto, and offload (whose activations the timing counts with only two inputs
            # on the device): the budget covers ramflow and the activations, the planner
            # splits it
            gpu_memory_bytes=estimate.device_budget_bytes
            if auto or offload
            else estimate.gpu_memory_bytes,
            timing=timing,
        )
        timed = dataclasses.replace(timed, unit_h2d_bytes=tuple(h2d_bytes))
    except ValueError:
        timed = None
    return {
        "prediction": prediction,
        "timed_plan": timed,
        "timing_rates": rates,
        "matmul_flops_per_s": matmul_flops_per_s,
    }


def default_device_budget(device: torch.device) -> int | None:
    """The device budget when the user gives none: 90% of the free memory of a CUDA
    device (the rest for the CUDA context and allocator slack), no cap on the CPU."""
    if device.type != "cuda":
        return None
    with contextlib.suppress(RuntimeError):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return None


__all__ = [
    "CHECKPOINTING_MODES",
    "RUNTIME_OVERHEAD_BYTES",
    "ActivationProfile",
    "MemoryEstimate",
    "OFFLOAD_WINS_BY",
    "LoraSizing",
    "RunDescription",
    "SpeedInputs",
    "default_device_budget",
    "estimate_run_memory",
    "size_string",
    "measure_activations",
    "predict_global_step",
    "predict_plan_step",
]
