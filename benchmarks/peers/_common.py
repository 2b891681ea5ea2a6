"""What every peer script shares: arguments, the model, the timing loop, the result line.

A peer script is runnable alone from the repository root, e.g.::

    python benchmarks/peers/ramtorch_offload.py --mode train --batch 4 --keep checkpoint

and prints one JSON line (its last line of output) with ``system``, ``variant``, ``mode`` and,
for training, ``batch``, ``step_s``, ``peak_bytes``; for inference a ``rows`` list with one
entry per batch size. If the peer cannot run here (not installed, needs CUDA) it prints
``{"skipped": true, "reason": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent.parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--mode", choices=("train", "infer"), default="train")
    p.add_argument("--model", choices=("reference", "llama-3b"), default="reference")
    p.add_argument("--tiny", action="store_true", help="small model (CPU smoke test)")
    p.add_argument("--batch", type=int, default=4, help="training batch")
    p.add_argument("--batches", default="1,8", help="inference batches, comma-separated")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    return p


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result, default=str), flush=True)


def skip(reason: str) -> None:
    emit({"skipped": True, "reason": reason})
    sys.exit(0)


def require(module: str) -> Any:
    """Import a peer's package or skip with the reason."""
    try:
        return __import__(module)
    except Exception as err:  # noqa: BLE001 - any import failure means this peer cannot run
        skip(f"cannot import {module}: {type(err).__name__}: {err}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """torch.distributed's env:// variables for a world of one process."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def run(main) -> None:
    """Run ``main(args)`` and print its result; print the traceback and exit 1 on failure."""
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
