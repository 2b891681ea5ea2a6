"""The step of Hugging Face's ``Trainer`` on an offloaded model against the bare loop, per
host format.

The reference model at 4x2048 tokens with the offload settings of the suite's capped 4x2048
case (``runners.run_ramflow_train``: checkpointed blocks, chunked loss, the budget that keeps
the peak under 12 GiB, ``AdamW(keep_grads=False)``, ``keep_grads=True`` where the loop
clips), bf16 autocast. Variants, each run once per host format (``--host-precision
fp32,lean``), each run in a process of its own:

- ``bare``: the README's loop (``loss.backward(); opt.step(); opt.zero_grad()``);
- ``trainer``: ``Trainer`` with ``max_grad_norm=0`` (it reads the norm only, so units step
  during backward: the fast path);
- ``trainer-clip``: ``Trainer`` with ``max_grad_norm=1.0`` (a real clip: every step waits
  for ``optimizer.step()``);
- ``bare-compiled``: the bare loop with each decoder block compiled (``block.compile()``,
  inductor; ramflow's hooks run eagerly between the graphs), issue 15's point 6;
- ``trainer-accum``: ``Trainer`` with ``gradient_accumulation_steps=--accum`` (M) and
  ``max_grad_norm=0``: micro-batch after micro-batch, each unit loaded per micro-batch
  (``keep_grads=True``: with accumulation the plain ``Trainer`` cannot keep the promise of
  ``keep_grads=False``);
- ``trainer-unit-major``: the same with ``ramflow.train.UnitMajorTrainer``: the M
  micro-batches unit-major, each unit loaded twice per optimizer step
  (``keep_grads=False``).

The accumulating variants' step is one optimizer step of M micro-batches; ``x bare`` divides
it by M first. ``loads/step`` is the most H2D loads of one unit in a timed step
(``DeviceWindow.num_loads``).

The offload call is the one a user writes: ``ramflow.offload(model, gpu_memory=...,
host_precision=...)``, ``device_optimizer`` left to the planner (``--device-optimizer
auto``, the default). ``--device-optimizer on`` passes ``device_optimizer=True`` (every
resident unit whose states fit steps on the GPU), as the suite's cases and this script did
before 2026-11-28 (``results/2026-11-23-nvidia-h100-toolkit-trainer``).

Every run gets the same ``gpu_memory``: the one the first run finds (the bare fp32 run in
the default order) by the suite's calibration (``runners._ramflow_budget``: the cap minus
the activations one step measures with nothing resident), or ``--gpu-memory``. The
activations do not depend on the host format, so one calibration serves all formats, and a
format is then compared with fp32 on the same budget, not on its own calibration's noise.

A step is the wall clock between the ends of consecutive steps, each end after
``torch.cuda.synchronize()`` (for the Trainer in ``on_step_end``), after warm-ups; the
median is reported. ``steps_in_backward`` counts the timed Trainer steps whose units were
stepped during backward (the step policy's ``last_eager`` before ``optimizer.step()``; until
2026-11-28: the steps whose ``p.grad`` were None then, the same count with
``keep_grads=False``). The report gives each format's step against fp32's in the same
variant (issue 30, point 3: lean at most 1.0x fp32 in every loop).

GPU box, from the repository root (one H100: about 8 minutes)::

    PYTHONUNBUFFERED=1 python3 benchmarks/trainer_step/trainer_step.py --out-dir $OUT \\
        --variants bare,trainer,trainer-clip --host-precision fp32,lean --budget-s 500

The Trainer's accumulation, plain and unit-major (``--accum`` micro-batches per step)::

    PYTHONUNBUFFERED=1 python3 benchmarks/trainer_step/trainer_step.py --out-dir $OUT \\
        --variants bare,trainer-accum,trainer-unit-major --host-precision fp32,lean --accum 2

CPU smoke test (a 4-layer, 256-wide model, sequences of 128; about a minute)::

    python benchmarks/trainer_step/trainer_step.py --smoke --variants bare,trainer \\
        --host-precision fp32,lean --out-dir /tmp/trainer-step

Writes ``<out-dir>/<date>-<device>-trainer-step/trainer_step.{json,md}``, rewritten after
each run, so a run cut short keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402

import cases  # noqa: E402
import harness  # noqa: E402
import measure  # noqa: E402
import runners  # noqa: E402
from models import loss_of, make_batch, model_shape  # noqa: E402

VARIANTS = (
    "bare",
    "trainer",
    "trainer-clip",
    "bare-compiled",
    "trainer-accum",
    "trainer-unit-major",
)
MAX_GRAD_NORM = {
    "trainer": 0.0,
    "trainer-clip": 1.0,
    "trainer-accum": 0.0,
    "trainer-unit-major": 0.0,
}
ACCUMULATING = ("trainer-accum", "trainer-unit-major")  # run --accum micro-batches per step
FORMATS = ("fp32", "bf16", "lean", "kahan")  # ramflow.offload's host_precision presets
REFERENCE_FORMAT = "fp32"  # every other format's step is given against this one's
# --device-optimizer -> ramflow.offload(device_optimizer=...)
DEVICE_OPTIMIZER: dict[str, bool | None] = {"auto": None, "on": True}


def case_of(smoke: bool, host_precision: str = REFERENCE_FORMAT) -> dict[str, Any]:
    """The suite's capped 4x2048 training case (2x128 with ``smoke``) in one host format."""
    warmup, steps = (1, 3) if smoke else (2, 5)
    return {
        **cases._base("reference", smoke, warmup, steps),
        **cases.training_shapes(smoke)[0],
        "host_precision": host_precision,
    }


