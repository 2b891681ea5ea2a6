"""Build ramflow's native CPU kernels into this machine's cache: ``python -m
ramflow.build_kernels`` (``make setup`` runs it), so that no training step waits for a build.

See [Note: building before the first step] in ``ramflow.kernels.cpu_kernels``. Where a CUDA device
and Triton are present, the lean device step's kernel is compiled as well (Triton keeps it
in its own per-machine cache). Exit status 0 also when native code is not used here (the
reason is printed; steps then run PyTorch's path with the same results); 1 when the build
failed.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    """Build (or find) the kernels and say where they are; the exit status."""
    from .kernels import cpu_kernels as _cpu_kernels

    start = time.perf_counter()
    if not _cpu_kernels.native_wanted():
        print("ramflow: native CPU kernels are not used here (disabled, or not x86-64)")
        return 0
    try:
        path = _cpu_kernels.build_library()
    except Exception as err:  # noqa: BLE001 - reported, and steps fall back to PyTorch
        print(f"ramflow: building the CPU kernels failed: {type(err).__name__}: {err}")
        return 1
    available = _cpu_kernels.native_kernel_available()
    print(
        f"ramflow: CPU kernels in {path} ({time.perf_counter() - start:.1f} s)"
        + ("" if available else f"; not used: {_cpu_kernels.NATIVE.reason}")
    )
    warmed = _warm_up_device_steps()
    if warmed:
        print(f"ramflow: compiled the lean device step for {warmed}")
    return 0


def _warm_up_device_steps() -> str:
    """Compile the lean device step for every lean preset on the current CUDA device;
    returns the presets compiled ("" without CUDA or Triton)."""
    import torch

    from .choices import HOST_PRECISION_PRESETS
    from .formats.host import HostPrecision
    from .kernels.lean_kernels import warm_up_device_step

    if not torch.cuda.is_available():
        return ""
    device = torch.device("cuda", torch.cuda.current_device())
    done = []
    for name in HOST_PRECISION_PRESETS:
        precision = HostPrecision.parse(name)
        if not precision.is_exact and warm_up_device_step(
            device,
            master_dtype=precision.master_format.dtype,
            state_dtype=precision.state_format.dtype,
            compensated=precision.master_format.compensated,
        ):
            done.append(name)
    return ", ".join(done)


if __name__ == "__main__":
    sys.exit(main())
