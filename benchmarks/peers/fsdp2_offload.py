"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with ``CPUOffloadPolicy(pin_memory=True)``, a
world of one process.

As PyTorch's FSDP2 documentation shows: ``fully_shard`` each decoder block, then the root,
with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the offload policy keeps
the sharded fp32 parameters, gradients and optimizer states on the CPU and runs the optimizer
step there. Optimizer: ``torch.optim.AdamW(model.parameters())`` with torch's default
implementation choice (``--optimizer default``; on CPU tensors that is the single-tensor loop),
or ``fused``/``foreach``. Training step: forward with the loss, ``loss.backward()``,
``opt.step()``, ``opt.zero_grad()``; no activation checkpointing.
"""

from __future__ import annotations

import _common  # noqa: F401
from _common import emit, parser, run, single_process_env, skip


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=("default", "fused", "foreach"), default="default")
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import measure
    from models import build_model, loss_of, make_batch, model_shape

    if args.mode != "train":
        skip("the harness runs FSDP2 for training only")
    if not torch.cuda.is_available():
        skip("FSDP2 with CPUOffloadPolicy computes on CUDA")
    single_process_env()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device)
    try:
        mesh = init_device_mesh("cuda", (1,))
        model = build_model(args.model, tiny=args.tiny)
        shape = model_shape(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True)
        blocks = model.layers if hasattr(model, "layers") else model.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}[
            args.optimizer
        ]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **kwargs)
        ids, labels = make_batch(shape.vocab_size, args.batch, args.seq, device=device)

        def step() -> None:
            loss = loss_of(model, ids, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()

        res = measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
        emit(
            {
                "system": f"FSDP2 CPUOffloadPolicy (torch {torch.__version__})",
                "variant": f"AdamW {args.optimizer}",
                "mode": "train",
                "batch": args.batch,
                "checkpoint": False,
                **shape.__dict__,
                **res,
            }
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
