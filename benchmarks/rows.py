"""Case results as rows: floors, the step-time prediction, k of n. Pure Python (no torch).

The floor of a case is max(GPU compute, PCIe, CPU optimizer), each from figures measured in
the run (or in another run's floors, with ``bench.py --report``):
- GPU compute: the resident step of the same model, batch and checkpointing, else a resident
  step at another batch scaled by tokens, else the FLOP count (2 per multiply-add of the
  forward, x3 for training, x4 with recomputation) over the measured matmul rate;
- PCIe: bf16 weights host-to-device once (inference) or twice (training), bf16 gradients
  device-to-host once, at the measured pinned rates (``pcie_seconds``);
- CPU optimizer: ramflow's AdamW alone over the case's own host tensors (measured in its
  process), else an AdamW step's 28 B per parameter at the fastest host-memory rate any AdamW
  reached in the run (``best_adamw_dram_rate``).

Each ramflow step is also predicted by ``ramflow.planner.predict`` (loaded from ``src/`` by path, so
no torch here) from the units the case recorded and the rates this run measured
(``measured_rates``, ``forward_efficiencies``, ``in_step_rated``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from pathlib import Path
from typing import Any

GIB = 1 << 30
PREDICT_PATH = Path(__file__).resolve().parent.parent / "src" / "ramflow" / "planner/predict.py"

PREDICT_TOLERANCE = 0.15  # point 4: predicted step time within 15% of the measured one


def load_predict():
    """``ramflow.planner.predict`` loaded from its file (it and ``planner/task_graph.py``, which it
    imports, need only the standard library): as a module of a stand-in package whose path
    is ``src/ramflow``, so its relative import finds the sibling without running
    ``ramflow/__init__.py`` (which imports torch)."""
    name = "ramflow_predict_standalone"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(PREDICT_PATH.parent)]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.predict")


def _shape(result: dict[str, Any]) -> dict[str, Any] | None:
    keys = ("num_params", "embed_params", "num_layers", "dim", "vocab_size")
    if all(k in result for k in keys):
        return {k: result[k] for k in keys}
    return None


def rows_of(case: dict[str, Any], record: dict[str, Any]) -> list[dict[str, Any]]:
    """The table rows of one case record ({"status", "result", ...})."""
    result = record.get("result") or {}
    kind = case["kind"]
    common = {
        "case": case["id"],
        "group": case["group"],
        "model": case["model"],
        "seq": case["seq"],
        "status": record["status"],
        "error": record.get("error"),
        "shape": _shape(result),
    }
    if kind in ("ramflow_train", "resident_train"):
        system = "ramflow" if kind == "ramflow_train" else "resident"
        return [_train_row(common, system, case, result)]
    if kind in ("ramflow_infer", "resident_infer"):
        system = "ramflow" if kind == "ramflow_infer" else "resident (bf16)"
        sub = result.get("rows") or [{"batch": b} for b in case["batches"]]
        return [_infer_row(common, system, r, result) for r in sub]
    if kind == "peer":
        system = result.get("system", case.get("peer", "peer"))
        args = case["args"]
        if args[args.index("--mode") + 1] == "infer":
            batches = args[args.index("--batches") + 1].split(",")
            sub = result.get("rows") or [{"batch": int(b)} for b in batches]
            return [_infer_row(common, system, r, result) for r in sub]
        batch = int(args[args.index("--batch") + 1])
        return [
            _train_row(
                common,
                system,
                {
                    **case,
                    "batch": batch,
                    "checkpoint": result.get("checkpoint", False),
                    "cap_gib": None,
                },
                result,
            )
        ]
    return []


def _bytes(result: dict[str, Any]) -> tuple[Any, Any, str]:
    if result.get("h2d_bytes_counted") is not None:
        return result["h2d_bytes_counted"], result["d2h_bytes_counted"], "counted"
    if result.get("h2d_bytes_plan") is not None:
        return result["h2d_bytes_plan"], result.get("d2h_bytes_plan"), "plan"
    if "h2d_bytes" in result:
        return result["h2d_bytes"], result.get("d2h_bytes"), result.get("bytes_how", "reported")
    return None, None, ""


def _train_row(
    common: dict[str, Any], system: str, case: dict[str, Any], result: dict[str, Any]
) -> dict[str, Any]:
    h2d, d2h, how = _bytes(result)
    peak = result.get("peak_bytes")
    cap = case.get("cap_gib")
    tokens = case["batch"] * case["seq"]
    step = result.get("step_s")
    return {
        **common,
        "system": system,
        "variant": result.get("variant"),
        "mode": "train",
        "batch": case["batch"],
        "tokens": tokens,
        "checkpoint": case.get("checkpoint", False),
        "loss_chunk_tokens": case.get("loss_chunk_tokens", 0),
        "cap_gib": cap,
        "num_layers": result.get("num_layers", case.get("num_layers")),
        "step_s": step,
        "step_times_s": result.get("step_times_s"),
        "tokens_per_s": tokens / step if step else None,
        "peak_bytes": peak,
        "within_cap": None if cap is None or peak is None else peak <= cap * GIB,
        "planned_bytes": result.get("planned_bytes"),
        "resident_units": result.get("resident_units"),
        "num_units": result.get("num_units"),
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "h2d_refresh_bytes": result.get("h2d_refresh_bytes_counted"),
        "activation_bytes": result.get("calibration_activation_bytes"),
        "bytes_how": how,
        "predict_inputs": result.get("predict_inputs"),
        "optimizer_in_step_params_per_s": result.get("optimizer_in_step_params_per_s"),
        "optimizer_alone_params_per_s": result.get("optimizer_alone_params_per_s"),
        "optimizer_alone_cpu_stepped_params": result.get("optimizer_alone_cpu_stepped_params"),
        "device_stepped_units": result.get("device_stepped_units") or [],
    }


def _infer_row(
    common: dict[str, Any], system: str, row: dict[str, Any], result: dict[str, Any]
) -> dict[str, Any]:
    h2d, d2h, how = _bytes({**result, **row})
    tokens = row["batch"] * common["seq"]
    step = row.get("step_s")
    return {
        **common,
        "system": system,
        "variant": result.get("variant"),
        "mode": "infer",
        "batch": row["batch"],
        "tokens": tokens,
        "checkpoint": False,
        "cap_gib": None,
        "step_s": step,
        "tokens_per_s": tokens / step if step else None,
        "peak_bytes": row.get("peak_bytes"),
        "within_cap": None,
        "resident_units": result.get("resident_units"),
        "num_units": result.get("num_units"),
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "bytes_how": how,
        "predict_inputs": row.get("predict_inputs"),
    }


# ---------------------------------------------------------------------------------- floors


def _forward_flops(shape: dict[str, Any], batch: int, seq: int) -> float:
    matmul = 2.0 * (shape["num_params"] - shape["embed_params"]) * batch * seq
    return matmul + 2.0 * shape["num_layers"] * batch * seq * seq * shape["dim"]


# An AdamW step's least host-memory traffic per fp32 parameter: read param, grad, exp_avg,
# exp_avg_sq, write param, exp_avg, exp_avg_sq (4 B each). ramflow's in-step kernel moves the
# same 28 (a bf16 gradient read, a bf16 wire copy written).
ADAMW_BYTES_PER_PARAM = 28


def best_adamw_dram_rate(
    floors: dict[str, Any] | None, cpu: dict[str, Any] | None
) -> tuple[float, str] | None:
    """The highest host-memory throughput (bytes/s) any CPU AdamW reached in this run, and
    whose: torch's fused AdamW in the floors, and torch's and ramflow's over a model's
    masters (the CPU optimizer case). The CPU optimizer floor is the model's AdamW bytes at
    that rate: a floor set by DRAM, not by one implementation's speed."""
    found = []
    if floors and floors.get("cpu_adamw_fused_params_per_s"):
        rate = floors["cpu_adamw_fused_params_per_s"] * ADAMW_BYTES_PER_PARAM
        found.append((rate, "torch fused AdamW, floors"))
    if cpu and cpu.get("torch_fused_bytes_per_s"):
        found.append((cpu["torch_fused_bytes_per_s"], "torch fused AdamW, CPU optimizer case"))
    if cpu and cpu.get("ramflow_bytes_per_s"):
        found.append((cpu["ramflow_bytes_per_s"], "ramflow's AdamW, CPU optimizer case"))
    return max(found) if found else None


