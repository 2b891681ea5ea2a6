"""``ramflow profile`` on the CPU with the tiny preset: the files it promises, and the
plain and offloaded runs side by side computing the same first step."""

from __future__ import annotations

import json
from pathlib import Path

from ramflow.train.profile import SNAPSHOT_NOTE_CPU


def test_profile_writes_the_reports_plain_and_offloaded(
    tmp_path: Path, ramflow_cli, capsys
) -> None:
    out = tmp_path / "profile"
    argv = ("profile", "--preset", "tiny", "--device", "cpu", "--seq-len", "16", "--steps", "2")
    assert ramflow_cli(*argv, "--offload", "--out", out) == 0
    printed = capsys.readouterr().out
    assert "plain" in printed and "offloaded" in printed and SNAPSHOT_NOTE_CPU in printed

    summary = json.loads((out / "summary.json").read_text())
    assert summary["snapshot_note"] == SNAPSHOT_NOTE_CPU  # CPU: no allocator history
    assert not list(out.glob("snapshot-*"))
    plain, offloaded = summary["variants"]
    assert (plain["name"], offloaded["name"]) == ("plain", "offloaded")
    for v in (plain, offloaded):
        assert v["completed"] and len(v["losses"]) == 2
        assert Path(v["timeline"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert v["peak_device_bytes"] is None and v["peak_host_rss_bytes"] > 0
    # same weights, same tokens, fp32 on the CPU: offloading computes the same forward
    assert offloaded["losses"][0] == plain["losses"][0]

    report = (out / "activations.txt").read_text()
    assert summary["activation_bytes"] > 0 and "model.layers.0" in report


def test_profile_refuses_bad_sizes(tmp_path: Path, ramflow_cli, capsys) -> None:
    assert ramflow_cli("profile", "--device", "cpu", "--steps", "0", "--out", tmp_path) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
