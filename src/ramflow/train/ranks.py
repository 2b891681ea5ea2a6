"""The ranks of a data-parallel ``ramflow train``: who this process is among them, and the
few collectives the training loop needs beside ramflow's own (ZeRO's gradient reduction).

[Note: several ranks from the CLI]
``torchrun --nproc-per-node N -m ramflow train ...`` (or ``ramflow train --nproc-per-node
N``, see ``launch.py``) runs N copies of the same loop, one per GPU (``LOCAL_RANK``), over
NCCL; on the CPU over gloo. The model is offloaded with ``zero_stage`` (see [Note: data
parallelism on the engine] in ``ramflow.distributed.zero``): gradients are averaged over the ranks,
each unit is stepped by one rank. Everything else is made to agree as follows.

- **Data.** ``--batch-size`` is one rank's micro-batch B. Each micro-batch, every rank
  draws the same B x N sequences that one process with a micro-batch of B x N would draw
  (the data position is global) and keeps rows ``rank * B : (rank + 1) * B``. With
  gradients averaged, N ranks at B compute the steps of one process at B x N (up to the
  order of the sums); the global batch is B x N x ``--grad-accum``. Validation splits its
  batches the same way and sums losses and rows over the ranks.
- **Agreement.** Set-up errors are gathered (``Ranks.together``), so that every rank fails
  with the same message instead of the others waiting in a collective; a stop request
  (Ctrl-C, SIGTERM) on any rank stops every rank after the same step (``Ranks.any``).
- **Reporting.** Rank 0 alone prints, logs, plots and writes ``run.json``; the loss it
  logs is the mean over the ranks, tokens/s counts every rank's tokens and the MFU is over
  every GPU's peak.
- **Checkpoints.** The weights are written once (by rank 0: the ranks share one host
  copy), each rank writes its own optimizer shard; see [Note: checkpoint layout].

Not with several ranks (refused with what to do): fp16 (the GradScaler's skip decision
would differ between ranks that hold different gradients), ``--lora``,
``--batch-size auto`` and the back-off after an out-of-memory error
(each rank would pick its own micro-batch and the collectives would no longer match).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..choices import DEFAULT_NUMA_BINDING, NUMA_BINDINGS

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0  # torch's default for NCCL
SAVE_TIMEOUT_S = 7200.0
"""How long the other ranks wait for rank 0 to write a checkpoint's weights (and delete
older checkpoints) when that is longer than the run's timeout: 280 GB of a 70B model's fp32
weights take 4 minutes at 1.2 GB/s and much longer on a slow disk. A rank 0 that dies
fails the wait at once (gloo's sockets close); only a hung one is waited for this long."""


def bind_to_gpu_node(gpu_index: int, mode: str) -> frozenset[int] | None:
    """Bind this process's threads (and those it starts later) to the logical CPUs that
    ``mode`` gives GPU ``gpu_index``, through PyTorch's own NUMA binding (what torchrun's
    ``--numa-binding`` does): ``"exclusive"``, each GPU of a NUMA node its own share of that
    node's physical cores; ``"node"``, ``"socket"``, ``"core-complex"`` as
    ``torch.numa.binding.AffinityMode`` says; ``"none"``, no binding. Memory the rank
    touches first (its optimizer states, its units of the shared store, pinned buffers)
    then lands on that node. Returns the CPUs bound to, or None where nothing was bound
    (``"none"``, a PyTorch without the module, a machine whose topology it cannot read:
    it logs why and goes on).

    Raises:
        ValueError: ``mode`` is not one of ``NUMA_BINDINGS``.
    """
    if mode not in NUMA_BINDINGS:
        raise ValueError(f"--numa-binding {mode!r}: choose one of {', '.join(NUMA_BINDINGS)}")
    if mode == "none" or not hasattr(os, "sched_getaffinity"):
        return None
    try:  # a private entry point of a public module: guarded against its changes
        from torch.numa.binding import (
            AffinityMode,
            NumaOptions,
            _maybe_apply_numa_binding_to_current_process,
        )
    except ImportError:
        return None
    before = os.sched_getaffinity(0)
    _maybe_apply_numa_binding_to_current_process(
        gpu_index=gpu_index,
        numa_options=NumaOptions(AffinityMode(mode), should_fall_back_if_binding_fails=True),
    )
    after = os.sched_getaffinity(0)
    return frozenset(after) if after and after != before else None


class RankSetupError(ValueError):
    """Another rank failed to set up (its message is included); this one stops too."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a run (one process: the defaults).

    Attributes:
        rank: global rank, 0 to ``world_size - 1``.
        world_size: number of ranks.
        local_rank: rank on this host; its GPU is ``cuda:local_rank``.
        local_world_size: ranks on this host (they share its cores and host store).
        peers: every rank's (host name, PID), gathered by ``start``: a failed collective
            names the ranks of this host that died.
        group: the gloo group of the loop's own collectives, made by ``start`` with the
            run's timeout (a gloo group made without one waits 30 minutes).
        save_group: a gloo group for waiting on rank 0's part of a save, with
            ``SAVE_TIMEOUT_S`` if that is longer.
        cpus: the logical CPUs ``start`` bound this rank to (``bind_to_gpu_node``), None
            when it did not bind it.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    peers: tuple[tuple[str, int], ...] = field(default=(), compare=False, repr=False)
    group: Any = field(default=None, compare=False, repr=False)
    save_group: Any = field(default=None, compare=False, repr=False)
    cpus: frozenset[int] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Ranks:
        """The ranks torchrun (or ``ramflow train --nproc-per-node``) described in the
        environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), else
        an initialized process group's, else one process.

        Raises:
            ValueError: the variables are not integers, or out of range.
        """
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env and dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            return cls(dist.get_rank(), world, dist.get_rank(), world)
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError as err:
            raise ValueError(
                f"the torchrun environment is malformed ({err}); launch with torchrun or "
                "ramflow train --nproc-per-node N"
            ) from None
        if not (0 <= rank < world and 0 <= local < local_world <= world):
            raise ValueError(
                f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={world}, "
                f"LOCAL_WORLD_SIZE={local_world}; launch with torchrun or ramflow train "
                "--nproc-per-node N"
            )
        return cls(rank, world, local, local_world)

    @property
    def several(self) -> bool:
        """More than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reports and writes the shared files."""
        return self.rank == 0

    def device(self, device: str | None) -> str | None:
        """This rank's device for the run's ``--device``: ``cuda:LOCAL_RANK`` for ``cuda``
        (or None on a machine with CUDA), the CPU for ``cpu``.

        Raises:
            ValueError: ``cuda:N`` with several ranks (each rank takes its own GPU).
        """
        if not self.several:
            return device
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            return f"cuda:{self.local_rank}"
        if device != "cpu":
            raise ValueError(
                f"--device {device} with {self.world_size} ranks: each rank takes the GPU of "
                "its LOCAL_RANK; give --device cuda (or cpu), and CUDA_VISIBLE_DEVICES to "
                "choose the GPUs"
            )
        return device

    def start(
        self,
        *,
        device: str | None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        numa_binding: str = DEFAULT_NUMA_BINDING,
    ) -> bool:
        """Join the process group (NCCL for a CUDA ``device``, else gloo) unless one is
        initialized already, bind this rank to its GPU, and to the cores near it
        (``numa_binding``, see ``bind_to_gpu_node``), and give it its share of the host's
        cores as threads (its bound cores, else ``cores // local_world_size``). Returns
        whether it created the group
        (then ``stop`` ends it). One process: does nothing, returns False.

        Raises:
            ValueError: ``timeout_s`` not positive; ``device`` refused by ``device()``;
                fewer visible GPUs than local ranks.
        """
        if not self.several:
            return False
        if not timeout_s > 0:
            raise ValueError(
                f"--dist-timeout must be a positive number of seconds, got {timeout_s}"
            )
        device = self.device(device)
        cuda = device is not None and device.startswith("cuda")
        if cuda:
            if torch.cuda.device_count() <= self.local_rank:
                raise ValueError(
                    f"rank {self.rank} needs GPU {self.local_rank} but this machine shows "
                    f"{torch.cuda.device_count()}; start at most that many ranks per host"
                )
            torch.cuda.set_device(self.local_rank)
        cpus = bind_to_gpu_node(self.local_rank, numa_binding) if cuda else None
        object.__setattr__(self, "cpus", cpus)
        # a bound rank's threads are its cores'; else its share of the host's
        torch.set_num_threads(
            len(cpus) if cpus else max(1, (os.cpu_count() or 1) // self.local_world_size)
        )
        created = not dist.is_initialized()
        timeout = datetime.timedelta(seconds=timeout_s)
        if created:
            dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timeout)
        from ..distributed.zero import host_name

        # frozen for callers; filled once, here, before any collective of the loop
        object.__setattr__(self, "group", dist.new_group(backend="gloo", timeout=timeout))
        saves = datetime.timedelta(seconds=max(timeout_s, SAVE_TIMEOUT_S))
        object.__setattr__(self, "save_group", dist.new_group(backend="gloo", timeout=saves))
        object.__setattr__(self, "peers", tuple(self.all_gather((host_name(), os.getpid()))))
        return created

    def stop(self) -> None:
        """Leave the process group ``start`` created."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives on the host (gloo), in the loop's thread

    def _group(self, slow: bool = False) -> dist.ProcessGroup:
        group = self.save_group if slow else self.group
        if group is None:
            raise RuntimeError("Ranks.start() must run before the ranks' collectives")
        return group

    @contextlib.contextmanager
    def _explained(self, what: str) -> Iterator[None]:
        """A failed collective raises ramflow's error: which rank of this host died, if
        one did, and what to do (as the engine's, see [Note: a rank that dies] in
        ``ramflow.distributed.zero``)."""
        try:
            yield
        except Exception as err:
            from ..distributed.zero import host_name, pid_alive

            me = host_name()
            dead = [r for r, (h, pid) in enumerate(self.peers) if h == me and not pid_alive(pid)]
            who = (
                ", ".join(f"rank {r} (PID {self.peers[r][1]})" for r in dead) + " on this host died"
                if dead
                else "another rank has probably died or stopped"
            )
            raise RuntimeError(
                f"ramflow: {what} failed on rank {self.rank}: {who}. Stop every rank and "
                f"restart them all from the last checkpoint (--resume). Cause: {err}"
            ) from err

    def all_gather(self, obj: T, *, slow: bool = False) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order; ``slow``: some rank may take
        up to ``SAVE_TIMEOUT_S`` to get here (it writes a checkpoint).

        Raises:
            RuntimeError: another rank died or failed (the message names it).
        """
        if not self.several:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._explained("exchanging the training loop's state"):
            dist.all_gather_object(out, obj, group=self._group(slow))
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` (the others pass anything, e.g. None).

        Raises:
            RuntimeError: another rank died or failed (the message names it).
        """
        if not self.several:
            return obj
        box = [obj]
        with self._explained("exchanging the training loop's state"):
            dist.broadcast_object_list(box, src=0, group=self._group())
        return box[0]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return any(self.all_gather(bool(flag))) if self.several else bool(flag)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums of ``values`` over the ranks (float64 on the host)."""
        if not self.several:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        with self._explained("summing the loss over the ranks"):
            dist.all_reduce(t, group=self._group())
        return t.tolist()

    def barrier(self, *, slow: bool = False) -> None:
        """Wait for every rank (RuntimeError, naming a dead rank, if one is gone);
        ``slow`` as in ``all_gather``."""
        if self.several:
            with self._explained("waiting for the other ranks"):
                dist.barrier(group=self._group(slow))

    def together(self, fn: Callable[[], T], *, slow: bool = False) -> T:
        """Run ``fn`` on every rank; if it raises on any, raise on every rank: its own
        error where it failed, a ``RankSetupError`` with the first failed rank's message
        elsewhere (so that no rank waits in a collective for one that gave up). ``slow``
        as in ``all_gather``."""
        try:
            value, error = fn(), None
        except Exception as err:  # re-raised below, after the others learn of it
            value, error = None, err
        if not self.several:
            if error is not None:
                raise error
            return value  # type: ignore[return-value]
        failures = self.all_gather(
            None if error is None else f"{type(error).__name__}: {error}", slow=slow
        )
        if error is not None:
            raise error
        for rank, failure in enumerate(failures):
            if failure is not None:
                raise RankSetupError(f"rank {rank} stopped the run: {failure}")
        return value  # type: ignore[return-value]


def check_several_ranks(*, world_size: int, precision: str, lora: bool, auto_batch: bool) -> None:
    """Refuse settings a run of several ranks does not support (see [Note: several ranks
    from the CLI] for why).

    Raises:
        ValueError: with what to change.
    """
    if world_size < 2:
        return
    refused = [
        (precision == "fp16", "--precision fp16 (use bf16, or fp32)"),
        (lora, "--lora (train LoRA on one rank)"),
        (auto_batch, "--batch-size auto (give a number: each rank's micro-batch)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{world_size} ranks do not support {what}")


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SAVE_TIMEOUT_S",
    "RankSetupError",
    "Ranks",
    "bind_to_gpu_node",
    "check_several_ranks",
]