def add_floors(
    rows: list[dict[str, Any]],
    floors: dict[str, Any] | None,
    cpu_case: dict[str, Any] | None = None,
) -> None:
    """Set ``compute_s``, ``pcie_s``, ``cpu_opt_s``, ``floor_s``, ``bound`` and ``x_floor``
    on every non-resident row (in place), from the floors, the CPU optimizer case
    (``best_adamw_dram_rate``) and the resident rows."""
    resident = [
        r
        for r in rows
        if r["system"].startswith("resident") and r["status"] == "ok" and r.get("step_s")
    ]
    for row in rows:
        if row["system"].startswith("resident") or row["status"] != "ok":
            continue
        shape = row.get("shape") or next(
            (
                r["shape"]
                for r in rows
                if r.get("shape")
                and r["model"] == row["model"]
                and r.get("num_layers") == row.get("num_layers")
            ),
            None,
        )
        compute, how = _compute_floor(row, resident, shape, floors)
        pcie = cpu = None
        if floors and shape:
            bw = floors.get("bandwidth_bytes_per_s") or {}
            weights = 2 * shape["num_params"]  # bf16
            h2d = weights * (2 if row["mode"] == "train" else 1)
            d2h = weights if row["mode"] == "train" else 0
            if bw.get("h2d"):
                pcie = pcie_seconds(h2d, d2h, bw)
            dram = best_adamw_dram_rate(floors, cpu_case)
            here = row.get("optimizer_alone_params_per_s")
            if row["mode"] == "train" and here:
                cpu = shape["num_params"] / here  # measured in the case's own process
            elif row["mode"] == "train" and dram:
                cpu = shape["num_params"] * ADAMW_BYTES_PER_PARAM / dram[0]
            elif row["mode"] == "infer":
                cpu = 0.0
        parts = {"GPU compute": compute, "PCIe": pcie, "CPU optimizer": cpu}
        known = {k: v for k, v in parts.items() if v is not None}
        row.update(compute_s=compute, compute_how=how, pcie_s=pcie, cpu_opt_s=cpu)
        if known:
            bound = max(known, key=known.get)
            row.update(floor_s=known[bound], bound=bound, floor_complete=len(known) == 3)
            row["x_floor"] = row["step_s"] / known[bound] if row.get("step_s") else None


