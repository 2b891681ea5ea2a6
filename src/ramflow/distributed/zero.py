"""The engine under torch.distributed: gradient reduction, ZeRO ownership, shared host store.

[Note: data parallelism on the engine]
Every rank runs the same model on its own micro-batch and its own GPU, streaming over its
own PCIe link. When a unit's gradients are complete on the device, the rank reduces them
over the process group (all-reduce; reduce to the owner under ZeRO-2 when one owner serves
every rank) asynchronously; the D2H copy of the reduced gradients waits for it on the D2H
stream. Each unit has one owner per host that steps it (ZeRO-1: optimizer states exist on
the owner only; ZeRO-2: only the owner copies the gradients down and keeps them). After
``opt.step()`` every rank's worker waits for its own steps and for the others (a barrier on a gloo
group), then rewrites the wire copies of the units others stepped and reloads them before
their next use. Ranks of one host share one host copy of the master weights (and, under
``ramflow.offload``, of the wire copy), so nothing crosses processes but the barrier.

Collectives are issued in backward order, which is the same on every rank for the same
model; a unit that receives gradients on some ranks and not on others would hang them
(as in DDP without ``find_unused_parameters``): the process group's timeout ends it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..engine.host_store import FillMaster
from ..engine.phase_times import PhaseSeconds
from ..engine.worker import STEP
from ..formats.host import HostPrecision
from ..sizes import format_bytes
from ..transfer.streams import record_event
from ..units.unit import Unit, UnitSpec
from .store_files import (  # noqa: F401 - STORE_FILE and the checks are imported from here
    STORE_FILE,
    CreatedFiles,
    check_shm_directory_pins,
    create_store_file,
    filesystem_type,
    host_name,
    pid_alive,
    remove_stale_store_files,
    shm_directory,
)

_AFTER_ALL_STEPS = 1 << 62  # worker order: behind every step of this rank

if TYPE_CHECKING:
    from ..engine.engine import Engine

_cpu_groups: dict[int, dist.ProcessGroup] = {}


def require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group "
            "first (torchrun sets up the environment; use backend='nccl' on GPUs, 'gloo' on CPUs)"
        )


def cpu_group() -> dist.ProcessGroup:
    """A gloo group over all ranks for host-side collectives (barriers, host tensors).
    Every rank must reach the first call (it creates the group)."""
    key = id(dist.group.WORLD)
    group = _cpu_groups.get(key)
    if group is None:
        if dist.get_backend() == "gloo":
            group = dist.group.WORLD
        else:
            group = dist.new_group(backend="gloo")
        _cpu_groups[key] = group
    return group


def host_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks on this host, in order (found by host name)."""
    names: list[str | None] = [None] * dist.get_world_size()
    me = host_name()
    dist.all_gather_object(names, me, group=group)
    return [r for r, n in enumerate(names) if n == me]


