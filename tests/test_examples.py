"""The scripts under examples/ run as real programs (subprocesses), on the CPU with gloo in
CI and, marked ``gpu``, on CUDA with NCCL on the GPU box.

The multi-process examples are checked against themselves run as one process on the same
global batches: ``ramtorch_zero.py --world-size 1`` and ``offload_torchrun.py`` without
torchrun. Only the order of floating-point sums differs (each rank sums over its part of
the batch, then the ranks' sums are reduced; RamTorch's loop also scales the loss by
1/world size), so the runs agree to fp32 rounding, with one exception that sets the
tolerance: AdamW divides each gradient element by its own running RMS, so an element whose
gradient is a near-cancelling sum (tiny next to the terms summed) gets a relative error
far above fp32's and its update, at most ``lr`` per step, can move by a fraction of ``lr``.
Measured over 8 steps at lr 3e-3 (seeds 0-2): losses within 5e-7 relative, each tensor's
weights within 1.5e-6 in relative L2 norm, and the worst single element 1.3e-5 apart (GELU
model; 2e-7 for the ReLU model, whose dead units have gradients of exactly zero). The
checks use 1e-5 relative for losses and tensor norms and 0.1 * lr for any element: a
missed or doubled step, a stale broadcast or an unscaled gradient is off by far more.

Every process of a comparison computes on one CPU thread (``--threads 1``): the ranks and
the one-process reference alike. The order of every sum then follows from the data split
alone, with no thread count or BLAS partition left to vary between runs or machines, so a
comparison gives the same numbers every time (on this 2-core machine, measured bit for bit
over repeated runs with and without competing load). The reference used to take two
threads; a loss 1.8e-5 apart failed 1 of 3 full runs on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LR = 3e-3  # the default --lr of ramtorch_zero.py and offload_torchrun.py

# variables of an enclosing launcher that would redirect the examples' own rendezvous
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def run_example(*args: str, timeout: float = 300) -> str:
    """Run ``python *args`` from the repository root; returns stdout, fails with the
    output's tail when the exit status is not 0."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def printed_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+/\d+\s+loss ([0-9.]+)", stdout)]


def assert_same_training(run: dict, ref: dict) -> None:
    """``run`` (several ranks) trained as ``ref`` (one process): see the module docstring."""
    assert len(run["losses"]) == len(ref["losses"]) > 0
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    assert run["state"].keys() == ref["state"].keys()
    for name, want in ref["state"].items():
        got = run["state"][name]
        assert got.shape == want.shape, name
        relative = ((got - want).norm() / want.norm()).item()
        assert relative <= 1e-5, (name, relative)
        worst = (got - want).abs().max().item()
        assert worst <= 0.1 * LR, (name, worst)


def _gpus(n: int, *values: object):
    """pytest.param(*values) for the GPU box, skipped with fewer than ``n`` CUDA devices."""
    enough = pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA devices")
    return pytest.param(*values, marks=[pytest.mark.gpu, enough])


DEVICES = ["cpu", _gpus(1, "cuda")]


# ----------------------------------------------------------------- single-process examples


@pytest.mark.parametrize("device", DEVICES)
def test_single_layer(device):
    out = run_example("examples/ramtorch_single_layer.py", "--device", device, "--steps", "10")
    assert re.search(r"max \|ramflow Linear - nn.Linear\| = 0\b", out), out
    losses = printed_losses(out)
    assert len(losses) == 10 and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("device", DEVICES)
def test_model_built_from_linear(device):
    out = run_example("examples/ramtorch_model.py", "--device", device, "--steps", "20")
    losses = printed_losses(out)
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("device", DEVICES)
def test_convert_existing_model(device):
    out = run_example("examples/ramtorch_convert.py", "--device", device, "--steps", "8")
    assert "15 Linear layers converted" in out, out  # 7 per Llama layer and the head
    match = re.search(r"after - before conversion\| = (\S+)", out)
    assert match and float(match.group(1)) <= 1e-5, out
    losses = printed_losses(out)
    assert len(losses) == 8 and losses[-1] < losses[0], losses


