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

import contextlib
import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import measure
from models import (
    build_model,
    logits_of,
    loss_of,
    make_batch,
    meta_shape,
    model_shape,
    resident_peak_bytes,
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
    from ramflow._registry import engine_of_model

    engine = engine_of_model(model)
    before = [(0, 0.0)]
    res = measure.time_steps(
        _train_step(model, opt, ids, labels, device, losses),
        device=device,
        warmup=case["warmup"],
        steps=case["steps"],
        drain=lambda: ramflow.synchronize(model),
        counter=counter,
        on_timed_start=lambda: before.__setitem__(0, engine.host_step_totals()),
    )
    params, seconds = (a - b for a, b in zip(engine.host_step_totals(), before[0]))
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
    from ramflow._cpu_kernels import fused_adamw_step_

    units = [u for u in engine.units if u in opt._unit_state and u.staging is not None]
    if not units:
        return {}
    params = sum(u.trainable_numel for u in units)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for u in units:
            n = u.trainable_numel
            state = opt._unit_state[u]
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
    from ramflow._costs import unit_shapes

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
    """What ``report.py`` needs to predict this step (``ramflow._predict``) once the floors
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
    from ramflow._lean_triton import available as lean_kernel_on

    device_optimizer = True
    if not lean_kernel_on(torch.device(device)):
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
        host_precision=plan.host_precision,
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


def _kofn_budgets(plan, shapes: list, fractions: list[float]) -> list[tuple[int, int | None]]:
    """(k, gpu_memory) for k = round(f x n) of the n blocks resident, f in ``fractions``.

    The engine keeps units resident from the last one backwards, so k blocks resident means
    the units after the blocks (final norm, head) too. The budget is the least one that makes
    the engine keep exactly those: ramflow's bytes at each step of its rule, at their largest.
    """
    from ramflow._plan import _ramflow_bytes

    names = list(plan.unit_names)
    blocks = [i for i, s in enumerate(shapes) if s.block]
    n = len(blocks)
    overhead = plan.grad_bytes + plan.fixed_bytes
    slots = plan.prefetch_depth + 2
    forced = {s.name for s in shapes if s.rest}
    out: list[tuple[int, int | None]] = []
    for f in fractions:
        k = round(f * n)
        if k == 0:
            out.append((0, None))
            continue
        first = blocks[n - k]
        resident = set(forced)
        need = _ramflow_bytes(names, plan.unit_bytes, resident, slots, overhead)
        for i in reversed(range(first, len(names))):
            resident.add(names[i])
            need = max(need, _ramflow_bytes(names, plan.unit_bytes, resident, slots, overhead))
        out.append((k, need))
    return out


def run_ramflow_kofn(case: dict[str, Any]) -> dict[str, Any]:
    """Training (``batch``) and inference (``infer_batch``) with k of the n blocks resident,
    k = round(f x n) for f in ``fractions``: budgets chosen so, one offload each, in one
    process (the model is built once). Bytes are counted each way, resident refreshes apart.

    Training runs ``rounds`` times per k, the k order reversed every other round, and the
    step is the median over rounds (``step_s_rounds`` keeps each): the CPU optimizer that
    binds it drifts by more than 5% between minutes of one process on the GPU box
    (benchmarks/results/2026-11-22-nvidia-h200-refresh, run 4). Inference runs once per k.
    """
    import ramflow

    device = compute_device()
    counter = measure.CopyCounter()
    model_checkpoints, offload_kwargs = _offload_kwargs(case)
    model = _model(case, device="cpu", checkpoint=model_checkpoints)
    shapes = _unit_shapes(model)
    vocab = model_shape(model).vocab_size
    ids, labels = make_batch(vocab, case["batch"], case["seq"], device=device)
    infer_ids, _ = make_batch(vocab, case["infer_batch"], case["seq"], device=device)
    ramflow.offload(model, gpu_memory=None, device=device, **offload_kwargs)
    budgets = _kofn_budgets(ramflow.get_plan(model), shapes, case["fractions"])
    ramflow.undo(model)
    rows = []
    for k, budget in budgets:
        rows.append(_kofn_row(case, model, shapes, k, budget, ids, labels, infer_ids, counter))
    for r in range(1, case.get("rounds", 1)):
        for k, budget in budgets if r % 2 == 0 else reversed(budgets):
            row = next(x for x in rows if x["k"] == k)
            with _kofn_offloaded(case, model, budget, device, counter) as (_, opt):
                again = _time_ramflow_training(model, opt, ids, labels, device, case, counter)
            row["train"]["step_s_rounds"].append(again["step_s"])
            row["train"]["optimizer_alone_s_rounds"].append(again.get("optimizer_alone_s"))
    for row in rows:
        row["train"]["step_s"] = statistics.median(row["train"]["step_s_rounds"])
    return {
        "rows": rows,
        "rounds": case.get("rounds", 1),
        "num_blocks": sum(1 for s in shapes if s.block),
        "num_units": len(shapes),
        **_shape_fields(model),
    }


@contextlib.contextmanager
def _kofn_offloaded(case, model, budget, device, counter) -> Iterator[tuple[Any, Any]]:
    """``model`` offloaded at ``budget`` with a fresh ramflow AdamW, in training mode:
    yields (plan, optimizer), then gives the model back and frees what the engine held."""
    import ramflow

    _, offload_kwargs = _offload_kwargs(case)
    ramflow.offload(model, gpu_memory=budget, device=device, **offload_kwargs)
    counter.watch(model)
    opt = ramflow.optim.AdamW(model.parameters(), **RAMFLOW_OPTIMIZER)
    model.train()
    try:
        yield ramflow.get_plan(model), opt
    finally:
        ramflow.undo(model)
        del opt
        gc.collect()  # the engine's pinned host buffers go with it
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _kofn_row(case, model, shapes, k, budget, ids, labels, infer_ids, counter) -> dict[str, Any]:
    """The first round at ``budget``: training and inference, bytes, plan and predictions."""
    import ramflow

    device = ids.device
    with _kofn_offloaded(case, model, budget, device, counter) as (plan, opt):
        train = _time_ramflow_training(model, opt, ids, labels, device, case, counter)
        ramflow.synchronize(model)
        model.eval()

        def forward() -> None:
            with torch.no_grad():
                logits_of(model, infer_ids)

        infer = measure.time_steps(
            forward, device=device, warmup=case["warmup"], steps=case["steps"], counter=counter
        )
        blocks = {s.name for s in shapes if s.block}
        return {
            "k": k,
            "gpu_memory_bytes": budget,
            "resident": list(plan.resident),
            "resident_blocks": sum(1 for n in plan.resident if n in blocks),
            **_plan_fields(plan),
            "train": {
                **train,
                "step_s_rounds": [train["step_s"]],
                "optimizer_alone_s_rounds": [train.get("optimizer_alone_s")],
                "batch": case["batch"],
                "predict_inputs": predict_inputs(
                    case, shapes, plan, model, mode="train", batch=case["batch"]
                ),
            },
            "infer": {
                **infer,
                "batch": case["infer_batch"],
                "predict_inputs": predict_inputs(
                    case, shapes, plan, model, mode="infer", batch=case["infer_batch"]
                ),
            },
        }


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


# ---------------------------------------------------------------------------------- CPU optimizer


def run_cpu_optimizer(case: dict[str, Any]) -> dict[str, Any]:
    """ramflow's AdamW over an offloaded model's host masters vs torch's CPU AdamW (fused and
    foreach) over the very same parameter tensors and gradients, in this process.

    One forward and backward (batch 1) lands every gradient in ramflow's host gradients; then
    each timed ramflow step is ``opt.step()`` and ``ramflow.synchronize`` (no backward in
    between, so every step is the deferred kind: the worker steps each unit's fp32 masters
    from its fp32 host gradients and, with a bf16 wire, writes the wire copy). torch's
    optimizers then step the same parameters with the same ``.grad`` tensors.

    GB/s counts the least traffic each step needs, in one pass: AdamW reads param, grad,
    exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (28 B per fp32 parameter);
    ramflow also writes the bf16 wire copy (2 B more).
    """
    import ramflow

    device = compute_device()
    model = _model(case, device="cpu")
    ramflow.offload(model, gpu_memory=None, device=device)
    rf_opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    ids, labels = make_batch(model_shape(model).vocab_size, 1, case["seq"], device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_of(model, ids, labels)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    num = sum(p.numel() for p in params)
    wire_refresh = ramflow.get_plan(model).wire_dtype != "float32"

    def timed(step, drain=None) -> list[float]:
        step()  # states are allocated here
        if drain:
            drain()
        times = []
        for _ in range(case["steps"]):
            t0 = time.perf_counter()
            step()
            if drain:
                drain()
            times.append(time.perf_counter() - t0)
        return times

    rf_times = timed(rf_opt.step, lambda: ramflow.synchronize(model))
    missing = sum(1 for p in params if p.grad is None)
    if missing:
        raise RuntimeError(f"{missing} parameters have no gradient after backward")
    fused_opt = torch.optim.AdamW(params, lr=LR, fused=True)
    fused_times = timed(fused_opt.step)
    del fused_opt
    foreach_opt = torch.optim.AdamW(params, lr=LR, foreach=True)
    foreach_times = timed(foreach_opt.step)
    del foreach_opt
    dram = measure.dram_copy_bandwidth(nbytes=measure.GiB if not case["tiny"] else 64 * measure.MiB)
    formats = _host_format_rates(min(num, 1 << 28 if not case["tiny"] else 1 << 20), case, dram)
    adam_bytes = 28
    rf_bytes = adam_bytes + (2 if wire_refresh else 0)
    med = statistics.median
    return {
        "num_params": num,
        "wire_refresh": wire_refresh,
        "ramflow_step_s": med(rf_times),
        "torch_fused_step_s": med(fused_times),
        "torch_foreach_step_s": med(foreach_times),
        "ramflow_params_per_s": num / med(rf_times),
        "torch_fused_params_per_s": num / med(fused_times),
        "torch_foreach_params_per_s": num / med(foreach_times),
        "ramflow_bytes_per_s": num * rf_bytes / med(rf_times),
        "torch_fused_bytes_per_s": num * adam_bytes / med(fused_times),
        "bytes_per_param": {"torch_adamw": adam_bytes, "ramflow": rf_bytes},
        "dram_copy_bytes_per_s": dram,
        "host_formats": formats,
        "cpu_threads": torch.get_num_threads(),
        "step_times_s": {
            "ramflow": rf_times,
            "torch_fused": fused_times,
            "torch_foreach": foreach_times,
        },
    }


# one pass over DRAM per format: bytes read plus written per parameter (the gradient is the
# bf16 staging buffer; 8-bit states add one fp32 absmax per 256 elements each way)
HOST_FORMAT_BYTES = {
    "bf16": 2 + 2 * 2 + 2 * 4,  # gradient, bf16 master (it is the wire), bf16 m and v
    "lean": 2 + 2 * 2 + 2 * 2 + 4 * 4 / 256,  # ... 8-bit m and v, their absmax
    "kahan": 2 + 2 * 4 + 2 * 2 + 4 * 4 / 256,  # ... bf16 master and compensation
}


def _host_format_rates(n: int, case: dict[str, Any], dram: float) -> dict[str, Any]:
    """Each lean host format's CPU AdamW step over ``n`` parameters of flat buffers
    (``_lean_kernels.lean_adamw_step_``, all threads, fastest of the case's steps after one
    untimed): params/s, bytes/s and their share of the DRAM copy rate (issue 14 wants 0.85).

    The top-level rates are those of the instruction set the step runs here
    (``lean_isa``); on an AVX-512 CPU ``by_isa["avx2"]`` has the AVX2 step's too, from the
    same buffers. The copy rate drifts between processes and within one (see
    benchmarks/results/2026-11-22-nvidia-h200-refresh), so it is measured again after the
    formats, and each share is taken against the larger of the two: the lower share."""
    from ramflow._lean_kernels import QBLOCK, lean_adamw_step_, lean_isa, quantize_blockwise

    isas = [lean_isa() or "torch"]
    if isas[0] == "avx512":
        isas.append("avx2")
    grad = torch.randn(n).to(torch.bfloat16)
    by_isa: dict[str, dict[str, Any]] = {}
    before = os.environ.get("RAMFLOW_LEAN_ISA")
    try:
        for isa in isas:
            if isa in ("avx512", "avx2"):
                os.environ["RAMFLOW_LEAN_ISA"] = isa
            by_isa[isa] = {}
            for name, nbytes in HOST_FORMAT_BYTES.items():
                master = torch.randn(n).to(torch.bfloat16)
                comp = torch.zeros(n, dtype=torch.bfloat16) if name == "kahan" else None
                if name == "bf16":
                    m = torch.zeros(n, dtype=torch.bfloat16)
                    v = torch.zeros(n, dtype=torch.bfloat16)
                    am = av = None
                else:
                    m = quantize_blockwise(torch.zeros(n), signed=True)[0]
                    v = quantize_blockwise(torch.zeros(n), signed=False)[0]
                    am, av = torch.zeros(-(-n // QBLOCK)), torch.zeros(-(-n // QBLOCK))
                times = []
                for step in range(1, case["steps"] + 2):
                    t0 = time.perf_counter()
                    lean_adamw_step_(
                        master, grad, m, v, step=step, lr=1e-6, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, compensation=comp, exp_avg_absmax=am,
                        exp_avg_sq_absmax=av,
                    )  # fmt: skip
                    times.append(time.perf_counter() - t0)
                best = min(times[1:])
                by_isa[isa][name] = {"step_s": best, "bytes_per_param": nbytes}
                del master, comp, m, v, am, av
    finally:
        if before is None:
            os.environ.pop("RAMFLOW_LEAN_ISA", None)
        else:
            os.environ["RAMFLOW_LEAN_ISA"] = before
    after = measure.dram_copy_bandwidth(
        nbytes=measure.GiB if not case["tiny"] else 64 * measure.MiB
    )
    copy = max(dram, after)
    for rates in by_isa.values():
        for r in rates.values():
            r["params_per_s"] = n / r["step_s"]
            r["bytes_per_s"] = n * r["bytes_per_param"] / r["step_s"]
            r["share_of_dram_copy"] = r["bytes_per_s"] / copy
    return {
        "params": n,
        "isa": isas[0],
        **by_isa[isas[0]],
        "by_isa": {isa: rates for isa, rates in by_isa.items() if isa != isas[0]},
        "dram_copy_bytes_per_s": {"before": dram, "after": after, "used": copy},
    }


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
