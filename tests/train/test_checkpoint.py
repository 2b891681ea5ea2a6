"""Checkpoint folders: atomic replacement, retention, and what ``find_checkpoint`` picks."""

from __future__ import annotations

import shutil
from pathlib import Path

from ramflow.train.checkpoint import LATEST_FILE, find_checkpoint, list_checkpoints, open_checkpoint


def test_run_folder_resolves_to_its_latest_checkpoint(tmp_path: Path, trained_run: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    root = run / "checkpoints"
    latest = open_checkpoint(run).path
    assert find_checkpoint(root) == latest == find_checkpoint(latest)
    # a temporary folder left by a crash mid-save is never mistaken for a checkpoint
    (root / ".step-00000009.tmp-123").mkdir()
    assert find_checkpoint(run) == latest
    # without the pointer file, the newest finished folder is used
    (root / LATEST_FILE).unlink()
    assert find_checkpoint(run) == latest


def test_only_the_newest_checkpoints_are_kept(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast
) -> None:
    out = tmp_path / "run"
    assert (
        ramflow_cli(
            "train",
            "--data",
            corpus_file,
            "--steps",
            "4",
            "--save-every",
            "1",
            "--eval-every",
            "0",
            "--keep-checkpoints",
            "2",
            "--out",
            out,
            *fast,
        )
        == 0
    )
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [
        "step-00000003",
        "step-00000004",
    ]
    assert (out / "checkpoints" / LATEST_FILE).read_text().strip() == "step-00000004"
    state = open_checkpoint(out).state
    assert state["data_position"] == 4 * 2 and state["tokens_seen"] == 4 * 2 * 32
    assert set(state["files"]) >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors"}
