"""DeepSpeed 0.19.8 ZeRO-3 with parameter and optimizer offload to CPU, one process.

Configured as DeepSpeed's ZeRO-3 offload examples recommend: ``stage: 3``, ``offload_param``
and ``offload_optimizer`` on ``cpu`` with ``pin_memory``, ``overlap_comm``,
``contiguous_gradients``, bf16 enabled (DeepSpeed keeps bf16 weights and fp32 masters on the
CPU), its AdamW (DeepSpeedCPUAdam, compiled on first use: about a minute, outside the timed
steps). A world of one: RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR/PORT and
``deepspeed.init_distributed()``. Training step: ``loss = engine(x, y)``,
``engine.backward(loss)``, ``engine.step()``. No activation checkpointing (as in the reference cases).
The model is built on the CPU and handed to ``deepspeed.initialize`` (``zero.Init`` matters
for models that do not fit in host memory; this one does).
"""

from __future__ import annotations

import time

import _common  # noqa: F401
from _common import emit, parser, require, run, single_process_env, skip


def zero3_offload_config(batch: int, *, weight_decay: float) -> dict:
    """DeepSpeed's config for ZeRO-3 with parameters and optimizer states offloaded to pinned
    CPU memory, bf16, its AdamW (lr 1e-5), ``batch`` sequences per step on one GPU."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-5,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": weight_decay,
            },
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    import torch

    import measure
    from models import build_model, make_batch, model_shape

    if args.mode != "train":
        skip("the harness runs DeepSpeed for training only")
    if not torch.cuda.is_available():
        skip("DeepSpeed ZeRO-3 offload needs CUDA")
    single_process_env()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    deepspeed = require("deepspeed")
    deepspeed.init_distributed()
    model = build_model(args.model, tiny=args.tiny)
    shape = model_shape(model)
    config = zero3_offload_config(args.batch, weight_decay=0.01)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    setup_s = time.perf_counter() - t0
    ids, labels = make_batch(shape.vocab_size, args.batch, args.seq, device=device)
    reference = args.model == "reference"

    def step() -> None:
        loss = (
            engine(ids, labels)
            if reference
            else engine(input_ids=ids, labels=labels, use_cache=False).loss
        )
        engine.backward(loss)
        engine.step()

    res = measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    emit(
        {
            "system": "DeepSpeed " + deepspeed.__version__ + " ZeRO-3 offload",
            "variant": "params+optimizer",
            "mode": "train",
            "batch": args.batch,
            "checkpoint": False,
            "setup_s": setup_s,
            **shape.__dict__,
            **res,
        }
    )


if __name__ == "__main__":
    run(main)
