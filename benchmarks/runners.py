"""What runs inside one case's process: build, set up, time, and return a plain dict.

Each ``run_*`` function takes a case (a JSON-able dict made by ``cases.py``) and returns the
case's measurements. It never catches its own errors: ``bench.py`` runs every case in a
process of its own and records a crash, an out-of-memory error or a timeout as that case's
result.

A training step is the drop-in loop of DESIGN.md: bf16 autocast forward with the loss,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``. Inference is one forward under
``torch.no_grad()`` returning the logits.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import torch

import measure
from case_steps import (
    LR,
    RAMFLOW_OPTIMIZER,
    _last_loss,
    _model,
    _offload_kwargs,
    _plan_fields,
    _shape_fields,
    _time_ramflow_training,
    _train_step,
    _unit_shapes,
    compute_device,
    predict_inputs,
)
from cpu_optimizer_runner import run_cpu_optimizer
from kofn_runner import run_ramflow_kofn
from models import (
    logits_of,
    loss_of,
    make_batch,
    meta_shape,
    model_shape,
    resident_peak_bytes,
)

# ---------------------------------------------------------------------------------- floors


def run_floors(case: dict[str, Any]) -> dict[str, Any]:
    """Copy bandwidths, matmul rate, CPU AdamW rates, DRAM copy rate.

    The CPU AdamW rate is measured over ``adam_slice_params`` fp32 parameters and is used
    as a rate (parameters per second): the floors scale it linearly to the model's size.
    """
    device = compute_device()
    tiny = case["tiny"]
    bw = measure.pinned_bandwidth(device, nbytes=measure.GiB if not tiny else 64 * measure.MiB)
    slice_params = case.get("adam_slice_params", 16 << 20 if tiny else 256 << 20)
    return {
        "bandwidth_bytes_per_s": bw,
        "matmul_flops_per_s": measure.matmul_flops(device),
        "adam_slice_params": slice_params,
        "cpu_adamw_fused_params_per_s": measure.cpu_adamw_rate(slice_params, fused=True),
        "cpu_adamw_foreach_params_per_s": measure.cpu_adamw_rate(slice_params, fused=False),
        "dram_copy_bytes_per_s": measure.dram_copy_bandwidth(
            nbytes=measure.GiB if not tiny else 64 * measure.MiB
        ),
        "cpu_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------- ramflow


def _ramflow_budget(case, model, ids, labels, device) -> tuple[int | None, dict[str, Any]]:
    """Find the ``gpu_memory`` that keeps the whole step under the case's cap.

    ramflow's ``gpu_memory`` caps only what ramflow allocates (window, gradient buffers,
    resident units); the cap of the issue is on the whole peak, activations included. One
    calibration step with nothing resident measures the activations (peak minus ramflow's
    planned bytes); the budget is the cap minus those and a margin. Then the model is given
    back (``ramflow.undo``) and offloaded again with that budget.
    """
    import ramflow

    cap = case.get("cap_gib")
    if cap is None or device.type != "cuda":
        return None, {"budget_rule": "none" if cap is None else "cap ignored on the CPU"}
    ramflow.offload(model, gpu_memory=None, device=device, **_offload_kwargs(case)[1])
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    measure.reset_peak(device)
    _train_step(model, opt, ids, labels, device)()
    ramflow.synchronize(model)
    peak = measure.peak_bytes(device)
    plan = ramflow.get_plan(model)
    activation = peak - plan.planned_bytes
    margin = 256 * measure.MiB
    budget = int(cap * measure.GiB) - activation - margin
    ramflow.undo(model)
    del opt
    gc.collect()  # the engine's pinned host buffers go with it
    torch.cuda.empty_cache()
    info = {
        "budget_rule": "cap - (calibration peak - planned bytes) - 256 MiB",
        "calibration_peak_bytes": peak,
        "calibration_activation_bytes": activation,
    }
    if budget < plan.min_gpu_memory_bytes:
        info["budget_note"] = "activations leave less than the smallest plan: nothing resident"
        return None, info
    return budget, info


def run_ramflow_train(case: dict[str, Any]) -> dict[str, Any]:
    import ramflow

    device = compute_device()
    counter = measure.CopyCounter()
    t0 = time.perf_counter()
    model_checkpoints, offload_kwargs = _offload_kwargs(case)
    model = _model(case, device="cpu", checkpoint=model_checkpoints)
    shapes = _unit_shapes(model)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    budget, budget_info = _ramflow_budget(case, model, ids, labels, device)
    # what the budget leaves after the plan holds the first units' optimizer on the GPU,
    # in every host format (the lean formats' device step is one Triton kernel; without it,
    # PyTorch ops made the 4x2048 step slower: 1452 against 980 ms on the H100,
    # benchmarks/results/2026-11-23-nvidia-h100-lean-device-step)
    from ramflow.kernels.lean_triton import available as lean_kernel_on

    device_optimizer: bool | None = True
    if case.get("device_optimizer") == "auto":
        device_optimizer = None  # the planner's choice: the loop that passes nothing else
    elif not lean_kernel_on(torch.device(device)):
        device_optimizer = offload_kwargs.get("host_precision", "fp32") == "fp32"
    ramflow.offload(
        model, gpu_memory=budget, device=device, device_optimizer=device_optimizer, **offload_kwargs
    )
    counter.watch(model)
    opt = ramflow.optim.AdamW(model.parameters(), **RAMFLOW_OPTIMIZER)
    setup_s = time.perf_counter() - t0
    losses: list = []
    res = _time_ramflow_training(model, opt, ids, labels, device, case, counter, losses)
    plan = ramflow.get_plan(model)
    on_device = sum(b for n, b in zip(plan.unit_names, plan.unit_bytes) if n in plan.device_stepped)
    out = {**res, **_shape_fields(model), **_plan_fields(plan), **budget_info}
    out.update(
        host_precision=plan.host_precision.name,
        device_optimizer=case.get("device_optimizer", "on"),
        device_stepped_units=len(plan.device_stepped),
        host_bytes_per_parameter=plan.host_bytes_per_parameter,
        checkpointing_by=case.get("checkpointing_by") if case.get("checkpoint") else None,
        loss=_last_loss(losses),
        setup_s=setup_s,
        gpu_memory_bytes=budget,
        # every streamed unit crosses twice (forward, backward), resident units once
        # (their refresh after the step); every gradient crosses once, in the wire dtype.
        # An upper bound: units still cached in the window at the turn-around are not re-sent.
        # (units stepped on the GPU: no refresh, no gradients down)
        h2d_bytes_plan=2 * plan.streamed_bytes_per_pass + plan.resident_bytes - on_device,
        d2h_bytes_plan=sum(plan.unit_bytes) - on_device,
        predict_inputs=predict_inputs(case, shapes, plan, model, mode="train", batch=case["batch"]),
    )
    return out


def run_ramflow_infer(case: dict[str, Any]) -> dict[str, Any]:
    import ramflow

    device = compute_device()
    counter = measure.CopyCounter()
    t0 = time.perf_counter()
    model = _model(case, device="cpu")
    model.eval()
    shapes = _unit_shapes(model)
    ramflow.offload(model, gpu_memory=None, device=device)
    counter.watch(model)
    plan = ramflow.get_plan(model)
    setup_s = time.perf_counter() - t0
    rows = []
    for batch in case["batches"]:
        ids, _ = make_batch(model_shape(model).vocab_size, batch, case["seq"], device=device)

        def step(ids=ids) -> None:
            with torch.no_grad():
                logits_of(model, ids)

        res = measure.time_steps(
            step, device=device, warmup=case["warmup"], steps=case["steps"], counter=counter
        )
        rows.append(
            {
                "batch": batch,
                **res,
                "h2d_bytes_plan": plan.streamed_bytes_per_pass,
                "d2h_bytes_plan": 0,
                "predict_inputs": predict_inputs(
                    case, shapes, plan, model, mode="infer", batch=batch
                ),
            }
        )
    return {"rows": rows, "setup_s": setup_s, **_shape_fields(model), **_plan_fields(plan)}


# ---------------------------------------------------------------------------------- resident


def _does_not_fit(case: dict[str, Any], device: torch.device, *, mode: str) -> dict | None:
    """A skip record when the resident step would not fit the device (a rough estimate,
    ``models.resident_peak_bytes``), so that the case is estimated, not crashed: the report
    then takes the compute floor from another resident step or the FLOP count."""
    if device.type != "cuda":
        return None
    shape = meta_shape(case["model"], tiny=case["tiny"], num_layers=case.get("num_layers"))
    batches = case.get("batches") or [case["batch"]]
    need = max(
        resident_peak_bytes(
            shape,
            mode=mode,
            batch=b,
            seq=case["seq"],
            checkpoint=bool(case.get("checkpoint")),
            loss_chunk_tokens=case.get("loss_chunk_tokens", 0),
        )
        for b in batches
    )
    _, total = torch.cuda.mem_get_info(device)
    if need <= 0.97 * total:
        return None
    return {
        "skipped": True,
        "reason": f"does not fit: needs about {need / measure.GiB:.1f} GiB, the device has "
        f"{total / measure.GiB:.1f} GiB (estimated, not run)",
        "estimated_peak_bytes": need,
        **dataclasses.asdict(shape),
    }


def run_resident_train(case: dict[str, Any]) -> dict[str, Any]:
    """Everything on the GPU: fp32 weights, bf16 autocast, fused AdamW on the device."""
    device = compute_device()
    skip = _does_not_fit(case, device, mode="train")
    if skip:
        return skip
    model = _model(case, device=device)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    losses: list = []
    res = measure.time_steps(
        _train_step(model, opt, ids, labels, device, losses),
        device=device,
        warmup=case["warmup"],
        steps=case["steps"],
    )
    return {
        **res,
        **_shape_fields(model),
        "loss": _last_loss(losses),
        "h2d_bytes": 0,
        "d2h_bytes": 0,
        "bytes_how": "none",
    }


def run_resident_infer(case: dict[str, Any]) -> dict[str, Any]:
    """Everything on the GPU in bf16."""
    device = compute_device()
    skip = _does_not_fit(case, device, mode="infer")
    if skip:
        return skip
    model = _model(case, device=device, dtype=torch.bfloat16)
    model.eval()
    rows = []
    for batch in case["batches"]:
        ids, _ = make_batch(model_shape(model).vocab_size, batch, case["seq"], device=device)

        def step(ids=ids) -> None:
            with torch.no_grad():
                logits_of(model, ids)

        res = measure.time_steps(step, device=device, warmup=case["warmup"], steps=case["steps"])
        rows.append({"batch": batch, **res, "h2d_bytes": 0, "d2h_bytes": 0, "bytes_how": "none"})
    return {"rows": rows, **_shape_fields(model)}


# ---------------------------------------------------------------------------------- trace


def run_trace(case: dict[str, Any]) -> dict[str, Any]:
    """One ramflow training step under ``torch.profiler``, written as a gzipped Chrome/Perfetto
    trace, with the optimizer spans of ramflow's host worker added (the profiler does not
    record ``record_function`` on threads it was not started from), and an overlap summary.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    import ramflow
    import trace_summary

    device = compute_device()
    host_spans = trace_summary.HostSpans()
    host_spans.install()
    model_checkpoints, offload_kwargs = _offload_kwargs(case)
    model = _model(case, device="cpu", checkpoint=model_checkpoints)
    ids, labels = make_batch(
        model_shape(model).vocab_size, case["batch"], case["seq"], device=device
    )
    ramflow.offload(model, gpu_memory=None, device=device, **offload_kwargs)
    opt = ramflow.optim.AdamW(model.parameters(), **RAMFLOW_OPTIMIZER)

    def step() -> None:
        with record_function("bench.forward"), torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, ids, labels)
        with record_function("bench.backward"):
            loss.backward()
        with record_function("bench.optimizer_step"):
            opt.step()
            opt.zero_grad()
        with record_function("bench.drain"):
            ramflow.synchronize(model)
            measure.sync(device)

    for _ in range(max(case["warmup"], 2)):  # the second step is the first with eager steps
        step()
    measure.sync(device)
    host_spans.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        clock = trace_summary.clock_marks()
        t0 = time.perf_counter()
        step()
        step_s = time.perf_counter() - t0
    out_dir = case["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(out_dir, f"{case['trace_name']}.json")
    prof.export_chrome_trace(raw)
    path, summary = trace_summary.finish(raw, clock, host_spans.spans())
    return {"trace_path": path, "step_s": step_s, "summary": summary, **_shape_fields(model)}


RUNNERS = {
    "floors": run_floors,
    "ramflow_train": run_ramflow_train,
    "ramflow_infer": run_ramflow_infer,
    "ramflow_kofn": run_ramflow_kofn,
    "resident_train": run_resident_train,
    "resident_infer": run_resident_infer,
    "cpu_optimizer": run_cpu_optimizer,
    "trace": run_trace,
}


def run(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in this process and return its measurements."""
    torch.manual_seed(0)
    return RUNNERS[case["kind"]](case)
