"""The step-time model (``ramflow.planner.predict``): properties on synthetic units, and the H200 step
times of 2026-11-22 (the earlier calibration run and the whole two-part suite) reproduced from
the inputs recorded with them. Nothing is timed."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest

from ramflow.planner.predict import (
    ATTENTION_BACKWARD_PER_FORWARD,
    RESOURCES,
    Rates,
    UnitCost,
    attention_flops,
    forward_flops,
    forward_seconds,
    measured_efficiency,
    predict_step,
)

GB = 1e9
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
CALIBRATION = RESULTS / "2026-11-22-nvidia-h200-calibration"


def _units(
    n: int = 12,
    *,
    nbytes: int = 400_000_000,
    forward_s: float = 0.006,
    resident_last: int = 0,
    checkpointed: bool = False,
) -> list[UnitCost]:
    return [
        UnitCost(
            name=f"layers.{i}",
            wire_bytes=nbytes,
            trainable_params=nbytes // 2,
            forward_s=forward_s,
            resident=i >= n - resident_last,
            checkpointed=checkpointed,
        )
        for i in range(n)
    ]


RATES = Rates(h2d_bytes_per_s=50 * GB, d2h_bytes_per_s=50 * GB, both_bytes_per_s=90 * GB)


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_more_bytes_never_make_a_step_faster(mode: str) -> None:
    times = [
        predict_step(_units(nbytes=b), rates=RATES, mode=mode).step_s
        for b in (100_000_000, 200_000_000, 400_000_000, 800_000_000)
    ]
    assert times == sorted(times)
    assert times[-1] > times[0]


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_more_bandwidth_never_makes_a_step_slower(mode: str) -> None:
    times = [
        predict_step(_units(), rates=Rates.from_pcie(bw * GB), mode=mode).step_s
        for bw in (10, 20, 40, 80)
    ]
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]


@pytest.mark.parametrize("k", [0, 3, 6, 9])
def test_residents_take_exactly_their_share_off_the_streamed_bytes(k: int) -> None:
    n = 12
    train_full = predict_step(_units(n), rates=RATES).h2d_forward_bytes
    train = predict_step(_units(n, resident_last=k), rates=RATES)
    assert train.h2d_forward_bytes * n == train_full * (n - k)
    # a resident unit crosses once per training step: its refresh after the CPU step
    assert train.h2d_refresh_bytes == k * 400_000_000
    if k < 9:  # more streamed units than the window holds: each forward loads them all
        full = predict_step(_units(n), rates=RATES, mode="infer").h2d_stream_bytes
        pred = predict_step(_units(n, resident_last=k), rates=RATES, mode="infer")
        assert pred.h2d_stream_bytes * n == full * (n - k)


def test_inference_moves_nothing_when_the_window_holds_every_streamed_unit() -> None:
    # three (or four) streamed units, a window of four: they stay on the device; five do not
    pred = predict_step(_units(12, resident_last=9), rates=RATES, mode="infer")
    assert pred.h2d_bytes == 0 and pred.bound == "GPU compute"
    assert predict_step(_units(12, resident_last=7), rates=RATES, mode="infer").h2d_bytes > 0


def test_a_slow_cpu_optimizer_binds_and_sets_the_step() -> None:
    slow = replace(RATES, cpu_optimizer_params_per_s=0.5e9)
    pred = predict_step(_units(), rates=slow)
    assert pred.bound == "CPU optimizer"
    cpu = pred.busy_s["CPU optimizer"]
    assert cpu <= pred.step_s <= cpu * 1.15  # only the pipeline's ends are not overlapped
    assert pred.optimizer_tail_s > 0


def test_steps_after_backward_cost_what_they_do_not_overlap() -> None:
    """A loop that clips or accumulates steps only after backward (``deferred_steps``): the
    steps overlap the next forward alone, never the backward, so the step is never shorter
    than with steps during backward; where the CPU optimizer takes longer than a forward,
    the difference is about the backward's span. With an unbounded CPU nothing changes."""
    units = _units(resident_last=12, forward_s=0.02)
    slow = replace(RATES, cpu_optimizer_params_per_s=2e9)
    eager = predict_step(units, rates=slow)
    deferred = predict_step(units, rates=slow, deferred_steps=True)
    backward_s = 2 * 12 * 0.02  # BACKWARD_PER_FORWARD of each unit's forward
    assert deferred.step_s > eager.step_s + 0.5 * backward_s
    assert deferred.step_s <= eager.step_s + 1.5 * backward_s
    fast = replace(RATES, cpu_optimizer_params_per_s=float("inf"))
    assert predict_step(units, rates=fast, deferred_steps=True).step_s == pytest.approx(
        predict_step(units, rates=fast).step_s
    )


