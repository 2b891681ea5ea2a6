"""Chunked attention equals SDPA; the SDPA report sees which kernels ran; use_sdpa switches
a Hugging Face model.

Tolerances: chunking changes no reduction (each query's softmax and weighted sum run over
all its keys as in SDPA), but SDPA's CPU kernel computes the same sums in its own order
(blocks of keys with an online softmax), so results differ by rounding: in float64 by a few
ulp (1e-12 is far above that and far below any error of masking or scaling); in float32 by
about 1e-7 relative per sum, checked at 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import tiny_llama
from ramflow.memory import chunked_attention, sdpa_backends_report, use_sdpa

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_chunked_attention_equals_sdpa(dtype, is_causal, chunk_size):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 17, 8, dtype=dtype, requires_grad=True)  # (B, heads, L, E)
    k = torch.randn(2, 3, 17, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 17, 5, dtype=dtype, requires_grad=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3)
    got = chunked_attention(q, k, v, chunk_size=chunk_size, is_causal=is_causal, scale=0.3)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_keys_longer_than_queries_and_default_scale():
    torch.manual_seed(0)
    q = torch.randn(4, 5, 16, dtype=torch.float64)
    k = torch.randn(4, 11, 16, dtype=torch.float64)
    v = torch.randn(4, 11, 16, dtype=torch.float64)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        got = chunked_attention(q, k, v, chunk_size=2, is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages saved for backward while ``fn`` runs."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_recompute_keeps_no_probabilities():
    q, k, v = (torch.randn(1, 2, 256, 8, requires_grad=True) for _ in range(3))
    probabilities = 4 * 2 * 256 * 256  # (B, heads, L, S) in fp32
    saved = saved_bytes(lambda: chunked_attention(q, k, v, chunk_size=32, recompute=False))
    assert saved >= probabilities  # every chunk's probabilities, all of them
    recomputed = saved_bytes(lambda: chunked_attention(q, k, v, chunk_size=32))
    assert recomputed == 3 * 4 * 2 * 256 * 8  # q, k and v, kept for the recomputation


def test_chunked_attention_rejects_bad_input():
    q = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_attention(q, q, q, chunk_size=0)
    with pytest.raises(ValueError, match="head sizes"):
        chunked_attention(q, torch.randn(2, 4, 6), q, chunk_size=2)
    with pytest.raises(ValueError, match="lengths"):
        chunked_attention(q, q, torch.randn(2, 5, 8), chunk_size=2)


class SDPABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_sdpa_report_sees_the_backend():
    report = sdpa_backends_report(SDPABlock(), torch.randn(2, 6, 8))
    assert report.num_sdpa_calls == 1
    assert sum(report.backends.values()) == 1
    assert set(report.backends) <= {"flash (cpu)", "math"}  # the CPU's two kernels
    assert "1 call" in report.format()


def test_sdpa_report_and_switch_on_hugging_face():
    torch.manual_seed(0)
    model = tiny_llama(tie=False)  # built with attn_implementation="eager", 3 layers
    ids = torch.randint(0, 128, (1, 8))
    eager = sdpa_backends_report(model, input_ids=ids)
    assert eager.num_sdpa_calls == 0 and eager.num_softmax_calls >= 3
    assert "no SDPA call" in eager.format()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert use_sdpa(model) == "eager"
    assert use_sdpa(model) == "sdpa"  # already switched: left as it is
    report = sdpa_backends_report(model, input_ids=ids)
    assert report.num_sdpa_calls == 3
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # same attention, fp32 order


def test_use_sdpa_refuses_plain_modules():
    with pytest.raises(TypeError, match="not a Hugging Face model"):
        use_sdpa(nn.Linear(2, 2))
