"""Loading rate of ``ramflow.offload(model, weights=...)`` by source (issue 48, point 5), on
the CPU: GB/s of fp32-equivalent weights (4 bytes per parameter over the seconds) for a
Llama-shaped model of ``--params`` parameters built on the meta device.

Sources (``--sources``), each loaded in a fresh process of its own (fresh pages, no
caches of an earlier case), with ``--host-precision`` masters:

- ``seeded``: the presets' seeded init, ``SeededInit(model, seed=0)``;
- ``state-dict``: a state dict of fp32 CPU tensors already in memory (drawn untimed by the
  same init), given as ``weights=lambda name, out: out.copy_(state[name])``;
- ``safetensors``: the same weights written first (untimed) as one ``--file-dtype``
  safetensors file into ``--files-dir`` (/dev/shm: the page cache's speed, not a disk's);
- ``normal``: a plain weights function that calls ``out.normal_(0, 0.02)`` on the global
  generator, tensor after tensor (what a user's own random init does: one thread).

Each case reports the seconds of the ``offload`` call and of the fill inside it (the
``MetaLoader.fill`` calls), and the GB/s of each. ``--threads`` sets
``torch.set_num_threads`` and the loader's threads (``default_num_threads()`` reads the
CPU affinity, so the case runs under ``os.sched_setaffinity`` to that many CPUs).

On the 2-core machine (about a minute)::

    python benchmarks/load/load_rate.py --params 5e8

GPU box (16 cores; a 14B model is 56 GB of fp32 masters, so one source at a time)::

    python benchmarks/load/load_rate.py --params 1.4e10 --hidden 5120 --intermediate 13824 \\
        --sources seeded --host-precision lean
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VOCAB = 32000
SOURCES = ("seeded", "state-dict", "safetensors", "normal")


def meta_llama(args: argparse.Namespace):
    """A Llama-shaped ``transformers`` model on the meta device with about ``args.params``
    parameters (at least one layer)."""
    import torch
    import transformers

    hidden, intermediate = args.hidden, args.intermediate
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((args.params - 2 * VOCAB * hidden) / per_layer))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def state_dict_of(model, dtype) -> dict:
    """The seeded init's values of ``model``'s parameters as ordinary CPU tensors."""
    import torch

    from ramflow.train.initialization import SeededInit

    init = SeededInit(model, seed=0)
    state = {name: torch.empty(p.shape, dtype=dtype) for name, p in model.named_parameters()}
    init.write_many(list(state.items()))
    return state


def normal_init(name: str, out) -> None:
    """A user's plain random init: norms one, the rest ``normal_`` on the global generator."""
    if out.dim() == 1:
        out.fill_(1.0)
    else:
        out.normal_(0.0, 0.02)


def _cpu_s() -> float:
    """CPU seconds of this process so far, all threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """One source in this process."""
    import torch

    import ramflow
    from ramflow.io import loading

    torch.set_num_threads(args.threads)
    model = meta_llama(args)
    n = sum(p.numel() for p in model.parameters())
    if args.case == "seeded":
        from ramflow.train.initialization import SeededInit

        weights: Any = SeededInit(model, seed=0)
    elif args.case == "state-dict":
        state = state_dict_of(model, torch.float32)

        def weights(name: str, out: torch.Tensor) -> None:
            out.copy_(state[name])

    elif args.case == "safetensors":
        weights = args.file
    else:
        weights = normal_init
    fill_s = [0.0]
    fill = loading.MetaLoader.fill

    def timed_fill(self, *a, **k):
        t = time.perf_counter()
        fill(self, *a, **k)
        fill_s[0] += time.perf_counter() - t

    loading.MetaLoader.fill = timed_fill
    t, cpu = time.perf_counter(), _cpu_s()
    ramflow.offload(model, device="cpu", host_precision=args.host_precision, weights=weights)
    load_s, cpu_s = time.perf_counter() - t, _cpu_s() - cpu
    return {
        "source": args.case if args.case != "safetensors" else f"safetensors ({args.file_dtype})",
        "parameters": n, "host_precision": args.host_precision,
        "threads": args.threads, "load_s": load_s, "fill_s": fill_s[0], "cpu_s": cpu_s,
        "load_gb_per_s": 4 * n / load_s / 1e9, "fill_gb_per_s": 4 * n / fill_s[0] / 1e9,
    }  # fmt: skip


def write_file(args: argparse.Namespace, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.file_dtype]
    save_file(state_dict_of(meta_llama(args), dtype), str(path))


def _child(args: argparse.Namespace, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, __file__, *sys.argv[1:], *extra]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    return subprocess.run(
        argv, env=env, capture_output=True, text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=5e8, help="parameters of the model")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--sources", default="seeded,state-dict,safetensors,normal")
    p.add_argument("--host-precision", default="fp32", help="fp32, bf16, lean or kahan")
    p.add_argument("--file-dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--files-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--case", choices=(*SOURCES, "write-file"), help=argparse.SUPPRESS)
    p.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case == "write-file":
        write_file(args, args.file)
        return 0
    if args.case is not None:
        print(json.dumps(run_case(args)))
        return 0
    sources = args.sources.split(",")
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        p.error(f"--sources takes {', '.join(SOURCES)}, got {', '.join(unknown)}")
    file = args.files_dir / f"ramflow-load-rate-{os.getpid()}.safetensors"
    rows = []
    print(
        "| source | params (G) | masters | threads | load s | fill s | GB/s fp32-eq (load) | (fill) | CPU s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        for source in sources:
            extra = ["--case", source, "--file", str(file)]
            if source == "safetensors":
                done = _child(args, "--case", "write-file", "--file", str(file))
                if done.returncode != 0:
                    sys.stderr.write(done.stderr)
                    return 1
            done = _child(args, *extra)
            file.unlink(missing_ok=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(
                f"| {r['source']} | {r['parameters'] / 1e9:.2f} | {r['host_precision']} | {r['threads']} "
                f"| {r['load_s']:.2f} | {r['fill_s']:.2f} | {r['load_gb_per_s']:.2f} "
                f"| {r['fill_gb_per_s']:.2f} | {r['cpu_s']:.2f} |",
                flush=True,
            )
    finally:
        file.unlink(missing_ok=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
