"""RamTorch's ``Linear`` signature on ``ramflow.Linear``."""

from __future__ import annotations

import torch

from ...layers import linear as _linear


class Linear(_linear.Linear):
    """``ramtorch.Linear(in_features, out_features, bias=True, dtype=None, device="cuda",
    skip_init=False)`` on ``ramflow.Linear``: ``dtype`` is the wire (compute) dtype, masters
    stay fp32; ``device="cuda"`` computes on the CPU when CUDA is not available (so the same
    script runs in CI); ``skip_init`` leaves the weights uninitialised (zeros here), for
    layers that are about to be loaded. ``.device`` is the compute device.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | int = "cuda",
        skip_init: bool = False,
    ) -> None:
        self._skip_init = skip_init
        if (
            device is not None
            and not torch.cuda.is_available()
            and torch.device(f"cuda:{device}" if isinstance(device, int) else device).type == "cuda"
        ):
            device = "cpu"
        super().__init__(in_features, out_features, bias, device=device, wire_dtype=dtype)

    def reset_parameters(self) -> None:
        if not getattr(self, "_skip_init", False):
            super().reset_parameters()

    @property
    def device(self) -> torch.device | None:
        """The compute device (None until it is known: a bare "cuda" resolves at first use)."""
        return self._device
