"""``ramflow plan`` names the device it planned for, plans the GPU run that a
``--gpu-memory`` budget asks for on a machine without one, and prints sizes with units."""

from __future__ import annotations

import re

import pytest
import torch

from ramflow._plan import parse_bytes
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
    assert out.splitlines()[1].startswith("device cuda, precision bf16")
    assert "budget 2.00 GiB" in out
    assert "step time (predicted" in out and "assumed: pinned PCIe" in out  # the rates assumed
    offload = next(line for line in out.splitlines() if "ramflow.offload(model" in line)
    assert re.search(r"gpu_memory='\d+\.\d\d(GiB|MiB)'", offload), offload
    _no_raw_byte_counts(out)


@NO_CUDA
def test_without_cuda_the_plan_says_which_device_it_assumed(ramflow_cli, capsys) -> None:
    out = _plan_output(ramflow_cli, capsys, "--gpu-memory", "2GiB")
    assert "(this machine has no CUDA device: planned a run on a CUDA GPU" in out
    out = _plan_output(ramflow_cli, capsys)
    assert out.splitlines()[1].startswith("device cpu, precision fp32")
    assert "(this machine has no CUDA device: planned a CPU run; --device cuda" in out


def test_device_cpu_keeps_a_cpu_plan(ramflow_cli, capsys) -> None:
    out = _plan_output(ramflow_cli, capsys, "--device", "cpu", "--gpu-memory", "2GiB")
    assert out.splitlines()[1].startswith("device cpu, precision fp32")
    assert "no CUDA device" not in out  # the user named the device
    _no_raw_byte_counts(out)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(8405385728, "7.82GiB"), (2**30, "1.00GiB"), (8 * 2**20 + 5, "8.00MiB"), (1023, "0.00MiB")],
)
def test_size_string_rounds_down_in_units_offload_reads(num_bytes: int, text: str) -> None:
    assert size_string(num_bytes) == text
    assert parse_bytes(text) <= num_bytes
