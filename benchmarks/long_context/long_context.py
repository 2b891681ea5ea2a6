"""Long context on one GPU (issue 32, point 3): a Llama-3.1-8B shape, full fine-tune, lean host
formats, batch 1, with and without activation offload, in one process.

Legend: B = sequences per step (1), T = tokens per sequence, L = layers, D = model width.

The model (preset ``llama-8b``; ``--tiny``: a 2-layer Llama on the CPU for the smoke test) is
built on the meta device and offloaded once with ``ramflow.offload(host_precision="lean",
activation_checkpointing=CheckpointOffload(), gpu_memory=<ramflow's smallest plan>)``: every
layer streams, so that the activations get the rest of the GPU (at these lengths a step is
tens of seconds of compute and the weights' copies hide under it). The loss is
``ramflow train``'s (``chunk_lm_head``, ``lm_loss``). Each run is one sequence length and one
mode: ``offload`` (the layers' inputs in pinned host memory) or ``on`` (checkpointing alone:
the engine's ``BoundaryOffloader.enabled = False``), timed on the host between
``torch.cuda.synchronize`` calls.

What runs, in this order, while ``--budget-s`` allows (each run's time is predicted from the
plan, scaled by what earlier runs measured, plus the pinned pool's warm-up; a run that would
not fit the budget is skipped and listed): a warm-up step at a short length; the toolkit
lengths (``--toolkit``, default 8k, 32k and 128k) in both modes; then for each mode, offload
first, the ladder (``--ladder``) from the plan's predicted longest length upward while it
fits, downward from one that does not (lengths already run are not run again).

Before each run the cached pinned blocks are given back (``release_pinned_cache``: another
length's boundaries, rounded to another power of two, are of no use and would add up), and a
run whose plan needs more host RAM than is available (``MemoryEstimate.ram_needed_bytes``
against MemAvailable plus the process's own RSS) is not started: it is recorded as "host RAM:
plan X GiB, available Y GiB" and counts as not fitting for the ladder. Runs up to 32k time 2
steps (the second timed), longer ones 1, the first at that length; before an offload run the
pinned blocks its step will take (the plan's layer inputs, each rounded to a power of two) are
allocated and freed through PyTorch's caching host allocator (``warm_pinned_pool``), so the
timed step reuses them as a training run's second step does, instead of paying
``cudaHostAlloc`` (16 GiB at 64k) inside the timer; the table says which step was timed, and
the json counts the pinned blocks the timed step still created (``pinned_allocs_in_step``).

Reported per run: step time, tokens/s, model TFLOP/s (``ramflow.train.flops.
model_flops_per_token``, the count of ramflow's MFU: 6 x matmul parameters x tokens, plus
attention: 6 x L x D x T per token for causal attention's two products, forward and backward;
recomputation not counted), peak GPU memory (``max_memory_allocated``) against the plan's
``device_total_bytes``, peak host RSS (VmHWM, reset before each run) against the plan's
``ram_needed_bytes``, the plan's predicted step (``ramflow.train.estimate.predict_plan_step``
with this run's measured matmul, pinned copy and CPU AdamW rates) and the errors. Then the
longest length that fits per mode (over every run of it) and the memory toolkit's rows
(docs/memory.md): what offload saves and costs at each toolkit length, or that checkpointing
alone does not fit there. Writes ``long_context.json``, ``long_context.md`` and
``long_context.log`` into ``--out-dir`` after every run (``long_context_report.py`` builds the
table).

GPU box (H100 80 GB; about 7 minutes, ``--budget-s 420`` by default; the files are rewritten
after every run, so a time limit still leaves the runs done):

    PYTHONUNBUFFERED=1 timeout 475 python3 benchmarks/long_context/long_context.py --out-dir $OUT/long-context

Several runs' results as one report (a (mode, T) in several files: the later one that ran;
plans recorded before the host figures existed are recomputed):

    python benchmarks/long_context/long_context.py --merge A/long_context.json B/long_context.json \
        --toolkit 8192,32768,131072 --out-dir DIR

CPU smoke test (seconds): ``python benchmarks/long_context/long_context.py --tiny --out-dir DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH / "long_context"), str(BENCH.parent / "src")]

from ramflow.cli.main import default_allocator_settings  # noqa: E402

# the CUDA allocator `ramflow train` runs with (expandable segments unless the user set
# PYTORCH_CUDA_ALLOC_CONF), set before torch allocates; recorded in the meta
ALLOC_CONF = default_allocator_settings(os.environ)

import long_context_report as report  # noqa: E402
import torch  # noqa: E402
from long_context_report import GIB, MODES  # noqa: E402

import measure  # noqa: E402
from measure import matmul_rate, pinned_bandwidth  # noqa: E402
from models import random_init  # noqa: E402

TINY_LADDER = (128, 256, 512, 1024)


def model_config(tiny: bool, longest: int):
    """The run's ``transformers`` config; ``max_position_embeddings`` raised to ``longest``
    where the ladder goes past it (llama3 rope scaling is computed per position; past the
    model's 131072 only the speed and memory mean anything)."""
    if tiny:
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=longest,
            tie_word_embeddings=False, attn_implementation="sdpa",
        )  # fmt: skip
    else:
        from ramflow.train.presets import get_preset

        cfg = get_preset("llama-8b").to_config()
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, longest)
    cfg.use_cache = False
    return cfg


