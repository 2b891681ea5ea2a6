"""The streaming engine: host store, device window, hooks and the gradient path.

Legend: N = a unit's flat element count (padded), T = its trainable prefix.

[Note: units and views]
Each unit owns one flat fp32 master buffer on the host (N,), one flat pinned wire buffer in
the wire dtype (N,) (the master itself when the dtypes agree), and one flat device tensor
(N,) whose storage is allocated while the unit is on the device and resized to zero while
it is not. The module's host parameters are views into the master; the device parameters
are views into the device tensor, created once. Autograd saves those device views for
backward; because the storage object never changes (only its allocation), a reload before
backward makes every saved view valid again (the trick of FSDP2's unsharded parameters).
Copies into the device tensor go through a second tensor on the same storage with its own
version counter, so that a reload does not trip autograd's in-place check.

[Note: pins and the schedule]
A unit is pinned while something needs its device copy: a forward call (pre- to post-
forward hook), a backward call (from the first gradient of its outputs to the gradients of
its inputs, see ``_PostBackward``), or a recomputation under activation checkpointing. An
unpinned unit stays cached in the window until room is needed (least recently used goes
first). Forward prefetches the units that followed in the previous forward (module order on
the first), backward the units that preceded in this forward, ``prefetch_depth`` ahead.
A wrong guess costs bandwidth, never correctness: every use acquires and waits.

[Note: the window is real memory]
The CPU issues kernels far ahead of the GPU. If evicting a unit only handed its storage back
to the caching allocator (with ``record_stream``), every unit whose kernels are still queued
would stay allocated, and peak memory would follow how far the CPU runs ahead, not the
window. So releasing a unit's last pin records an event on each stream that used it, and
evicting waits for those events on the host before it frees the storage: the CPU never runs
more than a window ahead of the GPU (FSDP1's ``limit_all_gathers`` does the same for its
all-gathers). Gradient buffers are limited the same way: a third waits for the oldest D2H.

[Note: when the step runs]
The first optimizer step is applied by ``opt.step()`` (deferred). If that step saw exactly
one backward and nobody changed the gradients in between (no clipping, no unscaling; seen
through the gradients' version counters), later backward passes step each unit as soon as
its gradients have landed (eager, see [Note: optimizer overlap]). A loop that changes
pattern afterwards gets a RuntimeError, never a silently wrong step. Deferred steps run on
the worker too: ``opt.step()`` returns at once and each unit's next forward waits for that
unit's step only.

[Note: the refresh follows the step]
A resident unit's device copy is refreshed by one H2D after its host step. The forward
that needs the unit waits for that copy, so the copy of the last unit stepped before the
next step's forward reaches it is on the critical path (8 ms for a 0.4 GB block at PCIe 5
speed, and in a step bound by the CPU optimizer nothing else runs then). So the step of a
resident unit runs in pieces (``REFRESH_PIECE_BYTES`` of wire copy each), and each piece's
H2D is issued as soon as the kernel has written it: only the last piece's copy is left
when the step ends. The pieces cover the trainable prefix; the frozen rest of the device
copy is current when the unit was exactly one version behind (checked), and the last
piece's event is the unit's load event (one stream, copies in order).
Pieces cost the worker about 0.3 ms each on the GPU box (a kernel call and a copy issued
from Python, which waits for the GIL while the training loop runs Python code): 4% of the
optimizer's rate when every unit is cut (benchmarks/results/2026-11-22-nvidia-h200-refresh).
So only a step that starts with nothing else queued on the worker is cut: the one whose
refresh the next forward is waiting for.

[Note: the optimizer on the device]
With ``device_optimizer=True`` the plan gives what the GPU budget leaves to resident units
(forward order first) as fp32 master weights and AdamW states on the device
(``_plan.with_device_optimizer``); those units are stepped by PyTorch's fused AdamW on the
device, on the current stream, the moment their gradients are complete: no gradient D2H,
no CPU step, no refresh H2D, and the next forward reads the new weights in stream order.
In a step bound by the CPU optimizer that takes their share off the CPU (DeepSpeed's
ZeRO-Offload++ does the same with a fixed ratio). The device holds the newest state; the
host's masters, wire copies and states are brought up to date by ``synchronize`` (and so
by every ``state_dict``). A deferred step (the first, clipping, accumulation) uploads the
unit's host fp32 gradients. A step that the device cannot take (several optimizers or
param groups in one unit, ZeRO) pulls the state back, steps on the host and uploads it
again at the next device step. The device step's rounding is CUDA's fused AdamW, within
float rounding of the host kernel (bit-identical on the CPU device).

[Note: parameters during backward]
The module slots of a unit point at its device parameters only while one of its forward
calls runs (pre- to post-forward hook, ``always_call``, so also when the forward raises).
A recomputation during backward that does not call the unit's own forward (the user's
``torch.utils.checkpoint`` inside the unit, or ours, which wraps ``forward``) swaps the
unit in for the duration of each call of a module inside it that holds its parameters
(forward hooks on those modules), and our wrapper swaps around its call. So outside a
forward call, ``model.parameters()`` always yields the user's host parameters, even after
a backward pass that raised halfway.

[Note: a failed backward]
A backward pass ends with a callback queued from the root output's gradient hook; autograd
runs it only when the pass succeeds. If the pass raises, the callback never runs, and the
next call from the training loop into ramflow (a forward, ``opt.step``, ``opt.zero_grad``,
``model.zero_grad``, clipping, ``synchronize``, ``state_dict``) sees it queued and cleans up
(``_abort_backward``): it releases what the pass pinned, drops the device gradients of units
whose backward had not finished, waits for the landings and steps already started, and
undoes what they left: gradients that landed where there were none (the usual case, after
``zero_grad``) are dropped again, exactly; gradients added to ones accumulated earlier
cannot be taken out bit for bit, so ``opt.step()`` then raises until ``opt.zero_grad()``.
Units already stepped during the pass (the eager overlap) cannot be rolled back without a
copy of their states, so the next forward and ``opt.step()`` raise a RuntimeError naming
them until a checkpoint is loaded or ``ramflow.accept_partial_step`` is called: never a
silent partial step. A loop-pattern error (raised in backward or in ``opt.step``) sets a
flag that ``opt.zero_grad()`` clears, restarting the step policy, optimizer states kept.

[Note: moving and casting an offloaded model]
Every module of an offloaded model has ``_apply`` (what ``.to``, ``.cuda``, ``.cpu``,
``.half``, ``.float``, ``.to_empty``, ``share_memory`` ... call) routed to the engine through
its instance ``__dict__``. The engine applies the conversion to a probe tensor to learn what
it asks for: a move to the compute device, or a cast to the wire dtype, is what the model
already is (only buffers are converted, and kept on the device), which is why Hugging Face's
``Trainer``'s ``model.to(device)`` works; anything else (another device, another dtype, the
meta device, ``to_empty``, shared memory) raises ValueError naming ``ramflow.undo`` and
``offload``'s arguments, before anything changes. The masters stay fp32 in host RAM.

[Note: a plain optimizer]
A ``torch.optim`` optimizer given offloaded parameters steps the host masters (their
gradients are on the host). Global optimizer step hooks wait for pending landings before
its step and copy the updated weights to the device after it (``refresh_from_host``), so
it trains as on a resident model; it warns once that ``ramflow.optim`` overlaps the step
with backward instead.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NoReturn

import psutil
import torch
import torch.utils.checkpoint
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils import _pytree as pytree

from ._plan import DEVICE_STEP_PIECE, OffloadPlan, format_bytes, make_plan, with_device_optimizer
from ._registry import (
    engine_of_param,
    live_engines,
    set_engine_of_model,
    set_engine_of_param,
    weak_method,
)
from ._streams import CopyStreams, alloc_host, pin_in_place, record_event, unpin
from ._units import UnitSpec
from ._worker import LAND, STEP, HostWorker

if TYPE_CHECKING:
    from ._dist import DistributedState
    from .optim import HostOptimizer

_ALIGN = 64  # elements; keeps every view 128-byte aligned for fp32, 64 for bf16
# A resident unit's refresh is sent in pieces of this many wire bytes, each as soon as the
# step has written it. See [Note: the refresh follows the step].
REFRESH_PIECE_BYTES = 64 << 20
# False: evictions wait for the GPU with the lock held, as before (a benchmark's comparison)
_WAIT_UNLOCKED = True


@atexit.register
def _drain_at_exit() -> None:
    """Let optimizer steps in flight finish before the interpreter tears torch down under
    the worker thread (which aborts the process)."""
    for engine in live_engines():
        try:
            engine.worker.wait_idle()
        except RuntimeError:
            pass  # the error was the user's to see earlier; exiting anyway
        engine.worker.stop()


_optimizer_hooks: list[torch.utils.hooks.RemovableHandle] = []
_warned_optimizers: weakref.WeakSet = weakref.WeakSet()


def _install_optimizer_hooks() -> None:
    """Global step hooks that make a plain ``torch.optim`` optimizer work on offloaded
    parameters (installed once, at the first engine). See [Note: a plain optimizer]."""
    if not _optimizer_hooks:
        _optimizer_hooks.append(register_optimizer_step_pre_hook(_plain_step_pre))
        _optimizer_hooks.append(register_optimizer_step_post_hook(_plain_step_post))


def _engines_stepped_by(opt: torch.optim.Optimizer) -> list[Engine]:
    if getattr(opt, "_ramflow_host_optimizer", False):
        return []
    engines: dict[int, Engine] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            engine = engine_of_param(p)
            if engine is not None:
                engines[id(engine)] = engine
    return list(engines.values())


def _plain_step_pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for engine in _engines_stepped_by(opt):
        engine.synchronize()  # every gradient landed, no step of ours in flight


def _plain_step_post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    engines = _engines_stepped_by(opt)
    if engines and opt not in _warned_optimizers:
        _warned_optimizers.add(opt)
        warnings.warn(
            f"{type(opt).__module__}.{type(opt).__name__} steps parameters of a model offloaded "
            "by ramflow: it runs on the calling thread after backward, and ramflow copies the "
            "updated weights to the device after each of its steps. ramflow.optim.AdamW or SGD "
            "step each unit while backward still runs.",
            stacklevel=3,
        )
    for engine in engines:
        engine.refresh_from_host()


def _release_engine(worker: HostWorker | None, pinned: list[torch.Tensor]) -> None:
    """Finalizer of an engine (see [Note: lifetime] in ``ramflow._registry``): stop the
    worker thread it owned and unpin what it page-locked. Holds no reference to the engine."""
    if worker is not None:
        worker.stop()
    for t in pinned:
        unpin(t)
    pinned.clear()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _refuse_copy() -> NoReturn:
    raise TypeError(
        "an offloaded model cannot be copied with copy.deepcopy or pickled (its weights live "
        "in ramflow's host store and its hooks belong to its engine). Deep-copy the model "
        "before ramflow.offload, save model.state_dict(), or call ramflow.undo(model) first."
    )


class _Unit:
    """Runtime state of one unit. See [Note: units and views]."""

    def __deepcopy__(self, memo: dict) -> _Unit:
        _refuse_copy()

    def __reduce__(self) -> Any:
        _refuse_copy()

    def __init__(self, index: int, spec: UnitSpec) -> None:
        self.index = index
        self.name = spec.name
        self.rest = spec.rest
        self.modules = spec.modules
        self.owned = spec.owned
        self.num_trainable = sum(1 for p in spec.owned if p.requires_grad)
        self.offsets: list[int] = []
        n = 0
        for p in spec.owned:
            self.offsets.append(n)
            n += -(-p.numel() // _ALIGN) * _ALIGN
            if len(self.offsets) == self.num_trainable:
                self.trainable_numel = n
        if self.num_trainable == 0:
            self.trainable_numel = 0
        self.numel = n
        self.resident = False
        self.other_deps: list[_Unit] = []  # owners of tied parameters this unit reads
        # (module, name, host parameter, device parameter) for every slot the forward reads
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        self.orig_dtypes = [p.dtype for p in spec.owned]
        self.given_master = spec.master
        self.given_wire = spec.wire
        self.owner: int | None = None  # the rank that steps this unit (ZeRO), None: every rank
        # host store
        self.master: torch.Tensor
        self.wire: torch.Tensor
        self.staging: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None
        self.host_grad_views: list[torch.Tensor] = []
        self.grad_versions: list[int] = []
        # device side
        self.device_flat: torch.Tensor
        self.device_alias: torch.Tensor
        self.device_params: list[nn.Parameter] = []
        self.allocated = False
        self.device_version = -1
        self.host_version = 0
        self.h2d_event: torch.cuda.Event | None = None
        self.wire_read_event: torch.cuda.Event | None = None
        self.used_streams: set[torch.cuda.Stream] = set()
        self.idle_events: list[torch.cuda.Event] = []  # recorded when the last pin went
        self.pins = 0
        self.backward_pins = 0
        self.wire_ready = threading.Event()
        self.wire_ready.set()
        self.h2d_issued = threading.Event()
        self.h2d_issued.set()
        self.load_requested = False
        # gradients
        self.device_grad: torch.Tensor | None = None
        self.fired = 0
        self.dispatched_this_backward = False
        self.land_future: Future | None = None
        self.staging_reader: Future | None = None  # a step that reads the staging buffer
        self.call_stack: list[_Frame] = []
        self.slot_stack: list[tuple[nn.Module, bool]] = []
        self.swaps = 0
        # stepped on the device (see [Note: the optimizer on the device])
        self.device_stepped = False
        self.device_state: dict[str, torch.Tensor] | None = None
        self.device_step_event: torch.cuda.Event | None = None
        self.host_stale = False  # the device state is newer than the host's copies
        self.device_step_pending = False

    @property
    def deps(self) -> list[_Unit]:
        """The units a call of this one needs on the device: itself first, then the owners
        of tied parameters it reads (a property, so that a unit holds no cycle to itself)."""
        return [self, *self.other_deps]

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire.element_size()

    def views(self, flat: torch.Tensor, *, trainable_only: bool = False) -> list[torch.Tensor]:
        params = self.owned[: self.num_trainable] if trainable_only else self.owned
        return [flat[off : off + p.numel()].view(p.shape) for off, p in zip(self.offsets, params)]

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r})"


def plan_inputs(units: list[_Unit], wire_dtype: torch.dtype) -> dict[str, Any]:
    """What ``make_plan`` needs to know of the units: names, wire bytes, gradient bytes and
    which must stay resident (the engine's plan and ``ramflow plan``'s use the same)."""
    wire_size = torch.empty((), dtype=wire_dtype).element_size()
    return {
        "wire_dtype": str(wire_dtype).replace("torch.", ""),
        "unit_names": [u.name for u in units],
        "unit_bytes": [u.numel * wire_size for u in units],
        "unit_grad_bytes": [u.trainable_numel * wire_size for u in units],
        "always_resident": [u.rest for u in units],
    }


def _checkpointed_forward(
    module_ref: weakref.ref, forward: Any, call_swapped: Any, *args: Any, **kwargs: Any
) -> Any:
    """A unit's forward under ``torch.utils.checkpoint`` (non-reentrant); the recomputation
    runs with the unit's parameters swapped in (see ``Engine._call_swapped``)."""
    module = module_ref()
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        call_swapped, forward, module, *args, use_reentrant=False, **kwargs
    )


