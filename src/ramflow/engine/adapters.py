"""Small trainable parameters (adapters) kept on the device for good, never streamed.

[Note: adapters on the device]
In LoRA-style fine-tuning (Hu et al. 2021; QLoRA, Dettmers et al. 2023) a frozen base holds
nearly every parameter and small adapters hold the rest. Streaming the adapters with their
units would send their gradients down and their new weights up every step and step them on
the CPU, for a few MB. Instead ``ramflow.offload`` leaves them out of the units: they move
to the device as ordinary parameters (like the model's buffers), autograd accumulates their
gradients there, and an optimizer steps them there (``ramflow.optim.AdamW`` with PyTorch's
fused AdamW on the device, as any parameter that no engine manages; a plain torch optimizer
works too). The frozen base streams through the window as before.

The rule (``offload(..., trainable_on_device=None)``, the default): the trainable parameters
of PEFT's adapters (the adapter containers of its tuner layers, which cast their input to
their own dtype) stay on the device when they are at most ``ADAPTER_SHARE`` of the model's
parameters (by elements) and, under a ``gpu_memory`` budget, their device bytes (weights, gradients and
AdamW's two states: four times their bytes) take at most half of it. ``True`` keeps them on
the device whatever their share; ``False`` streams them with their units.

Parameters that appear after ``offload`` (``peft.get_peft_model`` on an offloaded model adds
its adapters to modules inside units) are adopted the same way at the next forward, and a
unit whose parameters were all frozen since (PEFT freezes the base) stops sending gradients.
See ``ModelHooks.adopt_changes`` in ``ramflow.engine.model_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

# at most this share of the model's parameters (elements) may be trainable for the
# automatic rule to keep them on the device: LoRA of rank 8-64 on a 1B-70B model is 0.1-2%;
# a full fine-tune, or one of a large head, is more and streams as before
ADAPTER_SHARE = 0.10

# weights, gradients and AdamW's exp_avg and exp_avg_sq, all in the parameter's dtype
_DEVICE_COPIES = 4


def device_bytes(params: Iterable[nn.Parameter]) -> int:
    """Device bytes that ``params`` take when trained on the device.

    Args:
        params: parameters (any device; meta included: only shapes and dtypes are read).

    Returns:
        Bytes: weights, gradients (trainable ones) and AdamW's two states (four times the
        weights' bytes; frozen ones once).
    """
    total = 0
    for p in params:
        copies = _DEVICE_COPIES if p.requires_grad else 1
        total += copies * p.numel() * p.element_size()
    return total


def _adapter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters of ``model``'s PEFT adapters: those held in the adapter
    containers of PEFT's tuner layers (``adapter_layer_names``, e.g. ``lora_A``,
    ``lora_B``), which also cast their input to their own dtype."""
    ids: set[int] = set()
    for module in model.modules():
        for name in getattr(module, "adapter_layer_names", ()):
            container = getattr(module, name, None)
            if isinstance(container, nn.Module):
                ids.update(id(p) for p in container.parameters())
    return ids


def choose_on_device(
    model: nn.Module,
    *,
    trainable_on_device: bool | None,
    gpu_memory_bytes: int | None,
    zero_stage: int | None,
) -> list[nn.Parameter]:
    """The parameters of ``model`` that ``ramflow.offload`` keeps on the device (see
    [Note: adapters on the device]): its trainable ones, or none.

    Args:
        model: the model being offloaded.
        trainable_on_device: ``ramflow.offload``'s option: True keeps the trainable
            parameters on the device, False none, None the model's adapters where they
            are a small share of it and fit the budget.
        gpu_memory_bytes: ramflow's share of the device, bytes; None: no cap.
        zero_stage: ``ramflow.offload``'s ``zero_stage`` (None: one process).

    Returns:
        The parameters kept on the device (empty: none).

    Raises:
        ValueError: ``trainable_on_device=True`` with ``zero_stage`` (their gradients would
            need their own all-reduce), or with no trainable parameter in the model.
        TypeError: ``trainable_on_device`` is not a bool or None.
    """
    if trainable_on_device is not None and not isinstance(trainable_on_device, bool):
        raise TypeError(
            f"trainable_on_device must be True, False or None, got {trainable_on_device!r}"
        )
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if trainable_on_device is False:
        return []
    if trainable_on_device is True:
        if zero_stage is not None:
            raise ValueError(
                "trainable_on_device=True cannot be combined with zero_stage yet (the "
                "parameters kept on the device would need their own gradient all-reduce); "
                "leave it out to stream them with their units"
            )
        if not trainable:
            raise ValueError(
                "trainable_on_device=True, but the model has no trainable parameter "
                "(requires_grad=True): set requires_grad on the adapters before offload, or "
                "leave the option out"
            )
        return trainable
    if zero_stage is not None or not trainable or len(trainable) == len(params):
        return []
    # the automatic rule takes adapters only (a trainable head of a frozen backbone streams
    # with its unit, in the wire dtype, as any layer the model computes in it)
    adapters = _adapter_ids(model)  # once: it walks the whole model
    trainable = [p for p in trainable if id(p) in adapters]
    if not trainable:
        return []
    numel = sum(p.numel() for p in params)
    if sum(p.numel() for p in trainable) > ADAPTER_SHARE * numel:
        return []
    if gpu_memory_bytes is not None and 2 * device_bytes(trainable) > gpu_memory_bytes:
        return []
    return trainable


