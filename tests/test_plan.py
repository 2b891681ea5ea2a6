"""The planner (``ramflow.planner.plan.make_plan``): without timing inputs it only fits the budget;
with them it picks residents, prefetch depth and checkpointing for the least predicted step."""

from __future__ import annotations

import dataclasses

import pytest

from ramflow.planner.plan import PlanTiming, auto_device_optimizer, make_plan
from ramflow.planner.predict import Rates
from ramflow.sizes import parse_bytes

MB = 1_000_000
N = 12
NAMES = ["embed", *[f"layers.{i}" for i in range(N)], "head"]
BYTES = [200 * MB, *[400 * MB] * N, 200 * MB]
PARAMS = [b // 2 for b in BYTES]


def _plan(budget: int | None, timing: PlanTiming | None = None, **kw):
    return make_plan(
        device="cuda:0",
        wire_dtype="bfloat16",
        unit_names=NAMES,
        unit_bytes=BYTES,
        unit_grad_bytes=BYTES,
        always_resident=[False] * len(NAMES),
        fixed_bytes=0,
        gpu_memory_bytes=budget,
        timing=timing,
        **kw,
    )


def _timing(**kw) -> PlanTiming:
    fields = dict(
        forward_s=[0.0] + [0.004] * N + [0.003],
        trainable_params=PARAMS,
        rates=Rates.from_pcie(25e9, cpu_optimizer_params_per_s=20e9),
    )
    fields.update(kw)
    return PlanTiming(**fields)


def test_more_budget_never_predicts_a_slower_step() -> None:
    steps = [
        _plan(budget, _timing()).prediction.step_s
        for budget in (3000 * MB, 5000 * MB, 8000 * MB, 12000 * MB)
    ]
    for before, after in zip(steps, steps[1:]):
        assert after <= before * 1.005


def test_a_pcie_bound_step_keeps_units_resident() -> None:
    none = _plan(3000 * MB, _timing())
    some = _plan(8000 * MB, _timing())
    assert len(some.resident) > len(none.resident)
    assert some.prediction.step_s < none.prediction.step_s
    assert some.planned_bytes <= 8000 * MB


def test_the_engine_realises_the_timed_plan() -> None:
    timed = _plan(8000 * MB, _timing())
    kwargs = timed.offload_kwargs()
    engine = _plan(kwargs["gpu_memory"], prefetch_depth=kwargs["prefetch_depth"])
    assert engine.resident == timed.resident
    assert engine.window_bytes == timed.window_bytes


def test_a_tight_budget_checkpoints_only_as_many_units_as_it_must() -> None:
    acts = dict(
        activation_bytes=[0] + [1000 * MB] * N + [0],
        checkpoint_bytes=[0] + [100 * MB] * N + [0],
        other_activation_bytes=500 * MB,
    )
    roomy = _plan(40000 * MB, _timing(**acts))
    assert roomy.checkpointed == ()
    tight = _plan(12000 * MB, _timing(**acts))
    assert 0 < len(tight.checkpointed) < N
    assert tight.planned_bytes + tight.activation_bytes <= 12000 * MB
    # one unit fewer checkpointed would not have fit beside the same plan
    peaks = _timing(**acts).activation_peak_bytes
    index = {n: i for i, n in enumerate(NAMES)}
    fewer = {index[n] for n in tight.checkpointed[1:]}
    assert tight.planned_bytes + peaks(fewer) > 12000 * MB


def test_too_small_for_any_policy_says_so() -> None:
    acts = dict(activation_bytes=[0] + [1000 * MB] * N + [0], other_activation_bytes=9000 * MB)
    with pytest.raises(ValueError, match="too small"):
        _plan(9000 * MB, _timing(**acts))


def test_fixed_checkpointing_and_depths_are_kept() -> None:
    plan = _plan(None, _timing(checkpointed=["layers.0", "layers.1"], prefetch_depths=(3,)))
    assert plan.checkpointed == ("layers.0", "layers.1")
    assert plan.prefetch_depth == 3
    assert plan.resident == ()  # no budget: nothing resident beyond the window
    with pytest.raises(ValueError, match="does not have"):
        _plan(None, _timing(checkpointed=["layers.99"]))


def test_without_timing_nothing_changes() -> None:
    plan = _plan(5000 * MB)
    assert plan.prediction is None and plan.checkpointed == ()
    # window 4 x 400 MB and gradients 2 x 400 MB leave 2600 MB: the head and six blocks
    assert plan.resident == (*[f"layers.{i}" for i in range(6, N)], "head")
    assert "predicted" not in plan.describe()
    assert "predicted step" in _plan(5000 * MB, _timing()).describe()


@pytest.mark.parametrize(
    "value, says",
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (-float("inf"), "finite"),
        ("nan", "finite"),
        ("inf GiB", "finite"),
        ("Infinity", "finite"),
        ("-12GiB", "negative"),
        ("- 1 MB", "negative"),
        (-1, "negative"),
        (-0.5, "negative"),
        ("12 parsecs", "cannot read"),
    ],
)
def test_parse_bytes_refuses_sizes_that_are_not_finite_or_negative(value, says):
    """NaN and infinity once crashed in int() (or were read as no size at all), and a
    negative string was called unreadable: each error now names what is wrong."""
    with pytest.raises(ValueError, match=f"gpu_memory: .*{says}"):
        parse_bytes(value)


