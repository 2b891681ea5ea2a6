"""The small corpus of the benchmarks' CPU ``--smoke`` runs.

``ramflow train`` without ``--data`` tokenizes the whole standard library (about 30 MB, tens
of seconds on 2 cores, in every process that builds the corpus); a smoke run checks the
pipeline, not the model, so it trains on a few standard library modules instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def smoke_corpus(out_dir: Path) -> Path:
    """Write ``out_dir/smoke-corpus.txt`` (about 500 KB of Python source) and return its path."""
    text = "".join(Path(m.__file__).read_text() for m in (argparse, json.decoder, json.encoder))
    path = out_dir / "smoke-corpus.txt"
    path.write_text(text * 4)
    return path
