"""A full fine-tune of a Llama-3.1-70B shape on one host's GPUs: ``ramflow train --preset
llama-70b --nproc-per-node N``, measured against its plan and the host's floors.

In one run, on the GPU box (a 4-GPU kind):

1. the floors every rank shares (``multi_gpu.py --floors`` under torchrun): each GPU's bf16
   matmul rate at 8192x4096x11008, pinned copy rates;
2. the host format's CPU AdamW rate with all of the host's cores (the plan's input);
3. ``ramflow plan`` of the same run with those rates: the host bytes and the predicted
   step;
4. ``ramflow train`` itself (the stdlib corpus, random init from the seed through the
   presets' ``SeededInit``, lean host formats), while a thread samples the host's memory in
   use (psutil's ``used``: total minus available, so the /dev/shm store counts) every
   0.2 s. ``--api``: the same run through the Python API instead,
   ``examples/llama_torchrun.py`` under ``torchrun`` (the same model, seed, data, batch and
   host formats, no clipping, ramflow's device share read from the plan), sampled the
   same way; ``--both``: the example, then ``ramflow train``, on the same floors and plan,
   in one report (a column each).

Reports (``node_70b.json`` and ``node_70b.md`` in ``--out-dir``): the load time as the
trainer logs it (``load_s``: build, fill and offload; ``since_start_s``: rank 0's process
start to its first step), the peak host memory in use
above the baseline against the plan's host bytes, peak GPU memory, the median step time of
the steps after the first two, tokens/s, model TFLOPS per GPU (6 x parameters x tokens per
GPU per step / step time; attention and recomputation not counted) against the slowest
GPU's matmul rate, and measured over predicted step.

    PYTHONUNBUFFERED=1 python3 benchmarks/node/node_70b.py --out-dir /tmp/node-70b \
        --pack $OUT/node-70b.tgz --clip-grad 0 --budget-s 420

Both, in one device call of at most 10 minutes (the example first; ``ramflow train``
gets what is left of ``--budget-s``)::

    PYTHONUNBUFFERED=1 python3 benchmarks/node/node_70b.py --both --steps 5 \
        --out-dir /tmp/node-70b --pack $OUT/node-70b.tgz --budget-s 540

CPU smoke test (the tiny preset on two gloo ranks; a minute, two with ``--both``)::

    python benchmarks/node/node_70b.py --smoke [--api | --both] --out-dir /tmp/node-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE.parent), str(ROOT / "src")]

GIB = 2**30


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run(cmd: list[str], log: Path, *, timeout: float) -> tuple[int, float]:
    """Run ``cmd``, its output to ``log``; returns (exit code, seconds). Past ``timeout``
    the whole process group goes (the launcher and its ranks), exit code 124."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.perf_counter() - t0


def _floors(out: Path, gpus: int, smoke: bool) -> dict | None:
    jsonl = out / "floors.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        str(HERE / "multi_gpu.py"),
        "--floors",
        "--out",
        str(jsonl),
    ] + (["--cpu"] if smoke else [])
    _run(cmd, out / "floors.log", timeout=300)
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return rows[0] if rows else None


def _cpu_optimizer_rate(host_precision: str) -> float | None:
    """The host format's one-pass CPU AdamW rate with all of this host's cores, parameters
    per second (``bench.py --cpu-optimizer``'s measurement)."""
    import cpu_optimizer_runner
    import measure

    try:
        dram = measure.dram_copy_bandwidth()
        rates = cpu_optimizer_runner._host_format_rates(1 << 27, {"steps": 3, "tiny": False}, dram)
        return rates[host_precision]["params_per_s"]
    except Exception as e:  # noqa: BLE001 (the report says why there is none)
        print(f"CPU optimizer rate not measured: {type(e).__name__}: {e}", flush=True)
        return None


