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
plan, scaled by what earlier runs measured; a run that would not fit the budget is skipped and
listed): a warm-up step at a short length; the toolkit lengths (``--toolkit``, default 8k,
32k and 128k) in both modes; then for each mode, offload first, the ladder (``--ladder``)
from the plan's predicted longest length upward while it fits, downward from an
out-of-memory error (lengths already run are not run again). Runs up to 32k time 2 steps (the first one a warm-up),
longer ones 1 (the first step at a length: its allocations are in it; said in the table).

Reported per run: step time, tokens/s, model TFLOP/s (6 x matmul parameters x tokens, plus
attention: 6 x L x D x T per token for causal attention's two products, forward and backward;
recomputation not counted), peak GPU memory (``max_memory_allocated``) against the plan's
``device_total_bytes`` for that length and mode, peak host RSS (VmHWM, reset before each
run), the plan's predicted step (``ramflow.train.estimate.predict_plan_step`` with this run's
measured matmul and pinned copy rates) and the errors. Then the longest length that fits per
mode and the memory toolkit's rows (docs/memory.md): what offload saves and costs at each
toolkit length. Writes ``long_context.json``, ``long_context.md`` and ``long_context.log``
into ``--out-dir`` after every run.

GPU box (H100 80 GB; about 7 minutes, ``--budget-s 420`` by default; the files are rewritten
after every run, so a time limit still leaves the runs done):

    PYTHONUNBUFFERED=1 timeout 475 python3 benchmarks/long_context/long_context.py --out-dir $OUT/long-context

CPU smoke test (seconds): ``python benchmarks/long_context/long_context.py --tiny --out-dir DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import torch  # noqa: E402

import measure  # noqa: E402
from measure import matmul_rate, pinned_bandwidth  # noqa: E402
from models import random_init  # noqa: E402

GIB = 2**30
MODES = ("offload", "on")
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


def model_flops(cfg, matmul_params: int, tokens: int, seq: int) -> float:
    """Model FLOPs of one training step (no recomputation): 6 per matmul parameter and
    token, plus causal attention's 6 x L x D x T per token (QK^T and PV, half the square)."""
    attention = 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq
    return tokens * (6.0 * matmul_params + attention)


class Plans:
    """The plan's figures for each (mode, T): ``estimate_memory`` with no cap (ramflow's plan
    streams every unit, as the run's does) and its predicted step at the measured rates."""

    def __init__(self, cfg, rates, matmul: float | None, host_precision: str, device_type: str):
        self.cfg, self.rates, self.matmul = cfg, rates, matmul
        self.host_precision, self.device_type = host_precision, device_type
        self._cache: dict[tuple[str, int], dict] = {}

    def __call__(self, mode: str, seq: int) -> dict:
        from ramflow.train.estimate import estimate_memory, predict_plan_step

        key = (mode, seq)
        if key not in self._cache:
            est = estimate_memory(
                self.cfg, model_name="llama-8b", device_type="cuda", precision="bf16",
                compute_dtype=torch.bfloat16, wire_dtype=torch.bfloat16, batch_size=1,
                seq_len=seq, gpu_memory_bytes=None, checkpointing=mode,
                host_precision=self.host_precision,
            )  # fmt: skip
            pred = predict_plan_step(
                self.cfg, est, timing_rates=self.rates, matmul_flops_per_s=self.matmul
            )
            self._cache[key] = {
                "device_total_bytes": est.device_total_bytes,
                "ramflow_bytes": est.plan.planned_bytes,
                "host_activation_pinned_bytes": est.host_activation_pinned_bytes,
                "step_s": pred.step_s,
                "bound": pred.bound,
                "offload_bytes": pred.offload_bytes,
            }
        return self._cache[key]