class Plans:
    """The plan's figures for each (mode, T): ``estimate_memory`` with no cap (ramflow's plan
    streams every unit, as the run's does) and its predicted step at the measured rates. The
    host figure is the whole process's RAM (``MemoryEstimate.ram_needed_bytes``), whose
    pinned layer inputs ``ActivationProfile.offloaded_bytes(pinned=True)`` rounds up to a
    power of two each (``transfer.streams.caching_host_block_bytes``) as the caching host allocator
    takes them; ``pool_block_bytes`` x ``pool_blocks`` is that pool, which the run warms."""

    def __init__(self, cfg, rates, matmul: float | None, host_precision: str, device_type: str):
        self.cfg, self.rates, self.matmul = cfg, rates, matmul
        self.host_precision, self.device_type = host_precision, device_type
        self._cache: dict[tuple[str, int], dict] = {}

    def __call__(self, mode: str, seq: int) -> dict:
        from ramflow.train.estimate import RunDescription, estimate_run_memory, predict_plan_step
        from ramflow.transfer.streams import caching_host_block_bytes

        key = (mode, seq)
        if key not in self._cache:
            est = estimate_run_memory(
                self.cfg, run=RunDescription(1, seq, model_name="llama-8b", precision="bf16"),
                device_type="cuda", compute_dtype=torch.bfloat16, wire_dtype=torch.bfloat16,
                device_budget_bytes=None, checkpointing=mode,
                host_precision=self.host_precision,
            )  # fmt: skip
            pred = predict_plan_step(
                self.cfg, est, timing_rates=self.rates, matmul_flops_per_s=self.matmul
            )
            offload = est.activation_offload
            self._cache[key] = {
                "device_total_bytes": est.device_total_bytes,
                "ramflow_bytes": est.plan.planned_bytes,
                "host_bytes": est.ram_needed_bytes,
                "host_pinned_bytes": est.host_pinned_bytes,
                "host_activation_pinned_bytes": est.host_activation_pinned_bytes,
                "pool_block_bytes": (
                    caching_host_block_bytes(est.activations.layer_input_bytes) if offload else 0
                ),
                "pool_blocks": len(est.activations.layer_bytes) if offload else 0,
                "step_s": pred.step_s,
                "bound": pred.bound,
                "offload_bytes": pred.offload_bytes,
            }
        return self._cache[key]


def train_step(model, opt, ids_BT: torch.Tensor) -> None:
    """One training step of the offloaded LM on token ids (B, T) int64 on its device:
    ``ramflow train``'s chunked loss (``lm_loss``) under bf16 autocast, backward, the
    optimizer's step; on CUDA it returns after ``torch.cuda.synchronize``."""
    from ramflow.train.loss import lm_loss

    with torch.autocast(ids_BT.device.type, dtype=torch.bfloat16):
        loss = lm_loss(model, ids_BT)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if ids_BT.is_cuda:
        torch.cuda.synchronize(ids_BT.device)


