"""Plans for several ranks on one host: the ZeRO stage, the host RAM of N ranks, and what
N GPUs' tokens/s would be.

[Note: ZeRO stage of a plan]
ZeRO-2 is the plan's choice whenever there are several ranks: each unit's gradients
are reduced to its owner, which alone copies them down and keeps a host buffer for them,
so a host moves one unit's gradients over PCIe once per step instead of once per rank
(ZeRO-1: every rank lands every unit's averaged gradients) and holds one gradient buffer
instead of N. The optimizer states are sharded either way. ZeRO-1 computes the same
steps (``--zero-stage 1`` forces it) and costs more on every count, so it is never chosen.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..memory.estimate import MemoryEstimate, runtime_overhead_bytes
from ..planner.predict import Rates, StepPrediction
from ..sizes import format_bytes


@dataclass(frozen=True)
class ZeroChoice:
    """The ZeRO stage of a run of several ranks and why.

    Attributes:
        stage: 1 or 2.
        reason: one line for the plan and the run's messages.
    """

    stage: int
    reason: str


def choose_zero_stage(num_ranks: int, forced: int | None = None) -> ZeroChoice:
    """The ZeRO stage for ``num_ranks`` ranks (see [Note: ZeRO stage of a plan]).

    Args:
        num_ranks: ranks of the run, at least 2.
        forced: ``--zero-stage``: 1 or 2; None to let the plan choose.

    Raises:
        ValueError: ``num_ranks`` below 2, or ``forced`` not 1, 2 or None.
    """
    if num_ranks < 2:
        raise ValueError(f"a ZeRO stage needs at least 2 ranks, got {num_ranks}")
    if forced is not None:
        if forced not in (1, 2):
            raise ValueError(f"--zero-stage must be 1 or 2, got {forced}")
        return ZeroChoice(forced, "--zero-stage")
    return ZeroChoice(
        2,
        "each unit's gradients are copied down and kept once per host, by the rank that "
        "steps it (ZeRO-1: by every rank)",
    )


# [Note: N ranks on one host]
# What the ranks of a host share, for the plan of ``ramflow plan --nproc-per-node N``:
# - RAM: the host store (master weights, wire copies) once, in shared memory; the optimizer
#   states once, sharded over the ranks; the runtime (Python, torch) once per rank. Each
#   rank's own gradient buffers (pinned staging, host gradients) count N times, except
#   those made per unit at the unit's first landing under ZeRO-2, where a rank lands only
#   the units it steps: once in all. A gradient ring (lean host formats) is every rank's.
# - Time: each rank has its own GPU and PCIe link, so a rank's compute and H2D are one
#   GPU's; its D2H is one GPU's under ZeRO-1 and a 1/N share under ZeRO-2. The CPU
#   optimizer steps every parameter once per host, on all the host's cores, and loses
#   time to every byte the N links move through host DRAM (the 1-GPU model's
#   ``Rates.copies_on_host_dram_s``, now with N ranks' copies). Host DRAM carries all of
#   it: N ranks' H2D reads, the D2H writes and the optimizer's own traffic
#   (``Rates.cpu_optimizer_dram_bytes_per_param`` per parameter).
# The N-rank step is the largest of those busy times, times the 1-GPU pipeline's own
# step over its largest busy time (how far from its floor one GPU's schedule runs); the
# resource with the largest busy time is what binds. It ignores the reduction's NCCL
# traffic (over NVLink, beside PCIe) and NUMA; it is a plan, not a measurement.

DEFAULT_HOST_DRAM_BYTES_PER_S = 192e9
"""Host DRAM traffic rate, bytes read plus written per second: twice the 96 GB/s memory
copy rate measured on the H200 box (``/work/shared/ANCHORS.md``; a copy reads and writes
each byte). Give your host's with ``ramflow plan --host-dram-gbps``."""

MIN_CORES_PER_RANK = 2
"""Cores a rank needs besides the optimizer's threads: its training loop (which feeds the
GPU) and its worker thread (landing, refresh). Fewer, and the ranks' threads queue."""


