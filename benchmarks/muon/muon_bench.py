"""Muon under offload (issue 33, point 3): what the orthogonalization costs, and parity.

Three parts, one process, written to ``--out-dir`` as ``muon.json``, ``muon.md`` and
``muon.log``:

1. ``ns``: the Newton-Schulz iteration (``torch.optim.Muon``'s, bf16, 5 steps) of each
   matrix shape of one Llama-3-8B layer on the device: median time, TFLOP/s, peak device
   memory above the input; and one 1024 x 4096 matrix on the host CPU (why the iteration
   runs on the device).
2. ``layer``: one Llama-3-8B layer's Muon step as ramflow runs it for an offloaded unit
   (host fp32 masters and gradients; blend on the host, iteration on the device, apply
   on the host; ``ramflow.optim.Muon``), split into its host and device parts, against
   AdamW over the same tensors (PyTorch's fused CPU AdamW, what ramflow's AdamW runs for
   plain parameters; its native one-pass kernel for offloaded units is faster), and the
   host parts as ``torch.optim.Muon``'s ops compute them. With ``--device cpu`` only the
   host parts (the ratio to fused AdamW is the figure that carries between machines).
3. ``train``: a Llama of ``--layers`` layers of the 8B's width offloaded with ramflow
   (bf16 wire, fp32 masters, ``--gpu-memory``), ``--steps`` steps of ``--batch`` x
   ``--seq`` tokens with ``ramflow.optim.Muon`` and with ``ramflow.optim.AdamW``, and the
   same model resident with ``torch.optim.Muon`` + ``torch.optim.AdamW`` (the reference):
   median step time after the warm-ups, peak device memory, and the loss of each step
   of the offloaded Muon run against the resident reference's (same init, same data).

GPU box (H100/H200, 16 cores; about 4 minutes):

    PYTHONUNBUFFERED=1 python3 benchmarks/muon/muon_bench.py --out-dir $OUT/muon

CPU smoke test (tiny shapes, a few seconds), and the host parts of the real layer
on a development machine (about 6 GB of RAM, a minute on 2 cores):

    python benchmarks/muon/muon_bench.py --device cpu --tiny --out-dir /tmp/muon-smoke
    python benchmarks/muon/muon_bench.py --device cpu --parts layer --out-dir /tmp/muon-host
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

import ramflow  # noqa: E402
from ramflow.optim.muon import _Orthogonalizer  # noqa: E402

# (name, rows, cols) of one Llama-3-8B layer's matrices (out_features, in_features)
LLAMA_8B_LAYER = [
    ("q_proj", 4096, 4096),
    ("k_proj", 1024, 4096),
    ("v_proj", 1024, 4096),
    ("o_proj", 4096, 4096),
    ("gate_proj", 14336, 4096),
    ("up_proj", 14336, 4096),
    ("down_proj", 4096, 14336),
]
TINY_LAYER = [("q_proj", 64, 64), ("k_proj", 32, 64), ("up_proj", 128, 64), ("down_proj", 64, 128)]
LOG: list[str] = []
PARTS = ("ns", "layer", "train")
# DRAM bytes per element of each host part of ``layer`` (reads + writes)
BYTES_PER_ELEMENT = dict(blend=14, apply=10, adamw_fused_cpu=28, copy=8)


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def ns_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Matmul FLOPs of the iteration on an m x n matrix (m <= n): per step X X^T (2 m^2 n),
    B = bA + cA A (2 m^3), B X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, *, repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def part_ns(device: torch.device, shapes, *, repeat: int) -> dict:
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS
    from torch.optim._muon import _zeropower_via_newtonschulz as ns

    coeffs = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    rows_out = []
    for name, r, c in shapes:
        x = torch.randn(r, c, device=device).bfloat16()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times = timed(lambda x=x: ns(x.clone(), coeffs, 5, EPS), device, repeat=repeat)
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        t = statistics.median(times)
        row = dict(
            matrix=name,
            shape=[r, c],
            ms=t * 1e3,
            tflops=ns_flops(r, c) / t / 1e12,
            peak_extra_bytes=peak,
        )
        rows_out.append(row)
        say(f"ns {name} {r}x{c}: {t * 1e3:.2f} ms, {row['tflops']:.1f} TFLOP/s, extra {peak}")
    cpu_shape = (1024, 4096) if device.type == "cuda" else shapes[0][1:]
    x = torch.randn(*cpu_shape).bfloat16()
    t = statistics.median(timed(lambda: ns(x.clone(), coeffs, 5, EPS), torch.device("cpu"),
                                repeat=1, warmup=0))  # fmt: skip
    say(f"ns on the host CPU {cpu_shape}: {t * 1e3:.1f} ms ({torch.get_num_threads()} threads)")
    return {"device": rows_out, "cpu": dict(shape=list(cpu_shape), ms=t * 1e3,
                                            threads=torch.get_num_threads())}  # fmt: skip


def part_layer(device: torch.device, shapes, *, repeat: int) -> dict:
    """One layer's Muon step over host tensors, and its parts, against fused CPU AdamW.

    Host parts, each over the layer's matrices: ``blend`` (ramflow's one-pass blend into
    the buffers the device reads), ``apply`` (its one-pass update), and, for comparison,
    the same arithmetic as ``torch.optim.Muon``'s ops (``torch_ops_*``: what ramflow ran
    before). ``device``: every matrix's upload, iteration and download in flight at once,
    read at the end. The whole step and the device part need CUDA (the iteration of a
    whole layer on the CPU takes minutes): with ``--device cpu`` only the host parts run.
    """
    from ramflow.kernels.muon_kernels import muon_apply_, muon_blend_, muon_kernel_available

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c, generator=gen) * 0.02) for _, r, c in shapes]
    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    numel = sum(p.numel() for p in params)
    orth = _Orthogonalizer(device)
    bufs = [torch.zeros_like(p) for p in params]
    blends = [orth.blend_buffer(p.shape) for p in params]
    outs = [torch.randn(p.shape).bfloat16() for p in params]

    def blend():
        for g, b, u in zip(grads, bufs, blends):
            muon_blend_(b, g, u, momentum_coef=0.95, nesterov=True)

    def apply():
        for p, o in zip(params, outs):
            muon_apply_(p.data, o, lr=1e-4, weight_decay=0.1, adjusted_lr=1e-4)

    def torch_ops_blend():
        for g, b in zip(grads, bufs):
            b.lerp_(g, 0.05)
            g.lerp(b, 0.95).bfloat16()

    def torch_ops_apply():
        for p, o in zip(params, outs):
            p.data.mul_(1 - 1e-5)
            p.data.add_(o, alpha=-1e-4)

    copies = [torch.empty_like(g) for g in grads]

    def copy():  # the DRAM yardstick: 8 bytes per element
        for g, c in zip(grads, copies):
            c.copy_(g)

    def device_part():
        jobs = [orth.submit(u, ns_steps=5) for u in blends]
        for job in jobs:
            job.result()

    out = dict(params=numel, native=muon_kernel_available(), threads=torch.get_num_threads())
    # the parts take turns, round by round, so a neighbour's load falls on all alike
    parts = dict(blend=blend, apply=apply, torch_ops_blend=torch_ops_blend,
                 torch_ops_apply=torch_ops_apply, copy=copy)  # fmt: skip
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
    parts["adamw_fused_cpu"] = adamw.step
    if device.type == "cuda":
        muon = ramflow.optim.Muon([{"params": params, "use_muon": True}], lr=1e-4)
        muon._orthogonalizer = lambda p: orth  # as for an offloaded unit on ``device``
        parts["muon"] = muon.step
        parts["device_roundtrip"] = device_part
    times: dict[str, list[float]] = {k: [] for k in parts}
    for fn in parts.values():
        timed(fn, device, repeat=0)  # warm-up: pages, pinned blocks, the library
    for _ in range(repeat):
        for name, fn in parts.items():
            times[name] += timed(fn, device, repeat=1, warmup=0)
    for name, ts in times.items():
        out[f"{name}_ms"] = statistics.median(ts) * 1e3
    for name, nbytes in BYTES_PER_ELEMENT.items():
        out[f"{name}_gb_per_s"] = numel * nbytes / out[f"{name}_ms"] * 1e-6
    out["host_ms"] = out["blend_ms"] + out["apply_ms"]
    out["torch_ops_host_ms"] = out["torch_ops_blend_ms"] + out["torch_ops_apply_ms"]
    say(
        f"layer ({numel / 1e6:.0f} M params, {out['threads']} threads, native "
        f"{out['native']}): host blend {out['blend_ms']:.0f} ms + apply {out['apply_ms']:.0f}"
        f" ({out['blend_gb_per_s']:.0f} and {out['apply_gb_per_s']:.0f} GB/s; copy "
        f"{out['copy_gb_per_s']:.0f}, AdamW {out['adamw_fused_cpu_gb_per_s']:.0f} GB/s)"
        f" (torch.optim.Muon's ops: {out['torch_ops_blend_ms']:.0f} + "
        f"{out['torch_ops_apply_ms']:.0f}); fused CPU AdamW {out['adamw_fused_cpu_ms']:.0f} ms;"
        f" host / AdamW {out['host_ms'] / out['adamw_fused_cpu_ms']:.2f} (torch ops "
        f"{out['torch_ops_host_ms'] / out['adamw_fused_cpu_ms']:.2f})"
    )
    if "muon_ms" in out:
        out["muon_gparams_per_s"] = numel / out["muon_ms"] * 1e-6
        say(f"layer: whole Muon step {out['muon_ms']:.0f} ms, device round trip of all "
            f"matrices {out['device_roundtrip_ms']:.0f} ms")  # fmt: skip
    return out


def llama(layers: int, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def run_steps(model, opt, data, device, *, autocast: bool) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for ids in data:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
        sync(device)
        times.append(time.perf_counter() - start)
    return losses, times


class _Pair:
    """torch.optim.Muon over the hidden matrices, torch.optim.AdamW over the rest (fused, as
    ramflow's AdamW steps on the CPU)."""

    def __init__(self, groups, lr: float) -> None:
        muon = [p for g in groups if g["use_muon"] for p in g["params"]]
        rest = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                for g in groups if not g["use_muon"]]  # fmt: skip
        self.opts = [
            torch.optim.Muon(muon, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True),
        ]

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


