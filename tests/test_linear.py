"""ramflow.Linear and replace_linear against plain nn.Linear on a deepcopy."""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ramflow


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4)
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, device, steps: int = 4, **kw):
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(device)
        y = torch.randn(8, 4, generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=kw.get("autocast", False)):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_linear_trains_like_nn_linear(device):
    """fp32 wire: the same losses and weights as nn.Linear with fused AdamW, bit for bit."""
    ref = _stack().to(device)
    model = ramflow.helpers.replace_linear(copy.deepcopy(_stack()), device=device)
    assert all(isinstance(m, ramflow.Linear) for m in (model[0], model[2], model[4]))
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), device)
    losses = _train(model, ramflow.optim.AdamW(model.parameters(), lr=1e-2), device)
    # on the CPU the same kernels: bit for bit; on CUDA the reference steps with the GPU's
    # fused AdamW, ours with the CPU's, whose roundings differ in the last bits
    exact = device.type == "cpu"
    assert losses == (ref_losses if exact else pytest.approx(ref_losses, rel=1e-5))
    ramflow.synchronize(model)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert b.device.type == "cpu"
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-6}
        torch.testing.assert_close(b, a.cpu(), **tol)


@pytest.mark.gpu
def test_linear_bf16_wire_under_autocast(device):
    """bf16 on the wire under bf16 autocast: what nn.Linear computes under autocast, whose
    matmuls round the weights to bf16 the same way."""
    if device.type != "cuda":
        pytest.skip("autocast in bf16 is the GPU path")
    ref = _stack().to(device)
    model = ramflow.helpers.replace_linear(
        copy.deepcopy(_stack()), device=device, wire_dtype=torch.bfloat16
    )
    ref_losses = _train(
        ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True), device, autocast=True
    )
    losses = _train(model, ramflow.optim.AdamW(model.parameters(), lr=1e-3), device, autocast=True)
    assert losses == pytest.approx(ref_losses, rel=2e-2)


def test_linear_under_activation_checkpointing(device):
    """Recomputation in backward reloads the layers: gradients equal nn.Linear's."""
    ref = _stack().to(device)
    model = ramflow.helpers.replace_linear(copy.deepcopy(_stack()), device=device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(ref, x, use_reentrant=False).sum().backward()
    torch.utils.checkpoint.checkpoint(model, x2, use_reentrant=False).sum().backward()
    ramflow.synchronize(model)
    torch.testing.assert_close(x2.grad, x.grad)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad.cpu())


