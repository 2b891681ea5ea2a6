"""MXFP4 frozen experts (issue 47, point 5's gpt-oss-120b LoRA run): what one layer's experts
cost per load, for ``--frozen-format mxfp4``.

One gpt-oss-120b layer's experts (``--experts`` 128 of gate-up H x 2I and down I x H, H =
I = 2880) kept as a gpt-oss checkpoint ships them (blocks along dimension -2), timed:

- ``repack_s``: moving the checkpoint's codes and scales into the store's order on the CPU
  (``mxfp4.from_checkpoint_layout``, once per weight at load; x 36 layers for the model);
- ``h2d_s``: the packed bytes from pinned host memory to the GPU (one load's PCIe time);
- ``dequant_triton_s`` and ``dequant_ops_s``: the store's dequantize into bf16 on the
  device, as one Triton kernel and as PyTorch ops (``RAMFLOW_DISABLE_TRITON=1``), with the
  bytes each moves.

Writes ``mxfp4_dequant.json`` under ``--out`` and prints it. GPU box::

    python benchmarks/moe/mxfp4_dequant.py --out benchmarks/results/<dated dir>

CPU smoke (tiny sizes, seconds)::

    python benchmarks/moe/mxfp4_dequant.py --experts 2 --hidden 64 --device cpu --out /tmp/mx
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from ramflow.formats.frozen import FrozenStore


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880, help="H = I, a multiple of 32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    e, h = args.experts, args.hidden
    shapes = [(e, h, 2 * h), (e, h, h)]  # gate_up (E, H, 2I), down (E, I, H)
    g = torch.Generator().manual_seed(0)
    checkpoint = [
        (
            torch.randint(0, 256, (e, c, r // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(118, 123, (e, c, r // 32), generator=g, dtype=torch.uint8),
        )
        for _, r, c in shapes
    ]
    params = [nn.Parameter(torch.empty(s, device="meta"), requires_grad=False) for s in shapes]
    numels = [-(-p.numel() // 256) * 256 for p in params]
    pin = device.type == "cuda"
    store = FrozenStore(
        "mxfp4",
        params,
        numels,
        wire_dtype=torch.bfloat16,
        alloc=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pin),
    )
    start = time.perf_counter()
    for i, (blocks, scales) in enumerate(checkpoint):
        store.write_mxfp4(i, blocks, scales)
    repack_s = time.perf_counter() - start

    staging = store.host.to(device)
    out = torch.empty(sum(numels), dtype=torch.bfloat16, device=device)
    h2d_s = _timed(lambda: staging.copy_(store.host, non_blocking=True), device, args.repeats)
    dequant = lambda: store.dequantize(staging, out)  # noqa: E731
    triton_s = _timed(dequant, device, args.repeats) if device.type == "cuda" else None
    os.environ["RAMFLOW_DISABLE_TRITON"] = "1"
    ops_s = _timed(dequant, device, args.repeats)
    weights = sum(p.numel() for p in params)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "experts": e,
        "hidden": h,
        "weights": weights,
        "packed_bytes": store.nbytes,
        "bits_per_weight": 8 * store.nbytes / weights,
        "repack_s": repack_s,
        "repack_gb_per_s": store.nbytes / repack_s / 1e9,
        "h2d_s": h2d_s,
        "h2d_gb_per_s": store.nbytes / h2d_s / 1e9,
        "dequant_triton_s": triton_s,
        "dequant_ops_s": ops_s,
        # bytes read (codes and scales) and written (bf16) by one dequantize
        "dequant_bytes": store.nbytes + 2 * weights,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mxfp4_dequant.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
