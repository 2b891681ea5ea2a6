"""Issue 48, point 2: the measured host and GPU peaks of a lean full fine-tune against the
plan's figures, for three architectures, in the plain loop and through ``ramflow train``.

Each case runs in a fresh process (its VmHWM, from /proc/self/status, is that case's
alone): the plain loop builds the shape on the meta device, offloads it
(``ramflow.train.modeling.build_offloaded``: no full fp32 model first), steps it with
``AdamW(keep_grads=False, clips=...)`` and compares VmHWM with ``get_plan(model).host_bytes``
plus the runtime the plan assumes (``memory.estimate.runtime_overhead_bytes``), and
``torch.cuda.max_memory_allocated`` with the plan's GPU figure (ramflow's share,
``OffloadPlan.planned_bytes``; the loop's activations come on top, and are listed). The CLI
case registers the shape as a preset in its process and runs ``ramflow train`` there
(``cli.main``), comparing with ``ramflow plan``'s host total plus runtime and its device
total (activations included). A case holds when the measured peak is within 10% + 2 GiB of
the planned one (the issue's test). Writes ``host_peak.json`` and ``host_peak.md`` under
``--out-dir``; exits 0 when every case ran (1 when one raised), whether or not it held.

Usage (GPU box):
    python benchmarks/memory/host_peak.py --out-dir benchmarks/results/DATE-host-peak
CPU smoke (tiny shapes):
    python benchmarks/memory/host_peak.py --out-dir /tmp/hp --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
ARCHITECTURES = ("llama", "qwen2", "qwen3_moe")
# the allowance: within 10% of the plan plus 2 GiB
RELATIVE_SLACK, ABSOLUTE_SLACK_BYTES = 0.10, 2 * GIB


def _vmhwm_bytes() -> int:
    """This process's peak resident set (VmHWM, shared memory it touched included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _preset(args: argparse.Namespace, arch: str):
    """The shape of ``arch`` at the flags' size, as a ``ModelPreset``."""
    from ramflow.train.presets import ModelPreset

    options: dict[str, Any] = {}
    if arch == "qwen3_moe":
        options = {
            "moe_intermediate_size": args.moe_intermediate,
            "num_experts": args.experts,
            "num_experts_per_tok": args.experts_per_token,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return ModelPreset(
        name=f"host-peak-{arch}",
        description=f"issue 48 host-peak shape ({arch})",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq_len),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        architecture=arch,
        architecture_options=options,
    )


def _plain(args: argparse.Namespace, arch: str, clip: float) -> dict[str, Any]:
    """One plain-loop case, in this process."""
    import torch

    import ramflow
    from ramflow.memory.estimate import runtime_overhead_bytes
    from ramflow.train.modeling import build_offloaded

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.zeros(1, device=device)  # the CUDA context is the runtime's
    runtime = _vmhwm_bytes()
    config = _preset(args, arch).to_config()
    model = build_offloaded(
        config,
        seed=0,
        device=device,
        wire_dtype=torch.bfloat16,
        gpu_memory=args.gpu_memory,
        host_precision=args.host_precision,
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False, clips=clip > 0)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
        x = x.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip > 0:
            ramflow.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    plan = ramflow.get_plan(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "num_trainable": trained,
        "runtime_measured_bytes": runtime,
        "host_planned_bytes": plan.host_bytes + runtime_overhead_bytes(device.type),
        "host_store_planned_bytes": plan.host_bytes,
        "gpu_planned_bytes": plan.planned_bytes if cuda else None,
        "gpu_planned_what": "ramflow's share (OffloadPlan.planned_bytes); activations on top",
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "host_peak_bytes": _vmhwm_bytes(),
    }


