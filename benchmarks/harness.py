"""Run cases one process each, within a time budget, and write the results as they come.

The parent process never imports torch (no CUDA context of its own on the GPU): it starts
each case as ``python benchmarks/bench.py --run-case JSON`` (or a peer script), waits for it
with a timeout, reads the one result line it prints, and rewrites the run's files
(``<out>/<date>-<device>-<what>/<name>.json``, ``.md``, ``.log``; ``run_dir``) after every
case, so that a run cut short still leaves its results. A case that crashes, runs out of
memory or times out is recorded with its status and the end of its output; the run goes on.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import cases as cases_mod
import report
import rows as rows_mod
import targets as targets_mod

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULT_PREFIX = "BENCH_RESULT "
MIN_TIMEOUT_S = 120.0


def device_name() -> str:
    """The GPU's name from nvidia-smi (no CUDA context in this process), else "cpu"."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            if out.strip():
                return out.strip().splitlines()[0].strip()
        except (subprocess.SubprocessError, OSError):
            pass
    return "cpu"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _ramflow_version() -> str | None:
    init = REPO / "src" / "ramflow" / "__init__.py"
    if init.exists():
        m = re.search(r'__version__\s*=\s*"([^"]+)"', init.read_text())
        if m:
            return m.group(1)
    return _version("ramflow")


