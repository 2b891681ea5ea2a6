"""Turn case results into rows with floors, and write the markdown report.

Pure Python (no torch): ``bench.py --report`` can rebuild a report from result files anywhere.

The floor of a case is max(GPU compute, PCIe, CPU optimizer), each from figures measured in
the run (or in another run's floors, with ``--report``):
- GPU compute: the resident step of the same model, batch and checkpointing (measured), else
  a resident step at another batch scaled by tokens, else the FLOP count (2 per multiply-add
  of the forward, x3 for training, x4 with recomputation) over the measured matmul rate;
- PCIe: bf16 weights host-to-device once (inference) or twice (training), and bf16 gradients
  device-to-host once, over the measured pinned bandwidths (``pcie_seconds``: both ways at
  once at half the both-ways rate each, the rest of the larger direction alone); everything
  streamed, nothing resident, as in ANCHORS.md;
- CPU optimizer: the fp32 master parameters over torch's fused CPU AdamW rate, measured on a
  slice of parameters and scaled linearly (training only).

Each ramflow step is also predicted by ramflow's step-time model (``ramflow._predict``, loaded
from ``src/`` by path, so no torch here) from the unit sizes the case recorded and the rates
this run measured: pinned copy rates and the bf16 matmul rate from the floors, the CPU AdamW
rate from the CPU optimizer case (else the floors' torch fused rate scaled by
``RAMFLOW_ADAMW_PER_TORCH_FUSED``), and each model's GPU forward efficiency from its resident
bf16 inference step (``forward_efficiencies``). "x predicted" is measured / predicted.

``targets`` states issue 4's targets for the reference model, each a ratio from the one run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

GIB = 1 << 30
PREDICT_PATH = Path(__file__).resolve().parent.parent / "src" / "ramflow" / "_predict.py"

# Issue 4's targets, for the reference model of ANCHORS.md; each is a ratio from one run on one
# device (``targets``).
INFER_1_PCIE_TARGET = 1.05  # inference 1x2048, nothing resident: <= 1.05x the PCIe floor
INFER_8_RESIDENT_TARGET = 1.05  # inference 8x2048: <= 1.05x the resident bf16 inference step
TRAIN_FLOOR_TARGET = 1.15  # training 4x2048, peak <= 12 GiB: step <= 1.15x its floor
TRAIN_4_PEER_TARGET = 2.0  # ... and tokens/s >= 2x the fastest peer at 4x2048, any memory
TRAIN_16_PEER_TARGET = 1.4  # training 16x2048, peak <= 16 GiB: tokens/s >= 1.4x the fastest peer
TRAIN_NOCAP_RESIDENT_TARGET = 1.15  # training 16x2048, no cap: step <= 1.15x the resident step
PREDICT_TOLERANCE = 0.15  # point 4: predicted step time within 15% of the measured one
# k of n, training: "the step time follows" the bytes: fewer bytes never make the step slower
# than k = 0 by more than this (our reading; bound by the CPU optimizer the step barely moves,
# and fewer copies through host memory may make it faster, which follows the bytes too)
KOFN_TRAIN_FLAT = 0.05


def load_predict():
    """``ramflow._predict`` loaded from its file (it needs only the standard library)."""
    name = "ramflow_predict_standalone"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PREDICT_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


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
    """Forward FLOPs of each recorded unit for ``batch`` sequences (``_predict.forward_flops``)."""
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
    prediction gives it to ``_predict.forward_seconds`` (``infer_efficiency``), so the GPU time
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
                x.get("predict_inputs") or reference_inputs(x)
                for x in rows
                if x["system"] == "ramflow"
                and _model_key(x) == key
                and (x.get("predict_inputs") or reference_inputs(x))
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


def reference_inputs(row: dict[str, Any]) -> dict[str, Any] | None:
    """Prediction inputs of a reference-model ramflow row recorded before cases kept them
    (the 2026-11-22 files): units [embed, blocks, norm, head] from the shape fields, the
    last ``resident_units`` of them resident, the model's own checkpointing."""
    shape = row.get("shape")
    if row["model"] != "reference" or not shape or row.get("resident_units") is None:
        return None
    d, v, layers = shape["dim"], shape["vocab_size"], shape["num_layers"]
    block = (shape["num_params"] - 2 * v * d - d) // layers
    specs = [("embed", v * d, 0, 0, False)]
    specs += [(f"layers.{i}", block, block - 2 * d, 1, True) for i in range(layers)]
    specs += [("norm", d, 0, 0, False), ("head", v * d, v * d, 0, False)]
    n, resident = len(specs), row["resident_units"]
    ckpt = row["mode"] == "train" and row.get("checkpoint")
    chunked = bool(row.get("loss_chunk_tokens"))
    return {
        "mode": row["mode"],
        "batch": row["batch"],
        "seq": row["seq"],
        "hidden": d,
        "prefetch_depth": 2,
        "grad_bytes_per_param": 2,
        "units": [
            {
                "name": name,
                "wire_bytes": 2 * params,
                "trainable_params": params,
                "matmul_params": mm,
                "attention_layers": attn,
                "resident": i >= n - resident,
                "checkpointed": bool(ckpt and (is_block or (chunked and name == "head"))),
                "deps": [],
            }
            for i, (name, params, mm, attn, is_block) in enumerate(specs)
        ],
    }


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
        inputs = row.get("predict_inputs") or reference_inputs(row)
        eff = _efficiency_for(efficiencies, *_model_key(row))
        pred = predict(inputs, in_step_rated(rated, row.get("optimizer_in_step_params_per_s")), eff)
        if pred is None:
            continue
        row["predicted_s"] = pred.step_s
        row["predicted"] = pred.as_dict()
        row["predicted_how"] = "recorded units" if row.get("predict_inputs") else "shape fields"
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


REFERENCE_SCOPE = "reference"
OTHER_SCOPE = "{model} (no target in the issue; reported)"


def _scope(model: str) -> str:
    return REFERENCE_SCOPE if model == "reference" else OTHER_SCOPE.format(model=model)


def _critical(pred: dict[str, Any] | None) -> str:
    if not pred:
        return ""
    crit = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in pred["critical_s"].items() if v >= 5e-4)
    return f"predicted critical path (ms): {crit}"


def _floor_why(r: dict[str, Any]) -> str:
    """The floor that binds a row (measured floors) and the predicted critical path."""
    parts = []
    if r.get("bound"):
        parts.append(f"binding floor: {r['bound']} {_f(r.get('floor_s'), 1e3)} ms")
    crit = _critical(r.get("predicted"))
    if crit:
        parts.append(crit)
    return "; ".join(parts)


