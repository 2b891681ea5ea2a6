"""The ``ramflow`` command: it parses options and calls ``ramflow.train``; no logic of its own.

May import: everything.
"""

from .main import main

__all__ = ["main"]
