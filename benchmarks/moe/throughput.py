"""MoE training throughput on one GPU box, ramflow beside its peers (issue 47, points 2 and 5).

One command runs, within ``--budget-s``, each case in a process of its own (in priority
order; a case that no longer fits the budget is recorded as skipped, one that dies or runs
out of time is recorded with the phase it was in and its host peak):

- ``floors``: pinned H2D, D2H and both-ways copy rates, the bf16 matmul rate and torch's
  fused CPU AdamW rate: the rates the planner's predictions below are made with.
- ``ramflow.dsv2.full``: a full fine-tune of the DeepSeek-V2-Lite shape (the
  ``deepseek-v2-lite`` preset, 15.7 B parameters), ``--grad-accum`` micro-batches per step
  run unit-major (``ramflow.accumulate``, as ``ramflow train --grad-accum`` runs them), then,
  on the same model, the ordinary accumulation loop (``opt.no_step()`` for all but the last
  micro-batch): each unit's weights cross PCIe once per step against once per micro-batch.
- ``ramflow.dsv2.lora``: LoRA (rank ``--lora-rank``, ``ramflow train``'s targets) on the
  same shape, unit-major.
- ``ramflow.qwen3.L<n>.full``: the Qwen3-30B-A3B shape with ``--layers`` decoder layers
  (``auto``: the most whose plan fits ``--host-ram-gib``) under ``--host-precision``.
- ``deepspeed.dsv2.full``: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the
  CPU (``peers/deepspeed_zero3.py``'s config): DeepSpeed's own estimate of its host RAM
  first; where that exceeds the RAM available the row says so with both figures.
- ``deepspeed.dsv2.lora``, ``accelerate.dsv2.lora``: LoRA on the same shape under ZeRO-3
  offload, and under ``accelerate``'s ``device_map`` offload (``infer_auto_device_map`` with
  ``max_memory``, ``dispatch_model``); the accelerate row says whether the adapters changed.

Every ramflow case is set up as ``ramflow train`` sets it up: the memory plan
(``estimate_run_memory``, checkpointing ``auto``, the device budget ``--gpu-memory``), the
model built on the meta device and drawn unit by unit into the host store in its final
format (``build_offloaded``: no full fp32 model exists), the chunked loss, bf16 autocast,
``ramflow.optim.AdamW`` as ``ramflow train`` builds it (lean: ``keep_grads=False, clips=True``,
the compact deferred gradient), global-norm clipping at 1.0 folded into the
step, random tokens. Per row: tokens/s; MFU on the active parameters with causal attention
(``ramflow.train.flops.model_flops_per_token`` over the device's dense bf16 peak); host
peak (VmHWM of the case's process, its children's included) against the plan's RAM
(``ram_needed_bytes``); GPU peak (``max_memory_allocated`` over the timed steps, and the
allocator's reserved peak) against the budget; the planner's step
(``predict_plan_step`` at the floors' rates, ``micro_batches`` for unit-major; the ordinary
loop as ``M - 1`` micro-steps without the optimizer and one with it) beside the measured
median, and their ratio (issue 47 point 2: within 15%).

Rows are appended to ``rows.jsonl`` under ``--out-dir`` as each finishes (a case's process
writes its own rows; a later crash loses nothing), and ``throughput.md`` is rewritten after
every case. ``--smoke`` runs tiny shapes on the CPU (CI's test; ``MOE_BENCH_DIE_IN=<case>``
makes that case's process exit at its start, as a crash would).

    PYTHONUNBUFFERED=1 python3 benchmarks/moe/throughput.py --budget-s 280 --out-dir $OUT/moe
    python3 benchmarks/moe/throughput.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
SRC = BENCH.parent / "src"
for path in (str(SRC), str(BENCH), str(BENCH / "peers"), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

GIB = 1 << 30
PHASE_PREFIX = "@phase "

# ----------------------------------------------------------------------------- shapes

TINY_MOE = {
    "qwen3": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, max_position_embeddings=256, norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "dsv2": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_attention_heads=4, num_key_value_heads=4, head_dim=24, vocab_size=256,
        max_position_embeddings=256, tie_word_embeddings=False, topk_method="greedy",
        n_group=1, topk_group=1,
    ),
}  # fmt: skip
FULL_LAYERS = {"dsv2": 27, "qwen3": 48}
PRESET = {"dsv2": "deepseek-v2-lite", "qwen3": "qwen3-30b-a3b"}


def model_config(shape: str, layers: int | None, *, tiny: bool):
    """The ``transformers`` config of ``shape`` (``"dsv2"``, ``"qwen3"``) with ``layers``
    decoder layers (None: the model's own), the ``ramflow train`` preset's, or a tiny one of
    the same family (``tiny``, for the CPU)."""
    if tiny:
        from transformers import DeepseekV2Config, Qwen3MoeConfig

        cls = DeepseekV2Config if shape == "dsv2" else Qwen3MoeConfig
        return cls(num_hidden_layers=layers or 3, **TINY_MOE[shape])
    from ramflow.train.presets import get_preset

    config = get_preset(PRESET[shape]).to_config()
    if layers is not None:
        config.num_hidden_layers = layers
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = config.layer_types[:layers]
    return config


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One process of the run.

    Attributes:
        id: the case's name in the report.
        kind: ``floors``, ``ramflow``, ``deepspeed`` or ``accelerate``.
        shape: ``dsv2`` or ``qwen3`` (none for the floors).
        layers: decoder layers (None: the shape's own; ``-1``: the most that fit the RAM).
        lora: LoRA adapters on a frozen base (else a full fine-tune).
        loops: for ramflow, the accumulation loops timed in turn: ``unit-major``, ``ordinary``.
        estimate_s: the time it is expected to take on the GPU box (set-up included).
    """

    id: str
    kind: str
    shape: str = ""
    layers: int | None = None
    lora: bool = False
    loops: tuple[str, ...] = ("unit-major",)
    estimate_s: float = 60.0


def all_cases(args) -> list[Case]:
    """The cases in priority order (``--only`` keeps those whose id contains a given text)."""
    qwen_layers = -1 if args.layers == "auto" else int(args.layers)
    qwen_id = "auto" if qwen_layers < 0 else str(qwen_layers)
    cases = [
        Case("floors", "floors", estimate_s=20),
        Case("ramflow.dsv2.full", "ramflow", "dsv2", loops=("unit-major", "ordinary"), estimate_s=130),
        Case("ramflow.dsv2.lora", "ramflow", "dsv2", lora=True, estimate_s=80),
        Case(f"ramflow.qwen3.L{qwen_id}.full", "ramflow", "qwen3", layers=qwen_layers, estimate_s=120),
        Case("deepspeed.dsv2.full", "deepspeed", "dsv2", estimate_s=10),
        Case("deepspeed.dsv2.lora", "deepspeed", "dsv2", lora=True, estimate_s=150),
        Case("accelerate.dsv2.lora", "accelerate", "dsv2", lora=True, estimate_s=120),
    ]  # fmt: skip
    if args.only:
        keep = [t for t in args.only.split(",") if t]
        cases = [c for c in cases if c.kind == "floors" or any(t in c.id for t in keep)]
    return cases


# ----------------------------------------------------------------------------- child helpers


def phase(name: str) -> None:
    """Tell the parent (on stdout) which phase the case is in: a case that dies or runs
    out of time is reported with its last phase."""
    print(PHASE_PREFIX + name, flush=True)


def host_peak_bytes() -> int:
    """Peak RSS of this process (VmHWM) or of its largest waited-for child, bytes."""
    import measure

    own = measure.proc_status_bytes("VmHWM") or 0
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return max(own, children)


def append_row(path: Path, row: dict) -> None:
    """Append one JSON line and flush it to disk at once."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def floors_rates(rows: list[dict], host_precision):
    """``planner.predict.Rates`` and the matmul rate from the floors row (defaults where
    there is none, or on the CPU); under lean, lean's measured step rate. ``host_precision``:
    the run's ``HostPrecision``."""
    from ramflow.planner.predict import DEFAULT_MATMUL_FLOPS_PER_S, Rates, ramflow_adamw_rate

    floors = next((r for r in rows if r.get("case") == "floors" and r.get("status") == "ok"), None)
    if floors is None or floors.get("h2d_bytes_per_s") is None:
        return Rates(), DEFAULT_MATMUL_FLOPS_PER_S, "defaults (no GPU floors)"
    rates = Rates(
        h2d_bytes_per_s=floors["h2d_bytes_per_s"],
        d2h_bytes_per_s=floors["d2h_bytes_per_s"],
        both_bytes_per_s=floors["both_bytes_per_s"],
        cpu_optimizer_params_per_s=ramflow_adamw_rate(floors["cpu_adamw_fused_params_per_s"]),
    )
    if host_precision.name == "lean" and floors.get("ramflow_lean_params_per_s"):
        # lean's own step rate, measured, rather than fp32's times the planner's ratio; the
        # host DRAM rate that the copies are charged at stays fp32's (``rates_for``)
        fp32, lean = rates.cpu_optimizer_params_per_s, floors["ramflow_lean_params_per_s"]
        rates = dataclasses.replace(
            rates,
            cpu_optimizer_params_per_s=lean,
            cpu_optimizer_dram_bytes_per_param=rates.cpu_optimizer_dram_bytes_per_param
            * fp32
            / lean,
            host_precision=host_precision,
        )
        return rates, floors["matmul_flops_per_s"], "measured (floors, lean's own step)"
    return rates, floors["matmul_flops_per_s"], "measured (floors)"


def token_batches(vocab: int, batch: int, seq: int, count: int, device, seed: int):
    """``count`` micro-batches of random token ids, (B, T) int64 on ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(count)]


# ----------------------------------------------------------------------------- the floors


def run_floors(case: Case, args, out: Path) -> None:
    import torch

    import measure

    device = torch.device(args.device)
    phase("copy rates")
    bw = measure.pinned_bandwidth(device, nbytes=GIB if device.type == "cuda" else 64 << 20)
    phase("matmul rate")
    matmul = measure.matmul_flops(device) if device.type == "cuda" else None
    phase("cpu adamw rate")
    adam = measure.cpu_adamw_rate(256 << 20 if device.type == "cuda" else 4 << 20)
    phase("ramflow's own steps: fp32 and the lean formats")
    from cpu_optimizer_runner import _host_format_rates

    n = 64 << 20 if device.type == "cuda" else 1 << 20
    steps = _host_format_rates(n, {"steps": 2}, dram=measure.dram_copy_bandwidth(nbytes=n * 2))
    append_row(
        out,
        {
            "case": case.id,
            "status": "ok",
            "h2d_bytes_per_s": bw["h2d"],
            "d2h_bytes_per_s": bw["d2h"],
            "both_bytes_per_s": bw["both"],
            "matmul_flops_per_s": matmul,
            "cpu_adamw_fused_params_per_s": adam,
            "ramflow_fp32_params_per_s": steps["fp32"]["params_per_s"],
            "ramflow_lean_params_per_s": steps["lean"]["params_per_s"],
            "cpu_threads": torch.get_num_threads(),
            "host_peak_bytes": host_peak_bytes(),
        },
    )


# ----------------------------------------------------------------------------- ramflow


def fitting_layers(args, host, wire, compute, budget) -> int:
    """The most Qwen3 layers whose plan's RAM (``ram_needed_bytes``) fits ``--host-ram-gib``:
    the plans of 1 and 2 layers give the bytes per layer, and the plans from that count
    down check it (meta models only)."""
    from ramflow.memory.estimate import RunDescription
    from ramflow.train.estimate import estimate_run_memory

    def ram(layers: int) -> int:
        config = model_config("qwen3", layers, tiny=args.smoke)
        est = estimate_run_memory(
            config,
            run=RunDescription(batch_size=args.batch, seq_len=args.seq),
            device_type=args.device.split(":")[0],
            compute_dtype=compute,
            wire_dtype=wire,
            device_budget_bytes=budget,
            checkpointing=args.checkpointing,
            host_precision=host,
            held_gradients="codes" if host.compact_deferred else "grads",
        )
        return est.ram_needed_bytes

    one, two = ram(1), ram(2)
    # the smoke test's limit is 2 layers' plan and a half, so that the count is worked out
    limit = args.host_ram_gib * GIB if not args.smoke else (two + (two - one) // 2)
    most = FULL_LAYERS["qwen3"] if not args.smoke else 4
    layers = max(1, min(most, 1 + int((limit - one) // max(1, two - one))))
    while layers > 1 and ram(layers) > limit:
        layers -= 1
    return layers


def predicted_step_s(config, est, rates, matmul, *, loop: str, micro_batches: int) -> dict:
    """The planner's optimizer step of ``micro_batches`` (``predict_global_step``): unit-major
    loads the weights once and computes ``micro_batches`` times; the ordinary loop is
    ``micro_batches - 1`` micro-steps whose units are not stepped, then one that is."""
    from ramflow.train.estimate import predict_global_step

    p = predict_global_step(
        config,
        est,
        micro_batches=micro_batches,
        unit_major=loop == "unit-major",
        timing_rates=rates,
        matmul_flops_per_s=matmul,
    )
    return {"predicted_step_s": p.step_s, "bound": p.bound, "busy_s": p.busy_s}


def run_ramflow(case: Case, args, out: Path) -> None:
    import torch

    import measure
    import ramflow
    from ramflow.engine.host_store import resolve_precision
    from ramflow.memory.estimate import RunDescription, offload_units
    from ramflow.sizes import parse_bytes
    from ramflow.train.backoff import checkpointing_policy
    from ramflow.train.estimate import LoraSizing, SpeedInputs, estimate_run_memory
    from ramflow.train.flops import model_flops_per_token, peak_flops
    from ramflow.train.lora import apply_lora
    from ramflow.train.loss import chunk_lm_head, lm_loss
    from ramflow.train.modeling import build_offloaded, meta_model

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    compute = torch.bfloat16 if cuda else torch.float32
    budget = parse_bytes(args.gpu_memory) if cuda else None
    phase("plan")
    probe = model_config(case.shape, None, tiny=args.smoke)
    host, wire, _ = resolve_precision(
        args.host_precision,
        lambda: offload_units(meta_model(probe))[0],
        wire_dtype=compute if cuda else None,
        default_wire=compute,
    )
    rates, matmul, rates_from = floors_rates(read_rows(out), host)
    layers = case.layers
    if layers is not None and layers < 0:
        layers = fitting_layers(args, host, wire, compute, budget)
    config = model_config(case.shape, layers, tiny=args.smoke)
    est = estimate_run_memory(
        config,
        run=RunDescription(batch_size=args.batch, seq_len=args.seq, model_name=case.id),
        device_type=device.type,
        compute_dtype=compute,
        wire_dtype=wire,
        device_budget_bytes=budget,
        checkpointing=args.checkpointing,
        host_precision=host,
        # the loop clips, as ramflow train: each unit's gradient held to the step, in 8-bit
        # codes under lean formats (``train.gradient_holding``), else in the master's dtype
        held_gradients="codes" if host.compact_deferred else "grads",
        speed=SpeedInputs(timing_rates=rates, matmul_flops_per_s=matmul) if cuda else None,
        lora=LoraSizing(args.lora_rank) if case.lora else None,
    )
    phase("build (meta, drawn unit by unit into the host store)")
    t0 = time.perf_counter()
    model = build_offloaded(
        config,
        seed=0,
        requires_grad=not case.lora,
        gpu_memory=est.gpu_memory_bytes,
        device=device,
        wire_dtype=wire,
        activation_checkpointing=checkpointing_policy(est.checkpointing_mode),
        host_precision=host,
    )
    if case.lora:
        model = apply_lora(model, rank=args.lora_rank, targets=lora_targets(model), seed=0)
    with contextlib.suppress(ValueError):  # the loss in chunks where the head allows it
        chunk_lm_head(model)
    build_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = ramflow.optim.AdamW(
        params,
        lr=1e-5,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        overlap=True,
        keep_grads=not host.compact_deferred,
        clips=host.compact_deferred,
    )
    m = args.grad_accum
    flops_per_token = model_flops_per_token(model, seq_len=args.seq)
    peak = peak_flops(device, torch.bfloat16) if cuda else None
    tokens_per_step = m * args.batch * args.seq
    vocab = config.vocab_size

    def autocast():
        return torch.autocast("cuda", dtype=compute) if cuda else contextlib.nullcontext()

    counter = [0]

    def next_batches():
        counter[0] += 1
        return token_batches(vocab, args.batch, args.seq, m, device, seed=counter[0])

    def finish(losses) -> None:
        ramflow.clip_grad_norm_(params, 1.0, fold=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(torch.isfinite(x).all() for x in losses), "a loss is not finite"

    def unit_major_step() -> None:
        if m == 1:
            return ordinary_step()

        def loss_fn(x):
            with autocast():
                return lm_loss(model, x) / m  # the micro-batch's share of the mean

        finish(ramflow.accumulate(model, next_batches(), loss_fn))

    def ordinary_step() -> None:
        losses = []
        for i, x in enumerate(next_batches()):
            ctx = opt.no_step() if i < m - 1 else contextlib.nullcontext()
            with ctx:
                with autocast():
                    loss = lm_loss(model, x)
                (loss / m).backward()
            losses.append(loss.detach())
        finish(losses)

    steps = {"unit-major": unit_major_step, "ordinary": ordinary_step}
    for loop in case.loops:
        phase(f"steps ({loop})")
        res = measure.time_steps(
            steps[loop],
            device=device,
            warmup=args.warmup,
            steps=args.steps,
            drain=lambda: ramflow.synchronize(model),
        )
        step_s = res["step_s"]
        tokens_per_s = tokens_per_step / step_s
        pred = predicted_step_s(config, est, rates, matmul, loop=loop, micro_batches=m)
        append_row(
            out,
            {
                "case": case.id,
                "status": "ok",
                "system": "ramflow" + (" LoRA" if case.lora else ""),
                "loop": loop if m > 1 else "one micro-batch",
                "shape": PRESET[case.shape] + ("" if not args.smoke else " (tiny)"),
                "layers": config.num_hidden_layers,
                "parameters": est.num_parameters,
                "active_parameters": est.parameter_counts.active if est.parameter_counts else None,
                "trained_parameters": sum(p.numel() for p in params),
                "host_precision": host.name,
                "checkpointing": est.checkpointing_mode,
                "micro_batch": f"{args.batch}x{args.seq}",
                "grad_accum": m,
                "tokens_per_step": tokens_per_step,
                "step_s": step_s,
                "step_times_s": res["step_times_s"],
                "tokens_per_s": tokens_per_s,
                "flops_per_token": flops_per_token,
                "mfu": None if peak is None else flops_per_token * tokens_per_s / peak.flops_per_s,
                "peak_flops": None if peak is None else peak.description,
                "gpu_peak_bytes": res["peak_bytes"],
                "gpu_reserved_peak_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
                "gpu_budget_bytes": budget,
                "gpu_planned_bytes": est.device_total_bytes if cuda else None,
                "host_peak_bytes": host_peak_bytes(),
                "host_planned_bytes": est.ram_needed_bytes,
                "rates_from": rates_from,
                "build_s": build_s,
                **pred,
            },
        )
    ramflow.undo(model)


# ----------------------------------------------------------------------------- peers


def peer_model(case: Case, args, device):
    """The shape in bf16 on the CPU with seeded values (meta build, ``to_empty``, filled
    from one block of seeded draws as ``routed_experts.seeded_init`` fills it)."""
    import torch
    from routed_experts import seeded_init
    from transformers import AutoModelForCausalLM

    config = model_config(case.shape, case.layers, tiny=args.smoke)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            seeded_init(name, p.data)
    return model, config


def lora_targets(model) -> list[str]:
    """``ramflow train``'s default LoRA targets that ``model`` has, and latent attention's
    projections (DeepSeek's MLA has no ``k_proj``/``v_proj``). The routed experts are
    stacked 3-D parameters in ``transformers`` 5, not linear modules: their LoRA is not
    among these (the dense and shared MLPs' are)."""
    from torch import nn

    from ramflow.train.lora import DEFAULT_TARGETS

    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    wanted = (*DEFAULT_TARGETS, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    return [t for t in wanted if t in names]


def lora_wrap(model, args):
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model)
    config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets)
    model.requires_grad_(False)
    return get_peft_model(model, config)


def peer_row(case: Case, args, config, res: dict, system: str, **extra) -> dict:
    import torch

    from ramflow.planner.costs import attention_width, parameter_counts
    from ramflow.train.flops import training_flops_per_token

    tokens_per_step = args.grad_accum * args.batch * args.seq
    counts = parameter_counts(extra.pop("model"))
    flops = training_flops_per_token(
        matmul_params=counts.active_matmul,
        trained_matmul_params=counts.active_trained_matmul,
        seq_len=args.seq,
        attention_layers=config.num_hidden_layers,
        attention_width=attention_width(config),
    )
    from ramflow.train.flops import peak_flops

    device = torch.device(args.device)
    peak = peak_flops(device, torch.bfloat16) if device.type == "cuda" else None
    tps = tokens_per_step / res["step_s"]
    return {
        "case": case.id,
        "status": "ok",
        "system": system,
        "loop": "ordinary" if args.grad_accum > 1 else "one micro-batch",
        "shape": PRESET[case.shape],
        "layers": config.num_hidden_layers,
        "parameters": counts.total,
        "active_parameters": counts.active,
        "micro_batch": f"{args.batch}x{args.seq}",
        "grad_accum": args.grad_accum,
        "tokens_per_step": tokens_per_step,
        "step_s": res["step_s"],
        "step_times_s": res["step_times_s"],
        "tokens_per_s": tps,
        "mfu": None if peak is None else flops * tps / peak.flops_per_s,
        "gpu_peak_bytes": res["peak_bytes"],
        "gpu_budget_bytes": None,
        "host_peak_bytes": host_peak_bytes(),
        **extra,
    }


def run_deepspeed(case: Case, args, out: Path) -> None:
    import psutil
    import torch

    if not torch.cuda.is_available() or args.device == "cpu":
        append_row(out, {"case": case.id, "status": "skipped", "cause": "DeepSpeed needs CUDA"})
        return
    import _common

    import measure

    phase("import deepspeed")
    import deepspeed
    from deepspeed_zero3 import zero3_offload_config

    config = model_config(case.shape, case.layers, tiny=args.smoke)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in meta.parameters())
    largest = max(p.numel() for p in meta.parameters())
    if not case.lora:
        try:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            # without its 1.5x buffer factor: the least it asks for
            cpu_need = estimate_zero3_model_states_mem_needs(
                total, largest, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                cpu_offload_params=True, zero_init=True, additional_buffer_factor=1.0,
            )[0]  # fmt: skip
        except ImportError:  # its byte model: 18 bytes per parameter on the host
            cpu_need = 18 * total
        available = psutil.virtual_memory().available
        if cpu_need > available:
            append_row(
                out,
                {
                    "case": case.id,
                    "status": "did not fit",
                    "system": f"DeepSpeed {deepspeed.__version__} ZeRO-3 offload",
                    "parameters": total,
                    "cause": f"DeepSpeed's own estimate of its host RAM for ZeRO-3 offload "
                    f"(params and optimizer on the CPU) is {cpu_need / GIB:.1f} GiB "
                    f"({cpu_need / total:.1f} bytes per parameter); "
                    f"{available / GIB:.1f} GiB are available",
                    "host_planned_bytes": cpu_need,
                },
            )
            return
    _common.single_process_env()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    deepspeed.init_distributed()
    phase("build (bf16 on the CPU)")
    model, config = peer_model(case, args, device)
    if case.lora:
        model = lora_wrap(model, args)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    phase("deepspeed.initialize")
    ds_config = zero3_offload_config(args.batch, weight_decay=0.1)
    ds_config["gradient_accumulation_steps"] = args.grad_accum
    ds_config["gradient_clipping"] = 1.0
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.grad_accum, device, 1)

    def step() -> None:  # DeepSpeed steps the optimizer at the last micro-batch's step()
        for x in batches:
            loss = engine(input_ids=x, labels=x, use_cache=False).loss
            engine.backward(loss)
            engine.step()

    phase("steps")
    res = measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    system = f"DeepSpeed {deepspeed.__version__} ZeRO-3 offload" + (" LoRA" if case.lora else "")
    append_row(out, peer_row(case, args, config, res, system, model=model))


