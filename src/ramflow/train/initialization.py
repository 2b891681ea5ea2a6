"""A seeded random initialisation that any rank can compute for any parameter on its own.

[Note: a seeded init that does not depend on who fills it]
A preset starts from random weights. ``torch.manual_seed(seed)`` followed by
``transformers``' ``from_config`` draws them from one global stream in module order, so a
value depends on every tensor drawn before it: only one process that builds the whole model
in order can reproduce it, single-threaded (an fp32 70B model is 280 GB and takes
minutes to draw). ``SeededInit`` draws every parameter from generators of its own instead:
a parameter is cut into chunks of ``CHUNK_ELEMENTS``, and chunk ``i`` of parameter
``name`` is drawn by a ``torch.Generator`` seeded with a hash of ``(seed, name, i)``. So the
value of an element depends only on the seed, the parameter's name and the element's
position: one process, or N ranks that each fill the units they own
(``ramflow.offload(..., zero_stage=..., weights=init)``), threads in any number and order,
an fp32 or a bf16 master (drawn in fp32, rounded to nearest) all start from the same
weights. The rules are those of ``transformers``' ``PreTrainedModel._init_weights``: a
normal of standard deviation ``config.initializer_range`` for linear and embedding
weights (an embedding's padding row zero), ones for norm weights, zeros for biases.
The values are those of torch's CPU ``normal_``, whose AVX2 kernel (AVX2 and AVX-512
machines) and DEFAULT kernel (no AVX2, ``ATEN_CPU_CAPABILITY=default``) differ in the last
bits: ``tests/train/test_initialization.py`` pins both.

[Note: drawing a unit's chunks at once]
``ramflow.offload`` fills a unit at a time (``MetaLoader.fill``), and a chunk is the smallest
piece of work (its generator is serial). Drawn a parameter at a time, a 5120 x 5120 weight
has 7 chunks: 7 of 32 threads drew while 25 idled, and a bf16 master's chunks were rounded
by one copy on the calling thread after each wave. ``write_many`` takes the whole unit (a
layer is about 80 chunks), and ``num_threads`` persistent threads each take the next chunk,
largest first. An fp32 output is drawn straight into its place; a bf16 one into the
thread's own fp32 scratch, then rounded into its place by the same thread right after the
draw, by ``kernels.lean_kernels.round_to_bf16_native`` (a PyTorch ``copy_`` on each thread would
start an OpenMP team per thread; without the native library, PyTorch's ``copy_`` in pieces
of its grain, which stay on the thread). So the threads also fault in the master's pages in
parallel (see [Note: filling the host store] in ``ramflow.engine.host_store``), and only a unit's
last round of chunks leaves threads idle. The values do not change: each chunk is still one
``normal_`` of its own generator, and the rounding is ``copy_``'s (nearest even). Measured
by ``benchmarks/load/seeded_init_rate.py`` and ``benchmarks/load/load_speed.py``; figures
in docs/design.md ("Loading").
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..io.loading import default_num_threads
from ..kernels import lean_kernels as _lean_kernels

# elements per generator. This is part of the values: changing it changes every preset's
# initial weights (a run resumed from a seed, a LoRA base rebuilt from its seed)
CHUNK_ELEMENTS = 1 << 22

# PyTorch's CPU grain (at::internal::GRAIN_SIZE): a copy_ of at most this many elements
# runs on the calling thread alone
_SERIAL_COPY_ELEMENTS = 32768

_NORMAL, _ONES, _ZEROS = "normal", "ones", "zeros"
_NORM_CLASSES = (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm)
_LINEAR_CLASSES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _is_norm(module: nn.Module) -> bool:
    # as transformers: its RMSNorm and LayerNorm classes are the model's own, by name
    name = type(module).__name__
    return isinstance(module, _NORM_CLASSES) or "LayerNorm" in name or "RMSNorm" in name


class SeededInit:
    """``weights(name, out)`` for ``ramflow.offload`` (and ``io.loading.load_resident``):
    writes the seeded random initial value of parameter ``name`` into ``out``. See [Note:
    a seeded init that does not depend on who fills it].

    Args:
        model: the model whose parameters will be asked for (on any device, the meta
            device included); only its module types and names are read.
        seed: the run's seed (any int; the same seed gives the same weights).
        std: standard deviation of the normal weights; None takes the model's
            ``config.initializer_range`` (0.02 without one), as ``transformers`` does.
        num_threads: threads that draw the chunks of the tensors of one call (values do
            not depend on it); None: ``default_num_threads()``. They are started on the
            first call and kept while this object lives. Outputs that are not fp32 (a
            bf16 master) are drawn into an fp32 scratch of one chunk (16 MiB) per thread,
            also kept, and rounded to nearest from it.

    Raises:
        ValueError: a parameter belongs to a module that is none of linear, embedding or
            norm layers (the rules do not say how to draw it; load that model's weights
            from a checkpoint instead), ``std`` is negative or not finite, or
            ``num_threads`` < 1.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        seed: int,
        std: float | None = None,
        num_threads: int | None = None,
    ) -> None:
        if std is None:
            std = getattr(getattr(model, "config", None), "initializer_range", None) or 0.02
        if num_threads is None:
            num_threads = default_num_threads()
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        if not (math.isfinite(float(std)) and float(std) >= 0):
            raise ValueError(f"std must be a finite number >= 0, got {std}")
        self.seed = int(seed)
        self.std = float(std)
        self.num_threads = num_threads
        # the drawing threads (num_threads > 1) and each one's fp32 scratch, made on first
        # use: see [Note: drawing a unit's chunks at once]
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._local = threading.local()
        # parameter name -> (rule, padding row or None)
        self._rules: dict[str, tuple[str, int | None]] = {}
        unknown: list[str] = []
        for prefix, module in model.named_modules(remove_duplicate=False):
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                name = f"{prefix}.{pname}" if prefix else pname
                rule = self._rule(module, pname)
                if rule is None:
                    unknown.append(f"{name} ({type(module).__name__})")
                else:
                    self._rules[name] = rule
        if unknown:
            raise ValueError(
                "the seeded init draws linear and embedding weights, norm weights and biases "
                f"(transformers' rules); it has no rule for {', '.join(unknown[:5])}"
                + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
                + ". Load this model's weights from a checkpoint folder (--model DIR)."
            )

    @staticmethod
    def _rule(module: nn.Module, pname: str) -> tuple[str, int | None] | None:
        if pname == "bias" and isinstance(module, (*_LINEAR_CLASSES, nn.Embedding)):
            return _ZEROS, None
        if isinstance(module, _LINEAR_CLASSES) and pname == "weight":
            return _NORMAL, None
        if isinstance(module, nn.Embedding) and pname == "weight":
            return _NORMAL, module.padding_idx
        if _is_norm(module) and pname in ("weight", "bias"):
            return (_ONES if pname == "weight" else _ZEROS), None
        # mixture-of-experts blocks, as transformers' MoE families initialize them (Qwen3-MoE,
        # Mixtral, gpt-oss, DeepSeek-V2/V3): the fused expert matrices normal and their
        # biases zero; the router's weight (and gpt-oss' router bias) normal; gpt-oss'
        # attention sinks normal
        kind = type(module).__name__
        if kind.endswith("Experts"):
            return (_ZEROS if pname.endswith("bias") else _NORMAL), None
        if "Router" in kind and pname in ("weight", "bias"):
            return _NORMAL, None
        if pname == "sinks":
            return _NORMAL, None
        return None

    def chunk_seed(self, name: str, index: int) -> int:
        """The generator seed of chunk ``index`` of parameter ``name`` (63 bits)."""
        digest = hashlib.blake2b(f"{self.seed}\0{name}\0{index}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 1

    def __call__(self, name: str, out: torch.Tensor) -> None:
        """Write the initial value of parameter ``name`` into ``out`` (a contiguous CPU
        tensor of its shape, fp32 or another floating dtype, which then gets the fp32
        values rounded to nearest).

        Raises:
            KeyError: ``name`` is not a parameter of the model this init was made for.
        """
        self.write_many([(name, out)])

    def write_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``self(name, out)`` for each ``(name, out)`` of ``items`` (a unit's parameters:
        ``MetaLoader.fill`` calls it so), their chunks drawn in parallel all together. See
        [Note: drawing a unit's chunks at once].

        Raises:
            KeyError: a name is not a parameter of the model this init was made for
                (before anything is written).
        """
        chunk_elements = CHUNK_ELEMENTS  # read once: the tests change it
        chunks: list[_Chunk] = []
        padding_rows: list[tuple[torch.Tensor, int]] = []
        rules = [(self._rule_of(name), name, out) for name, out in items]
        for (rule, padding_idx), name, out in rules:
            if rule == _ONES:
                out.fill_(1.0)
            elif rule == _ZEROS:
                out.zero_()
            else:
                assert out.is_contiguous(), "ramflow fills contiguous views of its masters"
                flat = out.view(-1)
                for index, start in enumerate(range(0, flat.numel(), chunk_elements)):
                    chunks.append(_Chunk(flat[start : start + chunk_elements], name, index))
                if padding_idx is not None:
                    padding_rows.append((out, padding_idx))
        if chunks:
            # the native rounding, built (or found in the cache) here, not on a worker
            native = any(c.out.dtype == torch.bfloat16 for c in chunks) and (
                _lean_kernels.lean_kernel_available()
            )
            if self.num_threads == 1:
                for chunk in chunks:
                    self._draw(chunk, native)
            else:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        self.num_threads, thread_name_prefix="ramflow-seeded-init"
                    )
                # largest first, so that a parameter's short last chunk fills a gap at the end
                order = sorted(chunks, key=lambda c: -c.out.numel())
                list(self._pool.map(lambda c: self._draw(c, native), order))  # first error
        for out, row in padding_rows:
            out[row].zero_()

    def _rule_of(self, name: str) -> tuple[str, int | None]:
        try:
            return self._rules[name]
        except KeyError:
            raise KeyError(
                f"the seeded init was made for another model: it has no parameter {name!r}"
            ) from None

    def _draw(self, chunk: _Chunk, native: bool) -> None:
        """Draw ``chunk`` on this thread: straight into the output when it is fp32, else
        into this thread's fp32 scratch, then rounded into the output here."""
        g = torch.Generator().manual_seed(self.chunk_seed(chunk.name, chunk.index))
        out = chunk.out
        if out.dtype == torch.float32:
            out.normal_(0.0, self.std, generator=g)  # one thread: a generator is serial
            return
        n = out.numel()
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < n:
            scratch = self._local.scratch = torch.empty(max(n, CHUNK_ELEMENTS))
        drawn = scratch[:n]
        drawn.normal_(0.0, self.std, generator=g)
        if native and out.dtype == torch.bfloat16:
            _lean_kernels.round_to_bf16_native(drawn, out)
            return
        # PyTorch's copy_ runs on this thread alone up to its grain (32768 elements);
        # above it, it would start an OpenMP team on every drawing thread
        for start in range(0, n, _SERIAL_COPY_ELEMENTS):
            out[start : start + _SERIAL_COPY_ELEMENTS].copy_(
                drawn[start : start + _SERIAL_COPY_ELEMENTS]
            )


class _Chunk(NamedTuple):
    """Chunk ``index`` of parameter ``name``: its elements' view of the output."""

    out: torch.Tensor  # (<= CHUNK_ELEMENTS,), contiguous
    name: str
    index: int


__all__ = ["CHUNK_ELEMENTS", "SeededInit", "default_num_threads"]
