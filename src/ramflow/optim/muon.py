"""Muon over host fp32 master weights (``ramflow.optim.Muon``), with AdamW for the rest.

Muon (Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024)
steps a 2-D hidden weight matrix by the orthogonalized momentum of its gradient: the
Nesterov momentum is brought to the nearest semi-orthogonal matrix by five steps of a
quintic Newton-Schulz iteration in bf16. "Muon is Scalable for LLM Training" (Liu et al.,
Moonlight, 2025) adds decoupled weight decay and scales the update by
``0.2 * sqrt(max(A, B))`` so that its RMS matches AdamW's and AdamW's learning rate and
weight decay carry over. Embeddings, the output layer, norms and biases are stepped by
AdamW, as both papers do. The arithmetic is PyTorch's own (``torch.optim.Muon``'s
``_zeropower_via_newtonschulz`` and ``_adjust_lr``; PyTorch's fused CPU AdamW), so on the
CPU a step is ``torch.optim.Muon`` plus ``torch.optim.AdamW(fused=True)`` bit for bit.

[Note: Muon's orthogonalization on the device]
A step of an offloaded matrix runs where its unit's step runs, on the host worker, as the
other optimizers' steps do (during backward once the loop allows it, see [Note: when the
step runs] in ``engine.stepper``), in three parts:
  1. host: the momentum ``m <- lerp(m, g, 1 - mu)`` and the Nesterov blend
     ``u = lerp(g, m, mu)`` in fp32 over the host gradient (whole: accumulated, clipped,
     unscaled, reduced as any host step sees it), rounded to bf16 (the iteration's first
     op, so rounding on the host gives its bits), in one pass written straight into a
     pinned buffer (``kernels.muon_kernels.muon_blend_``);
  2. device: ``u`` (bf16, 2 bytes per element) goes H2D, the Newton-Schulz iteration
     runs there in bf16 (tensor cores: a 4096 x 14336 matrix is about 5.5 TFLOP, seconds
     on a CPU, milliseconds on an H100), and the result ``O`` (bf16) comes back D2H, on
     three streams of this optimizer's (upload, iteration, download), so one matrix's
     copies overlap another's iteration;
  3. host: ``p <- p * (1 - lr * wd) - lr_adj * O``, one pass (``muon_apply_``).
The matrices of a unit are pipelined: while the device orthogonalizes one, the worker
blends the next and applies the one before. The momentum never leaves the host, and only
the blend and the result cross PCIe: 4 bytes per element on top of the gradient's D2H and
the weights' H2D that every ramflow optimizer pays (AdamW: 4 in all).
Why not at the moment the unit's gradients are complete on the device, before their D2H:
the blend needs the momentum (host fp32, 4 bytes per element to upload and 4 to bring back
if it were updated there) and the whole gradient, which under gradient accumulation, a
clip or a GradScaler exists only on the host after ``step()``. Blending on the host serves
every loop with one path, and costs less PCIe than moving the momentum.
The device's memory for the iteration (the blend, its Gram matrices and the result, about
``2 * A * B * 3 + 3 * min(A, B) ** 2`` bytes for the largest matrix, two matrices in
flight) is not in ramflow's plan: it is taken from the caching allocator on the side
stream when a unit steps. With a CPU engine (``device='cpu'``: the CI tests) the iteration
runs on the CPU, in the same bf16 ops.

[Note: Muon under ZeRO]
Newton-Schulz orthogonalizes a whole matrix: it cannot run on a flat shard of a parameter.
ramflow's ZeRO-1/2 shard by unit (``distributed.zero``: each unit has an owner rank, which steps it
whole from the reduced gradients), so each rank orthogonalizes the matrices of the units
it owns, whole, and no parameter is ever split. A layout that splits one parameter over
ranks would need its shards gathered before the iteration; ramflow has none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ..kernels.cpu_kernels import check_threads
from ..kernels.muon_kernels import muon_apply_, muon_blend_
from ..transfer.streams import record_event
from ..units.registry import engine_of_param
from .host_optimizer import HostOptimizer

try:  # torch >= 2.9
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr
    from torch.optim._muon import _zeropower_via_newtonschulz as _newton_schulz
except ImportError:  # pragma: no cover - older torch; refused in Muon.__init__
    _newton_schulz = None

ADJUST_LR_FNS = ("original", "match_rms_adamw")
MOMENTUM = "momentum_buffer"  # torch.optim.Muon's name, so its states load here


class _Orthogonalized(NamedTuple):
    """A Newton-Schulz result on its way to the host: ``out`` (bf16, host, pinned on CUDA)
    is complete once ``event`` has (None: computed synchronously); ``keep`` holds the
    inputs the asynchronous copies read until then."""

    out: torch.Tensor
    event: torch.cuda.Event | None
    keep: tuple[torch.Tensor, ...]

    def result(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.out


class _Orthogonalizer:
    """Runs the Newton-Schulz iteration of host matrices on one device. See [Note: Muon's
    orthogonalization on the device]. On CUDA the upload, the iteration and the download
    run on three streams of its own, created on first use, beside the backward pass on
    the compute stream, so that one matrix's copies overlap another's iteration."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: tuple[torch.cuda.Stream, ...] | None = None

    def blend_buffer(self, shape: torch.Size) -> torch.Tensor:
        """A host bf16 buffer of ``shape`` for a blend to orthogonalize: pinned (from
        PyTorch's caching host allocator) when the iteration runs on CUDA, so the upload
        is a DMA from where the blend was written."""
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=self.device.type == "cuda")

    def submit(self, blend: torch.Tensor, *, ns_steps: int) -> _Orthogonalized:
        """Start the orthogonalization of ``blend`` (2-D, bf16, contiguous; on the host, or
        already on this device for a parameter that is not offloaded)."""
        coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
        if self.device.type != "cuda" or blend.device.type == "cuda":
            orthogonal = _newton_schulz(blend, coefficients, ns_steps, EPS)
            if orthogonal.device.type == "cpu":  # a tall matrix's comes back transposed
                orthogonal = orthogonal.contiguous()  # for the one-pass update
            return _Orthogonalized(orthogonal, None, ())
        if self._streams is None:
            self._streams = tuple(torch.cuda.Stream(self.device) for _ in range(3))
        h2d, work, d2h = self._streams
        src = blend.pin_memory()  # itself when pinned (``blend_buffer``)
        with torch.cuda.stream(h2d):
            staged = src.to(self.device, non_blocking=True)
        work.wait_stream(h2d)
        staged.record_stream(work)
        with torch.cuda.stream(work), torch.profiler.record_function("ramflow.muon_ns"):
            orthogonal = _newton_schulz(staged, coefficients, ns_steps, EPS)
        d2h.wait_stream(work)
        orthogonal.record_stream(d2h)
        with torch.cuda.stream(d2h):
            out = torch.empty(orthogonal.shape, dtype=orthogonal.dtype, pin_memory=True)
            out.copy_(orthogonal, non_blocking=True)
            event = record_event(d2h)
        return _Orthogonalized(out, event, (src,))


