"""What ``nn.Module._apply`` does to an offloaded model: moves and casts that keep it where
it is, and an error for the rest.

[Note: moving and casting an offloaded model]
Every module of an offloaded model has ``_apply`` (what ``.to``, ``.cuda``, ``.cpu``,
``.half``, ``.float``, ``.to_empty``, ``share_memory`` ... call) routed to the engine through
its instance ``__dict__``. The engine applies the conversion to a probe tensor to learn what
it asks for: a move to the compute device, or a cast to the wire dtype, is what the model
already is (only buffers are converted, and kept on the device), which is why Hugging Face's
``Trainer``'s ``model.to(device)`` works; anything else (another device, another dtype, the
meta device, ``to_empty``, shared memory) raises ValueError naming ``ramflow.undo`` and
``offload``'s arguments, before anything changes. The masters stay fp32 in host RAM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ModelApply:
    """The ``_apply`` of every module of one offloaded model (the schedule installs it).

    Args:
        device: the compute device (the buffers stay there).
        wire_dtype: the dtype the model computes in (the one cast that is accepted).
    """

    def __init__(self, *, device: torch.device, wire_dtype: torch.dtype) -> None:
        self.device = device
        self.wire_dtype = wire_dtype

    def apply(self, module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        """``module.to(...)``, ``.cuda()``, ``.half()`` and everything else that goes through
        ``nn.Module._apply`` (``fn`` maps a tensor to its converted copy): only the buffers
        are converted, and kept on the device. Returns ``module``. See [Note: moving and
        casting an offloaded model].

        Raises:
            ValueError: the conversion moves the model off its compute device, casts it to
                another dtype than its wire dtype, puts it in shared memory or does not keep
                the values (``to_empty``, the meta device); nothing changed.
        """
        # on the compute device: a cast (``.float()``) keeps it there, a move does not
        probe = torch.tensor([0.5, -1.25], dtype=torch.float32, device=self.device)
        out = fn(probe)
        what = f"{type(module).__name__}._apply({getattr(fn, '__name__', 'fn')})"
        host_probe = torch.zeros(1)  # share_memory_() acts on host tensors only
        fn(host_probe)
        if host_probe.is_shared():
            raise ValueError(
                "share_memory() on an offloaded model would move its host store; ramflow keeps "
                "one host copy per host already (zero_stage=... under torch.distributed). Call "
                "share_memory() before ramflow.offload, or ramflow.undo(model) first."
            )
        if (
            not isinstance(out, torch.Tensor)
            or out.is_meta
            or not torch.equal(out.detach().to(self.device, torch.float32), probe)
        ):
            raise ValueError(
                f"{what} would not keep the values of the parameters (to_empty, the meta device "
                "or an unknown conversion); ramflow keeps them in host RAM. Call "
                "ramflow.undo(model) first to get an ordinary module."
            )
        device, dtype = out.device, out.dtype
        if dtype == torch.float32 and fn(probe.to(torch.bfloat16)).dtype == torch.bfloat16:
            dtype = None  # a move that keeps dtypes (``.to(device)``, ``.cuda()``)
        if device != self.device and not (device.type == self.device.type == "cpu"):
            raise ValueError(
                f"this model is offloaded by ramflow to compute on {self.device}; it cannot move "
                f"to {device}. Its weights stay in host RAM whatever the compute device. For an "
                "ordinary module on the CPU, call ramflow.undo(model); to compute on another "
                "device, call ramflow.undo(model) and ramflow.offload(model, device=...)."
            )
        if dtype is not None and dtype != self.wire_dtype:
            name = str(dtype).replace("torch.", "")
            wire = str(self.wire_dtype).replace("torch.", "")
            raise ValueError(
                f"this model is offloaded by ramflow with master weights in host RAM that compute in "
                f"{wire} (its wire dtype); casting it to {name} is not supported in place. "
                + (
                    f"Call ramflow.undo(model), then ramflow.offload(model, wire_dtype=torch.{name})."
                    if dtype != torch.float64
                    else "ramflow computes in float32, bfloat16 or float16: for float64, call "
                    "ramflow.undo(model) and keep the model resident."
                )
            )
        # device and dtype are what they already are: only the buffers follow (they live on
        # the device, and a plain model casts its floating-point buffers too)
        modules = module.modules() if recurse else [module]
        for m in modules:
            for name, buf in m._buffers.items():
                if buf is not None:
                    new = fn(buf)
                    m._buffers[name] = new if new.device == self.device else new.to(self.device)
        return module