def _write(out: Path, result: dict) -> None:
    (out / "long_context.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "long_context.md").write_text(markdown(result))


def _g(x, scale: float = 1.0, spec: str = ".2f") -> str:
    return "-" if x is None else format(x / scale, spec)


def _err(measured, predicted) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted - 1:+.1%}"


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = [
        f"# Long context: {m['model']}, full fine-tune, host formats {m['host_precision']}, B=1",
        "",
        f"{m['date']}, {m['device']}, torch {m['torch']}, commit {m['commit']}; "
        f"{m['parameters'] / 1e6:,.1f} M parameters; GPU free at start "
        f"{_g(m['gpu_free_bytes'], GIB)} GiB; ramflow's share {_g(m['ramflow_share_bytes'], GIB)} "
        f"GiB (every layer streamed); load {_g(r.get('load_s'), 1, '.1f')} s. Model TFLOP/s "
        "count attention FLOPs (causal: 6 L D T per token) and no recomputation.",
        "",
        "| T | mode | fits | steps run (the last timed) | step s | tokens/s | model TFLOP/s | peak GPU GiB "
        "(plan, error) | peak host GiB | predicted step s (error) |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for run in r["runs"]:
        p = run["plan"]
        fits = {True: "yes", False: "no: out of memory", None: run.get("skipped", "-")}[run["fits"]]
        lines.append(
            f"| {run['seq']} | {run['mode']} | {fits} | {run.get('steps_run', '-')} | "
            f"{_g(run.get('step_s'), 1, '.2f')} | {_g(run.get('tokens_per_s'), 1, ',.0f')} | "
            f"{_g(run.get('model_flops_per_s'), 1e12, '.0f')} | "
            f"{_g(run.get('peak_gpu_bytes'), GIB)} ({_g(p['device_total_bytes'], GIB)}, "
            f"{_err(run.get('peak_gpu_bytes'), p['device_total_bytes'])}) | "
            f"{_g(run.get('peak_host_bytes'), GIB, '.1f')} | {_g(p['step_s'], 1, '.2f')} "
            f"({_err(run.get('step_s'), p['step_s'])}) |"
        )
    lines += ["", "Longest sequence that fits:", ""]
    for mode in MODES:
        lf = r["longest"].get(mode, {})
        lines.append(
            f"- {mode}: {lf.get('fits') or 'none measured'} (predicted {lf.get('predicted')}; "
            f"first that failed: {lf.get('failed') or 'none tried'})"
        )
    lines += ["", "Memory toolkit rows (docs/memory.md):", ""]
    lines += r.get("toolkit_rows") or ["(none: a length lacks a run in both modes)"]
    if r.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(r["skipped"])]
    lines += ["", f"Command: `{m['command']}`", ""]
    return "\n".join(lines)


