"""A Llama-3.1-70B shape on one GPU: inference and LoRA with compressed frozen weights
(issue 16, point 5).

The model is built on the meta device, frozen, and materialized unit by unit straight into
ramflow's host store from a random init (``offload(weights=fn)``), so its full-precision
size is never in host RAM. Measured, each against its floor:

* inference: prefill of 1 x 2048 and decode steps at batch 1 and 32, each against the PCIe
  floor of the bytes it streams (the H2D rate is measured in the same run, pinned);
* LoRA (rank 16, attention and MLP projections, Hugging Face's activation checkpointing):
  1 x 2048 per step within 24 GiB of GPU in all (against its PCIe floor: the streamed bytes
  of forward and backward), and 4 x 2048 within 32 GiB (model FLOP/s, counting 4 x
  parameters x tokens, against the measured bf16 matmul rate). ramflow's own budget
  (``--gpu-memory``, default 16 GiB) leaves the rest to activations; the GPU peak of each
  case is reported against its limit;
* host RSS peak and GPU peak; ``--peer accelerate``: accelerate's ``device_map="auto"``
  offload of the same shape, or its failure.

``--lora-variants`` times the LoRA cases once per variant, each on top of the ones before
it, on one model: ``stock`` (Hugging Face's Llama and PEFT's LoRA as they come), ``fused``
(``ramflow.helpers.fuse_lora``: the rank-r update written in the frozen matmul's epilogue),
``liger`` (also Liger Kernel's RMSNorm, SwiGLU and RoPE, ``apply_liger_kernel_to_llama``;
needs ``liger-kernel``).

``--frozen-format bf16`` keeps frozen weights in the wire dtype. Writes ``lora_70b.json`` and ``lora_70b.md`` under ``--out-dir``;
``--smoke`` runs a tiny shape on the CPU (tested in CI).

    python benchmarks/lora_70b/lora_70b.py --shape llama-3.1-70b --frozen-format int8 --out-dir DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402

import measure  # noqa: E402
import ramflow  # noqa: E402
from measure import matmul_rate  # noqa: E402
from models import ChunkedLossHead  # noqa: E402

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256),
    "tiny": (64, 128, 2, 4, 2, 128),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 1 << 30
LOSS_CHUNK = 2048  # tokens per chunk of the LoRA step's loss


def llama_config(shape: str, layers: int | None = None):
    """The shape's ``LlamaConfig``, with ``layers`` decoder layers when given (a shorter
    model of the same units, for a quick check)."""
    from transformers import LlamaConfig

    hidden, inter, shape_layers, heads, kv, vocab = SHAPES[shape]
    layers = layers or shape_layers
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


_PATTERN_ELEMENTS = 1 << 24


@functools.cache
def _pattern() -> torch.Tensor:
    """16 M normal values (std 0.02, fixed seed), drawn once."""
    return torch.randn(_PATTERN_ELEMENTS, generator=torch.Generator().manual_seed(0)) * 0.02


def random_init(name: str, out: torch.Tensor) -> None:
    """Weights for a benchmark: norms at one, the rest normal values of std 0.02, tiled
    from one block of 16 M draws (PyTorch's CPU ``normal_`` runs on one thread: drawing 70 B
    values would take minutes; for speed only the values' scale matters)."""
    if out.dim() == 1:
        out.fill_(1.0)
        return
    flat = out.view(-1)
    src = _pattern().to(out.dtype)
    for lo in range(0, flat.numel(), src.numel()):
        hi = min(flat.numel(), lo + src.numel())
        flat[lo:hi].copy_(src[: hi - lo])


def build(
    shape: str,
    *,
    device: str,
    gpu_memory: str | None,
    frozen_format: str | None,
    lora_rank: int | None = None,
    layers: int | None = None,
):
    """The frozen model of ``shape`` on the meta device, with PEFT's LoRA (rank
    ``lora_rank``, attention and MLP projections) when given, offloaded and materialized
    unit by unit into the store; the adapters are made on the device by ``offload``
    (PEFT's default init) and planned with the units. Returns the model and the seconds."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    # parameters on the meta device, buffers (rotary frequencies) computed on the CPU
    with init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM(llama_config(shape, layers))
        # the loss in checkpointed chunks: fp32 logits of 4 x 2048 tokens over 128k would
        # take 4 GiB, their gradient as much again (see lora_step)
        model.lm_head = ChunkedLossHead(model.lm_head, LOSS_CHUNK)
    model.requires_grad_(False)
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        # the budget holds no full activations at 70B; non-reentrant, so the adapters get
        # gradients although no checkpointed input requires one
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                            target_modules=LORA_TARGETS, lora_dropout=0.0)  # fmt: skip
        model = get_peft_model(model, config)
    options: dict[str, Any] = {"device": device, "gpu_memory": gpu_memory}
    if frozen_format is not None:
        options["frozen_format"] = frozen_format
    t0 = time.perf_counter()
    ramflow.offload(model, weights=random_init, **options)
    return model, time.perf_counter() - t0


def streamed_bytes(model) -> int:
    """Bytes one pass copies host to device: every unit that is not resident, as it
    crosses PCIe (compressed, where its frozen weights are)."""
    plan = ramflow.get_plan(model)
    resident = set(plan.resident)
    sizes = getattr(plan, "unit_h2d_bytes", None) or plan.unit_bytes
    return sum(b for n, b in zip(plan.unit_names, sizes) if n not in resident)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class LinkProbe:
    """The pinned H2D rate of the link right now: one copy of ``nbytes`` from a pinned host
    buffer into a device buffer made for the copy and freed after it (so it adds nothing
    to a case's GPU peak, which is reached while the model runs, not between runs).

    Taken before and after every timed call (``timed(..., probe=...)``): the link's rate
    moved between 42 and 55 GB/s within one session on the H100 box (copies of the same
    unit, 2026-11-24), so a floor from a rate taken minutes earlier misjudges a step by as
    much. The mean of the two rates beside a call is that call's floor rate."""

    def __init__(self, device: str, nbytes: int = GIB) -> None:
        self.device = torch.device(device)
        self.nbytes = nbytes
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)

    def rate(self) -> float:
        dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        dev.copy_(self.host, non_blocking=True)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        del dev
        return self.nbytes / seconds


def timed(
    fn,
    device: str,
    repeat: int,
    times: list[float] | None = None,
    *,
    probe: LinkProbe | None = None,
    rates: list[float] | None = None,
) -> float:
    """Median seconds of ``fn`` over ``repeat`` calls after one warm-up (the upper middle
    one for an even ``repeat``); every call's seconds are appended to ``times`` and, with a
    ``probe``, the link's rate beside each call (see ``LinkProbe``) to ``rates``."""
    fn()
    times = [] if times is None else times
    rates = [] if rates is None else rates
    for _ in range(repeat):
        before = probe.rate() if probe is not None else None
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if probe is not None:
            rates.append((before + probe.rate()) / 2)
    return sorted(times)[len(times) // 2]


def adjacent(bytes_moved: int, times: list[float], rates: list[float]) -> dict[str, Any]:
    """Each call's time over the PCIe floor at the rate measured beside it: the median
    and the best ratio, and the rates (GB/s)."""
    ratios = sorted(t * r / bytes_moved for t, r in zip(times, rates))
    if not ratios:
        return {}
    return {
        "x_floor_adjacent_median": ratios[len(ratios) // 2],
        "x_floor_adjacent_best": ratios[0],
        "adjacent_rates_gbps": [round(r / 1e9, 1) for r in rates],
    }


def gpu_peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None


def inference(model, args, device: str, rate: float | None, probe=None) -> dict[str, Any]:
    """Prefill and decode steps of the offloaded ``model``, each against the PCIe floor of
    the bytes one pass streams: at ``rate`` (measured at the start) and, with a ``probe``,
    at the rate measured beside each call."""
    model.eval()
    per_pass = streamed_bytes(model)
    floor = None if rate is None else per_pass / rate
    vocab = SHAPES[args.shape][5]
    out: dict[str, Any] = {"streamed_bytes_per_pass": per_pass}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, args.seq_len), device=device)
        runs: list[float] = []
        rates: list[float] = []
        fn = functools.partial(model, input_ids=ids, use_cache=False)
        t = timed(fn, device, args.repeat, runs, probe=probe, rates=rates)
        out["prefill"] = {"tokens": args.seq_len, "seconds": t, "floor_s": floor, "runs_s": runs}
        out["prefill"].update(adjacent(per_pass, runs, rates))
        for batch in (1, 32):
            prompt = torch.randint(0, vocab, (batch, 16), device=device)
            cache = model(input_ids=prompt, use_cache=True).past_key_values
            nxt = torch.randint(0, vocab, (batch, 1), device=device)

            def step(cache=cache, nxt=nxt):
                model(input_ids=nxt, past_key_values=cache, use_cache=True)

            runs, rates = [], []
            t = timed(step, device, args.repeat, runs, probe=probe, rates=rates)
            row = {"seconds_per_token": t, "floor_s": floor, "runs_s": runs}
            out[f"decode_b{batch}"] = row | adjacent(per_pass, runs, rates)
    out["gpu_peak_bytes"] = gpu_peak(device)
    return out


def copy_engine_trace(model, args, device: str, out_dir: Path) -> dict[str, Any]:
    """One prefill and one batch-1 decode step under ``torch.profiler``: for each, the H2D
    copies (count, bytes, summed time, the rate of the copies themselves), the wall from the
    first copy's start to the last one's end, the share of that wall the H2D engine was
    busy, and the longest gaps between copies with the kernels that ran meanwhile. Tells a
    slow link (copies slower than the measured pinned rate) from an idle one (gaps)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = SHAPES[args.shape][5]
    calls = {}
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, args.seq_len), device=device)
        calls["prefill"] = lambda: model(input_ids=ids, use_cache=False)
        prompt = torch.randint(0, vocab, (1, 16), device=device)
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        nxt = torch.randint(0, vocab, (1, 1), device=device)
        calls["decode_b1"] = lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True)
        out: dict[str, Any] = {}
        for name, fn in calls.items():
            fn()
            sync(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                sync(device)
            path = out_dir / f"trace-{name}.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
            out[name] = _copy_summary(events)
    return out


def copy_event_timeline(model, args, device: str) -> dict[str, Any]:
    """One prefill and one batch-1 decode step timed by CUDA events around each compressed
    unit's copy, without the profiler (which slows the host and so changes how far the
    loop runs ahead of the GPU): per call, the wall on the GPU, the copies' summed time
    (each from the H2D stream reaching it to its end, so a wait for a staging buffer
    counts in it), the time the H2D stream stood idle between two copies (the next one
    not yet issued by the host), the rate inside the copies, and the first copy's start."""
    from ramflow.transfer import streams as _streams

    original = _streams.CopyStreams.h2d_then
    records: list[tuple[Any, Any, int]] = []

    def timed_h2d_then(self, src, then, staging):
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.h2d_stream)
        event = original(self, src, then, staging)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.h2d_stream)
        records.append((begin, end, src.numel()))
        return event

    vocab = SHAPES[args.shape][5]
    out: dict[str, Any] = {}
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, args.seq_len), device=device)
        prompt = torch.randint(0, vocab, (1, 16), device=device)
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        nxt = torch.randint(0, vocab, (1, 1), device=device)
        calls = {
            "prefill": functools.partial(model, input_ids=ids, use_cache=False),
            "decode_b1": functools.partial(
                model, input_ids=nxt, past_key_values=cache, use_cache=True
            ),
        }
        _streams.CopyStreams.h2d_then = timed_h2d_then
        try:
            for name, fn in calls.items():
                runs = []
                for _ in range(3):
                    records.clear()
                    sync(device)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    stop = torch.cuda.Event(enable_timing=True)
                    stop.record()
                    sync(device)
                    copies = [b.elapsed_time(e) for b, e, _ in records]
                    idle = [
                        e.elapsed_time(b2) for (_, e, _), (b2, _, _) in zip(records, records[1:])
                    ]
                    nbytes = sum(n for _, _, n in records)
                    runs.append({
                        "wall_ms": round(start.elapsed_time(stop), 2),
                        "copies": len(records),
                        "copy_ms": round(sum(copies), 2),
                        "idle_between_copies_ms": round(sum(max(0.0, x) for x in idle), 2),
                        "rate_in_copies_gbps": round(nbytes / sum(copies) / 1e6, 2) if copies else None,
                        "first_copy_at_ms": round(start.elapsed_time(records[0][0]), 2) if records else None,
                        "after_last_copy_ms": round(records[-1][1].elapsed_time(stop), 2) if records else None,
                        "longest_copies_ms": sorted(round(c, 2) for c in copies)[-3:],
                    })  # fmt: skip
                out[name] = runs
        finally:
            _streams.CopyStreams.h2d_then = original
    return out