def part_train(device: torch.device, args) -> dict:
    base = llama(args.layers, args.tiny)
    gen = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    data = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
            for _ in range(args.steps)]  # fmt: skip
    params = sum(p.numel() for p in base.parameters())
    say(f"train: {params / 1e9:.2f} B params, {args.steps} steps of {args.batch}x{args.seq}")
    out: dict = {"params": params}
    lr = 3e-4
    autocast = device.type == "cuda"
    runs = [("resident_torch_muon", None), ("ramflow_muon", "muon"), ("ramflow_adamw", "adamw")]
    for name, kind in runs:
        model = copy.deepcopy(base)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if kind is None:
            if device.type == "cuda" and params * 16 > torch.cuda.mem_get_info(device)[0] * 0.8:
                say(f"{name}: skipped, does not fit")
                continue
            model.to(device)
            opt = _Pair(ramflow.optim.muon_param_groups(model, weight_decay=0.1), lr)
        else:
            wire = torch.bfloat16 if device.type == "cuda" else torch.float32
            kwargs = dict(device=device, wire_dtype=wire)
            if device.type == "cuda":
                kwargs["gpu_memory"] = args.gpu_memory
            ramflow.offload(model, **kwargs)
            groups = ramflow.optim.muon_param_groups(model, weight_decay=0.1)
            if kind == "muon":
                opt = ramflow.optim.Muon(groups, lr=lr)
            else:
                groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                          for g in groups]  # fmt: skip
                opt = ramflow.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
        losses, times = run_steps(model, opt, data, device, autocast=autocast)
        if kind is not None:
            ramflow.synchronize(model)
        timed_steps = times[args.warmup :] or times
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out[name] = dict(
            losses=losses,
            step_s=statistics.median(timed_steps),
            steps_s=times,
            peak_gpu_bytes=peak,
        )
        say(f"{name}: step {statistics.median(timed_steps):.3f} s, peak {peak}, losses "
            + " ".join(f"{x:.4f}" for x in losses))  # fmt: skip
        if kind is not None:
            ramflow.undo(model)
        del model, opt
    ref = out.get("resident_torch_muon")
    if ref is not None:
        diff = [abs(a - b) for a, b in zip(out["ramflow_muon"]["losses"], ref["losses"])]
        out["muon_loss_max_abs_diff"] = max(diff)
        say(f"ramflow Muon vs resident torch.optim.Muon: max |loss diff| {max(diff):.2e}")
    return out


