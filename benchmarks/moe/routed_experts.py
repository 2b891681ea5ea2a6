"""Decoding at batch 1 with routed experts against loading every expert (issue 47, point 4).

A Qwen3-30B-A3B shape with fewer layers (``--layers``, default 8) is built on the meta
device, frozen, and materialized unit by unit into ramflow's host store from a seeded
pattern (``offload(weights=fn)``), twice: once with ``routed_experts=False`` (every load
copies every expert) and once with the default (the router's choice, see [Note: experts
loaded by the router] in ``ramflow.engine.expert_loading``). Each greedy-decodes the same
prompt; per variant the script reports H2D bytes per decoded token (the window's
counter, exact), of which experts, decoded tokens per second, and whether both produced
the same tokens. ``--gpu-memory`` (default 6 GiB) keeps the window below the model, so
every token streams every layer.

Writes ``routed_experts.json`` and ``routed_experts.md`` under ``--out-dir`` (default
``$OUT``); ``--smoke`` runs a tiny shape on the CPU (tested in CI).

    python benchmarks/moe/routed_experts.py --layers 8 --new-tokens 32 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

import torch  # noqa: E402

import ramflow  # noqa: E402
from ramflow.units.registry import engine_of_model  # noqa: E402

SHAPES = {
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 128 experts of width 768, 8 per token
    "qwen3-30b-a3b": dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, max_position_embeddings=4096, norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=272, max_position_embeddings=256, norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
_PATTERN_ELEMENTS = 1 << 22


def qwen3_moe_config(shape: str, layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=layers, **SHAPES[shape])


def seeded_init(name: str, out: torch.Tensor) -> None:
    """Norms at one, the rest normal values of std 0.02 tiled from one block of seeded
    draws (for speed: the router's choices need varied weights, not independent ones),
    shifted per parameter name so that experts differ."""
    if out.dim() == 1:
        out.fill_(1.0)
        return
    pattern = torch.randn(_PATTERN_ELEMENTS, generator=torch.Generator().manual_seed(0)) * 0.02
    flat = out.view(-1)
    shift = sum(name.encode()) % 4096
    src = pattern.roll(shift).to(out.dtype)
    for lo in range(0, flat.numel(), src.numel()):
        hi = min(flat.numel(), lo + src.numel())
        flat[lo:hi].copy_(src[: hi - lo])


def build(args, *, routed: bool):
    """The frozen model on the meta device, offloaded and filled unit by unit."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = qwen3_moe_config(args.shape, args.layers)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, experts_implementation=args.experts_implementation
        )
    model.requires_grad_(False)
    ramflow.offload(
        model,
        device=args.device,
        gpu_memory=args.gpu_memory,
        weights=seeded_init,
        routed_experts=routed,
    )
    return model


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def decode(model, prompt: torch.Tensor, new_tokens: int, device: str):
    """Greedy generation of ``new_tokens`` after ``prompt``; returns (tokens, seconds, H2D
    bytes, expert bytes)."""
    engine = engine_of_model(model)
    sync(device)
    bytes0 = engine.window.bytes_loaded
    experts0 = engine.routed_experts.expert_bytes_loaded()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    seconds = time.perf_counter() - t0
    return (
        out[0, prompt.shape[1] :].tolist(),
        seconds,
        engine.window.bytes_loaded - bytes0,
        engine.routed_experts.expert_bytes_loaded() - experts0,
    )


def measure(args, *, routed: bool, prompt: torch.Tensor) -> dict:
    """One variant: a warm-up, then prefill with one token and the full decode; decoding's
    figures are the difference, so the prompt's pass is not counted."""
    t0 = time.perf_counter()
    model = build(args, routed=routed)
    build_s = time.perf_counter() - t0
    decode(model, prompt, 2, args.device)  # warm-up: kernels, allocator, the first loads
    _, s1, b1, e1 = decode(model, prompt, 1, args.device)
    tokens, sn, bn, en = decode(model, prompt, args.new_tokens + 1, args.device)
    n = args.new_tokens
    result = {
        "routed_experts": routed,
        "build_s": round(build_s, 2),
        "tokens": tokens,
        "decode_tokens_per_s": n / (sn - s1),
        "h2d_bytes_per_token": (bn - b1) / n,
        "expert_bytes_per_token": (en - e1) / n,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if args.device != "cpu" else 0,
    }
    del model
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def report(result: dict) -> str:
    rows = [
        "| experts loaded | H2D MB / token | of which experts | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for r in result["variants"]:
        rows.append(
            f"| {'routed' if r['routed_experts'] else 'all'} | "
            f"{r['h2d_bytes_per_token'] / 1e6:.1f} | {r['expert_bytes_per_token'] / 1e6:.1f} | "
            f"{r['decode_tokens_per_s']:.2f} |"
        )
    head = (
        f"{result['shape']}, {result['layers']} layers, batch 1, prompt {result['prompt']}, "
        f"{result['new_tokens']} decoded tokens, experts implementation "
        f"{result['experts_implementation']}, {result['device_name']}; same tokens: "
        f"{result['same_tokens']}."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gpu-memory", default="6GiB")
    p.add_argument("--experts-implementation", default=None, help="default: transformers'")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.layers, args.device = "tiny", 8, "cpu"
        args.new_tokens, args.prompt, args.gpu_memory = 4, 4, "2MiB"
    prompt = torch.randint(
        0, SHAPES[args.shape]["vocab_size"], (1, args.prompt), generator=torch.Generator()
    ).to(args.device)
    variants = [measure(args, routed=r, prompt=prompt) for r in (False, True)]
    result = {
        "shape": args.shape,
        "layers": args.layers,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "gpu_memory": args.gpu_memory,
        "experts_implementation": args.experts_implementation or "transformers' default",
        "device_name": torch.cuda.get_device_name() if args.device != "cpu" else "CPU",
        "same_tokens": variants[0]["tokens"] == variants[1]["tokens"],
        "variants": variants,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routed_experts.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "routed_experts.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
