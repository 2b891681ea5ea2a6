"""An optimizer across the model's lifetime: built before ``offload``, kept after ``undo``
(and a new ``offload``), reset by loading an empty state dict; a plain ``torch.optim``
optimizer on host formats it cannot step.

Where ramflow claims exactness (fp32 on the CPU) the reference is PyTorch's fused AdamW on
a ``copy.deepcopy`` of the same model, compared bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ramflow
from models import MLPStack

LR = 1e-2
LEAN = dict(device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
LEAN4 = dict(device="cpu", wire_dtype=torch.bfloat16, host_precision="lean4")
FP32 = dict(device="cpu")


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def train(model, opt, data) -> list[float]:
    """One step per batch; after each, a no_grad forward on the next input (the first use
    of the new weights). Returns the losses and the outputs' sums, in order."""
    curve = []
    for k, batch in enumerate(data):
        loss = mse(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            out = model(data[(k + 1) % len(data)][0])
        curve += [loss.item(), out.double().sum().item()]
    return curve


def weights(model) -> list[torch.Tensor]:
    if ramflow.is_offloaded(model):
        ramflow.synchronize(model)
    return [p.detach().clone() for p in model.parameters()]


def assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    differ = [k for k, (a, b) in enumerate(zip(ours, theirs)) if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} of {len(ours)} parameters differ"


def ref_adamw(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


# ---- an optimizer built before offload ------------------------------------------------


@pytest.mark.parametrize("stepped_before", [False, True])
def test_adamw_built_before_offload_trains_as_resident(stepped_before):
    """Built before ``offload`` (and, ``stepped_before``, stepped on the resident model
    first, so it brings plain states along): every forward after a step uses the new
    weights, bit for bit as PyTorch's AdamW on the resident model."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    opt, ref_opt = ramflow.optim.AdamW(model.parameters(), lr=LR), ref_adamw(ref)
    data = batches(4)
    if stepped_before:
        assert train(model, opt, data[:2]) == train(ref, ref_opt, data[:2])
    ramflow.offload(model, **FP32)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same(weights(model), weights(ref))
    assert_same(
        [opt.state[p]["exp_avg_sq"] for p in model.parameters()],
        [ref_opt.state[p]["exp_avg_sq"] for p in ref.parameters()],
    )


def test_adamw_built_before_lean_offload_equals_one_built_after():
    """In a lean host format, an optimizer built before ``offload`` steps the same bits as
    one built after it (and refreshes the wire copy the next forward reads)."""
    torch.manual_seed(0)
    before, after = MLPStack(), MLPStack()
    after.load_state_dict(before.state_dict())
    opt_before = ramflow.optim.AdamW(before.parameters(), lr=LR)
    ramflow.offload(before, **LEAN)
    ramflow.offload(after, **LEAN)
    opt_after = ramflow.optim.AdamW(after.parameters(), lr=LR)
    data = batches(4)
    assert train(before, opt_before, data) == train(after, opt_after, data)
    assert_same(weights(before), weights(after))


def test_sgd_built_before_lean_offload_refused_at_step():
    """``ramflow.optim.SGD`` has no lean step: built before a lean ``offload``, its next
    step raises the ValueError it raises when built after, and changes nothing."""
    torch.manual_seed(0)
    model = MLPStack()
    opt = ramflow.optim.SGD(model.parameters(), lr=LR)
    ramflow.offload(model, **LEAN)
    mse(model, batches(1)[0]).backward()
    before = weights(model)
    with pytest.raises(ValueError, match="no CPU step"):
        opt.step()
    assert_same(weights(model), before)


# ---- an optimizer kept after undo ----------------------------------------------------


@pytest.mark.parametrize("then", ["resident", "reoffload"])
def test_adamw_kept_after_undo_steps_as_torch(then):
    """The same optimizer after ``ramflow.undo`` steps the plain parameters, and after a
    new ``offload`` the new engine's, bit for bit as PyTorch's AdamW throughout."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    ramflow.offload(model, **FP32)
    opt, ref_opt = ramflow.optim.AdamW(model.parameters(), lr=LR), ref_adamw(ref)
    data = batches(6)
    assert train(model, opt, data[:3]) == train(ref, ref_opt, data[:3])
    ramflow.undo(model)
    if then == "reoffload":
        ramflow.offload(model, **FP32)
    assert train(model, opt, data[3:]) == train(ref, ref_opt, data[3:])
    assert_same(weights(model), weights(ref))
    assert all(float(opt.state[p]["step"]) == 6 for p in model.parameters())


@pytest.mark.parametrize("offload_kwargs", [LEAN, LEAN4], ids=["lean", "lean4"])
def test_adamw_kept_after_lean_undo_steps_as_torch_from_its_states(offload_kwargs):
    """After ``undo`` of a lean model, the optimizer's 8-bit (or 4-bit) moments become
    plain fp32 tensors (decoded), and it steps as PyTorch's AdamW loaded with its state
    dict."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, **offload_kwargs)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    data = batches(5)
    train(model, opt, data[:2])
    ramflow.undo(model)
    state = opt.state_dict()  # the decoded, plain states
    for st in state["state"].values():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].abs().sum() > 0
    ref = copy.deepcopy(model)
    ref_opt = ref_adamw(ref)
    ref_opt.load_state_dict(copy.deepcopy(state))
    for group in ref_opt.param_groups:
        group["fused"] = True  # the loaded groups have none, which PyTorch reads as False
    assert train(model, opt, data[2:]) == train(ref, ref_opt, data[2:])
    assert_same(weights(model), weights(ref))


# ---- loading an empty state dict -----------------------------------------------------


@pytest.mark.parametrize("offload_kwargs", [FP32, LEAN, LEAN4], ids=["fp32", "lean", "lean4"])
def test_loading_an_empty_state_dict_restarts_the_moments(offload_kwargs):
    """Loading the state dict of an optimizer that never stepped resets it as PyTorch
    does: the next steps equal those of a new optimizer (zero moments, step 0)."""
    torch.manual_seed(0)
    reset, fresh = MLPStack(), MLPStack()
    ramflow.offload(reset, **offload_kwargs)
    ramflow.offload(fresh, **offload_kwargs)
    opt = ramflow.optim.AdamW(reset.parameters(), lr=LR)
    empty = copy.deepcopy(opt.state_dict())
    data = batches(6)
    train(reset, opt, data[:3])
    fresh.load_state_dict(reset.state_dict())
    opt.load_state_dict(empty)
    assert len(opt.state) == 0
    fresh_opt = ramflow.optim.AdamW(fresh.parameters(), lr=LR)
    assert train(reset, opt, data[3:]) == train(fresh, fresh_opt, data[3:])
    assert_same(weights(reset), weights(fresh))


# ---- states made when the optimizer is built -----------------------------------------


@pytest.mark.parametrize("offload_kwargs", [FP32, LEAN, LEAN4], ids=["fp32", "lean", "lean4"])
def test_a_second_optimizer_takes_the_states_the_first_never_used(offload_kwargs):
    """States are made when an optimizer is built (see [Note: states made before the
    first step] in ``ramflow.optim.unit_states``), with ``opt.state`` empty as PyTorch's; a
    second optimizer built while the first holds states it never stepped takes those
    buffers rather than making a second set, and trains as a fresh optimizer does on a
    twin model. One that stepped keeps its own."""
    torch.manual_seed(0)
    model, twin = MLPStack(), MLPStack()
    twin.load_state_dict(model.state_dict())
    ramflow.offload(model, **offload_kwargs)
    ramflow.offload(twin, **offload_kwargs)
    first = ramflow.optim.AdamW(model.parameters(), lr=LR)
    units = list(first.unit_states)
    assert len(units) == len(model._ramflow_engine.units) and len(first.state) == 0
    buffers = {n: t.data_ptr() for n, t in first.unit_states[units[0]].items()}
    second = ramflow.optim.AdamW(model.parameters(), lr=LR)
    assert not first.unit_states and list(second.unit_states) == units
    assert {n: t.data_ptr() for n, t in second.unit_states[units[0]].items()} == buffers
    data = batches(3)
    assert train(model, second, data) == train(
        twin, ramflow.optim.AdamW(twin.parameters(), lr=LR), data
    )
    assert_same(weights(model), weights(twin))
    third = ramflow.optim.AdamW(model.parameters(), lr=LR)  # ``second`` stepped: its own
    assert list(second.unit_states) == units and list(third.unit_states) == units
    first_moment = next(iter(second.unit_states[units[0]]))  # exp_avg, or its 4-bit codes
    assert (
        second.unit_states[units[0]][first_moment] is not third.unit_states[units[0]][first_moment]
    )


# ---- a plain torch.optim optimizer on lean host formats -------------------------------


@pytest.mark.parametrize(
    "offload_kwargs",
    [
        LEAN,
        dict(LEAN, host_precision="bf16"),
        dict(LEAN, host_precision="kahan"),
        dict(FP32, host_precision=ramflow.HostPrecision(optimizer_states="int8")),
    ],
    ids=["lean", "bf16", "kahan", "fp32-int8"],
)
@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.SGD], ids=["AdamW", "SGD"])
def test_plain_optimizer_refused_on_non_fp32_formats(offload_kwargs, make):
    """A ``torch.optim`` optimizer cannot step bf16 masters (round to nearest loses the
    updates) or keep 8-bit states: its first step raises a ValueError naming what works,
    before anything is changed."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, **offload_kwargs)
    opt = make(model.parameters(), lr=LR)
    mse(model, batches(1)[0]).backward()
    before = weights(model)
    with pytest.raises(ValueError, match=r"ramflow\.optim\.AdamW.*host_precision='fp32'"):
        opt.step()
    assert_same(weights(model), before)
    assert not opt.state


@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.SGD], ids=["AdamW", "SGD"])
def test_plain_optimizer_on_fp32_formats_still_trains(make):
    """fp32 masters and states: a ``torch.optim`` optimizer trains as on the resident
    model (with its warning that it does not overlap)."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    ramflow.offload(model, **FP32)
    opt, ref_opt = make(model.parameters(), lr=LR), make(ref.parameters(), lr=LR)
    data = batches(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same(weights(model), weights(ref))
