"""The k-of-n case: k of the n blocks resident (k = 0, n/4, n/2, 3n/4), the bytes each way
and the step time of training (in rounds) and inference (``cases.py``'s ``ramflow_kofn``)."""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Iterator
from typing import Any

import torch

import measure
from case_steps import (
    RAMFLOW_OPTIMIZER,
    _model,
    _offload_kwargs,
    _plan_fields,
    _shape_fields,
    _time_ramflow_training,
    _unit_shapes,
    compute_device,
    predict_inputs,
)
from models import (
    logits_of,
    make_batch,
    model_shape,
)


def _kofn_budgets(plan, shapes: list, fractions: list[float]) -> list[tuple[int, int | None]]:
    """(k, gpu_memory) for k = round(f x n) of the n blocks resident, f in ``fractions``.

    The engine keeps units resident from the last one backwards, so k blocks resident means
    the units after the blocks (final norm, head) too. The budget is the least one that makes
    the engine keep exactly those: ramflow's bytes at each step of its rule, at their largest.
    """
    from ramflow.planner.plan import _ramflow_bytes

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