class _UnitHook:
    """A hook that calls ``method(unit, *extra, *args)`` for one unit of an engine, holding
    the engine weakly and the unit by index (hooks live in modules and device parameters
    that the unit itself holds: no reference cycle; see [Note: lifetime])."""

    __slots__ = ("_method", "_index", "_extra")

    def __init__(self, method: Any, index: int, *extra: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._index = index
        self._extra = extra

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        unit = method.__self__.units[self._index]
        return method(unit, *self._extra, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _UnitHook:
        _refuse_copy()


class _ModuleCall:
    """``module.<method>(...)`` routed to an engine method ``fn(module, ...)``, holding both
    weakly (it lives in the module's ``__dict__``; see [Note: lifetime])."""

    __slots__ = ("_fn", "_module")

    def __init__(self, fn: Any, module: nn.Module) -> None:
        self._fn = weakref.WeakMethod(fn)
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn, module = self._fn(), self._module()
        assert fn is not None and module is not None, "the offloaded model is gone"
        return fn(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _ModuleCall:
        _refuse_copy()


class _Frame:
    """What one forward call of a unit has taken so far (see ``Engine._pre_forward``)."""

    __slots__ = ("acquired", "swapped", "call")

    def __init__(self) -> None:
        self.acquired = False
        self.swapped = False
        self.call: _Call | None = None


class _Call:
    """One forward call of a unit that autograd may run backward through."""

    __slots__ = ("deps", "order", "position", "pre_backward_done", "bw_pinned", "rc_pinned")

    def __init__(self, deps: list[_Unit], order: list[_Unit] | None, position: int) -> None:
        self.deps = deps
        self.order = order
        self.position = position
        self.pre_backward_done = False
        self.bw_pinned = False
        self.rc_pinned = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, engine: Engine, call: _Call, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.engine = engine
        ctx.call = call
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.engine._post_backward(ctx.call)
        return (None, None, *grads)


class Engine:
    """Owns one offloaded model: its units, host store, window, hooks and worker.

    Built by ``ramflow.offload``; see its docstring for the arguments.
    """

    def __init__(
        self,
        model: nn.Module | None,
        specs: list[UnitSpec],
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        gpu_memory_bytes: int | None,
        prefetch_depth: int,
        activation_checkpointing: bool = False,
        worker: HostWorker | None = None,
        streams: CopyStreams | None = None,
        device_optimizer: bool = False,
    ) -> None:
        # model None: a layer engine (see ``ramflow._linear``): no root module, units are
        # added one by one with ``add_units``, worker and streams are shared per device.
        # The model owns the engine, never the other way round: see [Note: lifetime].
        self._model_ref = None if model is None else weakref.ref(model)
        self._layer_engine = model is None
        self.device = device
        self.wire_dtype = wire_dtype
        self.prefetch_depth = prefetch_depth
        self.device_optimizer = device_optimizer
        # the worker's optimizer kernels so far: parameters stepped, seconds (host_step_totals)
        self._host_steps = [0, 0.0]
        self.streams = streams if streams is not None else CopyStreams(device)
        self.worker = worker if worker is not None else HostWorker(device)
        self._owns_worker = worker is None
        self._lock = threading.RLock()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._gpu_memory_bytes = gpu_memory_bytes
        # fixed device bytes: buffers stay on the device (tiny, and BatchNorm-style running
        # statistics are updated in forward)
        self._fixed_bytes = (
            0 if model is None else sum(b.numel() * b.element_size() for b in model.buffers())
        )
        self.units: list[_Unit] = []
        self._rest_units: list[_Unit] = []
        self._unit_of_param: dict[int, _Unit] = {}
        self._window_used = 0
        self._lru: OrderedDict[_Unit, None] = OrderedDict()
        self._pinned_in_place: list[torch.Tensor] = []
        self.dist: DistributedState | None = None

        # per-forward and per-backward state
        self._order: list[_Unit] = []
        self._in_order: set[_Unit] = set()
        self._prev_order: list[_Unit] = []
        self._positions: dict[_Unit, int] = {}
        self._outstanding: set[_Call] = set()
        self._backward_dirty = False
        self._end_backward_queued_for = -1
        self._landing: list[Future] = []
        self._grads_in_flight: deque[torch.cuda.Event | None] = deque()
        # step policy, see [Note: when the step runs]
        self._optimizers: list[weakref.ref[HostOptimizer]] = []
        self._eager_allowed = False
        self._eager_now: bool | None = None
        self._last_backward_eager = False
        self._final_backwards = 0
        self._clip_used = False
        self._checkpointed: list[nn.Module] = []
        self._hf_checkpointing = False
        # recovery state, see [Note: a failed backward]
        self._pass_landed: list[tuple[_Unit, bool]] = []  # (unit, gradients were fresh)
        self._pass_stepped: list[_Unit] = []
        self._partial_step: list[str] = []  # units a failed backward had already stepped
        self._partial_grads = False  # gradients hold part of a failed backward
        self._pattern_error = False  # a loop-pattern RuntimeError was raised
        self._root_active = 0

        _install_optimizer_hooks()
        self._finalizer = weakref.finalize(
            self, _release_engine, self.worker if self._owns_worker else None,
            self._pinned_in_place,
        )  # fmt: skip
        self.add_units(specs)
        if model is not None:
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.device != self.device:
                        module._buffers[name] = buf.to(self.device)
            self._install_root_hooks()
            if activation_checkpointing:
                self._checkpoint_units(activation_checkpointing)
            set_engine_of_model(model, self)

    @property
    def model(self) -> nn.Module | None:
        """The root module (None for a layer engine or once the model is gone)."""
        return None if self._model_ref is None else self._model_ref()

    def add_units(self, specs: list[UnitSpec]) -> list[_Unit]:
        """Build the host store, device views and hooks of new units and plan again.

        Called once by the constructor, and by ``ramflow.Linear`` for each layer that joins
        a layer engine. Raises MemoryError (host RAM) or ValueError (GPU budget)."""
        new = [_Unit(len(self.units) + i, s) for i, s in enumerate(specs)]
        self._check_host_memory(new)
        all_units = self.units + new
        plan = make_plan(
            device=str(self.device),
            **plan_inputs(all_units, self.wire_dtype),
            fixed_bytes=self._fixed_bytes,
            gpu_memory_bytes=self._gpu_memory_bytes,
            prefetch_depth=self.prefetch_depth,
        )
        if self.units and set(plan.resident) != {u.name for u in self.units if u.resident}:
            raise ValueError("adding units would change which units are resident")
        if self.device_optimizer:
            plan = with_device_optimizer(plan, [u.trainable_numel for u in all_units])
        self.plan: OffloadPlan = plan
        resident = set(plan.resident)
        for u in new:
            u.resident = u.name in resident
            u.device_stepped = u.name in plan.device_stepped
            for p in u.owned:
                self._unit_of_param[id(p)] = u
            self._positions[u] = u.index
        self.units.extend(new)
        self._rest_units = [u for u in self.units if u.rest]
        self._build_host_store(new)
        self._build_device_side(new, specs)
        self._window_capacity = plan.window_bytes
        for u in new:
            if u.resident:
                with self._lock:
                    self._allocate(u)
                    self._issue_h2d(u)
        self._install_unit_hooks(new)
        for u in new:
            for p in u.owned:
                set_engine_of_param(p, self)
        return new

    # ------------------------------------------------------------------ set-up

    def _check_host_memory(self, units: list[_Unit]) -> None:
        wire_size = torch.empty((), dtype=self.wire_dtype).element_size()
        need = 0
        for u in units:
            if u.given_master is not None:
                need -= u.numel * 4  # the layer's own buffer becomes the master
            need += u.numel * 4
            if self.wire_dtype != torch.float32:
                need += u.numel * wire_size
            need += u.trainable_numel * (4 + wire_size)  # host gradients + D2H staging
        avail = psutil.virtual_memory().available
        if need > avail:
            raise MemoryError(
                f"ramflow needs about {format_bytes(need)} of host RAM for this model "
                f"(fp32 master weights, wire copies, gradients) but only {format_bytes(avail)} "
                "is available. Free memory, freeze parameters you do not train "
                "(requires_grad=False), or use a smaller model."
            )

    def _build_host_store(self, units: list[_Unit]) -> None:
        pin = self.device.type == "cuda"
        for u in units:
            if u.given_master is not None:
                # The layer laid its parameters out as this engine would (``_ALIGN``): its
                # buffer is the master, shared memory included (``share_memory_()``).
                u.master = u.given_master
                assert all(
                    p.data_ptr() == view.data_ptr() for p, view in zip(u.owned, u.views(u.master))
                ), "a given master must hold the unit's parameters at the engine's offsets"
                if pin and self.wire_dtype == torch.float32:
                    pin_in_place(u.master, what=f"the master weights of {u.name!r}")
                    self._pinned_in_place.append(u.master)
            else:
                u.master = alloc_host(
                    u.numel,
                    torch.float32,
                    pin=pin and self.wire_dtype == torch.float32,
                    what=f"the master weights of unit {u.name!r}",
                )
                u.master.zero_()  # padding between views stays defined
                with torch.no_grad():
                    for view, p in zip(u.views(u.master), u.owned):
                        view.copy_(p.detach())
                        p.data = view
            if u.given_wire is not None:
                u.wire = u.given_wire
                if pin:
                    pin_in_place(u.wire, what=f"the wire copy of {u.name!r}")
                    self._pinned_in_place.append(u.wire)
            elif self.wire_dtype == torch.float32:
                u.wire = u.master
            else:
                u.wire = alloc_host(
                    u.numel, self.wire_dtype, pin=pin, what=f"the wire copy of {u.name!r}"
                )
                u.wire.copy_(u.master)

    def _build_device_side(self, units: list[_Unit], specs: list[UnitSpec]) -> None:
        for u in units:
            u.device_flat = torch.empty(u.numel, dtype=self.wire_dtype, device=self.device)
            u.device_alias = torch.empty(0, dtype=self.wire_dtype, device=self.device).set_(
                u.device_flat.untyped_storage(), 0, (u.numel,)
            )
            for k, (view, p) in enumerate(zip(u.views(u.device_flat), u.owned)):
                dp = nn.Parameter(view, requires_grad=p.requires_grad)
                if p.requires_grad:
                    self._hooks.append(
                        dp.register_post_accumulate_grad_hook(_UnitHook(self._on_grad, u.index, k))
                    )
                u.device_params.append(dp)
            u.device_flat.untyped_storage().resize_(0)
        device_param = {id(p): dp for u in self.units for p, dp in zip(u.owned, u.device_params)}
        for u, spec in zip(units, specs):
            for module, name in spec.slots:
                host = module._parameters[name]
                u.slots.append((module, name, host, device_param[id(host)]))
                owner = self._unit_of_param[id(host)]
                if owner is not u and owner not in u.other_deps:
                    u.other_deps.append(owner)

    def _install_root_hooks(self) -> None:
        root = self.model
        assert root is not None
        sync = weak_method(self._synchronize_hook)
        self._hooks.append(
            root.register_forward_pre_hook(
                weak_method(self._root_pre_forward), with_kwargs=True, prepend=True
            )
        )
        self._hooks.append(
            root.register_forward_hook(
                weak_method(self._root_post_forward), with_kwargs=True, always_call=True
            )
        )
        self._hooks.append(root.register_state_dict_pre_hook(sync))
        # a partial load keeps the other weights: bring device-stepped ones to the host first
        self._hooks.append(root.register_load_state_dict_pre_hook(sync))
        self._hooks.append(
            root.register_load_state_dict_post_hook(weak_method(self._after_load_state_dict))
        )
        # See [Note: moving and casting an offloaded model]
        for module in root.modules():
            module.__dict__["_apply"] = _ModuleCall(self._apply_to_model, module)
        root.__dict__["zero_grad"] = _ModuleCall(self._module_zero_grad, root)

    def _synchronize_hook(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize()

    def _install_unit_hooks(self, units: list[_Unit]) -> None:
        for u in units:
            if u.rest:
                continue
            for m in u.modules:
                self._hooks.append(
                    m.register_forward_pre_hook(
                        _UnitHook(self._pre_forward, u.index), with_kwargs=True
                    )
                )
                self._hooks.append(
                    m.register_forward_hook(
                        _UnitHook(self._post_forward, u.index), with_kwargs=True, always_call=True
                    )
                )
                if self._layer_engine:  # a layer: its own state dict is the way in and out
                    self._hooks.append(
                        m.register_state_dict_pre_hook(weak_method(self._synchronize_hook))
                    )
                    self._hooks.append(
                        m.register_load_state_dict_post_hook(
                            weak_method(self._after_load_state_dict)
                        )
                    )
            # See [Note: parameters during backward]
            inner = {id(m): m for m, _, _, _ in u.slots if all(m is not v for v in u.modules)}
            for m in inner.values():
                self._hooks.append(
                    m.register_forward_pre_hook(_UnitHook(self._slot_pre_forward, u.index))
                )
                self._hooks.append(
                    m.register_forward_hook(
                        _UnitHook(self._slot_post_forward, u.index), always_call=True
                    )
                )

    def _checkpoint_units(self, which: bool | Iterable[str] = True) -> None:
        """Recompute activations in backward instead of keeping them
        (``torch.utils.checkpoint``, non-reentrant; Chen et al. 2016): every block
        (``which=True``), or the units named in ``which`` (a plan's ``checkpointed``).

        A Hugging Face model gets its own switch (it also turns the KV cache off, which a
        recomputation would otherwise extend twice); with names, the layers of the other
        units have theirs turned off again. Other models (and named units that hold no
        Hugging Face layer) get a wrapper inside the unit's forward, so the unit's hooks
        still run once per call and the recomputation finds the unit pinned and its device
        parameters in place.

        Raises:
            ValueError: ``which`` names a unit the model does not have (the model is given
                back as it was).
        """
        names: set[str] | None = None
        if which is not True:
            names = {which} if isinstance(which, str) else set(which)
            known = [u.name for u in self.units if not u.rest]
            unknown = sorted(names - set(known))
            if unknown:
                self.remove()
                raise ValueError(
                    f"activation_checkpointing names units this model does not have: {unknown}. "
                    f"Its units: {known}"
                )
        if getattr(self.model, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            self._hf_checkpointing = True
            if names is None:
                return
            for u in self.units:
                flagged = [
                    m
                    for root in u.modules
                    if root is not self.model
                    for m in root.modules()
                    if getattr(m, "gradient_checkpointing", False) is True
                ]
                if u.name not in names:
                    for m in flagged:
                        m.gradient_checkpointing = False
                elif flagged:
                    names.discard(u.name)  # Hugging Face recomputes it
        for u in self.units:
            if u.rest or len(u.modules) != 1 or u.modules[0] is self.model:
                continue
            if names is not None and u.name not in names:
                continue
            module = u.modules[0]
            if "forward" in module.__dict__:
                continue  # already wrapped by someone else; leave it alone
            # the wrapper lives in the module: it holds the module and the engine weakly
            forward = functools.partial(
                _checkpointed_forward,
                weakref.ref(module),
                type(module).forward,
                _UnitHook(self._call_swapped, u.index),
            )
            module.forward = forward
            self._checkpointed.append(module)

    def _call_swapped(self, u: _Unit, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` with ``u``'s module slots on the device parameters: the checkpoint
        wrapper's recomputation calls the unit's own forward, not its hooks."""
        self._swap(u, to_device=True)
        try:
            return fn(*args, **kwargs)
        finally:
            self._swap(u, to_device=False)

    # ------------------------------------------------------------------ window

    def _allocate(self, u: _Unit) -> None:
        """Give ``u`` device storage (lock held), on the H2D stream that writes it first;
        ``_evict`` frees it only after every reader is done."""
        nbytes = u.numel * u.device_flat.element_size()
        if self.streams.is_cuda:
            with torch.cuda.stream(self.streams.h2d_stream):
                u.device_flat.untyped_storage().resize_(nbytes)
        else:
            u.device_flat.untyped_storage().resize_(nbytes)
        u.allocated = True
        if not u.resident:
            self._window_used += u.nbytes
            self._lru[u] = None

    def _evict(self, u: _Unit) -> None:
        """Free ``u``'s device storage (lock held). See [Note: the window is real memory]."""
        assert u.pins == 0 and not u.resident and u.allocated
        for event in u.idle_events:
            event.synchronize()
        u.idle_events = []
        u.used_streams.clear()
        u.device_flat.untyped_storage().resize_(0)
        u.allocated = False
        u.device_version = -1
        self._window_used -= u.nbytes
        self._lru.pop(u, None)

    def _make_room(self, u: _Unit, protect: Iterable[_Unit] = ()) -> bool:
        """Evict least recently used unpinned units until ``u`` fits (lock held; released
        while it waits for the GPU to finish with a victim, see ``_wait_unlocked``)."""
        keep = set(protect)
        keep.add(u)
        while self._window_used + u.nbytes > self._window_capacity:
            victim = next((v for v in self._lru if v.pins == 0 and v not in keep), None)
            if victim is None:
                return False
            busy = [e for e in victim.idle_events if not e.query()]
            if busy and _WAIT_UNLOCKED:
                self._wait_unlocked(busy)
                continue  # the window may have changed meanwhile: choose again
            self._evict(victim)
        return True

    def _wait_unlocked(self, events: list[torch.cuda.Event]) -> None:
        """Wait for ``events`` with the engine lock released (held once by the caller).

        The training loop's thread runs ahead of the GPU and waits here, at a window slot,
        most of the time it streams; the host worker takes the lock after every unit it
        steps, to issue the unit's copy. Waiting with the lock held would stall the CPU
        optimizer until the GPU reached the victim's last kernel."""
        self._lock.release()
        try:
            for event in events:
                event.synchronize()
        finally:
            self._lock.acquire()

    def _issue_h2d(self, u: _Unit) -> None:
        """Copy ``u``'s wire buffer into its device storage (lock held, storage allocated).

        Overwriting a copy that is still on the device (a resident unit after its step, a
        stale cached one) waits for the streams that read it, so queued kernels never see
        half-new weights."""
        if u.device_version != -1:
            for stream in u.used_streams:
                self.streams.h2d_stream.wait_stream(stream)
        event = self.streams.h2d(u.device_alias, u.wire)
        u.h2d_event = event
        u.wire_read_event = event
        u.device_version = u.host_version
        u.load_requested = False
        u.h2d_issued.set()

    def _request(self, u: _Unit, *, must: bool, protect: Iterable[_Unit] = ()) -> bool:
        """Make sure a fresh copy of ``u`` is on its way (lock held).

        With ``must`` the window may overflow rather than fail (a forward that needs more
        units at once than the window holds); a prefetch returns False instead.
        """
        if u.allocated and u.device_version == u.host_version:
            if not u.resident:
                self._lru.move_to_end(u)
            return True
        if u.load_requested:
            return True
        if not u.allocated:
            if not self._make_room(u, protect) and not must:
                return False
            self._allocate(u)
        elif not u.resident:
            self._lru.move_to_end(u)
        if u.wire_ready.is_set():
            self._issue_h2d(u)
        else:  # its optimizer step is still running; the worker issues the copy after it
            u.load_requested = True
            u.h2d_issued.clear()
        return True

    def _acquire(self, units: list[_Unit], *, backward: bool = False) -> None:
        """Pin ``units`` and make the compute stream wait for their copies; on an error
        (out of memory, a failed optimizer step) the pins taken so far are given back."""
        pinned: list[_Unit] = []
        try:
            with self._lock:
                for u in units:
                    self._request(u, must=True)
                    u.pins += 1
                    if backward:
                        u.backward_pins += 1
                    pinned.append(u)
            stream = self.streams.compute_stream()
            for u in units:
                while not u.h2d_issued.wait(timeout=1.0):
                    self.worker.raise_error()
                if stream is not None:
                    if u.h2d_event is not None:
                        stream.wait_event(u.h2d_event)  # See [Note: copies and events]
                    u.used_streams.add(stream)
        except BaseException:
            self._release(pinned, backward=backward)
            raise

    def _release(self, units: list[_Unit], *, backward: bool = False) -> None:
        with self._lock:
            for u in units:
                u.pins -= 1
                if backward:
                    u.backward_pins -= 1
                assert u.pins >= 0 and u.backward_pins >= 0
                if u.pins == 0 and u.used_streams:
                    u.idle_events = [record_event(s) for s in u.used_streams]

    def _prefetch(self, units: list[_Unit]) -> None:
        with self._lock:
            for u in units:
                if u.resident:
                    continue
                if not self._request(u, must=False, protect=units):
                    break

    def _expand(self, units: Iterable[_Unit]) -> list[_Unit]:
        out: list[_Unit] = []
        for u in units:
            for d in u.deps:
                if d not in out:
                    out.append(d)
        return out

    def _forward_prediction(self, u: _Unit, position: int) -> list[_Unit]:
        prev = self._prev_order
        depth = self.prefetch_depth
        if position < len(prev) and prev[position] is u:
            nxt = prev[position + 1 : position + 1 + depth]
        else:
            nxt = [v for v in self.units[u.index + 1 :] if not v.resident and not v.rest][:depth]
        return self._expand(nxt)

    def _backward_prediction(self, order: list[_Unit], position: int) -> list[_Unit]:
        lo = max(0, position - self.prefetch_depth)
        return self._expand(reversed(order[lo:position]))

    # ------------------------------------------------------------------ hooks

    def _swap(self, u: _Unit, *, to_device: bool) -> None:
        """Point the unit's module slots at the device parameters while a forward call or
        a backward call of the unit is in flight (counted: they nest under checkpointing,
        whose recomputation may call submodules directly, without the unit's hooks)."""
        u.swaps += 1 if to_device else -1
        assert u.swaps >= 0
        if u.swaps == (1 if to_device else 0):
            for module, name, host, dev in u.slots:
                module._parameters[name] = dev if to_device else host

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _in_backward():
            return args, kwargs
        self._settle()
        self.worker.raise_error()
        self._raise_if_partial_step()
        if self._order:
            self._prev_order = self._order
        self._order = []
        self._in_order = set()
        rest = self._rest_units
        if rest:
            self._acquire(rest)
            for u in rest:
                self._swap(u, to_device=True)
        self._root_active += 1  # _root_post_forward undoes the above (also after an error)
        cast = (
            self.wire_dtype
            if self.wire_dtype != torch.float32 and not torch.is_autocast_enabled(self.device.type)
            else None
        )

        def move(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.device != self.device:
                x = x.to(self.device)
            if cast is not None and x.is_floating_point() and x.dtype != cast:
                x = x.to(cast)
            return x

        return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)

    def _root_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _in_backward() or not self._root_active:
            return
        self._root_active -= 1
        rest = self._rest_units
        for u in rest:
            self._swap(u, to_device=False)
        self._release(rest)
        if output is None:
            return  # the forward raised
        positions: dict[_Unit, int] = {}
        for i, u in enumerate(self._order):
            positions.setdefault(u, i)
        self._positions.update(positions)
        if not torch.is_grad_enabled():
            # no backward follows: start loading the next forward's first units now, so
            # back-to-back inference calls do not wait for the pipeline to fill
            first = [u for u in self._order if not u.resident][: self.prefetch_depth]
            self._prefetch(self._expand(first))
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._root_output_grad)

    def _layer_pass(self, u: _Unit) -> None:
        """A layer engine has no root to mark a forward pass: a unit called again starts
        the next one (and ends a backward pass that did not end on its own)."""
        if self._backward_dirty:
            self._end_backward()
        if u in self._in_order:
            self._prev_order = self._order
            self._order = []
            self._in_order = set()
        if u not in self._in_order:
            self._positions[u] = len(self._order)

    def _root_output_grad(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self._end_backward_queued_for != task:
            self._end_backward_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict):
        in_bw = _in_backward()
        if not in_bw and self._layer_engine:
            self._settle()
            self._raise_if_partial_step()
            self._layer_pass(u)
        # what this call takes, undone by _post_forward also when something below raises
        # (always_call): a failed forward leaves no pin and no swapped parameter behind
        frame = _Frame()
        u.call_stack.append(frame)
        position = len(self._order)
        if not in_bw:
            self._order.append(u)
            self._in_order.add(u)
        with torch.profiler.record_function(f"ramflow.wait:{u.name}"):
            self._acquire(u.deps)
        frame.acquired = True
        self._swap(u, to_device=True)
        frame.swapped = True
        if not in_bw:
            self._prefetch(self._forward_prediction(u, position))
        else:  # recomputation under checkpointing: backward goes on to earlier units
            last = max((i for i, v in enumerate(self._order) if v is u), default=None)
            if last is not None:
                self._prefetch(self._backward_prediction(self._order, last))
        if torch.is_grad_enabled():
            call = _Call(u.deps, None if in_bw else self._order, position)
            frame.call = call
            leaves, spec = pytree.tree_flatten((args, kwargs))
            idx = [
                i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
            ]
            if idx:
                wrapped = _PostBackward.apply(self, call, *[leaves[i] for i in idx])
                for i, t in zip(idx, wrapped):
                    leaves[i] = t
                args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, kwargs

    def _post_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if not u.call_stack:
            return  # a hook before ours raised: our pre-forward never ran
        frame = u.call_stack.pop()
        if frame.swapped:
            self._swap(u, to_device=False)
        if not frame.acquired:
            return
        call = frame.call
        if call is None or not _in_backward():
            self._release(u.deps)
            if call is not None:
                tensors = [
                    t
                    for t in pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                hook = functools.partial(weak_method(self._pre_backward), call)
                for t in tensors:
                    t.register_hook(hook)
            return
        # Recomputation inside backward. Non-reentrant checkpointing: the original call
        # holds backward pins, so this one can go. Reentrant: nothing else holds the unit
        # until the nested backward through this recomputation reaches its inputs.
        if all(d.backward_pins > 0 for d in u.deps):
            self._release(u.deps)
        else:
            call.rc_pinned = True
            self._outstanding.add(call)
            self._backward_dirty = True

    def _slot_pre_forward(self, u: _Unit, module: nn.Module, args: tuple) -> None:
        """A module inside ``u`` called during backward (a recomputation that does not go
        through the unit's own forward): its parameters are the device ones while it runs.
        See [Note: parameters during backward]."""
        swap = _in_backward() and u.pins > 0
        u.slot_stack.append((module, swap))
        if swap:
            self._swap(u, to_device=True)

    def _slot_post_forward(self, u: _Unit, module: nn.Module, args: tuple, output: Any) -> None:
        if u.slot_stack and u.slot_stack[-1][0] is module:
            if u.slot_stack.pop()[1]:
                self._swap(u, to_device=False)

    def _pre_backward(self, call: _Call, grad: torch.Tensor) -> None:
        if call.pre_backward_done:
            return
        call.pre_backward_done = True
        self._backward_dirty = True
        if self._layer_engine:  # no root output to end the backward pass from
            self._root_output_grad(grad)
        with torch.profiler.record_function("ramflow.wait_backward"):
            self._acquire(call.deps, backward=True)
        call.bw_pinned = True
        self._outstanding.add(call)
        if call.order is not None:
            self._prefetch(self._backward_prediction(call.order, call.position))

    def _post_backward(self, call: _Call) -> None:
        if call.bw_pinned:
            call.bw_pinned = False
            self._release(call.deps, backward=True)
        if call.rc_pinned:
            call.rc_pinned = False
            self._release(call.deps)
        self._outstanding.discard(call)

    # ------------------------------------------------------------------ gradients

    def _on_grad(self, u: _Unit, k: int, dparam: nn.Parameter) -> None:
        """Post-accumulate hook of device parameter ``k`` of ``u``: into the flat buffer."""
        self._backward_dirty = True
        if u.device_grad is None:
            while len(self._grads_in_flight) >= 2:  # the plan's two gradient buffers
                done = self._grads_in_flight.popleft()
                if done is not None:
                    done.synchronize()
            u.device_grad = torch.zeros(
                u.trainable_numel, dtype=self.wire_dtype, device=self.device
            )
        off = u.offsets[k]
        u.device_grad[off : off + dparam.numel()].view(dparam.shape).copy_(dparam.grad)
        dparam.grad = None
        u.fired += 1
        if u.fired == u.num_trainable:
            self._dispatch_grads(u)

    def _dispatch_grads(self, u: _Unit) -> None:
        """One D2H copy of ``u``'s gradients, then landing (and maybe the step) on the worker."""
        eager = self._decide_eager()
        if u.dispatched_this_backward and eager:
            raise self._pattern(
                f"unit {u.name!r} received gradients twice in one backward pass (a unit called "
                "in two reentrant checkpoint regions), so its step cannot run during backward. "
                "Construct the ramflow optimizer with overlap=False."
            )
        u.dispatched_this_backward = True
        reduced = None
        if self._live_dist() is not None:  # data parallel: sum (or average) over ranks first
            reduced = self.dist.reduce_gradients(u, u.device_grad)
            if not self.dist.keeps_gradients(u):  # ZeRO-2: another rank steps this unit
                self._grads_in_flight.append(self.streams.retire(u.device_grad, after=reduced))
                u.device_grad = None
                u.fired = 0
                return
        if eager and u.device_stepped and self._steps_here(u):
            eager = False  # no host step follows: the gradients only land (if kept)
            params = u.owned[: u.num_trainable]
            if self._device_steppable(u) and all(p.grad is None for p in params):
                opt = self.optimizers[0]
                self._device_step(u, opt, opt._hyperparameters(), u.device_grad)
                self._pass_stepped.append(u)
                if not opt.keep_grads:
                    u.device_grad = None
                    u.fired = 0
                    u.grad_versions = []
                    return
            else:  # accumulated on the host: stepped from there at the end of backward
                u.device_step_pending = True
        for reader in (u.land_future, u.staging_reader):
            if reader is not None and not reader.done():
                reader.result()  # the staging buffer is still being read
        u.staging_reader = None
        if u.staging is None:
            u.staging = alloc_host(
                u.trainable_numel,
                self.wire_dtype,
                pin=self.streams.is_cuda,
                what=f"the gradient staging buffer of {u.name!r}",
            )
        with torch.profiler.record_function(f"ramflow.d2h_grads:{u.name}"):
            event = self.streams.d2h(u.staging, u.device_grad, after=reduced)
        self._grads_in_flight.append(event)
        u.device_grad = None
        u.fired = 0
        eager = eager and self._steps_here(u)
        if eager:
            with self._lock:
                u.host_version += 1
                u.wire_ready.clear()
        u.land_future = self.worker.submit(
            LAND,
            len(self._landing),
            functools.partial(self._land, u, event, eager),
            ready=None if event is None else event.query,
        )
        self._landing.append(u.land_future)

    def _land(self, u: _Unit, event: torch.cuda.Event | None, eager: bool) -> None:
        """Worker: add the staged gradients into the fp32 host gradients of ``u``.

        When the step follows at once and one optimizer steps the whole unit in one pass
        (``flat_group``), landing is folded into that pass: the kernel reads the staged
        gradients and writes the fp32 gradients (``p.grad``) as it steps. ``p.grad`` points
        at them already, so a change by the user is still seen by the version check; their
        contents are complete once the step is (``ramflow.synchronize``)."""
        if event is not None:
            event.synchronize()
        params = u.owned[: u.num_trainable]
        if u.host_grad is None:
            u.host_grad = torch.empty(u.trainable_numel, dtype=torch.float32)
            u.host_grad_views = u.views(u.host_grad, trainable_only=True)
        staging = u.staging
        assert staging is not None
        fresh = all(p.grad is None for p in params)
        ours = not fresh and all(p.grad is v for p, v in zip(params, u.host_grad_views))
        fused = (
            eager
            and self._steps_here(u)
            and (fresh or ours)
            and len(self.optimizers) == 1
            and self.optimizers[0].flat_group(u) is not None
        )
        # the optimizer's keep_grads=False: the fused step does not write p.grad at all
        drop = fused and fresh and not self.optimizers[0].keep_grads
        with torch.no_grad():
            if fused:
                pass  # See the docstring: the step writes the gradients.
            elif fresh:
                u.host_grad.copy_(staging)
            elif ours:
                u.host_grad.add_(staging)
            else:
                for p, view, s in zip(
                    params, u.host_grad_views, u.views(staging, trainable_only=True)
                ):
                    if p.grad is None:
                        view.copy_(s)
                        p.grad = view
                    else:
                        p.grad.add_(s)
            if fresh and not drop:
                for p, view in zip(params, u.host_grad_views):
                    p.grad = view
        u.grad_versions = [] if drop else [p.grad._version for p in params]
        self._pass_landed.append((u, fresh))
        if fused or (eager and self._steps_here(u)):
            self._pass_stepped.append(u)
        if fused:
            opt = self.optimizers[0]
            u.staging_reader = self.worker.submit(
                STEP,
                self._positions.get(u, u.index),
                functools.partial(
                    self._step_staged,
                    u,
                    opt,
                    opt._hyperparameters(),
                    accumulate=ours,
                    keep_grads=not drop,
                ),
            )
        elif eager and self._steps_here(u):
            self.worker.submit(
                STEP,
                self._positions.get(u, u.index),
                functools.partial(self._step_unit, u, self._step_items(u, self.optimizers)),
            )

    def _decide_eager(self) -> bool:
        if self._eager_now is None:
            no_step = any(opt._no_step_depth for opt in self.optimizers)
            if self._last_backward_eager and not no_step:
                raise self._pattern(
                    "a second backward pass ran before opt.step(), but ramflow had already "
                    "applied the step during the first (it saw one backward per step so far). "
                    "For gradient accumulation, run the non-final micro-batches under "
                    "`with opt.no_step():`, or construct the optimizer with overlap=False."
                )
            self._eager_now = (
                self._eager_allowed
                and not no_step
                and self._final_backwards == 0
                and len(self.optimizers) == 1
            )
        return self._eager_now

    def _end_backward(self) -> None:
        """End of a backward pass: release what it held, send leftover gradients, and wait
        until every gradient has landed in the host gradients (so ``p.grad`` is complete)."""
        for call in list(self._outstanding):
            self._post_backward(call)
        for u in self.units:
            if u.fired:
                self._dispatch_grads(u)
            u.dispatched_this_backward = False
        landing, self._landing = self._landing, []
        for fut in landing:
            fut.result()
        for u in self.units:
            if u.device_step_pending:
                u.device_step_pending = False
                self._step_from_host(u, self._step_items(u, self.optimizers))

        if self._eager_now is not None:
            no_step = any(opt._no_step_depth for opt in self.optimizers)
            if not no_step:
                self._final_backwards += 1
            self._last_backward_eager = self._eager_now
        self._eager_now = None
        self._backward_dirty = False
        self._end_backward_queued_for = -1
        self._pass_landed.clear()
        self._pass_stepped.clear()

    # ------------------------------------------------------------------ recovery

    def _settle(self) -> None:
        """Called where the training loop enters ramflow outside backward (a forward, a
        step, zero_grad, clipping, synchronize): finish the last backward pass. Its end
        callback runs only when the pass succeeds, so one that was queued and never ran
        means the pass raised. See [Note: a failed backward]."""
        if _in_backward():
            return
        if self._end_backward_queued_for != -1:
            self._abort_backward()
        elif self._backward_dirty:  # a backward that did not reach the root's outputs
            self._end_backward()

    def _abort_backward(self) -> None:
        """Clean up after a backward pass that raised. See [Note: a failed backward]."""
        for call in list(self._outstanding):
            self._post_backward(call)
        for u in self.units:
            u.device_grad = None  # gradients of units whose backward had not finished
            u.fired = 0
            u.dispatched_this_backward = False
            u.device_step_pending = False
        landing, self._landing = self._landing, []
        error: BaseException | None = None
        for fut in landing:
            try:
                fut.result()
            except BaseException as err:  # noqa: BLE001 - re-raised below, after clean-up
                error = error or err
        try:
            self.worker.wait_idle()  # the steps the landings started
        except RuntimeError as err:
            error = error or err
        self._grads_in_flight.clear()
        for u, fresh in self._pass_landed:
            if fresh:  # nothing was accumulated before this pass: drop what it left
                for p in u.owned[: u.num_trainable]:
                    p.grad = None
            else:
                self._partial_grads = True
            u.grad_versions = []
        stepped = {u.name for u in self._pass_stepped}
        self._partial_step = [u.name for u in self.units if u.name in stepped]
        self._pass_landed.clear()
        self._pass_stepped.clear()
        self._eager_now = None
        self._backward_dirty = False
        self._end_backward_queued_for = -1
        if error is not None:
            raise RuntimeError(f"ramflow host worker failed: {error}") from error

    def _raise_if_partial_step(self) -> None:
        if self._partial_step:
            names = self._partial_step
            shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
            raise RuntimeError(
                f"the last backward pass raised after ramflow had already applied this step's "
                f"optimizer update to {len(names)} unit(s) ({shown}): steps run during backward "
                "once the loop is known to step after every backward. The model is partly "
                "stepped. Reload a checkpoint (model.load_state_dict and opt.load_state_dict), "
                "or call ramflow.accept_partial_step(model) to go on from these weights; "
                "AdamW(..., overlap=False) never steps before backward has finished."
            )

    def accept_partial_step(self) -> None:
        """Go on from the weights a failed backward left partly stepped."""
        self._settle()
        self._partial_step = []

    def on_zero_grad(self) -> None:
        """Called by ``opt.zero_grad()`` (and the root's ``zero_grad``) before gradients are
        cleared: nothing from the last backward lands afterwards, and after a loop-pattern
        error the step policy starts afresh (the optimizer's states stay as they are)."""
        self._settle()
        self._partial_grads = False
        if self._pattern_error:
            self._pattern_error = False
            self._last_backward_eager = False
            self._final_backwards = 0
            self._eager_allowed = False
            self._clip_used = False

    def _pattern(self, message: str) -> RuntimeError:
        """A loop-pattern error; ``opt.zero_grad()`` recovers from it."""
        self._pattern_error = True
        return RuntimeError(
            message + " After this error, call opt.zero_grad() and go on: ramflow then "
            "learns the loop's pattern afresh (the optimizer's states are kept)."
        )

    # ------------------------------------------------------------------ steps

    def _step_items(self, u: _Unit, optimizers: list[HostOptimizer]) -> list[tuple]:
        """What a step of ``u`` needs, captured now: per optimizer its hyperparameters, and
        the parameters it holds with their gradients (the user may zero_grad before the
        worker gets to the step)."""
        items = []
        for opt in optimizers:
            params = [p for p in u.owned[: u.num_trainable] if p.grad is not None and opt._holds(p)]
            if params:
                items.append((opt, opt._hyperparameters(), params, [p.grad for p in params]))
        return items

    def _step_unit(self, u: _Unit, items: list[tuple]) -> None:
        """Worker: step ``u``'s master weights with each optimizer, then refresh its wire
        copy (in the same pass when one optimizer steps the whole unit flat)."""
        self._before_host_write(u)
        wire_written = False
        pieces = None
        start = time.perf_counter()
        with torch.profiler.record_function(f"ramflow.optimizer:{u.name}"):
            if len(items) == 1 and self._whole_unit(u, items[0]):
                opt, hyper, _, _ = items[0]
                pieces = self._refresh_pieces(u)
                opt.flat_step(
                    u,
                    hyper,
                    grad=u.host_grad,
                    wire_out=self._wire_prefix(u),
                    pieces=pieces,
                    after_piece=functools.partial(self._send_piece, u) if pieces else None,
                )
                wire_written = True
            else:
                for opt, hyper, params, grads in items:
                    opt._step_params(params, grads, hyper)
        self._count_host_step(sum(p.numel() for item in items for p in item[2]), start)
        self._refresh_wire(u, written=wire_written, sent=wire_written and bool(pieces))

    def _step_staged(
        self,
        u: _Unit,
        opt: HostOptimizer,
        hyper: list[dict],
        *,
        accumulate: bool,
        keep_grads: bool = True,
    ) -> None:
        """Worker: land and step ``u`` in one pass from the staged gradients. See ``_land``."""
        self._before_host_write(u)
        pieces = self._refresh_pieces(u)
        start = time.perf_counter()
        with torch.profiler.record_function(f"ramflow.optimizer:{u.name}"):
            opt.flat_step(
                u,
                hyper,
                grad=u.staging,
                accumulate=u.host_grad if accumulate else None,
                grad_out=None if accumulate or not keep_grads else u.host_grad,
                wire_out=self._wire_prefix(u),
                pieces=pieces,
                after_piece=functools.partial(self._send_piece, u) if pieces else None,
            )
        self._count_host_step(u.trainable_numel, start)
        self._refresh_wire(u, written=True, sent=bool(pieces))

    def _refresh_pieces(self, u: _Unit) -> list[tuple[int, int]] | None:
        """Worker, before a flat step of ``u``: the element ranges to step and send one by
        one, or None to send the unit after its step as usual. See [Note: the refresh
        follows the step]."""
        if not u.resident or u.wire is u.master or self.worker.queued():
            return None
        step = max(_ALIGN, REFRESH_PIECE_BYTES // u.wire.element_size() // _ALIGN * _ALIGN)
        n = u.trainable_numel
        with self._lock:
            # the device copy lacks this step only, so the frozen rest needs no copy
            current = u.allocated and u.device_version == u.host_version - 1
        if not current or n <= step:
            return None
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _send_piece(self, u: _Unit, lo: int, hi: int) -> None:
        """Worker: copy the wire range ``[lo, hi)`` that the step has just written to the
        device copy of resident ``u`` (the first piece waits for the copy's readers).

        No lock: a resident unit is never evicted, and nobody else issues its copy or reads
        it until ``_refresh_wire`` sets ``h2d_issued``."""
        if lo == 0:
            for stream in list(u.used_streams):
                self.streams.h2d_stream.wait_stream(stream)
        u.wire_read_event = self.streams.h2d(u.device_alias[lo:hi], u.wire[lo:hi])

    def _count_host_step(self, params: int, start: float) -> None:
        self._host_steps[0] += params
        self._host_steps[1] += time.perf_counter() - start

    def host_step_totals(self) -> tuple[int, float]:
        """(parameters stepped, seconds) of the worker's optimizer kernels since the engine
        was made, summed over units: their rate is the CPU optimizer's rate inside the
        training loop, beside the copies and the loop's own threads. Read between steps
        (after ``synchronize``) for exact figures."""
        return self._host_steps[0], self._host_steps[1]

    def _whole_unit(self, u: _Unit, item: tuple) -> bool:
        opt, _, params, grads = item
        return (
            u.host_grad is not None
            and opt.flat_group(u) is not None
            and len(params) == u.num_trainable == len(u.host_grad_views)
            and all(g is v for g, v in zip(grads, u.host_grad_views))
        )

    @staticmethod
    def _wire_prefix(u: _Unit) -> torch.Tensor | None:
        return None if u.wire is u.master else u.wire[: u.trainable_numel]

    @staticmethod
    def _before_host_write(u: _Unit) -> None:
        """No host buffer is rewritten while a DMA reads it: wait for the unit's last H2D."""
        if u.wire_read_event is not None:
            u.wire_read_event.synchronize()

    def _refresh_wire(self, u: _Unit, *, written: bool = False, sent: bool = False) -> None:
        """Worker: rewrite the wire copy from the master (unless the step already did) and
        re-issue any waiting load; ``sent``: the step already copied it to the device in
        pieces (``_send_piece``), the last piece's event stands for the load."""
        if u.wire is not u.master:
            if not written:
                self._before_host_write(u)
                u.wire.copy_(u.master)
        with self._lock:
            u.wire_ready.set()
            if sent:
                u.h2d_event = u.wire_read_event
                u.device_version = u.host_version
                u.load_requested = False
                u.h2d_issued.set()
            elif u.load_requested or (u.resident and u.allocated):
                self._issue_h2d(u)

    def schedule_step(self, opt: HostOptimizer) -> None:
        """Called by ``opt.step()``: check or schedule the step of every unit it holds."""
        self._settle()
        self.worker.raise_error()
        self._raise_if_partial_step()
        if self._partial_grads:
            raise RuntimeError(
                "the gradients hold part of a backward pass that raised, added to gradients "
                "accumulated before it; that part cannot be taken out again. Call "
                "opt.zero_grad() and run the micro-batches of this step again."
            )
        modified = self._grads_modified(opt)
        if self._last_backward_eager:
            if modified:
                raise self._pattern(
                    "gradients were changed after backward (clipping, unscaling or a manual "
                    "edit), but ramflow had already applied this step during backward. Use "
                    "ramflow.clip_grad_norm_ from the first step on, or construct the "
                    "optimizer with overlap=False."
                )
        else:
            for u in sorted(self.units, key=lambda v: self._positions.get(v, v.index)):
                if not self._steps_here(u):
                    continue
                items = self._step_items(u, [opt])
                if items:
                    self._step_from_host(u, items)
        self._eager_allowed = (
            opt.overlap and self._final_backwards == 1 and not modified and not self._clip_used
        )
        self._final_backwards = 0
        self._last_backward_eager = False
        if self._live_dist() is not None:
            self.dist.after_step(self)

    def _step_from_host(self, u: _Unit, items: list[tuple]) -> None:
        """Step ``u`` from its host gradients: on the device if it is stepped there and one
        optimizer steps it whole, else on the worker (a device-stepped unit then gives its
        state back to the host first, and uploads it again at its next device step)."""
        if not items:
            return
        if (
            u.device_stepped
            and len(items) == 1
            and self._device_steppable(u, items[0][0])
            and self._whole_unit(u, items[0])
        ):
            opt, hyper, _, _ = items[0]
            assert u.host_grad is not None
            self._device_step(u, opt, hyper, u.host_grad)
            return
        self._drop_device_state(u)
        with self._lock:
            u.host_version += 1
            u.wire_ready.clear()
        self.worker.submit(
            STEP, self._positions.get(u, u.index), functools.partial(self._step_unit, u, items)
        )

    # ------------------------------------------------------------------ device steps

    def _device_steppable(self, u: _Unit, opt: HostOptimizer | None = None) -> bool:
        """Whether ``u`` can be stepped on the device now: planned so, one process, and one
        optimizer with a device step holding all of it flat (one group, one step count)."""
        if not u.device_stepped or self._live_dist() is not None:
            return False
        if opt is None:
            if len(self.optimizers) != 1:
                return False
            opt = self.optimizers[0]
        return hasattr(opt, "device_flat_step") and opt.flat_group(u) is not None

    def _device_step(
        self, u: _Unit, opt: HostOptimizer, hyper: list[dict], grad: torch.Tensor
    ) -> None:
        """Step ``u`` on the device, on the current stream: its fp32 master weights and
        optimizer states stay there and the new weights go straight into its device copy,
        which the next forward reads in stream order. The host copies are stale until
        ``_pull_device_state``."""
        n = u.trainable_numel
        with torch.profiler.record_function(f"ramflow.device_optimizer:{u.name}"):
            if u.device_state is None:
                self._wait_host_idle(u)
                u.device_state = opt.device_state(u, self.device)  # type: ignore[attr-defined]
            opt.device_flat_step(  # type: ignore[attr-defined]
                u,
                hyper,
                grad=grad,
                state=u.device_state,
                weights_out=u.device_alias[:n],  # see [Note: units and views]
                piece=DEVICE_STEP_PIECE,
            )
        if self.device.type == "cuda":
            u.device_step_event = record_event(torch.cuda.current_stream(self.device))
        u.host_stale = True

    def _wait_host_idle(self, u: _Unit) -> None:
        """Before the host copies of ``u`` are read for the device: its host step done."""
        u.wire_ready.wait()
        if u.staging_reader is not None:
            u.staging_reader.result()

    def _pull_device_state(self, u: _Unit, *, weights: bool = True) -> None:
        """Copy ``u``'s device-stepped master weights and wire copy (unless ``weights`` is
        False: the host's were just replaced) and optimizer states back to the host
        (``synchronize``); the device keeps them."""
        st = u.device_state
        if st is None or not u.host_stale:
            return
        if u.device_step_event is not None:
            u.device_step_event.synchronize()
        n = u.trainable_numel
        self._before_host_write(u)
        with torch.no_grad():
            if weights:
                u.master[:n].copy_(st["master"])
                if u.wire is not u.master:
                    u.wire[:n].copy_(u.device_flat[:n])
            st["host_exp_avg"].copy_(st["exp_avg"])
            st["host_exp_avg_sq"].copy_(st["exp_avg_sq"])
        u.host_stale = False

    def _drop_device_state(self, u: _Unit) -> None:
        """The host takes over ``u``'s master weights and states (copied back if newer);
        the device frees its copies and uploads them again at the next device step."""
        self._pull_device_state(u)
        u.device_state = None
        u.device_step_event = None

    def drop_device_states(self) -> None:
        """Every device-stepped unit's state back to the host (``load_state_dict``)."""
        self.synchronize()
        for u in self.units:
            self._drop_device_state(u)

    def _steps_here(self, u: _Unit) -> bool:
        """Whether this process steps ``u`` (under ZeRO, only the unit's owner does)."""
        return self._live_dist() is None or self.dist.owns(u)

    def _live_dist(self) -> DistributedState | None:
        """The distributed state while its process group lives; a destroyed group ends
        data parallelism for this engine (later runs in the process are single ones)."""
        if self.dist is not None and not self.dist.alive():
            self.dist = None
        return self.dist

    def mark_stale(self, units: Iterable[_Unit]) -> None:
        """Another process is stepping these units' master weights (ZeRO): their next use
        waits until ``_refresh_wire`` runs for them (see ``ramflow._dist``)."""
        with self._lock:
            for u in units:
                u.host_version += 1
                u.wire_ready.clear()

    def _grads_modified(self, opt: HostOptimizer) -> bool:
        for u in self.units:
            params = u.owned[: u.num_trainable]
            if not u.grad_versions:
                continue
            for p, view, version in zip(params, u.host_grad_views, u.grad_versions):
                if p.grad is None or not opt._holds(p):
                    continue
                if p.grad is not view or p.grad._version != version:
                    return True
        return False

    def note_clip(self) -> None:
        """Called by ``ramflow.clip_grad_norm_`` before it reads the gradients."""
        self._settle()
        if self._last_backward_eager:
            raise self._pattern(
                "ramflow.clip_grad_norm_ was called after ramflow had already applied the step "
                "during backward (it saw no clipping at the first step). Clip from the first "
                "step on, or construct the optimizer with overlap=False."
            )
        self._clip_used = True
        self._eager_allowed = False

    # ------------------------------------------------------------------ the model's own calls

    def _module_zero_grad(self, module: nn.Module, set_to_none: bool = True) -> None:
        """``model.zero_grad()``: as ``opt.zero_grad()``, nothing of the last backward pass
        lands after it."""
        self.on_zero_grad()
        if not set_to_none:
            self.synchronize()
        type(module).zero_grad(module, set_to_none=set_to_none)

    def _apply_to_model(self, module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        """``module.to(...)``, ``.cuda()``, ``.half()`` and everything else that goes through
        ``nn.Module._apply``. See [Note: moving and casting an offloaded model]."""
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
                f"this model is offloaded by ramflow with fp32 master weights that compute in "
                f"{wire} (its wire dtype); casting it to {name} is not supported in place. "
                f"Call ramflow.undo(model), then ramflow.offload(model, wire_dtype=torch.{name})"
                + (
                    ""
                    if dtype != torch.float64
                    else " is not possible either: float64 needs a resident model"
                )
                + "."
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

    def __deepcopy__(self, memo: dict) -> Engine:
        _refuse_copy()

    def __reduce__(self) -> Any:
        _refuse_copy()

    # ------------------------------------------------------------------ public-ish

    def attach(self, opt: HostOptimizer) -> None:
        self._settle()
        if opt not in self.optimizers:
            # a new optimizer starts the step policy afresh (a layer engine outlives the
            # models and optimizers of earlier runs in the same process)
            self._optimizers.append(weakref.ref(opt))
            self._last_backward_eager = False
            self._final_backwards = 0
            self._eager_allowed = False

    @property
    def optimizers(self) -> list[HostOptimizer]:
        """The live ramflow optimizers holding parameters of this engine (held weakly)."""
        alive = [opt for ref in self._optimizers if (opt := ref()) is not None]
        if len(alive) != len(self._optimizers):
            self._optimizers = [weakref.ref(opt) for opt in alive]
        return alive

    def unit_of(self, p: torch.Tensor) -> _Unit | None:
        return self._unit_of_param.get(id(p))

    def synchronize(self) -> None:
        """Wait for every pending gradient landing and optimizer step on the host."""
        self._settle()
        self.worker.wait_idle()
        for u in self.units:
            self._pull_device_state(u)

    def _after_load_state_dict(self, module: nn.Module, incompatible: Any) -> None:
        self._partial_step = []  # a checkpoint was loaded: see [Note: a failed backward]
        self.refresh_from_host()

    def refresh_from_host(self) -> None:
        """The host master weights changed outside ramflow: rewrite wire and device copies."""
        self.worker.wait_idle()
        for u in self.units:
            # device-stepped: the host's (new) weights win, the device's states are kept
            self._pull_device_state(u, weights=False)
            u.device_state = None
            u.device_step_event = None
            with self._lock:
                u.host_version += 1
                u.wire_ready.clear()
            self._refresh_wire(u)

    def remove(self) -> None:
        """Undo everything: hooks off, device memory freed, plain parameters back."""
        self.synchronize()
        if self._owns_worker:
            self.worker.stop()
        for t in self._pinned_in_place:
            unpin(t)
        self._pinned_in_place.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in self._checkpointed:
            del module.forward
        self._checkpointed.clear()
        if self._hf_checkpointing:
            assert self.model is not None
            disable = (
                getattr(self.model, "activation_checkpointing_disable", None)
                or self.model.gradient_checkpointing_disable
            )
            disable()
        for module in self.model.modules() if self.model is not None else ():
            module.__dict__.pop("_apply", None)
            module.__dict__.pop("zero_grad", None)
        for u in self.units:
            self._drop_device_state(u)
            if u.swaps:
                u.swaps = 1
                self._swap(u, to_device=False)
        with self._lock:
            for u in self.units:
                u.pins = u.backward_pins = 0
                if u.allocated and u.resident:  # let _evict account for it like a window unit
                    u.resident = False
                    self._window_used += u.nbytes
                if u.allocated:
                    self._evict(u)
        with torch.no_grad():
            for u in self.units:
                for p, dtype in zip(u.owned, u.orig_dtypes):
                    grad = p.grad
                    p.data = p.data.to(dtype=dtype, copy=True)
                    p.grad = None if grad is None else grad.to(dtype=dtype, copy=True)
        if self.model is not None:
            for module in self.model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.cpu()
            set_engine_of_model(self.model, None)
        for u in self.units:
            for p in u.owned:
                set_engine_of_param(p, None)
