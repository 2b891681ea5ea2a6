"""``fuse_lora``: PEFT's LoRA ``Linear`` as one frozen matmul and one rank-r update written
into its output.

[Note: fused LoRA]
PEFT computes a LoRA layer as ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides
the two small matmuls, the scaling and the sum each read and write a tensor of the
layer's output size, and backward does the same again (the scaling's gradient, and the sum
of the base's and the branch's input gradients). For a Llama-70B layer at 8192 tokens
that is about 1.4 GB per pass over the outputs, several passes per step, on the SMs the
step's large matmuls need. ``_LoraLinear`` writes the update into the base's output in
the matmul's epilogue (``addmm_`` with ``alpha=scaling``) and accumulates the branch's
input gradient into the base's the same way, so no elementwise pass is left.

Not the same bits as PEFT: the scaled update is added to the output in fp32 and rounded
once, where PEFT rounds ``lora_B(...)``, its product with ``scaling`` and the sum to the
compute dtype one after another. It is a model change like any fused kernel, so it is
opt-in, and it applies to a resident model exactly as to an offloaded one (an offloaded
model with ``fuse_lora`` computes what the resident one with ``fuse_lora`` computes).

A call falls back to PEFT's own forward whenever the fused form would not compute the
same function: adapters disabled or merged, several active adapters, a LoRA variant
(DoRA, ...), dropout that is active, a bias on ``lora_B``, ``fan_in_fan_out``, extra
arguments (``adapter_names``), a base layer that is not a plain ``nn.Linear``, or, without
autocast, tensors of different dtypes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

_FUSED = "_ramflow_fused_lora"  # marks an instance whose forward fuse_lora replaced


class _LoraLinear(torch.autograd.Function):
    """``y = x W^T + b + scaling * (x A^T) B^T``: ``x`` (..., in), ``W`` (out, in), ``b``
    (out,) or None, ``A`` (r, in), ``B`` (out, r), all one dtype and device."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ lora_a.t()
        if bias is None:
            y = x2 @ weight.t()
        else:
            y = torch.addmm(bias, x2, weight.t())
        y.addmm_(h, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, h)
        ctx.scaling = scaling
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb, _ = ctx.needs_input_grad
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        s = ctx.scaling
        grad_x = grad_w = grad_bias = grad_a = grad_lb = None
        # the branch's gradient at h: (N, r), small
        grad_h = torch.mm(g2, lora_b).mul_(s) if (need_x or need_a) else None
        if need_lb:
            grad_lb = torch.mm(g2.t(), h).mul_(s)
        x2 = x.reshape(-1, x.shape[-1])
        if need_a:
            grad_a = torch.mm(grad_h.t(), x2)
        if need_x:
            grad_x = torch.mm(g2, weight).addmm_(grad_h, lora_a).view(x.shape)
        if need_w:
            grad_w = torch.mm(g2.t(), x2)
        if need_b:
            grad_bias = g2.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_lb, None


def _plain_linear(m: Any) -> bool:
    return type(m) is nn.Linear


def _fused_call(layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """The fused output of ``layer`` (a PEFT LoRA ``Linear``) for ``x``, or None where the
    fused form does not apply (see [Note: fused LoRA])."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name):
        return None
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (
        isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training)
    ):
        return None
    base, a, b = layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name]
    if getattr(layer, "fan_in_fan_out", False) or not all(map(_plain_linear, (base, a, b))):
        return None
    if a.bias is not None or b.bias is not None:
        return None
    w, bias, wa, wb = base.weight, base.bias, a.weight, b.weight
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        if not x.is_floating_point():
            return None
        x, w, wa, wb = (t.to(dtype) for t in (x, w, wa, wb))
        bias = None if bias is None else bias.to(dtype)
    elif len({t.dtype for t in (x, w, wa, wb) + (() if bias is None else (bias,))}) != 1:
        return None
    with torch.autocast(kind, enabled=False):
        return _LoraLinear.apply(x, w, bias, wa, wb, float(layer.scaling[name]))


def _forward(layer: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    y = _fused_call(layer, x, args, kwargs)
    if y is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    return y


def fuse_lora(model: nn.Module) -> int:
    """Compute every PEFT LoRA ``Linear`` of ``model`` as one frozen matmul plus a rank-r
    update written into its output in the matmul's epilogue (see [Note: fused LoRA]).

    Works on a resident or an offloaded model, before or after ``ramflow.offload``, in
    training and inference. Each call checks that the fused form computes PEFT's function
    (one active adapter, not merged, no active dropout, no DoRA or other variant, plain
    ``nn.Linear`` base and adapters without bias, ``fan_in_fan_out`` off, one dtype or
    autocast) and otherwise runs PEFT's own forward. Under autocast the matmuls run in the
    autocast dtype, as PEFT's do; the update is added in fp32 and rounded once, so the
    output differs from PEFT's by at most the compute dtype's rounding.

    Args:
        model: any module containing PEFT ``lora.Linear`` layers (a ``PeftModel`` or a model
            that ``get_peft_model`` changed in place).

    Returns the number of layers fused (0 when there are none; already fused ones count).
    Raises ImportError when PEFT is not installed. ``unfuse_lora`` restores PEFT's forward.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for m in model.modules():
        if type(m) is LoraLinear:
            if not getattr(m, _FUSED, False):
                m.forward = types.MethodType(_forward, m)
                setattr(m, _FUSED, True)
            count += 1
    return count


def unfuse_lora(model: nn.Module) -> int:
    """Undo ``fuse_lora``: PEFT's own forward for every layer it fused. Returns how many."""
    count = 0
    for m in model.modules():
        if getattr(m, _FUSED, False):
            del m.forward
            delattr(m, _FUSED)
            count += 1
    return count