class DistributedState:
    """How one engine takes part in data parallelism; see [Note: data parallelism on the
    engine]. ``unit.owner`` holds each unit's owner rank (None: every rank steps it)."""

    def __init__(self, *, zero_stage: int, average: bool, reduce_to_owner: bool) -> None:
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage}")
        self.group = dist.group.WORLD
        self.cpu_group = cpu_group()
        # the worker thread's own group: collectives of two threads never share a group
        self.step_group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.zero_stage = zero_stage
        self.average = average
        self.reduce_to_owner = reduce_to_owner and zero_stage == 2
        # how many ranks own each unit: one per host when each host steps its own copy
        # (``ramflow.offload``), one in all (``ramflow.distributed``)
        self.copies = 1
        # every rank's (host name, PID): a failed collective names the ranks of this host
        # that died, see [Note: a rank that dies]
        peers: list[tuple[str, int] | None] = [None] * self.world_size
        dist.all_gather_object(peers, (host_name(), os.getpid()), group=self.cpu_group)
        self.peers: list[tuple[str, int]] = peers  # type: ignore[assignment]
        # see [Note: refresh by broadcast]: the units every rank keeps resident, and the
        # worker's group for their broadcasts (set by ``refresh_by_broadcast``)
        self.broadcast_units: frozenset[int] = frozenset()
        self.broadcast_group: dist.ProcessGroup | None = None
        self._broadcast_stream: torch.cuda.Stream | None = None
        # wall seconds of the worker's phases after each step, see [Note: the step's sync]
        self.sync_seconds = PhaseSeconds()

    def alive(self) -> bool:
        """False once the process group this state was made for has been destroyed."""
        return dist.is_available() and dist.is_initialized() and dist.group.WORLD is self.group

    def owns(self, u: Unit) -> bool:
        return u.owner is None or u.owner == self.rank

    def keeps_gradients(self, u: Unit) -> bool:
        return self.zero_stage < 2 or self.owns(u)

    def reduce_gradients(self, u: Unit, grad: torch.Tensor) -> dist.Work | None:
        """Start the reduction of ``u``'s flat device gradients (in place; async)."""
        if self.world_size == 1:
            return None
        if self.average:
            grad.mul_(1.0 / self.world_size)
        what = f"reducing the gradients of unit {u.name!r}"
        with self.explained(what):
            if self.reduce_to_owner and u.owner is not None:
                work = dist.reduce(grad, dst=u.owner, group=self.group, async_op=True)
            else:
                work = dist.all_reduce(grad, group=self.group, async_op=True)
        return _Work(work, what, self)

    def after_step(self, engine: Engine) -> None:
        """Called by ``opt.step()`` once this rank's steps are scheduled: mark the units
        that other ranks step as stale (their next use waits), and queue, behind this
        rank's own steps on the worker, the refresh of those units and the barrier with
        the other ranks ([Note: the step's sync]). ``opt.step()`` returns at once: the next
        forward overlaps the tail of the steps, as on one GPU, and waits only at a unit
        that is not current yet."""
        others = [u for u in engine.units if not self.owns(u) and u.num_trainable]
        engine.window.begin_host_write(others)
        # this step's device steps are all issued: the barrier waits for their write-backs
        written = engine.device_stepper.write_back_events()
        sync = functools.partial(self._sync, engine, others, written)
        engine.worker.submit(STEP, _AFTER_ALL_STEPS, sync)

    def _sync(
        self, engine: Engine, others: list[Unit], written: list[tuple[Unit, torch.cuda.Event]]
    ) -> None:
        """Worker: see [Note: the step's sync]. ``written``: the write-backs of this step's
        device steps, which the barrier waits for."""
        clock = time.perf_counter()
        received: dict[int, torch.cuda.Event | None] = {}
        sent: list[tuple[Unit, torch.cuda.Event]] = []
        if self.broadcast_units:
            received, sent = self._broadcast_resident(engine)
        late = []
        for u in others:  # in unit order: the next forward waits for each unit's own copy
            if u.index in received and _wire_shared(u):
                engine.host.refresh_wire(u, written=True, received=(received[u.index],))
            else:
                late.append(u)
        clock = self.sync_seconds.add("broadcasts issued", clock)
        # the host store is current before the barrier: see [Note: the device optimizer
        # under ZeRO] in ramflow.engine.stepper
        for u, event in written:
            self.wait_event(event, f"writing the weights of unit {u.name!r} back to the host")
        clock = self.sync_seconds.add("write-backs", clock)
        with self.explained("waiting for the other ranks' optimizer steps"):
            dist.barrier(group=self.step_group)
            for u in engine.units:
                if u.owner is not None and u.num_trainable and not u.master.is_shared():
                    dist.broadcast(
                        u.master[: u.trainable_numel], src=u.owner, group=self.step_group
                    )
        clock = self.sync_seconds.add("barrier", clock)
        for u in late:
            if u.index in received:
                event = received[u.index]
                if event is not None:
                    self.wait_event(event, f"receiving unit {u.name!r} from rank {u.owner}")
                engine.host.refresh_wire(u, written=_wire_shared(u), received=(event,))
            else:
                engine.host.refresh_wire(u, written=_wire_shared(u))
        # every send and receive has ended before the worker goes on: its next tasks (host
        # steps and their refreshes) rewrite device copies that a broadcast may still read
        for u, event in sent:
            self.wait_event(event, f"broadcasting unit {u.name!r} to the other ranks")
        for u in engine.units:
            if received.get(u.index) is not None:
                self.wait_event(received[u.index], f"receiving unit {u.name!r} from rank {u.owner}")
        self.sync_seconds.add("broadcasts ended", clock)

    def refresh_by_broadcast(self, engine: Engine) -> None:
        """Every rank (a collective): from now on, the device copies of the units every
        rank keeps resident are refreshed from their owner's device by a broadcast instead
        of a copy from the host (see [Note: refresh by broadcast]). Only where one owner
        serves every rank (one host); elsewhere nothing changes."""
        mine = [
            u.index for u in engine.units if u.resident and u.num_trainable and u.owner is not None
        ]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.cpu_group)
        common = frozenset.intersection(*(frozenset(x) for x in everyone))
        if self.copies != 1 or not common:
            return
        cuda = engine.device.type == "cuda"
        # the worker thread's own group: NCCL on GPUs; on CPUs its gloo step group
        self.broadcast_group = dist.new_group(backend="nccl") if cuda else self.step_group
        if cuda:
            self._broadcast_stream = torch.cuda.Stream(engine.device)
        self.broadcast_units = common

    def open_communicators(self, device: torch.device) -> None:
        """Every rank (a collective): one collective of one element on each process group
        the steps use on ``device`` (the gradients' reductions, the resident units'
        broadcasts), so that NCCL, which makes a group's communicator at its first
        collective (seconds on a host of several GPUs), makes them at ``offload`` and not
        inside the first step. See [Note: states made before the first step] in
        ``ramflow.optim.unit_states``."""
        probe = torch.zeros(1, device=device)
        with self.explained("opening the process groups' communicators"):
            dist.all_reduce(probe, group=self.group)
            if self.broadcast_group is not None and self.broadcast_group is not self.step_group:
                dist.broadcast(
                    probe,
                    src=dist.get_global_rank(self.broadcast_group, 0),
                    group=self.broadcast_group,
                )
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _broadcast_resident(
        self, engine: Engine
    ) -> tuple[dict[int, torch.cuda.Event | None], list[tuple[Unit, torch.cuda.Event]]]:
        """Worker: issue the broadcast of each unit of ``broadcast_units`` from its owner's
        device copy (stepped and refreshed there during backward) into every other rank's,
        in unit order on every rank, without waiting for them. Returns, for the units this
        rank receives, the event that ends each copy (None on the CPU, where they have
        ended), and the units this rank sends with theirs."""
        stream = self._broadcast_stream
        received: dict[int, torch.cuda.Event | None] = {}
        sent: list[tuple[Unit, torch.cuda.Event]] = []
        for u in engine.units:
            if u.index not in self.broadcast_units:
                continue
            mine = u.owner == self.rank
            flat = u.device_alias[: u.trainable_numel].view(torch.uint8)
            what = f"broadcasting unit {u.name!r} from rank {u.owner}"
            with self.explained(what):
                if stream is None:
                    dist.broadcast(flat, src=u.owner, group=self.broadcast_group)
                    event = None
                else:
                    with torch.cuda.stream(stream):
                        # the owner sends what its refresh (or device step) wrote; the
                        # others overwrite a copy only once their backward is done reading it
                        mine_events = [u.h2d_event, u.device_step_event]
                        for e in mine_events if mine else u.idle_events:
                            if e is not None:
                                stream.wait_event(e)
                        dist.broadcast(
                            flat, src=u.owner, group=self.broadcast_group, async_op=True
                        ).wait()
                        event = record_event(stream)
            if not mine:
                received[u.index] = event
            elif event is not None:
                sent.append((u, event))
        return received, sent

    def dead_ranks(self) -> list[int]:
        """The ranks of this host whose process is gone (a zombie counts as gone)."""
        me = host_name()
        return [r for r, (host, pid) in enumerate(self.peers) if host == me and not pid_alive(pid)]

    def failure(self, what: str, cause: BaseException | str) -> RuntimeError:
        """ramflow's error for a collective (or a wait on one) that failed: which rank died
        where it can tell, and what to do. See [Note: a rank that dies]."""
        # a killed process closes its sockets (which fails our collective) a moment before
        # it is gone from the process table: give it that moment
        give_up = time.monotonic() + _DYING_S
        while not (dead := self.dead_ranks()) and time.monotonic() < give_up:
            time.sleep(0.05)
        if dead:
            who = ", ".join(f"rank {r} (PID {self.peers[r][1]})" for r in dead)
            why = f"{who} on this host died"
        else:
            away = [r for r, (host, _) in enumerate(self.peers) if host != host_name()]
            why = "another rank has probably died or stopped" + (
                f" (no rank of this host has; ranks {away} are on other hosts)" if away else ""
            )
        return RuntimeError(
            f"ramflow: {what} failed on rank {self.rank}: {why}. Data parallelism cannot go "
            "on without every rank: check the other ranks' logs, stop every rank and restart "
            "them all from the last checkpoint (torchrun --max-restarts does). "
            f"Cause: {cause}"
        )

    @contextlib.contextmanager
    def explained(self, what: str) -> Iterator[None]:
        """Turn a collective's failure into ``failure``'s error."""
        try:
            yield
        except Exception as err:
            raise self.failure(what, err) from err

    def wait_event(self, event: torch.cuda.Event, what: str) -> None:
        """Host: wait for ``event``, which follows a collective on the device (NCCL), by
        polling it, so that a rank of this host that died fails this one at once with
        ``failure``'s error instead of blocking until NCCL's watchdog ends the process at
        the process group's timeout. See [Note: a rank that dies]."""
        checked = time.monotonic()
        while not event.query():
            if time.monotonic() - checked >= _LIVENESS_PERIOD_S:
                checked = time.monotonic()
                if self.dead_ranks():
                    raise self.failure(what, "its process is gone")
            time.sleep(_POLL_S)