def _cpu_floor_note(
    r: dict[str, Any], floors: dict[str, Any] | None, cpu: dict[str, Any] | None
) -> str:
    """Why the CPU optimizer floor is where it is, and what the prediction charges it."""
    shape = r.get("shape") or {}
    parts = []
    dram = best_adamw_dram_rate(floors, cpu)
    here = r.get("optimizer_alone_params_per_s")
    if here and shape:
        parts.append(
            f"CPU optimizer floor = {shape['num_params'] / 1e9:.2f} G params at "
            f"{here / 1e9:.2f} G params/s ({here * ADAMW_BYTES_PER_PARAM / 1e9:.1f} GB/s): "
            "ramflow's AdamW alone over this case's own host tensors, in its process, after "
            "the timed steps (GPU and worker idle)"
        )
        if dram and r.get("step_s"):
            strict = shape["num_params"] * ADAMW_BYTES_PER_PARAM / dram[0]
            parts.append(
                f"against the fastest AdamW host-memory rate anywhere in this run "
                f"({dram[0] / 1e9:.1f} GB/s, {dram[1]}; {strict * 1e3:.1f} ms) the step is "
                f"{r['step_s'] / strict:.3f}"
            )
    elif dram and shape:
        parts.append(
            f"CPU optimizer floor = {shape['num_params'] / 1e9:.2f} G params x "
            f"{ADAMW_BYTES_PER_PARAM} B / {dram[0] / 1e9:.1f} GB/s, the fastest AdamW's host "
            f"memory traffic in this run ({dram[1]})"
        )
    on_device = r.get("device_stepped_units") or []
    cpu_params = r.get("optimizer_alone_cpu_stepped_params")
    if on_device and here and cpu_params and shape and r.get("step_s"):
        # the floor above is the issue's: every parameter stepped by the CPU optimizer
        cpu_alone = cpu_params / here
        parts.append(
            f"{len(on_device)} units ({(shape['num_params'] - cpu_params) / 1e9:.2f} G params: "
            f"{', '.join(on_device)}) are stepped on the GPU (ramflow's device_optimizer, "
            f"in the budget's room); the CPU optimizer alone over the other "
            f"{cpu_params / 1e9:.2f} G params takes {cpu_alone * 1e3:.1f} ms, and the step is "
            f"{r['step_s'] / cpu_alone:.3f} of that"
        )
    if floors and floors.get("cpu_adamw_fused_params_per_s"):
        parts.append(
            f"torch fused AdamW alone {floors['cpu_adamw_fused_params_per_s'] / 1e9:.2f} G params/s"
        )
    if cpu and cpu.get("ramflow_params_per_s"):
        parts.append(f"ramflow's AdamW alone {cpu['ramflow_params_per_s'] / 1e9:.2f} G params/s")
    if r.get("optimizer_in_step_params_per_s"):
        parts.append(
            f"in this step {r['optimizer_in_step_params_per_s'] / 1e9:.2f} G params/s (its "
            "worker's kernel time, beside the step's copies)"
        )
    copies = (r.get("h2d_bytes") or 0) + (r.get("d2h_bytes") or 0)
    rate = here * ADAMW_BYTES_PER_PARAM if here else dram[0] if dram else None
    if rate and shape and copies and r.get("step_s") and r.get("cpu_opt_s"):
        # every byte the PCIe copies move is read from or written to host memory as well
        host = shape["num_params"] * ADAMW_BYTES_PER_PARAM + copies
        bound = host / rate
        parts.append(
            f"host-memory bound of the whole step: the optimizer's {ADAMW_BYTES_PER_PARAM} B "
            f"per parameter plus the copies' {copies / 1e9:.2f} GB through host memory, "
            f"{host / 1e9:.1f} GB at {rate / 1e9:.1f} GB/s = {bound * 1e3:.1f} ms "
            f"({bound / r['cpu_opt_s']:.3f} of the CPU optimizer floor; the step is "
            f"{r['step_s'] / bound:.3f} of it)"
        )
    if floors and floors.get("cpu_adamw_fused_params_per_s") and shape and r.get("step_s"):
        fused = shape["num_params"] / floors["cpu_adamw_fused_params_per_s"]
        parts.append(
            f"against ANCHORS.md's floor (the model's parameters at torch fused AdamW's rate, "
            f"{fused * 1e3:.1f} ms) the step is {r['step_s'] / fused:.3f}"
        )
    pred = r.get("predicted")
    if pred and pred.get("copies_on_cpu_s"):
        parts.append(
            f"predicted CPU busy {pred['busy_s']['CPU optimizer'] * 1e3:.0f} ms, "
            f"{pred['copies_on_cpu_s'] * 1e3:.0f} ms of it the copies' host-memory traffic"
        )
    return "; ".join(parts)


def _logits_note(r: dict[str, Any]) -> str:
    """For a capped row over its cap: the fp32 logits against the activations it recorded."""
    shape = r.get("shape") or {}
    act = r.get("activation_bytes")
    if not shape or not act or r["mode"] != "train":
        return ""
    logits = r["tokens"] * shape["vocab_size"] * 4
    ckpt = shape["num_layers"] * r["tokens"] * shape["dim"] * 2 if r.get("checkpoint") else 0
    planned = r.get("planned_bytes")
    loss = "transformers' loss" if r["model"] != "reference" else "the loss"
    return (
        f"activations (calibration peak - planned) {act / GIB:.2f} GiB; one fp32 copy of the "
        f"logits ({r['tokens']} tokens x {shape['vocab_size']} vocabulary x 4 B) is "
        f"{logits / GIB:.2f} GiB, and {loss} holds about "
        f"{(act - ckpt) / logits:.1f} such copies at its peak (upcast, log-softmax output, its "
        f"gradient) besides {ckpt / GIB:.2f} GiB of checkpointed block inputs"
        + (f"; ramflow's smallest plan {planned / GIB:.2f} GiB" if planned else "")
    )


