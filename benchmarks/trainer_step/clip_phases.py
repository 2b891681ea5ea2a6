"""Where a clipped step's time goes: the phases of the loop that Hugging Face's ``Trainer``
runs, without and with a real clip, ramflow's folded clip against PyTorch's clip in place.

The reference model at 4x2048 tokens with the settings of ``trainer_step.py`` (the capped
suite case, ``device_optimizer`` left to the planner), the loop ``forward -> backward ->
torch.nn.utils.clip_grad_norm_ (routed to ramflow's, as accelerate calls it) -> step() ->
zero_grad()``. Variants, each run once per host format, each in a process of its own:

- ``noclip``: no clip call (the bare loop);
- ``norm``: ``max_norm=inf`` (the ``Trainer``'s ``max_grad_norm=0``: the norm only);
- ``clip``: ``max_norm=1.0`` (the ``Trainer``'s default): the norm from the device gradients,
  the coefficient applied by each unit's step (``ramflow.engine.grad_scale``);
- ``clip-inplace``: the same with ``RAMFLOW_CLIP_FOLD=0``: PyTorch's clip on the host
  gradients (a per-tensor norm, then a scale in place), as ramflow clipped before.

Per timed step, the main thread's wall seconds in each phase, with no synchronisation
between them (each phase holds the waits the loop really has there): ``forward`` (of it,
``forward waits``: waiting for units whose step or load had not ended), ``backward`` (of
it, ``finish``: the end of the pass, waiting for the last landings), ``clip`` (of it,
``norm``: read from the device norms, ``scale``: the fold, ``in place``: PyTorch's clip),
``step()`` (of it, ``uploads``: waiting until device steps have read host gradients),
``tail``: ``zero_grad`` and ``torch.cuda.synchronize`` at the step's end. The worker's
seconds per step beside them: ``landing`` (gradients into the host buffers) and
``optimizer`` (host steps' kernels). ``step`` is the wall clock between the ends of
consecutive steps (as ``trainer_step.py``); the median of each column is reported.

GPU box, from the repository root (one H100 or H200: about 6 minutes)::

    PYTHONUNBUFFERED=1 python3 benchmarks/trainer_step/clip_phases.py --out-dir $OUT \\
        --host-precision fp32,lean --budget-s 450

CPU smoke test (a 4-layer, 256-wide model, sequences of 128; about a minute)::

    python benchmarks/trainer_step/clip_phases.py --smoke --out-dir /tmp/clip-phases

Writes ``<out-dir>/<date>-<device>-clip-phases/clip_phases.{json,md}``, rewritten after each
run, so a run cut short keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "src")]

import torch  # noqa: E402

import harness  # noqa: E402
import measure  # noqa: E402
import runners  # noqa: E402
import trainer_step  # noqa: E402
from models import loss_of, make_batch, model_shape  # noqa: E402

# variant -> (max_norm given to clip_grad_norm_, None: no call; RAMFLOW_CLIP_FOLD)
VARIANTS: dict[str, tuple[float | None, str]] = {
    "clip": (1.0, "1"),
    "clip-inplace": (1.0, "0"),
    "norm": (math.inf, "1"),
    "noclip": (None, "1"),
}
# the 2026-11-27 calibration of trainer_step.py on one H100 (bytes), so that every run here
# plans as those did; --gpu-memory replaces it
DEFAULT_GPU_MEMORY = 10394318848
COLUMNS = (
    "step", "forward", "forward waits", "backward", "finish", "clip", "norm", "scale",
    "in place", "step()", "uploads", "tail", "landing", "optimizer",
)  # fmt: skip


class Clock:
    """Seconds per phase of the current step, from wrappers around ramflow's calls (the
    worker's phases are added from its thread, the others from the main thread)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.now[phase] = self.now.get(phase, 0.0) + seconds

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Time every call of ``owner.name`` (a module function or a bound method)."""
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        setattr(owner, name, timed)


def run_variant(variant: str, case: dict[str, Any], budget: int | None) -> dict[str, Any]:
    """One variant in one host format, in this process (``RAMFLOW_CLIP_FOLD`` set by the
    parent); returns its record."""
    import ramflow
    from ramflow.engine import clip as _clip
    from ramflow.units.registry import engine_of_model

    max_norm, _ = VARIANTS[variant]
    device = runners.compute_device()
    model_checkpoints, offload_kwargs = runners._offload_kwargs(case)
    model = runners._model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    ramflow.offload(model, gpu_memory=budget, device=device, **offload_kwargs)
    plan = ramflow.get_plan(model)
    clipping = max_norm is not None and max_norm < math.inf
    kwargs = trainer_step.optimizer_kwargs("trainer-clip" if clipping else "trainer")
    opt = ramflow.optim.AdamW(model.parameters(), **kwargs)
    engine = engine_of_model(model)
    clock = Clock()
    clock.wrap(_clip, "_norm_from_device", "norm")
    clock.wrap(_clip, "_scale", "scale")
    clock.wrap(_clip, "_TORCH_CLIP_GRAD_NORM", "in place")
    clock.wrap(engine.gradients, "finish_pass", "finish")
    clock.wrap(engine.gradients, "land", "landing")
    clock.wrap(engine.device_stepper, "wait_host_grad_reads", "uploads")
    rows: list[dict[str, float]] = []
    norm_sources: list[str] = []
    end = time.perf_counter()
    for i in range(case["warmup"] + case["steps"]):
        clock.now = {}
        waits0 = engine.window.wait_seconds.totals.get("units not current", 0.0)
        kernels0 = engine.host_stepper.host_step_totals()[1]
        t = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, ids, labels)
        t = _lap(clock, "forward", t)
        loss.backward()
        t = _lap(clock, "backward", t)
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norm_sources.append(norm.device.type)
            t = _lap(clock, "clip", t)
        opt.step()
        t = _lap(clock, "step()", t)
        opt.zero_grad()
        measure.sync(device)
        if i == case["warmup"] + case["steps"] - 1:
            ramflow.synchronize(model)  # the last step's host work is charged to the run
        t = _lap(clock, "tail", t)
        clock.add("step", t - end)
        clock.add(
            "forward waits",
            engine.window.wait_seconds.totals.get("units not current", 0.0) - waits0,
        )
        clock.add("optimizer", engine.host_stepper.host_step_totals()[1] - kernels0)
        end = t
        if i >= case["warmup"]:
            rows.append(dict(clock.now))
    medians = {c: statistics.median(r.get(c, 0.0) for r in rows) for c in COLUMNS}
    return {
        "variant": variant,
        "host_precision": case["host_precision"],
        "max_norm": max_norm,
        "clip_fold": os.environ.get("RAMFLOW_CLIP_FOLD", "0"),
        "gpu_memory_bytes": budget,
        "device_stepped_units": len(plan.device_stepped),
        "units": len(plan.unit_names),
        "norm_on": sorted(set(norm_sources)),
        "medians_s": medians,
        "steps_s": [r.get("step", 0.0) for r in rows],
        "phases_s": rows,
    }


def _lap(clock: Clock, phase: str, since: float) -> float:
    now = time.perf_counter()
    clock.add(phase, now - since)
    return now


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    out = [
        f"# Phases of a clipped step ({meta['device']}, commit {meta['commit']})",
        "",
        f"Reference model, {meta['batch']}x{meta['seq']} tokens, the capped suite case's "
        f"offload settings, `device_optimizer` auto, `gpu_memory` {meta['gpu_memory']}; median "
        "ms per timed step of each phase (main thread; `landing` and `optimizer` on the "
        "worker). `norm`/`scale`/`in place` are parts of `clip`, `forward waits` of "
        "`forward`, `finish` of `backward`, `uploads` of `step()`.",
        "",
        "| variant | format | device-stepped | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for r in doc["records"]:
        if "medians_s" not in r:
            why = r.get("skipped") or f"failed: {r.get('error', '?')}"
            line = str(why).strip().splitlines()[-1:] or ["?"]
            out.append(f"| {r['variant']} | {r['host_precision']} | {line[0][:160]} |")
            continue
        cells = " | ".join(f"{r['medians_s'][c] * 1e3:.0f}" for c in COLUMNS)
        stepped = f"{r['device_stepped_units']} of {r['units']}"
        out.append(f"| {r['variant']} | {r['host_precision']} | {stepped} | {cells} |")
    return "\n".join(out) + "\n"


def _run_child(args: argparse.Namespace, variant: str, fmt: str, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--format", fmt]
    cmd += ["--out-dir", str(args.out_dir), "--budget", str(args.budget)]
    cmd += ["--smoke"] * args.smoke
    env = {**harness.child_env(), "RAMFLOW_CLIP_FOLD": VARIANTS[variant][1]}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {
            "variant": variant,
            "host_precision": fmt,
            "error": f"timed out ({timeout_s:.0f} s)",
        }
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"variant": variant, "host_precision": fmt, "error": proc.stderr.strip()[-2000:]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/trainer_step/clip_phases.py", description=__doc__)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in order")
    p.add_argument("--host-precision", default="fp32,lean", help="comma-separated host formats")
    p.add_argument(
        "--gpu-memory",
        default=None,
        help=f"gpu_memory of every run (default {DEFAULT_GPU_MEMORY} bytes, trainer_step.py's "
        "calibration on one H100; none with --smoke)",
    )
    p.add_argument("--timeout-s", type=float, default=150.0, help="per run")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all runs")
    p.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--format", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--budget", default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:  # a child: one variant in one format, its record on the last line
        budget = None if args.budget == "none" else int(args.budget)
        case = trainer_step.case_of(args.smoke, args.format)
        print(json.dumps(run_variant(args.variant, case, budget), default=str), flush=True)
        return 0
    import ramflow

    try:
        variants = trainer_step._split(args.variants, tuple(VARIANTS), "--variants")
        formats = trainer_step._split(args.host_precision, trainer_step.FORMATS, "--host-precision")
        if args.gpu_memory is not None:
            args.budget = ramflow.parse_bytes(args.gpu_memory, what="--gpu-memory")
        else:
            args.budget = "none" if args.smoke else DEFAULT_GPU_MEMORY
    except (TypeError, ValueError) as err:
        p.error(str(err))
    case = trainer_step.case_of(args.smoke)
    meta = {
        "device": harness.device_name(),
        "commit": harness._commit(),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "batch": case["batch"],
        "seq": case["seq"],
        "gpu_memory": args.budget,
        "torch": torch.__version__,
    }
    stem = harness.run_dir(args.out_dir, "clip-phases") / "clip_phases"
    stem.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    longest = 0.0
    for fmt in formats:
        for variant in variants:
            left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
            if left is not None and left < max(1.1 * longest, 1.0):
                record = {
                    "variant": variant,
                    "host_precision": fmt,
                    "skipped": f"{left:.0f} s left",
                }
            else:
                timeout = args.timeout_s if left is None else min(args.timeout_s, left)
                start = time.perf_counter()
                record = _run_child(args, variant, fmt, timeout)
                record["wall_s"] = time.perf_counter() - start
                longest = max(longest, record["wall_s"])
            records.append(record)
            print(
                variant,
                fmt,
                record.get("medians_s", {}).get("step", record.get("skipped")),
                flush=True,
            )
            doc = {"meta": meta, "records": records}
            stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
            stem.with_suffix(".md").write_text(markdown(doc))
    print(stem.with_suffix(".md").read_text())
    return 0 if all("medians_s" in r or "skipped" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
