"""Shared fixtures: the devices a parity test runs on, and seeded reference pairs."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU box)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each parity test runs on the CPU (CI) and, marked ``gpu``, on CUDA."""
    return torch.device(request.param)
