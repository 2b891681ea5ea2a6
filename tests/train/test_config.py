"""A run's settings (``ramflow.train.config.TrainConfig``): every value that cannot make a
run is refused at construction, with a one-line message naming the flag and what to give."""

from __future__ import annotations

import pytest

from ramflow.train.config import TrainConfig
from ramflow.train.lr_schedule import warmup_cosine


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(preset="tiny", model="some/dir"), r"^give either --preset or --model DIR, not both$"),
        (dict(save_every=-1), r"^--save-every must not be negative, got -1$"),
        (dict(decay_steps=0), r"^--decay-steps must be at least 1, got 0$"),
        (dict(seed=2**64), r"^--seed must be from 0 to 2\*\*63 - 1, got 18446744073709551616$"),
        (dict(seed=-1), r"^--seed must be from 0 to 2\*\*63 - 1, got -1$"),
        (dict(beta2=1.0), r"^beta2 must be in \[0, 1\), got 1\.0$"),
        (dict(eps=float("nan")), r"^eps must be a positive number, got nan$"),
        (dict(precision="fp64"), r"^--precision 'fp64': choose one of auto, "),
        (dict(host_precision="fp8"), r"^--host-precision 'fp8': choose one of "),
        (dict(lora_rank=4, device_optimizer=True), r"^--device-optimizer steps a full fine-tune"),
        (dict(device_optimizer="yes"), r"^device_optimizer must be None \(auto\), True or False"),
    ],
)
def test_a_setting_that_cannot_make_a_run_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"preset": "tiny", **options})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(lr_warmup=3), r"^unknown training options: lr_warmup$"),
        (dict(preset="tiny", model="some/dir"), r"^give either --preset or --model DIR, not both$"),
        (dict(global_batch=0), r"^--global-batch must be at least 1, got 0$"),
        (dict(global_batch=8), r"^--global-batch needs --batch-size \(a number of sequences, or"),
        (
            dict(batch_size="auto", global_batch=8, grad_accum=2),
            r"^--batch-size auto chooses --grad-accum to reach --global-batch; drop --grad-accum$",
        ),
        (dict(batch_size=3, global_batch=8), r"^--global-batch 8 is not a multiple of --batch-s"),
        (
            dict(batch_size=2, global_batch=8, grad_accum=2),
            r"^--global-batch 8 is not --batch-size 2 x --grad-accum 2; give two of the three$",
        ),
    ],
)
def test_options_that_cannot_make_a_run_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_options(**options)


def test_a_global_batch_is_a_micro_batch_times_accumulation() -> None:
    config = TrainConfig.from_options(batch_size=2, global_batch=8)
    assert (config.batch_size, config.grad_accum, config.global_batch) == (2, 4, 8)
    auto = TrainConfig.from_options(batch_size="auto", global_batch=8)
    assert auto.auto_batch_size and auto.batch_size == 8  # fitted to the device later


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 10, 0.1), r"need warmup_steps >= 0 and total_steps >= 1, got -1, 10"),
        ((1, 0, 0.1), r"need warmup_steps >= 0 and total_steps >= 1, got 1, 0"),
        ((1, 10, 1.5), r"min_lr_ratio must be in \[0, 1\], got 1\.5"),
    ],
)
def test_a_schedule_that_cannot_be_drawn_is_refused(args: tuple, message: str) -> None:
    warmup, total, ratio = args
    with pytest.raises(ValueError, match=message):
        warmup_cosine(warmup_steps=warmup, total_steps=total, min_lr_ratio=ratio)
