"""Quick engine probe on the GPU box: one process, the ANCHORS reference model shape.

Prints H2D bandwidth, offloaded inference (1x2048) and training (4x2048) step times, and
peak GPU memory. A smoke check between full benchmark runs, not the harness itself.

    python benchmarks/quick_probe.py --layers 12 --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import ramflow


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight)


class Block(nn.Module):
    def __init__(self, d: int, f: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Model(nn.Module):
    def __init__(
        self, layers: int, d: int = 4096, f: int = 11008, heads: int = 32, vocab: int = 32000
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def timed(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def h2d_bandwidth() -> float:
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    return 2**30 / min(timed(lambda: dev.copy_(host, non_blocking=True), 5))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--checkpointing", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"H2D pinned 1 GiB: {h2d_bandwidth() / 1e9:.1f} GB/s")
    with torch.device("meta"):
        model = Model(args.layers)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    t0 = time.perf_counter()
    ramflow.offload(model, gpu_memory=args.gpu_memory, activation_checkpointing=args.checkpointing)
    print(f"offload: {time.perf_counter() - t0:.1f} s")
    print(ramflow.get_plan(model).describe())
    wire_bytes = ramflow.get_plan(model).streamed_bytes_per_pass
    ids1 = torch.randint(0, 32000, (1, 2048), device="cuda")
    ids4 = torch.randint(0, 32000, (4, 2048), device="cuda")

    def infer():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids1)

    t = timed(infer, args.steps + 1)[1:]
    print(
        f"inference 1x2048: median {statistics.median(t) * 1e3:.1f} ms "
        f"(PCIe floor {wire_bytes / 54.4e9 * 1e3:.1f} ms at 54.4 GB/s)"
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5)

    def train():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids4)
        loss.backward()
        opt.step()
        opt.zero_grad()

    torch.cuda.reset_peak_memory_stats()
    t = timed(lambda: (train(), ramflow.synchronize(model)), 2)
    print(f"first train steps (deferred, synchronized): {[round(v, 3) for v in t]} s")
    t = timed(lambda: (train(), ramflow.synchronize(model)), args.steps)
    print(f"train 4x2048 synchronized each step: median {statistics.median(t):.3f} s")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train()
    ramflow.synchronize(model)
    torch.cuda.synchronize()
    print(
        f"train 4x2048 pipelined: {(time.perf_counter() - t0) / args.steps:.3f} s/step, "
        f"peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
