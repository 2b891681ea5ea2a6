"""The host store: each unit's master, its wire copy and its gradient staging buffer.

Owns the host RAM check, the buffers' layout (``units.unit.ALIGN``), page-locking (pinned
allocation, or pinning a buffer a layer or another rank gave), the host formats
(``HostPrecision``: an fp32 master beside its wire copy, or a bf16 master that is the wire
copy; staging per unit, or a ring of a few staging buffers the units in flight borrow), and
rewriting the wire copy from the master after a step; the H2D copy that follows is the
window's.

[Note: the gradient ring]
With ``gradients="ring"`` a unit holds a staging buffer only from its gradients' D2H copy
until the host has read them (its fused step, or their landing in a full host gradient):
``RING_BUFFERS`` buffers of the largest unit's size, pinned once, taken in ``dispatch`` and
given back by the worker. A backward pass that runs ahead of the CPU optimizer waits for a
free buffer (the next forward waits for those steps anyway). So the host gradients cost a
fixed few units, not the model: the full host gradient buffer is made only for a step that
needs it (the first, gradient accumulation, clipping) and dropped once units are stepped
during backward.

[Note: filling the host store]
A unit's master (and a separate wire copy) is an anonymous mapping of its own pages
(``transfer.streams.map_host``): zeros that cost nothing until written, so the padding between
parameters is zero without a pass over the buffer, and the pages are faulted in by whoever
writes them first. That is the fill: ``MetaLoader.fill`` reads files in parallel threads
straight into the views, a seeded init draws in threads. Only then is the buffer
page-locked (``cudaHostRegister``), on a thread of its own while the next unit fills:
locking pages that are already there only pins them, while locking first made the driver
fault and zero every page on one thread, and a ``zero_()`` and the fill wrote them twice
more (a 12B model loaded in 107 s, 0.2 GB/s of bf16 weights). No DMA reads a unit before
``build`` returns, which waits for every lock.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable

import psutil
import torch

from ..choices import AUTO, HOST_PRECISION_PRESETS
from ..formats.frozen import FrozenStore, give_back, meta_stand_in
from ..formats.host import RING_BUFFERS, HostPrecision
from ..sizes import format_bytes, parse_bytes
from ..transfer.streams import alloc_host, alloc_pinned, map_host, pin_in_place, unpin
from ..units.unit import Unit
from .window import DeviceWindow

# writes a unit's parameter values into their views of its new master (``HostStore.build``)
FillMaster = Callable[[list[torch.nn.Parameter], list[torch.Tensor]], None]
# a checkpoint's packed MXFP4 pair (blocks, scales) of a parameter, or None where it holds
# the values (``MetaLoader.packed``; see [Note: packed MXFP4 tensors in a checkpoint])
PackedSource = Callable[[torch.nn.Parameter], "tuple[torch.Tensor, torch.Tensor] | None"]


HOST_RAM_ENV = "RAMFLOW_HOST_RAM"


def host_ram_available() -> int:
    """Bytes of host RAM ramflow may count on: ``$RAMFLOW_HOST_RAM`` when set (a size such
    as ``"240GiB"``), else what the kernel calls available (``MemAvailable``, by psutil).

    The override is for machines whose ``MemTotal`` understates what they can hold: a VM
    whose memory is hot-plugged or ballooned as it is used (seen on Firecracker guests that
    report 31 of 256 GiB at boot) would otherwise be refused a store that fits.

    Raises:
        ValueError: ``$RAMFLOW_HOST_RAM`` is set but not a size (names the variable).
    """
    value = os.environ.get(HOST_RAM_ENV, "").strip()
    if value:
        return parse_bytes(value, what=HOST_RAM_ENV)
    return psutil.virtual_memory().available


def store_bytes(units: list[Unit], precision: HostPrecision, wire_dtype: torch.dtype) -> int:
    """Host bytes of ``units``' masters, wire copies and gradients under ``precision`` with
    a wire of ``wire_dtype`` (``HostPrecision.host_bytes``, the one byte model); the
    optimizer's states are not counted (see ``optimizer_state_bytes``). Buffers a layer or
    another rank gave are not new.

    Args:
        units: the engine's units.
        precision: their host formats.
        wire_dtype: the device copies' dtype.

    Returns:
        Bytes of host RAM.
    """
    return precision.host_bytes(units, wire_dtype).store


def optimizer_state_bytes(units: list[Unit], precision: HostPrecision) -> int:
    """Host bytes of AdamW's states (and a Kahan master's compensation).

    Args:
        units: the engine's units.
        precision: their host formats.

    Returns:
        Bytes of host RAM.
    """
    return precision.host_bytes(units, torch.float32).states


# ``auto`` keeps fp32 masters when the store and AdamW's states take at most this share of
# the available RAM (the rest is the loop's: data, activations' host side, the OS cache)
AUTO_FP32_SHARE = 0.75


def choose_precision(
    units: list[Unit],
    wire_dtype: torch.dtype | None,
    available: int,
    *,
    default_wire: torch.dtype = torch.bfloat16,
) -> tuple[HostPrecision, str]:
    """``host_precision="auto"``: fp32 where the store and AdamW's states fit in
    ``AUTO_FP32_SHARE`` of ``available`` bytes, else the leanest (``lean``) where it fits
    (it needs a bf16 wire). ``wire_dtype`` None: each candidate's wire follows its master
    (``HostPrecision.wire_for``, ``default_wire`` for fp32 masters).

    Args:
        units: the units to keep (their trainable and frozen parameter counts size the
            store and AdamW's states).
        wire_dtype: the wire dtype the user asked for, or None (it follows the master).
        available: host RAM that may be used, in bytes.
        default_wire: the wire of fp32 masters when ``wire_dtype`` is None.

    Returns:
        (policy, why): ``HostPrecision.fp32()`` or ``HostPrecision.lean()``, and one
        sentence with the sizes that decided it, for the log.

    Raises:
        MemoryError: not even the leanest fits; the message gives each preset's size.
    """
    sizes = {}
    for name in ("fp32", "lean"):
        pr = HostPrecision.parse(name)
        wire = pr.wire_for(wire_dtype, default=default_wire)
        sizes[name] = store_bytes(units, pr, wire) + optimizer_state_bytes(units, pr)
    if sizes["fp32"] <= AUTO_FP32_SHARE * available:
        return HostPrecision.fp32(), (
            f"fp32: the store and AdamW's states ({format_bytes(sizes['fp32'])}) fit in "
            f"{AUTO_FP32_SHARE:.0%} of the available {format_bytes(available)}"
        )
    lean_wire = HostPrecision.lean().wire_for(wire_dtype, default=default_wire)
    if lean_wire == torch.bfloat16 and sizes["lean"] <= available:
        return HostPrecision.lean(), (
            f"lean: fp32 would need {format_bytes(sizes['fp32'])} of the available "
            f"{format_bytes(available)}; lean needs {format_bytes(sizes['lean'])}"
        )
    raise MemoryError(
        f"no host_precision fits: fp32 needs about {format_bytes(sizes['fp32'])} and lean "
        f"about {format_bytes(sizes['lean'])} (with AdamW's states"
        + ("" if lean_wire == torch.bfloat16 else "; lean needs wire_dtype=torch.bfloat16")
        + f"), but only {format_bytes(available)} of host RAM is available. Free memory, "
        "freeze parameters you do not train, or use a smaller model."
    )


def resolve_precision(
    host_precision: HostPrecision | str | None,
    units: Callable[[], list[Unit]],
    *,
    wire_dtype: torch.dtype | None,
    default_wire: torch.dtype,
    available: int | None = None,
) -> tuple[HostPrecision, torch.dtype, str | None]:
    """The policy and the wire dtype of a run from what the user gave: the one place
    where ``"auto"`` is decided (``choose_precision`` over ``units()``, made only then, on
    ``available`` bytes, default this machine's available RAM) and where the wire follows
    the master when ``wire_dtype`` is None (``HostPrecision.wire_for``).

    Args:
        host_precision: a ``HostPrecision``, a preset's name, ``"auto"``, or None (fp32).
        units: makes the units to size (called only for ``"auto"``).
        wire_dtype: the wire dtype the user asked for, or None (it follows the master).
        default_wire: the wire of fp32 masters when ``wire_dtype`` is None.
        available: host RAM ``"auto"`` may use, in bytes; None: this machine's available
            RAM now (``host_ram_available``).

    Returns:
        (policy, wire dtype, why): the host formats, the dtype of the device copies, and
        the sentence saying why ``"auto"`` chose the policy (None when it was given).

    Raises:
        ValueError: an unknown preset, or masters that cannot serve ``wire_dtype``
            (``HostPrecision.check_wire``).
        TypeError: ``host_precision`` is neither a policy nor a string.
        MemoryError: ``"auto"`` and not even the leanest fits.
    """
    reason = None
    if isinstance(host_precision, str) and host_precision == AUTO:
        if available is None:
            available = host_ram_available()
        precision, reason = choose_precision(
            units(), wire_dtype, available, default_wire=default_wire
        )
    else:
        precision = HostPrecision.parse(host_precision)
    wire = precision.wire_for(wire_dtype, default=default_wire)
    precision.check_wire(wire)
    return precision, wire, reason


class HostStore:
    """The host buffers of one engine's units.

    Args:
        device: the compute device (buffers are pinned when it is a GPU).
        wire_dtype: dtype of the wire copies and gradient staging buffers.
        window: the device window, told when a wire copy is current again.
        precision: the host formats (default ``HostPrecision.fp32()``); its master must go
            with ``wire_dtype`` (``HostPrecision.check_wire``).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        wire_dtype: torch.dtype,
        window: DeviceWindow,
        precision: HostPrecision | None = None,
    ) -> None:
        self.device = device
        self.wire_dtype = wire_dtype
        self.precision = HostPrecision.fp32() if precision is None else precision
        self.precision.check_wire(wire_dtype)
        self._window = window
        self._pin = device.type == "cuda"
        # the gradient ring: free staging buffers, and the size they are made at
        self._ring_free: list[torch.Tensor] = []
        self._ring_made = 0
        self._ring_numel = 0
        self._ring_lent: dict[Unit, torch.Tensor] = {}
        self._ring_cond = threading.Condition()
        # buffers page-locked in place (given by a layer or shared by ranks): unpinned by
        # ``unpin_all`` or the engine's finalizer, which holds this list, not the store
        self.pinned_in_place: list[torch.Tensor] = []

    def store_bytes(self, units: list[Unit], precision: HostPrecision | None = None) -> int:
        """Host bytes of ``units``' store under ``precision`` (default: this store's); see
        the module-level ``store_bytes``."""
        pr = self.precision if precision is None else precision
        return store_bytes(units, pr, self.wire_dtype)

    def check_memory(self, units: list[Unit]) -> None:
        """Raise MemoryError if the host store of ``units`` does not fit in available RAM.

        The store (masters, wire copies, gradients) must fit; the message gives what each
        preset would need with AdamW's states too, so the user can pick one that fits."""
        need = self.store_bytes(units)
        avail = host_ram_available()
        if need > avail:
            sizes = []
            for name in HOST_PRECISION_PRESETS:
                pr = HostPrecision.parse(name)
                try:
                    pr.check_wire(self.wire_dtype)
                except ValueError:
                    continue
                total = self.store_bytes(units, pr) + optimizer_state_bytes(units, pr)
                sizes.append(f"{name} {format_bytes(total)}")
            raise MemoryError(
                f"ramflow needs about {format_bytes(need)} of host RAM for this model's host "
                f"store ({self.precision.spelled}: master weights, wire copies, "
                f"gradients) but only {format_bytes(avail)} is available. With AdamW's states, "
                f"each host_precision needs about: {', '.join(sizes)}. Pick one that fits "
                "(ramflow.offload(..., host_precision=...)), free memory, freeze parameters "
                "you do not train (requires_grad=False), or use a smaller model. On a VM "
                f"whose RAM grows as it is used, set {HOST_RAM_ENV} (e.g. '240GiB')."
            )

    def build(
        self,
        units: list[Unit],
        *,
        fill: FillMaster | None = None,
        packed: PackedSource | None = None,
    ) -> None:
        """Make the masters and wire copies of new ``units``, one unit at a time; their host
        parameters become views into the masters.

        ``fill(params, views)``: writes the values of a unit's parameters (its ``owned``, in
        order) into their views of the new master; None copies each parameter's own data.
        A model built on the meta device is loaded through it unit by unit, so the host
        never holds more than the store plus one unit's source tensors. ``packed(p)``:
        the checkpoint's packed MXFP4 pair of a compressed parameter, which its frozen store
        takes as it is (``FrozenStore.write_mxfp4``), or None: ``fill`` gives its values."""
        pin = self._pin
        lean_master = self.precision.master_is_wire
        # a given master in the master's dtype is zero_stage's shared host store (made for
        # this format by ``ramflow.distributed.zero.shared_host_store``); ``ramflow.Linear`` gives fp32
        if lean_master and any(
            (u.given_master is not None and u.given_master.dtype != self.precision.master_dtype)
            or u.given_wire is not None
            for u in units
        ):
            raise ValueError(
                f"{self.precision.spelled} keeps bf16 master weights, which "
                "ramflow.Linear layers do not support yet; use host_precision='fp32' with them"
            )
        # the master is the wire copy (a bf16 master, or fp32 with an fp32 wire)
        serves_wire = self.precision.master_format.wire_copy_bytes(self.wire_dtype) == 0
        if self.precision.gradient_format.ring:
            self._ring_numel = max(
                [self._ring_numel, *(u.trainable_numel for u in units)], default=0
            )
        # locks pages filled already, while the next unit fills: see [Note: filling the host store]
        locker = concurrent.futures.ThreadPoolExecutor(1) if pin else None
        locks: list[concurrent.futures.Future] = []
        try:
            for u in units:
                self._build_unit(
                    u, fill, packed, serves_wire=serves_wire, locker=locker, locks=locks
                )
        finally:
            if locker is not None:
                locker.shutdown(wait=True)
        for lock in locks:
            lock.result()  # raises the first MemoryError of the driver

    def _build_unit(
        self,
        u: Unit,
        fill: FillMaster | None,
        packed: PackedSource | None,
        *,
        serves_wire: bool,
        locker: concurrent.futures.ThreadPoolExecutor | None,
        locks: list[concurrent.futures.Future],
    ) -> None:
        """``build`` for one unit; its new buffers are page-locked by ``locker`` (None: not
        pinned) once written, the futures appended to ``locks``."""

        def lock_later(t: torch.Tensor, what: str) -> None:
            if locker is not None:
                locks.append(locker.submit(self._pin_written, t, what))

        assert not u.compressed or (u.given_master is None and u.given_wire is None), (
            "offload refuses frozen_format with given host buffers"
        )
        pin = self._pin
        u.precision = self.precision
        u.rounding_seed = self.precision.unit_seed(u.index)
        if u.given_master is not None:
            # The layer (or the shared host store) laid the parameters out as this engine
            # would (``ALIGN``): its buffer is the master, shared memory included.
            u.master = u.given_master
            assert u.master.dtype == self.precision.master_dtype
            assert all(
                p.data_ptr() == view.data_ptr() for p, view in zip(u.owned, u.views(u.master))
            ), "a given master must hold the unit's parameters at the engine's offsets"
            # a master that the device step writes back (under ZeRO, a unit this rank
            # steps on its device) is pinned too: see [Note: the device optimizer under
            # ZeRO] in ``ramflow.engine.stepper``
            write_back = u.device_stepped and u.owner is not None
            if pin and (serves_wire or write_back):
                pin_in_place(u.master, what=f"the master weights of {u.name!r}")
                self.pinned_in_place.append(u.master)
        else:
            what = f"the master weights of unit {u.name!r}"
            # zeros (the padding between views too) until the fill writes the views
            u.master = map_host(u.kept_numel, self.precision.master_dtype, what=what)
            kept = u.owned[: u.num_kept]
            views = u.views(u.master, kept_only=True)
            with torch.no_grad():
                if fill is None:
                    for view, p in zip(views, kept):
                        view.copy_(p.detach())
                else:
                    fill(kept, views)
                for view, p in zip(views, kept):
                    p.data = view
            if serves_wire:  # a master that is the wire copy is pinned, as a wire copy is
                lock_later(u.master, what)
            if u.compressed:
                self._build_compressed(u, fill, packed)
        if u.given_wire is not None:
            u.wire = u.given_wire
            if pin:
                pin_in_place(u.wire, what=f"the wire copy of {u.name!r}")
                self.pinned_in_place.append(u.wire)
        elif serves_wire:
            u.wire = u.master
        else:
            what = f"the wire copy of {u.name!r}"
            u.wire = map_host(u.kept_numel, self.wire_dtype, what=what)
            u.wire.copy_(u.master)
            lock_later(u.wire, what)

    def _pin_written(self, t: torch.Tensor, what: str) -> None:
        """Locker thread: page-lock ``t``, written already (see [Note: filling the host
        store]); ``unpin_all`` unlocks it."""
        pin_in_place(t, what=what)
        self.pinned_in_place.append(t)

    def _alloc(self, numel: int, dtype: torch.dtype, *, pin: bool, what: str) -> torch.Tensor:
        """A flat host buffer; ``pin``: page-locked over exactly its own pages, unlocked by
        ``unpin_all`` (see [Note: pinned memory of its own size] in ``ramflow.transfer.streams``)."""
        if not pin:
            return alloc_host(numel, dtype, pin=False, what=what)
        t = alloc_pinned(numel, dtype, what=what)
        self.pinned_in_place.append(t)
        return t

    def _build_compressed(
        self, u: Unit, fill: FillMaster | None, packed: PackedSource | None
    ) -> None:
        """Compress ``u``'s frozen matrices one at a time (from their data, from a
        checkpoint's packed MXFP4 pair, or read by ``fill`` into a buffer of one parameter)
        and make their host parameters meta stand-ins. See [Note: compressed frozen weights] in ``ramflow.formats.frozen``."""
        params = u.compressed
        u.frozen = FrozenStore(
            u.frozen_format,
            params,
            u.compressed_numels(),
            wire_dtype=self.wire_dtype,
            alloc=lambda nbytes: self._alloc(
                nbytes, torch.uint8, pin=self._pin, what=f"the compressed weights of {u.name!r}"
            ),
        )
        with torch.no_grad():
            for i, p in enumerate(params):
                pair = None if packed is None else packed(p)
                if pair is not None:
                    u.frozen.write_mxfp4(i, *pair)
                    del pair
                elif fill is None:
                    u.frozen.write(i, p.detach())
                else:
                    buf = torch.empty(p.shape, dtype=torch.float32)
                    fill([p], [buf])
                    u.frozen.write(i, buf)
                    del buf
                meta_stand_in(p, self.wire_dtype)

    def read_compressed(self, u: Unit, i: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``i``-th compressed parameter of ``u`` dequantized (a new CPU tensor in
        ``dtype``): the values its device copy computes with."""
        return u.frozen.read(i, dtype)

    def write_compressed(self, u: Unit, i: int, values: torch.Tensor) -> None:
        """Compress ``values`` into the ``i``-th compressed parameter of ``u``
        (``load_state_dict``); the caller marks the unit stale and refreshes it after.
        Values equal to its current dequantized ones keep its bytes (``FrozenStore.holds``:
        a model's own ``state_dict()`` loads back bit for bit)."""
        if u.frozen.holds(i, values):
            return
        self.before_host_write(u)
        u.frozen.write(i, values)

    def restore_compressed(self, u: Unit) -> None:
        """``undo``: the compressed parameters become ordinary CPU parameters again,
        dequantized, in their original dtypes."""
        for i, p in enumerate(u.compressed):
            give_back(p, u.frozen.read(i, u.orig_dtypes[u.num_kept + i]))

    def staging(self, u: Unit) -> torch.Tensor:
        """``u``'s gradient staging buffer (T,) in the wire dtype, pinned on a GPU. Per unit,
        made at its first use (frozen units never get one); with the gradient ring, taken
        from the ring (waiting for a free buffer) until ``release_staging``."""
        if u.staging is not None:
            return u.staging
        if self.precision.gradient_format.ring:
            with self._ring_cond:
                while not self._ring_free and self._ring_made >= RING_BUFFERS:
                    self._ring_cond.wait()
                if self._ring_free:
                    buf = self._ring_free.pop()
                else:
                    self._ring_made += 1
                    buf = self._alloc(
                        self._ring_numel,
                        self.wire_dtype,
                        pin=self._pin,
                        what="a staging buffer of the gradient ring",
                    )
                self._ring_lent[u] = buf
            u.staging = buf[: u.trainable_numel]
            return u.staging
        u.staging = self._alloc(
            u.trainable_numel,
            self.wire_dtype,
            pin=self._pin,
            what=f"the gradient staging buffer of {u.name!r}",
        )
        return u.staging

    def make_ring(self, num_buffers: int) -> None:
        """Make the gradient ring's buffers now, up to ``num_buffers`` (at most
        ``RING_BUFFERS``), rather than in the first backward: each is written first (zeros,
        by the intra-op threads, so its pages are faulted in in parallel) and then
        page-locked, as the store's buffers are (see [Note: filling the host store]); the
        first backward finds them free. Does nothing without the ring. See [Note: states
        made before the first step] in ``ramflow.optim.unit_states``."""
        if not self.precision.gradient_format.ring or not self._ring_numel:
            return
        with self._ring_cond:
            while self._ring_made < min(num_buffers, RING_BUFFERS):
                what = "a staging buffer of the gradient ring"
                buf = map_host(self._ring_numel, self.wire_dtype, what=what)
                buf.zero_()  # faults the pages in, in parallel, before they are locked
                if self._pin:
                    pin_in_place(buf, what=what)
                    self.pinned_in_place.append(buf)
                self._ring_made += 1
                self._ring_free.append(buf)
                self._ring_cond.notify()

    def host_gradients(self, u: Unit, *, pinned: bool) -> torch.Tensor:
        """A new flat host gradient buffer (T,) of ``u`` in the master dtype (PyTorch wants
        a gradient's dtype to be its parameter's). ``pinned`` (a unit stepped on the device,
        whose deferred steps upload it): page-locked, made once per unit and kept, so the
        upload is an asynchronous DMA at the PCIe rate rather than a synchronous copy
        through the driver's bounce buffers (a tenth of the rate on the GPU box)."""
        dtype = self.precision.master_dtype
        if not (pinned and self._pin):
            return torch.empty(u.trainable_numel, dtype=dtype)
        if u.pinned_host_grad is None or u.pinned_host_grad.numel() != u.trainable_numel:
            u.pinned_host_grad = self._alloc(
                u.trainable_numel, dtype, pin=True, what=f"the host gradients of {u.name!r}"
            )
        return u.pinned_host_grad

    def release_staging(self, u: Unit) -> None:
        """Worker or main thread: the host has read ``u``'s staged gradients; with the
        gradient ring its buffer goes back to the ring (a per-unit buffer stays)."""
        if not self.precision.gradient_format.ring or u.staging is None:
            return
        u.staging = None
        with self._ring_cond:
            self._ring_free.append(self._ring_lent.pop(u))
            self._ring_cond.notify()

    @staticmethod
    def wire_prefix(u: Unit) -> torch.Tensor | None:
        """The trainable prefix (T,) of ``u``'s wire copy, for a step that writes it, or
        None when the wire copy is the master."""
        return None if u.wire is u.master else u.wire[: u.trainable_numel]

    @staticmethod
    def before_host_write(u: Unit) -> None:
        """No host buffer is rewritten while a DMA reads it: wait for the unit's last H2D."""
        if u.wire_read_event is not None:
            u.wire_read_event.synchronize()

    def refresh_wire(
        self,
        u: Unit,
        *,
        written: bool = False,
        sent: bool = False,
        received: tuple[torch.cuda.Event | None] | None = None,
    ) -> None:
        """Worker: rewrite the wire copy from the master (unless the step already did) and
        tell the window, which re-issues any waiting load; ``sent``: the step already copied
        it to the device in pieces (``DeviceWindow.send_piece``); ``received``: ``(event,)``
        when the device copy came from the unit's owner instead (``DeviceWindow.received``)."""
        if u.wire is not u.master:
            if not written:
                self.before_host_write(u)
                u.wire.copy_(u.master)
        if received is not None:
            self._window.received(u, received[0])
        else:
            self._window.wire_refreshed(u, sent=sent)

    def unpin_all(self) -> None:
        """Unpin the buffers pinned in place (``remove``)."""
        for t in self.pinned_in_place:
            unpin(t)
        self.pinned_in_place.clear()
