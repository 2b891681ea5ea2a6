"""The device window: which units have device storage, and the copies that fill it.

Owns each unit's device side (the flat device tensor, its alias and the device parameters),
the window's byte budget and least-recently-used order, pins, the H2D copies, and the lock
that guards them (the host worker takes it to issue a unit's copy after its step).

[Note: the window is real memory]
The CPU issues kernels far ahead of the GPU. If evicting a unit only handed its storage back
to the caching allocator (with ``record_stream``), every unit whose kernels are still queued
would stay allocated, and peak memory would follow how far the CPU runs ahead, not the
window. So releasing a unit's last pin records an event on each stream that used it, and
evicting waits for those events on the host before it frees the storage: the CPU never runs
more than a window ahead of the GPU (FSDP1's ``limit_all_gathers`` does the same for its
all-gathers). Gradient buffers are limited the same way: a third waits for the oldest D2H.

[Note: one version counter per device parameter]
A unit's device parameters share its flat storage but not its version counter: each is a
tensor of its own on that storage (``set_``), not a view of the flat tensor. Views share
their base's counter, so an in-place write to one parameter (PEFT's ``ParamWrapper``
parametrizes a 3-D expert weight with ``set_`` in every forward) would bump every weight of
the unit, and backward would refuse the router weight saved earlier in the same layer,
where the resident model, whose parameters are separate tensors, trains. The H2D copies
write through ``device_alias``, which has its own counter too, so a load bumps no parameter.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from ..transfer.streams import CopyStreams, StagingBuffers, record_event
from ..units.experts import ExpertGroup, find_expert_slices
from ..units.unit import Unit, UnitSpec
from .phase_times import PhaseSeconds
from .worker import HostWorker

# False: evictions wait for the GPU with the lock held, as before (a benchmark's comparison)
_WAIT_UNLOCKED = True
_POLL_S = 1e-4  # a forward that waits for a broadcast stalls by at most this


class DeviceWindow:
    """The device side of one engine's units: allocation, eviction, budget and loads.

    Args:
        device: the compute device.
        wire_dtype: dtype of the device copies.
        streams: the copy streams of ``device``.
        worker: the host worker, whose errors a waiting acquire raises.
        routed_experts: units with routed experts load them by the router's choice where
            that leaves the result unchanged (see [Note: experts loaded by the router] in
            ``ramflow.engine.expert_loading``); False: every load copies every expert.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        streams: CopyStreams,
        worker: HostWorker,
        routed_experts: bool = False,
    ) -> None:
        self.device = device
        self.routed_experts = routed_experts
        # tests: fill the experts a sliced load leaves out with NaN, so that a computation
        # that read one would show it
        self.poison_unloaded_experts = False
        self.wire_dtype = wire_dtype
        self.streams = streams
        self.worker = worker
        self._lock = threading.RLock()
        self._capacity = 0
        self._used = 0
        self._lru: OrderedDict[Unit, None] = OrderedDict()
        self._staging = StagingBuffers()  # compressed units' copies land here first
        # seconds the computing thread waited in ``acquire`` for units not current yet
        self.wait_seconds = PhaseSeconds()
        # bytes of weights copied H2D so far, loads and expert slices (benchmarks, tests)
        self.bytes_loaded = 0
        # H2D copies of each unit's weights (by unit name) since the window was made
        self.num_loads: Counter[str] = Counter()

    # ------------------------------------------------------------------ set-up

    def build(self, units: list[Unit], specs: list[UnitSpec], owner_of: dict[int, Unit]) -> None:
        """Make the device tensors and parameters of new ``units`` (no storage yet) and
        point their slots at them. ``owner_of``: id of a host parameter -> its unit, every
        unit of the engine included (tied parameters may belong to earlier units)."""
        for u in units:
            u.device_flat = torch.empty(u.numel, dtype=self.wire_dtype, device=self.device)
            u.device_alias = torch.empty(0, dtype=self.wire_dtype, device=self.device).set_(
                u.device_flat.untyped_storage(), 0, (u.numel,)
            )
            storage = u.device_flat.untyped_storage()
            for offset, p in zip(u.offsets, u.owned):
                # See [Note: one version counter per device parameter]
                data = torch.empty(0, dtype=self.wire_dtype, device=self.device)
                data.set_(storage, offset, p.shape)
                u.device_params.append(nn.Parameter(data, requires_grad=p.requires_grad))
            u.device_flat.untyped_storage().resize_(0)
        device_param: dict[int, nn.Parameter] = {}
        for v in owner_of.values():
            for p, dp in zip(v.owned, v.device_params):
                device_param[id(p)] = dp
        for u, spec in zip(units, specs):
            for module, name in spec.slots:
                host = module._parameters[name]
                u.slots.append((module, name, host, device_param[id(host)]))
                owner = owner_of[id(host)]
                if owner is not u and owner not in u.other_deps:
                    u.other_deps.append(owner)
            if not u.rest:  # counted also when loaded whole
                u.expert_slices = find_expert_slices(
                    u.modules,
                    u.owned,
                    u.offsets,
                    u.num_kept,
                    u.kept_numel,
                    spec.slots,
                )

    def set_capacity(self, window_bytes: int) -> None:
        """The plan's window: bytes of device storage that non-resident units may hold."""
        self._capacity = window_bytes

    def load_resident(self, u: Unit) -> None:
        """Allocate resident ``u`` for good and start its first copy."""
        with self._lock:
            self._allocate(u)
            self._issue_h2d(u)

    @property
    def used_bytes(self) -> int:
        """Device bytes that non-resident units hold now."""
        return self._used

    # ------------------------------------------------------------------ storage

    def _allocate(self, u: Unit) -> None:
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
            self._used += u.nbytes
            self._lru[u] = None

    def _evict(self, u: Unit) -> None:
        """Free ``u``'s device storage (lock held). See [Note: the window is real memory]."""
        assert u.pins == 0 and not u.resident and u.allocated
        for event in u.idle_events:
            event.synchronize()
        u.idle_events = []
        u.used_streams.clear()
        if u.frozen is not None and u.h2d_event is not None:
            # the dequantize wrote this storage on another stream, perhaps never read since:
            # its next owner on the H2D stream waits for it (see ramflow.transfer.streams)
            self.streams.h2d_stream.wait_event(u.h2d_event)
        u.device_flat.untyped_storage().resize_(0)
        u.allocated = False
        u.device_version = -1
        # a prefetched unit whose load waited for its optimizer step: the worker's
        # ``wire_refreshed`` must not copy into the storage just freed (the next request
        # allocates and loads it again)
        u.load_requested = False
        self._used -= u.nbytes
        self._lru.pop(u, None)

    def _make_room(self, u: Unit, protect: Iterable[Unit] = ()) -> bool:
        """Evict least recently used unpinned units until ``u`` fits (lock held; released
        while it waits for the GPU to finish with a victim, see ``_wait_unlocked``)."""
        keep = set(protect)
        keep.add(u)
        while self._used + u.nbytes > self._capacity:
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
        """Wait for ``events`` with the lock released (held once by the caller).

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

    def free_all(self, units: list[Unit]) -> None:
        """Free the device storage of every unit, resident ones included (``remove``)."""
        with self._lock:
            for u in units:
                u.pins = u.backward_pins = 0
                if u.allocated and u.resident:  # let _evict account for it like a window unit
                    u.resident = False
                    self._used += u.nbytes
                if u.allocated:
                    self._evict(u)
            self._staging.free()

    # ------------------------------------------------------------------ copies

    def _issue_h2d(self, u: Unit) -> None:
        """Copy ``u``'s wire buffer into its device storage (lock held, storage allocated),
        and its compressed weights, dequantized there (see [Note: compressed frozen
        weights] in ``ramflow.formats.frozen``).

        Overwriting a copy that is still on the device (a resident unit after its step, a
        stale cached one) waits for the streams that read it, so queued kernels never see
        half-new weights."""
        if u.device_version != -1:
            for stream in u.used_streams:
                self.streams.h2d_stream.wait_stream(stream)
        k = u.kept_numel
        self.num_loads[u.name] += 1
        slices = u.expert_slices
        if slices is not None and self._slices_experts(u):
            # See [Note: experts loaded by the router] in ramflow.engine.expert_loading
            event = None
            if self.poison_unloaded_experts:
                self._poison(u)  # before the copies: their event covers it
            for lo, hi in slices.rest:
                event = self.streams.h2d(u.device_alias[lo:hi], u.wire[lo:hi])
                self.bytes_loaded += (hi - lo) * u.wire.element_size()
            slices.forget()
        else:
            event = self.streams.h2d(u.device_alias[:k], u.wire) if k else None
            self.bytes_loaded += k * u.wire.element_size()
            if slices is not None:
                for g in slices.groups:
                    g.loaded.update(range(g.num_experts))
                    slices.expert_elements_loaded += g.num_experts * g.expert_numel()
        if u.frozen is not None:
            self.bytes_loaded += u.frozen.host.numel() * u.frozen.host.element_size()
            # on the stream that waited for the H2D stream: this event also stands for the
            # kept elements' copy
            event = self.streams.h2d_then(
                u.frozen.host,
                lambda src: u.frozen.dequantize(src, u.device_alias[k:]),
                self._staging,
            )
        u.h2d_event = event
        u.load_follows_collective = False
        u.wire_read_event = event
        u.device_version = u.host_version
        u.load_requested = False
        u.h2d_issued.set()

    def _slices_experts(self, u: Unit) -> bool:
        """Whether a load of ``u`` leaves its experts to ``load_experts``: not for a unit
        kept on the device (its copy serves every later call, and a step on the device
        reads and writes back every expert), nor, where an experts module is trained, for
        a load issued under grad, in backward or by the host worker (a training pass needs
        every expert: loading them with the unit keeps them prefetched)."""
        if not self.routed_experts or u.resident or u.device_stepped:
            return False
        if all(not g.trainable for g in u.expert_slices.groups):
            return True
        in_backward = torch._C._current_graph_task_id() != -1
        return not torch.is_grad_enabled() and not in_backward

    def _poison(self, u: Unit) -> None:
        """Fill the experts of ``u``'s device copy with NaN (tests; lock held)."""
        stream = self.streams.h2d_stream if self.streams.is_cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for g in u.expert_slices.groups:
                for lo, hi in g.runs(list(range(g.num_experts))):
                    u.device_alias[lo:hi].fill_(float("nan"))

    def load_experts(self, u: Unit, group: ExpertGroup, experts: list[int] | None) -> None:
        """Copy the slices of ``experts`` (sorted expert ids of ``group``; None: all) that
        ``u``'s device copy lacks, and make the calling thread's stream wait for them.
        ``u`` is pinned (its load issued). See [Note: experts loaded by the router] in
        ``ramflow.engine.expert_loading``."""
        with self._lock:
            assert u.pins > 0 and u.allocated
            wanted = range(group.num_experts) if experts is None else experts
            missing = sorted(set(wanted) - group.loaded)
            if missing:
                slices = u.expert_slices
                event = None
                for lo, hi in group.runs(missing):
                    event = self.streams.h2d(u.device_alias[lo:hi], u.wire[lo:hi])
                    slices.expert_elements_loaded += hi - lo
                    self.bytes_loaded += (hi - lo) * u.wire.element_size()
                group.loaded.update(missing)
                group.event = event
                if event is not None:
                    u.wire_read_event = event  # a later step's host write waits for it
        stream = self.streams.compute_stream()
        if stream is not None and group.event is not None:
            stream.wait_event(group.event)  # See [Note: copies and events]

    def send_piece(self, u: Unit, lo: int, hi: int) -> None:
        """Worker: copy the wire range ``[lo, hi)`` that the step has just written to the
        device copy of resident ``u`` (the first piece waits for the copy's readers).

        No lock: a resident unit is never evicted, and nobody else issues its copy or reads
        it until ``wire_refreshed`` sets ``h2d_issued``. See [Note: the refresh follows the
        step] in ``ramflow.engine.stepper``."""
        if lo == 0:
            for stream in list(u.used_streams):
                self.streams.h2d_stream.wait_stream(stream)
        u.wire_read_event = self.streams.h2d(u.device_alias[lo:hi], u.wire[lo:hi])

    def begin_host_write(self, units: Iterable[Unit]) -> None:
        """The host copies of ``units`` are about to change (a step here or on another
        rank): their next use waits until ``wire_refreshed``."""
        with self._lock:
            for u in units:
                u.host_version += 1
                u.wire_ready.clear()

    def wire_refreshed(self, u: Unit, *, sent: bool) -> None:
        """Worker: ``u``'s wire copy is current again; issue a load that waits for it, or
        the refresh of a resident unit. ``sent``: the step already copied it to the device
        in pieces (``send_piece``), the last piece's event stands for the load."""
        with self._lock:
            u.wire_ready.set()
            if sent:
                u.h2d_event = u.wire_read_event
                u.load_follows_collective = False
                u.device_version = u.host_version
                u.load_requested = False
                u.h2d_issued.set()
            elif u.allocated and (u.load_requested or u.resident):
                self._issue_h2d(u)

    def received(self, u: Unit, event: torch.cuda.Event | None) -> None:
        """Worker: resident ``u``'s device copy was just written by another rank (its
        owner's broadcast, see [Note: refresh by broadcast] in ``ramflow.distributed.zero``), and its
        wire copy is current; ``event`` marks the copy's end on the device (None on the
        CPU, where it has ended). Its next use polls ``event`` on the host, then waits for
        it as for a load (see [Note: the step's sync] in ``ramflow.distributed.zero``)."""
        with self._lock:
            u.wire_ready.set()
            u.h2d_event = event
            u.load_follows_collective = event is not None
            u.device_version = u.host_version
            u.load_requested = False
            u.h2d_issued.set()

    def one_version_behind(self, u: Unit) -> bool:
        """Whether ``u``'s device copy lacks exactly the step that is running now (so only
        its trainable prefix needs a copy after it)."""
        with self._lock:
            return u.allocated and u.device_version == u.host_version - 1

    def _request(self, u: Unit, *, must: bool, protect: Iterable[Unit] = ()) -> bool:
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

    # ------------------------------------------------------------------ pins

    def acquire(self, units: list[Unit], *, backward: bool = False) -> None:
        """Pin ``units`` and make the compute stream wait for their copies; on an error
        (out of memory, a failed optimizer step) the pins taken so far are given back."""
        pinned: list[Unit] = []
        try:
            with self._lock:
                for u in units:
                    self._request(u, must=True)
                    u.pins += 1
                    if backward:
                        u.backward_pins += 1
                    pinned.append(u)
            stream = self.streams.compute_stream()
            start = time.perf_counter()
            for u in units:
                while not u.h2d_issued.wait(timeout=1.0):
                    self.worker.raise_error()
                if stream is not None:
                    if u.h2d_event is not None:
                        if u.load_follows_collective:
                            self._poll_collective(u.h2d_event)
                        stream.wait_event(u.h2d_event)  # See [Note: copies and events]
                    if u.device_step_event is not None:  # a step on a stream of its own
                        stream.wait_event(u.device_step_event)
                    u.used_streams.add(stream)
            self.wait_seconds.add("units not current", start)
        except BaseException:
            self.release(pinned, backward=backward)
            raise

    def _poll_collective(self, event: torch.cuda.Event) -> None:
        """Wait on the host for ``event``, which follows a collective, raising the worker's
        error meanwhile (its own waits check whether a rank has died; see [Note: the step's
        sync] in ``ramflow.distributed.zero``)."""
        while not event.query():
            self.worker.raise_error()
            time.sleep(_POLL_S)

    def release(self, units: list[Unit], *, backward: bool = False) -> None:
        """Give back one pin of each of ``units``; the last pin records when the GPU is
        done with the unit (``_evict`` waits for it)."""
        with self._lock:
            for u in units:
                u.pins -= 1
                if backward:
                    u.backward_pins -= 1
                assert u.pins >= 0 and u.backward_pins >= 0
                if u.pins == 0 and u.used_streams:
                    u.idle_events = [record_event(s) for s in u.used_streams]

    def prefetch(self, units: list[Unit]) -> None:
        """Start loading ``units`` in order while they fit without evicting a pinned unit
        or one of themselves (a wrong guess costs bandwidth, never correctness)."""
        with self._lock:
            for u in units:
                if u.resident:
                    continue
                if not self._request(u, must=False, protect=units):
                    break