def optimizer_kwargs(variant: str) -> dict[str, Any]:
    """``ramflow.optim.AdamW``'s arguments: the suite's (``keep_grads=False``), except for a
    loop that clips, which cannot promise never to read the gradients: under the gradient
    ring of the non-fp32 formats ``keep_grads=False`` steps even the first backward during
    backward, and the clip is then refused; and the plain ``Trainer`` that accumulates,
    whose second backward would then come after a step. (fp32 is deferred there either
    way, so ``keep_grads`` changes nothing for it.)"""
    if MAX_GRAD_NORM.get(variant, 0.0) > 0 or variant == "trainer-accum":
        return {**runners.RAMFLOW_OPTIMIZER, "keep_grads": True}
    return dict(runners.RAMFLOW_OPTIMIZER)


def run_variant(
    variant: str,
    case: dict[str, Any],
    budget: int | None,
    *,
    calibrate: bool,
    device_optimizer: str,
    accum: int = 1,
) -> dict[str, Any]:
    """One variant in one host format, in this process; returns its record.

    ``calibrate``: find the budget first (``runners._ramflow_budget``) instead of ``budget``.
    ``accum``: micro-batches per optimizer step of the ``ACCUMULATING`` variants.
    """
    import ramflow

    device = runners.compute_device()
    model_checkpoints, offload_kwargs = runners._offload_kwargs(case)
    model = runners._model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    budget_info: dict[str, Any] = {}
    if calibrate:
        budget, budget_info = runners._ramflow_budget(case, model, ids, labels, device)
    ramflow.offload(
        model,
        gpu_memory=budget,
        device=device,
        device_optimizer=DEVICE_OPTIMIZER[device_optimizer],
        **offload_kwargs,
    )
    plan = ramflow.get_plan(model)
    opt = ramflow.optim.AdamW(model.parameters(), **optimizer_kwargs(variant))
    if variant == "bare-compiled":
        for block in model.layers:
            block.compile()
    if variant in ("bare", "bare-compiled"):
        res = measure.time_steps(
            runners._train_step(model, opt, ids, labels, device),
            device=device,
            warmup=case["warmup"],
            steps=case["steps"],
            drain=lambda: ramflow.synchronize(model),
        )
    else:
        micro_batches = accum if variant in ACCUMULATING else 1
        res = _time_trainer(
            model,
            opt,
            (ids, labels),
            device,
            case,
            MAX_GRAD_NORM[variant],
            micro_batches=micro_batches,
            unit_major=variant == "trainer-unit-major",
        )
    return {
        "variant": variant,
        "host_precision": case["host_precision"],
        "device_optimizer": device_optimizer,
        "gpu_memory_bytes": budget,
        **budget_info,
        "keep_grads": opt.keep_grads,
        "device_stepped_units": len(plan.device_stepped),
        "units": len(plan.unit_names),
        "device_optimizer_reason": plan.device_optimizer_reason,
        "host_bytes_per_parameter": plan.host_bytes_per_parameter,
        **res,
    }


