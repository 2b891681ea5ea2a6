"""The training loss of a causal language model without its full logits.

Legend: B = sequences per micro-batch, T = tokens per sequence, D = hidden width,
V = vocabulary, N = B x (T - 1) predicted tokens, C = tokens per chunk.

[Note: the loss in chunks]
A Hugging Face causal LM computes ``lm_head(hidden_BTD)``, the (B, T, V) logits, and then
the cross-entropy in fp32: at 131072 tokens and Llama 3's 128256-token vocabulary the
fp32 logits alone are 67 GB, more than the rest of the step. ``chunk_lm_head`` replaces the
output layer's ``forward`` (an instance attribute, so its hooks, its parameters' names and
a tied embedding stay as they are) by one that, while ``lm_loss`` runs the model, takes
the hidden states and returns the mean next-token cross-entropy itself (a 0-dim fp32
tensor, in the place of the logits; no labels reach the model, so it computes no loss of
its own). The tokens are taken C at a time; each chunk's logits (C, V), made in the
autocast dtype as the model's head would and upcast to fp32 as its loss does, exist only
while the chunk's loss is computed: each chunk runs under non-reentrant
``torch.utils.checkpoint``, which keeps the chunk's hidden states and recomputes its
logits in backward (Liger Kernel's fused linear cross-entropy and torchtune's chunked
output loss make the same trade). The head's weight goes into the checkpoint as an
argument, read inside the head's own forward call, so an offloaded model's recomputation
finds the device weight that the head's backward has loaded (see [Note: parameters during
backward] in ``ramflow.engine.schedule``).

The sum over chunks runs in another order than one cross-entropy over all tokens, so the
loss agrees with the model's own to fp32 rounding (relative 1e-6 on the tests' 4096
tokens), not bit for bit.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DEFAULT_CHUNK_LOGIT_BYTES",
    "IGNORE_INDEX",
    "chunk_lm_head",
    "chunk_tokens_for",
    "lm_loss",
]

IGNORE_INDEX = -100  # a label that takes no loss (cross_entropy's default ignore_index)

# a chunk's fp32 logits: 256 MiB (512 tokens of Llama 3's vocabulary)
DEFAULT_CHUNK_LOGIT_BYTES = 256 << 20


def chunk_tokens_for(vocab_size: int, logit_bytes: int = DEFAULT_CHUNK_LOGIT_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits take about ``logit_bytes``."""
    return max(1, logit_bytes // (4 * vocab_size))


def _chunk_loss_sum(
    hidden_CD: torch.Tensor, labels_C: torch.Tensor, weight_VD: torch.Tensor, bias_V: Any
) -> torch.Tensor:
    logits_CV = F.linear(hidden_CD, weight_VD, bias_V).float()  # as the model's loss upcasts
    return F.cross_entropy(logits_CV, labels_C, reduction="sum")


class _ChunkedHeadForward:
    """The output layer's ``forward`` while chunked. See [Note: the loss in chunks]."""

    def __init__(self, head: nn.Linear, chunk_tokens: int) -> None:
        self.head_forward = type(head).forward
        self.head = head
        self.chunk_tokens = chunk_tokens
        # per thread: ramflow.accumulate runs each micro-batch's forward in its own thread
        self._local = threading.local()

    @property
    def labels_BT(self) -> torch.Tensor | None:
        """The labels of the forward running on this thread (None: return logits)."""
        return getattr(self._local, "labels_BT", None)

    @labels_BT.setter
    def labels_BT(self, labels_BT: torch.Tensor | None) -> None:
        self._local.labels_BT = labels_BT

    def __call__(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        labels_BT = self.labels_BT
        if labels_BT is None:
            return self.head_forward(self.head, hidden_BTD)  # generation, evaluation by logits
        if hidden_BTD.shape[:2] != labels_BT.shape:
            raise ValueError(
                f"lm_loss: the head got hidden states of shape {tuple(hidden_BTD.shape)} for "
                f"labels of shape {tuple(labels_BT.shape)}; the model must pass every position "
                "to its head (no logits_to_keep)"
            )
        hidden_ND = hidden_BTD[:, :-1].reshape(-1, hidden_BTD.shape[-1])
        labels_N = labels_BT[:, 1:].reshape(-1).to(device=hidden_BTD.device, dtype=torch.long)
        # the weight as this forward call sees it: the device copy on an offloaded model
        weight, bias = self.head.weight, self.head.bias
        total = hidden_BTD.new_zeros((), dtype=torch.float32)
        # the mean over the positions that have a target (cross_entropy's ignore_index:
        # -100 marks none); plain text has a target everywhere
        for start in range(0, labels_N.numel(), self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            if torch.is_grad_enabled():
                chunk = checkpoint(
                    _chunk_loss_sum,
                    hidden_ND[part],
                    labels_N[part],
                    weight,
                    bias,
                    use_reentrant=False,
                )
            else:
                chunk = _chunk_loss_sum(hidden_ND[part], labels_N[part], weight, bias)
            total = total + chunk
        return total / (labels_N != IGNORE_INDEX).sum().clamp(min=1)


def chunk_lm_head(model: nn.Module, *, chunk_tokens: int | None = None) -> None:
    """Make ``lm_loss(model, ...)`` compute the loss in chunks, never the full logits. See
    [Note: the loss in chunks]. Call it once, before or after ``ramflow.offload``; without
    ``lm_loss`` running, the head computes its logits as before.

    Args:
        model: a Hugging Face causal LM whose output layer
            (``model.get_output_embeddings()``) is an ``nn.Linear``.
        chunk_tokens: tokens per chunk (C); default ``chunk_tokens_for(vocab)``, about
            256 MiB of fp32 logits.

    Raises:
        ValueError: the model has no ``nn.Linear`` output layer, its forward is already
            replaced, or ``chunk_tokens`` < 1.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"chunk_lm_head: {type(model).__name__} has no nn.Linear output layer "
            f"(get_output_embeddings() gave {type(head).__name__}); compute its loss with "
            "labels= instead"
        )
    if "forward" in head.__dict__:
        raise ValueError("chunk_lm_head: the output layer's forward is already replaced")
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(head.out_features)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_lm_head: chunk_tokens must be >= 1, got {chunk_tokens}")
    head.forward = _ChunkedHeadForward(head, chunk_tokens)


def lm_loss(
    model: nn.Module, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``input_ids_BT`` ((B, T) integer ids,
    any device; each sequence predicts its own next tokens): a 0-dim fp32 tensor on the
    model's compute device, with a graph for ``backward()``. ``labels_BT`` ((B, T) integer
    ids, ``IGNORE_INDEX`` where no loss is taken: a prompt, padding; see
    ``ramflow.train.chat_data``) are the targets, None: the ids themselves; the mean is
    over the positions with a target. After ``chunk_lm_head(model)`` it is computed in
    chunks (See [Note: the loss in chunks]), plus a mixture of experts' router auxiliary
    loss (``router_aux_loss_coef`` times ``aux_loss``) where its config asks for it
    (``output_router_logits``), as the model's own; otherwise it is the model's own
    ``labels=`` loss."""
    labels_BT = input_ids_BT if labels_BT is None else labels_BT
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chunked = head.__dict__.get("forward") if head is not None else None
    if not isinstance(chunked, _ChunkedHeadForward):
        return model(input_ids=input_ids_BT, labels=labels_BT, use_cache=False).loss
    chunked.labels_BT = labels_BT
    try:
        out = model(input_ids=input_ids_BT, use_cache=False)
    finally:
        chunked.labels_BT = None
    loss = out.logits
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        # a mixture of experts with output_router_logits: the router's load-balancing loss,
        # which its labels= loss adds in the same way (transformers' MoE causal LMs)
        loss = loss + model.config.router_aux_loss_coef * aux.to(loss.device)
    return loss
