"""Host bytes of a Qwen3-30B-A3B shape under lean and lean4, by part (issue 47 point 5).

Builds the ``qwen3-30b-a3b`` preset on the meta device, finds its units as ``offload``
does, and prints ``HostPrecision.host_bytes`` (the one byte model that ``get_plan`` and
``ramflow plan`` read) for each format and each way a step holds its gradients: the ring
alone (steps during backward: no clipping, no accumulation, ``keep_grads=False``), the
compact 8-bit deferred gradient (``keep_grads=False, clips=True``), and a full gradient in
the master's dtype (what ``ramflow train`` keeps today on one process). Add ``--runtime-gib``
(``ramflow plan``'s runtime, 3.5) for the whole host:

    PYTHONPATH=src python benchmarks/host_formats/adam4bit_plan.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM

from ramflow import HostPrecision
from ramflow.train.presets import get_preset
from ramflow.units.unit import Unit, find_units

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--runtime-gib", type=float, default=3.5)
    args = p.parse_args(argv)
    preset = get_preset(args.preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset.to_config(vocab_size=preset.vocab_size))
    units = [Unit(i, spec) for i, spec in enumerate(find_units(model))]
    trained = sum(u.trainable_numel for u in units)
    print(f"{args.preset}: {trained / 1e9:.2f} B trained elements in {len(units)} units")
    print(
        "| formats | gradients held | master | states | deferred/full gradients | staging "
        "| total | + runtime | bytes per parameter |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in ("lean", "lean4"):
        pr = HostPrecision.parse(name)
        for held, kwargs in (
            ("ring only", None),
            ("compact 8-bit", dict(kept_grads=False)),
            ("full bf16", dict(full_gradients=True, kept_grads=True)),
        ):
            parts = pr.host_bytes(units, torch.bfloat16, **(kwargs or {}))
            grads = parts.gradients + (parts.deferred_gradients if kwargs else 0)
            total = parts.master + parts.wire + parts.states + parts.staging + grads
            print(
                f"| {name} | {held} | {parts.master / GIB:.1f} | {parts.states / GIB:.1f} | "
                f"{grads / GIB:.1f} | {parts.staging / GIB:.2f} | {total / GIB:.1f} | "
                f"{total / GIB + args.runtime_gib:.1f} | {total / trained:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
