"""Lean host formats with units stepped on the device (``device_optimizer=True``).

A bf16 master is the unit's device copy, so a device step adds only the unit's states (in
their format) on the device and runs the host kernel's arithmetic there in PyTorch ops.
Against the same model and format stepped on the host alone (a deepcopy), every loss,
weight and state is bit-identical: on the CPU device (CI) and, marked ``gpu``, on CUDA,
where the step runs as PyTorch's CUDA ops.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import MLPStack
from ramflow.formats.host import HostPrecision
from ramflow.planner.plan import LEAN_DEVICE_STEP_SCRATCH_BYTES
from test_parity import mlp_batches, mse

FORMATS = ["lean", "kahan", "bf16", "lean4"]


def offload_first_two_on_device(model, device, precision: str) -> list[str]:
    """Offload ``model`` (every unit resident) with a budget that leaves room for the
    device states of its first two units only; returns the units stepped there."""
    kwargs = dict(device=device, wire_dtype=torch.bfloat16, host_precision=precision)
    probe = copy.deepcopy(model)
    ramflow.offload(probe, gpu_memory=10**9, device_optimizer=False, **kwargs)
    engine = ramflow.api._engine(probe)
    planned = engine.plan.planned_bytes
    assert len(engine.plan.resident) == len(engine.units)
    first_two = sum(u.trainable_numel for u in engine.units[:2])
    ramflow.undo(probe)
    per_param = HostPrecision.parse(precision).device_step_bytes_per_parameter
    budget = planned + LEAN_DEVICE_STEP_SCRATCH_BYTES + int(per_param * first_two) + 1
    ramflow.offload(model, gpu_memory=budget, device_optimizer=True, **kwargs)
    plan = ramflow.get_plan(model)
    assert plan.planned_bytes <= budget
    return list(plan.device_stepped)


def train(m, opt, batches) -> list[float]:
    """The losses of one bf16-autocast step of ``opt`` per batch of ``batches``."""
    out = []
    for batch in batches:
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16):
            loss = mse(m, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("precision", FORMATS)
def test_device_steps_give_the_host_steps_bits(device, precision):
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    host_only = copy.deepcopy(model)
    stepped = offload_first_two_on_device(model, device, precision)
    assert len(stepped) == 2
    ramflow.offload(host_only, device=device, wire_dtype=torch.bfloat16, host_precision=precision)
    # the device states are the format's, not fp32 ones: 12 bytes per parameter would
    # not have fit the budget for even one unit of this size
    per_param = HostPrecision.parse(precision).device_step_bytes_per_parameter
    assert per_param < 6
    opts = [
        ramflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, host_only)
    ]
    batches = mlp_batches(6, device)
    assert train(model, opts[0], batches) == train(host_only, opts[1], batches)
    engine = ramflow.api._engine(model)
    assert any(u.device_state is not None for u in engine.units)  # stepped there
    ramflow.synchronize(model)
    ramflow.synchronize(host_only)
    for (name, p), q in zip(model.named_parameters(), host_only.parameters()):
        assert torch.equal(p, q), name
    states = [opt.state_dict()["state"] for opt in opts]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        for name, t in states[0][key].items():
            assert torch.equal(t, states[1][key][name]), (key, name)


def test_a_model_saved_after_device_steps_resumes_with_the_same_bits(device):
    torch.manual_seed(0)
    base = MLPStack(depth=4)
    model, resumed = copy.deepcopy(base), copy.deepcopy(base)
    offload_first_two_on_device(model, device, "lean")
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    batches = mlp_batches(6, device)

    first = train(model, opt, batches[:3])
    saved_model = copy.deepcopy(model.state_dict())  # the device's newest, pulled back
    saved_opt = copy.deepcopy(opt.state_dict())
    rest = train(model, opt, batches[3:])

    offload_first_two_on_device(resumed, device, "lean")
    opt2 = ramflow.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert first and train(resumed, opt2, batches[3:]) == rest


def decay_groups(model, lr: float) -> list[dict]:
    """The usual LLM recipe: matrices with weight decay, biases without and (to show that
    each run gets its own group) at another learning rate."""
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": mats, "weight_decay": 0.1},
        {"params": vecs, "weight_decay": 0.0, "lr": 2 * lr},
    ]


@pytest.mark.parametrize("precision", ["lean", "kahan", "lean4"])
def test_units_in_two_param_groups_step_on_the_device(device, precision):
    """A unit whose parameters sit in two param groups (weights with decay, biases
    without) is stepped on the device run by run, not handed back to the host: the same
    bits as the host steps, and the host stepped only the other units."""
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    host_only = copy.deepcopy(model)
    stepped = offload_first_two_on_device(model, device, precision)
    ramflow.offload(host_only, device=device, wire_dtype=torch.bfloat16, host_precision=precision)
    opts = [ramflow.optim.AdamW(decay_groups(m, 1e-2), lr=1e-2) for m in (model, host_only)]
    batches = mlp_batches(6, device)
    assert train(model, opts[0], batches) == train(host_only, opts[1], batches)
    ramflow.synchronize(model)
    ramflow.synchronize(host_only)
    for (name, p), q in zip(model.named_parameters(), host_only.parameters()):
        assert torch.equal(p, q), name
    engine = ramflow.api._engine(model)
    dev_units = [u for u in engine.units if u.name in stepped]
    assert dev_units and all(u.device_state is not None for u in dev_units)
    # the first step is deferred and stepped from the host's gradients on the device too:
    # the host stepped only the other units, each step
    host_units = [u for u in engine.units if u.name not in stepped]
    assert engine.host_stepper.host_step_totals()[0] <= 6 * sum(
        u.trainable_numel for u in host_units
    )


@pytest.mark.gpu
@pytest.mark.parametrize("precision", FORMATS)
def test_offload_compiles_the_device_step_so_steps_compile_nothing(precision):
    """With units planned on the device, ``offload`` compiles the Triton kernel for every
    variant a step launches (see [Note: building before the first step]): training with
    clipping and two param groups (decay on and off) compiles no kernel."""
    from ramflow.kernels.lean_triton import _kernel

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    offload_first_two_on_device(model, device, precision)
    kernels = _kernel().device_caches[device.index][0]  # Triton 3's per-device kernel cache
    compiled = len(kernels)
    assert compiled >= 4
    opt = ramflow.optim.AdamW(decay_groups(model, 1e-2), lr=1e-2)
    for batch in mlp_batches(3, device):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = mse(model, batch)
        loss.backward()
        ramflow.clip_grad_norm_(model.parameters(), 1e-3)  # a gradient scale below 1
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    assert len(kernels) == compiled
