"""The host store: each unit's fp32 master, its wire copy and its gradient staging buffer.

Owns the host RAM check, the buffers' layout (``_units._ALIGN``), page-locking (pinned
allocation, or pinning a buffer a layer or another rank gave), and rewriting the wire copy
from the master after a step; the H2D copy that follows is the window's.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from ._plan import format_bytes
from ._streams import alloc_host, pin_in_place, unpin
from ._units import _Unit
from ._window import DeviceWindow

# writes a unit's parameter values into their views of its new master (``HostStore.build``)
FillMaster = Callable[[list[torch.nn.Parameter], list[torch.Tensor]], None]


class HostStore:
    """The host buffers of one engine's units.

    Args:
        device: the compute device (buffers are pinned when it is a GPU).
        wire_dtype: dtype of the wire copies and gradient staging buffers.
        window: the device window, told when a wire copy is current again.
    """

    def __init__(
        self, *, device: torch.device, wire_dtype: torch.dtype, window: DeviceWindow
    ) -> None:
        self.device = device
        self.wire_dtype = wire_dtype
        self._window = window
        self._pin = device.type == "cuda"
        # buffers page-locked in place (given by a layer or shared by ranks): unpinned by
        # ``unpin_all`` or the engine's finalizer, which holds this list, not the store
        self.pinned_in_place: list[torch.Tensor] = []

    def check_memory(self, units: list[_Unit]) -> None:
        """Raise MemoryError if the host store of ``units`` does not fit in available RAM."""
        wire_size = torch.empty((), dtype=self.wire_dtype).element_size()
        need = 0
        for u in units:
            if u.given_master is not None:
                need -= u.numel * 4  # the layer's own buffer becomes the master
            need += u.numel * 4
            if self.wire_dtype != torch.float32:
                need += u.numel * wire_size
            need += u.trainable_numel * (4 + wire_size)  # host gradients + D2H staging
        avail = psutil.virtual_memory().available
        if need > avail:
            raise MemoryError(
                f"ramflow needs about {format_bytes(need)} of host RAM for this model "
                f"(fp32 master weights, wire copies, gradients) but only {format_bytes(avail)} "
                "is available. Free memory, freeze parameters you do not train "
                "(requires_grad=False), or use a smaller model."
            )

    def build(self, units: list[_Unit], *, fill: FillMaster | None = None) -> None:
        """Make the masters and wire copies of new ``units``, one unit at a time; their host
        parameters become views into the masters.

        ``fill(params, views)``: writes the values of a unit's parameters (its ``owned``, in
        order) into their views of the new master; None copies each parameter's own data.
        A model built on the meta device is loaded through it unit by unit, so the host
        never holds more than the store plus one unit's source tensors."""
        pin = self._pin
        for u in units:
            if u.given_master is not None:
                # The layer laid its parameters out as this engine would (``_ALIGN``): its
                # buffer is the master, shared memory included (``share_memory_()``).
                u.master = u.given_master
                assert all(
                    p.data_ptr() == view.data_ptr() for p, view in zip(u.owned, u.views(u.master))
                ), "a given master must hold the unit's parameters at the engine's offsets"
                if pin and self.wire_dtype == torch.float32:
                    pin_in_place(u.master, what=f"the master weights of {u.name!r}")
                    self.pinned_in_place.append(u.master)
            else:
                u.master = alloc_host(
                    u.numel,
                    torch.float32,
                    pin=pin and self.wire_dtype == torch.float32,
                    what=f"the master weights of unit {u.name!r}",
                )
                u.master.zero_()  # padding between views stays defined
                views = u.views(u.master)
                with torch.no_grad():
                    if fill is None:
                        for view, p in zip(views, u.owned):
                            view.copy_(p.detach())
                    else:
                        fill(u.owned, views)
                    for view, p in zip(views, u.owned):
                        p.data = view
            if u.given_wire is not None:
                u.wire = u.given_wire
                if pin:
                    pin_in_place(u.wire, what=f"the wire copy of {u.name!r}")
                    self.pinned_in_place.append(u.wire)
            elif self.wire_dtype == torch.float32:
                u.wire = u.master
            else:
                u.wire = alloc_host(
                    u.numel, self.wire_dtype, pin=pin, what=f"the wire copy of {u.name!r}"
                )
                u.wire.copy_(u.master)

    def staging(self, u: _Unit) -> torch.Tensor:
        """``u``'s gradient staging buffer (T,) in the wire dtype, pinned on a GPU; made at
        its first use (frozen units never get one)."""
        if u.staging is None:
            u.staging = alloc_host(
                u.trainable_numel,
                self.wire_dtype,
                pin=self._pin,
                what=f"the gradient staging buffer of {u.name!r}",
            )
        return u.staging

    @staticmethod
    def wire_prefix(u: _Unit) -> torch.Tensor | None:
        """The trainable prefix (T,) of ``u``'s wire copy, for a step that writes it, or
        None when the wire copy is the master."""
        return None if u.wire is u.master else u.wire[: u.trainable_numel]

    @staticmethod
    def before_host_write(u: _Unit) -> None:
        """No host buffer is rewritten while a DMA reads it: wait for the unit's last H2D."""
        if u.wire_read_event is not None:
            u.wire_read_event.synchronize()

    def refresh_wire(self, u: _Unit, *, written: bool = False, sent: bool = False) -> None:
        """Worker: rewrite the wire copy from the master (unless the step already did) and
        tell the window, which re-issues any waiting load; ``sent``: the step already copied
        it to the device in pieces (``DeviceWindow.send_piece``)."""
        if u.wire is not u.master:
            if not written:
                self.before_host_write(u)
                u.wire.copy_(u.master)
        self._window.wire_refreshed(u, sent=sent)

    def unpin_all(self) -> None:
        """Unpin the buffers pinned in place (``remove``)."""
        for t in self.pinned_in_place:
            unpin(t)
        self.pinned_in_place.clear()
