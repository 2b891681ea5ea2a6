"""``bench.py --report`` on the kept H200 suite: the joined report holds every case and every
target (pure Python; the benchmark code needs no torch here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SUITE = BENCH / "results" / "2026-11-22-nvidia-h200-suite"
# appended, not prepended: tests/models.py must keep its name ahead of benchmarks/models.py
sys.path.append(str(BENCH))

import bench  # noqa: E402


def test_report_joins_the_kept_suite_into_one_table(tmp_path: Path) -> None:
    parts = [str(SUITE / "part1.json"), str(SUITE / "part2.json")]
    assert bench.main(["--report", *parts, "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    text = (tmp_path / "report.md").read_text()
    ours = [t for t in doc["targets"] if t["met"] is not None]
    # 36 reference targets, all met in this run (README's "Measured speed")
    assert (len(ours), sum(t["met"] for t in ours)) == (36, 36)
    assert "targets (issue 4, reference model): 36 of 36 met" in text
    table = text.split("## Cases")[1].split("\n## ")[0].splitlines()
    rows = [line for line in table if line.startswith(("| reference", "| llama-3b"))]
    assert len(rows) == sum(1 for r in doc["rows"] if r["status"] == "ok")
    # llama-3b's three results outside their thresholds, each with its one-line reason
    misses = text.split("## Misses")[1].split("\n## ")[0].strip().splitlines()
    assert len(misses) == 3
    assert all(m.startswith("- outside (reported): llama-3b") and "needs" in m for m in misses)


def test_report_refuses_a_missing_file(tmp_path: Path, capsys) -> None:
    assert bench.main(["--report", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
