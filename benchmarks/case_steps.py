"""The pieces every case's process uses: the device, the model, the offload settings, the
timed training loop and the inputs of the step-time prediction (``runners`` and the study
scripts build on them).

A training step is the drop-in loop of DESIGN.md: bf16 autocast forward with the loss,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

import measure
from models import (
    build_model,
    loss_of,
    model_shape,
)

LR = 1e-5
# ramflow's timed training loops read no gradients: its optimizer leaves p.grad unwritten
# when it steps during backward (4 bytes less DRAM traffic per parameter; see its docstring)
RAMFLOW_OPTIMIZER = {"lr": LR, "keep_grads": False}


def compute_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _model(
    case: dict[str, Any],
    *,
    device: str | torch.device,
    dtype: torch.dtype = torch.float32,
    checkpoint: bool | None = None,
):
    return build_model(
        case["model"],
        tiny=case["tiny"],
        device=device,
        dtype=dtype,
        num_layers=case.get("num_layers"),
        checkpoint=case.get("checkpoint", False) if checkpoint is None else checkpoint,
        loss_chunk_tokens=case.get("loss_chunk_tokens", 0),
    )


def _offload_kwargs(case: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Whether the model checkpoints itself, and the extra ``ramflow.offload`` arguments."""
    extra = {"host_precision": case.get("host_precision", "fp32")}
    if case.get("checkpoint") and case.get("checkpointing_by") == "ramflow":
        return False, {"activation_checkpointing": True, **extra}
    return bool(case.get("checkpoint")), extra


def _train_step(model, opt, ids, labels, device: torch.device, losses: list | None = None):
    """The training step; with ``losses``, each step's loss (a detached device tensor) is
    appended, read only after timing (``_last_loss``) so that no step waits for it."""

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss.detach())

    return step


def _time_ramflow_training(
    model, opt, ids, labels, device, case, counter, losses: list | None = None
) -> dict[str, Any]:
    """``measure.time_steps`` of ramflow's training step (drained at the end), plus
    ``optimizer_in_step_params_per_s``: the CPU optimizer's rate over the timed steps, from
    its engine's ``host_step_totals``."""
    import ramflow
    from ramflow.units.registry import engine_of_model

    engine = engine_of_model(model)
    before = [(0, 0.0)]
    res = measure.time_steps(
        _train_step(model, opt, ids, labels, device, losses),
        device=device,
        warmup=case["warmup"],
        steps=case["steps"],
        drain=lambda: ramflow.synchronize(model),
        counter=counter,
        on_timed_start=lambda: before.__setitem__(0, engine.host_stepper.host_step_totals()),
    )
    params, seconds = (a - b for a, b in zip(engine.host_stepper.host_step_totals(), before[0]))
    res["optimizer_in_step_params_per_s"] = params / seconds if seconds > 0 else None
    res.update(_optimizer_alone(engine, opt))
    return res


def _optimizer_alone(engine, opt, repeats: int = 3) -> dict[str, Any]:
    """The CPU optimizer's time alone over this case's own host tensors, in this process:
    after the drained timed steps (GPU and worker idle), ramflow's AdamW kernel over every
    unit's fp32 masters, states and last staged bf16 gradients, writing the wire copy, as in
    the step (28 B per parameter). lr = 0 and no weight decay: the same memory traffic,
    and the weights stay as they are. Fastest of ``repeats``: the CPU optimizer floor of
    the case, measured when and where the case ran (a machine's DRAM rate drifts between
    processes: benchmarks/results/2026-11-22-nvidia-h200-refresh)."""
    from ramflow.kernels.cpu_kernels import fused_adamw_step_

    units = [u for u in engine.units if u in opt.unit_states and u.staging is not None]
    if not units:
        return {}
    params = sum(u.trainable_numel for u in units)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for u in units:
            n = u.trainable_numel
            state = opt.unit_states[u]
            fused_adamw_step_(
                u.master[:n], u.staging[:n], state["exp_avg"], state["exp_avg_sq"],
                step=1000, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                wire_out=engine.host.wire_prefix(u), num_threads=opt.threads,
            )  # fmt: skip
        times.append(time.perf_counter() - start)
    best = min(times)
    return {
        "optimizer_alone_s": best,
        "optimizer_alone_params": params,
        "optimizer_alone_params_per_s": params / best,
        # the part the CPU steps in the timed steps (the rest is stepped on the GPU)
        "optimizer_alone_cpu_stepped_params": sum(
            u.trainable_numel for u in units if not u.device_stepped
        ),
    }


