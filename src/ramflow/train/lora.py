"""LoRA runs of ``ramflow train --lora RANK``: PEFT adapters on an offloaded, frozen base.

The base (a preset's fresh weights or ``--model``'s) is frozen and offloaded first; PEFT's
``get_peft_model`` then adds the adapters, which ``ramflow.adopt`` moves to the device for
good (see [Note: adapters on the device] in ``ramflow.engine.adapters``). A LoRA run's
checkpoints hold the adapters in PEFT's own format (``adapter_config.json`` and
``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, checkpoint)`` loads
them) and the base's ``config.json``, not the base's weights; resuming rebuilds the base
from the run's settings (the preset and seed, or ``--model``) and loads the adapters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import ramflow

from .._quiet import quiet_peft_wrap
from ..choices import FROZEN_FORMATS

# attention and MLP projections of Llama-style models (Llama, Mistral, Qwen2, the presets)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def parse_targets(text: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``--lora-targets q_proj,v_proj`` as a tuple of module names (None: the default)."""
    if text is None:
        return None
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("--lora-targets names no module: give names like q_proj,v_proj")
    return tuple(names)


def check_lora_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Raise ValueError naming each target that is not the last name of a linear module of
    ``model`` (a meta-device model is enough), with the names it does have."""
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ValueError(
            f"--lora-targets: the model has no linear module named {', '.join(missing)}; its "
            f"linear modules are {', '.join(linear)}"
        )


def count_lora_parameters(model: nn.Module, *, rank: int, targets: Sequence[str] | None) -> int:
    """Parameters of the rank-``rank`` adapters that ``apply_lora`` would add to ``model``
    (a meta-device model is enough): A (rank x in) and B (out x rank) for each linear module
    whose last name is a target."""
    names = set(targets or DEFAULT_TARGETS)
    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in names
    )


def check_frozen_format(frozen_format: str | None) -> None:
    """Raise ValueError for a format ``ramflow.offload(frozen_format=...)`` does not know."""
    if frozen_format is None:
        return
    if frozen_format not in FROZEN_FORMATS:
        raise ValueError(
            f"--frozen-format {frozen_format!r}: choose one of {', '.join(FROZEN_FORMATS)}"
        )


def frozen_format_options(frozen_format: str | None) -> dict[str, Any]:
    """The ``ramflow.offload`` keyword for ``--frozen-format`` (none when not given)."""
    check_frozen_format(frozen_format)
    return {} if frozen_format is None else {"frozen_format": frozen_format}


def apply_lora(
    model: nn.Module, *, rank: int, targets: Sequence[str] | None, seed: int
) -> nn.Module:
    """Add LoRA adapters (PEFT, alpha = 2 x rank, no dropout) to the offloaded ``model``,
    whose parameters are frozen, and move them to the device (``ramflow.adopt``).

    Returns the ``peft.PeftModel``; its adapters are initialised from ``seed`` (PEFT's
    default: A random, B zero, so the first forward equals the base's).

    Raises:
        ValueError: ``rank`` below 1; a target ``model`` does not have.
    """
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"--lora must be a positive rank, got {rank}")
    targets = tuple(targets) if targets is not None else DEFAULT_TARGETS
    check_lora_targets(model, targets)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0)
    torch.manual_seed(seed)
    return _peft_on_device(model, config)


def _peft_on_device(model: nn.Module, config: Any) -> nn.Module:
    """PEFT's ``get_peft_model`` of the offloaded ``model`` with the ``LoraConfig``, its
    adapters moved to the device (``ramflow.adopt``)."""
    from peft import get_peft_model

    with quiet_peft_wrap():  # see [Note: quiet imports]
        peft_model = get_peft_model(model, config)
    ramflow.adopt(peft_model)
    return peft_model


def load_adapters(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load the adapters a LoRA checkpoint holds into the PEFT ``model`` (same shapes).

    Raises:
        ValueError: the checkpoint holds adapters of other names or shapes.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(os.fspath(directory), ADAPTER_WEIGHTS_FILE))
    result = set_peft_model_state_dict(model, tensors)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the adapters in {directory} do not match this run's (missing "
            f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}): resume with the "
            "run's own --lora and --lora-targets"
        )


def is_adapter_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds PEFT adapters (``adapter_config.json``), as a LoRA run's
    checkpoints do, rather than a whole model."""
    return os.path.isfile(os.path.join(os.fspath(directory), ADAPTER_CONFIG_FILE))


def adapter_base(directory: str | os.PathLike) -> str | None:
    """The base model folder that the adapters in ``directory`` were trained on (PEFT's
    ``base_model_name_or_path``, absolute for a base that ``ramflow train --model`` read),
    or None: a run on a preset's fresh weights, whose base is rebuilt from its seed."""
    from peft import LoraConfig

    return LoraConfig.from_pretrained(os.fspath(directory)).base_model_name_or_path or None


def attach_adapters(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Put the LoRA adapters saved in ``directory`` (PEFT's format) on the offloaded base
    ``model``, with the saved config as it is (rank, alpha, targets, dropout), on the
    device (``ramflow.adopt``). Returns the ``peft.PeftModel``.

    Raises:
        ValueError: the adapters do not match the base (names or shapes).
    """
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(os.fspath(directory))
    check_lora_targets(model, config.target_modules)
    peft_model = _peft_on_device(model, config)
    load_adapters(peft_model, directory)
    return peft_model


__all__ = [
    "ADAPTER_CONFIG_FILE",
    "DEFAULT_TARGETS",
    "adapter_base",
    "apply_lora",
    "attach_adapters",
    "check_frozen_format",
    "check_lora_targets",
    "count_lora_parameters",
    "frozen_format_options",
    "is_adapter_checkpoint",
    "load_adapters",
    "parse_targets",
]
