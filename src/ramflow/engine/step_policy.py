"""The step policy: whether a backward pass steps units as their gradients land.

``StepPolicy`` holds what the stepper has learned about the loop (one backward per step, no
clipping, settings unchanged between backward and ``step()``), decides each pass at its
first unit, and raises the loop-pattern errors; the ``Stepper`` runs the steps it decides.
``StepItem`` is what a step of one unit needs, captured when it is scheduled
(``step_items``). See [Note: when the step runs] in ``engine.stepper``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ..units.unit import Unit
from .interfaces import StepOptimizer

# the end of a loop-pattern error whose eager pass came from keep_grads=False's promise
_PROMISE = (
    ": the optimizer was built with keep_grads=False, a promise that the loop never reads "
    "or changes the gradients, so under the gradient ring of a host_precision other than "
    "fp32 every backward, the first included, steps each unit as its gradients land. To "
    "clip, build it with clips=True (ramflow.optim.AdamW(..., keep_grads=False, clips=True)); "
    "to read the gradients, with keep_grads=True (the default) or overlap=False."
)


class StepItem(NamedTuple):
    """One optimizer's part of a unit's step, captured when it is scheduled (the user may
    ``zero_grad`` before the worker gets to it).

    Attributes:
        optimizer: the ramflow optimizer that steps it.
        hyper: its param groups' settings then (``hyperparameters()``).
        params: the unit's trainable parameters it holds that have gradients.
        grads: their gradients (``p.grad``) then.
        versions: the gradients' version counters then (a write in place is an error).
    """

    optimizer: StepOptimizer
    hyper: list[dict]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    versions: list[int]

    def all_host_grads(self, u: Unit) -> bool:
        """Whether this item holds every trainable parameter of ``u`` with the host
        gradients as they landed (the unit's flat host gradient)."""
        return (
            u.host_grad is not None
            and len(self.params) == u.num_trainable == len(u.host_grad_views)
            and all(g is v for g, v in zip(self.grads, u.host_grad_views))
        )

    def whole_unit(self, u: Unit) -> bool:
        """Whether this item steps all of ``u`` flat from the host gradients as they
        landed."""
        return self.optimizer.flat_runs(u) is not None and self.all_host_grads(u)


def step_items(u: Unit, optimizers: Sequence[StepOptimizer]) -> list[StepItem]:
    """What a step of ``u`` needs, captured now: per optimizer of ``optimizers`` that holds
    some of ``u``'s trainable parameters with gradients, its hyperparameters, those
    parameters with their gradients (the user may zero_grad before the worker gets to the
    step) and the gradients' version counters (see ``HostStepper.step_unit``).

    Args:
        u: the unit to step; its trainable parameters are ``owned[:num_trainable]``
            (host fp32 masters, or another host format's, with host gradients).
        optimizers: the ramflow optimizers that may step it, in order.

    Returns:
        one ``StepItem`` per optimizer of ``optimizers`` that holds at least one of ``u``'s
        trainable parameters with a gradient (``p.grad`` not None), in ``optimizers``'
        order; empty when none does.
    """
    items = []
    for opt in optimizers:
        params = [p for p in u.owned[: u.num_trainable] if p.grad is not None and opt.holds(p)]
        if params:
            grads = [p.grad for p in params]
            versions = [g._version for g in grads]
            items.append(StepItem(opt, opt.hyperparameters(), params, grads, versions))
    return items


def same_settings(a: list[dict], b: list[dict]) -> bool:
    """Whether two copies of an optimizer's param-group settings (``hyperparameters``)
    are equal; tensors (a tensor learning rate) compare by value.

    Args:
        a, b: lists of per-group settings dicts (``StepOptimizer.hyperparameters()``, the
            ``params`` left out). Tensor values may be on any device (compared on the CPU).

    Returns:
        True when both have the same groups with the same keys and equal values (tensors:
        same shape and ``torch.equal``; a tensor never equals a number).
    """
    if len(a) != len(b):
        return False
    for group_a, group_b in zip(a, b):
        if group_a.keys() != group_b.keys():
            return False
        for key, x in group_a.items():
            y = group_b[key]
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                same = (
                    isinstance(x, torch.Tensor)
                    and isinstance(y, torch.Tensor)
                    and x.shape == y.shape
                    and bool(torch.equal(x.cpu(), y.cpu()))
                )
                if not same:
                    return False
            elif x != y:
                return False
    return True


class StepPolicy:
    """When units step: during backward (eager) or at ``opt.step()`` (deferred).

    A pass is eager when the loop was seen to take exactly one backward per step without
    changing the gradients or the settings in between (``allowed``, learned at each
    ``after_step``), or from the first pass with the gradient ring and an optimizer that
    keeps no gradients; and when no ``no_step`` is active, no final backward ran since the
    last step, and one optimizer holds the engine's parameters.

    Attributes:
        allowed: the last step showed the loop's pattern allows eager passes.
        eager_now: the open pass's decision (None between passes).
        last_eager: the last finished pass stepped during backward.
        step_was_eager: the last ``opt.step()`` found its units stepped during backward.
        final_backwards: backward passes (outside ``no_step``) since the last step.
        clip_used: the loop clips (a real clip defers every step).
        settings_at_backward: the optimizer's settings when the last pass ended.
        settings_late: settings were changed between backward and step: never eager.
        eager_settings: the settings an eager pass stepped with (checked at ``step()``).
        seen_step: an ``opt.step()`` has run.
        partial_step: names of units a failed backward had already stepped.
        partial_grads: gradients hold part of a failed backward.
        pattern_error: a loop-pattern error was raised (``zero_grad`` starts afresh).
        eager_by_promise: the last decided pass was eager on ``keep_grads=False``'s promise
            (``_eager_from_the_start``), not on a pattern seen: the errors then name it.
    """

    def __init__(self) -> None:
        self.allowed = False
        self.eager_now: bool | None = None
        self.last_eager = False
        self.final_backwards = 0
        self.clip_used = False
        self.settings_at_backward: list[dict] | None = None
        self.settings_late = False
        self.eager_settings: list[dict] | None = None
        self.step_was_eager = False
        self.seen_step = False
        self.partial_step: list[str] = []
        self.partial_grads = False
        self.pattern_error = False
        self.eager_by_promise = False

    def new_optimizer(self) -> None:
        """A new optimizer starts the policy afresh (a layer engine outlives the models
        and optimizers of earlier runs in the same process)."""
        self.last_eager = False
        self.final_backwards = 0
        self.allowed = False
        self.settings_late = False
        self.seen_step = False

    def pattern(self, message: str) -> RuntimeError:
        """A loop-pattern error; ``opt.zero_grad()`` recovers from it."""
        self.pattern_error = True
        return RuntimeError(
            message + " After this error, call opt.zero_grad() and go on: ramflow then "
            "learns the loop's pattern afresh (the optimizer's states are kept)."
        )

    def begin_pass(
        self,
        optimizers: Sequence[StepOptimizer],
        *,
        ring: bool,
        trains_first: bool,
        holding: bool = False,
    ) -> bool:
        """The open pass's decision, made at its first dispatched unit. ``ring``: the host
        gradients are a ring (``GradientFormat.ring``); ``trains_first``: the one optimizer
        trains that unit (see [Note: an optimizer of another model]); ``holding``: units
        hold gradients in 8-bit codes from a pass under ``no_step``, which this pass adds
        to (never during backward)."""
        if self.eager_now is None:
            no_step = any(opt.no_step_depth for opt in optimizers)
            if self.last_eager and not no_step:
                raise self.pattern(
                    "a second backward pass ran before opt.step(), but ramflow had already "
                    "applied the step during the first (it saw one backward per step so far). "
                    "For gradient accumulation, run the non-final micro-batches under "
                    "`with opt.no_step():`, or construct the optimizer with overlap=False."
                )
            self.eager_now = (
                (self.allowed or self._eager_from_the_start(optimizers, ring=ring))
                and not no_step
                and not holding
                and self.final_backwards == 0
                and len(optimizers) == 1
                and trains_first
            )
            self.eager_by_promise = self.eager_now and not self.allowed
            self.eager_settings = optimizers[0].hyperparameters() if self.eager_now else None
        return self.eager_now

    def _eager_from_the_start(self, optimizers: Sequence[StepOptimizer], *, ring: bool) -> bool:
        """With the gradient ring and an optimizer that keeps no gradients
        (``keep_grads=False``, a promise that the loop never reads them, so never clips),
        the first backward steps during backward too: no full host gradient buffer is ever
        made for a first, deferred step (it would be the largest host buffer of a lean
        store). A loop that breaks the promise gets the loop-pattern errors; one that
        clips says so (``clips=True``): its passes hold their gradients for the clip."""
        return (
            ring
            and not self.seen_step
            and not self.pattern_error
            and len(optimizers) == 1
            and optimizers[0].overlap
            and not optimizers[0].keep_grads
            and not optimizers[0].clips
        )

    def end_pass(self, optimizers: Sequence[StepOptimizer]) -> None:
        """A backward pass finished: count it."""
        if self.eager_now is not None:
            if not any(opt.no_step_depth for opt in optimizers):
                self.final_backwards += 1
            self.last_eager = self.eager_now
            self.settings_at_backward = (
                optimizers[0].hyperparameters() if len(optimizers) == 1 else None
            )
        self.eager_now = None

    def failed_pass(self, stepped: Iterable[str], *, partial_grads: bool) -> None:
        """A backward pass raised after it had stepped the units named ``stepped`` (in
        order) and, with ``partial_grads``, added to accumulated gradients."""
        self.partial_step = list(stepped)
        self.partial_grads = self.partial_grads or partial_grads
        self.eager_now = None

    def raise_if_partial_step(self) -> None:
        if self.partial_step:
            names = self.partial_step
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
        """Go on from the weights a failed backward left partly stepped (also after a
        checkpoint was loaded)."""
        self.partial_step = []

    def zero_grad(self) -> None:
        """``opt.zero_grad()``; see ``Stepper.zero_grad``."""
        if self.last_eager and not self.pattern_error:
            raise self.pattern(
                "opt.zero_grad() ran after a backward pass without an opt.step() between them, "
                "but ramflow had already applied that step during backward (it saw one "
                "backward per step so far), so its update is in the weights. A loop that skips "
                "steps (a guard against non-finite gradients, ...) needs the optimizer built "
                "with overlap=False; reload a checkpoint to take this update back."
            )
        self.partial_grads = False
        if self.pattern_error:
            self.pattern_error = False
            self.last_eager = False
            self.final_backwards = 0
            self.allowed = False
            self.clip_used = False
            self.settings_late = False

    def note_clip(self) -> None:
        """The gradients are about to be clipped (a finite ``max_norm``)."""
        if self.last_eager:
            clipped = (
                "gradients were clipped (ramflow.clip_grad_norm_, or torch.nn.utils."
                "clip_grad_norm_ with a finite max_norm) after ramflow had already applied the "
                "step during backward"
            )
            if self.eager_by_promise:
                raise self.pattern(f"{clipped}{_PROMISE}")
            raise self.pattern(
                f"{clipped} (it saw no clipping at the first step). Clip from the first step "
                "on, or construct the optimizer with overlap=False."
            )
        self.clip_used = True
        self.allowed = False

    def check_step(self, settings: list[dict], *, modified: bool) -> bool:
        """``opt.step()`` with the optimizer's ``settings`` now, the gradients ``modified``
        since backward or not: raise what the loop may not do, and return whether the units
        still need their step (False: the last pass stepped them during backward)."""
        self.raise_if_partial_step()
        if self.partial_grads:
            raise RuntimeError(
                "the gradients hold part of a backward pass that raised, added to gradients "
                "accumulated before it; that part cannot be taken out again. Call "
                "opt.zero_grad() and run the micro-batches of this step again."
            )
        if not self.last_eager:
            if self.settings_at_backward is not None and not same_settings(
                settings, self.settings_at_backward
            ):
                self.settings_late = True  # set between backward and step: never eager
            return True
        if modified:
            changed = (
                "gradients were changed after backward (clipping, unscaling or a manual "
                "edit), but ramflow had already applied this step during backward"
            )
            if self.eager_by_promise:
                raise self.pattern(f"{changed}{_PROMISE}")
            raise self.pattern(
                f"{changed}. Use ramflow.clip_grad_norm_ from the first step on, or construct "
                "the optimizer with overlap=False."
            )
        if self.eager_settings is not None and not same_settings(settings, self.eager_settings):
            raise self.pattern(
                "the optimizer's settings (learning rate, weight decay, ...) changed between "
                "backward and opt.step(), but ramflow had already applied this step during "
                "backward with the settings of then (it saw them unchanged at the first "
                "step). Set them before backward or after opt.step() (as an LR scheduler's "
                "step() after opt.step() does), or construct the optimizer with "
                "overlap=False."
            )
        return False

    def after_step(self, opt: StepOptimizer, *, modified: bool) -> None:
        """``opt.step()`` done: learn whether the next passes may step during backward."""
        self.seen_step = True
        self.step_was_eager = self.last_eager
        self.allowed = (
            opt.overlap
            and self.final_backwards == 1
            and not modified
            and not self.clip_used
            and not self.settings_late
        )
        self.final_backwards = 0
        self.last_eager = False
