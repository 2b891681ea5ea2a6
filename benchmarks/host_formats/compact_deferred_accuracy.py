"""Accuracy of the compact deferred gradient (issue 48, point 1), on the CPU.

A clipped lean step holds each unit's gradient in 8-bit codes between backward and
``opt.step()`` (``ramflow.optim.AdamW(keep_grads=False, clips=True)``, see [Note: the
compact deferred gradient] in ``ramflow.formats.deferred_grad``). This script trains small
causal language models with the drop-in loop (``ramflow.offload`` on the CPU, global-norm
clipping at ``--clip`` every step) three ways from the same initial weights and batches:

* ``fp32``: ``host_precision="fp32"``, exact (the reference);
* ``lean``: ``host_precision="lean"`` with the default AdamW, whose deferred steps hold
  bf16 gradients in ``p.grad`` (what lean's earlier accuracy runs measured);
* ``lean-compact``: lean with ``keep_grads=False, clips=True``: 8-bit deferred gradients.

for each seed of ``--seeds`` and each architecture of ``--archs``: ``llama`` (the one the
lean formats were measured on) and the held-out ``qwen2`` (biases on q, k and v, tied
embeddings, another MLP width) or ``neox`` (GPT-NeoX: LayerNorm, parallel residual, fused
QKV with bias, GELU). The data is the bytes of Python's standard library sources (a
vocabulary of 256). The final loss is the mean validation loss of ``--eval-batches``
held-out batches after the last step. Target: lean-compact within 1% of fp32 at every seed
and architecture.

Writes ``--out-dir/compact_accuracy.json`` and ``compact_accuracy.md``. About 25 minutes
on 2 busy cores with the defaults (the recorded run's settings):

    PYTHONPATH=src python benchmarks/host_formats/compact_deferred_accuracy.py \\
        --out-dir benchmarks/results/2026-12-07-cpu-compact-deferred-grad
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import ramflow

VARIANTS = {
    "fp32": ("fp32", {}),
    "lean": ("lean", {}),
    "lean-compact": ("lean", {"keep_grads": False, "clips": True}),
}


def corpus_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's sources, sorted by path."""
    root = Path(sys.modules["json"].__file__).resolve().parents[1]
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


def make_model(arch: str, seed: int) -> nn.Module:
    """A small causal LM of ``arch`` with weights drawn from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=256, num_key_value_heads=2, **common)
        return transformers.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(
            intermediate_size=224, num_key_value_heads=2, tie_word_embeddings=True, **common
        )
        return transformers.Qwen2ForCausalLM(cfg)
    if arch == "neox":
        cfg = transformers.GPTNeoXConfig(intermediate_size=384, **common)
        return transformers.GPTNeoXForCausalLM(cfg)
    raise ValueError(f"--archs: {arch!r} is not one of llama, qwen2, neox")


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (n, batch), generator=g)
    return [torch.stack([data[s : s + seq] for s in row]) for row in starts]


def train(base: nn.Module, variant: str, args, train_b, eval_b) -> dict:
    precision, opt_kwargs = VARIANTS[variant]
    model = copy.deepcopy(base)
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision=precision)
    opt = ramflow.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **opt_kwargs)
    losses = []
    start = time.perf_counter()
    for ids in train_b:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ramflow.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ramflow.synchronize(model)
    seconds = time.perf_counter() - start
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        val = [float(model(input_ids=ids, labels=ids).loss) for ids in eval_b]
    ramflow.undo(model)
    return {
        "final_val_loss": sum(val) / len(val),
        "last_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--archs", default="llama,qwen2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = corpus_bytes(4_000_000)
    split = int(data.numel() * 0.95)
    rows = []
    for arch in args.archs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            base = make_model(arch, seed)
            train_b = batches(data[:split], args.steps, args.batch_size, args.seq_len, seed)
            eval_b = batches(data[split:], args.eval_batches, args.batch_size, args.seq_len, 99)
            row = {"arch": arch, "seed": seed}
            for variant in VARIANTS:
                row[variant] = train(base, variant, args, train_b, eval_b)
                print(arch, seed, variant, row[variant], flush=True)
            rows.append(row)
    result = {
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "rows": rows,
    }
    (out / "compact_accuracy.json").write_text(json.dumps(result, indent=2))
    (out / "compact_accuracy.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    """One line per (architecture, seed): final validation losses and the differences
    from fp32, relative; whether lean-compact is within 1%."""
    lines = [
        "| arch | seed | fp32 | lean | lean-compact | lean vs fp32 | compact vs fp32 "
        "| compact vs lean | within 1% |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        f, le, c = (r[v]["final_val_loss"] for v in VARIANTS)
        lines.append(
            f"| {r['arch']} | {r['seed']} | {f:.4f} | {le:.4f} | {c:.4f} | "
            f"{(le - f) / f:+.2%} | {(c - f) / f:+.2%} | {(c - le) / le:+.2%} | "
            f"{'yes' if abs(c - f) <= 0.01 * f else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
