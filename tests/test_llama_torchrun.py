"""``examples/llama_torchrun.py``, the Python API's form of ``ramflow train --preset llama-70b
--nproc-per-node N``, run end to end on 2 gloo ranks with the tiny size, against ``ramflow
train`` itself on the same seed, data and batch.

The two compute the same steps: the same config (the example takes its preset's), the
same seeded init, the same global batch each step (the example's ``DistributedSampler``
is seeded with ``epoch_order_seed``), the same recipe (AdamW with decay on matrices,
betas (0.9, 0.95), the warmup-cosine schedule, no clipping, steps during backward) and the
same chunked loss. What differs by design is which rank holds which row of a global batch
(the sampler deals the rows out in turn, ``ramflow train`` in blocks): each rank's
gradient is a sum over other rows before the ranks' sums are averaged. With the lean host
formats the CPU computes in bf16 (their masters are the wire copy), so those partial sums
round differently, and each step's master rounding feeds the next: measured over 8 steps
(seeds 0-2), losses within 1.5e-4 relative; checked at 2e-3. (With fp32 host formats the
two agree to 1.3e-7, fp32 rounding.) A wrong learning rate, schedule, beta or data order
is off by far more after a few steps.

Every rank computes on one thread (``--threads 1``; ``ramflow train --nproc-per-node 2``
gives each of this 2-core machine's ranks one), so the runs are repeatable.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from ramflow.train.tokenizer import ByteTokenizer
from test_examples import EXAMPLES, _gpus, run_example

STEPS = 8
COMMON = ["--batch-size", "2", "--seq-len", "64", "--seed", "0", "--data", "docs"]


def _example_module():
    spec = importlib.util.spec_from_file_location("llama_torchrun", EXAMPLES / "llama_torchrun.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(*args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _cli_losses(run_dir) -> list[float]:
    lines = (run_dir / "log.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("event") == "step"]


EXAMPLE = ["examples/llama_torchrun.py", "--size", "tiny", "--host-precision", "lean"]


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory) -> tuple[dict, str]:
    """The example on 2 gloo ranks: lean host formats, ZeRO-2, a meta-device model filled
    by the seeded init; its summary and its output."""
    out = tmp_path_factory.mktemp("seeded") / "summary.json"
    stdout = run_example(
        *_torchrun(*EXAMPLE, *COMMON, "--steps", str(STEPS), "--threads", "1", "--out", str(out))
    )
    return json.loads(out.read_text()), stdout


def test_llama_torchrun_trains_as_ramflow_train(tmp_path, seeded_run):
    """The example trains as ``ramflow train --preset tiny --nproc-per-node 2`` does on the
    same seed, data and batch (see the module docstring for the tolerance)."""
    run_dir = tmp_path / "cli"
    run_example(
        "-m", "ramflow", "train", "--preset", "tiny", "--nproc-per-node", "2",
        "--device", "cpu", "--host-precision", "lean", *COMMON, "--steps", str(STEPS),
        "--clip-grad", "0", "--checkpointing", "on",
        "--eval-every", "0", "--eval-batches", "1", "--keep-checkpoints", "0",
        "--no-progress", "--out", str(run_dir),
    )  # fmt: skip
    want = _cli_losses(run_dir)
    seeded, stdout = seeded_run
    got = [r["loss"] for r in seeded["steps"]]
    assert len(got) == len(want) == STEPS
    assert all(math.isfinite(x) for x in got)
    assert got[-1] < 0.8 * got[0], got  # it trained
    assert got == pytest.approx(want, rel=2e-3)  # see the module docstring
    run = json.loads((run_dir / "run.json").read_text())
    assert seeded["corpus_fingerprint"] == run["corpus"]["fingerprint"]
    assert seeded["num_parameters"] == run["num_parameters"]
    assert (seeded["world_size"], seeded["backend"], seeded["zero_stage"]) == (2, "gloo", 2)
    assert f"step {STEPS}/{STEPS}" in stdout and "loaded in" in stdout


def test_llama_torchrun_from_safetensors(tmp_path, seeded_run):
    """``--weights DIR`` with the seeded init's weights saved by ``save_pretrained``: the
    same bf16 masters (both are the fp32 values rounded to nearest), so the same steps bit
    for bit. Two steps: the second loss follows the first update, at the peak LR whatever
    ``--steps`` is (a shorter run's cosine decays faster after it)."""
    from ramflow.train.modeling import build_model

    folder = tmp_path / "weights"
    config = _example_module().llama_config("tiny", ByteTokenizer())
    build_model(config, seed=0).save_pretrained(folder)
    out = tmp_path / "from-files.json"
    run_example(
        *_torchrun(
            *EXAMPLE, *COMMON, "--steps", "2", "--threads", "1", "--weights", str(folder),
            "--out", str(out),
        )
    )  # fmt: skip
    from_files = json.loads(out.read_text())
    seeded, _ = seeded_run
    assert [r["loss"] for r in from_files["steps"]] == [r["loss"] for r in seeded["steps"][:2]]
    assert from_files["weights"] == str(folder)


@pytest.mark.parametrize("backend", [_gpus(2, "nccl")])
def test_llama_torchrun_on_gpus(tmp_path, backend):
    """On 2 GPUs (NCCL, bf16 autocast): it trains, and reports each rank's peak memory."""
    out = tmp_path / "gpus.json"
    run_example(
        *_torchrun(
            "examples/llama_torchrun.py", "--size", "tiny", *COMMON, "--steps", str(STEPS),
            "--gpu-memory", "1GiB", "--out", str(out),
        )
    )  # fmt: skip
    result = json.loads(out.read_text())
    losses = [r["loss"] for r in result["steps"]]
    assert result["backend"] == backend and len(losses) == STEPS
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0], losses
    assert len(result["peak_gpu_bytes_per_rank"]) == 2
    assert all(0 < b < torch.cuda.get_device_properties(0).total_memory for b in
               result["peak_gpu_bytes_per_rank"])  # fmt: skip