def test_parse_bytes_reads_signed_and_spaced_sizes():
    assert parse_bytes("+1.5 GiB") == 3 * 2**29
    assert parse_bytes(" 512MiB ") == 512 * 2**20
    assert parse_bytes(12.0) == 12


LEAN_STATES = 2.03  # device bytes per parameter of a lean unit's states


def _auto(budget: int | None, **kw):
    fields = dict(
        bytes_per_param=LEAN_STATES,
        scratch_bytes=64 * MB,
        rates=Rates.from_pcie(25e9, cpu_optimizer_params_per_s=1e9),
    )
    fields.update(kw)
    return auto_device_optimizer(_plan(budget), PARAMS, **fields)


def test_auto_device_optimizer_steps_the_first_resident_units_that_fit() -> None:
    everything = sum(BYTES) + 6 * 400 * MB  # all resident, window and gradients
    room = sum(int(p * LEAN_STATES) for p in PARAMS[:3]) + 64 * MB
    plan = _auto(_plan(everything).planned_bytes + room)
    assert len(plan.resident) == len(NAMES)
    # the embedding (first) and the first two blocks fill the room exactly
    assert plan.device_stepped == ("embed", "layers.0", "layers.1")
    assert plan.planned_bytes <= plan.gpu_memory_bytes
    assert "3 of 14 resident units" in plan.device_optimizer_reason
    assert "GPU compute not known" in plan.device_optimizer_reason
    assert "stepped on the device: embed, layers.0-1" in plan.describe()


def test_auto_device_optimizer_needs_room_and_a_budget() -> None:
    tight = _auto(_plan(sum(BYTES) + 6 * 400 * MB).planned_bytes)
    assert tight.device_stepped == ()
    assert tight.device_optimizer_reason.startswith("none: the budget leaves")
    assert _auto(None).device_stepped == ()
    assert _auto(None).device_optimizer_reason == "none: no gpu_memory budget"


def test_auto_device_optimizer_keeps_a_gpu_bound_step_on_the_host() -> None:
    big = _plan(10**12).planned_bytes * 2
    # a fast CPU and slow device steps with a long forward: the CPU work is hidden
    fast_cpu = Rates.from_pcie(1e15, cpu_optimizer_params_per_s=1e15)
    fast_cpu = dataclasses.replace(fast_cpu, device_optimizer_params_per_s=1e9)
    plan = _auto(big, rates=fast_cpu, forward_s=[0.05] * len(NAMES))
    assert plan.device_stepped == ()
    assert "does not shorten the predicted step" in plan.device_optimizer_reason
    # the same budget with the default CPU rate: stepping there pays
    assert _auto(big, forward_s=[0.05] * len(NAMES)).device_stepped


def test_offloaded_inputs_leave_two_on_the_device_and_cross_pcie_in_the_prediction() -> None:
    """PlanTiming(offload=True): every layer checkpointed, at most two inputs of 300 MB on
    the device at once (not N), and each crosses PCIe once each way in the predicted step."""
    acts = dict(
        activation_bytes=[0] + [1000 * MB] * N + [0],
        checkpoint_bytes=[0] + [300 * MB] * N + [0],
        checkpointed=NAMES[1:-1],
    )
    on = _timing(**acts)
    off = _timing(offload=True, **acts)
    every = set(range(1, N + 1))
    assert on.activation_peak_bytes(every) - off.activation_peak_bytes(every) == (N - 2) * 300 * MB
    assert off.offload_bytes(1, every) == 300 * MB and on.offload_bytes(1, every) == 0
    assert off.offload_bytes(0, every) == 0
    plan_on, plan_off = _plan(None, on), _plan(None, off)
    assert plan_off.prediction.offload_bytes == N * 300 * MB
    assert plan_on.prediction.offload_bytes == 0
    assert plan_off.prediction.step_s > plan_on.prediction.step_s
