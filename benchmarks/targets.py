"""Issue 4's targets, each a ratio from one run, met or not, and a one-line reason for a miss.

The targets are for the reference model (reference_model.py); other models' rows are measured against
the same thresholds and reported (``met`` None, ``within`` says how they compare). Each target
names the table row it belongs to (``key``: ``row_key`` or ``kofn_key``). Pure Python.
"""

from __future__ import annotations

from typing import Any

from rows import (
    ADAMW_BYTES_PER_PARAM,
    GIB,
    PREDICT_TOLERANCE,
    best_adamw_dram_rate,
    pcie_seconds,
)

INFER_1_PCIE_TARGET = 1.05  # inference 1x2048, nothing resident: <= 1.05x the PCIe floor
INFER_8_RESIDENT_TARGET = 1.05  # inference 8x2048: <= 1.05x the resident bf16 inference step
TRAIN_FLOOR_TARGET = 1.15  # training 4x2048, peak <= 12 GiB: step <= 1.15x its floor
TRAIN_4_PEER_TARGET = 2.0  # ... and tokens/s >= 2x the fastest peer at 4x2048, any memory
TRAIN_16_PEER_TARGET = 1.4  # training 16x2048, peak <= 16 GiB: tokens/s >= 1.4x the fastest peer
TRAIN_NOCAP_RESIDENT_TARGET = 1.15  # training 16x2048, no cap: step <= 1.15x the resident step
# k of n, training: "the step time follows" the bytes: fewer bytes never make the step slower
# than k = 0 by more than this (bound by the CPU optimizer the step barely moves, and fewer
# copies through host memory may make it faster, which follows the bytes too)
KOFN_TRAIN_FLAT = 0.05

REFERENCE = "reference"


def row_key(r: dict[str, Any]) -> str:
    """The key of one row of ``rows.rows_of`` (an inference case has one row per batch)."""
    return f"{r['case']}:{r['mode']}:{r['batch']}"


def kofn_key(r: dict[str, Any]) -> str:
    """The key of one row of ``rows.kofn_rows``."""
    return f"{r['case']}:{r['mode']}:k{r['k']}"


def _item(
    r: dict[str, Any], key: str, target: str, ratio: float, threshold: str, met: bool, why=""
) -> dict[str, Any]:
    """``target``: the ratio's short name, then in parentheses what it is measured against."""
    reference = r["model"] == REFERENCE
    return {
        "scope": REFERENCE if reference else f"{r['model']} (no target in the issue; reported)",
        "key": key,
        "target": target,
        "ratio": ratio,
        "threshold": threshold,
        "met": met if reference else None,
        "within": met,
        "why": "" if met else why,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _critical(pred: dict[str, Any] | None) -> str:
    if not pred:
        return ""
    crit = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in pred["critical_s"].items() if v >= 5e-4)
    return f"predicted critical path (ms): {crit}"


def _floor_why(r: dict[str, Any]) -> str:
    """The floor that binds a row and the predicted critical path, in one line."""
    parts = []
    if r.get("bound"):
        parts.append(f"{r['bound']} floor {_ms(r.get('floor_s'))} binds")
    crit = _critical(r.get("predicted"))
    if crit:
        parts.append(crit)
    return "; ".join(parts)


