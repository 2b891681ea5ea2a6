"""Does the engine step units during backward on this device? Prints its step state.

PYTHONPATH=src python benchmarks/eager_probe.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import ramflow

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_model as rm  # noqa: E402
from runners import loss_of  # noqa: E402


def main() -> None:
    cfg = dataclasses.replace(rm.TINY, checkpoint=True, loss_chunk_tokens=32)
    model = rm.build_reference(cfg)
    ramflow.offload(model)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-4)
    engine = ramflow.api._engine(model)
    calls = {"staged": 0, "deferred": 0}
    for name, key in (("_step_staged", "staged"), ("_step_unit", "deferred")):
        original = getattr(engine, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        setattr(engine, name, counted)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    for i in range(4):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, ids, ids)
        loss.backward()
        state = dict(
            last_eager=engine._last_backward_eager,
            final=engine._final_backwards,
            modified=engine._grads_modified(opt),
            dirty=engine._backward_dirty,
        )
        opt.step()
        opt.zero_grad()
        ramflow.synchronize(model)
        print(i, state, "allowed", engine._eager_allowed, calls)


if __name__ == "__main__":
    main()
