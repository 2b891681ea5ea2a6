"""The seeded init's fill rate on the CPU (issue 30, point 5): elements per second per thread
and in total, and what one chunk costs, part by part.

``ramflow.train.initialization.SeededInit`` writes a preset's initial weights while the host
store is built (``ramflow.offload(model, weights=init)``). This measures that fill without
the rest of ``offload``: a Llama-shaped model (``--hidden``, ``--intermediate``, 32000
tokens, as many layers as make about ``--params`` elements) is built on the meta device,
and each unit (the embedding, each layer, the final norm with the head) gets a fresh
anonymous mapping of its own (``transfer.streams.map_host``, as ``HostStore.build`` makes a master,
so the fill pays the page faults), filled through ``MetaLoader.fill`` (the hook
``HostStore.build`` calls) and kept until the model is filled, as the store keeps them (so
every unit's pages are new ones, not the last unit's again; it needs the model's bytes of
RAM). Per ``--threads`` and ``--dtypes`` (bf16: a lean
master, drawn in fp32 and rounded to nearest; fp32), the best of ``--repeats``.

Before that, on one thread, the parts of one chunk of ``CHUNK_ELEMENTS``: the draw
(``normal_`` with a freshly seeded generator), its seed (``chunk_seed`` and the
generator), and the fp32 -> bf16 rounding (PyTorch's ``copy_`` on one intra-op thread; and
the native loop the fill uses, where it is built); and the fill's own cost per chunk
(Python, the GIL held), from a weight cut into 20000 chunks of 64 elements.

Prints a table and, with ``--out-dir``, writes ``seeded_init_rate.json`` and
``seeded_init_rate.md`` there. On a 2-core machine (about a minute)::

    python benchmarks/load/seeded_init_rate.py --threads 1,2 --params 5e8

GPU box (CPU only; 16-32 cores)::

    python benchmarks/load/seeded_init_rate.py --threads 1,8,16,32 --params 4e9 \\
        --out-dir $OUT/seeded-init-rate
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ramflow.io import loading as _loading  # noqa: E402
from ramflow.kernels import lean_kernels as _lean_kernels  # noqa: E402
from ramflow.train import initialization  # noqa: E402
from ramflow.train.initialization import CHUNK_ELEMENTS, SeededInit  # noqa: E402
from ramflow.transfer import streams as _streams  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VOCAB = 32000


def meta_llama(hidden: int, intermediate: int, params: float) -> nn.Module:
    """A Llama-shaped ``transformers`` model on the meta device with about ``params``
    elements (at least one layer)."""
    import transformers

    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((params - 2 * VOCAB * hidden) / per_layer))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def units_of(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each unit as the engine cuts a Llama: embedding, layers, head."""
    inner = model.model
    units = [list(inner.embed_tokens.parameters())]
    units += [list(layer.parameters()) for layer in inner.layers]
    units.append(list(inner.norm.parameters()) + list(model.lm_head.parameters()))
    return units


