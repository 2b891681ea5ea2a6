"""Data-parallel offloaded training of the reference model: N GPUs against one.

Each rank is a ``torchrun`` process with its own GPU and micro-batch of the same size, so
N GPUs process N times the tokens of one per step. One GPU runs plain
``ramflow.offload(model)``; N > 1 run ``ramflow.offload(model, zero_stage=...)``, sharing one
host copy of the weights and splitting the CPU optimizer's work. Rank 0 writes one JSON
line (median step time, tokens/s, peak GPU memory of each rank, the bytes each rank copied
per step, the CPU optimizer's rate and the host memory in use) to ``--out``.

    torchrun --nproc-per-node 1 benchmarks/node/multi_gpu.py --out r.jsonl
    torchrun --nproc-per-node 4 benchmarks/node/multi_gpu.py --zero-stage 2 --out r.jsonl
    torchrun --nproc-per-node 4 benchmarks/node/multi_gpu.py --floors --out floors.jsonl
    python benchmarks/node/multi_gpu.py --report r.jsonl --floors-from floors.jsonl

``--floors`` measures what the ranks share instead of training: pinned H2D and D2H of every
GPU at once (their sum is what the host's DRAM serves to PCIe), one GPU alone, the host's
memory copy rate with all cores, and each GPU's bf16 matmul rate. The report divides each
step's host DRAM traffic (every rank's H2D and D2H plus the CPU optimizer's bytes) by the
copy rate, and each rank's H2D by its link's rate, to say which resource binds.

``--device-optimizer on`` steps on each GPU the resident units its rank owns (under ZeRO:
see [Note: the device optimizer under ZeRO] in ramflow/engine/device_stepper.py); ``auto`` (the default)
is ``offload``'s own choice (the planner's, per rank under ZeRO), ``off`` none:

    torchrun --nproc-per-node 2 benchmarks/node/multi_gpu.py --device-optimizer on --out r.jsonl

The ranks share the host's cores: each uses cores / ranks threads.
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
BENCH = HERE.parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]


def _host_memory_sampler(stop, peak: list[int]) -> None:
    """Every 50 ms, the host memory in use by everyone, kept as the peak in ``peak[0]``."""
    while not stop.wait(0.05):
        peak[0] = max(peak[0], _host_in_use())


def _host_in_use() -> int:
    """The system's memory in use: psutil's ``used``, total minus available, which counts
    the /dev/shm store (shared memory cannot be reclaimed) but not the page cache."""
    import psutil

    return psutil.virtual_memory().used


def _init_process(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    # the ranks share the host's cores (torchrun --numa-binding may narrow them further)
    threads = max(1, (os.cpu_count() or 1) // local_world)
    if hasattr(os, "sched_getaffinity"):
        threads = min(threads, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    if args.cpu:  # a smoke test of this script without GPUs (gloo)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return device


def _floors(args: argparse.Namespace) -> None:
    """What the ranks share: every GPU's pinned copies at once, then one alone, the host's
    copy rate and each GPU's matmul rate."""
    import torch
    import torch.distributed as dist

    import measure

    device = _init_process(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    together = measure.pinned_bandwidth(device)  # all ranks at once
    dist.barrier()
    alone = measure.pinned_bandwidth(device) if rank == 0 else None
    dist.barrier()
    matmul = measure.matmul_flops(device) if device.type == "cuda" else None
    dist.barrier()
    dram = measure.dram_copy_bandwidth(nbytes=4 * measure.GiB) if rank == 0 else None
    mine = {"rank": rank, "together": together, "matmul_flops": matmul}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        out = {
            "kind": "floors",
            "date": date.today().isoformat(),
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
            "gpus": world,
            "alone": alone,
            "ranks": everyone,
            "dram_copy_bytes_per_s": dram,
            "cores": os.cpu_count(),
            "numa_nodes": _numa_nodes(),
            "command": " ".join(sys.argv),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _numa_nodes() -> int:
    nodes = Path("/sys/devices/system/node")
    return len(list(nodes.glob("node[0-9]*"))) if nodes.exists() else 1


def _run(args: argparse.Namespace) -> None:
    import threading

    import torch
    import torch.distributed as dist

    import measure
    import ramflow
    from models import build_model, make_batch, model_shape
    from ramflow.engine.device_stepper import STEP_STREAM
    from ramflow.units.registry import engine_of_model
    from runners import _train_step

    device = _init_process(args)
    world = dist.get_world_size()
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    stop, host_peak = threading.Event(), [0]
    host_before = _host_in_use()
    sampler = None
    if local_rank == 0:
        sampler = threading.Thread(target=_host_memory_sampler, args=(stop, host_peak), daemon=True)
        sampler.start()
    t0 = time.perf_counter()
    weights = None
    if args.meta:  # every rank builds on the meta device; the host store is filled once
        from models import random_init
        from reference_model import REFERENCE, TINY, ReferenceModel

        cfg = (TINY if args.tiny else REFERENCE).replace(
            checkpoint=args.checkpoint, loss_chunk_tokens=args.loss_chunk
        )
        if args.layers is not None:
            cfg = cfg.replace(num_layers=args.layers)
        with torch.device("meta"):
            model = ReferenceModel(cfg)
        weights = random_init
    else:
        model = build_model(
            "reference",
            tiny=args.tiny,
            device="cpu",
            num_layers=args.layers,
            checkpoint=args.checkpoint,
            loss_chunk_tokens=args.loss_chunk,
        )
    zero = args.zero_stage if world > 1 else None
    counter = measure.CopyCounter()
    ramflow.offload(
        model,
        device=device,
        gpu_memory=args.gpu_memory,
        zero_stage=zero,
        host_precision=args.host_precision,
        weights=weights,
        device_optimizer=DEVICE_OPTIMIZER[args.device_optimizer],
    )
    counter.watch(model)
    engine = engine_of_model(model)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False)
    ids, labels = make_batch(
        model_shape(model).vocab_size, args.batch, args.seq, device=device, seed=rank
    )
    dist.barrier()
    setup_s = time.perf_counter() - t0
    host_after_offload = _host_in_use()
    before: list = [(0, 0.0), {}, {}]

    def phases() -> tuple[dict[str, float], dict[str, float]]:
        """Seconds so far: the forward's waits for units, the worker's sync phases."""
        sync = (
            engine.stepper.dist.sync_seconds.snapshot() if engine.stepper.dist is not None else {}
        )
        return engine.window.wait_seconds.snapshot(), sync

    def timed_start() -> None:
        before[:] = [engine.host_stepper.host_step_totals(), *phases()]

    res = measure.time_steps(
        _train_step(model, opt, ids, labels, device),
        device=device,
        warmup=args.warmup,
        steps=args.steps,
        drain=lambda: ramflow.synchronize(model),
        counter=counter,
        on_timed_start=timed_start,
    )
    params, seconds = (a - b for a, b in zip(engine.host_stepper.host_step_totals(), before[0]))
    waits, sync = (
        {k: (v - old.get(k, 0.0)) / args.steps for k, v in now.items()}
        for now, old in zip(phases(), before[1:])
    )
    stop.set()
    # every rank's own times, bytes and peak, gathered on rank 0
    mine = {
        "rank": rank,
        "step_s": res["step_s"],
        "step_times_s": res["step_times_s"],
        "peak_bytes": res["peak_bytes"],
        "h2d_bytes_per_step": res.get("h2d_bytes_counted"),
        "d2h_bytes_per_step": res.get("d2h_bytes_counted"),
        "h2d_refresh_bytes_per_step": res.get("h2d_refresh_bytes_counted"),
        "optimizer_params_per_step": params / args.steps,
        "optimizer_params_per_s": params / seconds if seconds > 0 else None,
        "threads": torch.get_num_threads(),
        "host_peak_in_use": host_peak[0] if local_rank == 0 else None,
        "device_stepped_units": len(ramflow.get_plan(model).device_stepped),
        # per step: seconds the forward (and backward) waited for units not current yet,
        # and the worker's sync after opt.step() by phase (see [Note: the step's sync] in
        # ramflow/distributed/zero.py; it overlaps the next forward)
        "unit_wait_s": waits.get("units not current"),
        "sync_s": sync,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        step_s = max(r["step_s"] for r in everyone)  # the step ends when the slowest rank's does
        tokens = world * args.batch * args.seq
        plan = ramflow.get_plan(model)
        out = {
            "kind": "train",
            "date": date.today().isoformat(),
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
            "gpus": world,
            "zero_stage": zero,
            "host_precision": args.host_precision,
            # resident units reach the ranks that do not own them from the owner's device
            # (see [Note: refresh by broadcast] in ramflow/distributed/zero.py) or from the host; read
            # from the engine, which decided it (one GPU refreshes nothing)
            "refresh": "-"
            if engine.stepper.dist is None
            else ("broadcast" if engine.stepper.dist.broadcast_units else "host"),
            "device_optimizer": args.device_optimizer,
            "device_optimizer_reason": plan.device_optimizer_reason,
            # "0": device steps that wait for a reduction run on the compute stream (an A/B
            # of [Note: the device optimizer under ZeRO] in ramflow/engine/device_stepper.py); read
            # from the engine's module, which decided it from RAMFLOW_DEVICE_STEP_STREAM
            "device_step_stream": "1" if STEP_STREAM else "0",
            "checkpoint": args.checkpoint,
            "meta": args.meta,
            "batch_per_gpu": args.batch,
            "seq": args.seq,
            "gpu_memory": args.gpu_memory,
            "resident_units": len(plan.resident),
            "num_units": len(plan.unit_names),
            "num_params": sum(p.numel() for p in model.parameters()),
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "ranks": everyone,
            "setup_s": setup_s,
            "host_in_use_before": host_before,
            "host_in_use_after_offload": host_after_offload,
            "host_in_use_peak": host_peak[0],
            "command": " ".join(sys.argv),
            "host": platform.node(),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _busy(r: dict, link_bytes_per_s: float | None) -> dict[str, float]:
    """Per resource, the largest share of the step any rank kept it busy: the CPU
    optimizer (this rank's parameters stepped over its in-step rate) and the H2D link (the
    rank's H2D bytes over the rate every GPU reached while all copied at once)."""
    out = {}
    opt = [
        x["optimizer_params_per_step"] / x["optimizer_params_per_s"]
        for x in r["ranks"]
        if x.get("optimizer_params_per_s")
    ]
    if opt:
        out["CPU optimizer"] = max(opt) / r["step_s"]
    if link_bytes_per_s:
        h2d = max(x["h2d_bytes_per_step"] or 0 for x in r["ranks"])
        out["H2D link"] = h2d / link_bytes_per_s / r["step_s"]
    return out


def _report(paths: list[str]) -> None:
    rows = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line]
    floors = next((r for r in rows if r.get("kind") == "floors"), None)
    rows = [r for r in rows if r.get("kind", "train") == "train"]

    def key(r):
        return (
            r["batch_per_gpu"],
            r["seq"],
            r["gpu_memory"],
            r.get("host_precision"),
            r.get("checkpoint"),
            r.get("meta"),
        )

    # one GPU has no other rank to refresh: its rows are every refresh's baseline (the one
    # with the same --device-optimizer where there is one)
    base = {key(r): r["tokens_per_s"] for r in rows if r["gpus"] == 1}
    same = {(key(r), _device_optimizer(r)): r["tokens_per_s"] for r in rows if r["gpus"] == 1}
    link = None
    if floors:
        link = min(x["together"]["h2d_pieces"] or 0 for x in floors["ranks"]) or None
    print(
        "| GPUs | host formats | refresh | device optimizer | tokens per GPU | ramflow budget | "
        "step | tokens/s | vs one GPU | peak GPU | host memory in use | CPU optimizer busy | "
        "H2D link busy |"
    )
    print("| --- " * 13 + "|")
    for r in rows:
        one = same.get((key(r), _device_optimizer(r)), base.get(key(r)))
        ratio = f"{r['tokens_per_s'] / one:.2f}x" if one else "-"
        peaks = [x["peak_bytes"] for x in r["ranks"] if x["peak_bytes"] is not None]
        peak = f"{max(peaks) / 2**30:.1f} GiB" if peaks else "-"
        busy = _busy(r, link)
        host = (
            f"{(r['host_in_use_after_offload'] - r['host_in_use_before']) / 2**30:.1f} GiB "
            f"(peak {(r['host_in_use_peak'] - r['host_in_use_before']) / 2**30:.1f})"
        )
        print(
            f"| {r['gpus']} | {r.get('host_precision') or 'fp32'} | {r.get('refresh', 'host')} | "
            f"{_device_optimizer_cell(r)} | {r['batch_per_gpu']}x{r['seq']} | {r['gpu_memory'] or 'no cap'} | "
            f"{r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} | {ratio} | {peak} | {host} | "
            + " | ".join(
                f"{busy[k]:.0%}" if k in busy else "-" for k in ("CPU optimizer", "H2D link")
            )
            + " |"
        )
    print(
        f"\n{rows[0]['date']}, {rows[0]['device']}; step = median of the slowest rank. Host "
        "memory in use: the system's (total - available), above what it was before the model was "
        "built, after offload (peak while training). Busy: the largest share of the step "
        "that any rank kept the resource working. Device optimizer: --device-optimizer "
        "(units stepped on the GPUs, all ranks, of the resident units)."
    )
    _report_sync(rows)
    if floors:
        alone = floors["alone"] or {}
        together = [x["together"] for x in floors["ranks"]]
        print(
            f"Floors: host memory copy {floors['dram_copy_bytes_per_s'] / 1e9:.0f} GB/s "
            f"({floors['cores']} cores, {floors['numa_nodes']} NUMA node(s)); pinned H2D "
            f"{(alone.get('h2d_pieces') or 0) / 1e9:.1f} GB/s one GPU alone, "
            f"{sum(t['h2d_pieces'] or 0 for t in together) / 1e9:.1f} GB/s summed over "
            f"{len(together)} GPUs at once "
            f"(D2H {sum(t['d2h_pieces'] or 0 for t in together) / 1e9:.1f}); "
            f"bf16 matmul {min(x['matmul_flops'] or 0 for x in floors['ranks']) / 1e12:.0f} "
            "TFLOP/s on the slowest GPU."
        )


SYNC_PHASES = ("broadcasts issued", "write-backs", "barrier", "broadcasts ended")


def _report_sync(rows: list[dict]) -> None:
    """Where a multi-GPU step's extra time goes, per row of several GPUs: the largest per
    step over the ranks of the time the passes waited for units (on the step's path) and of
    each phase of the worker's sync after ``opt.step()`` (beside the next forward)."""
    rows = [r for r in rows if r["gpus"] > 1 and any("sync_s" in x for x in r["ranks"])]
    if not rows:
        return
    print(
        "\n| GPUs | host formats | device optimizer | step stream | tokens per GPU | step | "
        "passes wait for units | sync: " + " | ".join(SYNC_PHASES) + " |"
    )
    print("| --- " * (7 + len(SYNC_PHASES)) + "|")

    def worst(r: dict, get) -> str:
        values = [v for x in r["ranks"] if (v := get(x)) is not None]
        return f"{max(values) * 1e3:.1f} ms" if values else "-"

    for r in rows:
        cells = [worst(r, lambda x: x.get("unit_wait_s"))]
        cells += [worst(r, lambda x, p=p: (x.get("sync_s") or {}).get(p)) for p in SYNC_PHASES]
        print(
            f"| {r['gpus']} | {r.get('host_precision') or 'fp32'} | {_device_optimizer_cell(r)} "
            f"| {'on' if r.get('device_step_stream', '1') != '0' else 'off'} "
            f"| {r['batch_per_gpu']}x{r['seq']} | {r['step_s'] * 1e3:.0f} ms | "
            + " | ".join(cells)
            + " |"
        )
    print(
        "\nPer step, the largest over the ranks. Passes wait for units: the forward and "
        "backward's host waits for units not current (another rank's step, its broadcast), "
        "on the step's path. Step stream: device steps after a reduction on a stream of "
        "their own (RAMFLOW_DEVICE_STEP_STREAM). Sync: the worker's phases after opt.step(), "
        "beside the next "
        "forward (see [Note: the step's sync] in src/ramflow/distributed/zero.py): issuing the "
        "broadcasts, waiting for this rank's write-backs, the barrier, the rest until every "
        "broadcast ended."
    )


# --device-optimizer: offload's device_optimizer
DEVICE_OPTIMIZER = {"auto": None, "on": True, "off": False}


def _device_optimizer(r: dict) -> str:
    return r.get("device_optimizer", "auto")  # rows from before the option: offload's default


def _device_optimizer_cell(r: dict) -> str:
    stepped = [x.get("device_stepped_units") for x in r["ranks"]]
    if None in stepped:
        return _device_optimizer(r)
    return f"{_device_optimizer(r)} ({sum(stepped)}/{r['resident_units']})"


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
    parser.add_argument(
        "--host-precision", default="fp32", help="ramflow host formats (fp32, lean, ...)"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="the model recomputes each block in backward"
    )
    parser.add_argument(
        "--loss-chunk", type=int, default=0, help="head and loss in chunks of this many tokens"
    )
    parser.add_argument(
        "--device-optimizer",
        choices=tuple(DEVICE_OPTIMIZER),
        default="auto",
        help="offload's device_optimizer: auto (None: its own choice), on (True), off (False)",
    )
    parser.add_argument("--floors", action="store_true", help="measure the shared floors only")
    parser.add_argument(
        "--meta",
        action="store_true",
        help="build on the meta device and fill the host store through weights= (no rank "
        "holds a full model: the host memory in use is the store's)",
    )
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke test)")
    parser.add_argument("--out", default="multi_gpu.jsonl")
    parser.add_argument("--report", nargs="+", metavar="JSONL", help="print the table and exit")
    args = parser.parse_args()
    if args.report:
        _report(args.report)
    elif args.floors:
        _floors(args)
    else:
        _run(args)


if __name__ == "__main__":
    main()
