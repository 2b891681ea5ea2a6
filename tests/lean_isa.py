"""Running the native lean step in one instruction set, for the tests that compare them."""

from __future__ import annotations

import pytest

from ramflow.kernels import lean_kernels as _lean_kernels

LEAN_ISAS = ["avx512", "avx2", "scalar"]


def use_lean_isa(isa: str, monkeypatch) -> None:
    """Caps the native lean step at ``isa``; skips where this CPU or build cannot run it."""
    if not _lean_kernels.lean_kernel_available():
        pytest.skip("the native lean kernels are not available here")
    monkeypatch.setenv("RAMFLOW_LEAN_ISA", isa)
    if _lean_kernels.lean_isa() != isa:
        pytest.skip(f"this CPU runs the lean step in {_lean_kernels.lean_isa()}, not {isa}")
