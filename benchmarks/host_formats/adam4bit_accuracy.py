"""Accuracy of the 4-bit AdamW states (``host_precision="lean4"``, issue 47 point 5), on the CPU.

``lean4`` keeps bf16 masters (stochastic rounding) and AdamW's moments in 4 bits (Li et al.
2023, see [Note: 4-bit AdamW states] in ``ramflow.formats.states_4bit``). This script trains
small causal language models with the drop-in loop (``ramflow.offload`` on the CPU,
global-norm clipping at ``--clip`` every step) three ways from the same initial weights and
batches: ``fp32`` (exact, the reference), ``lean`` (8-bit states) and ``lean4``, for each
seed of ``--seeds`` and each architecture of ``--archs``: ``qwen3_moe`` (a mixture of
experts: 8 experts of width 64, 2 per token, every layer sparse, the router's auxiliary
loss on) and the held-out dense ``qwen2`` (q/k/v biases, tied embeddings) or ``llama``.
The data is the bytes of Python's standard library sources (vocabulary 256, as
``compact_deferred_accuracy.py``). The figure is the mean validation loss of
``--eval-batches`` held-out batches after the last step. Target: lean4 within 1% of fp32
at every seed and architecture.

Writes ``--out-dir/adam4bit_accuracy.json`` and ``adam4bit_accuracy.md``:

    PYTHONPATH=src python benchmarks/host_formats/adam4bit_accuracy.py \\
        --out-dir benchmarks/results/2026-12-07-cpu-adam4bit
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compact_deferred_accuracy import batches, corpus_bytes  # noqa: E402

VARIANTS = ("fp32", "lean", "lean4")


def make_model(arch: str, seed: int) -> nn.Module:
    """A small causal LM of ``arch`` with weights drawn from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=256,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=24,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
            **common,
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(intermediate_size=224, tie_word_embeddings=True, **common)
        return transformers.Qwen2ForCausalLM(cfg)
    if arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=256, **common)
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"--archs: {arch!r} is not one of qwen3_moe, qwen2, llama")


def train(base: nn.Module, precision: str, args, train_b, eval_b) -> dict:
    model = copy.deepcopy(base)
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision=precision)
    opt = ramflow.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
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
        # the language-model loss alone (the auxiliary loss is a training term)
        val = [
            float(nn.functional.cross_entropy(
                model(input_ids=ids).logits[:, :-1].float().reshape(-1, 256),
                ids[:, 1:].reshape(-1),
            ))
            for ids in eval_b
        ]  # fmt: skip
    ramflow.undo(model)
    return {
        "final_val_loss": sum(val) / len(val),
        "last_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--archs", default="qwen3_moe,qwen2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument(
        "--reference",
        help="a JSON of this script with the same settings: its fp32 and lean results are "
        "taken, not trained again (they do not depend on the 4-bit format)",
    )
    args = p.parse_args(argv)
    reference = {}
    if args.reference:
        for r in json.loads(Path(args.reference).read_text())["rows"]:
            for variant in ("fp32", "lean"):
                reference[r["arch"], r["seed"], variant] = r[variant]
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
                if (arch, seed, variant) in reference:
                    row[variant] = reference[arch, seed, variant]
                    continue
                row[variant] = train(base, variant, args, train_b, eval_b)
                print(arch, seed, variant, row[variant], flush=True)
            rows.append(row)
            # written after every row, so an interrupted run keeps what it measured
            write(out, args, rows)
    print(markdown(rows))
    return 0


def write(out: Path, args, rows: list[dict]) -> None:
    result = {
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "rows": rows,
    }
    (out / "adam4bit_accuracy.json").write_text(json.dumps(result, indent=2))
    (out / "adam4bit_accuracy.md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """One line per (architecture, seed): final validation losses and the differences
    from fp32, relative; whether lean4 is within 1%."""
    lines = [
        "| arch | seed | fp32 | lean | lean4 | lean vs fp32 | lean4 vs fp32 | within 1% |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        f, le, q = (r[v]["final_val_loss"] for v in VARIANTS)
        lines.append(
            f"| {r['arch']} | {r['seed']} | {f:.4f} | {le:.4f} | {q:.4f} | "
            f"{(le - f) / f:+.2%} | {(q - f) / f:+.2%} | "
            f"{'yes' if abs(q - f) <= 0.01 * f else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
