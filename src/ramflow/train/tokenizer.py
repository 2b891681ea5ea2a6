"""Tokenizers: a byte-level one that needs no download, and a wrapper of a local Hugging Face one.

Both turn text into lists of token ids (ints) and back, and know their special ids. A
checkpoint folder carries its tokenizer: the usual Hugging Face files (``tokenizer.json``,
``tokenizer_config.json``), so that ``AutoTokenizer.from_pretrained`` loads it, plus
``ramflow_tokenizer.json`` for the byte tokenizer (``load_tokenizer`` reads either).

[Note: the byte tokenizer in the tokenizers library's format]
The byte tokenizer is written as a ``tokenizers`` BPE model without merges whose vocabulary
is the 256 byte symbols of GPT-2's byte-level scheme (Radford et al. 2019; every byte is
mapped to a printable character), symbol of byte b -> id b, behind a ``ByteLevel``
pre-tokenizer that neither splits nor adds a prefix space, with ``<bos>``, ``<eos>`` and
``<pad>`` as special tokens 256-258 and no post-processor. ``split_special_tokens`` makes
``transformers`` read a literal ``"<bos>"`` in a text as its five bytes, as ramflow does.
So ``AutoTokenizer`` encodes any text to exactly its UTF-8 bytes, adds no special tokens,
and its ``ByteLevel`` decoder (``skip_special_tokens=True``) replaces invalid UTF-8 with
U+FFFD as ``ByteTokenizer.decode`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

BYTE_TOKENIZER_FILE = "ramflow_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _byte_symbols() -> list[str]:
    """GPT-2's printable character for each byte 0-255: printable Latin-1 bytes stand for
    themselves, the others for 256, 257, ... in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


class Tokenizer(Protocol):
    """What training and generation need from a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...

    def save(self, directory: str | os.PathLike) -> None:
        """Write the files that ``load_tokenizer(directory)`` reads back."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then ``<bos>`` 256, ``<eos>`` 257, ``<pad>`` 258.

    Every text is representable, nothing is downloaded, and the vocabulary (259) is small
    enough for the ``tiny`` preset. Decoding replaces invalid UTF-8 (a cut multi-byte
    character) with U+FFFD.
    """

    name = "byte"
    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``ramflow_tokenizer.json`` and the same tokenizer in the Hugging Face
        format: see [Note: the byte tokenizer in the tokenizers library's format]."""
        from tokenizers import Tokenizer as FastTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        fast = FastTokenizer(
            models.BPE(vocab={s: b for b, s in enumerate(_byte_symbols())}, merges=[])
        )
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        fast.decoder = decoders.ByteLevel()
        specials = ["<bos>", "<eos>", "<pad>"]
        fast.add_special_tokens(specials)
        assert [fast.token_to_id(t) for t in specials] == [self.bos_id, self.eos_id, self.pad_id]
        fast.save(str(Path(directory, HF_TOKENIZER_FILE)))
        hf_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": True,
        }
        Path(directory, HF_TOKENIZER_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        spec = {
            "type": "byte",
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
        }
        Path(directory, BYTE_TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")


class HFTokenizer:
    """A Hugging Face tokenizer read from a local folder (never downloaded).

    Args:
        path: a folder with ``tokenizer.json`` / ``tokenizer_config.json`` (what
            ``save_pretrained`` writes).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``transformers`` cannot read a tokenizer from ``path``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer folder {path} does not exist")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot read a Hugging Face tokenizer from {path}: {err}") from err
        self.name = str(path)
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id
        pad = self._tok.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)

    @property
    def hf_tokenizer(self) -> Any:
        """The ``transformers`` tokenizer read from the folder (its chat template, offsets)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False, verbose=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        # whole documents, cut into --seq-len sequences later: the model's maximum length,
        # which transformers warns about (verbose), does not apply here
        return self._tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        self._tok.save_pretrained(str(directory))


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """True if ``directory`` holds a tokenizer that ``load_tokenizer`` can read."""
    d = Path(directory)
    return (d / BYTE_TOKENIZER_FILE).is_file() or any(
        (d / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer stored at ``path``, or the byte tokenizer when ``path`` is None.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds no tokenizer that can be read, or a corrupt byte-tokenizer file.
    """
    if path is None:
        return ByteTokenizer()
    d = Path(path)
    if not d.exists():
        raise FileNotFoundError(f"tokenizer folder {d} does not exist")
    spec_file = d / BYTE_TOKENIZER_FILE
    if spec_file.is_file():
        try:
            spec = json.loads(spec_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{spec_file} is not valid JSON: {err}") from err
        if spec.get("type") != "byte" or spec.get("vocab_size") != ByteTokenizer.vocab_size:
            raise ValueError(f"{spec_file} does not describe ramflow's byte tokenizer")
        return ByteTokenizer()
    if not has_tokenizer(d):
        raise ValueError(
            f"{d} holds no tokenizer (no tokenizer.json, tokenizer_config.json or {BYTE_TOKENIZER_FILE}); "
            "give --tokenizer DIR"
        )
    return HFTokenizer(d)


__all__ = [
    "BYTE_TOKENIZER_FILE",
    "HF_TOKENIZER_CONFIG_FILE",
    "HF_TOKENIZER_FILE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "has_tokenizer",
    "load_tokenizer",
]
