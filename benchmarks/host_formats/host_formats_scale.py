"""Scale of the lean host formats (issue 14, point 7): a big model's training step on one GPU.

Legend: B = sequences per step, T = tokens per sequence, V = vocabulary, D = model width.

Builds the model of ``--shape`` on the meta device (no memory), offloads it with
``ramflow.offload(host_precision=..., weights=SeededInit(model, seed=0), gpu_memory=...,
activation_checkpointing=True)`` (the seeded init ``ramflow train`` uses, drawn by all the
host's cores; the host never holds a full-precision copy), then times
``--steps`` training steps after ``--warmup`` with ``ramflow.optim.AdamW`` (one parameter
group) under ``torch.autocast`` bf16 on random tokens. The loss is computed in chunks of
``--loss-chunk`` tokens, each checkpointed, inside the head unit (the logits of B x T tokens
over V = 152k in fp32 would take 20 GB), so only one chunk's logits exist at a time.

Reports: peak host RSS (VmHWM) during loading and during training (reset in between through
``/proc/self/clear_refs``), peak GPU memory (allocated and reserved; ``--gpu-memory`` caps
only ramflow's own allocation, the activations come on top), median step time, tokens/s,
model TFLOP/s (``ramflow.train.flops.model_flops_per_token``, the count of ramflow's MFU:
active weights and causal attention, x tokens per step / step time), the bf16 matmul rate measured
in the same process (8192^3 ``torch.matmul`` for about a second) and MFU (model over matmul
rate), the plan (``describe()``, host bytes per parameter) and ramflow's predicted step
(``ramflow.train.estimate.estimate_run_memory(speed=...)`` with the measured matmul rate and
this box's pinned copy rates and the host format's CPU AdamW rate, measured in the same run;
when it cannot, the reason). Writes
``scale-<shape>.json`` and ``.md`` into ``--out-dir``, rewritten after every stage and step,
so a timeout still leaves the numbers so far.

GPU (H100 80 GB, 128 GiB RAM, 16 cores):

    PYTHONUNBUFFERED=1 python3 benchmarks/host_formats/host_formats_scale.py --shape llama-3.1-8b \\
        --batch 4 --seq 2048 --gpu-memory 24GiB --out-dir $OUT/host-formats-scale
    PYTHONUNBUFFERED=1 python3 benchmarks/host_formats/host_formats_scale.py --shape qwen2.5-14b \\
        --batch 8 --seq 4096 --gpu-memory 24GiB --out-dir $OUT/host-formats-scale

(``--host-precision lean`` is the default; ``--steps 4 --warmup 2``.) CPU smoke test (a
tiny Llama shape, 2 steps, bf16 wire; seconds):

    python benchmarks/host_formats/host_formats_scale.py --smoke --out-dir /tmp/scale-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import os  # noqa: E402

from ramflow.cli.main import default_allocator_settings  # noqa: E402

# the CUDA allocator `ramflow train` runs with (expandable segments unless the user set
# PYTORCH_CUDA_ALLOC_CONF), set before torch allocates: the reserved peak then follows the
# allocated one (2026-11-27, H200: 50.8 GiB reserved for 44.0 allocated without it)
ALLOC_CONF = default_allocator_settings(os.environ)

import torch  # noqa: E402

import measure  # noqa: E402
from measure import matmul_rate  # noqa: E402
from models import ChunkedLossHead  # noqa: E402

SHAPES = ("llama-3.1-8b", "llama-8b", "qwen2.5-14b", "llama-13b", "neox-12b", "tiny", "tiny-neox")
GIB = 2**30


def model_config(shape: str):
    """The ``transformers`` config of ``shape`` (sdpa attention, no KV cache)."""
    if shape in ("llama-8b", "llama-3.1-8b"):
        from ramflow.train.presets import PRESETS

        cfg = PRESETS["llama-8b"].to_config()
    elif shape == "qwen2.5-14b":
        from transformers import Qwen2Config

        cfg = Qwen2Config(  # Qwen2.5-14B's config.json
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        )
    elif shape in ("llama-13b", "neox-12b", "tiny-neox"):  # the loading study's (issue 30.6)
        sys.path.insert(0, str(BENCH / "load"))
        from load_speed import model_config as load_config

        cfg = load_config(shape)
    elif shape == "tiny":
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def measured_rates(device: torch.device, host_precision: str) -> dict:
    """This box's rates for the prediction: pinned H2D/D2H copy rates (1 GiB, best of 3) and
    the CPU AdamW rate of ``host_precision`` (its one-pass kernel over flat buffers, as
    ``bench.py --cpu-optimizer`` measures it; fp32 is not measured here and keeps the
    default). Empty on the CPU."""
    if device.type != "cuda":
        return {}
    import cpu_optimizer_runner
    import measure

    bw = measure.pinned_bandwidth(device)
    out = {
        "h2d_bytes_per_s": bw["h2d"],
        "d2h_bytes_per_s": bw["d2h"],
        "both_bytes_per_s": bw["both"],
    }
    if host_precision != "fp32":
        dram = measure.dram_copy_bandwidth()
        rates = cpu_optimizer_runner._host_format_rates(1 << 27, {"steps": 3}, dram)
        out["cpu_optimizer_params_per_s"] = rates[host_precision]["params_per_s"]
        out["dram_copy_bytes_per_s"] = dram
    return out


def predicted_step(
    cfg, args, device: torch.device, matmul: float | None, rates: dict | None = None
) -> dict:
    """ramflow's estimate of this run's step time on a CUDA GPU (also planned on the CPU, for
    the smoke test: then with the default H200 rates and a 24 GiB budget), or why there is
    none. ``rates``: this box's (``measured_rates``); missing ones are the defaults."""
    from ramflow import HostPrecision
    from ramflow.planner.cpu_rates import optimizer_speed
    from ramflow.planner.predict import RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM, Rates
    from ramflow.sizes import parse_bytes
    from ramflow.train.estimate import RunDescription, SpeedInputs, estimate_run_memory

    rates = rates or {}
    timing = Rates()
    if rates.get("h2d_bytes_per_s"):
        timing = dataclasses.replace(
            timing,
            h2d_bytes_per_s=rates["h2d_bytes_per_s"],
            d2h_bytes_per_s=rates["d2h_bytes_per_s"],
            both_bytes_per_s=rates["both_bytes_per_s"],
        )
    if rates.get("cpu_optimizer_params_per_s"):
        # the rate is the format's own; the copies' DRAM rate stays the fp32 kernel's
        formats = HostPrecision.parse(args.host_precision)
        speed = optimizer_speed(formats)
        timing = dataclasses.replace(
            timing,
            cpu_optimizer_params_per_s=rates["cpu_optimizer_params_per_s"],
            cpu_optimizer_dram_bytes_per_param=RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM / speed,
            host_precision=formats,
        )

    common = dict(
        run=RunDescription(args.batch, args.seq, model_name=args.shape, precision="bf16"),
        device_type="cuda",
        compute_dtype=torch.bfloat16,
        wire_dtype=torch.bfloat16,
        checkpointing="on",
        host_precision=args.host_precision,
    )
    try:
        # the estimate's budget is the whole device's; this run's caps ramflow alone: plan
        # with ramflow's budget plus the estimate's own activations
        acts = estimate_run_memory(cfg, device_budget_bytes=None, **common).device_activation_bytes
        gpu_memory_bytes = parse_bytes(args.gpu_memory or "24GiB", what="--gpu-memory")
        est = estimate_run_memory(
            cfg,
            device_budget_bytes=gpu_memory_bytes + acts,
            speed=SpeedInputs(timing_rates=timing, matmul_flops_per_s=matmul),
            **common,
        )
    except Exception as e:  # noqa: BLE001 (the benchmark records why and goes on)
        return {"step_s": None, "why_none": f"{type(e).__name__}: {e}"}
    pred = getattr(est, "prediction", None)
    return {
        "step_s": pred.step_s if pred is not None else None,
        "bound": getattr(pred, "bound", None),
        "why_none": None if pred is not None else "estimate_memory gave no prediction",
        "estimated_activation_bytes": acts,
        "plan": est.plan.describe(),
        "rates": dataclasses.asdict(timing),
        "note": "the estimate's activations assume the model's own loss, not this chunked one; "
        + (
            "its copy and CPU optimizer rates are this box's, measured in this run"
            if rates.get("cpu_optimizer_params_per_s") or rates.get("h2d_bytes_per_s")
            else "its copy and CPU optimizer rates are the H200 box's defaults"
        ),
    }


