"""The lazy loader of a family of native entry points built into the ``kernels.cpu_kernels``
library (the lean steps, Muon's passes). See ``KernelLibrary``."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

from .cpu_kernels import ENV_DISABLE, build_library

__all__ = ["KernelLibrary"]


class KernelLibrary:
    """The native library of one family of entry points (the lean steps, Muon's passes):
    built and loaded once per process, on the first ``get()``, or None where PyTorch's ops
    run instead; ``reason`` says why. A subclass declares its entry points' types in
    ``_declare(lib)`` (and may check them there, returning None to fall back) and says
    what a build failure costs in ``_on_build_error``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self.lib: ctypes.CDLL | None = None
        self.reason = ""

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (build and check it on the first call)."""
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self.lib = self._load()
                    self._loaded = True
        return self.lib

    def _load(self) -> ctypes.CDLL | None:
        if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
            self.reason = f"{ENV_DISABLE} is set"
            return None
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self.reason = f"it is only verified on x86-64, not {platform.machine()}"
            return None
        try:
            lib = ctypes.CDLL(build_library())
        except Exception as err:  # any build failure means: use PyTorch, do not crash
            self.reason = f"it could not be built ({type(err).__name__}: {err})"
            self._on_build_error(err)
            return None
        return self._declare(lib)

    def _declare(self, lib: ctypes.CDLL) -> ctypes.CDLL | None:
        raise NotImplementedError

    def _on_build_error(self, err: Exception) -> None:
        raise NotImplementedError
