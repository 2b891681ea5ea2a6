"""``ramflow profile``: a few training steps of a model, and where their memory went.

Legend: B = sequences per micro-batch, T = tokens per sequence.

The model is a preset or a Hugging Face folder, as for ``ramflow train``; the data are
random token ids (memory does not depend on the text). Each variant runs ``steps``
optimizer steps under a ``ramflow.memory.MemoryTracker`` with a reading after every
forward, backward and optimizer step: "plain" is the model on the device with
``torch.optim.AdamW``, the PyTorch baseline; "offloaded" is ``ramflow.offload`` with
``ramflow.optim.AdamW``. A variant that runs out of device memory is reported as such
(which is what offloading is for) rather than ending the command. The output folder gets:

- ``activations.txt``: ``activation_report`` of one micro-batch (the first variant that
  ran), per module, largest first;
- ``timeline-<variant>.png``: the tracker's readings over the steps (``plot_timeline``);
- ``snapshot-<variant>.pickle``: the CUDA allocator's history of the last step, for
  https://pytorch.org/memory_viz (CUDA only: on the CPU there is no allocator history,
  and ``summary.json`` says so);
- ``summary.json``: per variant, peaks, losses and step times (each step's, the first
  step's and the steady state's), and the activation total.

[Note: the steady step of a profile]
The first step of a variant pays for what happens once: the caching allocator's first
segments, CUDA's lazy kernel loading and cuBLAS's workspace, and for the offloaded model
the host store's first copies; on the GPU box it took 2,995 ms where the later steps took
about 100 ms, so a mean over three steps said 537 ms of a 100 ms step. The report gives
the first step on its own and the steady step as the mean of the steps after the
``WARMUP_STEPS`` dropped, also without the last step on CUDA, which records the
allocator's history for the snapshot (stack traces at every allocation slow it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import ramflow

from ..memory import MemoryTracker, activation_report, memory_snapshot, plot_timeline
from ..sizes import format_bytes, parse_bytes
from .modeling import build_model, load_model, model_config
from .precision import ComputePolicy, resolve_compute
from .tokenizer import has_tokenizer, load_tokenizer

__all__ = ["VariantProfile", "ProfileResult", "profile_model"]

SNAPSHOT_NOTE_CPU = "no snapshot: the allocator history is CUDA's (the run was on the CPU)"

WARMUP_STEPS = 1
"""Steps at the start of a variant left out of its steady step. See [Note: the steady
step of a profile]."""


@dataclass(frozen=True)
class VariantProfile:
    """One variant's figures.

    Attributes:
        name: ``"plain"`` or ``"offloaded"``.
        completed: all steps ran (False: out of device memory, see ``error``).
        error: the out-of-memory message, or None.
        losses: training loss of each step.
        step_s: wall time of each step, seconds.
        peak_device_bytes: the device's peak allocated bytes over the steps (None on the CPU).
        peak_host_rss_bytes: the largest host RSS reading.
        timeline: the PNG, or None.
        snapshot: the allocator history, or None (CPU, or the variant did not run).
    """

    name: str
    completed: bool
    error: str | None
    losses: tuple[float, ...]
    step_s: tuple[float, ...]
    peak_device_bytes: int | None
    peak_host_rss_bytes: int
    timeline: str | None
    snapshot: str | None

    @property
    def steady_steps(self) -> range:
        """The steps (0-based) whose mean is the steady step: after ``WARMUP_STEPS``, and
        before the last one where it recorded the allocator history (``snapshot``). See
        [Note: the steady step of a profile]."""
        return range(WARMUP_STEPS, len(self.step_s) - (self.snapshot is not None))

    @property
    def first_step_s(self) -> float | None:
        """The first step's wall time, seconds (None: no step ran)."""
        return self.step_s[0] if self.step_s else None

    @property
    def steady_step_s(self) -> float | None:
        """The mean wall time of ``steady_steps``, seconds (None: too few steps ran)."""
        times = [self.step_s[k] for k in self.steady_steps]
        return sum(times) / len(times) if times else None

    def timing(self) -> dict[str, Any]:
        """The step times for ``summary.json``: each step's, the first's, the steady mean
        and its steps (1-based, inclusive; None: too few steps)."""
        steps = self.steady_steps
        return {
            "first_step_s": self.first_step_s,
            "steady_step_s": self.steady_step_s,
            "steady_steps": [steps.start + 1, steps.stop] if len(steps) else None,
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


@dataclass(frozen=True)
class ProfileResult:
    """What ``profile_model`` wrote and measured.

    Attributes:
        out_dir: the output folder.
        device: where the steps ran.
        batch_size, seq_len: B and T.
        activation_bytes: bytes saved for backward by one micro-batch (measured).
        variants: one ``VariantProfile`` per variant, in the order run.
        snapshot_note: why there is no snapshot, or None.
    """

    out_dir: Path
    device: str
    batch_size: int
    seq_len: int
    activation_bytes: int | None
    variants: tuple[VariantProfile, ...]
    snapshot_note: str | None

    def describe(self) -> str:
        """The variants side by side, one row per figure."""
        names = [v.name for v in self.variants]

        def size(v: int | None) -> str:
            return "-" if v is None else format_bytes(v)

        rows = [
            ("", *names),
            ("completed", *("yes" if v.completed else "out of memory" for v in self.variants)),
            ("peak device", *(size(v.peak_device_bytes) for v in self.variants)),
            ("peak host RSS", *(size(v.peak_host_rss_bytes) for v in self.variants)),
            (
                "last loss",
                *(f"{v.losses[-1]:.4f}" if v.losses else "-" for v in self.variants),
            ),
            ("first step", *(_ms(v.first_step_s) for v in self.variants)),
            (
                "steady step",
                *(
                    f"{_ms(v.steady_step_s)} (steps {v.steady_steps.start + 1}-"
                    f"{v.steady_steps.stop})"
                    if v.steady_step_s is not None
                    else "-"
                    for v in self.variants
                ),
            ),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"profile on {self.device}: micro-batch {self.batch_size} x {self.seq_len} tokens, "
            f"activations {size(self.activation_bytes)} saved for backward",
            *(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                )
                for r in rows
            ),
        ]
        # See [Note: the steady step of a profile]
        cuda = any(v.snapshot is not None for v in self.variants)
        steady = (
            f"steady step: the mean after the first {WARMUP_STEPS} (warm-up: allocator, "
            "kernels, first copies)"
            + (", without the last (it records the snapshot)" if cuda else "")
        )
        if any(v.step_s and v.steady_step_s is None for v in self.variants):
            steady += f"; give --steps {WARMUP_STEPS + 1 + cuda} or more for one"
        lines.append(steady)
        if self.snapshot_note:
            lines.append(self.snapshot_note)
        lines.append(f"written to {self.out_dir}")
        return "\n".join(lines)


