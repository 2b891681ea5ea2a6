"""``--model org/name``: a Hugging Face Hub model id, found in the local Hub cache.

ramflow never downloads: a run must not stall or fail halfway on a network, and a GPU box
often has none. A model id is looked up in the cache that ``hf download`` and
``from_pretrained`` fill (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``: ``models--org--name/snapshots/<revision>/`` with
``refs/main`` naming the revision), through ``huggingface_hub.snapshot_download(...,
local_files_only=True)``; when it is not there, the error says the command that downloads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# what a Hub id looks like (org/name); a path that exists is always taken as a path
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(model: str | os.PathLike) -> bool:
    """Whether ``model`` is meant as a Hub id: ``org/name`` that is not an existing path."""
    text = str(model)
    return bool(_HUB_ID.match(text)) and not Path(text).exists()


def resolve_hub_model(model: str | os.PathLike, *, revision: str | None = None) -> Path:
    """The local folder of ``model``: itself when it is a path, else the cached snapshot of
    the Hub id ``org/name`` (``revision``: a branch, tag or commit; default ``main``).

    Args:
        model: a folder, or a Hub id such as ``Qwen/Qwen3-0.6B``.
        revision: which snapshot of a Hub id.

    Returns:
        The folder (for a Hub id: ``.../models--org--name/snapshots/<commit>``).

    Raises:
        FileNotFoundError: a Hub id that is not in the local cache (the message gives the
            ``hf download`` command and the cache searched); a relative path ``a/b`` that
            does not exist reads as one, and the message says it is no folder either.
        ValueError: a Hub id without the ``huggingface_hub`` package.
    """
    if not looks_like_hub_id(model):
        return Path(model)
    repo_id = str(model)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ModuleNotFoundError:
        raise ValueError(
            f"--model {repo_id}: a Hub id needs the huggingface_hub package (pip install "
            "'ramflow[hf]'), or give a local model folder"
        ) from None
    cache = os.environ.get("HF_HUB_CACHE", HF_HUB_CACHE)  # read now: tests and users set it late
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"--model {repo_id}: no such folder, and not in the Hugging Face cache ({cache}); "
            f"ramflow does not download: run `hf download {repo_id}` first (or give a local "
            "model folder)"
        ) from None


__all__ = ["looks_like_hub_id", "resolve_hub_model"]
