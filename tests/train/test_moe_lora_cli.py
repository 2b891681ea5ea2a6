"""``ramflow plan / train / generate --lora`` on mixtures of experts on the CPU (issue 47):
LoRA on the stacked experts (by default, or named by ``--lora-targets``), and a gpt-oss
folder whose experts ship as MXFP4 trained with them kept so (``--frozen-format mxfp4``).
See [Note: LoRA targets of a mixture of experts] in ``ramflow.train.lora``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from moe_models import save_gpt_oss_mxfp4_folder, save_moe_folder
from ramflow.train import open_checkpoint
from ramflow.train.report import read_log

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gpt_oss_mxfp4_folder(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _host_parameter_bytes(out: str) -> str:
    """The plan's host (pageable) bytes of the parameters, as printed."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith("parameters ")]
    return " ".join(line.split()[4:6])


def _kib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def test_plan_sizes_mxfp4_experts(gpt_oss_dir: Path, ramflow_cli, capsys) -> None:
    """The planner's host bytes of the frozen base: MXFP4 below int8 below the wire dtype
    (fp32 on the CPU)."""
    sizes = {}
    for fmt in (None, "int8", "mxfp4"):
        extra = () if fmt is None else ("--frozen-format", fmt)
        rc = ramflow_cli("plan", "--model", gpt_oss_dir, "--device", "cpu", "--seq-len", "32",
                         "--batch-size", "2", "--lora", "4", *extra)  # fmt: skip
        out, err = capsys.readouterr()
        assert rc == 0, err
        sizes[fmt] = _kib(_host_parameter_bytes(out))
    assert sizes["mxfp4"] < sizes["int8"] < sizes[None]


def test_lora_trains_mxfp4_experts_and_generates(
    gpt_oss_dir: Path, tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    """``--lora 4 --frozen-format mxfp4`` on a gpt-oss folder with packed experts: the
    default targets adapt attention and both stacked expert weights, the adapters train,
    and ``generate`` runs the checkpoint over the same base."""
    run = tmp_path / "run"
    rc = ramflow_cli("train", "--model", gpt_oss_dir, "--data", corpus_file, "--steps", "2",
                     "--lora", "4", "--lr", "1e-2", "--frozen-format", "mxfp4", *fast,
                     "--out", run)  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    ckpt = open_checkpoint(run).path
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert set(config["target_parameters"]) == {"experts.gate_up_proj", "experts.down_proj"}
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    adapters = load_file(str(ckpt / "adapter_model.safetensors"))
    experts_b = [v for k, v in adapters.items() if "experts" in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(v.abs().sum() > 0 for v in experts_b)  # they trained
    losses = [r["loss"] for r in read_log(run / "log.jsonl") if r["event"] == "step"]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)

    capsys.readouterr()
    rc = ramflow_cli("generate", "--model", run, "--prompt", "def ", "--max-new-tokens", "3",
                     "--ignore-eos", "--device", "cpu", "--frozen-format", "mxfp4")  # fmt: skip
    assert rc == 0 and "(3 new tokens)" in capsys.readouterr().out


def test_lora_targets_name_expert_parameters(
    tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    """``--lora-targets`` takes stacked expert parameters beside linear modules; a name the
    model lacks gets one line that lists what it has."""
    folder = save_moe_folder("qwen3_moe", tmp_path / "qwen3_moe")
    run = tmp_path / "run"
    rc = ramflow_cli("train", "--model", folder, "--data", corpus_file, "--steps", "1",
                     "--lora", "2", "--lora-targets", "q_proj,experts.down_proj", *fast,
                     "--out", run)  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    config = json.loads((open_checkpoint(run).path / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj"]
    assert config["target_modules"] == ["q_proj"]

    capsys.readouterr()
    rc = ramflow_cli("train", "--model", folder, "--data", corpus_file, "--steps", "1",
                     "--lora", "2", "--lora-targets", "experts.up_proj", *fast,
                     "--out", tmp_path / "bad")  # fmt: skip
    err = capsys.readouterr().err
    assert rc != 0
    assert "no linear module or stacked expert parameter named experts.up_proj" in err
    assert "experts.gate_up_proj" in err


def test_full_fine_tune_of_packed_experts(
    gpt_oss_dir: Path, tmp_path: Path, corpus_file: Path, ramflow_cli, fast
) -> None:
    """Without ``--lora`` the packed experts load as transformers' dequantized values into
    trained fp32 masters: the first step's loss is the resident model's ``labels=`` loss on
    the same batch (fp32 on the CPU, to the chunked loss's rounding, relative 1e-6: see
    tests/train/test_loss.py), and the checkpoint, dense, drops the base's MXFP4
    ``quantization_config`` (plain ``from_pretrained`` then reads it as it is)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ramflow.train.data import BatchStream, build_corpus, find_documents
    from ramflow.train.modeling import load_model
    from ramflow.train.tokenizer import load_tokenizer

    run = tmp_path / "run"
    rc = ramflow_cli("train", "--model", gpt_oss_dir, "--data", corpus_file, "--steps", "1",
                     *fast, "--out", run)  # fmt: skip
    assert rc == 0
    (first,) = [r["loss"] for r in read_log(run / "log.jsonl") if r["event"] == "step"]
    corpus = build_corpus(find_documents(corpus_file), load_tokenizer(gpt_oss_dir), seq_len=32)
    ids = BatchStream(corpus.train_tokens, batch_size=2, seq_len=32, seed=0).next_batch()
    with torch.no_grad():
        want = load_model(gpt_oss_dir)(input_ids=ids, labels=ids).loss.item()
    assert first == pytest.approx(want, rel=1e-6)

    ckpt = open_checkpoint(run).path
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
