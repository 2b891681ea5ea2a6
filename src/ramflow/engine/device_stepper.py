"""The device stepper: the units stepped on the GPU, the device state they keep, and its way
back to the host.

Owns each device-stepped unit's step (PyTorch's fused AdamW, or the lean formats' device
kernel), the stream of steps that wait for a reduction, the write-back of their weights to a
shared host store under ZeRO, and the pull of their weights and states back to the host
(``synchronize``, a host step, a load). Which units step here and when is the planner's
(``planner.plan.with_device_optimizer``) and the stepper's (``engine.stepper``) call.

[Note: the optimizer on the device]
With ``device_optimizer=True`` the plan gives what the GPU budget leaves to resident units
(forward order first) as fp32 master weights and AdamW states on the device
(``planner.plan.with_device_optimizer``); those units are stepped by PyTorch's fused AdamW on the
device, on the current stream, the moment their gradients are complete: no gradient D2H,
no CPU step, no refresh H2D, and the next forward reads the new weights in stream order.
In a step bound by the CPU optimizer that takes their share off the CPU (DeepSpeed's
ZeRO-Offload++ does the same with a fixed ratio). The device holds the newest state; the
host's masters, wire copies and states are brought up to date by ``synchronize`` (and so
by every ``state_dict``). A deferred step (the first, clipping, accumulation) uploads the
unit's host fp32 gradients. A unit whose parameters sit in several param groups (a block's norm
weights without weight decay, its matrices with: Hugging Face's and ``ramflow train``'s
recipe) is stepped run by run, each with its group's hyperparameters (``flat_runs``).
A step that the device cannot take (several optimizers in one unit, parameters at
different step counts) pulls the state back, steps on the host and uploads it
again at the next device step. The device step's rounding is CUDA's fused AdamW, within
float rounding of the host kernel (bit-identical on the CPU device). Lean host formats: a
bf16 master is the wire copy, hence the unit's device copy, so the device holds only the
unit's states in their format (8-bit codes and scales, bf16, a Kahan compensation: about 2
bytes per parameter instead of 12) and steps the device copy in place with the host
kernel's arithmetic (``lean_adamw_step_`` on CUDA tensors: one Triton kernel, see
``kernels.lean_triton``, or PyTorch ops without Triton): the same bits as a host step, the same
counter-based rounding, so runs and resumes do not depend on which units the plan put
there. A deferred step's round trip (gradients D2H to the host's buffer, then H2D
again) is what a clipping loop, and ``ramflow train``, which always defers, pay for it: so
a device-stepped unit's host gradients are pinned (the upload is a DMA at the PCIe rate,
not a synchronous copy through the driver's bounce buffers, about ten times slower), and
``step()`` returns once the uploads have read them (``wait_host_grad_reads``): the loop may
then write ``p.grad`` at once, as after a host step.

[Note: the device optimizer under ZeRO]
With ``zero_stage`` each rank plans, and steps on its own GPU, the resident units it owns
(``Engine._with_device_optimizer`` counts no other unit; the default lets the planner
choose among them per rank, [Note: the device optimizer's default] in ``ramflow.planner.plan``),
so each GPU holds the device states of its shard only; the other units keep the host step
of their owner. The owner's step waits for the unit's gradient reduction (``after``). On
CUDA it runs on a stream of the steps' own (faster on 4 GPUs than on the compute stream:
docs/speed.md, "Device steps on their own stream"; ``RAMFLOW_DEVICE_STEP_STREAM=0``
steps there, to bisect a suspected race), which first waits for the compute stream: the backward
goes on meanwhile, the gradient buffer is kept for that stream (``record_stream``, and the
backward's throttle on buffers in flight counts it), and the unit's next use waits for
``device_step_event`` (``DeviceWindow.acquire``), as do its broadcast and its write-back.
The one-process device step leaves the host copies stale until ``synchronize``, but under
ZeRO the host store is shared: other ranks read a unit's wire copy (a refresh from the
host, a load of a unit they do not keep resident) and any rank's ``state_dict`` reads its
master. So right after each device step the owner copies the new weights (an fp32 master
and the wire copy, or the bf16 master that is the wire copy; the states stay on the device
until ``synchronize``) into the shared store on the D2H stream, behind the step
(``_write_back``; the owner pins such a master even where a wire copy beside it is what
others read), and the step's barrier waits for those copies (``ramflow.distributed.zero``,
[Note: the step's sync]): after the barrier the host store is as after host steps. The next forward
does not wait for the write-backs or the barrier where it takes the units from their
owners' devices ([Note: refresh by broadcast]). Race-free as the host step is (see "Data
parallelism" in docs/design.md): the write-back follows the reduction, which every rank
joins after its last read of the unit in this step, and the barrier orders it before every
next read of the host store; the owner's next device step of the unit waits for the
write-back's copies and for the next reduction, which the other ranks join only once their
copy of the unit (from the host or the broadcast) has ended. The bytes are those of the
one-process device step, so the run equals one process stepping the same units on the
device (tested on gloo). Cost against host steps: the write-back's D2H (2 bytes per
parameter with a bf16 master, 6 with an fp32 master beside a bf16 wire) in place of the
gradients' D2H, the CPU step and the owner's refresh H2D.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..planner.plan import DEVICE_STEP_PIECE
from ..transfer.streams import CopyStreams, record_event
from ..units.unit import Unit
from .host_store import HostStore
from .interfaces import StepOptimizer
from .window import DeviceWindow

# "1" (the default): a device step that waits for a reduction runs on a stream of the steps'
# own, so the backward does not stall for the collective's tail (docs/speed.md,
# "Device steps on their own stream"); "0" steps on the current
# stream, which then waits for the reduction (kept to bisect a suspected race)
STEP_STREAM = os.environ.get("RAMFLOW_DEVICE_STEP_STREAM", "1") == "1"


class DeviceStepper:
    """The optimizer steps of one engine's device-stepped units. See [Note: the optimizer on
    the device].

    Args:
        device: the compute device (device steps run there).
        units: the engine's unit list (shared; the engine appends to it).
        window: the device window (a refresh from the host).
        host: the host store (masters, wire copies, states).
        streams: the copy streams of ``device`` (the D2H stream writes a device step's
            weights back to the host under ZeRO).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        units: list[Unit],
        window: DeviceWindow,
        host: HostStore,
        streams: CopyStreams,
    ) -> None:
        self.device = device
        self.units = units
        self._window = window
        self._host = host
        self._streams = streams
        self._stream: torch.cuda.Stream | None = None  # made on first use

    def steppable(self, u: Unit, opt: StepOptimizer) -> bool:
        """Whether ``opt`` can step ``u`` on the device: ``u`` is planned so and ``opt`` has a
        device step and holds all of it (any param groups, one step count; ``flat_runs``).
        Whether this process steps ``u`` at all (its owner under ZeRO) is the caller's."""
        return (
            u.device_stepped and hasattr(opt, "device_flat_step") and opt.flat_runs(u) is not None
        )

    def step(
        self,
        u: Unit,
        opt: StepOptimizer,
        hyper: list[dict],
        grad: torch.Tensor,
        *,
        after: object | None = None,
        grad_scale: float = 1.0,
        write_back: bool = False,
    ) -> bool:
        """Step ``u`` on the device: its fp32 master weights and optimizer states stay
        there and the new weights go straight into its device copy; ``grad_scale``
        multiplies ``grad`` (flat, fp32 or the wire dtype, on the device or pinned on the
        host) first (a clip's coefficient). The host copies are stale until ``pull_state``;
        with ``write_back`` (under ZeRO, where the host store is shared) the weights are
        written back to the host store at once (see [Note: the device optimizer under
        ZeRO]). ``after``: the work handle of the data-parallel reduction of ``grad`` (in
        place), which the step waits for: on CUDA the step then runs on a stream of its own
        (unless ``RAMFLOW_DEVICE_STEP_STREAM=0``), so the backward goes on meanwhile, and the
        next use of the unit waits for ``u.device_step_event`` (``DeviceWindow.acquire``);
        otherwise on the current stream, which the next forward follows in order. Returns
        whether it ran on its own stream."""
        n = u.trainable_numel
        cuda = self.device.type == "cuda"
        with torch.profiler.record_function(f"ramflow.device_optimizer:{u.name}"):
            if u.device_state is None:
                self._wait_host_idle(u)
                u.device_state = opt.device_state(u, self.device)  # type: ignore[attr-defined]
            side = self._step_stream() if cuda and after is not None else None
            if side is not None:  # the gradients (and states just uploaded) are written
                side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                self._wait_write_back(u, host=False)  # its copies read what this step rewrites
                if after is not None:
                    after.wait()  # type: ignore[attr-defined]
                opt.device_flat_step(  # type: ignore[attr-defined]
                    u,
                    hyper,
                    grad=grad,
                    state=u.device_state,
                    weights_out=u.device_alias[:n],  # see [Note: units and views]
                    piece=DEVICE_STEP_PIECE,
                    grad_scale=grad_scale,
                )
                if side is not None:
                    grad.record_stream(side)
                if cuda:
                    u.device_step_event = record_event(torch.cuda.current_stream(self.device))
                    if grad.device.type == "cpu":
                        u.host_grad_read = u.device_step_event
                u.host_stale = True
                u.weights_written = False
                u.write_back_event = None
                if write_back:
                    self._write_back(u)  # on the step's stream: the D2H follows it
        return side is not None

    def _step_stream(self) -> torch.cuda.Stream | None:
        """The stream of device steps that wait for a reduction: one of their own (None:
        the current stream, where ``RAMFLOW_DEVICE_STEP_STREAM=0``). See [Note: the device
        optimizer under ZeRO]."""
        if not STEP_STREAM:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _write_back(self, u: Unit) -> None:
        """Under ZeRO, right after a device step of ``u``: copy its new weights into the
        shared host master and wire copy (pinned), on the D2H stream behind the step;
        ``u.write_back_event`` ends the copies. See [Note: the device optimizer under
        ZeRO]."""
        st = u.device_state
        assert st is not None
        n = u.trainable_numel
        self._host.before_host_write(u)
        with torch.no_grad(), torch.profiler.record_function(f"ramflow.write_back:{u.name}"):
            # an fp32 master has its own device copy in the state, a bf16 one is the device copy
            event = self._streams.d2h(u.master[:n], st.get("master", u.device_flat[:n]))
            if u.wire is not u.master:  # one stream: the last copy's event ends both
                event = self._streams.d2h(u.wire[:n], u.device_flat[:n])
        u.weights_written = True
        u.write_back_event = event

    def _wait_write_back(self, u: Unit, *, host: bool) -> bool:
        """Wait for the copies of the last write-back of ``u``'s weights (``host``: on this
        thread; else the current stream waits on CUDA). Returns whether the host's weights
        are the device's."""
        event = u.write_back_event
        if event is not None:
            if host:
                event.synchronize()
            else:
                torch.cuda.current_stream(self.device).wait_event(event)
        return u.weights_written

    def write_back_events(self) -> list[tuple[Unit, torch.cuda.Event]]:
        """At ``opt.step()``, under ZeRO: the units whose weights this rank's device steps
        are writing back, each with the event that ends its copies (none on the CPU, where
        they have ended). The step's barrier waits for them (``ramflow.distributed.zero``)."""
        return [(u, u.write_back_event) for u in self.units if u.write_back_event is not None]

    @staticmethod
    def wait_host_grad_read(u: Unit) -> None:
        """Before the host gradients of ``u`` are written: the device step that uploads them
        (asynchronously, from pinned memory) has read them."""
        if u.host_grad_read is not None:
            u.host_grad_read.synchronize()
            u.host_grad_read = None

    def wait_host_grad_reads(self) -> None:
        """At the end of ``step()`` (and of a pass that stepped units from the host): every
        upload of host gradients is done, so ``p.grad`` may be written (clipped, zeroed,
        accumulated into) as soon as the call returns. See [Note: the optimizer on the
        device]."""
        for u in self.units:
            self.wait_host_grad_read(u)

    @staticmethod
    def _wait_host_idle(u: Unit) -> None:
        """Before the host copies of ``u`` are read for the device: its host step done."""
        u.wire_ready.wait()
        if u.staging_reader is not None:
            u.staging_reader.result()

    def pull_state(self, u: Unit, *, weights: bool = True) -> None:
        """Copy ``u``'s device-stepped master weights, wire copy and optimizer states back
        to the host (``synchronize``); the device keeps them. ``weights`` False: the host's
        weights were just replaced, only the states come back."""
        st = u.device_state
        if st is None or not u.host_stale:
            return
        if u.device_step_event is not None:
            u.device_step_event.synchronize()
        written = self._wait_write_back(u, host=True)  # under ZeRO: never written twice
        n = u.trainable_numel
        self._host.before_host_write(u)
        with torch.no_grad():
            if weights and not written:
                # an fp32 master has its own device copy; a bf16 one is the device copy
                u.master[:n].copy_(st["master"] if "master" in st else u.device_flat[:n])
                if u.wire is not u.master:
                    u.wire[:n].copy_(u.device_flat[:n])
            for name, t in st.items():
                if name.startswith("host_"):
                    t.copy_(st[name.removeprefix("host_")])
        u.host_stale = False

    def drop_state(self, u: Unit) -> None:
        """The host takes over ``u``'s master weights and states (copied back if newer);
        the device frees its copies and uploads them again at the next device step."""
        self.pull_state(u)
        self._forget(u)

    def refresh_from_host(self, u: Unit) -> None:
        """The host master weights of ``u`` changed outside ramflow (worker idle): the
        host's weights win over a device step's (its states are kept), and the wire and
        device copies follow."""
        self.pull_state(u, weights=False)
        self._forget(u)
        self._window.begin_host_write([u])
        self._host.refresh_wire(u)

    @staticmethod
    def _forget(u: Unit) -> None:
        """The device's copy of ``u``'s state is let go (the host's is current)."""
        u.device_state = None
        u.device_step_event = None
        u.weights_written = False
        u.write_back_event = None
