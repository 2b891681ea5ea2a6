"""Loading speed and host memory (issue 30, point 5): a 12-14B model built on the meta device,
loaded through ``ramflow.offload(weights=...)``, then trained for a few steps.

For each ``--shapes`` (default: ``llama-13b``, Llama-2-13B's shape, 13.0 B parameters; and
``neox-12b``, Pythia-12B's GPT-NeoX shape, 11.8 B, not Llama: fused QKV with biases,
LayerNorm, parallel residual), each case in a process of its own:

1. ``function``: offload with ``host_precision=--host-precision`` (lean) and the presets'
   ``SeededInit`` as ``weights=``;
2. ``safetensors``: the same weights written first (untimed, in a process of their own) as
   bf16 safetensors shards into ``--files-dir`` (default /dev/shm when it has room, else a
   folder under the system's temp directory, which the page cache then holds), then offload
   from that folder; the files are removed after.

Each case reports the seconds of the ``offload`` call and of the host store's build inside
it (``HostStore.build``: the fill, the wire copies, the page-locking it waits for), the rate
in GB/s of bf16 weights (2 bytes per parameter over the call's seconds: the target is 2 GB/s,
a 12-14B model in under 20 s), and the seconds spent page-locking on the locker thread
(overlapped with the fill); the peak RSS (VmHWM, reset before loading and again before
training) against the bound ``plan host bytes x 1.1 + 4 GiB`` (the plan's ``host_bytes``:
store and AdamW's states), and the smaps_rollup breakdown (Rss, Pss, Private and Shared,
Anonymous) of the largest RSS sampled every 0.25 s. Then (``--train-after``, default after
the function load) ``--steps`` training steps of ``--batch`` x ``--seq`` random tokens under
bf16 autocast with ``ramflow.optim.AdamW(keep_grads=False)`` (the gradient ring from the
first step, the store's steady state; ``--keep-grads`` measures a loop whose first step is
deferred, which the plan's ``host_deferred_bytes`` adds), activation checkpointing and
``--gpu-memory``; the step times and the training peak against the same bound.

The parent first builds the kernels (``python -m ramflow.build_kernels``, untimed). Cases
that would start after ``--budget-s`` are skipped and listed. Writes ``load_speed.json``,
``load_speed.md`` (the table) and ``load_speed.log`` (every process's output) into
``--out-dir``, rewritten after each case.

GPU box (16 cores, 128 GiB; about 5 minutes):

    PYTHONUNBUFFERED=1 python3 benchmarks/load/load_speed.py --out-dir $OUT/load-speed

CPU smoke test (tiny shapes, seconds):

    python benchmarks/load/load_speed.py --device cpu --shapes tiny-llama,tiny-neox \\
        --out-dir /tmp/load-speed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import harness  # noqa: E402
import measure  # noqa: E402

GIB = 2**30
SHARD_BYTES = 4 * GIB  # as Hugging Face's hubs shard: a few GiB per file
SHAPES = ("llama-13b", "neox-12b", "llama-1.1b", "tiny-llama", "tiny-neox")
BOUND_SHARE, BOUND_FIXED = 1.10, 4 * GIB  # peak RSS <= plan host bytes x 1.1 + 4 GiB


def model_config(shape: str):
    """The ``transformers`` config of ``shape`` (sdpa attention, no KV cache)."""
    import transformers

    if shape == "llama-13b":  # Llama-2-13B's config.json
        cfg = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
            num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
        )  # fmt: skip
    elif shape == "neox-12b":  # Pythia-12B's config.json
        cfg = transformers.GPTNeoXConfig(
            vocab_size=50688, hidden_size=5120, intermediate_size=20480, num_hidden_layers=36,
            num_attention_heads=40, max_position_embeddings=2048, rotary_pct=0.25,
            use_parallel_residual=True, tie_word_embeddings=False,
        )  # fmt: skip
    elif shape == "llama-1.1b":  # TinyLlama-1.1B's shape: the docs' CPU measurement
        cfg = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
        )  # fmt: skip
    elif shape == "tiny-llama":
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        )  # fmt: skip
    elif shape == "tiny-neox":
        cfg = transformers.GPTNeoXConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, tie_word_embeddings=False,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def meta_model(shape: str):
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(model_config(shape))


# ---------------------------------------------------------------- child: write the files


def write_files(shape: str, folder: Path) -> dict[str, Any]:
    """The seeded init's weights of ``shape`` in bf16 as safetensors shards and an index."""
    import torch
    from safetensors.torch import save_file

    from ramflow.train.initialization import SeededInit

    t0 = time.perf_counter()
    model = meta_model(shape)
    init = SeededInit(model, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    names = [n for n, _ in model.named_parameters()]  # a tied weight once

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name in names:
        p = model.get_parameter(name)
        t = torch.empty(p.shape, dtype=torch.bfloat16)
        init(name, t)
        shard[name] = t
        if sum(v.nbytes for v in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"write_s": time.perf_counter() - t0, "file_bytes": nbytes}


# ---------------------------------------------------------------- child: load and train


def _rollup() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")[0], line.split()[1]
        if key in ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean",
                   "Private_Dirty", "Anonymous"):  # fmt: skip
            out[key] = int(value) * 1024
    return out


