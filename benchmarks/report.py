"""The markdown report of one results document (``harness.document``): a header with the
command, commit and floors, one table row per case (step, tokens/s, peak GPU, floor, ratios,
targets met or not), a one-line reason per miss, k of n, scaling, CPU optimizer and trace.
Pure Python (no torch): ``bench.py --report`` rebuilds it from result files anywhere.
"""

from __future__ import annotations

import math
from typing import Any

from rows import GIB, PREDICT_TOLERANCE, linear_fit
from targets import kofn_key, row_key


def _f(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * scale:.{digits}f}"


def _budget(row: dict[str, Any]) -> str:
    if row["mode"] == "infer":
        return "nothing resident" if row["system"] == "ramflow" else ""
    parts = []
    if row.get("cap_gib") is not None:
        parts.append(f"<= {row['cap_gib']} GiB")
    elif row["system"] == "ramflow":
        parts.append("no cap")
    if row.get("checkpoint"):
        parts.append("ckpt")
    if row.get("loss_chunk_tokens"):
        parts.append("chunked loss")
    return ", ".join(parts)


def label(r: dict[str, Any]) -> str:
    """One row's name: model, system, step, tokens and budget (and depth, for scaling)."""
    system = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
    text = f"{r['model']} {system} {r['mode']} {r['batch']}x{r['seq']}"
    if r["group"] == "scaling":
        text += f", {r.get('num_layers')} layers"
    budget = _budget(r)
    return f"{text}, {budget}" if budget else text


def _verdict(items: list[dict[str, Any]]) -> str:
    if not items:
        return "-"
    ours = [t for t in items if t["met"] is not None]
    if ours:
        missed = sum(1 for t in ours if not t["met"])
        return "met" if not missed else f"NOT MET ({missed})"
    outside = sum(1 for t in items if not t["within"])
    return "reported" + (f" ({outside} outside)" if outside else "")


def _targets_cell(items: list[dict[str, Any]]) -> str:
    """Each target's name, ratio and threshold (the planner's is the x predicted column)."""
    return "; ".join(
        f"{t['target'].split(' (')[0]} {_f(t['ratio'], 1, 3)} ({t['threshold']})"
        for t in items
        if not t["target"].startswith("predicted")
    )


