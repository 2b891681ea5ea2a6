"""The models the harness runs, their inputs, and what a step of each computes.

Two models: ``reference`` (``reference_model.py``, a 2.69 B Llama-like decoder) and
``llama-3b`` (``transformers``' ``LlamaForCausalLM`` in the shape of Llama 3.2 3B: width
3072, 28 layers, 24 heads with 8 key/value heads, vocabulary 128256, tied embeddings). Both
are built from a config with random weights: the GPU box has no network, and timing does not
depend on the values. ``tiny=True`` gives a few-layer narrow version of each for CPU smoke
tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from reference_model import REFERENCE, TINY, ReferenceModel, build_reference, fill_random_

MODELS = ("reference", "llama-3b")


@dataclass(frozen=True)
class ModelShape:
    """What the floors need to know about a model.

    Attributes:
        num_params: parameter count (tied parameters once).
        embed_params: parameters of the token embedding (no FLOPs: a lookup).
        num_layers: decoder blocks.
        dim: model width.
        vocab_size: vocabulary.
    """

    num_params: int
    embed_params: int
    num_layers: int
    dim: int
    vocab_size: int

    def forward_flops(self, batch: int, seq: int) -> float:
        """FLOPs of one forward over ``batch`` x ``seq`` tokens: 2 per multiply-add of every
        matmul weight, plus causal attention (QK^T and AV, half the square)."""
        tokens = batch * seq
        matmul = 2.0 * (self.num_params - self.embed_params) * tokens
        attention = 2.0 * self.num_layers * batch * seq * seq * self.dim
        return matmul + attention


def build_model(
    name: str,
    *,
    tiny: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    checkpoint: bool = False,
    loss_chunk_tokens: int = 0,
) -> nn.Module:
    """A model with random weights, allocated on ``device`` in ``dtype``.

    ``checkpoint`` recomputes each block in backward; ``loss_chunk_tokens`` computes head and
    loss in checkpointed chunks (reference model only; ignored for llama-3b, whose loss is
    ``transformers``' own).
    """
    if name == "reference":
        cfg = TINY if tiny else REFERENCE
        cfg = cfg.replace(checkpoint=checkpoint, loss_chunk_tokens=loss_chunk_tokens)
        if num_layers is not None:
            cfg = cfg.replace(num_layers=num_layers)
        return build_reference(cfg, device=device, dtype=dtype)
    if name == "llama-3b":
        return _build_llama(
            tiny=tiny, device=device, dtype=dtype, num_layers=num_layers, checkpoint=checkpoint
        )
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def _build_llama(
    *,
    tiny: bool,
    device: torch.device | str,
    dtype: torch.dtype,
    num_layers: int | None,
    checkpoint: bool,
) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if tiny:
        shape = dict(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
        )
    else:
        shape = dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=128256,
        )
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    config = LlamaConfig(
        **shape,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to(dtype)  # on the meta device: free
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the head a storage of its own: share the embedding's again
    with torch.device(device):
        # to_empty left the rotary frequencies (an fp32 buffer) uninitialised: rebuild them
        model.model.rotary_emb = LlamaRotaryEmbedding(config)
    fill_random_(model)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def meta_shape(name: str, *, tiny: bool = False, num_layers: int | None = None) -> ModelShape:
    """``model_shape`` of a model built on the meta device: sizes without allocating."""
    if name == "reference":
        cfg = TINY if tiny else REFERENCE
        if num_layers is not None:
            cfg = cfg.replace(num_layers=num_layers)
        with torch.device("meta"):
            return model_shape(ReferenceModel(cfg))
    return model_shape(
        _build_llama(
            tiny=tiny, device="meta", dtype=torch.float32, num_layers=num_layers, checkpoint=False
        )
    )


# Bytes per token and layer that a bf16-autocast block keeps for backward, in model widths
# (the reference model's resident 4x2048 step on the H200: 13.5 GiB over 8192 x 12 x 4096);
# a checkpointed block keeps its fp32 input (4 bytes per width); logits cost about 14 bytes per
# token and vocabulary entry (bf16 logits, fp32 copy, fp32 and bf16 gradients).
ACTIVATION_WIDTHS_PER_LAYER = 30
LOGITS_BYTES = 14


def resident_peak_bytes(
    shape: ModelShape,
    *,
    mode: str,
    batch: int,
    seq: int,
    checkpoint: bool = False,
    loss_chunk_tokens: int = 0,
) -> int:
    """A rough peak of a resident step: fp32 weights, gradients and AdamW states (16 bytes
    per parameter) and activations for training; bf16 weights and the logits for inference.
    Used to skip resident cases that cannot fit the device, instead of crashing them."""
    tokens = batch * seq
    if mode == "infer":
        return 2 * shape.num_params + tokens * shape.vocab_size * 2 + 4 * tokens * shape.dim * 8
    layer = tokens * shape.dim * ACTIVATION_WIDTHS_PER_LAYER
    if checkpoint:
        layers = shape.num_layers * tokens * shape.dim * 4 + layer
    else:
        layers = shape.num_layers * layer
    chunk = loss_chunk_tokens if 0 < loss_chunk_tokens < tokens else tokens
    return 16 * shape.num_params + layers + chunk * shape.vocab_size * LOGITS_BYTES


def model_shape(model: nn.Module) -> ModelShape:
    """Parameter counts and sizes of a model built by ``build_model``."""
    num_params = sum(p.numel() for p in model.parameters())  # parameters() dedups ties
    if isinstance(model, ReferenceModel):
        cfg = model.cfg
        return ModelShape(
            num_params, model.embed.weight.numel(), cfg.num_layers, cfg.dim, cfg.vocab_size
        )
    cfg = model.config
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    # tied: the head matmul still runs, so count the embedding's FLOPs through the head
    embed_params = 0 if head is embed else embed.numel()
    return ModelShape(
        num_params, embed_params, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    )


def vocab_size(model: nn.Module) -> int:
    return model_shape(model).vocab_size


def make_batch(
    vocab: int, batch: int, seq: int, *, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and labels, both (batch, seq) int64, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids.to(device), labels.to(device)


def loss_of(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss (mean cross-entropy) of one batch, a scalar."""
    if isinstance(model, ReferenceModel):
        return model(input_ids, labels)
    return model(input_ids=input_ids, labels=labels, use_cache=False).loss


def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits (B, T, V) of one forward."""
    if isinstance(model, ReferenceModel):
        return model(input_ids)
    return model(input_ids=input_ids, use_cache=False).logits


class ChunkedLossHead(nn.Module):
    """The LM head with the loss: mean cross-entropy of ``hidden_BTD`` against ``labels_BT``
    computed over chunks of ``chunk`` tokens, each chunk checkpointed (its logits, fp32
    ``chunk x V``, exist only while it is computed, in forward and again in backward).
    Replaces the model's ``lm_head`` so that ramflow streams it as one unit.

    Without labels (neither given nor in ``labels_BT``) it is the plain head: the logits.
    ``labels_BT``, set by the caller, makes the model's own forward return the loss in
    place of its logits (a 0-dim fp32 tensor), so the call goes through the model's root."""

    def __init__(self, head: nn.Linear, chunk: int) -> None:
        super().__init__()
        self.head = head
        self.chunk = chunk
        self.labels_BT: torch.Tensor | None = None

    def _chunk_loss(self, h_ND: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
        logits_NV = self.head(h_ND).float()
        return nn.functional.cross_entropy(logits_NV, y_N, reduction="sum")

    def forward(
        self, hidden_BTD: torch.Tensor, labels_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        labels_BT = self.labels_BT if labels_BT is None else labels_BT
        if labels_BT is None:
            return self.head(hidden_BTD)
        h_ND = hidden_BTD[:, :-1].reshape(-1, hidden_BTD.shape[-1])
        y_N = labels_BT[:, 1:].reshape(-1)
        total = hidden_BTD.new_zeros((), dtype=torch.float32)
        for lo in range(0, y_N.numel(), self.chunk):
            sl = slice(lo, lo + self.chunk)
            total = total + checkpoint(self._chunk_loss, h_ND[sl], y_N[sl], use_reentrant=False)
        return total / y_N.numel()


def random_init(name: str, out: torch.Tensor) -> None:
    """``weights`` for ``ramflow.offload``: norms 1, biases 0, the rest uniform with standard
    deviation 0.02 (uniform is several times faster than normal on the CPU; for a speed
    benchmark only the values' scale matters)."""
    if "norm" in name:
        out.fill_(1.0)
    elif name.endswith("bias"):
        out.zero_()
    else:
        a = 0.02 * math.sqrt(3.0)
        out.uniform_(-a, a)
