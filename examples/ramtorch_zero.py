"""RamTorch's multi-GPU ZeRO-1/ZeRO-2 training loop, on ramflow.

The loop RamTorch documents, with its import lines pointed at ``ramflow.compat.ramtorch``:
the model is built in the parent process before ``torch.multiprocessing.spawn``; each worker
joins the process group, converts its ``nn.Linear`` layers, shards the optimizer
(``create_zero_param_groups``; ZeRO-1) and, with ``--zero 2``, the gradients
(``setup_grad_sharding_hooks``), reads its part of every global batch through a
``DistributedSampler``, divides the loss by the world size, steps its shard, broadcasts the
ordinary parameters it owns (``broadcast_zero_params``), steps the LR scheduler and clears
the gradients with ``model.zero_grad()``.

    python examples/ramtorch_zero.py                         # NCCL over every GPU, or 2 CPU ranks
    python examples/ramtorch_zero.py --backend gloo --world-size 2 --zero 1
    python examples/ramtorch_zero.py --world-size 4 --zero 2 --width 4096 --depth 8

``--world-size 1`` runs the same global batches in one process: the final weights and losses
of any world size agree with it to fp32 rounding (tests/test_examples.py checks this).
``--replace-before-spawn`` converts the layers in the parent instead, after which
``model.share_memory()`` leaves one host copy of the offloaded weights for all workers;
RamTorch's order (the default) gives each worker its own copy of them, kept in sync by a
broadcast after each step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ramflow
from ramflow.compat.ramtorch import AdamW
from ramflow.compat.ramtorch.helpers import replace_linear_with_ramtorch
from ramflow.compat.ramtorch.zero1 import broadcast_zero_params, create_zero_param_groups
from ramflow.compat.ramtorch.zero2 import setup_grad_sharding_hooks


class Regressor(nn.Module):
    """An ordinary PyTorch model: a LayerNorm (stays an ordinary parameter, synchronised by
    ``broadcast_zero_params``) and ``depth`` ``nn.Linear`` layers (offloaded once converted)."""

    def __init__(self, dim_in: int, width: int, depth: int, dim_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim_in)
        layers: list[nn.Module] = [nn.Linear(dim_in, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, dim_out))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(x))


def make_dataset(args: argparse.Namespace) -> TensorDataset:
    """The same synthetic regression set in every process: inputs and a random teacher's
    outputs (seeded, independent of the rank and of the world size)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.samples, args.dim_in, generator=g)
    w1 = torch.randn(args.dim_in, args.width, generator=g) / args.dim_in**0.5
    w2 = torch.randn(args.width, args.dim_out, generator=g) / args.width**0.5
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


def train(rank: int, args: argparse.Namespace, model: nn.Module) -> None:
    world_size = args.world_size
    torch.set_num_threads(args.threads)
    if args.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        args.backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout)
    )

    # convert the Linear layers (RamTorch: replace_linear_with_ramtorch(model, rank)); the
    # layers attach to this process's engine when they first meet the optimizer or run
    if not args.replace_before_spawn:
        model = replace_linear_with_ramtorch(model, rank if device.type == "cuda" else "cpu")
    model.to(device)

    # ZeRO-1: each rank keeps the optimizer states of its share of the parameters
    param_groups = [{"params": list(model.parameters()), "lr": args.lr, "weight_decay": 0.01}]
    rank_param_groups = create_zero_param_groups(param_groups, world_size)
    # ZeRO-2: each rank also keeps only the gradients of its share
    if args.zero == 2:
        setup_grad_sharding_hooks(rank_param_groups, rank)
    optimizer = AdamW(rank_param_groups[rank])
    scheduler = torch.optim.lr_scheduler.StepLR(
        optimizer, step_size=args.lr_step, gamma=args.lr_gamma
    )

    # every step reads one global batch: global_batch / world_size samples on each rank
    dataset = make_dataset(args)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(dataset, batch_size=args.global_batch // world_size, sampler=sampler)

    losses: list[float] = []
    for epoch in itertools.count():
        if len(losses) == args.steps:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            # gradients are summed over the ranks: scale the loss as RamTorch's loop does
            loss = F.mse_loss(model(inputs), targets) / world_size
            loss.backward()
            optimizer.step()  # this rank's shard; ramflow.Linear copies are current after it
            broadcast_zero_params(rank_param_groups)  # ordinary parameters, from their owners
            scheduler.step()
            model.zero_grad()  # not optimizer.zero_grad(): it only knows this rank's shard

            total = loss.detach().clone()  # this rank's share of the global mean loss
            dist.all_reduce(total)
            losses.append(total.item())
            if rank == 0:
                print(
                    f"epoch {epoch} step {len(losses)}/{args.steps}  loss {losses[-1]:.5f}  "
                    f"lr {scheduler.get_last_lr()[0]:.2e}",
                    flush=True,
                )
            if len(losses) == args.steps:
                break

    if rank == 0 and args.out:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.save({"losses": losses, "state": state, "args": vars(args)}, args.out)
    # every rank: the last step's sync with the other ranks may still run on ramflow's host
    # worker, on a group that destroy_process_group would pull from under it
    ramflow.synchronize(model)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpus = torch.cuda.device_count()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--world-size", type=int, default=gpus or 2, help="processes (default: one per GPU, or 2)"
    )
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        help="default: nccl when there is a GPU per process, else gloo (on the CPU)",
    )
    parser.add_argument("--zero", type=int, choices=[1, 2], default=2, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step, all ranks")
    parser.add_argument("--samples", type=int, default=64, help="dataset size (one epoch)")
    parser.add_argument("--dim-in", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3, help="number of Linear layers (>= 2)")
    parser.add_argument("--dim-out", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-step", type=int, default=4, help="StepLR step_size (steps)")
    parser.add_argument("--lr-gamma", type=float, default=0.5, help="StepLR gamma")
    parser.add_argument("--replace-before-spawn", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads per process (cores / ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="rank 0 saves the losses and final state_dict here")
    args = parser.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if gpus >= args.world_size else "gloo"
    if args.backend == "nccl" and gpus < args.world_size:
        parser.error(f"--backend nccl needs a GPU per process: {gpus} for {args.world_size}")
    if args.global_batch % args.world_size or args.samples % args.global_batch:
        parser.error("--global-batch must divide by --world-size, and --samples by --global-batch")
    if args.depth < 2:
        parser.error("--depth must be at least 2")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # a single-host rendezvous for init_process_group's default env:// method
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    print(
        f"{args.world_size} processes, backend {args.backend}, ZeRO-{args.zero}, "
        f"global batch {args.global_batch}",
        flush=True,
    )

    # build the model BEFORE spawning the workers: they all receive this one
    torch.manual_seed(args.seed)
    model = Regressor(args.dim_in, args.width, args.depth, args.dim_out)
    if args.replace_before_spawn:
        model = replace_linear_with_ramtorch(model, "cuda" if args.backend == "nccl" else "cpu")
    model.share_memory()  # workers map these host tensors instead of copying them
    mp.spawn(train, args=(args, model), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
