"""The native kernels are built before the first step (see [Note: building before the first
step] in ``ramflow.kernels.cpu_kernels``): by ``python -m ramflow.build_kernels`` (``make setup``),
or in the background from ``ramflow.offload``; never at import, never inside a step.

Each case runs a fresh Python on its own cache folder, with the real build (seconds on this
machine); ``_compile`` is wrapped only to record which thread calls it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ramflow

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("c++") is None,
    reason="the native kernel builds on x86-64 with a C++ compiler",
)

SRC = str(Path(ramflow.__file__).parents[1])

TRAIN = r"""
import json, threading
import torch
import ramflow
from ramflow.kernels import cpu_kernels as k

calls = []
real = k._compile
def counted(*args, **kwargs):
    calls.append(threading.current_thread().name)
    return real(*args, **kwargs)
k._compile = counted

out = {"thread_at_import": any(t.name == "ramflow-build-kernels" for t in threading.enumerate())}
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
ramflow.offload(model, device="cpu")
out["started_at_offload"] = k._BACKGROUND.started
out["calls_after_offload"] = list(calls)
opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(2):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
ramflow.synchronize(model)
out["calls"] = calls
out["native"] = k.native_kernel_available()
print("RESULT " + json.dumps(out))
"""


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONPATH": SRC}
    env.pop("RAMFLOW_DISABLE_CPU_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _train(cache: Path) -> tuple[dict, str]:
    proc = _run(cache, "-c", TRAIN)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stderr


def test_offload_builds_in_the_background_and_steps_never_build(tmp_path):
    """Cold cache: importing starts nothing; ``offload`` starts the one build, in its
    thread, with one line on stderr; the steps wait for it and run the native kernel.
    Warm cache: no line, no build, at offload or in a step."""
    cold, err = _train(tmp_path)
    assert not cold["thread_at_import"]
    assert cold["started_at_offload"]
    assert cold["calls"] == ["ramflow-build-kernels"]  # once, in the background thread
    assert cold["native"]
    assert err.count("building ramflow's CPU kernels in the background") == 1, err
    warm, err = _train(tmp_path)
    assert not warm["started_at_offload"]
    assert warm["calls"] == [] and warm["native"]
    assert "building" not in err, err


def test_build_kernels_fills_the_cache_that_offload_then_uses(tmp_path):
    """``python -m ramflow.build_kernels`` (``make setup``) builds into the cache; a run
    after it starts no build."""
    out = _run(tmp_path, "-m", "ramflow.build_kernels").stdout
    assert f"CPU kernels in {tmp_path}" in out, out
    assert len(list((tmp_path / "ramflow").glob("*.so"))) == 1
    warm, err = _train(tmp_path)
    assert warm["calls"] == [] and not warm["started_at_offload"] and warm["native"]
    assert "building" not in err