def _item(scope, target, case, ratio, threshold, met, why="") -> dict[str, Any]:
    return {
        "scope": scope,
        "target": target,
        "case": case,
        "ratio": ratio,
        "threshold": threshold,
        "met": met if scope == REFERENCE_SCOPE else None,
        "within": met,
        "why": why,
    }


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 4's targets, each a ratio from this one run, with met or NOT MET and for a miss
    the floor that binds. The targets are for the reference model (ANCHORS.md); other models'
    rows are listed as reported (``met`` None, ``within`` says how they compare)."""
    rows = [r for r in doc["rows"] if r["status"] == "ok" and r.get("step_s")]
    floors, cpu = doc.get("floors"), doc.get("cpu_optimizer")
    main = [r for r in rows if r["system"] == "ramflow" and r["group"] == "ramflow"]
    peers = [r for r in rows if r["group"] == "peers"]
    resident = [r for r in rows if r["system"].startswith("resident")]
    out: list[dict[str, Any]] = []

    def fastest_peer(r: dict[str, Any]) -> dict[str, Any] | None:
        same = [
            p
            for p in peers
            if p["model"] == r["model"]
            and p["mode"] == "train"
            and p["batch"] == r["batch"]
            and p["seq"] == r["seq"]
        ]
        return min(same, key=lambda p: p["step_s"]) if same else None

    for r in main:
        scope = _scope(r["model"])
        what = f"{r['model']} {r['mode']} {r['batch']}x{r['seq']}, {_budget(r)}"
        if r["mode"] == "infer" and r["batch"] == 1 and r.get("pcie_s"):
            ratio = r["step_s"] / r["pcie_s"]
            ok = ratio <= INFER_1_PCIE_TARGET
            out.append(
                _item(
                    scope,
                    f"inference 1x2048, nothing resident: step <= {INFER_1_PCIE_TARGET}x the "
                    "PCIe floor",
                    f"{what} (PCIe floor {_f(r['pcie_s'], 1e3)} ms)",
                    ratio,
                    f"<= {INFER_1_PCIE_TARGET}",
                    ok,
                    "" if ok else _floor_why(r),
                )
            )
        if r["mode"] == "infer" and r["batch"] == 8:
            res = next(
                (
                    x
                    for x in resident
                    if x["mode"] == "infer"
                    and x["model"] == r["model"]
                    and x["batch"] == r["batch"]
                    and x["seq"] == r["seq"]
                ),
                None,
            )
            if res:
                ratio = r["step_s"] / res["step_s"]
                ok = ratio <= INFER_8_RESIDENT_TARGET
                why = ""
                if not ok:
                    over = (r["step_s"] - res["step_s"]) * 1e3
                    fill = _fill_note(r, (floors or {}).get("bandwidth_bytes_per_s") or {})
                    why = (
                        f"binding floor: GPU compute, the resident step {_f(res['step_s'], 1e3)} "
                        f"ms; the {over:.1f} ms over it is {fill or 'not hidden loading'}; "
                        f"{_critical(r.get('predicted'))}"
                    )
                out.append(
                    _item(
                        scope,
                        f"inference 8x2048: step <= {INFER_8_RESIDENT_TARGET}x the resident bf16 "
                        "inference step",
                        f"{what} (resident {_f(res['step_s'], 1e3)} ms)",
                        ratio,
                        f"<= {INFER_8_RESIDENT_TARGET}",
                        ok,
                        why,
                    )
                )
        if r["mode"] != "train":
            continue
        cap = r.get("cap_gib")
        if cap is not None and r.get("peak_bytes"):
            ratio = r["peak_bytes"] / (cap * GIB)
            ok = ratio <= 1
            why = "" if ok else _logits_note(r) or "activations (see the budget rule)"
            out.append(
                _item(
                    scope,
                    f"training {r['batch']}x{r['seq']}: peak GPU memory <= {cap} GiB",
                    f"{what} (peak {_f(r['peak_bytes'], 1 / GIB, 2)} GiB)",
                    ratio,
                    "<= 1",
                    ok,
                    why,
                )
            )
        if r["batch"] == 4 and cap is not None:
            if r.get("x_floor") is not None:
                ok = r["x_floor"] <= TRAIN_FLOOR_TARGET
                why = _floor_why(r) if not ok else ""
                if r.get("bound") == "CPU optimizer":
                    why += ("; " if why else "") + _cpu_floor_note(r, floors, cpu)
                out.append(
                    _item(
                        scope,
                        f"training 4x2048, peak <= {cap} GiB: step <= {TRAIN_FLOOR_TARGET}x its "
                        "floor",
                        f"{what} (floor {_f(r.get('floor_s'), 1e3)} ms, {r.get('bound')})",
                        r["x_floor"],
                        f"<= {TRAIN_FLOOR_TARGET}",
                        ok,
                        why,
                    )
                )
            best = fastest_peer(r)
            if best:
                ratio = best["step_s"] / r["step_s"]  # tokens/s ratio at the same tokens
                ok = ratio >= TRAIN_4_PEER_TARGET
                out.append(
                    _item(
                        scope,
                        f"training 4x2048, peak <= {cap} GiB: tokens/s >= {TRAIN_4_PEER_TARGET}x "
                        "the fastest peer at any memory",
                        f"{what} (fastest peer: {best['system']}, {_f(best['step_s'], 1e3)} ms, "
                        f"{_f(best.get('peak_bytes'), 1 / GIB, 1)} GiB)",
                        ratio,
                        f">= {TRAIN_4_PEER_TARGET}",
                        ok,
                        "" if ok else _floor_why(r),
                    )
                )
        if r["batch"] == 16 and cap is not None:
            best = fastest_peer(r)
            if best:
                ratio = best["step_s"] / r["step_s"]
                ok = ratio >= TRAIN_16_PEER_TARGET
                out.append(
                    _item(
                        scope,
                        f"training 16x2048, peak <= {cap} GiB: tokens/s >= "
                        f"{TRAIN_16_PEER_TARGET}x the fastest peer at any memory",
                        f"{what} (fastest peer: {best['system']}, {_f(best['step_s'], 1e3)} ms, "
                        f"{_f(best.get('peak_bytes'), 1 / GIB, 1)} GiB)",
                        ratio,
                        f">= {TRAIN_16_PEER_TARGET}",
                        ok,
                        "" if ok else _floor_why(r),
                    )
                )
        if r["batch"] == 16 and cap is None and r.get("compute_s"):
            ratio = r["step_s"] / r["compute_s"]
            ok = ratio <= TRAIN_NOCAP_RESIDENT_TARGET
            how = r.get("compute_how") or ""
            est = ""
            if how != "resident step":
                est = f"estimated: {how}; a resident step without checkpointing does not fit"
                src = next(
                    (
                        x
                        for x in resident
                        if x["model"] == r["model"]
                        and x["mode"] == "train"
                        and not x.get("checkpoint")
                        and x.get("peak_bytes")
                    ),
                    None,
                )
                if src:
                    est += (
                        f" (at {src['batch']}x{src['seq']} it peaks at "
                        f"{src['peak_bytes'] / GIB:.1f} GiB)"
                    )
            out.append(
                _item(
                    scope,
                    f"training 16x2048, no cap: step <= {TRAIN_NOCAP_RESIDENT_TARGET}x the "
                    "resident step",
                    f"{what} (resident {_f(r['compute_s'], 1e3)} ms{'; ' + est if est else ''})",
                    ratio,
                    f"<= {TRAIN_NOCAP_RESIDENT_TARGET}",
                    ok,
                    "" if ok else _floor_why(r),
                )
            )
    out += _kofn_targets(doc, resident, floors)
    predicted = [r for r in rows if r["system"] == "ramflow" and r.get("x_predicted") is not None]
    kofn = [r for r in doc.get("kofn") or [] if r.get("x_predicted") is not None]
    for r in predicted + kofn:
        if "k" in r:
            what = (
                f"{r['model']} {r['mode']} {r['batch']}x{r['seq']}, k={r['k']} of {r['n']} blocks"
            )
        elif r["group"] == "scaling":
            what = f"{r['model']} {r['mode']} {r['batch']}x{r['seq']}, {r['num_layers']} layers"
        else:
            what = f"{r['model']} {r['mode']} {r['batch']}x{r['seq']}, {_budget(r)}"
        ok = abs(r["x_predicted"] - 1) <= PREDICT_TOLERANCE
        out.append(
            _item(
                _scope(r["model"]),
                f"planner: measured / predicted within 1 +- {PREDICT_TOLERANCE}",
                f"{what} (predicted {_f(r['predicted_s'], 1e3)} ms)",
                r["x_predicted"],
                f"{1 - PREDICT_TOLERANCE:.2f} to {1 + PREDICT_TOLERANCE:.2f}",
                ok,
                "" if ok else _critical(r.get("predicted")),
            )
        )
    order = (
        "inference 1x2048",
        "inference 8x2048",
        "training 4x2048: peak",
        "training 4x2048, peak",
        "training 16x2048: peak",
        "training 16x2048, peak",
        "training 16x2048, no cap",
        "k of n",
        "planner",
    )

    def rank(t: dict[str, Any]) -> tuple[bool, int]:
        return t["scope"] != REFERENCE_SCOPE, next(
            (i for i, o in enumerate(order) if t["target"].startswith(o)), len(order)
        )

    return sorted(out, key=rank)


def _fill_note(r: dict[str, Any], bw: dict[str, Any]) -> str:
    """The loads the first compute waits for when nothing is resident (the pipeline fill)."""
    inputs = r.get("predict_inputs") or reference_inputs(r)
    if not inputs or not bw.get("h2d"):
        return ""
    units = inputs["units"]
    first = next((i for i, u in enumerate(units) if u["matmul_params"] > 0), None)
    if first is None:
        return ""
    fill = units[: first + 1]
    nbytes = sum(u["wire_bytes"] for u in fill if not u["resident"])
    if not nbytes:
        return ""
    names = " and ".join(u["name"] for u in fill if not u["resident"])
    return (
        f"the pipeline fill: the first compute waits for the loads of {names} "
        f"({nbytes / 1e9:.2f} GB, {nbytes / bw['h2d'] * 1e3:.1f} ms at "
        f"{bw['h2d'] / 1e9:.1f} GB/s), since nothing is resident to start on (the engine keeps "
        "the last units resident first)"
    )


def _rounds(r: dict[str, Any], base: dict[str, Any]) -> str:
    """How a k-of-n training step was taken when it ran in several rounds."""
    mine, theirs = r.get("step_s_rounds") or [], base.get("step_s_rounds") or []
    if len(mine) < 2:
        return ""
    ms = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
    return (
        f" (medians of {len(mine)} rounds, the k order reversed every other round: "
        f"{ms(mine)} against {ms(theirs)} ms)"
    )


def _kofn_targets(
    doc: dict[str, Any], resident: list[dict[str, Any]], floors: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """k of n resident: bytes at most (n-k)/n of full streaming, and the step time follows
    (inference falls with the bytes; training, bound by the CPU optimizer, does not rise)."""
    out: list[dict[str, Any]] = []
    bw = (floors or {}).get("bandwidth_bytes_per_s") or {}
    dram = best_adamw_dram_rate(floors, doc.get("cpu_optimizer"))
    for mode in ("train", "infer"):
        ks = sorted(
            (r for r in doc.get("kofn") or [] if r["mode"] == mode and r.get("step_s")),
            key=lambda r: r["k"],
        )
        if not ks or ks[0]["k"] != 0:
            continue
        base = ks[0]
        for prev, r in zip([None, *ks], ks):
            scope = _scope(r["model"])
            what = (
                f"{r['model']} {mode} {r['batch']}x{r['seq']}, k={r['k']} of {r['n']} blocks "
                f"({r['resident_units']}/{r['num_units']} units)"
            )
            # the floors of this layout: GPU compute (the resident step), PCIe (its bytes),
            # CPU optimizer (training)
            res = next(
                (
                    x
                    for x in resident
                    if x["model"] == r["model"]
                    and x["mode"] == mode
                    and x["batch"] == r["batch"]
                    and x["seq"] == r["seq"]
                    and (mode == "infer" or x.get("checkpoint"))
                    and (mode == "infer" or x.get("loss_chunk_tokens"))
                ),
                None,
            )
            parts: dict[str, float] = {}
            if res:
                parts["GPU compute"] = res["step_s"]
            if bw.get("h2d") and r.get("h2d_bytes") is not None:
                parts["PCIe"] = pcie_seconds(r["h2d_bytes"], r.get("d2h_bytes") or 0, bw)
            if mode == "train" and dram and r.get("num_params"):
                parts["CPU optimizer"] = r["num_params"] * ADAMW_BYTES_PER_PARAM / dram[0]
            binds = max(parts, key=parts.get) if parts else None
            floor_text = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
            if r["k"] and r.get("stream_share") is not None:
                ok = r["stream_share"] <= r["target_share"]
                note = ""
                if ok and r["stream_share"] < r["target_share"] - 0.005:
                    why = []
                    if mode == "infer" and not r["h2d_stream_bytes"]:
                        why.append("every streamed unit stays in the window between forwards")
                    elif r["resident_byte_share"] > r["k"] / r["n"] + 0.005:
                        why.append(
                            "the final norm and head are resident too (resident byte share "
                            f"{r['resident_byte_share']:.2f} against k/n = {r['k'] / r['n']:.2f})"
                        )
                    pred = r.get("predicted")
                    if mode == "train" and pred:
                        fwd = pred["h2d_forward_bytes"]
                        back = pred["h2d_stream_bytes"] - fwd
                        why.append(
                            f"backward re-sends only the streamed units that left the window by "
                            f"the turn-around ({back / 1e9:.2f} of {fwd / 1e9:.2f} GB)"
                        )
                    note = "fewer: " + "; ".join(why) if why else ""
                out.append(
                    _item(
                        scope,
                        "k of n resident: streamed H2D <= (n-k)/n of full streaming",
                        f"{what}: {_f(r['h2d_stream_bytes'], 1e-9, 2)} GB of "
                        f"{_f(base['h2d_stream_bytes'], 1e-9, 2)}, (n-k)/n = {r['target_share']:.3f}",
                        r["stream_share"],
                        f"<= {r['target_share']:.3f}",
                        ok,
                        note,
                    )
                )
            if not r["k"]:
                continue
            ratio = r["step_s"] / base["step_s"]
            if mode == "infer":
                ok = prev is not None and r["step_s"] < prev["step_s"]
                saved = (base["h2d_stream_bytes"] or 0) - (r["h2d_stream_bytes"] or 0)
                took = base["step_s"] - r["step_s"]
                note = f"floors (ms): {floor_text}; binds: {binds}"
                if saved and bw.get("h2d"):
                    note += (
                        f"; {took / (saved / bw['h2d']):.0%} of the saved bytes' transfer time "
                        "came off the step (the rest: the resident units' compute, which runs "
                        "after the last load)"
                    )
                out.append(
                    _item(
                        scope,
                        "k of n resident, inference: the step time falls with the bytes",
                        f"{what}: step {_f(r['step_s'], 1e3)} ms against "
                        f"{_f(prev['step_s'], 1e3)} at k={prev['k']} (byte share "
                        f"{_f(r['stream_share'], 1, 3)})",
                        ratio,
                        f"< {prev['step_s'] / base['step_s']:.3f} (k={prev['k']})",
                        ok,
                        note,
                    )
                )
            else:
                ok = ratio <= 1 + KOFN_TRAIN_FLAT
                note = f"floors (ms): {floor_text}; binds: {binds}"
                if r.get("predicted"):
                    note += (
                        f"; predicted {_f(base['predicted_s'], 1e3)} -> "
                        f"{_f(r['predicted_s'], 1e3)} ms (fewer copies through host memory "
                        "beside the CPU optimizer)"
                    )
                out.append(
                    _item(
                        scope,
                        "k of n resident, training: fewer bytes, the step no slower (CPU "
                        "optimizer bound)",
                        f"{what}: step {_f(r['step_s'], 1e3)} ms against "
                        f"{_f(base['step_s'], 1e3)} at k=0{_rounds(r, base)}",
                        ratio,
                        f"<= {1 + KOFN_TRAIN_FLAT}",
                        ok,
                        note,
                    )
                )
    return out


# ---------------------------------------------------------------------------------- markdown


def _f(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * scale:.{digits}f}"


def _budget(row: dict[str, Any]) -> str:
    if row["mode"] == "infer":
        return "nothing resident" if row["system"] == "ramflow" else "-"
    parts = []
    if row.get("cap_gib") is not None:
        parts.append(f"<= {row['cap_gib']} GiB")
    elif row["system"] == "ramflow":
        parts.append("no cap")
    if row.get("checkpoint"):
        parts.append("ckpt")
    if row.get("loss_chunk_tokens"):
        parts.append("chunked loss")
    return ", ".join(parts) or "-"


def _how(row: dict[str, Any]) -> str:
    return row["bytes_how"] if row.get("bytes_how") in ("counted", "plan") else ""


def _x_predicted(r: dict[str, Any]) -> str:
    if r.get("x_predicted") is None:
        return "-"
    flag = "" if r.get("prediction_ok") else " MISS"
    return f"{r['x_predicted']:.2f}{flag}"


def _parts(pred: dict[str, Any]) -> str:
    text = f"forward {pred['forward_s'] * 1e3:.0f} + backward {pred['backward_s'] * 1e3:.0f}"
    if pred["mode"] == "train":
        text += f"; optimizer tail {pred['optimizer_tail_s'] * 1e3:.0f}"
    return text


def _first_step(r: dict[str, Any]) -> str:
    """The first timed step (after a drain) against the model's first simulated step."""
    times, pred = r.get("step_times_s"), r.get("predicted") or {}
    if r.get("mode") != "train" or not times or not pred.get("first_step_s"):
        return "-"
    return (
        f"{times[0] * 1e3:.0f} / {pred['first_step_s'] * 1e3:.0f} "
        f"(x{times[0] / pred['first_step_s']:.2f})"
    )


