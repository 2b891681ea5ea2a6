"""Where memory goes, and training inside a budget, with ``ramflow.memory`` on a plain model.

    python examples/memory_toolkit.py                      # small, seconds on a CPU
    python examples/memory_toolkit.py --device cuda --dim 1024 --depth 12 --batch 64

1. ``activation_report``: the bytes each block saves for backward, measured.
2. ``CheckpointToBudget``: checkpoint the fewest blocks that bring those under a budget
   (half of what the model saves by default), with the report showing the result.
3. Gradient accumulation: a batch as ``--micro-batches`` micro-batches, each loss scaled by
   1/n so that the summed gradients are the full batch's mean gradient (checked below);
   activations exist for one micro-batch at a time. No wrapper class: it is a loop.
4. ``MemoryTracker``: labelled readings over one training step, printed as a table and,
   with ``--timeline``, drawn as a PNG.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from ramflow.memory import (
    CheckpointToBudget,
    MemoryTracker,
    activation_report,
    apply_checkpointing,
    plot_timeline,
)


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="samples per optimizer step")
    parser.add_argument("--micro-batches", type=int, default=4, help="gradient accumulation")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeline", default=None, help="write the step's timeline PNG here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.batch % args.micro_batches:
        parser.error("--batch must be a multiple of --micro-batches")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = Model(args.dim, args.depth).to(device)
    teacher = Model(args.dim, 2).to(device).requires_grad_(False)
    micro = args.batch // args.micro_batches
    x = torch.randn(args.batch, 16, args.dim, device=device)  # (B, T, D)
    y = teacher(x)

    # 1. what each block saves for backward, for one micro-batch
    report = activation_report(model, x[:micro], loss_fn=lambda out: F.mse_loss(out, y[:micro]))
    print(f"saved for backward per micro-batch: {report.total_saved_bytes} bytes")
    per_block = [report[f"blocks.{i}"].saved_bytes for i in range(args.depth)]
    print(f"  per block (bytes): {per_block}")

    # 2. checkpoint the fewest blocks that halve it
    budget = report.total_saved_bytes // 2
    handle = apply_checkpointing(model, CheckpointToBudget(budget, report=report))
    after = activation_report(model, x[:micro], loss_fn=lambda out: F.mse_loss(out, y[:micro]))
    print(
        f"checkpointed {len(handle.plan.blocks)} of {args.depth} blocks "
        f"({', '.join(handle.plan.blocks)}): {after.total_saved_bytes} bytes saved, "
        f"budget {budget}"
    )

    # 3. gradient accumulation: n micro-batches, each loss scaled by 1/n
    def accumulate() -> float:
        total = 0.0
        for x_mb, y_mb in zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches)):
            loss = F.mse_loss(model(x_mb), y_mb) / args.micro_batches
            loss.backward()  # gradients add up in .grad
            total += loss.item()
        return total

    accumulate()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()  # the whole batch at once, for the check
    worst = max((a - p.grad).abs().max().item() for a, p in zip(accumulated, model.parameters()))
    print(f"max |accumulated - full-batch gradient| = {worst:.3g}")
    model.zero_grad(set_to_none=True)

    # 4. train, tracking one step
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        if step == min(1, args.steps - 1):  # after the first step the optimizer states exist
            with MemoryTracker(device=device) as tracker:
                loss = accumulate()
                tracker.snapshot("forward + backward")
                opt.step()
                tracker.snapshot("optimizer step")
                opt.zero_grad(set_to_none=True)
                tracker.snapshot("zero_grad")
        else:
            loss = accumulate()
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(f"step {step + 1}/{args.steps}  loss {loss:.6f}")
    print(tracker.summary())
    if args.timeline:
        print(f"timeline: {plot_timeline(tracker.records, args.timeline)}")
    handle.undo()


if __name__ == "__main__":
    main()
