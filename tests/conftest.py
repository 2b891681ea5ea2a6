"""Shared fixtures: the devices a parity test runs on, and seeded reference pairs.

[Note: threads per test worker]
``make test`` runs the suite in ``pytest-xdist`` workers (``-n 2`` on CI's 2 cores). Each
worker would otherwise start as many intra-op threads as the machine has cores, so two
workers would run four threads on two cores and wait on each other in every parallel
region. Each worker takes its share of the cores instead (its torch threads, and
``OMP_NUM_THREADS`` for the processes it starts), set once at session start. Without
xdist nothing changes. No test depends on the default thread count: the ones about
threads set them explicitly (test_cpu_kernels, test_optimizers, test_muon, the examples'
``--threads 1``).
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch


def pytest_configure(config):
    # what the processes that tests start through multiprocessing's forkserver (the ranks
    # of dist_workers.run, test_checkpoint_faults' runs) import once, in the server: see
    # [Note: ranks fork from a preloaded server] in dist_workers.py. A module that fails to
    # import is skipped by the server, and then imported by each process that needs it.
    multiprocessing.set_forkserver_preload(
        [
            "dist_workers",
            "transformers",
            "transformers.models.llama.modeling_llama",
            "ramflow.train",
        ]
    )
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:  # See [Note: threads per test worker]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


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


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps its state (mixed precision, the gradient-accumulation plugin) in
    process-wide singletons that every ``Accelerator`` and ``Trainer`` of the process
    shares: a ``Trainer(bf16=True)`` test left ``mixed_precision="bf16"`` for a later test's
    ``Accelerator(cpu=True)`` in the same xdist worker (test_diffusers' accelerate test then
    stepped another model). Reset after each test, as accelerate's own ``AccelerateTestCase``
    does; nothing when the test never imported accelerate."""
    yield
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
