"""``benchmarks/moe/throughput.py --smoke``: the whole MoE throughput benchmark on the CPU
with tiny DeepSeek-V2 and Qwen3-MoE shapes, one process per case, with one case made to die
(``MOE_BENCH_DIE_IN``): the rows finished before it and after it are all kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_every_case_and_a_crash_loses_no_row(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MOE_BENCH_DIE_IN="ramflow.dsv2.lora")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/moe/throughput.py"), "--smoke",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        if r.get("kind") is None:
            by.setdefault(r["case"], []).append(r)
    full = by["ramflow.dsv2.full"]
    assert [r["loop"] for r in full] == ["unit-major", "ordinary"]
    for r in [*full, *by["ramflow.qwen3.Lauto.full"]]:
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["predicted_step_s"] > 0
        assert r["tokens_per_step"] == 2 * 2 * 32  # grad-accum x batch x seq
        # the plan's RAM (its runtime allowance dominates a tiny model's) and the case
        # process's peak, which holds torch: both read, in bytes
        assert r["host_planned_bytes"] > 2**28 and r["host_peak_bytes"] > 2**27
        assert r["mfu"] is None  # no dense bf16 peak on the CPU
    # the Qwen3 count: the smoke's RAM limit is 2.5 layers' plan
    assert by["ramflow.qwen3.Lauto.full"][0]["layers"] == 2
    (died,) = by["ramflow.dsv2.lora"]
    assert died["status"] == "failed" and "exit 3" in died["cause"]
    assert "dying as MOE_BENCH_DIE_IN asks" in died["cause"]
    for peer in ("deepspeed.dsv2.full", "deepspeed.dsv2.lora", "accelerate.dsv2.lora"):
        assert by[peer][0]["status"] == "skipped" and "CUDA" in by[peer][0]["cause"]
    table = (tmp_path / "throughput.md").read_text()
    assert table.count("| ramflow.dsv2.full | ramflow |") == 2
    assert "ramflow.dsv2.lora: failed" in table
