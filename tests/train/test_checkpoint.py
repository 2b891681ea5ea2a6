"""Checkpoint folders: atomic replacement, retention, what ``find_checkpoint`` picks, the
clean-up after a killed save, and names that must stay inside the run folder."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ramflow.train.report import read_log
from ramflow.train.run_checkpoint import (
    LATEST_FILE,
    find_checkpoint,
    list_checkpoints,
    open_checkpoint,
    state_checksum,
)


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


def _hidden(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


def test_temporaries_of_a_killed_save_are_removed_at_the_next_start(
    tmp_path: Path, trained_run: Path, ramflow_cli
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    root = run / "checkpoints"
    shutil.copytree(root / "step-00000008", root / ".step-00000009.tmp-123")  # half a save
    (root / ".step-00000004.del-77").mkdir()  # half a deletion
    (root / ".latest.tmp-123").write_text("step-00000009\n")
    assert ramflow_cli("train", "--resume", run, "--steps", "9", "--no-progress") == 0
    assert _hidden(run) == []
    assert [p.name for p in list_checkpoints(root)] == ["step-00000009"]


def test_the_only_copy_left_by_an_earlier_same_step_save_is_restored(
    tmp_path: Path, trained_run: Path, ramflow_cli
) -> None:
    """An earlier ramflow saved a step again by renaming the old folder aside first; killed
    between its two renames, the aside folder was the run's only checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    root = run / "checkpoints"
    (root / "step-00000008").rename(root / ".step-00000008.old-4242")
    assert ramflow_cli("train", "--resume", run, "--steps", "9", "--no-progress") == 0
    assert [r["step"] for r in read_log(run / "log.jsonl") if r["event"] == "step"] == list(
        range(1, 10)
    )
    assert _hidden(run) == []


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_latest_must_name_a_checkpoint_of_this_run(
    tmp_path: Path, trained_run: Path, ramflow_cli, capsys, where: str
) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(trained_run, run)
    shutil.copytree(trained_run, other)
    target = other / "checkpoints" / "step-00000008"
    name = str(target) if where == "absolute" else "../../other/checkpoints/step-00000008"
    (run / "checkpoints" / LATEST_FILE).write_text(name + "\n")
    assert ramflow_cli("train", "--resume", run, "--steps", "9", "--no-progress") == 2
    err = capsys.readouterr().err
    assert "latest" in err and "not a file name inside" in err and "Traceback" not in err
    assert ramflow_cli("generate", "--model", run, "--prompt", "x", "--max-new-tokens", "1") == 2
    assert open_checkpoint(other).step == 8  # untouched


def test_manifest_entries_must_be_inside_the_checkpoint(
    tmp_path: Path, trained_run: Path, ramflow_cli, capsys
) -> None:
    """A manifest entry that points elsewhere is refused even when its checksum matches."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 10)
    state_file = open_checkpoint(run).path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["files"]["../../../outside.bin"] = {
        "bytes": 10,
        "sha256": hashlib.sha256(outside.read_bytes()).hexdigest(),
    }
    state_file.write_text(json.dumps(state))
    assert ramflow_cli("train", "--resume", run, "--steps", "9", "--no-progress") == 2
    err = capsys.readouterr().err
    assert "outside.bin" in err and "not a file name inside" in err and "Traceback" not in err


def test_index_entries_must_be_inside_the_model_folder(
    tmp_path: Path, trained_run: Path, ramflow_cli, capsys
) -> None:
    """A weights index (with a manifest that agrees) that sends the loader to another folder."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = open_checkpoint(run).path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ckpt / "model.safetensors").rename(elsewhere / "model.safetensors")
    index = ckpt / "model.safetensors.index.json"
    weights = load_file(str(elsewhere / "model.safetensors"))
    index.write_text(
        json.dumps({"weight_map": dict.fromkeys(weights, "../../../elsewhere/model.safetensors")})
    )
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["files"]["model.safetensors"]
    state["files"][index.name] = {
        "bytes": index.stat().st_size,
        "sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
    }
    state["state_sha256"] = state_checksum(state)  # a state whose checksum agrees
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    rc = ramflow_cli("generate", "--model", ckpt, "--prompt", "x", "--max-new-tokens", "1")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "elsewhere" in err and "not a file name inside" in err and "Traceback" not in err


def test_a_resumed_run_says_where_it_resumes_and_logs_it(
    tmp_path: Path, trained_run: Path, ramflow_cli, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    capsys.readouterr()
    assert ramflow_cli("train", "--resume", run, "--steps", "9", "--no-progress") == 0
    out = capsys.readouterr().out
    ckpt = run / "checkpoints" / "step-00000008"
    assert f"resuming from step 8 of 9: {ckpt}" in out, out
    records = read_log(run / "log.jsonl")
    starts = [r["step"] for r in records if r["event"] == "start"]
    assert starts == [0, 8]  # the first run's start, then the resumed one's
    resume = next(r for r in records if r["event"] == "resume")
    assert (resume["step"], resume["checkpoint"]) == (8, str(ckpt))
