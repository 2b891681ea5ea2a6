"""Device and precision: which device computes, in which dtype, and what crosses the wire.

``resolve_compute`` turns the user's ``--device`` and ``--precision`` into a ``ComputePolicy``
once, at set-up; the training and generation loops only read its fields.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..choices import COMPUTE_PRECISIONS

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ComputePolicy:
    """How a run computes.

    Attributes:
        device: the compute device (``cuda:N`` or ``cpu``).
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (never ``"auto"``).
        compute_dtype: dtype of matmuls under autocast (float32 for fp32).
        wire_dtype: dtype of the weight copies on the device and on the wire, given to
            ``ramflow.offload``: the compute dtype on CUDA, float32 on the CPU (the CPU
            computes from the fp32 masters; autocast casts there).
        use_autocast: wrap forward passes in ``torch.autocast``.
        use_grad_scaler: scale the loss with ``torch.amp.GradScaler`` (fp16 only).
    """

    device: torch.device
    precision: str
    compute_dtype: torch.dtype
    wire_dtype: torch.dtype
    use_autocast: bool
    use_grad_scaler: bool

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for a forward pass (a no-op context for fp32)."""
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``cuda`` (current device) when available and ``device`` is None, else ``device``.

    Raises:
        ValueError: ``device`` is not a CUDA device or the CPU, or CUDA is asked for but absent.
    """
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"--device {device!r} is not a device name (use cuda, cuda:1 or cpu)"
        ) from err
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {dev}: ramflow runs on a CUDA device or the CPU")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {device}: this machine has no CUDA device; use --device cpu"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_compute(*, device: str | torch.device | None, precision: str) -> ComputePolicy:
    """The policy for ``device`` (see ``resolve_device``) and ``precision``.

    ``precision="auto"`` is bf16 on a CUDA device that supports it (fp16 on older ones) and
    fp32 on the CPU, where autocast is rarely faster.

    Raises:
        ValueError: unknown precision, or a device that ``resolve_device`` refuses.
    """
    if precision not in COMPUTE_PRECISIONS:
        raise ValueError(
            f"--precision {precision!r}: choose one of {', '.join(COMPUTE_PRECISIONS)}"
        )
    dev = resolve_device(device)
    if precision == "auto":
        if dev.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "fp32"
    dtype = _DTYPES[precision]
    return ComputePolicy(
        device=dev,
        precision=precision,
        compute_dtype=dtype,
        wire_dtype=dtype if dev.type == "cuda" else torch.float32,
        use_autocast=precision != "fp32",
        use_grad_scaler=precision == "fp16",
    )


def planned_compute(
    *, device: str | None, precision: str
) -> tuple[str, str, torch.dtype, torch.dtype]:
    """For planning another machine (no device needed): ``(device_type, precision,
    compute_dtype, wire_dtype)``. ``device`` None means this machine's default.

    Raises:
        ValueError: unknown precision or device name.
    """
    if precision not in COMPUTE_PRECISIONS:
        raise ValueError(
            f"--precision {precision!r}: choose one of {', '.join(COMPUTE_PRECISIONS)}"
        )
    if device is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        try:
            device_type = torch.device(device).type
        except RuntimeError as err:
            raise ValueError(f"--device {device!r} is not a device name (use cuda or cpu)") from err
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"--device {device}: ramflow runs on a CUDA device or the CPU")
    if precision == "auto":
        precision = "bf16" if device_type == "cuda" else "fp32"
    dtype = _DTYPES[precision]
    return device_type, precision, dtype, dtype if device_type == "cuda" else torch.float32


__all__ = ["ComputePolicy", "planned_compute", "resolve_compute", "resolve_device"]