# ----------------------------------------------------------------- RamTorch's ZeRO loop


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The examples run as one process, once per (script, backend), for the comparisons."""
    cache: dict[tuple[str, str], dict] = {}

    def get(script: str, backend: str, *extra: str) -> dict:
        key = (script, backend)
        if key not in cache:
            out = tmp_path_factory.mktemp("reference") / "result.pt"
            # one thread, as each rank has (see the module docstring); without torchrun
            # offload_torchrun.py is a world of one
            size = ["--world-size", "1"] if script == "ramtorch_zero.py" else []
            run_example(
                f"examples/{script}",
                "--backend",
                backend,
                *size,
                "--threads",
                "1",
                *extra,
                "--out",
                str(out),
            )
            cache[key] = torch.load(out, weights_only=False)
        return cache[key]

    return get


@pytest.mark.parametrize(
    "backend,zero,replace_before_spawn",
    [
        ("gloo", 2, False),  # RamTorch's documented order, ZeRO-2
        ("gloo", 1, True),
        _gpus(2, "nccl", 2, False),
        _gpus(2, "nccl", 1, True),
    ],
)
def test_ramtorch_zero_two_ranks_equal_one(
    tmp_path, one_process, backend, zero, replace_before_spawn
):
    """RamTorch's ZeRO-1/2 loop over 2 spawned ranks trains as one process does: the layers
    converted in each worker (RamTorch's order; private host copies kept in sync by a
    broadcast) or in the parent before ``share_memory()`` (one host copy for all). Two of
    the four combinations, to keep CI short: each stage and each order runs once."""
    ref = one_process("ramtorch_zero.py", backend)
    out = tmp_path / "result.pt"
    args = ["--backend", backend, "--world-size", "2", "--zero", str(zero), "--threads", "1"]
    if replace_before_spawn:
        args.append("--replace-before-spawn")
    stdout = run_example("examples/ramtorch_zero.py", *args, "--out", str(out))
    assert f"ZeRO-{zero}" in stdout and "epoch 1" in stdout  # two epochs: set_epoch ran
    run = torch.load(out, weights_only=False)
    assert run["args"]["world_size"] == 2
    assert_same_training(run, ref)
    assert run["state"]["norm.weight"].sub(1).abs().max() > 0  # the LayerNorm trained too


# ----------------------------------------------------------------- ramflow.offload + torchrun


@pytest.mark.parametrize("backend", ["gloo", _gpus(2, "nccl")])
def test_offload_torchrun_two_ranks_equal_one(tmp_path, one_process, backend):
    """``torchrun --nproc-per-node 2`` with ``ramflow.offload(model, zero_stage=2)``
    trains as the script does alone (fp32 on the wire on GPUs too, for the comparison)."""
    extra = ["--wire-dtype", "float32"]
    ref = one_process("offload_torchrun.py", backend, *extra)
    out = tmp_path / "result.pt"
    run_example(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/offload_torchrun.py",
        "--backend",
        backend,
        "--zero",
        "2",
        "--threads",
        "1",
        *extra,
        "--out",
        str(out),
    )
    run = torch.load(out, weights_only=False)
    assert run["world_size"] == 2 and ref["world_size"] == 1
    assert_same_training(run, ref)


# ----------------------------------------------------------------- ramflow.memory


def test_memory_toolkit():
    """The memory example: the budget policy meets its budget, gradient accumulation gives
    the full batch's gradient (only the order of fp32 sums differs: measured 4e-9, checked
    at 1e-6), and the model trains."""
    out = run_example("examples/memory_toolkit.py", "--steps", "4", "--timeline", "")
    match = re.search(r"checkpointed (\d+) of 6 blocks .*: (\d+) bytes saved, budget (\d+)", out)
    assert match, out
    assert 0 < int(match.group(1)) < 6 and int(match.group(2)) <= int(match.group(3))
    match = re.search(r"accumulated - full-batch gradient\| = (\S+)", out)
    assert match and float(match.group(1)) <= 1e-6, out
    losses = printed_losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert "optimizer step" in out  # the tracker's table


@pytest.mark.parametrize("device", DEVICES)
def test_train_flux_dit(device):
    """The diffusion transformer example: a tiny Flux trained by rectified flow matching
    under accelerate, each double- and single-stream block a unit of its own."""
    args = ["--steps", "3", "--checkpointing"] + (["--cpu"] if device == "cpu" else [])
    out = run_example("examples/train_flux_dit.py", *args)
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), out
    assert "11 units, 6 of them blocks" in out, out
