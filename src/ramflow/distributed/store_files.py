"""The shared host store's files: where they live, their names, and their removal.

Used by ``ramflow.distributed.zero.shared_host_store``; see [Note: host store files].
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import socket

import psutil
import torch


def host_name() -> str:
    """This host's name for grouping ranks by host: the machine's, unless
    ``$RAMFLOW_TEST_HOST`` names a simulated host (tests run several "hosts" on one machine;
    never set it otherwise, or ranks of one machine stop sharing their host copy)."""
    return os.environ.get("RAMFLOW_TEST_HOST") or socket.gethostname()


# [Note: host store files]
# The leader of a host creates one file per unit and kind in $RAMFLOW_SHM_DIR (default
# /dev/shm), named ``ramflow-<pid>-<token>-<host>-<unit>.<master|wire>``: the leader's PID,
# a token drawn by rank 0 for this set-up, and the host name. It creates each with
# O_CREAT | O_EXCL (never opening a file someone else made), and unlinks every file it made
# on every exit path it runs code on: once all ranks of the host have mapped them, or in a
# ``finally`` when set-up fails, or at interpreter exit. A leader killed outright (SIGKILL,
# ``os._exit``, SIGTERM without a handler: no Python runs then, and a Python handler would
# only run after the blocking collective returns, delaying the kill by up to the process
# group's timeout) leaves its files; the next ``shared_host_store`` on this host removes the
# files of this naming pattern whose PID is no longer a live process. Files of other hosts
# (a directory shared between containers), of live processes, and of other names are never
# touched.
STORE_FILE = re.compile(
    r"ramflow-(?P<pid>[0-9]+)-(?P<token>[0-9a-f]{32})-(?P<host>.+)-(?P<unit>[0-9]+)"
    r"\.(?P<kind>master|wire)"
)


def shm_directory() -> str:
    return os.environ.get("RAMFLOW_SHM_DIR", "/dev/shm")


_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def filesystem_type(path: str, *, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the filesystem that holds ``path`` (from the ``mounts`` table: the
    longest mount point above it), or None where that cannot be read."""
    real = os.path.realpath(path)
    try:
        with open(mounts, encoding="utf-8") as f:
            table = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best, kind = "", None
    for point, fstype in table:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fstype
    return kind


def check_shm_directory_pins(directory: str, *, mounts: str = "/proc/self/mounts") -> None:
    """Raise ValueError when the shared host store's ``directory`` is not memory-backed:
    Linux does not page-lock the pages of a file on disk for DMA (``cudaHostRegister``
    fails), so a GPU run could not copy from the shared masters asynchronously."""
    kind = filesystem_type(directory, mounts=mounts)
    if kind is not None and kind not in _MEMORY_FILESYSTEMS:
        raise ValueError(
            f"RAMFLOW_SHM_DIR={directory} is on a {kind} filesystem: the shared host store "
            "must be in memory-backed files for the GPU to copy from them (Linux does not "
            "page-lock a disk file's pages). Use /dev/shm (the default) or another tmpfs."
        )


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process of this PID namespace (a zombie is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # exists, but cannot be inspected (another user's)
        return True


def remove_stale_store_files(directory: str) -> list[str]:
    """Remove this host's store files in ``directory`` whose creating process is gone.

    Only names that match ``STORE_FILE`` with this host's name are considered, and only
    those whose PID is not a live process are removed (see [Note: host store files]).
    Returns the paths removed; a file that cannot be removed (another user's) is skipped.
    """
    host = host_name()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = STORE_FILE.fullmatch(name)
        if m is None or m["host"] != host or pid_alive(int(m["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def create_store_file(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Create ``path`` exclusively, size it for ``numel`` elements of ``dtype`` and map it
    shared; returns the 1-D tensor over it (zeros).

    Raises:
        FileExistsError: ``path`` exists already (it is left as it was).
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, numel * torch.empty((), dtype=dtype).element_size())
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class CreatedFiles:
    """The store files this process created; ``remove`` unlinks them (once, idempotent),
    also from ``atexit`` while set-up runs. See [Note: host store files]."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __enter__(self) -> CreatedFiles:
        atexit.register(self.remove)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
        atexit.unregister(self.remove)

    def create(self, path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = create_store_file(path, numel, dtype)
        self.paths.append(path)
        return tensor

    def remove(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.paths.clear()
