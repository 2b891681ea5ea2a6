"""What a run logs beside its progress: tokens/s and model FLOP utilisation (MFU) in the
step records and the summary, and TensorBoard event files with ``--log-to tensorboard``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from ramflow.train import TrainConfig, train
from ramflow.train.flops import model_flops_utilisation, peak_flops, peak_flops_of
from ramflow.train.report import read_log

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.parametrize(
    ("name", "dtype", "tflops", "label"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0, "H100 SXM dense bf16"),
        ("NVIDIA H100 PCIe", torch.float16, 756.0, "H100 PCIe dense fp16"),
        ("NVIDIA H200", torch.bfloat16, 989.0, "H200 dense bf16"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5, "A100 dense fp32"),
        ("NVIDIA L40", torch.bfloat16, 181.0, "L40 dense bf16"),
    ],
)
def test_peak_of_known_devices(name: str, dtype: torch.dtype, tflops: float, label: str) -> None:
    peak = peak_flops_of(name, dtype)
    assert peak is not None
    assert peak.flops_per_s == tflops * 1e12
    assert peak.description.startswith(label) and f"{tflops:g} TFLOP/s" in peak.description


def test_no_peak_on_the_cpu_or_an_unknown_device() -> None:
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    assert peak_flops_of("Some Future GPU", torch.bfloat16) is None
    assert model_flops_utilisation(flops_per_token=6e9, tokens_per_s=1e4, peak=None) is None


def test_mfu_is_flops_per_token_times_tokens_over_the_peak() -> None:
    peak = peak_flops_of("NVIDIA H200", torch.bfloat16)
    mfu = model_flops_utilisation(flops_per_token=6 * 2.69e9, tokens_per_s=15_000.0, peak=peak)
    assert mfu == pytest.approx(6 * 2.69e9 * 15_000 / 989e12, rel=1e-12)  # float rounding only


def _config(corpus_file: Path, *, device: str = "cpu") -> TrainConfig:
    return TrainConfig.from_options(
        data=str(corpus_file),
        steps=3,
        eval_every=3,
        seq_len=32,
        batch_size=2,
        eval_batches=1,
        device=device,
    )


def test_cpu_run_logs_tokens_per_s_and_no_mfu(tmp_path: Path, corpus_file: Path) -> None:
    result = train(_config(corpus_file), out=tmp_path / "run", progress=False)
    steps = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["event"] == "step"]
    assert len(steps) == 3
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in steps)
    assert "tokens/s while training" in result.summary
    assert "MFU" not in result.summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_logs_mfu_against_its_peak(tmp_path: Path, corpus_file: Path) -> None:
    config = _config(corpus_file, device="cuda")
    result = train(config, out=tmp_path / "run", progress=False)
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in the table of peaks")
    steps = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["event"] == "step"]
    assert all(0 < r["mfu"] < 1 for r in steps)
    assert f"over the {peak.description}" in result.summary


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")
def test_log_to_tensorboard_without_the_package_says_how_to_install_it(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = ramflow_cli("train", "--data", corpus_file, "--steps", "1", *fast, "--out", out,
                     "--log-to", "tensorboard")  # fmt: skip
    assert rc == 2
    assert "pip install tensorboard" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_log_to_tensorboard_writes_the_scalars(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    rc = ramflow_cli("train", "--data", corpus_file, "--steps", "3", "--eval-every", "3", *fast,
                     "--out", out, "--log-to", "tensorboard")  # fmt: skip
    assert rc == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "val/loss"} <= tags
    log = [r for r in read_log(out / "log.jsonl") if r["event"] == "step"]
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in log]  # fp32 events
    assert [e.step for e in events.Scalars("val/loss")] == [0, 3]


def test_a_three_step_run_warms_up_lowers_its_loss_and_names_the_steps_it_averages(
    tmp_path: Path, corpus_file: Path
) -> None:
    """Three steps of the tiny preset from random weights on the CPU: the default warmup
    is not 0, so step 1 takes less than the peak learning rate and the loss falls; the
    summary's last training loss is the mean of the 3 steps there are, and says so."""
    config = TrainConfig.from_options(
        data=str(corpus_file), steps=3, seq_len=32, batch_size=2, eval_every=0, device="cpu"
    )
    assert config.warmup_steps >= 1
    result = train(config, out=tmp_path / "run", progress=False)
    steps = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["event"] == "step"]
    losses = [r["loss"] for r in steps]
    assert len(losses) == 3
    assert steps[0]["lr"] < config.lr
    assert losses[2] < losses[0]
    assert result.last_loss == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert f"-> {result.last_loss:.4f} (mean of all 3 steps, 1 to 3)" in result.summary
    assert "last 10" not in result.summary
