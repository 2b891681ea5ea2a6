"""Where does ramflow's peak GPU memory happen? Logs memory_allocated at engine events.

PYTHONPATH=src:tests python benchmarks/memory_trace.py
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch

import ramflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import tiny_llama  # noqa: E402  (the tests' small models)


def main() -> None:
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8, hidden=1024, intermediate=4096)
    ids = torch.randint(0, 128, (4, 256)).cuda()
    probe = ramflow.offload(copy.deepcopy(model), device="cuda")
    plan = ramflow.get_plan(probe)
    ramflow.undo(probe)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    m = ramflow.offload(copy.deepcopy(model), device="cuda", gpu_memory=plan.min_gpu_memory_bytes)
    engine = ramflow.api._engine(m)
    events: list[tuple[int, str]] = []

    def wrap(name: str) -> None:
        original = getattr(engine, name)

        @functools.wraps(original)
        def traced(*args, **kwargs):
            out = original(*args, **kwargs)
            label = name
            if args and hasattr(args[0], "name"):
                label += f":{args[0].name}"
            events.append((torch.cuda.memory_allocated() - base, label))
            return out

        setattr(engine, name, traced)

    for name in ("_allocate", "_evict", "_dispatch_grads", "_issue_h2d"):
        wrap(name)
    opt = ramflow.optim.AdamW(m.parameters(), lr=1e-4)
    for step in range(2):
        torch.cuda.reset_peak_memory_stats()
        loss = m(input_ids=ids, labels=ids).loss
        events.append((torch.cuda.memory_allocated() - base, "after forward"))
        loss.backward()
        events.append((torch.cuda.memory_allocated() - base, "after backward"))
        opt.step()
        opt.zero_grad()
        ramflow.synchronize(m)
        torch.cuda.synchronize()
        print(
            f"step {step}: peak {torch.cuda.max_memory_allocated() - base} plan {plan.planned_bytes}"
        )
    top = sorted(events, reverse=True)[:12]
    for nbytes, label in top:
        print(f"{nbytes / 2**20:9.1f} MiB  {label}")
    print("allocated units now:", [u.name for u in engine.units if u.allocated])
    print(torch.cuda.memory_summary(abbreviated=True)[:3000])


if __name__ == "__main__":
    main()
