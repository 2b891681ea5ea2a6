"""``ramflow plan --nproc-per-node N``: one host's RAM for N ranks and their predicted speed.
See [Note: N ranks on one host] in ``ramflow/train/scale.py``."""

from __future__ import annotations

import dataclasses

import pytest

from ramflow.memory.estimate import runtime_overhead_bytes
from ramflow.planner.predict import Rates, StepPrediction
from ramflow.train import TrainConfig, plan_run
from ramflow.train.scale import plan_ranks, predict_ranks

GIB = 1 << 30


def _one_gpu(**busy_ms: float) -> StepPrediction:
    """A 1-GPU training prediction with the given busy times, 10% above its floor."""
    busy = {"GPU compute": 0.5, "PCIe H2D": 0.2, "PCIe D2H": 0.1, "CPU optimizer": 0.4}
    busy.update({k.replace("_", " "): v / 1e3 for k, v in busy_ms.items()})
    floor = max(busy.values())
    return StepPrediction(
        mode="train",
        step_s=floor * 1.1,
        forward_s=0.0,
        backward_s=0.0,
        optimizer_tail_s=0.0,
        busy_s=busy,
        bound=max(busy, key=busy.__getitem__),
        h2d_bytes=10 * 10**9,
        d2h_bytes=2 * 10**9,
        copies_on_cpu_s=0.1,
    )


RATES = Rates(cpu_optimizer_params_per_s=4e9, cpu_optimizer_dram_bytes_per_param=30.0)


def test_one_rank_is_the_one_gpu_prediction():
    one = _one_gpu()
    p = predict_ranks(
        one, num_ranks=1, num_trainable=10**9, tokens_per_rank_step=8192, rates=RATES,
        host_dram_bytes_per_s=1e15, cores=64,
    )  # fmt: skip
    assert p.step_s == pytest.approx(one.step_s)
    assert p.speedup == pytest.approx(1.0)
    assert p.bound == "GPU compute"


def test_the_host_binds_as_ranks_are_added():
    """Compute-bound alone; the CPU optimizer, which pays for every rank's copies through
    host DRAM, binds at 8 ranks: the speed-up stays below 8 and says why."""
    one = _one_gpu()
    kwargs = dict(num_trainable=10**9, tokens_per_rank_step=8192, rates=RATES, cores=64)
    two = predict_ranks(one, num_ranks=2, host_dram_bytes_per_s=1e15, **kwargs)
    eight = predict_ranks(one, num_ranks=8, host_dram_bytes_per_s=1e15, **kwargs)
    assert two.bound == "GPU compute" and two.speedup == pytest.approx(2.0)
    # arithmetic 0.3 s + 8 x 10 GB H2D + 2 GB D2H (ZeRO-2: once) at 4e9 x 30 B/s
    expected_cpu = 0.3 + (8 * 10e9 + 2e9) / (4e9 * 30)
    assert eight.busy_s["CPU optimizer"] == pytest.approx(expected_cpu)
    assert eight.bound == "CPU optimizer"
    assert eight.step_s == pytest.approx(expected_cpu * 1.1)
    assert 1 < eight.speedup < 8
    assert eight.busy_s["PCIe D2H"] == pytest.approx(0.1 / 8)  # ZeRO-2: owners only
    zero1 = predict_ranks(one, num_ranks=8, host_dram_bytes_per_s=1e15, zero_stage=1, **kwargs)
    assert zero1.busy_s["PCIe D2H"] == pytest.approx(0.1)
    assert zero1.busy_s["CPU optimizer"] > eight.busy_s["CPU optimizer"]


def test_host_dram_and_cores_can_bind():
    one = _one_gpu()
    kwargs = dict(num_trainable=10**9, tokens_per_rank_step=8192, rates=RATES)
    slow = predict_ranks(one, num_ranks=4, host_dram_bytes_per_s=50e9, cores=64, **kwargs)
    # 4 x 10 GB + 2 GB + 30 GB of the optimizer's own traffic at 50 GB/s
    assert slow.busy_s["host DRAM"] == pytest.approx((40e9 + 2e9 + 30e9) / 50e9)
    assert slow.bound == "host DRAM"
    few = predict_ranks(one, num_ranks=8, host_dram_bytes_per_s=1e15, cores=8, **kwargs)
    assert few.bound.endswith("(and host cores)") and "8 cores" in few.cores_note
    with pytest.raises(ValueError, match="at least 1"):
        predict_ranks(one, num_ranks=0, **kwargs)


