"""Plain ``torch.optim`` optimizers on an offloaded model: global step hooks.

[Note: a plain optimizer]
A ``torch.optim`` optimizer given offloaded parameters steps the host masters (their
gradients are on the host). Global optimizer step hooks wait for pending landings before
its step and copy the updated weights to the device after it (``refresh_from_host``), so
it trains as on a resident model; it warns once that ``ramflow.optim`` overlaps the step
with backward instead. It steps the host masters with its own arithmetic and keeps its own
fp32 states, so it trains only fp32 masters with fp32 states: on trained parameters kept in
another host format (bf16 masters lose its updates to rounding; 8-bit states would be
ignored) its first step raises ValueError, before anything is changed.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..units.registry import engine_of_param

_optimizer_hooks: list[torch.utils.hooks.RemovableHandle] = []
_warned_optimizers: weakref.WeakSet = weakref.WeakSet()


def install_optimizer_hooks() -> None:
    """Global step hooks that make a plain ``torch.optim`` optimizer work on offloaded
    parameters (installed once, at the first engine). See [Note: a plain optimizer]."""
    if not _optimizer_hooks:
        _optimizer_hooks.append(register_optimizer_step_pre_hook(_plain_step_pre))
        _optimizer_hooks.append(register_optimizer_step_post_hook(_plain_step_post))


def _engines_stepped_by(opt: torch.optim.Optimizer, *, check: bool = False) -> list[Any]:
    """The engines holding parameters of plain optimizer ``opt`` (none for ramflow's own).

    Raises:
        ValueError: ``check`` and ``opt`` holds a trainable parameter whose engine keeps
            it in a host format other than fp32 masters with fp32 states.
    """
    if getattr(opt, "_ramflow_host_optimizer", False):
        return []
    engines: dict[int, Any] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            engine = engine_of_param(p)
            if engine is None:
                continue
            engines[id(engine)] = engine
            if check and p.requires_grad and not engine.host.precision.is_exact:
                raise _format_refusal(opt, engine.host.precision)
    return list(engines.values())


def _format_refusal(opt: torch.optim.Optimizer, precision: Any) -> ValueError:
    """The error for plain optimizer ``opt`` on parameters kept in ``precision`` (a
    ``HostPrecision`` that is not fp32 throughout), naming what works."""
    why = []
    if not precision.master_format.exact:
        why.append("round its updates of the bf16 master weights to nearest (small ones vanish)")
    if not precision.state_format.exact:
        why.append(f"keep fp32 states of its own, not {precision.optimizer_states!r} ones")
    return ValueError(
        f"{type(opt).__module__}.{type(opt).__name__} cannot step parameters that ramflow "
        f"keeps with {precision.spelled}: it would {' and '.join(why)}. Use "
        "ramflow.optim.AdamW, which steps every host format, or offload with "
        "host_precision='fp32' to train with a torch.optim optimizer."
    )


def _plain_step_pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for engine in _engines_stepped_by(opt, check=True):
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
