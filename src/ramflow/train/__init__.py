"""``ramflow train``, ``generate`` and ``plan`` as a library: train causal language models
on real text with ramflow's offloading engine, sample from them, and plan their memory.

Needs ``transformers`` (the ``hf`` extra). The modules, one concept each:
``presets`` (model shapes), ``tokenizer``, ``data`` (corpus and resumable batches),
``modeling`` (building and loading models), ``precision`` (device and dtypes),
``estimate`` (memory plans on the meta device), ``schedule`` (LR), ``checkpoint``,
``report`` (progress, log, plot), ``config`` (a run's settings), ``setup`` (the checks
before a run), ``trainer`` (the loop), ``profile`` (``ramflow profile``) and ``generation``.
"""

from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .config import TrainConfig, resume_config
from .estimate import MemoryEstimate, estimate_memory
from .generation import Generation, SamplingConfig, generate, load_for_generation
from .presets import PRESETS, ModelPreset, get_preset
from .setup import plan_run
from .trainer import TrainResult, train

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
    "estimate_memory",
    "generate",
    "get_preset",
    "load_for_generation",
    "open_checkpoint",
    "plan_run",
    "resume_config",
    "train",
]
