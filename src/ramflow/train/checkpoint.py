"""Training checkpoints that lose nothing and load nothing unsafe.

[Note: checkpoint layout]
A run folder keeps its checkpoints in ``checkpoints/step-NNNNNNNN/``:

- ``config.json`` and ``model.safetensors`` (or shards plus ``model.safetensors.index.json``):
  the fp32 master weights under Hugging Face names, so the folder is also a model that
  ``ramflow generate --model`` and ``from_pretrained`` read;
- ``optimizer.safetensors`` (or shards): every optimizer state tensor, keyed
  ``<parameter name>::<state name>``;
- ``rng.safetensors``: the torch CPU and CUDA generator states (uint8 tensors);
- the tokenizer's files;
- ``trainer_state.json``: step, data position, LR scheduler and GradScaler state, Python
  ``random`` state, the training settings, the optimizer's param groups, and a manifest
  with the size and sha256 of every other file.

A checkpoint is written into a hidden temporary folder, flushed to disk, and renamed into
place (a rename is atomic), then ``checkpoints/latest`` is replaced the same way. A crash
at any moment leaves the previous checkpoint intact. Reading checks the manifest first, so
a truncated or altered file is reported before anything is loaded; tensors are read with
safetensors and metadata with ``json``: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .modeling import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from .tokenizer import Tokenizer

FORMAT = "ramflow-train-checkpoint"
VERSION = 1
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_INDEX_FILE = "optimizer.safetensors.index.json"
RNG_FILE = "rng.safetensors"
LATEST_FILE = "latest"
_STEP_PREFIX = "step-"
_KEY_SEP = "::"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, truncated, or does not fit the run."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint folder.

    Attributes:
        path: the ``step-NNNNNNNN`` folder.
        step: optimizer steps done when it was written.
        state: the content of ``trainer_state.json``.
    """

    path: Path
    step: int
    state: dict[str, Any]

    @property
    def run_dir(self) -> Path:
        """The run folder that holds ``checkpoints/``."""
        return self.path.parent.parent


# ---------------------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    _fsync(tmp)
    os.replace(tmp, path)