def toolkit_rows(runs: list[dict], seqs: list[int], model: str) -> list[str]:
    """The memory toolkit table's rows: offload against checkpointing alone at each T."""
    by = {(x["mode"], x["seq"]): x for x in runs if x["fits"] is not None}
    out = []
    for seq in seqs:
        on, off = by.get(("on", seq)), by.get(("offload", seq))
        if off is None or not off["fits"]:
            continue
        length = f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)
        label = f"activation offload at {length} tokens ({model}, B=1)"
        if on is None or not on["fits"]:
            out.append(
                f"| {label} vs checkpointing alone (out of memory) | "
                f"{_g(off['peak_gpu_bytes'], GIB)} GiB | - | {off['step_s'] * 1e3:.0f} ms | - |"
            )
            continue
        saved = (
            on["peak_gpu_bytes"] - off["peak_gpu_bytes"]
            if on["peak_gpu_bytes"] is not None and off["peak_gpu_bytes"] is not None
            else None
        )
        cost = off["step_s"] / on["step_s"] - 1
        out.append(
            f"| {label} vs checkpointing alone ({_g(on['peak_gpu_bytes'], GIB)} GiB, "
            f"{on['step_s'] * 1e3:.0f} ms) | {_g(off['peak_gpu_bytes'], GIB)} GiB | "
            f"{_g(saved, GIB)} GiB | {off['step_s'] * 1e3:.0f} ms | {cost:+.1%} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--ladder", default="32768,65536,98304,131072,163840")
    p.add_argument("--toolkit", default="8192,32768,131072", help="lengths of the table rows")
    p.add_argument("--host-precision", default="lean")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting runs after this")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama on the CPU (smoke test)")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    ladder = sorted(int(x) for x in args.ladder.split(","))
    toolkit = sorted(int(x) for x in args.toolkit.split(","))
    if args.tiny:
        ladder, toolkit = list(TINY_LADDER), [128, 512]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "long_context.log", "a")  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    import ramflow
    from harness import _commit
    from ramflow._predict import Rates
    from ramflow.memory import CheckpointOffload
    from ramflow.train.loss import chunk_lm_head, lm_loss

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cuda = device.type == "cuda"
    cfg = model_config(args.tiny, max(ladder + toolkit))
    matmul = matmul_rate(device)
    bw = pinned_bandwidth(device)
    rates = Rates()
    if bw["h2d"]:
        rates = dataclasses.replace(
            rates, h2d_bytes_per_s=bw["h2d"], d2h_bytes_per_s=bw["d2h"], both_bytes_per_s=bw["both"]
        )
    plans = Plans(cfg, rates, matmul, args.host_precision, device.type)
    free = torch.cuda.mem_get_info(device)[0] if cuda else None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    chunk_lm_head(model)
    n_params = sum(q.numel() for q in model.parameters())
    matmul_params = sum(q.numel() for n, q in model.named_parameters() if q.dim() == 2) - (
        model.get_input_embeddings().weight.numel()
    )
    share = plans("offload", ladder[0])["ramflow_bytes"]
    result: dict = {
        "meta": {
            "date": date.today().isoformat(), "host": platform.node(),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "commit": _commit(),
            "model": "tiny" if args.tiny else "llama-8b", "parameters": n_params,
            "host_precision": args.host_precision, "gpu_free_bytes": free,
            "ramflow_share_bytes": share, "matmul_flops_per_s": matmul, "pinned": bw,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
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
    offloader = ramflow.api._engine(model).schedule.boundary_offloader
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-5, keep_grads=False)
    gen = torch.Generator().manual_seed(0)
    # measured over predicted step times so far: the budget scales predictions by the
    # largest (1.2 before any run has said)
    ratios: list[float] = []

    def step(seq: int) -> None:
        ids_BT = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model, ids_BT)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)

    def run(mode: str, seq: int) -> dict:
        plan = plans(mode, seq)
        steps = 2 if seq <= 32768 or args.tiny else 1
        record = {"mode": mode, "seq": seq, "plan": plan, "fits": None}
        left = args.budget_s - (time.perf_counter() - t_start)
        need = steps * plan["step_s"] * max(ratios, default=1.2)
        if cuda and need > left:
            record["skipped"] = f"skipped: about {need:.0f} s left {left:.0f} s of the budget"
            result["skipped"].append(f"{mode} at {seq}: {record['skipped']}")
            return record
        offloader.enabled = mode == "offload"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        measure.reset_peak_rss()
        times = []
        try:
            for _ in range(steps):
                t = time.perf_counter()
                step(seq)
                times.append(time.perf_counter() - t)
        except torch.OutOfMemoryError as err:
            record.update(fits=False, error=str(err).splitlines()[0])
        else:
            record.update(fits=True, step_s=times[-1], steps_run=steps, first_step_s=times[0])
            record["tokens_per_s"] = seq / times[-1]
            record["model_flops_per_s"] = model_flops(cfg, matmul_params, seq, seq) / times[-1]
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

    def record(r: dict) -> dict:
        result["runs"].append(r)
        _write(out, result)
        return r

    done: dict[tuple[str, int], dict] = {}

    def once(mode: str, seq: int) -> dict:
        if (mode, seq) not in done:
            done[(mode, seq)] = record(run(mode, seq))
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
        while 0 <= k < len(ladder):
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
        result["longest"][mode] = {
            "fits": fits, "failed": failed, "predicted": predicted[-1] if predicted else None
        }  # fmt: skip
        _write(out, result)
    result["toolkit_rows"] = toolkit_rows(result["runs"], toolkit, result["meta"]["model"])
    result["total_s"] = time.perf_counter() - t_start
    _write(out, result)
    say((out / "long_context.md").read_text())
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
