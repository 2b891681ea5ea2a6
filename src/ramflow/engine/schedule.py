"""The schedule: the hooks that tell the engine what the model runs, and what follows.

Owns the forward and backward hooks, the recorded forward order and the prefetches it
predicts, each call's frame, the module slots (which parameters a module sees, and the
check that they are still the offloaded ones), the end of a backward pass (and its clean-up
when it raised), and the routing of the model's ``_apply`` to ``engine.model_apply``.
Activation checkpointing is ``engine.checkpointer``'s; its recomputation runs through
these hooks.

[Note: pins and the schedule]
A unit is pinned while something needs its device copy: a forward call (pre- to post-
forward hook), a backward call (from the first gradient of its outputs to the gradients of
its inputs, see ``_PostBackward``), or a recomputation under activation checkpointing. An
unpinned unit stays cached in the window until room is needed (least recently used goes
first). Forward prefetches the units that followed in the previous forward (module order on
the first), backward the units that preceded in this forward, ``prefetch_depth`` ahead.
A wrong guess costs bandwidth, never correctness: every use acquires and waits.

[Note: parameters during backward]
The module slots of a unit point at its device parameters only while one of its forward
calls runs (pre- to post-forward hook, ``always_call``, so also when the forward raises).
A recomputation during backward that does not call the unit's own forward (the user's
``torch.utils.checkpoint`` inside the unit, or ours, which wraps ``forward``) swaps the
unit in for the duration of each call of a module inside it that holds its parameters or
has a submodule that does (forward hooks on those modules: a module may read a child's
parameters without calling the child, as ``ramflow.helpers.fuse_lora``'s layers read their
base layer's weight), and our wrapper swaps around its call. So outside a
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
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..units.registry import weak_method
from ..units.unit import Unit
from .gradients import GradientPath
from .hooks import ModuleCall, UnitHook
from .model_apply import ModelApply
from .stepper import Stepper
from .window import DeviceWindow
from .worker import HostWorker


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a recomputation under
    activation checkpointing included)."""
    return torch._C._current_graph_task_id() != -1


def unit_deps(units: Iterable[Unit]) -> list[Unit]:
    """The units whose device copies ``units`` read (each unit's ``deps``: itself and the
    owners of parameters tied into it), each once, in order.

    Args:
        units: units in the order they will run (a forward order, or its reverse for
            backward).

    Returns:
        ``units``' dependencies, each once, in the order first met: the units the device
        window must hold (or prefetch) for ``units`` to run.
    """
    out: list[Unit] = []
    for u in units:
        for d in u.deps:
            if d not in out:
                out.append(d)
    return out


def swap_parameters(u: Unit, *, to_device: bool) -> None:
    """Point the unit's module slots at the device parameters while a forward call or
    a backward call of the unit is in flight (counted: they nest under checkpointing,
    whose recomputation may call submodules directly, without the unit's hooks). See
    [Note: parameters during backward].

    Args:
        u: the unit; its device parameters must be current (acquired by the window) while
            swapped in.
        to_device: True at the start of a call (the first of nested calls swaps the device
            parameters in, after ``check_host_parameters``), False at its end (the last
            swaps the host parameters back).

    Raises:
        RuntimeError: a slot or a parameter's data was replaced since ``offload``
            (``check_host_parameters``).
    """
    if to_device and u.swaps == 0:
        check_host_parameters(u)
    u.swaps += 1 if to_device else -1
    assert u.swaps >= 0
    if u.swaps == (1 if to_device else 0):
        for module, name, host, dev in u.slots:
            module._parameters[name] = dev if to_device else host