def test_inference_without_compute_is_the_pcie_floor() -> None:
    pred = predict_step(_units(forward_s=1e-6), rates=RATES, mode="infer")
    assert pred.bound == "PCIe H2D"
    assert pred.step_s == pytest.approx(12 * 400_000_000 / RATES.h2d_bytes_per_s, rel=1e-3)


def test_fast_links_and_cpu_leave_the_compute() -> None:
    fast = Rates(1e15, 1e15, 2e15, cpu_optimizer_params_per_s=1e15)
    pred = predict_step(_units(checkpointed=True), rates=fast)
    assert pred.bound == "GPU compute"
    assert pred.step_s == pytest.approx(12 * 0.006 * 4, rel=1e-2)  # forward, recompute, 2x


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("rate", [5, 50, 500])
def test_no_step_beats_a_floor_and_the_critical_path_adds_up(mode: str, rate: float) -> None:
    pred = predict_step(_units(resident_last=4), rates=Rates.from_pcie(rate * GB), mode=mode)
    assert pred.step_s >= pred.floor_s * (1 - 1e-9)
    assert set(pred.critical_s) == set(RESOURCES)
    assert sum(pred.critical_s.values()) == pytest.approx(pred.step_s, rel=1e-9)
    assert pred.forward_s + pred.backward_s == pytest.approx(pred.step_s, rel=1e-9)


def test_checkpointing_adds_one_forward_of_compute() -> None:
    plain = predict_step(_units(), rates=RATES).busy_s["GPU compute"]
    ckpt = predict_step(_units(checkpointed=True), rates=RATES).busy_s["GPU compute"]
    assert ckpt - plain == pytest.approx(12 * 0.006)


def test_a_deeper_prefetch_loads_more_under_the_compute() -> None:
    # four compute-heavy units with few bytes, then four heavy in bytes with no compute: only
    # a window deeper than the gap loads the last ones while the first ones compute
    units = [UnitCost(f"c{i}", 64, 32, 0.1) for i in range(4)]
    units += [UnitCost(f"b{i}", 2_000_000_000, 32, 0.0) for i in range(4)]
    shallow = predict_step(units, rates=RATES, prefetch_depth=1, mode="infer").step_s
    deep = predict_step(units, rates=RATES, prefetch_depth=4, mode="infer").step_s
    assert deep < shallow
    assert deep == pytest.approx(0.4, rel=1e-3)  # the compute alone: every load hidden


def test_tied_weights_load_their_owner() -> None:
    units = [UnitCost("embed", 1000, 500, 0.0)]
    units += [UnitCost(f"layers.{i}", 1000, 500, 0.001) for i in range(6)]
    units += [UnitCost("head", 0, 0, 0.001, deps=(0,))]
    pred = predict_step(units, rates=RATES, mode="infer")
    # the head's forward loads the embedding's weight again, and that copy is still in the
    # window when the next forward starts: once per forward (the H200 run's llama-3b
    # inference counted exactly its wire bytes per forward)
    assert pred.h2d_bytes == 7000
    assert pred.d2h_bytes == 0
    train = predict_step(units, rates=RATES)
    assert train.h2d_forward_bytes == 8000  # the optimizer changed it: both loads are needed
    assert train.d2h_bytes == 7 * 500 * 2  # the tied weight's gradients leave once


def test_flops_and_bad_input() -> None:
    assert forward_flops(10, batch=2, seq=3) == 2 * 10 * 6
    assert forward_flops(0, batch=1, seq=4, attention_layers=1, hidden=8) == 4 * 16 * 8
    assert forward_seconds(1e12, 1e12, mode="infer") > forward_seconds(1e12, 1e12, mode="train")
    with pytest.raises(ValueError):
        predict_step(_units(), rates=RATES, mode="sideways")
    with pytest.raises(ValueError):
        predict_step(_units(), rates=RATES, prefetch_depth=0)


