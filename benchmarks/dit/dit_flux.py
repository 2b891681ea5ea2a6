"""A Flux-dev-shaped diffusion transformer (about 12B) fine-tuned at 1024x1024 under 24 GiB
(issue 33, point 1): ramflow against resident training and RamTorch.

Legend: B images per step, L image tokens, S text tokens.

The model is diffusers' ``FluxTransformer2DModel`` with Flux-dev's config (19 double-stream
and 38 single-stream blocks, hidden 3072, 24 heads of 128, guidance embed; 11.9 B
parameters), random weights. One step is the rectified-flow step of diffusers'
``train_dreambooth_flux.py``: a 1024x1024 image's latents (16 x 128 x 128) packed 2x2 into
L = 4096 tokens of 64 channels, S = 512 text tokens of 4096 dims (T5) and a pooled 768
(CLIP), x_t = (1 - t) x0 + t noise at a logit-normal t, the MSE of the predicted velocity
against noise - x0, under bf16 autocast, B = 1.

Cases, each in a process of its own (a crash or timeout is recorded and the run goes on;
a case that no longer fits ``--budget-s`` is skipped):

- ``ramflow``: the 12B model built on the meta device and drawn unit by unit into the host
  store by ``SeededInit`` (never a full fp32 copy), ``ramflow.offload(gpu_memory=cap -
  --activation-reserve, activation_checkpointing=True, host_precision=--host-precision)``,
  ``ramflow.optim.AdamW``. ``auto`` takes the lean format on a 128 GiB box (fp32 masters and
  AdamW states, 16 bytes per parameter, do not fit there).
- ``resident-small``: the same shape with ``--small-double`` and ``--small-single`` blocks
  (2.5 B by default), fp32 on the GPU, diffusers' ``enable_gradient_checkpointing``,
  ``torch.optim.AdamW(fused=True)``. The 12B does not fit resident on 80 GB (fp32 weights,
  gradients and AdamW states take about 190 GB).
- ``ramflow-small``: that smaller model through ramflow, as ``ramflow``: the ratio to
  ``resident-small`` is ramflow's cost at the same shape.
- ``ramtorch-small``: the smaller model through RamTorch 1.11's ``OffloadModel`` (chunks:
  the embedders, each block, the output layer; ``window=2``, ``keep_activations=
  "checkpoint"``, fp32 masters, ``torch.optim.AdamW(fused=True)`` as its ``flush_grads``
  recommends, as ``benchmarks/peers/ramtorch_offload.py``). The 12B does not fit it on a
  128 GiB box: fp32 masters, gradient accumulators and AdamW states take about 190 GB.

Each case reports: set-up time, median step time over ``--steps`` after ``--warmup``, peak
GPU memory (``torch.cuda.max_memory_allocated`` over the timed steps; reserved too), peak
host RSS (VmHWM) and RSS after the steps. Writes ``dit_flux.json``, ``dit_flux.md`` and
``dit_flux.log`` into ``--out-dir``, rewritten after each case.

GPU (one H100, 128 GiB RAM, 16 cores; about 5 minutes; diffusers travels as wheels, with
RamTorch's)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    PYTHONUNBUFFERED=1 python3 benchmarks/dit/dit_flux.py --out-dir $OUT/dit-flux

CPU smoke test (tiny Flux, all cases; RamTorch's is skipped where it is not installed)::

    python benchmarks/dit/dit_flux.py --tiny --device cpu --out-dir /tmp/dit-smoke
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

GIB = 2**30
CASES = ("ramflow", "resident-small", "ramflow-small", "ramtorch-small")

# Flux-dev's transformer (black-forest-labs/FLUX.1-dev, transformer/config.json)
FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
TINY = dict(FLUX_DEV, num_layers=2, num_single_layers=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
            axes_dims_rope=(4, 6, 6), in_channels=16)  # fmt: skip
# (latent channels, latent side, text tokens): 1024x1024 through Flux's VAE (8x, 16 channels)
SHAPE = (16, 128, 512)
TINY_SHAPE = (4, 8, 8)


def flux_config(args: argparse.Namespace, *, small: bool) -> dict:
    cfg = dict(TINY if args.tiny else FLUX_DEV)
    if small:
        cfg.update(num_layers=args.small_double, num_single_layers=args.small_single)
    return cfg


def make_batch(cfg: dict, args: argparse.Namespace, device):
    """Inputs and target of one step on ``device`` (fixed seed: every case sees the same)."""
    import torch
    from diffusers import FluxPipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling

    channels, side, text_tokens = TINY_SHAPE if args.tiny else SHAPE
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, channels, side, side, generator=g)  # (B, C, H, W)
    noise = torch.randn(x0.shape, generator=g)
    t = compute_density_for_timestep_sampling(
        "logit_normal", 1, logit_mean=0.0, logit_std=1.0, generator=g
    )
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    pack = FluxPipeline._pack_latents
    inputs = dict(
        hidden_states=pack(xt, 1, channels, side, side),  # (B, L, 4C)
        timestep=t,
        guidance=torch.full((1,), 3.5),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg["joint_attention_dim"], generator=g),
        txt_ids=torch.zeros(text_tokens, 3),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, side // 2, side // 2, "cpu", x0.dtype),
    )
    inputs = {k: v.to(device) for k, v in inputs.items()}
    return inputs, pack(noise - x0, 1, channels, side, side).to(device)


def run_case(args: argparse.Namespace) -> dict:
    """One case in this process; returns its record."""
    import torch
    import torch.nn.functional as F
    from diffusers import FluxTransformer2DModel

    import measure

    device = torch.device(args.device)
    if device.type == "cuda":
        # every case alike: cuDNN's bf16 attention backward has returned NaN gradients
        # (pytorch/pytorch#196678), and examples/train_flux_dit.py went NaN with it on an H100
        torch.backends.cuda.enable_cudnn_sdp(False)
    small = args.case != "ramflow"
    cfg = flux_config(args, small=small)
    inputs, target = make_batch(cfg, args, device)
    rec: dict = {"case": args.case, "config": cfg}
    t0 = time.perf_counter()
    drain = None
    if args.case in ("ramflow", "ramflow-small"):
        import ramflow
        from ramflow.sizes import parse_bytes
        from ramflow.train.initialization import SeededInit

        with torch.device("meta"):
            model = FluxTransformer2DModel(**cfg)
        cap = parse_bytes(args.gpu_memory)
        reserve = parse_bytes(args.activation_reserve)
        ramflow.offload(
            model,
            device=device,
            weights=SeededInit(model, seed=0),
            gpu_memory=cap - reserve if device.type == "cuda" else None,
            activation_checkpointing=True,
            host_precision=args.host_precision,
            wire_dtype=torch.bfloat16,
            device_optimizer={"auto": None, "on": True, "off": False}[args.device_optimizer],
        )
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5)
        plan = ramflow.get_plan(model)
        rec["plan"] = plan.describe() if hasattr(plan, "describe") else str(plan)
        print(rec["plan"], file=sys.stderr, flush=True)  # before the first step
        rec["gpu_memory_bytes"] = cap - reserve

        def drain() -> None:
            ramflow.synchronize(model)

        forward = model
    elif args.case == "resident-small":
        torch.manual_seed(0)
        with torch.device(device):
            model = FluxTransformer2DModel(**cfg)
        model.enable_gradient_checkpointing()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        forward = model
    else:
        forward, opt = _ramtorch(cfg, device)
    rec["num_params"] = sum(p.numel() for p in opt.param_groups[0]["params"])
    rec["setup_s"] = time.perf_counter() - t0
    print(f"{args.case}: set up in {rec['setup_s']:.1f} s", file=sys.stderr, flush=True)
    done = [0]
    rec["rss_after_setup_bytes"] = measure.proc_status_bytes("VmRSS")

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if args.case == "ramtorch-small":
                forward.step(
                    tuple(inputs[k] for k in _RAMTORCH_INPUTS),
                    targets=target,
                    loss_fn=lambda out, y: F.mse_loss(out.float(), y.float()),
                )
                forward.flush_grads()
            else:
                pred = forward(**inputs, return_dict=False)[0]
                F.mse_loss(pred.float(), target.float()).backward()
        opt.step()
        opt.zero_grad()
        done[0] += 1  # progress on stderr: a case cut by the budget still says how far it got
        print(f"{args.case}: step {done[0]} queued at {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip

    rec.update(measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps,
                                  drain=drain))  # fmt: skip
    if device.type == "cuda":
        rec["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    rec["peak_rss_bytes"] = measure.proc_status_bytes("VmHWM")
    rec["rss_bytes"] = measure.proc_status_bytes("VmRSS")
    return rec


_RAMTORCH_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                    "guidance", "txt_ids", "img_ids")  # fmt: skip


def _ramtorch(cfg: dict, device):
    """The Flux model diced into RamTorch chunks, each passing (image tokens, text tokens,
    time embedding, rotary cos, rotary sin) to the next, as Flux's forward does."""
    import ramtorch
    import torch
    from diffusers import FluxTransformer2DModel
    from torch import nn

    torch.manual_seed(0)
    flux = FluxTransformer2DModel(**cfg)

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x_embedder, self.context_embedder = flux.x_embedder, flux.context_embedder
            self.time_text_embed, self.pos_embed = flux.time_text_embed, flux.pos_embed

        def forward(self, hidden, text, pooled, t, guidance, txt_ids, img_ids):
            hidden = self.x_embedder(hidden)
            temb = self.time_text_embed(t.to(hidden.dtype) * 1000,
                                        guidance.to(hidden.dtype) * 1000, pooled)  # fmt: skip
            cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
            return hidden, self.context_embedder(text), temb, cos, sin

    class Block(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, hidden, text, temb, cos, sin):
            text, hidden = self.block(hidden_states=hidden, encoder_hidden_states=text,
                                      temb=temb, image_rotary_emb=(cos, sin))  # fmt: skip
            return hidden, text, temb, cos, sin

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_out, self.proj_out = flux.norm_out, flux.proj_out

        def forward(self, hidden, text, temb, cos, sin):
            return self.proj_out(self.norm_out(hidden, temb))

    blocks = [*flux.transformer_blocks, *flux.single_transformer_blocks]
    chunks = [Stem(), *(Block(b) for b in blocks), Head()]
    om = ramtorch.OffloadModel(chunks, device=device, window=2, keep_activations="checkpoint")
    return om, torch.optim.AdamW(om.parameters(), lr=1e-5, fused=True)


