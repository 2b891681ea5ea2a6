"""The memory toolkit's techniques measured on one model, in one run: what each saves, and
what it costs in step time (issue 18, point 6).

Legend: B = sequences per micro-batch, T = tokens per sequence, D = model width.

Every figure comes from the toolkit itself: peaks from ``ramflow.memory.MemoryTracker`` (the
device's ``max_memory_allocated``; host RSS for CPU-only training), saved activations from
``ramflow.memory.activation_report``, the checkpointing from ``ramflow.memory``'s policies and
``ramflow.offload(activation_checkpointing=...)``. A step is timed on the host between
``synchronize`` calls, after warm-up steps; the table gives the median.

Groups, each against its own baseline (the first row of the group):

- precision: fp32 training against bf16 autocast (the same fp32 weights);
- checkpointing (bf16): every block, every 2nd, by measured activation bytes under half the
  savings, ``checkpoint_sequential`` segments, selective (save matmuls, recompute the rest);
- gradient accumulation (bf16): B/4 sequences x 4 micro-batches against B in one;
- offload (bf16): ``ramflow.offload`` with ``ramflow.optim.AdamW``, plain and with every
  block checkpointed, against the resident model with fused AdamW;
- attention at 4k, 8k and 16k tokens (one block, B=1, bf16): eager softmax(QK^T)V against
  SDPA and ramflow's chunked attention;
- CPU only: the same model trained on the host's cores (fp32, fused CPU AdamW) against the
  GPU with offload, at the same shape.

The model is the benchmarks' reference model (``reference_model.py``: Llama-shaped, fused
QKV, SwiGLU, SDPA), cut to 8 blocks of width 2048 (536 M parameters) so the run takes about
three minutes on an H100; its blocks sit in an ``nn.Sequential`` so that segments apply.

Run (GPU box): ``python benchmarks/memory_toolkit/memory_toolkit.py --out-dir $OUT``; writes
``memory_toolkit.json`` and ``memory_toolkit.md`` there. ``--smoke``: tiny sizes on any
device (the CPU test runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path.insert(0, str(BENCH.parent / "src"))
sys.path.insert(0, str(BENCH))

import ramflow  # noqa: E402
from harness import _commit  # noqa: E402
from ramflow.memory import (  # noqa: E402
    CheckpointAll,
    CheckpointEveryKth,
    CheckpointSegments,
    CheckpointToBudget,
    MemoryTracker,
    SelectiveCheckpoint,
    activation_report,
    apply_checkpointing,
    chunked_attention,
    find_blocks,
)
from reference_model import Attention, Block, ReferenceConfig, ReferenceModel, fill_random_  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """The run's shapes.

    Attributes:
        model: the reference model's shape.
        batch: B of a training step.
        seq_len: T of a training step.
        attention_lengths: T of the attention comparison (B=1).
        attention_chunk: queries per chunk of the chunked attention.
        cpu_batch: B of the CPU-only comparison (T = ``seq_len``).
        warmup: untimed steps before each measurement.
        steps: timed steps per measurement.
    """

    model: ReferenceConfig
    batch: int
    seq_len: int
    attention_lengths: tuple[int, ...]
    attention_chunk: int
    cpu_batch: int
    warmup: int
    steps: int


FULL = Sizes(
    model=ReferenceConfig(num_layers=8, dim=2048, num_heads=16, ffn_dim=5504, vocab_size=32000),
    batch=4,
    seq_len=1024,
    attention_lengths=(4096, 8192, 16384),
    attention_chunk=1024,
    cpu_batch=1,
    warmup=2,
    steps=3,
)
SMOKE = Sizes(
    model=ReferenceConfig(num_layers=4, dim=32, num_heads=2, ffn_dim=64, vocab_size=128),
    batch=4,
    seq_len=16,
    attention_lengths=(64,),
    attention_chunk=16,
    cpu_batch=1,
    warmup=0,
    steps=1,
)


class SequentialReference(ReferenceModel):
    """The reference model with its blocks in an ``nn.Sequential`` called as one module
    (what ``checkpoint_sequential`` segments); the same parameters and computation."""

    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.Sequential(*self.layers)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(input_ids))), labels)


class AttentionVariant(nn.Module):
    """``reference_model.Attention`` with its core computed by SDPA, eagerly (scores and
    probabilities materialized, the textbook way) or by ``ramflow.memory.chunked_attention``."""

    def __init__(self, attn: Attention, impl: str, chunk: int) -> None:
        super().__init__()
        self.num_heads, self.qkv, self.out = attn.num_heads, attn.qkv, attn.out
        self.impl, self.chunk = impl, chunk

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        qkv = self.qkv(x_BTD).view(b, t, 3, self.num_heads, d // self.num_heads)
        q_BHTK, k_BHTK, v_BHTK = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.impl == "sdpa":
            y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        elif self.impl == "chunked":
            y_BHTK = chunked_attention(
                q_BHTK, k_BHTK, v_BHTK, chunk_size=self.chunk, is_causal=True
            )
        else:
            scores_BHTT = q_BHTK @ k_BHTK.transpose(-2, -1) / (d // self.num_heads) ** 0.5
            mask_TT = torch.ones(t, t, dtype=torch.bool, device=x_BTD.device).triu(1)
            probs_BHTT = scores_BHTT.masked_fill(mask_TT, float("-inf")).softmax(-1)
            y_BHTK = probs_BHTT.to(v_BHTK.dtype) @ v_BHTK
        return self.out(y_BHTK.transpose(1, 2).reshape(b, t, d))


# ------------------------------------------------------------------ measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(step: Callable[[], None], device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Peak memory (device; host RSS on the CPU) and median step time of ``step``, or the
    out-of-memory error it raised."""
    try:
        for _ in range(sizes.warmup):
            step()
        synchronize(device)
        times = []
        with MemoryTracker(device=device) as tracker:
            for i in range(sizes.steps):
                start = time.perf_counter()
                step()
                synchronize(device)
                times.append(time.perf_counter() - start)
                tracker.snapshot(f"step {i}")
    except torch.OutOfMemoryError as err:
        return {"status": "out of memory: " + str(err).splitlines()[0][:120]}
    finally:
        free(device)
    if device.type == "cuda":
        peak = tracker.peak_bytes
        kind = "device"
    else:
        peak = max(r["host_rss_bytes"] for r in tracker.records)
        kind = "host RSS"
    return {
        "status": "ok",
        "peak_bytes": peak,
        "peak_kind": kind,
        "step_s": statistics.median(times),
    }


