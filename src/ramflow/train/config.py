"""The settings of a training run, and which of them a resumed run may change."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..choices import AUTO, CHECKPOINTING_MODES, COMPUTE_PRECISIONS, HOST_PRECISIONS
from ..formats.host import HostPrecision, check_optimizer_formats
from ..sizes import parse_bytes
from .generation import resolve_model_dir
from .hub import resolve_hub_model
from .lora import check_frozen_format, parse_targets
from .lr_schedule import default_warmup_steps
from .modeling import read_config
from .optimizers import OPTIMIZER_DEFAULTS, OPTIMIZERS
from .presets import get_preset
from .run_checkpoint import Checkpoint, CheckpointError

# Settings a resumed run may change: they decide how long it runs, where, and how it uses
# memory, not what a step computes.
RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        # changes the LR of the steps to come, but only when given anew: see resume_config
        "decay_steps",
        "save_every",
        "keep_checkpoints",
        "eval_every",
        "eval_batches",
        "device",
        "device_budget_bytes",
        "checkpointing",
    }
)


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run (what ``ramflow train``'s options become).

    Build it with ``TrainConfig.from_options``, which fills the preset's defaults.

    Attributes:
        preset: name of a model preset (``ramflow.train.presets.PRESETS``), or None with ``model``.
        model: a Hugging Face checkpoint folder to start from, or None with ``preset``;
            ``from_options`` also takes a Hub id ``org/name`` from the local Hub cache
            (``ramflow.train.hub``) and stores its snapshot folder.
        tokenizer: a local Hugging Face tokenizer folder; None: the model folder's own
            tokenizer if it has one, else the byte tokenizer.
        data: text file, folder or JSON lines; None: the Python standard library sources.
        steps: optimizer steps to reach (a resumed run counts the steps already done).
        batch_size: sequences per micro-batch (B) to start with; with ``auto_batch_size``,
            the global batch (the fitted micro-batch divides it).
        seq_len: tokens per sequence (T).
        grad_accum: micro-batches per optimizer step (tokens per step = grad_accum * B * T).
            An out-of-memory error halves the micro-batch and doubles the accumulation:
            ``global_batch`` never changes (see ``ramflow.memory.fit``).
        auto_batch_size: fit the micro-batch to the device budget at the start of the run
            (``--batch-size auto``): the largest divisor of ``global_batch`` whose estimate
            fits and whose trial step does not run out of memory; default False.
        lr: peak learning rate.
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio``; in [0, 1].
        warmup_steps: linear warmup steps, each below the peak learning rate (see
            ``lr_schedule.warmup_cosine``); ``from_options`` never defaults it to 0, so a
            model from random weights never takes the full learning rate at step 1.
        decay_steps: the cosine decay reaches ``lr * min_lr_ratio`` at this step and stays
            there; None: ``steps``. ``from_options`` sets it to ``steps``, so a resumed run
            with another ``steps`` keeps the first run's schedule unless it is given anew.
        weight_decay: the optimizer's weight decay of matrices (norm weights get none);
            finite, >= 0. ``from_options`` defaults it per optimizer (AdamW 0.1).
        beta1, beta2, eps: AdamW's.
        optimizer: ``adamw`` (default), ``lion``, ``adafactor``, ``sgd`` (momentum 0.9) or
            ``muon`` (Moonlight's: hidden matrices by Muon, the rest by AdamW):
            ``ramflow.optim``'s, see ``ramflow.train.optimizers``. ``from_options`` scales
            the default ``lr`` per optimizer (``OPTIMIZER_DEFAULTS``). Adafactor, SGD and
            Muon step fp32 host formats only; only AdamW steps on the device. A resumed run
            keeps it.
        clip_grad: global gradient-norm limit, finite; 0 turns clipping off.
        precision: ``auto`` (bf16 on CUDA, fp32 on the CPU), ``bf16``, ``fp16`` (with a
            GradScaler) or ``fp32``.
        checkpointing: activation checkpointing ``on``, ``off``, ``offload`` (on, with the
            layers' inputs in pinned host memory) or ``auto`` (the lightest that the plan
            fits in the device budget beside ramflow's smallest plan; at a micro-batch of
            1, an out-of-memory error takes the next heavier one, see ``backoff.py``).
        host_precision: the host formats (``ramflow.offload``'s ``host_precision``): a
            ``HostPrecision``, or ``"auto"`` (decided once at set-up, for the plan and the
            run: ``setup.host_formats``). A preset's name (``fp32``, ``bf16``, ``lean``,
            ``kahan``) is parsed into its policy here, where it enters; ``to_dict`` writes
            the name back. Formats other than fp32 need a bf16 wire: on the CPU the weights
            are then kept and computed in bf16. A resumed run keeps its format.
        device_optimizer: step the optimizer of resident units on the device where
            ramflow's budget leaves room for their states (``ramflow.offload(...,
            device_optimizer=...)``): the same arithmetic as the host formats' CPU step,
            without the gradients' copy and the CPU's pass for those units. It costs
            device memory within the budget (fp32: 12 bytes per parameter stepped there;
            bf16 masters: their states only). None (default, ``--device-optimizer auto``):
            the planner chooses the units whose device step shortens the predicted step
            (on several ranks, each among the units it steps; none with fp32 masters,
            ``lora_rank`` or on the CPU); True:
            every unit that fits (not with ``lora_rank``: adapters are on the device
            already); False: none.
        seed: seeds the model's initialisation and the data order.
        device: ``cuda``, ``cuda:N`` or ``cpu``; None: CUDA when available.
        device_budget_bytes: the whole device's budget for the run (weights, gradients,
            activations), bytes; None: 90% of the free memory of a CUDA device, no cap on
            the CPU. ``from_options`` reads it from ``gpu_memory`` (``--gpu-memory``, a size
            such as ``"12GiB"``), parsed there once. ramflow's share of it, what the
            activations leave, is the estimate's ``gpu_memory_bytes``, the ``gpu_memory``
            that ``ramflow.offload`` gets.
        save_every: write a checkpoint every this many steps (0: only at the end and on Ctrl-C).
        keep_checkpoints: finished checkpoints kept on disk; 0: none is written (a benchmark
            or a smoke run on a disk too small for one: Ctrl-C and SIGTERM then lose the run).
        eval_every: validation every this many steps and before the first (0: only at
            the end). ``from_options`` sizes it to the run: a fifth of the steps, or 0 for
            a run of fewer than ``PERIODIC_EVAL_MIN_STEPS`` (see [Note: validation sized
            to the run]).
        eval_batches: micro-batches of held-out text per validation; ``from_options``
            sizes it to the run (at most 8).
        val_fraction: share of the corpus held out for validation, between 0 and 1.
        lora_rank: train LoRA adapters of this rank (PEFT) on a frozen base instead of
            every weight (``--lora``); None: a full fine-tune. See ``ramflow.train.lora``.
        lora_targets: comma-separated names of the linear modules or stacked expert
            parameters that get adapters; None: attention and MLP projections
            (``lora.DEFAULT_TARGETS``) and an MoE's experts (``lora.resolve_targets``).
        frozen_format: ``int8``, ``nf4`` or ``mxfp4``: frozen weights kept compressed in host RAM
            (``ramflow.offload(..., frozen_format=...)``); None: in the wire dtype.
        fuse_lora: compute each LoRA layer as one frozen matmul with the rank-r update
            written in its epilogue (``ramflow.helpers.fuse_lora``, ``--fuse-lora``): fewer
            passes over activations, the same function up to one rounding of the sum.
    """

    preset: str | None = "tiny"
    model: str | None = None
    tokenizer: str | None = None
    data: str | None = None
    steps: int = 150
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    auto_batch_size: bool = False
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: str = "adamw"
    clip_grad: float = 1.0
    precision: str = "auto"
    checkpointing: str = "auto"
    host_precision: HostPrecision | str = HostPrecision.fp32()
    device_optimizer: bool | None = None
    seed: int = 0
    device: str | None = None
    device_budget_bytes: int | None = None
    save_every: int = 500
    keep_checkpoints: int = 1
    eval_every: int = 30
    eval_batches: int = 8
    val_fraction: float = 0.01
    lora_rank: int | None = None
    lora_targets: str | None = None
    frozen_format: str | None = None
    fuse_lora: bool = False

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.model is None):
            raise ValueError("give either --preset or --model DIR, not both")
        if self.preset is not None:
            get_preset(self.preset)
        positive = (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "eval_batches",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.keep_checkpoints < 0:
            raise ValueError(
                f"--keep-checkpoints must be 0 (write none) or more, got {self.keep_checkpoints}"
            )
        for name in ("warmup_steps", "save_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}"
                )
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"--decay-steps must be at least 1, got {self.decay_steps}")
        # torch.manual_seed takes a 64-bit integer; a larger one fails after the model is
        # built, with "Overflow when unpacking long long"
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be from 0 to 2**63 - 1, got {self.seed}")
        # Every float is checked for NaN and infinity as well: a NaN passes any `x < 0`
        # test and turns every weight into NaN at the first step.
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"--min-lr-ratio must be in [0, 1] (the LR floor as a share of --lr), "
                f"got {self.min_lr_ratio}"
            )
        if not (self.clip_grad >= 0 and math.isfinite(self.clip_grad)):
            raise ValueError(
                f"--clip-grad must be a finite number >= 0 (0 turns clipping off), "
                f"got {self.clip_grad}"
            )
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(
                f"--weight-decay must be a finite number >= 0 (0 turns it off), "
                f"got {self.weight_decay}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be between 0 and 1, got {self.val_fraction}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a positive number, got {self.eps}")
        if self.precision not in COMPUTE_PRECISIONS:
            raise ValueError(
                f"--precision {self.precision!r}: choose one of {', '.join(COMPUTE_PRECISIONS)}"
            )
        object.__setattr__(self, "host_precision", _host_precision(self.host_precision))
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.optimizer != "adamw" and self.device_optimizer:
            raise ValueError(
                f"--optimizer {self.optimizer} has no device step: drop --device-optimizer, "
                "or use --optimizer adamw, which steps on the device too"
            )
        exact = isinstance(self.host_precision, HostPrecision) and self.host_precision.is_exact
        if self.optimizer in ("adafactor", "sgd", "muon") and not exact:
            raise ValueError(
                f"--optimizer {self.optimizer} steps fp32 master weights and states only: use "
                "--host-precision fp32, or --optimizer adamw or lion, which step every host "
                "format"
            )
        if self.optimizer == "lion" and isinstance(self.host_precision, HostPrecision):
            try:
                check_optimizer_formats(self.host_precision, "Lion")
            except ValueError:
                raise ValueError(
                    f"--optimizer lion has no step for --host-precision "
                    f"{self.host_precision.name} (its states are AdamW's): use --optimizer "
                    "adamw, or --host-precision lean"
                ) from None
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(
                f"--checkpointing {self.checkpointing!r}: choose one of {', '.join(CHECKPOINTING_MODES)}"
            )
        if self.device_budget_bytes is not None and (
            isinstance(self.device_budget_bytes, bool)
            or not isinstance(self.device_budget_bytes, int)
            or self.device_budget_bytes < 0
        ):
            raise ValueError(
                f"device_budget_bytes must be a number of bytes >= 0, got "
                f"{self.device_budget_bytes!r}; --gpu-memory takes a size such as 12GiB"
            )
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"--lora must be a positive rank, got {self.lora_rank}")
        if self.lora_targets is not None:
            if self.lora_rank is None:
                raise ValueError("--lora-targets chooses where LoRA goes: give --lora RANK too")
            parse_targets(self.lora_targets)
        check_frozen_format(self.frozen_format)
        if self.fuse_lora and self.lora_rank is None:
            raise ValueError(
                "--fuse-lora fuses the LoRA layers of a LoRA run: give --lora RANK too"
            )
        if self.device_optimizer not in (None, True, False):
            raise ValueError(
                f"device_optimizer must be None (auto), True or False, got "
                f"{self.device_optimizer!r}"
            )
        if self.device_optimizer is True and self.lora_rank is not None:
            raise ValueError(
                "--device-optimizer steps a full fine-tune's units on the device; with --lora "
                "the adapters are stepped there already: drop --device-optimizer"
            )

    @property
    def schedule_steps(self) -> int:
        """The step at which the cosine decay ends (``decay_steps``, else ``steps``)."""
        return self.decay_steps if self.decay_steps is not None else self.steps

    def steps_during_backward(self, *, several_ranks: bool) -> bool:
        """Whether the loop lets ramflow step units during backward (the eager overlap), so
        that no full host gradient buffer is made: only without clipping, accumulation or
        fp16's loss scaling (each needs every gradient before a step), and only on several
        ranks, where an out-of-memory error ends the run; one process keeps steps out of
        backward so that its back-off stays exact (see [Note: backing off after an
        out-of-memory error] in ``backoff.py``)."""
        return (
            several_ranks
            and self.clip_grad == 0
            and self.grad_accum == 1
            and self.precision != "fp16"
        )

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step (``grad_accum * batch_size``)."""
        return self.grad_accum * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """A config from command-line style options; None (or absent) means the default.

        Defaults that depend on the model: ``batch_size``, ``seq_len``, ``lr`` and
        ``steps`` come from the preset (``tiny`` when neither preset nor model is given);
        a ``model`` folder gets B=4, T=min(2048, its context), lr=2e-5 and 100 steps.
        ``lr`` is scaled and ``weight_decay`` set per ``optimizer`` (``OPTIMIZER_DEFAULTS``).
        ``decay_steps`` defaults to ``steps``, ``warmup_steps`` to a fifth of the steps (at least 1, at most 200), ``eval_every`` to
        a fifth.

        Raises:
            ValueError: an unknown option or an invalid value (see the attributes).
        """
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)} - {"global_batch"}
        if unknown - {"gpu_memory"}:
            raise ValueError(f"unknown training options: {', '.join(sorted(unknown))}")
        given = _device_budget({k: v for k, v in options.items() if v is not None})
        global_batch = given.pop("global_batch", None)
        if given.get("batch_size") == "auto":
            # the preset's (or the model folder's) batch fills it in below, as the global
            # batch when no --global-batch is given
            del given["batch_size"]
            given["auto_batch_size"] = True
        elif isinstance(given.get("batch_size"), str):
            raise ValueError(
                f"--batch-size {given['batch_size']!r}: give a number of sequences or 'auto'"
            )
        if "tokenizer" in given:
            given["tokenizer"] = str(resolve_hub_model(given["tokenizer"]))
        if "model" in given:
            given.setdefault("preset", None)
            if given["preset"] is not None:
                raise ValueError("give either --preset or --model DIR, not both")
            # a Hub id: its snapshot in the local cache; a run folder: its latest checkpoint
            given["model"] = str(resolve_model_dir(given["model"]))
            ctx = getattr(read_config(given["model"]), "max_position_embeddings", 2048)
            base = {"batch_size": 4, "seq_len": min(2048, ctx), "lr": 2e-5, "steps": 100}
        else:
            preset = get_preset(given.setdefault("preset", "tiny"))
            base = {
                "batch_size": preset.batch_size,
                "seq_len": preset.seq_len,
                "lr": preset.lr,
                "steps": preset.steps,
            }
        if global_batch is not None:
            _set_global_batch(given, global_batch)
        defaults = OPTIMIZER_DEFAULTS.get(given.get("optimizer", "adamw"))
        if defaults is not None:  # else refused by __post_init__
            base["lr"] *= defaults.lr_scale
            base["weight_decay"] = defaults.weight_decay
        for k, v in base.items():
            given.setdefault(k, v)
        if given.get("auto_batch_size") and "grad_accum" in given:
            given["batch_size"] *= given.pop("grad_accum")  # the global batch, fitted later
        steps = given["steps"]
        given.setdefault("decay_steps", steps)
        given.setdefault("warmup_steps", default_warmup_steps(steps))
        _size_validation(given)
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (JSON, a checkpoint, the trackers): host formats by
        their preset's name, or their fields where they are no preset."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        hp = self.host_precision
        if isinstance(hp, HostPrecision):
            preset = hp.name in HOST_PRECISIONS and HostPrecision.parse(hp.name) == hp
            out["host_precision"] = hp.name if preset else dataclasses.asdict(hp)
        return out

    @property
    def model_name(self) -> str:
        """The preset, or the model folder, for messages."""
        return self.preset if self.preset is not None else str(self.model)


def _device_budget(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``gpu_memory`` (``--gpu-memory``'s size, as a user or an older
    checkpoint gives it) parsed into ``device_budget_bytes``: where the value enters.

    Raises:
        ValueError: an unreadable size, or both names given.
    """
    if "gpu_memory" not in options:
        return options
    options = dict(options)
    text = options.pop("gpu_memory")
    if options.get("device_budget_bytes") is not None and text is not None:
        raise ValueError("give the device budget once: gpu_memory or device_budget_bytes")
    if text is not None:
        options["device_budget_bytes"] = parse_bytes(text, what="--gpu-memory")
    return options


