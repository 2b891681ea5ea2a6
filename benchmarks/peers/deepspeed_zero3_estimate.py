"""DeepSpeed's own estimate of the host and GPU memory ZeRO-3 needs for a model's states.

Runs ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold`` (no
GPU, no model: it takes the parameter counts) for a Llama shape on one host of
``--gpus`` GPUs, and prints DeepSpeed's table. With ``offload_param`` and
``offload_optimizer`` on the CPU, "per CPU" is the host RAM DeepSpeed asks for.

    python benchmarks/peers/deepspeed_zero3_estimate.py --shape llama-3.1-70b --gpus 4

Needs ``deepspeed`` (``DS_BUILD_OPS=0 pip install deepspeed==0.19.8`` in a venv with torch).
"""

from __future__ import annotations

import argparse

# hidden, layers, MLP width, vocabulary, heads, key/value heads (the models' config.json)
SHAPES = {
    "llama-3.1-70b": (8192, 80, 28672, 128256, 64, 8),
    "llama-3.1-8b": (4096, 32, 14336, 128256, 32, 8),
}


def counts(shape: str) -> tuple[int, int]:
    """(all parameters, the largest layer's: the untied embedding or head)."""
    h, layers, ffn, vocab, heads, kv = SHAPES[shape]
    head_dim = h // heads
    per_layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * ffn + 2 * h
    return layers * per_layer + 2 * vocab * h + h, vocab * h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-70b")
    p.add_argument("--gpus", type=int, default=4)
    args = p.parse_args()
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    total, largest = counts(args.shape)
    print(f"{args.shape}: {total:,} parameters, largest layer {largest:,}")
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params=total, largest_layer_params=largest, num_gpus_per_node=args.gpus, num_nodes=1
    )


if __name__ == "__main__":
    main()