def run_accelerate(case: Case, args, out: Path) -> None:
    import torch

    if not torch.cuda.is_available() or args.device == "cpu":
        append_row(out, {"case": case.id, "status": "skipped", "cause": "device_map needs CUDA"})
        return
    from accelerate import dispatch_model, infer_auto_device_map

    import measure
    from ramflow.sizes import parse_bytes

    device = torch.device("cuda", 0)
    phase("build (bf16 on the CPU)")
    model, config = peer_model(case, args, device)
    model = lora_wrap(model, args)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer_cls = type(model.base_model.model.model.layers[0]).__name__
    phase("dispatch_model")
    device_map = infer_auto_device_map(
        model,
        max_memory={0: parse_bytes(args.gpu_memory), "cpu": args.host_ram_gib * GIB},
        no_split_module_classes=[layer_cls],
        dtype=torch.bfloat16,
    )
    dispatch_model(model, device_map=device_map, main_device=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().float().cpu().clone() for p in trainable[:4]]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    batches = token_batches(config.vocab_size, args.batch, args.seq, args.grad_accum, device, 1)

    def step() -> None:  # the ordinary accumulation loop
        for x in batches:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    phase("steps")
    res = measure.time_steps(step, device=device, warmup=args.warmup, steps=args.steps)
    after = [p.detach().float().cpu() for p in trainable[:4]]
    changed = any(not torch.equal(a, b) for a, b in zip(before, after))
    offloaded = sum(1 for v in device_map.values() if v in ("cpu", "disk"))
    import accelerate

    append_row(
        out,
        peer_row(
            case, args, config, res, f"accelerate {accelerate.__version__} device_map LoRA",
            model=model, adapters_changed=changed,
            note=f"{offloaded} of {len(device_map)} device_map entries on the CPU",
        ),
    )  # fmt: skip


