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
"""

from __future__ import annotations

import concurrent.futures
import hashlib

import torch
from torch import nn

from .._loading import default_num_threads

# elements per generator. This is part of the values: changing it changes every preset's
# initial weights (a run resumed from a seed, a LoRA base rebuilt from its seed)
CHUNK_ELEMENTS = 1 << 22

_NORMAL, _ONES, _ZEROS = "normal", "ones", "zeros"
_NORM_CLASSES = (nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm)
_LINEAR_CLASSES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _is_norm(module: nn.Module) -> bool:
    # as transformers: its RMSNorm and LayerNorm classes are the model's own, by name
    name = type(module).__name__
    return isinstance(module, _NORM_CLASSES) or "LayerNorm" in name or "RMSNorm" in name


class SeededInit:
    """``weights(name, out)`` for ``ramflow.offload`` (and ``_loading.load_resident``):
    writes the seeded random initial value of parameter ``name`` into ``out``. See [Note:
    a seeded init that does not depend on who fills it].

    Args:
        model: the model whose parameters will be asked for (on any device, the meta
            device included); only its module types and names are read.
        seed: the run's seed (any int; the same seed gives the same weights).
        std: standard deviation of the normal weights; None takes the model's
            ``config.initializer_range`` (0.02 without one), as ``transformers`` does.
        num_threads: threads that draw the chunks of one parameter (values do not depend
            on it); None: ``default_num_threads()``. Outputs that are not fp32 (a bf16
            master) are drawn into an fp32 scratch of ``num_threads`` chunks (16 MiB each),
            kept while this object lives, and rounded to nearest from it.

    Raises:
        ValueError: a parameter belongs to a module that is none of linear, embedding or
            norm layers (the rules do not say how to draw it; load that model's weights
            from a checkpoint instead), or ``num_threads`` < 1.
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
        self.seed = int(seed)
        self.std = float(std)
        self.num_threads = num_threads
        self._scratch: torch.Tensor | None = None  # see _scratch_for
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
        try:
            rule, padding_idx = self._rules[name]
        except KeyError:
            raise KeyError(
                f"the seeded init was made for another model: it has no parameter {name!r}"
            ) from None
        if rule == _ONES:
            out.fill_(1.0)
            return
        if rule == _ZEROS:
            out.zero_()
            return
        assert out.is_contiguous(), "ramflow fills contiguous views of its masters"
        flat = out.view(-1)
        starts = range(0, flat.numel(), CHUNK_ELEMENTS)
        threads = min(self.num_threads, len(starts))
        pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None

        def run(fn, items) -> None:
            if pool is None:
                for item in items:
                    fn(item)
            else:
                list(pool.map(fn, items))  # torch's kernels release the GIL: in parallel

        def draw(index: int, into: torch.Tensor) -> None:
            g = torch.Generator().manual_seed(self.chunk_seed(name, index))
            into.normal_(0.0, self.std, generator=g)  # one thread: a generator is serial

        try:
            if flat.dtype == torch.float32:
                run(
                    lambda i: draw(i, flat[starts[i] : starts[i] + CHUNK_ELEMENTS]),
                    range(len(starts)),
                )
            else:
                # drawn in fp32 as for an fp32 master, a wave of chunks at a time, then
                # rounded by one copy on this thread with PyTorch's intra-op threads (a copy
                # on each drawing thread would start an OpenMP team per thread)
                scratch = self._scratch_for(threads)
                for w in range(0, len(starts), threads):
                    wave = starts[w : w + threads]
                    lo, hi = wave[0], min(wave[-1] + CHUNK_ELEMENTS, flat.numel())

                    def draw_into_scratch(i: int, lo: int = lo, hi: int = hi) -> None:
                        a = starts[i] - lo
                        draw(i, scratch[a : min(a + CHUNK_ELEMENTS, hi - lo)])

                    run(draw_into_scratch, range(w, w + len(wave)))
                    flat[lo:hi].copy_(scratch[: hi - lo])
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        if padding_idx is not None:
            out[padding_idx].zero_()

    def _scratch_for(self, threads: int) -> torch.Tensor:
        """fp32 scratch of ``threads`` chunks, kept while this init lives (made anew for
        every tensor, its pages would be faulted in again each time)."""
        if self._scratch is None or self._scratch.numel() < threads * CHUNK_ELEMENTS:
            self._scratch = torch.empty(threads * CHUNK_ELEMENTS)
        return self._scratch


__all__ = ["CHUNK_ELEMENTS", "SeededInit", "default_num_threads"]
