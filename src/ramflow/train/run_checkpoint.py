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
  ``random`` state, the training settings, the optimizer's param groups, a manifest
  with the size and sha256 of every other file, and ``state_sha256``: the sha256 of the
  file's own content without that field, as canonical JSON (``state_checksum``), so that
  an edited step or data position is refused instead of resumed on other weights.

A run of N > 1 ranks (see [Note: several ranks from the CLI] in ``ranks.py``) writes the
weights once, from rank 0 (the ranks share one host copy of them), and each rank's
optimizer shard (the states of the units it steps) as ``optimizer-rank-RRRRR.safetensors``
(or shards plus an index) and its generator states as ``rng-rank-RRRRR.safetensors``;
``trainer_state.json`` adds ``num_ranks`` and ``optimizer_ranks`` (each rank's param
names, groups, scalar states and Python ``random`` state) and lists every rank's files in
its manifest. Such a checkpoint resumes with the same number of ranks only (ZeRO's owner of
each unit depends on it); ``check_num_ranks`` says so before anything is loaded.

[Note: atomic checkpoints]
A checkpoint is written into a hidden temporary folder (``.step-NNNNNNNN.tmp-PID``),
flushed to disk, and renamed into place (a rename is atomic); then ``checkpoints/latest``
is replaced the same way, and only then are older checkpoints deleted (each is first renamed
to a hidden ``.NAME.del-PID`` folder, so that a half-deleted folder is never mistaken for
a checkpoint). So every visible ``step-*`` folder is complete, and ``latest`` names a
complete one at every moment. Saving a step that is already on disk (a resumed run that
had nothing left to do) writes into the step's second slot ``step-NNNNNNNN.1`` (or back into
``step-NNNNNNNN`` when the second slot holds the current one), switches ``latest`` and then
deletes the other: no rename ever leaves the run without a resumable checkpoint. Hidden
temporaries of a save killed midway are removed by ``remove_stale_temporaries`` when the
next run starts in the folder (one process trains a run folder at a time). With several
ranks, rank 0 makes the temporary folder, every rank writes its shard into it and sends
rank 0 its manifest entries, and rank 0 alone writes the rest, renames and deletes; a kill
of any rank (or all) before the rename leaves only the hidden temporary folder.

Reading checks the state's checksum, that its step is the one its folder is named after,
and the manifest first, so a truncated or altered file is reported before anything is
loaded (or deleted); tensors are read with safetensors and metadata with ``json``: nothing
is unpickled. Every name read from ``latest``, the manifest or an index must be a plain
name inside its folder (no ``..``, no absolute path).

[Note: test faults]
Test-only: ``RAMFLOW_TEST_FAULT=ACTION:PHASE:N[:RANK]`` makes the N-th save phase PHASE of
this process (of rank RANK only, when given) send the process SIGKILL (ACTION ``kill``) or
SIGTERM (``term``), so that tests can stop a real process at a chosen moment of a save
without timing. The phases are ``SAVE_PHASES``, and ``step``, which the training loop
passes at the start of each optimizer step. Unset, it costs one environment lookup per
phase.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import random
import shutil
import signal
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .modeling import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, file_in
from .ranks import Ranks
from .tokenizer import Tokenizer

FORMAT = "ramflow-train-checkpoint"
VERSION = 1
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_INDEX_FILE = "optimizer.safetensors.index.json"
RNG_FILE = "rng.safetensors"
LATEST_FILE = "latest"
_STEP_PREFIX = "step-"
_STEP_DIGITS = 8
STATE_CHECKSUM_KEY = "state_sha256"
_SECOND_SLOT = ".1"
STATE_KEY_SEP = "::"
# the moments of a save a test may stop at: see [Note: test faults]
SAVE_PHASES = (
    "begin",
    "weights",
    "optimizer",
    "files",
    "state",
    "renamed",
    "latest",
    "deleting",
    "done",
)
_FAULT_ENV = "RAMFLOW_TEST_FAULT"
_fault_hits: Counter[str] = Counter()  # test-only; see [Note: test faults]


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


