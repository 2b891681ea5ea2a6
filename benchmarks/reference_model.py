"""The benchmarks' reference model: a Llama-like decoder in plain PyTorch.

Legend: B = batch, T = sequence length, D = model width, H = heads, K = head width (D / H),
F = SwiGLU hidden width, V = vocabulary.

Each block is [RMSNorm, fused QKV D->3D, causal SDPA over H heads, output D->D, RMSNorm,
fused SwiGLU gate/up D->2F, down F->D], no biases, residual connections around attention and
the MLP. The blocks live in an ``nn.ModuleList`` named ``layers`` so that ramflow (and any
block-wise engine) finds them as units; embedding, final norm and head are separate modules.
No rotary embedding: it has no parameters and little compute, and timing is all we measure
(the reference shape has no positional encoding either).

With ``REFERENCE`` (12 blocks, D=4096, F=11008, V=32000) the model has 2.69 B parameters.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape of the reference model.

    Attributes:
        num_layers: number of decoder blocks (12 in the reference shape).
        dim: model width D (4096).
        num_heads: attention heads H (32); ``dim`` must divide by it.
        ffn_dim: SwiGLU hidden width F (11008).
        vocab_size: vocabulary V (32000).
        norm_eps: RMSNorm epsilon.
        checkpoint: recompute each block in backward (``torch.utils.checkpoint``,
            non-reentrant) instead of keeping its activations.
        loss_chunk_tokens: with labels, compute head and cross-entropy over this many tokens at
            a time, each chunk checkpointed, so the (B*T, V) logits never exist at once; 0
            computes the full logits (the plain way).
    """

    num_layers: int = 12
    dim: int = 4096
    num_heads: int = 32
    ffn_dim: int = 11008
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    checkpoint: bool = False
    loss_chunk_tokens: int = 0

    def replace(self, **changes: object) -> ReferenceConfig:
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Parameter count (embedding and head are not tied)."""
        d, f, v = self.dim, self.ffn_dim, self.vocab_size
        block = d * 3 * d + d * d + d * 2 * f + f * d + 2 * d
        return self.num_layers * block + 2 * v * d + d


REFERENCE = ReferenceConfig()
TINY = ReferenceConfig(num_layers=4, dim=256, num_heads=4, ffn_dim=688, vocab_size=1024)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), computed in fp32, output in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.num_heads:
            raise ValueError(f"dim {cfg.dim} does not divide into {cfg.num_heads} heads")
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        qkv = self.qkv(x_BTD).view(b, t, 3, self.num_heads, d // self.num_heads)
        q_BHTK, k_BHTK, v_BHTK = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.out(y_BHTK.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer, 2020) with the gate and up projections fused into one matmul."""

    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x_BTD).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


def _chunk_loss(
    h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor
) -> torch.Tensor:
    logits_NV = F.linear(h_ND, weight_VD)
    return F.cross_entropy(logits_NV.float(), labels_N, reduction="sum")


class LMHead(nn.Module):
    """Head D->V; with labels it returns the mean cross-entropy instead of the logits.

    The loss is computed inside this module's own call so that an engine which swaps the
    weight in for the call (ramflow, accelerate hooks) sees every use of it. With
    ``loss_chunk_tokens`` the weight is passed to each checkpointed chunk explicitly, so the
    recomputation in backward reads the tensor autograd saved, not the module attribute.
    """

    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.loss_chunk_tokens = cfg.loss_chunk_tokens
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor | None = None) -> torch.Tensor:
        if labels_BT is None:
            return F.linear(h_BTD, self.weight)
        h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
        labels_N = labels_BT.reshape(-1)
        chunk = self.loss_chunk_tokens
        if chunk <= 0 or chunk >= h_ND.shape[0]:
            return _chunk_loss(h_ND, self.weight, labels_N) / labels_N.numel()
        total = h_ND.new_zeros((), dtype=torch.float32)
        for start in range(0, h_ND.shape[0], chunk):
            part = slice(start, start + chunk)
            total = total + checkpoint(
                _chunk_loss, h_ND[part], self.weight, labels_N[part], use_reentrant=False
            )
        return total / labels_N.numel()


class ReferenceModel(nn.Module):
    """Token ids (B, T) int64 -> logits (B, T, V), or the mean cross-entropy with ``labels``.

    Labels are the targets for each position as given (no shift: the benchmark feeds random
    tokens, so the shift would only cost a copy).
    """

    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = LMHead(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x_BTD = self.embed(input_ids)
        for layer in self.layers:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x_BTD = checkpoint(layer, x_BTD, use_reentrant=False)
            else:
                x_BTD = layer(x_BTD)
        return self.head(self.norm(x_BTD), labels)

    def chunks(self) -> list[nn.Module]:
        """[embedding, block 0..L-1, final norm + head]: the dicing that chunk-list engines
        (RamTorch ``OffloadModel``) take, each chunk consuming the previous one's output."""
        return [self.embed, *self.layers, nn.Sequential(self.norm, _LogitsOnly(self.head))]


class _LogitsOnly(nn.Module):
    def __init__(self, head: LMHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return self.head(h_BTD)


def fill_random_(model: nn.Module, *, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Give every floating-point parameter N(0, std) values (norm weights ones), fast.

    Drawing 2.7 B normal numbers takes seconds per process on the CPU; this draws one pool of
    16 M values and copies windows of it, at memory speed. The values are as good as random
    for timing (no zeros, no denormals), not for training.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((1 << 24) + 4099, generator=gen) * std
    pools: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            key = (p.device, p.dtype)
            if key not in pools:
                pools[key] = pool.to(device=p.device, dtype=p.dtype)
            src = pools[key]
            offset = zlib.crc32(name.encode()) % 4099
            window = 1 << 24
            flat = p.view(-1)
            for start in range(0, flat.numel(), window):
                n = min(flat.numel() - start, window)
                flat[start : start + n].copy_(src[offset : offset + n])
    return model


def build_reference(
    cfg: ReferenceConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ReferenceModel:
    """A ``ReferenceModel`` allocated directly on ``device`` in ``dtype``, filled by
    ``fill_random_`` (built on the meta device first, so no default init runs)."""
    with torch.device("meta"):
        model = ReferenceModel(cfg)
    model.to(dtype)  # on the meta device: free
    model.to_empty(device=device)
    return fill_random_(model)
