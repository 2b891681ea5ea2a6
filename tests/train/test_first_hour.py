"""What a newcomer meets in the first hour: the README's references, the package metadata,
and ``ramflow train``'s output when it goes to a file or a pipe instead of a terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_references(text: str) -> set[str]:
    """Paths in the README's code spans (outside code blocks) and link targets that name the repository's own
    files: those under its top-level folders, and bare ``*.md`` / ``*.py`` file names."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks: commands, not files
    spans = re.findall(r"`([^`]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    found = set()
    for span in spans:
        for word in span.split():
            word = word.split("::")[0].strip("()[],;:\"'").rstrip("/")
            if word.startswith(("benchmarks/", "docs/", "examples/", "tests/", "src/")) or (
                re.fullmatch(r"[\w./-]+\.(md|py)", word)
            ):
                found.add(word)
    return found


def test_readme_refers_only_to_files_in_the_repository() -> None:
    """Every file the README names is in the checkout (a bare file name anywhere in it)."""
    text = (ROOT / "README.md").read_text()
    named = _readme_references(text)
    assert {"benchmarks/bench.py", "docs/design.md"} <= named  # the scan sees the paths
    files = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts}
    missing = sorted(t for t in named if not (ROOT / t).exists() and ("/" in t or t not in files))
    assert not missing, f"the README names files that are not in the repository: {missing}"
    assert "ANCHORS" not in text and "shared/" not in text


def test_pyproject_uses_the_spdx_license_field() -> None:
    """``license = "Apache-2.0"`` (PEP 639) needs setuptools >= 77; the TOML table that
    setuptools deprecates is gone."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    requires = meta["build-system"]["requires"]
    assert "setuptools>=77" in requires


def test_progress_into_a_pipe_is_whole_lines(tmp_path: Path, corpus_file: Path) -> None:
    """With stdout and stderr on pipes, progress comes as whole lines, in order with the
    header and the validation losses: no carriage-return redraws of a bar."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, "-m", "ramflow", "train", "--data", str(corpus_file)]
        + ["--steps", "6", "--eval-every", "3", "--seq-len", "32", "--batch-size", "2"]
        + ["--eval-batches", "1", "--device", "cpu", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "\r" not in proc.stderr
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if re.match(r"step \d+/6: loss ", line)]
    # a twentieth of 6 steps rounds up to a line every step
    assert [int(line.split("/")[0].split()[1]) for line in progress] == list(range(1, 7))
    assert all("tok/s" in line and "RAM" in line for line in progress)
    order = [line.split(":")[0] for line in lines if line.startswith("step ")]
    assert order == [
        "step 0",
        "step 1/6",
        "step 2/6",
        "step 3/6",
        "step 3",
        "step 4/6",
        "step 5/6",
        "step 6/6",
        "step 6",
    ]
    assert lines[0].startswith("tiny: fits this machine: ")


# What a line about something other than the user's run looks like: a Python warning
# ("FutureWarning: ...", "warnings.warn(" as its source line), a logging warning of torch's
# format ("W1127 04:41:23.656000 6139 torch/..."), or torchao's "Failed to load".
_NOT_ABOUT_THE_RUN = re.compile(r"warn|deprecat|^[WE]\d{4} \d\d:|Failed to load", re.IGNORECASE)


def _ramflow(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """``ramflow ARGV`` in a fresh process (import-time messages are printed once per
    process), its output on pipes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "ramflow", *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_commands_print_only_lines_about_the_run(tmp_path: Path, corpus_file: Path) -> None:
    """With the test extra installed (torchao, PEFT, TRL, ...), ``--help``, ``plan``,
    ``train``, ``train --lora`` and ``generate`` print nothing on stderr and no warning on
    stdout: see [Note: quiet imports] in ``ramflow/_quiet.py``."""
    fast = ("--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--device", "cpu")
    run, lora = tmp_path / "run", tmp_path / "lora"
    commands = [
        ("--help",),
        ("plan", "--seq-len", "32", "--batch-size", "2", "--device", "cpu"),
        ("train", "--data", corpus_file, "--steps", "2", "--out", run, *fast),
        ("generate", "--model", run, "--prompt", "def ", "--max-new-tokens", "4"),
        ("train", "--model", run / "checkpoints" / "step-00000002", "--lora", "4")
        + ("--data", corpus_file, "--steps", "1", "--eval-every", "0", "--out", lora, *fast),
    ]
    for argv in commands:
        proc = _ramflow(*argv)
        command = " ".join(map(str, argv[:1]))
        assert proc.returncode == 0, f"ramflow {command}: {proc.stderr}"
        assert proc.stderr == "", f"ramflow {command} printed on stderr:\n{proc.stderr}"
        unexpected = [line for line in proc.stdout.splitlines() if _NOT_ABOUT_THE_RUN.search(line)]
        assert not unexpected, f"ramflow {command} printed: {unexpected}"


@pytest.mark.parametrize("interactive", [False, True])
def test_slow_tokenizing_says_so_on_stderr(capsys, monkeypatch, interactive: bool) -> None:
    """Work that outlasts the delay gets a line (a pipe) or a tqdm bar (a terminal) on
    stderr; quick work prints nothing."""
    from ramflow.train import data
    from ramflow.train.report import SlowProgress

    with SlowProgress(100, desc="quick", delay_s=60, interactive=interactive) as p:
        p.update(100)
    assert capsys.readouterr() == ("", "")
    with SlowProgress(100, desc="tokenizing 2 documents", delay_s=0, interactive=interactive) as p:
        p.update(60)
        p.update(40)
    out, err = capsys.readouterr()
    assert out == "" and "tokenizing 2 documents" in err
    if not interactive:
        assert err.splitlines()[0] == "tokenizing 2 documents ..."
        assert err.splitlines()[1].startswith("tokenizing 2 documents: done in ")
    # ranks other than 0 tokenize the same corpus silently: one notice per run
    monkeypatch.setenv("RANK", "1")
    with SlowProgress(100, desc="tokenizing 2 documents", delay_s=0, interactive=interactive) as p:
        p.update(100)
    assert capsys.readouterr() == ("", "")
    monkeypatch.delenv("RANK")

    class Words:  # a tokenizer that is not the byte tokenizer: encoded in chunks
        name = "words"

        def encode_batch(self, texts: list[str]) -> list[list[int]]:
            return [[len(w) for w in t.split()] for t in texts]

    monkeypatch.setattr(data, "_ENCODE_CHUNK_CHARS", 5)  # a chunk per document or two
    texts = ["a bb ccc", "dd", "dd", "ee f"]
    assert [t.tolist() for t in data._token_tensor(Words(), texts)] == [[1, 2, 3], [2], [2], [2, 1]]
