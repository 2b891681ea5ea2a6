"""The gradient norms of a backward pass, read from the device gradients as they form.

[Note: the norm from the device gradients]
A loop that reads the global gradient norm (Hugging Face's ``Trainer`` logs ``grad_norm``
with ``max_grad_norm=0``, and clips with its default ``max_grad_norm=1.0``) would read the
host gradients: one pass over 4 bytes per parameter on the CPU after backward, on the
step's critical path, and during an eager pass it would wait for the steps that write
them. So each unit's dispatch in a backward pass keeps the 2-norm of each of its
parameters' device gradients (``torch._foreach_norm`` over views of the unit's flat
gradient buffer, accumulated in fp32; a device vector, after the data-parallel reduction,
so in the reduced scale) when the unit had no gradients before the pass. The clip stacks
those norms in the order of the parameters it was given and takes their 2-norm, as
``torch.nn.utils.clip_grad_norm_`` does with its per-tensor norms: on the CPU the same
bits as PyTorch's function on the host gradients (the same values, the same reductions);
on CUDA within fp32 rounding (the device reduces in another order than the CPU).

The norms are those of the step's gradients only when every unit of the pass started from
no gradients and nothing changed the host gradients since they landed:
- a pass that stepped during backward (eager; ``p.grad`` may be None after it) qualifies
  when all its units started fresh (otherwise the host gradients are read, once the steps
  that write them are done);
- a deferred pass (clipping defers every step; so do the first step and accumulation)
  qualifies when all its units started fresh, every gradient is still the host buffer as
  it landed (same tensor, same version counter) and no unit holds gradients left from
  before the pass.
Otherwise (accumulation, gradients edited or replaced) the host gradients are read.
"""

from __future__ import annotations

import torch

from ..transfer.streams import record_event
from ..units.unit import Unit


class PassNorms:
    """Per-parameter 2-norms of each unit's device gradients in the last backward pass.

    See [Note: the norm from the device gradients].

    Attributes:
        whole: every unit dispatched in the pass so far started from no gradients.
        fresh: some unit of the pass started from no gradients.
    """

    def __init__(self) -> None:
        # per unit: (num_trainable,) fp32 norms and the event that ends them (None on the CPU)
        self._norms: dict[Unit, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.whole = False
        self.fresh = False

    def begin_pass(self) -> None:
        """A backward pass dispatched its first unit."""
        self._norms = {}
        self.whole = True
        self.fresh = False

    def invalidate(self) -> None:
        """The norms kept are not the gradients' any more (``zero_grad``)."""
        self._norms = {}
        self.whole = False

    def note(
        self,
        u: Unit,
        grad: torch.Tensor,
        *,
        fresh: bool,
        after: object | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Dispatch of ``u``: keep the norms of its flat device gradients ``grad`` (T,)
        while the pass is whole. ``fresh``: ``u`` had no gradients before the pass.
        ``after``: the work handle of their data-parallel reduction (in place), which the
        norms wait for, on ``stream`` (on CUDA; None: the calling stream)."""
        self.fresh = self.fresh or fresh
        if not fresh:  # these gradients add to earlier ones
            self.invalidate()
        if not self.whole or not u.num_trainable:
            return
        views = u.views(grad, trainable_only=True)
        if grad.device.type != "cuda":
            if after is not None:
                after.wait()  # type: ignore[attr-defined]
            self._norms[u] = (_param_norms(views), None)
            return
        produced = torch.cuda.current_stream(grad.device).record_event()
        stream = stream or torch.cuda.current_stream(grad.device)
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            if after is not None:
                after.wait()  # type: ignore[attr-defined]  # this stream waits for it
            norms = _param_norms(views)
            grad.record_stream(stream)
            self._norms[u] = (norms, record_event(stream))

    def units(self) -> list[Unit]:
        """The units whose norms are kept."""
        return list(self._norms)

    def ready(self, device: torch.device) -> dict[Unit, torch.Tensor]:
        """The norms kept per unit, ordered on the calling stream of ``device``."""
        out = {}
        for u, (norms, event) in self._norms.items():
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
            out[u] = norms
        return out


def _param_norms(views: list[torch.Tensor]) -> torch.Tensor:
    """(len(views),) fp32: the 2-norm of each view, accumulated in fp32 (as PyTorch's
    ``clip_grad_norm_`` takes each gradient's norm, ``torch._foreach_norm``)."""
    return torch.stack(torch._foreach_norm(views, 2.0, dtype=torch.float32))
