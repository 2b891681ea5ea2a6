"""Issue 48, points 1 and 2 in ``ramflow train``: the gradients a CLI step holds in the lean
host formats (compact 8-bit codes when it clips, none when it does not), and ``ramflow
plan``, ``get_plan(model).host_bytes`` and the bytes the host really holds agreeing.
See [Note: the gradients of a CLI step] in ``ramflow/train/gradient_holding.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ramflow
import ramflow.train.trainer as trainer_module
from ramflow.engine.host_store import RING_BUFFERS
from ramflow.formats.deferred_grad import compact_nbytes
from ramflow.train import TrainConfig, plan_run, train
from ramflow.train.gradient_holding import GradientHolding
from ramflow.units.registry import engine_of_model
from test_compact_deferred_grad import allocated_host_bytes

RUN = dict(steps=3, seq_len=32, batch_size=2, eval_every=0, eval_batches=1, device="cpu", seed=0)


class Captured:
    """The model and optimizer that ``train`` builds, and what each step's end finds."""

    def __init__(self, monkeypatch) -> None:
        self.model: Any = None
        self.opt: Any = None
        self.after_step: list[tuple[int, int]] = []  # (full host gradients, compact buffers)
        build, make = trainer_module.build_offloaded, trainer_module.make_optimizer

        def build_offloaded(*args, **kwargs):
            self.model = build(*args, **kwargs)
            return self.model

        def make_optimizer(*args, **kwargs):
            self.opt = make(*args, **kwargs)
            return self.opt

        monkeypatch.setattr(trainer_module, "build_offloaded", build_offloaded)
        monkeypatch.setattr(trainer_module, "make_optimizer", make_optimizer)

    def on_step(self, record: dict[str, Any]) -> None:
        units = engine_of_model(self.model).units
        self.after_step.append(
            (
                sum(u.host_grad is not None for u in units),
                sum(u.compact_grad is not None for u in units),
            )
        )


def _host_total(est) -> int:
    return est.host_pinned_bytes + est.host_pageable_bytes


@pytest.mark.parametrize(
    ("clip_grad", "grad_accum"),
    # clipped: codes from the first step; unclipped: steps during backward, none held;
    # accumulated: unit-major (one rank), each unit's gradient complete as it lands
    [(1.0, 1), (0.0, 1), (0.0, 2)],
    ids=["clipped", "unclipped", "accumulated"],
)
def test_a_lean_cli_run_holds_what_its_plan_counts(
    tmp_path: Path, corpus_file: Path, monkeypatch, clip_grad: float, grad_accum: int
) -> None:
    """The optimizer is AdamW(keep_grads=False) and says it clips where the run clips; no
    unit ever holds a full host gradient (checked after every step, the first included);
    a clipped run holds every unit's gradient in 8-bit codes, an unclipped one none.
    ``ramflow plan``'s host total is ``get_plan(model).host_bytes``, and what the store,
    the codes and the optimizer's states allocate is that, less the ring's staging buffers
    not made yet (a fixed cost: at most RING_BUFFERS of the largest unit)."""
    got = Captured(monkeypatch)
    config = TrainConfig.from_options(
        data=str(corpus_file),
        host_precision="lean",
        clip_grad=clip_grad,
        grad_accum=grad_accum,
        keep_checkpoints=0,
        **RUN,
    )
    est = plan_run(config)
    train(config, out=tmp_path / "run", progress=False, on_step=got.on_step)
    clips = clip_grad > 0
    assert (got.opt.overlap, got.opt.keep_grads, got.opt.clips) == (True, False, clips)
    engine = engine_of_model(got.model)
    trained = [u for u in engine.units if u.num_trainable]
    assert got.after_step == [(0, len(trained) if clips else 0)] * RUN["steps"]
    plan = ramflow.get_plan(got.model)
    compact = sum(compact_nbytes(u.trainable_numel) for u in engine.units)
    assert plan.host_deferred_bytes == (compact if clips else 0)
    assert plan.host_bytes == _host_total(est)
    host = engine.host
    not_made = (RING_BUFFERS - host._ring_made) * host._ring_numel * host.wire_dtype.itemsize
    held = allocated_host_bytes(engine, got.opt)
    assert 0 <= plan.host_bytes - held <= not_made, (plan.host_bytes, held, not_made)


