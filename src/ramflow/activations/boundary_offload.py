"""Activation offload: the inputs that checkpointed blocks keep go to pinned host memory.

Activation checkpointing keeps one tensor per checkpointed block on the device: its input
(the block's *boundary*), which non-reentrant ``torch.utils.checkpoint`` saves for the
recomputation. At long sequence lengths those boundaries are what is left of the
activations (a Llama 3.1 8B layer's input at 131072 tokens is 1 GiB in bf16, 32 GiB over
its 32 layers). ``BoundaryOffloader`` moves them to pinned host memory in forward and
brings each back, one block ahead, in backward: the technique of ZeRO-Offload's and
ZeRO-Infinity's activation checkpoint offload (Rajbhandari et al., 2021, "ZeRO-Infinity:
Breaking the GPU Memory Wall for Extreme Scale Deep Learning", section 5) and of
``torch.autograd.graph.save_on_cpu``, with the copies on side streams.

[Note: offloaded checkpoint boundaries]
Non-reentrant ``torch.utils.checkpoint`` saves a block's positional tensor inputs before it
pushes its own saved-tensor hooks (``_CheckpointFrame.save_inputs``), so the hooks around
the ``checkpoint(...)`` call (``saved_tensors_hooks(pack, unpack)``, PyTorch's mechanism)
see exactly the boundary, and nothing the block saves inside (those become the
checkpoint's placeholders). Keyword tensors (a Hugging Face layer's rotary tables and mask,
shared by every layer) stay with the checkpoint and on the device.

- pack (forward): a pinned host buffer of the tensor's size, a D2H copy on the D2H stream
  after an event recorded on the producing stream, an event recorded after the copy; the
  source is ``record_stream``-ed for the D2H stream so its memory is not handed out while
  the copy reads it. Once the forward drops its own references, the device memory is free.
- unpack (the block's recomputation in backward): the boundary's H2D copy, issued earlier by
  a prefetch or now, on the H2D stream, which first waits for the D2H event (the host buffer
  is complete); the compute stream waits for the H2D event and the device copy is
  ``record_stream``-ed for it. Then the boundaries of the ``prefetch`` blocks packed before
  this one (the next ones backward recomputes) are requested, so their H2D overlaps this
  block's recomputation and backward, as the weights are prefetched.
- The host buffers live as long as autograd keeps the packed value (until the graph is
  freed); PyTorch's caching host allocator does not reuse a pinned block until the
  non-blocking copies that used it are done (it records an event on their stream), so a
  buffer is never rewritten while a DMA reads it. The device copy is handed to autograd and
  not kept: a second backward through a retained graph copies it again.
On the CPU there are no streams: the copies are synchronous and the events are None, and
the same code runs (host buffers are not pinned, since nothing would read them by DMA), so
the CPU tests exercise the bookkeeping and bit-for-bit parity.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ..transfer.streams import CopyStreams, record_event

__all__ = ["BoundaryOffloader", "OffloadStats"]


class OffloadStats(NamedTuple):
    """What a ``BoundaryOffloader`` did since it was made.

    Attributes:
        num_packed: boundaries sent to host memory (forward).
        packed_bytes: their bytes, summed.
        num_prefetched: boundaries whose H2D copy was issued before their block needed them.
        num_fetched_late: boundaries whose H2D copy was issued only when their block needed
            them (the first block of each backward, or a prefetch that missed).
    """

    num_packed: int
    packed_bytes: int
    num_prefetched: int
    num_fetched_late: int


class _Boundary:
    """One saved boundary: its host copy, the D2H event, and once requested its device copy
    with the H2D event. ``previous`` is the boundary packed just before it (weakly)."""

    __slots__ = (
        "device",
        "host",
        "d2h_event",
        "device_copy",
        "h2d_event",
        "prefetched",
        "previous",
        "__weakref__",
    )

    def __init__(self, device: torch.device, host: torch.Tensor, d2h_event: Any) -> None:
        self.device = device
        self.host = host
        self.d2h_event = d2h_event
        self.device_copy: torch.Tensor | None = None
        self.h2d_event: Any = None
        self.prefetched = False
        self.previous: weakref.ref[_Boundary] | None = None


class BoundaryOffloader:
    """Saved-tensor hooks that keep checkpointed blocks' inputs in host memory and prefetch
    them back in backward. See [Note: offloaded checkpoint boundaries].

    Use ``with offloader.saving(): checkpoint(fn, *args, use_reentrant=False)``: the
    positional tensor arguments (any device, any dtype) are copied to host memory (pinned
    for a CUDA tensor) and the device copies can be freed; in backward each comes back to
    its device with the same shape, dtype and values (contiguous strides).

    Args:
        prefetch: how many blocks' boundaries, beyond the one being recomputed, to copy
            back ahead of their recomputation; at least 1. Each costs one boundary of
            device memory during backward.

    Attributes:
        enabled: while False, ``saving()`` installs no hooks: the blocks are checkpointed
            as without offload, their inputs kept on the device (for a run that offloads
            only its long sequences, or a benchmark that compares both in one process).
            Default True. A graph built while it was True still unpacks through the
            offloader.

    Raises:
        ValueError: ``prefetch`` is not an int >= 1.
    """

    def __init__(self, *, prefetch: int = 1) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ValueError(f"BoundaryOffloader: prefetch must be an int >= 1, got {prefetch!r}")
        self.prefetch = prefetch
        self.enabled = True
        self._streams: dict[torch.device, CopyStreams] = {}
        # the boundary packed last on each thread: the chain backward walks to prefetch
        self._local = threading.local()
        self._num_packed = 0
        self._packed_bytes = 0
        self._num_prefetched = 0
        self._num_late = 0

    @property
    def stats(self) -> OffloadStats:
        """Counts since this offloader was made (see ``OffloadStats``)."""
        return OffloadStats(
            self._num_packed, self._packed_bytes, self._num_prefetched, self._num_late
        )

    def saving(self) -> contextlib.AbstractContextManager:
        """The context under which a ``checkpoint(...)`` call's inputs are offloaded (none
        while ``enabled`` is False)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook on its own, for a caller that chooses which saved tensors go to
        host memory (``engine.unit_major``): returns what ``unpack`` takes back (an empty
        tensor as it is)."""
        return self._pack(tensor)

    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook on its own: the device copy of what ``pack`` returned."""
        return self._unpack(packed)

    def _copy_streams(self, device: torch.device) -> CopyStreams:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = CopyStreams(device)
        return streams

    def _pack(self, tensor: torch.Tensor) -> _Boundary | torch.Tensor:
        if tensor.numel() == 0:
            # nothing to move: torch 2.11's non-reentrant checkpoint also saves an empty
            # placeholder beside each call's inputs (seen on the GPU box: 12 packs for 6
            # blocks); it stays as it is and is not counted as a boundary
            return tensor
        streams = self._copy_streams(tensor.device)
        source = tensor.detach()
        if not source.is_contiguous():
            source = source.contiguous()  # a dense host buffer; values are unchanged
        host = torch.empty(
            source.shape, dtype=source.dtype, device="cpu", pin_memory=streams.is_cuda
        )
        event = streams.d2h(host, source)  # See [Note: offloaded checkpoint boundaries]
        boundary = _Boundary(tensor.device, host, event)
        last = getattr(self._local, "last", None)
        boundary.previous = last
        self._local.last = weakref.ref(boundary)
        self._num_packed += 1
        self._packed_bytes += host.numel() * host.element_size()
        return boundary

    def _request(self, boundary: _Boundary) -> None:
        """Issue ``boundary``'s H2D copy unless it is already under way."""
        if boundary.device_copy is not None:
            return
        streams = self._copy_streams(boundary.device)
        host = boundary.host
        if not streams.is_cuda:
            boundary.device_copy = host.clone()
            return
        stream = streams.h2d_stream
        with torch.cuda.stream(stream), torch.profiler.record_function("ramflow.boundary_h2d"):
            stream.wait_event(boundary.d2h_event)  # the host buffer is complete
            device_copy = torch.empty(host.shape, dtype=host.dtype, device=boundary.device)
            device_copy.copy_(host, non_blocking=True)
            boundary.h2d_event = record_event(stream)
        boundary.device_copy = device_copy

    def _unpack(self, boundary: _Boundary | torch.Tensor) -> torch.Tensor:
        if isinstance(boundary, torch.Tensor):  # an empty tensor, kept by _pack
            return boundary
        if boundary.device_copy is None:
            self._num_late += 1
            self._request(boundary)
        elif boundary.prefetched:
            self._num_prefetched += 1
        boundary.prefetched = False
        device_copy, boundary.device_copy = boundary.device_copy, None
        assert device_copy is not None
        if boundary.h2d_event is not None:
            compute = torch.cuda.current_stream(boundary.device)
            compute.wait_event(boundary.h2d_event)
            device_copy.record_stream(compute)
        # the next blocks backward recomputes: See [Note: offloaded checkpoint boundaries]
        ahead = boundary.previous
        for _ in range(self.prefetch):
            nxt = ahead() if ahead is not None else None
            if nxt is None:
                break
            if nxt.device_copy is None:
                self._request(nxt)
                nxt.prefetched = True
            ahead = nxt.previous
        return device_copy