def _by_key(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for t in doc.get("targets") or []:
        out.setdefault(t["key"], []).append(t)
    return out


def _more_steps(doc: dict[str, Any]) -> str:
    """Which kinds of case timed more steps than ``--steps`` (``cases.OVERLAPPED_STEPS``)."""
    base = doc["meta"].get("steps") or 0
    more = sorted({c["kind"] for c in doc["cases"] if (c.get("case") or {}).get("steps", 0) > base})
    return f" (more for {', '.join(more)}: `cases.OVERLAPPED_STEPS`)" if more else ""


def _header(doc: dict[str, Any]) -> list[str]:
    meta, floors = doc["meta"], doc.get("floors") or {}
    ours = [t for t in doc.get("targets") or [] if t["met"] is not None]
    out = [
        f"# ramflow benchmark, {meta['date']}, {meta.get('device')}",
        "",
        f"- command: `{meta['command']}`",
        f"- commit {meta.get('commit') or '-'}; torch {meta.get('torch')}, ramflow "
        f"{meta.get('ramflow')}, python {meta.get('python')}; wall {_f(meta.get('wall_s'), 1, 0)} s",
        f"- each case in its own process; step = median of {meta.get('steps')} timed steps after "
        f"{meta.get('warmup')} warm-ups{_more_steps(doc)}",
        f"- targets (issue 4, reference model): {sum(1 for t in ours if t['met'])} of "
        f"{len(ours)} met",
    ]
    if floors:
        bw = floors.get("bandwidth_bytes_per_s") or {}
        out.append(
            f"- floors: pinned H2D {_f(bw.get('h2d'), 1e-9)}, D2H {_f(bw.get('d2h'), 1e-9)}, "
            f"both ways {_f(bw.get('both'), 1e-9)} GB/s; bf16 matmul "
            f"{_f(floors.get('matmul_flops_per_s'), 1e-12, 0)} TFLOP/s; CPU AdamW torch fused "
            f"{_f(floors.get('cpu_adamw_fused_params_per_s'), 1e-9, 2)} G params/s; host memory "
            f"copy {_f(floors.get('dram_copy_bytes_per_s'), 1e-9)} GB/s"
        )
    return [*out, ""]


def _cases_section(doc: dict[str, Any], by_key: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = [
        "## Cases",
        "",
        "Floor = max(GPU compute, PCIe, CPU optimizer) and which binds; x floor = step / floor; "
        f"x predicted = step / ramflow's step-time model (within 1 +- {PREDICT_TOLERANCE} is the "
        "planner's target). Targets (issue 4): PCIe floor, resident = step over that step; "
        "floor = x floor; peak = peak GPU over the cap; peer = tokens/s over the fastest peer's "
        "at the same tokens, any memory. Met counts every target of the row, the planner's too.",
        "",
        "| case | step (ms) | tokens/s | peak GPU (GiB) | floor (ms) | x floor | x predicted "
        "| targets: ratio (threshold) | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        if r["status"] != "ok":
            continue
        floor = "-" if r.get("floor_s") is None else f"{_f(r['floor_s'], 1e3)} {r['bound']}"
        peak = _f(r.get("peak_bytes"), 1 / GIB, 2)
        if r.get("within_cap") is False:
            peak += " (over cap)"
        items = by_key.get(row_key(r), []) if r["system"] == "ramflow" else []
        out.append(
            f"| {label(r)} | {_f(r.get('step_s'), 1e3)} | {_f(r.get('tokens_per_s'), 1, 0)} | "
            f"{peak} | {floor} | {_f(r.get('x_floor'), 1, 2)} | {_f(r.get('x_predicted'), 1, 2)} "
            f"| {_targets_cell(items)} | {_verdict(items)} |"
        )
    return [*out, ""]


def _kofn_section(doc: dict[str, Any], by_key: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = doc.get("kofn") or []
    if not rows:
        return []
    out = [
        "## k of n blocks resident",
        "",
        "Streamed H2D = counted H2D minus the refreshes of resident units; share = streamed / "
        "that of k = 0, against (n-k)/n.",
        "",
        "| case | k / n | step (ms) | streamed H2D (GB) | share | (n-k)/n | x predicted "
        "| targets: ratio (threshold) | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        items = by_key.get(kofn_key(r), [])
        out.append(
            f"| {r['model']} {r['mode']} {r['batch']}x{r['seq']} | {r['k']}/{r['n']} | "
            f"{_f(r['step_s'], 1e3)} | {_f(r['h2d_stream_bytes'], 1e-9, 2)} | "
            f"{_f(r['stream_share'], 1, 3)} | {r['target_share']:.3f} | "
            f"{_f(r.get('x_predicted'), 1, 2)} | {_targets_cell(items)} | {_verdict(items)} |"
        )
    return [*out, ""]


def _misses(doc: dict[str, Any]) -> list[str]:
    """One line per target missed (reference model) or outside its threshold (others)."""
    names = {row_key(r): label(r) for r in doc["rows"]}
    names.update(
        {kofn_key(r): f"{r['model']} k of n {r['mode']}, k={r['k']}" for r in doc.get("kofn") or []}
    )
    out = []
    for t in doc.get("targets") or []:
        if t["within"]:
            continue
        what = "NOT MET" if t["met"] is False else "outside (reported)"
        out.append(
            f"- {what}: {names.get(t['key'], t['key'])}: {t['target']} = {t['ratio']:.3f}, "
            f"needs {t['threshold']}: {t['why'] or '-'}"
        )
    return ["## Misses", "", *out, ""] if out else []


def _scaling_line(rows: list[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if r["group"] == "scaling" and r["status"] == "ok"]
    fit = linear_fit([r["num_layers"] for r in ok], [r["step_s"] for r in ok])
    if not fit:
        return []
    return [
        f"Scaling with depth (ramflow training, nothing resident): step = "
        f"{_f(fit['intercept'], 1e3)} ms + {_f(fit['slope'], 1e3, 2)} ms x layers, "
        f"R^2 = {fit['r2']:.4f}.",
        "",
    ]


def cpu_optimizer_line(cpu: dict[str, Any] | None) -> list[str]:
    """Issue 4 point 7: ramflow's CPU AdamW against torch's fused one, same tensors and
    process, in parameters and host-memory bytes per second."""
    if not cpu or not cpu.get("ramflow_params_per_s") or not cpu.get("torch_fused_params_per_s"):
        return []
    bpp = cpu.get("bytes_per_param") or {}
    ours, theirs = cpu["ramflow_params_per_s"], cpu["torch_fused_params_per_s"]
    return [
        f"CPU optimizer (same tensors, same process, {cpu.get('num_params', 0) / 1e6:.0f} M fp32 "
        f"parameters, {cpu.get('cpu_threads')} threads): ramflow AdamW {ours / 1e9:.2f} G "
        f"params/s ({ours * bpp.get('ramflow', 30) / 1e9:.1f} GB/s), torch fused "
        f"{theirs / 1e9:.2f} G params/s ({theirs * bpp.get('torch_adamw', 28) / 1e9:.1f} GB/s).",
        "",
        *host_formats_lines(cpu.get("host_formats")),
    ]


def host_formats_lines(formats: dict[str, Any] | None) -> list[str]:
    """Issue 14 point 2: each host format's one-pass CPU AdamW, per instruction set, against
    the host's copy rate (the larger of the two measured around the formats)."""
    if not formats or "lean" not in formats:
        return []
    copy = formats.get("dram_copy_bytes_per_s")
    if not isinstance(copy, dict):  # runs before 2026-11-26 measured it once
        copy = {"used": formats["lean"]["bytes_per_s"] / formats["lean"]["share_of_dram_copy"]}
    out = [
        f"Host formats, one pass each over {formats['params'] / 1e6:.0f} M parameters; copy "
        f"rate {copy['used'] / 1e9:.1f} GB/s"
        + (
            f" (larger of {copy['before'] / 1e9:.1f} before and {copy['after'] / 1e9:.1f} after)"
            if "before" in copy
            else ""
        )
        + "; target 0.85 of it:",
        "",
        "| instruction set | format | G params/s | bytes/param | GB/s | share of copy rate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    sets = {formats.get("isa", "?"): formats, **formats.get("by_isa", {})}
    for isa, rates in sets.items():
        for name in ("bf16", "lean", "kahan"):
            r = rates.get(name)
            if r:
                out.append(
                    f"| {isa} | {name} | {r['params_per_s'] / 1e9:.2f} | "
                    f"{r['bytes_per_param']:.2f} | {r['bytes_per_s'] / 1e9:.1f} | "
                    f"{r['share_of_dram_copy']:.2f} |"
                )
    fp32 = formats.get("fp32")
    if fp32:  # runs since 2026-11-28 time ramflow's fp32 step too
        out += [
            "",
            f"ramflow's fp32 step: {fp32['params_per_s'] / 1e9:.2f} G params/s. Each format's "
            "rate over it (`planner.cpu_rates.OPTIMIZER_SPEED_BY_ISA`): "
            + "; ".join(
                f"{isa}: "
                + ", ".join(
                    f"{name} {rates[name]['x_fp32']:.2f}"
                    for name in ("bf16", "lean", "kahan")
                    if name in rates
                )
                for isa, rates in sets.items()
            ),
        ]
    return [*out, ""]


def _trace_section(trace: dict[str, Any] | None) -> list[str]:
    if not trace:
        return []
    from trace_summary import format_summary

    return [
        f"## Trace of one ramflow training step ({_f(trace.get('step_s'), 1e3)} ms under the "
        "profiler)",
        "",
        f"File: `{trace.get('trace_path')}` (open in ui.perfetto.dev)",
        "",
        format_summary(trace.get("summary", {})),
        "",
    ]


def _not_run(doc: dict[str, Any]) -> list[str]:
    failed = [c for c in doc["cases"] if c["status"] != "ok"]
    if not failed:
        return []
    out = ["## Cases that did not finish", ""]
    for c in failed:
        why = (c.get("error") or "").replace("\n", " ")[:200]
        out.append(f"- {c['id']}: {c['status']}: {why}")
    return [*out, ""]


def markdown(doc: dict[str, Any]) -> str:
    """The whole report (``doc``: ``harness.document``)."""
    by_key = _by_key(doc)
    out = _header(doc)
    out += _cases_section(doc, by_key)
    out += _misses(doc)
    out += _kofn_section(doc, by_key)
    out += _scaling_line(doc["rows"])
    out += cpu_optimizer_line(doc.get("cpu_optimizer"))
    out += _trace_section(doc.get("trace"))
    out += _not_run(doc)
    return "\n".join(out)
