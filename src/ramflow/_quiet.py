"""Messages of other packages that are not about the user's run, silenced by their exact text.

[Note: quiet imports]
A command's output is the user's: every line should be about their run. Some packages
that ramflow's dependencies import print lines at import time that are about their own
installation instead. Each is silenced here by a filter that matches that one message and
nothing else, so a new message, or the same message in a case where it matters, still
shows:

- torchao's wheel carries CUDA kernels (``torchao/_C*.so``). With a CPU build of torch
  they cannot load, and ``import torchao`` logs "Failed to load ..." for each; dropped only
  when torch has no CUDA (on a CUDA build the same line means a broken install).
  ``transformers`` imports torchao whenever it is installed, so every ``--model`` run and
  every ``generate`` met these lines once the test extra was installed.
- torch logs that registering an Enum as a pytree constant is deprecated; torchao does it
  at import for two of its enums. Dropped only for classes of torchao's own modules.
- PEFT reads ``model.is_gradient_checkpointing``, which transformers deprecates with a
  ``FutureWarning``. ``quiet_peft_wrap`` hides it around ramflow's own ``get_peft_model``
  calls only, where the user wrote no PEFT code.

The logging filters are installed when this module is imported, which ``import ramflow``
does before anything imports torchao; they sit on the emitting loggers only. docs/design.md ("Quiet output") says why filters
rather than keeping test-only packages out of the environment.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator

_TORCHAO_EXTENSION = re.compile(r"^Failed to load \S*torchao[/\\]_C\S*\.so: ")
_PYTREE_ENUM = "%s is an Enum subclass and is now natively supported by torch.compile"
_PEFT_CHECKPOINTING = r"`is_gradient_checkpointing` is deprecated"


def _torch_has_cuda() -> bool:
    torch = sys.modules.get("torch")
    return torch is None or getattr(torch.version, "cuda", None) is not None


def _is_torchao_extension_on_cpu_torch(record: logging.LogRecord) -> bool:
    return bool(_TORCHAO_EXTENSION.match(record.getMessage())) and not _torch_has_cuda()


def _is_torchao_pytree_enum(record: logging.LogRecord) -> bool:
    if not (isinstance(record.msg, str) and record.msg.startswith(_PYTREE_ENUM)):
        return False
    args = record.args if isinstance(record.args, tuple) else ()
    module = getattr(args[0], "__module__", "") if args else ""
    return module == "torchao" or module.startswith("torchao.")


class _DropMessage(logging.Filter):
    """Drops the records ``known`` recognises; lets every other record through."""

    def __init__(self, known: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.known(record)


_FILTERS = {
    "torchao": _DropMessage(_is_torchao_extension_on_cpu_torch),
    "torch.utils._pytree": _DropMessage(_is_torchao_pytree_enum),
}


def install() -> None:
    """Install the logging filters of [Note: quiet imports] (idempotent)."""
    for name, drop in _FILTERS.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Inside, transformers' FutureWarning about ``is_gradient_checkpointing``, which PEFT
    reads when it wraps a model, is not shown. See [Note: quiet imports]."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_CHECKPOINTING, category=FutureWarning)
        yield


install()  # at ``import ramflow``, which imports this module first

__all__ = ["install", "quiet_peft_wrap"]
