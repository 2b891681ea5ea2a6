"""``fit_batch``: the largest micro-batch under the lightest checkpointing, estimate first,
then real trial steps that back off on ``torch.OutOfMemoryError``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ramflow.memory import fit_batch, smaller_micro_batch
from ramflow.memory.fit import micro_batch_candidates

D = 16


def test_candidates_divide_the_global_batch_and_back_off_keeps_dividing() -> None:
    assert micro_batch_candidates(12) == [12, 6, 4, 3, 2, 1]
    assert micro_batch_candidates(12, max_micro_batch=5) == [4, 3, 2, 1]
    assert [smaller_micro_batch(b) for b in (8, 6, 9, 7, 2, 1)] == [4, 3, 3, 1, 1, None]
    with pytest.raises(ValueError, match=r"^the global batch must be at least 1 sequence, got 0"):
        micro_batch_candidates(0)
    with pytest.raises(ValueError, match=r"^max_micro_batch must be at least 1, got 0$"):
        micro_batch_candidates(4, max_micro_batch=0)
    with pytest.raises(ValueError, match=r"^give at least one checkpointing level to try"):
        fit_batch(global_batch=4, estimate=lambda b, ckpt: b, checkpointing=())


def test_estimate_picks_the_largest_micro_batch_without_checkpointing_first() -> None:
    def estimate(micro_batch: int, checkpointing: bool) -> int:
        return micro_batch * (10 if checkpointing else 40)  # bytes, linear in B

    fit = fit_batch(global_batch=16, device_budget_bytes=170, estimate=estimate)
    assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (4, 4, False)
    assert [t.micro_batch for t in fit.trials] == [16, 8, 4]
    # nothing fits plainly: checkpointing on, the largest micro-batch under it
    fit = fit_batch(global_batch=16, device_budget_bytes=35, estimate=estimate)
    assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (2, 8, True)
    assert "global batch 16" in fit.describe()
    with pytest.raises(ValueError, match="no micro-batch"):
        fit_batch(global_batch=16, device_budget_bytes=5, estimate=estimate)


def test_budget_takes_size_strings_and_the_hint_fits_what_was_tried() -> None:
    def estimate(micro_batch: int, checkpointing: bool) -> int:
        return micro_batch * (256 if checkpointing else 1024)

    fit = fit_batch(global_batch=8, device_budget_bytes="2KiB", estimate=estimate)
    assert (fit.micro_batch, fit.checkpointing, fit.device_budget_bytes) == (2, False, 2048)
    # checkpointed levels were tried and failed: no advice to turn checkpointing on
    with pytest.raises(ValueError, match="no micro-batch") as both:
        fit_batch(global_batch=8, device_budget_bytes="100 B", estimate=estimate)
    assert "--checkpointing on" not in str(both.value)
    with pytest.raises(ValueError, match="turn --checkpointing on"):
        fit_batch(
            global_batch=8, device_budget_bytes=100, estimate=estimate, checkpointing=(False,)
        )
    with pytest.raises(ValueError, match="device_budget_bytes"):
        fit_batch(global_batch=8, device_budget_bytes="lots", estimate=estimate)
    with pytest.raises(ValueError, match="negative"):
        fit_batch(global_batch=8, device_budget_bytes=-1, estimate=estimate)
    with pytest.raises(TypeError, match="device_budget_bytes"):
        fit_batch(global_batch=8, device_budget_bytes=True, estimate=estimate)


def test_trial_steps_back_off_on_out_of_memory() -> None:
    """A real forward and backward; the model raises the allocator's error above 3 rows."""
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 1))

    def guard(module: nn.Module, args: tuple) -> None:
        if args[0].shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    model[2].register_forward_pre_hook(guard)
    sizes = []

    def trial(micro_batch: int, checkpointing: bool) -> None:
        sizes.append(micro_batch)
        model(torch.randn(micro_batch, D)).sum().backward()
        model.zero_grad(set_to_none=True)

    fit = fit_batch(global_batch=12, trial=trial, checkpointing=(False,))
    assert sizes == [12, 6, 4, 3]
    assert (fit.micro_batch, fit.grad_accum) == (3, 4)
    assert [t.outcome for t in fit.trials] == ["out of memory (trial)"] * 3 + ["fits"]
