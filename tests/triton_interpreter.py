"""Triton kernels on the CPU: a test module's check run in Triton's interpreter.

``TRITON_INTERPRET=1`` is read when a kernel is defined (at import), so the check runs in a
child process that imports the test module with the variable set. The check is a function
of the module taking the device name and returning what differed (empty: all bits equal);
marked ``gpu``, the same function runs on the compiled kernel in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreted_mismatches(module: str, check: str) -> list[str]:
    """``module.check("cpu")`` with Triton's interpreter, in a child process: the lines
    it returned. Skips the test where Triton is not installed.

    Raises:
        AssertionError: the child failed otherwise than by returning mismatches.
    """
    pytest.importorskip("triton", reason="Triton is installed by the dev extra on Linux x86-64")
    code = (
        f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; "
        f"print('\\n'.join(t.{check}('cpu')))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if line.strip()]