def _prediction_section(doc: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Predicted against measured for every ramflow step, with the parts and the bound."""
    ours = [r for r in rows if r.get("predicted")]
    if not ours:
        return []
    rated = measured_rates(doc.get("floors"), doc.get("cpu_optimizer"))
    p = load_predict()
    effs = doc.get("gpu_forward") or {}
    eff_text = "; ".join(
        f"{e['model']} {e['efficiency']:.1%} (resident bf16 inference {e['batch']}x{e['seq']}, "
        f"{e['step_s'] * 1e3:.1f} ms)"
        for e in effs.values()
    )
    out = [
        "## Predicted against measured",
        "",
        "ramflow's step-time model (`ramflow._predict`) on the unit sizes each case recorded and "
        "this run's rates"
        + (
            f": H2D {rated[0].h2d_bytes_per_s / 1e9:.1f}, D2H {rated[0].d2h_bytes_per_s / 1e9:.1f}, "
            f"both {(rated[0].both_bytes_per_s or 0) / 1e9:.1f} GB/s; bf16 matmul "
            f"{rated[1] / 1e12:.0f} TFLOP/s; CPU AdamW {rated[0].cpu_optimizer_params_per_s / 1e9:.2f} "
            f"G params/s ({rated[2]}), whose DRAM traffic "
            f"({rated[0].cpu_optimizer_dram_bytes_per_param:.0f} B per parameter) shares host "
            "memory with the PCIe copies: each step's copy bytes are charged to the optimizer at "
            "its DRAM rate. A training case that recorded its own CPU optimizer rate (its "
            'worker\'s kernel time over the timed steps, "in step" in the table) is predicted '
            "with that rate instead, the copies' share already in it"
            if rated
            else ""
        )
        + ". GPU forward: each model's inference efficiency measured on its resident step "
        + (
            f"({eff_text}; a training forward runs at that x "
            f"{p.TRAIN_MATMUL_EFFICIENCY}/{p.INFER_MATMUL_EFFICIENCY})"
            if eff_text
            else f"(none in this run: {p.INFER_MATMUL_EFFICIENCY:.0%} inference, "
            f"{p.TRAIN_MATMUL_EFFICIENCY:.0%} training)"
        )
        + f". MISS: measured / predicted outside 1 +- {PREDICT_TOLERANCE}. First step: the "
        "first timed step, which follows a drain (no optimizer step to wait for: GPU and links "
        "alone), measured / predicted.",
        "",
        "| model | step | tokens | budget | resident | measured (ms) | predicted (ms) | parts (ms) "
        "| critical path (ms) | bound | x predicted | first step (ms) | CPU AdamW in step "
        "(G params/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ours:
        pred = r["predicted"]
        crit = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in pred["critical_s"].items() if v >= 5e-4)
        resident = f"{r.get('resident_units')}/{r.get('num_units')}" if r.get("num_units") else "-"
        out.append(
            f"| {r['model']} | {r['mode']} | {r['batch']}x{r['seq']} | {_budget(r)} | {resident} | "
            f"{_f(r['step_s'], 1e3)} | {_f(r['predicted_s'], 1e3)} | {_parts(pred)} | {crit} | "
            f"{pred['bound']} | {_x_predicted(r)} | {_first_step(r)} | "
            f"{_f(r.get('optimizer_in_step_params_per_s'), 1e-9, 2)} |"
        )
    out += ["", *_prediction_notes(ours, doc.get("kofn") or []), ""]
    return out


LOSS_BYTES_PER_LOGIT = 40
"""Device memory traffic of a plain fp32 cross-entropy per logit, forward and backward: the
fp32 upcast (read 2, write 4), log-softmax (read 4 twice, write 4), the NLL gradient (write 4),
log-softmax's backward (read 8, write 4), the cast back (read 4, write 2)."""


def _prediction_notes(rows: list[dict[str, Any]], kofn: list[dict[str, Any]]) -> list[str]:
    """What the model leaves out, with this run's figures where they show."""
    out = ["What the model leaves out (so what a residual means):", ""]
    plain = [
        r
        for r in rows
        if r.get("predicted")
        and r["mode"] == "train"
        and not r.get("loss_chunk_tokens")
        and r.get("shape")
    ]
    if plain:
        big = max(plain, key=lambda r: r["tokens"] * r["shape"]["vocab_size"])
        logits = big["tokens"] * big["shape"]["vocab_size"]
        out.append(
            "- The loss's own memory traffic: the head's matmul is in the FLOPs; the fp32 "
            "upcast, log-softmax and their gradients over the vocabulary are not (about "
            f"{LOSS_BYTES_PER_LOGIT} bytes per logit; the largest here, {big['model']} "
            f"{big['batch']}x{big['seq']} over {big['shape']['vocab_size']} words: "
            f"{logits * LOSS_BYTES_PER_LOGIT / 1e12:.2f} TB of device memory traffic, some "
            f"{logits * LOSS_BYTES_PER_LOGIT / 4e12 * 1e3:.0f} ms at 4 TB/s, against a "
            f"{big['step_s'] * 1e3:.0f} ms step; the floors measure no device memory rate)."
        )
    firsts = [
        (r["step_times_s"][0] / r["predicted"]["first_step_s"], r)
        for r in [*rows, *kofn]
        if r.get("predicted")
        and r["mode"] == "train"
        and r.get("step_times_s")
        and r["predicted"].get("first_step_s")
    ]
    if firsts:
        lo, hi = min(firsts, key=lambda x: x[0]), max(firsts, key=lambda x: x[0])
        out.append(
            "- GPU time beyond the FLOP count and the links: the first timed steps (no optimizer "
            f"step to wait for) run x{lo[0]:.2f} to x{hi[0]:.2f} of the model's first step "
            f"({lo[1]['model']} {lo[1]['batch']}x{lo[1]['seq']} to {hi[1]['model']} "
            f"{hi[1]['batch']}x{hi[1]['seq']}); the recorded fields hold no kernel times of "
            "those steps (the trace has one step, 4x2048), so the gaps are not attributed."
        )
    out.append(
        "- The CPU optimizer's rate in the training process: measured there where a case "
        "recorded it (the table's last column); otherwise the rate alone with the copies' share "
        "of host DRAM modelled, and other threads on the same cores (the autograd thread "
        "launching kernels beside the optimizer's OpenMP pool) not."
    )
    ramps = [
        r
        for r in [*rows, *kofn]
        if r.get("predicted") and r["mode"] == "train" and len(r.get("step_times_s") or []) >= 3
    ]
    if ramps:
        r = max(
            ramps, key=lambda r: (max(r["step_times_s"]) - min(r["step_times_s"])) / r["step_s"]
        )
        times = ", ".join(f"{t * 1e3:.0f}" for t in r["step_times_s"])
        out.append(
            "- The benchmark's step is the median of the timed steps after a drain; where the "
            "CPU optimizer binds they ramp (e.g. "
            f"{r['model']} {r['batch']}x{r['seq']}: {times} ms: the first waits for no "
            "optimizer, the last for the whole optimizer tail), so two cases with about the same "
            "sum can have medians 10% apart; the model gives the steady state."
        )
    return out


def _more_steps(doc: dict[str, Any]) -> str:
    """Which cases timed more steps than the run's ``--steps`` (cases.OVERLAPPED_STEPS)."""
    base = doc["meta"].get("steps")
    more = {}
    for c in doc.get("cases") or []:
        steps = (c.get("case") or {}).get("steps")
        if base is not None and steps is not None and steps > base:
            more.setdefault(steps, []).append(c["kind"])
    return "".join(
        f"; {n} for {', '.join(sorted(set(kinds)))} (ramflow's optimizer runs into the next "
        "step: the first timed step waits for none, the last drains; the median is one of the "
        "steady-state steps between)"
        for n, kinds in sorted(more.items())
    )


def _kofn_section(doc: dict[str, Any]) -> list[str]:
    rows = doc.get("kofn") or []
    if not rows:
        return []
    out = [
        "## k of n blocks resident",
        "",
        "Budgets chosen so that k of the n blocks are resident (the engine keeps units from the "
        "last one backwards, so the final norm and head are resident too when k > 0). Streamed "
        "H2D = counted H2D minus the refreshes of resident units after their CPU steps; share = "
        "streamed H2D / that of k = 0, against the target (n-k)/n.",
        "",
        "| model | step | tokens | k / n | resident units (byte share) | step (ms) | predicted (ms) "
        "| x predicted | H2D streamed (GB) | refresh (GB) | D2H (GB) | share | (n-k)/n | share / target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['mode']} | {r['batch']}x{r['seq']} | {r['k']}/{r['n']} | "
            f"{r['resident_units']}/{r['num_units']} ({r['resident_byte_share']:.2f}) | "
            f"{_f(r['step_s'], 1e3)} | {_f(r['predicted_s'], 1e3)} | {_x_predicted(r)} | "
            f"{_f(r['h2d_stream_bytes'], 1e-9, 2)} | {_f(r['h2d_refresh_bytes'], 1e-9, 2)} | "
            f"{_f(r['d2h_bytes'], 1e-9, 2)} | {_f(r['stream_share'], 1, 3)} | "
            f"{r['target_share']:.3f} | {_f(r['x_target'], 1, 3)} |"
        )
    out.append("")
    return out


def _targets_section(doc: dict[str, Any]) -> list[str]:
    items = doc.get("targets") or []
    if not items:
        return []
    ours = [t for t in items if t["met"] is not None]
    met = sum(1 for t in ours if t["met"])
    out = [
        "## Targets (issue 4)",
        "",
        f"Reference model (ANCHORS.md): {met} of {len(ours)} met. Each ratio is from this one "
        "run; for a miss, the floor that binds. Other models' rows are reported against the "
        "same thresholds (the issue sets no target for them). Thresholds: constants at the top "
        'of `benchmarks/report.py`; "the step time follows" (k of n, training, bound by the '
        f"CPU optimizer) is read as: no more than {KOFN_TRAIN_FLAT:.0%} slower than k = 0.",
        "",
        "| scope | target | case | ratio | threshold | met | why (for a miss), notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in items:
        why = (t.get("why") or "").replace("|", "/")
        if t["met"] is None:
            verdict = "reported (" + ("within" if t["within"] else "outside") + ")"
        else:
            verdict = "met" if t["met"] else "NOT MET"
        out.append(
            f"| {t['scope']} | {t['target']} | {t['case']} | {_f(t['ratio'], 1, 3)} | "
            f"{t['threshold']} | {verdict} | {why} |"
        )
    out.append("")
    line = cpu_optimizer_line(doc.get("cpu_optimizer"))
    if line:
        out += [line, ""]
    return out


def _trace_prediction(doc: dict[str, Any]) -> str | None:
    """The traced step predicted: it synchronizes the host worker inside the step, so it is
    the model's first step plus the rest of its optimizer work (``first_drained_s``)."""
    rec = next((c for c in doc["cases"] if c["kind"] == "trace" and c["status"] == "ok"), None)
    rated = measured_rates(doc.get("floors"), doc.get("cpu_optimizer"))
    if rec is None or rated is None:
        return None
    case, res = rec["case"], rec["result"]
    row = {
        "model": case["model"],
        "shape": _shape(res),
        "resident_units": 0,  # the trace offloads with no budget: nothing resident
        "mode": "train",
        "batch": case["batch"],
        "seq": case["seq"],
        "checkpoint": case.get("checkpoint"),
        "loss_chunk_tokens": case.get("loss_chunk_tokens"),
    }
    eff = _efficiency_for(doc.get("gpu_forward"), case["model"], res.get("num_layers"), case["seq"])
    pred = predict(reference_inputs(row), rated, eff)
    if pred is None:
        return None
    summary = res.get("summary") or {}
    busy = (summary.get("optimizer") or {}).get("busy_ms")
    landing = (summary.get("landing") or {}).get("busy_ms") or 0.0
    return (
        "Predicted (the step-time model, nothing resident, this run's rates): the traced step "
        "synchronizes ramflow's host worker before it ends, so its whole optimizer work is in it: "
        f"{pred.first_drained_s * 1e3:.0f} ms against {res['step_s'] * 1e3:.0f} ms measured "
        f"under the profiler; host worker busy {pred.busy_s['CPU optimizer'] * 1e3:.0f} ms "
        f"({pred.copies_on_cpu_s * 1e3:.0f} ms of it the copies' host-memory traffic)"
        + (
            f" against {busy + landing:.0f} ms measured (optimizer {busy:.0f} + landing "
            f"{landing:.0f})."
            if busy
            else "."
        )
    )


def cpu_optimizer_line(cpu: dict[str, Any] | None) -> str | None:
    """Issue 4 point 7: ramflow's CPU AdamW against torch's fused one, same tensors and
    process, in parameters and DRAM bytes per second."""
    if not cpu or not cpu.get("ramflow_params_per_s") or not cpu.get("torch_fused_params_per_s"):
        return None
    bpp = cpu.get("bytes_per_param") or {}
    ours, theirs = cpu["ramflow_params_per_s"], cpu["torch_fused_params_per_s"]
    return (
        f"CPU optimizer: ramflow AdamW {ours / 1e9:.2f} G params/s "
        f"({ours * bpp.get('ramflow', 30) / 1e9:.1f} GB/s of DRAM traffic) vs torch fused "
        f"{theirs / 1e9:.2f} G params/s ({theirs * bpp.get('torch_adamw', 28) / 1e9:.1f} GB/s), "
        f"same tensors, same process ({cpu.get('num_params', 0) / 1e6:.0f} M fp32 parameters, "
        f"{cpu.get('cpu_threads')} threads; {bpp.get('ramflow', 30)} and "
        f"{bpp.get('torch_adamw', 28)} bytes per parameter: ramflow also writes the bf16 wire "
        "copy)."
    )


def markdown(doc: dict[str, Any]) -> str:
    """The whole report: header, floors, main table, scaling, CPU optimizer, trace, failures."""
    meta = doc["meta"]
    out = [
        f"# ramflow benchmark, {meta['date']}",
        "",
        f"- device: {meta.get('device')}",
        f"- torch {meta.get('torch')}, ramflow {meta.get('ramflow')}, commit {meta.get('commit') or '-'}",
        f"- command: `{meta['command']}`",
        f"- steps: median of {meta.get('steps')} timed steps after {meta.get('warmup')} warm-ups, "
        f"each case in its own process{_more_steps(doc)}",
        f"- wall time: {_f(meta.get('wall_s'), 1, 0)} s",
        "",
    ]
    floors = doc.get("floors")
    if floors:
        bw = floors.get("bandwidth_bytes_per_s") or {}
        out += [
            "## Floors",
            "",
            "| what | measured |",
            "| --- | --- |",
            f"| H2D, pinned, one 1 GiB copy | {_f(bw.get('h2d'), 1e-9)} GB/s |",
            f"| D2H, pinned, one 1 GiB copy | {_f(bw.get('d2h'), 1e-9)} GB/s |",
            f"| H2D + D2H at once (two streams), total | {_f(bw.get('both'), 1e-9)} GB/s |",
            f"| H2D / D2H in 8 MiB pieces | {_f(bw.get('h2d_pieces'), 1e-9)} / {_f(bw.get('d2h_pieces'), 1e-9)} GB/s |",
            f"| GPU bf16 matmul 8192x4096x11008 | {_f(floors.get('matmul_flops_per_s'), 1e-12, 0)} TFLOP/s |",
            f"| CPU AdamW fp32, torch fused / foreach ({floors.get('cpu_threads')} threads, "
            f"{_f(floors.get('adam_slice_params'), 1e-6, 0)} M-parameter slice, scaled linearly) | "
            f"{_f(floors.get('cpu_adamw_fused_params_per_s'), 1e-9, 2)} / "
            f"{_f(floors.get('cpu_adamw_foreach_params_per_s'), 1e-9, 2)} G params/s |",
            f"| CPU memory copy (read + write) | {_f(floors.get('dram_copy_bytes_per_s'), 1e-9)} GB/s |",
            "",
        ]
    rows = doc["rows"]
    main = [r for r in rows if r["group"] != "scaling"]
    if main:
        out += [
            "## Steps",
            "",
            "Floor = max(GPU compute, PCIe, CPU optimizer), (partial) where a part could not be measured; "
            "bytes are per step (counted: ramflow's copies counted as issued; plan: from the plan; "
            "-: not measured).",
            "",
            "| model | system | step | tokens | budget | step (ms) | tokens/s | peak GPU (GiB) | H2D (GB) | D2H (GB) "
            "| floor (ms), bound | x floor | predicted (ms) | x predicted | status |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in main:
            system = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
            floor = "-" if r.get("floor_s") is None else f"{_f(r['floor_s'], 1e3)} {r['bound']}"
            if r.get("floor_s") is not None and not r.get("floor_complete"):
                floor += " (partial)"
            peak = _f(r.get("peak_bytes"), 1 / GIB, 2)
            if r.get("within_cap") is False:
                peak += " (over cap)"
            status = (
                r["status"]
                if r["status"] == "ok"
                else f"{r['status']}: {(r.get('error') or '')[:80]}"
            )
            out.append(
                f"| {r['model']} | {system} | {r['mode']} | {r['batch']}x{r['seq']} | {_budget(r)} | "
                f"{_f(r.get('step_s'), 1e3)} | "
                f"{_f(r.get('tokens_per_s'), 1, 0)} | {peak} | {_f(r.get('h2d_bytes'), 1e-9, 2)} | "
                f"{_f(r.get('d2h_bytes'), 1e-9, 2)} {_how(r)} | "
                f"{floor} | {_f(r.get('x_floor'), 1, 2)} | {_f(r.get('predicted_s'), 1e3)} | "
                f"{_x_predicted(r)} | {status} |"
            )
        notes = [r for r in main if r.get("compute_how") not in (None, "-", "resident step")]
        if notes:
            out.append("")
            for r in notes:
                out.append(f"- {r['case']}: GPU compute floor from {r['compute_how']}.")
        out.append("")
        out += _prediction_section(doc, main)
    out += _kofn_section(doc)
    out += _targets_section(doc)
    scaling = [r for r in rows if r["group"] == "scaling"]
    if scaling:
        ok = [r for r in scaling if r["status"] == "ok"]
        fit = linear_fit([r["num_layers"] for r in ok], [r["step_s"] for r in ok])
        out += [
            "## Scaling with depth (ramflow, training, nothing resident)",
            "",
            "| layers | step (ms) | ms per layer | peak GPU (GiB) | ramflow planned (GiB) | status |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in scaling:
            per = r["step_s"] / r["num_layers"] if r.get("step_s") and r.get("num_layers") else None
            out.append(
                f"| {r.get('num_layers')} | {_f(r.get('step_s'), 1e3)} | {_f(per, 1e3)} | "
                f"{_f(r.get('peak_bytes'), 1 / GIB, 2)} | {_f(r.get('planned_bytes'), 1 / GIB, 2)} | {r['status']} |"
            )
        if fit:
            out += [
                "",
                f"Fit: step = {_f(fit['intercept'], 1e3)} ms + {_f(fit['slope'], 1e3, 2)} ms x layers, "
                f"R^2 = {fit['r2']:.4f}.",
            ]
        peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes")]
        if len(peaks) > 1:
            out.append(
                f"Peak GPU memory spread: {_f(min(peaks), 1 / GIB, 2)} to {_f(max(peaks), 1 / GIB, 2)} GiB "
                "(activation checkpointing keeps one block input per layer: that part grows with depth)."
            )
        out.append("")
    cpu = doc.get("cpu_optimizer")
    if cpu:
        out += [
            "## CPU optimizer (same tensors, same process)",
            "",
            "| optimizer | step (ms) | G params/s | GB/s moved | % of CPU memory copy rate |",
            "| --- | --- | --- | --- | --- |",
        ]
        dram = cpu.get("dram_copy_bytes_per_s")
        bpp = cpu.get("bytes_per_param", {})
        for name, key, nbytes in (
            (
                "ramflow.optim.AdamW (writes the bf16 wire too)"
                if cpu.get("wire_refresh")
                else "ramflow.optim.AdamW",
                "ramflow",
                bpp.get("ramflow", 28),
            ),
            ("torch AdamW fused", "torch_fused", bpp.get("torch_adamw", 28)),
            ("torch AdamW foreach", "torch_foreach", bpp.get("torch_adamw", 28)),
        ):
            rate = cpu.get(f"{key}_params_per_s")
            gbs = rate * nbytes if rate else None
            out.append(
                f"| {name} | {_f(cpu.get(f'{key}_step_s'), 1e3)} | {_f(rate, 1e-9, 2)} | {_f(gbs, 1e-9)} | "
                f"{_f(gbs / dram if gbs and dram else None, 100, 0)} |"
            )
        out += [
            "",
            f"{_f(cpu.get('num_params'), 1e-6, 1)} M fp32 parameters, {cpu.get('cpu_threads')} threads; "
            f"CPU memory copy {_f(dram, 1e-9)} GB/s (read + write); bytes per parameter: {bpp}.",
            "",
        ]
    trace = doc.get("trace")
    if trace:
        from trace_summary import format_summary

        out += [
            "## Trace of one step",
            "",
            f"File: `{trace.get('trace_path')}` (open in ui.perfetto.dev)",
            "",
            format_summary(trace.get("summary", {})),
            "",
        ]
        line = _trace_prediction(doc)
        if line:
            out += [line, ""]
    failed = [c for c in doc["cases"] if c["status"] != "ok"]
    if failed:
        out += [
            "## Cases that did not finish",
            "",
            "| case | status | why |",
            "| --- | --- | --- |",
        ]
        for c in failed:
            why = (c.get("error") or "").replace("|", "/").replace("\n", " ")[:200]
            out.append(f"| {c['id']} | {c['status']} | {why} |")
        out.append("")
    return "\n".join(out)