def _save_sharded(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    filename: str,
    index_name: str,
    *,
    max_shard_bytes: int,
) -> None:
    """Write ``tensors`` as one safetensors file, or as shards plus an index (HF layout),
    copying at most one shard's worth of bytes at a time."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / filename), metadata={"format": "pt"})
        return
    stem = filename.removesuffix(".safetensors")
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        shard_name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shard_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / index_name).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )


def _weights_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied duplicates dropped (the first name of a shared
    tensor is kept, as ``save_pretrained`` does; loading re-ties the others)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        # state_dict() detaches, so a tied weight shows as two tensor objects on one storage
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def _optimizer_payload(
    optimizer: torch.optim.Optimizer, param_names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, state in sd["state"].items():
        name = param_names[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}{_KEY_SEP}{key}"] = value.detach().contiguous()
            else:
                scalars[f"{name}{_KEY_SEP}{key}"] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_names": list(param_names), "param_groups": groups, "scalars": scalars}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def _python_random_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def step_dir_name(step: int) -> str:
    """``step-00000300`` for step 300."""
    return f"{_STEP_PREFIX}{step:08d}"


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Finished checkpoint folders under ``checkpoints_dir``, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    return sorted(
        p for p in checkpoints_dir.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX)
    )


def save_checkpoint(
    checkpoints_dir: str | os.PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    tokenizer: Tokenizer,
    state: dict[str, Any],
    keep: int = 1,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write a checkpoint atomically. See [Note: checkpoint layout].

    Args:
        checkpoints_dir: the run's ``checkpoints`` folder (created if needed).
        step: optimizer steps done.
        model: the (offloaded) model; ``state_dict()`` waits for pending optimizer steps.
        optimizer: its state tensors are saved under ``param_names``.
        param_names: the name of each parameter, in the optimizer's order.
        tokenizer: saved beside the weights, for ``generate``.
        state: JSON-serialisable training state (step, data position, schedules, settings).
        keep: finished checkpoints to keep (older ones are deleted after this one is in place).
        max_shard_bytes: split weight and optimizer files above this size (bytes).

    Returns:
        The new checkpoint folder.
    """
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.config.save_pretrained(str(tmp))
        _save_sharded(
            _weights_to_save(model),
            tmp,
            WEIGHTS_FILE,
            WEIGHTS_INDEX_FILE,
            max_shard_bytes=max_shard_bytes,
        )
        opt_tensors, opt_meta = _optimizer_payload(optimizer, param_names)
        _save_sharded(
            opt_tensors, tmp, OPTIMIZER_FILE, OPTIMIZER_INDEX_FILE, max_shard_bytes=max_shard_bytes
        )
        from safetensors.torch import save_file

        save_file(_rng_tensors(), str(tmp / RNG_FILE))
        tokenizer.save(tmp)
        files = {}
        for f in sorted(tmp.iterdir()):
            _fsync(f)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            **state,
            "python_random": _python_random_state(),
            "optimizer": opt_meta,
            "files": files,
        }
        (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n")
        _fsync(tmp / STATE_FILE)
        _fsync(tmp)
        if final.exists():  # the same step saved again (a resumed run stopped at once)
            old = root / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (root / LATEST_FILE).parent.mkdir(exist_ok=True)
    tmp_latest = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    tmp_latest.write_text(final.name + "\n")
    _fsync(tmp_latest)
    os.replace(tmp_latest, root / LATEST_FILE)
    for old in list_checkpoints(root)[: -max(keep, 1)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- reading


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder meant by ``path``: a checkpoint folder itself, a run folder
    (its latest checkpoint), or a run's ``checkpoints`` folder.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: no checkpoint there.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--resume {p}: no such folder")
    if (p / STATE_FILE).is_file():
        return p
    for root in (p / "checkpoints", p):
        latest = root / LATEST_FILE
        if latest.is_file():
            name = latest.read_text().strip()
            if (root / name).is_dir():
                return root / name
        found = list_checkpoints(root)
        if found:
            return found[-1]
    if p.name.startswith(_STEP_PREFIX):
        raise CheckpointError(f"{p} is not a complete checkpoint: {STATE_FILE} is missing")
    raise CheckpointError(
        f"no checkpoint in {p} (looked for {STATE_FILE} and checkpoints/{LATEST_FILE})"
    )


def open_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> Checkpoint:
    """Find and verify a checkpoint (see ``find_checkpoint``) before anything is loaded.

    Args:
        path: checkpoint, run or ``checkpoints`` folder.
        verify: compare every file's size and sha256 with the manifest.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: no checkpoint; unreadable ``trainer_state.json``; another format
            or version; a file missing, truncated or altered.
    """
    d = find_checkpoint(path)
    state_file = d / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{state_file} is unreadable (truncated or corrupt): {err}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{d} is not a ramflow training checkpoint ({STATE_FILE} has another format)"
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{d} has checkpoint version {state.get('version')}; this ramflow reads {VERSION}"
        )
    if verify:
        for name, meta in state["files"].items():
            f = d / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint {d} is incomplete: {name} is missing")
            size = f.stat().st_size
            if size != meta["bytes"]:
                raise CheckpointError(
                    f"checkpoint {d} is corrupt: {name} has {size} bytes, expected {meta['bytes']} "
                    "(truncated?). Resume from an earlier checkpoint or start afresh."
                )
            if _sha256(f) != meta["sha256"]:
                raise CheckpointError(
                    f"checkpoint {d} is corrupt: the content of {name} does not match its checksum. "
                    "Resume from an earlier checkpoint or start afresh."
                )
    return Checkpoint(d, int(state["step"]), state)


def _read_tensors(d: Path, filename: str, index_name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = d / index_name
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else [filename]
    )
    out: dict[str, torch.Tensor] = {}
    for name in names:
        try:
            out.update(load_file(str(d / name)))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{d / name} is unreadable: {err}") from err
    return out


def load_optimizer_state(
    ckpt: Checkpoint, optimizer: torch.optim.Optimizer, param_names: Sequence[str]
) -> None:
    """Restore ``optimizer``'s state from ``ckpt``; parameters are matched by name.

    Raises:
        CheckpointError: the checkpoint's parameters differ from ``param_names`` (another
            model), or a state tensor has another shape than its parameter.
    """
    meta = ckpt.state["optimizer"]
    if list(meta["param_names"]) != list(param_names):
        raise CheckpointError(
            f"the optimizer state in {ckpt.path} belongs to another model: its parameters differ "
            f"({len(meta['param_names'])} saved, {len(param_names)} in this model)"
        )
    tensors = _read_tensors(ckpt.path, OPTIMIZER_FILE, OPTIMIZER_INDEX_FILE)
    index_of = {n: i for i, n in enumerate(param_names)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        name, _, field = key.rpartition(_KEY_SEP)
        i = index_of[name]
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[i].shape:
            raise CheckpointError(
                f"optimizer state {key} in {ckpt.path} has shape {tuple(value.shape)}, but the "
                f"parameter has {tuple(params[i].shape)}: the checkpoint is of another model shape"
            )
        state.setdefault(i, {})[field] = value
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def restore_rng_state(ckpt: Checkpoint) -> None:
    """Restore the torch CPU/CUDA and Python ``random`` generator states saved in ``ckpt``."""
    tensors = _read_tensors(ckpt.path, RNG_FILE, "")
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = ckpt.state["python_random"]
    random.setstate((version, tuple(internal), gauss))


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "find_checkpoint",
    "list_checkpoints",
    "load_optimizer_state",
    "open_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "step_dir_name",
]
