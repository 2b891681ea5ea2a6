"""benchmarks/trainer_step/trainer_step.py --smoke runs the Trainer variants once per host
format on the CPU and writes its report with each format's step against fp32's. (Its figures
are the GPU box's to give; here only the pipeline and the table are checked.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_step" / "trainer_step.py"


@pytest.fixture(scope="module")
def trainer_step():
    """The script as a module. It puts benchmarks/ first on sys.path and imports
    benchmarks/models.py as ``models``, the name of tests/models.py too: sys.path and
    ``sys.modules["models"]`` are put back afterwards, so the other tests keep theirs."""
    path, models = list(sys.path), sys.modules.pop("models", None)
    try:
        spec = importlib.util.spec_from_file_location("trainer_step", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        sys.modules.pop("models", None)
        if models is not None:
            sys.modules["models"] = models
    return module


def test_smoke_runs_each_variant_in_each_format(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--variants", "trainer,trainer-clip",
         "--host-precision", "fp32,lean", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    (run,) = tmp_path.iterdir()
    doc = json.loads((run / "trainer_step.json").read_text())
    assert doc["meta"]["device_optimizer"] == "auto"  # the call a user writes
    runs = {(r["variant"], r["host_precision"]): r for r in doc["records"]}
    assert list(runs) == [("trainer", "fp32"), ("trainer", "lean"),
                          ("trainer-clip", "fp32"), ("trainer-clip", "lean")]  # fmt: skip
    for (variant, fmt), r in runs.items():
        assert r["step_s"] > 0 and r["device_optimizer"] == "auto"
        # each run really used its format: the plan's host bytes per trained parameter
        assert (r["host_bytes_per_parameter"] < 5) == (fmt == "lean"), (variant, fmt)
        # max_grad_norm=0 keeps every timed step during backward; a real clip defers them
        expect = r["timed_steps"] if variant == "trainer" else 0
        assert r["steps_in_backward"] == expect, (variant, fmt)
    # a clipping loop's optimizer keeps its gradients (else lean's ring refuses the clip)
    assert runs[("trainer-clip", "lean")]["keep_grads"] is True
    assert runs[("trainer", "lean")]["keep_grads"] is False
    md = (run / "trainer_step.md").read_text()
    assert "| trainer | lean |" in md and "| trainer-clip | lean |" in md
    assert "At most 1.0x fp32:" in md and " of 2 runs." in md


def _record(variant: str, fmt: str, step_s: float | None, **extra) -> dict:
    record = {"variant": variant, "host_precision": fmt, **extra}
    if step_s is not None:
        record.update(step_s=step_s, units=7, device_stepped_units=0, peak_bytes=0)
    return record


def test_each_format_is_compared_with_fp32_in_its_own_variant(trainer_step) -> None:
    records = [
        _record("bare", "fp32", 0.8),
        _record("bare", "lean", 1.0),
        _record("trainer", "fp32", 0.8),
        _record("trainer", "lean", 0.6),
        _record("trainer-clip", "fp32", 2.0),
        _record("trainer-clip", "lean", None, skipped="skipped: 40 s left, 150 s needed"),
        _record("bare-compiled", "lean", 0.5),  # no fp32 run to compare with
    ]
    cmp = trainer_step.against_reference(records)
    assert [c["ratio"] for c in cmp][:4] == [None, pytest.approx(1.25), None, pytest.approx(0.75)]
    assert [c["ok"] for c in cmp] == [None, False, None, True, None, None, None]
    meta = {"device": "cpu", "commit": "x", "batch": 4, "seq": 2048, "device_optimizer": "auto",
            "gpu_memory_bytes": None, "budget_from": "--gpu-memory 10GiB"}  # fmt: skip
    md = trainer_step.markdown({"meta": meta, "records": records})
    assert "| bare | lean | 1000 ms | 8192 | 1.25x | **no** | 1.00x |" in md
    assert "| trainer | lean | 600 ms | 13653 | 0.75x | yes | 0.60x |" in md
    assert "| trainer-clip | lean | skipped: 40 s left, 150 s needed |" in md
    assert "At most 1.0x fp32: 1 of 2 runs." in md
