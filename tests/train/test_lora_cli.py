"""``ramflow train --lora``: PEFT adapters on a frozen, offloaded base, on the CPU.

The checkpoints hold the adapters in PEFT's format, resume bit for bit, and bad input gets
one clear error before anything is written.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ramflow.train import TrainConfig, open_checkpoint, train
from ramflow.train.modeling import build_model, read_config
from ramflow.train.report import read_log

peft = pytest.importorskip("peft")


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_log(run / "log.jsonl") if r["event"] == "step"]


LORA = ("--lora", "4", "--lr", "1e-2", "--seed", "3")


def test_lora_checkpoint_loads_in_peft_and_resumes_bit_for_bit(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast
) -> None:
    settings = ["--steps", "6", "--eval-every", "3", "--save-every", "2", *LORA, *fast]
    whole = tmp_path / "whole"
    assert ramflow_cli("train", "--data", corpus_file, *settings, "--out", whole) == 0
    ckpt = open_checkpoint(whole)
    names = {p.name for p in ckpt.path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= names
    assert "model.safetensors" not in names  # the base is the preset's, from the seed
    losses = _losses(whole)
    assert len(losses) == 6 and losses[-1] < losses[0]

    # PEFT loads the adapters onto the base the run started from (the preset, its seed)
    run_config = json.loads((whole / "run.json").read_text())["config"]
    base = build_model(read_config(ckpt.path), seed=run_config["seed"])
    loaded = peft.PeftModel.from_pretrained(base, str(ckpt.path))
    saved = load_file(str(ckpt.path / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * read_config(ckpt.path).num_hidden_layers
    state = peft.get_peft_model_state_dict(loaded)
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in saved.items() if "lora_B" in k)

    # the same run stopped after step 3, then resumed by the CLI: the same losses, bit for bit
    config = TrainConfig.from_options(
        data=str(corpus_file),
        seq_len=32,
        batch_size=2,
        eval_batches=1,
        device="cpu",
        steps=6,
        eval_every=3,
        save_every=2,
        lora_rank=4,
        lr=1e-2,
        seed=3,
    )
    stop = threading.Event()
    result = train(
        config,
        out=tmp_path / "split",
        progress=False,
        stop=stop,
        on_step=lambda r: stop.set() if r["step"] == 3 else None,
    )
    assert result.interrupted and result.steps_done == 3
    resume = ("--no-progress", "--device", "cpu")
    assert ramflow_cli("train", "--resume", tmp_path / "split", *resume) == 0
    assert _losses(tmp_path / "split") == losses
    a = load_file(str(open_checkpoint(tmp_path / "split").path / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], saved[k]) for k in saved)


def test_fuse_lora_trains_as_peft_and_resumes_bit_for_bit(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, monkeypatch
) -> None:
    """``--fuse-lora`` (``ramflow.helpers.fuse_lora``): the run records it, its resume keeps
    it (bit for bit), and it trains as PEFT's layers do."""
    from ramflow.layers import lora_fused as _lora_fused

    settings = ["--steps", "6", "--eval-every", "3", "--save-every", "3", *LORA, *fast]
    fused, plain = tmp_path / "fused", tmp_path / "plain"
    fused_calls = []
    apply = _lora_fused._LoraLinear.apply
    monkeypatch.setattr(
        _lora_fused._LoraLinear, "apply", lambda *a: fused_calls.append(1) or apply(*a)
    )
    assert (
        ramflow_cli("train", "--data", corpus_file, *settings, "--fuse-lora", "--out", fused) == 0
    )
    assert fused_calls  # the fused layers ran (their curve may equal PEFT's to the bit)
    fused_calls.clear()
    assert ramflow_cli("train", "--data", corpus_file, *settings, "--out", plain) == 0
    assert not fused_calls
    assert json.loads((fused / "run.json").read_text())["config"]["fuse_lora"] is True
    a, b = torch.tensor(_losses(fused)), torch.tensor(_losses(plain))
    assert len(a) == 6
    # fp32 on the CPU: the fused sum is rounded once where PEFT rounds twice, a few ulps per
    # layer; six AdamW steps at lr 1e-2 keep the curves within 1e-4 of each other
    assert ((a - b).abs() / b.abs()).max() < 1e-4

    # stopped after step 3, resumed without the flag: the stored setting holds
    config = TrainConfig.from_options(
        data=str(corpus_file), seq_len=32, batch_size=2, eval_batches=1, device="cpu",
        steps=6, eval_every=3, save_every=3, lora_rank=4, lr=1e-2, seed=3, fuse_lora=True,
    )  # fmt: skip
    stop = threading.Event()
    split = tmp_path / "split"
    result = train(config, out=split, progress=False, stop=stop,
                   on_step=lambda r: stop.set() if r["step"] == 3 else None)  # fmt: skip
    assert result.interrupted and result.steps_done == 3
    assert ramflow_cli("train", "--resume", split, "--no-progress", "--device", "cpu") == 0
    assert _losses(split) == _losses(fused)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--lora", "0"), "--lora must be a positive rank, got 0"),
        (("--lora", "-2"), "--lora must be a positive rank"),
        (("--lora", "4", "--lora-targets", "q_proj,wq"), "no linear module named wq"),
        (("--lora-targets", "q_proj"), "give --lora RANK too"),
        (("--lora", "4", "--lora-targets", ","), "names no module"),
        (("--fuse-lora",), "--fuse-lora fuses the LoRA layers of a LoRA run: give --lora RANK"),
    ],
)
def test_bad_lora_input_is_refused_before_the_run(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys, flags, message
) -> None:
    out = tmp_path / "run"
    rc = ramflow_cli("train", "--data", corpus_file, "--steps", "2", *flags, *fast, "--out", out)
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_frozen_format_flag(ramflow_cli, fast, capsys) -> None:
    """An unknown format is refused by the parser (a known one: tests/test_frozen_formats.py
    and ``ramflow train --lora --frozen-format``'s run in benchmarks/frozen_quality/frozen_quality.py)."""
    with pytest.raises(SystemExit) as exc:
        ramflow_cli("train", "--frozen-format", "int4", *fast)
    assert exc.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_generate_loads_a_lora_checkpoint_on_its_base(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, monkeypatch
) -> None:
    """``ramflow generate --model <LoRA run>`` loads the base the run trained on (the
    ``--model`` folder, named by an absolute path in ``adapter_config.json``, so from any
    folder; or the preset's weights from the run's seed) and puts the adapters on it: the
    logits equal PEFT's over the plain base, on the CPU in fp32, bit for bit."""
    from ramflow.train.generation import load_for_generation
    from ramflow.train.modeling import load_model

    common = ("--data", corpus_file, "--eval-every", "0", *fast)
    base_run = tmp_path / "base"
    assert ramflow_cli("train", *common, "--steps", "2", "--out", base_run) == 0
    on_model, on_preset = tmp_path / "lora-model", tmp_path / "lora-preset"
    assert (
        ramflow_cli("train", *common, *LORA, "--steps", "3", "--model", base_run, "--out", on_model)
        == 0
    )
    assert ramflow_cli("train", *common, *LORA, "--steps", "3", "--out", on_preset) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    for run, base in (
        (on_model, lambda cfg: load_model(open_checkpoint(base_run).path, config=cfg)),
        (on_preset, lambda cfg: build_model(cfg, seed=3)),
    ):
        ckpt = open_checkpoint(run).path
        model, _, _ = load_for_generation(run, device="cpu")
        ref = peft.PeftModel.from_pretrained(base(read_config(ckpt)), str(ckpt)).eval()
        with torch.no_grad():
            out, expected = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert torch.equal(out, expected), run.name
        # the adapters are trained ones (B left zero), so the base alone would differ
        with torch.no_grad(), ref.disable_adapter():
            assert not torch.equal(ref(input_ids=ids).logits, expected), run.name