def _parse_plan(text: str) -> dict:
    """The figures ``ramflow plan --nproc-per-node N`` prints that this report compares."""
    out: dict = {}
    m = re.search(r"host RAM for \d+ ranks: ([0-9.,]+) GiB", text)
    if m:
        out["host_bytes"] = float(m.group(1).replace(",", "")) * GIB
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    # what the ranks make before the first step: the store, and since the optimizer's
    # states and the gradient ring are made at set-up (not in the first step), those too
    for key, pattern in (
        ("store_bytes", r"host store ([0-9.,]+) ([KMGT]iB|B) once"),
        ("states_bytes", r"optimizer states ([0-9.,]+) ([KMGT]iB|B) once"),
        ("host_gradients_bytes", r"host gradients of all ranks ([0-9.,]+) ([KMGT]iB|B)"),
    ):
        m = re.search(pattern, text)
        if m:
            out[key] = float(m.group(1).replace(",", "")) * units[m.group(2)]
    m = re.search(r"of its ([0-9.,]+) ([KMGT]iB|B) share", text)
    if m:  # what ramflow train gives ramflow.offload as gpu_memory: the budget less activations
        out["ramflow_share"] = m.group(1).replace(",", "") + m.group(2)
    m = re.search(r"predicted: \d+ GPUs: ([0-9,]+) ms per step", text)
    if m:
        out["step_s"] = float(m.group(1).replace(",", "")) / 1e3
    m = re.search(r"bound by ([^;]+);", text[text.find("predicted:") :]) if m else None
    if m:
        out["bound"] = m.group(1)
    return out


def _rss_parts(pid: int) -> dict[str, int]:
    """``RssAnon``, ``RssFile`` and ``RssShmem`` of one process, bytes (``/proc/PID/status``)."""
    parts: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    parts[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return parts


class _HostMemory:
    """Samples psutil's ``used`` (total minus available) every ``period`` seconds, and at
    the peak, each descendant process's resident memory by kind (``_rss_parts``): private
    (anonymous) memory per rank against the shared store (shmem). ``timeline``: (seconds
    since the start, bytes in use above the baseline), one sample a second."""

    def __init__(self, period: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self.baseline = psutil.virtual_memory().used
        self.peak = self.baseline
        self.at_peak: list[dict] = []
        self.shmem = 0
        self.t0 = time.monotonic()
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(period,), daemon=True)
        self._thread.start()

    def _sample(self, period: float) -> None:
        me = self._psutil.Process()
        while not self._stop.wait(period):
            vm = self._psutil.virtual_memory()
            t = time.monotonic() - self.t0
            if not self.timeline or t - self.timeline[-1][0] >= 1.0 or vm.used > self.peak:
                self.timeline.append((round(t, 1), vm.used - self.baseline))
            if vm.used > self.peak:
                self.peak = vm.used
                self.shmem = vm.shared
                procs = []
                for child in me.children(recursive=True):
                    parts = _rss_parts(child.pid)
                    if parts.get("RssAnon", 0) > 1 << 30:  # the ranks, not the launcher
                        procs.append({"pid": child.pid, **parts})
                self.at_peak = procs

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.baseline


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# examples/llama_torchrun.py's --size of each preset it has
API_SIZES = {"tiny": "tiny", "llama-8b": "8b", "llama-70b": "70b"}


def _train_cli(args, common: list[str], out: Path, deadline: float) -> dict:
    """``ramflow train`` under the host memory sampler; its figures as the trainer logs
    them (``log.jsonl``, ``run.json``)."""
    run_dir = out / "run"
    cmd = [
        sys.executable, "-m", "ramflow", "train", *common, "--steps", str(args.steps),
        # the one validation at the end: a batch, not eight (it is not timed)
        "--eval-every", "0", "--eval-batches", "1",
        "--keep-checkpoints", "0", "--no-progress", "--out", str(run_dir),
    ]  # fmt: skip
    run = _measured(cmd, out / "train.log", deadline)
    log = _read_log(run_dir / "log.jsonl")
    start = next((r for r in log if r.get("event") == "start"), {})
    run.update(
        load_s=start.get("load_s"),
        since_start_s=start.get("since_start_s"),
        steps=[r for r in log if "step_s" in r and "loss" in r],
        peak_gpu_bytes_per_rank=next(
            (r.get("peak_gpu_bytes_per_rank") for r in log if r.get("event") == "end"), None
        ),
    )
    if (run_dir / "run.json").exists():
        run["num_parameters"] = json.loads((run_dir / "run.json").read_text())["num_parameters"]
    return run


def _train_api(args, share: str | None, out: Path, deadline: float) -> dict:
    """``examples/llama_torchrun.py`` under ``torchrun`` and the host memory sampler: the
    same model, data, batch and host formats through the Python API, with ramflow's
    device share from the plan (``ramflow train`` gives ``offload`` the same)."""
    summary_path = out / "api" / "summary.json"
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.gpus}", str(ROOT / "examples" / "llama_torchrun.py"),
        "--size", API_SIZES[args.preset], "--host-precision", args.host_precision,
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--checkpointing", "on", "--steps", str(args.steps), "--out", str(summary_path),
    ]  # fmt: skip
    if args.smoke:
        cmd += ["--device", "cpu"]
    if share:
        cmd += ["--gpu-memory", share]
    run = _measured(cmd, out / "api.log", deadline)
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        run.update(
            {
                k: summary.get(k)
                for k in (
                    "load_s", "load_phases_s", "since_start_s", "steps", "num_parameters",
                    "peak_gpu_bytes_per_rank", "resident_units",
                )
            }
        )  # fmt: skip
    return run