def slot_callers(roots: list[nn.Module], holders: list[nn.Module]) -> list[nn.Module]:
    """The modules under the unit's ``roots`` (not the roots themselves) that hold one of
    its parameters (``holders``) or contain a module that does, each once, in module
    order. See [Note: parameters during backward].

    Args:
        roots: the unit's root modules (a block, or the modules of the rest unit).
        holders: the modules whose ``_parameters`` hold one of the unit's parameters
            (its slots' modules), under the roots or, for a tied parameter, elsewhere.

    Returns:
        the modules that a recomputation under activation checkpointing may call without
        passing through the roots' hooks (their calls must swap the unit's parameters in):
        descendants of ``roots`` with a holder in their subtree, then every holder that is
        not a root, each once.
    """
    holder_ids = {id(m) for m in holders}
    root_ids = {id(r) for r in roots}
    contains: dict[int, bool] = {}  # module id -> whether its subtree holds a parameter

    def holds(m: nn.Module) -> bool:
        key = id(m)
        if key not in contains:
            contains[key] = False  # a module reached again through itself adds nothing
            below = [holds(c) for c in m.children()]  # every child, to fill the memo
            contains[key] = key in holder_ids or any(below)
        return contains[key]

    found: dict[int, nn.Module] = {}
    for root in roots:
        holds(root)
        for sub in root.modules():
            if id(sub) not in root_ids and contains.get(id(sub)):
                found.setdefault(id(sub), sub)
    # every holder that is not a root, also one outside every root (a parameter tied into
    # a module of another unit's subtree)
    for m in holders:
        if id(m) not in root_ids:
            found.setdefault(id(m), m)
    return list(found.values())


def check_host_parameters(u: Unit) -> None:
    """The unit's module slots still hold the parameters ramflow offloaded, and those
    still view its host store: ``module.weight = nn.Parameter(t)``,
    ``load_state_dict(..., assign=True)`` or ``p.data = t`` after ``offload`` would
    otherwise be undone by the next swap (or ignored, the store keeping the old values),
    silently.

    Args:
        u: the unit, checked before its device parameters are swapped in. Its kept
            parameters (``owned[:num_kept]``) must share the storage of its host master
            buffer (``u.master``), when it has one.

    Raises:
        RuntimeError: a slot holds another tensor, or a parameter's data was replaced.
    """
    for module, name, host, _ in u.slots:
        if module._parameters.get(name) is not host:
            raise RuntimeError(
                f"{type(module).__name__}.{name} (unit {u.name!r}) was replaced after "
                "ramflow.offload (module.{0} = ..., or load_state_dict(..., assign=True)); "
                "ramflow streams the parameter it offloaded and would put it back. Copy the "
                "new values into it instead (with torch.no_grad(): module.{0}.copy_(t), or "
                "load_state_dict without assign=True), or call ramflow.undo(model) first "
                "and offload again.".format(name)
            )
    if u.master is None or u.num_kept == 0:
        return
    storage = u.master.untyped_storage().data_ptr()
    for p in u.owned[: u.num_kept]:
        if p.untyped_storage().data_ptr() != storage:
            raise RuntimeError(
                f"the data of a parameter of unit {u.name!r} (shape {tuple(p.shape)}) was "
                "replaced after ramflow.offload (p.data = t); ramflow streams its own copy "
                "and would keep training the old values. Copy the new values into the "
                "parameter instead (with torch.no_grad(): p.copy_(t)), or call "
                "ramflow.undo(model) first and offload again."
            )


class _Frame:
    """What one forward call of a unit has taken so far (see ``Schedule._pre_forward``)."""

    __slots__ = ("acquired", "swapped", "call")

    def __init__(self) -> None:
        self.acquired = False
        self.swapped = False
        self.call: _Call | None = None


class _Call:
    """One forward call of a unit that autograd may run backward through."""

    __slots__ = (
        "deps",
        "order",
        "position",
        "pre_backward_done",
        "backward_task",
        "bw_pinned",
        "rc_pinned",
    )

    def __init__(self, deps: list[Unit], order: list[Unit] | None, position: int) -> None:
        self.deps = deps
        self.order = order
        self.position = position
        self.pre_backward_done = False
        self.backward_task = -1  # the autograd graph task of its backward
        self.bw_pinned = False
        self.rc_pinned = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, schedule: Schedule, call: _Call, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.schedule = schedule
        ctx.call = call
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.schedule._post_backward(ctx.call)
        return (None, None, *grads)


