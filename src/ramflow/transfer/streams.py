"""Copy streams: one H2D and one D2H stream per device, and an event for every copy.

[Note: copies and events]
Every asynchronous copy records an event on its copy stream right after it is issued, and
its consumer waits on exactly that event: the compute stream with ``wait_event`` before it
reads the device copy, a host thread with ``event.synchronize()`` before it reads pinned
memory that a D2H copy wrote, or before it rewrites pinned memory that an H2D copy reads.
A D2H copy first makes its stream wait on an event recorded on the producing stream. On
the CPU there are no streams: copies are synchronous and the events are None.

[Note: waiting threads sleep]
Events that a host thread waits on are made with ``blocking=True`` (cudaEventBlockingSync):
the waiting thread sleeps until the GPU signals, instead of spinning on a core. The CPU
optimizer's threads use every core while the training loop's threads wait (the autograd
thread for a gradient buffer, the loop for a window slot), and a spinning waiter takes a
core from them. The wake-up costs tens of microseconds, against waits of milliseconds.

[Note: the copy engine never waits for a kernel]
A compressed unit is copied as it is stored (int8 or NF4 bytes) and dequantized on the
device. The copy runs on the H2D stream and the dequantize on a second, high-priority
stream that waits for the copy's event: were both on one stream, the next unit's copy would
queue behind this unit's dequantize, which itself waits for SMs the compute stream holds,
and PCIe would idle for every dequantize. The copies land in two staging buffers used in
turn (``StagingBuffers``); a copy into one first waits for the dequantize that last read it,
so at most two compressed units are staged at once, which the plan counts. The unit's H2D
event is the dequantize's, so its readers wait for both; and since the dequantize writes
storage that the window allocated on the H2D stream, evicting a unit makes the H2D stream
wait for that event before the storage goes back to the caching allocator.

[Note: pinned memory of its own size]
PyTorch's pinned allocations (``torch.empty(..., pin_memory=True)``) come from its caching
host allocator, which rounds every block up to a power of two: a Qwen2.5-14B layer's bf16
master (550 MB) took 1 GiB, and the 14B run's host RSS was 103 GiB against a 61 GiB
store. So ramflow maps its large host buffers itself (an anonymous private mapping, whole
pages of its own, marked not to be inherited by a fork as ``cudaHostAlloc``'s are) and
page-locks exactly those pages with ``cudaHostRegister``; the host store unlocks them when
the engine goes (``HostStore.unpin_all``, or the engine's finalizer). Their bytes are
counted by ``registered_bytes``, outside ``torch.cuda.host_memory_stats()``.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import torch

from ..sizes import format_bytes


def record_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A new event recorded on ``stream`` that a host thread can wait on without spinning.
    See [Note: waiting threads sleep]."""
    event = torch.cuda.Event(blocking=_BLOCKING)
    event.record(stream)
    return event


_BLOCKING = True  # False: spinning waits (for a benchmark's comparison)


