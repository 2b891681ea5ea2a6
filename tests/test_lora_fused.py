"""``ramflow.helpers.fuse_lora``: PEFT's LoRA layers as one matmul plus an update written in
its epilogue ([Note: fused LoRA] in ``ramflow.layers.lora_fused``).

What could fail: the fused layer computing another function than PEFT's (scaling, bias,
autocast dtypes, gradients of the adapters and of the input), a case PEFT handles
differently (dropout, DoRA, disabled or merged adapters, several adapters) taking the
fused path, and the offloaded model computing other values than the resident one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import enable_hf_checkpointing, tiny_llama

peft = pytest.importorskip("peft")
from ramflow.layers.lora_fused import _LoraLinear  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TwoLayers(nn.Module):
    """A base with a bias (``a``) and one without (``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 16, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def lora(model: nn.Module, **kw) -> nn.Module:
    # init_lora_weights=False: lora_B random, so the update is not zero at the start
    options = {"r": 4, "lora_alpha": 12, "target_modules": ["a", "b"], "lora_dropout": 0.0,
               "init_lora_weights": False} | kw  # fmt: skip
    return peft.get_peft_model(model, peft.LoraConfig(**options))


def fused_in_graph(y: torch.Tensor) -> bool:
    """Whether ``_LoraLinear`` is in the autograd graph of ``y``."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == f"{_LoraLinear.__name__}Backward":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """``a`` within 2^-16 (about 128 fp32 ulps) of ``b``'s largest magnitude."""
    assert (a - b).abs().max() <= 2**-16 * b.abs().max(), what


def test_fp32_matches_peft(device):
    torch.manual_seed(0)
    ref = lora(TwoLayers()).to(device)
    model = copy.deepcopy(ref)
    assert ramflow.helpers.fuse_lora(model) == 2
    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model(x), ref(x_ref)
    assert fused_in_graph(y) and not fused_in_graph(y_ref)
    (y * y_ref.detach().sign()).sum().backward()
    (y_ref * y_ref.detach().sign()).sum().backward()
    # fp32: the fused epilogue rounds the scaled update and the sum once, PEFT twice, and
    # the scaling meets the adapters' gradients at another point of their sums (PEFT scales
    # the output gradient, the fused backward the rank-r product), so the two differ by a
    # few fp32 ulps of each tensor's largest entry
    close(y, y_ref)
    close(x.grad, x_ref.grad)
    g, g_ref = grads(model), grads(ref)
    assert set(g) == set(g_ref) and len(g) == 4  # only the adapters train
    for name in g:
        close(g[name], g_ref[name], name)


def test_autocast_bf16_matches_peft_to_its_rounding(device):
    torch.manual_seed(0)
    ref = lora(TwoLayers()).to(device)
    model = copy.deepcopy(ref)
    ramflow.helpers.fuse_lora(model)
    layer, layer_ref = model.base_model.model.a, ref.base_model.model.a
    x = torch.randn(64, 32, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y, y_ref = layer(x), layer_ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    # PEFT rounds lora_B's output, its product with the scaling and the sum to bf16, the
    # fused layer only the sum: they differ by at most an ulp of the output plus the two
    # roundings of the update, each under 2^-8 of the output's magnitude here
    bound = 2**-7 * y_ref.float().abs().amax()
    assert (y.float() - y_ref.float()).abs().max() <= bound
    assert fused_in_graph(y)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_offloaded_fused_equals_resident_fused(device, when, checkpointing):
    """Offloaded with ``fuse_lora`` computes what the resident model with ``fuse_lora``
    computes, step after step (bit for bit on the CPU). With Hugging Face's activation
    checkpointing the fused layers run again in backward, reading their base layer's
    weight without calling it (see [Note: parameters during backward])."""
    torch.manual_seed(0)
    base = tiny_llama(tie=False, hidden=128, intermediate=256)
    if checkpointing:
        enable_hf_checkpointing(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    ref = copy.deepcopy(model).to(device)
    if when == "before":
        ramflow.helpers.fuse_lora(model)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    if when == "after":
        ramflow.helpers.fuse_lora(model)
    assert ramflow.helpers.fuse_lora(ref) == 3 * len(TARGETS)
    opt = ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )  # the kernel ramflow steps device-resident adapters with
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        assert fused_in_graph(loss) and fused_in_graph(ref_loss)
        for o, l_ in ((opt, loss), (ref_opt, ref_loss)):
            l_.backward()
            o.step()
            o.zero_grad()
        if device.type == "cpu":
            assert torch.equal(loss, ref_loss), step
        else:  # cuBLAS may pick another kernel for another alignment of the same operands
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    moved = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(p.count_nonzero() for p in moved)  # every adapter got gradients


def _same_as_peft(model, ref, x, *, expect_fused: bool, **kw) -> None:
    torch.manual_seed(3)
    y = model(x, **kw)
    torch.manual_seed(3)
    y_ref = ref(x, **kw)
    assert fused_in_graph(y) is expect_fused
    if not expect_fused:
        assert torch.equal(y, y_ref)


def test_cases_peft_computes_differently_take_peft_path():
    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    # active dropout: PEFT's path (its random mask); in eval mode the dropout is the
    # identity and the fused path applies
    ref = lora(TwoLayers(), lora_dropout=0.5)
    model = copy.deepcopy(ref)
    ramflow.helpers.fuse_lora(model)
    _same_as_peft(model, ref, x, expect_fused=False)
    model.eval()
    _same_as_peft(model, ref.eval(), x, expect_fused=True)
    # DoRA
    ref = lora(TwoLayers(), use_dora=True)
    model = copy.deepcopy(ref)
    ramflow.helpers.fuse_lora(model)
    _same_as_peft(model, ref, x, expect_fused=False)
    # adapters disabled, merged, several active
    ref = lora(TwoLayers())
    model = copy.deepcopy(ref)
    ramflow.helpers.fuse_lora(model)
    with model.disable_adapter(), ref.disable_adapter():
        _same_as_peft(model, ref, x, expect_fused=False)
    cfg = peft.LoraConfig(r=2, target_modules=["a", "b"], init_lora_weights=False)
    for m in (model, ref):
        torch.manual_seed(5)
        m.add_adapter("second", cfg)
        m.base_model.set_adapter(["default", "second"])
    _same_as_peft(model, ref, x, expect_fused=False)
    for m in (model, ref):
        m.set_adapter("default")
        m.merge_adapter()
    _same_as_peft(model, ref, x, expect_fused=False)
    # without autocast, operands of two dtypes (a bf16 base, fp32 adapters)
    ref = lora(TwoLayers())
    ref.base_model.model.a.base_layer.to(torch.bfloat16)
    model = copy.deepcopy(ref)
    ramflow.helpers.fuse_lora(model)
    xb = x.detach().to(torch.bfloat16)
    y, y_ref = model.base_model.model.a(xb), ref.base_model.model.a(xb)
    assert not fused_in_graph(y) and torch.equal(y, y_ref)


def test_fuse_count_unfuse_and_deepcopy():
    torch.manual_seed(0)
    assert ramflow.helpers.fuse_lora(TwoLayers()) == 0  # no LoRA layers: nothing to do
    model = lora(TwoLayers())
    assert ramflow.helpers.fuse_lora(model) == 2
    assert ramflow.helpers.fuse_lora(model) == 2  # idempotent
    x = torch.randn(4, 32)
    copied = copy.deepcopy(model)
    layer = copied.base_model.model.a
    assert layer.forward.__self__ is layer  # the copy's forward is bound to the copy
    assert fused_in_graph(copied(x.requires_grad_()))
    assert ramflow.helpers.unfuse_lora(model) == 2
    assert not fused_in_graph(model(x))
    assert ramflow.helpers.unfuse_lora(model) == 0
