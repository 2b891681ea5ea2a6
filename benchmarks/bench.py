"""ramflow's benchmark harness: floors, ramflow, resident, peers, k of n resident, scaling, CPU
optimizer, trace; each ramflow step also against its predicted time (``ramflow.planner.predict``).

Run on the GPU box from the repository root, e.g.::

    python benchmarks/bench.py --all --part 1 --budget-s 540 --out-dir $OUT
    python benchmarks/bench.py --floors --ramflow --resident --budget-s 520 --out-dir $OUT

Each case runs in a process of its own, in priority order, and cases that no longer fit
``--budget-s`` are skipped (and listed). A run writes into its own folder,
``<out-dir>/<date>-<device>-<what>/`` (what: ``--tag``, else ``suite`` for ``--all``, else the
model): ``<name>.json`` (raw records; the command and commit in ``meta``), ``<name>.md`` (the
report) and ``<name>.log`` (every case's output), with name ``part1``/``part2`` for ``--part``,
else ``run``; rewritten after every case. ``--report`` joins result files into ``report.json``
and ``report.md`` beside the first. ``--tiny`` runs a few-layer narrow model with short
sequences, for a smoke test on the CPU. See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import cases
import harness


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/bench.py",
        description="ramflow benchmark harness (GPU box; --tiny for a CPU smoke test).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to measure (none given: --floors --ramflow --resident)")
    g.add_argument(
        "--floors",
        action="store_true",
        help="pinned H2D/D2H/both-ways bandwidth, matmul rate, CPU AdamW rate",
    )
    g.add_argument(
        "--ramflow",
        action="store_true",
        help="ramflow inference and training at the issue's budgets",
    )
    g.add_argument(
        "--resident",
        action="store_true",
        help="all-on-GPU steps: the GPU compute floor of each case",
    )
    g.add_argument(
        "--cpu-optimizer",
        action="store_true",
        help="ramflow's AdamW vs torch's fused CPU AdamW, same tensors",
    )
    g.add_argument("--scaling", action="store_true", help="ramflow training step at several depths")
    g.add_argument(
        "--trace",
        nargs="?",
        const="",
        metavar="DIR",
        help="write a Perfetto/Chrome trace of one ramflow training step to DIR (default: --out-dir)",
    )
    g.add_argument(
        "--peers",
        action="store_true",
        help="RamTorch, DeepSpeed ZeRO-3 offload, FSDP2 offload, accelerate",
    )
    g.add_argument(
        "--kofn",
        action="store_true",
        help="k of the n blocks resident (k = 0, n/4, n/2, 3n/4): bytes each way and step time",
    )
    g.add_argument(
        "--all",
        action="store_true",
        help="the whole suite, both models, in priority order (cases.suite_cases): about 15 "
        "minutes on an H200, so on a 10-minute device call run it as --part 1 and --part 2 "
        "and join them with --report",
    )
    p.add_argument(
        "--part",
        type=int,
        choices=(1, 2),
        default=None,
        help="with --all: only this half of the suite (each fits ~540 s on an H200)",
    )
    p.add_argument(
        "--model",
        choices=("reference", "llama-3b"),
        default="reference",
        help="the model of the group flags (--all runs both)",
    )
    p.add_argument("--tiny", action="store_true", help="small model and sequences (CPU smoke test)")
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps per case (the median is reported)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument(
        "--budget-s",
        type=float,
        default=520.0,
        help="skip cases that would end past this many seconds",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where the run's folder is made (default: benchmarks/results); with --report, "
        "where report.json and .md go (default: beside the first file)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="what the run is, the end of its folder's name (default: suite for --all, else "
        "the model)",
    )
    p.add_argument(
        "--peer",
        action="append",
        choices=("ramtorch", "deepspeed", "fsdp2", "accelerate"),
        help="with --peers: only these peers (repeatable)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only cases whose id contains TEXT (repeatable)",
    )
    p.add_argument("--scaling-depths", default="6,12,24", help="depths for --scaling")
    p.add_argument(
        "--checkpointing-by",
        choices=("model", "ramflow"),
        default="model",
        help="who recomputes activations in ramflow's checkpointed cases: the model's own "
        "per-block torch.utils.checkpoint (as the resident cases) or "
        "ramflow.offload(activation_checkpointing=True)",
    )
    p.add_argument(
        "--host-precision",
        choices=("fp32", "bf16", "lean", "kahan"),
        default="fp32",
        help="ramflow.offload(host_precision=...) of ramflow's training cases; the first "
        "resident units are stepped on the GPU (device_optimizer=True; for the lean formats "
        "only where Triton runs their device step as one kernel)",
    )
    p.add_argument(
        "--device-optimizer",
        choices=("on", "auto"),
        default="on",
        help="on (default): the first resident units of ramflow's training cases step on the "
        "GPU where the host format has a device step; auto: the planner decides "
        "(device_optimizer=None, the loop that passes nothing beyond host_precision)",
    )
    p.add_argument(
        "--list", action="store_true", help="print the cases and their time estimates, run nothing"
    )
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="join result files into one report (report.json, report.md); run nothing",
    )
    p.add_argument("--run-case", metavar="JSON", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _run_one(case_json: str) -> None:
    """Child process: run one case and print its result line."""
    import torch

    import runners

    result = runners.run(json.loads(case_json))
    result["torch_version"] = torch.__version__
    result["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(harness.RESULT_PREFIX + json.dumps(result, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.run_case:
        _run_one(args.run_case)
        return 0
    if args.report:
        paths = [Path(x) for x in args.report]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            print(f"bench.py: --report: no such file: {', '.join(missing)}", file=sys.stderr)
            return 2
        folder = Path(args.out_dir) if args.out_dir else paths[0].parent
        stem = harness.merge(paths, folder / "report")
        print(f"wrote {stem}.json and {stem}.md")
        return 0
    if args.part is not None and not args.all:
        print("bench.py: --part needs --all", file=sys.stderr)
        return 2
    groups = [
        g for g in cases.GROUPS if getattr(args, g) or (g == "trace" and args.trace is not None)
    ]
    if not groups:
        groups = ["floors", "ramflow", "resident"]
    out_dir = Path(args.out_dir) if args.out_dir else harness.BENCH_DIR / "results"
    what = args.tag or ("suite" if args.all else args.model)
    name = f"part{args.part}" if args.part is not None else "run"
    folder = harness.run_dir(out_dir, what) if not args.list else out_dir
    trace_dir = args.trace if args.trace else str(folder)
    tag = args.tag or (
        "run" if not args.all else "all" if args.part is None else f"part{args.part}"
    )
    options = dict(
        tiny=args.tiny,
        warmup=args.warmup,
        steps=args.steps,
        out_dir=trace_dir,
        scaling_depths=[int(d) for d in args.scaling_depths.split(",")],
        peer_names=args.peer,
        checkpointing_by=args.checkpointing_by,
        host_precision=args.host_precision,
        device_optimizer=args.device_optimizer,
    )
    if args.all:
        selected = cases.suite_cases(part=args.part, tag=tag, **options)
    else:
        selected = cases.build_cases(groups, model=args.model, tag=f"{args.model}-{tag}", **options)
    if args.only:
        selected = [c for c in selected if any(t in c["id"] for t in args.only)]
    if args.list:
        total = 0.0
        for c in selected:
            total += c["estimate_s"]
            print(f"{c['estimate_s']:6.0f} s  {c['id']}")
        print(f"{total:6.0f} s  in all (budget {args.budget_s:.0f} s)")
        return 0
    command = "python benchmarks/bench.py " + " ".join(shlex.quote(a) for a in argv)
    stem = harness.run_all(
        selected,
        budget_s=args.budget_s,
        stem=folder / name,
        command=command,
        steps=args.steps,
        warmup=args.warmup,
    )
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