def report(result: dict) -> str:
    lines = [f"# Muon under offload ({result['meta']['device']}, {result['meta']['date']})", ""]
    if "ns" in result:
        lines += ["## Newton-Schulz (bf16, 5 steps) per matrix of a Llama-3-8B layer", "",
                  "| matrix | shape | ms | TFLOP/s | extra device memory |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in result["ns"]["device"]:
            extra = (
                "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.0f} MiB"
            )
            lines.append(f"| {r['matrix']} | {r['shape'][0]}x{r['shape'][1]} | {r['ms']:.2f} | "
                         f"{r['tflops']:.1f} | {extra} |")  # fmt: skip
        c = result["ns"]["cpu"]
        lines += ["", f"On the host CPU ({c['threads']} threads), {c['shape'][0]}x{c['shape'][1]}: "
                  f"{c['ms']:.0f} ms.", ""]  # fmt: skip
    la = result.get("layer")
    if la:
        whole = f"{la['muon_ms']:.0f}" if "muon_ms" in la else "-"
        dev = f"{la['device_roundtrip_ms']:.0f}" if "device_roundtrip_ms" in la else "-"
        adamw = la["adamw_fused_cpu_ms"]
        lines += [
            f"## One layer's step over host tensors ({la['threads']} threads)", "",
            "| params | Muon (ms) | host blend | host apply | host / fused AdamW "
            "| device round trip | fused CPU AdamW (ms) |",
            "|---|---|---|---|---|---|---|",
            f"| {la['params'] / 1e6:.0f} M | {whole} | {la['blend_ms']:.0f} | "
            f"{la['apply_ms']:.0f} | {la['host_ms'] / adamw:.2f} | {dev} | {adamw:.0f} |",
            "",
            f"The same host arithmetic as torch.optim.Muon's ops: blend "
            f"{la['torch_ops_blend_ms']:.0f} ms + apply {la['torch_ops_apply_ms']:.0f} ms "
            f"({la['torch_ops_host_ms'] / adamw:.2f} x fused AdamW). Native passes: "
            f"{la['native']}. DRAM rates (bytes read and written): blend "
            f"{la['blend_gb_per_s']:.0f} GB/s, apply {la['apply_gb_per_s']:.0f}, fused AdamW "
            f"{la['adamw_fused_cpu_gb_per_s']:.0f}, an fp32 copy {la['copy_gb_per_s']:.0f}.",
            "",
        ]  # fmt: skip
    tr = result.get("train")
    if not tr:
        return "\n".join(lines) + "\n"
    lines += [
        "## Training steps",
        "",
        "| run | step (s) | peak GPU | final loss |",
        "|---|---|---|---|",
    ]
    for name in ("resident_torch_muon", "ramflow_muon", "ramflow_adamw"):
        r = tr.get(name)
        if r is None:
            lines.append(f"| {name} | skipped | | |")
            continue
        peak = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB"
        lines.append(f"| {name} | {r['step_s']:.3f} | {peak} | {r['losses'][-1]:.4f} |")
    if "muon_loss_max_abs_diff" in tr:
        lines += ["", f"Max |loss difference|, ramflow Muon vs resident torch.optim.Muon, per "
                  f"step: {tr['muon_loss_max_abs_diff']:.2e} (on CUDA: ramflow's bf16 wire "
                  "against autocast over fp32 weights, and Muon's bf16 iteration magnifying "
                  "rounding; docs/design.md, Muon; on the CPU: 0)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gpu-memory", default="12GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, of {','.join(PARTS)} (default: all)")  # fmt: skip
    args = ap.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        ap.error(f"--parts {args.parts}: choose from {','.join(PARTS)}")
    if args.tiny:
        args.layers, args.batch, args.seq = 2, 2, 32
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    meta = dict(device=name or "cpu", date=str(date.today()), torch=torch.__version__,
                argv=sys.argv, threads=torch.get_num_threads())  # fmt: skip
    say(json.dumps(meta))
    shapes = TINY_LAYER if args.tiny else LLAMA_8B_LAYER
    result = {"meta": meta}
    if "ns" in parts:
        result["ns"] = part_ns(device, shapes, repeat=args.repeat)
    if "layer" in parts:
        result["layer"] = part_layer(device, shapes, repeat=max(2, args.repeat // 2))
    if "train" in parts:
        result["train"] = part_train(device, args)
    (out_dir / "muon.json").write_text(json.dumps(result, indent=1))
    (out_dir / "muon.md").write_text(report(result))
    (out_dir / "muon.log").write_text("\n".join(LOG) + "\n")
    say(f"wrote {out_dir}/muon.json, muon.md, muon.log")


if __name__ == "__main__":
    main()