def _build(preset: str | None, model_dir: str | None, seed: int) -> tuple[torch.nn.Module, Any]:
    tokenizer = load_tokenizer(model_dir if model_dir and has_tokenizer(model_dir) else None)
    config = model_config(preset=preset, model_dir=model_dir, tokenizer=tokenizer)
    model = load_model(model_dir, config=config) if model_dir else build_model(config, seed=seed)
    return model, config


def _run_variant(
    name: str,
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    *,
    policy: ComputePolicy,
    gpu_memory: int | None,
    out_dir: Path,
) -> VariantProfile:
    """``len(batches)`` steps of ``model`` (a copy it may modify), tracked."""
    cuda = policy.device.type == "cuda"
    where = "GPU" if cuda else policy.device.type.upper()
    losses: list[float] = []
    times: list[float] = []
    error = None
    snapshot = None
    tracker = MemoryTracker(device=policy.device)
    offloaded = name == "offloaded"
    try:
        with tracker:
            if offloaded:
                ramflow.offload(
                    model, gpu_memory=gpu_memory, device=policy.device, wire_dtype=policy.wire_dtype
                )
                opt = ramflow.optim.AdamW(model.parameters(), lr=1e-4)
            else:
                model.to(policy.device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tracker.snapshot("offloaded" if offloaded else f"model on the {where}")
            for k, x in enumerate(batches):
                last = k == len(batches) - 1
                record = (
                    memory_snapshot(out_dir / f"snapshot-{name}.pickle")
                    if cuda and last
                    else contextlib.nullcontext()
                )
                t0 = time.perf_counter()
                with record:
                    x = x.to(policy.device)  # (B, T)
                    with policy.autocast():
                        loss = model(input_ids=x, labels=x, use_cache=False).loss
                    tracker.snapshot(f"step {k + 1} forward")
                    loss.backward()
                    tracker.snapshot(f"step {k + 1} backward")
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if offloaded:
                        ramflow.synchronize(model)
                    tracker.snapshot(f"step {k + 1} optimizer step")
                if cuda and last:
                    snapshot = str(out_dir / f"snapshot-{name}.pickle")
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())
    except torch.OutOfMemoryError as err:
        error = str(err).splitlines()[0] if str(err) else "out of memory"
    finally:
        if offloaded:
            with contextlib.suppress(Exception):
                ramflow.undo(model)
    timeline = None
    if len(tracker.records) > 1:
        timeline = str(
            plot_timeline(
                tracker.records,
                out_dir / f"timeline-{name}.png",
                title=f"ramflow profile on the {where}: {name} model",
            )
        )
    return VariantProfile(
        name=name,
        completed=error is None,
        error=error,
        losses=tuple(losses),
        step_s=tuple(times),
        peak_device_bytes=tracker.peak_bytes,
        peak_host_rss_bytes=max(r["host_rss_bytes"] for r in tracker.records),
        timeline=timeline,
        snapshot=snapshot,
    )