RUNNERS = {
    "floors": run_floors,
    "ramflow": run_ramflow,
    "deepspeed": run_deepspeed,
    "accelerate": run_accelerate,
}


def child_main(args) -> int:
    case = next(c for c in all_cases(args) if c.id == args.case)
    out = Path(args.out_dir) / "rows.jsonl"
    if os.environ.get("MOE_BENCH_DIE_IN") == case.id:  # the smoke test's crash
        phase("dying as MOE_BENCH_DIE_IN asks")
        os._exit(3)
    RUNNERS[case.kind](case, args, out)
    return 0


# ----------------------------------------------------------------------------- the parent


def run_case(case: Case, args, timeout_s: float, log) -> dict:
    """Run ``case`` in its own process; returns what the parent saw: exit status, seconds,
    the last phase, the process's peak RSS (``wait4``: children included)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case.id, *args.forward]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    log.write(f"\n===== {case.id} (timeout {timeout_s:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    last_phase, tail = "start", []
    deadline = t0 + timeout_s
    timed_out = False
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            timed_out = True
            proc.kill()
            break
        if not sel.select(timeout=min(left, 1.0)):
            continue
        line = proc.stdout.readline()
        if not line:
            break
        log.write(line)
        log.flush()
        if line.startswith(PHASE_PREFIX):
            last_phase = line[len(PHASE_PREFIX) :].strip()
        tail = (tail + [line.rstrip()])[-6:]
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {
        "rc": code,
        "timed_out": timed_out,
        "seconds": time.perf_counter() - t0,
        "phase": last_phase,
        "tail": tail,
        "host_peak_bytes": usage.ru_maxrss * 1024,
    }


def fmt_gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def report(rows: list[dict], meta: dict) -> str:
    """The markdown table: one row per measured loop or peer, then the misses' causes."""
    head = (
        "| case | system | loop | micro-batch x accum | tokens/s | MFU | step s | predicted s (bound) "
        "| x pred | host peak / plan GiB | GPU peak / budget GiB (reserved) |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---|\n"
    )
    lines, notes = [], []
    rates_seen: set[str] = set()
    for r in rows:
        if r.get("case") == "floors":
            if r.get("status") == "ok" and r.get("h2d_bytes_per_s"):
                notes.append(
                    f"Floors: H2D {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H "
                    f"{r['d2h_bytes_per_s'] / 1e9:.1f}, both {r['both_bytes_per_s'] / 1e9:.1f}; "
                    f"matmul {r['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; torch fused CPU AdamW "
                    f"{r['cpu_adamw_fused_params_per_s'] / 1e9:.2f} G params/s "
                    f"({r['cpu_threads']} threads)."
                )
            continue
        if r.get("kind") == "case_end":
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r['case']} | {r.get('system', '-')} | - | - | - | - | - | - | - | "
                         f"{fmt_gib(r.get('host_peak_bytes'))} / {fmt_gib(r.get('host_planned_bytes'))}"
                         f" | - |")  # fmt: skip
            notes.append(f"- {r['case']}: {r['status']}: {r.get('cause', '')}")
            continue
        pred = r.get("predicted_step_s")
        ratio = "-" if not pred else f"{r['step_s'] / pred:.2f}"
        pred_text = "-" if not pred else f"{pred:.2f} ({r.get('bound', '-')})"
        if r.get("rates_from"):
            rates_seen.add(r["rates_from"])
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['case']} | {r['system']} | {r['loop']} | {r['micro_batch']} x "
            f"{r['grad_accum']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['step_s']:.2f} | "
            f"{pred_text} | {ratio} | {fmt_gib(r['host_peak_bytes'])} / "
            f"{fmt_gib(r.get('host_planned_bytes'))} | {fmt_gib(r.get('gpu_peak_bytes'))} / "
            f"{fmt_gib(r.get('gpu_budget_bytes'))} ({fmt_gib(r.get('gpu_reserved_peak_bytes'))}) |"
        )
        if r.get("adapters_changed") is False:
            notes.append(f"- {r['case']}: the adapters did not change over the steps.")
    if rates_seen:
        notes.append("Predictions at the rates: " + "; ".join(sorted(rates_seen)) + ".")
    by_loop = {(r["case"], r.get("loop")): r for r in rows if r.get("status") == "ok"}
    for (case, loop), r in by_loop.items():
        other = by_loop.get((case, "ordinary"))
        if loop == "unit-major" and other is not None:
            notes.append(
                f"- {case}: one weight pass per step (unit-major) runs "
                f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x the ordinary loop's tokens/s "
                f"at {r['grad_accum']} micro-batches per step."
            )
    title = (
        f"MoE training throughput, {meta['device_name']}, commit {meta['commit']}, "
        f"host formats {meta['host_precision']}, budget {meta['gpu_memory']} GPU.\n\n"
    )
    return title + head + "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def parent_main(args, argv: list[str]) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / "rows.jsonl"
    cases = all_cases(args)
    if args.list:
        for c in cases:
            print(f"{c.id:32s} {c.kind:10s} about {c.estimate_s:.0f} s")
        return 0
    commit = os.environ.get("RAMFLOW_BENCH_COMMIT") or _commit()
    device_name = "CPU"
    if args.device != "cpu":
        import torch

        if torch.cuda.is_available():
            device_name = torch.cuda.get_device_name()
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "device_name": device_name,
        "host_precision": args.host_precision,
        "gpu_memory": args.gpu_memory,
    }
    append_row(rows_path, {"kind": "meta", **meta})
    start = time.perf_counter()
    with open(out_dir / "throughput.log", "a", encoding="utf-8") as log:
        for case in cases:
            left = args.budget_s - (time.perf_counter() - start)
            if left < min(case.estimate_s, 30) and not args.smoke:
                append_row(rows_path, {"case": case.id, "status": "skipped",
                                       "cause": f"out of time: {left:.0f} s of the budget left, "
                                       f"the case takes about {case.estimate_s:.0f} s"})  # fmt: skip
                continue
            if case.kind == "floors" and args.device == "cpu":
                append_row(rows_path, {"case": case.id, "status": "skipped",
                                       "cause": "no GPU: the predictions take the planner's "
                                       "default rates"})  # fmt: skip
                continue
            if case.kind in ("deepspeed", "accelerate") and args.device == "cpu":
                append_row(rows_path, {"case": case.id, "status": "skipped",
                                       "cause": f"{case.kind} offload needs CUDA"})  # fmt: skip
                continue
            seen = {r.get("case") for r in read_rows(rows_path)}
            run = run_case(case, args, max(1.0, left), log)
            after = read_rows(rows_path)
            append_row(rows_path, {"kind": "case_end", "case": case.id, **run})
            if not any(r.get("case") == case.id for r in after) or case.id in seen:
                cause = (
                    f"ran out of time after {run['seconds']:.0f} s in phase {run['phase']!r}"
                    if run["timed_out"]
                    else f"exit {run['rc']} in phase {run['phase']!r}: "
                    + " / ".join(run["tail"][-2:])
                )
                append_row(rows_path, {"case": case.id, "status": "failed", "cause": cause,
                                       "host_peak_bytes": run["host_peak_bytes"]})  # fmt: skip
            else:
                _raise_host_peaks(rows_path, case.id, run["host_peak_bytes"])
            rows = [r for r in read_rows(rows_path) if r.get("kind") not in ("meta",)]
            (out_dir / "throughput.md").write_text(report(rows, meta))
    print((out_dir / "throughput.md").read_text())
    return 0