def _last_loss(losses: list) -> float | None:
    """The last step's loss: a sanity check that the run computed something finite."""
    return float(losses[-1]) if losses else None


def _shape_fields(model) -> dict[str, Any]:
    return dataclasses.asdict(model_shape(model))


def _unit_shapes(model) -> list:
    """ramflow's units of ``model`` as the step-time model sees them (before offloading)."""
    from ramflow.planner.costs import unit_shapes

    return unit_shapes(model)


def _checkpointed_units(case: dict[str, Any], shapes: list) -> list[str]:
    """The units whose forward is recomputed in backward in this case's training step."""
    if not case.get("checkpoint"):
        return []
    if case.get("checkpointing_by") == "ramflow" and case["model"] == "reference":
        return [s.name for s in shapes if not s.rest]  # ramflow wraps every unit's forward
    names = [s.name for s in shapes if s.block]  # the model's own (or HF's) per-block switch
    if case.get("loss_chunk_tokens") and case["model"] == "reference":
        names.append("head")  # each loss chunk is checkpointed: the head runs again
    return names


def predict_inputs(
    case: dict[str, Any], shapes: list, plan, model, *, mode: str, batch: int
) -> dict[str, Any] | None:
    """What ``report.py`` needs to predict this step (``ramflow.planner.predict``) once the floors
    are known: per unit its wire bytes, trainable parameters, matmul weights, attention
    layers, tied dependencies, and whether it is resident or checkpointed. None when the
    plan's units are not the ones found here."""
    if [s.name for s in shapes] != list(plan.unit_names):
        return None
    resident = set(plan.resident)
    on_device = set(plan.device_stepped)
    ckpt = set(_checkpointed_units(case, shapes)) if mode == "train" else set()
    itemsize = 4 if plan.wire_dtype == "float32" else 2
    units = [
        {
            "name": s.name,
            "wire_bytes": nbytes,
            # stepped on the GPU: no gradient D2H, no CPU step, no refresh (its few ms of
            # GPU time are left out of the model)
            "trainable_params": 0 if s.name in on_device else s.trainable_numel,
            "device_stepped": s.name in on_device,
            "matmul_params": s.matmul_params,
            "attention_layers": s.attention_layers,
            "block": s.block,
            "deps": list(s.deps),
            "resident": s.rest or s.name in resident,
            "checkpointed": s.name in ckpt,
        }
        for s, nbytes in zip(shapes, plan.unit_bytes)
    ]
    return {
        "mode": mode,
        "batch": batch,
        "seq": case["seq"],
        "hidden": model_shape(model).dim,
        "prefetch_depth": plan.prefetch_depth,
        "grad_bytes_per_param": itemsize,
        "units": units,
    }


def _plan_fields(plan) -> dict[str, Any]:
    return {
        "plan": plan.describe(),
        "planned_bytes": plan.planned_bytes,
        "resident_units": len(plan.resident),
        "num_units": len(plan.unit_names),
        "streamed_bytes_per_pass": plan.streamed_bytes_per_pass,
        "resident_bytes": plan.resident_bytes,
        "wire_bytes_total": sum(plan.unit_bytes),
        "device_stepped_units": list(plan.device_stepped),
        "device_step_bytes": plan.device_step_bytes,
    }
