"""The device optimizer under ZeRO (``offload(..., zero_stage=..., device_optimizer=True)``):
each rank steps on its own device the resident units it owns, writes their weights back to
the shared host store, and the others refresh from it or from the owner's device copy (see
[Note: the device optimizer under ZeRO] in ``ramflow.engine.device_stepper``). gloo on the CPU device,
where the device step runs too (CI); NCCL on two GPUs (the GPU box)."""

from __future__ import annotations

import pytest
import torch

import dist_workers as W
from test_distributed import _check_ok, _nccl

FP32 = {"wire_dtype": torch.float32}
LEAN = {"wire_dtype": torch.bfloat16, "host_precision": "lean"}


def _train(tmp_path, name: str, world_size: int, backend: str, options: dict) -> list[dict]:
    results = W.run(
        W.train_offload,
        world_size,
        {
            "device_optimizer": True,
            **options,
            "out": str(tmp_path / name),
            "backend": backend,
            "gpu_memory": "1GiB",  # room to keep every unit resident, with its device states
            "whole_batch": True,
        },
    )
    _check_ok(results)
    return results


def _assert_bit_for_bit(results: list[dict], ref: dict) -> None:
    for r in results:
        assert r["losses"] == ref["losses"]
        assert r["norms"] == ref["norms"]
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("refresh", ["0", "1"], ids=["refresh-host", "refresh-broadcast"])
@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("formats", [FP32, LEAN], ids=["fp32", "lean"])
@pytest.mark.parametrize("world_size,backend", [(2, "gloo"), _nccl(2)])
def test_owners_step_on_their_device_as_one_process_does(
    tmp_path, monkeypatch, world_size, backend, formats, zero_stage, refresh
):
    """Two ranks that each train on the whole global batch average two equal gradients,
    which is exact, so they step with one process's gradients: with every unit stepped on
    the device of its owner, losses and final weights equal, bit for bit, one process that
    steps every unit on its device (the same device step, on the same bytes). Each rank
    plans device steps for the units it owns only, the CPU optimizer steps nothing, and
    every rank's device copies end as the shared wire copies (refreshed from the host
    store, which the owners wrote back, or from the owners' devices)."""
    monkeypatch.setenv("RAMFLOW_REFRESH_BY_BROADCAST", refresh)
    options = {**formats, "zero_stage": zero_stage}
    ref = _train(tmp_path, "one", 1, backend, {**options, "zero_stage": None})[0]
    results = _train(tmp_path, "two", world_size, backend, options)
    _assert_bit_for_bit(results, ref)
    assert sorted(ref["device_optimizer"][0]) == sorted(ref["unit_names"])
    stepped = [set(r["device_optimizer"][0]) for r in results]
    assert all(stepped) and not stepped[0] & stepped[1]
    assert stepped[0] | stepped[1] == set(ref["unit_names"])
    assert all("owns" in r["device_optimizer"][1] for r in results)
    assert all(r["host_steps"] == 0 for r in [ref, *results])
    assert all(r["device_current"] for r in results)
    broadcast = [r["broadcast_units"] for r in results]
    assert broadcast == ([len(ref["unit_names"])] * 2 if refresh == "1" else [0, 0])


def _clip_cases() -> list:
    """(formats, world_size, backend): fp32 and lean on gloo; lean on NCCL, since fp32's
    device step on CUDA is PyTorch's fused CUDA AdamW, not the host kernel's bits (its
    NCCL case is the test above, against one process's device steps)."""
    lean_nccl = _nccl(2)
    return [
        pytest.param(FP32, 2, "gloo", id="fp32-gloo"),
        pytest.param(LEAN, 2, "gloo", id="lean-gloo"),
        pytest.param(LEAN, *lean_nccl.values, marks=lean_nccl.marks, id="lean-nccl"),
    ]


@pytest.mark.parametrize("formats,world_size,backend", _clip_cases())
def test_clipping_under_zero2_with_device_steps(tmp_path, formats, world_size, backend):
    """Clipping defers every step: each owner lands its reduced gradients, the global norm
    is summed over the ranks' shares (ZeRO-2), each rank scales its own, and the owners step
    their units on the device from the clipped host gradients. Norms, losses and weights
    equal, bit for bit, the same two ranks stepping every unit on the host (the device step
    gives the host kernel's bits: fused AdamW on the CPU device, the lean kernel's
    arithmetic anywhere); one process would clip by a norm summed in another order."""
    options = {**formats, "zero_stage": 2, "clip": 0.05}
    on_device = _train(tmp_path, "device", world_size, backend, options)
    on_host = _train(tmp_path, "host", world_size, backend, {**options, "device_optimizer": False})
    _assert_bit_for_bit(on_device, on_host[0])
    # the clip bit: the norms exceed max_norm, so the gradients were scaled
    assert all(n > 0.05 for n in on_host[0]["norms"])
    assert all(r["host_steps"] == 0 for r in on_device)
    assert all(r["host_steps"] > 0 for r in on_host)


