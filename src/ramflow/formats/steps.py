"""Each host format's AdamW arithmetic, on the host and on the device.

A unit's host formats (``HostPrecision``) choose its step: ``EXACT`` (fp32 masters and
fp32 states: PyTorch's fused AdamW arithmetic, the native kernel of ``kernels.cpu_kernels`` on the
host and ``torch._fused_adamw_`` on the device) or ``LEAN`` (any other format: the one-pass
kernel of ``kernels.lean_kernels``, the same bits on the host and the device, Triton or PyTorch
ops there). ``adamw_for`` picks it; ``optim.AdamW`` calls it and never asks which
format a unit has. The states are those the format names (``HostPrecision.state_names``),
sliced by ``HostPrecision.state_view``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..kernels import lean_triton as _lean_triton
from ..kernels.cpu_kernels import cut_at_tails, fused_adamw_step_
from ..kernels.lean_kernels import lean_adamw_step_
from .host import LEAN_DEVICE_STEP_PIECE, STEP_ALIGN, HostPrecision, MasterFormat

# one param group's ranges of a unit's flat buffers: (group index, begin, end)
Runs = Sequence[tuple[int, int, int]]
Pieces = Sequence[tuple[int, int]]


class AdamWSettings(NamedTuple):
    """One param group's AdamW settings, as floats (read once per step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: dict[str, Any]) -> AdamWSettings:
        beta1, beta2 = group["betas"]
        return cls(
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
        )


@dataclass(frozen=True)
class FlatStep:
    """How one flat host step of a unit walks its buffers, and with which settings
    (``optim.AdamW.flat_step`` makes one per unit and step).

    Attributes:
        pieces: ``(begin, end)`` element ranges of the unit's flat buffers, stepped in order.
        runs: the param groups' ranges, ``(group index, begin, end)`` (``AdamW.flat_runs``).
        settings: each param group's settings, by group index.
        step: the step count after this step (1 on the first).
        tails: each parameter's scalar tail (``kernels.cpu_kernels.odd_tails``); the exact
            step calls its kernel on each one apart.
        seed: the unit's rounding seed (stochastic rounding of the lean formats).
        threads: the kernel's CPU threads; None: its default.
        after_piece: called with ``(begin, end)`` once a piece is stepped; None: nothing.
        grad_scale: multiplies the gradient as the kernel reads it (a clip's coefficient;
            see ``Optimizer.flat_step``); 1.0: none.
    """

    pieces: Pieces
    runs: Runs
    settings: Sequence[AdamWSettings]
    step: int
    tails: Sequence[tuple[int, int]]
    seed: int
    threads: int | None
    after_piece: Callable[[int, int], None] | None = None
    grad_scale: float = 1.0


