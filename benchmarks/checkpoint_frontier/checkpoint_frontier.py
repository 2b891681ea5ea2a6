"""Step time against activation memory of the resident reference model, per checkpointing.

Issue 14's point 6 asks ramflow's step at 4x2048 tokens under 12 GiB to be at most 1.15x
the plain resident step; the step that checkpoints every block is 1.22x. This measures what
each block left un-checkpointed (or a selective policy) saves in time and costs in memory,
on the resident model, so that the ramflow run's free memory can be set against it.

Everything on the GPU as in the benchmark's resident cases (fp32 weights, bf16 autocast,
fused AdamW); the chunked loss of the checkpointed cases; the policies of
``ramflow.memory`` installed with ``apply_checkpointing`` on the one model, in turn.
Per variant: the median step of ``--steps`` timed steps, the peak allocated bytes over
them, and the activations at their peak (that peak minus what is allocated between steps:
weights, their gradients' buffers, optimizer states).

    python benchmarks/checkpoint_frontier/checkpoint_frontier.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402

from ramflow.memory import (  # noqa: E402
    CheckpointAll,
    CheckpointPlan,
    SelectiveCheckpoint,
    apply_checkpointing,
)
from reference_model import REFERENCE, TINY, build_reference  # noqa: E402

SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


class FirstBlocks:
    """Checkpoint the first ``n`` blocks (a policy for ``apply_checkpointing``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def resolve(self, model, blocks) -> CheckpointPlan:
        return CheckpointPlan(blocks=tuple(name for name, _ in blocks[: self.n]))


def _variants(num_layers: int) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("every block", CheckpointAll())]
    for n in (3 * num_layers // 4, num_layers // 2, num_layers // 4, 0):
        out.append((f"first {n} of {num_layers} blocks", FirstBlocks(n) if n else None))
    out.append(("selective: save SDPA outputs", SelectiveCheckpoint(save_ops=SDPA_OPS)))
    out.append(("selective: save matmuls and SDPA", SelectiveCheckpoint()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = (TINY if args.tiny else REFERENCE).replace(loss_chunk_tokens=args.loss_chunk_tokens)
    model = build_reference(cfg, device=device, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=gen)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows = []
    for name, policy in _variants(cfg.num_layers):
        handle = apply_checkpointing(model, policy) if policy is not None else None
        for _ in range(args.warmup):
            step()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        between = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else 0  # the CPU: no count
        rows.append(
            {
                "variant": name,
                "checkpointed_blocks": len(handle.plan.blocks) if handle else 0,
                "step_s": statistics.median(times),
                "step_times_s": times,
                "peak_bytes": peak,
                "between_steps_bytes": between,
                "activation_peak_bytes": peak - between,
            }
        )
        print(
            f"{name:36s} {1e3 * rows[-1]['step_s']:7.1f} ms  activations at peak "
            f"{rows[-1]['activation_peak_bytes'] / 2**30:6.2f} GiB",
            flush=True,
        )
        if handle is not None:
            handle.undo()
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "loss_chunk_tokens": args.loss_chunk_tokens,
        "model": "reference",
        "num_params": sum(t.numel() for t in model.parameters()),
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
