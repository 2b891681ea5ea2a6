"""A run's checkpoint folder is a complete Hugging Face model folder: ``AutoTokenizer`` and
``AutoModelForCausalLM`` load it with ``from_pretrained`` and give ramflow's tokens and
logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ramflow.train import open_checkpoint
from ramflow.train.modeling import load_model
from ramflow.train.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = [
    "def main(argv=None):\n\treturn 0\r\n",
    "  two  spaces, a tab\tand trailing space ",
    "h\u00e9llo w\u00f6rld, \u65e5\u672c\u8a9e, \U0001f389",
    "a literal <bos> and <eos> and <pad> in the text",
    "",
]


@pytest.fixture(scope="module")
def checkpoint_dir(trained_run: Path) -> Path:
    return open_checkpoint(trained_run).path


def test_auto_tokenizer_encodes_as_the_byte_tokenizer(checkpoint_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(checkpoint_dir)
    assert isinstance(ours, ByteTokenizer)  # ramflow still reads its own
    theirs = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)
    assert len(theirs) == ours.vocab_size
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (256, 257, 258)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == text
    # special ids dropped, a cut multi-byte character replaced, as ramflow decodes
    ids = [256, *"\u00e9".encode()[:1], 65, 257]
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids) == "\ufffdA"


def test_auto_model_gives_ramflows_logits(checkpoint_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(checkpoint_dir), local_files_only=True, dtype=torch.float32
    ).eval()
    ours = load_model(checkpoint_dir).eval()
    assert type(theirs) is type(ours)
    batch = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :10].tolist() == list(TEXTS[0].encode()[:10])
    with torch.no_grad():
        expected = ours(**batch).logits
        got = theirs(**batch).logits
    # the same fp32 weights through the same class on the same CPU: bit for bit
    assert torch.equal(got, expected)
    ours_state = ours.state_dict()
    assert all(torch.equal(t, ours_state[k]) for k, t in theirs.state_dict().items())
