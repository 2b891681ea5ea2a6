"""Where the long-context step's plan misses at short sequences (issue 32, point 3): the
Llama-3.1-8B shape of ``long_context.py`` (lean, B=1, every layer streamed), one length
(``--seq``, default 8192), timed with the CPU optimizer on fewer threads.

At 8k tokens the plan (``predict_plan_step``) had the step 17-21% shorter than measured
(2026-11-28), while from 32k up it is within 1.5%. At 8k the CPU step of the 8.0 B
parameters (about 0.9 s at the one-pass rate) runs beside a backward of about 0.8 s on the
same cores that launch the GPU's kernels and issue the copies. For each thread count in
``--threads`` this measures the lean one-pass rate with that many threads
(``cpu_optimizer_runner._host_format_rates``, as ``long_context.py`` does), then times
``--steps`` steps (after one untimed) per mode with ``AdamW(threads=n)``, and the plan's step
at that rate. Writes ``short_steps.json`` and ``short_steps.md`` into ``--out-dir`` after
every run.

GPU box (about 4 minutes with the defaults; the load is about 65 s):

    PYTHONUNBUFFERED=1 python3 benchmarks/long_context/short_steps.py --out-dir $OUT/short
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import long_context as lc  # noqa: E402  (sets the allocator settings before torch allocates)


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# The {m['seq']}-token step by CPU optimizer threads: llama-8b, lean, B=1",
        "",
        f"{m['date']}, {m['device']}, torch {m['torch']}, commit {m['commit']}, "
        f"{m['cores']} cores; load {result.get('load_s', 0):.1f} s. Step: median of "
        f"{m['steps']} after one untimed; rate: the lean one-pass step with that many threads.",
        "",
        "| threads | lean G params/s | mode | step s (all timed) | predicted s | error |",
        "| ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for r in result["runs"]:
        times = ", ".join(f"{t:.2f}" for t in r["times"])
        lines.append(
            f"| {r['threads']} | {r['cpu_params_per_s'] / 1e9:.2f} | {r['mode']} | "
            f"{r['step_s']:.3f} ({times}) | {r['predicted_s']:.3f} | "
            f"{r['step_s'] / r['predicted_s'] - 1:+.1%} |"
        )
    lines += ["", f"Command: `{m['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--threads", default="16,14,12", help="CPU optimizer threads, comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="offload,on")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the CPU smoke test of this model is long_context.py --tiny)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM

    import ramflow
    from harness import _commit
    from ramflow.memory import CheckpointOffload
    from ramflow.train.loss import chunk_lm_head

    device = torch.device("cuda")
    cores = os.cpu_count()
    threads = [min(int(x), torch.get_num_threads()) for x in args.threads.split(",")]
    cfg = lc.model_config(False, args.seq)
    matmul = lc.matmul_rate(device)
    bw = lc.pinned_bandwidth(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    chunk_lm_head(model)
    share = lc.Plans(cfg, lc._rates(bw, matmul, None), matmul, "lean", "cuda")("offload", args.seq)
    result: dict = {
        "meta": {
            "date": date.today().isoformat(), "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "commit": _commit(), "cores": cores, "seq": args.seq,
            "steps": args.steps, "matmul_flops_per_s": matmul, "pinned": bw,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
        "runs": [],
    }  # fmt: skip
    t0 = time.perf_counter()
    ramflow.offload(
        model, device=device, gpu_memory=share["ramflow_bytes"], wire_dtype=torch.bfloat16,
        host_precision="lean", activation_checkpointing=CheckpointOffload(),
        weights=lc.random_init,
    )  # fmt: skip
    result["load_s"] = time.perf_counter() - t0
    offloader = ramflow.api._engine(model).checkpointer.boundary_offloader
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        ids_BT = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=gen).to(device)
        t = time.perf_counter()
        lc.train_step(model, opt, ids_BT)
        return time.perf_counter() - t

    step()  # kernels, allocator, the host worker, the first (deferred) optimizer step
    all_threads = torch.get_num_threads()
    for n in threads:
        torch.set_num_threads(n)
        rate, fmt = lc._cpu_rate("lean")
        torch.set_num_threads(all_threads)
        opt.threads = n
        plans = lc.Plans(cfg, lc._rates(bw, matmul, rate, fmt), matmul, "lean", "cuda")
        for mode in args.modes.split(","):
            offloader.enabled = mode == "offload"
            step()  # the first at this setting
            times = [step() for _ in range(args.steps)]
            result["runs"].append({
                "threads": n, "mode": mode, "cpu_params_per_s": rate, "times": times,
                "step_s": statistics.median(times), "predicted_s": plans(mode, args.seq)["step_s"],
            })  # fmt: skip
            (out / "short_steps.json").write_text(json.dumps(result, indent=2) + "\n")
            (out / "short_steps.md").write_text(markdown(result))
            print(markdown(result).splitlines()[-3], flush=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