def test_causal_attention_counts_half_the_square_and_backs_up_at_flash_rate() -> None:
    """Attention's products: half the square when causal, and a backward of 2.5 forwards
    (FlashAttention-2's count) against the matmuls' 2; the recomputation of a checkpointed
    unit is one forward of both. Before, a long causal sequence was charged the full square
    at 2 + 1 + 1 forwards: 16 T^2 D per layer where 9 T^2 D are run."""
    full = attention_flops(batch=2, seq=8, attention_layers=3, hidden=4)
    assert full == 4 * 3 * 2 * 8 * 8 * 4
    assert attention_flops(batch=2, seq=8, attention_layers=3, hidden=4, causal=True) == full / 2
    assert forward_flops(5, batch=2, seq=8, attention_layers=3, hidden=4, causal=True) == (
        2 * 5 * 16 + full / 2
    )
    assert ATTENTION_BACKWARD_PER_FORWARD == 2.5
    mm, att = 0.004, 0.002  # a unit whose forward is 4 ms of matmuls and 2 ms of attention
    plain = UnitCost(
        name="u", wire_bytes=0, trainable_params=0, forward_s=mm + att, attention_s=att
    )
    ckpt = replace(plain, checkpointed=True)
    assert plain.backward_s == pytest.approx(2 * mm + 2.5 * att, rel=1e-12)
    assert ckpt.backward_s == pytest.approx(2 * mm + 2.5 * att + (mm + att), rel=1e-12)
    # the GPU-bound step is forward plus that backward, per unit
    units = [replace(ckpt, name=f"u{i}") for i in range(4)]
    step = predict_step(units, rates=Rates(cpu_optimizer_params_per_s=float("inf")))
    assert step.busy_s["GPU compute"] == pytest.approx(4 * (4 * mm + 4.5 * att), rel=1e-9)
    # no attention share given: all of the forward backs up at the matmuls' rate, as before
    assert replace(ckpt, attention_s=0.0).backward_s == pytest.approx(3 * (mm + att), rel=1e-12)


# ----------------------------------------------------------------------------- last session


def _reference_units(
    shape: dict,
    *,
    batch: int,
    seq: int,
    resident: int,
    ckpt: bool,
    chunked: bool,
    matmul: float,
    mode: str,
) -> list[UnitCost]:
    """The reference model's units [embed, blocks, norm, head] from a result's shape fields."""
    d, v, layers = shape["dim"], shape["vocab_size"], shape["num_layers"]
    block = (shape["num_params"] - 2 * v * d - d) // layers
    specs = [("embed", v * d, 0, 0)]
    specs += [(f"layers.{i}", block, block - 2 * d, 1) for i in range(layers)]
    specs += [("norm", d, 0, 0), ("head", v * d, v * d, 0)]
    n = len(specs)
    units = []
    for i, (name, params, mm, attn) in enumerate(specs):
        flops = forward_flops(mm, batch=batch, seq=seq, attention_layers=attn, hidden=d)
        units.append(
            UnitCost(
                name=name,
                wire_bytes=2 * params,
                trainable_params=params,
                forward_s=forward_seconds(flops, matmul, mode=mode),
                resident=i >= n - resident,
                # the model checkpoints its blocks, and with a chunked loss its head's chunks
                checkpointed=ckpt and (attn == 1 or (chunked and name == "head")),
            )
        )
    return units


