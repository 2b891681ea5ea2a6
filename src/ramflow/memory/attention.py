"""Attention memory: a chunked attention, which SDPA backend a model runs, and a switch to SDPA.

Plain ("eager") attention materializes the (L, S) score and probability matrices of every
head and saves them for backward: O(T^2) memory per head, which at long sequence lengths is
most of the activations. PyTorch's fused ``F.scaled_dot_product_attention`` backends (flash,
memory-efficient, cuDNN; flash on the CPU) never materialize them. ``chunked_attention`` is
for where those backends do not apply (an unsupported mask, dtype or head size): it computes
the same result one block of queries at a time.

Shape legend: B... batch and head dimensions (any number, broadcast as in matmul), L query
length, S key/value length, E query/key head size, Ev value head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

__all__ = ["SDPAReport", "chunked_attention", "sdpa_backends_report", "use_sdpa"]


def _attend_chunk(
    q_c: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row0: int, scale: float, is_causal: bool
) -> torch.Tensor:
    scores = torch.matmul(q_c, k.transpose(-2, -1)) * scale  # (B..., c, S)
    if is_causal:
        rows = torch.arange(row0, row0 + q_c.shape[-2], device=q_c.device)[:, None]
        cols = torch.arange(k.shape[-2], device=q_c.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    # softmax in at least fp32, as SDPA's kernels accumulate it, then back to the value dtype
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return torch.matmul(probs.to(v.dtype), v)  # (B..., c, Ev)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int,
    is_causal: bool = False,
    scale: float | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """Scaled dot-product attention over blocks of ``chunk_size`` queries.

    Computes ``softmax(q @ k^T * scale + causal mask) @ v`` as
    ``F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)`` does
    (the causal mask is its top-left aligned one: query i sees keys 0..i), but holds the
    scores of only ``chunk_size`` queries at a time: O(L * chunk_size) extra memory instead
    of O(L * S) per head. With ``recompute`` (and gradients needed), each chunk runs under
    ``torch.utils.checkpoint`` (non-reentrant), so backward also keeps only q, k, v and
    recomputes one chunk's probabilities at a time; without it autograd saves every chunk's
    probabilities, O(L * S) again. Use it where SDPA's fused backends cannot run; where they
    can, SDPA is faster and needs no chunking.

    Args:
        q: (B..., L, E) queries, floating point, any device.
        k: (B..., S, E) keys; batch dimensions broadcast against ``q``'s.
        v: (B..., S, Ev) values.
        chunk_size: queries per block, >= 1.
        is_causal: apply the causal mask.
        scale: the scores' scale; default ``1 / sqrt(E)``.
        recompute: recompute each chunk in backward instead of saving its probabilities.

    Returns:
        (B..., L, Ev) in ``v``'s dtype; the softmax runs in at least fp32.

    Raises:
        ValueError: ``chunk_size`` < 1, tensors of fewer than 2 dimensions, or head sizes
            or lengths that do not match.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_attention: chunk_size must be an int >= 1, got {chunk_size!r}")
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise ValueError("chunked_attention: q, k and v need shapes (..., length, head size)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"chunked_attention: q and k head sizes differ ({q.shape[-1]} and {k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"chunked_attention: k and v lengths differ ({k.shape[-2]} and {v.shape[-2]})"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outputs = []
    for row0 in range(0, q.shape[-2], chunk_size):
        q_c = q[..., row0 : row0 + chunk_size, :]
        if recompute and needs_grad:
            out = checkpoint(_attend_chunk, q_c, k, v, row0, scale, is_causal, use_reentrant=False)
        else:
            out = _attend_chunk(q_c, k, v, row0, scale, is_causal)
        outputs.append(out)
    return torch.cat(outputs, dim=-2)


# the aten operators behind F.scaled_dot_product_attention, by the backend they are
_BACKEND_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math (mps)",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


@dataclass(frozen=True)
class SDPAReport:
    """Which attention kernels one forward of a model ran.

    Attributes:
        num_sdpa_calls: calls of ``F.scaled_dot_product_attention``.
        backends: per backend (``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``,
            ``"flash (cpu)"``, ...), how many of those calls ran it.
        num_softmax_calls: softmax calls outside SDPA: eager attention computes one per
            layer (other softmaxes count too, so this is a hint, not proof).
        enabled: the CUDA backend switches (``torch.backends.cuda.*_sdp_enabled``) as set
            when measured; the CPU runs its flash kernel or math whatever they say.
        device: where the model ran.
    """

    num_sdpa_calls: int
    backends: dict[str, int]
    num_softmax_calls: int
    enabled: dict[str, bool]
    device: torch.device

    def format(self) -> str:
        """A few lines for a person to read."""
        lines = [f"scaled_dot_product_attention on {self.device}: {self.num_sdpa_calls} call(s)"]
        for backend, n in sorted(self.backends.items()):
            lines.append(f"  {backend}: {n}")
        if self.num_sdpa_calls == 0:
            lines.append(
                f"  no SDPA call; {self.num_softmax_calls} softmax call(s): attention, if any, "
                "runs eagerly and saves its (L, S) probabilities (Hugging Face: use_sdpa(model))"
            )
        elif self.backends.get("math"):
            lines.append(
                "  math materializes the (L, S) scores like eager attention: check dtype, head "
                "size and mask against the fused backends' limits (torch.nn.attention.sdpa_kernel)"
            )
        switches = ", ".join(f"{k}={'on' if v else 'off'}" for k, v in self.enabled.items())
        lines.append(f"  CUDA switches: {switches}")
        return "\n".join(lines)


def sdpa_backends_report(model: nn.Module, *args: Any, **kwargs: Any) -> SDPAReport:
    """Run one forward of ``model(*args, **kwargs)`` and say which SDPA backends it ran.

    The forward runs under ``torch.profiler`` (CPU activity, which records the aten
    operators on any device), in the caller's grad mode: the backend chosen can depend on
    whether gradients are needed. The output is dropped.

    Args:
        model: any ``nn.Module``, on the device to check.
        *args, **kwargs: example inputs, with the dtype, shapes and masks of real use
            (the backends' limits depend on them).

    Returns:
        An ``SDPAReport``.
    """
    first = next(iter((*model.parameters(), *model.buffers())), None)
    device = first.device if first is not None else torch.device("cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(*args, **kwargs)
    backends: dict[str, int] = {}
    num_sdpa = num_softmax = 0
    for event in prof.events():
        if event.name == "aten::scaled_dot_product_attention":
            num_sdpa += 1
        elif event.name in _BACKEND_OPS:
            backend = _BACKEND_OPS[event.name]
            backends[backend] = backends.get(backend, 0) + 1
        elif event.name == "aten::_softmax":
            num_softmax += 1
    switches = torch.backends.cuda
    enabled = {
        "flash": switches.flash_sdp_enabled(),
        "efficient": switches.mem_efficient_sdp_enabled(),
        "cudnn": switches.cudnn_sdp_enabled(),
        "math": switches.math_sdp_enabled(),
    }
    return SDPAReport(
        num_sdpa_calls=num_sdpa,
        backends=backends,
        num_softmax_calls=num_softmax,
        enabled=enabled,
        device=device,
    )


def use_sdpa(model: nn.Module) -> str:
    """Switch a Hugging Face model's attention to ``attn_implementation="sdpa"``.

    Uses ``model.set_attn_implementation("sdpa")`` (transformers 5; it dispatches to the
    sub-models) where the model has it, else sets ``config._attn_implementation``. A model
    already on SDPA is left as it is.

    Args:
        model: a ``transformers.PreTrainedModel``.

    Returns:
        The implementation it had before (``"eager"``, ``"sdpa"``, ...), to switch back with
        ``model.set_attn_implementation(previous)``.

    Raises:
        TypeError: ``model`` has no Hugging Face config with an attention implementation.
        ValueError: the model does not support SDPA (transformers' own error, or the switch
            did not take).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(
            f"use_sdpa: {type(model).__name__} is not a Hugging Face model (no "
            "config._attn_implementation); call F.scaled_dot_product_attention in its "
            "attention instead"
        )
    previous = config._attn_implementation
    if previous == "sdpa":
        return previous
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    else:
        config._attn_implementation = "sdpa"
    if model.config._attn_implementation != "sdpa":
        raise ValueError(
            f"use_sdpa: {type(model).__name__} kept attn_implementation="
            f"{model.config._attn_implementation!r}; this model does not support switching to "
            "SDPA after loading: load it with attn_implementation='sdpa'"
        )
    return previous
