"""Bad input gets a clear error (exit status 2) and leaves no partial state behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ramflow.train import open_checkpoint
from ramflow.train.report import read_log
from ramflow.train.run_checkpoint import state_checksum


def _tree(path: Path) -> dict[str, int]:
    """Every file under ``path`` with its size: to show that nothing changed."""
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


def _fails(ramflow_cli, capsys, *argv, expect: str) -> str:
    rc = ramflow_cli(*argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "error:" in err and expect in err, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def run_copy(tmp_path: Path, trained_run: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


def test_missing_data_path(tmp_path: Path, ramflow_cli, capsys, fast) -> None:
    out = tmp_path / "out"
    _fails(
        ramflow_cli,
        capsys,
        "train",
        "--data",
        tmp_path / "nope.txt",
        "--out",
        out,
        *fast,
        expect="nope.txt",
    )
    assert not out.exists()


def test_empty_corpus(tmp_path: Path, ramflow_cli, capsys, fast) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("")
    (data / "b.md").write_text("")
    out = tmp_path / "out"
    _fails(
        ramflow_cli, capsys, "train", "--data", data, "--out", out, *fast, expect="no text found"
    )
    assert not out.exists()


def test_corpus_too_small_for_one_sequence(tmp_path: Path, ramflow_cli, capsys, fast) -> None:
    data = tmp_path / "tiny.txt"
    data.write_text("print('hi')\n")
    out = tmp_path / "out"
    _fails(ramflow_cli, capsys, "train", "--data", data, "--out", out, *fast, expect="too small")
    assert not out.exists()


def test_malformed_json_lines(tmp_path: Path, ramflow_cli, capsys, fast) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    _fails(
        ramflow_cli,
        capsys,
        "train",
        "--data",
        data,
        "--out",
        tmp_path / "out",
        *fast,
        expect="d.jsonl:2",
    )
    assert not (tmp_path / "out").exists()


def test_budget_too_small(tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast) -> None:
    out = tmp_path / "out"
    err = _fails(
        ramflow_cli,
        capsys,
        "train",
        "--data",
        corpus_file,
        "--gpu-memory",
        "1MiB",
        "--out",
        out,
        *fast,
        expect="too small",
    )
    assert "--gpu-memory" in err  # says what to give instead
    assert not out.exists()
    # plan answers with its verdict: the first line says it does not fit and what does
    assert ramflow_cli("plan", "--preset", "tiny", "--gpu-memory", "1MiB") == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("tiny: DOES NOT FIT this budget: --gpu-memory 1.00 MiB is too small")
    assert "Give --gpu-memory" in first


def test_ram_too_small_is_refused_before_anything_is_built(
    tmp_path: Path, corpus_file: Path, ramflow_cli, capsys
) -> None:
    from ramflow.train import TrainConfig, plan_run

    config = TrainConfig.from_options(preset="llama-8b", device="cpu")
    est = plan_run(config)
    if est.fits_ram:
        pytest.skip("this machine has the RAM for an 8B model on the CPU")
    out = tmp_path / "out"
    err = _fails(
        ramflow_cli, capsys, "train", "--preset", "llama-8b", "--device", "cpu", "--data",
        corpus_file, "--out", out, expect="of RAM",
    )  # fmt: skip
    assert "available" in err
    assert not out.exists()


def test_unreadable_budget_and_bad_settings(
    tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast
) -> None:
    out = tmp_path / "out"
    _fails(ramflow_cli, capsys, "train", "--gpu-memory", "lots", "--out", out, expect="lots")
    _fails(
        ramflow_cli,
        capsys,
        "train",
        "--data",
        corpus_file,
        "--seq-len",
        "4096",
        "--out",
        out,
        expect="context",
    )
    _fails(ramflow_cli, capsys, "train", "--steps", "0", "--out", out, expect="--steps")
    assert not out.exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--clip-grad", "nan"),
        ("--clip-grad", "inf"),
        ("--weight-decay", "nan"),
        ("--weight-decay", "-1"),
        ("--lr", "inf"),
        ("--min-lr-ratio", "5"),
        ("--min-lr-ratio", "nan"),
        ("--val-fraction", "nan"),
    ],
)
def test_non_finite_or_out_of_range_floats_are_refused_before_anything_is_written(
    tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast, flag: str, value: str
) -> None:
    out = tmp_path / "out"
    _fails(
        ramflow_cli, capsys, "train", "--data", corpus_file, *fast, flag, value, "--out", out,
        expect=flag,
    )  # fmt: skip
    assert not out.exists()  # so the corrected command can use the same --out


@pytest.mark.parametrize("flag", ["--gpu-tflops", "--pcie-gbps", "--cpu-adamw-gparams"])
def test_plan_refuses_non_finite_rates(ramflow_cli, capsys, flag: str) -> None:
    _fails(ramflow_cli, capsys, "plan", "--preset", "tiny", flag, "nan", expect=flag)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "state"])
def test_corrupt_checkpoint_is_refused_and_nothing_changes(
    run_copy: Path, ramflow_cli, capsys, damage: str
) -> None:
    ckpt = open_checkpoint(run_copy).path
    weights = ckpt / "model.safetensors"
    if damage == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        expect = "truncated"
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0xFF
        weights.write_bytes(bytes(data))
        expect = "checksum"
    elif damage == "delete":
        (ckpt / "optimizer.safetensors").unlink()
        expect = "missing"
    else:
        state = ckpt / "trainer_state.json"
        state.write_text(state.read_text()[:200])
        expect = "unreadable"
    before = _tree(run_copy)
    _fails(
        ramflow_cli,
        capsys,
        "train",
        "--resume",
        run_copy,
        "--steps",
        "12",
        "--no-progress",
        expect=expect,
    )
    assert _tree(run_copy) == before


def test_checkpoint_of_another_model_shape(run_copy: Path, ramflow_cli, capsys) -> None:
    before = _tree(run_copy)
    _fails(
        ramflow_cli,
        capsys,
        "train",
        "--resume",
        run_copy,
        "--preset",
        "llama-1b",
        expect="another model shape",
    )
    _fails(ramflow_cli, capsys, "train", "--resume", run_copy, "--lr", "0.5", expect="--lr")
    assert _tree(run_copy) == before


def test_weights_of_another_shape_than_their_config(
    tmp_path: Path, run_copy: Path, ramflow_cli, capsys, fast
) -> None:
    """A model folder whose config no longer matches its weights (hidden size edited)."""
    model_dir = tmp_path / "model"
    shutil.copytree(open_checkpoint(run_copy).path, model_dir)
    # a plain Hugging Face folder: a ramflow checkpoint's manifest would refuse the edit
    (model_dir / "trainer_state.json").unlink()
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 512
    (model_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    err = _fails(
        ramflow_cli,
        capsys,
        "train",
        "--model",
        model_dir,
        "--out",
        out,
        *fast,
        expect="another model shape",
    )
    assert "mlp" in err  # names the tensors
    assert not out.exists()
    _fails(
        ramflow_cli,
        capsys,
        "generate",
        "--model",
        model_dir,
        "--prompt",
        "x",
        expect="another model shape",
    )


def test_no_checkpoint_to_resume(tmp_path: Path, ramflow_cli, capsys) -> None:
    (tmp_path / "empty").mkdir()
    _fails(ramflow_cli, capsys, "train", "--resume", tmp_path / "empty", expect="no checkpoint")
    _fails(ramflow_cli, capsys, "train", "--resume", tmp_path / "absent", expect="absent")


def test_interrupted_log_beyond_the_checkpoint_is_dropped_on_resume(
    run_copy: Path, ramflow_cli
) -> None:
    """A crash after the last checkpoint leaves log lines of steps the resumed run redoes."""
    log = run_copy / "log.jsonl"
    records = read_log(log)
    with log.open("a") as f:
        f.write('{"event": "step", "step": 9, "loss": 1.0}\n{"event": "step", "step": 10, "lo')
    assert ramflow_cli("train", "--resume", run_copy, "--steps", "10", "--no-progress") == 0
    steps = [r["step"] for r in read_log(log) if r["event"] == "step"]
    assert steps == list(range(1, 11))
    assert read_log(log)[: len(records)] == records


def _drop(state: dict, key: str) -> None:
    del state[key]


MALFORMED_STATES = {
    "step is text": lambda s: s.update(step="eight"),
    "no manifest": lambda s: _drop(s, "files"),
    "manifest entry without size": lambda s: s["files"]["model.safetensors"].pop("bytes"),
    "no data position": lambda s: _drop(s, "data_position"),
    "no scheduler step": lambda s: s["scheduler"].pop("last_epoch"),
    "random state cut": lambda s: s["python_random"][1].pop(),
    "optimizer without names": lambda s: s["optimizer"].pop("param_names"),
    "unknown setting": lambda s: s["train_config"].update(warp_factor=9),
    "setting of the wrong type": lambda s: s["train_config"].update(batch_size="two"),
}


@pytest.mark.parametrize("damage", MALFORMED_STATES)
def test_malformed_trainer_state_is_refused_before_anything_is_written(
    run_copy: Path, ramflow_cli, capsys, damage: str
) -> None:
    """Valid JSON with fields missing or of the wrong kind: one line, exit 2, no change."""
    state_file = open_checkpoint(run_copy, verify=False).path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    MALFORMED_STATES[damage](state)
    # signed again: these are the checks of a state whose checksum agrees
    state["state_sha256"] = state_checksum(state)
    state_file.write_text(json.dumps(state))
    before = _tree(run_copy)
    err = _fails(
        ramflow_cli, capsys, "train", "--resume", run_copy, "--steps", "12", "--no-progress",
        expect="malformed",
    )  # fmt: skip
    assert len(err.strip().splitlines()) == 1
    assert _tree(run_copy) == before


def test_out_at_an_existing_run_refuses_and_names_resume(
    run_copy: Path, tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast
) -> None:
    before = _tree(run_copy)
    err = _fails(
        ramflow_cli, capsys, "train", "--data", corpus_file, "--out", run_copy, *fast,
        expect="already holds a run",
    )  # fmt: skip
    assert f"--resume {run_copy}" in err
    # nor may a resumed run write into another run's folder
    other = tmp_path / "other"
    shutil.copytree(run_copy, other)
    _fails(
        ramflow_cli, capsys, "train", "--resume", run_copy, "--steps", "9", "--out", other,
        "--no-progress", expect="already holds a run",
    )  # fmt: skip
    assert _tree(run_copy) == before == _tree(other)


def test_generate_checks_checksums_as_resume_does(run_copy: Path, ramflow_cli, capsys) -> None:
    weights = open_checkpoint(run_copy).path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # still a readable safetensors file, with other weights
    weights.write_bytes(bytes(data))
    for model in (run_copy, weights.parent):
        _fails(
            ramflow_cli, capsys, "generate", "--model", model, "--prompt", "x",
            "--max-new-tokens", "1", expect="checksum",
        )  # fmt: skip


def test_out_at_a_file_is_refused(tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast):
    """It used to end in a raw "[Errno 17] File exists"."""
    out = tmp_path / "a-file"
    out.write_text("mine")
    _fails(
        ramflow_cli, capsys, "train", "--data", corpus_file, "--out", out, *fast,
        expect="is a file, not a folder",
    )  # fmt: skip
    assert out.read_text() == "mine"


def test_a_misspelt_choice_is_one_line_with_the_closest_and_version_answers():
    """argparse's usage errors are one line on stderr (no usage block) naming the closest
    choice; ``--version`` prints the package's version."""
    import subprocess
    import sys

    import ramflow

    bad = subprocess.run(
        [sys.executable, "-m", "ramflow", "train", "--host-precision", "lena"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean 'lean'?" in lines[0], bad.stderr
    version = subprocess.run(
        [sys.executable, "-m", "ramflow", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip() == f"ramflow {ramflow.__version__}"


def test_a_run_folder_that_cannot_be_written_is_refused_before_anything_runs(tmp_path) -> None:
    """``--out`` under a file, or on a file system that takes no folders (``/proc``), is
    one line naming the place, not a disk-space verdict of 0 B or an OSError later; a
    writable place is left as it was (the probe folder is removed)."""
    from ramflow.train.trainer import check_writable

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"^--out .*a-file/run: cannot write in .*a-file \("):
        check_writable(tmp_path / "a-file" / "run")
    if Path("/proc/self").exists():
        with pytest.raises(ValueError, match=r"^--out /proc/run: cannot write in /proc \("):
            check_writable(Path("/proc/run"))
    check_writable(tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