def _measured(cmd: list[str], log: Path, deadline: float) -> dict:
    """Run ``cmd`` while ``_HostMemory`` samples the host; the exit code, wall time and
    host memory figures."""
    memory = _HostMemory()
    rc, wall = _run(cmd, log, timeout=max(60.0, deadline - time.monotonic()))
    host_peak = memory.stop()
    return {
        "command": " ".join(cmd[1:]),
        "exit_code": rc,
        "wall_s": wall,
        "host_peak_in_use_bytes": host_peak,
        "host_shmem_at_peak_bytes": memory.shmem,
        "ranks_rss_at_peak": memory.at_peak,
        "host_timeline": memory.timeline,
    }


def _load_peak(run: dict) -> None:
    """The peak host memory in use while the ranks load: the samples up to rank 0's first
    step (``since_start_s`` after its process started, which is within a second of the
    launcher's start)."""
    since = run.get("since_start_s")
    samples = [b for t, b in run.get("host_timeline") or [] if since is not None and t <= since]
    run["host_load_peak_bytes"] = max(samples) if samples else None


def _load_bound(plan: dict, gpus: int) -> float:
    """What the ranks may hold before the first step: the plan's store, optimizer states
    and host gradients (the ring), all made at set-up, plus 4 GiB per rank (issue 29,
    point 2: no rank holds a model beside the store while loading)."""
    made = sum(plan.get(k) or 0 for k in ("store_bytes", "states_bytes", "host_gradients_bytes"))
    return made + gpus * 4 * GIB