class CopyStreams:
    """The copy streams of one device, created lazily on first use (never at import)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._h2d: torch.cuda.Stream | None = None
        self._d2h: torch.cuda.Stream | None = None
        self._decompress: torch.cuda.Stream | None = None

    @property
    def h2d_stream(self) -> torch.cuda.Stream:
        if self._h2d is None:
            self._h2d = torch.cuda.Stream(self.device)
        return self._h2d

    @property
    def decompress_stream(self) -> torch.cuda.Stream:
        """The stream that turns staged compressed bytes into a unit's device tensor: high
        priority, so that its short kernels start between the compute stream's."""
        if self._decompress is None:
            self._decompress = torch.cuda.Stream(self.device, priority=-1)
        return self._decompress

    @property
    def d2h_stream(self) -> torch.cuda.Stream:
        if self._d2h is None:
            self._d2h = torch.cuda.Stream(self.device)
        return self._d2h

    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream the calling thread computes on (None on the CPU)."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy pinned ``src`` into device ``dst`` on the H2D stream. See [Note: copies and events]."""
        if not self.is_cuda:
            dst.copy_(src)
            return None
        stream = self.h2d_stream
        with torch.cuda.stream(stream), torch.profiler.record_function("ramflow.h2d"):
            dst.copy_(src, non_blocking=True)
            event = record_event(stream)
        return event

    def h2d_then(
        self, src: torch.Tensor, then: Callable[[torch.Tensor], None], staging: StagingBuffers
    ) -> torch.cuda.Event | None:
        """Copy pinned ``src`` (flat, uint8) into one of ``staging``'s device buffers on the
        H2D stream, then call ``then(staged)`` on the decompression stream (it writes the
        unit's device tensor, e.g. dequantizes); the returned event, recorded on the
        decompression stream, covers both. On the CPU ``then(src)`` runs at once. See
        [Note: the copy engine never waits for a kernel]."""
        if not self.is_cuda:
            then(src)
            return None
        copy_stream, work = self.h2d_stream, self.decompress_stream
        buf, last_read = staging.next_buffer(src.numel(), self.device)
        with torch.cuda.stream(copy_stream), torch.profiler.record_function("ramflow.h2d"):
            if last_read is not None:
                copy_stream.wait_event(last_read)  # its previous contents were dequantized
            staged = buf[: src.numel()]
            staged.copy_(src, non_blocking=True)
            copied = record_event(copy_stream)
        with torch.cuda.stream(work), torch.profiler.record_function("ramflow.dequantize"):
            work.wait_event(copied)
            then(staged)
            event = record_event(work)
        staging.read_until(event)
        return event

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, after=None) -> torch.cuda.Event | None:
        """Copy device ``src`` (written on the calling thread's stream) into pinned ``dst``.

        ``src`` is kept alive for the copy with ``record_stream``. ``after``: a
        ``torch.distributed`` work handle (an all-reduce of ``src``) that the copy waits
        for. See [Note: copies and events].
        """
        if not self.is_cuda:
            if after is not None:
                after.wait()
            dst.copy_(src)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        stream = self.d2h_stream
        with torch.cuda.stream(stream), torch.profiler.record_function("ramflow.d2h"):
            stream.wait_event(produced)
            if after is not None:
                after.wait()  # makes this stream wait for the collective
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
            event = record_event(stream)
        return event

    def retire(self, src: torch.Tensor, *, after) -> torch.cuda.Event | None:
        """Keep device ``src`` allocated until the collective ``after`` (a
        ``torch.distributed`` work handle) that reads it is done; returns the event that
        marks it, for the caller's throttle (None on the CPU, where ``after`` is waited)."""
        if after is None:
            return None
        if not self.is_cuda:
            after.wait()
            return None
        stream = self.d2h_stream
        with torch.cuda.stream(stream):
            after.wait()
            src.record_stream(stream)
            event = record_event(stream)
        return event