def test_lora_run_counts_only_the_adapters_as_trained(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    out = tmp_path / "run"
    argv = ["--steps", "1", "--eval-every", "0", "--lora", "4", *fast, "--out", out]
    assert ramflow_cli("train", "--data", corpus_file, *argv) == 0
    text = capsys.readouterr().out
    adapters = sum(
        t.numel()
        for t in load_file(str(open_checkpoint(out).path / "adapter_model.safetensors")).values()
    )
    base = build_model(read_config(open_checkpoint(out).path), seed=0)
    num_base = sum(p.numel() for p in base.parameters())
    assert adapters < num_base / 10
    summary = next(line for line in text.splitlines() if line.endswith(" M trained"))
    assert summary.endswith(
        f"({(num_base + adapters) / 1e6:,.2f} M parameters), {adapters / 1e6:,.2f} M trained"
    )
    plan = next(line for line in text.splitlines() if line.startswith("plan: "))
    assert f"({adapters / 1e6:,.2f} M trained: LoRA rank 4, the base frozen)" in plan


def _ram_needed(first_line: str) -> str:
    """The RAM figure of a verdict that fits: ``...; RAM 1.09 GiB of 19.98 GiB available``."""
    return first_line.split("; RAM ", 1)[1].split(" of ", 1)[0]


def test_plan_sizes_a_lora_run_as_train_runs_it(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    """``plan --lora R`` counts the base frozen (no host gradients or optimizer states) and
    the adapters on the device, and its verdict is ``train --lora R``'s."""
    from ramflow.memory.estimate import (
        ADAPTER_CHECKPOINT_BYTES_PER_PARAMETER,
        ADAPTER_DEVICE_BYTES_PER_PARAMETER,
    )
    from ramflow.sizes import format_bytes
    from ramflow.train.lora import count_lora_parameters
    from ramflow.train.modeling import meta_model, model_config
    from ramflow.train.tokenizer import load_tokenizer

    shape = ("--preset", "tiny", "--device", "cpu", "--seq-len", "32", "--batch-size", "2")
    assert ramflow_cli("plan", *shape) == 0
    full = capsys.readouterr().out
    assert ramflow_cli("plan", *shape, "--lora", "4") == 0
    lora = capsys.readouterr().out
    config = model_config(preset="tiny", model_dir=None, tokenizer=load_tokenizer(None))
    adapters = count_lora_parameters(meta_model(config), rank=4, targets=None)
    assert f"({adapters / 1e6:,.2f} M trained: LoRA adapters on the device" in lora
    table = {line.split("  ")[0]: line for line in lora.splitlines()}
    assert format_bytes(adapters * ADAPTER_DEVICE_BYTES_PER_PARAMETER) in table["LoRA adapters"]
    assert table["gradients"].split()[1:] == ["-"] * 4
    assert table["optimizer states"].split()[2:] == ["-"] * 4
    assert format_bytes(adapters * ADAPTER_CHECKPOINT_BYTES_PER_PARAMETER) in table["checkpoint"]
    full_ram, lora_ram = (_ram_needed(t.splitlines()[0]) for t in (full, lora))
    assert float(lora_ram.split()[0]) < float(full_ram.split()[0]), (lora_ram, full_ram)

    out = tmp_path / "run"
    argv = ("--steps", "1", "--eval-every", "0", "--lora", "4", *fast, "--out", out)
    assert ramflow_cli("train", "--data", corpus_file, *argv) == 0
    assert _ram_needed(capsys.readouterr().out.splitlines()[0]) == lora_ram


def test_plan_sizes_compressed_frozen_weights(ramflow_cli, capsys) -> None:
    """``--frozen-format int8 | nf4 | mxfp4`` keeps the frozen base in fewer host bytes
    (int8 about one byte a weight, nf4 and mxfp4 about half of it); on the device the
    window and the residents are the same, and the fixed part grows by the staging buffers
    that the compressed bytes land in (two units' worth, as the engine's plan has them)."""
    shape = ("plan", "--preset", "tiny", "--device", "cuda", "--gpu-memory", "1GiB", "--lora", "4")
    pinned, device, fixed = {}, {}, {}
    for fmt in (None, "int8", "nf4", "mxfp4"):
        assert ramflow_cli(*shape, *(("--frozen-format", fmt) if fmt else ())) == 0
        lines = capsys.readouterr().out.splitlines()
        total = next(line for line in lines if line.startswith("total"))
        cells = total.split()[1:]  # GPU, CPU pinned, CPU pageable, disk: "1.00 MiB" each
        pinned[fmt] = float(cells[2])
        assert cells[3] == "MiB"
        # "window W + gradients G + fixed F + resident R = ...", each "1.00 MiB"
        share = next(line for line in lines if line.startswith("ramflow on the device"))
        words = share.split("=")[0].split()
        device[fmt] = [
            words[words.index(k) + 1 : words.index(k) + 3] for k in ("window", "resident")
        ]
        fixed[fmt] = words[words.index("fixed") + 1 : words.index("fixed") + 3]
    assert device["int8"] == device["nf4"] == device["mxfp4"] == device[None]
    assert all(fixed[fmt] != fixed[None] for fmt in ("int8", "nf4", "mxfp4"))
    assert pinned["nf4"] < pinned["int8"] < pinned[None]
    assert pinned["mxfp4"] < pinned["int8"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("frozen_format", [None, "int8"])
def test_a_lora_run_stays_within_the_plan_it_was_checked_against(
    tmp_path: Path, corpus_file: Path, ramflow_cli, frozen_format: str | None
) -> None:
    """On the GPU, a LoRA run's peak device memory stays within the plan's device total
    (adapters included), with the budget set to that total: the plan is a promise."""
    from ramflow.train import plan_run

    fmt = {} if frozen_format is None else {"frozen_format": frozen_format}
    shape = dict(preset="tiny", device="cuda", seq_len=256, batch_size=4, lora_rank=4, **fmt)
    est = plan_run(TrainConfig.from_options(gpu_memory="4GiB", **shape))
    budget = f"{est.device_total_bytes * 1.05 / 2**20:.2f}MiB"
    out = tmp_path / "run"
    argv = [
        "train", "--data", corpus_file, "--preset", "tiny", "--device", "cuda", "--seq-len",
        "256", "--batch-size", "4", "--lora", "4", "--steps", "3", "--eval-every", "0",
        "--no-progress", "--gpu-memory", budget, "--out", out,
    ]  # fmt: skip
    if frozen_format is not None:
        argv += ["--frozen-format", frozen_format]
    assert ramflow_cli(*argv) == 0
    peaks = [r["peak_gpu_bytes"] for r in read_log(out / "log.jsonl") if r["event"] == "step"]
    assert max(peaks) <= est.device_total_bytes * 1.05, (max(peaks), est.device_total_bytes)
