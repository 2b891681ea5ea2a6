"""Convert an existing model: every ``nn.Linear`` becomes an offloaded ``Linear``, then train.

RamTorch's "converting existing models" example, on ramflow. The model is a small Llama from
``transformers`` built from a config (random weights, nothing downloaded); its attention and
MLP projections and its head are ``nn.Linear`` layers that ``replace_linear_with_ramtorch``
swaps for layers whose weights stay in CPU RAM. Embeddings and norms stay ordinary
parameters and move to the device with ``model.to(device)``.

    python examples/ramtorch_convert.py                         # tiny, seconds on a CPU
    python examples/ramtorch_convert.py --hidden 1024 --layers 8 --device cuda

The script checks that the converted model computes the same logits as before (the wire
dtype is the weights' dtype, fp32 here), then trains a few steps on a repeating token pattern.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ramflow.compat.ramtorch import AdamW, Linear
from ramflow.compat.ramtorch.helpers import replace_linear_with_ramtorch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def batch_of_patterns(args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """Token rows that repeat a random period-4 pattern: learnable in a few steps."""
    period = torch.randint(0, args.vocab, (args.batch, 4), generator=generator)
    return period.repeat(1, -(-args.seq_len // 4))[:, : args.seq_len]


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,  # a tied head would share its weight with the embedding
    )
    model = LlamaForCausalLM(config)  # an existing model: random weights, on the CPU
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    probe = batch_of_patterns(args, generator)
    with torch.no_grad():
        before = model(probe).logits

    # the conversion (RamTorch: replace_linear_with_ramtorch(model, rank); an int is a
    # CUDA device index, a string any device)
    model = replace_linear_with_ramtorch(model, args.device)
    model = model.to(device)
    converted = sum(isinstance(m, Linear) for m in model.modules())
    offloaded = sum(
        p.numel() for m in model.modules() if isinstance(m, Linear) for p in m.parameters()
    )
    total = sum(p.numel() for p in model.parameters())
    print(f"{converted} Linear layers converted: {offloaded:,} of {total:,} parameters in CPU RAM")
    with torch.no_grad():
        after = model(probe.to(device)).logits.cpu()
    print(f"max |logits after - before conversion| = {(after - before).abs().max().item():.3g}")

    model.train()
    optimizer = AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        tokens = batch_of_patterns(args, generator).to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
