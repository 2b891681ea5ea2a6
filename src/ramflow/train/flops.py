"""Model FLOP utilisation (MFU): the share of a device's peak that a training step uses.

A training step of a dense model costs about ``6 * N`` FLOPs per token (``2 N`` forward,
``4 N`` backward; Kaplan et al. 2020, "Scaling Laws for Neural Language Models"), with N the
trained parameters. MFU is that rate over the device's peak (PaLM, Chowdhery et al. 2022):

    mfu = 6 * N * tokens_per_s / peak_flops_per_s

It counts neither attention's ``T``-dependent FLOPs nor the recomputation of activation
checkpointing, so it reads the same for every memory plan. The peaks are the vendors'
dense (no sparsity) tensor-core figures for 16-bit inputs, and the plain FP32 figures
(no TF32, which PyTorch's default matmul precision does not use); a device that is not in
the table, and the CPU, get no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        description: which peak, for the report (``"H100 SXM dense bf16 peak, 989 TFLOP/s"``).
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


def model_flops_utilisation(
    *, num_parameters: int, tokens_per_s: float, peak: PeakFlops | None
) -> float | None:
    """``6 * num_parameters * tokens_per_s / peak`` (a share, 0.42 for 42%), or None without a peak."""
    if peak is None:
        return None
    return 6.0 * num_parameters * tokens_per_s / peak.flops_per_s


__all__ = ["PeakFlops", "model_flops_utilisation", "peak_flops", "peak_flops_of"]
