"""DeepSpeed ZeRO-3 offload on a big shape of ``host_formats/host_formats_scale.py`` (issue 14, point 7a).

The same model, tokens and loss as ``host_formats_scale.py`` (the shape's ``transformers``
config, the chunked-loss head, bf16 autocast, random tokens), trained the way DeepSpeed's
ZeRO-3 offload examples train a model larger than the host's fp32 copy: built inside
``deepspeed.zero.Init(remote_device="cpu", pin_memory=True, dtype=torch.bfloat16)`` (each
parameter is partitioned to pinned host memory as it is made, so no full copy exists),
``offload_param`` and ``offload_optimizer`` to the CPU with ``pin_memory``, bf16, DeepSpeed's
CPU AdamW, ``transformers``' gradient checkpointing on every decoder layer. A world of one,
or under ``torchrun`` one process per GPU of the host (each rank its ``LOCAL_RANK`` GPU and
its own micro-batch of ``--batch``); ``--shape llama-70b`` is ``ramflow train``'s preset
(issue 29, point 4: DeepSpeed on the 70B run's model and host).

Host RAM: DeepSpeed's own estimate (``estimate_zero3_model_states_mem_needs``, with and
without its 1.5x buffer factor) is recorded first. A watchdog thread samples the available
host RAM every 0.2 s; when it falls under ``--reserve`` (default 6 GiB) it records the
process's peak RSS and the stage reached and ends the process (exit 3), so that the box is
not taken down by the kernel's out-of-memory killer: that is the run's failure, with the
memory it asked for. Otherwise the steps are timed as in ``host_formats_scale.py``.

GPU box::

    PYTHONUNBUFFERED=1 python3 benchmarks/peers/deepspeed_zero3_big.py --shape llama-3.1-8b \\
        --batch 4 --seq 2048 --out-dir $OUT/deepspeed-8b
    PYTHONUNBUFFERED=1 torchrun --standalone --nproc-per-node 4 \\
        benchmarks/peers/deepspeed_zero3_big.py --shape llama-70b --batch 4 --seq 4096 \\
        --reserve 16GiB --out-dir $OUT/deepspeed-70b

Writes ``deepspeed-<shape>.json`` (rank 0; ``deepspeed-<shape>-rank<R>.json`` for the others)
into ``--out-dir``, rewritten at every stage and every 5 s (``host_in_use_timeline``: the host's
memory in use each second).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "host_formats")]

import _common  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from deepspeed_zero3 import zero3_offload_config  # noqa: E402

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    import host_formats_scale as scale

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=(*scale.SHAPES, "llama-70b"), default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument("--reserve", default="6GiB", help="host RAM kept free (the watchdog)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    path = out / f"deepspeed-{args.shape}{f'-rank{rank}' if rank else ''}.json"
    from ramflow.sizes import parse_bytes

    reserve = parse_bytes(args.reserve, what="--reserve")
    result: dict = {
        "meta": {
            "shape": args.shape,
            "batch": args.batch,
            "seq": args.seq,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host_ram_bytes": psutil.virtual_memory().total,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "reserve_bytes": reserve,
        },
        "stage": "start",
        "steps_s": [],
    }

    lock = threading.Lock()  # the watchdog thread writes too

    def write() -> None:
        with lock:
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")

    def watchdog() -> None:
        # also rewrites the json every 5 s with the host's memory in use each second, so a
        # run that a time limit ends keeps how far its allocation had got
        peak = 0
        start = time.monotonic()
        timeline = result.setdefault("host_in_use_timeline", [])  # [seconds, bytes]
        while True:
            elapsed = time.monotonic() - start
            if not timeline or elapsed - timeline[-1][0] >= 1.0:
                vm = psutil.virtual_memory()
                timeline.append([round(elapsed, 1), vm.total - vm.available])
                if len(timeline) % 5 == 0:
                    write()
            rss = psutil.Process().memory_info().rss
            peak = max(peak, rss)
            result["peak_rss_bytes"] = peak
            vm = psutil.virtual_memory()
            result["host_peak_in_use_bytes"] = max(
                result.get("host_peak_in_use_bytes", 0), vm.total - vm.available
            )
            if psutil.virtual_memory().available < reserve:
                result["outcome"] = (
                    f"stopped by the watchdog at stage {result['stage']!r}: host RAM available "
                    f"fell under {args.reserve} (process RSS {rss / GIB:.1f} GiB of "
                    f"{psutil.virtual_memory().total / GIB:.0f} GiB)"
                )
                write()
                print(result["outcome"], flush=True)
                os._exit(3)
            time.sleep(0.2)

    if not torch.cuda.is_available():
        result["outcome"] = "skipped: DeepSpeed ZeRO-3 offload needs CUDA"
        write()
        print(result["outcome"])
        return 0
    _common.single_process_env()  # under torchrun its variables are set already
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    deepspeed = _common.require("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from transformers import AutoModelForCausalLM

    if args.shape == "llama-70b":
        from ramflow.train.presets import get_preset

        cfg = get_preset("llama-70b").to_config()  # its own vocabulary, 128256
        cfg.use_cache = False
        cfg._attn_implementation = "sdpa"
    else:
        cfg = scale.model_config(args.shape)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(q.numel() for q in meta.parameters())
    largest = max(m.weight.numel() for m in meta.modules() if hasattr(m, "weight"))
    del meta
    for factor in (1.0, 1.5):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest, additional_buffer_factor=factor
        )
        result[f"deepspeed_estimate_x{factor}"] = {"cpu_bytes": cpu, "gpu_bytes": gpu}
    result["meta"]["parameters"] = n_params
    result["meta"]["deepspeed"] = deepspeed.__version__
    try:
        threading.Thread(target=watchdog, daemon=True).start()
        deepspeed.init_distributed()
        config = zero3_offload_config(args.batch, weight_decay=0.0)
        result["stage"] = "building (zero.Init)"
        write()
        t0 = time.perf_counter()
        with deepspeed.zero.Init(
            remote_device="cpu", pin_memory=True, dtype=torch.bfloat16, config_dict_or_path=config
        ):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.lm_head = scale.ChunkedLossHead(model.lm_head, args.loss_chunk)
        result["build_s"] = time.perf_counter() - t0
        result["stage"] = "deepspeed.initialize (optimizer states)"
        write()
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        result["initialize_s"] = time.perf_counter() - t0 - result["build_s"]
        result["stage"] = "training"
        write()
        gen = torch.Generator().manual_seed(0)
        ids_BT = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
        torch.cuda.reset_peak_memory_stats(device)
        t_prev = time.perf_counter()
        for i in range(args.warmup + args.steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden_BTD = engine.module.model(input_ids=ids_BT).last_hidden_state
                loss = engine.module.lm_head(hidden_BTD, ids_BT)
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize(device)
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            (result["steps_s"] if i >= args.warmup else result.setdefault("warmup_s", [])).append(
                dt
            )
            print(f"step {i + 1}: {dt:.3f} s, loss {loss.item():.4f}", flush=True)
            if result["steps_s"]:
                med = statistics.median(result["steps_s"])
                tokens = args.batch * args.seq
                result["summary"] = {
                    "median_step_s": med,
                    "tokens_per_s": tokens / med,
                    "model_flops_per_s": 6 * n_params * tokens / med,
                    "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(device),
                }
            write()
    except Exception as err:
        result["outcome"] = f"failed at stage {result['stage']!r}: {type(err).__name__}: {err}"
        write()
        raise
    result["stage"] = "done"
    result["outcome"] = "trained"
    write()
    return 0


if __name__ == "__main__":
    _common.run(lambda: sys.exit(main()))
