"""Where the GPU time of a LoRA step on a compressed, streamed Llama shape goes (issue 16,
point 5b): one step under ``torch.profiler``, its kernels summed by kind (matmuls,
attention, the dequantize, the LoRA branches' small matmuls, elementwise and reductions,
copies), the share of the wall the GPU computed, and the step's time with each of the
variants given.

Variants (``--variants``, run in the order given on one model, each on top of the ones
before it):

* ``stock``: the model as Hugging Face and PEFT build it;
* ``rms``: ``LlamaRMSNorm`` as ``torch.nn.functional.rms_norm`` (one fused kernel each way);
* ``lora``: PEFT's LoRA layers fused (``ramflow.helpers.fuse_lora``);
* ``liger``: Liger Kernel's RMSNorm, SwiGLU and RoPE (``apply_liger_kernel_to_llama``),
  with ``lora``.

    python benchmarks/lora_70b/lora_step_profile.py --layers 8 --batch 4 --out-dir DIR

``--smoke`` runs the tiny shape on the CPU without the profiler (tested in CI).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ramflow  # noqa: E402
from lora_70b import SHAPES, apply_variant, build, make_lora_step, sync  # noqa: E402
from measure import matmul_rate  # noqa: E402

KINDS = [
    ("dequantize", ("dequantize",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitk")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton", "cat", "index")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def profile_step(step, out_dir: Path, name: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    path = out_dir / f"trace-{name}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()  # hundreds of MB; the summary below is what is kept
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_kind[kind_of(e["name"])] = by_kind.get(kind_of(e["name"]), 0.0) + e["dur"]
        row = by_name.setdefault(e["name"][:120], [0, 0.0])
        row[0] += 1
        row[1] += e["dur"]
    # matmuls with a small dimension (the LoRA branches): shapes are not in kernel names,
    # so they are told by their short duration
    small = sum(e["dur"] for e in kernels if kind_of(e["name"]) == "matmul" and e["dur"] < 60)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {
        "wall_s_profiled": wall,
        "kernel_us_by_kind": {
            k: round(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "matmul_us_under_60us_each": round(small),
        "kernels_busy_us": round(union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])),
        "h2d_us": round(sum(e["dur"] for e in copies if "HtoD" in e["name"])),
        "top_kernels": [{"name": n, "count": c, "us": round(us)} for n, (c, us) in top],
    }


def patch_rms_norm() -> None:
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        normed = F.rms_norm(
            hidden_states.float(), (hidden_states.shape[-1],), eps=self.variance_epsilon
        )
        return self.weight * normed.to(dtype)

    modeling_llama.LlamaRMSNorm.forward = forward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-70b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--frozen-format", default="int8")
    p.add_argument("--gpu-memory", default="16GiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--variants", default="stock,lora,rms,liger")
    p.add_argument("--profile", default="stock,liger", help="variants to profile, comma-separated")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, no profile")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda"
    if args.smoke:
        args.shape, args.layers, args.batch, args.seq_len, args.repeat = "tiny", None, 2, 32, 1
        args.gpu_memory, args.variants, args.profile, device = None, "stock,lora,rms", "", "cpu"
    cuda = device == "cuda"
    flops = matmul_rate(torch.device(device))
    model, load_s = build(args.shape, device=device, gpu_memory=args.gpu_memory,
                          frozen_format=args.frozen_format, lora_rank=16, layers=args.layers)  # fmt: skip
    num_params = sum(p.numel() for p in model.parameters())
    model.train()
    opt = ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, SHAPES[args.shape][5], (args.batch, args.seq_len), device=device)
    step = make_lora_step(model, opt, ids, device)
    result: dict[str, Any] = {
        "meta": {"shape": args.shape, "layers": args.layers, "batch": args.batch,
                 "seq_len": args.seq_len, "frozen_format": args.frozen_format,
                 "parameters": num_params, "load_s": load_s,
                 "matmul_tflops": flops and flops / 1e12,
                 "device": torch.cuda.get_device_name() if cuda else "cpu"},
        "variants": {},
    }  # fmt: skip
    tokens = args.batch * args.seq_len
    for variant in args.variants.split(","):
        if variant == "rms":
            patch_rms_norm()
        elif variant == "lora":
            ramflow.helpers.fuse_lora(model)
        elif variant == "liger":
            apply_variant(model, "liger")  # lora_70b's: fuse_lora (kept) and Liger Kernel
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step()
        runs = []
        losses = []
        for _ in range(args.repeat):
            sync(device)
            t0 = time.perf_counter()
            losses.append(float(step()))
            sync(device)
            runs.append(time.perf_counter() - t0)
        t = sorted(runs)[len(runs) // 2]
        row: dict[str, Any] = {
            "step_s": t,
            "runs_s": runs,
            "losses": losses,
            "x_matmul_4PT": flops and 4 * num_params * tokens / t / flops,
            "x_matmul_6PT": flops and 6 * num_params * tokens / t / flops,
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        if cuda and variant in args.profile.split(","):
            row["profile"] = profile_step(step, args.out_dir, variant)
        result["variants"][variant] = row
        print(variant, json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        (args.out_dir / "lora_step_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
