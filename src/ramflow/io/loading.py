"""Loading a model built on the meta device into the host store, unit by unit.

[Note: loading without a full-precision peak]
``ramflow.offload(model, weights=...)`` takes a model whose parameters are on the meta
device (shapes only) and reads each unit's values while the host store builds that unit's
master (``HostStore.build``'s fill hook): each tensor is read from its safetensors file
straight into its view of the new master (see [Note: reading safetensors at the
machine's speed]), or written there by the weights function. So the host holds the store
plus at most a few MiB per reading thread, never a whole model in another precision first.
Everything that can fail from the files' headers alone (a missing tensor, another shape)
is checked before anything is allocated, and the model is given back as it came (on the
meta device). Buffers are small and are made before the store: persistent ones are read
from the checkpoint; non-persistent ones (a rotary embedding's ``inv_freq``) are computed
in ``__init__``, so on the meta device they hold nothing: a ``transformers`` model
recomputes them with its own ``_init_weights`` (as its ``from_pretrained`` does after a
meta-device build); another model must bring them on a real device.

[Note: reading safetensors at the machine's speed]
A safetensors file is a JSON header of each tensor's dtype, shape and byte range, then the
bytes (https://github.com/huggingface/safetensors, "Format"). ``SafetensorsReader`` reads
those ranges with ``os.preadv`` in ``default_num_threads()`` threads, in pieces of
``READ_PIECE_BYTES``: where the file's dtype is the master's (a bf16 checkpoint into bf16
masters) straight into the master's pages, which the reading threads fault in as they
write them (see [Note: filling the host store] in ``ramflow.engine.host_store``); else each
thread reads a piece into a scratch buffer of its own and the calling thread casts a wave
of pieces with one ``copy_`` (PyTorch's intra-op threads: a torch op on each reading
thread would start an OpenMP team per thread, threads times too many). Nothing is mapped,
so no page of a file counts in the process's RSS, and the page cache (or /dev/shm) feeds
the threads at memory speed. ``safe_open`` still checks every file first, and reads the
tensors of a dtype torch cannot hold in a buffer (none today) one at a time.

[Note: how fast each source fills]
Files and the seeded init fill the masters on all the process's cores, and the time goes
into the work itself (a profile of a 0.5B load shows no Python loop that counts): files
are ``preadv``'d as above; ``SeededInit`` draws a unit's chunks on ``default_num_threads()``
threads (see [Note: drawing a unit's chunks at once] in ``ramflow.train.initialization``).
A plain function ``weights(name, out)`` is called tensor after tensor on the calling
thread, so it is as fast as its own ops: a copy from a state dict (``out.copy_(t)``) or a
``fill_`` runs on PyTorch's intra-op threads, but CPU ``normal_`` and ``uniform_`` draw
on one thread from one generator (a few hundred million values a second), which cannot
be split without changing the values. A function that can work on many tensors at once
gives itself a ``write_many(items)`` (as ``SeededInit`` does). ``ramflow.offload`` never
calls a plain function from several threads: one that draws from the global generator
would then give values that depend on the threads' order. Loads that last show a tqdm
bar of the parameters filled (after ``PROGRESS_DELAY_S``; only on a terminal, only on
rank 0). Measured by ``benchmarks/load/load_rate.py``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import struct
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..formats import mxfp4
from ..formats.frozen import mxfp4_to_values

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# ``weights(name, out)`` writes the parameter (or persistent buffer) ``name`` into ``out``
WeightsFunction = Callable[[str, torch.Tensor], None]
Weights = str | os.PathLike | WeightsFunction

_SHOWN = 5  # problems named in an error message

# a load still running after this many seconds shows its progress bar
PROGRESS_DELAY_S = 3.0

# bytes one reading thread reads at a time (and, for a cast, its scratch buffer's size):
# large enough that a system call costs nothing beside the copy, small enough that 16
# threads' scratch stays a quarter of a GiB
READ_PIECE_BYTES = 16 << 20

# safetensors' dtype names ("Format" in its README) as torch dtypes, a table: one row per
# kind (floats, integers, bytes and bool, fp8)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def default_num_threads() -> int:
    """Threads one process fills host memory with (reading files, drawing a seeded init):
    its CPUs shared among the ranks of its host (``$LOCAL_WORLD_SIZE``, which torchrun
    sets; torchrun also sets ``OMP_NUM_THREADS=1``, so PyTorch's own thread count says
    nothing here)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (cpus or 1) // max(1, local_ranks))


