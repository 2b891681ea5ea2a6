"""A model built from ``Linear`` layers (``nn.Sequential`` with ReLU), trained for a few steps.

RamTorch's "building models" example, on ramflow: the layers are ``Linear`` from
``ramflow.compat.ramtorch`` (RamTorch's import line changed), everything else is PyTorch.

    python examples/ramtorch_model.py                           # small, seconds on a CPU
    python examples/ramtorch_model.py --width 4096 --depth 8 --device cuda --bf16

Each layer's weights live in CPU RAM; a forward streams them to the device layer by layer,
prefetching the layers that came next in the previous forward, and the optimizer steps the
host copies. The task is a fixed random teacher network, so the loss must go down.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from ramflow.compat.ramtorch import AdamW, Linear


class OffloadedMLP(nn.Module):
    """``depth`` ``Linear`` layers with ReLU between them; only ``Linear`` is not PyTorch's."""

    def __init__(self, dim_in: int, width: int, depth: int, dim_out: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [Linear(dim_in, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [Linear(width, width), nn.ReLU()]
        layers.append(Linear(width, dim_out))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim-in", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4, help="number of Linear layers (>= 2)")
    parser.add_argument("--dim-out", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--bf16", action="store_true", help="bfloat16 autocast (CUDA); masters stay fp32"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.depth < 2:
        parser.error("--depth must be at least 2")
    return args


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    model = OffloadedMLP(args.dim_in, args.width, args.depth, args.dim_out)
    model.to(device)  # picks the compute device; the weights stay in CPU RAM
    teacher = nn.Sequential(
        nn.Linear(args.dim_in, args.width), nn.Tanh(), nn.Linear(args.width, args.dim_out)
    ).to(device)
    optimizer = AdamW(model.parameters(), lr=args.lr)
    print(
        f"{sum(p.numel() for p in model.parameters()):,} parameters in "
        f"{args.depth} Linear layers, computing on {device}"
    )

    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.dim_in, device=device)
        with torch.no_grad():
            target = teacher(x)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            prediction = model(x)
        loss = F.mse_loss(prediction.float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
