"""``benchmarks/node/node_70b.py``'s report: the plan figures it reads (ramflow's device
share, which ``--api`` hands the example) and the table of one or both runs, with the
figures a CPU run lacks (pure Python; the training runs themselves are its ``--smoke``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "node" / "node_70b.py"

# the lines of a `ramflow plan --nproc-per-node 4` (4 x H200, llama-70b, lean) it reads
PLAN = """\
ramflow on the device: window 6.38 GiB + gradients 3.91 GiB + fixed 512 B + resident 86.79 GiB = 97.08 GiB of its 97.66 GiB share (the budget less the activations); the smallest that works, streaming every unit: 11.74 GiB
4 ranks on this host, ZeRO-2 (...)
host RAM for 4 ranks: 310.20 GiB = host store 131.42 GiB once (shared memory) + optimizer states 133.47 GiB once (sharded) + host gradients of all ranks 31.31 GiB + 4 x 3.50 GiB per rank (runtime); 480.00 GiB available: fits
predicted: 4 GPUs: 15737 ms per step, 4,165 tokens/s (4.00x one GPU); bound by GPU compute; busy per step (ms): GPU compute 15335
"""


@pytest.fixture(scope="module")
def node_70b():
    path = list(sys.path)  # the script puts benchmarks/ first; other tests import models
    try:
        spec = importlib.util.spec_from_file_location("node_70b", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_plan_figures(node_70b):
    plan = node_70b._parse_plan(PLAN)
    assert plan["ramflow_share"] == "97.66GiB"
    assert plan["host_bytes"] == pytest.approx(310.20 * 2**30)
    assert (plan["step_s"], plan["bound"]) == (15.737, "GPU compute")
    assert plan["store_bytes"] == pytest.approx(131.42 * 2**30)
    # made before the first step too (the optimizer's states, the gradient ring)
    assert plan["states_bytes"] == pytest.approx(133.47 * 2**30)
    assert plan["host_gradients_bytes"] == pytest.approx(31.31 * 2**30)


def test_load_peak_is_the_samples_before_the_first_step(node_70b):
    # rank 0's first step 10 s after its start: the 12 GiB sample at 11 s is training's
    run = {"since_start_s": 10.0, "host_timeline": [(1.0, 2 * 2**30), (9.5, 5 * 2**30),
                                                    (11.0, 12 * 2**30)]}  # fmt: skip
    args = type("Args", (), dict(batch_size=2, seq_len=64, gpus=2))()
    node_70b._figures(run, args, None, {"store_bytes": 2**30})
    assert run["host_load_peak_bytes"] == 5 * 2**30
    assert run["load_peak_over_bound"] == pytest.approx(5 / (1 + 2 * 4))


def test_report_of_both_runs(node_70b):
    args = dict(preset="tiny", gpus=2, batch_size=2, seq_len=64, host_precision="lean")
    steps = [{"step": k, "loss": 5.0 - k, "step_s": 0.5, "peak_gpu_bytes": None} for k in (1, 2)]
    result = {
        "date": "2026-11-27",
        "args": {**args, "api": False, "both": True},
        "plan": {"host_bytes": 2 * 2**30},
        "runs": {
            # a CPU run: no GPU memory, no matmul rate
            "api": {"steps": steps, "num_parameters": 10**6, "host_peak_in_use_bytes": 2**30,
                    "peak_gpu_bytes_per_rank": [None, None], "exit_code": 0},
            "cli": {"skipped": "the budget (--budget-s) was spent"},
        },
    }  # fmt: skip
    run = result["runs"]["api"]
    node_70b._figures(run, type("Args", (), args)(), None, result["plan"])
    assert run["step_s"] == 0.5 and run["tokens_per_s"] == 2 * 2 * 64 / 0.5
    assert run["host_peak_over_plan"] == 0.5 and run["of_matmul"] is None
    text = node_70b._markdown(result)
    header = next(line for line in text.splitlines() if line.startswith("| figure"))
    assert header == "| figure | Python API (examples/llama_torchrun.py) | ramflow train | target |"
    assert "| losses | 4.000, 3.000 | - | - |" in text
    assert "ramflow train: `-` (exit -, - s); the budget (--budget-s) was spent." in text
