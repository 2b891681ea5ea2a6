"""``ramflow train``, ``generate`` and ``plan`` as a library: train causal language models
on real text with ramflow's offloading engine, sample from them, and plan their memory.

Needs ``transformers`` (the ``hf`` extra). The modules, one concept each:
``presets`` (model shapes), ``tokenizer``, ``data`` (corpus and resumable batches),
``modeling`` (building and loading models), ``precision`` (device and dtypes),
``estimate`` (memory plans on the meta device), ``lr_schedule``, ``run_checkpoint`` (a run's
checkpoints: weights, optimizer states, data position),
``report`` (progress, log, plot), ``config`` (a run's settings), ``setup`` (the checks
before a run), ``trainer`` (the loop), ``profile`` (``ramflow profile``), ``generation``
and ``hf_trainer`` (Hugging Face's ``Trainer`` on the unit-major step order).

May import: the public surface (``ramflow``), ``compat`` and every folder below them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and the layout test
    from .config import TrainConfig, resume_config
    from .estimate import MemoryEstimate, estimate_run_memory
    from .generation import Generation, SamplingConfig, generate, load_for_generation
    from .hf_trainer import UnitMajorTrainer, UnitMajorTrainerMixin
    from .presets import PRESETS, ModelPreset, get_preset
    from .run_checkpoint import Checkpoint, CheckpointError, open_checkpoint
    from .setup import plan_run
    from .trainer import TrainResult, train

# public name -> its module. The names load on first use (PEP 562), as ``ramflow``'s do, so
# that the command's parser can read ``presets`` (no PyTorch) before anything heavy loads.
_WHERE = {
    **dict.fromkeys(["TrainConfig", "resume_config"], "config"),
    **dict.fromkeys(["MemoryEstimate", "estimate_run_memory"], "estimate"),
    **dict.fromkeys(
        ["Generation", "SamplingConfig", "generate", "load_for_generation"], "generation"
    ),
    **dict.fromkeys(["UnitMajorTrainer", "UnitMajorTrainerMixin"], "hf_trainer"),
    **dict.fromkeys(["PRESETS", "ModelPreset", "get_preset"], "presets"),
    **dict.fromkeys(["Checkpoint", "CheckpointError", "open_checkpoint"], "run_checkpoint"),
    "plan_run": "setup",
    **dict.fromkeys(["TrainResult", "train"], "trainer"),
}

__all__ = [
    "PRESETS",
    "Checkpoint",
    "CheckpointError",
    "Generation",
    "MemoryEstimate",
    "ModelPreset",
    "SamplingConfig",
    "TrainConfig",
    "TrainResult",
    "UnitMajorTrainer",
    "UnitMajorTrainerMixin",
    "estimate_run_memory",
    "generate",
    "get_preset",
    "load_for_generation",
    "open_checkpoint",
    "plan_run",
    "resume_config",
    "train",
]
assert sorted(_WHERE) == sorted(__all__)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ramflow.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