def profile_model(
    *,
    out_dir: str | os.PathLike,
    preset: str | None = None,
    model: str | os.PathLike | None = None,
    steps: int = 5,
    batch_size: int = 2,
    seq_len: int = 128,
    device: str | None = None,
    precision: str = "auto",
    gpu_memory: str | None = None,
    offload: bool = False,
    seed: int = 0,
) -> ProfileResult:
    """Run ``steps`` training steps and write the memory reports (see the module's docstring).

    Args:
        out_dir: the output folder (created; files in it are overwritten).
        preset: a model preset (default ``tiny`` when ``model`` is None).
        model: a Hugging Face causal LM folder instead of a preset.
        steps: optimizer steps per variant, at least 1.
        batch_size, seq_len: the micro-batch, B sequences of T tokens.
        device: ``cuda``, ``cuda:N`` or ``cpu`` (default: CUDA when available).
        precision: as for ``ramflow train``.
        gpu_memory: the offloaded variant's ``gpu_memory`` (default: ramflow's).
        offload: also run the model offloaded, beside the plain run.
        seed: seeds the model's initialisation and the token ids.

    Returns:
        A ``ProfileResult``; ``describe()`` prints the variants side by side.

    Raises:
        ValueError: both or bad ``preset``/``model``, sizes below 1, an unreadable
            ``gpu_memory``, an unknown device or precision.
        FileNotFoundError: ``model`` is not a model folder.
    """
    if preset is not None and model is not None:
        raise ValueError("give either --preset or --model DIR, not both")
    for flag, value in (("--steps", steps), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    gpu_memory_bytes = (
        parse_bytes(gpu_memory, what="--gpu-memory") if gpu_memory is not None else None
    )
    policy = resolve_compute(device=device, precision=precision)
    base, config = _build(
        preset if preset is not None or model is not None else "tiny",
        None if model is None else str(model),
        seed,
    )
    base.train()
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx is not None and seq_len > ctx:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context of {ctx} tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    batches = [
        torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g)
        for _ in range(steps)
    ]

    activation_bytes = None
    with contextlib.suppress(torch.OutOfMemoryError):
        probe = copy.deepcopy(base).to(policy.device)
        x = batches[0].to(policy.device)
        with policy.autocast():
            report = activation_report(probe, input_ids=x, labels=x, use_cache=False)
        (out / "activations.txt").write_text(report.format(top=None) + "\n")
        activation_bytes = report.total_saved_bytes
        del probe, report
    if policy.device.type == "cuda":
        torch.cuda.empty_cache()

    variants = []
    for name in ("plain", "offloaded") if offload else ("plain",):
        model_copy = copy.deepcopy(base)
        variants.append(
            _run_variant(
                name, model_copy, batches, policy=policy, gpu_memory=gpu_memory_bytes, out_dir=out
            )
        )
        del model_copy
        if policy.device.type == "cuda":
            torch.cuda.empty_cache()
    result = ProfileResult(
        out_dir=out,
        device=str(policy.device),
        batch_size=batch_size,
        seq_len=seq_len,
        activation_bytes=activation_bytes,
        variants=tuple(variants),
        snapshot_note=None if policy.device.type == "cuda" else SNAPSHOT_NOTE_CPU,
    )
    summary = {
        "device": result.device,
        "precision": policy.precision,
        "model": str(model) if model is not None else (preset or "tiny"),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "activation_bytes": activation_bytes,
        "activation_report": "activations.txt" if activation_bytes is not None else None,
        "snapshot_note": result.snapshot_note,
        "warmup_steps": WARMUP_STEPS,
        "variants": [asdict(v) | v.timing() for v in variants],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result
