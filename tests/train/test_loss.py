"""The chunked loss (``ramflow.train.loss``): the model's own loss without its full logits.

fp32 tolerance: the chunked loss sums the same per-token fp32 cross-entropies as the
model's one call, in another order (a sum per chunk, then over chunks), so the two agree to
fp32 rounding: relative 1e-6 of a loss near ln(V) ~ 6 over 4096 tokens leaves room for
a few ulps per chunk sum. Gradients go through the same products in another grouping:
relative 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ramflow
from ramflow.train.loss import chunk_lm_head, chunk_tokens_for, lm_loss

V, T = 1024, 4096


def long_llama(*, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).train()


class LargestTensor(TorchDispatchMode):
    """The largest tensor (elements) any operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_loss_equals_the_full_loss_at_4096_tokens(tie: bool) -> None:
    model = long_llama(tie=tie)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (1, T))
    expected = lm_loss(ref, ids)  # no chunking: the model's own labels= loss
    expected.backward()
    chunk_lm_head(model, chunk_tokens=256)
    with LargestTensor() as probe:
        loss = lm_loss(model, ids)
        loss.backward()
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    # never the (T, V) logits, nor a (T, T) attention matrix or mask: the largest tensor
    # is a (T, 128) MLP activation
    assert probe.largest <= T * 128 < T * V // 4
    assert probe.largest < T * T


def test_without_lm_loss_the_head_gives_logits_and_no_grad_works() -> None:
    model = long_llama()
    ids = torch.randint(0, V, (2, 64))
    before = model(input_ids=ids).logits
    chunk_lm_head(model, chunk_tokens=7)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    with torch.no_grad():
        chunked = lm_loss(model, ids)
        full = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)


def test_offloaded_model_chunked_loss_matches() -> None:
    """On an offloaded model the chunks' recomputation reads the head's device weight."""
    model = long_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, V, (1, 512))
    expected = lm_loss(ref, ids)
    expected.backward()
    ramflow.offload(model, device="cpu")
    chunk_lm_head(model, chunk_tokens=100)
    loss = lm_loss(model, ids)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    ramflow.undo(model)


def test_errors() -> None:
    with pytest.raises(ValueError, match="no nn.Linear output layer"):
        chunk_lm_head(torch.nn.Linear(2, 2))
    model = long_llama()
    chunk_lm_head(model)
    with pytest.raises(ValueError, match="already replaced"):
        chunk_lm_head(model)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunk_lm_head(long_llama(), chunk_tokens=0)
    assert chunk_tokens_for(128256) == 523  # 256 MiB of fp32 logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunked_loss_in_bf16_stays_under_the_logits() -> None:
    """Under bf16 autocast at 16384 tokens of a 32768-token vocabulary the full fp32 logits
    are 2 GiB; the chunked loss's peak above the peak of the model's body alone (the decoder
    layers' forward and backward on the same batch, whose attention may hold a 16384 x 16384
    mask: SDPA's backend choice is PyTorch's, measured 0.7 GB on an H100 with torch 2.11)
    stays under a quarter of that, and it agrees with the model's own loss to bf16 logits'
    rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab, tokens = 32768, 16384
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).cuda().train()
    ids = torch.randint(0, vocab, (1, tokens), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = lm_loss(model, ids).detach()
    chunk_lm_head(model, chunk_tokens=512)  # a chunk: 64 MiB of fp32 logits

    def peak_above_base(run) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run()
        out.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    body = peak_above_base(
        lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state.float().sum()
    )
    loss = None

    def chunked_loss() -> torch.Tensor:
        nonlocal loss
        loss = lm_loss(model, ids)
        return loss

    logits_fp32 = tokens * vocab * 4
    assert peak_above_base(chunked_loss) - body < logits_fp32 // 4
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-3, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_chunked_loss_adds_the_routers_aux_loss(family: str) -> None:
    """A mixture of experts with ``output_router_logits``: the chunked loss adds the router's
    load-balancing loss (``router_aux_loss_coef`` x ``aux_loss``) as the model's ``labels=``
    loss does, and trains the routers as it does (DeepSeek-V3 has no aux loss in
    transformers: the loss is the cross-entropy alone on both sides)."""
    from transformers import AutoModelForCausalLM

    from moe_models import moe_config

    config = moe_config(family)
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 32))
    expected = lm_loss(ref, ids)  # no chunking: the model's own labels= loss
    expected.backward()
    chunk_lm_head(model, chunk_tokens=7)
    loss = lm_loss(model, ids)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
