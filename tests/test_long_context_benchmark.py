"""benchmarks/long_context/long_context.py --tiny runs on the CPU and writes its report: both
modes at each length of its ladder from one offloaded model, the longest that fits, the
toolkit rows. (Its figures are the GPU box's to give; here only the pipeline is checked.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context" / "long_context.py"


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
    assert "count attention FLOPs" in md and "| 1024 | offload | yes |" in md
    assert (tmp_path / "long_context.log").read_text()
