"""``ramflow train --nproc-per-node N``: start N ranks of ``ramflow train`` on this host.

[Note: the launcher]
The ranks are N child processes ``python -m ramflow train ...`` with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); the launcher hosts the rendezvous store itself (a ``TCPStore`` on a port
the system picks, which the ranks join as clients: ``TORCHELASTIC_USE_AGENT_STORE``), so
there is no free-port race. We do not go through ``torch.distributed.run`` because its
agent turns a Ctrl-C into SIGTERM for every rank: our ranks take the first signal as
"finish the step and save" and a second as "abort", so torchrun's SIGINT-then-SIGTERM
would abort the save that Ctrl-C asks for. Here the children stay in the terminal's
process group (a Ctrl-C reaches each of them once, as it would one process) and the
launcher ignores SIGINT; a SIGTERM sent to the launcher alone (a scheduler) is passed on
once to every rank.

Exit status: 0 when every rank finished; otherwise that of the first rank to fail (by
time, to a tenth of a second; of two seen at once, one killed by a signal), the shell's ``128 + signal`` for a rank killed by a signal, so that the root cause,
not its echo on the other ranks, is what a script sees. Once a rank has failed, the others
get the process group's timeout (``--dist-timeout``) plus ``_GRACE_S`` to fail on their own
(ramflow names the dead rank, see [Note: a rank that dies] in ``ramflow.distributed.zero``); ranks
still running then are killed.

[Note: ranks die with their launcher]
A launcher killed with SIGKILL (or by the OOM killer) cannot pass anything on: its ranks
would go on training and saving as orphans, holding the run folder's lock. So each rank
watches its parent (``follow_launcher``, a daemon thread): once the launcher, named in
``RAMFLOW_LAUNCHER_PID``, is no longer its parent, the rank sends itself SIGTERM, once,
and does what a SIGTERM to the launcher makes it do: finish the step, save, exit 143.
Not ``prctl(PR_SET_PDEATHSIG)``: with it, each rank of a killed launcher (a process of
several threads) got the signal twice, and a second SIGTERM aborts the save. Ranks that torchrun starts are left alone (its agent watches them).

The ranks' watches poll apart, so their signals arrive up to ``_WATCH_S`` apart: the
first rank signalled stops every rank after the same step (``Ranks.any``), and the
others' own signals come later, during that step or the save. Each is that rank's first
signal, a stop, not the second that aborts ([Note: stopping and resuming] in
``trainer.py``); counted as a second, as before, it aborted the save on one rank in
about half the runs. The launcher's death takes the rendezvous store with it, but the
save does not need it: gloo's collectives (the loop's and the save's) run on the
connections the ranks made to each other at set-up, and the store is read only then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_GRACE_S = 30.0  # beyond the process group's timeout, for a failing rank to write its error
_POLL_S = 0.1
LAUNCHER_PID_ENV = "RAMFLOW_LAUNCHER_PID"
_WATCH_S = 0.5  # how often a rank looks whether its launcher is still its parent


@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        rank: its global rank.
        pid: its process id.
        status: its exit status as a shell reports it (``128 + signal`` when killed).
    """

    rank: int
    pid: int
    status: int


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(status: int) -> str:
    if status > 128:
        try:
            return f"status {status} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return f"status {status}"


def rank_environment(
    base: dict[str, str], *, rank: int, nproc: int, port: int, threads: int
) -> dict[str, str]:
    """The environment of rank ``rank`` of ``nproc`` on this host (torchrun's variables)."""
    return {
        **base,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": str(threads),
        LAUNCHER_PID_ENV: str(os.getpid()),
    }


def follow_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """In a rank that ``launch`` started: send this process SIGTERM, once, when the
    launcher dies, however it dies (a daemon thread watches the parent PID every
    ``_WATCH_S``). See [Note: ranks die with their launcher]. Returns whether it watches
    (False outside such a rank)."""
    env = os.environ if environ is None else environ
    launcher = env.get(LAUNCHER_PID_ENV)
    if launcher is None:
        return False
    parent = int(launcher)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ramflow-launcher-watch", daemon=True).start()
    return True


def launch(
    argv: Sequence[str],
    *,
    nproc: int,
    timeout_s: float,
    module: str = "ramflow",
) -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` ranks on this host and wait for them.
    See [Note: the launcher].

    Args:
        argv: the ranks' arguments (``train ...``).
        nproc: ranks to start, at least 1.
        timeout_s: the process group's timeout (seconds): after a rank fails, the others
            get this long (plus a grace) to fail on their own before they are killed.
        module: the module the ranks run (tests may run another).

    Returns:
        The exit status: 0, or the first failed rank's (``128 + signal`` when killed).

    Raises:
        ValueError: ``nproc`` below 1.
    """
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {nproc}")
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def pass_on(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM and not forwarded:
            forwarded.append(signum)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),  # the ranks get it
        signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on),
    }
    try:
        for rank in range(nproc):
            env = rank_environment(
                dict(os.environ), rank=rank, nproc=nproc, port=store.port, threads=threads
            )
            procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
        first = _wait(procs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        del store
    if first is None:
        return 0
    others = [
        f"rank {r} {_describe(_status(p.returncode))}"
        for r, p in enumerate(procs)
        if r != first.rank
    ]
    print(
        f"ramflow train: rank {first.rank} (PID {first.pid}) ended first, with "
        f"{_describe(first.status)}; then {', '.join(others)}",
        file=sys.stderr,
    )
    return first.status


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> RankExit | None:
    """Wait for every rank; return the first that failed (None when none did). Ranks
    still running ``timeout_s + _GRACE_S`` after the first failure are killed."""
    first: RankExit | None = None
    deadline = float("inf")
    while True:
        running, failed = False, []
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is None:
                running = True
            elif code != 0:
                failed.append(RankExit(rank, p.pid, _status(code)))
        if failed and first is None:
            # seen in the same poll: a rank killed by a signal is the cause, the others'
            # errors its echo
            first = max(failed, key=lambda e: e.status > 128)
            deadline = time.monotonic() + timeout_s + _GRACE_S
        if not running:
            return first
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(_POLL_S)


__all__ = ["LAUNCHER_PID_ENV", "RankExit", "follow_launcher", "launch", "rank_environment"]