class Schedule:
    """The hooks of one engine and the order of its units' calls.

    Args:
        device: the compute device (inputs are moved there).
        wire_dtype: the dtype the model computes in (inputs are cast to it).
        prefetch_depth: how many units ahead forward and backward load.
        layer_engine: True for the engine of ``ramflow.Linear`` layers (no root module).
        units: the engine's unit list (shared; the engine appends to it).
        worker: the host worker (its errors are raised at a forward).
        window: the device window (pins and prefetches).
        gradients: the gradient path (ends or undoes a backward pass).
        stepper: the stepper (forward order, refused partial steps).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        prefetch_depth: int,
        layer_engine: bool,
        units: list[Unit],
        worker: HostWorker,
        window: DeviceWindow,
        gradients: GradientPath,
        stepper: Stepper,
    ) -> None:
        self.device = device
        self.wire_dtype = wire_dtype
        self.prefetch_depth = prefetch_depth
        self._layer_engine = layer_engine
        self.units = units
        self.worker = worker
        self._window = window
        self._gradients = gradients
        self._stepper = stepper
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._rest_units: list[Unit] = []
        # per-forward and per-backward state
        self._order: list[Unit] = []
        self._in_order: set[Unit] = set()
        self._prev_order: list[Unit] = []
        self._outstanding: set[_Call] = set()
        self._end_backward_queued_for = -1
        self._root_active = 0
        # a unit-major step (See [Note: one weight pass per optimizer step] in
        # ``engine.unit_major``): its micro-batches' forwards run in threads of their own
        self._unit_major = False
        self._thread = threading.local()  # micro_batch (None outside), num_calls
        # every module's ``_apply``, see [Note: moving and casting an offloaded model]
        self._model_apply = ModelApply(device=device, wire_dtype=wire_dtype)

    @property
    def order(self) -> list[Unit]:
        """The units in the order the current (or last) forward pass called them."""
        return self._order

    # ------------------------------------------------------------------ set-up

    def add_units(self, units: list[Unit]) -> None:
        """Hooks on the modules of new ``units`` (the rest unit gets none: the root's
        hooks load it)."""
        self._rest_units = [u for u in self.units if u.rest]
        for u in units:
            if u.rest:
                continue
            for m in u.modules:
                self._hooks.append(
                    m.register_forward_pre_hook(
                        UnitHook(self._pre_forward, u.index), with_kwargs=True
                    )
                )
                self._hooks.append(
                    m.register_forward_hook(
                        UnitHook(self._post_forward, u.index), with_kwargs=True, always_call=True
                    )
                )
            # See [Note: parameters during backward]
            inner = slot_callers(u.modules, [m for m, _, _, _ in u.slots])
            for m in inner:
                self._hooks.append(
                    m.register_forward_pre_hook(UnitHook(self._slot_pre_forward, u.index))
                )
                self._hooks.append(
                    m.register_forward_hook(
                        UnitHook(self._slot_post_forward, u.index), always_call=True
                    )
                )

    def install_root_hooks(self, root: nn.Module) -> None:
        """The root's forward hooks (a pass starts and ends there) and every module's
        ``_apply``. See [Note: moving and casting an offloaded model] in
        ``ramflow.engine.model_apply``."""
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
        for module in root.modules():
            module.__dict__["_apply"] = ModuleCall(self._model_apply.apply, module)

    def restore(self, model: nn.Module | None) -> None:
        """Take off every hook and routed ``_apply``; swap host parameters back into every
        module slot (``remove``; the checkpointer takes off its wrappers)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in model.modules() if model is not None else ():
            module.__dict__.pop("_apply", None)
        for u in self.units:
            if u.swaps:
                u.swaps = 1
                swap_parameters(u, to_device=False)

    # ------------------------------------------------------------------ unit-major steps

    def _records_order(self) -> bool:
        """Whether this thread's forward is the one whose unit calls make the order (the
        first micro-batch's in a unit-major step, any other forward's outside one)."""
        return getattr(self._thread, "micro_batch", None) in (None, 0)

    def begin_unit_major(self) -> None:
        """A unit-major step starts: its forwards run in threads (``enter_micro_batch``),
        and its backward is one pass that ``end_unit_major`` ends. See [Note: one weight
        pass per optimizer step] in ``ramflow.engine.unit_major``."""
        self.settle()
        self._unit_major = True
        self._gradients.hold = True

    def enter_micro_batch(self, m: int | None) -> None:
        """This thread runs micro-batch ``m``'s forward of a unit-major step (None: it
        has ended)."""
        self._thread.micro_batch = m

    def end_unit_major(self, *, failed: bool) -> None:
        """The unit-major step's backward has ended (``failed``: it raised, or a forward
        did): end its pass, or clean it up as [Note: a failed backward] says."""
        self._unit_major = False
        self._gradients.hold = False
        if failed:
            self._abort_backward()
        elif self._gradients.pass_open:
            self._end_backward()

    @property
    def in_pass(self) -> bool:
        """Inside a forward or backward pass."""
        return bool(self._root_active) or in_backward()

    # ------------------------------------------------------------------ predictions

    def _forward_prediction(self, u: Unit, position: int) -> list[Unit]:
        prev = self._prev_order
        depth = self.prefetch_depth
        if position < len(prev) and prev[position] is u:
            nxt = prev[position + 1 : position + 1 + depth]
        else:
            nxt = [v for v in self.units[u.index + 1 :] if not v.resident and not v.rest][:depth]
        return unit_deps(nxt)

    def _backward_prediction(self, order: list[Unit], position: int) -> list[Unit]:
        lo = max(0, position - self.prefetch_depth)
        return unit_deps(reversed(order[lo:position]))

    # ------------------------------------------------------------------ forward

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if in_backward():
            return args, kwargs
        self.settle()
        self.worker.raise_error()
        self._stepper.policy.raise_if_partial_step()
        self._thread.num_calls = 0
        if self._records_order():
            if self._order:
                self._prev_order = self._order
            self._order = []
            self._in_order = set()
        rest = self._rest_units
        if rest:
            self._window.acquire(rest)
            for u in rest:
                swap_parameters(u, to_device=True)
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
        if in_backward() or not self._root_active:
            return
        self._root_active -= 1
        rest = self._rest_units
        for u in rest:
            swap_parameters(u, to_device=False)
        self._window.release(rest)
        if output is None:
            return  # the forward raised
        positions: dict[Unit, int] = {}
        for i, u in enumerate(self._order):
            positions.setdefault(u, i)
        for u, i in positions.items():
            self._stepper.note_position(u, i)
        if not torch.is_grad_enabled():
            # no backward follows: start loading the next forward's first units now, so
            # back-to-back inference calls do not wait for the pipeline to fill
            first = [u for u in self._order if not u.resident][: self.prefetch_depth]
            self._window.prefetch(unit_deps(first))
        if torch.is_grad_enabled() and not self._unit_major:  # whose runner ends its pass
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._root_output_grad)

    def _layer_pass(self, u: Unit) -> None:
        """A layer engine has no root to mark a forward pass: a unit called again starts
        the next one (and ends a backward pass that did not end on its own)."""
        if self._gradients.pass_open:
            self._end_backward()
        if u in self._in_order:
            self._prev_order = self._order
            self._order = []
            self._in_order = set()
        if u not in self._in_order:
            self._stepper.note_position(u, len(self._order))

    def _pre_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict):
        in_bw = in_backward()
        if not in_bw and self._layer_engine:
            self.settle()
            self._stepper.policy.raise_if_partial_step()
            self._layer_pass(u)
        # what this call takes, undone by _post_forward also when something below raises
        # (always_call): a failed forward leaves no pin and no swapped parameter behind
        frame = _Frame()
        u.call_stack.append(frame)
        if in_bw:
            position = len(self._order)
        else:  # every micro-batch of a unit-major step makes the same calls: its own count
            position = self._thread.num_calls if self._unit_major else len(self._order)
            self._thread.num_calls = position + 1
            if self._records_order():
                self._order.append(u)
                self._in_order.add(u)
        with torch.profiler.record_function(f"ramflow.wait:{u.name}"):
            self._window.acquire(u.deps)
        frame.acquired = True
        swap_parameters(u, to_device=True)
        frame.swapped = True
        if not in_bw:
            self._window.prefetch(self._forward_prediction(u, position))
        else:  # recomputation under checkpointing: backward goes on to earlier units
            last = max((i for i, v in enumerate(self._order) if v is u), default=None)
            if last is not None:
                self._window.prefetch(self._backward_prediction(self._order, last))
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

    def _post_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if not u.call_stack:
            return  # a hook before ours raised: our pre-forward never ran
        frame = u.call_stack.pop()
        if frame.swapped:
            swap_parameters(u, to_device=False)
        if not frame.acquired:
            return
        call = frame.call
        if call is None or not in_backward():
            self._window.release(u.deps)
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
            self._window.release(u.deps)
        else:
            call.rc_pinned = True
            self._outstanding.add(call)
            self._gradients.open_pass()

    def _slot_pre_forward(self, u: Unit, module: nn.Module, args: tuple) -> None:
        """A module inside ``u`` called during backward (a recomputation that does not go
        through the unit's own forward): its parameters are the device ones while it runs.
        See [Note: parameters during backward]."""
        swap = in_backward() and u.pins > 0
        u.slot_stack.append((module, swap))
        if swap:
            swap_parameters(u, to_device=True)

    def _slot_post_forward(self, u: Unit, module: nn.Module, args: tuple, output: Any) -> None:
        if u.slot_stack and u.slot_stack[-1][0] is module:
            if u.slot_stack.pop()[1]:
                swap_parameters(u, to_device=False)

    # ------------------------------------------------------------------ backward

    def _root_output_grad(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self._end_backward_queued_for != task:
            self._end_backward_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, call: _Call, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if call.pre_backward_done and task != call.backward_task and self._unit_major:
            # a unit-major step runs backward in several passes, and a call whose outputs
            # feed both the next unit and the loss (an MoE router's logits) is reached by
            # two of them: pinned again for the second
            self._post_backward(call)
            call.pre_backward_done = False
        if call.pre_backward_done:
            if task != call.backward_task:
                raise RuntimeError(
                    "a second backward pass ran through the graph of one forward of an "
                    "offloaded model (backward(retain_graph=True), then backward again): "
                    "ramflow frees each unit's device weights once its backward is done, so "
                    "the graph cannot be run again. Run the forward again before each backward."
                )
            return  # another output of the same call, in the same pass
        if torch.is_grad_enabled():
            raise RuntimeError(
                "backward with create_graph=True (a double backward: gradient penalties, "
                "Hessian-vector products) is not supported on an offloaded model: the graph "
                "of the gradients would hold device weights that ramflow frees after each "
                "unit's backward. Compute it on a resident model (ramflow.undo(model)), or "
                "approximate the penalty without create_graph (finite differences)."
            )
        call.pre_backward_done = True
        call.backward_task = task
        self._gradients.open_pass()
        if self._layer_engine:  # no root output to end the backward pass from
            self._root_output_grad(grad)
        with torch.profiler.record_function("ramflow.wait_backward"):
            self._window.acquire(call.deps, backward=True)
        call.bw_pinned = True
        self._outstanding.add(call)
        if call.order is not None:
            self._window.prefetch(self._backward_prediction(call.order, call.position))

    def _post_backward(self, call: _Call) -> None:
        if call.bw_pinned:
            call.bw_pinned = False
            self._window.release(call.deps, backward=True)
        if call.rc_pinned:
            call.rc_pinned = False
            self._window.release(call.deps)
        self._outstanding.discard(call)

    def _end_backward(self) -> None:
        """End of a backward pass: release what it held, send leftover gradients, and wait
        until every gradient has landed in the host gradients (so ``p.grad`` is complete)."""
        for call in list(self._outstanding):
            self._post_backward(call)
        self._gradients.finish_pass()
        self._stepper.end_pass()
        self._end_backward_queued_for = -1

    def settle(self) -> None:
        """Called where the training loop enters ramflow outside backward (a forward, a
        step, zero_grad, clipping, synchronize): finish the last backward pass. Its end
        callback runs only when the pass succeeds, so one that was queued and never ran
        means the pass raised. See [Note: a failed backward]."""
        if in_backward():
            return
        if self._end_backward_queued_for != -1:
            self._abort_backward()
        elif self._gradients.pass_open:  # a backward that did not reach the root's outputs
            self._end_backward()

    def _abort_backward(self) -> None:
        """Clean up after a backward pass that raised. See [Note: a failed backward]."""
        for call in list(self._outstanding):
            self._post_backward(call)
        error, stepped, partial_grads = self._gradients.abort_pass()
        self._stepper.failed_pass(stepped=stepped, partial_grads=partial_grads)
        self._end_backward_queued_for = -1
        if error is not None:
            raise RuntimeError(f"ramflow host worker failed: {error}") from error