@pytest.mark.parametrize("zero_stage,host_precision", [(2, "fp32"), (1, "fp32"), (2, "lean")])
def test_host_ram_counts_the_store_once_and_each_ranks_own_n_times(zero_stage, host_precision):
    config = TrainConfig.from_options(
        preset="tiny", device="cuda", gpu_memory="1GiB", batch_size=4, seq_len=256,
        host_precision=host_precision,
    )  # fmt: skip
    e = plan_run(config)
    e = dataclasses.replace(e, ram_available_bytes=1000 * GIB)
    plan = plan_ranks(e, num_ranks=4, zero_stage=zero_stage)
    # the staging: per unit on its owner only under ZeRO-2, a ring on every rank; the full
    # gradient buffer (fp32's, or the one a clipping loop keeps beside a ring): the owner's
    staging = 1 if zero_stage == 2 and host_precision == "fp32" else 4
    full = 1 if zero_stage == 2 else 4
    assert e.host_gradient_pageable_bytes > 0  # the trainer clips by default
    assert plan.ram_needed_bytes == (
        e.host_parameter_pinned_bytes
        + e.host_parameter_pageable_bytes
        + e.host_optimizer_bytes
        + staging * e.host_gradient_pinned_bytes
        + full * e.host_gradient_pageable_bytes
        + 4 * runtime_overhead_bytes("cuda")
    )
    assert plan.fits_ram and plan.zero.stage == zero_stage
    tight = plan_ranks(
        dataclasses.replace(e, ram_available_bytes=plan.ram_needed_bytes - 1),
        num_ranks=4,
        zero_stage=zero_stage,
    )
    assert not tight.fits_ram


def test_a_full_gradient_buffer_is_counted_where_the_loop_keeps_one():
    """Lean's gradient ring makes no full host gradient buffer where units step during
    backward: several ranks without clipping or accumulation, and one process without
    clipping (see [Note: the gradients of a CLI step] in ramflow/train/gradient_holding.py).
    Several ranks that clip or accumulate keep one, 2 bytes (bf16) per trained parameter;
    one process that clips holds 8-bit codes, 1 + 4/256 bytes."""
    from ramflow.formats.deferred_grad import compact_nbytes

    options = dict(preset="tiny", device="cuda", gpu_memory="1GiB", host_precision="lean")
    plans = {
        (clip, accum, ranks): plan_run(
            TrainConfig.from_options(**options, clip_grad=clip, grad_accum=accum),
            num_ranks=ranks,
        )
        for clip, accum, ranks in [
            (0.0, 1, 4),
            (1.0, 1, 4),
            (0.0, 2, 4),
            (0.0, 1, 1),
            (0.0, 2, 1),
            (1.0, 1, 1),
        ]  # fmt: skip
    }
    eager = plans[(0.0, 1, 4)]
    for key, e in plans.items():
        assert e.host_gradient_pinned_bytes == eager.host_gradient_pinned_bytes, key
        if key in ((0.0, 1, 4), (0.0, 1, 1), (0.0, 2, 1)):
            assert e.host_gradient_pageable_bytes == 0, key
        elif key == (1.0, 1, 1):
            # per unit: codes and one fp32 scale per block (the units' sizes are the plan's)
            assert e.num_trainable < e.host_gradient_pageable_bytes, key
            assert e.host_gradient_pageable_bytes <= compact_nbytes(e.num_trainable) + 4 * 8
        else:
            assert e.host_gradient_pageable_bytes == 2 * e.num_trainable, key
    assert TrainConfig.from_options(clip_grad=0.0).steps_during_backward(several_ranks=True)
    assert not TrainConfig.from_options(clip_grad=0.0).steps_during_backward(several_ranks=False)


def test_plan_cli_for_eight_gpus(ramflow_cli, capsys):
    rc = ramflow_cli(
        "plan", "--preset", "tiny", "--device", "cuda", "--gpu-memory", "1GiB",
        "--nproc-per-node", "8", "--host-dram-gbps", "100",
    )  # fmt: skip
    out = capsys.readouterr().out
    # 8 CUDA processes need 8 runtimes (3.5 GiB each) beside the store: the exit status
    # says whether this machine's RAM holds them, as the line does
    ram = next(line for line in out.splitlines() if line.startswith("host RAM for 8 ranks:"))
    assert rc == (0 if ram.endswith(": fits") else 1), out
    assert "8 ranks on this host, ZeRO-2" in out
    assert "host RAM for 8 ranks:" in out and "once (shared memory)" in out
    assert "predicted: 8 GPUs:" in out and "tokens/s" in out and "bound by" in out
    assert ramflow_cli("plan", "--preset", "tiny", "--nproc-per-node", "2",
                       "--host-dram-gbps", "0") == 2  # fmt: skip


def test_plan_cli_for_another_machines_cores(ramflow_cli, capsys):
    """``--host-cores`` plans the host named, not this one: 8 ranks on this 2-core machine
    would queue (the note says so), on a 128-core host they do not."""
    args = ("plan", "--preset", "tiny", "--device", "cuda", "--gpu-memory", "1GiB",
            "--nproc-per-node", "8")  # fmt: skip
    # 0 or 1: whether this machine's RAM holds 8 CUDA runtimes (test_plan_cli_for_eight_gpus)
    assert ramflow_cli(*args, "--host-cores", "2") in (0, 1)
    assert "this host's 2 cores give each of 8 ranks" in capsys.readouterr().out
    assert ramflow_cli(*args, "--host-cores", "128") in (0, 1)
    assert "cores give each of" not in capsys.readouterr().out
    assert ramflow_cli(*args, "--host-cores", "0") == 2
