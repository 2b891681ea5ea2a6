"""One process per run folder: an exclusive lock on ``<run folder>/.lock``.

[Note: the run folder's lock]
Two runs writing one run folder delete each other's checkpoints (each keeps only its own
newest), and a ``--resume`` that starts while another process saves removes that save's
hidden temporary folder as left over by a killed save (``remove_stale_temporaries``). So
rank 0 of a run holds an exclusive ``fcntl.flock`` on ``<run folder>/.lock`` from before it
opens the checkpoint to resume until the run ends; the file holds the holder's PID, host
and start time, for the message that refuses a second run, and is emptied when the run
ends. The kernel drops the lock when its process dies, however it dies (``kill -9``
included): a lock file left by a dead process is simply taken over. The file itself stays (deleting it would let a process that
opened the old file and one that creates a new one both "hold" the lock). On a network
file system the lock is as good as its ``flock`` (NFS emulates it with byte-range locks).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunFolderInUse(OSError):
    """Another live process holds the run folder's lock (``ramflow train`` exits 2)."""


class RunLock:
    """An exclusive lock on a run folder, held until ``release`` (or the process's end).
    See [Note: the run folder's lock].

    Attributes:
        path: the lock file, ``<run folder>/.lock``.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, creating the run folder and the lock file if needed, and write
        this process's PID, host and start time into it; returns ``self``.

        Raises:
            RunFolderInUse: another live process holds it (the message names its PID and
                host, and what to do).
            OSError: the folder or the file cannot be created.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderInUse(self._refusal()) from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.write(fd, f"pid {os.getpid()} host {socket.gethostname()} since {stamp}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Empty the lock file and drop the lock (the file stays); nothing when it is not
        held."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # closing the only descriptor releases the flock

    def _refusal(self) -> str:
        try:
            holder = self.path.read_text(errors="replace").strip() or "its PID not yet written"
        except OSError:
            holder = "unknown"
        return (
            f"the run folder {self.path.parent} is in use by another ramflow run ({holder}): "
            "two runs in one folder delete each other's checkpoints; wait for it to end or "
            "stop it (Ctrl-C saves), or give another --out"
        )

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["LOCK_FILE", "RunFolderInUse", "RunLock"]