def _host_precision(value: Any) -> HostPrecision | str:
    """``TrainConfig.host_precision`` as given: a policy, or ``"auto"``; a preset's name
    (the command line's, a checkpoint's) or a policy's fields (``to_dict`` of one that is
    no preset) become the policy.

    Raises:
        ValueError: a name that is no preset nor ``auto``.
        TypeError: neither a policy, a name nor a mapping of its fields.
    """
    if isinstance(value, HostPrecision) or value == AUTO:
        return value
    if isinstance(value, str):
        if value not in HOST_PRECISIONS:
            raise ValueError(
                f"--host-precision {value!r}: choose one of {', '.join(HOST_PRECISIONS)}"
            )
        return HostPrecision.parse(value)
    if isinstance(value, dict):
        return HostPrecision(**value)
    raise TypeError(f"host_precision must be a HostPrecision or a preset's name, got {value!r}")


# [Note: validation sized to the run]
# A validation pass is a forward over eval_batches micro-batches, each as costly to stream
# through the device as a training micro-batch's forward. With fixed defaults (8 batches,
# at step 0 and every fifth of the run) a 5-step fine-tune validated six times, 48
# micro-batches against 5 of training, and spent most of its time there. So a run of fewer
# than PERIODIC_EVAL_MIN_STEPS validates once, at the end; and the default eval_batches
# keeps all the validation passes of a run within VALIDATION_SHARE of its training
# micro-batches (at least one batch each, at most MAX_EVAL_BATCHES). Given values are kept.
PERIODIC_EVAL_MIN_STEPS = 25
VALIDATION_SHARE = 0.25
MAX_EVAL_BATCHES = 8


