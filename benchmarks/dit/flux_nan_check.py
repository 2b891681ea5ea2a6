"""Which setting makes a tiny Flux go NaN on CUDA: resident or offloaded, accelerate or not,
autocast, wire dtype, checkpointing, cuDNN attention. One line per run: the losses of 4
rectified-flow steps (``tests/diffusion_models.py``'s tiny Flux with Flux-dev's guidance
embed, lr 1e-4) and the parameters that are not finite at the end; a resident run also
names the parameters whose gradients were not finite at each step.

GPU box (seconds per run; ``benchmarks/results/2026-11-27-nvidia-h100-dit-flux-fault/``
ran the list in its ``call4.sh``):

    python3 benchmarks/dit/flux_nan_check.py --mode resident --accel 0
    python3 benchmarks/dit/flux_nan_check.py --mode offload --no-cudnn-sdp

``DEV=cpu`` runs it on the CPU (no NaN there: a smoke test).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

import torch  # noqa: E402

import ramflow  # noqa: E402
from diffusion_models import flow_batch, flow_loss, tiny_flux  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="offload", choices=("offload", "resident"))
    p.add_argument("--ckpt", type=int, default=1, help="activation checkpointing (0 or 1)")
    p.add_argument("--autocast", type=int, default=1, help="bf16 autocast (0 or 1)")
    p.add_argument("--wire", default="bf16", choices=("bf16", "fp32"), help="ramflow's wire")
    p.add_argument("--accel", type=int, default=1, help="through accelerate (0 or 1)")
    p.add_argument("--gpu-memory", default=None, help="ramflow's gpu_memory")
    p.add_argument("--no-cudnn-sdp", action="store_true", help="turn cuDNN attention off")
    a = p.parse_args()
    dev = torch.device(os.environ.get("DEV", "cuda"))
    if a.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    model = tiny_flux(guidance=True)
    if a.mode == "resident":
        model = model.to(dev)
        if a.ckpt:
            model.enable_gradient_checkpointing()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model = ramflow.offload(
            model,
            device=dev,
            gpu_memory=a.gpu_memory,
            wire_dtype=torch.bfloat16 if a.wire == "bf16" else torch.float32,
            activation_checkpointing=bool(a.ckpt),
        )
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-4)
    backward = torch.Tensor.backward
    if a.accel:
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision="bf16" if a.autocast else "no")
        model, opt = acc.prepare(model, opt)
        backward = acc.backward
    losses = []
    for step in range(4):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bool(a.autocast)):
            loss = flow_loss(model, flow_batch(step), dev)
        backward(loss)
        if a.mode == "resident":
            bad = [
                n
                for n, q in model.named_parameters()
                if q.grad is not None and not torch.isfinite(q.grad).all()
            ]
            if bad:
                print("  nonfinite grads at step", step, bad[:4])
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    if a.mode != "resident":
        ramflow.synchronize(model)
    bad = [n for n, q in model.named_parameters() if not torch.isfinite(q.detach().float()).all()]
    print(f"{' '.join(sys.argv[1:]) or 'default'}: losses {losses} nonfinite params {bad[:5]}")


if __name__ == "__main__":
    main()
