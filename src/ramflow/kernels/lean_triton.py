"""The lean AdamW step as one fused GPU kernel (Triton), for units stepped on the device.

``ramflow.offload(device_optimizer=True)`` steps the units the GPU budget leaves room for
on the device, in their host format (see [Note: the optimizer on the device] in
``engine.device_stepper``). The PyTorch-ops version of the lean step (``kernels.lean_kernels._step_torch``)
launches about 30 kernels per piece and made a device-stepped step slower than a
host-stepped one (docs/speed.md, "The lean step on the device"). This kernel
reads the gradient, master and states once and writes them once, like the CPU kernel.

[Note: the same bits on the GPU]
The kernel computes [Note: lean formats, one pass] of ``kernels.lean_kernels`` in the same order,
with the same roundings, so a device step gives the host step's bits:

* no fused multiply-adds: launched with ``enable_fp_fusion=False`` (Triton contracts
  ``a * b + c`` by default);
* the square root and the two divisions correctly rounded (``tl.sqrt_rn``, ``tl.div_rn``;
  Triton's ``/`` on fp32 is the approximate ``div.full``);
* the stochastic rounding's random bits from the same counter-based hash of (key, element
  index), in uint32 arithmetic;
* 8-bit codes converted to and from FP8 E4M3 by the native code's integer operations
  (``[Note: FP8 conversions in bits]`` in ``lean_kernels.cpp``), not Triton's fp8 casts,
  so the interpreter (CPU tests) and every GPU give c10's bits; the block scales'
  exponents from the bits of the blocks' absmax.

One program takes ``_ROWS`` blocks of 256 elements (an 8-bit block's scale comes from a
row's max). Triton is imported on first use; where it is missing (CPU-only PyTorch) or the
tensors are not on a CUDA device, ``lean_adamw_step_`` keeps the PyTorch path.
``RAMFLOW_DISABLE_TRITON=1`` keeps it too (for comparisons).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_ROWS = 4  # blocks of 256 per program: 1024 elements, 4 warps
_ENV_DISABLE = "RAMFLOW_DISABLE_TRITON"


@functools.cache
def _kernel():
    """The jitted kernel, or None where Triton cannot be imported."""
    try:
        from .lean_triton_kernel import lean_adamw_kernel
    except ImportError:
        return None
    return lean_adamw_kernel


def available(device: torch.device) -> bool:
    """Whether lean steps of tensors on ``device`` run this kernel."""
    if device.type != "cuda" or os.environ.get(_ENV_DISABLE, "") not in ("", "0"):
        return False
    return _kernel() is not None


def lean_adamw_step(
    master,
    grad,
    exp_avg,
    exp_avg_sq,
    compensation,
    m_scale,
    v_scale,
    wire_out,
    *,
    master_format,
    state_format,
    key,
    counter_offset,
    grad_scale,
    apply_decay,
    c,
    block,
) -> None:
    """One lean step on CUDA tensors, checked by ``kernels.lean_kernels.lean_adamw_step_`` (the
    tensors and scalars of its ``_step_torch``; the formats: its ``_MASTER_*`` and
    ``_STATE_FORMAT`` codes; ``block``: the 8-bit block, ``QBLOCK``)."""
    dev = master.device
    dummy = master  # for the pointers a format does not read
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        # one row per group of the kernel's parameters (pointers, sizes, hyperparameters,
        # constants), as its signature lays them out
        _kernel()[(-(-master.numel() // (_ROWS * block)),)](
            master, compensation if compensation is not None else dummy, grad,
            exp_avg, exp_avg_sq,
            m_scale if m_scale is not None else dummy,
            v_scale if v_scale is not None else dummy,
            wire_out if wire_out is not None else dummy,
            master.numel(), counter_offset, key,
            c["decay"], c["beta1"], c["one_minus_beta1"], c["beta2"], c["one_minus_beta2"],
            c["bc2_sqrt"], c["eps"], c["neg_step_size"], grad_scale,
            MASTER=master_format, STATE=state_format,
            WIRE=_WIRE[None if wire_out is None else wire_out.dtype],
            APPLY_SCALE=grad_scale != 1.0, APPLY_DECAY=bool(apply_decay),
            ROWS=_ROWS, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip


_WIRE = {None: 0, torch.bfloat16: 1, torch.float16: 2}