def file_in(directory: Path, name: Any, *, listed_in: Path) -> Path:
    """``directory / name`` for a file name read from ``listed_in`` (an index or manifest),
    refused unless it is a plain name inside ``directory``: no folder part, no ``..``, not
    absolute, so that a crafted index cannot make a loader read files elsewhere.

    Raises:
        ValueError: ``name`` is not a plain file name.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or Path(name).name != name
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(
            f"{listed_in} lists {name!r}, which is not a file name inside {directory}; "
            "the folder is damaged or was not written by a trusted tool"
        )
    return directory / name


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a valid safetensors index: {err}") from err
    files = [file_in(index.parent, name, listed_in=index) for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index.parent}: the index lists weight files that are missing: {', '.join(missing)}"
        )
    return files


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: ``path`` itself if it is a ``.safetensors``
    file; the files an index lists if it is an index (``*.index.json``); for a folder,
    those of its ``model.safetensors.index.json`` if there is one, else
    ``model.safetensors``, else every ``*.safetensors`` file but optimizer states.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no safetensors weights
            (``.bin`` pickles are refused: loading them could run arbitrary code); an index
            lists files that are missing.
        ValueError: the index is not valid JSON.
    """
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _index_files(p)
        if p.suffix == ".safetensors":
            return [p]
        raise FileNotFoundError(f"{p} is neither a .safetensors file nor a safetensors index")
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist")
    if (p / WEIGHTS_INDEX_FILE).is_file():
        return _index_files(p / WEIGHTS_INDEX_FILE)
    if (p / WEIGHTS_FILE).is_file():
        return [p / WEIGHTS_FILE]
    files = sorted(f for f in p.glob("*.safetensors") if not f.name.startswith("optimizer"))
    if files:
        return files
    extra = (
        " (only pickled .bin weights, which ramflow does not load)" if any(p.glob("*.bin")) else ""
    )
    raise FileNotFoundError(f"{p} holds no safetensors weights{extra}")


def open_safetensors(path: Path) -> Any:
    """``safe_open`` on the CPU (a context manager whose pages are mapped, not read).

    Raises:
        ValueError: the file is not a readable safetensors file.
    """
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {err}"
        ) from err