def test_last_sessions_h200_step_times_within_15_percent() -> None:
    main = json.loads((CALIBRATION / "main.json").read_text())
    ready = json.loads((CALIBRATION / "ramflow-ready.json").read_text())
    floors, cpu = main["floors"], main["cpu_optimizer"]
    bw = floors["bandwidth_bytes_per_s"]
    rates = Rates(bw["h2d"], bw["d2h"], bw["both"], cpu["ramflow_params_per_s"])
    checked = 0
    for rec in ready["cases"]:
        case, res = rec["case"], rec["result"]
        if case["kind"] == "ramflow_train":
            runs = [(case["batch"], res["step_s"], res["resident_units"], "train")]
        elif case["kind"] == "ramflow_infer":
            runs = [(r["batch"], r["step_s"], res["resident_units"], "infer") for r in res["rows"]]
        else:
            continue
        for batch, measured, resident, mode in runs:
            units = _reference_units(
                res,
                batch=batch,
                seq=case["seq"],
                resident=resident,
                ckpt=bool(case.get("checkpoint")),
                chunked=bool(case.get("loss_chunk_tokens")),
                matmul=floors["matmul_flops_per_s"],
                mode=mode,
            )
            assert sum(u.wire_bytes for u in units) == res["wire_bytes_total"]
            pred = predict_step(units, rates=rates, mode=mode)
            assert pred.step_s == pytest.approx(measured, rel=0.15), (rec["id"], batch)
            if res.get("h2d_bytes_counted") is not None and mode == "train":
                counted = res["h2d_bytes_counted"] if "rows" not in res else None
                assert pred.h2d_bytes == pytest.approx(counted, rel=0.05), rec["id"]
            checked += 1
    assert checked == 5  # 4x2048 <= 12 GiB, 16x2048 <= 16 GiB and no cap; inference 1 and 8


# ----------------------------------------------------------------------------- this run

H200_SUITE = (
    "2026-11-22-nvidia-h200-suite/part1.json",
    "2026-11-22-nvidia-h200-suite/part2.json",
)


def _suite_records() -> dict[str, dict]:
    """The case records of the two-part H200 suite, joined as ``bench.py --report`` joins
    them (a later file wins for a case in both, but the floors come from the first)."""
    records: dict[str, dict] = {}
    for name in H200_SUITE:
        for rec in json.loads((RESULTS / name).read_text())["cases"]:
            if rec["id"] == "floors" and "floors" in records:
                continue
            records[rec["id"]] = rec
    return records


def _recorded_units(
    inputs: dict, matmul: float, infer_efficiency: float | None, *, batch: int | None = None
) -> list[UnitCost]:
    """``UnitCost`` of the units a case recorded (``runners.predict_inputs``)."""
    batch = inputs["batch"] if batch is None else batch
    return [
        UnitCost(
            name=u["name"],
            wire_bytes=u["wire_bytes"],
            trainable_params=u["trainable_params"],
            forward_s=forward_seconds(
                forward_flops(
                    u["matmul_params"],
                    batch=batch,
                    seq=inputs["seq"],
                    attention_layers=u["attention_layers"],
                    hidden=inputs["hidden"],
                ),
                matmul,
                mode=inputs["mode"],
                infer_efficiency=infer_efficiency,
            ),
            resident=u["resident"],
            checkpointed=u["checkpointed"],
            deps=tuple(u["deps"]),
        )
        for u in inputs["units"]
    ]


