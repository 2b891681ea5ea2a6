"""``ramflow train``, ``generate`` and ``plan`` as a library: train causal language models
on real text with ramflow's offloading engine, sample from them, and plan their memory.

Needs ``transformers`` (the ``hf`` extra). The modules, one concept each:
``presets`` (model shapes), ``tokenizer``, ``data`` (corpus and resumable batches),
``modeling`` (building and loading models), ``precision`` (device and dtypes),
``estimate`` (memory plans on the meta device), ``lr_schedule``, ``run_checkpoint`` (a run's
checkpoints: weights, optimizer states, data position),
``report`` (progress, log, plot), ``config`` (a run's settings), ``setup`` (the checks
before a run), ``trainer`` (the loop), ``profile`` (``ramflow profile``) and ``generation``.

May import: the public surface (``ramflow``), ``compat`` and every folder below them.
"""

from .config import TrainConfig, resume_config
from .estimate import MemoryEstimate, estimate_run_memory
from .generation import Generation, SamplingConfig, generate, load_for_generation
from .presets import PRESETS, ModelPreset, get_preset
from .run_checkpoint import Checkpoint, CheckpointError, open_checkpoint
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
    "estimate_run_memory",
    "generate",
    "get_preset",
    "load_for_generation",
    "open_checkpoint",
    "plan_run",
    "resume_config",
    "train",
]