class Muon(HostOptimizer):
    """Muon (Jordan et al., 2024) for 2-D hidden weight matrices and AdamW (Loshchilov &
    Hutter, 2019) for the other parameters, over host fp32 master weights, overlapped with
    backward; the Newton-Schulz iteration runs on the model's device (see [Note: Muon's
    orthogonalization on the device]).

    A step of a Muon matrix ``W`` (A x B) with gradient ``g`` and momentum ``m``:
    ``m <- mu m + (1 - mu) g``; ``u = (1 - mu) g + mu m`` (Nesterov; else ``u = m``);
    ``O = NS5(u)`` (bf16, coefficients (3.4445, -4.7750, 2.0315), ``ns_steps`` steps);
    ``W <- W (1 - lr wd) - lr s O``, with ``s = 0.2 sqrt(max(A, B))`` for
    ``adjust_lr_fn="match_rms_adamw"`` (Moonlight, the default: AdamW's lr and weight
    decay carry over) or ``sqrt(max(1, A / B))`` for ``"original"`` (Jordan's, with a
    larger lr, e.g. 0.02). This is ``torch.optim.Muon``, bit for bit on the CPU.

    Which parameters Muon steps: a param group may say ``use_muon`` (True: every parameter
    must be 2-D; False: AdamW). A group that does not is split in two, its 2-D parameters
    (Muon) and the rest (AdamW), in that order. Embeddings and the output layer are 2-D
    but belong to AdamW (both papers): give them a ``use_muon=False`` group, e.g. with
    ``muon_param_groups(model)``.

    Args:
        params: parameters or param groups, as for ``torch.optim.Muon``.
        lr: Muon's learning rate (before the shape scale ``s``).
        momentum: ``mu``, in [0, 1).
        nesterov: use the Nesterov blend (as the papers), else the momentum itself.
        ns_steps: Newton-Schulz steps, 1 to 99.
        weight_decay: decoupled weight decay of both parts, ``W *= 1 - lr * weight_decay``.
        adjust_lr_fn: ``"match_rms_adamw"`` or ``"original"``, see above.
        adamw_lr: the AdamW groups' learning rate (their ``lr`` key); None: ``lr``.
        adamw_betas, adamw_eps: AdamW's (their ``betas`` and ``eps`` keys). The defaults
            (0.9, 0.95) and 1e-8 are Moonlight's and the Muon reference's.
        overlap: as for ``ramflow.optim.AdamW``.
        threads: CPU threads of the host passes over offloaded matrices (the blend and
            the update, ``kernels.muon_kernels``), an int >= 1; None (the default) is
            ``torch.get_num_threads()``. The result does not depend on it.

    State per parameter, fp32 on the host (plain tensors of the parameter's shape, not
    the units' flat buffers: no flat step reads them): Muon matrices ``momentum_buffer``;
    AdamW parameters ``step`` (float32 scalar), ``exp_avg``, ``exp_avg_sq``. Only the
    exact host formats (``host_precision='fp32'``) are stepped; others are refused with a
    ValueError when the optimizer meets the model's parameters. Units planned for the
    device step (``device_optimizer``) are stepped on the host: Muon has no device step.

    Raises:
        ValueError: an out-of-range setting, a parameter of a ``use_muon=True`` group that
            is not 2-D, or PyTorch without ``torch.optim.Muon`` (< 2.9).
        TypeError: ``threads`` is not an int or None.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.1,
        adjust_lr_fn: str = "match_rms_adamw",
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        overlap: bool = True,
        threads: int | None = None,
    ) -> None:
        check_threads(threads)
        self.threads = threads
        if _newton_schulz is None:
            raise ValueError(
                f"ramflow.optim.Muon uses torch.optim.Muon's iteration, which this PyTorch "
                f"({torch.__version__}) lacks: install torch >= 2.9"
            )
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}, must be >= 0")
        if adamw_lr is not None and not adamw_lr >= 0.0:
            raise ValueError(f"invalid adamw_lr: {adamw_lr}, must be >= 0 or None")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum: {momentum}, must be in [0, 1)")
        if not (isinstance(ns_steps, int) and 1 <= ns_steps < 100):
            raise ValueError(f"invalid ns_steps: {ns_steps!r}, must be an int from 1 to 99")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}, must be >= 0")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"invalid adjust_lr_fn: {adjust_lr_fn!r}, choose one of {', '.join(ADJUST_LR_FNS)}"
            )
        if not (0.0 <= adamw_betas[0] < 1.0 and 0.0 <= adamw_betas[1] < 1.0):
            raise ValueError(f"invalid adamw_betas: {adamw_betas}, each must be in [0, 1)")
        if not adamw_eps >= 0.0:
            raise ValueError(f"invalid adamw_eps: {adamw_eps}, must be >= 0")
        self._adamw_lr = lr if adamw_lr is None else adamw_lr
        self._orthogonalizers: dict[torch.device, _Orthogonalizer] = {}
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
            betas=tuple(adamw_betas),
            eps=adamw_eps,
        )
        super().__init__(params, defaults, overlap=overlap)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; a group without ``use_muon`` is
        added as two, its 2-D parameters (Muon) then the rest (AdamW), each only if it has
        any. An AdamW group without its own ``lr`` gets ``adamw_lr``.

        Raises:
            ValueError: a ``use_muon=True`` group holds a parameter that is not 2-D.
        """
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # a set is refused by torch's own check
            params = list(params)
        if "use_muon" in param_group or isinstance(params, set):
            parts = [(bool(param_group.get("use_muon", False)), params)]
        else:
            matrices = [p for p in params if p.dim() == 2]
            rest = [p for p in params if p.dim() != 2]
            parts = [(True, matrices), (False, rest)] if matrices and rest else []
            parts = parts or [(bool(matrices), params)]
        for use_muon, ps in parts:
            if use_muon:
                flat = [p for p in ps if p.dim() != 2]
                if flat:
                    raise ValueError(
                        f"a use_muon=True param group holds a parameter of shape "
                        f"{tuple(flat[0].shape)}: Muon orthogonalizes 2-D matrices only; put "
                        "embeddings, norms, biases and other shapes in a use_muon=False group "
                        "(AdamW), e.g. with ramflow.optim.muon_param_groups(model)"
                    )
            group = {**param_group, "params": ps, "use_muon": use_muon}
            if not use_muon:
                group.setdefault("lr", self._adamw_lr)
            super().add_param_group(group)

    def _update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        if group["use_muon"]:
            self._muon_update(params, grads, group)
        else:
            self._adamw_update(params, grads, group)

    def _muon_update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        """One Muon step of ``params`` (host masters or plain parameters), pipelined: the
        blend of a matrix and the update of the one before run on the host while the
        device orthogonalizes. See [Note: Muon's orthogonalization on the device]."""
        mu = group["momentum"]
        in_flight: tuple[torch.Tensor, _Orthogonalized] | None = None
        for p, g in zip(params, grads):
            st = self.state[p]
            if not st:
                st[MOMENTUM] = self._zeros(p)
            buf = st[MOMENTUM]
            orthogonalizer = self._orthogonalizer(p)
            if _on_host(buf, torch.float32) and _on_host(g, torch.float32):
                blend = orthogonalizer.blend_buffer(p.shape)
                muon_blend_(
                    buf,
                    g,
                    blend,
                    momentum_coef=mu,
                    nesterov=group["nesterov"],
                    num_threads=self.threads,
                )
            else:
                if g.dtype != buf.dtype:
                    g = g.to(buf.dtype)
                buf.lerp_(g, 1 - mu)
                blend = (g.lerp(buf, mu) if group["nesterov"] else buf).bfloat16().contiguous()
            job = orthogonalizer.submit(blend, ns_steps=group["ns_steps"])
            if in_flight is not None:
                self._apply(*in_flight, group)
            in_flight = (p, job)
        if in_flight is not None:
            self._apply(*in_flight, group)

    def _apply(self, p: torch.Tensor, job: _Orthogonalized, group: dict[str, Any]) -> None:
        """``p <- p * (1 - lr * wd) - lr_adj * O``, as ``torch.optim.Muon`` (the bf16
        ``O`` is added in ``p``'s dtype)."""
        lr, wd = group["lr"], group["weight_decay"]
        adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
        orthogonal = job.result()
        if _on_host(p, torch.float32) and _on_host(orthogonal, torch.bfloat16):
            muon_apply_(
                p,
                orthogonal,
                lr=lr,
                weight_decay=wd,
                adjusted_lr=adjusted,
                num_threads=self.threads,
            )
            return
        p.mul_(1 - lr * wd)
        p.add_(orthogonal.to(p.device), alpha=-adjusted)

    def _orthogonalizer(self, p: torch.Tensor) -> _Orthogonalizer:
        """The orthogonalizer of the device ``p`` is computed on: its engine's for an
        offloaded parameter (whose master is on the host), else ``p``'s own."""
        engine = engine_of_param(p)
        device = p.device if engine is None else torch.device(engine.device)
        if device not in self._orthogonalizers:
            self._orthogonalizers[device] = _Orthogonalizer(device)
        return self._orthogonalizers[device]

    def _adamw_update(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], group: dict[str, Any]
    ) -> None:
        """PyTorch's AdamW (fused on the CPU) over the non-Muon parameters."""
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
        self._adamw(
            params,
            grads,
            group,
            lambda p: {"exp_avg": self._zeros(p), "exp_avg_sq": self._zeros(p)},
        )

    @staticmethod
    def _zeros(p: torch.Tensor) -> torch.Tensor:
        """A state tensor of ``p``: zeros of its shape, dtype and device (an offloaded
        parameter is its host fp32 master)."""
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _flat_names(self, p: torch.Tensor, state: dict[str, Any]) -> tuple[str, ...]:
        """None: Muon's states are plain host tensors, not views of the units' flat
        buffers (a unit of matrices and vectors would otherwise hold AdamW's two moments
        for every element, 8 bytes per parameter that Muon never reads)."""
        return ()

    def _states_to_unit(self, p: torch.Tensor, engine: Any) -> None:
        """``p`` joined ``engine``: its states (of a plain parameter, maybe on the device)
        become fp32 host tensors, as the host master they step."""
        st = self.state.get(p)
        for name, value in list((st or {}).items()):
            if name != "step" and isinstance(value, torch.Tensor):
                st[name] = value.to("cpu", torch.float32, copy=True)


