"""Loading once per host: the time and host memory of building a preset on N ranks.

Every rank builds the preset on the meta device and offloads it with ``zero_stage`` and
the preset's seeded init (``SeededInit``) as ``weights=``, so each rank draws the units it
owns into the host's one shared copy (see [Note: loading once per host] in
``ramflow.distributed.zero``). A thread samples the host's memory in use every 20 ms; rank 0 prints
one JSON line: the load time (from the first rank's start to the last rank's end), the
peak memory in use over the baseline before loading, the store's bytes, and the excess
per rank (what ramflow promises stays under 4 GiB).

"In use" is total minus available memory (psutil 7's ``used``; older psutil computed
``used`` without the page cache, and the store's files in /dev/shm are page cache that
cannot be dropped, so it is computed here from ``total`` and ``available``, which count
them). The page cache of files read (safetensors) is available and not counted. The host
must be otherwise idle for the numbers to mean anything.

    torchrun --nproc-per-node 4 benchmarks/load_once/load_once.py --preset llama-70b
    torchrun --nproc-per-node 2 benchmarks/load_once/load_once.py --preset llama-1b \
        --host-precision fp32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path[:0] = [str(BENCH.parent / "src")]

GiB = 2**30


class MemorySampler:
    """The peak of the host's memory in use (total minus available) while it runs,
    sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total - vm.available

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> MemorySampler:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-70b")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--host-precision", default="lean")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=128256, help="for presets without one")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import ramflow
    from ramflow.train.initialization import SeededInit
    from ramflow.train.modeling import count_parameters, meta_model
    from ramflow.train.presets import get_preset

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = dist.new_group(backend="gloo")
    preset = get_preset(args.preset)
    config = preset.to_config(vocab_size=None if preset.vocab_size else args.vocab_size)

    dist.barrier(group=cpu)
    in_use0 = MemorySampler.now()
    with MemorySampler() as memory:
        start = time.time()
        model = meta_model(config)
        init = SeededInit(model, seed=args.seed)
        ramflow.offload(
            model,
            zero_stage=args.zero_stage,
            weights=init,
            host_precision=args.host_precision,
            wire_dtype=torch.bfloat16 if cuda else None,
        )
        end = time.time()
        dist.barrier(group=cpu)
    times = [None] * world
    dist.all_gather_object(times, (start, end), group=cpu)
    peaks = [None] * world
    dist.all_gather_object(peaks, memory.peak, group=cpu)

    engine = model._ramflow_engine
    store = sum(
        u.master.nbytes + (u.wire.nbytes if u.wire is not u.master else 0) for u in engine.units
    )
    plan = ramflow.get_plan(model)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    peak_in_use = max(peaks)
    excess = peak_in_use - in_use0 - store
    if rank == 0:
        row = {
            "benchmark": "load_once",
            "preset": args.preset,
            "parameters": count_parameters(model),
            "ranks": world,
            "local_ranks": local,
            "zero_stage": args.zero_stage,
            "host_precision": plan.host_precision,
            "threads_per_rank": init.num_threads,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "load_s": round(max(t[1] for t in times) - min(t[0] for t in times), 2),
            "store_gib": round(store / GiB, 2),
            "plan_host_gib": None if plan.host_bytes is None else round(plan.host_bytes / GiB, 2),
            "baseline_in_use_gib": round(in_use0 / GiB, 2),
            "peak_in_use_gib": round(peak_in_use / GiB, 2),
            "peak_over_baseline_gib": round((peak_in_use - in_use0) / GiB, 2),
            "excess_per_rank_gib": round(excess / local / GiB, 2),
            "within_4gib_per_rank": excess <= 4 * GiB * local,
        }
        line = json.dumps(row)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
