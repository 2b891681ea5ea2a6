"""Checkpoints of real ``ramflow train`` processes that are killed or terminated mid-save.

The processes are real and die for real (SIGKILL, SIGTERM); what is chosen is only the
moment, through the test-only ``RAMFLOW_TEST_FAULT`` hook (see [Note: test faults] in
``ramflow/train/run_checkpoint.py``), so that no test depends on timing. Processes come from a
``forkserver`` that has imported torch and transformers once, so a trial costs a fork and
a few tiny steps rather than a Python start-up.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ramflow import cli
from ramflow.train import open_checkpoint
from ramflow.train.report import read_log
from ramflow.train.run_checkpoint import list_checkpoints

pytestmark = pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="needs fork (POSIX)"
)

JOIN_TIMEOUT_S = 600  # generous: the machine may be shared; nothing here depends on it
STEPS = 3  # saves at steps 1, 2 and 3 (save_every 1), one kept
# the moments of a save the hook can stop at (``checkpoint.SAVE_PHASES``)
SAVE_PHASES = (
    "begin", "weights", "optimizer", "files", "state", "renamed", "latest", "deleting", "done",
)  # fmt: skip


def _main(argv: list[str], fault: str | None, environ: dict[str, str]) -> None:
    """The child process: ``ramflow ARGV`` with the fault hook set, exiting with its status."""
    os.environ.clear()  # the test's environment, not the forkserver's from its start
    os.environ.update(environ)
    if fault is not None:
        os.environ["RAMFLOW_TEST_FAULT"] = fault
    sys.exit(cli.main(argv))


@pytest.fixture(scope="module")
def spawn():
    """Start ``ramflow ARGV`` (with ``fault``) as a child process; returns the Process."""
    ctx = multiprocessing.get_context("forkserver")  # its preload: tests/conftest.py
    started = []

    def start(*argv: str | Path, fault: str | None = None) -> multiprocessing.Process:
        proc = ctx.Process(
            target=_main, args=([str(a) for a in argv], fault, dict(os.environ)), daemon=True
        )
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()


def _join(proc: multiprocessing.Process) -> int:
    proc.join(JOIN_TIMEOUT_S)
    assert not proc.is_alive(), f"the child did not end within {JOIN_TIMEOUT_S} s"
    return proc.exitcode


def _train_args(corpus_file: Path, out: Path, fast: tuple[str, ...]) -> list[str | Path]:
    return [
        "train", "--data", corpus_file, "--steps", str(STEPS), "--save-every", "1",
        "--eval-every", "0", "--keep-checkpoints", "1", "--out", out, *fast,
    ]  # fmt: skip


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_log(run / "log.jsonl") if r["event"] == "step"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(open_checkpoint(run).path / "model.safetensors"))


def _hidden(run: Path) -> list[str]:
    return [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path, fast) -> Path:
    """The uninterrupted run that every killed-and-resumed run must equal bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert cli.main([str(a) for a in _train_args(corpus_file, out, fast)]) == 0
    return out


def _assert_equals_reference(run: Path, reference: Path) -> None:
    assert _losses(run) == _losses(reference)
    a, b = _weights(run), _weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Every (phase, save) a SIGKILL can hit: saves 2 and 3 have a checkpoint before them (save 1
# has nothing to lose). The seed picks which ten run; "deleting" happens in saves 2 and 3
# as its 1st and 2nd occurrence.
_MOMENTS = [(phase, save) for phase in SAVE_PHASES for save in (2, 3)]
TRIALS = random.Random(20261123).sample(_MOMENTS, 10)


@pytest.mark.parametrize(("phase", "save"), TRIALS)
def test_kill_9_during_a_save_loses_nothing(
    tmp_path: Path, corpus_file: Path, fast, spawn, reference: Path, ramflow_cli, phase, save
) -> None:
    out = tmp_path / "run"
    nth = save - 1 if phase == "deleting" else save
    proc = spawn(*_train_args(corpus_file, out, fast), fault=f"kill:{phase}:{nth}")
    assert _join(proc) == -signal.SIGKILL
    # a complete checkpoint survives: the one before this save, or this save's own
    ckpt = open_checkpoint(out)  # checks every file against the manifest
    assert ckpt.step in (save - 1, save)
    # the next start removes what the killed save left and continues bit for bit
    assert ramflow_cli("train", "--resume", out, "--no-progress", "--device", "cpu") == 0
    assert _hidden(out) == []
    assert [p.name[:13] for p in list_checkpoints(out / "checkpoints")] == ["step-00000003"]
    _assert_equals_reference(out, reference)


def test_a_kill_between_the_renames_of_a_same_step_save_keeps_a_checkpoint(
    tmp_path: Path, reference: Path, spawn, ramflow_cli
) -> None:
    """Resuming a finished run saves its step again: killed after the new folder is in
    place but before ``latest`` names it, the run still has its complete checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    proc = spawn(
        "train", "--resume", run, "--no-progress", "--device", "cpu", fault="kill:renamed:1"
    )
    assert _join(proc) == -signal.SIGKILL
    ckpt = open_checkpoint(run)
    assert ckpt.step == STEPS
    # both slots of the step are complete; latest names the old one
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [
        "step-00000003",
        "step-00000003.1",
    ]
    assert ckpt.path.name == "step-00000003"
    for slot in list_checkpoints(run / "checkpoints"):
        assert open_checkpoint(slot).step == STEPS
    # saving the step again reuses the slot latest does not name, then drops the other
    assert ramflow_cli("train", "--resume", run, "--no-progress", "--device", "cpu") == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000003.1"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000003.1"
    assert _hidden(run) == []
    _assert_equals_reference(run, reference)


def test_sigterm_during_a_save_finishes_it_and_exits_143(
    tmp_path: Path, corpus_file: Path, fast, spawn
) -> None:
    """SIGTERM arrives while step 1's checkpoint is being written: the save completes, the
    run stops there without saving step 1 a second time, and exits 128 + 15."""
    out = tmp_path / "run"
    proc = spawn(*_train_args(corpus_file, out, fast), fault="term:weights:1")
    assert _join(proc) == 128 + signal.SIGTERM
    assert open_checkpoint(out).step == 1
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log if r["event"] == "checkpoint"] == [1]
    assert log[-1]["event"] == "end" and log[-1]["interrupted"] is True
    assert _hidden(out) == []


def test_sigterm_between_steps_saves_and_exits_143(
    tmp_path: Path, corpus_file: Path, fast, spawn
) -> None:
    """What a scheduler or ``docker stop`` does: SIGTERM from outside, once a step is logged."""
    out = tmp_path / "run"
    proc = spawn(
        "train", "--data", corpus_file, "--steps", "100000", "--eval-every", "0",
        "--out", out, *fast,
    )  # fmt: skip
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not (out / "log.jsonl").exists() or not _losses(out):
        assert proc.is_alive(), f"the run ended early with {proc.exitcode}"
        assert time.monotonic() < deadline, f"no training step within {JOIN_TIMEOUT_S} s"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    assert _join(proc) == 128 + signal.SIGTERM
    last_step = _losses(out)[-1][0]
    assert open_checkpoint(out).step == last_step
    assert read_log(out / "log.jsonl")[-1]["interrupted"] is True