def test_two_simulated_hosts_step_on_their_devices_as_on_the_host(tmp_path):
    """Two hosts of two ranks ($RAMFLOW_TEST_HOST): each host steps every unit once, on the
    device of its owner there, from gradients all-reduced over the four ranks, and writes
    the weights back to its own host store. Losses and weights equal, bit for bit, the same
    four ranks stepping every unit on the host (the device step gives the host kernel's
    bits on the CPU device)."""
    options = {**LEAN, "zero_stage": 2, "hosts": ["host-a", "host-a", "host-b", "host-b"]}
    on_device = _train(tmp_path, "device", 4, "gloo", options)
    on_host = _train(tmp_path, "host", 4, "gloo", {**options, "device_optimizer": False})
    _assert_bit_for_bit(on_device, on_host[0])
    assert all(r["host_steps"] == 0 for r in on_device)
    assert all(r["device_current"] for r in on_device)


def _right_after_cases() -> list:
    """(options, backend): every unit resident, each stepped on its owner's device (on its
    own stream on CUDA) and broadcast to the other rank before the barrier; and host steps
    with three units resident (broadcast), the others loaded from the host after it."""
    lean_device = {**LEAN, "device_optimizer": True, "gpu_memory": "1GiB"}
    nccl = _nccl(2)
    return [
        pytest.param(lean_device, "gloo", id="lean-device-gloo"),
        pytest.param(
            {**FP32, "device_optimizer": True, "gpu_memory": "1GiB"}, "gloo", id="fp32-device-gloo"
        ),
        pytest.param(
            {**LEAN, "device_optimizer": False, "gpu_memory": "160KiB"},
            "gloo",
            id="lean-host-partly-resident-gloo",
        ),
        pytest.param(lean_device, "nccl", marks=nccl.marks, id="lean-device-nccl"),
    ]


@pytest.mark.parametrize("options,backend", _right_after_cases())
def test_state_dict_and_undo_right_after_a_step_see_its_weights(
    tmp_path, monkeypatch, options, backend
):
    """``model.state_dict()`` taken at once after each ``opt.step()`` (its steps, the
    owners' write-backs and the step's sync still running on the workers), and the plain
    weights after ``ramflow.undo`` right after the last step, equal one process's on every
    rank, bit for bit: both wait for this rank's worker, so for the barrier behind which
    every owner's write-back has landed, even though the next forward no longer waits for
    it (see [Note: the step's sync] in ramflow.distributed.zero)."""
    monkeypatch.setenv("RAMFLOW_REFRESH_BY_BROADCAST", "1")
    options = {**options, "state_each_step": True, "undo": True, "whole_batch": True}
    options["backend"] = backend

    def run(name: str, world_size: int, zero_stage: int | None) -> list[dict]:
        opts = {**options, "zero_stage": zero_stage, "out": str(tmp_path / name)}
        results = W.run(W.train_offload, world_size, opts)
        _check_ok(results)
        return results

    ref = run("one", 1, None)[0]
    assert len(ref["step_states"]) == W.STEPS
    for r in run("two", 2, 2):
        for got, want in zip(r["step_states"], ref["step_states"], strict=True):
            for k, v in want.items():
                assert torch.equal(got[k], v), k
        for k, v in ref["state"].items():
            assert torch.equal(r["state"][k], v), k
        assert not torch.equal(r["step_states"][-1][k], r["step_states"][-2][k])  # it trained


def test_the_planner_chooses_device_steps_per_rank_under_zero(monkeypatch):
    """``device_optimizer=None`` under ZeRO: each rank's planner chooses among the resident
    units it owns (never another rank's), with its CPU optimizer at its share of the host's
    rate, and the plan's reason says so. The CPU device refuses device steps before any
    prediction; with that refusal lifted, the choice is the one a GPU rank makes."""
    from ramflow.engine import engine as engine_module
    from ramflow.engine.engine import Engine
    from ramflow.engine.options import EngineOptions
    from ramflow.formats.host import HostPrecision
    from ramflow.units.unit import find_units

    monkeypatch.setattr(engine_module, "device_optimizer_refusal", lambda **_: None)
    model = W.reference_model(seed=0)
    specs = find_units(model)
    owners = [i % 2 for i in range(len(specs))]
    options = EngineOptions(
        device=torch.device("cpu"),
        wire_dtype=torch.bfloat16,
        gpu_memory_bytes=1 << 30,  # every unit resident, with room for its device states
        prefetch_depth=2,
        device_optimizer=None,
        host_precision=HostPrecision.lean(),
        owners=tuple(owners),
        rank=1,
    )
    engine = Engine(model, specs, options)
    try:
        plan = engine.plan
        mine = {u.name for u in engine.units if u.owner == 1}
        assert plan.device_stepped and set(plan.device_stepped) <= mine
        assert "rank 1 owns" in plan.device_optimizer_reason
        assert "1/2 of the host's rate" in plan.device_optimizer_reason
    finally:
        engine.remove()
