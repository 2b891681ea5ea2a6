"""H2D and D2H copy rates of each kind of page-locked host memory, in one process.

Issue 16 left a 5% gap open: the 70B store streamed its int8 bytes at 47.8 GB/s, 0.87 of
the pinned rate measured beside it with PyTorch's pinned memory (54.7 GB/s). ramflow maps
its large host buffers itself and locks them with ``cudaHostRegister`` ([Note: pinned
memory of its own size] in ``ramflow.transfer.streams``). This benchmark times, round by round in
one process so that the link's drift falls on every kind alike:

* ``cuda_host_alloc``: ``torch.empty(..., pin_memory=True)`` (PyTorch's caching host
  allocator, ``cudaHostAlloc``);
* ``registered_4k``: an anonymous mapping of 4 KiB pages, locked in place
  (``cudaHostRegister``), as ``ramflow.transfer.streams.alloc_pinned`` did before huge pages;
* ``registered_thp``: the same mapping with ``MADV_HUGEPAGE`` (transparent 2 MiB pages),
  2 MiB-aligned, touched before it is locked;
* ``ramflow``: ``ramflow.transfer.streams.alloc_pinned`` as it is at this commit.

Each kind copies a ``--gib`` buffer to the GPU and back, as one copy and as pieces
(``--piece-mib``, the way a streaming engine copies units), ``--rounds`` times after a
second of warm-up; the rate is bytes over the time between two synchronizations.

    python benchmarks/pinned_memory/pinned_memory.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402

import harness  # noqa: E402
from ramflow.transfer import streams as _streams  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
HUGE = 2 * MiB


def anon_huge_pages_kib() -> int:
    """``AnonHugePages`` of this process, KiB (``/proc/self/smaps_rollup``), or -1."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def registered(nbytes: int, *, huge: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """``nbytes`` of an anonymous mapping locked with ``cudaHostRegister``; ``huge``:
    ``MADV_HUGEPAGE`` on a 2 MiB-aligned span, every page touched before locking."""
    span = nbytes + (HUGE if huge else 0)
    pages = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(pages, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE if huge else 0
    t = raw[start : start + nbytes]
    if huge:
        pages.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise MemoryError(f"cudaHostRegister error {int(err)}")
    return t, pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="buffer size per kind, GiB")
    parser.add_argument("--piece-mib", type=int, default=64, help="piece size, MiB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pinned_memory.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    nbytes = int(args.gib * GiB) // HUGE * HUGE
    piece = args.piece_mib * MiB
    thp_before = anon_huge_pages_kib()
    kinds: dict[str, torch.Tensor] = {}
    keep: list[Any] = []
    kinds["cuda_host_alloc"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    t, pages = registered(nbytes, huge=False)
    t.fill_(1)
    kinds["registered_4k"], _ = t, keep.append(pages)
    thp_mid = anon_huge_pages_kib()
    t, pages = registered(nbytes, huge=True)
    kinds["registered_thp"], _ = t, keep.append(pages)
    thp_after = anon_huge_pages_kib()
    kinds["ramflow"] = _streams.alloc_pinned(nbytes, torch.uint8, what="the benchmark").fill_(1)
    thp_ramflow = anon_huge_pages_kib()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def copy(host: torch.Tensor, *, h2d: bool, step: int) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for lo in range(0, nbytes, step):
                hi = min(lo + step, nbytes)
                if h2d:
                    dev[lo:hi].copy_(host[lo:hi], non_blocking=True)
                else:
                    host[lo:hi].copy_(dev[lo:hi], non_blocking=True)
        torch.cuda.synchronize(device)
        return nbytes / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:  # an idle link runs slower until it is busy
        copy(kinds["cuda_host_alloc"], h2d=True, step=nbytes)
    cases = [(d, s) for d in ("h2d", "d2h") for s in ("whole", "pieces")]
    rates: dict[str, dict[str, list[float]]] = {
        k: {f"{d}_{s}": [] for d, s in cases} for k in kinds
    }
    for _ in range(args.rounds):
        for name, host in kinds.items():
            for d, s in cases:
                step = nbytes if s == "whole" else piece
                rates[name][f"{d}_{s}"].append(copy(host, h2d=d == "h2d", step=step))
    thp_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {
        "device_name": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "commit": harness._commit(),
        "bytes_per_copy_set": nbytes,
        "piece_bytes": piece,
        "rounds": args.rounds,
        "transparent_hugepage": thp_mode.read_text().strip() if thp_mode.exists() else None,
        "anon_huge_pages_kib": {
            "before": thp_before,
            "after_registered_4k": thp_mid,
            "after_registered_thp": thp_after,
            "after_ramflow": thp_ramflow,
        },
        "rates_bytes_per_s": rates,
        "summary_gb_per_s": {
            k: {
                c: {"best": max(v) / 1e9, "median": statistics.median(v) / 1e9}
                for c, v in r.items()
            }
            for k, r in rates.items()
        },
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pinned_memory.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Pinned host memory kinds, {result['device_name']}",
        "",
        f"- command: `python benchmarks/pinned_memory/pinned_memory.py {' '.join(argv or sys.argv[1:])}`",
        f"- commit {result['commit']}; torch {result['torch_version']}; "
        f"{nbytes / GiB:.2f} GiB per kind, pieces of {args.piece_mib} MiB, {args.rounds} rounds",
        f"- transparent huge pages: {result['transparent_hugepage']}; AnonHugePages (KiB): "
        f"{result['anon_huge_pages_kib']}",
        "",
        "| kind | " + " | ".join(f"{d} {s} best / median (GB/s)" for d, s in cases) + " |",
        "| --- |" + " --- |" * len(cases),
    ]
    for k, r in result["summary_gb_per_s"].items():
        cells = [f"{r[f'{d}_{s}']['best']:.1f} / {r[f'{d}_{s}']['median']:.1f}" for d, s in cases]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (args.out_dir / "pinned_memory.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
