"""RamTorch's documented API on ramflow: change the import lines, keep the code.

=================================================  ==========================================
RamTorch                                           here
=================================================  ==========================================
``from ramtorch import Linear, AdamW``             ``from ramflow.compat.ramtorch import ...``
``ramtorch.helpers.replace_linear_with_ramtorch``  ``ramflow.compat.ramtorch.helpers``
``ramtorch.zero1.create_zero_param_groups``        ``ramflow.compat.ramtorch.zero1``
``ramtorch.zero1.broadcast_zero_params``           ``ramflow.compat.ramtorch.zero1``
``ramtorch.zero2.setup_grad_sharding_hooks``       ``ramflow.compat.ramtorch.zero2``
=================================================  ==========================================

Differences that show: master weights stay fp32 (``dtype`` and ``.to(dtype)`` choose the
dtype on the wire and on the GPU); optimizer states are fp32; gradients are reduced under
ZeRO-1 too (RamTorch reduces them only with the ZeRO-2 hooks), summed, as RamTorch's loops
expect (they divide the loss by the world size); the device defaults to the CPU where
CUDA is not available, so the same script runs in CI.
"""

from . import helpers, zero1, zero2
from .linear import Linear
from .optim import AdamW

__all__ = ["AdamW", "Linear", "helpers", "zero1", "zero2"]
