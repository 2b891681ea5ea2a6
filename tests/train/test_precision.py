"""``--device`` and ``--precision`` (``ramflow.train.precision``): the policy they give,
and the one-line refusals of names that are not devices or precisions."""

from __future__ import annotations

import pytest
import torch

from ramflow.train.precision import planned_compute, resolve_compute, resolve_device


def test_the_cpu_computes_in_fp32_unless_told_otherwise() -> None:
    auto = resolve_compute(device="cpu", precision="auto")
    assert (auto.precision, auto.compute_dtype, auto.wire_dtype) == (
        "fp32",
        torch.float32,
        torch.float32,
    )
    assert not auto.use_autocast and not auto.use_grad_scaler
    half = resolve_compute(device="cpu", precision="fp16")
    # the CPU computes from its fp32 masters: only autocast lowers the matmuls
    assert (half.compute_dtype, half.wire_dtype) == (torch.float16, torch.float32)
    assert half.use_autocast and half.use_grad_scaler


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu0", r"^--device 'gpu0' is not a device name \(use cuda, cuda:1 or cpu\)$"),
        ("meta", r"^--device meta: ramflow runs on a CUDA device or the CPU$"),
    ],
)
def test_a_device_that_is_not_one_is_refused(device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_device_says_to_use_the_cpu() -> None:
    """The message names the device as the user wrote it (``cuda:7``, not ``cuda``)."""
    with pytest.raises(ValueError, match=r"^--device cuda: this machine has no CUDA device; use"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^--device cuda:7: this machine has no CUDA device; "):
        resolve_device("cuda:7")


def test_an_unknown_precision_lists_the_choices() -> None:
    for resolve in (resolve_compute, planned_compute):
        with pytest.raises(ValueError, match=r"^--precision 'fp8': choose one of auto, bf16, "):
            resolve(device="cpu", precision="fp8")


def test_a_plan_for_another_machine_needs_no_device() -> None:
    assert planned_compute(device="cuda", precision="auto") == (
        "cuda",
        "bf16",
        torch.bfloat16,
        torch.bfloat16,
    )
    assert planned_compute(device="cpu", precision="auto")[:2] == ("cpu", "fp32")
    with pytest.raises(ValueError, match=r"^--device 'tpu!' is not a device name"):
        planned_compute(device="tpu!", precision="auto")
    with pytest.raises(ValueError, match=r"^--device meta: ramflow runs on a CUDA device"):
        planned_compute(device="meta", precision="bf16")
