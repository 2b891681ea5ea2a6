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
"""

from __future__ import annotations

import math
from typing import Any

GIB = 1 << 30


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
        "tokens_per_s": tokens / step if step else None,
        "peak_bytes": peak,
        "within_cap": None if cap is None or peak is None else peak <= cap * GIB,
        "planned_bytes": result.get("planned_bytes"),
        "resident_units": result.get("resident_units"),
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "bytes_how": how,
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
        "h2d_bytes": h2d,
        "d2h_bytes": d2h,
        "bytes_how": how,
    }


# ---------------------------------------------------------------------------------- floors


def _forward_flops(shape: dict[str, Any], batch: int, seq: int) -> float:
    matmul = 2.0 * (shape["num_params"] - shape["embed_params"]) * batch * seq
    return matmul + 2.0 * shape["num_layers"] * batch * seq * seq * shape["dim"]


def add_floors(rows: list[dict[str, Any]], floors: dict[str, Any] | None) -> None:
    """Set ``compute_s``, ``pcie_s``, ``cpu_opt_s``, ``floor_s``, ``bound`` and ``x_floor``
    on every non-resident row (in place), from the floors and the resident rows."""
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
            if row["mode"] == "train" and floors.get("cpu_adamw_fused_params_per_s"):
                cpu = shape["num_params"] / floors["cpu_adamw_fused_params_per_s"]
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
        "each case in its own process",
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
            "| system | step | tokens | budget | step (ms) | tokens/s | peak GPU (GiB) | H2D (GB) | D2H (GB) "
            "| floor (ms), bound | x floor | status |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
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
                f"| {system} | {r['mode']} | {r['batch']}x{r['seq']} | {_budget(r)} | {_f(r.get('step_s'), 1e3)} | "
                f"{_f(r.get('tokens_per_s'), 1, 0)} | {peak} | {_f(r.get('h2d_bytes'), 1e-9, 2)} | "
                f"{_f(r.get('d2h_bytes'), 1e-9, 2)} {_how(r)} | "
                f"{floor} | {_f(r.get('x_floor'), 1, 2)} | {status} |"
            )
        notes = [r for r in main if r.get("compute_how") not in (None, "-", "resident step")]
        if notes:
            out.append("")
            for r in notes:
                out.append(f"- {r['case']}: GPU compute floor from {r['compute_how']}.")
        out.append("")
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