def pcie_seconds(h2d: float, d2h: float, bw: dict[str, float]) -> float:
    """Least time to move ``h2d`` and ``d2h`` bytes: while both directions run, each gets
    half the measured both-ways rate; the rest of the larger direction runs alone."""
    if not d2h:
        return h2d / bw["h2d"]
    if not h2d:
        return d2h / bw["d2h"]
    shared = min(h2d, d2h)
    rest, alone = (h2d - shared, bw["h2d"]) if h2d >= d2h else (d2h - shared, bw["d2h"])
    return shared / (bw["both"] / 2) + rest / alone


def _compute_floor(row, resident, shape, floors) -> tuple[float | None, str]:
    same = [
        r
        for r in resident
        if r["model"] == row["model"]
        and r["mode"] == row["mode"]
        and r["seq"] == row["seq"]
        and r.get("num_layers") == row.get("num_layers")
        and r["checkpoint"] == row["checkpoint"]
    ]
    exact = [r for r in same if r["batch"] == row["batch"]]
    if exact:
        return exact[0]["step_s"], "resident step"
    if same:
        r = same[0]
        return r["step_s"] * row["tokens"] / r[
            "tokens"
        ], f"resident {r['batch']}x{r['seq']} scaled by tokens"
    if shape and floors and floors.get("matmul_flops_per_s"):
        factor = 1 if row["mode"] == "infer" else (4 if row["checkpoint"] else 3)
        flops = factor * _forward_flops(shape, row["batch"], row["seq"])
        return flops / floors["matmul_flops_per_s"], "FLOPs / matmul rate"
    return None, "-"


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least squares y = a + b x with R^2; None with fewer than two points."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"intercept": a, "slope": b, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


# ---------------------------------------------------------------------------------- predictions


def measured_rates(floors: dict[str, Any] | None, cpu: dict[str, Any] | None):
    """(Rates, matmul FLOP/s, where the CPU rate came from) from this run's figures; None
    when the floors are missing (no prediction then)."""
    if not floors or not floors.get("matmul_flops_per_s"):
        return None
    bw = floors.get("bandwidth_bytes_per_s") or {}
    if not bw.get("h2d") or not bw.get("d2h"):
        return None
    p = load_predict()
    if cpu and cpu.get("ramflow_params_per_s"):
        rate, how = cpu["ramflow_params_per_s"], "ramflow's AdamW, CPU optimizer case"
    elif floors.get("cpu_adamw_fused_params_per_s"):
        rate = p.ramflow_adamw_rate(floors["cpu_adamw_fused_params_per_s"])
        how = f"torch fused x {p.RAMFLOW_ADAMW_PER_TORCH_FUSED} (floors)"
    else:
        return None
    rates = p.Rates(bw["h2d"], bw["d2h"], bw.get("both"), rate)
    return rates, floors["matmul_flops_per_s"], how


