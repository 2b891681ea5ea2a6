"""Activation report: per module, the bytes autograd saves for backward, measured.

One forward and backward of the model on example inputs, with
``torch.autograd.graph.saved_tensors_hooks`` installed: every tensor that an operation saves
for its backward passes through the pack hook, which charges it to the modules whose forward
is running at that moment (the innermost and all that enclose it). See [Note: counting saved
storages] for what one byte means here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..sizes import format_bytes
from ..units.unit import repeated_block_modules

__all__ = ["ActivationReport", "ModuleActivations", "activation_report"]

# [Note: counting saved storages]
# A saved tensor keeps its whole storage alive, so a module is charged the storage's bytes,
# once per storage however many views of it are saved (ReLU saves its output, the next
# Linear saves the same tensor as its input: one storage). A storage that belongs to a
# parameter or buffer is not an activation (it lives anyway), so a saved weight or its
# transpose is not charged. ``total_saved_bytes`` counts each storage once over the whole
# model. Inside a ``torch.utils.checkpoint`` region (non-reentrant) tensors go through
# checkpoint's own hooks and are dropped, while the region's inputs, which checkpoint keeps
# for the recomputation, come through ours: a checkpointed block is charged its inputs only,
# which is what the model, as it is, keeps.


@dataclass(frozen=True)
class ModuleActivations:
    """One module's row of an ``ActivationReport``.

    Attributes:
        name: dotted module path ("" for the root).
        module_type: the module's class name.
        saved_bytes: bytes of the storages saved for backward while the module's forward ran
            (its submodules included), each storage once; parameters and buffers excluded.
        num_saved_tensors: how many saved tensors were charged to it (views included).
        input_bytes: bytes of the storages of the tensors passed to its forward (what
            activation checkpointing keeps for recomputation), each storage once.
        forward_peak_bytes: the device's peak allocated bytes while its forward ran, from
            ``torch.cuda.max_memory_allocated``; None on the CPU.
        backward_peak_bytes: likewise from the first gradient of its outputs to the last
            gradient of its inputs (to the end of backward when no input needs a gradient);
            None on the CPU or when none of its outputs needed a gradient.
        num_calls: how many times its forward ran.
    """

    name: str
    module_type: str
    saved_bytes: int
    num_saved_tensors: int
    input_bytes: int
    forward_peak_bytes: int | None
    backward_peak_bytes: int | None
    num_calls: int


@dataclass(frozen=True)
class ActivationReport:
    """What ``activation_report`` measured.

    Attributes:
        modules: one row per module that ran, the largest ``saved_bytes`` first (module
            order among equals).
        total_saved_bytes: bytes of all storages saved for backward during the forward,
            each once (see [Note: counting saved storages]).
        device: where the model ran.
        blocks: names of the model's repeated blocks that ran, in block order: the blocks
            ``ramflow.memory.find_blocks`` names on the same model (empty when it has none);
            None for a report not made by ``activation_report``.
    """

    modules: tuple[ModuleActivations, ...]
    total_saved_bytes: int
    device: torch.device
    blocks: tuple[str, ...] | None = None

    def __getitem__(self, name: str) -> ModuleActivations:
        for row in self.modules:
            if row.name == name:
                return row
        raise KeyError(f"no module named {name!r} ran in the measured forward")

    def format(self, *, top: int | None = 20) -> str:
        """A fixed-width table of the ``top`` largest rows (all when None)."""
        rows = self.modules if top is None else self.modules[:top]

        def size(value: int | None) -> str:
            return "-" if value is None else format_bytes(value)

        table = [("module", "type", "saved", "inputs", "fwd peak", "bwd peak")]
        for r in rows:
            table.append(
                (
                    r.name or "<root>",
                    r.module_type,
                    size(r.saved_bytes),
                    size(r.input_bytes),
                    size(r.forward_peak_bytes),
                    size(r.backward_peak_bytes),
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
            for row in table
        ]
        head = f"activations saved for backward on {self.device}: {format_bytes(self.total_saved_bytes)}"
        return head + "\n" + "\n".join(lines)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """(device, storage address) of a strided tensor with memory; None otherwise."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (t.device, storage.data_ptr())


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _scalar_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for t in _tensors(output if not hasattr(output, "to_tuple") else output.to_tuple()):
        if t.requires_grad:
            return t.float().sum()
    raise TypeError(
        "activation_report: the model's output holds no tensor that needs a gradient; pass "
        "loss_fn=... that turns the output into a scalar loss"
    )