def state_checksum(state: dict[str, Any]) -> str:
    """The sha256 (hex) of a ``trainer_state.json`` content as canonical JSON (sorted keys,
    no spaces, ASCII), without its own ``state_sha256`` field. See [Note: checkpoint
    layout]."""
    body = {k: v for k, v in state.items() if k != STATE_CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def fault_point(phase: str) -> None:
    """Test-only: stop this process here if ``RAMFLOW_TEST_FAULT`` asks for it. See
    [Note: test faults]."""
    spec = os.environ.get(_FAULT_ENV)
    if spec is None:
        return
    fields = spec.split(":")
    action, where, nth, rank = [*fields, *("1", "")[len(fields) - 2 :]][:4]
    if where != phase or (rank and rank != os.environ.get("RANK", "0")):
        return
    _fault_hits[phase] += 1
    if _fault_hits[phase] == int(nth):
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGTERM)


def _save_sharded(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    filename: str,
    index_name: str,
    *,
    max_shard_bytes: int,
) -> list[str]:
    """Write ``tensors`` as one safetensors file, or as shards plus an index (HF layout),
    copying at most one shard's worth of bytes at a time; returns the names written."""
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
        return [filename]
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
    return [*sorted(set(weight_map.values())), index_name]


def _dense_config(config: Any, *, adapters_only: bool) -> Any:
    """The config to write beside the weights: a whole model's weights are written dense,
    so a ``quantization_config`` its base came with (gpt-oss's MXFP4 experts) would tell
    ``from_pretrained`` to unpack tensors the checkpoint does not hold; adapters keep the
    base's config as it is."""
    if adapters_only or getattr(config, "quantization_config", None) is None:
        return config
    dense = copy.deepcopy(config)
    del dense.quantization_config
    return dense


def _weights_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied duplicates dropped (the first name of a shared
    tensor is kept, as ``save_pretrained`` does; loading re-ties the others). For an
    offloaded model these are views of the fp32 masters: nothing is copied, and
    ``_save_sharded`` bounds what one file holds."""
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
                tensors[f"{name}{STATE_KEY_SEP}{key}"] = value.detach().contiguous()
            else:
                scalars[f"{name}{STATE_KEY_SEP}{key}"] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_names": list(param_names), "param_groups": groups, "scalars": scalars}


def rank_file(filename: str, rank: int) -> str:
    """The name of rank ``rank``'s own ``filename`` in a checkpoint of several ranks:
    ``optimizer.safetensors`` -> ``optimizer-rank-00001.safetensors``."""
    stem, dot, suffix = filename.partition(".")
    return f"{stem}-rank-{rank:05d}{dot}{suffix}"


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
    return f"{_STEP_PREFIX}{step:0{_STEP_DIGITS}d}"


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Finished checkpoint folders under ``checkpoints_dir``, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    return sorted(
        p for p in checkpoints_dir.iterdir() if p.is_dir() and p.name.startswith(_STEP_PREFIX)
    )


def _read_latest(root: Path) -> str | None:
    """The checkpoint folder name in ``root/latest``, None without the file.

    Raises:
        CheckpointError: the file names anything but a ``step-*`` folder beside it.
    """
    latest = root / LATEST_FILE
    if not latest.is_file():
        return None
    name = latest.read_text(errors="replace").strip()
    try:
        file_in(root, name, listed_in=latest)
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    if not name.startswith(_STEP_PREFIX):
        raise CheckpointError(
            f"{latest} names {name!r}, which is not a checkpoint folder (step-NNNNNNNN); "
            "fix or delete the file (without it the newest checkpoint is used)"
        )
    return name


def _delete(path: Path) -> None:
    """Delete a checkpoint folder: hidden first (atomic), then removed. See
    [Note: atomic checkpoints]."""
    hidden = path.with_name(f".{path.name}.del-{os.getpid()}")
    os.rename(path, hidden)
    fault_point("deleting")
    shutil.rmtree(hidden)


def _free_slot(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes: ``step-N``, or its second slot when ``step-N``
    exists (see [Note: atomic checkpoints]); never the folder ``latest`` names."""
    slots = [root / step_dir_name(step), root / (step_dir_name(step) + _SECOND_SLOT)]
    for slot in slots:
        if not slot.exists():
            return slot
    # both exist (a save killed after its rename): reuse the one latest does not name
    with_latest = _read_latest(root)
    stale = slots[1] if with_latest == slots[0].name else slots[0]
    _delete(stale)
    return stale


