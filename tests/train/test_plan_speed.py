"""``ramflow plan``'s predicted step time: printed with its assumptions, and it follows them."""

from __future__ import annotations

import dataclasses

import pytest

from ramflow import HostPrecision
from ramflow.planner.cpu_rates import OPTIMIZER_SPEED, rated_as, rates_for
from ramflow.planner.plan import make_plan
from ramflow.planner.predict import Rates
from ramflow.train import TrainConfig, plan_run


def _plan(*, clip_grad: float | None = None, num_ranks: int = 1, **rates):
    config = TrainConfig.from_options(
        preset="tiny", device="cuda", gpu_memory="1GiB", batch_size=4, seq_len=256,
        clip_grad=clip_grad,
    )  # fmt: skip
    return plan_run(config, num_ranks=num_ranks, **rates)


def test_plan_cli_prints_the_prediction_and_its_assumptions(ramflow_cli, capsys) -> None:
    rc = ramflow_cli(
        "plan", "--preset", "tiny", "--device", "cuda", "--gpu-memory", "1GiB",
        "--pcie-gbps", "10", "--gpu-tflops", "100", "--cpu-adamw-gparams", "1",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    for text in (
        "step time (predicted",
        "bound by",
        "pinned PCIe 10.0 GB/s",
        "100 TFLOP/s",
        "1.00 G params/s",
        "fastest plan for the same budget",
        "resident units:",
        "prefetch depth",
        "checkpointed units:",
        "ramflow.offload(model, gpu_memory=",
    ):
        assert text in out


def test_a_cpu_run_gets_no_prediction(ramflow_cli, capsys) -> None:
    assert ramflow_cli("plan", "--preset", "tiny", "--device", "cpu") == 0
    assert "predicted" not in capsys.readouterr().out


def test_bad_rates_are_refused(ramflow_cli, capsys) -> None:
    assert ramflow_cli("plan", "--preset", "tiny", "--device", "cuda", "--pcie-gbps", "0") == 2
    assert "--pcie-gbps must be positive" in capsys.readouterr().err


def test_the_prediction_follows_the_assumed_rates() -> None:
    slow_cpu = _plan(timing_rates=Rates(cpu_optimizer_params_per_s=1e6)).prediction
    assert slow_cpu.bound == "CPU optimizer"
    slow_link = _plan(timing_rates=Rates.from_pcie(1e6, cpu_optimizer_params_per_s=1e15))
    assert slow_link.prediction.bound.startswith("PCIe")
    slow_gpu = _plan(
        timing_rates=Rates.from_pcie(1e15, cpu_optimizer_params_per_s=1e15),
        matmul_flops_per_s=1e9,
    ).prediction
    assert slow_gpu.bound == "GPU compute"


def test_the_fastest_plan_fits_and_the_engine_can_follow_it() -> None:
    # a slow link: residents pay where units step during backward (several ranks without
    # clipping); steps after backward put each refresh on the next forward's path
    est = _plan(clip_grad=0.0, num_ranks=2, timing_rates=Rates.from_pcie(1e8))
    best = est.timed_plan
    assert best is not None and best.prediction is not None
    assert best.planned_bytes + best.activation_bytes <= est.device_budget_bytes
    assert best.prediction.step_s <= est.prediction.step_s * 1.005
    assert best.resident  # the link binds, so the planner keeps units on the device
    kwargs = best.offload_kwargs()
    plan = est.plan
    engine = make_plan(
        device="cuda",
        wire_dtype=plan.wire_dtype,
        unit_names=plan.unit_names,
        unit_bytes=plan.unit_bytes,
        unit_grad_bytes=[plan.grad_bytes // 2] * len(plan.unit_names),
        always_resident=[False] * len(plan.unit_names),
        fixed_bytes=plan.fixed_bytes,
        gpu_memory_bytes=kwargs["gpu_memory"],
        prefetch_depth=kwargs["prefetch_depth"],
    )
    assert engine.resident == best.resident


@pytest.mark.parametrize("checkpointing", ["on", "off"])
def test_a_fixed_checkpointing_setting_is_kept(checkpointing: str) -> None:
    config = TrainConfig.from_options(
        preset="tiny", device="cuda", gpu_memory="1GiB", checkpointing=checkpointing
    )
    best = plan_run(config).timed_plan
    assert bool(best.checkpointed) == (checkpointing == "on")


def test_each_host_format_is_predicted_at_its_own_cpu_optimizer_rate() -> None:
    # a CPU-bound plan: the optimizer's time is the step's, so it scales with the format's
    # rate (OPTIMIZER_SPEED), which the rates given are converted from (fp32);
    # the copies' host DRAM time is left out (it is the same for every format)
    slow = dataclasses.replace(
        Rates.from_pcie(1e15, cpu_optimizer_params_per_s=1e6),
        cpu_optimizer_dram_bytes_per_param=None,
    )
    steps = {}
    for name in ("fp32", "bf16", "lean", "kahan"):
        config = TrainConfig.from_options(
            preset="tiny",
            device="cuda",
            gpu_memory="1GiB",
            batch_size=4,
            seq_len=256,
            host_precision=name,
        )
        pred = plan_run(config, timing_rates=slow, matmul_flops_per_s=1e18).prediction
        assert pred.bound == "CPU optimizer"
        steps[name] = pred.step_s
    speed = OPTIMIZER_SPEED
    for name in ("bf16", "lean", "kahan"):
        assert steps[name] / steps["fp32"] == pytest.approx(speed["fp32"] / speed[name], rel=0.02)
    # rates convert back and forth, the machine's DRAM rate kept; a policy that is not a
    # preset is rated as the preset with its optimizer states
    rates = Rates()
    lean = rates_for(rates, HostPrecision.lean())
    assert lean.cpu_optimizer_params_per_s == pytest.approx(
        rates.cpu_optimizer_params_per_s * speed["lean"], rel=1e-12
    )
    dram = rates.cpu_optimizer_params_per_s * rates.cpu_optimizer_dram_bytes_per_param
    assert lean.cpu_optimizer_params_per_s * lean.cpu_optimizer_dram_bytes_per_param == (
        pytest.approx(dram, rel=1e-12)
    )
    back = rates_for(lean, HostPrecision.fp32())
    assert back.cpu_optimizer_params_per_s == pytest.approx(rates.cpu_optimizer_params_per_s)
    odd = HostPrecision(master="bf16-sr", optimizer_states="fp8", gradients="full")
    assert odd.name == "bf16-sr/fp8/full"  # not a preset: rated by its fields, not its name
    assert rates_for(rates, odd) == dataclasses.replace(lean, host_precision=odd)
    kahan = HostPrecision(master="bf16-kahan", optimizer_states="fp8", gradients="full")
    assert rated_as(kahan) == "kahan" and rated_as(dataclasses.replace(odd, seed=3)) == "lean"


def test_the_estimates_own_description_gives_the_fastest_plan_as_an_offload_call() -> None:
    """``MemoryEstimate.describe()`` (what an API user prints) says the prediction, the
    rates it assumed and the fastest plan as the ``ramflow.offload`` call that makes it."""
    from ramflow.memory.estimate import size_string

    est = _plan(clip_grad=0.0, num_ranks=2, timing_rates=Rates.from_pcie(1e8))
    text = est.describe()
    best = est.timed_plan
    kwargs = best.offload_kwargs()
    assert f"step time (predicted, estimated inputs): {est.prediction.describe()}" in text
    assert "pinned PCIe 0.1 GB/s H2D" in text
    assert (
        f"fastest plan for this budget: {best.prediction.step_s * 1e3:.0f} ms per step, "
        f"bound by {best.prediction.bound}"
    ) in text
    assert (
        f"ramflow.offload(model, gpu_memory={size_string(kwargs['gpu_memory'])!r}, "
        f"prefetch_depth={kwargs['prefetch_depth']}, activation_checkpointing="
    ) in text


def test_the_predicted_step_of_several_micro_batches_is_the_optimizer_step() -> None:
    """``--grad-accum M``: the plan predicts the optimizer step the run times (M
    micro-batches, run unit-major on one process: the compute M times, the weights and the
    optimizer once), not one micro-batch's. With a GPU so slow that compute binds, the step
    is about M times one micro-batch's; with a CPU optimizer so slow that it binds, about
    the same as one micro-batch's (tolerances: the pipeline's other resources add a few
    percent). Before, it printed one micro-batch's step for any M."""

    def plan(accum: int, rates: Rates, matmul: float) -> float:
        config = TrainConfig.from_options(
            preset="tiny", device="cuda", gpu_memory="1GiB", batch_size=4, seq_len=256,
            grad_accum=accum,
        )  # fmt: skip
        return plan_run(config, timing_rates=rates, matmul_flops_per_s=matmul).prediction.step_s

    fast = Rates.from_pcie(1e15, cpu_optimizer_params_per_s=1e15)
    assert plan(4, fast, 1e9) == pytest.approx(4 * plan(1, fast, 1e9), rel=0.05)
    slow_cpu = Rates.from_pcie(1e15, cpu_optimizer_params_per_s=1e5)
    assert plan(4, slow_cpu, 1e15) == pytest.approx(plan(1, slow_cpu, 1e15), rel=0.05)