def test_to_moves_compute_not_weights():
    """model.to(...) picks the compute device and dtype; the fp32 masters stay on the host,
    and nothing of ours moves before the layer runs."""
    layer = ramflow.Linear(8, 4)
    model = nn.Sequential(layer, nn.LayerNorm(4))
    model.to("cpu", dtype=torch.bfloat16)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
    assert model[1].weight.dtype == torch.bfloat16
    y = model(torch.randn(2, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="after it has run"):
        model.to(torch.float16)


@pytest.mark.gpu
def test_a_move_to_the_cpu_before_the_first_call_computes_on_the_cpu():
    """RamTorch builds layers with device="cuda"; a model then moved to the CPU computes
    there (the examples' --device cpu on a GPU machine). share_memory() is not a move."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = nn.Sequential(ramflow.Linear(8, 4, device="cuda"), nn.ReLU())
    model.share_memory()
    assert model[0].extra_repr().endswith("device=cuda, wire_dtype=float32")
    model.to("cpu")
    x = torch.randn(2, 8)
    y = model(x)
    assert y.device.type == "cpu"
    ref = F.relu(F.linear(x, model[0].weight, model[0].bias))
    assert torch.equal(y, ref)  # fp32 wire on the CPU: nn.Linear's own computation
    model.cpu()  # after the first call a move to the CPU changes nothing


def test_fp32_input_with_bf16_wire_returns_fp32():
    layer = ramflow.Linear(8, 4, wire_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(3, 8)
    y = layer(x)
    assert y.dtype == torch.float32
    ref = F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16()).float()
    torch.testing.assert_close(y, ref)


def test_state_dict_round_trip_reaches_the_device():
    """load_state_dict rewrites the host masters and the next call uses them."""
    layer = ramflow.Linear(8, 4, device="cpu")
    x = torch.randn(2, 8)
    layer(x)
    other = nn.Linear(8, 4)
    layer.load_state_dict(other.state_dict())
    torch.testing.assert_close(layer(x), other(x))
    assert layer.state_dict()["weight"].data_ptr() == layer.weight.data_ptr()


def test_replace_linear_keeps_weights_and_frozen_flags():
    model = _stack()
    model[2].weight.requires_grad_(False)  # frozen weight, trainable bias: other layout
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ramflow.helpers.replace_linear(model, device="cpu")
    assert not model[2].weight.requires_grad and model[2].bias.requires_grad
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k])
    opt = ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _train(model, opt, torch.device("cpu"), steps=2)
    ramflow.synchronize(model)
    torch.testing.assert_close(model[2].weight, expected["2.weight"], rtol=0, atol=0)
    assert not torch.equal(model[2].bias, expected["2.bias"])


def test_replace_linear_refuses_tied_weights():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="tied"):
        ramflow.helpers.replace_linear(model)
    assert type(model[0]) is nn.Linear  # nothing replaced


def test_share_memory_before_first_use_and_pickling_after():
    layer = ramflow.Linear(8, 4, device="cpu")
    layer.share_memory()
    assert layer.weight.is_shared() and layer.bias.is_shared()
    clone = pickle.loads(pickle.dumps(layer))  # before it runs: fine
    torch.testing.assert_close(clone.weight, layer.weight)
    layer(torch.randn(1, 8))
    assert layer.weight.is_shared()  # the shared buffer became the master
    with pytest.raises(RuntimeError, match="cannot be pickled"):
        pickle.dumps(layer)


def test_refresh_after_foreign_in_place_edit():
    layer = ramflow.Linear(8, 4, device="cpu")
    x = torch.randn(2, 8)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    model = nn.Sequential(layer)
    ramflow.refresh(model)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "assign-load"])
def test_a_layer_copied_before_its_first_call_computes_as_nn_linear(how):
    """A copy gives weight and bias storage of their own; the first call used to fail an
    assertion and leave a half-built unit in the process's layer engine, breaking the
    other layers."""
    import copy
    import pickle

    torch.manual_seed(0)
    layer = ramflow.Linear(5, 3)
    ref = torch.nn.Linear(5, 3)
    if how == "deepcopy":
        layer = copy.deepcopy(layer)
    elif how == "pickle":
        layer = pickle.loads(pickle.dumps(layer))
    else:
        layer.load_state_dict({"weight": torch.randn(3, 5), "bias": torch.randn(3)}, assign=True)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5)
    assert torch.equal(layer(x), ref(x))
    other = ramflow.Linear(5, 3)  # the process's layer engine still works
    other(x).sum().backward()
    assert other.weight.grad is not None


def test_a_float64_layer_is_refused_when_made():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16.*torch.nn.Linear"):
        ramflow.Linear(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ramflow.Linear(4, 3).double()


@contextlib.contextmanager
def _collector_off():
    """The garbage collector off: what is garbage stays until ``gc.collect()``, as it
    does between two of the collector's runs."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _dropped_in_a_cycle(layer: ramflow.Linear) -> weakref.ref:
    """Train ``layer`` with one backward per step (the pattern that steps during backward)
    under an AdamW caught in a reference cycle (as test_compat_ramtorch's ``exec``
    namespace catches its script's), then drop it; a weak reference to it."""
    opt = ramflow.optim.AdamW(layer.parameters(), lr=1e-2)
    opt.cycle = opt
    x = torch.randn(2, layer.in_features)
    for _ in range(3):
        layer(x).sum().backward()
        opt.step()
        opt.zero_grad()
    # its last steps done: a step still on the engine's worker holds the optimizer (as it
    # should), which under load outlived the next line's new optimizer (a ci12 failure)
    ramflow.synchronize(layer)
    return weakref.ref(opt)


def test_an_optimizer_dropped_in_a_cycle_does_not_step_another_model_s_backward():
    """The layer engine of the process serves every model; an optimizer of another model
    that is garbage but not yet collected made this model's backward step during backward,
    so a second backward raised "a second backward pass ran before opt.step()" (the flake
    of test_a_layer_copied_before_its_first_call_computes_as_nn_linear after
    test_compat_ramtorch in one worker). See [Note: an optimizer of another model]."""
    with _collector_off():
        stale = _dropped_in_a_cycle(ramflow.Linear(5, 3))
        assert stale() is not None  # garbage, not collected: the engine still sees it
        layer = ramflow.Linear(5, 3)
        ref = nn.Linear(5, 3)
        ref.load_state_dict(layer.state_dict())
        x = torch.randn(2, 5)
        for _ in range(2):  # gradients accumulate; nothing steps
            layer(x).sum().backward()
            ref(x).sum().backward()
        ramflow.synchronize(layer)
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
        torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=0, atol=0)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=0)


def test_a_new_optimizer_collects_one_dropped_in_a_cycle():
    """One dropped but not collected kept a new optimizer's passes deferred (eager needs
    one optimizer) and its states in memory until the collector ran."""
    with _collector_off():
        layer = ramflow.Linear(5, 3)
        stale = _dropped_in_a_cycle(layer)
        assert stale() is not None
        opt = ramflow.optim.AdamW(layer.parameters(), lr=1e-2)
        assert stale() is None
        x = torch.randn(2, 5)
        for _ in range(2):
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert layer._engine.stepper.policy.step_was_eager
