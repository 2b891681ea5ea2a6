"""Restoring an optimizer from a checkpoint folder (``ramflow.train.restore``): the state
lands on the parameters of the same names, and files that do not fit this model are refused
with a ``CheckpointError`` naming the file or the state. The checksums of
``open_checkpoint`` catch damage first; these are the checks behind them, here met by
folders written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ramflow.train.restore import load_optimizer_state
from ramflow.train.run_checkpoint import (
    OPTIMIZER_FILE,
    OPTIMIZER_INDEX_FILE,
    STATE_KEY_SEP,
    Checkpoint,
    CheckpointError,
)

NAMES = ["w", "b"]


def _optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor], names=NAMES) -> Checkpoint:
    save_file(tensors, str(tmp_path / OPTIMIZER_FILE))
    groups = [{**{k: v for k, v in _optimizer().param_groups[0].items() if k != "params"}}]
    groups[0]["params"] = [0, 1]
    meta = {"param_names": names, "scalars": {}, "param_groups": groups}
    return Checkpoint(tmp_path, 1, {"optimizer": meta})


def _key(name: str) -> str:
    return f"{name}{STATE_KEY_SEP}momentum_buffer"


def test_the_state_lands_on_the_parameters_of_its_names(tmp_path: Path) -> None:
    w, b = torch.arange(6.0).view(3, 2), torch.tensor([7.0, 8.0, 9.0])
    opt = _optimizer()
    load_optimizer_state(_checkpoint(tmp_path, {_key("w"): w, _key("b"): b}), opt, NAMES)
    pw, pb = opt.param_groups[0]["params"]
    assert torch.equal(opt.state[pw]["momentum_buffer"], w)
    assert torch.equal(opt.state[pb]["momentum_buffer"], b)


def test_a_state_of_another_model_is_refused(tmp_path: Path) -> None:
    w, b = torch.zeros(3, 2), torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"belongs to another model: .*\(2 saved, 3 in"):
        load_optimizer_state(_checkpoint(tmp_path, {_key("w"): w}), _optimizer(), [*NAMES, "c"])
    stray = _checkpoint(tmp_path, {_key("w"): w, _key("b"): b, _key("c"): b.clone()})
    with pytest.raises(CheckpointError, match=r"optimizer state c::momentum_buffer .*no param"):
        load_optimizer_state(stray, _optimizer(), NAMES)
    wide = _checkpoint(tmp_path, {_key("w"): torch.zeros(3, 4), _key("b"): b})
    with pytest.raises(
        CheckpointError, match=r"has shape \(3, 4\), but the parameter has \(3, 2\)"
    ):
        load_optimizer_state(wide, _optimizer(), NAMES)


def test_an_unreadable_file_or_index_is_named(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, {_key("w"): torch.zeros(3, 2)})
    (tmp_path / OPTIMIZER_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors is unreadable: "):
        load_optimizer_state(ckpt, _optimizer(), NAMES)
    index = tmp_path / OPTIMIZER_INDEX_FILE
    for text in ("{", json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}})):
        index.write_text(text)
        with pytest.raises(CheckpointError, match=r"is not a valid safetensors index: "):
            load_optimizer_state(ckpt, _optimizer(), NAMES)