def _fmt(x, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if x is None else format(x / scale, spec)


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# Flux-dev-shaped DiT fine-tune at 1024x1024, {meta['device_name']}, {meta['date']}",
        "",
        f"`{meta['command']}`; GPU budget {meta['gpu_memory']} (ramflow's `gpu_memory` = "
        f"budget - {meta['activation_reserve']} for activations); host precision "
        f"`{meta['host_precision']}`.",
        "",
        "| case | params (B) | step (s) | set-up (s) | peak GPU alloc / reserved (GiB) "
        "| peak host RSS (GiB) | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["cases"]:
        note = r.get("error") or r.get("skipped") or ""
        lines.append(
            f"| {r['case']} | {_fmt(r.get('num_params'), 1e9)} | {_fmt(r.get('step_s'), spec='.3f')}"
            f" | {_fmt(r.get('setup_s'), spec='.1f')} | {_fmt(r.get('peak_bytes'), GIB)} / "
            f"{_fmt(r.get('peak_reserved_bytes'), GIB)} | {_fmt(r.get('peak_rss_bytes'), GIB)} "
            f"| {note[:120]} |"
        )
    by = {r["case"]: r for r in result["cases"] if r.get("step_s")}
    if "resident-small" in by:
        base = by["resident-small"]["step_s"]
        for name in ("ramflow-small", "ramtorch-small"):
            if name in by:
                lines.append(f"\n{name} / resident-small: {by[name]['step_s'] / base:.2f}x")
    if "ramflow-small" in by and "ramtorch-small" in by:
        ratio = by["ramtorch-small"]["step_s"] / by["ramflow-small"]["step_s"]
        lines.append(f"\nramtorch-small / ramflow-small: {ratio:.2f}x")
    lines.append("\nThe 12B does not fit resident on 80 GB, nor RamTorch's fp32 state in 128 GiB "
                 "of host RAM (about 190 GB each); both are compared at the smaller depth.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out-dir", type=Path, required=True, help="where the results go")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    p.add_argument("--tiny", action="store_true", help="a tiny Flux and 16 image tokens")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    p.add_argument("--gpu-memory", default="24GiB", help="the GPU budget of the whole step")
    p.add_argument("--activation-reserve", default="6GiB",
                   help="what the budget keeps for activations (ramflow's gpu_memory is the rest)")  # fmt: skip
    p.add_argument("--host-precision", default="auto", help="ramflow's host format")
    p.add_argument("--device-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="ramflow.offload's device_optimizer: auto (the planner's), on, off")  # fmt: skip
    p.add_argument("--small-double", type=int, default=4, help="double blocks of the small model")
    p.add_argument("--small-single", type=int, default=8, help="single blocks of the small model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=330, help="wall-clock budget of the run")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a child process's one case
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; choose from {CASES}")
    if args.case:
        # a case that hangs (a lost CUDA context does) prints its Python stacks before the
        # parent's timeout kills it
        deadline = float(os.environ.get("DIT_CASE_TIMEOUT_S", "0"))
        if deadline > 30:
            faulthandler.dump_traceback_later(deadline - 15, exit=False)
        print("RESULT " + json.dumps(run_case(args), default=str), flush=True)
        return 0

    start = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.out_dir / "dit_flux.log", "w")  # noqa: SIM115 - open for the whole run
    result = {"meta": _meta(args, argv), "cases": []}
    for case in args.cases.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            result["cases"].append({"case": case, "skipped": "the run's --budget-s is spent"})
            continue
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--case", case]  # fmt: skip
        log.write(f"\n=== {case}: {' '.join(cmd)}\n")
        log.flush()
        rec = {"case": case}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1",
                                       "DIT_CASE_TIMEOUT_S": f"{left:.0f}"})  # fmt: skip
            log.write(proc.stdout + proc.stderr)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if found:
                rec = json.loads(found[-1][len("RESULT ") :])
            elif "No module named 'ramtorch'" in proc.stderr:
                rec["skipped"] = "RamTorch is not installed (carry its wheel)"
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                rec["error"] = f"exit {proc.returncode}: {' '.join(tail)}"
        except subprocess.TimeoutExpired as err:
            for out in (err.stdout, err.stderr):  # what the case printed before the kill
                if out:
                    log.write(out.decode(errors="replace") if isinstance(out, bytes) else out)
            rec["error"] = f"timed out after {left:.0f} s (--budget-s)"
        log.flush()
        print(json.dumps({k: rec.get(k) for k in ("case", "step_s", "peak_bytes", "error",
                                                  "skipped")}), flush=True)  # fmt: skip
        result["cases"].append(rec)
        (args.out_dir / "dit_flux.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out_dir / "dit_flux.md").write_text(markdown(result))
    log.close()
    print(markdown(result))
    return 0


def _meta(args: argparse.Namespace, argv: list[str] | None) -> dict:
    import torch

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    return {
        "command": "python benchmarks/dit/dit_flux.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": date.today().isoformat(),
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "commit": os.environ.get("RAMFLOW_BENCH_COMMIT"),
        "gpu_memory": args.gpu_memory,
        "activation_reserve": args.activation_reserve,
        "host_precision": args.host_precision,
    }


if __name__ == "__main__":
    sys.exit(main())
