"""CPU optimizers over the master weights of offloaded models: ``ramflow.optim.*``.

``AdamW``, ``SGD``, ``Lion``, ``Adafactor`` and ``Muon`` are ``torch.optim.Optimizer``
subclasses. This folder owns them and what they share (``HostOptimizer``: param groups over
offloaded and plain parameters, the engine's step hooks, per-unit state buffers).

May import: ``layers``, ``engine`` and everything below them.
"""

from .adafactor import Adafactor
from .adamw import SGD, AdamW
from .host_optimizer import HostOptimizer
from .lion import Lion
from .muon import Muon, muon_param_groups

__all__ = ["Adafactor", "AdamW", "HostOptimizer", "Lion", "Muon", "SGD", "muon_param_groups"]