def _peak_why(r: dict[str, Any]) -> str:
    """For a capped row over its cap: its activations against one fp32 copy of the logits."""
    shape, act = r.get("shape") or {}, r.get("activation_bytes")
    if not shape or not act:
        return "activations over the room the cap leaves"
    logits = r["tokens"] * shape["vocab_size"] * 4
    return (
        f"activations {act / GIB:.2f} GiB; one fp32 copy of the logits is {logits / GIB:.2f} "
        "GiB and the loss holds several at its peak"
    )


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the run (``doc``: ``harness.document``'s rows, k of n rows, floors)."""
    rows = [r for r in doc["rows"] if r["status"] == "ok" and r.get("step_s")]
    main = [r for r in rows if r["system"] == "ramflow" and r["group"] == "ramflow"]
    peers = [r for r in rows if r["group"] == "peers"]
    resident = [r for r in rows if r["system"].startswith("resident")]
    out: list[dict[str, Any]] = []

    def fastest_peer(r: dict[str, Any]) -> dict[str, Any] | None:
        same = [
            p
            for p in peers
            if (p["model"], p["mode"], p["batch"], p["seq"])
            == (r["model"], "train", r["batch"], r["seq"])
        ]
        return min(same, key=lambda p: p["step_s"]) if same else None

    for r in main:
        key, cap = row_key(r), r.get("cap_gib")
        if r["mode"] == "infer" and r["batch"] == 1 and r.get("pcie_s"):
            ratio = r["step_s"] / r["pcie_s"]
            t = f"PCIe floor ({_ms(r['pcie_s'])})"
            out.append(
                _item(r, key, t, ratio, f"<= {INFER_1_PCIE_TARGET}", ratio <= INFER_1_PCIE_TARGET,
                      _floor_why(r))
            )  # fmt: skip
        if r["mode"] == "infer" and r["batch"] == 8:
            res = next(
                (
                    x
                    for x in resident
                    if (x["mode"], x["model"], x["batch"], x["seq"])
                    == ("infer", r["model"], r["batch"], r["seq"])
                ),
                None,
            )
            if res:
                ratio = r["step_s"] / res["step_s"]
                ok = ratio <= INFER_8_RESIDENT_TARGET
                why = "; ".join(
                    x
                    for x in (f"GPU compute (resident {_ms(res['step_s'])}) binds",
                              _critical(r.get("predicted")))
                    if x
                )  # fmt: skip
                t = f"resident ({_ms(res['step_s'])})"
                out.append(_item(r, key, t, ratio, f"<= {INFER_8_RESIDENT_TARGET}", ok, why))
        if r["mode"] != "train":
            continue
        if cap is not None and r.get("peak_bytes"):
            ratio = r["peak_bytes"] / (cap * GIB)
            out.append(
                _item(r, key, f"peak ({cap} GiB cap)", ratio, "<= 1", ratio <= 1, _peak_why(r))
            )
        if r["batch"] == 4 and cap is not None and r.get("x_floor") is not None:
            ok = r["x_floor"] <= TRAIN_FLOOR_TARGET
            t = f"floor ({r.get('bound')})"
            out.append(
                _item(r, key, t, r["x_floor"], f"<= {TRAIN_FLOOR_TARGET}", ok, _floor_why(r))
            )
        threshold = {4: TRAIN_4_PEER_TARGET, 16: TRAIN_16_PEER_TARGET}.get(r["batch"])
        best = fastest_peer(r) if cap is not None and threshold else None
        if best:
            ratio = best["step_s"] / r["step_s"]  # tokens/s over the peer's, same tokens
            t = f"peer ({best['system']} {_ms(best['step_s'])})"
            out.append(
                _item(r, key, t, ratio, f">= {threshold}", ratio >= threshold, _floor_why(r))
            )
        if r["batch"] == 16 and cap is None and r.get("compute_s"):
            ratio = r["step_s"] / r["compute_s"]
            how = r.get("compute_how") or ""
            est = "" if how == "resident step" else f", estimated: {how}"
            t = f"resident ({_ms(r['compute_s'])}{est})"
            ok = ratio <= TRAIN_NOCAP_RESIDENT_TARGET
            out.append(
                _item(r, key, t, ratio, f"<= {TRAIN_NOCAP_RESIDENT_TARGET}", ok, _floor_why(r))
            )
    out += _kofn_targets(doc, resident)
    band = f"{1 - PREDICT_TOLERANCE:.2f} to {1 + PREDICT_TOLERANCE:.2f}"
    for r in rows + (doc.get("kofn") or []):
        if r.get("system", "ramflow") != "ramflow" or r.get("x_predicted") is None:
            continue
        ok = abs(r["x_predicted"] - 1) <= PREDICT_TOLERANCE
        key = kofn_key(r) if "k" in r else row_key(r)
        t = f"predicted ({_ms(r['predicted_s'])})"
        out.append(_item(r, key, t, r["x_predicted"], band, ok, _critical(r.get("predicted"))))
    return out


def _layout_floors(
    doc: dict[str, Any], r: dict[str, Any], resident: list[dict[str, Any]]
) -> dict[str, float]:
    """The floors of one k-of-n layout (ms): GPU compute (the resident step), PCIe (its
    counted bytes), CPU optimizer (training)."""
    floors = doc.get("floors") or {}
    bw = floors.get("bandwidth_bytes_per_s") or {}
    dram = best_adamw_dram_rate(floors, doc.get("cpu_optimizer"))
    train = r["mode"] == "train"
    res = next(
        (
            x
            for x in resident
            if (x["model"], x["mode"], x["batch"], x["seq"])
            == (r["model"], r["mode"], r["batch"], r["seq"])
            and (not train or (x.get("checkpoint") and x.get("loss_chunk_tokens")))
        ),
        None,
    )
    parts: dict[str, float] = {}
    if res:
        parts["GPU compute"] = res["step_s"]
    if bw.get("h2d") and r.get("h2d_bytes") is not None:
        parts["PCIe"] = pcie_seconds(r["h2d_bytes"], r.get("d2h_bytes") or 0, bw)
    if train and dram and r.get("num_params"):
        parts["CPU optimizer"] = r["num_params"] * ADAMW_BYTES_PER_PARAM / dram[0]
    return parts


def _kofn_targets(doc: dict[str, Any], resident: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """k of n resident: streamed H2D at most (n-k)/n of full streaming, and the step time
    follows (inference falls with the bytes; training, bound by the CPU optimizer, is no more
    than ``KOFN_TRAIN_FLAT`` slower than at k = 0; medians of its rounds where it ran several)."""
    out: list[dict[str, Any]] = []
    for mode in ("train", "infer"):
        ks = sorted(
            (r for r in doc.get("kofn") or [] if r["mode"] == mode and r.get("step_s")),
            key=lambda r: r["k"],
        )
        if not ks or ks[0]["k"] != 0:
            continue
        base = ks[0]
        for prev, r in zip(ks, ks[1:]):
            key = kofn_key(r)
            if r.get("stream_share") is not None:
                ok = r["stream_share"] <= r["target_share"]
                out.append(
                    _item(r, key, "bytes (streamed H2D of k = 0)", r["stream_share"],
                          f"<= {r['target_share']:.3f}", ok, "more bytes streamed than (n-k)/n")
                )  # fmt: skip
            parts = _layout_floors(doc, r, resident)
            binds = max(parts, key=parts.get) if parts else "-"
            why = f"{binds} binds; floors (ms): " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in parts.items()
            )
            ratio = r["step_s"] / base["step_s"]
            if mode == "infer":
                limit = prev["step_s"] / base["step_s"]
                t = f"step (k = 0; below k = {prev['k']})"
                out.append(_item(r, key, t, ratio, f"< {limit:.3f}", ratio < limit, why))
            else:
                ok = ratio <= 1 + KOFN_TRAIN_FLAT
                out.append(_item(r, key, "step (k = 0)", ratio, f"<= {1 + KOFN_TRAIN_FLAT}", ok,
                                 why))  # fmt: skip
    return out