def _time_trainer(
    model,
    opt,
    batch,
    device,
    case,
    max_grad_norm: float,
    *,
    micro_batches: int = 1,
    unit_major: bool = False,
) -> dict[str, Any]:
    """Time ``Trainer`` (``UnitMajorTrainer`` with ``unit_major``) steps of
    ``micro_batches`` micro-batches, each ``batch`` (ids, labels)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ramflow.train import UnitMajorTrainer
    from ramflow.units.registry import engine_of_model

    ids, labels = batch
    engine = engine_of_model(model)
    policy = engine.stepper.policy  # ramflow.engine.step_policy.StepPolicy
    ends: list[float] = []
    in_backward: list[bool] = []
    loads: list[int] = []  # per step: the most loads of one unit
    before: dict[str, int] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            before.clear()
            before.update(engine.window.num_loads)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            in_backward.append(policy.last_eager)

        def on_step_end(self, args, state, control, **kwargs):
            measure.sync(device)
            ends.append(time.perf_counter())
            now = engine.window.num_loads
            loads.append(max(now[k] - before.get(k, 0) for k in now))
            if state.global_step == case["warmup"]:
                measure.reset_peak(device)

    class LossTrainer(UnitMajorTrainer if unit_major else Trainer):
        """The reference model takes (ids, labels) and returns the loss."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return loss_of(model, inputs["input_ids"], inputs["labels"])

    total = case["warmup"] + case["steps"]
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids.cpu(), labels.cpu())]
    args = TrainingArguments(
        output_dir="/tmp/ramflow-trainer-step",
        use_cpu=device.type == "cpu",
        bf16=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=case["batch"],
        gradient_accumulation_steps=micro_batches,
        max_grad_norm=max_grad_norm,
        max_steps=total,
        logging_steps=total,
        save_strategy="no",
    )
    trainer = LossTrainer(
        model=model,
        args=args,
        train_dataset=rows * total * micro_batches,
        optimizers=(opt, None),
        callbacks=[Clock()],
    )
    trainer.train()
    times = [b - a for a, b in zip(ends[case["warmup"] - 1 :], ends[case["warmup"] :])]
    return {
        "step_s": statistics.median(times),
        "step_times_s": times,
        "peak_bytes": measure.peak_bytes(device),
        "max_grad_norm": max_grad_norm,
        "steps_in_backward": sum(in_backward[case["warmup"] :]),
        "timed_steps": len(times),
        "micro_batches": micro_batches,
        "max_loads_per_step": max(loads[case["warmup"] :]),
    }


# ---------------------------------------------------------------------------------- report


