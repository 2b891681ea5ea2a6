"""benchmarks/long_context/long_context.py --tiny runs on the CPU and writes its report: both
modes at each length of its ladder from one offloaded model, the longest that fits, the
toolkit rows. (Its figures are the GPU box's to give; here only the pipeline is checked.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context" / "long_context.py"
sys.path.insert(0, str(SCRIPT.parent))

import long_context_report as report  # noqa: E402

GIB = 2**30


def test_long_context_smoke_run_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "long_context.json").read_text())
    runs = {(r["mode"], r["seq"]): r for r in result["runs"]}
    assert {("offload", 128), ("on", 128), ("offload", 1024), ("on", 1024)} <= set(runs)
    assert all(r["fits"] and r["step_s"] > 0 and r["plan"]["step_s"] > 0 for r in runs.values())
    # the offload runs moved the inputs, the others did not: the plan's bytes say which
    assert runs[("offload", 1024)]["plan"]["offload_bytes"] > 0
    assert runs[("on", 1024)]["plan"]["offload_bytes"] == 0
    assert result["longest"]["offload"]["fits"] == 1024
    assert len(result["toolkit_rows"]) == 2
    md = (tmp_path / "long_context.md").read_text()
    assert "count attention FLOPs" in md and "| 1024 | offload | yes | step 2 of 2 |" in md
    assert (tmp_path / "long_context.log").read_text()
    # every run has the plan's host bytes and the measured peak RSS beside them
    assert all(r["plan"]["host_bytes"] > 0 and r["peak_host_bytes"] > 0 for r in runs.values())
    assert all(r["host_available_bytes"] >= r["plan"]["host_bytes"] for r in runs.values())
    # --merge of the run with itself gives the same runs and one table
    merged = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--merge", str(tmp_path / "long_context.json"),
         str(tmp_path / "long_context.json"), "--out-dir", str(merged)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = json.loads((merged / "long_context.json").read_text())
    assert {(r["mode"], r["seq"]) for r in again["runs"]} == set(runs)
    assert len(again["runs"]) == len(runs)
    assert again["longest"] == result["longest"] and again["toolkit_rows"] == result["toolkit_rows"]


def _run(mode: str, seq: int, fits, **kw) -> dict:
    plan = {"device_total_bytes": 40 * GIB, "step_s": 10.0, "host_bytes": 70 * GIB}
    base = {"mode": mode, "seq": seq, "plan": plan, "fits": fits}
    if fits:
        base.update(step_s=kw.pop("step_s", 10.0), peak_gpu_bytes=kw.pop("gpu", 30 * GIB))
        base.update(steps_run=1, peak_host_bytes=72 * GIB)
    return {**base, **kw}


def test_a_run_over_the_host_ram_counts_as_not_fitting_and_longest_uses_every_run() -> None:
    runs = [
        _run("offload", 8192, True),
        _run("offload", 131072, True),  # a toolkit length, above the ladder's last fit
        _run("offload", 98304, True),
        _run("offload", 163840, False, reason="host RAM: plan 140.0 GiB, available 125.0 GiB"),
        _run("on", 65536, True),
        _run("on", 131072, False, reason="out of memory", peak_gpu_bytes=65 * GIB),
        _run("on", 98304, None, skipped="skipped: budget"),
    ]
    assert report.longest(runs, "offload", 98304) == {
        "fits": 131072, "failed": 163840, "predicted": 98304
    }  # fmt: skip
    assert report.longest(runs, "on")["fits"] == 65536
    assert report.longest(runs, "on")["failed"] == 131072
    assert report.fate(runs[3]) == "no: host RAM: plan 140.0 GiB, available 125.0 GiB"


def test_toolkit_rows_say_when_checkpointing_alone_does_not_fit() -> None:
    runs = [
        _run("offload", 8192, True, step_s=1.8, gpu=7 * GIB),
        _run("on", 8192, True, step_s=1.6, gpu=9 * GIB),
        _run("offload", 131072, True, step_s=52.0, gpu=38 * GIB),
        _run("on", 131072, False, reason="out of memory", peak_gpu_bytes=65 * GIB),
        _run("offload", 65536, True),
        _run("on", 65536, None, skipped="skipped: budget"),
    ]
    rows = report.toolkit_rows(runs, [8192, 65536, 131072], "llama-8b", 76 * GIB)
    assert len(rows) == 3
    assert "8k tokens" in rows[0] and "| 2.00 GiB | 1800 ms | +12.5% |" in rows[0]
    assert "checkpointing alone: skipped: budget" in rows[1]
    assert (
        "128k tokens (llama-8b, B=1); checkpointing alone: does not fit (out of memory at "
        in (rows[2])
    )
    assert "plan 40.00 GiB of 76.00 GiB free" in rows[2]
    over = _run("on", 131072, False, reason="out of memory", peak_gpu_bytes=None)
    assert report.not_fit_reason(over, 30 * GIB) == "plan 40.00 GiB > 30.00 GiB free"


def test_merge_keeps_decided_runs_over_skipped_ones_and_refuses_other_models() -> None:
    meta = {"model": "llama-8b", "host_precision": "lean", "command": "a", "commit": "x"}
    one = {"meta": meta, "runs": [_run("on", 98304, None, skipped="skipped: budget")],
           "skipped": ["on at 98304: skipped: budget"]}  # fmt: skip
    two = {"meta": {**meta, "command": "b", "commit": "y"}, "runs": [_run("on", 98304, True)]}
    merged = report.merge_results([one, two], [98304])
    assert [r["fits"] for r in merged["runs"]] == [True]
    assert merged["skipped"] == [] and merged["meta"]["commands"] == ["a", "b"]
    assert merged["meta"]["commits"] == ["x", "y"]
    assert report.merge_results([two, one], [98304])["runs"][0]["fits"] is True
    with pytest.raises(ValueError, match="different runs"):
        report.merge_results([one, {**two, "meta": {**meta, "model": "tiny"}}], [98304])


def test_a_lean_run_plans_with_its_own_cpu_rate() -> None:
    """``_rates`` with the run's own formats' CPU rate (lean, measured by the one-pass lean
    step) keeps it as it is for a lean plan; a rate of fp32's is converted by
    ``OPTIMIZER_SPEED``, whose lean ratio lagged the FP8 kernels (with it the 8k plan was
    44-47% pessimistic on 2026-11-28). In a subprocess: the script puts benchmarks/ first on
    ``sys.path``, whose ``models`` is not the tests' own."""
    code = (
        "import sys; sys.argv = ['long_context.py']; import long_context as lc\n"
        "from ramflow import HostPrecision\n"
        "from ramflow.planner.cpu_rates import optimizer_speed, rates_for\n"
        "lean = HostPrecision.lean()\n"
        "own = rates_for(lc._rates({}, None, 5e9, 'lean'), lean)\n"
        "conv = rates_for(lc._rates({}, None, 5e9), lean)\n"
        "print(own.cpu_optimizer_params_per_s, conv.cpu_optimizer_params_per_s,"
        " 5e9 * optimizer_speed(lean))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env,
        cwd=SCRIPT.parent, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    own, converted, expected = map(float, proc.stdout.split()[-3:])
    assert own == 5e9
    assert converted == pytest.approx(expected)
