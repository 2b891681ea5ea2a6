"""Corpus discovery, the held-out split and the resumable batch order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ramflow.train.data import BatchStream, Document, build_corpus, find_documents, stdlib_root
from ramflow.train.tokenizer import ByteTokenizer


def test_default_corpus_is_the_standard_library() -> None:
    docs = find_documents(None)
    assert len(docs) > 100
    assert all(d.name.endswith(".py") and d.text for d in docs)
    assert any(d.name.endswith("argparse.py") for d in docs)
    assert all(
        d.name.startswith(str(stdlib_root())) and "site-packages" not in d.name for d in docs
    )


def test_folders_text_files_and_json_lines(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "sub" / "c.jsonl").write_text(
        json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": ""}) + "\n"
    )
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    docs = find_documents(tmp_path)
    assert [d.text for d in docs] == ["alpha", "beta", "gamma"]
    assert [d.text for d in find_documents(tmp_path / "sub" / "c.jsonl")] == ["gamma"]


def test_split_is_fixed_and_wraps_documents() -> None:
    docs = [Document(f"d{i}", f"document number {i} " * 20) for i in range(30)]
    tok = ByteTokenizer()
    a = build_corpus(docs, tok, seq_len=16, val_fraction=0.1)
    b = build_corpus(list(docs), tok, seq_len=16, val_fraction=0.1)
    assert torch.equal(a.train_tokens, b.train_tokens) and a.fingerprint == b.fingerprint
    stream = torch.cat([a.train_tokens, a.val_tokens])
    assert int((stream == tok.bos_id).sum()) == int((stream == tok.eos_id).sum()) == 30
    assert a.val_tokens.numel() == int(stream.numel() * 0.1)
    with pytest.raises(ValueError, match="too small"):
        build_corpus(docs[:1], tok, seq_len=4096)


def test_batch_stream_resumes_at_any_position_across_epochs() -> None:
    tokens = torch.arange(10 * 8, dtype=torch.int32)  # 10 sequences of 8
    whole = BatchStream(tokens, batch_size=3, seq_len=8, seed=5)
    batches = [whole.next_batch() for _ in range(9)]  # 27 sequences: almost three epochs
    resumed = BatchStream(tokens, batch_size=3, seq_len=8, seed=5, position=4 * 3)
    for expected in batches[4:]:
        assert torch.equal(resumed.next_batch(), expected)
    first_epoch = torch.cat(batches)[:10, 0] // 8
    assert sorted(first_epoch.tolist()) == list(range(10))  # every sequence once per epoch
    other_seed = BatchStream(tokens, batch_size=3, seq_len=8, seed=6)
    assert not all(torch.equal(other_seed.next_batch(), b) for b in batches[:3])


@pytest.mark.parametrize("seed", [0, 7])
def test_distributed_sampler_seeded_by_epoch_order_seed_gives_the_same_global_batches(seed):
    """A ``DistributedSampler`` seeded with ``epoch_order_seed`` draws, each step and
    epoch, the global batch ``BatchStream`` draws for the same ranks (what
    examples/llama_torchrun.py relies on to train as ``ramflow train``); only the rows'
    placement among the ranks differs. 24 sequences, 2 ranks at 3: 4 steps an epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    from ramflow.train.data import epoch_order_seed

    num_ranks, batch, seq_len = 2, 3, 8
    tokens = torch.arange(24 * seq_len, dtype=torch.int32)
    sequences = tokens.view(24, seq_len).long()
    streams = [
        BatchStream(tokens, batch_size=batch, seq_len=seq_len, seed=seed, rank=r, num_ranks=2)
        for r in range(num_ranks)
    ]
    samplers = [
        DistributedSampler(
            sequences, num_replicas=num_ranks, rank=r, seed=epoch_order_seed(seed), drop_last=True
        )
        for r in range(num_ranks)
    ]
    loaders = [DataLoader(sequences, batch_size=batch, sampler=s) for s in samplers]
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        for mine in zip(*loaders):
            want = torch.cat([s.next_batch() for s in streams])
            got = torch.cat(mine)
            assert sorted(got[:, 0].tolist()) == sorted(want[:, 0].tolist())
            assert not torch.equal(got, want)  # dealt in turn, not in blocks


def test_inputs_that_make_no_batch_are_refused(tmp_path: Path) -> None:
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "a"}\n\n{"text": \n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:3: not a JSON object \("):
        find_documents(lines)
    docs = [Document("a", "x" * 100)]
    with pytest.raises(ValueError, match=r"^val_fraction must be between 0 and 1, got 1\.0$"):
        build_corpus(docs, ByteTokenizer(), seq_len=8, val_fraction=1.0)
    with pytest.raises(ValueError, match=r"^seq_len must be at least 2, got 1$"):
        build_corpus(docs, ByteTokenizer(), seq_len=1)
    tokens = torch.arange(64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^batch_size and seq_len must be positive, got 0 and 8"):
        BatchStream(tokens, batch_size=0, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"^the training stream \(64 tokens\) is shorter than one"):
        BatchStream(tokens, batch_size=2, seq_len=65, seed=0)