def against_reference(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per record with a step: its step over the reference format's in the same variant.

    Returns one dict per record, in order: ``variant``, ``host_precision``, ``step_s``
    (None for a run that failed or was skipped) and ``ratio`` (its step over fp32's in the
    same variant; None for fp32 itself or where either step is missing) and ``ok``
    (``ratio <= 1.0``, or None without a ratio).
    """
    ref = {
        r["variant"]: r["step_s"]
        for r in records
        if r.get("host_precision") == REFERENCE_FORMAT and "step_s" in r
    }
    out = []
    for r in records:
        step = r.get("step_s")
        base = ref.get(r["variant"])
        ratio = None
        if step is not None and base and r.get("host_precision") != REFERENCE_FORMAT:
            ratio = step / base
        out.append(
            {
                "variant": r["variant"],
                "host_precision": r.get("host_precision"),
                "step_s": step,
                "ratio": ratio,
                "ok": None if ratio is None else ratio <= 1.0,
            }
        )
    return out


def markdown(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["records"]
    tokens = meta["batch"] * meta["seq"]
    bare = {
        r.get("host_precision"): r["step_s"]
        for r in rows
        if r["variant"] == "bare" and "step_s" in r
    }
    budget = meta.get("gpu_memory_bytes")
    budget_text = f"{budget / measure.GiB:.2f} GiB" if budget else "none (nothing resident)"
    out = [
        f"# Trainer step against the bare loop, per host format ({meta['device']}, "
        f"commit {meta['commit']})",
        "",
        f"Reference model, {meta['batch']}x{meta['seq']} tokens, offload settings of the "
        f"capped 4x2048 suite case, `device_optimizer` {meta['device_optimizer']} "
        f"({'the planner decides' if meta['device_optimizer'] == 'auto' else 'True'}); "
        f"`gpu_memory` {budget_text} for every run ({meta['budget_from']}); median of the "
        "timed steps. `x fp32`: the step over fp32's in the same variant. The "
        f"accumulating variants step every {meta.get('accum', 1)} micro-batches: their "
        "`x bare` is per micro-batch; `loads/step`: the most H2D loads of one unit in a "
        "timed step.",
        "",
        "| variant | format | step | tokens/s | x fp32 | <= 1.0x | x bare | steps during "
        "backward | loads/step | device-stepped units | peak GPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, cmp in zip(rows, against_reference(rows)):
        fmt = r.get("host_precision", "-")
        if "step_s" not in r:
            why = r.get("skipped") or f"failed: {r.get('error', '?')}"
            out.append(f"| {r['variant']} | {fmt} | {_one_line(why)} | | | | | | | | |")
            continue
        ratio = f"{cmp['ratio']:.2f}x" if cmp["ratio"] is not None else "-"
        ok = "-" if cmp["ok"] is None else ("yes" if cmp["ok"] else "**no**")
        micro = r.get("micro_batches", 1)
        xbare = f"{r['step_s'] / micro / bare[fmt]:.2f}x" if bare.get(fmt) else "-"
        num_loads = r.get("max_loads_per_step", "-")
        eager = (
            f"{r['steps_in_backward']} of {r['timed_steps']}" if "steps_in_backward" in r else "-"
        )
        stepped = f"{r['device_stepped_units']} of {r['units']}" if "units" in r else "-"
        peak = f"{r['peak_bytes'] / measure.GiB:.1f} GiB" if r.get("peak_bytes") else "-"
        out.append(
            f"| {r['variant']} | {fmt} | {r['step_s'] * 1e3:.0f} ms | "
            f"{tokens * micro / r['step_s']:.0f} | {ratio} | {ok} | {xbare} | {eager} | "
            f"{num_loads} | {stepped} | {peak} |"
        )
    verdicts = [c for c in against_reference(rows) if c["ok"] is not None]
    if verdicts:
        met = sum(c["ok"] for c in verdicts)
        out += ["", f"At most 1.0x fp32: {met} of {len(verdicts)} runs."]
    return "\n".join(out) + "\n"


def _one_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "?")[:160].replace("|", "/")


# ---------------------------------------------------------------------------------- runs


def _run_child(
    args: argparse.Namespace,
    variant: str,
    fmt: str,
    budget: int | None,
    calibrate: bool,
    timeout_s: float,
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--variant", variant, "--format", fmt]
    cmd += ["--device-optimizer", args.device_optimizer, "--out-dir", str(args.out_dir)]
    cmd += ["--smoke"] * args.smoke + ["--calibrate"] * calibrate
    cmd += ["--accum", str(args.accum)]
    cmd += ["--budget", str(budget)] if budget is not None else []
    try:
        proc = subprocess.run(
            cmd, env=harness.child_env(), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f} s"
        return {"variant": variant, "host_precision": fmt, "error": error}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"variant": variant, "host_precision": fmt, "error": proc.stderr.strip()[-2000:]}


def _split(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(
            f"{flag} {text!r}: give a comma-separated list of distinct names from "
            f"{', '.join(allowed)}"
        )
    return names


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/trainer_step/trainer_step.py", description=__doc__)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in order")
    p.add_argument(
        "--host-precision",
        default=REFERENCE_FORMAT,
        help=f"comma-separated host formats ({', '.join(FORMATS)}); each variant runs once per "
        "format, in this order",
    )
    p.add_argument(
        "--device-optimizer",
        choices=tuple(DEVICE_OPTIMIZER),
        default="auto",
        help="auto (default): device_optimizer left to the planner, the call a user writes; "
        "on: device_optimizer=True, as the suite's cases (and this script before 2026-11-28)",
    )
    p.add_argument(
        "--gpu-memory",
        help="one gpu_memory for every run (e.g. 10GiB) instead of the first run's calibration",
    )
    p.add_argument(
        "--accum",
        type=int,
        default=2,
        help="micro-batches per optimizer step of the trainer-accum and trainer-unit-major "
        "variants (default 2: unit-major keeps every micro-batch's unit inputs on the GPU)",
    )
    p.add_argument("--timeout-s", type=float, default=180.0, help="per run")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for all runs: a run (or a variant's set of formats) that the longest run "
        "so far says would not fit is skipped and listed",
    )
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--format", choices=FORMATS, default=REFERENCE_FORMAT, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:  # a child: one variant in one format, its record on the last line
        record = run_variant(
            args.variant,
            case_of(args.smoke, args.format),
            args.budget,
            calibrate=args.calibrate,
            device_optimizer=args.device_optimizer,
            accum=args.accum,
        )
        print(json.dumps(record, default=str), flush=True)
        return 0
    import ramflow

    budget: int | None = None
    budget_from = "calibrated by the first run"
    try:
        variants = _split(args.variants, VARIANTS, "--variants")
        formats = _split(args.host_precision, FORMATS, "--host-precision")
        if args.gpu_memory is not None:
            budget = ramflow.parse_bytes(args.gpu_memory, what="--gpu-memory")
            budget_from = f"--gpu-memory {args.gpu_memory}"
    except (TypeError, ValueError) as err:
        p.error(str(err))
    calibrated = budget is not None
    case = case_of(args.smoke)
    meta = {
        "device": harness.device_name(),
        "commit": harness._commit(),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "batch": case["batch"],
        "seq": case["seq"],
        "variants": variants,
        "host_precisions": formats,
        "device_optimizer": args.device_optimizer,
        "accum": args.accum,
        "gpu_memory_bytes": budget,
        "budget_from": budget_from,
        "torch": torch.__version__,
        "transformers": harness._version("transformers"),
    }
    stem = harness.run_dir(args.out_dir, "trainer-step") / "trainer_step"
    stem.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    longest = 0.0  # wall seconds of the longest run so far: the estimate of the next

    def write() -> None:
        doc = {"meta": meta, "records": records}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(doc))

    for variant in variants:
        skip = ""  # why this variant's runs are skipped
        for i, fmt in enumerate(formats):
            left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
            # a variant's first format starts only if all its formats fit (a lone fp32 run
            # answers nothing about the others); 10% for the spread between runs
            need = 1.1 * longest * (len(formats) if i == 0 else 1)
            if not skip and left is not None and left < max(need, 1.0):
                skip = f"skipped: {left:.0f} s left, {need:.0f} s needed"
            if skip:
                record = {"variant": variant, "host_precision": fmt, "skipped": skip}
            else:
                timeout = args.timeout_s if left is None else min(args.timeout_s, left)
                start = time.perf_counter()
                record = _run_child(args, variant, fmt, budget, not calibrated, timeout)
                record["wall_s"] = time.perf_counter() - start
                longest = max(longest, record["wall_s"])
                if not calibrated and "budget_rule" in record:
                    calibrated = True
                    budget = meta["gpu_memory_bytes"] = record.get("gpu_memory_bytes")
                    meta["budget_from"] = (
                        f"calibrated by the {variant} {fmt} run: {record['budget_rule']}"
                    )
            records.append(record)
            print(variant, fmt, record.get("step_s", record.get("skipped", "failed")), flush=True)
            write()
    print(stem.with_suffix(".md").read_text())
    return 0 if all("step_s" in r or "skipped" in r for r in records) else 1  # failed: 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