def _restore_aside(root: Path, name: str) -> None:
    """Rename ``root/.NAME.old-PID`` back to ``root/NAME``: an earlier ramflow saved a step
    again by renaming its folder aside first, and a kill between its two renames left the
    run's only copy there (``latest`` still names ``NAME``)."""
    for aside in sorted(root.glob(f".{name}.old-*")):
        if aside.is_dir() and (aside / STATE_FILE).is_file():
            os.rename(aside, root / name)
            return


def remove_stale_temporaries(checkpoints_dir: str | os.PathLike) -> list[str]:
    """Remove what saves killed midway left in ``checkpoints_dir``: hidden ``.*.tmp-PID``
    and ``.*.del-PID`` entries (see [Note: atomic checkpoints]). A ``.step-N.old-PID``
    folder (an earlier ramflow's same-step save, killed between its two renames) holds the only
    copy of ``step-N`` when that folder is missing: it is renamed back, else removed.

    Call it only while no other process saves into the folder.

    Returns:
        What was removed or restored, for the run's messages.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    done = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if not name.startswith("."):
            continue
        stem, sep, pid = name[1:].rpartition(".old-")
        if sep and pid.isdigit() and stem.startswith(_STEP_PREFIX) and not (root / stem).exists():
            os.rename(entry, root / stem)
            done.append(f"restored {stem} from {name}")
            continue
        if not any(f".{kind}-" in name for kind in ("tmp", "del", "old")):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        done.append(f"removed {name}")
    if done:
        _fsync(root)
    return done


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
    adapters_only: bool = False,
    ranks: Ranks | None = None,
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
        adapters_only: ``model`` is a ``peft.PeftModel`` of a LoRA run: write its adapters
            in PEFT's format (``save_pretrained``: ``adapter_config.json``,
            ``adapter_model.safetensors``) instead of the model's weights; the base is the
            run's ``--model`` or preset (see ``ramflow.train.lora``).
        ranks: the ranks of a data-parallel run; every rank calls this with its own
            optimizer (None: one process).

    Returns:
        The new checkpoint folder (on every rank).

    Raises:
        OSError: a file cannot be written (on every rank when one rank's write fails:
            ``RankSetupError`` on the others); nothing visible changes then.
    """
    ranks = ranks if ranks is not None else Ranks()
    root = Path(checkpoints_dir)

    def begin() -> tuple[Path, Path]:
        root.mkdir(parents=True, exist_ok=True)
        final = _free_slot(root, step)
        tmp = root / f".{step_dir_name(step)}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return final, tmp

    final, tmp = ranks.broadcast(ranks.together(begin if ranks.is_main else lambda: None))
    try:
        fault_point("begin")
        own = ranks.together(
            lambda: _write_rank_files(tmp, optimizer, param_names, ranks, max_shard_bytes)
        )
        shards = ranks.all_gather(own)

        def finish() -> None:
            _dense_config(model.config, adapters_only=adapters_only).save_pretrained(str(tmp))
            if adapters_only:
                model.save_pretrained(str(tmp))
            else:
                _save_sharded(
                    _weights_to_save(model),
                    tmp,
                    WEIGHTS_FILE,
                    WEIGHTS_INDEX_FILE,
                    max_shard_bytes=max_shard_bytes,
                )
            fault_point("weights")
            tokenizer.save(tmp)
            theirs = {name for files, _ in shards for name in files}
            files = {}
            for f in sorted(tmp.iterdir()):
                if f.name not in theirs:
                    _fsync(f)
                    files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for rank_files, _ in shards:
                files.update(rank_files)
            files = dict(sorted(files.items()))
            fault_point("files")
            metas = [meta for _, meta in shards]
            payload = {
                "format": FORMAT,
                "version": VERSION,
                "step": step,
                **state,
                "python_random": metas[0]["python_random"],
                "optimizer": {k: v for k, v in metas[0].items() if k != "python_random"},
                **(
                    {"num_ranks": ranks.world_size, "optimizer_ranks": metas}
                    if ranks.several
                    else {}
                ),
                "files": files,
            }
            payload[STATE_CHECKSUM_KEY] = state_checksum(payload)
            (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n")
            _fsync(tmp / STATE_FILE)
            _fsync(tmp)
            fault_point("state")
            os.rename(tmp, final)
            _fsync(root)

        # the others wait while rank 0 writes the weights: see ranks.SAVE_TIMEOUT_S
        ranks.together(finish if ranks.is_main else lambda: None, slow=True)
    except BaseException as err:
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        failed = _write_failure(err, step, root)
        if failed is not None:
            raise failed from err
        raise
    if ranks.is_main:
        fault_point("renamed")
        _publish(root, final, step, keep)
    # no rank goes on (and may save again) before the checkpoint is in place
    ranks.barrier(slow=True)
    return final


def _write_failure(err: BaseException, step: int, root: Path) -> OSError | None:
    """The one-line error of a save that could not write its files (safetensors reports a
    full disk as a ``SafetensorError``, not an ``OSError``); None for other errors. The
    temporary folder is gone by then and the last complete checkpoint is untouched."""
    from safetensors import SafetensorError

    if not isinstance(err, (OSError, SafetensorError)):
        return None
    text = str(err)
    full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left", "os error 28", "Disk quota exceeded")
    )
    try:
        latest = _read_latest(root)
    except (CheckpointError, OSError):
        latest = None
    kept = (
        f"the last complete checkpoint, {root / latest}, is kept"
        if latest is not None
        else "no complete checkpoint was written before"
    )
    if full:
        out = OSError(
            f"the disk is full: the checkpoint of step {step} could not be written into "
            f"{root} (no space left on device) and the run stopped; {kept}. Free space or "
            "move the run folder to a larger disk, then --resume it"
        )
        out.errno = errno.ENOSPC
        return out
    if isinstance(err, OSError):
        return None  # its own message names the file and the cause
    return OSError(
        f"the checkpoint of step {step} could not be written into {root} ({text}); the run "
        f"stopped; {kept}"
    )