def _cli(args: argparse.Namespace, arch: str, clip: float) -> dict[str, Any]:
    """One ``ramflow train`` case, in this process (the CLI's own code path)."""
    import torch

    from ramflow import cli
    from ramflow.memory.estimate import runtime_overhead_bytes
    from ramflow.train import TrainConfig, plan_run
    from ramflow.train.presets import PRESETS

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from smoke_corpus import smoke_corpus

    preset = _preset(args, arch)
    PRESETS[preset.name] = preset
    work = Path(tempfile.mkdtemp(prefix="host-peak-"))
    corpus = smoke_corpus(work)
    options = dict(
        preset=preset.name,
        data=str(corpus),
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        host_precision=args.host_precision,
        clip_grad=clip,
        gpu_memory=args.gpu_memory,
        keep_checkpoints=0,
        eval_every=0,
        device=args.device,
    )
    est = plan_run(TrainConfig.from_options(**options))
    argv = ["train", "--preset", preset.name, "--data", str(corpus), "--out", str(work / "run")]
    for key in ("steps", "seq_len", "batch_size", "host_precision", "clip_grad", "gpu_memory"):
        argv += [f"--{key.replace('_', '-')}", str(options[key])]
    argv += ["--keep-checkpoints", "0", "--eval-every", "0", "--no-progress"]
    argv += ["--device", args.device]
    rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"ramflow {' '.join(argv)} exited {rc}")
    cuda = args.device == "cuda"
    host_total = est.host_pinned_bytes + est.host_pageable_bytes
    return {
        "num_trainable": est.num_trainable,
        "host_planned_bytes": host_total + runtime_overhead_bytes(est.device_type),
        "host_store_planned_bytes": host_total,
        "host_bytes_per_parameter": est.host_bytes_per_parameter,
        "gpu_planned_bytes": est.device_total_bytes if cuda else None,
        "gpu_planned_what": "ramflow plan's device total (activations included)",
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "host_peak_bytes": _vmhwm_bytes(),
    }


def _holds(measured: int | None, planned: int | None) -> bool | None:
    if measured is None or planned is None:
        return None
    return abs(measured - planned) <= RELATIVE_SLACK * planned + ABSOLUTE_SLACK_BYTES


def run_case(args: argparse.Namespace, mode: str, arch: str, clip: float) -> dict[str, Any]:
    """One case's row: measured and planned peaks, and whether each holds."""
    start = time.perf_counter()
    row: dict[str, Any] = {"mode": mode, "arch": arch, "clip_grad": clip}
    try:
        row.update((_plain if mode == "plain" else _cli)(args, arch, clip))
        row["host_holds"] = _holds(row["host_peak_bytes"], row["host_planned_bytes"])
        row["gpu_holds"] = _holds(row["gpu_peak_bytes"], row["gpu_planned_bytes"])
    except Exception as err:  # noqa: BLE001 - a case's failure is its row's result
        row["error"] = f"{type(err).__name__}: {err}"[:2000]
    row["seconds"] = time.perf_counter() - start
    return row


def _gib(v: int | None) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (GiB)."""
    head = (
        "| mode | arch | clip | host peak | host plan | holds | GPU peak | GPU plan | holds |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['mode']} | {r['arch']} | {r['clip_grad']} | error: {r['error'][:80]} |"
            )
            continue
        lines.append(
            f"| {r['mode']} | {r['arch']} | {r['clip_grad']} | {_gib(r['host_peak_bytes'])} | "
            f"{_gib(r['host_planned_bytes'])} | {r['host_holds']} | {_gib(r['gpu_peak_bytes'])} | "
            f"{_gib(r['gpu_planned_bytes'])} | {r['gpu_holds']} |"
        )
    return head + "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--archs", default=",".join(ARCHITECTURES))
    p.add_argument("--modes", default="plain,cli")
    p.add_argument("--clip-grads", default="1.0,0", help="one case per value (0: no clipping)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=12)
    p.add_argument("--experts-per-token", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=1408)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gpu-memory", default="12GiB")
    p.add_argument("--host-precision", default="lean")
    p.add_argument("--device", default=None, help="default: cuda where present, else cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument(
        "--in-process", action="store_true", help="run the cases here (tests; VmHWM is shared)"
    )
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # MODE,ARCH,CLIP: a child
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab, args.experts, args.experts_per_token, args.moe_intermediate = 512, 4, 2, 32
        args.seq_len, args.batch_size, args.steps, args.gpu_memory = 32, 2, 2, "1GiB"
        args.device = args.device or "cpu"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:  # a child: one case, its row on stdout's last line
        mode, arch, clip = args.case.split(",")
        print(json.dumps(run_case(args, mode, arch, float(clip))))
        return 0
    cases = [
        (mode, arch, float(clip))
        for arch in args.archs.split(",")
        for mode in args.modes.split(",")
        for clip in args.clip_grads.split(",")
    ]
    rows = []
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--in-process"]
    for mode, arch, clip in cases:
        if args.in_process:
            rows.append(run_case(args, mode, arch, clip))
        else:
            cmd = [sys.executable, __file__, *forwarded, "--case", f"{mode},{arch},{clip}"]
            done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            try:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                rows.append(
                    {
                        "mode": mode,
                        "arch": arch,
                        "clip_grad": clip,
                        "error": f"exit {done.returncode}: {done.stderr[-1500:]}",
                    }
                )
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "case")}
    result = {"settings": settings, "rows": rows}
    (args.out_dir / "host_peak.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out_dir / "host_peak.md").write_text(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