@dataclass(frozen=True)
class RanksPrediction:
    """The predicted step of N ranks on one host. See [Note: N ranks on one host].

    Attributes:
        num_ranks: N.
        step_s: seconds per optimizer step of all ranks.
        tokens_per_s: training tokens per second of all ranks together.
        one_gpu_tokens_per_s: the 1-GPU prediction's, for the speed-up.
        busy_s: per resource, its busy time per step with N ranks (seconds).
        bound: the resource with the largest busy time.
        cores_note: set when the host has fewer than ``MIN_CORES_PER_RANK`` cores per rank.
    """

    num_ranks: int
    step_s: float
    tokens_per_s: float
    one_gpu_tokens_per_s: float
    busy_s: dict[str, float]
    bound: str
    cores_note: str | None = None

    @property
    def speedup(self) -> float:
        """Tokens/s over one GPU's."""
        return self.tokens_per_s / self.one_gpu_tokens_per_s

    def describe(self) -> str:
        busy = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in self.busy_s.items())
        return (
            f"{self.num_ranks} GPUs: {self.step_s * 1e3:.0f} ms per step, "
            f"{self.tokens_per_s:,.0f} tokens/s ({self.speedup:.2f}x one GPU); bound by "
            f"{self.bound}; busy per step (ms): {busy}"
            + (f"\n  {self.cores_note}" if self.cores_note else "")
        )


def predict_ranks(
    one: StepPrediction,
    *,
    num_ranks: int,
    num_trainable: int,
    tokens_per_rank_step: int,
    rates: Rates,
    zero_stage: int = 2,
    host_dram_bytes_per_s: float = DEFAULT_HOST_DRAM_BYTES_PER_S,
    cores: int | None = None,
) -> RanksPrediction:
    """Predict N ranks' step on one host from one GPU's (see [Note: N ranks on one host]).

    Args:
        one: the 1-GPU step prediction (``ramflow.planner.predict.predict_step``) of one rank's
            micro-batch.
        num_ranks: N, at least 1.
        num_trainable: trained parameters (each stepped once per host per step).
        tokens_per_rank_step: tokens one rank computes per step (B x T x accumulation).
        rates: the rates ``one`` was predicted with (CPU optimizer rate: the whole host's).
        zero_stage: 1 or 2: who copies the gradients down.
        host_dram_bytes_per_s: host DRAM traffic rate, bytes read plus written per second.
        cores: the host's cores (default: this machine's).

    Raises:
        ValueError: ``num_ranks`` below 1, a rate not positive, or ``one`` not a training
            prediction.
    """
    if num_ranks < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {num_ranks}")
    if not (host_dram_bytes_per_s > 0 and math.isfinite(host_dram_bytes_per_s)):
        raise ValueError(f"--host-dram-gbps must be positive, got {host_dram_bytes_per_s / 1e9}")
    if one.mode != "train":
        raise ValueError("predict_ranks needs a training step's prediction")
    cores = cores if cores is not None else (os.cpu_count() or 1)
    n = num_ranks
    d2h_host = one.d2h_bytes * (1 if zero_stage == 2 and n > 1 else n)
    copies = n * one.h2d_bytes + d2h_host
    arithmetic_s = one.busy_s["CPU optimizer"] - one.copies_on_cpu_s
    per_param = rates.cpu_optimizer_dram_bytes_per_param or 0.0
    busy = {
        "GPU compute": one.busy_s["GPU compute"],
        "PCIe H2D": one.busy_s["PCIe H2D"],
        "PCIe D2H": one.busy_s["PCIe D2H"] * d2h_host / max(n * one.d2h_bytes, 1),
        "CPU optimizer": arithmetic_s + rates.copies_on_host_dram_s(copies),
        "host DRAM": (copies + num_trainable * per_param) / host_dram_bytes_per_s,
    }
    pipeline = one.step_s / one.floor_s if one.floor_s > 0 else 1.0
    step_s = max(busy.values()) * pipeline
    bound = max(busy, key=busy.__getitem__)
    note = None
    if cores < MIN_CORES_PER_RANK * n:
        note = (
            f"this host's {cores} cores give each of {n} ranks fewer than "
            f"{MIN_CORES_PER_RANK} (its loop and its worker): the ranks' threads will queue "
            "and the prediction is optimistic"
        )
        bound = f"{bound} (and host cores)"
    return RanksPrediction(
        num_ranks=n,
        step_s=step_s,
        tokens_per_s=n * tokens_per_rank_step / step_s,
        one_gpu_tokens_per_s=tokens_per_rank_step / one.step_s,
        busy_s=busy,
        bound=bound,
        cores_note=note,
    )