def _write(out: Path, result: dict) -> None:
    (out / "long_context.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "long_context.md").write_text(report.markdown(result))


def host_ram_available() -> int:
    """Bytes of RAM this process may hold: what the kernel calls available (MemAvailable,
    through psutil) plus what the process holds already (VmRSS), since a run's plan counts
    the whole process (host store, runtime) and not only what it adds. ``$RAMFLOW_HOST_RAM``,
    where set, is taken as the whole budget (``ramflow.engine.host_store.host_ram_available``)."""
    from ramflow.engine.host_store import HOST_RAM_ENV
    from ramflow.engine.host_store import host_ram_available as ramflow_available

    if os.environ.get(HOST_RAM_ENV, "").strip():
        return ramflow_available()
    return ramflow_available() + (measure.proc_status_bytes("VmRSS") or 0)


def release_pinned_cache() -> bool:
    """Give PyTorch's cached pinned blocks back (``torch.accelerator.empty_host_cache``, or
    the older ``torch._C._host_emptyCache``): a length's boundaries (rounded to a power of
    two) are no use to another length, and kept they add up (run 1 of 2026-11-27: 8k, 32k and
    128k's 42 GiB, and 163840's 64 GiB, over a 125 GiB host). False where neither exists."""
    gc.collect()
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is None:
        return False
    empty()
    return True


def pinned_allocs() -> int | None:
    """Pinned blocks PyTorch's caching host allocator has created so far (``cudaHostAlloc``
    calls); None without CUDA or without ``torch.cuda.host_memory_stats``."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return torch.cuda.host_memory_stats().get("num_host_alloc")


def warm_pinned_pool(block_bytes: int, count: int) -> float:
    """Allocate ``count`` pinned blocks of ``block_bytes`` at once through PyTorch's caching
    host allocator (the one ``BoundaryOffloader`` takes its buffers from) and free them: the
    allocator keeps them, so the step that follows reuses them instead of paying
    ``cudaHostAlloc`` inside the timed step (the warm-up's seconds are recorded: its rate on
    the box is not yet measured), as a
    training run's second step does. Seconds taken."""
    t = time.perf_counter()
    blocks = [torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    del blocks
    return time.perf_counter() - t


def _rates(
    pinned: dict,
    matmul: float | None,
    cpu_params_per_s: float | None,
    cpu_rate_format: str = "fp32",
):
    """``ramflow.planner.predict.Rates`` from the run's measured copy rates and CPU optimizer rate;
    the defaults (the H200 box's) for what was not measured. ``cpu_rate_format``: the host
    formats the rate is of: "fp32" (ramflow's AdamW from torch's fused one,
    ``rows.measured_rates``' rule; the plan converts it to the run's formats by
    ``planner.cpu_rates.OPTIMIZER_SPEED``), or the run's own formats' one-pass rate
    (``cpu_optimizer_runner._host_format_rates``, as ``host_formats_scale.py`` measures it),
    taken as it is."""
    from ramflow import HostPrecision
    from ramflow.planner.cpu_rates import optimizer_speed
    from ramflow.planner.predict import RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM, Rates

    rates = Rates()
    if pinned.get("h2d"):
        rates = dataclasses.replace(
            rates, h2d_bytes_per_s=pinned["h2d"], d2h_bytes_per_s=pinned["d2h"],
            both_bytes_per_s=pinned["both"],
        )  # fmt: skip
    if cpu_params_per_s:
        rates = dataclasses.replace(rates, cpu_optimizer_params_per_s=cpu_params_per_s)
        if cpu_rate_format != "fp32":  # the copies' DRAM rate stays the fp32 kernel's
            formats = HostPrecision.parse(cpu_rate_format)
            rates = dataclasses.replace(
                rates,
                cpu_optimizer_dram_bytes_per_param=RAMFLOW_ADAMW_DRAM_BYTES_PER_PARAM
                / optimizer_speed(formats),
                host_precision=formats,
            )
    return rates


def _cpu_rate(host_precision: str) -> tuple[float, str]:
    """The CPU optimizer's rate for the run's host formats, parameters per second, and the
    formats it is of. fp32: ramflow's AdamW from torch's fused CPU AdamW. The lean formats:
    their own one-pass step over 2**27 parameters with all threads (the constants that
    convert fp32's rate to theirs lag the kernels: on 2026-11-28 the plan at 8k tokens, where
    the CPU step binds, was 44-47% pessimistic with them)."""
    from ramflow.planner.predict import ramflow_adamw_rate

    if host_precision == "fp32":
        return ramflow_adamw_rate(measure.cpu_adamw_rate(1 << 27)), "fp32"
    import cpu_optimizer_runner

    dram = measure.dram_copy_bandwidth()
    rates = cpu_optimizer_runner._host_format_rates(1 << 27, {"steps": 3}, dram)
    return rates[host_precision]["params_per_s"], host_precision


def merge(paths: list[str], out: Path, toolkit: list[int] | None) -> int:
    """``--merge``: several runs' ``long_context.json`` as one report in ``out``. Runs
    recorded before the plan had host figures get their plan recomputed by this code at the
    run's recorded rates (the meta says so)."""
    results = [json.loads(Path(x).read_text()) for x in paths]
    lengths = toolkit or sorted({t for x in results for t in x["meta"].get("toolkit", [])})
    merged = report.merge_results(results, lengths or [8192, 32768, 131072])
    meta = merged["meta"]
    stale = [x for x in merged["runs"] if "host_bytes" not in x["plan"]]
    if stale:
        from harness import _commit

        cfg = model_config(meta["model"] == "tiny", max(x["seq"] for x in merged["runs"]))
        rates = _rates(
            meta["pinned"], meta["matmul_flops_per_s"], meta.get("cpu_params_per_s"),
            meta.get("cpu_rate_format", "fp32"),
        )  # fmt: skip
        plans = Plans(cfg, rates, meta["matmul_flops_per_s"], meta["host_precision"], "cuda")
        for run in stale:
            run["plan"] = plans(run["mode"], run["seq"])
        meta["plans_recomputed"] = f"{len(stale)} runs' plans recomputed at commit {_commit()}"
        meta["commits"].append(f"plans {_commit()}")
    out.mkdir(parents=True, exist_ok=True)
    _write(out, merged)
    print((out / "long_context.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--ladder", default="32768,65536,98304,131072,163840")
    p.add_argument("--toolkit", default=None, help="lengths of the table rows (8192,32768,131072)")
    p.add_argument("--host-precision", default="lean")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting runs after this")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama on the CPU (smoke test)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' json, run nothing")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    toolkit_arg = sorted(int(x) for x in args.toolkit.split(",")) if args.toolkit else None
    if args.merge:
        return merge(args.merge, out, toolkit_arg)
    t_start = time.perf_counter()
    ladder = sorted(int(x) for x in args.ladder.split(","))
    toolkit = toolkit_arg or [8192, 32768, 131072]
    if args.tiny:
        ladder, toolkit = list(TINY_LADDER), [128, 512]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "long_context.log", "a")  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    import psutil

    import ramflow
    from harness import _commit
    from ramflow.memory import CheckpointOffload
    from ramflow.train.flops import model_flops_per_token
    from ramflow.train.loss import chunk_lm_head

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cuda = device.type == "cuda"
    cfg = model_config(args.tiny, max(ladder + toolkit))
    matmul = matmul_rate(device)
    bw = pinned_bandwidth(device)
    cpu_rate, cpu_rate_format = _cpu_rate(args.host_precision) if cuda else (None, "fp32")
    plans = Plans(
        cfg, _rates(bw, matmul, cpu_rate, cpu_rate_format), matmul, args.host_precision,
        device.type,
    )  # fmt: skip
    free = torch.cuda.mem_get_info(device)[0] if cuda else None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    chunk_lm_head(model)
    n_params = sum(q.numel() for q in model.parameters())
    share = plans("offload", ladder[0])["ramflow_bytes"]
    result: dict = {
        "meta": {
            "date": date.today().isoformat(), "host": platform.node(),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "commit": _commit(),
            "model": "tiny" if args.tiny else "llama-8b", "parameters": n_params,
            "host_precision": args.host_precision, "gpu_free_bytes": free,
            "host_ram_bytes": psutil.virtual_memory().total,
            "ramflow_share_bytes": share, "matmul_flops_per_s": matmul, "pinned": bw,
            "cpu_params_per_s": cpu_rate, "cpu_rate_format": cpu_rate_format,
            "toolkit": toolkit, "ladder": ladder,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "cuda_alloc_conf": ALLOC_CONF,
        },
        "runs": [], "longest": {}, "skipped": [],
    }  # fmt: skip
    say(f"long context: {result['meta']['model']} on {result['meta']['device']}")
    t0 = time.perf_counter()
    ramflow.offload(
        model, device=device, gpu_memory=share if cuda else None, wire_dtype=torch.bfloat16,
        host_precision=args.host_precision, activation_checkpointing=CheckpointOffload(),
        weights=random_init,
    )  # fmt: skip
    result["load_s"] = time.perf_counter() - t0
    say(f"loaded in {result['load_s']:.1f} s\n{ramflow.get_plan(model).describe()}")
    offloader = ramflow.api._engine(model).checkpointer.boundary_offloader
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False)
    gen = torch.Generator().manual_seed(0)
    # measured over predicted step times so far: the budget scales predictions by the
    # largest (1.2 before any run has said); the pool's warm-up by its measured s/GiB
    ratios: list[float] = []
    warm_s_per_gib: list[float] = []

    def step(seq: int) -> None:
        ids_BT = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen).to(device)
        train_step(model, opt, ids_BT)

    def run(mode: str, seq: int) -> dict:
        plan = plans(mode, seq)
        steps = 2 if seq <= 32768 or args.tiny else 1
        record = {"mode": mode, "seq": seq, "plan": plan, "fits": None}
        pool_bytes = plan["pool_block_bytes"] * plan["pool_blocks"] if cuda else 0
        left = args.budget_s - (time.perf_counter() - t_start)
        warm = pool_bytes / GIB * max(warm_s_per_gib, default=1.0)
        need = steps * plan["step_s"] * max(ratios, default=1.2) + warm
        if cuda and need > left:
            record["skipped"] = f"skipped: about {need:.0f} s left {left:.0f} s of the budget"
            result["skipped"].append(f"{mode} at {seq}: {record['skipped']}")
            return record
        offloader.enabled = mode == "offload"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            record["pinned_cache_released"] = release_pinned_cache()
        available = host_ram_available()
        record["host_available_bytes"] = available
        if plan["host_bytes"] > available:
            record.update(
                fits=False,
                reason=f"host RAM: plan {plan['host_bytes'] / GIB:.1f} GiB, available "
                f"{available / GIB:.1f} GiB",
            )
            say(f"{mode} at {seq}: not started ({record['reason']})")
            return record
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        measure.reset_peak_rss()
        if pool_bytes:  # See warm_pinned_pool: the timed step reuses these blocks
            record["pool_bytes"] = pool_bytes
            record["pool_warm_s"] = warm_pinned_pool(plan["pool_block_bytes"], plan["pool_blocks"])
            warm_s_per_gib.append(record["pool_warm_s"] / (pool_bytes / GIB))
        times = []
        try:
            for _ in range(steps):
                allocs = pinned_allocs()
                t = time.perf_counter()
                step(seq)
                times.append(time.perf_counter() - t)
                if allocs is not None:
                    record["pinned_allocs_in_step"] = pinned_allocs() - allocs
        except torch.OutOfMemoryError as err:
            record.update(fits=False, reason="out of memory", error=str(err).splitlines()[0])
        else:
            record.update(fits=True, step_s=times[-1], steps_run=steps, first_step_s=times[0])
            record["tokens_per_s"] = seq / times[-1]
            flops = seq * model_flops_per_token(model, seq_len=seq)  # ramflow's MFU count
            record["model_flops_per_s"] = flops / times[-1]
            ratios.append(times[-1] / plan["step_s"])
        if record["fits"] is False:
            opt.zero_grad(set_to_none=True)
            ramflow.accept_partial_step(model)
        record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
        record["peak_host_bytes"] = measure.proc_status_bytes("VmHWM")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        fate = f"fits, {record['step_s']:.2f} s" if record["fits"] else "out of memory"
        say(f"{mode} at {seq}: {fate}")
        return record

    done: dict[tuple[str, int], dict] = {}

    def once(mode: str, seq: int) -> dict:
        if (mode, seq) not in done:
            done[(mode, seq)] = run(mode, seq)
            result["runs"].append(done[(mode, seq)])
            _write(out, result)
        return done[(mode, seq)]

    step(min(ladder + toolkit) // 4 or 1)  # warm-up: kernels, allocator, the host worker
    for seq in toolkit:  # the table's rows first: the ladder reuses them
        for mode in MODES:
            once(mode, seq)
    for mode in MODES:
        usable = free if free is not None else float("inf")
        predicted = [s for s in ladder if plans(mode, s)["device_total_bytes"] <= usable]
        start = predicted[-1] if predicted else ladder[0]
        fits, failed = None, None
        k = ladder.index(start)
        while 0 <= k < len(ladder):  # a run that does not fit, for the GPU or the host RAM
            r = once(mode, ladder[k])
            if r["fits"] is None:
                break
            if r["fits"]:
                fits = ladder[k] if fits is None else max(fits, ladder[k])
                if failed is not None:
                    break
                k += 1
            else:
                failed = ladder[k] if failed is None else min(failed, ladder[k])
                if fits is not None:
                    break
                k -= 1
        result["longest"][mode] = report.longest(
            result["runs"], mode, predicted[-1] if predicted else None
        )
        _write(out, result)
    result["toolkit_rows"] = report.toolkit_rows(
        result["runs"], toolkit, result["meta"]["model"], free
    )
    result["total_s"] = time.perf_counter() - t_start
    _write(out, result)
    say((out / "long_context.md").read_text())
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
