"""Accuracy of the host formats (issue 14, point 5): one ``ramflow train`` run per format.

Each format of ``--formats`` (fp32, bf16, lean, kahan) trains the same preset on the same
data with the same seed, all runs at once as subprocesses on one GPU: the host's cores are
split between them (``OMP_NUM_THREADS`` = cores / runs, which is ``torch.get_num_threads()``
in each, the thread count of ramflow's AdamW) and so is the device budget (``--gpu-memory``
per run). At ``--budget-s`` minus ``--grace-s`` the runs still going get SIGTERM: the trainer
finishes its step, saves a checkpoint and writes its summary; at ``--budget-s`` minus 5 s a
run still going is killed. The curves come from each run's ``log.jsonl``.

Writes into ``--out-dir``: ``accuracy.png`` (training and validation loss of every format,
one figure), ``accuracy.json`` and ``accuracy.md`` (final validation loss per format and its
difference from fp32's, relative; steps reached; the command lines), and per format
``<format>/`` with the run's ``log.jsonl``, ``run.json`` and console output. The run folders
themselves (with checkpoints, about 15 GiB for fp32 at 1.24 B parameters) go under
``--run-root`` (default: a folder in the system's temporary directory), not the output.

GPU (H100, 16 cores): two formats per call (four at once share the host's DRAM for the
deferred steps' gradients and run slower than two), then a call that resumes all four:

    PYTHONUNBUFFERED=1 python3 benchmarks/host_formats/host_formats_accuracy.py --formats fp32,lean \\
        --budget-s 470 --device-optimizer --gpu-memory 30GiB --run-root /tmp/acc-runs \\
        --out-dir $OUT/acc
    ... --formats bf16,kahan ... (the same)
    PYTHONUNBUFFERED=1 python3 benchmarks/host_formats/host_formats_accuracy.py --resume --budget-s 420 \\
        --device-optimizer --gpu-memory 30GiB --run-root /tmp/acc-runs --out-dir $OUT/accf

With ``--device-optimizer`` the units step on the GPU with each format's own arithmetic
(``ramflow train --device-optimizer``; tested to give the CPU step's bits; the lean formats
in one Triton kernel), so the runs are not bound by the CPU optimizer: 0.74-1.08 s per step
of llama-1b, two runs at once. The deferred step's gradient round trip and the clipping
over the host's copy are what remain on the CPU (not profiled separately;
``benchmarks/results/2026-11-24-nvidia-h100-lean-triton``).

A run that was stopped by the budget left a checkpoint in ``--run-root``: on the same
machine (still warm), the same command with ``--resume`` continues every unfinished run to
``--steps`` (finished ones are only collected again), as above.

Defaults: ``--preset llama-1b --steps 500 --batch-size 4 --seq-len 512 --eval-every 100
--gpu-memory 16GiB`` (per run), clipping at 1.0 and the seed 0, the standard library corpus.
CPU smoke test (the tiny preset, a few steps, a small corpus; about a minute on 2 cores):

    python benchmarks/host_formats/host_formats_accuracy.py --smoke --out-dir /tmp/acc-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC.parent / "benchmarks"))  # smoke_corpus

from smoke_corpus import smoke_corpus  # noqa: E402

FORMATS = ("fp32", "bf16", "lean", "kahan")
TARGET_RELATIVE = 0.01  # issue 14: final validation loss within 1% of fp32's on the GPU


def _read_log(path: Path) -> list[dict]:
    """The records of a ``log.jsonl`` (a torn last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _finished(run_dir: Path, steps: int) -> bool:
    ends = [r for r in _read_log(run_dir / "log.jsonl") if r.get("event") == "end"]
    return bool(ends) and ends[-1]["step"] >= steps and not ends[-1].get("interrupted")


def _command(args: argparse.Namespace, fmt: str, run_dir: Path, data: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "ramflow", "train"]
    if args.resume and (run_dir / "checkpoints").exists():
        return [*cmd, "--resume", str(run_dir), "--steps", str(args.steps), "--no-progress"]
    cmd += [
        "--preset", args.preset, "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--host-precision", fmt, "--seed", str(args.seed),
        "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
        "--save-every", "0", "--clip-grad", "1.0", "--out", str(run_dir), "--no-progress",
    ]  # fmt: skip
    if args.device:
        cmd += ["--device", args.device]
    if args.gpu_memory:
        cmd += ["--gpu-memory", args.gpu_memory]
    if args.device_optimizer:
        cmd += ["--device-optimizer"]
    if data is not None:
        cmd += ["--data", str(data)]
    return cmd


def _run_all(args: argparse.Namespace, out_dir: Path, run_root: Path) -> dict[str, dict]:
    """Start one training process per format, stop them at the budget, return their info."""
    t0 = time.monotonic()
    data = smoke_corpus(out_dir) if args.smoke else args.data
    formats = args.formats
    threads = args.threads or max(1, (os.cpu_count() or 1) // len(formats))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    runs: dict[str, dict] = {}
    for fmt in formats:
        run_dir = run_root / fmt
        (out_dir / fmt).mkdir(parents=True, exist_ok=True)
        info: dict = {"run_dir": str(run_dir), "threads": threads}
        if args.resume and _finished(run_dir, args.steps):
            info.update(command=None, returncode=0, note="finished in an earlier call")
            runs[fmt] = info
            continue
        if run_dir.exists() and not (args.resume and (run_dir / "checkpoints").exists()):
            raise SystemExit(
                f"{run_dir} exists: give another --run-root, remove it, or --resume to continue"
            )
        cmd = _command(args, fmt, run_dir, data)
        console = open(out_dir / fmt / "console.log", "a")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=env)
        info.update(command=" ".join(cmd), proc=proc, console=console)
        runs[fmt] = info
        print(f"[{time.monotonic() - t0:6.1f}s] {fmt}: pid {proc.pid}: {info['command']}")
    stop_at = t0 + args.budget_s - args.grace_s
    kill_at = t0 + args.budget_s - 5
    signalled = False
    while any("proc" in r and r["proc"].poll() is None for r in runs.values()):
        now = time.monotonic()
        if now >= stop_at and not signalled:
            signalled = True
            for fmt, r in runs.items():
                if "proc" in r and r["proc"].poll() is None:
                    print(f"[{now - t0:6.1f}s] {fmt}: budget reached, SIGTERM (it saves and stops)")
                    r["proc"].send_signal(signal.SIGTERM)
                    r["stopped_by_budget"] = True
        if now >= kill_at:
            for fmt, r in runs.items():
                if "proc" in r and r["proc"].poll() is None:
                    print(f"[{now - t0:6.1f}s] {fmt}: still running at the budget's end, killed")
                    r["proc"].kill()
                    r["killed"] = True
            break
        time.sleep(1.0)
    for fmt, r in runs.items():
        if "proc" in r:
            r["returncode"] = r.pop("proc").wait()
            r.pop("console").close()
            print(f"[{time.monotonic() - t0:6.1f}s] {fmt}: exit {r['returncode']}")
    return runs


def _curves(run_dir: Path) -> dict:
    records = _read_log(run_dir / "log.jsonl")
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    return {
        "train": [(r["step"], r["loss"]) for r in steps],
        "val": [(r["step"], r["val_loss"]) for r in evals],
        "step_s": [r["step_s"] for r in steps],
        "peak_gpu_bytes": max(
            (r["peak_gpu_bytes"] for r in steps if r["peak_gpu_bytes"]), default=None
        ),
        "host_rss_bytes": max((r["host_rss_bytes"] for r in steps), default=None),
    }


def _plot(curves: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(13, 4.8))
    for fmt, c in curves.items():
        if c["train"]:
            s, loss = zip(*c["train"])
            window = max(1, len(loss) // 50)
            smooth = [sum(loss[max(0, i - window + 1) : i + 1]) / len(loss[max(0, i - window + 1) : i + 1]) for i in range(len(loss))]  # fmt: skip
            ax_t.plot(s, smooth, label=f"{fmt} (mean of {window})")
        if c["val"]:
            s, loss = zip(*c["val"])
            ax_v.plot(s, loss, marker="o", label=fmt)
    for ax, what in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _report(args: argparse.Namespace, runs: dict[str, dict], out_dir: Path) -> dict:
    curves = {fmt: _curves(Path(r["run_dir"])) for fmt, r in runs.items()}
    for fmt, r in runs.items():
        for name in ("log.jsonl", "run.json", "loss.png"):
            src = Path(r["run_dir"]) / name
            if src.exists():
                (out_dir / fmt / name).write_bytes(src.read_bytes())
    # the last validation step every run reached: the fair comparison when some were cut short
    reached = [max((s for s, _ in c["val"]), default=-1) for c in curves.values()]
    common = min(reached) if reached else -1
    rows = {}
    for fmt, c in curves.items():
        val = dict(c["val"])
        last_step, last_val = c["val"][-1] if c["val"] else (None, None)
        times = sorted(c["step_s"][1:]) or sorted(c["step_s"])
        rows[fmt] = {
            "steps_reached": c["train"][-1][0] if c["train"] else 0,
            "final_val_step": last_step,
            "final_val_loss": last_val,
            "common_val_step": common if common >= 0 else None,
            "common_val_loss": val.get(common),
            "median_step_s": times[len(times) // 2] if times else None,
            "peak_gpu_bytes": c["peak_gpu_bytes"],
            "peak_host_rss_bytes": c["host_rss_bytes"],
            "returncode": runs[fmt].get("returncode"),
            "stopped_by_budget": runs[fmt].get("stopped_by_budget", False),
            "killed": runs[fmt].get("killed", False),
            "command": runs[fmt].get("command"),
            "threads": runs[fmt]["threads"],
        }
    ref = rows.get("fp32", {})
    for row in rows.values():
        for key in ("final_val_loss", "common_val_loss"):
            base, mine = ref.get(key), row[key]
            rel = (mine - base) / base if base and mine is not None else None
            row[key.replace("_loss", "_rel_to_fp32")] = rel
        rel = row["common_val_rel_to_fp32"]
        row["within_target"] = None if rel is None else abs(rel) <= TARGET_RELATIVE
    result = {
        "meta": {
            "date": date.today().isoformat(),
            "host": platform.node(),
            "python": sys.version.split()[0],
            "argv": sys.argv,
            "preset": args.preset,
            "steps": args.steps,
            "tokens_per_step": args.batch_size * args.seq_len,
            "seed": args.seed,
            "target_relative": TARGET_RELATIVE,
        },
        "formats": rows,
    }
    title = (
        f"host formats: {args.preset}, {args.batch_size}x{args.seq_len} tokens per step, "
        f"seed {args.seed}"
    )
    _plot(curves, out_dir / "accuracy.png", title)
    (out_dir / "accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "accuracy.md").write_text(_markdown(result, title))
    return result


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _markdown(result: dict, title: str) -> str:
    lines = [
        f"# {title}",
        "",
        f"{result['meta']['date']}, {result['meta']['host']}; target: validation loss within "
        f"{TARGET_RELATIVE:.0%} of fp32's at the last step every run reached (`common`).",
        "",
        "![curves](accuracy.png)",
        "",
        "| format | steps | final val (step) | vs fp32 | common val (step) | vs fp32 | within | "
        "median step | peak GPU | peak RSS | exit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    gib = 2**30
    for fmt, r in result["formats"].items():
        lines.append(
            f"| {fmt} | {r['steps_reached']} | {_fmt(r['final_val_loss'], '.4f')} "
            f"({r['final_val_step']}) | {_fmt(r['final_val_rel_to_fp32'], '+.2%')} | "
            f"{_fmt(r['common_val_loss'], '.4f')} ({r['common_val_step']}) | "
            f"{_fmt(r['common_val_rel_to_fp32'], '+.2%')} | {r['within_target']} | "
            f"{_fmt(r['median_step_s'], '.3f')} s | "
            f"{_fmt(r['peak_gpu_bytes'] and r['peak_gpu_bytes'] / gib, '.2f')} GiB | "
            f"{_fmt(r['peak_host_rss_bytes'] and r['peak_host_rss_bytes'] / gib, '.2f')} GiB | "
            f"{r['returncode']}{' (budget)' if r['stopped_by_budget'] else ''} |"
        )
    lines += ["", "Commands (run concurrently, one GPU, threads per run as given):", ""]
    for fmt, r in result["formats"].items():
        lines.append(f"- {fmt} ({r['threads']} threads): `{r['command']}`")
    return "\n".join(lines) + "\n"


def summarize_seeds(
    dirs: list[Path], out_dir: Path, only: list[set[str] | None] | None = None
) -> dict:
    """Several seeds' outputs of this script (each a folder with ``accuracy.json`` and
    ``<format>/log.jsonl``; folders of one seed are merged, so a format run later is set
    against the same seed's fp32 run of another folder) in one report: per seed, each
    format's final validation loss against the same seed's fp32; per format, the mean over
    its seeds against fp32's mean over the same seeds. A seed counts for a format only
    where both runs reached the last step. Raises ValueError for two runs of one format
    and seed, or folders of one seed with different step counts. ``only`` gives, per folder
    of ``dirs``, the formats taken from it (None: all), e.g. fp32 runs of an older commit
    set against new lean runs; the others are left out. Writes ``seeds.json``, ``seeds.md`` and ``seeds.png``
    (every run's training and validation curves) into ``out_dir``."""
    by_seed: dict[int, dict] = {}
    curves: dict[str, dict] = {}
    for d, keep in zip(dirs, only or [None] * len(dirs)):
        r = json.loads((d / "accuracy.json").read_text())
        meta, rows = r["meta"], r["formats"]
        entry = by_seed.setdefault(
            meta["seed"],
            {"seed": meta["seed"], "folders": [], "steps": meta["steps"], "final_val": {}},
        )
        if meta["steps"] != entry["steps"]:
            raise ValueError(
                f"{d} ran {meta['steps']} steps, another folder of seed {meta['seed']} {entry['steps']}"
            )
        entry["folders"].append(str(d))
        for f, row in rows.items():
            if keep is not None and f not in keep:
                continue
            if f in entry["final_val"]:
                raise ValueError(f"seed {meta['seed']} has two {f} runs ({d} and another folder)")
            if row["final_val_step"] == meta["steps"] and row["final_val_loss"] is not None:
                entry["final_val"][f] = row["final_val_loss"]
            if (d / f / "log.jsonl").exists():
                curves[f"{f}, seed {meta['seed']}"] = _curves(d / f)
    seeds = [by_seed[k] for k in sorted(by_seed)]
    formats = [f for f in FORMATS if any(f in s["final_val"] for s in seeds)]
    summary = {}
    for f in formats:
        pairs = [(s["final_val"][f], s["final_val"]["fp32"], s["seed"]) for s in seeds
                 if f in s["final_val"] and "fp32" in s["final_val"]]  # fmt: skip
        if not pairs:
            continue
        mine = sum(a for a, _, _ in pairs) / len(pairs)
        base = sum(b for _, b, _ in pairs) / len(pairs)
        summary[f] = {
            "seeds": [seed for _, _, seed in pairs],
            "rel_to_fp32_per_seed": [(a - b) / b for a, b, _ in pairs],
            "mean_final_val": mine,
            "fp32_mean_final_val": base,
            "mean_rel_to_fp32": (mine - base) / base,
            "within_target": abs(mine - base) / base <= TARGET_RELATIVE,
        }
    result = {"seeds": seeds, "formats": summary, "target_relative": TARGET_RELATIVE}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "seeds.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(curves, out_dir / "seeds.png", "host formats, every seed")
    lines = [
        "# Host formats over several seeds",
        "",
        f"Final validation loss against fp32's over the same seeds (target: within "
        f"{TARGET_RELATIVE:.0%}). Folders: "
        + ", ".join(f"`{f}`" for s in seeds for f in s["folders"])
        + ".",
        "",
        "![curves](seeds.png)",
        "",
        "| format | seeds | vs fp32, per seed | mean final val | fp32 mean | mean vs fp32 | within |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f, row in summary.items():
        per = ", ".join(f"{x:+.2%}" for x in row["rel_to_fp32_per_seed"])
        lines.append(
            f"| {f} | {', '.join(map(str, row['seeds']))} | {per} | "
            f"{row['mean_final_val']:.4f} | {row['fp32_mean_final_val']:.4f} | "
            f"{row['mean_rel_to_fp32']:+.2%} | {row['within_target']} |"
        )
    (out_dir / "seeds.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="folder for the plot, report and logs")
    p.add_argument("--run-root", default=None, help="folder for the run folders (checkpoints)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated host formats")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="corpus (default: the stdlib sources)")
    p.add_argument("--device", default=None, help="as ramflow train's --device")
    p.add_argument("--gpu-memory", default="16GiB", help="device budget of each run")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run")
    p.add_argument(
        "--device-optimizer",
        action="store_true",
        help="ramflow train --device-optimizer: units whose states fit the budget step on "
        "the GPU, with the host formats' arithmetic (the same bits as the CPU step)",
    )
    p.add_argument("--budget-s", type=float, default=560.0, help="wall budget of this script")
    p.add_argument("--grace-s", type=float, default=90.0, help="time left for the runs to save")
    p.add_argument("--resume", action="store_true", help="continue runs stopped by the budget")
    p.add_argument("--smoke", action="store_true", help="tiny preset, few steps, on the CPU")
    p.add_argument(
        "--seeds",
        default=None,
        metavar="DIRS",
        help="comma-separated output folders of runs with other seeds: write their summary "
        "(seeds.md, seeds.json, seeds.png) into --out-dir and run nothing; DIR:fp32+lean takes "
        "only those formats from DIR",
    )
    args = p.parse_args(argv)
    if args.seeds is not None:
        dirs, only = [], []
        for item in (d for d in args.seeds.split(",") if d):
            folder, _, formats = item.partition(":")
            dirs.append(Path(folder))
            only.append(set(formats.split("+")) if formats else None)
        summarize_seeds(dirs, Path(args.out_dir), only)
        print((Path(args.out_dir) / "seeds.md").read_text())
        return 0
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown or not args.formats:
        p.error(f"--formats: unknown {unknown}; choose from {', '.join(FORMATS)}")
    if args.smoke:
        args.preset, args.steps, args.batch_size, args.seq_len = "tiny", 6, 2, 32
        args.eval_every, args.eval_batches, args.device, args.gpu_memory = 3, 1, "cpu", None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.run_root is None:
        args.run_root = tempfile.mkdtemp(prefix="ramflow-accuracy-")
    run_root = Path(args.run_root)
    run_root.mkdir(parents=True, exist_ok=True)
    runs = _run_all(args, out_dir, run_root)
    result = _report(args, runs, out_dir)
    print((out_dir / "accuracy.md").read_text())
    failed = [f for f, r in result["formats"].items() if r["final_val_loss"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
