"""``ramflow train --checkpointing auto`` after a real out-of-memory error at a micro-batch of
1 (issue 32, point 4): the run goes to activation offload and finishes.

The plan sizes the run to the GPU's free memory; ``--cap-gib`` then lets PyTorch's caching
allocator hold only that much (``torch.cuda.set_per_process_memory_fraction``), as if the
plan's estimate were that far off. With the llama-8b preset at 131072 tokens the plan
chooses checkpointing alone (about 61 GiB of activations predicted); under a cap of 60 GiB
its first step runs out of memory for real, the trainer switches the model to activation
offload (the layers' inputs, 32 GiB, in pinned host memory) and runs the step again (see
[Note: a heavier checkpointing after an out-of-memory error] in
``ramflow/train/backoff.py``). Without ``--cap-gib`` it is the plain CLI run (which may or
may not run out of memory).

Writes ``<out-dir>/oom_offload.json`` (the switch events, losses, step times, peak GPU
memory, the checkpointing the run ended with) and ``<out-dir>/oom_offload.txt`` (the
console), and the run folder ``<out-dir>/run``. ``--device cpu --preset tiny --seq-len 32``
is the smoke test (no cap on the CPU).

    python benchmarks/long_context/oom_offload.py --out-dir out/oom-offload --cap-gib 60
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--preset", default="llama-8b")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--cap-gib", type=float, default=None, help="what the caching allocator may hold (GiB)"
    )
    args = p.parse_args(argv)

    from ramflow.cli.main import default_allocator_settings

    default_allocator_settings(os.environ)  # as `ramflow train`: before CUDA starts
    import torch

    from ramflow.train import TrainConfig, train
    from ramflow.train.report import read_log

    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.cap_gib is not None:
        if args.device == "cpu":
            raise SystemExit("--cap-gib caps the CUDA caching allocator; leave it out on the CPU")
        device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    config = TrainConfig.from_options(
        preset=args.preset,
        seq_len=args.seq_len,
        batch_size=1,
        steps=args.steps,
        checkpointing="auto",
        eval_every=0,
        eval_batches=1,
        keep_checkpoints=0,
        device=args.device,
        seed=0,
    )
    console = io.StringIO()
    error = None
    with contextlib.redirect_stdout(console):
        try:
            result = train(config, out=args.out_dir / "run", progress=False, handle_sigint=False)
        except Exception as err:  # noqa: BLE001 - recorded in the results
            result, error = None, f"{type(err).__name__}: {err}"
    text = console.getvalue() + (f"\nerror: {error}\n" if error else "")
    (args.out_dir / "oom_offload.txt").write_text(text)
    sys.stdout.write(text)
    log_path = args.out_dir / "run" / "log.jsonl"
    records = read_log(log_path) if log_path.exists() else []
    events = [r for r in records if r["event"].startswith(("checkpointing_", "oom_backoff"))]
    steps = [r for r in records if r["event"] == "step"]
    run_json = args.out_dir / "run" / "run.json"
    info = json.loads(run_json.read_text()) if run_json.exists() else {}
    results = {
        "argv": sys.argv[1:],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cap_gib": args.cap_gib,
        "error": error,
        "switch_events": events,
        "checkpointing_planned": info.get("checkpointing_planned"),
        "checkpointing_mode": info.get("checkpointing_mode"),
        "steps": [
            {k: r[k] for k in ("step", "loss", "step_s", "micro_batch", "peak_gpu_bytes")}
            for r in steps
        ],
        "steps_done": None if result is None else result.steps_done,
        "peak_gpu_gib": None if result is None or result.peak_gpu_bytes is None
        else result.peak_gpu_bytes / 2**30,
    }  # fmt: skip
    (args.out_dir / "oom_offload.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
