"""What the engine's parts need of the objects that plug into them.

The engine's parts sit below ``ramflow.optim`` and ``ramflow.distributed.zero`` in the import order
(docs/design.md): they name an optimizer or a data-parallel state only through these
protocols, so no part imports the modules that use it, not even for type hints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..units.unit import Unit


class StepOptimizer(Protocol):
    """What the stepper and the gradient path need of a ramflow optimizer
    (``ramflow.optim.HostOptimizer``). A device step (``device_state``,
    ``device_flat_step``) is optional: the stepper checks for it with ``hasattr``."""

    overlap: bool  # may step units during backward
    keep_grads: bool  # False: a fused step need not write ``p.grad``
    clips: bool  # the loop clips before every step: no pass is eager from the start
    no_step_depth: int  # > 0 inside ``opt.no_step()``

    def holds(self, p: torch.Tensor) -> bool: ...

    def hyperparameters(self) -> list[dict[str, Any]]: ...

    def step_params(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], hyper: list[dict[str, Any]]
    ) -> None: ...

    def flat_runs(self, unit: Unit) -> list[tuple[int, int, int]] | None: ...

    def flat_step(
        self,
        unit: Unit,
        hyper: list[dict[str, Any]],
        *,
        grad: torch.Tensor,
        accumulate: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        wire_out: torch.Tensor | None = None,
        pieces: list[tuple[int, int]] | None = None,
        after_piece: Callable[[int, int], None] | None = None,
        grad_scale: float = 1.0,
    ) -> None: ...


class DataParallel(Protocol):
    """What the stepper, the gradient path and the engine need of a data-parallel state
    (``ramflow.distributed.zero.DistributedState``)."""

    def alive(self) -> bool: ...

    def owns(self, u: Unit) -> bool: ...

    def keeps_gradients(self, u: Unit) -> bool: ...

    def reduce_gradients(self, u: Unit, grad: torch.Tensor) -> Any: ...

    def after_step(self, engine: Any) -> None: ...

    def wait_event(self, event: Any, what: str) -> None: ...
