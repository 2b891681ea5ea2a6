"""Building and loading causal language models on the host, before ``ramflow.offload``.

Models are ``transformers`` ``AutoModelForCausalLM`` instances in fp32 on the CPU, of any
architecture that ``transformers`` knows: a preset is built from its config with a seeded
random initialisation (``SeededInit``: the same weights whether one process builds it
resident, ``build_model``, or it is drawn unit by unit into the host store by one process
or N ranks, ``build_offloaded``); a checkpoint folder (config plus safetensors, what
``save_pretrained`` or ``ramflow train`` writes) is first checked against the config from
the file headers alone. ``load_offloaded`` (the CLI's way) builds the model on the meta
device and reads the files into ``ramflow.offload``'s host store unit by unit, so no full
fp32 model exists first; ``load_model`` reads them by ``transformers``' own
``from_pretrained`` into a resident model (for ``ramflow profile`` and references). Both
convert the checkpoint's names as for that architecture and tie tied weights.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ramflow

from ..formats.mxfp4 import checkpoint_shape
from ..io.loading import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    checkpoint_key_mapper,
    file_in,
    load_resident,
    open_safetensors,
    packed_pairs,
    weight_files,
)
from .initialization import SeededInit
from .presets import get_preset
from .tokenizer import Tokenizer


def read_config(directory: str | os.PathLike):
    """The ``transformers`` config stored in ``directory/config.json``.

    Raises:
        FileNotFoundError: the folder or its ``config.json`` is missing.
        ValueError: the config cannot be read or is not a causal language model.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"model folder {d} does not exist")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"{d} has no config.json; --model needs a Hugging Face checkpoint folder"
        )
    from transformers import AutoConfig

    try:
        # an absolute name_or_path: a LoRA run's adapter_config.json names its base by it
        config = AutoConfig.from_pretrained(str(d.resolve()), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot read {d / 'config.json'}: {err}") from err
    return config


def model_config(*, preset: str | None, model_dir: str | os.PathLike | None, tokenizer: Tokenizer):
    """The config of the model to train: the preset's (sized for ``tokenizer``) or the folder's.

    Raises:
        ValueError: both or neither of ``preset`` and ``model_dir``; an unknown preset; a
            tokenizer with more tokens than the model's embedding has rows.
        FileNotFoundError: ``model_dir`` or its config is missing.
    """
    if (preset is None) == (model_dir is None):
        raise ValueError("give either a preset or a model folder (--preset or --model), not both")
    if preset is not None:
        return get_preset(preset).to_config(
            vocab_size=tokenizer.vocab_size,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
    config = read_config(model_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model in {model_dir} has "
            f"only {config.vocab_size} embedding rows; give the model's own tokenizer (--tokenizer DIR)"
        )
    return config


def meta_model(config) -> nn.Module:
    """The model of ``config`` on the meta device: shapes only, no memory."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as err:
        raise ValueError(f"{type(config).__name__} is not a causal language model: {err}") from err


def build_model(config, *, seed: int) -> nn.Module:
    """A freshly initialised fp32 model of ``config`` on the CPU, resident: the weights
    ``SeededInit(model, seed=seed)`` draws (see [Note: a seeded init that does not depend
    on who fills it] in ``ramflow.train.initialization``), the same as ``build_offloaded``
    gives an offloaded model on one process or on N ranks.

    Raises:
        ValueError: ``config`` is not a causal language model, or has parameters the
            seeded init has no rule for.
    """
    model = meta_model(config)
    return load_resident(model, SeededInit(model, seed=seed))


def build_offloaded(
    config, *, seed: int, requires_grad: bool = True, **offload_options: Any
) -> nn.Module:
    """A freshly initialised model of ``config``, offloaded: built on the meta device and
    given ``SeededInit(model, seed=seed)``'s weights unit by unit as ``ramflow.offload``
    builds the host store (with ``zero_stage``, each rank draws the units it owns into the
    host's shared copy). No full fp32 model exists first; the weights are ``build_model``'s.

    Args:
        config: a ``transformers`` config of a causal language model.
        seed: the seed of the initial weights.
        requires_grad: False freezes every parameter before offloading.
        offload_options: keyword arguments of ``ramflow.offload`` (not ``weights``).

    Returns:
        The offloaded model, in train mode.

    Raises:
        ValueError: see ``build_model``; MemoryError, ValueError: see ``ramflow.offload``.
    """
    model = meta_model(config).requires_grad_(requires_grad)
    ramflow.offload(model, weights=SeededInit(model, seed=seed), **offload_options)
    model.train()
    return model


def _expected_tensors(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes of the persistent state of ``model``, and the names that may be absent
    because they share storage with another entry (a tied head)."""
    expected: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    seen: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        expected[name] = tuple(t.shape)
        if id(t) in seen:
            optional.add(name)
        else:
            seen[id(t)] = name
    return expected, optional


def check_weights(directory: str | os.PathLike, config) -> None:
    """Check, from the safetensors headers only, that ``directory`` holds every tensor of
    the model of ``config`` with the right shape.

    Raises:
        FileNotFoundError: no weights (see ``weight_files``).
        ValueError: a file is unreadable; tensors are missing or have other shapes (the
            message lists them: the weights belong to another model shape).
    """
    model = meta_model(config)
    expected, optional = _expected_tensors(model)
    to_model_key = checkpoint_key_mapper(model)
    found: dict[str, tuple[int, ...] | None] = {}  # None: converted, shape not checked here
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            for key in f.keys():
                name, converted = to_model_key(key)
                found[name] = None if converted else tuple(f.get_slice(key).get_shape())
    # gpt-oss's experts as MXFP4 pairs (see [Note: packed MXFP4 tensors in a checkpoint])
    for name, (blocks, scales) in packed_pairs(found, expected).items():
        pair = (found.pop(blocks), found.pop(scales))
        found[name] = None if None in pair else checkpoint_shape(*pair) or pair
    wrong = [
        f"{k}: file {found[k]}, model {shape}"
        for k, shape in expected.items()
        if found.get(k) is not None and found[k] != shape
    ]
    missing = [k for k in expected if k not in found and k not in optional]
    if wrong or missing:
        lines = wrong[:5] + [f"{k}: missing" for k in missing[:5]]
        more = len(wrong) + len(missing) - len(lines)
        raise ValueError(
            f"the weights in {directory} do not fit the model of its config "
            f"({config.num_hidden_layers} layers, hidden size {config.hidden_size}, vocab "
            f"{config.vocab_size}): another model shape, or an incomplete checkpoint.\n  "
            + "\n  ".join(lines)
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def load_model(directory: str | os.PathLike, *, config=None) -> nn.Module:
    """Read a checkpoint folder into an fp32 model on the CPU, one tensor at a time.

    Args:
        directory: a folder with ``config.json`` and safetensors weights.
        config: the config to build (default: the folder's own).

    Returns:
        The model in train mode, parameters fp32 on the CPU.

    Raises:
        FileNotFoundError, ValueError: see ``read_config`` and ``check_weights``.
    """
    from transformers import AutoModelForCausalLM

    config = read_config(directory) if config is None else config
    check_weights(directory, config)
    weight_files(directory)  # safetensors only: never a pickle
    from transformers.utils import logging as hf_logging

    # ramflow prints its own lines; a second bar would break them in a file or pipe
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(directory),
            config=config,
            **_dequantized_mxfp4(config),
            dtype=torch.float32,
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
        )
    except (OSError, RuntimeError) as err:
        raise ValueError(f"cannot load the weights in {directory}: {err}") from err
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    missing = [k for k in info.get("missing_keys", ()) if k]
    mismatched = list(info.get("mismatched_keys", ()))
    if missing or mismatched:
        raise ValueError(
            f"the weights in {directory} do not fit the model of its config: "
            + ", ".join([*(f"{k}: missing" for k in missing[:5]), *map(str, mismatched[:5])])
        )
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None:
        assert head.weight is embed.weight, "the tied head was not tied to the embedding"
    unexpected = list(info.get("unexpected_keys", ()))
    if unexpected:
        warnings.warn(
            f"{directory}: ignored {len(unexpected)} tensors the model does not have "
            f"(e.g. {unexpected[0]})",
            stacklevel=2,
        )
    model.train()
    return model


def _dequantized_mxfp4(config) -> dict[str, Any]:
    """``from_pretrained``'s keyword that dequantizes a gpt-oss checkpoint's MXFP4 experts
    on the CPU (transformers would fetch GPU kernels from the Hub otherwise), where the
    config says they are MXFP4; else none."""
    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if str(getattr(method, "value", method)) != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _needs_conversion(directory: str | os.PathLike, model: nn.Module) -> bool:
    """Whether some tensors of ``directory`` become ``model``'s only through
    ``transformers``' weight conversion (several checkpoint tensors make one)."""
    to_model_key = checkpoint_key_mapper(model)
    for path in weight_files(directory):
        with open_safetensors(path) as f:
            if any(to_model_key(key)[1] for key in f.keys()):
                return True
    return False


def load_offloaded(
    directory: str | os.PathLike,
    *,
    config=None,
    requires_grad: bool = True,
    **offload_options: Any,
) -> nn.Module:
    """Read a checkpoint folder straight into ``ramflow.offload``'s host store, unit by unit.

    The model is built on the meta device and offloaded with ``weights=directory`` (see
    [Note: loading without a full-precision peak] in ``ramflow.io.loading``): the host never
    holds a full fp32 model beside the store; with ``zero_stage`` in ``offload_options``
    every rank reads the units it owns into its host's shared copy (see [Note: loading once
    per host] in ``ramflow.distributed.zero``). A checkpoint that only ``transformers``' weight
    conversion turns into the model's tensors (stacked experts) is loaded by ``load_model``
    first instead (on every rank, under ``zero_stage``).

    Args:
        directory: a folder with ``config.json`` and safetensors weights.
        config: the config to build (default: the folder's own).
        requires_grad: False freezes every parameter before offloading (a frozen base for
            LoRA, or inference with compressed frozen weights).
        offload_options: keyword arguments of ``ramflow.offload`` (not ``weights``).

    Returns:
        The offloaded model, fp32 master weights, in train mode.

    Raises:
        FileNotFoundError, ValueError: see ``read_config`` and ``check_weights``;
            MemoryError, ValueError: see ``ramflow.offload``.
    """
    config = read_config(directory) if config is None else config
    check_weights(directory, config)
    model = meta_model(config).requires_grad_(requires_grad)
    if _needs_conversion(directory, model):
        model = load_model(directory, config=config).requires_grad_(requires_grad)
        ramflow.offload(model, **offload_options)
    else:
        ramflow.offload(model, weights=directory, **offload_options)
    model.train()
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters' elements (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = [
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX_FILE",
    "build_model",
    "build_offloaded",
    "check_weights",
    "count_parameters",
    "file_in",
    "load_model",
    "load_offloaded",
    "meta_model",
    "model_config",
    "read_config",
    "weight_files",
]
