"""Units stepped on the device (``ramflow.offload(device_optimizer=True)``) against resident
PyTorch on a deepcopy: eager steps, deferred steps (the first, clipping), accumulation,
gradients kept, state dicts, and a load in the middle of training.

On the CPU device the device step is PyTorch's fused CPU AdamW, which ramflow's host kernel
matches bit for bit, so these curves are exact; on CUDA it is the fused CUDA kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import MLPStack
from ramflow.planner.plan import DEVICE_STEP_BYTES_PER_PARAM, DEVICE_STEP_SCRATCH_BYTES
from test_parity import max_rel, mlp_batches, mse, params_rel, ref_adamw


def offload_two_on_device(model, device, **kwargs) -> list[str]:
    """Offload ``model`` (all units resident) with a budget that leaves room for the device
    state of its first two units only; returns the names of the units stepped there."""
    probe = copy.deepcopy(model)
    ramflow.offload(
        probe, device=device, wire_dtype=torch.float32, gpu_memory=10**9, device_optimizer=False
    )
    engine = ramflow.api._engine(probe)
    planned = engine.plan.planned_bytes
    assert len(engine.plan.resident) == len(engine.units)
    first_two = sum(u.trainable_numel for u in engine.units[:2])
    ramflow.undo(probe)
    budget = planned + DEVICE_STEP_SCRATCH_BYTES + DEVICE_STEP_BYTES_PER_PARAM * first_two
    ramflow.offload(
        model,
        device=device,
        wire_dtype=torch.float32,
        gpu_memory=budget,
        device_optimizer=True,
        **kwargs,
    )
    plan = ramflow.get_plan(model)
    assert plan.planned_bytes <= budget
    assert "stepped on the device" in plan.describe()
    return list(plan.device_stepped)


def trained_pair(device):
    """A 4-block MLP offloaded with its first two units stepped on the device, its resident
    deepcopy, and a ramflow AdamW and the reference AdamW for them (lr 1e-2)."""
    model = MLPStack(depth=4)
    ref = copy.deepcopy(model).to(device)
    offload_two_on_device(model, device)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ref, opt, ref_adamw(ref.parameters(), 1e-2, device)


def tol(device) -> float:
    # CUDA: the reference steps with the GPU's foreach AdamW, the device-stepped units with
    # the fused one and the others with the CPU's
    return 1e-6 if device.type == "cpu" else 1e-5


def test_plan_gives_the_leftover_budget_to_the_first_units(device):
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    stepped = offload_two_on_device(model, device)
    names = [u.name for u in ramflow.api._engine(model).units]
    assert stepped == names[:2]
    # no budget: nothing on the device (under ZeRO: tests/test_distributed_device_optimizer.py)
    other = MLPStack(depth=4)
    ramflow.offload(other, device=device, device_optimizer=True)
    assert ramflow.get_plan(other).device_stepped == ()


@pytest.mark.parametrize("keep_grads", [False, True], ids=["drop-grads", "keep-grads"])
def test_device_steps_match_resident(device, keep_grads):
    """Eager steps after the first: device-stepped units never copy gradients down (unless
    kept), and every weight, gradient and state matches the resident run."""
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    ref = copy.deepcopy(model).to(device)
    stepped = offload_two_on_device(model, device)
    engine = ramflow.api._engine(model)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2, keep_grads=keep_grads)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    batches = mlp_batches(3, device)
    for step in range(6):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batches[step % 3]).backward()
            if m is model:
                ramflow.synchronize(model)
                filled = [p.grad is not None for p in model.parameters()]
                # keep_grads=False: eager steps (after the first) leave p.grad None
                assert all(filled) if keep_grads or step == 0 else not any(filled), step
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < tol(device)
    dev_units = [u for u in engine.units if u.name in stepped]
    assert all(u.device_state is not None for u in dev_units)
    # the CPU stepped only the other units, every step
    host_units = [u for u in engine.units if u.name not in stepped]
    host_params = [p for u in host_units for p in u.owned[: u.num_trainable]]
    low = 6 * sum(p.numel() for p in host_params)
    high = 6 * sum(u.trainable_numel for u in host_units)  # flat steps count the padding
    assert low <= engine.host_stepper.host_step_totals()[0] <= high
    # the states came back to the host with synchronize: compare them too
    theirs = ref_opt.state_dict()["state"]
    ours = opt.state_dict()["state"]
    for k in theirs:
        for name in ("exp_avg", "exp_avg_sq"):
            # CUDA: second moments of gradients from two AdamW kernels (1.3e-5 seen)
            state_tol = tol(device) if device.type == "cpu" else 1e-4
            assert max_rel(ours[k][name], theirs[k][name]) < state_tol, (k, name)
        assert float(ours[k]["step"]) == float(theirs[k]["step"]) == 6


def test_device_step_gradients_kept_equal_resident(device):
    torch.manual_seed(0)
    model, ref, opt, ref_opt = trained_pair(device)
    for x, y in mlp_batches(4, device):
        mse(model, (x, y)).backward()
        mse(ref, (x, y)).backward()
        ramflow.synchronize(model)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert max_rel(p.grad, q.grad) < tol(device)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < tol(device)


def test_device_steps_with_clipping_and_accumulation(device):
    """Deferred steps: clipping every step (the host's clipped fp32 gradients are uploaded),
    and accumulation under ``no_step`` (the final backward's step waits for the host sum)."""
    torch.manual_seed(0)
    for clip in (True, False):
        model, ref, opt, ref_opt = trained_pair(device)
        batches = mlp_batches(12, device)
        for step in range(4):
            for k in range(3):
                batch = batches[3 * step + k]
                if clip or k == 2:
                    (mse(model, batch) * 30).backward()
                else:
                    with opt.no_step():
                        (mse(model, batch) * 30).backward()
                (mse(ref, batch) * 30).backward()
                if clip:
                    ramflow.clip_grad_norm_(model.parameters(), 0.5)
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                    break
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        ramflow.synchronize(model)
        assert params_rel(model, ref) < tol(device), clip


def zero_in_place_after_each_step(model, ref, opt, ref_opt, device) -> None:
    """Four clipped steps of ``model`` and ``ref``, each followed at once by
    ``p.grad.zero_()`` on every parameter (PyTorch accumulates into the zeros next)."""
    for batch in mlp_batches(4, device):
        for m, o, clip in (
            (model, opt, ramflow.clip_grad_norm_),
            (ref, ref_opt, torch.nn.utils.clip_grad_norm_),
        ):
            (mse(m, batch) * 30).backward()
            clip(m.parameters(), 0.5)
            o.step()
            for p in m.parameters():
                p.grad.zero_()


def test_gradients_written_right_after_a_deferred_device_step(device):
    """A clipped (deferred) step uploads the host gradients of device-stepped units, on a
    GPU asynchronously from pinned memory: ``step()`` returns only once the uploads have
    read them, so zeroing ``p.grad`` in place at once does not reach the device step (a
    missing wait shows on the GPU as steps taken with zeros: weights far from the
    reference's)."""
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(
        model, device=device, wire_dtype=torch.float32, gpu_memory=10**9, device_optimizer=True
    )
    engine = ramflow.api._engine(model)
    assert all(u.device_stepped for u in engine.units)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    zero_in_place_after_each_step(
        model, ref, opt, ref_adamw(ref.parameters(), 1e-2, device), device
    )
    ramflow.synchronize(model)
    assert params_rel(model, ref) < tol(device)
    assert all(u.device_state is not None for u in engine.units)
    if device.type == "cuda":
        assert all(u.host_grad.is_pinned() for u in engine.units)


def test_gradients_written_during_a_host_step_are_never_silent(device):
    """Host-stepped units: the CPU optimizer reads the gradients after ``step()`` returns,
    so zeroing them in place at once may step with zeros. Either the worker had read them
    first (the weights are the reference's) or ramflow says so at the next call; never a
    silently wrong model (before the check: weights 100% off)."""
    torch.manual_seed(0)
    model, ref, opt, ref_opt = trained_pair(device)
    engine = ramflow.api._engine(model)
    assert any(not u.device_stepped for u in engine.units)
    try:
        zero_in_place_after_each_step(model, ref, opt, ref_opt, device)
        ramflow.synchronize(model)
    except RuntimeError as err:
        assert "written in place" in str(err) and "zero_grad()" in str(err)
    else:
        assert params_rel(model, ref) < tol(device)


def test_device_state_survives_state_dicts_and_loads(device):
    """Saving reads the device's newest weights and states; loading either (a fresh
    optimizer, or the model's weights) replaces what the device holds."""
    torch.manual_seed(0)
    model, ref, opt, ref_opt = trained_pair(device)
    batches = mlp_batches(8, device)
    for i, batch in enumerate(batches):
        if i == 3:
            saved_opt = opt.state_dict()
            saved_model = {k: v.clone() for k, v in model.state_dict().items()}
            for k, v in ref.state_dict().items():
                assert max_rel(saved_model[k], v) < tol(device), k
            opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
            opt.load_state_dict(saved_opt)
        if i == 5:  # scramble the weights, then load them back
            scrambled = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
            keep = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(scrambled)
            model.load_state_dict(keep)
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < tol(device)
    ramflow.undo(model)
    assert params_rel(model, ref.cpu()) < tol(device)


def test_units_in_two_param_groups_step_on_the_device(device):
    """Weights with decay, biases without and at another learning rate: each unit's runs
    are stepped on the device with their own group's hyperparameters, as resident."""
    from test_lean_device_optimizer import decay_groups

    torch.manual_seed(0)
    model = MLPStack(depth=4)
    ref = copy.deepcopy(model).to(device)
    stepped = offload_two_on_device(model, device)
    opt = ramflow.optim.AdamW(decay_groups(model, 1e-2), lr=1e-2)
    ref_opt = torch.optim.AdamW(
        decay_groups(ref, 1e-2), lr=1e-2, fused=device.type == "cpu" or None
    )
    batches = mlp_batches(3, device)
    for step in range(6):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batches[step % 3]).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < tol(device)
    engine = ramflow.api._engine(model)
    assert all(u.device_state is not None for u in engine.units if u.name in stepped)
    host_units = [u for u in engine.units if u.name not in stepped]
    assert engine.host_stepper.host_step_totals()[0] <= 6 * sum(
        u.trainable_numel for u in host_units
    )


@pytest.mark.parametrize("precision", ["fp32", "lean"])
def test_the_default_steps_nothing_on_the_cpu_and_changes_no_bit(precision):
    """``device_optimizer=None`` (the default) is the planner's choice: on the CPU there is
    no device step, so a run with the default is bit for bit one with ``False``."""
    torch.manual_seed(0)
    models = [MLPStack(depth=4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    kwargs = dict(device="cpu", gpu_memory=10**9, host_precision=precision)
    ramflow.offload(models[0], **kwargs)
    ramflow.offload(models[1], device_optimizer=False, **kwargs)
    plan = ramflow.get_plan(models[0])
    assert plan.device_stepped == ()
    assert plan.device_optimizer_reason == "none: the device is the CPU"
    assert ramflow.get_plan(models[1]).device_optimizer_reason == "device_optimizer=False"
    opts = [ramflow.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses = [[], []]
    for batch in mlp_batches(4, torch.device("cpu")):
        for m, o, out in zip(models, opts, losses):
            loss = mse(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    assert losses[0] == losses[1]
    for m in models:
        ramflow.synchronize(m)  # the last steps may still run on the worker
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_device_optimizer_must_be_none_or_a_bool():
    with pytest.raises(TypeError, match="device_optimizer"):
        ramflow.offload(MLPStack(), device="cpu", device_optimizer="auto")


@pytest.mark.gpu
def test_the_default_steps_lean_units_on_the_device_where_it_pays():
    """On CUDA with a lean format and room in the budget the planner steps units on the
    device; fp32 masters and LoRA-style adapters on the device keep every step on the host."""
    device = torch.device("cuda")
    lean = MLPStack(depth=4)
    ramflow.offload(lean, device=device, gpu_memory=10**9, host_precision="lean")
    plan = ramflow.get_plan(lean)
    assert plan.device_stepped, plan.device_optimizer_reason
    assert "step on the device: predicted" in plan.device_optimizer_reason
    fp32 = MLPStack(depth=4)
    ramflow.offload(fp32, device=device, gpu_memory=10**9)
    assert ramflow.get_plan(fp32).device_stepped == ()
    assert "fp32 masters" in ramflow.get_plan(fp32).device_optimizer_reason
