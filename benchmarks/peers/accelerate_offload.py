"""accelerate ``cpu_offload``: inference with every weight on the CPU, moved to the GPU module by
module as each runs (accelerate's documented big-model inference helper). bf16 weights, one
forward under ``torch.no_grad()`` per step.
"""

from __future__ import annotations

import _common  # noqa: F401
from _common import emit, parser, require, run, skip


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    import torch

    import measure
    from models import build_model, logits_of, make_batch, model_shape

    if args.mode != "infer":
        skip("accelerate's cpu_offload is for inference")
    accelerate = require("accelerate")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model = build_model(args.model, tiny=args.tiny, dtype=torch.bfloat16)
    model.eval()
    shape = model_shape(model)
    accelerate.cpu_offload(model, execution_device=device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ids, _ = make_batch(shape.vocab_size, batch, args.seq, device=device)

        def step(ids=ids) -> None:
            with torch.no_grad():
                logits_of(model, ids)

        rows.append(
            {
                "batch": batch,
                **measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps),
            }
        )
    emit(
        {
            "system": "accelerate " + accelerate.__version__ + " cpu_offload",
            "variant": "bf16 weights",
            "mode": "infer",
            **shape.__dict__,
            "rows": rows,
        }
    )


if __name__ == "__main__":
    run(main)
