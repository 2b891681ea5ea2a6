"""Do low-precision AdamW states follow fp32's? A CPU simulation.

Lean host formats store AdamW's moments as 8-bit FP8 E4M3 codes with a power-of-two scale
per block of 256 (``ramflow.kernels.lean_kernels``). A code has 3 mantissa bits, so a stored value
moves only when the exponential moving average moves it by more than half a code's spacing:
with ``beta2 = 0.95`` sqrt(v) may fall by at most 2.5% a step, less than half a spacing
(1/32 to 1/16), and a stored v that is rounded to nearest never falls ("state staleness",
Topollai & Choromanska 2026, arXiv 2603.16731). This script steps the same gradients
through ``lean_adamw_step_`` twice, with fp32 states and with low-precision ones (fp32
masters in both, so only the states differ), and reports per step the median ratio of the
low-precision v to fp32's and the ratio of the mean update sizes. ``--states 8bit`` (the
lean and kahan presets' states, the default) or ``bf16`` (the bf16 preset's: 8 significant
bits, half a spacing 2**-9 to 2**-8 of v, so at beta2 = 0.999, rounded to nearest, a v that
should fall by 0.1% a step stayed; both kinds are now rounded stochastically).

Gradients: element i has scale s_i = 10**-U(0, 3) (a spread of magnitudes within each
block), times N(0, 1) noise each step, times a global factor that is 1 (``flat``) or falls
from 42 to 2 with a time constant of 30 steps (``decay``, as a language model's gradient
norm falls in its first hundred steps).

    python benchmarks/host_formats/state_staleness.py --out-dir DIR [--steps 300] [--states bf16]

Writes ``state_staleness.json`` and ``state_staleness.md`` into DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import torch

from ramflow.kernels.lean_kernels import dequantize_blockwise, lean_adamw_step_, quantize_blockwise

CASES = [(0.95, "flat"), (0.95, "decay"), (0.999, "flat"), (0.999, "decay")]
REPORT_AT = (1, 10, 50, 100, 200, 300, 500, 1000)


def simulate(beta2: float, shape: str, steps: int, n: int, states: str = "8bit") -> list[dict]:
    """Rows (step, v ratio median/p10/p90, update ratio) of one case."""
    gen = torch.Generator().manual_seed(0)
    scale = 10 ** (-3 * torch.rand(n, generator=gen))
    ref = {"master": torch.zeros(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    lean = {"master": torch.zeros(n)}
    if states == "bf16":
        lean["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16)
        lean["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16)
        lean["exp_avg_scale"] = lean["exp_avg_sq_scale"] = None
    else:
        lean["exp_avg"], lean["exp_avg_scale"] = quantize_blockwise(torch.zeros(n), signed=True)
        lean["exp_avg_sq"], lean["exp_avg_sq_scale"] = quantize_blockwise(
            torch.zeros(n), signed=False
        )
    hyper = dict(lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0)
    rows = []
    for t in range(1, steps + 1):
        factor = 40 * math.exp(-t / 30) + 2 if shape == "decay" else 1.0
        g = scale * torch.randn(n, generator=gen) * factor
        before_ref, before_lean = ref["master"].clone(), lean["master"].clone()
        lean_adamw_step_(ref["master"], g, ref["exp_avg"], ref["exp_avg_sq"], step=t, **hyper)
        lean_adamw_step_(
            lean["master"], g, lean["exp_avg"], lean["exp_avg_sq"], step=t,
            exp_avg_scale=lean["exp_avg_scale"], exp_avg_sq_scale=lean["exp_avg_sq_scale"],
            **hyper,
        )  # fmt: skip
        if t in REPORT_AT or t == steps:
            if states == "bf16":
                low = lean["exp_avg_sq"].to(torch.float32)
            else:
                low = dequantize_blockwise(
                    lean["exp_avg_sq"], lean["exp_avg_sq_scale"], signed=False
                )
            ratio = low / ref["exp_avg_sq"].clamp_min(1e-30)
            update = (lean["master"] - before_lean).abs().mean() / (
                ref["master"] - before_ref
            ).abs().mean()
            q = torch.quantile(ratio[:1_000_000], torch.tensor([0.1, 0.5, 0.9])).tolist()
            rows.append(
                {"step": t, "v_ratio_p10": q[0], "v_ratio_median": q[1], "v_ratio_p90": q[2],
                 "update_ratio": float(update)}
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--states", choices=("8bit", "bf16"), default="8bit", help="the states compared")
    p.add_argument(
        "--elements", type=int, default=256 * 2048, help="state elements (a multiple of 256)"
    )
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results = {
        "commit": commit, "steps": args.steps, "elements": args.elements,
        "states": args.states, "cases": [],
    }  # fmt: skip
    what = args.states
    lines = [
        f"# {what} second moment against fp32's (CPU simulation)",
        "",
        f"`python benchmarks/host_formats/state_staleness.py --out-dir DIR --steps {args.steps} "
        f"--states {what}`, commit {commit}, {args.elements:,} elements, beta1 0.9, lr 1e-3, "
        "eps 1e-8.",
        "",
        f"| beta2 | gradients | step | v {what} / fp32, median (p10-p90) | update {what} / fp32 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for beta2, shape in CASES:
        rows = simulate(beta2, shape, args.steps, args.elements, args.states)
        results["cases"].append({"beta2": beta2, "gradients": shape, "rows": rows})
        for r in rows:
            lines.append(
                f"| {beta2} | {shape} | {r['step']} | {r['v_ratio_median']:.3f} "
                f"({r['v_ratio_p10']:.3f}-{r['v_ratio_p90']:.3f}) | {r['update_ratio']:.3f} |"
            )
        print(lines[-1], flush=True)
    (out / "state_staleness.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "state_staleness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