def test_the_h200_suite_step_times_within_15_percent() -> None:
    """Every ramflow step of the 2026-11-22 H200 suite (main cases of both models, scaling,
    k of n), predicted from the units and rates the run recorded: the step within 15% and the
    H2D bytes as counted. The GPU forward of each model runs at the efficiency its resident
    bf16 8x2048 inference step measured, and a training step's CPU optimizer at the rate its
    worker measured in that step, the copies' share of host memory included (the rules of
    ``rows.forward_efficiencies`` and ``rows.in_step_rated``)."""
    records = _suite_records()
    floors = records["floors"]["result"]
    cpu = records["cpu_optimizer.reference.4-layers"]["result"]
    bw, matmul = floors["bandwidth_bytes_per_s"], floors["matmul_flops_per_s"]
    rates = Rates(bw["h2d"], bw["d2h"], bw["both"], cpu["ramflow_params_per_s"])
    infer_inputs = {
        rec["case"]["model"]: rec["result"]["rows"][0]["predict_inputs"]
        for rec in records.values()
        if rec["kind"] == "ramflow_infer" and rec["status"] == "ok"
    }
    efficiency = {}
    for rec in records.values():
        if rec["kind"] == "resident_infer" and rec["status"] == "ok":
            model = rec["case"]["model"]
            row = max(rec["result"]["rows"], key=lambda r: r["batch"])
            flops = sum(
                forward_flops(
                    u["matmul_params"],
                    batch=row["batch"],
                    seq=rec["case"]["seq"],
                    attention_layers=u["attention_layers"],
                    hidden=infer_inputs[model]["hidden"],
                )
                for u in infer_inputs[model]["units"]
            )
            key = (model, rec["result"]["num_layers"])
            efficiency[key] = measured_efficiency(flops, row["step_s"], matmul)
    assert efficiency["reference", 12] == pytest.approx(0.758, abs=0.005)
    assert efficiency["llama-3b", 28] == pytest.approx(0.603, abs=0.005)

    runs = []  # (what, predict inputs, measured step, counted H2D bytes, efficiency, in-step)
    for rec in records.values():
        if rec["status"] != "ok":
            continue
        res, model = rec["result"], rec["case"]["model"]
        # the scaling depths (6, 24 layers) have no resident step: the calibrated default
        eff = efficiency.get((model, res.get("num_layers")))
        if rec["kind"] == "ramflow_train":
            rate = res.get("optimizer_in_step_params_per_s")
            inputs = res["predict_inputs"]
            runs.append((rec["id"], inputs, res["step_s"], res["h2d_bytes_counted"], eff, rate))
        elif rec["kind"] == "ramflow_infer":
            for row in res["rows"]:
                what = f"{rec['id']} batch {row['batch']}"
                inputs = row["predict_inputs"]
                runs.append((what, inputs, row["step_s"], row["h2d_bytes_counted"], eff, None))
        elif rec["kind"] == "ramflow_kofn":
            for row in res["rows"]:
                for mode in ("train", "infer"):
                    m = row[mode]
                    what = f"{rec['id']} k={row['k']} {mode}"
                    rate = m.get("optimizer_in_step_params_per_s")
                    inputs = m["predict_inputs"]
                    runs.append((what, inputs, m["step_s"], m["h2d_bytes_counted"], eff, rate))
    ratios = {}
    for what, inputs, measured, counted, eff, in_step in runs:
        units = _recorded_units(inputs, matmul, eff)
        here = rates
        if in_step and inputs["mode"] == "train":
            here = dataclasses.replace(
                rates, cpu_optimizer_params_per_s=in_step, cpu_optimizer_dram_bytes_per_param=None
            )
        pred = predict_step(
            units,
            rates=here,
            prefetch_depth=inputs["prefetch_depth"],
            mode=inputs["mode"],
            grad_bytes_per_param=inputs["grad_bytes_per_param"],
        )
        ratios[what] = measured / pred.step_s
        # Training loops that stream counted up to 7% more H2D than the model in this run:
        # about one 0.4 GB block per steady-state step sent again (k = 0 of k of n: 9.29 GB
        # per step in the morning's run with 3 timed steps, 9.53 and 9.61 in two runs with 5;
        # scaling, 6 layers: 4.75 against 4.43). Which streamed units are still in the window
        # when backward turns around depends on timing; not yet attributed. Inference
        # matches to 1%.
        tolerance = 0.10 if inputs["mode"] == "train" else 0.01
        assert pred.h2d_bytes == pytest.approx(counted, rel=tolerance, abs=1), what
    assert len(ratios) == 20  # 9 main, 3 scaling, 8 k of n
    misses = {k: round(v, 3) for k, v in ratios.items() if abs(v - 1) > 0.15}
    assert not misses


def _device_stepped(units: list[UnitCost], k: int) -> list[UnitCost]:
    """``units`` with the first ``k`` resident and stepped on the device."""
    return [
        replace(u, resident=True, device_stepped=True) if i < k else u for i, u in enumerate(units)
    ]


def test_device_steps_take_their_units_off_the_cpu_and_the_links() -> None:
    slow = replace(RATES, cpu_optimizer_params_per_s=0.5e9)
    host = predict_step(_units(resident_last=12), rates=slow)
    device = predict_step(_device_stepped(_units(resident_last=12), 4), rates=slow)
    per_unit = 200_000_000
    assert device.step_s < host.step_s  # a CPU-bound step gets shorter
    assert device.d2h_bytes == host.d2h_bytes - 4 * per_unit * 2  # no gradient copy
    assert device.h2d_refresh_bytes == host.h2d_refresh_bytes - 4 * 400_000_000  # no refresh
    gpu = device.busy_s["GPU compute"] - host.busy_s["GPU compute"]
    assert gpu == pytest.approx(4 * per_unit / slow.device_optimizer_params_per_s)
    assert device.busy_s["CPU optimizer"] < host.busy_s["CPU optimizer"]


