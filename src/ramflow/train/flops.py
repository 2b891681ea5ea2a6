"""Model FLOP utilisation (MFU): the share of a device's peak that a training step uses.

A training step costs, per token, 2 FLOPs per multiply-add of every weight a token's
forward multiplies activations with, 2 more for the gradient of the activations, and 2 more
for the gradient of the weight where it is trained (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models": ``6 N``), plus attention's score and value products, which grow
with the sequence: ``6 x L x W x T`` for causal attention (``L`` attention layers of width
``W`` summed over the query heads, ``T`` tokens per sequence; ``planner.predict.
attention_flops``' half square, forward and backward). ``N`` is a mixture of experts'
*active* weights: the experts a token is routed to, not all of them
(``planner.costs.parameter_counts``). MFU is that rate over the device's peak (PaLM,
Chowdhery et al. 2022, which also counts attention):

    mfu = training_flops_per_token * tokens_per_s / peak_flops_per_s

It does not count the recomputation of activation checkpointing, so it reads the same for
every memory plan. At 128k tokens an 8B Llama's attention costs 2.3 times its weights'
FLOPs, so leaving it out would read under a third of the true utilisation. The peaks are the
vendors' dense (no sparsity) tensor-core figures for 16-bit inputs, and the plain FP32
figures (no TF32, which PyTorch's default matmul precision does not use); a device that is
not in the table, and the CPU, get no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..planner.costs import attention_width, parameter_counts
from ..planner.predict import forward_flops

# (substring of torch.cuda.get_device_name, name, dense 16-bit TFLOP/s, FP32 TFLOP/s);
# the first match wins, so the more specific names come first
_PEAKS: tuple[tuple[str, str, float, float], ...] = (
    ("GH200", "GH200", 989.0, 67.0),
    ("H200", "H200", 989.0, 67.0),
    ("H100 PCIe", "H100 PCIe", 756.0, 51.0),
    ("H100 NVL", "H100 NVL", 835.0, 60.0),
    ("H100", "H100 SXM", 989.0, 67.0),
    ("H800", "H800", 989.0, 67.0),
    ("A100", "A100", 312.0, 19.5),
    ("A800", "A800", 312.0, 19.5),
    ("L40S", "L40S", 362.0, 91.6),
    ("L40", "L40", 181.0, 90.5),
    ("L4", "L4", 121.0, 30.3),
    ("A10G", "A10G", 70.0, 31.2),
    ("RTX 4090", "RTX 4090", 165.2, 82.6),
)


@dataclass(frozen=True)
class PeakFlops:
    """A device's assumed peak.

    Attributes:
        flops_per_s: dense peak in FLOP/s for the run's compute dtype.
        description: which peak, for the report (the GPU's name and the datasheet's dense
            peak for the dtype).
    """

    flops_per_s: float
    description: str


def peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops | None:
    """The assumed peak of ``device`` computing in ``dtype``, or None on the CPU and on a
    device not in the table (then no MFU is reported)."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def peak_flops_of(device_name: str, dtype: torch.dtype) -> PeakFlops | None:
    """The peak of the CUDA device called ``device_name`` (as ``torch.cuda.get_device_name``
    gives it, e.g. ``"NVIDIA H100 80GB HBM3"``) in ``dtype``; None if it is not in the table."""
    for key, label, half, single in _PEAKS:
        if key in device_name:
            if dtype in (torch.bfloat16, torch.float16):
                kind, tflops = ("bf16" if dtype == torch.bfloat16 else "fp16"), half
            else:
                kind, tflops = "fp32", single
            return PeakFlops(tflops * 1e12, f"{label} dense {kind} peak, {tflops:g} TFLOP/s")
    return None


def training_flops_per_token(
    *,
    matmul_params: int,
    seq_len: int,
    attention_layers: int,
    attention_width: int,
    trained_matmul_params: int | None = None,
) -> float:
    """FLOPs of one training step per token: ``4 x matmul_params + 2 x
    trained_matmul_params`` for the weights (``6 N`` when all are trained) plus causal
    attention's ``6 x attention_layers x attention_width x seq_len``. The one count behind
    every MFU and model-FLOP rate that ramflow and its benchmarks print.

    Args:
        matmul_params: the weights one token's forward multiplies activations with (a
            mixture of experts' active ones: ``ParameterCounts.active_matmul``).
        seq_len: tokens per sequence (T).
        attention_layers: attention layers (L), each causal.
        attention_width: query heads x head width (``planner.costs.attention_width``).
        trained_matmul_params: those of the weights that are trained; None: all of them.
    """
    trained = matmul_params if trained_matmul_params is None else trained_matmul_params
    forward = forward_flops(
        matmul_params,
        batch=1,
        seq=seq_len,
        attention_layers=attention_layers,
        hidden=attention_width,
        causal=True,
    )
    # forward once, backward twice over (activation and weight gradients, attention's too),
    # less the weight gradients of the frozen weights
    return 3.0 * forward / seq_len - 2.0 * (matmul_params - trained)


def model_flops_per_token(model: nn.Module, *, seq_len: int) -> float:
    """``training_flops_per_token`` of a Hugging Face causal LM (its ``config`` gives the
    layers, the attention width and the experts' routing) training on ``seq_len``-token
    sequences; the weights as ``model`` holds them (meta tensors are fine; frozen ones count
    4 FLOPs per token)."""
    counts = parameter_counts(model)
    config = model.config.get_text_config()
    return training_flops_per_token(
        matmul_params=counts.active_matmul,
        trained_matmul_params=counts.active_trained_matmul,
        seq_len=seq_len,
        attention_layers=config.num_hidden_layers,
        attention_width=attention_width(config),
    )


def model_flops_utilisation(
    *, flops_per_token: float, tokens_per_s: float, peak: PeakFlops | None
) -> float | None:
    """``flops_per_token * tokens_per_s / peak`` (a share, 0.42 for 42%), or None without a
    peak. ``flops_per_token``: ``model_flops_per_token``."""
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / peak.flops_per_s


__all__ = [
    "PeakFlops",
    "model_flops_per_token",
    "model_flops_utilisation",
    "peak_flops",
    "peak_flops_of",
    "training_flops_per_token",
]
