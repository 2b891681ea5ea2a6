"""Shared fixtures of the ``ramflow train`` tests: a small real corpus and tiny runs.

Every run uses the tiny preset on short sequences, so that a step takes milliseconds on a
2-core CPU; the text is real (pieces of the standard library's own sources).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ramflow import cli  # noqa: E402

# Options that make a training run take about a second on a 2-core CPU.
# On the CPU even where a GPU exists: these tests compare runs bit for bit.
FAST_OPTIONS = (
    "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-progress", "--device", "cpu",
)  # fmt: skip


def _run_cli(*argv: str | Path) -> int:
    return cli.main([str(a) for a in argv])


@pytest.fixture(scope="session")
def ramflow_cli() -> Callable[..., int]:
    """``ramflow ARGS...`` in this process; returns its exit status."""
    return _run_cli


@pytest.fixture(scope="session")
def fast() -> tuple[str, ...]:
    """Training options for runs of about a second (tiny preset, B=2, T=32)."""
    return FAST_OPTIONS


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 90 KB of real Python source as one text file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(
        (stdlib / name).read_text() for name in ("argparse.py", "json/decoder.py", "textwrap.py")
    )
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> Path:
    """A run folder of 8 steps of the tiny preset, shared by tests that only read it."""
    out = tmp_path_factory.mktemp("runs") / "trained"
    rc = _run_cli(
        "train",
        "--data",
        corpus_file,
        "--steps",
        "8",
        "--eval-every",
        "4",
        "--out",
        out,
        *FAST_OPTIONS,
    )
    assert rc == 0
    return out