def _write(out_dir: Path, shape: str, result: dict) -> None:
    (out_dir / f"scale-{shape}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"scale-{shape}.md").write_text(_markdown(result))


def _g(x, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if x is None else format(x / scale, spec)


def _markdown(r: dict) -> str:
    m, s = r["meta"], r.get("summary", {})
    lines = [
        f"# ramflow at scale: {m['shape']}, host precision {m['host_precision']}",
        "",
        f"{m['date']}, {m['device']}; {m['parameters'] / 1e6:,.1f} M parameters; "
        f"{m['batch']}x{m['seq']} tokens per step; --gpu-memory {m['gpu_memory']} (caps "
        "ramflow's own allocation; activations come on top); activation checkpointing on; "
        f"loss in chunks of {m['loss_chunk']} tokens. Stage: {r['stage']}.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| peak host RSS, loading | {_g(r.get('load_peak_rss_bytes'), GIB)} GiB |",
        f"| peak host RSS, training | {_g(s.get('train_peak_rss_bytes'), GIB)} GiB |",
        f"| peak host RSS, overall | {_g(s.get('peak_rss_bytes'), GIB)} GiB |",
        f"| peak GPU allocated / reserved | {_g(s.get('peak_gpu_allocated_bytes'), GIB)} / "
        f"{_g(s.get('peak_gpu_reserved_bytes'), GIB)} GiB |",
        f"| host bytes per trained parameter (plan) | {_g(r.get('host_bytes_per_parameter'))} |",
        f"| load time | {_g(r.get('load_s'), 1, '.1f')} s |",
        f"| median step ({len(r['steps_s'])} timed) | {_g(s.get('median_step_s'), 1, '.3f')} s |",
        f"| tokens/s | {_g(s.get('tokens_per_s'), 1, ',.0f')} |",
        f"| model TFLOP/s (weights and attention) | {_g(s.get('model_flops_per_s'), 1e12, '.1f')} |",
        f"| bf16 matmul rate, same run | {_g(r.get('matmul_flops_per_s'), 1e12, '.1f')} TFLOP/s |",
        f"| MFU vs that rate | {_g(s.get('mfu_vs_matmul'), 0.01, '.1f')}% |",
        f"| predicted step | {_g(r['prediction'].get('step_s'), 1, '.3f')} s "
        f"({r['prediction'].get('why_none') or 'bound: ' + str(r['prediction'].get('bound'))}) |",
        f"| measured / predicted | {_g(s.get('measured_over_predicted'), 1, '.3f')} |",
        "",
        "Plan (measured run):",
        "",
        "```",
        r.get("plan", "-"),
        "```",
        "",
        "Plan of the prediction:",
        "",
        "```",
        r["prediction"].get("plan", "-"),
        "```",
        "",
        f"Command: `{m['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    p.add_argument("--host-precision", default="lean", choices=["fp32", "bf16", "lean", "kahan"])
    p.add_argument("--batch", type=int, default=4, help="sequences per step B")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence T")
    p.add_argument("--gpu-memory", default="24GiB", help="ramflow's device budget")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before")
    p.add_argument("--loss-chunk", type=int, default=2048, help="tokens per loss chunk")
    p.add_argument("--threads", type=int, default=None, help="AdamW threads (default: torch's)")
    p.add_argument(
        "--device-optimizer",
        nargs="?",
        const="on",
        choices=("auto", "on", "off"),
        default="auto",
        help="ramflow.offload's device_optimizer: auto (default, None: the planner's "
        "choice), on (or the bare flag: True, every resident unit that fits), off (False)",
    )
    p.add_argument("--out-dir", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        # a tiny shape of --shape's family ("tiny-neox" stays), 2 steps on the CPU
        args.shape = args.shape if args.shape.startswith("tiny") else "tiny"
        args.batch, args.seq, args.steps, args.warmup = 2, 64, 2, 1
        args.gpu_memory, args.loss_chunk = None, 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    import ramflow
    from ramflow.train.flops import model_flops_per_token
    from ramflow.train.initialization import SeededInit

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = device.type == "cuda"
    cfg = model_config(args.shape)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # the head by its role, not its name (Llama's lm_head, GPT-NeoX's embed_out)
    head = ChunkedLossHead(model.get_output_embeddings(), args.loss_chunk)
    model.set_output_embeddings(head)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq
    flops_per_token = model_flops_per_token(model, seq_len=args.seq)
    result: dict = {
        "meta": {
            "date": date.today().isoformat(),
            "cuda_alloc_conf": ALLOC_CONF,
            "host": platform.node(),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "shape": args.shape,
            "config": cfg.to_dict(),
            "parameters": n_params,
            "host_precision": args.host_precision,
            "batch": args.batch,
            "seq": args.seq,
            "gpu_memory": args.gpu_memory,
            "loss_chunk": args.loss_chunk,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        },
        "stage": "start",
        "steps_s": [],
        "prediction": {},
    }
    result["matmul_flops_per_s"] = matmul_rate(device)
    result["measured_rates"] = measured_rates(device, args.host_precision)
    result["prediction"] = predicted_step(
        cfg, args, device, result["matmul_flops_per_s"], result["measured_rates"]
    )
    result["stage"] = "loading"
    result["rss_before_load_bytes"] = measure.proc_status_bytes("VmRSS")
    _write(out_dir, args.shape, result)

    measure.reset_peak_rss()
    t0 = time.perf_counter()
    ramflow.offload(
        model,
        device=device,
        gpu_memory=args.gpu_memory,
        wire_dtype=torch.bfloat16,
        host_precision=args.host_precision,
        activation_checkpointing=True,
        weights=SeededInit(model, seed=0),
        device_optimizer={"auto": None, "on": True, "off": False}[args.device_optimizer],
    )
    result["load_s"] = time.perf_counter() - t0
    result["load_peak_rss_bytes"] = measure.proc_status_bytes("VmHWM")
    plan = ramflow.get_plan(model)
    result["plan"] = plan.describe()
    result["host_bytes"] = getattr(plan, "host_bytes", None)
    result["host_bytes_per_parameter"] = plan.host_bytes_per_parameter
    result["stage"] = "training"
    _write(out_dir, args.shape, result)
    print(result["plan"], flush=True)

    # keep_grads=False: the loop reads no gradients, so under the gradient ring every step,
    # the first too, runs during backward and no full host gradient is ever made
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, threads=args.threads, keep_grads=False)
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    train_peak_reset = measure.reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            body = getattr(model, model.base_model_prefix)  # model.model, gpt_neox, ...
            hidden_BTD = body(input_ids=ids_BT).last_hidden_state
            loss = head(hidden_BTD, ids_BT)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    t_prev = time.perf_counter()
    for i in range(args.warmup + args.steps):
        loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        key = "warmup_s" if i < args.warmup else "steps_s"
        result.setdefault(key, []).append(dt)
        result.setdefault("losses", []).append(loss)
        med = statistics.median(result["steps_s"]) if result["steps_s"] else None
        flops = flops_per_token * tokens / med if med else None
        pred = result["prediction"].get("step_s")
        result["summary"] = {
            "median_step_s": med,
            "tokens_per_s": tokens / med if med else None,
            "model_flops_per_s": flops,
            "mfu_vs_matmul": flops / result["matmul_flops_per_s"]
            if flops and result["matmul_flops_per_s"]
            else None,
            "measured_over_predicted": med / pred if med and pred else None,
            "train_peak_rss_bytes": measure.proc_status_bytes("VmHWM")
            if train_peak_reset
            else None,
            "peak_rss_bytes": max(
                filter(None, [measure.proc_status_bytes("VmHWM"), result["load_peak_rss_bytes"]])
            ),
            "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        }
        print(f"step {i + 1} ({key[:-2]}): {dt:.3f} s, loss {loss:.4f}", flush=True)
        _write(out_dir, args.shape, result)
    ramflow.synchronize(model)
    result["stage"] = "done"
    _write(out_dir, args.shape, result)
    print((out_dir / f"scale-{args.shape}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
