"""LoRA runs of ``ramflow train --lora RANK``: PEFT adapters on an offloaded, frozen base.

The base (a preset's fresh weights or ``--model``'s) is frozen and offloaded first; PEFT's
``get_peft_model`` then adds the adapters, which ``ramflow.adopt`` moves to the device for
good (see [Note: adapters on the device] in ``ramflow.engine.adapters``). A LoRA run's
checkpoints hold the adapters in PEFT's own format (``adapter_config.json`` and
``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, checkpoint)`` loads
them) and the base's ``config.json``, not the base's weights; resuming rebuilds the base
from the run's settings (the preset and seed, or ``--model``) and loads the adapters.

[Note: LoRA targets of a mixture of experts]
transformers 5 keeps a mixture-of-experts layer's routed experts as stacked 3-D parameters
(``experts.gate_up_proj`` (E, ., .), ``experts.down_proj``), not linear modules; PEFT adapts
them through ``target_parameters`` (its ``ParamWrapper``: rank r per expert). A target of
``--lora-targets`` is either the last name of a linear module (``q_proj``) or the end of
such a parameter's name (``experts.gate_up_proj``, or ``gate_up_proj``). By default a run
adapts those of ``DEFAULT_TARGETS`` the model has, and every stacked expert parameter of
a mixture of experts: LoRA on attention alone leaves an MoE's MLPs, most of its weights,
untouched, and the experts are where a frozen base's bytes are (``--frozen-format mxfp4``
keeps gpt-oss's as they ship).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ramflow

from .._quiet import quiet_peft_wrap
from ..choices import FROZEN_FORMATS
from ..units.experts import is_experts_module

# attention and MLP projections of Llama-style models (Llama, Mistral, Qwen2, the presets)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def parse_targets(text: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``--lora-targets q_proj,v_proj,experts.down_proj`` as a tuple of names (None: the
    default); ``resolve_targets`` says which are modules and which expert parameters."""
    if text is None:
        return None
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("--lora-targets names no module: give names like q_proj,v_proj")
    return tuple(names)


@dataclass(frozen=True)
class LoraTargets:
    """Where a run's adapters go. See [Note: LoRA targets of a mixture of experts].

    Attributes:
        modules: last names of linear modules (PEFT's ``target_modules``).
        parameters: ends of stacked expert parameters' names (PEFT's ``target_parameters``).
    """

    modules: tuple[str, ...]
    parameters: tuple[str, ...]


def _expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The stacked 3-D parameters of ``model``'s experts modules, by full name."""
    return {
        f"{name}.{pname}": p
        for name, m in model.named_modules()
        if is_experts_module(m)
        for pname, p in m.named_parameters(recurse=False)
        if p.dim() == 3
    }


def _ends_with(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_targets(model: nn.Module, targets: Sequence[str] | None) -> LoraTargets:
    """Sort ``targets`` (``parse_targets``'s; None: the default) into linear modules and
    expert parameters of ``model`` (a meta-device model is enough). See [Note: LoRA
    targets of a mixture of experts].

    Raises:
        ValueError: a target names neither a linear module nor an expert parameter (the
            message lists those the model has); the default finds nothing to adapt.
    """
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    experts = _expert_parameters(model)
    short = sorted({".".join(name.rsplit(".", 2)[-2:]) for name in experts})
    if targets is None:
        found = LoraTargets(tuple(t for t in DEFAULT_TARGETS if t in linear), tuple(short))
        if not found.modules and not found.parameters:
            raise ValueError(
                f"the model has none of the default LoRA targets ({', '.join(DEFAULT_TARGETS)}); "
                f"name its linear modules with --lora-targets (it has {', '.join(linear)})"
            )
        return found
    modules = tuple(t for t in targets if t in linear)
    parameters = tuple(
        t for t in targets if t not in linear and any(_ends_with(n, t) for n in experts)
    )
    missing = [t for t in targets if t not in modules and t not in parameters]
    if missing:
        what = "linear module or stacked expert parameter" if short else "linear module"
        raise ValueError(
            f"--lora-targets: the model has no {what} named {', '.join(missing)}; its "
            f"linear modules are {', '.join(linear)}"
            + (f"; its expert parameters {', '.join(short)}" if short else "")
        )
    return LoraTargets(modules, parameters)


def check_lora_targets(model: nn.Module, targets: Sequence[str] | None) -> None:
    """Raise ValueError where ``resolve_targets`` does."""
    resolve_targets(model, targets)


def count_lora_parameters(model: nn.Module, *, rank: int, targets: Sequence[str] | None) -> int:
    """Parameters of the rank-``rank`` adapters that ``apply_lora`` would add to ``model``
    (a meta-device model is enough): A (rank x in) and B (out x rank) for each targeted
    linear module; for each targeted expert parameter (E, in, out), PEFT's rank per expert:
    A (E rank x in) and B (out x E rank)."""
    found = resolve_targets(model, targets)
    linear = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in found.modules
    )
    experts = sum(
        rank * p.shape[0] * (p.shape[1] + p.shape[2])
        for name, p in _expert_parameters(model).items()
        if any(_ends_with(name, t) for t in found.parameters)
    )
    return linear + experts


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
    found = resolve_targets(model, None if targets is None else tuple(targets))
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(found.modules) or None,
        target_parameters=list(found.parameters) or None,
        lora_dropout=0.0,
    )
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
    check_lora_targets(model, [*(config.target_modules or ()), *(config.target_parameters or ())])
    peft_model = _peft_on_device(model, config)
    load_adapters(peft_model, directory)
    return peft_model


__all__ = [
    "ADAPTER_CONFIG_FILE",
    "DEFAULT_TARGETS",
    "LoraTargets",
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
    "resolve_targets",
]
