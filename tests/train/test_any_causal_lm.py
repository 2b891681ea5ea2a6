"""``ramflow train / generate / plan --model DIR`` for causal LMs of several families, each
loaded through ``transformers``' own classes (``from_pretrained``: its checkpoint names,
its tied weights) and its tokenizer through ``AutoTokenizer``. The folders are made here:
tiny configs with random weights, written by ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ramflow.train import open_checkpoint
from ramflow.train.modeling import load_model
from ramflow.train.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer, HFTokenizer, load_tokenizer

SHAPE = dict(
    vocab_size=272,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)
FAMILIES = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "gemma2": dict(num_key_value_heads=2, head_dim=16),  # tied head, soft-capped logits
    "phi3": dict(num_key_value_heads=4),  # fused qkv and gate-up projections
    "gpt_neox": dict(),  # checkpoint names the head embed_out; the model calls it lm_head
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    family = request.param
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(str(path))
    ByteTokenizer().save(path)
    (path / BYTE_TOKENIZER_FILE).unlink()  # only the Hugging Face files: AutoTokenizer reads them
    return path


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_load_model_is_from_pretrained(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ours = load_model(model_dir)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True
    )
    assert type(ours) is type(theirs)
    if theirs.config.tie_word_embeddings:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ids = torch.tensor([list(b"def main():")])
    assert torch.equal(_logits(ours, ids), _logits(theirs, ids))  # same weights, same class


def test_train_generate_plan(
    model_dir: Path, tmp_path: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("h\u00e9llo") == list("h\u00e9llo".encode())

    run = tmp_path / "run"
    rc = ramflow_cli("train", "--model", model_dir, "--data", corpus_file, "--steps", "2",
                     "--eval-every", "2", *fast, "--out", run)  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "\r" not in err  # no progress bar of transformers' loading either
    ckpt = open_checkpoint(run).path
    trained = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, local_files_only=True
    )
    start = load_model(model_dir)
    ids = torch.tensor([list(b"import os")])
    assert torch.equal(_logits(trained, ids), _logits(load_model(ckpt), ids))
    assert not torch.equal(_logits(trained, ids), _logits(start, ids))  # it trained

    capsys.readouterr()
    rc = ramflow_cli("generate", "--model", run, "--prompt", "def ", "--max-new-tokens", "4",
                     "--ignore-eos", "--device", "cpu")  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "(4 new tokens)" in out

    rc = ramflow_cli("plan", "--model", model_dir, "--device", "cpu", "--seq-len", "32",
                     "--batch-size", "2")  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "2 layers" in out
