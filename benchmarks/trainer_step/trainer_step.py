"""The step of Hugging Face's ``Trainer`` on an offloaded model against the bare loop.

The reference model at 4x2048 tokens with the offload settings of the suite's capped 4x2048
case (``runners.run_ramflow_train``: checkpointed blocks, chunked loss, the budget that keeps
the peak under 12 GiB, ``device_optimizer=True``, ``AdamW(keep_grads=False)``), bf16
autocast, three variants, each in a process of its own:

- ``bare``: the suite's loop (``loss.backward(); opt.step(); opt.zero_grad()``);
- ``trainer``: ``Trainer`` with ``max_grad_norm=0`` (it reads the norm only, so units step
  during backward: the fast path);
- ``trainer-clip``: ``Trainer`` with ``max_grad_norm=1.0`` (a real clip: every step waits
  for ``optimizer.step()``);
- ``bare-compiled``: the bare loop with each decoder block compiled (``block.compile()``,
  inductor; ramflow's hooks run eagerly between the graphs), issue 15's point 6.

A step is the wall clock between the ends of consecutive steps, each end after
``torch.cuda.synchronize()`` (for the Trainer in ``on_step_end``), after warm-ups; the
median is reported. ``steps_in_backward`` counts the timed Trainer steps whose gradients
were gone before ``optimizer.step()`` (with ``keep_grads=False`` only a step during backward
leaves ``p.grad`` None). The budget the bare run finds is given to the others.

GPU box, from the repository root::

    PYTHONUNBUFFERED=1 python3 benchmarks/trainer_step/trainer_step.py --out-dir $OUT

CPU smoke test (a 4-layer, 256-wide model, sequences of 128; about a minute)::

    python benchmarks/trainer_step/trainer_step.py --smoke --out-dir /tmp/trainer-step

Writes ``<out-dir>/<date>-<device>-trainer-step/trainer_step.{json,md}``.
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

VARIANTS = ("bare", "trainer", "trainer-clip", "bare-compiled")
MAX_GRAD_NORM = {"trainer": 0.0, "trainer-clip": 1.0}


def case_of(smoke: bool) -> dict[str, Any]:
    """The suite's capped 4x2048 training case (2x128 with ``smoke``)."""
    warmup, steps = (1, 3) if smoke else (2, 5)
    return {
        **cases._base("reference", smoke, warmup, steps),
        **cases.training_shapes(smoke)[0],
    }


def run_variant(variant: str, case: dict[str, Any], budget: int | None) -> dict[str, Any]:
    """One variant in this process; returns its record."""
    import ramflow

    device = runners.compute_device()
    model_checkpoints, offload_kwargs = runners._offload_kwargs(case)
    model = runners._model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    budget_info: dict[str, Any] = {}
    if variant == "bare":
        budget, budget_info = runners._ramflow_budget(case, model, ids, labels, device)
    ramflow.offload(
        model, gpu_memory=budget, device=device, device_optimizer=True, **offload_kwargs
    )
    opt = ramflow.optim.AdamW(model.parameters(), **runners.RAMFLOW_OPTIMIZER)
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
        res = _time_trainer(model, opt, ids, labels, device, case, MAX_GRAD_NORM[variant])
    return {"variant": variant, "gpu_memory_bytes": budget, **budget_info, **res}


def _time_trainer(model, opt, ids, labels, device, case, max_grad_norm: float) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    params = [p for p in model.parameters() if p.requires_grad]
    ends: list[float] = []
    in_backward: list[bool] = []

    class Clock(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            in_backward.append(all(p.grad is None for p in params))

        def on_step_end(self, args, state, control, **kwargs):
            measure.sync(device)
            ends.append(time.perf_counter())
            if state.global_step == case["warmup"]:
                measure.reset_peak(device)

    class LossTrainer(Trainer):
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
        max_grad_norm=max_grad_norm,
        max_steps=total,
        logging_steps=total,
        save_strategy="no",
    )
    trainer = LossTrainer(
        model=model,
        args=args,
        train_dataset=rows * total,
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
    }


def markdown(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["records"]
    bare = next((r for r in rows if r["variant"] == "bare" and "step_s" in r), None)
    tokens = meta["batch"] * meta["seq"]
    out = [
        f"# Trainer step against the bare loop ({meta['device']}, commit {meta['commit']})",
        "",
        f"Reference model, {meta['batch']}x{meta['seq']} tokens, offload settings of the "
        "capped 4x2048 suite case; median of the timed steps.",
        "",
        "| variant | step | tokens/s | x bare | steps during backward | peak GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "step_s" not in r:
            out.append(f"| {r['variant']} | failed: {r.get('error', '?')} | | | | |")
            continue
        ratio = f"{r['step_s'] / bare['step_s']:.2f}x" if bare else "-"
        eager = (
            f"{r['steps_in_backward']} of {r['timed_steps']}" if "steps_in_backward" in r else "-"
        )
        peak = f"{r['peak_bytes'] / measure.GiB:.1f} GiB" if r.get("peak_bytes") else "-"
        out.append(
            f"| {r['variant']} | {r['step_s'] * 1e3:.0f} ms | {tokens / r['step_s']:.0f} | "
            f"{ratio} | {eager} | {peak} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/trainer_step/trainer_step.py", description=__doc__)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per variant")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    case = case_of(args.smoke)
    if args.variant:  # a child: one variant, its record on the last line
        print(json.dumps(run_variant(args.variant, case, args.budget)), flush=True)
        return 0
    records: list[dict[str, Any]] = []
    budget = None
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, "--out-dir", str(args.out_dir)]
        cmd += ["--smoke"] * args.smoke + (["--budget", str(budget)] if budget else [])
        try:
            proc = subprocess.run(
                cmd,
                env=harness.child_env(),
                capture_output=True,
                text=True,
                timeout=args.timeout_s,
            )
            lines = proc.stdout.strip().splitlines()
            record = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
            if record is None:
                record = {"variant": variant, "error": proc.stderr.strip()[-2000:]}
        except subprocess.TimeoutExpired:
            record = {"variant": variant, "error": f"timed out after {args.timeout_s:.0f} s"}
        if variant == "bare":
            budget = record.get("gpu_memory_bytes")
        records.append(record)
        print(variant, record.get("step_s", record.get("error")), flush=True)
    meta = {
        "device": harness.device_name(),
        "commit": harness._commit(),
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "batch": case["batch"],
        "seq": case["seq"],
        "torch": torch.__version__,
        "transformers": harness._version("transformers"),
    }
    doc = {"meta": meta, "records": records}
    stem = harness.run_dir(args.out_dir, "trainer-step") / "trainer_step"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(doc))
    print(stem.with_suffix(".md").read_text())
    return 0 if all("step_s" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