def _commit() -> str | None:
    """The code's commit: ``RAMFLOW_BENCH_COMMIT`` if set (the GPU box's copy of the tree
    carries a stale ``.git``), else ``git rev-parse``."""
    if os.environ.get("RAMFLOW_BENCH_COMMIT"):
        return os.environ["RAMFLOW_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (subprocess.SubprocessError, OSError):
        return None


def child_env() -> dict[str, str]:
    """The environment of a case: the repo's ``src`` (ramflow, uninstalled) and
    ``benchmarks`` first on PYTHONPATH, then whatever was there (e.g. carried wheels)."""
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(BENCH_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _command(case: dict[str, Any]) -> list[str]:
    if case["kind"] == "peer":
        return cases_mod.peer_command(case)
    return [sys.executable, str(BENCH_DIR / "bench.py"), "--run-case", json.dumps(case)]


def _parse(output: str, kind: str) -> dict[str, Any] | None:
    for line in reversed(output.splitlines()):
        line = line.strip()
        if kind != "peer" and line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
        if kind == "peer" and line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _status_of(output: str) -> str:
    if re.search(r"OutOfMemoryError|CUDA out of memory|out of memory", output):
        return "oom"
    if "BENCH_SKIP" in output:
        return "skipped"
    return "error"


def run_case(case: dict[str, Any], timeout_s: float, log) -> dict[str, Any]:
    """Run one case in a new process session; return its record."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _command(case),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=str(REPO),
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the case's own process group, started above
        output, _ = proc.communicate()
        timed_out = True
    wall = time.monotonic() - t0
    log.write(f"\n===== {case['id']} (rc {proc.returncode}, {wall:.1f} s)\n{output}")
    log.flush()
    record: dict[str, Any] = {
        "id": case["id"],
        "group": case["group"],
        "kind": case["kind"],
        "case": case,
        "wall_s": wall,
    }
    result = None if timed_out else _parse(output, case["kind"])
    if timed_out:
        record.update(
            status="timeout", error=f"killed after {timeout_s:.0f} s; output ends: {output[-1500:]}"
        )
    elif result is not None and proc.returncode == 0 and not result.get("skipped"):
        record.update(status="ok", result=result)
    elif result is not None and result.get("skipped"):
        record.update(status="skipped", error=result.get("reason"), result=result)
    else:
        record.update(
            status=_status_of(output), error=f"rc {proc.returncode}; output ends: {output[-1500:]}"
        )
    return record


def document(meta: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The results document: meta, case records, rows with floors and predictions, the k of
    n rows, the targets, and the special results."""
    doc: dict[str, Any] = {"meta": meta, "cases": records}
    for key in ("floors", "cpu_optimizer", "trace"):
        rec = next((r for r in records if r["kind"] == key and r["status"] == "ok"), None)
        doc[key] = rec["result"] if rec else None
    rows = [row for r in records for row in rows_mod.rows_of(r["case"], r)]
    rows_mod.add_floors(rows, doc["floors"], doc["cpu_optimizer"])
    doc["gpu_forward"] = rows_mod.forward_efficiencies(rows, doc["floors"])
    rows_mod.add_predictions(rows, doc["floors"], doc["cpu_optimizer"], doc["gpu_forward"])
    doc["rows"] = rows
    doc["kofn"] = rows_mod.kofn_rows(
        records, doc["floors"], doc["cpu_optimizer"], doc["gpu_forward"]
    )
    doc["targets"] = targets_mod.targets(doc)
    return doc


def write(doc: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    tmp = stem.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(report.markdown(doc))


def run_dir(out_dir: Path, what: str) -> Path:
    """The folder of one run: ``<out_dir>/<date>-<device>-<what>``, e.g.
    ``results/2026-11-22-nvidia-h200-suite`` (both calls of a two-part suite land in one)."""
    date = datetime.date.today().isoformat()
    return out_dir / f"{date}-{slug(device_name())}-{slug(what)}"


def run_all(
    cases: list[dict[str, Any]],
    *,
    budget_s: float,
    stem: Path,
    command: str,
    steps: int,
    warmup: int,
) -> Path:
    """Run ``cases`` in order within ``budget_s``; write ``<stem>.json`` (the raw records, the
    command and the commit in ``meta``), ``<stem>.md`` and ``<stem>.log`` (every case's
    output) after every case; return ``stem``."""
    start = time.monotonic()
    name = device_name()
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": name,
        "torch": _version("torch"),
        "ramflow": _ramflow_version(),
        "commit": _commit(),
        "command": command,
        "python": sys.version.split()[0],
        "steps": steps,
        "warmup": warmup,
        "budget_s": budget_s,
    }
    records: list[dict[str, Any]] = []
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".log"), "w") as log:
        for case in cases:
            left = budget_s - (time.monotonic() - start)
            if case["estimate_s"] > left:
                records.append(
                    {
                        "id": case["id"],
                        "group": case["group"],
                        "kind": case["kind"],
                        "case": case,
                        "status": "skipped",
                        "wall_s": 0.0,
                        "error": f"time budget: needs about {case['estimate_s']:.0f} s, {left:.0f} s left",
                    }
                )
                print(
                    f"[{time.monotonic() - start:6.1f}s] {case['id']}: skipped (budget)", flush=True
                )
                continue
            print(f"[{time.monotonic() - start:6.1f}s] {case['id']} ...", flush=True)
            record = run_case(case, min(left, max(4 * case["estimate_s"], MIN_TIMEOUT_S)), log)
            records.append(record)
            res = record.get("result") or {}
            meta["device"] = res.get("device_name", meta["device"])
            meta["torch"] = res.get("torch_version", meta["torch"])
            step = res.get("step_s")
            print(
                f"[{time.monotonic() - start:6.1f}s] {case['id']}: {record['status']}"
                + (f", {step * 1e3:.1f} ms/step" if step else "")
                + (f" ({(record.get('error') or '')[-300:]})" if record["status"] != "ok" else ""),
                flush=True,
            )
            meta["wall_s"] = time.monotonic() - start
            write(document(meta, records), stem)
    meta["wall_s"] = time.monotonic() - start
    write(document(meta, records), stem)
    return stem


def merge(paths: list[Path], stem: Path) -> Path:
    """Rebuild one report from several result files (e.g. the two calls of a suite) into
    ``<stem>.json`` and ``<stem>.md``: the case records are concatenated (a later file wins for
    a repeated case id) and the floors come from the first file that has them (so ``part1
    part2`` rates part 1's cases, the ones with targets, against the floors measured beside
    them)."""
    records: dict[str, dict[str, Any]] = {}
    metas = []
    for path in paths:
        doc = json.loads(path.read_text())
        metas.append(doc["meta"])
        for rec in doc["cases"]:
            if rec.get("group") == "floors" and rec["id"] in records:
                continue
            records[rec["id"]] = rec
    meta = dict(metas[0])
    meta["command"] = " ; ".join(m["command"] for m in metas)
    meta["wall_s"] = sum(m.get("wall_s") or 0 for m in metas)
    write(document(meta, list(records.values())), stem)
    return stem
