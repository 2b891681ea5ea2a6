"""Training within a budget: ``--batch-size auto`` and the back-off after an out-of-memory
error, on the CPU with the error injected.

``torch.OutOfMemoryError`` is what CUDA's allocator raises; it can be constructed on any
build, so a hook on a decoder layer raises it whenever the micro-batch is larger than a
limit: from the layer's forward, or from its backward (a tensor hook on its output), the
two places a real one comes from. A run that backs off must go on with the global batch
unchanged and compute what a run started at the smaller micro-batch computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ramflow.train import TrainConfig, train
from ramflow.train import trainer as trainer_module
from ramflow.train.report import read_log

RUN = dict(steps=4, seq_len=32, eval_every=0, eval_batches=1, device="cpu", seed=0)


class OOMInjector:
    """Raises ``torch.OutOfMemoryError`` from decoder layer 1 when a micro-batch has more
    than ``limit`` sequences and ``armed`` is set."""

    def __init__(self, *, limit: int, where: str, armed: bool = True) -> None:
        self.limit, self.where, self.armed = limit, where, armed
        self.raised = 0

    def _raise(self, *_: Any) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    def build(self, original):
        def build_offloaded(*args: Any, **kwargs: Any) -> torch.nn.Module:
            model = original(*args, **kwargs)
            layer = model.model.layers[1]

            def pre(module, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                if self.armed and self.where == "forward" and h.shape[0] > self.limit:
                    self._raise()

            def post(module, args, kwargs, output):
                h = output[0] if isinstance(output, tuple) else output
                if self.armed and self.where == "backward" and h.shape[0] > self.limit:
                    h.register_hook(self._raise)

            layer.register_forward_pre_hook(pre, with_kwargs=True)
            layer.register_forward_hook(post, with_kwargs=True)
            return model

        return build_offloaded


def _inject(monkeypatch, injector: OOMInjector) -> None:
    monkeypatch.setattr(
        trainer_module, "build_offloaded", injector.build(trainer_module.build_offloaded)
    )


def _steps(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_log(run / "log.jsonl") if r["event"] == "step"]


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read_log(run / "log.jsonl") if r["event"] == name]


@pytest.mark.parametrize(
    ("where", "clip_grad"),
    # without clipping ramflow could step units during backward (the eager overlap), which
    # a failed backward cannot undo: the trainer then builds the optimizer without overlap
    [("forward", 1.0), ("backward", 1.0), ("backward", 0.0)],
)
def test_oom_during_training_halves_the_micro_batch_and_keeps_the_global_batch(
    tmp_path: Path, corpus_file: Path, monkeypatch, where: str, clip_grad: float
) -> None:
    injector = OOMInjector(limit=2, where=where, armed=False)
    _inject(monkeypatch, injector)

    def arm(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            injector.armed = True  # from step 3 on, a micro-batch of 4 runs out of memory

    config = TrainConfig.from_options(
        data=str(corpus_file), batch_size=4, clip_grad=clip_grad, **RUN
    )
    result = train(config, out=tmp_path / "backoff", progress=False, on_step=arm)
    assert result.steps_done == 4 and not result.interrupted
    assert injector.raised == 1

    (event,) = _events(tmp_path / "backoff", "oom_backoff")
    assert event["step"] == 3
    assert (event["from_micro_batch"], event["micro_batch"], event["grad_accum"]) == (4, 2, 2)
    assert event["global_batch"] == 4
    steps = _steps(tmp_path / "backoff")
    assert [r["micro_batch"] for r in steps] == [4, 4, 2, 2]
    assert len({r["tokens"] - i * 4 * 32 for i, r in enumerate(steps)}) == 1  # 4 x 32 per step

    monkeypatch.undo()
    smaller = TrainConfig.from_options(
        data=str(corpus_file), batch_size=2, grad_accum=2, clip_grad=clip_grad, **RUN
    )
    train(smaller, out=tmp_path / "smaller", progress=False)
    reference = _steps(tmp_path / "smaller")
    assert [r["tokens"] for r in reference] == [r["tokens"] for r in steps]
    # one micro-batch of 4 against two of 2 sum the gradients in another order, which
    # moves fp32 results by rounding only (relative 1e-4 is about 1000 ulps at these
    # magnitudes, well above what 4 steps of rounding accumulate, far below a skipped or
    # repeated batch, which moves the loss by percents)
    for a, b in zip(steps, reference):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])


def test_batch_size_auto_fits_the_micro_batch_and_reaches_the_global_batch(
    tmp_path: Path, corpus_file: Path, monkeypatch, ramflow_cli
) -> None:
    injector = OOMInjector(limit=2, where="backward")
    _inject(monkeypatch, injector)
    common = ("--data", corpus_file, "--steps", "3", "--seq-len", "32", "--eval-every", "0",
              "--eval-batches", "1", "--no-progress", "--device", "cpu")  # fmt: skip
    out = tmp_path / "auto"
    assert ramflow_cli("train", *common, "--batch-size", "auto", "--global-batch", "8",
                       "--out", out) == 0  # fmt: skip
    (fit,) = _events(out, "batch_fit")
    assert (fit["micro_batch"], fit["grad_accum"], fit["global_batch"]) == (2, 4, 8)
    assert injector.raised == 2  # trial steps at 8 and 4 ran out of memory
    assert not _events(out, "oom_backoff")
    auto = _steps(out)
    assert [r["micro_batch"] for r in auto] == [2, 2, 2]

    monkeypatch.undo()
    ref = tmp_path / "fixed"
    assert ramflow_cli("train", *common, "--batch-size", "2", "--grad-accum", "4",
                       "--out", ref) == 0  # fmt: skip
    # the trial steps changed nothing: the same micro-batches compute the same steps
    assert [(r["step"], r["loss"]) for r in auto] == [(r["step"], r["loss"]) for r in _steps(ref)]


def test_a_micro_batch_of_one_that_runs_out_of_memory_ends_the_run(
    tmp_path: Path, corpus_file: Path, monkeypatch
) -> None:
    _inject(monkeypatch, OOMInjector(limit=0, where="forward"))
    config = TrainConfig.from_options(data=str(corpus_file), batch_size=2, **RUN)
    with pytest.raises(torch.OutOfMemoryError):
        train(config, out=tmp_path / "run", progress=False)
    (event,) = _events(tmp_path / "run", "oom_backoff")
    assert (event["from_micro_batch"], event["micro_batch"]) == (2, 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(batch_size=3, global_batch=8), "not a multiple"),
        (dict(batch_size=2, grad_accum=3, global_batch=8), "give two of the three"),
        (dict(batch_size="auto", grad_accum=2, global_batch=8), "drop --grad-accum"),
        (dict(batch_size="many"), "or 'auto'"),
    ],
)
def test_global_batch_options_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_options(**options)


def test_global_batch_sets_the_accumulation() -> None:
    config = TrainConfig.from_options(batch_size=2, global_batch=8)
    assert (config.batch_size, config.grad_accum, config.global_batch) == (2, 4, 8)
    auto = TrainConfig.from_options(batch_size="auto", global_batch=8)
    assert auto.auto_batch_size and auto.global_batch == 8


def test_auto_batch_size_without_global_batch_takes_the_presets_batch() -> None:
    # --global-batch defaults to --batch-size x --grad-accum: the preset's batch here
    preset_batch = TrainConfig.from_options().batch_size
    auto = TrainConfig.from_options(batch_size="auto")
    assert auto.auto_batch_size and auto.global_batch == preset_batch
    doubled = TrainConfig.from_options(batch_size="auto", grad_accum=2)
    assert doubled.auto_batch_size and doubled.global_batch == 2 * preset_batch


@pytest.mark.gpu
def test_a_real_out_of_memory_error_on_the_gpu_backs_off_and_the_run_goes_on(
    tmp_path: Path, corpus_file: Path
) -> None:
    """From step 3 on, the caching allocator may hold only 70% of what step 2's micro-batch
    of 4 took above what stays allocated between steps
    (``torch.cuda.set_per_process_memory_fraction``): a micro-batch of 4 runs out of memory
    for real, one of 2 (about half the activations: at T=1024 they dwarf the tiny preset's
    weights in the window) fits."""
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory

    def cap(record: dict[str, Any]) -> None:
        if record["step"] == 1:
            torch.cuda.reset_peak_memory_stats(device)
        elif record["step"] == 2:
            peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()
            between = torch.cuda.memory_allocated(device)
            held = torch.cuda.memory_reserved(device)
            budget = held + 0.7 * (peak - between)
            torch.cuda.set_per_process_memory_fraction(budget / total, device)

    config = TrainConfig.from_options(
        data=str(corpus_file),
        batch_size=4,
        steps=5,
        seq_len=1024,
        eval_every=0,
        eval_batches=1,
        device="cuda",
        seed=0,
    )
    try:
        result = train(config, out=tmp_path / "run", progress=False, on_step=cap)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    assert result.steps_done == 5 and not result.interrupted
    (event,) = _events(tmp_path / "run", "oom_backoff")
    assert event["step"] == 3
    assert (event["from_micro_batch"], event["micro_batch"], event["grad_accum"]) == (4, 2, 2)
    assert event["global_batch"] == 4
    assert "out of memory" in event["error"].lower()  # the allocator's own error
    assert [r["micro_batch"] for r in _steps(tmp_path / "run")] == [4, 4, 2, 2, 2]
