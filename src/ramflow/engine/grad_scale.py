"""A clip's coefficient, applied by each unit's optimizer step instead of a pass of its own.

[Note: folding the clip into the step]
A real clip (finite ``max_norm``) multiplies every gradient by one coefficient before any
step, so it defers every step (``note_clip``). PyTorch's ``clip_grad_norm_`` scales the
gradients in place: on the host that is a pass over 8 bytes per parameter on the CPU
between backward and the step, on the step's critical path. So ``ramflow.clip_grad_norm_``
leaves the host gradients as they are and records the coefficient per unit
(``fold_grad_scale``); each unit's step multiplies its gradients by it as it reads them
(the ``grad_scale`` of the host kernels and of the device step: an fp32 multiply first,
so the same bits as the scaled gradients; the kernels are built without contraction, so
the product is rounded before it is used). ``p.grad`` then holds the unscaled values
until something reads them through ramflow: ``ramflow.synchronize`` (and so every
``state_dict``), another clip, or a backward that adds to them scale them in place
(``apply_grad_scale``); ``zero_grad`` drops the coefficient with the gradients. A unit
whose step cannot fold it (not one flat step of the whole unit) is scaled in place when
its step is scheduled. A gradient written in place after the clip (its version counter
moved) cannot be told apart from one to scale: zeros (``p.grad.zero_()``) are kept, any
other write raises, naming ``ramflow.synchronize``. A gradient the loop replaced is the
loop's own and is not scaled, as in PyTorch.
"""

from __future__ import annotations

import torch

from ..units.unit import Unit


def fold_grad_scale(u: Unit, scale: float) -> bool:
    """A clip multiplies ``u``'s gradients by ``scale`` (an fp32 value): record it for the
    unit's step to apply (True), or, where ``p.grad`` is not the unit's host buffer, leave
    it to the caller (False). See [Note: folding the clip into the step].

    Args:
        u: the unit; it must have no pending coefficient (``apply_grad_scale`` first).
        scale: the clip's coefficient ``min(max_norm / (norm + 1e-6), 1)``, a Python float
            that is exact in fp32.

    Returns:
        True when recorded (``u.grad_scale`` and the gradients' version counters set);
        False when some ``p.grad`` is not a view of ``u``'s host gradient buffer, which the
        caller then scales itself.
    """
    params = u.owned[: u.num_trainable]
    if u.host_grad is None or not all(p.grad is v for p, v in zip(params, u.host_grad_views)):
        return False
    assert u.grad_scale is None  # a clip applies an earlier clip's first
    u.grad_scale = scale
    u.grad_scale_versions = [v._version for v in u.host_grad_views]
    return True


def scale_for_step(u: Unit, grads: list[torch.Tensor], *, flat: bool) -> float | None:
    """At the scheduling of ``u``'s step from ``grads`` (the gradients it reads, in the
    unit's order): the clip coefficient the step applies (1.0: none), or None where the
    gradients must be scaled in place first (``apply_grad_scale``): the step is not
    ``flat`` (one flat step of the whole unit, whose kernels take a ``grad_scale``) or a
    gradient was written since the clip.

    Args:
        u: the unit whose step is scheduled.
        grads: the host gradients the step reads (fp32 or the gradient format's dtype,
            CPU), one per trainable parameter, in the unit's order.
        flat: the step is one flat step of the whole unit (its kernels multiply by the
            coefficient as they read the gradients).

    Returns:
        1.0 without a pending coefficient; the coefficient (a float) when the step can
        apply it (``flat``, and every gradient is the unit's host view, unwritten since the
        clip); None when the caller must scale the gradients in place first.
    """
    if u.grad_scale is None:
        return 1.0
    if flat and all(
        g is v and g._version == n
        for g, v, n in zip(grads, u.host_grad_views, u.grad_scale_versions)
    ):
        return u.grad_scale
    return None


def raise_if_written(u: Unit) -> None:
    """Before any step is scheduled: ``u``'s gradients were not written in place since a
    clip whose coefficient is pending (zeros excepted: see [Note: folding the clip into the
    step]).

    Args:
        u: the unit; nothing is checked without a pending coefficient.

    Raises:
        RuntimeError: a gradient was written in place since the clip, to values other
            than zeros.
    """
    if u.grad_scale is None:
        return
    params = u.owned[: u.num_trainable]
    for p, view, version in zip(params, u.host_grad_views, u.grad_scale_versions):
        if p.grad is view and view._version != version and bool(view.any()):
            raise RuntimeError(
                f"a gradient of unit {u.name!r} was written in place after clip_grad_norm_ "
                "and before ramflow applied the clip's scale to it (ramflow folds the clip "
                "into the optimizer step and scales p.grad when it is read through "
                "ramflow). Call ramflow.synchronize(model) after clipping, before writing "
                "p.grad in place."
            )


def apply_grad_scale(u: Unit) -> None:
    """Scale ``u``'s host gradients in place by a clip's pending coefficient (no step reads
    them meanwhile). See [Note: folding the clip into the step].

    Args:
        u: the unit (nothing happens without a pending coefficient). Its host gradients are
            multiplied by the fp32 coefficient (PyTorch's bits for ``g * coef``) and the
            coefficient is cleared; gradients the loop replaced are left alone.

    Raises:
        RuntimeError: a gradient was written in place since the clip, to values other than
            zeros.
    """
    scale = u.grad_scale
    if scale is None:
        return
    raise_if_written(u)
    u.grad_scale = None
    if u.host_grad_read is not None:  # a device step's upload of them
        u.host_grad_read.synchronize()
        u.host_grad_read = None
    params = u.owned[: u.num_trainable]
    factor = torch.tensor(scale, dtype=torch.float32)
    pairs = list(zip(params, u.host_grad_views, u.grad_scale_versions))
    with torch.no_grad():
        if u.host_grad is not None and all(p.grad is v and v._version == n for p, v, n in pairs):
            u.host_grad.mul_(factor)  # one flat pass; elementwise, so PyTorch's bits
            return
        for p, view, version in pairs:
            if p.grad is view and view._version == version:
                view.mul_(factor)  # (replaced by the loop: its own; zeros: kept)
