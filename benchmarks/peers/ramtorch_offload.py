"""RamTorch 1.11 ``OffloadModel``: the reference model diced as [embedding, blocks, norm + head].

As its documentation recommends: weights stream through a GPU window of ``window=2`` chunk
slots over a dedicated copy stream (nothing pinned on the GPU). Inference runs ``model(x)``
with bf16 weights (``--weights bf16``) or fp32 weights under bf16 autocast
(``--weights fp32-autocast``). Training runs ``model.step(x, targets=y, loss_fn=...)`` under
bf16 autocast with fp32 masters, ``flush_grads()``, then ``torch.optim.AdamW(fused=True)`` over
``model.parameters()`` (the optimizer its ``flush_grads`` docstring recommends); ``--keep``
picks ``keep_activations`` (``keep``: True, ``checkpoint``: "checkpoint", ``recompute``:
False). H2D bytes are not counted; the result carries RamTorch's own ``stats``.
"""

from __future__ import annotations

import _common  # noqa: F401  (puts benchmarks/ on sys.path)
from _common import emit, parser, require, run, skip

KEEP = {"keep": True, "checkpoint": "checkpoint", "recompute": False}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--weights", choices=("bf16", "fp32-autocast"), default="bf16", help="inference weights"
    )
    p.add_argument("--keep", choices=tuple(KEEP), default="keep", help="training: keep_activations")
    p.add_argument("--window", type=int, default=2)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    import measure
    from models import build_model, make_batch, model_shape

    ramtorch = require("ramtorch")
    if args.model != "reference":
        skip("RamTorch takes a list of chunks; the harness dices only the reference model")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    bf16_weights = args.mode == "infer" and args.weights == "bf16"
    model = build_model(
        args.model, tiny=args.tiny, dtype=torch.bfloat16 if bf16_weights else torch.float32
    )
    shape = model_shape(model)
    autocast = not bf16_weights
    om = ramtorch.OffloadModel(
        model.chunks(),
        device=device,
        window=args.window,
        keep_activations=KEEP[args.keep] if args.mode == "train" else False,
    )
    out = {"system": "RamTorch " + ramtorch.__version__, "mode": args.mode, **shape.__dict__}
    if args.mode == "infer":
        out["variant"] = "bf16 weights" if bf16_weights else "fp32 weights + autocast"
        om.eval()
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            ids, _ = make_batch(shape.vocab_size, batch, args.seq, device=device)

            def step(ids=ids) -> None:
                with (
                    torch.no_grad(),
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast),
                ):
                    om(ids)

            res = measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
            rows.append({"batch": batch, **res})
        out["rows"] = rows
    else:
        out.update(variant=f"{args.keep}", batch=args.batch, checkpoint=args.keep != "keep")
        ids, labels = make_batch(shape.vocab_size, args.batch, args.seq, device=device)
        opt = torch.optim.AdamW(om.parameters(), lr=1e-5, fused=True)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                om.step(ids, targets=labels, loss_fn=loss_fn)
            om.flush_grads()
            opt.step()
            opt.zero_grad()

        out.update(measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps))
    out["stats"] = dict(getattr(om, "stats", {}))
    emit(out)


if __name__ == "__main__":
    run(main)