class RssSampler:
    """The smaps_rollup sample of the largest RSS while it runs (every 0.25 s)."""

    def __init__(self) -> None:
        self.largest: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            sample = _rollup()
            if sample.get("Rss", 0) > self.largest.get("Rss", -1):
                self.largest = sample
            if self._stop.wait(0.25):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def load_and_train(args: argparse.Namespace, shape: str, source: str, files: str | None) -> dict:
    """One case in this process: offload ``shape`` from ``source``, then train if asked."""
    import torch

    import ramflow
    from ramflow.engine import host_store as _host_store
    from ramflow.train.initialization import SeededInit

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # time the page-locking on the locker thread and the host store's build
    locked_s, built_s = [0.0], [0.0]
    pin, build = _host_store.pin_in_place, _host_store.HostStore.build

    def timed_pin(*a, **k):
        t = time.perf_counter()
        pin(*a, **k)
        locked_s[0] += time.perf_counter() - t

    def timed_build(self, *a, **k):
        t = time.perf_counter()
        build(self, *a, **k)
        built_s[0] += time.perf_counter() - t

    _host_store.pin_in_place = timed_pin
    _host_store.HostStore.build = timed_build
    if cuda:
        torch.ones(1, device=device)  # the CUDA context is part of the baseline
    model = meta_model(shape)
    n_params = sum(p.numel() for p in model.parameters())
    weights = SeededInit(model, seed=0) if source == "function" else files
    rss_before = measure.proc_status_bytes("VmRSS")
    measure.reset_peak_rss()
    t0 = time.perf_counter()
    with RssSampler() as sampler:
        ramflow.offload(
            model, device=device, gpu_memory=args.gpu_memory if cuda else None,
            host_precision=args.host_precision, activation_checkpointing=True, weights=weights,
        )  # fmt: skip
    load_s = time.perf_counter() - t0
    del weights
    plan = ramflow.get_plan(model)
    bound = int(plan.host_bytes * BOUND_SHARE + BOUND_FIXED)
    r: dict[str, Any] = {
        "shape": shape, "source": source, "parameters": n_params,
        "host_precision": plan.host_precision.name, "load_s": load_s, "build_s": built_s[0],
        "lock_s": locked_s[0], "gb_per_s": 2 * n_params / load_s / 1e9,
        "rss_before_bytes": rss_before, "load_peak_rss_bytes": measure.proc_status_bytes("VmHWM"),
        "load_rollup_at_peak": sampler.largest, "plan_host_bytes": plan.host_bytes,
        "plan_host_deferred_bytes": plan.host_deferred_bytes, "bound_bytes": bound,
        "plan": plan.describe(), "num_threads": os.cpu_count(),
    }  # fmt: skip
    print(plan.describe(), flush=True)
    if source not in args.train_after:
        return r
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=args.keep_grads)
    vocab = model.config.vocab_size
    ids_BT = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator())
    ids_BT = ids_BT.to(device)
    measure.reset_peak_rss()
    steps = []
    with RssSampler() as sampler:
        for _ in range(args.steps):
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids_BT, labels=ids_BT).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ramflow.synchronize(model)
            steps.append(time.perf_counter() - t)
            print(f"step {len(steps)}: {steps[-1]:.2f} s, loss {loss.item():.3f}", flush=True)
    r.update(step_s=steps, train_peak_rss_bytes=measure.proc_status_bytes("VmHWM"),
             train_rollup_at_peak=sampler.largest, keep_grads=args.keep_grads)  # fmt: skip
    if cuda:
        r["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return r


# ---------------------------------------------------------------- parent


def _files_dir(args: argparse.Namespace, need: int) -> Path:
    if args.files_dir is not None:
        return Path(args.files_dir)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.1:
        return shm / f"ramflow-load-speed-{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"ramflow-load-speed-{os.getpid()}"


def _child(args: argparse.Namespace, what: list[str], log, timeout_s: float) -> dict | None:
    """Run this script's ``--_child`` in a new process; its last JSON line, or None."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--_child", json.dumps(what)]
    try:
        proc = subprocess.run(cmd, env=harness.child_env(), capture_output=True, text=True,
                              timeout=max(1.0, timeout_s))  # fmt: skip
        out, status = proc.stdout + proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as err:
        out, status = f"{err.stdout or ''}{err.stderr or ''}", "timeout"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    log.write(f"===== {' '.join(map(str, what))} ({status})\n{out}\n")
    log.flush()
    lines = [ln for ln in out.splitlines() if ln.startswith("LOAD_SPEED ")]
    if not lines:
        return {"error": status, "tail": out[-2000:]}
    return json.loads(lines[-1][len("LOAD_SPEED ") :])


def _g(x: float | None, unit: float = GIB, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x / unit, fmt)


def markdown(doc: dict[str, Any]) -> str:
    rows = [
        f"# Loading speed and host memory ({doc['meta']['device']})",
        "",
        f"`{doc['meta']['command']}`, commit {doc['meta']['commit']}; bound = plan host "
        "bytes x 1.1 + 4 GiB; GiB throughout",
        "",
        "| shape | source | params (B) | load s | GB/s bf16 | build s | lock s | plan host "
        "| bound | load peak | train peak | steps s | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["cases"]:
        if "load_s" not in r:
            rows.append(f"| {r.get('shape')} | {r.get('source')} | | | | | | | | | | | "
                        f"{r.get('error', 'skipped')} |")  # fmt: skip
            continue
        peaks = [r["load_peak_rss_bytes"], r.get("train_peak_rss_bytes") or 0]
        ok = r["gb_per_s"] >= 2.0 and max(peaks) <= r["bound_bytes"]
        steps = ", ".join(f"{s:.1f}" for s in r.get("step_s", []))
        rows.append(
            f"| {r['shape']} | {r['source']} | {r['parameters'] / 1e9:.2f} | {r['load_s']:.1f} "
            f"| {r['gb_per_s']:.2f} | {r['build_s']:.1f} | {r['lock_s']:.1f} "
            f"| {_g(r['plan_host_bytes'])} | {_g(r['bound_bytes'])} "
            f"| {_g(r['load_peak_rss_bytes'])} | {_g(r.get('train_peak_rss_bytes'))} "
            f"| {steps or '-'} | {'yes' if ok else 'NO'} |"
        )
    if doc.get("writes"):
        rows.append("")
    for w in doc.get("writes", []):
        rows.append(f"- files of {w['shape']}: {_g(w.get('file_bytes'))} GiB written in "
                    f"{w.get('write_s', 0):.0f} s to {w.get('dir')}")  # fmt: skip
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--shapes", default="llama-13b,neox-12b")
    p.add_argument("--sources", default="function,safetensors")
    p.add_argument("--train-after", default="function", help="sources whose load trains")
    p.add_argument("--host-precision", default="lean")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-memory", default="24GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--keep-grads", action="store_true")
    p.add_argument("--files-dir", default=None)
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.train_after = args.train_after.split(",")
    if args.device == "cpu":
        args.seq = min(args.seq, 64)

    if args._child is not None:  # ------------------------------------ a child process
        what = json.loads(args._child)
        if what[0] == "write":
            result = write_files(what[1], Path(what[2]))
        else:
            result = load_and_train(args, what[1], what[2], what[3])
        print("LOAD_SPEED " + json.dumps(result, default=str), flush=True)
        return 0

    start = time.perf_counter()
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", *sys.argv])
    doc: dict[str, Any] = {
        "meta": {"device": harness.device_name(), "commit": harness._commit(),
                 "command": command, "cpus": os.cpu_count()},
        "cases": [], "writes": [],
    }  # fmt: skip

    def save() -> None:
        (out_dir / "load_speed.json").write_text(json.dumps(doc, indent=1, default=str))
        (out_dir / "load_speed.md").write_text(markdown(doc))

    with open(out_dir / "load_speed.log", "a") as log:
        t = time.perf_counter()
        build = subprocess.run([sys.executable, "-m", "ramflow.build_kernels"],
                               env=harness.child_env(), capture_output=True, text=True)  # fmt: skip
        log.write(f"===== build_kernels ({time.perf_counter() - t:.0f} s)\n{build.stdout}"
                  f"{build.stderr}\n")  # fmt: skip
        for shape in args.shapes.split(","):
            for source in args.sources.split(","):
                left = args.budget_s - (time.perf_counter() - start)
                if left <= 0:
                    doc["cases"].append({"shape": shape, "source": source,
                                         "error": "skipped: out of --budget-s"})  # fmt: skip
                    save()
                    continue
                files = None
                if source == "safetensors":
                    n = sum(p.numel() for p in meta_model(shape).parameters())
                    folder = _files_dir(args, 2 * n)
                    w = _child(args, ["write", shape, str(folder)], log, left) or {}
                    doc["writes"].append({"shape": shape, "dir": str(folder), **w})
                    files = str(folder)
                    left = args.budget_s - (time.perf_counter() - start)
                r = _child(args, ["load", shape, source, files], log, left)
                doc["cases"].append({"shape": shape, "source": source, **(r or {})})
                if files is not None:
                    shutil.rmtree(files, ignore_errors=True)
                save()
                print(markdown(doc).splitlines()[-1], flush=True)
    save()
    print((out_dir / "load_speed.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