def safetensors_ranges(path: Path) -> dict[str, tuple[torch.dtype | None, int, int]]:
    """Each tensor of a safetensors file (checked by ``open_safetensors`` first) as (its
    torch dtype, None where torch has none; its first byte and the byte after its last, in
    the file)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    begin = 8 + size
    return {
        key: (
            SAFETENSORS_DTYPES.get(entry["dtype"]),
            begin + entry["data_offsets"][0],
            begin + entry["data_offsets"][1],
        )
        for key, entry in header.items()
        if key != "__metadata__"
    }


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of the bytes of ``t`` (contiguous, CPU), for ``os.preadv``."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class SafetensorsReader:
    """Reads tensors of safetensors files into CPU tensors in parallel threads. See [Note:
    reading safetensors at the machine's speed].

    Args:
        num_threads: reading threads (>= 1); ``default_num_threads()`` when None.
    """

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        self._files: dict[Path, tuple[int, dict[str, tuple[torch.dtype | None, int, int]]]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._scratch: torch.Tensor | None = None  # (num_threads, READ_PIECE_BYTES) uint8

    def read(self, jobs: list[tuple[Path, str, torch.Tensor]]) -> None:
        """Write tensor ``key`` of file ``path`` into ``out`` (its shape, contiguous, CPU),
        cast to ``out``'s dtype, for each ``(path, key, out)`` of ``jobs``.

        Raises:
            ValueError: a file ends before one of its tensors.
            OSError: a read fails.
        """
        pieces: list[tuple[int, int, memoryview, Path]] = []  # (fd, offset, into, path)
        casts: list[tuple[int, int, int, torch.dtype, torch.Tensor, Path]] = []
        for path, key, out in jobs:
            fd, ranges = self._file(path)
            dtype, lo, hi = ranges[key]
            if out.numel() == 0:
                continue
            if (
                dtype is None
                or not out.is_contiguous()
                or hi - lo != out.numel() * dtype.itemsize
                or not hasattr(os, "preadv")  # not on every platform Python runs on
            ):
                self._read_whole(path, key, out)
            elif dtype == out.dtype:
                into = _bytes_of(out)
                for a in range(0, hi - lo, READ_PIECE_BYTES):
                    pieces.append((fd, lo + a, into[a : a + READ_PIECE_BYTES], path))
            else:
                flat = out.view(-1)
                per = READ_PIECE_BYTES // dtype.itemsize
                for a in range(0, flat.numel(), per):
                    part = flat[a : a + per]
                    casts.append((fd, lo + a * dtype.itemsize, part.numel(), dtype, part, path))
        if pieces:
            self._map(lambda piece: _pread_into(*piece), pieces)
        for w in range(0, len(casts), self.num_threads):
            self._cast_wave(casts[w : w + self.num_threads])

    def _cast_wave(self, wave: list[tuple[int, int, int, torch.dtype, torch.Tensor, Path]]) -> None:
        """Read up to ``num_threads`` pieces into the scratch rows in parallel, then cast
        each into its destination on this thread."""
        if self._scratch is None:
            self._scratch = torch.empty(self.num_threads, READ_PIECE_BYTES, dtype=torch.uint8)
        rows = self._scratch

        def read(i: int) -> None:
            fd, offset, n, dtype, _, path = wave[i]
            _pread_into(fd, offset, _bytes_of(rows[i])[: n * dtype.itemsize], path)

        self._map(read, range(len(wave)))
        for i, (_, _, n, dtype, part, _) in enumerate(wave):
            part.copy_(rows[i][: n * dtype.itemsize].view(dtype))

    def _map(self, fn: Callable[[Any], None], items: Any) -> None:
        if self.num_threads == 1:
            for item in items:
                fn(item)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.num_threads, thread_name_prefix="ramflow-read"
            )
        list(self._pool.map(fn, items))  # raises the first error

    def _file(self, path: Path) -> tuple[int, dict[str, tuple[torch.dtype | None, int, int]]]:
        if path not in self._files:
            ranges = safetensors_ranges(path)
            self._files[path] = (os.open(path, os.O_RDONLY), ranges)
        return self._files[path]

    @staticmethod
    def _read_whole(path: Path, key: str, out: torch.Tensor) -> None:
        """One tensor through ``safe_open`` (a dtype without a torch buffer view)."""
        with open_safetensors(path) as f:
            out.copy_(f.get_tensor(key))

    def close(self) -> None:
        """Close the files, stop the threads, free the scratch buffer."""
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._scratch = None


def _pread_into(fd: int, offset: int, into: memoryview, path: Path) -> None:
    """Fill ``into`` from byte ``offset`` of the open file ``fd`` (``path``)."""
    while into:
        n = os.preadv(fd, [into], offset)
        if n == 0:
            raise ValueError(f"{path} ends before its header says (truncated?)")
        into, offset = into[n:], offset + n


# [Note: packed MXFP4 tensors in a checkpoint]
# gpt-oss checkpoints hold each expert weight ``X`` (E, R, C) as two tensors, ``X_blocks``
# (E, C, R/32, 16) uint8 and ``X_scales`` (E, C, R/32) uint8: MXFP4 codes and E8M0 scales
# of the weight's transpose (``ramflow.formats.mxfp4``; transformers' ``Mxfp4Dequantize``
# turns them into ``X``). ``MetaLoader`` maps such a pair to the parameter ``X`` the model
# lacks in the file: under ``frozen_format="mxfp4"`` the host store keeps the pair's bytes
# as they are (``MetaLoader.packed``, ``FrozenStore.write_mxfp4``); anywhere else (a kept
# or trained parameter, another frozen format, a resident load) it is dequantized to the
# values transformers computes, bit for bit.
PACKED_SUFFIXES = ("_blocks", "_scales")


def packed_pairs(
    shapes: dict[str, tuple[int, ...]], params: Iterable[str]
) -> dict[str, tuple[str, str]]:
    """The parameters of ``params`` that a checkpoint holds only as packed MXFP4 pairs.
    See [Note: packed MXFP4 tensors in a checkpoint].

    Args:
        shapes: the checkpoint's tensors (in the model's names) and their shapes.
        params: the model's parameter names.

    Returns:
        parameter name -> (its blocks tensor's name, its scales tensor's name).
    """
    blocks, scales = PACKED_SUFFIXES
    return {
        name: (name + blocks, name + scales)
        for name in params
        if name not in shapes and name + blocks in shapes and name + scales in shapes
    }


def _transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` (without importing it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def checkpoint_key_mapper(
    model: nn.Module, keys: Iterable[str] | None = None
) -> Callable[[str], tuple[str, bool]]:
    """``key -> (model key, converted)`` for the tensor names of a checkpoint of ``model``:
    ``transformers`` renames some architectures' names on loading (GPT-NeoX's ``embed_out``
    is ``lm_head``); ``converted`` is True where several checkpoint tensors make one of the
    model's (stacked experts), whose shape the headers alone cannot check. For a model that
    is not a ``transformers`` model, names are the model's.

    Args:
        model: the model (on any device, the meta device included).
        keys: every tensor name of the checkpoint, where known. If each is one of the
            model's names, they are kept as they are without building ``transformers``'
            conversion tables (about a thousand regular expressions compiled: a second or
            more of a load). Only all of them together say so: a renaming may target a
            name that an older checkpoint uses for another tensor (``transformers``'
            ``GroupWeightRename``), so one foreign key sends every key through the tables.
    """
    if not _transformers_model(model):
        return lambda key: (key, False)
    if keys is not None and set(keys) <= set(model.state_dict(keep_vars=True)):
        return lambda key: (key, False)
    return _transformers_key_mapper(model)


def _transformers_key_mapper(model: nn.Module) -> Callable[[str], tuple[str, bool]]:
    """``checkpoint_key_mapper`` by ``transformers``' conversion tables."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers without weight conversion: names are the model's
        return lambda key: (key, False)
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)

    def mapper(key: str) -> tuple[str, bool]:
        name, pattern = rename_source_key(
            key, renamings, converters, base_model_prefix=prefix, meta_state_dict=meta_state
        )
        return name, pattern is not None

    return mapper