def _size_validation(given: dict[str, Any]) -> None:
    """Default ``eval_every`` and ``eval_batches`` in ``given`` from its ``steps`` and
    ``grad_accum``. See [Note: validation sized to the run]."""
    steps = given["steps"]
    every = given.setdefault("eval_every", steps // 5 if steps >= PERIODIC_EVAL_MIN_STEPS else 0)
    # before step 1, every `every` steps before the last, and at the end
    passes = 1 + -(-steps // every) if every > 0 else 1
    micro_batches = steps * given.get("grad_accum", 1)
    given.setdefault(
        "eval_batches",
        min(MAX_EVAL_BATCHES, max(1, int(VALIDATION_SHARE * micro_batches / passes))),
    )


def _set_global_batch(given: dict[str, Any], global_batch: int) -> None:
    """Express ``--global-batch`` as ``batch_size`` and ``grad_accum`` in ``given``.

    Raises:
        ValueError: a global batch below 1, one the micro-batch does not divide, or one
            that disagrees with ``--grad-accum``.
    """
    if global_batch < 1:
        raise ValueError(f"--global-batch must be at least 1, got {global_batch}")
    if given.get("auto_batch_size"):
        if "grad_accum" in given:
            raise ValueError(
                "--batch-size auto chooses --grad-accum to reach --global-batch; drop --grad-accum"
            )
        given["batch_size"] = global_batch
        return
    micro = given.get("batch_size")
    if micro is None:
        raise ValueError(
            "--global-batch needs --batch-size (a number of sequences, or 'auto' to fit it)"
        )
    if global_batch % micro:
        raise ValueError(
            f"--global-batch {global_batch} is not a multiple of --batch-size {micro}; give a "
            "micro-batch that divides it, or --batch-size auto"
        )
    if given.setdefault("grad_accum", global_batch // micro) != global_batch // micro:
        raise ValueError(
            f"--global-batch {global_batch} is not --batch-size {micro} x --grad-accum "
            f"{given['grad_accum']}; give two of the three"
        )


def resume_config(checkpoint: Checkpoint, **options: Any) -> TrainConfig:
    """The settings of the run that wrote ``checkpoint``, with the changes in ``options``
    (None means unchanged).

    The LR schedule is the first run's: ``decay_steps`` stays the checkpoint's when only
    ``steps`` changes (a checkpoint from before ``decay_steps`` existed decays over its own
    ``steps``), so a longer run continues at the LR floor and a shorter one stops early on
    the same curve; give ``decay_steps`` to stretch or shrink the decay instead.

    Raises:
        ValueError: an option differs from the checkpoint's and is not one of
            ``RESUMABLE_CHANGES`` (e.g. another preset: a checkpoint of another model shape).
        CheckpointError: the checkpoint's settings are not those of a ``TrainConfig``.
    """
    if options.get("batch_size") == "auto":
        options = {**options, "auto_batch_size": True, "batch_size": options.get("global_batch")}
    elif options.get("global_batch") is not None and options.get("batch_size") is not None:
        options = {**options, "grad_accum": options["global_batch"] // options["batch_size"]}
    options.pop("global_batch", None)
    options = _device_budget(options)
    # a checkpoint from before the budget was parsed where it enters holds --gpu-memory's text
    stored = _device_budget(dict(checkpoint.state["train_config"]))
    if stored.get("decay_steps") is None:
        stored["decay_steps"] = stored.get("steps")
    for key, value in options.items():
        if value is None or key not in stored or stored[key] == value:
            continue
        if key in ("preset", "model"):
            raise CheckpointError(
                f"--{key} {value} does not match the checkpoint {checkpoint.path}, which is of "
                f"{'preset ' + str(stored['preset']) if stored['preset'] else 'the model in ' + str(stored['model'])} "
                "(another model shape). Resume without --preset/--model, or start a new run."
            )
        if key not in RESUMABLE_CHANGES:
            raise ValueError(
                f"--{key.replace('_', '-')} {value} differs from the checkpoint's {stored[key]!r}; a resumed "
                f"run keeps the settings that decide its steps (it may change only "
                f"{', '.join('--' + k.replace('_', '-') for k in sorted(RESUMABLE_CHANGES))}). "
                "Start a new run to change it."
            )
        stored[key] = value
    try:
        return TrainConfig(**stored)
    except TypeError as err:
        raise CheckpointError(
            f"the settings in {checkpoint.path} are malformed ({err}); resume from an earlier "
            "checkpoint or start afresh"
        ) from err


__all__ = [
    "MAX_EVAL_BATCHES",
    "PERIODIC_EVAL_MIN_STEPS",
    "RESUMABLE_CHANGES",
    "VALIDATION_SHARE",
    "TrainConfig",
    "resume_config",
]