def new_model(sizes: Sizes, device: torch.device) -> SequentialReference:
    with torch.device("meta"):
        model = SequentialReference(sizes.model)
    model.to_empty(device=device)
    return fill_random_(model)


def batch(sizes: Sizes, b: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, sizes.model.vocab_size, (b, sizes.seq_len), generator=g).to(device)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ids_BT: torch.Tensor,
    *,
    bf16: bool,
    grad_accum: int = 1,
) -> Callable[[], None]:
    """One optimizer step over ``ids_BT`` cut into ``grad_accum`` micro-batches."""
    device_type = ids_BT.device.type

    def step() -> None:
        for micro in ids_BT.chunk(grad_accum):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(micro, labels=micro)
            (loss / grad_accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fused_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def saved_activations(model: nn.Module, ids_BT: torch.Tensor) -> int:
    with torch.autocast(ids_BT.device.type, dtype=torch.bfloat16):
        report = activation_report(model, ids_BT, labels=ids_BT)
    model.zero_grad(set_to_none=True)
    return report.total_saved_bytes


# ------------------------------------------------------------------ the groups


def row(group: str, technique: str, result: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A table row: ``result`` (a measurement, or another row's) under a group and name."""
    return {**result, "group": group, "technique": technique, **extra}


def resident_groups(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """Precision, checkpointing policies and gradient accumulation on the resident model."""
    model = new_model(sizes, device)
    opt = fused_adamw(model)
    ids = batch(sizes, sizes.batch, device)
    tokens = ids.numel()
    rows = [
        row("precision", "fp32", measure(train_step(model, opt, ids, bf16=False), device, sizes)),
        row("precision", "bf16 autocast",
            measure(train_step(model, opt, ids, bf16=True), device, sizes)),
    ]  # fmt: skip
    with torch.autocast(device.type, dtype=torch.bfloat16):
        report = activation_report(model, ids, labels=ids)
    model.zero_grad(set_to_none=True)
    rows.append(
        row("checkpointing", "none (bf16)", rows[1] | {},
            saved_activation_bytes=report.total_saved_bytes)
    )  # fmt: skip
    blocks = [name for name, _ in find_blocks(model)]
    per_segment = max(len(blocks) // 4, 1)
    num_segments = len(blocks) // per_segment
    savings = sum(report[n].saved_bytes - report[n].input_bytes for n in blocks)
    budget = report.total_saved_bytes - savings // 2
    policies = [
        ("every block", CheckpointAll()),
        ("every 2nd block", CheckpointEveryKth(2)),
        ("by size, under half the savings", CheckpointToBudget(budget, report=report)),
        (
            f"segments ({num_segments} of {per_segment} blocks, the last kept)",
            CheckpointSegments(num_segments),
        ),
        ("selective (save matmuls)", SelectiveCheckpoint()),
    ]
    for name, policy in policies:
        handle = apply_checkpointing(model, policy)
        result = measure(train_step(model, opt, ids, bf16=True), device, sizes)
        saved = saved_activations(model, ids)
        handle.undo()
        extra = {"saved_activation_bytes": saved}
        if isinstance(policy, CheckpointToBudget):
            extra["note"] = f"budget {ramflow.format_bytes(budget)} of saved activations"
        rows.append(row("checkpointing", name, result, **extra))
    rows.append(row("gradient accumulation", f"{sizes.batch} x 1 (bf16)", rows[1] | {}))
    rows.append(
        row(
            "gradient accumulation",
            f"{sizes.batch // 4} x 4 accumulated (bf16)",
            measure(train_step(model, opt, ids, bf16=True, grad_accum=4), device, sizes),
        )
    )
    rows.append(row("offload", "resident, fused AdamW (bf16)", rows[1] | {}))
    del model, opt
    free(device)
    for r in rows:
        r["tokens_per_step"] = tokens
    return rows


def offload_rows(sizes: Sizes, device: torch.device, b: int, group: str) -> list[dict[str, Any]]:
    """``ramflow.offload`` training, plain and with every block checkpointed."""
    model = new_model(sizes, torch.device("cpu"))
    ids = batch(sizes, b, device)
    rows = []
    choices = [
        ("offload (ramflow)", False),
        ("offload + every block checkpointed", CheckpointAll()),
    ]
    if group != "offload":
        choices = choices[:1]
    for name, checkpointing in choices:
        ramflow.offload(model, device=device, activation_checkpointing=checkpointing)
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5)
        result = measure(train_step(model, opt, ids, bf16=True), device, sizes)
        ramflow.synchronize(model)
        del opt
        ramflow.undo(model)
        rows.append(row(group, name, result, tokens_per_step=ids.numel()))
    del model
    free(device)
    return rows


def attention_rows(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """One block's forward and backward at long T, B=1, under bf16 autocast."""
    cfg = sizes.model
    rows = []
    for t in sizes.attention_lengths:
        for impl in ("eager", "sdpa", "chunked"):
            block = Block(cfg).to(device)
            block.attn = AttentionVariant(block.attn, impl, sizes.attention_chunk)
            x = torch.randn(1, t, cfg.dim, device=device, requires_grad=True)  # (B, T, D)

            def step(block: nn.Module = block, x: torch.Tensor = x) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = block(x)
                out.float().square().mean().backward()
                block.zero_grad(set_to_none=True)
                x.grad = None

            name = {"eager": "eager", "sdpa": "SDPA", "chunked": "chunked (ramflow)"}[impl]
            label = f"attention, {t // 1024}k tokens" if t >= 1024 else f"attention, {t} tokens"
            rows.append(row(label, name, measure(step, device, sizes), tokens_per_step=t))
            del block, x, step
            free(device)
    return rows


def cpu_only_rows(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """GPU with offload against training on the host's cores alone, at one shape."""
    rows = offload_rows(sizes, device, sizes.cpu_batch, "CPU only vs GPU + offload")
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = torch.device("cpu")
    model = new_model(sizes, cpu)
    ids = batch(sizes, sizes.cpu_batch, cpu)
    result = measure(train_step(model, fused_adamw(model), ids, bf16=False), cpu, sizes)
    rows.append(
        row(
            "CPU only vs GPU + offload",
            f"CPU only, {os.cpu_count()} cores (fp32, fused AdamW)",
            result,
            tokens_per_step=ids.numel(),
        )
    )
    del model
    free(cpu)
    return rows


# ------------------------------------------------------------------ the report


def compare(rows: list[dict[str, Any]]) -> None:
    """Memory saved and step-time cost of each row against its group's first row."""
    base: dict[str, dict[str, Any]] = {}
    for r in rows:
        first = base.setdefault(r["group"], r)
        if r.get("step_s"):
            r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        ok = r["status"] == "ok" and first["status"] == "ok"
        same_kind = ok and r["peak_kind"] == first["peak_kind"]
        r["saved_bytes"] = first["peak_bytes"] - r["peak_bytes"] if same_kind else None
        r["step_cost"] = r["step_s"] / first["step_s"] - 1 if ok else None


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def size(value: int | None) -> str:
        return "" if value is None else ramflow.format_bytes(value)

    lines = [
        f"# Memory toolkit: {meta['model']} on {meta['device_name']}",
        "",
        f"`{meta['command']}` at {meta['commit']}, torch {meta['torch']}. Each group is "
        "measured against its first row; peak is the device's `max_memory_allocated` "
        "(host RSS where marked).",
        "",
        "| group | technique | peak memory | memory saved | step time | step-time cost "
        "| tokens/s | saved activations | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['group']} | {r['technique']} | | | | | | | {r['status']} |")
            continue
        peak = size(r["peak_bytes"]) + (" (host RSS)" if r["peak_kind"] != "device" else "")
        cost = "" if r["step_cost"] is None else f"{r['step_cost']:+.0%}"
        lines.append(
            f"| {r['group']} | {r['technique']} | {peak} | {size(r['saved_bytes'])} "
            f"| {r['step_s'] * 1e3:.1f} ms | {cost} | {r.get('tokens_per_s', 0):,.0f} "
            f"| {size(r.get('saved_activation_bytes'))} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON and table go")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device, seconds)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    rows = resident_groups(sizes, device)
    rows += offload_rows(sizes, device, sizes.batch, "offload")
    rows += attention_rows(sizes, device)
    rows += cpu_only_rows(sizes, device)
    # the offload group's baseline is the resident bf16 row: keep groups together, in order
    order: dict[str, int] = {}
    for r in rows:
        order.setdefault(r["group"], len(order))
    rows.sort(key=lambda r: order[r["group"]])
    compare(rows)
    meta = {
        "command": shlex.join(["python", *sys.argv]),
        "commit": _commit(),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "cpu_cores": os.cpu_count(),
        "model": (
            f"reference model ({sizes.model.num_layers} blocks, D={sizes.model.dim}, "
            f"{sizes.model.num_params / 1e6:.0f} M parameters), training B x T = "
            f"{sizes.batch} x {sizes.seq_len}"
        ),
        "model_config": asdict(sizes.model),
        "sizes": {k: v for k, v in asdict(sizes).items() if k != "model"},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "memory_toolkit.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2)
    )
    table = markdown(rows, meta)
    (args.out_dir / "memory_toolkit.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
