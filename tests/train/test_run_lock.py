"""The run folder's lock (``ramflow.train.run_lock``) in one process: a second holder is
refused with the first's PID, and leaving the ``with`` block lets the next one in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ramflow.train.run_lock import RunFolderInUse, RunLock


def test_a_held_folder_is_refused_until_the_holder_leaves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLock(run) as held:
        assert held.path.read_text().startswith(f"pid {os.getpid()} host ")
        with pytest.raises(
            RunFolderInUse, match=rf"is in use by another ramflow run \(pid {os.getpid()} "
        ):
            RunLock(run).acquire()
    assert held.path.read_text() == ""  # emptied on the way out; the file stays
    RunLock(run).acquire().release()