def _copy_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """See ``copy_engine_trace``; times in the trace's microseconds."""
    h2d = sorted(
        (e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not h2d:
        return {"copies": 0}
    busy = sum(e["dur"] for e in h2d)
    nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in h2d)
    wall = h2d[-1]["ts"] + h2d[-1]["dur"] - h2d[0]["ts"]
    gaps = []
    for a, b in zip(h2d, h2d[1:]):
        lo, hi = a["ts"] + a["dur"], b["ts"]
        if hi - lo > 20:
            during = [k["name"][:60] for k in kernels if k["ts"] < hi and k["ts"] + k["dur"] > lo]
            gaps.append({"us": round(hi - lo, 1), "after_bytes": a.get("args", {}).get("bytes"),
                         "kernels": sorted(set(during))[:4]})  # fmt: skip
    gaps.sort(key=lambda g: -g["us"])
    big = [e for e in h2d if int(e.get("args", {}).get("bytes", 0)) >= 1 << 24]
    return {
        "copies": len(h2d),
        "bytes": nbytes,
        "copy_busy_us": round(busy, 1),
        "first_to_last_us": round(wall, 1),
        "busy_share": round(busy / wall, 4) if wall else None,
        "rate_in_copies_gbps": round(nbytes / busy / 1e3, 2) if busy else None,
        "rate_of_large_copies_gbps": sorted(
            round(int(e["args"]["bytes"]) / e["dur"] / 1e3, 1) for e in big
        ),
        "gaps_over_20us": len(gaps),
        "gap_sum_us": round(sum(g["us"] for g in gaps), 1),
        "longest_gaps": gaps[:8],
    }


def make_lora_step(peft_model, opt, ids: torch.Tensor, device: str):
    """One LoRA training step of ``peft_model`` (built by ``build``) on the token ids
    ``ids`` (batch, seq_len) under bf16 autocast: forward with the chunked loss, backward,
    ``opt.step()``, ``opt.zero_grad()``. Returns a function that runs it and returns the
    loss (a 0-dim fp32 tensor on ``device``)."""
    head = peft_model.get_base_model().lm_head

    def step() -> torch.Tensor:
        head.labels_BT = ids  # the forward returns the chunked loss as its "logits"
        try:
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                loss = peft_model(input_ids=ids).logits
        finally:
            head.labels_BT = None
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def lora_step(peft_model, model, args, device: str, batch: int, rate, flops, probe=None) -> dict:
    """Timed LoRA steps of ``batch`` x ``args.seq_len`` tokens on the offloaded model."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    peft_model.train()  # inference() left it in eval mode, where checkpointing is off
    opt = ramflow.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    vocab = SHAPES[args.shape][5]
    ids = torch.randint(0, vocab, (batch, args.seq_len), device=device)

    step = make_lora_step(peft_model, opt, ids, device)
    runs: list[float] = []
    rates: list[float] = []
    t = timed(step, device, args.repeat, runs, probe=probe, rates=rates)
    # LoRA's B matrices start at zero: every one moved iff gradients reached every adapter
    moved = [bool(p.count_nonzero()) for n, p in peft_model.named_parameters() if "lora_B" in n]
    per_pass = streamed_bytes(model)
    num_params = sum(p.numel() for p in model.parameters())
    tokens = batch * args.seq_len
    return {
        "batch": batch,
        "tokens": tokens,
        "gpu_memory": args.gpu_memory,
        "gpu_limit_gib": {1: 24, 4: 32}.get(batch),
        "step_s": t,
        "streamed_bytes_per_step": 2 * per_pass,  # forward and backward
        "floor_s": None if rate is None else 2 * per_pass / rate,
        "runs_s": runs,
        **adjacent(2 * per_pass, runs, rates),
        "model_flops_per_s": 4 * num_params * tokens / t,
        "matmul_flops_per_s": flops,
        "adapter_parameters": sum(p.numel() for p in opt.param_groups[0]["params"]),
        "adapters_trained": f"{sum(moved)} of {len(moved)}",
        "gpu_peak_bytes": gpu_peak(device),
    }


def apply_variant(peft_model, variant: str) -> None:
    """Make ``peft_model`` the LoRA ``variant`` (see ``--lora-variants``), in place."""
    if variant == "stock":
        return
    if variant not in ("fused", "liger"):
        raise ValueError(f"unknown LoRA variant {variant!r}: stock, fused or liger")
    ramflow.helpers.fuse_lora(peft_model)
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,  # the benchmark's head computes its chunked loss
            model=peft_model.get_base_model(),
        )


def _run_accelerate(args, device: str, max_memory: dict) -> dict[str, Any]:
    """The shape built in bf16 on the CPU and dispatched by accelerate, in a child process
    (for shapes whose bf16 weights fit in RAM): one timed prefill."""
    code = f"""
import json, time, torch, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from lora_70b import llama_config, SHAPES
from accelerate import dispatch_model, infer_auto_device_map
from transformers import LlamaForCausalLM
model = LlamaForCausalLM(llama_config({args.shape!r})).to(torch.bfloat16).eval()
gpu = {device!r}.startswith("cuda")
device_map = infer_auto_device_map(model, max_memory={max_memory!r}, dtype=torch.bfloat16)
model = dispatch_model(model, device_map=device_map)
ids = torch.randint(0, SHAPES[{args.shape!r}][5], (1, {args.seq_len}))
with torch.no_grad():
    model(input_ids=ids)
    if gpu: torch.cuda.synchronize()
    t0 = time.perf_counter(); model(input_ids=ids)
    if gpu: torch.cuda.synchronize()
print(json.dumps({{"prefill_s": time.perf_counter() - t0}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    return {
        "returncode": proc.returncode,
        "result": json.loads(last[0]) if last else None,
        "error": None if proc.returncode == 0 else (proc.stderr[-1500:] or "killed"),
    }


def accelerate_peer(args, device: str) -> dict[str, Any]:
    """accelerate's ``device_map="auto"`` offload of the same shape, as far as this host
    allows: the model on the meta device, ``infer_auto_device_map`` with the GPU budget and
    the host's available RAM (less 8 GiB for the process), then what the map needs. Its
    modules on "cpu" need their bf16 bytes in RAM; those on "disk" need a bf16 checkpoint
    of theirs on disk to be offloaded from (``offload_folder``). The run is tried only
    when the whole bf16 model fits in RAM (it is built there, then dispatched), else the
    reason is the result."""
    import shutil

    import psutil
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(llama_config(args.shape))
    avail = psutil.virtual_memory().available - 8 * GIB
    gpu = device.startswith("cuda")
    max_memory = {"cpu": max(avail, 0)}
    if gpu:
        max_memory[0] = args.gpu_memory or "24GiB"
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=torch.bfloat16)
    placed: dict[str, int] = {}
    modules = dict(model.named_modules())
    for name, where in device_map.items():
        nbytes = sum(p.numel() * 2 for p in modules[name].parameters()) if name else 0
        placed[str(where)] = placed.get(str(where), 0) + nbytes
    disk_free = shutil.disk_usage(args.out_dir.resolve().anchor).free
    out = {
        "max_memory": {str(k): v for k, v in max_memory.items()},
        "bf16_bytes_by_device": placed,
        "disk_free_bytes": disk_free,
        "result": None,
        "returncode": None,
    }
    need_disk = placed.get("disk", 0)
    total = sum(placed.values())
    if need_disk == 0 and total <= avail:
        out.update(_run_accelerate(args, device, max_memory))
        return out
    out["error"] = (
        f"device_map='auto' places {placed.get('0', 0) / GIB:.0f} GiB of bf16 weights on the "
        f"GPU, {placed.get('cpu', 0) / GIB:.0f} GiB in host RAM and {need_disk / GIB:.0f} GiB "
        f"on disk: it loads them with from_pretrained from a checkpoint of "
        f"{total / GIB:.0f} GiB, which this box's {disk_free / GIB:.0f} GiB of free disk "
        f"cannot hold, and building them in memory first needs the whole {total / GIB:.0f} "
        f"GiB in RAM ({avail / GIB:.0f} GiB available)"
    )
    return out


def ratio(t: float | None, floor: float | None) -> str:
    return "-" if t is None or not floor else f"{t / floor:.2f}x"


def markdown(r: dict[str, Any]) -> str:
    m = r["meta"]
    lines = [
        f"# {m['shape']} ({m.get('layers', '-')} layers) on one device ({m['device']}), "
        f"frozen weights {m['frozen_format']}",
        "",
        f"H2D {m['h2d_gbps'] or '-'} GB/s pinned, bf16 matmul {m['matmul_tflops'] or '-'} "
        f"TFLOP/s, host RSS peak {r['host_rss_peak_bytes'] / GIB:.1f} GiB",
        "",
        "| case | time | floor | vs floor | vs floor at the adjacent rate (median, best) "
        "| target | GPU peak |",
        "|---|---|---|---|---|---|---|",
    ]

    def peak(x):
        return "-" if x is None else f"{x / GIB:.1f} GiB"

    def near(row):
        if "x_floor_adjacent_median" not in row:
            return "-"
        return f"{row['x_floor_adjacent_median']:.2f}x, {row['x_floor_adjacent_best']:.2f}x"

    inf = r.get("inference")
    if inf:
        for name, key, target in (
            ("prefill 1x" + str(m["seq_len"]), "prefill", "<= 1.1x"),
            ("decode b1 (per token)", "decode_b1", "<= 1.1x"),
            ("decode b32 (per token)", "decode_b32", "<= 1.1x"),
        ):
            row = inf[key]
            t = row.get("seconds", row.get("seconds_per_token"))
            lines.append(
                f"| {name} | {t:.3f} s | {row['floor_s'] or 0:.3f} s | "
                f"{ratio(t, row['floor_s'])} | {near(row)} | {target} | "
                f"{peak(inf['gpu_peak_bytes'])} |"
            )
    for row in r.get("lora", []):
        name = f"LoRA r{m['lora_rank']} {row['batch']}x{m['seq_len']} (ramflow {row['gpu_memory']})"
        if row.get("variant", "stock") != "stock":
            name += f", {row['variant']}"
        if row["batch"] == 1:
            cmp, target = ratio(row["step_s"], row["floor_s"]), "<= 1.15x"
        else:
            frac = (
                row["model_flops_per_s"] / row["matmul_flops_per_s"]
                if row["matmul_flops_per_s"]
                else None
            )
            cmp = "-" if frac is None else f"{frac:.2f} of matmul"
            target = ">= 0.45 of matmul"
        if row.get("gpu_limit_gib"):
            target += f", GPU <= {row['gpu_limit_gib']} GiB"
        lines.append(
            f"| {name} | {row['step_s']:.3f} s | {row['floor_s'] or 0:.3f} s | {cmp} | "
            f"{near(row) if row['batch'] == 1 else '-'} | {target} | {peak(row['gpu_peak_bytes'])} |"
        )
    if "peer" in r:
        p = r["peer"]
        what = (
            f"prefill {p['result']['prefill_s']:.3f} s"
            if p["result"]
            else f"does not run: {p.get('error') or 'rc ' + str(p['returncode'])}"
        )
        lines.append(f"| accelerate device_map=auto | {what} | - | - | - | - | - |")
    lines += [f"\n{note}" for note in r["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.1-70b")
    p.add_argument("--frozen-format", choices=["bf16", "int8", "nf4"], default="int8")
    p.add_argument("--part", choices=["all", "inference", "lora"], default="all")
    p.add_argument("--peer", choices=["accelerate"], default=None, help="run the peer only")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--gpu-memory",
        default="16GiB",
        help="ramflow's device budget, one plan for every case (activations come on top)",
    )
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick check)")
    p.add_argument(
        "--lora-variants",
        default="stock",
        help="comma-separated, cumulative, in this order: stock, fused, liger (see above)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    p.add_argument(
        "--compare-waits",
        action="store_true",
        help="run inference again with spinning waits (ramflow.transfer.streams._BLOCKING = False)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="profile one prefill and one decode step: the copy engine's busy share and gaps",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.seq_len, args.repeat = "tiny", "cpu", 32, 1
        args.lora_rank = 4
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    notes: list[str] = []
    wanted = None if args.frozen_format == "bf16" else args.frozen_format
    args.frozen_format = wanted
    if device == "cpu":
        args.gpu_memory = None
    dev = torch.device(device)
    rate, flops = measure.pinned_bandwidth(dev)["h2d"], matmul_rate(dev)
    probe = LinkProbe(device) if device.startswith("cuda") else None
    result: dict[str, Any] = {
        "meta": {
            "shape": args.shape,
            "layers": args.layers or SHAPES[args.shape][2],
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "frozen_format": wanted or "bf16",
            "seq_len": args.seq_len,
            "lora_rank": args.lora_rank,
            "h2d_gbps": None if rate is None else round(rate / 1e9, 1),
            "matmul_tflops": None if flops is None else round(flops / 1e12, 1),
        },
        "notes": notes,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "lora_70b" + ("-accelerate" if args.peer else "")

    def write() -> None:
        # after every stage, so that a run cut short keeps what it measured
        result["host_rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out_dir / f"{stem}.md").write_text(markdown(result))

    if args.peer == "accelerate":
        result["peer"] = accelerate_peer(args, device)
    else:
        # one model for every case: a 70B shape takes minutes to materialize
        model, result["load_s"] = build(
            args.shape,
            device=device,
            gpu_memory=args.gpu_memory,
            frozen_format=wanted,
            lora_rank=args.lora_rank if args.part in ("all", "lora") else None,
            layers=args.layers,
        )
        result["plan"] = ramflow.get_plan(model).describe()
        write()
        print(result["plan"], flush=True)
        if args.part in ("all", "inference"):
            result["inference"] = inference(model, args, device, rate, probe)
            write()
            if args.compare_waits and device.startswith("cuda"):
                from ramflow.transfer import streams as _streams

                _streams._BLOCKING = False
                try:
                    result["inference_spinning_waits"] = inference(model, args, device, rate, probe)
                    write()
                    if args.trace:
                        result["copy_events_spinning_waits"] = copy_event_timeline(
                            model, args, device
                        )
                finally:
                    _streams._BLOCKING = True
                result["inference_sleeping_waits_again"] = inference(
                    model, args, device, rate, probe
                )
                write()
            if args.trace and device.startswith("cuda"):
                result["copy_events"] = copy_event_timeline(model, args, device)
                write()
                result["copy_trace"] = copy_engine_trace(model, args, device, args.out_dir)
                write()
        if args.part in ("all", "lora"):
            result["lora"] = []
            for variant in args.lora_variants.split(","):
                apply_variant(model, variant)
                for batch in (1, 4):
                    row = lora_step(model, model, args, device, batch, rate, flops, probe)
                    result["lora"].append({"variant": variant, **row})
                    write()
    write()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