def disk_full_error(err: OSError, checkpoints: Path) -> OSError | None:
    """The one-line error of a run stopped by a full disk (ENOSPC or a quota) outside a
    checkpoint's save (a log line, the loss plot, a tracker's file), naming the file and
    the last complete checkpoint in ``checkpoints``; None for another error, or one that
    ``_write_failure`` already worded.

    Args:
        err: the error that ended the run.
        checkpoints: the run's checkpoints folder (it may not exist).

    Returns:
        An ``OSError`` with errno ENOSPC to raise from ``err``, or None.
    """
    if err.errno not in (errno.ENOSPC, errno.EDQUOT) or str(err).startswith("the disk is full"):
        return None
    try:
        latest = _read_latest(checkpoints) if checkpoints.is_dir() else None
    except (CheckpointError, OSError):
        latest = None
    kept = (
        f"the last complete checkpoint, {checkpoints / latest}, is kept"
        if latest is not None
        else "no complete checkpoint was written before"
    )
    where = f" writing {err.filename}" if err.filename else ""
    out = OSError(
        f"the disk is full:{where} no space left on device, and the run stopped; {kept}. "
        "Free space or move the run folder to a larger disk, then --resume it"
    )
    out.errno = errno.ENOSPC
    return out


def _write_rank_files(
    tmp: Path,
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str],
    ranks: Ranks,
    max_shard_bytes: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Write this rank's optimizer states and generator states into ``tmp``; returns their
    manifest entries and the optimizer's metadata (with the Python ``random`` state)."""
    from safetensors.torch import save_file

    def name(filename: str) -> str:
        return rank_file(filename, ranks.rank) if ranks.several else filename

    opt_tensors, opt_meta = _optimizer_payload(optimizer, param_names)
    written = _save_sharded(
        opt_tensors,
        tmp,
        name(OPTIMIZER_FILE),
        name(OPTIMIZER_INDEX_FILE),
        max_shard_bytes=max_shard_bytes,
    )
    fault_point("optimizer")
    save_file(_rng_tensors(), str(tmp / name(RNG_FILE)))
    files = {}
    for filename in [*written, name(RNG_FILE)]:
        f = tmp / filename
        _fsync(f)
        files[filename] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    return files, {**opt_meta, "python_random": _python_random_state()}


def _publish(root: Path, final: Path, step: int, keep: int) -> None:
    """Point ``latest`` at ``final``, then delete the other slot of ``step`` and the
    checkpoints beyond ``keep``. See [Note: atomic checkpoints]."""
    tmp_latest = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    tmp_latest.write_text(final.name + "\n")
    _fsync(tmp_latest)
    os.replace(tmp_latest, root / LATEST_FILE)
    _fsync(root)
    fault_point("latest")
    # only now that latest names the new folder: the other slot of this step, then the oldest
    same_step = {step_dir_name(step), step_dir_name(step) + _SECOND_SLOT}
    for old in list_checkpoints(root):
        if old != final and old.name in same_step:
            _delete(old)
    for old in list_checkpoints(root)[: -max(keep, 1)]:
        if old != final:
            _delete(old)
    _fsync(root)
    fault_point("done")