def _cut(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def cut_at_runs(lo: int, hi: int, runs: Runs) -> list[tuple[int, int, int]]:
    """``[lo, hi)`` cut at the boundaries of ``runs`` (``AdamW.flat_runs``: consecutive
    ``(group index, begin, end)`` covering a unit's trainable prefix): the ``(group index,
    begin, end)`` parts of each run inside it, in order. A run begins at a parameter's
    offset, so every part begins on a whole block or where ``lo`` does."""
    return [(index, max(lo, b), min(hi, e)) for index, b, e in runs if b < hi and e > lo]


class ExactAdamW:
    """fp32 masters and states, stepped bit for bit as ``torch.optim.AdamW(fused=True)``."""

    def host_step(
        self,
        fmt: HostPrecision,
        master: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        walk: FlatStep,
        *,
        accumulate: torch.Tensor | None,
        grad_out: torch.Tensor | None,
        wire_out: torch.Tensor | None,
    ) -> None:
        """Step the flat ``master`` from ``grad`` piece by piece as ``walk`` says (see
        ``Optimizer.flat_step``), each part of a piece with the settings of its run's param
        group; each parameter's scalar tail is a call of its own
        (``kernels.cpu_kernels.odd_tails``).

        Args:
            fmt: the unit's host formats.
            master: the unit's flat fp32 masters (host).
            grad: its flat gradient, same length (host, fp32 or the wire dtype).
            states: its flat states by name (``HostPrecision.state_names``).
            walk: the pieces, runs and settings of this step.
            accumulate: a host gradient the kernel adds ``grad`` to and steps from; None: none.
            grad_out: where the kernel writes the gradient it read; None: nowhere.
            wire_out: the unit's wire copy, written from the new masters; None: none.
        """
        m, v = states["exp_avg"], states["exp_avg_sq"]
        for lo, hi in walk.pieces:
            for index, c, d in cut_at_runs(lo, hi, walk.runs):
                s = walk.settings[index]
                for a, b in cut_at_tails(c, d, walk.tails):
                    fused_adamw_step_(
                        master[a:b],
                        grad[a:b],
                        m[a:b],
                        v[a:b],
                        step=walk.step,
                        lr=s.lr,
                        beta1=s.beta1,
                        beta2=s.beta2,
                        eps=s.eps,
                        weight_decay=s.weight_decay,
                        grad_scale=walk.grad_scale,
                        accumulate=_cut(accumulate, a, b),
                        grad_out=_cut(grad_out, a, b),
                        wire_out=_cut(wire_out, a, b),
                        num_threads=walk.threads,
                    )
            if walk.after_piece is not None:
                walk.after_piece(lo, hi)

    def device_step(
        self,
        fmt: HostPrecision,
        state: dict[str, torch.Tensor],
        *,
        runs: Runs,
        settings: Sequence[AdamWSettings],
        grad: torch.Tensor,
        weights_out: torch.Tensor,
        piece: int,
        step: int,
        seed: int,
        threads: int | None,
        grad_scale: float = 1.0,
    ) -> None:
        """One step of a unit on the device with ``torch._fused_adamw_``: ``state`` holds
        its fp32 ``master`` and states there; the new weights go to ``weights_out``.
        ``grad_scale`` multiplies the gradient first, in fp32 (out of place: on the CPU
        device ``grad`` may be the host gradient itself). A host ``grad`` is read by an
        asynchronous copy where it is pinned (the caller's event covers the read)."""
        master, m, v = state["master"], state["exp_avg"], state["exp_avg_sq"]
        step_t = torch.full((), float(step), device=master.device)
        for index, begin, end in runs:
            s = settings[index]
            for lo in range(begin, end, piece):
                hi = min(end, lo + piece)
                g = grad[lo:hi].to(master.device, torch.float32, non_blocking=True)
                if grad_scale != 1.0:
                    g = g * grad_scale  # an fp32 value: the fp32 product, as a host clip's
                torch._fused_adamw_(
                    [master[lo:hi]],
                    [g],
                    [m[lo:hi]],
                    [v[lo:hi]],
                    [],
                    [step_t],
                    lr=s.lr,
                    beta1=s.beta1,
                    beta2=s.beta2,
                    weight_decay=s.weight_decay,
                    eps=s.eps,
                    amsgrad=False,
                    maximize=False,
                )
                weights_out[lo:hi].copy_(master[lo:hi])


class LeanAdamW:
    """Every other format: ``kernels.lean_kernels.lean_adamw_step_`` (stochastic or compensated
    rounding of bf16 masters, bf16 or 8-bit states), the same bits on the host and the
    device."""

    def piece(
        self,
        fmt: HostPrecision,
        master: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        lo: int,
        hi: int,
        *,
        settings: AdamWSettings,
        step: int,
        wire_out: torch.Tensor | None,
        seed: int,
        threads: int | None,
        grad_scale: float = 1.0,
    ) -> None:
        """Step elements ``lo:hi`` of the flat ``master`` (``grad`` is theirs, multiplied
        by ``grad_scale`` as it is read); ``lo`` is a multiple of ``STEP_ALIGN``, so the
        rounding and the 8-bit blocks are those of the whole unit. A state format whose
        moments the kernel reads decoded (4-bit) is stepped ``step_chunk`` elements at a
        time: the same bits, as each element's rounding counter and each block are the
        whole unit's."""
        states_format = fmt.state_format
        chunk = states_format.step_chunk or max(hi - lo, 1)
        for a in range(lo, hi, chunk):
            b = min(hi, a + chunk)
            # this chunk of each state (the state tensors' names are the kernel's arguments)
            st = {name: fmt.state_view(name, states[name], a, b) for name in fmt.state_names}
            moments = states_format.kernel_moments(st, b - a)
            lean_adamw_step_(
                master[a:b],
                grad[a - lo : b - lo],
                step=step,
                lr=settings.lr,
                beta1=settings.beta1,
                beta2=settings.beta2,
                eps=settings.eps,
                weight_decay=settings.weight_decay,
                grad_scale=grad_scale,
                compensation=st.get(MasterFormat.COMPENSATION),
                **moments,
                wire_out=_cut(wire_out, a - lo, b - lo),
                seed=seed,
                counter_offset=a,
                num_threads=threads,
            )
            states_format.store_moments(st, moments)

    def host_step(
        self,
        fmt: HostPrecision,
        master: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        walk: FlatStep,
        *,
        accumulate: torch.Tensor | None,
        grad_out: torch.Tensor | None,
        wire_out: torch.Tensor | None,
    ) -> None:
        """As ``ExactAdamW.host_step``; the kernel reads one gradient, the accumulated one."""
        assert walk.grad_scale == 1.0 or (accumulate is None and grad_out is None)
        # Through ``.data``, as the native fp32 kernel writes them, so the gradients'
        # version counters (the loop pattern check) see no change by the user.
        if accumulate is not None:
            accumulate.data.add_(grad)
            grad = accumulate
        elif grad_out is not None:
            grad_out.data.copy_(grad)
        for lo, hi in walk.pieces:
            for index, a, b in cut_at_runs(lo, hi, walk.runs):
                self.piece(
                    fmt,
                    master,
                    grad[a:b],
                    states,
                    a,
                    b,
                    settings=walk.settings[index],
                    step=walk.step,
                    wire_out=_cut(wire_out, a, b),
                    seed=walk.seed,
                    threads=walk.threads,
                    grad_scale=walk.grad_scale,
                )
            if walk.after_piece is not None:
                walk.after_piece(lo, hi)

    def device_step(
        self,
        fmt: HostPrecision,
        state: dict[str, torch.Tensor],
        *,
        runs: Runs,
        settings: Sequence[AdamWSettings],
        grad: torch.Tensor,
        weights_out: torch.Tensor,
        piece: int,
        step: int,
        seed: int,
        threads: int | None,
        grad_scale: float = 1.0,
    ) -> None:
        """One step on the device with the host kernel's arithmetic (one Triton kernel, or
        PyTorch ops without Triton). A master that is the wire copy is the unit's device
        copy ``weights_out``, stepped in place; an fp32 one (``state["master"]``) writes
        it as the wire."""
        if not _lean_triton.available(weights_out.device):
            # the PyTorch-ops step: its temporaries are what the plan's scratch holds
            piece = min(piece, LEAN_DEVICE_STEP_PIECE)
        piece = max(STEP_ALIGN, piece // STEP_ALIGN * STEP_ALIGN)
        own_master = "master" in state
        master = state["master"] if own_master else weights_out
        for index, begin, end in runs:
            for lo in range(begin, end, piece):  # begin: a parameter's, a whole block
                hi = min(end, lo + piece)
                g = grad[lo:hi].to(weights_out.device, non_blocking=True)
                self.piece(
                    fmt,
                    master,
                    g,
                    state,
                    lo,
                    hi,
                    settings=settings[index],
                    step=step,
                    wire_out=weights_out[lo:hi] if own_master else None,
                    seed=seed,
                    threads=threads,
                    grad_scale=grad_scale,
                )


EXACT = ExactAdamW()
LEAN = LeanAdamW()


def adamw_for(fmt: HostPrecision) -> ExactAdamW | LeanAdamW:
    """The AdamW arithmetic of host formats ``fmt``."""
    return EXACT if fmt.is_exact else LEAN