def _on_host(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the one-pass host kernels (``kernels.muon_kernels``) take ``t`` as a ``dtype``
    operand: contiguous, on the CPU; for other tensors PyTorch's ops run."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def muon_param_groups(model: torch.nn.Module, *, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """``model``'s trainable parameters as ``Muon`` param groups, as the Muon and Moonlight
    papers split them: the 2-D weights of hidden layers (Muon, ``weight_decay``); the
    weights of ``nn.Embedding`` modules and of the output layer (``get_output_embeddings()``
    of a Hugging Face model; AdamW, ``weight_decay``); vectors and other shapes (norm
    weights, biases: AdamW, no weight decay). Groups keep ``model.named_parameters()``'s
    order within them and are left out when empty.

    Returns:
        a list of dicts with ``params``, ``use_muon`` and ``weight_decay``.
    """
    aux: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            aux.add(id(module.weight))
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if head is not None:
        aux.update(id(p) for p in head.parameters())
    hidden, matrices, vectors = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() != 2:
            vectors.append(p)
        elif id(p) in aux:
            matrices.append(p)
        else:
            hidden.append(p)
    groups = [
        {"params": hidden, "use_muon": True, "weight_decay": weight_decay},
        {"params": matrices, "use_muon": False, "weight_decay": weight_decay},
        {"params": vectors, "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


__all__ = ["Muon", "muon_param_groups"]
