"""``ramflow train`` (the CLI) per host format: its step with lean against fp32 on one model
and budget (issue 30, point 3: lean at most 1.0x fp32 in every loop, the CLI included).

Runs ``python -m ramflow train`` once per host format (``--host-precision fp32,lean``) and per
clipping (``--clip-grad 1.0,0``: the CLI's default clips, which defers every step to after
backward; 0 lets the units step during backward), each in a process of its own, with the
same ``--preset``, ``--batch-size``, ``--seq-len``, ``--gpu-memory`` (the CLI's budget for
the whole run) and ``--steps``, no evaluation and no checkpoint before the end. ``--device-
optimizer`` is left to the planner, as a user leaves it. The step of a run is the median of
``step_s`` in its ``log.jsonl`` after ``--warmup`` steps; each format's step is given
against fp32's with the same clipping.

GPU box, from the repository root (one H100: about 4 minutes)::

    PYTHONUNBUFFERED=1 python3 benchmarks/trainer_step/cli_formats.py --out-dir $OUT/cli

CPU smoke test (the tiny preset, sequences of 64; about a minute)::

    python benchmarks/trainer_step/cli_formats.py --smoke --out-dir /tmp/cli-formats

Writes ``<out-dir>/cli_formats.{json,md}``, rewritten after each run (a run cut short keeps
what ran), and each run's folder ``<out-dir>/<format>-clip<value>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the harness's modules

import harness  # noqa: E402
from smoke_corpus import smoke_corpus  # noqa: E402

REFERENCE_FORMAT = "fp32"
NEVER = 10**9  # --eval-every / --save-every: not before the end of the run


def run_command(args: argparse.Namespace, fmt: str, clip: float, out: Path) -> list[str]:
    """The ``ramflow train`` command line of one run."""
    cmd = [
        sys.executable, "-m", "ramflow", "train", "--preset", args.preset,
        "--host-precision", fmt, "--clip-grad", str(clip), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--eval-every", str(NEVER), "--save-every", str(NEVER), "--keep-checkpoints", "0",
        "--eval-batches", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    if args.gpu_memory:
        cmd += ["--gpu-memory", args.gpu_memory]
    if args.device:
        cmd += ["--device", args.device]
    if args.data:
        cmd += ["--data", str(args.data)]
    return cmd


def record_of(log: Path, warmup: int) -> dict[str, Any]:
    """The median step after ``warmup`` steps, the step times and the run's end record,
    from a run folder's ``log.jsonl``.

    Raises:
        ValueError: the log holds no more steps than ``warmup``.
    """
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [e for e in events if e.get("event") == "step"]
    if len(steps) <= warmup:
        raise ValueError(f"{log}: {len(steps)} steps, none after the {warmup} warm-up steps")
    times = [float(e["step_s"]) for e in steps]
    end = next((e for e in events if e.get("event") == "end"), {})
    start = next((e for e in events if e.get("event") == "start"), {})
    return {
        "step_s": statistics.median(times[warmup:]),
        "step_times_s": times,
        # None per rank on the CPU (no device memory to read)
        "peak_gpu_bytes": max((b or 0) for b in end.get("peak_gpu_bytes_per_rank") or [0]),
        "peak_host_bytes": max((b or 0) for b in end.get("peak_host_bytes_per_rank") or [0]),
        "device_optimizer": start.get("config", {}).get("device_optimizer"),
        "final_loss": float(steps[-1]["loss"]),
    }


def report(doc: dict[str, Any]) -> str:
    """The markdown table: one row per run, its step against fp32's with the same clip."""
    meta = doc["meta"]
    ref = {
        r["clip_grad"]: r["step_s"]
        for r in doc["records"]
        if r["host_precision"] == REFERENCE_FORMAT and "step_s" in r
    }
    lines = [
        f"# `ramflow train` per host format ({meta['device']}, {meta['date']})",
        "",
        f"`{meta['command']}`; each run: `{meta['run_command']}`; step = median of `step_s` "
        f"in log.jsonl after {meta['warmup']} warm-up steps.",
        "",
        "| --clip-grad | host formats | step | x fp32 | <= 1.0x | steps | peak GPU | peak host |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = total = 0
    for r in doc["records"]:
        if "step_s" not in r:
            lines.append(
                f"| {r['clip_grad']} | {r['host_precision']} | failed: {r['error']} | | | | | |"
            )
            continue
        ratio, meets = "-", "-"
        if r["host_precision"] != REFERENCE_FORMAT and r["clip_grad"] in ref:
            x = r["step_s"] / ref[r["clip_grad"]]
            ratio, meets = f"{x:.2f}x", "yes" if x <= 1.0 else "no"
            total += 1
            ok += x <= 1.0
        lines.append(
            f"| {r['clip_grad']} | {r['host_precision']} | {r['step_s'] * 1e3:.0f} ms | {ratio} "
            f"| {meets} | {len(r['step_times_s'])} | {r['peak_gpu_bytes'] / 2**30:.1f} GiB "
            f"| {r['peak_host_bytes'] / 2**30:.1f} GiB |"
        )
    lines += ["", f"At most 1.0x fp32: {ok} of {total} runs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--host-precision", default="fp32,lean", help="comma-separated formats")
    p.add_argument("--clip-grad", default="1.0,0", help="comma-separated --clip-grad values")
    p.add_argument("--preset", default="anchor-2.7b")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--gpu-memory", default="12GiB", help="the CLI's budget; '' for its default")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="", help="the CLI's --device ('' for its default)")
    p.add_argument("--budget-s", type=float, default=480.0, help="no new run after this")
    p.add_argument("--data", type=Path, default=None, help="corpus (default: the stdlib sources)")
    p.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, 64 tokens")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.preset, args.batch_size, args.seq_len = "tiny", 2, 64
        args.gpu_memory, args.device, args.steps, args.warmup = "", "cpu", 4, 1
        args.data = args.data or smoke_corpus(args.out_dir)
    formats = [f for f in args.host_precision.split(",") if f]
    clips = [float(c) for c in args.clip_grad.split(",") if c]
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available() and args.device != "cpu"
        else "cpu"
    )
    doc: dict[str, Any] = {
        "meta": {
            "device": device,
            "date": date.today().isoformat(),
            "command": " ".join(["cli_formats.py", *(argv if argv is not None else sys.argv[1:])]),
            "run_command": " ".join(run_command(args, "FORMAT", 0.0, Path("DIR"))[1:]),
            "warmup": args.warmup,
            "commit": harness._commit(),
        },
        "records": [],
    }
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    t0 = time.perf_counter()
    for clip in clips:
        for fmt in formats:
            rec: dict[str, Any] = {"host_precision": fmt, "clip_grad": clip}
            if time.perf_counter() - t0 > args.budget_s:
                rec["error"] = "out of --budget-s"
                doc["records"].append(rec)
                continue
            out = args.out_dir / f"{fmt}-clip{clip:g}"
            proc = subprocess.run(
                run_command(args, fmt, clip, out), capture_output=True, text=True, env=env
            )
            (args.out_dir / f"{fmt}-clip{clip:g}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                rec["error"] = f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
            else:
                rec.update(record_of(out / "log.jsonl", args.warmup))
            doc["records"].append(rec)
            (args.out_dir / "cli_formats.json").write_text(json.dumps(doc, indent=1))
            (args.out_dir / "cli_formats.md").write_text(report(doc))
            print(f"{fmt} clip {clip:g}: {rec.get('step_s', rec.get('error'))}", flush=True)
    print(report(doc))
    return 0 if all("step_s" in r for r in doc["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