def materialize_meta_adapters(
    model: nn.Module, params: list[nn.Parameter], device: torch.device
) -> list[nn.Parameter]:
    """Give values to the parameters among ``params`` (new since ``offload``) that are on
    the meta device, or raise; returns ``params`` with those replaced by the new
    parameter objects (a meta tensor cannot take values in place).

    PEFT creates each adapter on the device and in the dtype of its base layer's weight;
    a weight kept compressed (``frozen_format``) is a meta stand-in, so
    ``peft.get_peft_model`` after ``offload`` leaves those adapters on the meta device,
    without values; so does ``get_peft_model`` on a model built on the meta device and
    offloaded with ``weights=`` (``offload`` calls this for the adapters it keeps on the
    device). A PEFT LoRA layer's adapters are made on ``device`` in fp32 and
    initialized by the layer's own ``reset_lora_parameters`` with PEFT's default LoRA
    initialization (A as ``nn.Linear``'s Kaiming-uniform, B zero: Hu et al. 2021).

    Args:
        model: the offloaded model (its PEFT LoRA layers are searched for the adapters).
        params: the parameters new since ``offload``.
        device: where new adapters are made (fp32).

    Returns:
        ``params``, each meta adapter replaced by its new parameter.

    Raises:
        ValueError: a meta parameter that is not a PEFT LoRA adapter (its values are
            unknown); the message says to add it before ``offload`` or give it values.
    """
    meta = {id(p) for p in params if p.is_meta}
    if not meta:
        return params
    replaced: dict[int, nn.Parameter] = {}
    for layer in model.modules():
        if not (hasattr(layer, "reset_lora_parameters") and hasattr(layer, "lora_A")):
            continue
        for adapter in list(layer.lora_A.keys()):
            parts = [layer.lora_A[adapter], layer.lora_B[adapter]]
            if not any(id(p) in meta for m in parts for p in m.parameters()):
                continue
            for m in parts:
                for name, old in list(m._parameters.items()):
                    if old is None or id(old) not in meta:
                        continue
                    values = torch.empty(old.shape, dtype=torch.float32, device=device)
                    m._parameters[name] = nn.Parameter(values, requires_grad=old.requires_grad)
                    replaced[id(old)] = m._parameters[name]
            layer.reset_lora_parameters(adapter, True)
    left = meta - replaced.keys()
    if left:
        names = [n for n, p in model.named_parameters() if id(p) in left][:3]
        raise ValueError(
            f"parameters added after ramflow.offload are on the meta device, without values "
            f"({', '.join(names)}): give them values, or add them before ramflow.offload"
        )
    return [replaced.get(id(p), p) for p in params]


class DeviceParameters:
    """The parameters one engine keeps on the device.

    Args:
        device: the compute device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.params: list[nn.Parameter] = []

    def adopt(self, params: Iterable[nn.Parameter]) -> None:
        """Move ``params`` (same objects, ``.data`` replaced) and their gradients to the
        device."""
        with torch.no_grad():
            for p in params:
                self.params.append(p)
                if p.device != self.device:
                    p.data = p.data.to(self.device)
                    if p.grad is not None:
                        p.grad = p.grad.to(self.device)

    @property
    def nbytes(self) -> int:
        """Device bytes they take with gradients and AdamW states (see ``device_bytes``)."""
        return device_bytes(self.params)

    def ids(self) -> set[int]:
        return {id(p) for p in self.params}

    def give_back(self) -> None:
        """Move every parameter (and gradient) to the CPU, as ``ramflow.undo`` gives back
        the rest of the model."""
        with torch.no_grad():
            for p in self.params:
                if p.device.type != "cpu":
                    p.data = p.data.cpu()
                    if p.grad is not None:
                        p.grad = p.grad.cpu()
        self.params.clear()


# [Note: merging adapters into an offloaded base]
# PEFT merges an adapter by writing the base layer's weight in place (``weight.data +=
# delta``, or ``weight.data = merged`` with ``safe_merge``), which ramflow does not see: the
# unit's wire and device copies went stale and the merged model computed without the
# adapter; under ``frozen_format`` the base weight is a stand-in on the meta device, where
# the write is lost without an error. So each PEFT tuner layer of an offloaded model gets
# instance ``merge``/``unmerge`` methods that call PEFT's and then give the unit the new
# host weights (``ModelHooks.refresh_param``), and that refuse a compressed base before PEFT
# writes anything.


def guard_adapter_merges(model: nn.Module, refresh_param: Callable[[nn.Parameter], None]) -> None:
    """Wrap ``merge``/``unmerge`` of ``model``'s PEFT tuner layers (modules with a
    ``base_layer``) once. See [Note: merging adapters into an offloaded base].

    Args:
        model: the offloaded model.
        refresh_param: called with each base weight a merge or unmerge changed, to write
            it back to its host master.
    """
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Module) or "merge" in module.__dict__:
            continue
        for name in ("merge", "unmerge"):
            method = getattr(module, name, None)
            if callable(method):
                module.__dict__[name] = GuardedMerge(method, base, refresh_param)


class GuardedMerge:
    """A tuner layer's ``merge`` or ``unmerge`` on an offloaded base layer."""

    def __init__(self, method: Any, base: nn.Module, refresh_param: Any) -> None:
        self._method = method
        self._base = base
        self._refresh = refresh_param

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        weights = [p for p in self._base.parameters() if p is not None]
        if any(p.is_meta for p in weights):
            raise ValueError(
                "cannot merge adapters into base weights that ramflow keeps compressed "
                "(frozen_format): call ramflow.undo(model) first, which gives back dense "
                "weights, then merge"
            )
        out = self._method(*args, **kwargs)
        for p in weights:
            self._refresh(p)
        return out
