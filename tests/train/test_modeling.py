"""Model folders (``ramflow.train.modeling``): the one-line refusals of folders that hold no
causal language model, and a checkpoint with tensors its model does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, T5Config  # noqa: E402

from ramflow.train.modeling import load_model, meta_model, model_config, read_config  # noqa: E402
from ramflow.train.tokenizer import ByteTokenizer  # noqa: E402


def _tiny_llama(folder: Path, *, vocab_size: int = 300) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    return model


def test_a_folder_without_a_readable_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^model folder .*absent does not exist$"):
        read_config(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json; --model needs a Hugging"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^cannot read .*config\.json: "):
        read_config(tmp_path)


def test_a_model_is_a_preset_or_a_folder_not_both(tmp_path: Path) -> None:
    for preset, folder in (("tiny", tmp_path), (None, None)):
        with pytest.raises(ValueError, match=r"^give either a preset or a model folder"):
            model_config(preset=preset, model_dir=folder, tokenizer=ByteTokenizer())


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    _tiny_llama(tmp_path, vocab_size=100)  # the byte tokenizer has more tokens
    with pytest.raises(ValueError, match=r"has only 100 embedding rows; give the model's own"):
        model_config(preset=None, model_dir=tmp_path, tokenizer=ByteTokenizer())


def test_a_config_that_is_no_causal_lm_says_so() -> None:
    with pytest.raises(ValueError, match=r"^T5Config is not a causal language model: "):
        meta_model(T5Config(num_layers=1, d_model=8, d_ff=16, num_heads=1, d_kv=8))


def test_tensors_the_model_lacks_are_ignored_with_a_warning(tmp_path: Path) -> None:
    reference = _tiny_llama(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.extra_probe.weight"] = torch.ones(3)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"ignored 1 tensors the model does not have"):
        model = load_model(tmp_path)
    assert model.training
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