def _model_key(row: dict[str, Any]) -> tuple[str, Any, Any]:
    return row["model"], (row.get("shape") or {}).get("num_layers"), row["seq"]


def _unit_flops(inputs: dict[str, Any], batch: int) -> list[float]:
    """Forward FLOPs of each recorded unit for ``batch`` sequences (``planner.predict.forward_flops``)."""
    p = load_predict()
    return [
        p.forward_flops(
            u["matmul_params"],
            batch=batch,
            seq=inputs["seq"],
            attention_layers=u["attention_layers"],
            hidden=inputs["hidden"],
        )
        for u in inputs["units"]
    ]


def forward_efficiencies(
    rows: list[dict[str, Any]], floors: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """Per model (and depth and sequence): its inference forward's efficiency, measured on the
    resident bf16 inference step with the most tokens: the step-time model's FLOP count over
    the model's units (from any ramflow row of that model) over step time x matmul rate. The
    prediction gives it to ``planner.predict.forward_seconds`` (``infer_efficiency``), so the GPU time
    of what the FLOP count does not see (norms, rotary embedding, activations, launch gaps) is
    this model's own, measured, not the reference model's calibration."""
    if not floors or not floors.get("matmul_flops_per_s"):
        return {}
    p = load_predict()
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["system"] != "resident (bf16)" or r["status"] != "ok" or not r.get("step_s"):
            continue
        key = _model_key(r)
        inputs = next(
            (
                x["predict_inputs"]
                for x in rows
                if x["system"] == "ramflow" and _model_key(x) == key and x.get("predict_inputs")
            ),
            None,
        )
        if inputs is None:
            continue
        name = "/".join(str(k) for k in key)
        if name in out and out[name]["tokens"] >= r["tokens"]:
            continue
        flops = sum(_unit_flops(inputs, r["batch"]))
        out[name] = {
            "model": r["model"],
            "batch": r["batch"],
            "seq": r["seq"],
            "tokens": r["tokens"],
            "step_s": r["step_s"],
            "flops": flops,
            "efficiency": p.measured_efficiency(flops, r["step_s"], floors["matmul_flops_per_s"]),
        }
    return out


def _efficiency_for(
    efficiencies: dict[str, dict[str, Any]] | None, model: str, num_layers: Any, seq: Any
) -> float | None:
    e = (efficiencies or {}).get(f"{model}/{num_layers}/{seq}")
    return e["efficiency"] if e else None


def in_step_rated(rated, in_step_params_per_s: float | None):
    """``rated`` with the CPU optimizer's rate measured inside the training step itself (its
    worker's kernel time over the timed steps: "measured on the first step", issue 4), when
    the case recorded one. That rate already includes the copies' share of host memory, so
    they are not charged again."""
    if rated is None or not in_step_params_per_s:
        return rated
    rates, matmul, _ = rated
    rates = dataclasses.replace(
        rates,
        cpu_optimizer_params_per_s=in_step_params_per_s,
        cpu_optimizer_dram_bytes_per_param=None,
    )
    return rates, matmul, "measured in the step"


def predict(inputs: dict[str, Any] | None, rated, infer_efficiency: float | None = None) -> Any:
    """The ``StepPrediction`` of a step recorded with ``runners.predict_inputs``;
    ``infer_efficiency``: the model's measured one (``forward_efficiencies``), if known."""
    if not inputs or rated is None:
        return None
    p = load_predict()
    rates, matmul, _ = rated
    mode = inputs["mode"]
    units = []
    for u, flops in zip(inputs["units"], _unit_flops(inputs, inputs["batch"])):
        units.append(
            p.UnitCost(
                name=u["name"],
                wire_bytes=u["wire_bytes"],
                trainable_params=u["trainable_params"],
                forward_s=p.forward_seconds(
                    flops, matmul, mode=mode, infer_efficiency=infer_efficiency
                ),
                resident=u["resident"],
                checkpointed=u["checkpointed"],
                deps=tuple(u.get("deps") or ()),
            )
        )
    return p.predict_step(
        units,
        rates=rates,
        prefetch_depth=inputs["prefetch_depth"],
        mode=mode,
        grad_bytes_per_param=inputs.get("grad_bytes_per_param", 2),
    )


def add_predictions(
    rows: list[dict[str, Any]],
    floors: dict[str, Any] | None,
    cpu: dict[str, Any] | None,
    efficiencies: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Set ``predicted_s``, ``predicted`` (the parts), ``x_predicted`` (measured over
    predicted) and ``prediction_ok`` on every ramflow row that ran (in place);
    ``efficiencies``: ``forward_efficiencies`` of the same rows."""
    rated = measured_rates(floors, cpu)
    for row in rows:
        if row["system"] != "ramflow" or row["status"] != "ok" or not row.get("step_s"):
            continue
        inputs = row.get("predict_inputs")
        eff = _efficiency_for(efficiencies, *_model_key(row))
        pred = predict(inputs, in_step_rated(rated, row.get("optimizer_in_step_params_per_s")), eff)
        if pred is None:
            continue
        row["predicted_s"] = pred.step_s
        row["predicted"] = pred.as_dict()
        row["x_predicted"] = row["step_s"] / pred.step_s
        row["prediction_ok"] = abs(row["x_predicted"] - 1) <= PREDICT_TOLERANCE


def kofn_rows(
    records: list[dict[str, Any]], floors, cpu, efficiencies=None
) -> list[dict[str, Any]]:
    """One row per (k, train or infer) of the k-of-n cases, with bytes against (n-k)/n of
    full streaming (the k = 0 row of the same case) and the prediction."""
    rated = measured_rates(floors, cpu)
    out: list[dict[str, Any]] = []
    for rec in records:
        if rec["kind"] != "ramflow_kofn" or rec["status"] != "ok":
            continue
        res = rec["result"]
        n = res["num_blocks"]
        full: dict[str, Any] = {}
        for r in res["rows"]:
            for mode in ("train", "infer"):
                m = r[mode]
                h2d, refresh = m.get("h2d_bytes_counted"), m.get("h2d_refresh_bytes_counted")
                if refresh is None and (mode == "infer" or r["k"] == 0):
                    refresh = 0  # no CPU step, or nothing resident: nothing is refreshed
                stream = None if h2d is None or refresh is None else h2d - refresh
                if r["k"] == 0:
                    full[mode] = stream
                eff = _efficiency_for(
                    efficiencies, rec["case"]["model"], res.get("num_layers"), rec["case"]["seq"]
                )
                rated_here = in_step_rated(rated, m.get("optimizer_in_step_params_per_s"))
                pred = predict(m.get("predict_inputs"), rated_here, eff)
                k = r[
                    "resident_blocks"
                ]  # the budget asked for r["k"]; this is what the engine kept
                target = (n - k) / n
                share = stream / full[mode] if stream is not None and full.get(mode) else None
                row = {
                    "case": rec["id"],
                    "model": rec["case"]["model"],
                    "mode": mode,
                    "batch": m["batch"],
                    "seq": rec["case"]["seq"],
                    "k": k,
                    "k_asked": r["k"],
                    "n": n,
                    "num_params": res.get("num_params"),
                    "num_layers": res.get("num_layers"),
                    "resident": r["resident"],
                    "resident_units": r["resident_units"],
                    "num_units": r["num_units"],
                    "resident_byte_share": r["resident_bytes"] / r["wire_bytes_total"],
                    "gpu_memory_bytes": r["gpu_memory_bytes"],
                    "step_s": m["step_s"],
                    "step_times_s": m.get("step_times_s"),
                    "step_s_rounds": m.get("step_s_rounds"),
                    "peak_bytes": m.get("peak_bytes"),
                    "h2d_bytes": h2d,
                    "h2d_stream_bytes": stream,
                    "h2d_refresh_bytes": refresh,
                    "d2h_bytes": m.get("d2h_bytes_counted"),
                    "stream_share": share,
                    "target_share": target,
                    "x_target": share / target if share is not None and target else None,
                    "predicted_s": pred.step_s if pred else None,
                    "predicted": pred.as_dict() if pred else None,
                    "predicted_stream_bytes": pred.h2d_stream_bytes if pred else None,
                    "x_predicted": m["step_s"] / pred.step_s if pred else None,
                }
                row["prediction_ok"] = (
                    None if pred is None else abs(row["x_predicted"] - 1) <= PREDICT_TOLERANCE
                )
                out.append(row)
    return out
