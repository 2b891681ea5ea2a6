"""Chat data (``ramflow.train.chat_data``): which files are chat data, and the one-line
refusals, naming the line or record, of conversations that cannot be trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ramflow.train.chat_data import build_chat_corpus, is_chat_data, read_conversations
from ramflow.train.tokenizer import ByteTokenizer

USER = {"role": "user", "content": "Hi."}
ASSISTANT = {"role": "assistant", "content": "Hello."}


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_only_a_first_record_with_messages_makes_chat_data(tmp_path: Path) -> None:
    chat = json.dumps({"messages": [USER, ASSISTANT]})
    assert is_chat_data(_jsonl(tmp_path, "", chat))  # blank lines before it are skipped
    assert not is_chat_data(_jsonl(tmp_path, "{not json", chat))
    assert not is_chat_data(_jsonl(tmp_path, json.dumps({"text": "plain"})))
    assert not is_chat_data(_jsonl(tmp_path, ""))
    assert not is_chat_data(tmp_path / "corpus.txt")
    assert not is_chat_data(None)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("[1, 2]", r'chat\.jsonl:2: expected \{"messages": \[\.\.\.\]\}$'),
        ("{oops", r"chat\.jsonl:2: not a JSON object \("),
        (json.dumps({"messages": []}), r"'messages' must be a non-empty list of messages$"),
        (json.dumps({"messages": [{"role": "user"}]}), r"message 0 must be an object with a"),
        (
            json.dumps({"messages": [USER, {"role": "bot", "content": "x"}]}),
            r"message 1 has role 'bot'; use one of assistant, system, tool, user$",
        ),
        (json.dumps({"messages": [USER]}), r"no assistant message, so nothing to learn from it$"),
    ],
)
def test_a_malformed_conversation_names_its_line(tmp_path: Path, record: str, message: str):
    path = _jsonl(tmp_path, json.dumps({"messages": [USER, ASSISTANT]}), record)
    with pytest.raises(ValueError, match=message) as err:
        read_conversations(path)
    assert "\n" not in str(err.value)


def test_no_conversation_at_all_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^--data .*absent\.jsonl: no such file"):
        read_conversations(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match=r"^--data .*chat\.jsonl: no conversations found$"):
        read_conversations(_jsonl(tmp_path, "", "  "))


def test_a_datasets_folder_needs_the_package(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    with pytest.raises(ValueError, match=r"is a datasets folder: reading it needs the datasets"):
        read_conversations(tmp_path)


def test_a_datasets_folder_without_a_train_split_or_messages_is_refused(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict(
        {
            "a": datasets.Dataset.from_dict({"messages": [[USER, ASSISTANT]]}),
            "b": datasets.Dataset.from_dict({"messages": [[USER, ASSISTANT]]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"a dataset of splits a, b without 'train'; save the"):
        read_conversations(tmp_path / "splits")
    datasets.DatasetDict({"only": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(tmp_path / "text")
    )
    with pytest.raises(ValueError, match=r"has no 'messages' column \(it has text\); rename"):
        read_conversations(tmp_path / "text")


def test_a_validation_share_outside_zero_to_one_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, json.dumps({"messages": [USER, ASSISTANT]}))
    for fraction in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"^val_fraction must be between 0 and 1, got"):
            build_chat_corpus(path, ByteTokenizer(), seq_len=32, val_fraction=fraction)
