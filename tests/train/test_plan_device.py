"""``ramflow plan`` names the device it planned for, plans the GPU run that a
``--gpu-memory`` budget asks for on a machine without one, and prints sizes with units."""

from __future__ import annotations

import re

import pytest
import torch

from ramflow.sizes import parse_bytes
from ramflow.train.estimate import size_string

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")


def _plan_output(ramflow_cli, capsys, *argv: str) -> str:
    rc = ramflow_cli("plan", "--preset", "tiny", "--batch-size", "2", "--seq-len", "64", *argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


def _no_raw_byte_counts(out: str) -> None:
    """No number of six digits or more, except the parameter counts' grouped digits."""
    raw = re.findall(r"(?<![\d.,])\d{6,}(?![\d.,])", out)
    assert not raw, f"raw byte counts in the plan: {raw}"


def test_a_gpu_budget_plans_a_gpu_run(ramflow_cli, capsys) -> None:
    """Without --device, --gpu-memory means a GPU run, also where this machine has none."""
    out = _plan_output(ramflow_cli, capsys, "--gpu-memory", "2GiB")
    assert out.splitlines()[0].startswith("tiny: fits this machine: GPU ")
    assert out.splitlines()[1] == "budget: 2.00 GiB of GPU memory"
    assert "on cuda in bf16" in out.splitlines()[3]
    assert "step time (predicted" in out and "assumed: pinned PCIe" in out  # the rates assumed
    offload = next(line for line in out.splitlines() if "ramflow.offload(model" in line)
    assert re.search(r"gpu_memory='\d+\.\d\d(GiB|MiB)'", offload), offload
    _no_raw_byte_counts(out)


@NO_CUDA
def test_without_cuda_the_plan_says_which_device_it_assumed(ramflow_cli, capsys) -> None:
    out = _plan_output(ramflow_cli, capsys, "--gpu-memory", "2GiB")
    assert out.splitlines()[2].startswith(
        "  (this machine has no CUDA device: planned a run on a CUDA GPU"
    )
    out = _plan_output(ramflow_cli, capsys)
    assert out.splitlines()[1] == "budget: no cap (a CPU run: the device side is RAM)"
    assert out.splitlines()[2].startswith(
        "  (this machine has no CUDA device: planned a CPU run; --device cuda"
    )
    assert "on cpu in fp32" in out.splitlines()[3]
    # no "0 of 7 units stay on the device": a CPU has none, each unit is copied in RAM
    assert out.splitlines()[5].startswith(
        "  a CPU run has no device memory: each of the 7 units is copied from the host store "
        "into a working slot in RAM before use ("
    )
    assert "stay on the device" not in out


def test_device_cpu_keeps_a_cpu_plan(ramflow_cli, capsys) -> None:
    out = _plan_output(ramflow_cli, capsys, "--device", "cpu", "--gpu-memory", "2GiB")
    assert out.splitlines()[1] == "budget: 2.00 GiB of CPU memory"
    assert "on cpu in fp32" in out.splitlines()[2]
    assert out.splitlines()[4] == (
        "  a CPU run: all 7 units keep a working copy in RAM, none is copied per step"
    )
    assert "no CUDA device" not in out  # the user named the device
    _no_raw_byte_counts(out)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(8405385728, "7.82GiB"), (2**30, "1.00GiB"), (8 * 2**20 + 5, "8.00MiB"), (1023, "0.00MiB")],
)
def test_size_string_rounds_down_in_units_offload_reads(num_bytes: int, text: str) -> None:
    assert size_string(num_bytes) == text
    assert parse_bytes(text) <= num_bytes


class _Memory:
    def __init__(self, available: int) -> None:
        self.available = available
        self.total = available


def _little_ram(monkeypatch, num_bytes: int) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(num_bytes))


def test_the_first_line_is_the_verdict_and_exit_1_when_it_does_not_fit(
    ramflow_cli, capsys, monkeypatch
) -> None:
    out = _plan_output(ramflow_cli, capsys, "--device", "cpu")
    assert out.splitlines()[0].startswith("tiny: fits this machine: CPU ")
    _little_ram(monkeypatch, 512 << 20)
    rc = ramflow_cli("plan", "--preset", "tiny", "--batch-size", "2", "--seq-len", "64")
    out = capsys.readouterr().out
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("tiny: DOES NOT FIT this machine: it needs about ")
    assert first.endswith("of RAM and 512.00 MiB is available")
    assert sum(line.startswith("budget") for line in out.splitlines()) == 1  # one budget


