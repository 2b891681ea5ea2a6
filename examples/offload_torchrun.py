"""Several GPUs with ``ramflow.offload(model, zero_stage=...)``, launched by ``torchrun``.

ramflow's own multi-GPU path: every rank builds the same model and offloads it whole; the
ranks of one host share one host copy of the weights (in shared memory), each unit is
stepped by one rank (ZeRO-1: its optimizer states live there; ZeRO-2: its gradients too),
gradients are averaged over the ranks, and the loop is the single-process loop with a
``DistributedSampler``.

    torchrun --nproc-per-node 2 examples/offload_torchrun.py                 # NCCL on 2 GPUs
    torchrun --nproc-per-node 2 examples/offload_torchrun.py --backend gloo  # 2 CPU processes
    python examples/offload_torchrun.py                                       # one process

Run without ``torchrun`` it starts a world of one process (the same global batches), which
is the reference that the multi-process runs agree with to fp32 rounding.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ramflow


class Block(nn.Module):
    """A pre-norm residual MLP block: one offloaded unit (one DMA per block and step)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, dim_in: int, dim: int, depth: int, dim_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim_in, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_dataset(args: argparse.Namespace) -> TensorDataset:
    """A seeded synthetic regression set, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.samples, args.dim_in, generator=g)
    w = torch.randn(args.dim_in, args.dim_out, generator=g) / args.dim_in**0.5
    return TensorDataset(x, torch.sin(x @ w))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        help="default: nccl when there is a GPU per local rank, else gloo (on the CPU)",
    )
    parser.add_argument("--zero", type=int, choices=[1, 2], default=2, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step, all ranks")
    parser.add_argument("--samples", type=int, default=64, help="dataset size (one epoch)")
    parser.add_argument("--dim-in", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3, help="residual blocks")
    parser.add_argument("--dim-out", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--gpu-memory", help="cap on ramflow's GPU memory per rank, e.g. 12GiB")
    parser.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16"],
        help="weights on the wire: default bfloat16 on GPUs, float32 on the CPU",
    )
    parser.add_argument("--threads", type=int, help="torch threads per process (cores / ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="rank 0 saves the losses and final state_dict here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # started without torchrun: a world of one process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = args.backend or ("nccl" if torch.cuda.device_count() >= local_world else "gloo")
    if args.global_batch % world_size or args.samples % args.global_batch:
        raise SystemExit("--global-batch must divide by the world size, --samples by it")
    # torchrun sets OMP_NUM_THREADS=1; the host optimizer is faster with cores / local ranks
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))

    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))

    # the same model on every rank (rank 0's weights become the shared host copy)
    torch.manual_seed(args.seed)
    model = ResidualMLP(args.dim_in, args.dim, args.depth, args.dim_out)
    wire = None if args.wire_dtype is None else getattr(torch, args.wire_dtype)
    ramflow.offload(
        model, device=device, zero_stage=args.zero, gpu_memory=args.gpu_memory, wire_dtype=wire
    )
    optimizer = ramflow.optim.AdamW(model.parameters(), lr=args.lr)

    dataset = make_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.global_batch // world_size, sampler=sampler)
    if rank == 0:
        print(
            f"{world_size} ranks, backend {backend}, ZeRO-{args.zero}, device {device}, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters",
            flush=True,
        )

    losses: list[float] = []
    for epoch in itertools.count():
        if len(losses) == args.steps:
            break
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()  # gradients are averaged over the ranks as they complete
            optimizer.step()  # a synchronisation point: every rank waits for the others
            optimizer.zero_grad()

            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world_size)
            if rank == 0:
                print(f"epoch {epoch} step {len(losses)}/{args.steps}  loss {losses[-1]:.5f}")
            if len(losses) == args.steps:
                break

    state = model.state_dict()  # waits for the last steps
    if rank == 0 and args.out:
        state = {k: v.detach().cpu().clone() for k, v in state.items()}
        torch.save({"losses": losses, "state": state, "world_size": world_size}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