# [Note: a rank that dies]
# A rank killed mid-step (SIGKILL, the OOM killer) runs no code, so the others learn of it
# from their next collective: gloo's fails at once (its peer's sockets close); NCCL's never
# completes on the device, so a host thread blocked on an event behind it (the backward's
# gradient throttle, the worker's landing) would wait until NCCL's watchdog takes the
# process down at the process group's timeout with its own message. ramflow therefore
# waits for those events by polling (``wait_event``) and checks every
# ``_LIVENESS_PERIOD_S`` whether a rank of this host is gone (its PID, gathered at
# set-up; a process that closed its sockets may take a moment, ``_DYING_S`` at most, to
# leave the process table); either way the error is ``DistributedState.failure``'s, naming
# the dead ranks of this host (ranks on other hosts are only known as "another rank") and
# saying what to do. The shared host store's files are unlinked once every rank of a host has mapped
# them (see [Note: host store files]), so a death after set-up leaves none behind.
# [Note: refresh by broadcast]
# A unit every rank keeps resident is stepped by its owner alone, and every rank must then
# refresh its device copy. From the host that costs each rank the units it does not own
# (N-1 of N of the resident bytes) over its own PCIe link while the next forward waits: on
# 4 GPUs with a 2.7 B model resident, 4.0 GB per rank and step (what that cost is in
# docs/multi-gpu.md, "Measured"). The
# owner already refreshed its own copy during backward, right after its step (or stepped it
# there, [Note: the device optimizer under ZeRO] in ``ramflow.engine.device_stepper``); by default
# (``RAMFLOW_REFRESH_BY_BROADCAST=0``, read by ``ramflow.offload``, turns it off) the others
# take it from there: the worker of every rank broadcasts each such unit, in unit order,
# from its owner's device (NCCL over NVLink, on a stream and a process group of the
# worker's own; gloo on CPUs), see [Note: the step's sync] for when. A receiver's copy waits
# for its backward's last use of the unit (``idle_events``), the owner's send for its step
# or refresh (``device_step_event``, ``h2d_event``), and the receiver's next use waits for
# the broadcast's event as for a load. The bytes are the owner's copy of the same shared
# wire copy, so results are unchanged (tested on gloo and NCCL). On by default: it is the
# faster (docs/multi-gpu.md, "Measured", gives the run); the ranks must agree on the
# variable (``refresh_by_broadcast`` is a collective).
# [Note: the step's sync]
# Behind this rank's steps, the worker (``_sync``): (1) issues the broadcasts of the
# resident units (unit order, nothing waited for) and marks each received unit current with
# its broadcast's event, where the unit's wire copy is the shared one (nothing on this
# host to rewrite); (2) waits for this rank's write-backs ([Note: the device optimizer
# under ZeRO]); (3) meets the other ranks at the barrier; (4) refreshes the other units
# from the host (and the received ones whose wire copy is this rank's own); (5) waits until
# every send and receive has ended. So the next forward waits per unit, for its own
# broadcast only, and neither the write-backs (a D2H of up to 6 bytes per parameter) nor
# the barrier are on its way: the bytes a broadcast carries are the owner's device copy,
# ordered by events, not by the host store. The host store is still current for every
# reader after the barrier, as before: a load of a unit not kept resident waits for (4),
# and ``synchronize`` (``state_dict``, a checkpoint, ``undo``) waits for the worker, so for
# (5). The owner's next write of a sent copy (its next device step, or a host step's
# refresh) follows the next reduction of the unit's gradients, which the receivers join
# only after their forward read the received copy (so after the broadcast has read the
# owner's), and the worker's own next tasks come after (5). A forward that meets a unit
# whose broadcast has not ended polls its event (``DeviceWindow.acquire``) and raises the
# worker's error, so a rank that dies meanwhile fails this one with ramflow's error (the
# worker's waits in (2)-(5) check liveness, [Note: a rank that dies]). Every phase's wall
# time is summed in ``DistributedState.sync_seconds`` (``benchmarks/node/multi_gpu.py``
# reports it per rank).
_LIVENESS_PERIOD_S = 0.5
_DYING_S = 2.0
_POLL_S = 1e-4  # a backward that waits here stalls by at most this (plus the sleep's slack)


