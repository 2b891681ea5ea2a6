"""The training text: finding documents, tokenising them, and a resumable batch order.

Legend: B = sequences per micro-batch, T = tokens per sequence.

[Note: data position]
The documents are shuffled once with a fixed seed (the same for every training seed, so
that runs share one validation set), tokenised, joined with ``<bos> ... <eos>`` around each
document, and the last ``val_fraction`` of that stream is held out. The training part is
cut into ``len // T`` sequences. Epoch ``e`` visits them in the order of
``randperm(num_sequences)`` drawn from a generator seeded with ``(seed, e)``; so the
position in the data is one integer, the number of sequences consumed, and a resumed run
that knows it sees exactly the sequences the uninterrupted run would have seen.

With several ranks the position is global: each micro-batch consumes the B x N sequences
one process with a micro-batch of B x N would take, and rank r keeps rows r*B:(r+1)*B (see
[Note: several ranks from the CLI] in ``ranks.py``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .report import SlowProgress
from .tokenizer import ByteTokenizer, Tokenizer

TEXT_SUFFIXES = frozenset(
    {
        ".txt",
        ".md",
        ".rst",
        ".py",
        ".pyi",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".html",
        ".css",
        ".tex",
        ".csv",
        ".toml",
        ".yaml",
        ".yml",
        ".cfg",
        ".ini",
        ".sh",
        ".text",
        "",
    }
)
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
_SPLIT_SEED = 1234  # fixed: the validation set does not depend on the training seed
# epoch e's order is drawn from seed * _EPOCH_SEED_STRIDE + e; part of the data order (a
# resumed run, and a DistributedSampler given epoch_order_seed, depend on it)
_EPOCH_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Document:
    """One text of the corpus.

    Attributes:
        name: where it came from (a path, or ``path:line`` for JSON lines).
        text: its content.
    """

    name: str
    text: str


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk_files(root: Path, suffixes: frozenset[str]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in ("__pycache__", "site-packages", "dist-packages")
        )
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if not f.startswith(".") and (
                p.suffix.lower() in suffixes or p.suffix.lower() in JSONL_SUFFIXES
            ):
                out.append(p)
    return out


def _read_text(path: Path, *, strict: bool) -> str:
    """The UTF-8 text of ``path``; ``strict``: refuse a file that is not UTF-8 text (a
    NUL byte or an invalid sequence), naming the byte offset, rather than replacing its
    bytes with U+FFFD, which would train on text that is not in the file."""
    data = path.read_bytes()
    if not strict:
        return data.decode("utf-8", errors="replace")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"--data {path}: byte {nul} is a NUL byte, so this is a binary file, not text; "
            "give UTF-8 text files (or move the file out of the --data folder)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--data {path} is not UTF-8 text: byte {err.start} (0x{data[err.start]:02x}) "
            f"starts no UTF-8 character; convert the file to UTF-8 (e.g. iconv -f latin1 -t "
            "utf-8) or move it out of the --data folder"
        ) from None


def _read_jsonl(path: Path, *, strict: bool) -> list[Document]:
    docs = []
    with io.StringIO(_read_text(path, strict=strict), newline=None) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object with a string field 'text'"
                )
            if record["text"]:
                docs.append(Document(f"{path}:{lineno}", record["text"]))
    return docs


def _read_file(path: Path, *, strict: bool) -> list[Document]:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _read_jsonl(path, strict=strict)
    text = _read_text(path, strict=strict)
    return [Document(str(path), text)] if text else []


def find_documents(data: str | os.PathLike | None) -> list[Document]:
    """The documents of a corpus, in a fixed order.

    Args:
        data: None for the Python standard library's ``.py`` sources of the running
            interpreter; a text file (one document); a JSON-lines file (``.jsonl``, one
            document per line's ``text`` field); or a folder, searched recursively for text
            files (by suffix: ``.txt``, ``.md``, ``.py``, ... and files without one) and
            JSON-lines files. Hidden files and folders are skipped.

    Returns:
        The non-empty documents, sorted by path.

    Raises:
        FileNotFoundError: ``data`` does not exist.
        ValueError: no text was found (the message says where it looked), a JSON line
            is malformed, or a file of ``data`` is not UTF-8 text (the message names the
            file and the byte offset: a NUL byte, or an invalid UTF-8 sequence).
    """
    if data is None:
        root = stdlib_root()
        files = _walk_files(root, frozenset({".py"}))
        where = f"the Python standard library at {root}"
    else:
        root = Path(data)
        if not root.exists():
            raise FileNotFoundError(f"--data {root}: no such file or folder")
        if root.is_dir():
            files = _walk_files(root, TEXT_SUFFIXES)
            where = f"folder {root}"
        else:
            files = [root]
            where = f"file {root}"
    docs: list[Document] = []
    for f in files:
        # the standard library holds a few files in other encodings on purpose (tests of
        # encodings): they are read with U+FFFD, as ever, so the default corpus is unchanged
        docs.extend(_read_file(f, strict=data is not None))
    if not docs:
        found = f"its {len(files)} text files are empty" if files else "it holds no text files"
        raise ValueError(
            f"no text found in {where}: {found}. Give --data a text file, a folder of text "
            "files, or JSON lines with a 'text' field."
        )
    return docs


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus split into training and validation streams.

    Attributes:
        train_tokens: (N_train,) int32 token ids, documents joined with bos/eos.
        val_tokens: (N_val,) int32 token ids, the held-out tail.
        num_documents: how many documents went in.
        source: a short description of where the text came from.
        fingerprint: sha256 of both token streams, to check a resumed run reads the same data.
        train_labels / val_labels: (N_train,) / (N_val,) int32 targets beside the tokens,
            -100 where no loss is taken (chat data: ``ramflow.train.chat_data``); None: the
            tokens themselves (plain text).
    """

    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    num_documents: int
    source: str
    fingerprint: str
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.train_tokens.numel() + self.val_tokens.numel()


_ENCODE_CHUNK_CHARS = 1 << 20  # text per encode_batch call, so that progress can show


def _token_tensor(tokenizer: Tokenizer, texts: list[str]) -> list[torch.Tensor]:
    if isinstance(tokenizer, ByteTokenizer):
        return [
            torch.frombuffer(bytearray(t.encode("utf-8")), dtype=torch.uint8).to(torch.int32)
            for t in texts
        ]
    out: list[torch.Tensor] = []
    desc = f"tokenizing {len(texts):,} documents ({tokenizer.name} tokenizer)"
    with SlowProgress(sum(len(t) for t in texts), desc=desc) as progress:
        start = 0
        while start < len(texts):
            end, size = start, 0
            while end < len(texts) and (end == start or size < _ENCODE_CHUNK_CHARS):
                size += len(texts[end])
                end += 1
            ids = tokenizer.encode_batch(texts[start:end])
            out += [torch.tensor(row, dtype=torch.int32) for row in ids]
            progress.update(size)
            start = end
    return out


def build_corpus(
    documents: list[Document],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    val_fraction: float = 0.01,
    source: str = "",
) -> Corpus:
    """Tokenise ``documents`` and hold out the validation tail. See [Note: data position].

    Args:
        documents: from ``find_documents``.
        tokenizer: turns each text into ids; bos/eos (when it has them) wrap each document.
        seq_len: tokens per training sequence (T); both splits need at least one sequence.
        val_fraction: share of the token stream held out for validation (0 < f < 1); at
            least ``seq_len`` tokens are held out.
        source: description kept for the summary.

    Raises:
        ValueError: the corpus holds fewer than two sequences of ``seq_len`` tokens, or
            ``val_fraction`` is out of range.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    texts = [documents[i].text for i in order.tolist()]
    pieces = []
    bos = (
        torch.tensor([tokenizer.bos_id], dtype=torch.int32)
        if tokenizer.bos_id is not None
        else None
    )
    eos = (
        torch.tensor([tokenizer.eos_id], dtype=torch.int32)
        if tokenizer.eos_id is not None
        else None
    )
    for ids in _token_tensor(tokenizer, texts):
        if bos is not None:
            pieces.append(bos)
        pieces.append(ids)
        if eos is not None:
            pieces.append(eos)
    stream = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int32)
    n = stream.numel()
    num_val = max(int(n * val_fraction), seq_len)
    if n - num_val < seq_len:
        raise ValueError(
            f"the corpus is too small: {n} tokens from {len(documents)} documents, but training "
            f"and validation need at least one sequence of --seq-len {seq_len} each "
            f"({2 * seq_len} tokens). Give more text or a shorter --seq-len."
        )
    train, val = stream[: n - num_val].clone(), stream[n - num_val :].clone()
    digest = hashlib.sha256()
    digest.update(train.numpy().tobytes())
    digest.update(val.numpy().tobytes())
    return Corpus(train, val, len(documents), source, digest.hexdigest())


def epoch_order_seed(seed: int) -> int:
    """The base seed of the training order of a run with ``seed``: epoch ``e`` visits the
    sequences in the order of ``torch.randperm(num_sequences)`` drawn from a
    ``torch.Generator`` seeded with ``epoch_order_seed(seed) + e`` (see [Note: data
    position]).

    That is ``torch.utils.data.DistributedSampler``'s rule for its ``seed``: a sampler
    with ``seed=epoch_order_seed(seed)`` (``shuffle=True``, ``drop_last=True``,
    ``set_epoch`` each epoch) over the same sequences gives N ranks at a batch of B, step
    after step, the global batches of B x N sequences that ``BatchStream`` (``ramflow
    train --seed seed``) gives them, within each epoch; only which rank holds which row
    differs (the sampler deals them out in turn, ``BatchStream`` in blocks), and at an
    epoch's end the sampler drops the last incomplete batch where ``BatchStream`` goes on
    into the next epoch. ``examples/llama_torchrun.py`` uses it so.
    """
    return int(seed) * _EPOCH_SEED_STRIDE


class BatchStream:
    """Training micro-batches in a fixed, resumable order. See [Note: data position].

    Args:
        tokens: (N,) int32 training stream.
        batch_size: sequences per micro-batch (B).
        seq_len: tokens per sequence (T).
        seed: seeds each epoch's order.
        position: sequences already consumed by all ranks together (to resume).
        rank: this rank, 0 to ``num_ranks - 1``.
        num_ranks: ranks that share each micro-batch of ``batch_size * num_ranks``
            sequences (see [Note: data position]).
        labels: (N,) int32 targets beside ``tokens`` (``Corpus.train_labels``), or None.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        position: int = 0,
        rank: int = 0,
        num_ranks: int = 1,
        labels: torch.Tensor | None = None,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}"
            )
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is not one of num_ranks {num_ranks}")
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_sequences = tokens.numel() // seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"the training stream ({tokens.numel()} tokens) is shorter than one sequence"
            )
        self._sequences = tokens[: self.num_sequences * seq_len].view(self.num_sequences, seq_len)
        self._labels = (
            labels[: self.num_sequences * seq_len].view(self.num_sequences, seq_len)
            if labels is not None
            else None
        )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = position
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(epoch_order_seed(self.seed) + epoch)
            self._order = torch.randperm(self.num_sequences, generator=g)
            self._epoch = epoch
        return self._order

    @property
    def epoch(self) -> float:
        """Passes over the training stream so far (fractional)."""
        return self.position / self.num_sequences

    def _next_rows(self) -> list[int]:
        rows = []
        first = self.position + self.rank * self.batch_size
        for k in range(first, first + self.batch_size):
            epoch, i = divmod(k, self.num_sequences)
            rows.append(int(self._epoch_order(epoch)[i]))
        self.position += self.batch_size * self.num_ranks
        return rows

    def next_batch(self) -> torch.Tensor:
        """This rank's part of the next micro-batch: (B, T) int64 token ids; advances
        ``position`` by B x ``num_ranks``."""
        return self._sequences[self._next_rows()].long()

    def next_labeled_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``next_batch``'s (B, T) int64 ids and their (B, T) int64 labels (-100: no
        loss), or None for labels when the stream has none (the ids are the targets)."""
        rows = self._next_rows()
        labels = self._labels[rows].long() if self._labels is not None else None
        return self._sequences[rows].long(), labels


def validation_batches(
    tokens: torch.Tensor,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int,
    rank: int = 0,
    num_ranks: int = 1,
) -> Iterator[torch.Tensor]:
    """At most ``max_batches`` (B, T) int64 batches of the held-out (N,) stream (the last
    may have fewer rows). The sequences are spread evenly over the whole stream, so that a
    few batches sample all of it rather than its first documents. With ``num_ranks``, the
    batches are those of one process at a batch of B x ``num_ranks``, and this ``rank``
    gets its rows of each (possibly none of the last)."""
    n = tokens.numel() // seq_len
    sequences = tokens[: n * seq_len].view(n, seq_len)
    step = batch_size * num_ranks
    count = min(n, max_batches * step)
    rows = (
        torch.linspace(0, n - 1, count).round().long()
        if count > 1
        else torch.zeros(count, dtype=torch.long)
    )
    for b in range(0, count, step):
        mine = rows[b : b + step][rank * batch_size : (rank + 1) * batch_size]
        if mine.numel():
            yield sequences[mine].long()


__all__ = [
    "BatchStream",
    "Corpus",
    "Document",
    "build_corpus",
    "epoch_order_seed",
    "find_documents",
    "stdlib_root",
    "validation_batches",
]
