"""Data-parallel offloaded training of the reference model: N GPUs against one.

Each rank is a ``torchrun`` process with its own GPU and micro-batch of the same size, so
N GPUs process N times the tokens of one per step. One GPU runs plain
``ramflow.offload(model)``; N > 1 run ``ramflow.offload(model, zero_stage=...)``, sharing one
host copy of the weights and splitting the CPU optimizer's work. Rank 0 writes one JSON
line (median step time, tokens/s, peak GPU memory of each rank) to ``--out``.

    torchrun --nproc-per-node 1 benchmarks/multi_gpu.py --out r1.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --zero-stage 2 --out r2.json
    python benchmarks/multi_gpu.py --report r1.json r2.json     # the markdown table

The ranks share the host's cores: each uses cores / ranks threads (as the README advises).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]


def _run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import measure
    import ramflow
    from models import build_model, make_batch, model_shape
    from runners import _train_step

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if args.cpu:  # a smoke test of this script without GPUs (gloo)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    model = build_model("reference", tiny=args.tiny, device="cpu", num_layers=args.layers)
    zero = args.zero_stage if world > 1 else None
    ramflow.offload(model, device=device, gpu_memory=args.gpu_memory, zero_stage=zero)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False)
    ids, labels = make_batch(
        model_shape(model).vocab_size, args.batch, args.seq, device=device, seed=rank
    )
    setup_s = time.perf_counter() - t0

    res = measure.time_steps(
        _train_step(model, opt, ids, labels, device),
        device=device,
        warmup=args.warmup,
        steps=args.steps,
        drain=lambda: ramflow.synchronize(model),
    )
    # every rank's own times and peak, gathered on rank 0
    mine = {"rank": rank, "step_s": res["step_s"], "peak_bytes": res["peak_bytes"]}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        step_s = max(r["step_s"] for r in everyone)  # the step ends when the slowest rank's does
        tokens = world * args.batch * args.seq
        out = {
            "date": date.today().isoformat(),
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
            "gpus": world,
            "zero_stage": zero,
            "batch_per_gpu": args.batch,
            "seq": args.seq,
            "gpu_memory": args.gpu_memory,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "ranks": everyone,
            "setup_s": setup_s,
            "threads_per_rank": torch.get_num_threads(),
            "command": " ".join(sys.argv),
            "host": platform.node(),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _report(paths: list[str]) -> None:
    rows = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line]
    base = {}
    for r in rows:
        if r["gpus"] == 1:
            base[(r["batch_per_gpu"], r["seq"], r["gpu_memory"])] = r["tokens_per_s"]
    print(
        "| GPUs | ZeRO | batch per GPU | budget | step | tokens/s | vs one GPU | peak GPU memory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        one = base.get((r["batch_per_gpu"], r["seq"], r["gpu_memory"]))
        ratio = f"{r['tokens_per_s'] / one:.2f}x" if one else "-"
        peaks = [x["peak_bytes"] for x in r["ranks"] if x["peak_bytes"] is not None]
        peak = f"{max(peaks) / 2**30:.1f} GiB" if peaks else "-"
        print(
            f"| {r['gpus']} | {r['zero_stage'] or '-'} | {r['batch_per_gpu']}x{r['seq']} | "
            f"{r['gpu_memory'] or 'no cap'} | {r['step_s'] * 1e3:.0f} ms | "
            f"{r['tokens_per_s']:.0f} | {ratio} | {peak} |"
        )
    print(f"\n{rows[0]['date']}, {rows[0]['device']}; step = median of the slowest rank.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 12)")
    parser.add_argument("--gpu-memory", default=None, help='ramflow budget per GPU, e.g. "12GiB"')
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the 4-layer smoke-test model")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke test)")
    parser.add_argument("--out", default="multi_gpu.jsonl")
    parser.add_argument("--report", nargs="+", metavar="JSONL", help="print the table and exit")
    args = parser.parse_args()
    if args.report:
        _report(args.report)
    else:
        _run(args)


if __name__ == "__main__":
    main()
