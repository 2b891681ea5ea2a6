"""The long-context benchmark's report: its table, the longest length that fits per mode, the
memory toolkit's rows, and the merge of several runs' ``long_context.json`` into one result.

Pure functions of the json's dicts (no torch), so that ``long_context.py --merge`` and the
tests can call them. A run record (one mode at one length T) has ``mode``, ``seq``, ``plan``
(the plan's figures), ``fits`` (True; False: it does not fit, ``reason`` says why: out of GPU
memory, or its planned host bytes over the host's available RAM; None: not run, ``skipped``
says why) and, once run, the measured step, peaks and pinned pool figures.
"""

from __future__ import annotations

GIB = 2**30
MODES = ("offload", "on")
MODE_NAMES = {"offload": "activation offload", "on": "checkpointing alone"}


def _g(x, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if x is None else format(x / scale, spec)


def _err(measured, predicted) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted - 1:+.1%}"


def length_name(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def fate(run: dict) -> str:
    """The table's "fits" cell: yes, no and why (one line), or why it was not run."""
    if run["fits"] is True:
        return "yes"
    if run["fits"] is False:
        return "no: " + run.get("reason", "out of memory")
    return run.get("skipped", "-")


def timed_step(run: dict) -> str:
    """Which step the table's time is: the second of two, or the first at this length, for
    offload with its pinned pool warmed (the new pinned blocks the step still allocated in
    parentheses) or not (a record from before the warm-up: it paid ``cudaHostAlloc``)."""
    steps = run.get("steps_run")
    if not steps:
        return "-"
    if steps > 1:
        return f"step {steps} of {steps}"
    if run["mode"] != "offload":
        return "first at this length"
    if "pool_warm_s" not in run:
        return "first at this length, pinned pool cold"
    new = run.get("pinned_allocs_in_step")
    return "first at this length, pinned pool warmed" + (f" ({new} new)" if new else "")


def not_fit_reason(run: dict, gpu_free_bytes: int | None) -> str:
    """Why a mode does not fit at a length, with the plan's figure against what there was:
    the host RAM line, "plan X GiB > Y GiB free", or the allocation at which it ran out of
    memory where the plan said it would fit."""
    if run.get("reason", "").startswith("host RAM"):
        return run["reason"]
    planned = run["plan"]["device_total_bytes"]
    plan, free = _g(planned, GIB), _g(gpu_free_bytes, GIB)
    if gpu_free_bytes is not None and planned > gpu_free_bytes:
        return f"plan {plan} GiB > {free} GiB free"
    at = _g(run.get("peak_gpu_bytes"), GIB)
    return f"out of memory at {at} GiB allocated; plan {plan} GiB of {free} GiB free"


def toolkit_rows(runs: list[dict], seqs: list[int], model: str, gpu_free_bytes=None) -> list[str]:
    """The memory toolkit table's rows (docs/memory.md: technique | peak memory | saved |
    step | step-time cost): offload against checkpointing alone at each T. Where
    checkpointing alone does not fit, the row says so with the plan's figures, since that is
    the row a user wants; where it was not run, the row says that."""
    by = {(x["mode"], x["seq"]): x for x in runs}
    out = []
    for seq in seqs:
        on, off = by.get(("on", seq)), by.get(("offload", seq))
        if off is None or not off["fits"]:
            continue
        label = f"activation offload at {length_name(seq)} tokens ({model}, B=1)"
        peak, step = f"{_g(off['peak_gpu_bytes'], GIB)} GiB", f"{off['step_s'] * 1e3:.0f} ms"
        if on is None or on["fits"] is None:
            why = on.get("skipped", "not run") if on else "not run"
            out.append(f"| {label}; checkpointing alone: {why} | {peak} | - | {step} | - |")
            continue
        if not on["fits"]:
            why = not_fit_reason(on, gpu_free_bytes)
            out.append(
                f"| {label}; checkpointing alone: does not fit ({why}) | {peak} | - | {step} | - |"
            )
            continue
        saved = (
            on["peak_gpu_bytes"] - off["peak_gpu_bytes"]
            if on["peak_gpu_bytes"] is not None and off["peak_gpu_bytes"] is not None
            else None
        )
        cost = off["step_s"] / on["step_s"] - 1
        out.append(
            f"| {label} vs checkpointing alone ({_g(on['peak_gpu_bytes'], GIB)} GiB, "
            f"{on['step_s'] * 1e3:.0f} ms) | {peak} | {_g(saved, GIB)} GiB | {step} | {cost:+.1%} |"
        )
    return out


def longest(runs: list[dict], mode: str, predicted: int | None = None) -> dict:
    """The longest T that fits in ``mode`` over every run of it (toolkit lengths and ladder
    alike), the shortest that did not (out of memory, or over the host's RAM), and the plan's
    predicted longest (``predicted``, from the run)."""
    mine = [r for r in runs if r["mode"] == mode]
    fits = max((r["seq"] for r in mine if r["fits"] is True), default=None)
    failed = min((r["seq"] for r in mine if r["fits"] is False), default=None)
    return {"fits": fits, "failed": failed, "predicted": predicted}


def markdown(r: dict) -> str:
    m = r["meta"]
    commits = ", ".join(m["commits"]) if m.get("commits") else m["commit"]
    lines = [
        f"# Long context: {m['model']}, full fine-tune, host formats {m['host_precision']}, B=1",
        "",
        f"{m['date']}, {m['device']}, torch {m['torch']}, commit {commits}; "
        f"{m['parameters'] / 1e6:,.1f} M parameters; GPU free at start "
        f"{_g(m['gpu_free_bytes'], GIB)} GiB; host RAM {_g(m.get('host_ram_bytes'), GIB, '.1f')} "
        f"GiB; ramflow's share {_g(m['ramflow_share_bytes'], GIB)} GiB (every layer streamed); "
        f"load {_g(r.get('load_s'), 1, '.1f')} s. Model TFLOP/s count attention FLOPs (causal: "
        "6 L D T per token) and no recomputation. Host peak: VmHWM; its plan is the whole "
        "process's RAM (`MemoryEstimate.ram_needed_bytes`: host store, pinned layer inputs "
        "rounded to powers of two, CUDA runtime). A run whose plan exceeds the RAM available "
        "(MemAvailable plus the process's own RSS) is not started. Offload runs time a step "
        "whose pinned buffers were allocated (warmed) before the timer started.",
        "",
        "| T | mode | fits | timed | step s | tokens/s | model TFLOP/s | peak GPU GiB "
        "(plan, error) | peak host GiB (plan, error) | predicted step s (error) |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for run in sorted(r["runs"], key=lambda x: (x["seq"], MODES.index(x["mode"]))):
        p = run["plan"]
        lines.append(
            f"| {run['seq']} | {run['mode']} | {fate(run)} | {timed_step(run)} | "
            f"{_g(run.get('step_s'), 1, '.2f')} | {_g(run.get('tokens_per_s'), 1, ',.0f')} | "
            f"{_g(run.get('model_flops_per_s'), 1e12, '.0f')} | "
            f"{_g(run.get('peak_gpu_bytes'), GIB)} ({_g(p['device_total_bytes'], GIB)}, "
            f"{_err(run.get('peak_gpu_bytes'), p['device_total_bytes'])}) | "
            f"{_g(run.get('peak_host_bytes'), GIB, '.1f')} ({_g(p.get('host_bytes'), GIB, '.1f')}"
            f", {_err(run.get('peak_host_bytes'), p.get('host_bytes'))}) | "
            f"{_g(p['step_s'], 1, '.2f')} ({_err(run.get('step_s'), p['step_s'])}) |"
        )
    pools = [x for x in r["runs"] if x.get("pool_warm_s")]
    if pools:
        lines += ["", "Pinned pool warm-up (before the timer): " + "; ".join(
            f"{x['seq']}: {_g(x['pool_bytes'], GIB, '.1f')} GiB in {x['pool_warm_s']:.1f} s"
            for x in pools
        )]  # fmt: skip
    lines += ["", "Longest sequence that fits (every run of the mode):", ""]
    for mode in MODES:
        lf = r["longest"].get(mode, {})
        lines.append(
            f"- {MODE_NAMES[mode]}: {lf.get('fits') or 'none measured'} (predicted "
            f"{lf.get('predicted')}; shortest that did not fit: {lf.get('failed') or 'none tried'})"
        )
    lines += ["", "Memory toolkit rows (docs/memory.md):", ""]
    lines += r.get("toolkit_rows") or ["(none: no toolkit length has an offload run that fits)"]
    if r.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(r["skipped"])]
    for cmd in m.get("commands") or [m["command"]]:
        lines += ["", f"Command: `{cmd}`"]
    return "\n".join(lines) + "\n"


def _better(new: dict, old: dict) -> bool:
    """A run decided (ran, or found not to fit) beats one skipped for the budget; among
    decided ones the later file's wins."""
    return new["fits"] is not None or old["fits"] is None


def merge_results(results: list[dict], toolkit: list[int]) -> dict:
    """Several runs' results as one: the runs of every file (for a (mode, T) in several, the
    later decided one), the first file's meta with every file's command and commit, and the
    longest lengths and toolkit rows (at ``toolkit``) recomputed over all runs.

    Raises:
        ValueError: no results, or results of different models or host formats.
    """
    if not results:
        raise ValueError("merge_results: no results given")
    kinds = {(x["meta"]["model"], x["meta"]["host_precision"]) for x in results}
    if len(kinds) > 1:
        raise ValueError(f"merge_results: the files are of different runs {sorted(kinds)}")
    by: dict[tuple[str, int], dict] = {}
    for res in results:
        for run in res["runs"]:
            key = (run["mode"], run["seq"])
            if key not in by or _better(run, by[key]):
                by[key] = run
    runs = sorted(by.values(), key=lambda x: (x["seq"], MODES.index(x["mode"])))
    meta = dict(results[0]["meta"])
    meta["commands"] = [x["meta"]["command"] for x in results]
    meta["commits"] = list(dict.fromkeys(str(x["meta"]["commit"]) for x in results))
    meta["toolkit"] = toolkit
    done = {(x["mode"], x["seq"]) for x in runs if x["fits"] is not None}
    merged = {
        "meta": meta,
        "runs": runs,
        "skipped": [s for x in results for s in x.get("skipped", [])
                    if not any(f"{m} at {t}:" in s for m, t in done)],
        "load_s": results[0].get("load_s"),
        "longest": {},
    }  # fmt: skip
    for mode in MODES:
        predicted = [x.get("longest", {}).get(mode, {}).get("predicted") for x in results]
        merged["longest"][mode] = longest(
            runs, mode, max((p for p in predicted if p), default=None)
        )
    merged["toolkit_rows"] = toolkit_rows(runs, toolkit, meta["model"], meta.get("gpu_free_bytes"))
    return merged