@dataclass(frozen=True)
class RanksPlan:
    """One host's RAM for N ranks, the ZeRO stage, and (GPU plans) the N-GPU speed.

    Attributes:
        num_ranks: N.
        zero: the ZeRO stage and why.
        shared_bytes: the host store, once per host (master weights and wire copies).
        optimizer_bytes: optimizer states, once in all (sharded over the ranks).
        gradient_bytes: host gradient buffers (pinned staging and gradients) of all ranks:
            once in all under ZeRO-2 (a rank lands only the units it steps), N times under
            ZeRO-1 or with a gradient ring.
        per_rank_bytes: one rank's own: the runtime, and on a CPU run its "device" side.
        ram_available_bytes: this machine's available RAM.
        prediction: the N-GPU step (GPU plans with a 1-GPU prediction), else None.
        device_side: a CPU run: ``per_rank_bytes`` includes each rank's "device" side.
    """

    num_ranks: int
    zero: ZeroChoice
    shared_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    per_rank_bytes: int
    ram_available_bytes: int
    prediction: RanksPrediction | None = None
    device_side: bool = False

    @property
    def ram_needed_bytes(self) -> int:
        return (
            self.shared_bytes
            + self.optimizer_bytes
            + self.gradient_bytes
            + self.num_ranks * self.per_rank_bytes
        )

    @property
    def fits_ram(self) -> bool:
        return self.ram_needed_bytes <= self.ram_available_bytes

    def describe(self) -> str:
        """The plan's lines for several ranks (appended to the 1-GPU plan's)."""
        n = self.num_ranks
        lines = [
            f"{n} ranks on this host, ZeRO-{self.zero.stage} ({self.zero.reason}); the figures "
            "above are one rank's GPU",
            f"host RAM for {n} ranks: {format_bytes(self.ram_needed_bytes)} = host store "
            f"{format_bytes(self.shared_bytes)} once (shared memory) + optimizer states "
            f"{format_bytes(self.optimizer_bytes)} once (sharded) + host gradients of all "
            f"ranks {format_bytes(self.gradient_bytes)} + {n} x "
            f"{format_bytes(self.per_rank_bytes)} per rank (runtime"
            + (", device side" if self.device_side else "")
            + "); "
            f"{format_bytes(self.ram_available_bytes)} available: "
            + ("fits" if self.fits_ram else "DOES NOT FIT"),
        ]
        if self.prediction is not None:
            lines.append("predicted: " + self.prediction.describe())
        return "\n".join(lines)


def plan_ranks(
    estimate: MemoryEstimate,
    *,
    num_ranks: int,
    zero_stage: int | None = None,
    tokens_per_rank_step: int | None = None,
    host_dram_bytes_per_s: float = DEFAULT_HOST_DRAM_BYTES_PER_S,
    cores: int | None = None,
) -> RanksPlan:
    """The plan of ``num_ranks`` ranks on one host from one rank's ``estimate`` (see
    [Note: N ranks on one host]).

    Args:
        estimate: one rank's plan (``plan_run``), its ``prediction`` for the speed.
        num_ranks: N, at least 2.
        zero_stage: ``--zero-stage``, None for the plan's choice.
        tokens_per_rank_step: tokens one rank computes per step (default: its micro-batch).
        host_dram_bytes_per_s, cores: see ``predict_ranks``.

    Raises:
        ValueError: ``num_ranks`` below 2, or another stage than 1 or 2.
    """
    zero = choose_zero_stage(num_ranks, zero_stage)
    e = estimate
    ring = e.host_precision.gradient_format.ring
    # the staging (a ring's, every rank's; ZeRO-2 without a ring: the owner's) and the full
    # gradient buffer a loop that clips or accumulates keeps (ZeRO-2: the owner's, once)
    staging_copies = num_ranks if ring or zero.stage == 1 else 1
    full_copies = 1 if zero.stage == 2 else num_ranks
    gradient_bytes = (
        e.host_gradient_pinned_bytes * staging_copies + e.host_gradient_pageable_bytes * full_copies
    )
    device_side = e.device_total_bytes if e.device_type == "cpu" else 0
    per_rank = runtime_overhead_bytes(e.device_type) + device_side
    prediction = None
    if e.prediction is not None and e.prediction.mode == "train":
        prediction = predict_ranks(
            e.prediction,
            num_ranks=num_ranks,
            num_trainable=e.num_trainable,
            tokens_per_rank_step=tokens_per_rank_step or e.batch_size * e.seq_len,
            rates=e.timing_rates or Rates(),
            zero_stage=zero.stage,
            host_dram_bytes_per_s=host_dram_bytes_per_s,
            cores=cores,
        )
    return RanksPlan(
        num_ranks=num_ranks,
        zero=zero,
        shared_bytes=e.host_parameter_pinned_bytes + e.host_parameter_pageable_bytes,
        optimizer_bytes=e.host_optimizer_bytes,
        gradient_bytes=gradient_bytes,
        per_rank_bytes=per_rank,
        ram_available_bytes=e.ram_available_bytes,
        prediction=prediction,
        device_side=device_side > 0,
    )


__all__ = [
    "DEFAULT_HOST_DRAM_BYTES_PER_S",
    "RanksPlan",
    "RanksPrediction",
    "ZeroChoice",
    "choose_zero_stage",
    "plan_ranks",
    "predict_ranks",
]
