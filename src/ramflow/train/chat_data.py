"""Supervised fine-tuning data: chat conversations, rendered by the tokenizer's chat
template, with the loss on the assistant's tokens only, packed into training sequences.

Legend: T = tokens per sequence.

[Note: the assistant's tokens]
A conversation is a list of ``{"role": ..., "content": ...}`` messages (the format of
Hugging Face's chat templates, TRL's ``SFTTrainer``, axolotl's ``chat_template`` and
LLaMA-Factory's ShareGPT-style data after renaming). It is rendered to text by the
tokenizer's own ``chat_template`` (``apply_chat_template``), so the fine-tuned model sees
exactly the markup it will be prompted with. Its labels are the token ids where the
assistant speaks (its reply and the end-of-turn markup the template closes it with, so that
the model learns to stop), and -100 elsewhere (system, user and tool turns, the template's
headers), which ``torch.nn.functional.cross_entropy`` ignores.

Where the assistant speaks is found in one of two ways:
1. a template that marks the assistant's text with ``{% generation %}`` ...
   ``{% endgeneration %}`` gives the mask itself (``return_assistant_tokens_mask``);
2. otherwise by rendering prefixes: the text of the conversation up to message i with the
   generation prompt (``add_generation_prompt=True``) ends where assistant message i
   starts, and the text up to and with message i ends where it ends; both must be
   prefixes of the whole conversation's text, else the template rewrites earlier turns
   (Qwen3's drops the reasoning of earlier replies) and the conversation is refused with
   what to do. The character spans are mapped to tokens by the fast tokenizer's offsets,
   so a token merged across a span's edge is not misplaced as it would be by tokenizing
   the prefixes separately. A token belongs to the assistant when its first character does.

[Note: packing conversations]
Conversations are packed whole, in a shuffled order, into sequences of T tokens (greedy,
as torchtune's ``PackedDataset``): the next one that does not fit starts a new sequence,
and the rest of a sequence is padding whose labels are -100. A conversation longer than T
is cut to T (counted in the corpus's description); one whose cut leaves no assistant token
is dropped. The tokens of one sequence attend to the earlier conversations packed with it
(no block-diagonal mask; the position ids run on), as in TRL's packing without
``padding_free``: the loss mask is kept exactly, the context is not. The held-out
conversations are packed the same way, into their own sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .data import Corpus
from .tokenizer import HFTokenizer, Tokenizer

IGNORE_INDEX = -100  # cross_entropy's ignore_index: no loss at this position
ROLES = frozenset({"system", "user", "assistant", "tool"})
_SPLIT_SEED = 1234  # as data.py's: the held-out conversations do not depend on --seed
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# what datasets' save_to_disk writes: a Dataset's two files, or a DatasetDict's one
_DATASET_FILES = ("dataset_info.json", "state.json")
_DATASET_DICT_FILE = "dataset_dict.json"


@dataclass(frozen=True)
class Conversation:
    """One training example.

    Attributes:
        name: where it came from (``path:line``, or ``path[index]`` of a datasets folder).
        messages: its ``{"role", "content"}`` messages in order.
    """

    name: str
    messages: list[dict[str, Any]]


def is_chat_data(data: str | os.PathLike | None) -> bool:
    """Whether ``data`` is chat data: a folder written by ``datasets``' ``save_to_disk``,
    or a ``.jsonl`` file whose first record has ``messages``."""
    if data is None:
        return False
    p = Path(data)
    if p.is_dir():
        return (p / _DATASET_DICT_FILE).is_file() or all(
            (p / name).is_file() for name in _DATASET_FILES
        )
    if not (p.is_file() and p.suffix.lower() in (".jsonl", ".ndjson")):
        return False
    with p.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and "messages" in record
    return False


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where}: message {k} must be an object with a string 'content' "
                '(e.g. {"role": "user", "content": "..."})'
            )
        if m.get("role") not in ROLES:
            raise ValueError(
                f"{where}: message {k} has role {m.get('role')!r}; use one of "
                f"{', '.join(sorted(ROLES))}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to learn from it")
    return messages


def read_conversations(data: str | os.PathLike) -> list[Conversation]:
    """The conversations of a JSON-lines file (one ``{"messages": [...]}`` per line) or of a
    ``datasets`` folder (``datasets.load_from_disk``; a ``DatasetDict``'s ``train`` split,
    or its only one) with a ``messages`` column.

    Raises:
        FileNotFoundError: ``data`` does not exist.
        ValueError: a malformed line or message (the message names it), no ``messages``
            column, or no conversation at all.
    """
    p = Path(data)
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: no such file or folder")
    conversations = []
    if p.is_dir():
        try:
            import datasets
        except ModuleNotFoundError:
            raise ValueError(
                f"--data {p} is a datasets folder: reading it needs the datasets package "
                "(pip install datasets), or give the conversations as JSON lines"
            ) from None
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
            if split is None:
                raise ValueError(
                    f"--data {p}: a dataset of splits {', '.join(ds)} without 'train'; save "
                    "the split to train on"
                )
            ds = ds[split]
        if "messages" not in ds.column_names:
            raise ValueError(
                f"--data {p}: the dataset has no 'messages' column (it has "
                f"{', '.join(ds.column_names)}); rename the conversations' column to 'messages'"
            )
        for i, messages in enumerate(ds["messages"]):
            where = f"{p}[{i}]"
            conversations.append(Conversation(where, _check_messages(messages, where)))
    else:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise ValueError(f'{where}: expected {{"messages": [...]}}')
                conversations.append(
                    Conversation(where, _check_messages(record["messages"], where))
                )
    if not conversations:
        raise ValueError(f"--data {p}: no conversations found")
    return conversations


def _chat_tokenizer(tokenizer: Tokenizer) -> Any:
    """The ``transformers`` tokenizer behind ``tokenizer``, checked for a chat template."""
    hf = tokenizer.hf_tokenizer if isinstance(tokenizer, HFTokenizer) else None
    if hf is None or not getattr(hf, "chat_template", None):
        raise ValueError(
            f"--data holds chat conversations, but the {tokenizer.name} tokenizer has no chat "
            "template; give --tokenizer (or --model) a Hugging Face tokenizer with a "
            "chat_template"
        )
    if not hf.is_fast:
        raise ValueError(
            f"the {tokenizer.name} tokenizer is a slow (Python) one; chat data needs a fast "
            "tokenizer (a folder with tokenizer.json) for its character offsets"
        )
    return hf


def render_conversation(hf: Any, conversation: Conversation) -> tuple[list[int], list[int]]:
    """The token ids of ``conversation`` as the chat template renders it, and its labels:
    the id where the assistant speaks, ``IGNORE_INDEX`` elsewhere. See [Note: the
    assistant's tokens].

    Args:
        hf: a fast ``transformers`` tokenizer with a ``chat_template``.

    Raises:
        ValueError: the template rewrites earlier turns (no ``{% generation %}`` marks
            and the prefixes are not prefixes), so the assistant's tokens cannot be found.
    """
    messages = conversation.messages
    if _GENERATION_TAG.search(hf.chat_template):  # it marks the assistant's text itself
        out = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        mask = out["assistant_masks"]
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    text = hf.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        end = hf.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(start) and text.startswith(end) and len(start) < len(end)):
            raise ValueError(
                f"{conversation.name}: the chat template renders message {i} differently "
                "inside the whole conversation than at its end, so the assistant's tokens "
                "cannot be found; use a template that marks them with {% generation %}"
            )
        spans.append((len(start), len(end)))
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    labels = [
        t if any(a <= first < b for a, b in spans) else IGNORE_INDEX
        for t, (first, _) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    return list(enc["input_ids"]), labels


@dataclass(frozen=True)
class Packed:
    """Conversations packed into sequences. See [Note: packing conversations].

    Attributes:
        tokens: (R * T,) int32 ids, R sequences of T one after another.
        labels: (R * T,) int32 labels, ``IGNORE_INDEX`` where no loss is taken.
        num_truncated: conversations cut to T tokens.
        num_dropped: conversations left without an assistant token by the cut.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    num_truncated: int
    num_dropped: int


def pack(examples: list[tuple[list[int], list[int]]], *, seq_len: int, pad_id: int) -> Packed:
    """Pack (ids, labels) examples whole into sequences of ``seq_len`` tokens, padding each
    with ``pad_id`` (label ``IGNORE_INDEX``). See [Note: packing conversations]."""
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    ids_row: list[int] = []
    labels_row: list[int] = []
    truncated = dropped = 0

    def flush() -> None:
        if ids_row:
            pad = seq_len - len(ids_row)
            rows_ids.append(ids_row + [pad_id] * pad)
            rows_labels.append(labels_row + [IGNORE_INDEX] * pad)

    for ids, labels in examples:
        if len(ids) > seq_len:
            ids, labels = ids[:seq_len], labels[:seq_len]
            truncated += 1
        if all(t == IGNORE_INDEX for t in labels[1:]):  # the first token is never a target
            dropped += 1
            continue
        if len(ids_row) + len(ids) > seq_len:
            flush()
            ids_row, labels_row = [], []
        ids_row = ids_row + ids
        labels_row = labels_row + labels
    flush()
    return Packed(
        torch.tensor(rows_ids, dtype=torch.int32).reshape(-1),
        torch.tensor(rows_labels, dtype=torch.int32).reshape(-1),
        truncated,
        dropped,
    )


def build_chat_corpus(
    data: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    val_fraction: float = 0.01,
) -> Corpus:
    """The training and validation sequences of chat ``data``, with their labels: the
    conversations are shuffled with a fixed seed, the last ``val_fraction`` of them (at
    least one) held out, each part rendered (see [Note: the assistant's tokens]) and packed
    into sequences of ``seq_len`` (see [Note: packing conversations]).

    Args:
        data: a JSON-lines file or ``datasets`` folder (``read_conversations``).
        tokenizer: an ``HFTokenizer`` with a chat template.
        seq_len: tokens per sequence (T).
        val_fraction: share of the conversations held out, 0 < f < 1.

    Returns:
        A ``Corpus`` whose token streams are whole sequences of T and whose
        ``train_labels``/``val_labels`` carry the loss mask.

    Raises:
        ValueError: no chat template, a malformed conversation, fewer than two
            conversations, or no conversation left with an assistant token in a part.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    hf = _chat_tokenizer(tokenizer)
    conversations = read_conversations(data)
    if len(conversations) < 2:
        raise ValueError(
            f"--data {data}: {len(conversations)} conversation; training and validation "
            "need at least one each"
        )
    order = torch.randperm(
        len(conversations), generator=torch.Generator().manual_seed(_SPLIT_SEED)
    ).tolist()
    num_val = min(max(1, round(len(conversations) * val_fraction)), len(conversations) - 1)
    rendered = [render_conversation(hf, conversations[i]) for i in order]
    parts = [
        pack(rendered[: len(rendered) - num_val], seq_len=seq_len, pad_id=tokenizer.pad_id),
        pack(rendered[len(rendered) - num_val :], seq_len=seq_len, pad_id=tokenizer.pad_id),
    ]
    for part, what in zip(parts, ("training", "validation")):
        if part.tokens.numel() == 0:
            raise ValueError(
                f"--data {data}: no {what} conversation keeps an assistant token within "
                f"--seq-len {seq_len}; give a longer --seq-len"
            )
    train, val = parts
    digest = hashlib.sha256()
    for t in (train.tokens, val.tokens, train.labels, val.labels):
        digest.update(t.numpy().tobytes())
    num_rows = train.tokens.numel() // seq_len
    cut = train.num_truncated + val.num_truncated
    dropped = train.num_dropped + val.num_dropped
    source = (
        f"{data} (chat: {len(conversations):,} conversations packed into {num_rows:,} "
        f"training sequences, loss on the assistant's "
        f"{int((train.labels != IGNORE_INDEX).sum()):,} tokens"
        + (f"; {cut} cut to --seq-len {seq_len}" if cut else "")
        + (f", {dropped} of them dropped (no assistant token left)" if dropped else "")
        + ")"
    )
    return Corpus(
        train.tokens,
        val.tokens,
        len(conversations),
        source,
        digest.hexdigest(),
        train_labels=train.labels,
        val_labels=val.labels,
    )


__all__ = [
    "IGNORE_INDEX",
    "Conversation",
    "Packed",
    "build_chat_corpus",
    "is_chat_data",
    "pack",
    "read_conversations",
    "render_conversation",
]
