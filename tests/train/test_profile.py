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

    # the first step apart, and the steady step: the mean after the warm-up step
    for v in (plain, offloaded):
        assert v["first_step_s"] == v["step_s"][0]
        assert v["steady_steps"] == [2, 2] and v["steady_step_s"] == v["step_s"][1]
    first = next(line for line in printed.splitlines() if line.startswith("first step"))
    steady = next(line for line in printed.splitlines() if line.startswith("steady step "))
    assert first.split()[2:4] == [f"{plain['step_s'][0] * 1e3:.0f}", "ms"]
    assert f"{plain['steady_step_s'] * 1e3:.0f} ms (steps 2-2)" in steady
    assert "steady step: the mean after the first 1 (warm-up" in printed
    assert "mean step" not in printed

    report = (out / "activations.txt").read_text()
    assert summary["activation_bytes"] > 0 and "model.layers.0" in report


def test_profile_refuses_bad_sizes(tmp_path: Path, ramflow_cli, capsys) -> None:
    assert ramflow_cli("profile", "--device", "cpu", "--steps", "0", "--out", tmp_path) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_the_steady_step_leaves_out_the_warm_up_and_the_snapshot_step(tmp_path: Path) -> None:
    """On CUDA the last step records the allocator history: the steady step is the mean of
    the steps between the warm-up and it; too few steps give none, and the report says how
    many to ask for."""
    from ramflow.train.profile import ProfileResult, VariantProfile

    def variant(step_s: tuple[float, ...], snapshot: str | None) -> VariantProfile:
        return VariantProfile(
            "offloaded", True, None, (1.0,) * len(step_s), step_s, 0, 0, None, snapshot
        )

    cuda = variant((3.0, 0.1, 0.3, 0.9), "snapshot-offloaded.pickle")
    assert list(cuda.steady_steps) == [1, 2] and cuda.steady_step_s == 0.2
    assert cuda.timing() == {"first_step_s": 3.0, "steady_step_s": 0.2, "steady_steps": [2, 3]}
    short = variant((3.0, 0.9), "snapshot-offloaded.pickle")
    assert short.steady_step_s is None and short.timing()["steady_steps"] is None
    text = ProfileResult(tmp_path, "cuda:0", 2, 16, None, (cuda, short), None).describe()
    assert "200 ms (steps 2-3)" in text and "3000 ms" in text
    assert "without the last (it records the snapshot); give --steps 3 or more" in text