def test_auto_host_formats_that_do_not_fit_show_the_lean_plan(
    ramflow_cli, capsys, monkeypatch
) -> None:
    """``--host-precision auto`` where not even lean fits: the lean plan with its verdict
    (not an error), and the RAM it needs is the lean plan's figure."""
    argv = ("plan", "--preset", "tiny", "--device", "cuda", "--gpu-memory", "1GiB")
    _little_ram(monkeypatch, 16 << 20)
    assert ramflow_cli(*argv, "--host-precision", "lean") == 1
    lean = capsys.readouterr().out
    assert ramflow_cli(*argv, "--host-precision", "auto") == 1
    auto = capsys.readouterr().out
    assert "host formats lean" in auto and "(auto: neither fp32 nor lean fits" in auto
    assert auto.splitlines()[0] == lean.splitlines()[0]  # the same bytes, the same verdict
    assert "DOES NOT FIT" in auto.splitlines()[0]


def test_host_precision_is_parsed_where_it_enters_and_named_back_for_json() -> None:
    """The command line's name becomes the policy in ``TrainConfig`` (once); ``to_dict``
    (run.json, a checkpoint) writes the name, and the dict gives the same config again."""
    from ramflow.formats.host import HostPrecision
    from ramflow.train import TrainConfig

    config = TrainConfig.from_options(host_precision="lean")
    assert config.host_precision == HostPrecision.lean()
    assert config.to_dict()["host_precision"] == "lean"
    assert TrainConfig(**config.to_dict()) == config
    assert TrainConfig.from_options(host_precision="auto").host_precision == "auto"
    custom = HostPrecision(master="bf16-sr", optimizer_states="fp32", gradients="ring", seed=3)
    config = TrainConfig.from_options(host_precision=custom)
    assert TrainConfig(**config.to_dict()).host_precision == custom  # fields, seed kept
    with pytest.raises(ValueError, match="--host-precision 'lena': choose one of"):
        TrainConfig.from_options(host_precision="lena")


def test_auto_host_formats_are_decided_once_for_the_plan_and_the_run(
    tmp_path, corpus_file, monkeypatch
) -> None:
    """``--host-precision auto`` with ``--batch-size auto`` (an estimate per micro-batch
    tried): the decision runs once, at set-up, and the run's offload gets its policy."""
    import ramflow
    import ramflow.engine.host_store as host_store
    from ramflow.train import TrainConfig, train

    calls = []
    choose = host_store.choose_precision

    def counted(*args, **kwargs):
        calls.append(1)
        return choose(*args, **kwargs)

    monkeypatch.setattr(host_store, "choose_precision", counted)
    plans = []
    offload = ramflow.offload

    def offload_and_keep_plan(model, **options):
        model = offload(model, **options)
        plans.append(ramflow.get_plan(model))
        return model

    monkeypatch.setattr(ramflow, "offload", offload_and_keep_plan)
    config = TrainConfig.from_options(
        data=str(corpus_file),
        steps=1,
        host_precision="auto",
        device="cpu",
        seq_len=32,
        batch_size="auto",
        global_batch=4,
        eval_batches=1,
        keep_checkpoints=0,
    )
    result = train(config, out=tmp_path / "run", progress=False)
    assert result.steps_done == 1
    assert len(calls) == 1, "auto was decided more than once"
    assert plans and plans[0].host_precision == ramflow.HostPrecision.fp32()


def test_the_device_budget_is_parsed_where_it_enters_and_resumes_from_either_name(
    tmp_path,
) -> None:
    """``--gpu-memory`` becomes ``TrainConfig.device_budget_bytes`` (the whole device's
    budget) once, in ``from_options``; run.json replays it as ``--gpu-memory``; a checkpoint
    written before the rename (its config holds ``gpu_memory: "1GiB"``) resumes with the
    same budget, and a resumed run may change it."""
    from ramflow.train import TrainConfig
    from ramflow.train.config import resume_config
    from ramflow.train.config_file import run_config_options
    from ramflow.train.run_checkpoint import Checkpoint

    config = TrainConfig.from_options(gpu_memory="12GiB")
    assert config.device_budget_bytes == 12 << 30
    assert "gpu_memory" not in config.to_dict()
    assert run_config_options(config.to_dict(), where="run.json")["gpu_memory"] == 12 << 30
    with pytest.raises(ValueError, match="--gpu-memory: cannot read 'twelve'"):
        TrainConfig.from_options(gpu_memory="twelve")
    with pytest.raises(ValueError, match="--gpu-memory takes a size"):
        TrainConfig(device_budget_bytes="12GiB")

    old = {**TrainConfig.from_options().to_dict(), "gpu_memory": "1GiB"}
    del old["device_budget_bytes"]
    ckpt = Checkpoint(tmp_path / "step-00000001", 1, {"train_config": old})
    assert resume_config(ckpt).device_budget_bytes == 1 << 30
    assert resume_config(ckpt, gpu_memory="2GiB").device_budget_bytes == 2 << 30
    assert ckpt.state["train_config"]["gpu_memory"] == "1GiB"  # the checkpoint's left as read
