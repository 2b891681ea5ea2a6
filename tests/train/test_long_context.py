"""``ramflow train`` at long sequences on the CPU (issue 32, point 2): documents packed into
long sequences, the model's own RoPE scaling from its config, the chunked loss and the
layers' inputs offloaded, end to end. The tiny preset is given a Llama 3.1-style context
(rope scaling ``llama3``, factor 8 over 1024 original positions, 8192 positions) so that a
4096-token sequence runs in seconds on 2 cores; the llama-8b preset's own scaling is
checked on its config and meta model."""

from __future__ import annotations

import dataclasses
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from ramflow.train import open_checkpoint
from ramflow.train.modeling import meta_model
from ramflow.train.presets import PRESETS, get_preset
from ramflow.train.report import read_log

T = 4096
LONG_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.fixture
def long_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny preset with a long, llama3-scaled context."""
    long = dataclasses.replace(
        PRESETS["tiny"], max_position_embeddings=2 * T, rope_parameters=dict(LONG_ROPE)
    )
    monkeypatch.setitem(PRESETS, "tiny", long)


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 documents of 1500 characters (pieces of standard library modules), so that each
    training sequence of T tokens packs several."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(
        (stdlib / name).read_text() for name in ("argparse.py", "textwrap.py", "shlex.py")
    )
    folder = tmp_path_factory.mktemp("docs")
    for i in range(60):
        (folder / f"doc{i:02d}.txt").write_text(text[i * 1500 : (i + 1) * 1500])
    return folder


def test_train_at_a_long_sequence_with_packed_documents(
    tmp_path: Path, documents: Path, long_tiny: None, ramflow_cli
) -> None:
    files = list(documents.iterdir())
    mean_bytes = sum(f.stat().st_size for f in files) / len(files)
    assert mean_bytes < T / 2  # several documents per sequence: packed
    out = tmp_path / "run"
    rc = ramflow_cli(
        "train", "--preset", "tiny", "--data", documents, "--seq-len", str(T),
        "--batch-size", "1", "--steps", "1", "--eval-batches", "1", "--checkpointing",
        "offload", "--device", "cpu", "--no-progress", "--out", out,
    )  # fmt: skip
    assert rc == 0
    steps = [r for r in read_log(out / "log.jsonl") if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1]
    assert all(math.isfinite(r["loss"]) for r in steps)
    # the byte-level loss starts near ln(259) = 5.56; a model that saw shifted or
    # truncated positions would still train, so the config is checked below
    assert 4.0 < steps[0]["loss"] < 7.0
    config = json.loads((open_checkpoint(out).path / "config.json").read_text())
    assert config["max_position_embeddings"] == 2 * T
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["seq_len"] == T and info["config"]["checkpointing"] == "offload"


def test_llama_8b_preset_passes_llama_3_1_rope_scaling_to_the_model() -> None:
    """The llama-8b preset's config carries Llama 3.1's rope scaling (Meta's config.json:
    llama3, factor 8, 8192 original positions, theta 500000) and its model uses it: the
    rotary embedding's inverse frequencies are the scaled ones, not the default's."""
    config = get_preset("llama-8b").to_config()
    assert config.max_position_embeddings == 131072
    assert config.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config._attn_implementation == "sdpa"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = meta_model(config).model.rotary_emb
    assert rotary.rope_type == "llama3"
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    # low frequencies divided by the factor, high ones kept
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)
    assert torch.equal(scaled[0], plain[0])
