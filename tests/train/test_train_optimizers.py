"""``ramflow train --optimizer``: each optimizer trains, checkpoints and resumes bit for bit;
the per-optimizer defaults; the combinations refused."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ramflow import optim
from ramflow.train import TrainConfig, open_checkpoint, train
from ramflow.train.optimizers import OPTIMIZER_DEFAULTS, make_optimizer
from ramflow.train.presets import get_preset
from ramflow.train.report import read_log


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_log(run / "log.jsonl") if r["event"] == "step"]


def _final(run: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(open_checkpoint(run).path / name))


@pytest.mark.parametrize(
    ("name", "host_precision"),
    [
        ("lion", "fp32"),
        ("lion", "lean"),
        ("adafactor", "fp32"),
        ("sgd", "fp32"),
        ("muon", "fp32"),
        ("adamw", "lean4"),
    ],
)
def test_resume_equals_uninterrupted(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, name: str, host_precision: str
) -> None:
    """The checkpoint carries each optimizer's states (Lion's momentum, 8-bit with its
    absmax and the rounding's step on the lean formats; Adafactor's factored row and column
    statistics and step; SGD's momentum buffer; Muon's momentum buffers and its AdamW
    moments): a run stopped after step 3 and resumed by
    the CLI ends as the uninterrupted one, bit for bit."""
    settings = dict(
        steps=6, eval_every=3, save_every=2, optimizer=name, host_precision=host_precision
    )
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert ramflow_cli("train", "--data", corpus_file, *flags, *fast, "--out", whole) == 0

    config = TrainConfig.from_options(
        data=str(corpus_file), seq_len=32, batch_size=2, eval_batches=1, device="cpu", **settings
    )
    stop = threading.Event()
    result = train(
        config,
        out=split,
        progress=False,
        stop=stop,
        on_step=lambda r: stop.set() if r["step"] == 3 else None,
    )
    assert result.steps_done == 3
    assert ramflow_cli("train", "--resume", split, "--no-progress", "--device", "cpu") == 0

    losses = _losses(whole)
    assert _losses(split) == losses
    assert losses[-1][1] < losses[0][1]  # it trains
    states = _final(whole, "optimizer.safetensors")
    assert states.keys() == _final(split, "optimizer.safetensors").keys()
    resumed = _final(split, "optimizer.safetensors")
    assert all(torch.equal(states[k], resumed[k]) for k in states)
    fields = {k.rsplit(".", 1)[-1] if "." in k else k for k in states}
    expected = {
        "lion": ["exp_avg"],
        "adafactor": ["row_var"],
        "sgd": ["momentum_buffer"],
        "muon": ["momentum_buffer", "exp_avg_sq"],  # hidden matrices; embeddings, norms
        "adamw": ["exp_avg_4bit", "exp_avg_sq_4bit_scale"],  # lean4: the 4-bit codes
    }[name]
    for field in expected:
        assert any(field in f for f in fields), sorted(fields)[:5]
    if name == "muon":  # the embeddings are AdamW's, the hidden matrices Muon's
        assert not any(k.startswith("model.embed_tokens.") and "momentum" in k for k in states)
        assert any(k.startswith("model.embed_tokens.") and "exp_avg_sq" in k for k in states)


def test_defaults_follow_adamws_per_optimizer() -> None:
    adamw_lr = get_preset("tiny").lr
    for name, defaults in OPTIMIZER_DEFAULTS.items():
        config = TrainConfig.from_options(optimizer=name, device="cpu")
        assert config.lr == pytest.approx(adamw_lr * defaults.lr_scale)
        assert config.weight_decay == defaults.weight_decay
    lion = TrainConfig.from_options(optimizer="lion", lr=1e-4, weight_decay=0.05, device="cpu")
    assert (lion.lr, lion.weight_decay) == (1e-4, 0.05)  # given values win
    assert TrainConfig.from_options(device="cpu").optimizer == "adamw"


def test_make_optimizer_builds_ramflows_optimizers() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    kinds = {"adamw": optim.AdamW, "lion": optim.Lion, "adafactor": optim.Adafactor}
    kinds.update(sgd=optim.SGD, muon=optim.Muon)
    for name, cls in kinds.items():
        opt = make_optimizer(
            name, [{"params": params}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, overlap=True
        )
        assert type(opt) is cls
    sgd = make_optimizer(
        "sgd", [{"params": params}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, overlap=True
    )
    assert sgd.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(optimizer="adam"), "choose one of adamw, lion, adafactor, sgd"),
        (dict(optimizer="sgd", host_precision="lean"), "--host-precision fp32"),
        (dict(optimizer="adafactor", host_precision="auto"), "--host-precision fp32"),
        (dict(optimizer="muon", host_precision="lean"), "--host-precision fp32"),
        (dict(optimizer="muon", device_optimizer=True), "drop --device-optimizer"),
        (dict(optimizer="lion", device_optimizer=True), "drop --device-optimizer"),
        (dict(optimizer="lion", host_precision="lean4"), "--optimizer adamw"),
    ],
)
def test_combinations_refused(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_options(device="cpu", **options)


def test_resume_keeps_the_optimizer(trained_run: Path, ramflow_cli, capsys) -> None:
    rc = ramflow_cli("train", "--resume", trained_run, "--optimizer", "lion", "--no-progress")
    assert rc != 0
    assert "--optimizer lion differs from the checkpoint's 'adamw'" in capsys.readouterr().err


def test_only_adamw_lets_the_planner_choose_device_steps(
    tmp_path: Path, corpus_file: Path, monkeypatch
) -> None:
    """``--device-optimizer auto`` (the default) plans device steps for AdamW only: the
    others have none, so the trainer offloads them with ``device_optimizer=False``."""
    from ramflow.train import trainer

    seen = []
    real = trainer.build_offloaded

    def spy(*args, **kwargs):
        seen.append(kwargs["device_optimizer"])
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "build_offloaded", spy)
    for name in ("adamw", "lion"):
        config = TrainConfig.from_options(
            data=str(corpus_file), seq_len=32, batch_size=2, eval_batches=1, device="cpu",
            steps=1, keep_checkpoints=0, optimizer=name,
        )  # fmt: skip
        train(config, out=tmp_path / name, progress=False)
    assert seen == [None, False]
