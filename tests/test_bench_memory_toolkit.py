"""``benchmarks/memory_toolkit/memory_toolkit.py --smoke`` runs every technique end to end on the CPU and
writes its JSON and table (figures are not checked: timing lives in benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_every_technique(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory_toolkit" / "memory_toolkit.py"), "--smoke",
         "--device", "cpu", "--out-dir", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    data = json.loads((tmp_path / "memory_toolkit.json").read_text())
    rows = data["rows"]
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    groups = {r["group"] for r in rows}
    assert {"precision", "checkpointing", "gradient accumulation", "offload",
            "CPU only vs GPU + offload"} <= groups  # fmt: skip
    assert any(g.startswith("attention") for g in groups)
    techniques = [r["technique"] for r in rows if r["group"] == "checkpointing"]
    assert len(techniques) == 6  # none and the five policies
    # the policies measurably cut the saved activations, each as far as it should
    saved = {
        r["technique"]: r["saved_activation_bytes"] for r in rows if r["group"] == "checkpointing"
    }
    assert saved["every block"] < saved["every 2nd block"] < saved["none (bf16)"]
    for r in rows:  # each group's first row is its baseline
        assert r["step_cost"] is not None and r["step_s"] > 0
    table = (tmp_path / "memory_toolkit.md").read_text()
    assert table.count("\n| ") == len(rows) + 2  # header, rule and one line per row
