"""Loading a model built on the meta device into the host store, unit by unit.

[Note: loading without a full-precision peak]
``ramflow.offload(model, weights=...)`` takes a model whose parameters are on the meta
device (shapes only) and reads each unit's values while the host store builds that unit's
master (``HostStore.build``'s fill hook): a tensor is read from its safetensors file
(``safe_open``, one tensor at a time, one file open and mapped at a time), cast into its
view of the new master, and dropped. So the host holds the store plus one unit's source
tensors plus the pages of one mapped file, never a whole model in another precision first.
Everything that can fail from the files' headers alone (a missing tensor, another shape)
is checked before anything is allocated, and the model is given back as it came (on the
meta device). Buffers are small and are made before the store: persistent ones are read
from the checkpoint; non-persistent ones (a rotary embedding's ``inv_freq``) are computed
in ``__init__``, so on the meta device they hold nothing: a ``transformers`` model
recomputes them with its own ``_init_weights`` (as its ``from_pretrained`` does after a
meta-device build); another model must bring them on a real device.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# ``weights(name, out)`` writes the parameter (or persistent buffer) ``name`` into ``out``
WeightsFunction = Callable[[str, torch.Tensor], None]
Weights = str | os.PathLike | WeightsFunction

_SHOWN = 5  # problems named in an error message


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


def _transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` (without importing it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def checkpoint_key_mapper(model: nn.Module) -> Callable[[str], tuple[str, bool]]:
    """``key -> (model key, converted)`` for the tensor names of a checkpoint of ``model``:
    ``transformers`` renames some architectures' names on loading (GPT-NeoX's ``embed_out``
    is ``lm_head``); ``converted`` is True where several checkpoint tensors make one of the
    model's (stacked experts), whose shape the headers alone cannot check. For a model that
    is not a ``transformers`` model, names are the model's."""
    if not _transformers_model(model):
        return lambda key: (key, False)
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
    gives the parameters CPU stand-ins and the buffers their values; ``fill`` is ``HostStore.build``'s hook; ``close`` releases
    the open file; ``restore`` puts the model back on the meta device after a failure.

    Args:
        model: every parameter on the meta device.
        weights: a safetensors file, a folder, or an index (see ``weight_files``); or a
            function ``weights(name, out)`` that writes the tensor ``name`` (as in
            ``model.named_parameters()``) into ``out`` (the tensor's view of the master, on
            the CPU).

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
        self._open: tuple[Path, Any, ExitStack] | None = None
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
        to_model_key = checkpoint_key_mapper(self._model)
        shapes: dict[str, tuple[int, ...]] = {}
        converted: list[str] = []
        for path in files:
            with open_safetensors(path) as f:
                for key in f.keys():
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
                    shapes[name] = tuple(f.get_slice(key).get_shape())
        if converted:
            raise ValueError(
                f"{self._source}: tensors such as {', '.join(converted[:_SHOWN])} become the "
                "model's only through transformers' weight conversion, which ramflow does not "
                "run while loading unit by unit. Load the model with from_pretrained and "
                "offload it without weights=."
            )
        problems: list[str] = []
        for names in self._names.values():
            found = [n for n in names if n in self._where]
            if not found:
                problems.append(f"{names[0]}: missing")
                continue
            shape, want = shapes[found[0]], tuple(self._model.get_parameter(names[0]).shape)
            if shape != want:
                problems.append(f"{found[0]}: file {shape}, model {want}")
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
        """``HostStore.build``'s hook: write ``params``' values into ``views`` (fp32 CPU
        views of one unit's new master), reading the file open now first, one tensor at
        a time."""
        todo = list(zip(params, views))
        if self._function is None:
            current = None if self._open is None else self._open[0]
            # the open file's tensors first, then file by file: one file mapped at a time
            todo.sort(key=lambda pv: (self._source_of(pv[0])[0] != current, self._source_of(pv[0])))
        for p, view in todo:
            self._write(self._names[id(p)][0], view, p)

    def _source_of(self, p: torch.Tensor) -> tuple[Path, str]:
        for name in self._names[id(p)]:
            if name in self._where:
                return self._where[name]
        raise AssertionError("checked at construction")

    def _write(self, name: str, out: torch.Tensor, p: torch.Tensor | None = None) -> None:
        if self._function is not None:
            self._function(name, out)
            return
        path, key = self._source_of(p) if p is not None else self._where[name]
        out.copy_(self._file(path).get_tensor(key))

    def _file(self, path: Path) -> Any:
        """The open handle of ``path``, closing the one open before (one file mapped)."""
        if self._open is not None and self._open[0] == path:
            return self._open[1]
        self.close()
        stack = ExitStack()
        handle = stack.enter_context(open_safetensors(path))
        self._open = (path, handle, stack)
        return handle

    def close(self) -> None:
        """Close the open file, if any."""
        if self._open is not None:
            self._open[2].close()
            self._open = None

    def restore(self) -> None:
        """Give the model back as it came: its parameters and buffers on the meta device."""
        self.close()
        for p, holder in self._swapped:
            torch.utils.swap_tensors(p, holder)
        self._swapped.clear()
        for module, name, buf in self._meta_buffers:
            module._buffers[name] = buf


def load_resident(model: nn.Module, weights: Weights) -> nn.Module:
    """The resident counterpart of ``ramflow.offload(model, weights=...)``: give a model
    built on the meta device ordinary CPU parameters, in their own dtypes, filled from
    ``weights`` one tensor at a time (buffers as ``MetaLoader.materialize`` makes them).
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
            for p in params:
                data = torch.empty(p.shape, dtype=p.dtype)
                loader.fill([p], [data])
                p.data = data
    except BaseException:
        loader.restore()
        raise
    finally:
        loader.close()
    return model