def _figures(run: dict, args, matmul: float | None, plan: dict) -> None:
    """The report's figures of one run, from its steps (the first two not timed)."""
    steps = run.get("steps") or []
    timed = [r["step_s"] for r in steps[2:]] or [r["step_s"] for r in steps]
    _load_peak(run)
    if run.get("host_load_peak_bytes") is not None and plan.get("store_bytes"):
        run["load_peak_over_bound"] = run["host_load_peak_bytes"] / _load_bound(plan, args.gpus)
    if plan.get("host_bytes"):
        run["host_peak_over_plan"] = run["host_peak_in_use_bytes"] / plan["host_bytes"]
    if not timed or not run.get("num_parameters"):
        return
    step_s = statistics.median(timed)
    tokens_per_gpu = args.batch_size * args.seq_len
    model_flops = 6.0 * run["num_parameters"] * tokens_per_gpu / step_s
    run.update(
        step_s=step_s,
        tokens_per_s=args.gpus * tokens_per_gpu / step_s,
        model_flops_per_gpu=model_flops,
        of_matmul=model_flops / matmul if matmul else None,
        peak_gpu_bytes=max((r.get("peak_gpu_bytes") or 0) for r in steps) or None,
    )
    if plan.get("step_s"):
        run["measured_over_predicted"] = step_s / plan["step_s"]
    # issue 30, point 4: the first step at most 10 s over the median, no later one over 1.5x
    run["first_step_over_median_s"] = steps[0]["step_s"] - step_s
    if len(steps) > 1:
        run["later_step_over_median"] = max(r["step_s"] for r in steps[1:]) / step_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--preset", default="llama-70b")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6, help="steps; the first two are not timed")
    p.add_argument("--host-precision", default="lean")
    p.add_argument(
        "--clip-grad",
        default=None,
        help="ramflow train --clip-grad (default: the trainer's, 1.0; 0 turns clipping off, "
        "so units step during backward and no full host gradient buffer is made); "
        "--api and --both: 0, the example's",
    )
    p.add_argument("--gpu-memory", default=None, help="ramflow train --gpu-memory")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--api",
        action="store_true",
        help="train with examples/llama_torchrun.py (the Python API, under torchrun) instead "
        "of ramflow train, with ramflow's device share from the plan",
    )
    which.add_argument(
        "--both",
        action="store_true",
        help="the example first, then ramflow train, on the same floors and plan: one report",
    )
    p.add_argument(
        "--cli-first",
        action="store_true",
        help="with --both: ramflow train first, then the example (the first run on a fresh "
        "machine is the first to touch its RAM)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny preset, 2 gloo ranks on the CPU")
    p.add_argument(
        "--pack",
        default=None,
        metavar="FILE",
        help="also write everything in --out-dir into this .tgz (the device tool brings back "
        "at most 8 files), after each stage, so a run cut short still leaves its logs",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=1800.0,
        help="seconds for the whole run: training is stopped (exit 124) when they are spent",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.gpus, args.batch_size, args.seq_len, args.steps = "tiny", 2, 2, 64, 4
    runs = ["api", "cli"] if args.both else ["api"] if args.api else ["cli"]
    if args.both and args.cli_first:
        runs.reverse()
    if "api" in runs:
        if args.preset not in API_SIZES:
            p.error(f"--api: examples/llama_torchrun.py has the presets {', '.join(API_SIZES)}")
        if args.clip_grad is not None and float(args.clip_grad) != 0:
            p.error("--api/--both: the example does not clip (its units step during backward)")
        args.clip_grad = "0"  # the plan's (and with --both, ramflow train's)
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": date.today().isoformat(), "args": vars(args), "runs": {}}

    def write() -> None:
        (out / "node_70b.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / "node_70b.md").write_text(_markdown(result))
        if args.pack:
            with tarfile.open(args.pack, "w:gz") as tar:
                tar.add(out, arcname=out.name)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    result["commit"] = commit or None
    floors = _floors(out, args.gpus, args.smoke)
    result["floors"] = floors
    matmul = None
    h2d = None
    if floors and floors["ranks"][0]["matmul_flops"]:
        matmul = min(r["matmul_flops"] for r in floors["ranks"])
        h2d = min(r["together"]["h2d_pieces"] for r in floors["ranks"])
        result["device"] = floors["device"]
    result["matmul_flops"] = matmul
    cpu_rate = None if args.smoke else _cpu_optimizer_rate(args.host_precision)
    result["cpu_optimizer_params_per_s"] = cpu_rate
    write()

    common = [
        "--preset",
        args.preset,
        "--host-precision",
        args.host_precision,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--checkpointing",
        "on",
        "--nproc-per-node",
        str(args.gpus),
    ]
    if args.smoke:
        common += ["--device", "cpu"]
    if args.gpu_memory:
        common += ["--gpu-memory", args.gpu_memory]
    if args.clip_grad is not None:
        common += ["--clip-grad", args.clip_grad]
    rates = []
    if matmul:
        rates += ["--gpu-tflops", f"{matmul / 1e12:.0f}"]
    if h2d:
        rates += ["--pcie-gbps", f"{h2d / 1e9:.1f}"]
    if cpu_rate:
        rates += ["--cpu-adamw-gparams", f"{cpu_rate / 1e9:.2f}"]
    plan_cmd = [sys.executable, "-m", "ramflow", "plan", *common, *rates]
    _run(plan_cmd, out / "plan.txt", timeout=300)
    plan_text = (out / "plan.txt").read_text()
    result["plan_command"] = " ".join(plan_cmd[1:])
    plan = result["plan"] = _parse_plan(plan_text)
    write()

    for name in runs:
        if time.monotonic() > deadline - 60:
            result["runs"][name] = {"skipped": "the budget (--budget-s) was spent"}
            continue
        if name == "api":
            run = _train_api(args, plan.get("ramflow_share"), out, deadline)
        else:
            run = _train_cli(args, common, out, deadline)
        _figures(run, args, matmul, plan)
        result["runs"][name] = run
        write()
    print(_markdown(result), flush=True)
    return 0 if all(r.get("exit_code") == 0 for r in result["runs"].values()) else 1


def _f(x, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if x is None else format(x / scale, spec)


def _largest(values: list | None) -> float | None:
    """The largest of ``values`` that is not None (a CPU run's are all None)."""
    values = [v for v in values or [] if v is not None]
    return max(values) if values else None


_RUN_NAMES = {"cli": "ramflow train", "api": "Python API (examples/llama_torchrun.py)"}


def _markdown(r: dict) -> str:
    a = r["args"]
    plan = r.get("plan") or {}
    runs = r.get("runs") or {}
    names = list(runs) or (
        ["api", "cli"] if a.get("both") else ["api"] if a.get("api") else ["cli"]
    )

    def row(label: str, cell, target: str) -> str:
        return (
            f"| {label} | " + " | ".join(cell(runs.get(n) or {}) for n in names) + f" | {target} |"
        )

    lines = [
        f"# {a['preset']}, full fine-tune, {a['gpus']} GPUs, {a['host_precision']} host formats",
        "",
        f"{r['date']}, {r.get('device', '-')}, commit {r.get('commit')}; "
        f"{a['batch_size']}x{a['seq_len']} tokens per GPU per step, activation checkpointing.",
        "",
        "| figure | " + " | ".join(_RUN_NAMES[n] for n in names) + " | target |",
        "| --- | " + " | ".join("---" for _ in names) + " | --- |",
        row(
            "load: build, fill and offload (rank 0's process start to its first step)",
            lambda x: (
                f"{_f(x.get('load_s'), 1, '.0f')} s ({_f(x.get('since_start_s'), 1, '.0f')} s)"
            ),
            "at most 300 s",
        ),
        row(
            f"peak host memory in use (all ranks, above the baseline); plan "
            f"{_f(plan.get('host_bytes'), GIB, '.1f')} GiB",
            lambda x: (
                f"{_f(x.get('host_peak_in_use_bytes'), GIB, '.1f')} GiB "
                f"({_f(x.get('host_peak_over_plan'))}x the plan)"
            ),
            "at most 1.2x the plan",
        ),
        row(
            f"peak host memory in use before the first step; the store, optimizer states and "
            f"host gradients {_f(_load_bound(plan, a['gpus']) - a['gpus'] * 4 * GIB, GIB, '.1f')}"
            " GiB + 4 GiB per rank",
            lambda x: (
                f"{_f(x.get('host_load_peak_bytes'), GIB, '.1f')} GiB "
                f"({_f(x.get('load_peak_over_bound'))}x the bound)"
            ),
            "at most 1.0x the bound",
        ),
        row(
            "peak GPU memory (the largest rank)",
            lambda x: _f(_largest(x.get("peak_gpu_bytes_per_rank")), GIB, ".1f") + " GiB",
            "-",
        ),
        row("step (median after two)", lambda x: f"{_f(x.get('step_s'), 1, '.2f')} s", "-"),
        row(
            "first step over the median; the slowest later step / the median",
            lambda x: (
                f"{_f(x.get('first_step_over_median_s'), 1, '+.1f')} s; "
                f"{_f(x.get('later_step_over_median'))}x"
            ),
            "at most +10 s; at most 1.5x",
        ),
        row("tokens/s, all GPUs", lambda x: _f(x.get("tokens_per_s"), 1, ",.0f"), "-"),
        row(
            f"model TFLOPS per GPU (6 x N x tokens), of the matmul rate "
            f"({_f(r.get('matmul_flops'), 1e12, '.0f')} TFLOP/s)",
            lambda x: f"{_f(x.get('model_flops_per_gpu'), 1e12, '.0f')} = {_f(x.get('of_matmul'))}",
            "at least 0.40",
        ),
        row(
            f"measured / the plan's predicted step ({_f(plan.get('step_s'), 1, '.2f')} s, bound "
            f"by {plan.get('bound', '-')})",
            lambda x: _f(x.get("measured_over_predicted")),
            "within 15%",
        ),
        row(
            "losses",
            lambda x: ", ".join(f"{s['loss']:.3f}" for s in x.get("steps") or []) or "-",
            "-",
        ),
        "",
        f"Plan: `{r.get('plan_command', '-')}`.",
    ]
    for n in names:
        x = runs.get(n) or {}
        lines.append(
            f"{_RUN_NAMES[n]}: `{x.get('command', '-')}` (exit {x.get('exit_code', '-')}, "
            f"{_f(x.get('wall_s'), 1, '.0f')} s)"
            + (f"; {x['skipped']}" if x.get("skipped") else "")
            + "."
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