class _Meter:
    """The hooks' shared state during one measured step."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.modules = {id(m): m for m in model.modules()}
        self.blocks = [id(m) for m in repeated_block_modules(model)]  # find_blocks' rule
        self.fixed = {
            key
            for t in (*model.parameters(), *model.buffers())
            if (key := _storage_key(t)) is not None
        }
        self.stack: list[int] = []  # modules whose forward is running, innermost last
        self.bw_active: list[int] = []  # modules whose backward is running
        self.saved: dict[int, dict[tuple, int]] = {}
        self.num_saved: dict[int, int] = {}
        self.inputs: dict[int, dict[tuple, int]] = {}
        self.calls: dict[int, int] = {}
        self.fw_peak: dict[int, int] = {}
        self.bw_peak: dict[int, int] = {}
        self.all_saved: dict[tuple, int] = {}
        self.order: list[int] = []
        self.tensor_hooks: list[Any] = []

    def tick(self) -> None:
        """Charge the peak since the last tick to every module active in that interval."""
        if not self.cuda:
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for mid in self.stack:
            self.fw_peak[mid] = max(self.fw_peak.get(mid, 0), peak)
        for mid in self.bw_active:
            self.bw_peak[mid] = max(self.bw_peak.get(mid, 0), peak)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is None or key in self.fixed:
            return t
        nbytes = t.untyped_storage().nbytes()
        self.all_saved[key] = nbytes
        for mid in self.stack:
            self.saved.setdefault(mid, {})[key] = nbytes
            self.num_saved[mid] = self.num_saved.get(mid, 0) + 1
        return t

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.tick()
        mid = id(module)
        if mid not in self.calls:
            self.order.append(mid)
        self.calls[mid] = self.calls.get(mid, 0) + 1
        seen = self.inputs.setdefault(mid, {})
        for t in _tensors((args, kwargs)):
            key = _storage_key(t)
            if key is not None and key not in self.fixed:
                seen[key] = t.untyped_storage().nbytes()
            if self.cuda and t.requires_grad:
                self.tensor_hooks.append(t.register_hook(self._backward_end(mid)))
        self.stack.append(mid)

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.tick()
        mid = id(module)
        # always_call: runs after an exception too; pop this module and whatever it left
        while self.stack and self.stack.pop() != mid:
            pass
        if self.cuda:
            start = self._backward_start(mid)
            for t in _tensors(output if not hasattr(output, "to_tuple") else output.to_tuple()):
                if t.requires_grad:
                    self.tensor_hooks.append(t.register_hook(start))

    def _backward_start(self, mid: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.tick()
            if mid not in self.bw_active:
                self.bw_active.append(mid)

        return hook

    def _backward_end(self, mid: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.tick()
            if mid in self.bw_active:
                self.bw_active.remove(mid)

        return hook

    def report(self) -> ActivationReport:
        rows = []
        for position, mid in enumerate(self.order):
            module = self.modules[mid]
            saved = self.saved.get(mid, {})
            rows.append(
                (
                    position,
                    ModuleActivations(
                        name=self.names.get(mid, ""),
                        module_type=type(module).__name__,
                        saved_bytes=sum(saved.values()),
                        num_saved_tensors=self.num_saved.get(mid, 0),
                        input_bytes=sum(self.inputs.get(mid, {}).values()),
                        forward_peak_bytes=self.fw_peak.get(mid) if self.cuda else None,
                        backward_peak_bytes=self.bw_peak.get(mid) if self.cuda else None,
                        num_calls=self.calls[mid],
                    ),
                )
            )
        rows.sort(key=lambda item: (-item[1].saved_bytes, item[0]))
        return ActivationReport(
            modules=tuple(row for _, row in rows),
            total_saved_bytes=sum(self.all_saved.values()),
            device=self.device,
            blocks=tuple(self.names[mid] for mid in self.blocks if mid in self.calls),
        )


def activation_report(
    model: nn.Module,
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> ActivationReport:
    """Measure, per module, the activations autograd saves for backward in one step.

    Runs ``model(*args, **kwargs)`` under ``torch.autograd.graph.saved_tensors_hooks`` (see
    [Note: counting saved storages]), then backward from ``loss_fn(output)`` so that the
    graph is freed and, on CUDA, each module's backward peak is read. The gradients that
    backward leaves on the parameters are put back as they were (``.grad`` restored), so
    the report changes nothing in the model; it does run the forward once (dropout draws
    random numbers, batch norm updates its running statistics: put the model in
    ``eval()`` first if that matters).

    On CUDA, the device's peak counter is read and reset at every module boundary
    (``torch.cuda.max_memory_allocated`` / ``reset_peak_memory_stats``) to give each
    module's forward and backward peak; on the CPU the peaks are None.

    Args:
        model: any ``nn.Module``, on the device whose memory is measured (taken from its
            first parameter or buffer; the CPU when it has none).
        *args, **kwargs: the example inputs, passed to ``model`` as they are.
        loss_fn: turns the output into a scalar to call ``backward`` on. Default: the
            output's ``loss`` attribute (Hugging Face models given labels), else the sum
            of the first output tensor that needs a gradient.

    Returns:
        An ``ActivationReport``, the module that saves most first.

    Raises:
        TypeError: no scalar to run backward from (pass ``loss_fn``); nothing is raised
            when the forward saves nothing (under ``torch.no_grad``, or all frozen).
    """
    first = next(iter((*model.parameters(), *model.buffers())), None)
    device = first.device if first is not None else torch.device("cpu")
    meter = _Meter(model, device)
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(meter.pre_forward, with_kwargs=True))
        handles.append(
            module.register_forward_hook(meter.post_forward, with_kwargs=True, always_call=True)
        )
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        # backward accumulates into an existing .grad in place, so the gradients are taken
        # off the parameters first; otherwise putting them back would put back the sum.
        for p, _ in grads:
            p.grad = None
        if meter.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            output = model(*args, **kwargs)
        for h in handles:
            h.remove()
        handles.clear()
        if meter.all_saved:
            loss = loss_fn(output) if loss_fn is not None else _scalar_loss(output)
            del output
            loss.backward()
            del loss
            meter.tick()
    finally:
        for h in (*handles, *meter.tensor_hooks):
            h.remove()
        for p, grad in grads:
            p.grad = grad
    return meter.report()