def fill_rate(model: nn.Module, dtype: torch.dtype, threads: int, repeats: int) -> dict:
    """Seconds to fill every unit of ``model`` through ``MetaLoader.fill`` (best of
    ``repeats``), each into a fresh mapping of its own."""
    units = units_of(model)
    numel = sum(p.numel() for u in units for p in u)
    init = SeededInit(model, seed=0, num_threads=threads)
    loader = _loading.MetaLoader(model, init)
    best = float("inf")
    try:
        for _ in range(repeats):
            seconds, masters = 0.0, []
            for params in units:
                n = sum(p.numel() for p in params)
                masters.append(_streams.map_host(n, dtype, what="a benchmark unit"))
                views, at = [], 0
                for p in params:
                    views.append(masters[-1][at : at + p.numel()].view(p.shape))
                    at += p.numel()
                t = time.perf_counter()
                loader.fill(params, views)
                seconds += time.perf_counter() - t
            best = min(best, seconds)
            del views, masters  # kept to the end, as the store keeps them: fresh pages
    finally:
        loader.close()
    return {
        "dtype": str(dtype).removeprefix("torch."), "threads": threads, "elements": numel,
        "seconds": best, "elements_per_s": numel / best,
        "elements_per_s_per_thread": numel / best / threads, "bf16_gb_per_s": 2 * numel / best / 1e9,
    }  # fmt: skip


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def components() -> dict[str, Any]:
    """One thread: the rates of the parts of one chunk."""
    x = torch.empty(CHUNK_ELEMENTS)
    x.zero_()
    init = SeededInit(nn.Linear(1, 1), seed=0, num_threads=1)
    draw_s = _best(
        lambda: x.normal_(
            0.0, 0.02, generator=torch.Generator().manual_seed(init.chunk_seed("w", 1))
        )
    )
    seed_s = _best(
        lambda: [torch.Generator().manual_seed(init.chunk_seed("model.layers.7.mlp.up_proj.weight", i))
                 for i in range(1000)]
    ) / 1000  # fmt: skip
    out = torch.empty(CHUNK_ELEMENTS, dtype=torch.bfloat16)
    out.zero_()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        round_s = _best(lambda: out.copy_(x))
    finally:
        torch.set_num_threads(threads)
    r = {
        "chunk_elements": CHUNK_ELEMENTS,
        "draw_elements_per_s": CHUNK_ELEMENTS / draw_s,
        "seed_us_per_chunk": seed_s * 1e6,
        "round_torch_elements_per_s": CHUNK_ELEMENTS / round_s,
    }
    native = getattr(_lean_kernels, "round_to_bf16_native", None)  # absent before 2026-11-27
    if native is not None and native(x[:16], out[:16]):
        r["round_native_elements_per_s"] = CHUNK_ELEMENTS / _best(lambda: native(x, out))
    # what the fill costs per chunk beside the work: chunks of 64 elements, one thread
    model, num_chunks = nn.Linear(64, 20000, bias=False), 20000
    tiny = SeededInit(model, seed=0, num_threads=1)
    initialization.CHUNK_ELEMENTS = 64
    try:
        for name, dtype in DTYPES.items():
            w = torch.empty(20000, 64, dtype=dtype)
            r[f"overhead_us_per_chunk_{name}"] = (
                _best(lambda w=w: tiny("weight", w), 3) / num_chunks * 1e6
            )
    finally:
        initialization.CHUNK_ELEMENTS = CHUNK_ELEMENTS
    return r


def markdown(doc: dict[str, Any]) -> str:
    c = doc["components"]
    lines = [
        f"# Seeded init fill rate ({doc['meta']['cpus']} CPUs, {doc['meta']['cpu']})",
        "",
        f"`{doc['meta']['command']}`, commit {doc['meta']['commit']}, torch "
        f"{doc['meta']['torch']} ({doc['meta']['capability']})",
        "",
        f"One thread, one chunk of {c['chunk_elements']:,} elements: draw "
        f"{c['draw_elements_per_s'] / 1e6:.0f} M/s; seed {c['seed_us_per_chunk']:.1f} us; "
        f"round to bf16 (torch, 1 thread) {c['round_torch_elements_per_s'] / 1e6:.0f} M/s"
        + (
            f"; native {c['round_native_elements_per_s'] / 1e6:.0f} M/s"
            if "round_native_elements_per_s" in c
            else ""
        )
        + f"; fill overhead per chunk (1 thread) {c['overhead_us_per_chunk_bf16']:.1f} us bf16, "
        f"{c['overhead_us_per_chunk_fp32']:.1f} us fp32",
        "",
        "| dtype | threads | elements (G) | s | G elem/s | M elem/s per thread | of the draw "
        "rate | GB/s bf16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["fills"]:
        share = r["elements_per_s_per_thread"] / c["draw_elements_per_s"]
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['elements'] / 1e9:.2f} | {r['seconds']:.2f} "
            f"| {r['elements_per_s'] / 1e9:.2f} | {r['elements_per_s_per_thread'] / 1e6:.0f} "
            f"| {share:.2f} | {r['bf16_gb_per_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default=f"1,{_loading.default_num_threads()}")
    p.add_argument("--params", type=float, default=5e8, help="elements of the model")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if any(t < 1 for t in threads):
        p.error(f"--threads takes positive counts, got {args.threads!r}")
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes takes {', '.join(DTYPES)}, got {', '.join(unknown)}")

    doc: dict[str, Any] = {
        "meta": {"command": " ".join(["python", *sys.argv]), "commit": _commit(),
                 "cpus": os.cpu_count(), "cpu": _cpu_name(), "torch": torch.__version__,
                 "capability": torch.backends.cpu.get_cpu_capability()},
        "components": components(), "fills": [],
    }  # fmt: skip
    model = meta_llama(args.hidden, args.intermediate, args.params)
    for name in args.dtypes.split(","):
        for n in threads:
            doc["fills"].append(fill_rate(model, DTYPES[name], n, args.repeats))
            print(markdown(doc).splitlines()[-1], flush=True)
    text = markdown(doc)
    print(text)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "seeded_init_rate.json").write_text(json.dumps(doc, indent=1))
        (args.out_dir / "seeded_init_rate.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
