"""The byte tokenizer, and a local Hugging Face tokenizer through ``--tokenizer``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ramflow.train import open_checkpoint
from ramflow.train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    text = "caf\u00e9 \u2603 print('x')\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> Path:
    """A small BPE tokenizer trained here with ``tokenizers`` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train([str(corpus_file)], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    path = tmp_path_factory.mktemp("tok") / "bpe"
    tok.save_pretrained(str(path))
    return path


def test_train_and_generate_with_a_local_hf_tokenizer(
    tmp_path: Path, hf_tokenizer_dir: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    tok = HFTokenizer(hf_tokenizer_dir)
    assert tok.vocab_size == 400 and tok.bos_id is not None and tok.pad_id != tok.eos_id
    out = tmp_path / "run"
    assert (
        ramflow_cli(
            "train",
            "--tokenizer",
            hf_tokenizer_dir,
            "--data",
            corpus_file,
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--out",
            out,
            *fast,
        )
        == 0
    )
    ckpt = open_checkpoint(out)
    assert isinstance(
        load_tokenizer(ckpt.path), HFTokenizer
    )  # the checkpoint carries its tokenizer
    capsys.readouterr()
    assert (
        ramflow_cli(
            "generate",
            "--device",
            "cpu",
            "--model",
            out,
            "--prompt",
            "def main",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
        )
        == 0
    )
    assert "(4 new tokens)" in capsys.readouterr().out


def test_missing_tokenizer_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path / "empty")


def test_a_damaged_tokenizer_folder_is_named(tmp_path: Path) -> None:
    spec = tmp_path / "ramflow_tokenizer.json"
    spec.write_text("{")
    with pytest.raises(ValueError, match=r"ramflow_tokenizer\.json is not valid JSON: "):
        load_tokenizer(tmp_path)
    spec.write_text('{"type": "byte", "vocab_size": 50000}')
    with pytest.raises(ValueError, match=r"does not describe ramflow's byte tokenizer$"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^tokenizer folder .*absent does not exist$"):
        HFTokenizer(tmp_path / "absent")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^cannot read a Hugging Face tokenizer from .*hf: "):
        HFTokenizer(tmp_path / "hf")