class StagingBuffers:
    """Two device buffers, used in turn, that compressed units are copied into before
    they are dequantized into their slots (one engine's; ``DeviceWindow`` owns them). Each
    is made on first use, as large as the largest unit staged so far. See [Note: the copy
    engine never waits for a kernel]."""

    COUNT = 2

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * self.COUNT
        self._read: list[torch.cuda.Event | None] = [None] * self.COUNT
        self._next = 0

    def next_buffer(
        self, nbytes: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The next buffer in turn, of at least ``nbytes`` uint8 on ``device``, and the
        event after which its last contents were read (None: nothing to wait for)."""
        i = self._next
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            if self._read[i] is not None:
                self._read[i].synchronize()  # a smaller one still read: rare, at growth only
                self._read[i] = None
            self._buffers[i] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf, self._read[i]

    def read_until(self, event: torch.cuda.Event) -> None:
        """The buffer just handed out is read until ``event``; the next call takes the other."""
        self._read[self._next] = event
        self._next = (self._next + 1) % self.COUNT

    def free(self) -> None:
        """Give the buffers back, once every event that reads them has completed."""
        for event in self._read:
            if event is not None:
                event.synchronize()
        self._buffers = [None] * self.COUNT
        self._read = [None] * self.COUNT


def caching_host_block_bytes(nbytes: int) -> int:
    """Host bytes that PyTorch's caching host allocator takes for a pinned allocation of
    ``nbytes`` (``torch.empty(..., pin_memory=True)``): the next power of two (its
    ``CachingHostAllocator`` rounds every block so, to reuse freed blocks; 0 for 0). See
    [Note: pinned memory of its own size] for the buffers ramflow sizes itself."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def alloc_host(numel: int, dtype: torch.dtype, *, pin: bool, what: str) -> torch.Tensor:
    """A flat host tensor, pinned when ``pin``; a clear MemoryError when the host cannot give it."""
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    except RuntimeError as err:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        kind = "pinned" if pin else "pageable"
        raise MemoryError(
            f"ramflow could not allocate {format_bytes(nbytes)} of {kind} host memory for {what}: "
            f"{err}. Free host memory, lower the model size, or (pinned) raise the locked-memory "
            "limit (ulimit -l)."
        ) from err


def map_host(numel: int, dtype: torch.dtype, *, what: str) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype`` over an anonymous mapping of
    its own whole pages: zeros that take no memory until first written (the kernel gives
    zero pages on first touch), so whoever writes it first pays for its pages, in as many
    threads as write (see [Note: filling the host store] in ``ramflow.engine.host_store``); not
    inherited by a fork, as ``cudaHostAlloc``'s memory is not. Lock it with
    ``pin_in_place`` once written (see [Note: pinned memory of its own size]).

    Raises:
        MemoryError: the host cannot map the pages."""
    nbytes = numel * dtype.itemsize
    span = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        pages = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as err:
        raise MemoryError(
            f"ramflow could not map {format_bytes(span)} of host memory for {what}: {err}. "
            "Free host memory or lower the model size."
        ) from err
    if hasattr(mmap, "MADV_DONTFORK"):
        pages.madvise(mmap.MADV_DONTFORK)  # as cudaHostAlloc's memory: no copy-on-write
    t = torch.frombuffer(pages, dtype=torch.uint8)  # holds a reference to ``pages``
    return t[:nbytes].view(dtype)


def alloc_pinned(numel: int, dtype: torch.dtype, *, what: str) -> torch.Tensor:
    """A flat host tensor of ``numel`` elements of ``dtype``, zeros, page-locked over exactly
    its own pages (``map_host``, then ``pin_in_place``); ``unpin`` it before the last
    reference goes. See [Note: pinned memory of its own size].

    Raises:
        MemoryError: the host cannot map the pages or the driver refuses to lock them."""
    t = map_host(numel, dtype, what=what)
    pin_in_place(t, what=what)
    return t


_registered: dict[int, int] = {}  # data pointer -> bytes page-locked by ramflow in place
_registered_lock = threading.Lock()


def registered_bytes() -> int:
    """Host bytes that ramflow has page-locked in place (``cudaHostRegister``) and not yet
    unlocked: outside PyTorch's pinned-memory statistics."""
    with _registered_lock:
        return sum(_registered.values())


def pin_in_place(t: torch.Tensor, *, what: str) -> None:
    """Page-lock the memory of a CPU tensor that already exists (shared memory included),
    so that copies from it are asynchronous DMA (``cudaHostRegister``). Undo with ``unpin``.

    Raises MemoryError when the driver refuses (the locked-memory limit, ``ulimit -l``)."""
    nbytes = t.untyped_storage().nbytes()
    # an empty store (the unit of a head tied to the embedding owns nothing) has nothing
    # to lock, and cudaHostRegister refuses zero bytes
    if nbytes == 0 or t.is_pinned():
        return
    ptr = t.untyped_storage().data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise MemoryError(
            f"ramflow could not page-lock {format_bytes(nbytes)} of host memory for {what} "
            f"(cudaHostRegister error {int(err)}). Raise the locked-memory limit (ulimit -l) or "
            "free host memory."
        )
    with _registered_lock:
        _registered[ptr] = nbytes


def unpin(t: torch.Tensor) -> None:
    """Undo ``pin_in_place`` (or ``alloc_pinned``)."""
    if t.untyped_storage().nbytes() == 0:
        return  # never locked: see pin_in_place
    ptr = t.untyped_storage().data_ptr()
    torch.cuda.cudart().cudaHostUnregister(ptr)
    with _registered_lock:
        _registered.pop(ptr, None)
