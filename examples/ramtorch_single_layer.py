"""One ``Linear`` whose weights stay in CPU RAM, used where an ``nn.Linear`` would be.

RamTorch's first example, on ramflow: only the import line differs from a RamTorch script
(``from ramtorch import ...`` becomes ``from ramflow.compat.ramtorch import ...``).

    python examples/ramtorch_single_layer.py                   # GPU if there is one, else CPU
    python examples/ramtorch_single_layer.py --features 4096 --device cuda

The layer holds fp32 master weights on the host and copies them to ``--device`` for every
call; gradients come back to ``weight.grad`` on the host, where the optimizer steps them.
The script first checks that the layer computes what ``nn.Linear`` computes with the same
weights, then takes a few AdamW steps towards a fixed random linear map.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ramflow.compat.ramtorch import AdamW, Linear


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=int, default=256, help="in and out features")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the layer computes (its weights stay in CPU RAM either way)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    layer = Linear(args.features, args.features, device=device)

    # the same computation as a resident nn.Linear with the same weights
    plain = torch.nn.Linear(args.features, args.features, device=device)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.copy_(layer.bias)
    x = torch.randn(args.batch, args.features, device=device)
    y = layer(x)
    print(f"output {tuple(y.shape)} on {y.device}; weight stays on {layer.weight.device}")
    difference = (y - plain(x)).abs().max().item()
    print(f"max |ramflow Linear - nn.Linear| = {difference:.3g}")

    # a few training steps: fit a fixed random linear map
    target_map = torch.randn(args.features, args.features, device=device) / args.features**0.5
    optimizer = AdamW(layer.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.features, device=device)
        loss = F.mse_loss(layer(x), x @ target_map.T)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
