"""The activation report measures, per module, the bytes autograd saves for backward.

The expected bytes are worked out by hand from what each operator saves (fp32, 4 bytes):
``mm``/``addmm`` (Linear) save their input, and the weight only when the input needs a
gradient; ReLU saves its output; softmax saves its output; ``bmm`` saves both operands.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ramflow.memory import activation_report

B, D, H, OUT = 5, 8, 16, 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, OUT))


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_linear_relu_stack_exact_bytes(input_requires_grad):
    model = mlp()
    x = torch.randn(B, D, requires_grad=input_requires_grad)
    report = activation_report(model, x)
    # Linear 0 saves x; ReLU 1 saves its output, which Linear 2 saves again as its input
    # (one storage); ReLU 3 and Linear 4 likewise. With x needing a gradient the Linears
    # also save their weight (transposed): a parameter, so not an activation.
    assert report["0"].saved_bytes == 4 * B * D
    for name in ("1", "2", "3", "4"):
        assert report[name].saved_bytes == 4 * B * H, name
    assert report[""].saved_bytes == report.total_saved_bytes == 4 * B * (D + 2 * H)
    assert report["2"].input_bytes == 4 * B * H
    assert [r.name for r in report.modules] == ["", "1", "2", "3", "4", "0"]  # largest first
    assert all(r.forward_peak_bytes is None for r in report.modules)  # CPU: no device peak


class Attention(nn.Module):
    """Eager multi-head self-attention with contiguous q, k, v (so that what matmul saves
    is fixed: reshaping a contiguous tensor is a view, not a copy)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = (part.contiguous() for part in qkv.unbind(0))  # (B, heads, T, Dh) each
        probs = torch.softmax(q @ k.transpose(-2, -1) * (1 / math.sqrt(d // self.heads)), -1)
        o = (probs @ v).transpose(1, 2).reshape(b, t, d)  # (B, T, D), a copy
        return self.out(o)


def test_attention_block_exact_bytes():
    b, t, d, heads = 2, 6, 16, 4
    torch.manual_seed(0)
    model = Attention(d, heads)
    report = activation_report(model, torch.randn(b, t, d))
    # qkv saves x; q @ k^T (bmm) saves q and k; softmax saves the probabilities, which
    # probs @ v saves again with v; out saves o. q, k, v, o and x are (B, T, D) each.
    btd = 4 * b * t * d
    assert report["qkv"].saved_bytes == btd
    assert report["out"].saved_bytes == btd
    assert report.total_saved_bytes == 5 * btd + 4 * b * heads * t * t


def test_report_changes_nothing_in_the_model():
    model = mlp()
    report = activation_report(model, torch.randn(B, D))
    assert report.total_saved_bytes > 0
    assert all(p.grad is None for p in model.parameters())  # backward ran; grads put back
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    grads = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    activation_report(model, torch.randn(B, D))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    # values too: the report's own backward must not be added into the existing grads
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())


def test_nothing_saved_without_grad():
    model = mlp()
    with torch.no_grad():
        report = activation_report(model, torch.randn(B, D))
    assert report.total_saved_bytes == 0
    assert report["0"].num_calls == 1


def test_format_lists_modules():
    text = activation_report(mlp(), torch.randn(B, D)).format()
    assert "Sequential" in text and "ReLU" in text and "<root>" in text


@pytest.mark.gpu
def test_cuda_peaks():
    model = mlp().cuda()
    x = torch.randn(B, D, device="cuda")
    before = torch.cuda.memory_allocated()
    report = activation_report(model, x)
    root = report[""]
    # at the end of forward every saved storage is alive (x was allocated before)
    assert root.forward_peak_bytes >= before + report.total_saved_bytes - 4 * B * D
    assert root.backward_peak_bytes is not None
    assert all(r.forward_peak_bytes is not None for r in report.modules)