@pytest.mark.parametrize(
    ("clip_grad", "per_parameter"),
    # the lean store (bf16 masters 2, FP8 states 2 + 8 / 256) and, clipping, the codes
    # (1 + 4 / 256): issue 48's 4.5 and 5.1 bytes per parameter
    [(0.0, 4.03125), (1.0, 4.03125 + 1 + 4 / 256)],
    ids=["unclipped", "clipped"],
)
def test_the_plan_of_a_lean_llama_8b(clip_grad: float, per_parameter: float) -> None:
    """``ramflow plan --preset llama-8b --host-precision lean``: the host total per trained
    parameter (the header's figure, as the table sums it) is the lean store's, plus the
    codes when clipping, plus the gradient ring's staging (a fixed 4 x the embedding's
    gradient in bf16), which the header names apart."""
    config = TrainConfig.from_options(
        preset="llama-8b", seq_len=128, batch_size=1, host_precision="lean", clip_grad=clip_grad
    )
    est = plan_run(config)
    total, n = _host_total(est), est.num_trainable
    assert est.host_bytes_per_parameter == total / n  # the header's figure is the table's
    assert est.host_ring_bytes == RING_BUFFERS * 128256 * 4096 * 2  # the embedding's, bf16
    per = (total - est.host_ring_bytes) / n
    assert per == pytest.approx(per_parameter, abs=2e-3)  # a block's padding at most
    assert per <= (5.1 if clip_grad else 4.5)
    header = est.describe()
    assert f"{total / n:.2f} bytes per trained parameter ({per:.2f} per parameter" in header


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # lean, one rank: codes when clipping, or where a pass runs under no_step
        (dict(clip_grad=1.0), GradientHolding(True, False, True, True)),
        (dict(clip_grad=0.0), GradientHolding(True, False, False, False)),
        (dict(clip_grad=0.0, auto_batch_size=True), GradientHolding(True, False, True, True)),
        # exact formats: as before (one rank keeps steps out of backward, p.grad kept)
        (dict(clip_grad=1.0, host_precision="fp32"), GradientHolding(True, True, False, True)),
        (dict(clip_grad=0.0, host_precision="fp32"), GradientHolding(False, True, False, True)),
        # another optimizer keeps p.grad
        (dict(clip_grad=1.0, optimizer="lion"), GradientHolding(True, True, False, True)),
    ],
)
def test_gradient_holding_per_run(options: dict, expected: GradientHolding) -> None:
    options = {"host_precision": "lean", **options}
    config = TrainConfig.from_options(**options)
    precision = ramflow.HostPrecision.parse(options["host_precision"])
    assert GradientHolding.of(config, precision, several_ranks=False, unit_major=True) == expected
    # several ranks: steps during backward where nothing needs every gradient, else p.grad
    several = GradientHolding.of(config, precision, several_ranks=True, unit_major=False)
    assert several.keep_grads == several.deferred == (config.clip_grad > 0)
    # without the unit-major order (MoE router logits), accumulation would run under
    # no_step: a lean run clips-by-promise and holds codes
    if precision.compact_deferred and options.get("optimizer", "adamw") == "adamw":
        assert GradientHolding.of(config, precision, several_ranks=False, unit_major=False) == (
            GradientHolding(True, False, True, True)
        )


def test_an_oom_after_eager_steps_ends_the_run_with_what_to_pass(
    tmp_path: Path, corpus_file: Path, monkeypatch
) -> None:
    """An unclipped lean run steps units during backward: an out-of-memory error raised
    after some had stepped cannot be backed off exactly, so the run ends with a message
    naming --resume with a smaller micro-batch and --clip-grad."""
    from test_oom_backoff import OOMInjector, _inject

    injector = OOMInjector(limit=2, where="backward", armed=True)
    _inject(monkeypatch, injector)
    options = {**RUN, "batch_size": 4}  # a micro-batch of 4 runs out of memory
    config = TrainConfig.from_options(
        data=str(corpus_file), host_precision="lean", clip_grad=0.0, keep_checkpoints=0, **options
    )
    with pytest.raises(torch.OutOfMemoryError, match="--resume.*--clip-grad"):
        train(config, out=tmp_path / "run", progress=False)