# ---------------------------------------------------------------------------------- reading


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder meant by ``path``: a checkpoint folder itself, a run folder
    (its latest checkpoint), or a run's ``checkpoints`` folder. A checkpoint that an
    earlier ramflow's same-step save left renamed aside is renamed back first.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: no checkpoint there; ``latest`` names something else than a
            ``step-*`` folder beside it.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--resume {p}: no such folder")
    if (p / STATE_FILE).is_file():
        return p
    for root in (p / "checkpoints", p):
        name = _read_latest(root)
        if name is not None and not (root / name).exists():
            _restore_aside(root, name)
        if name is not None and (root / name).is_dir():
            return root / name
        found = list_checkpoints(root)
        if found:
            return found[-1]
    if p.name.startswith(_STEP_PREFIX):
        raise CheckpointError(f"{p} is not a complete checkpoint: {STATE_FILE} is missing")
    raise CheckpointError(
        f"no checkpoint in {p} (looked for {STATE_FILE} and checkpoints/{LATEST_FILE})"
    )


def run_folder_of(path: str | os.PathLike) -> Path:
    """The run folder whose checkpoint ``find_checkpoint(path)`` finds, worked out without
    reading or changing anything (to lock it first: see [Note: the run folder's lock] in
    ``run_lock.py``)."""
    p = Path(path)
    if (p / STATE_FILE).is_file() or p.name.startswith(_STEP_PREFIX):
        return p.parent.parent
    return p if (p / "checkpoints").is_dir() else p.parent


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _state_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a ``trainer_state.json`` that resuming reads, or
    None: checked before a resumed run writes anything."""
    kinds = {
        "step": _is_int,
        "data_position": _is_int,
        "tokens_seen": _is_int,
        "files": lambda v: isinstance(v, dict),
        "train_config": lambda v: isinstance(v, dict),
        "scheduler": lambda v: isinstance(v, dict) and _is_int(v.get("last_epoch")),
        "grad_scaler": lambda v: isinstance(v, dict),
        "corpus": lambda v: isinstance(v, dict) and isinstance(v.get("fingerprint"), str),
        "python_random": lambda v: isinstance(v, list) and len(v) == 3,
        "optimizer": lambda v: (
            isinstance(v, dict)
            and isinstance(v.get("param_names"), list)
            and isinstance(v.get("scalars"), dict)
            and isinstance(v.get("param_groups"), list)
            and all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in v["param_groups"]
            )
        ),
    }
    for key, ok in kinds.items():
        if key not in state:
            return f"{key} is missing"
        if not ok(state[key]):
            return f"{key} has an unexpected value {json.dumps(state[key])[:60]}"
    if state["step"] < 0 or state["data_position"] < 0:
        return "step and data_position must not be negative"
    for name, meta in state["files"].items():
        if not (isinstance(meta, dict) and _is_int(meta.get("bytes"))):
            return f"the manifest entry of {name} has no byte count"
        if not isinstance(meta.get("sha256"), str):
            return f"the manifest entry of {name} has no sha256"
    if state.get("num_ranks", 1) != 1:
        shards = state.get("optimizer_ranks")
        if not (
            _is_int(state["num_ranks"])
            and state["num_ranks"] > 1
            and isinstance(shards, list)
            and len(shards) == state["num_ranks"]
            and all(isinstance(m, dict) and kinds["optimizer"](m) for m in shards)
            and all(isinstance(m.get("python_random"), list) for m in shards)
        ):
            return "num_ranks or optimizer_ranks (each rank's optimizer shard) is malformed"
    scaler = state["grad_scaler"]
    needed = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    if scaler and not all(isinstance(scaler.get(k), (int, float)) for k in needed):
        return f"grad_scaler lacks one of {', '.join(needed)}"
    version, internal, gauss = state["python_random"]
    try:
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError) as err:
        return f"python_random is not a generator state ({err})"
    return None


def _step_of_folder(name: str) -> int | None:
    """The step a ``step-NNNNNNNN`` (or ``step-NNNNNNNN.1``) folder name gives, None for
    another name (a checkpoint copied under a name of the user's)."""
    digits = name.removeprefix(_STEP_PREFIX).removesuffix(_SECOND_SLOT)
    if not name.startswith(_STEP_PREFIX) or not digits.isdigit():
        return None
    return int(digits)


def _model_file(name: str) -> bool:
    """Whether a model loader reads the checkpoint file ``name`` (not optimizer or RNG state)."""
    return not name.startswith(("optimizer", RNG_FILE.partition(".")[0]))


def num_ranks(ckpt: Checkpoint) -> int:
    """How many ranks wrote ``ckpt`` (1 for one process)."""
    return int(ckpt.state.get("num_ranks", 1))


def check_num_ranks(ckpt: Checkpoint, world_size: int) -> None:
    """Refuse to resume ``ckpt`` with another number of ranks than wrote it: each rank's
    optimizer shard holds the states of the units ZeRO gave it, which depend on the number
    of ranks, and the data order's position assumes the same global batch.

    Raises:
        CheckpointError: the numbers differ (the message says how to resume it).
    """
    saved = num_ranks(ckpt)
    if saved == world_size:
        return
    how = (
        "one process (without torchrun or --nproc-per-node)"
        if saved == 1
        else f"{saved} ranks (ramflow train --nproc-per-node {saved}, or torchrun "
        f"--nproc-per-node {saved} -m ramflow train)"
    )
    raise CheckpointError(
        f"the checkpoint {ckpt.path} was written by {saved} rank{'s' if saved > 1 else ''}, "
        f"this run has {world_size}: resume it with {how}, or start a new run"
    )


def open_checkpoint(
    path: str | os.PathLike, *, verify: bool = True, model_only: bool = False
) -> Checkpoint:
    """Find and verify a checkpoint (see ``find_checkpoint``) before anything is loaded.

    Args:
        path: checkpoint, run or ``checkpoints`` folder.
        verify: compare every file's size and sha256 with the manifest.
        model_only: verify only what a model loader reads (config, weights, tokenizer),
            not the optimizer and RNG states (for ``generate``); a state without a
            checksum (an earlier ramflow's) is accepted then, one whose checksum differs
            is not.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: no checkpoint; ``latest`` names something outside the folder;
            unreadable or malformed ``trainer_state.json``; its checksum missing or not
            matching its content, or its step not its folder's; another format or
            version; a manifest name outside the folder; a file missing, truncated or
            altered.
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
    problem = _state_problem(state)
    if problem is not None:
        raise CheckpointError(
            f"{state_file} is malformed: {problem}. Resume from an earlier checkpoint or start afresh."
        )
    for name in state["files"]:
        try:
            file_in(d, name, listed_in=state_file)
        except ValueError as err:
            raise CheckpointError(str(err)) from err
    # a model loader reads the weights, which the manifest checks, of an earlier ramflow's
    # checkpoint too; resuming one needs its state trusted
    unsigned_ok = model_only and STATE_CHECKSUM_KEY not in state
    if not unsigned_ok and state.get(STATE_CHECKSUM_KEY) != state_checksum(state):
        why = (
            "has no state_sha256 checksum (an earlier ramflow wrote it, or it was edited)"
            if STATE_CHECKSUM_KEY not in state
            else "does not match its checksum: it was edited or damaged"
        )
        raise CheckpointError(
            f"{state_file} {why}; nothing was changed. Resume from an earlier checkpoint "
            "or start afresh (a checkpoint's step and data position are not to be edited)."
        )
    named = _step_of_folder(d.name)
    if named is not None and named != state["step"]:
        raise CheckpointError(
            f"{state_file} says step {state['step']} but its folder {d.name} is step {named}; "
            "nothing was changed. Resume from an earlier checkpoint or start afresh."
        )
    if verify:
        for name, meta in state["files"].items():
            if model_only and not _model_file(name):
                continue
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


__all__ = [
    "SAVE_PHASES",
    "Checkpoint",
    "CheckpointError",
    "check_num_ranks",
    "fault_point",
    "find_checkpoint",
    "list_checkpoints",
    "num_ranks",
    "open_checkpoint",
    "rank_file",
    "remove_stale_temporaries",
    "run_folder_of",
    "save_checkpoint",
    "state_checksum",
    "step_dir_name",
]