def _wire_shared(u: Unit) -> bool:
    """Whether ``u``'s wire copy is the one its owner writes (the master, or a shared
    wire copy), so that nothing on this rank's host needs rewriting after its step."""
    return u.wire is u.master or u.given_wire is not None


class _Work:
    """A collective's work handle whose ``wait`` explains a failure (see
    ``DistributedState.failure``)."""

    def __init__(self, work: dist.Work, what: str, state: DistributedState) -> None:
        self._work, self._what, self._state = work, what, state

    def wait(self) -> None:
        with self._state.explained(self._what):
            self._work.wait()


def agree_on_precision(
    precision: HostPrecision, reason: str | None, *, auto: bool
) -> tuple[HostPrecision, str | None]:
    """The host format every rank uses (every rank calls this, in ``ramflow.offload``).

    The ranks of a host share one master per unit and the hosts' owners must round alike,
    so every rank needs the same policy, seed included. With ``host_precision="auto"``
    (``auto``) each rank chose from its own host's free RAM: if any chose a lean format,
    all take the first such rank's (the others then use less RAM than they could).

    Returns the policy and the reason for it (``get_plan(model).host_precision_reason``).

    Raises:
        ValueError: ranks were given different policies (the message names two of them).
    """
    chosen: list[tuple[HostPrecision, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, (precision, reason), group=cpu_group())
    if all(pr == precision for pr, _ in chosen):
        return precision, reason
    if auto:  # some rank's host lacks the RAM for fp32: all take its lean format
        rank, (pr, why) = next((r, c) for r, c in enumerate(chosen) if not c[0].is_exact)
        return pr, f"rank {rank} chose it for its host: {why}"
    for rank, (pr, _) in enumerate(chosen):
        if pr != precision:
            raise ValueError(
                f"the ranks' host_precision differ (rank {dist.get_rank()}: {precision}, "
                f"rank {rank}: {pr}); pass the same host_precision (and seed) on every rank"
            )
    return precision, reason


def assign_owners(numels: list[int], ranks: list[int]) -> list[int]:
    """Give each item an owner among ``ranks``, largest first to the least loaded rank
    (ties by rank): balanced optimizer work and state memory, the same on every rank."""
    load = {r: 0 for r in ranks}
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(ranks, key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


def raise_if_any_failed(what: str, error: BaseException | None) -> None:
    """Every rank calls this after a part of set-up that may fail on some ranks only (a
    file one host cannot read, a host short of shared memory, a weights function that
    raises on one rank's units), with the exception it caught or None. If any rank failed,
    every rank raises here, so that none waits in a later collective for ranks that have
    left (a hang until the process group's timeout): the failing rank raises its own
    error, the others a RuntimeError that names the first failing rank and its message."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    statuses: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, mine, group=cpu_group())
    failed = [(rank, message) for rank, message in enumerate(statuses) if message is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise RuntimeError(
            f"ramflow: {what} failed on rank {rank} ({message}); every rank stops. Fix the "
            f"cause that rank {rank}'s log names, then start all ranks again."
        )


def shared_host_store(
    specs: list[UnitSpec],
    *,
    wire_dtype: torch.dtype,
    numels: list[int],
    offsets: list[list[int]],
    master_dtype: torch.dtype = torch.float32,
    zero_stage: int | None = None,
    fill: FillMaster | None = None,
) -> tuple[list[int], list[int]]:
    """Put the units' masters and wire copies in shared memory, one copy per host.

    ``master_dtype`` is the host format's (``HostPrecision.master_dtype``): fp32 masters
    beside a wire copy of ``wire_dtype`` (none when that is fp32 too), or bf16 masters that
    are the wire copy (a bf16 wire; no second file). Only the masters are shared: optimizer
    states live on each unit's owner, gradient staging (per unit or the ring) on each rank.

    Without ``fill``, the first rank of each host writes its model's weights (after rank
    0's have been broadcast to the first ranks of the other hosts); the other ranks map the
    same pages and point their parameters at them, dropping their own copies. With
    ``fill`` (a model built on the meta device, ``ramflow.offload(..., weights=...)``: its
    parameters are CPU stand-ins, ``MetaLoader.materialize``), the leader creates the files
    empty, every rank maps them, and each rank writes the units it owns, through
    ``fill(params, views)`` (``MetaLoader.fill``), and their wire copies: see [Note:
    loading once per host]. Files live in ``$RAMFLOW_SHM_DIR`` (default /dev/shm) only
    until every rank of the host has mapped them; see [Note: host store files] for their
    names, and for the stale files of dead leaders that this call removes first. Returns
    each unit's owner (a global rank on this host) and this host's ranks.

    Raises ValueError when the ranks' models differ (unit sizes, parameter shapes, one
    loading weights and another not) or their ``zero_stage`` does (their collectives would
    not match: a hang), MemoryError when the shared-memory directory lacks room; with
    ``fill``, what it raises on any rank (the other ranks raise a RuntimeError naming that
    rank, ``raise_if_any_failed``). On any error the files are removed and no parameter
    points into them.
    """
    group = cpu_group()
    world = dist.get_world_size()
    local = host_ranks(group)
    me = dist.get_rank()
    leader = local[0]
    # unit sizes (every rank's must match) and PIDs (the leaders' name their files)
    shapes = [[tuple(p.shape) for p in spec.owned] for spec in specs]
    loading = fill is not None
    gathered: list[tuple | None] = [None] * world
    mine = (numels, os.getpid(), shapes, zero_stage, loading)
    dist.all_gather_object(gathered, mine, group=group)
    if any(g[0] != numels or g[2] != shapes for g in gathered):
        raise ValueError(
            "the ranks' models differ (unit sizes or parameter shapes do not match); build "
            "the same model on every rank before ramflow.offload"
        )
    stages = sorted({g[3] for g in gathered}, key=str)
    if len(stages) > 1:
        raise ValueError(
            f"the ranks were given different zero_stage values ({', '.join(map(str, stages))}); "
            "pass the same zero_stage on every rank"
        )
    if len({g[4] for g in gathered}) > 1:
        raise ValueError(
            "some ranks offload a meta-device model with weights= and others a model that "
            "holds its weights; do the same on every rank"
        )
    owners = assign_owners(numels, local)
    token = [uuid.uuid4().hex if me == 0 else None]
    dist.broadcast_object_list(token, src=0, group=group)
    directory = shm_directory()
    base = os.path.join(directory, f"ramflow-{gathered[leader][1]}-{token[0]}-{host_name()}")
    # a separate wire copy only beside fp32 masters (a bf16 master is the wire copy)
    separate_wire = master_dtype == torch.float32 and wire_dtype != torch.float32
    per_element = master_dtype.itemsize + (wire_dtype.itemsize if separate_wire else 0)
    need = sum(n * per_element for n in numels)
    masters: list[torch.Tensor] = []
    wires: list[torch.Tensor] = []
    with CreatedFiles() as created:
        error: BaseException | None = None
        if me == leader:
            try:
                remove_stale_store_files(directory)
                _check_room(directory, need)
            except Exception as err:  # noqa: BLE001 - agreed on below, then raised
                error = err
        raise_if_any_failed("preparing the shared host store", error)
        if loading:
            masters, wires = _fill_shared(
                specs,
                fill,
                created,
                base=base,
                numels=numels,
                offsets=offsets,
                owners=owners,
                leader=leader,
                master_dtype=master_dtype,
                wire_dtype=wire_dtype if separate_wire else None,
            )
        else:
            _copy_shared(
                specs,
                created,
                masters,
                wires,
                group=group,
                base=base,
                numels=numels,
                offsets=offsets,
                leader=leader,
                master_dtype=master_dtype,
                wire_dtype=wire_dtype if separate_wire else None,
            )
        dist.barrier(group=group)  # every rank has mapped the files: the leader unlinks them
    for i, spec in enumerate(specs):
        spec.master = masters[i]
        spec.wire = wires[i] if wires else None
        with torch.no_grad():
            for off, p in zip(offsets[i], spec.owned):
                p.data = masters[i][off : off + p.numel()].view(p.shape)
    return owners, local


def _check_room(directory: str, need: int) -> None:
    """Raise MemoryError when ``directory`` has less than ``need`` bytes free."""
    free = os.statvfs(directory)
    if free.f_bavail * free.f_frsize < need:
        raise MemoryError(
            f"ramflow needs {format_bytes(need)} of shared memory in {directory} for one host "
            f"copy of the weights, but only {format_bytes(free.f_bavail * free.f_frsize)} is "
            "free. Enlarge it (docker run --shm-size=...) or set RAMFLOW_SHM_DIR to a tmpfs "
            "with room."
        )


def _map_store_files(
    base: str, numels: list[int], master_dtype: torch.dtype, wire_dtype: torch.dtype | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Map a host's store files (made by its leader): the masters, and the wire copies
    when ``wire_dtype`` is given."""
    masters = [
        torch.from_file(f"{base}-{i}.master", shared=True, size=n, dtype=master_dtype)
        for i, n in enumerate(numels)
    ]
    wires = []
    if wire_dtype is not None:
        wires = [
            torch.from_file(f"{base}-{i}.wire", shared=True, size=n, dtype=wire_dtype)
            for i, n in enumerate(numels)
        ]
    return masters, wires


def _copy_shared(
    specs: list[UnitSpec],
    created: CreatedFiles,
    masters: list[torch.Tensor],
    wires: list[torch.Tensor],
    *,
    group: dist.ProcessGroup,
    base: str,
    numels: list[int],
    offsets: list[list[int]],
    leader: int,
    master_dtype: torch.dtype,
    wire_dtype: torch.dtype | None,
) -> None:
    """``shared_host_store`` of a model that holds its weights: the leader writes its own
    (rank 0's, on every host), the others map them. Fills ``masters`` and ``wires``."""
    me = dist.get_rank()
    if me == leader:
        for i, n in enumerate(numels):
            master = created.create(f"{base}-{i}.master", n, master_dtype)
            with torch.no_grad():
                for off, p in zip(offsets[i], specs[i].owned):
                    master[off : off + p.numel()].view(p.shape).copy_(p.detach())
            masters.append(master)
    # the first ranks of the other hosts take rank 0's weights (every rank makes the group)
    leaders = sorted(set(_gather_leaders(group, leader)))
    if len(leaders) > 1:
        leader_group = dist.new_group(ranks=leaders, backend="gloo")
        if me == leader:
            for master in masters:
                dist.broadcast(master, src=0, group=leader_group)
    if me == leader and wire_dtype is not None:
        for i, n in enumerate(numels):
            wire = created.create(f"{base}-{i}.wire", n, wire_dtype)
            wire.copy_(masters[i])
            wires.append(wire)
    dist.barrier(group=group)
    if me != leader:
        mapped_masters, mapped_wires = _map_store_files(base, numels, master_dtype, wire_dtype)
        masters.extend(mapped_masters)
        wires.extend(mapped_wires)


# [Note: loading once per host]
# A model built on the meta device on every rank (``ramflow.offload(model, zero_stage=...,
# weights=...)``) is loaded into its host's shared store by all the host's ranks at once:
# the leader creates the files empty (``ftruncate``: zero pages, no memory yet), every rank
# maps all of them, and each rank reads or draws the units it owns (``assign_owners``:
# balanced by size, the units it will step) straight into their shared masters through
# ``MetaLoader.fill``, one tensor at a time, then writes their wire copies. So the read
# (or a seeded init's draw) runs on every rank in parallel, which a 70B model needs to load
# in minutes, and the host holds the store plus, per rank, what one tensor's read takes;
# no rank ever builds a full model. The alternative, one rank reading everything while the
# others wait to map, keeps one process busy for the whole model. With several hosts each
# host's ranks fill their own copy from the same files (or the same seeded function):
# nothing crosses hosts. A failure on any rank (an unreadable file, a weights function that
# raises) is agreed on before anyone moves on (``raise_if_any_failed``): every rank raises,
# the leader removes the files, and ``offload`` gives the model back on the meta device.


def _fill_shared(
    specs: list[UnitSpec],
    fill: FillMaster,
    created: CreatedFiles,
    *,
    base: str,
    numels: list[int],
    offsets: list[list[int]],
    owners: list[int],
    leader: int,
    master_dtype: torch.dtype,
    wire_dtype: torch.dtype | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``shared_host_store`` of a meta-device model: see [Note: loading once per host].
    Returns this rank's mappings of the masters and wire copies."""
    me = dist.get_rank()
    error: BaseException | None = None
    masters: list[torch.Tensor] = []
    wires: list[torch.Tensor] = []
    try:
        if me == leader:
            masters = [
                created.create(f"{base}-{i}.master", n, master_dtype) for i, n in enumerate(numels)
            ]
            if wire_dtype is not None:
                wires = [
                    created.create(f"{base}-{i}.wire", n, wire_dtype) for i, n in enumerate(numels)
                ]
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error = err
    raise_if_any_failed("creating the shared host store's files", error)
    try:
        if me != leader:
            masters, wires = _map_store_files(base, numels, master_dtype, wire_dtype)
        with torch.no_grad():
            for i, spec in enumerate(specs):
                if owners[i] != me:
                    continue
                views = [
                    masters[i][off : off + p.numel()].view(p.shape)
                    for off, p in zip(offsets[i], spec.owned)
                ]
                fill(spec.owned, views)
                if wires:
                    wires[i].copy_(masters[i])
    except Exception as err:  # noqa: BLE001 - agreed on below, then raised
        error = err
    raise_if_any_failed("loading the weights into the shared host store", error)
    return masters, wires


def _gather_leaders(group: dist.ProcessGroup, leader: int) -> list[int]:
    leaders: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, leader, group=group)
    return [r for r in leaders if r is not None]