def test_device_steps_lengthen_a_gpu_bound_step_by_their_own_time() -> None:
    fast = Rates(1e15, 1e15, 2e15, cpu_optimizer_params_per_s=1e15)
    device = predict_step(_device_stepped(_units(resident_last=12), 4), rates=fast)
    own = 4 * 200_000_000 / fast.device_optimizer_params_per_s
    assert device.bound == "GPU compute"
    assert device.step_s == pytest.approx(12 * 0.006 * 3 + own, rel=1e-3)  # forward, 2x back


def test_a_streamed_unit_cannot_be_stepped_on_the_device() -> None:
    units = [replace(u, device_stepped=i == 0) for i, u in enumerate(_units())]
    with pytest.raises(ValueError, match="must be resident"):
        predict_step(units, rates=RATES)


# --------------------------------------------------------------------------- activation offload


def _offloaded(units: list[UnitCost], nbytes: int) -> list[UnitCost]:
    return [replace(u, checkpointed=True, offload_bytes=nbytes) for u in units]


def test_activation_offload_hides_under_compute_when_the_links_have_room() -> None:
    """Everything resident, long compute: the inputs' copies (0.02 s each way per unit)
    overlap the 1 s forwards; the step grows by at most the first input's late fetch and
    the copies' host DRAM time (the optimizer's, which the next forward waits for), and the
    copies show as busy link time."""
    units = _units(8, forward_s=1.0, resident_last=8, checkpointed=True)
    base = predict_step(units, rates=RATES)
    off = predict_step(_offloaded(units, 1 << 30), rates=RATES)
    assert off.offload_bytes == 8 << 30
    assert base.offload_bytes == 0 and base.h2d_bytes == off.h2d_bytes
    late_fetch = (1 << 30) / RATES.duplex()[0]
    dram = off.copies_on_cpu_s - base.copies_on_cpu_s
    assert base.step_s < off.step_s <= base.step_s + late_fetch + dram + 1e-9
    assert off.busy_s["PCIe D2H"] == pytest.approx(
        base.busy_s["PCIe D2H"] + 8 * (1 << 30) / (50 * GB)
    )
    assert off.copies_on_cpu_s == pytest.approx(
        base.copies_on_cpu_s + RATES.copies_on_host_dram_s(2 * 8 * (1 << 30))
    )
    assert "activation offload 8.59 GB each way" in off.describe()


def test_activation_offload_shares_the_link_with_the_weights() -> None:
    """Streamed units on a slow link: the inputs' H2D queue with the weights' reloads, so a
    step bound by PCIe grows by about their bytes over the backward's H2D rate; the more
    bytes offloaded, the longer the step."""
    slow = Rates(h2d_bytes_per_s=10 * GB, d2h_bytes_per_s=10 * GB, both_bytes_per_s=18 * GB)
    units = _units(12, nbytes=400_000_000, forward_s=0.001, checkpointed=True)
    base = predict_step(units, rates=slow)
    assert base.bound.startswith("PCIe")
    times = [predict_step(_offloaded(units, b), rates=slow).step_s for b in (0, 1 << 27, 1 << 29)]
    assert times[0] == pytest.approx(base.step_s)
    assert times == sorted(times) and times[2] > times[1] > times[0]
    # 12 inputs of 512 MiB each way: at least their H2D at the backward's 9 GB/s is added
    # (no overlap with the reloads, which already fill the link)
    assert times[2] - times[0] >= 0.9 * 12 * (1 << 29) / slow.duplex()[0]


def test_unit_major_micro_batches_load_once_and_compute_m_times() -> None:
    """A step of M micro-batches run unit-major (``ramflow.accumulate``) moves one
    micro-batch's weights and gradients and computes M times; on a PCIe-bound model it
    takes far less than M single-micro-batch steps, never less than its compute."""
    units = _units()
    one = predict_step(units, rates=RATES)
    four = predict_step(units, rates=RATES, micro_batches=4)
    assert four.h2d_bytes == one.h2d_bytes
    assert four.d2h_bytes == one.d2h_bytes
    assert four.busy_s["GPU compute"] == pytest.approx(4 * one.busy_s["GPU compute"])
    assert four.step_s >= four.busy_s["GPU compute"]
    assert four.step_s < 4 * one.step_s
    with pytest.raises(ValueError, match="micro_batches"):
        predict_step(units, rates=RATES, micro_batches=0)