def _raise_host_peaks(path: Path, case_id: str, peak: int) -> None:
    """The case's rows get the process's peak as ``wait4`` saw it where that is higher (a
    child's, or growth after the row was written); the file is rewritten whole, its rows
    in the same order."""
    rows = read_rows(path)
    for r in rows:
        if r.get("case") == case_id and r.get("status") == "ok" and "host_peak_bytes" in r:
            r["host_peak_bytes"] = max(r["host_peak_bytes"] or 0, peak)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    os.replace(tmp, path)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(BENCH.parent), "log", "-1", "--format=%h"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=280.0, help="seconds for all cases")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--only", default="", help="comma-separated texts; cases whose id has one")
    p.add_argument("--list", action="store_true", help="print the cases and run nothing")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-memory", default="70GiB", help="the device budget of every case")
    p.add_argument("--host-precision", default="lean", help="ramflow's host formats")
    p.add_argument("--host-ram-gib", type=float, default=120.0, help="RAM the plans may take")
    p.add_argument("--layers", default="auto", help="Qwen3 layers, or auto: the most that fit")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--checkpointing", default="auto", choices=("auto", "on", "off", "offload"))
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's case
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.batch, args.seq = "cpu", 2, 32
        args.grad_accum, args.warmup, args.steps = 2, 1, 2
        args.lora_rank, args.layers = 4, "auto"
    # what a child needs, as given (the smoke settings are re-derived from --smoke)
    raw = list(sys.argv[1:] if argv is None else argv)
    forward, skip_next = [], False
    for a in raw:
        if skip_next:
            skip_next = False
            continue
        if a in ("--case", "--list"):
            skip_next = a == "--case"
            continue
        forward.append(a)
    args.forward = forward
    if args.layers != "auto" and not args.layers.isdigit():
        p.error(f"--layers {args.layers}: a number of layers or auto")
    if args.grad_accum < 1 or args.batch < 1 or args.seq < 1 or args.steps < 1:
        p.error("--grad-accum, --batch, --seq and --steps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        try:
            return child_main(args)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            return 1
    return parent_main(args, argv or sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