class MetaLoader:
    """Fills the parameters of a meta-device model from ``weights`` as the host store is
    built. See [Note: loading without a full-precision peak].

    Construction checks everything (headers only, nothing allocated); ``materialize``
    gives the parameters CPU stand-ins and the buffers their values; ``fill`` is
    ``HostStore.build``'s hook; ``close`` closes the files and stops the reading threads;
    ``restore`` puts the model back on the meta device after a failure.

    Args:
        model: every parameter on the meta device.
        weights: a safetensors file, a folder, or an index (see ``weight_files``); or a
            function ``weights(name, out)`` that writes the tensor ``name`` (as in
            ``model.named_parameters()``) into ``out`` (the tensor's view of the master, on
            the CPU). A function object may also have ``write_many(items)``, which ``fill``
            then calls once per unit with its ``(name, out)`` pairs, so that it can work
            on them in parallel (``ramflow.train.initialization.SeededInit`` does).

    Raises:
        TypeError: ``weights`` is neither a path nor a callable.
        FileNotFoundError: see ``weight_files``.
        ValueError: a file is unreadable; tensors are missing, have another shape, or need
            ``transformers``' weight conversion; a non-persistent buffer on the meta device
            that nothing can compute.
    """

    def __init__(self, model: nn.Module, weights: Weights) -> None:
        self._model = model
        self._function: WeightsFunction | None = None
        self._where: dict[str, tuple[Path, str]] = {}  # model name -> (file, checkpoint key)
        # model name -> its packed MXFP4 pair: (file, key, shape) of the blocks, the scales
        self._packed: dict[str, tuple[tuple[Path, str, tuple[int, ...]], ...]] = {}
        self._names: dict[int, list[str]] = {}  # id(tensor) -> its names, first one first
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)
        self._hf = _transformers_model(model)
        self._meta_buffers = [
            (module, name, buf)
            for module in model.modules()
            for name, buf in module._buffers.items()
            if buf is not None and buf.is_meta
        ]
        self._persistent = self._persistent_meta_buffers()  # first name -> meta buffer
        self._swapped: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._reader = SafetensorsReader()
        self._num_params = sum(
            self._model.get_parameter(n[0]).numel() for n in self._names.values()
        )
        self._progress: Any = None  # the tqdm bar, made by the first fill
        if callable(weights):
            self._function = weights
            self._source = getattr(weights, "__name__", "the weights function")
        elif isinstance(weights, (str, os.PathLike)):
            self._source = str(weights)
            self._read_headers(weight_files(weights))
        else:
            raise TypeError(
                "weights= takes a path (a .safetensors file, a folder or an index) or a "
                f"function weights(name, out), got {type(weights).__name__}"
            )
        self._check_buffers()

    # ------------------------------------------------------------------ checks (no memory)

    def _read_headers(self, files: list[Path]) -> None:
        """Map each model name to its file and key, and check names and shapes."""
        tensors: list[tuple[Path, str, tuple[int, ...]]] = []  # (file, key, shape)
        for path in files:
            with open_safetensors(path) as f:
                tensors += [(path, key, tuple(f.get_slice(key).get_shape())) for key in f.keys()]
        to_model_key = checkpoint_key_mapper(self._model, [key for _, key, _ in tensors])
        shapes: dict[str, tuple[int, ...]] = {}
        converted: list[str] = []
        for path, key, shape in tensors:
            name, was_converted = to_model_key(key)
            if was_converted:
                converted.append(key)
                continue
            if name in self._where and self._where[name][0] != path:
                raise ValueError(
                    f"{self._source}: {key!r} is in both {self._where[name][0]} and "
                    f"{path}; a folder without an index must hold each tensor once "
                    "(a stale shard beside newer ones?). Remove the extra files, or "
                    "give weights= the index or the one file to load."
                )
            self._where[name] = (path, key)
            shapes[name] = shape
        all_names = [n for names in self._names.values() for n in names]
        for name, pair in packed_pairs(shapes, all_names).items():
            self._packed[name] = tuple((*self._where.pop(k), shapes.pop(k)) for k in pair)
            made = mxfp4.checkpoint_shape(*(shape for *_, shape in self._packed[name]))
            shapes[name] = made if made is not None else tuple(s for *_, s in self._packed[name])
        if converted:
            raise ValueError(
                f"{self._source}: tensors such as {', '.join(converted[:_SHOWN])} become the "
                "model's only through transformers' weight conversion, which ramflow does not "
                "run while loading unit by unit. Load the model with from_pretrained and "
                "offload it without weights=."
            )
        problems: list[str] = []
        for names in self._names.values():
            found = [n for n in names if n in self._where or n in self._packed]
            if not found:
                problems.append(f"{names[0]}: missing")
                continue
            shape, want = shapes[found[0]], tuple(self._model.get_parameter(names[0]).shape)
            if shape != want:
                what = "MXFP4 blocks and scales" if found[0] in self._packed else "file"
                problems.append(f"{found[0]}: {what} {shape}, model {want}")
        for name, buf in self._persistent.items():
            if name in self._where:
                if shapes[name] != tuple(buf.shape):
                    problems.append(f"{name}: file {shapes[name]}, model {tuple(buf.shape)}")
            elif not self._hf:  # a transformers model initialises what its files lack
                problems.append(f"{name}: missing")
        if problems:
            more = len(problems) - _SHOWN
            raise ValueError(
                f"the weights in {self._source} do not fit the model: another model shape, "
                "or an incomplete checkpoint.\n  "
                + "\n  ".join(problems[:_SHOWN])
                + (f"\n  ... and {more} more" if more > 0 else "")
            )
        known = set(self._model.state_dict(keep_vars=True))
        unexpected = [n for n in self._where if n not in known]
        if unexpected:
            warnings.warn(
                f"{self._source}: ignored {len(unexpected)} tensors the model does not have "
                f"(e.g. {unexpected[0]})",
                stacklevel=4,
            )

    def _persistent_meta_buffers(self) -> dict[str, torch.Tensor]:
        """The meta buffers that are part of the state dict, by their first name."""
        state = self._model.state_dict(keep_vars=True)
        meta = {id(b) for _, _, b in self._meta_buffers}
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in state.items():
            if id(t) in meta and id(t) not in seen:
                seen.add(id(t))
                out[name] = t
        return out

    def _check_buffers(self) -> None:
        if self._hf:
            return
        persistent = {id(b) for b in self._persistent.values()}
        lost = [
            f"{type(module).__name__}.{name}"
            for module, name, buf in self._meta_buffers
            if id(buf) not in persistent
        ]
        if lost:
            raise ValueError(
                f"non-persistent buffers on the meta device ({', '.join(lost[:_SHOWN])}) "
                "hold values computed in __init__ that no checkpoint has; build the model "
                "with its buffers on the CPU (only the parameters on the meta device, e.g. "
                "accelerate.init_empty_weights(include_buffers=False)) or assign them before "
                "ramflow.offload"
            )

    # ------------------------------------------------------------------ loading

    def materialize(self) -> None:
        """Make the model CPU-shaped without its memory, ready for the store to fill.

        Each parameter becomes (``torch.utils.swap_tensors``: the same Python object, so
        ties and references hold) a CPU tensor of its shape and dtype over one element
        (zero strides), which ``HostStore.build`` replaces by its view of the master (a
        meta tensor cannot take CPU data by ``p.data = ...``). Every meta buffer goes to
        the CPU with its value: read from the checkpoint (or written by the weights
        function) if persistent, else recomputed by the ``transformers`` model's
        ``_init_weights`` (see the Note)."""
        for module, name, buf in self._meta_buffers:
            module._buffers[name] = torch.empty_like(buf, device="cpu")
        with torch.no_grad():
            if self._hf:
                for module in {id(m): m for m, _, _ in self._meta_buffers}.values():
                    # its parameters are still on the meta device: only buffers get values
                    self._model._init_weights(module)
            for name in self._persistent:
                if self._function is not None or name in self._where:
                    self._write(name, self._model.get_buffer(name))
        # after the buffers: ``_init_weights`` may write the parameters it meets (on meta, a no-op)
        for p in {id(p): p for p in self._model.parameters()}.values():
            stand_in = torch.empty_strided(p.shape, (0,) * p.dim(), dtype=p.dtype)
            holder = nn.Parameter(stand_in, requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, holder)
            self._swapped.append((p, holder))  # holder now holds the meta tensor

    def fill(self, params: list[nn.Parameter], views: list[torch.Tensor]) -> None:
        """``HostStore.build``'s hook: write ``params``' values into ``views`` (contiguous
        CPU views of one unit's new master, in its dtype): read from the files in parallel
        (``SafetensorsReader``), or by the weights function: all at once through its
        ``write_many`` where it has one (``SeededInit``), else one tensor after another.
        See [Note: how fast each source fills]."""
        if self._progress is None:
            self._progress = _progress_bar(self._num_params)
        if self._function is None:
            packed = [(p, view) for p, view in zip(params, views) if self._packed_of(p)]
            self._reader.read(
                [(*self._source_of(p), v) for p, v in zip(params, views) if not self._packed_of(p)]
            )
            for p, view in packed:
                blocks, scales = self.packed(p)
                mxfp4_to_values(blocks, scales, view)
        else:
            items = [(self._names[id(p)][0], view) for p, view in zip(params, views)]
            write_many = getattr(self._function, "write_many", None)
            if write_many is not None:
                write_many(items)
            else:
                for name, view in items:
                    self._function(name, view)
        self._progress.update(sum(p.numel() for p in params))

    def _packed_of(self, p: torch.Tensor) -> tuple | None:
        for name in self._names[id(p)]:
            if name in self._packed:
                return self._packed[name]
        return None

    def packed(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed MXFP4 pair that the checkpoint holds for ``p`` (blocks (..., C, R/32,
        16) and scales (..., C, R/32), uint8, read now), or None where it holds ``p``
        itself or the weights are a function. See [Note: packed MXFP4 tensors in a
        checkpoint]."""
        source = None if self._function is not None else self._packed_of(p)
        if source is None:
            return None
        out = [torch.empty(shape, dtype=torch.uint8) for *_, shape in source]
        self._reader.read([(path, key, t) for (path, key, _), t in zip(source, out)])
        return out[0], out[1]

    def _source_of(self, p: torch.Tensor) -> tuple[Path, str]:
        for name in self._names[id(p)]:
            if name in self._where:
                return self._where[name]
        raise AssertionError("checked at construction")

    def _write(self, name: str, out: torch.Tensor) -> None:
        """A persistent buffer's value (``materialize``)."""
        if self._function is not None:
            self._function(name, out)
        else:
            self._reader.read([(*self._where[name], out)])

    def close(self) -> None:
        """Close the files, stop the reading threads and the progress bar."""
        self._reader.close()
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def restore(self) -> None:
        """Give the model back as it came: its parameters and buffers on the meta device."""
        self.close()
        for p, holder in self._swapped:
            torch.utils.swap_tensors(p, holder)
        self._swapped.clear()
        for module, name, buf in self._meta_buffers:
            module._buffers[name] = buf


def _progress_bar(total: int) -> Any:
    """A tqdm bar of the parameters filled, on stderr, drawn once the load has run
    ``PROGRESS_DELAY_S`` (never where stderr is no terminal, nor on a rank but 0 of
    ``$RANK``). Under ``torch.distributed`` a rank may fill only its share of the units,
    so the bar gives the count and the rate without a total."""
    from tqdm import tqdm

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return tqdm(
        total=None if distributed and torch.distributed.get_world_size() > 1 else total,
        desc="ramflow: loading weights",
        unit="param",
        unit_scale=True,
        delay=PROGRESS_DELAY_S,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not sys.stderr.isatty() or os.environ.get("RANK", "0") != "0",
    )


def load_resident(model: nn.Module, weights: Weights) -> nn.Module:
    """The resident counterpart of ``ramflow.offload(model, weights=...)``: give a model
    built on the meta device ordinary CPU parameters, in their own dtypes, filled from
    ``weights`` in one ``MetaLoader.fill`` (buffers as ``MetaLoader.materialize`` makes
    them).
    Returns ``model``.

    Raises:
        as ``MetaLoader``; on any error the model is given back on the meta device.
    """
    params = list({id(p): p for p in model.parameters()}.values())
    if not params or not all(p.is_meta for p in params):
        raise ValueError("load_resident takes a model whose parameters are all on the meta device")
    loader = MetaLoader(model, weights)
    try:
        loader.materialize()
        with torch.no_grad():
            datas = [torch.empty(p.shape, dtype=p.dtype) for p in params]
            loader.fill(params, datas)  # all at once: the reader's or init's threads stay busy
            for p, data in zip(params, datas):
                p.data = data
    except BaseException:
        loader.restore()
        raise
    finally:
        loader.close()
    return model
