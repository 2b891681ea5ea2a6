"""``ramflow.Linear``: one ``nn.Linear`` whose weights live in CPU RAM, streamed per call.

[Note: layer engines]
A model built from ``ramflow.Linear`` layers has no root that ramflow was given, so the
layers of one process join one *layer engine* per (device, wire dtype): an ``Engine``
without a root whose units are the layers, added as they attach. Everything else is the
core engine's: the layer's flat host buffer becomes its unit's fp32 master (one DMA per
layer; shared memory stays shared), copies run on the device's H2D/D2H streams with an
event each, the window holds a few layers and frees the rest, the order of calls recorded
in one forward drives the prefetch of the next layers, gradients land in ``p.grad`` on the
host and ``ramflow.optim`` steps them on the worker. A layer attaches in the process that
uses it: at ``model.to(device)``/``.cuda()``, at its first call, or when a ramflow optimizer
or ``ramflow.distributed.zero_param_groups`` receives its parameters. Building the model
before ``torch.multiprocessing.spawn`` therefore allocates nothing on the GPU and nothing
pinned: ``share_memory_()`` moves the plain host buffer, and every worker adopts it.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..engine.engine import Engine
from ..engine.options import EngineOptions
from ..engine.worker import HostWorker
from ..transfer.streams import CopyStreams
from ..units.unit import ALIGN, UnitSpec

# a Linear's parameters -> the layer, until the layer attaches to its engine
PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()

_engines: dict[tuple[int, torch.device, torch.dtype], Engine] = {}
_shared: dict[tuple[int, torch.device], tuple[HostWorker, CopyStreams]] = {}
_registry_lock = threading.Lock()
_names = itertools.count()

LAYER_PREFETCH_DEPTH = 4  # layers are small units: look further ahead than for blocks


def _check_wire_dtype(dtype: torch.dtype) -> None:
    """Raises ValueError for a wire dtype the layer engines do not run (float64)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"ramflow.Linear computes in float32, bfloat16 or float16, not {dtype}; use "
            "torch.nn.Linear for a float64 layer"
        )


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def layer_engine(device: torch.device, wire_dtype: torch.dtype) -> Engine:
    """The layer engine of this process for ``device`` and ``wire_dtype``; layer engines of
    one device share its worker thread and copy streams."""
    key = (os.getpid(), device, wire_dtype)
    with _registry_lock:
        engine = _engines.get(key)
        if engine is None:
            worker, streams = _shared.get((os.getpid(), device), (None, None))
            if worker is None:
                worker, streams = HostWorker(device), CopyStreams(device)
                _shared[(os.getpid(), device)] = (worker, streams)
            options = EngineOptions(
                device=device, wire_dtype=wire_dtype, prefetch_depth=LAYER_PREFETCH_DEPTH
            )
            engine = Engine(None, [], options, worker=worker, streams=streams)
            _engines[key] = engine
        return engine


def attach_pending(params: Any) -> None:
    """Attach the ``ramflow.Linear`` layers that own any of ``params`` (an iterable of
    tensors or of param-group dicts) to their engines, so that their parameters are managed
    from here on."""
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            layer = PENDING.get(p) if isinstance(p, torch.Tensor) else None
            if layer is not None:
                layer.attach()


class Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose parameters stay in CPU RAM and are streamed to the
    compute device for each call (RamTorch's ``Linear``, on ramflow's engine).

    ``y = x @ weight.T + bias`` for ``x`` of shape (..., in_features) on ``device``; ``y`` has
    shape (..., out_features), on ``device``, in ``x``'s dtype (or autocast's). ``weight``
    (out_features, in_features) and ``bias`` (out_features,) are fp32 master weights in one
    flat host buffer; each call copies them to the device in ``wire_dtype`` (one DMA on the
    H2D stream, with an event the compute waits on), prefetching the layers that followed
    in the previous forward. Gradients come back to ``weight.grad``/``bias.grad`` on the host
    (fp32). Autocast, activation checkpointing and ``state_dict`` work as for ``nn.Linear``.

    Step these parameters with ``ramflow.optim`` optimizers (they also refresh the device
    copies). Another optimizer that writes them in place needs ``ramflow.refresh(model)``
    before the next call, or the device keeps running the old weights.

    ``.to(device)`` / ``.cuda()`` pick the compute device (the weights stay on the host; a
    move to the CPU makes the CPU the compute device before the first call, and is ignored
    after it, since the weights are there already);
    ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` pick the wire dtype (the masters stay
    fp32); ``share_memory()`` moves the host buffer to shared memory, for workers started
    with ``torch.multiprocessing`` (see [Note: layer engines]). Neither may change after the
    layer has run (``ValueError``).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        device: compute device; None: the current CUDA device when the layer attaches, or
            the CPU without CUDA. The parameters are created on the CPU either way.
        dtype: the wire (and compute) dtype when given, like ``wire_dtype``.
        wire_dtype: dtype of the weights on the wire and on the device; default float32,
            which computes exactly what ``nn.Linear`` computes. bfloat16 halves the PCIe bytes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        *,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        n_weight = out_features * in_features
        bias_offset = _round_up(n_weight)
        numel = bias_offset + (_round_up(out_features) if bias else 0)
        flat = torch.zeros(numel, dtype=torch.float32)
        self.weight = nn.Parameter(flat[:n_weight].view(out_features, in_features))
        if bias:
            self.bias = nn.Parameter(flat[bias_offset : bias_offset + out_features])
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._host_flat = flat
        self._device = None if device is None else _as_device(device)
        self._wire_dtype = wire_dtype or dtype or torch.float32
        if not self._wire_dtype.is_floating_point:
            raise TypeError(f"wire_dtype must be floating point, got {self._wire_dtype}")
        _check_wire_dtype(self._wire_dtype)
        self._engine: Engine | None = None
        self._register_pending()

    # ------------------------------------------------------------------ attaching

    def _register_pending(self) -> None:
        for p in self.parameters(recurse=False):
            PENDING[p] = self

    def attach(self) -> None:
        """Join this process's layer engine (idempotent); see [Note: layer engines]."""
        if self._engine is not None:
            return
        device = self._device
        if device is None:
            device = _default_device()
        elif device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._relink()
        engine = layer_engine(device, self._wire_dtype)
        owned = [p for p in (self.weight, self.bias) if p is not None]
        owned.sort(key=lambda p: not p.requires_grad)
        in_layout = owned[0] is self.weight  # the engine's offsets are those of our buffer
        spec = UnitSpec(
            f"Linear({self.in_features}, {self.out_features})#{next(_names)}",
            [self],
            slots=[(self, name) for name, p in self._parameters.items() if p is not None],
            owned=owned,
            master=self._host_flat if in_layout else None,
        )
        engine.add_units([spec])
        self._engine = engine
        self._device = device
        for p in owned:
            PENDING.pop(p, None)

    def _relink(self) -> None:
        """Point ``weight`` and ``bias`` into ``_host_flat`` again, with their values: a
        ``copy.deepcopy``, a pickle without ``share_memory()`` or ``load_state_dict(...,
        assign=True)`` before the first call gives them storage of their own.

        Raises:
            ValueError: a parameter was replaced by one of another shape.
        """
        n_weight = self.out_features * self.in_features
        places = [
            (self.weight, self._host_flat[:n_weight].view(self.out_features, self.in_features))
        ]
        if self.bias is not None:
            offset = _round_up(n_weight)
            places.append((self.bias, self._host_flat[offset : offset + self.out_features]))
        with torch.no_grad():
            for p, view in places:
                if p.shape != view.shape:
                    raise ValueError(
                        f"a parameter of ramflow.Linear({self.in_features}, "
                        f"{self.out_features}) was replaced by one of shape {tuple(p.shape)}"
                    )
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            self.attach()
        return super().__call__(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        """Device and dtype moves choose the compute device and wire dtype; the host masters
        stay where they are (see the class docstring)."""
        probe = fn(torch.zeros((), dtype=torch.float32))
        device = probe.device
        dtype = probe.dtype if probe.dtype.is_floating_point else torch.float32
        if device.type != "cpu" and device != self._device:
            self._set("device", device)
        elif device.type == "cpu" and self._engine is None and self._moves_to_cpu(fn):
            self._device = device
        if dtype != torch.float32 and dtype != self._wire_dtype:
            self._set("wire dtype", dtype)
        if device.type == "cpu" and dtype == torch.float32 and self._engine is None:
            fn(self._host_flat)  # share_memory_() and friends act on the buffer in place
        return self

    def _moves_to_cpu(self, fn: Any) -> bool:
        """Whether ``fn`` (of ``_apply``) takes a tensor on this layer's CUDA compute device
        to the CPU: ``.to("cpu")`` and ``.cpu()`` do; ``share_memory_``, ``.float()`` and
        the like, which a CPU probe cannot tell apart from them, do not."""
        device = self._device
        if device is not None and device.type != "cuda":
            return False
        if not torch.cuda.is_available():
            return False
        try:
            return fn(torch.zeros((), device=device or "cuda")).device.type == "cpu"
        except (RuntimeError, TypeError):  # an fn meant for host tensors only
            return False

    def _set(self, what: str, value: Any) -> None:
        if self._engine is not None:
            raise ValueError(
                f"cannot change the {what} of a ramflow.Linear to {value} after it has run; "
                "move or cast the model before its first forward"
            )
        if what == "device":
            self._device = value
        else:
            _check_wire_dtype(value)
            self._wire_dtype = value

    def __getstate__(self) -> dict[str, Any]:
        if self._engine is not None:
            raise RuntimeError(
                "a ramflow.Linear that has already run cannot be pickled (its hooks and device "
                "state belong to this process). Build the model, call share_memory(), and "
                "start the workers before running it."
            )
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._register_pending()

    # ------------------------------------------------------------------ compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias  # the device copies while the call runs
        if x.device != weight.device:
            x = x.to(weight.device)
        if not torch.is_autocast_enabled(weight.device.type) and x.dtype != weight.dtype:
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        device = "unattached" if self._device is None else str(self._device)
        wire = str(self._wire_dtype).replace("torch.", "")
        return f"{super().extra_repr()}, device={device}, wire_dtype={wire}"


def _as_device(device: torch.device | str | int) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def replace_linear(
    model: nn.Module,
    *,
    device: torch.device | str | int | None = None,
    wire_dtype: torch.dtype | None = None,
    skip: tuple[str, ...] = (),
    layer_class: type[Linear] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by a ``ramflow.Linear`` holding the same
    weights (copied into its host buffer, ``requires_grad`` kept), in place.

    Args:
        model: any module; ``nn.Linear`` subclasses other than ``nn.Linear`` itself (and
            ``ramflow.Linear``) are left alone, as are modules whose dotted name ends with
            one of ``skip`` (e.g. ``("lm_head",)`` for a head tied to the embeddings).
        device, wire_dtype: as for ``ramflow.Linear``.
        layer_class: a subclass of ``ramflow.Linear`` to build (keyword arguments
            ``bias``, ``device``, ``wire_dtype``); default ``ramflow.Linear``.

    Returns ``model``. ``model.to(device)`` afterwards moves everything else; the replaced
    layers' weights stay on the host. Raises ValueError for a weight on the meta device,
    or a weight shared with another module (tied weights cannot live in two places).
    """
    counts: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
    targets = []
    for name, module in model.named_modules():
        if name == "" and type(module) is nn.Linear:
            raise ValueError("replace_linear replaces submodules; use ramflow.Linear directly")
        if type(module) is not nn.Linear or any(name.endswith(s) for s in skip if s):
            continue
        for p in module.parameters(recurse=False):
            if p.is_meta:
                raise ValueError(f"{name}.weight is on the meta device: load the weights first")
            if counts[id(p)] > 1:
                raise ValueError(
                    f"a parameter of {name} is shared with another module (tied weights); "
                    f"leave it resident with skip=({name!r},)"
                )
        targets.append(name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = (layer_class or Linear)(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            device=device,
            wire_dtype=wire_dtype,
        )
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.weight.requires_grad_(old.weight.requires_grad)
            if old.bias is not None:
                new.bias.copy_(old.bias)
                new.bias.requires_grad_(old.bias.requires_grad)
        new.train(old.training)
        setattr(parent, child, new)
    return model
