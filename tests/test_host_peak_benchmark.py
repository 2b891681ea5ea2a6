"""benchmarks/memory/host_peak.py --smoke: the issue 48 host-peak benchmark runs its plain
loop and ``ramflow train`` cases on tiny shapes on the CPU and writes its JSON and table.
(The figures are the GPU box's to give; here only the pipeline is checked, in this process,
so the VmHWM read is the test process's.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory" / "host_peak.py"


def test_smoke_runs_the_plain_loop_and_the_cli_and_writes_the_table(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("host_peak", SCRIPT)
    host_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_peak)
    argv = ["--smoke", "--in-process", "--archs", "qwen3_moe", "--clip-grads", "1.0"]
    assert host_peak.main([*argv, "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "host_peak.json").read_text())
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == {"plain", "cli"}
    for r in rows.values():
        assert "error" not in r, r
        # the planned peak is the plan's host bytes plus the runtime it assumes
        assert r["host_planned_bytes"] > r["host_store_planned_bytes"] > 0
        assert r["host_peak_bytes"] > 0 and r["gpu_peak_bytes"] is None  # a CPU run
    table = (tmp_path / "host_peak.md").read_text()
    assert table.count("| qwen3_moe |") == 2
