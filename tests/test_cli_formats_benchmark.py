"""benchmarks/trainer_step/cli_formats.py --smoke runs ``ramflow train`` once per host format
and clipping on the CPU and writes its table of each format's step against fp32's. (Its
figures are the GPU box's to give; here only the pipeline and the table are checked.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_step" / "cli_formats.py"


def test_smoke_runs_the_cli_in_each_format_and_clipping(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2] / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    doc = json.loads((tmp_path / "cli_formats.json").read_text())
    runs = {(r["clip_grad"], r["host_precision"]): r for r in doc["records"]}
    assert list(runs) == [(1.0, "fp32"), (1.0, "lean"), (0.0, "fp32"), (0.0, "lean")]
    for (clip, fmt), r in runs.items():
        assert len(r["step_times_s"]) == 4 and r["step_s"] > 0
        # each run really trained in its format and with its clipping: the CLI's own output
        log = (tmp_path / f"{fmt}-clip{clip:g}.log").read_text()
        assert f"host formats {fmt}," in log, log[-1500:]
        config = json.loads((tmp_path / f"{fmt}-clip{clip:g}" / "run.json").read_text())
        assert config["config"]["clip_grad"] == clip
    table = (tmp_path / "cli_formats.md").read_text()
    assert table.count("| lean |") == 2 and "At most 1.0x fp32:" in table
