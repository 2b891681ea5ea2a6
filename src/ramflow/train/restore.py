"""Restoring a run from a checkpoint: the optimizer's states (each rank its shard) and the
random generators' states, matched against the model they are loaded into. The layout is
``checkpoint.py``'s ([Note: checkpoint layout]).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..formats.host import saved_state_shape
from ..optim import HostOptimizer
from .modeling import file_in
from .run_checkpoint import (
    OPTIMIZER_FILE,
    OPTIMIZER_INDEX_FILE,
    RNG_FILE,
    STATE_KEY_SEP,
    Checkpoint,
    CheckpointError,
    num_ranks,
    rank_file,
)


def _read_tensors(d: Path, filename: str, index_name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = d / index_name
    if index_name and index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [file_in(d, name, listed_in=index) for name in names]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from err
    else:
        paths = [d / filename]
    out: dict[str, torch.Tensor] = {}
    for name in paths:
        try:
            out.update(load_file(str(name)))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{name} is unreadable: {err}") from err
    return out


def load_optimizer_state(
    ckpt: Checkpoint,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    *,
    rank: int = 0,
) -> None:
    """Restore ``optimizer``'s state from ``ckpt`` (rank ``rank``'s shard of a checkpoint of
    several ranks); parameters are matched by name.

    Raises:
        CheckpointError: the checkpoint's parameters differ from ``param_names`` (another
            model), or a state tensor has another shape than its parameter.
    """
    several = num_ranks(ckpt) > 1
    meta = ckpt.state["optimizer_ranks"][rank] if several else ckpt.state["optimizer"]
    if list(meta["param_names"]) != list(param_names):
        raise CheckpointError(
            f"the optimizer state in {ckpt.path} belongs to another model: its parameters differ "
            f"({len(meta['param_names'])} saved, {len(param_names)} in this model)"
        )
    tensors = _read_tensors(
        ckpt.path,
        rank_file(OPTIMIZER_FILE, rank) if several else OPTIMIZER_FILE,
        rank_file(OPTIMIZER_INDEX_FILE, rank) if several else OPTIMIZER_INDEX_FILE,
    )
    index_of = {n: i for i, n in enumerate(param_names)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        name, _, field = key.rpartition(STATE_KEY_SEP)
        if name not in index_of:
            raise CheckpointError(
                f"optimizer state {key} in {ckpt.path} belongs to no parameter of this model"
            )
        i = index_of[name]
        # per element, per block, or the optimizer's own (Adafactor's factored statistics)
        shape_of = (
            optimizer.state_shape if isinstance(optimizer, HostOptimizer) else saved_state_shape
        )
        expected = shape_of(field, params[i].shape)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != expected:
            raise CheckpointError(
                f"optimizer state {key} in {ckpt.path} has shape {tuple(value.shape)}, but the "
                f"parameter has {tuple(params[i].shape)}: the checkpoint is of another model shape"
            )
        state.setdefault(i, {})[field] = value
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def restore_rng_state(ckpt: Checkpoint, *, rank: int = 0) -> None:
    """Restore the torch CPU/CUDA and Python ``random`` generator states saved in ``ckpt``
    (by rank ``rank`` in a checkpoint of several ranks)."""
    several = num_ranks(ckpt) > 1
    tensors = _read_tensors(ckpt.path, rank_file(RNG_FILE, rank) if several else RNG_FILE, "")
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    saved = ckpt.state["optimizer_ranks"][rank] if several else ckpt.state
    version, internal, gauss = saved["python_random"]
    random.setstate((version, tuple(internal), gauss))


__all__ = ["load_optimizer_state", "restore_rng_state"]
