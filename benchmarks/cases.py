"""The cases a run measures, in priority order, each a JSON-able dict for one process.

A case dict has ``id`` (unique), ``group`` (the flag that selects it), ``kind`` (which runner
or peer script), ``estimate_s`` (expected wall time on an H200 for the full-size model,
process start included, used to skip cases that no longer fit the time budget), and the
workload: ``model``, ``tiny``, ``batch``/``batches``, ``seq``, ``checkpoint``,
``loss_chunk_tokens``, ``cap_gib``, ``warmup``, ``steps``.

The budgets are those of issue 4: training 4x2048 with peak GPU memory <= 12 GiB, 16x2048 at
<= 16 GiB and with no cap; inference with nothing resident. The capped training cases need
activation checkpointing and a chunked loss to fit (the (B*T, V) fp32 logits of 16x2048 alone
are 4 GiB); the uncapped one keeps activations and computes the loss the plain way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# ramflow's training step leaves its CPU optimizer running into the next step, so after the
# drain before timing the first timed step is short (nothing to wait for) and the last long
# (the drain of its optimizer tail is charged to it): with 5 timed steps the median is one
# of three steady-state steps, where 3 leave one.
OVERLAPPED_KINDS = ("ramflow_train", "ramflow_kofn")
OVERLAPPED_STEPS = 5

GROUPS = ("floors", "ramflow", "resident", "kofn", "trace", "cpu_optimizer", "scaling", "peers")
KOFN_FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # k = round(f x n) of the n blocks resident
KOFN_ROUNDS = 3  # training rounds per k (the CPU optimizer's rate drifts between minutes)
SEQ = 2048
LOSS_CHUNK = 4096  # tokens per head + cross-entropy chunk in the capped cases
PEERS_DIR = Path(__file__).resolve().parent / "peers"


def _base(model: str, tiny: bool, warmup: int, steps: int) -> dict[str, Any]:
    return {
        "model": model,
        "tiny": tiny,
        "warmup": warmup,
        "steps": steps,
        "seq": 128 if tiny else SEQ,
    }


def training_shapes(tiny: bool) -> list[dict[str, Any]]:
    """The three training cases: (batch, cap, checkpoint, chunked loss)."""
    small, large = (2, 4) if tiny else (4, 16)
    chunk = 64 if tiny else LOSS_CHUNK
    return [
        {"batch": small, "cap_gib": 12, "checkpoint": True, "loss_chunk_tokens": chunk},
        {"batch": large, "cap_gib": 16, "checkpoint": True, "loss_chunk_tokens": chunk},
        {"batch": large, "cap_gib": None, "checkpoint": False, "loss_chunk_tokens": 0},
    ]


def inference_batches(tiny: bool) -> list[int]:
    return [1, 2] if tiny else [1, 8]


def _train_id(prefix: str, model: str, shape: dict[str, Any], seq: int) -> str:
    cap = "nocap" if shape["cap_gib"] is None else f"cap{shape['cap_gib']}gib"
    ckpt = "-ckpt" if shape["checkpoint"] else ""
    return f"{prefix}.{model}.train.{shape['batch']}x{seq}.{cap}{ckpt}"


def _resident_id(model: str, shape: dict[str, Any], seq: int) -> str:
    ckpt = ".ckpt" if shape["checkpoint"] else ""
    loss = ".chunked-loss" if shape["loss_chunk_tokens"] else ""
    return f"resident.{model}.train.{shape['batch']}x{seq}{ckpt}{loss}"


def build_cases(
    groups: list[str],
    *,
    model: str,
    tiny: bool,
    warmup: int,
    steps: int,
    out_dir: str,
    tag: str,
    scaling_depths: list[int],
    peer_names: list[str] | None = None,
    checkpointing_by: str = "model",
    host_precision: str = "fp32",
    device_optimizer: str = "on",
) -> list[dict[str, Any]]:
    """All cases of the selected groups, in priority order (GROUPS order, then as listed).

    ``checkpointing_by``: who recomputes activations in ramflow's checkpointed cases,
    ``model`` (the model's own ``torch.utils.checkpoint`` per block, as in the resident
    cases) or ``ramflow`` (``ramflow.offload(activation_checkpointing=True)``, every unit).
    ``host_precision``: ``ramflow.offload``'s, for ramflow's training cases.
    ``device_optimizer``: ``on`` steps the first resident units on the GPU (where the host
    format has a device step); ``auto`` leaves it to the planner (``device_optimizer=None``,
    the plain loop that passes nothing beyond ``host_precision``).
    """
    base = _base(model, tiny, warmup, steps)
    base["checkpointing_by"] = checkpointing_by
    base["host_precision"] = host_precision
    base["device_optimizer"] = device_optimizer
    seq = base["seq"]
    # estimates are H200 wall times of the reference model (2026-11-22 runs, about 1.2x),
    # llama-3b (3.2 B parameters, 28 layers) about 1.2x those
    scale = 0.1 if tiny else (1.2 if model == "llama-3b" else 1.0)
    cases: list[dict[str, Any]] = []

    def add(
        group: str,
        case_id: str,
        kind: str,
        estimate_s: float,
        *,
        per_model: bool = True,
        **fields: Any,
    ) -> None:
        factor = scale if per_model or tiny else 1.0  # floors and the CPU optimizer: any model
        if kind in OVERLAPPED_KINDS:
            fields.setdefault("steps", max(base["steps"], OVERLAPPED_STEPS))
        cases.append(
            {
                **base,
                "id": case_id,
                "group": group,
                "kind": kind,
                "estimate_s": max(5.0, estimate_s * factor),
                **fields,
            }
        )

    train = training_shapes(tiny)
    if model != "reference":  # transformers computes its own loss: no chunking
        train = [shape | {"loss_chunk_tokens": 0} for shape in train]
    batches = inference_batches(tiny)
    if "floors" in groups:
        add("floors", "floors", "floors", 16, per_model=False)
    if "ramflow" in groups:
        add("ramflow", _train_id("ramflow", model, train[0], seq), "ramflow_train", 45, **train[0])
        infer_id = f"ramflow.{model}.infer.{'+'.join(map(str, batches))}x{seq}"
        add("ramflow", infer_id, "ramflow_infer", 22, batches=batches)
        add("ramflow", _train_id("ramflow", model, train[1], seq), "ramflow_train", 45, **train[1])
        if model == "reference":
            # llama-3b's 16x2048 step without checkpointing keeps ~85 GB of layer activations
            # and ~60 GB of fp32 logits: it fits no single GPU, so it is not run
            add(
                "ramflow",
                _train_id("ramflow", model, train[2], seq),
                "ramflow_train",
                32,
                **train[2],
            )
    if "resident" in groups:
        # The compute floor of each ramflow case: the same model and step, all on the GPU.
        # 16x2048 without checkpointing is left out: about 4x the activations of the 4x2048
        # step on top of 43 GB of fp32 weights, gradients and AdamW states does not fit
        # (estimated from 4x2048, as the report does). A case that would not fit
        # this device (``models.resident_peak_bytes``) is recorded as skipped, not run.
        plain_small = {**train[2], "batch": train[0]["batch"]}
        for shape, est in ((train[0], 14), (plain_small, 14), (train[1], 19)):
            resident_id = _resident_id(model, shape, seq)
            add("resident", resident_id, "resident_train", est, **shape | {"cap_gib": None})
        infer_id = f"resident.{model}.infer.{'+'.join(map(str, batches))}x{seq}"
        add("resident", infer_id, "resident_infer", 14, batches=batches)
    if "kofn" in groups:
        # k of the n blocks resident (budgets chosen so), training at the small batch with
        # checkpointing and inference at batch 1; one process, the model built once;
        # training in KOFN_ROUNDS rounds (median per k: runners.run_ramflow_kofn)
        shape = train[0] | {"cap_gib": None}
        kofn_id = f"kofn.{model}.train.{shape['batch']}x{seq}+infer.{batches[0]}x{seq}"
        add(
            "kofn",
            kofn_id,
            "ramflow_kofn",
            60 + 40 * (KOFN_ROUNDS - 1),
            **shape,
            infer_batch=batches[0],
            fractions=list(KOFN_FRACTIONS),
            rounds=KOFN_ROUNDS,
        )
    if "trace" in groups:
        shape = train[0] | {"cap_gib": None}
        trace_id = f"trace.{model}.train.{shape['batch']}x{seq}"
        add("trace", trace_id, "trace", 35, **shape, out_dir=out_dir, trace_name=f"trace-{tag}")
    if "cpu_optimizer" in groups:
        # four blocks of the reference model (1.07 B parameters): rates are per parameter
        depth = 2 if tiny else 4
        opt_id = f"cpu_optimizer.reference.{depth}-layers"
        add(
            "cpu_optimizer",
            opt_id,
            "cpu_optimizer",
            27,
            per_model=False,
            model="reference",
            num_layers=depth,
        )
    if "scaling" in groups:
        shape = train[0] | {"cap_gib": None}
        for depth in scaling_depths:
            scaling_id = f"scaling.{model}.train.{shape['batch']}x{seq}.{depth}-layers"
            est = 14 + 1.5 * depth
            add("scaling", scaling_id, "ramflow_train", est, **shape, num_layers=depth)
    if "peers" in groups:
        for case in peer_cases(model, tiny, train, batches, seq):
            if peer_names and case["peer"] not in peer_names:
                continue
            add("peers", case.pop("id"), "peer", case.pop("estimate_s"), **case)
    return cases


def peer_cases(
    model: str, tiny: bool, train: list[dict[str, Any]], batches: list[int], seq: int
) -> list[dict[str, Any]]:
    """Peer runs, most informative first. Each names its script and arguments."""
    small, large = train[0]["batch"], train[1]["batch"]
    b = ",".join(map(str, batches))
    # (peer, script, id suffix, arguments, H200 wall estimate (s), core): the core runs are
    # the best peers of 2026-11-22 at inference, 4x2048 and 16x2048 (what the targets compare
    # against); DeepSpeed's first case in a process tree also compiles its CPU Adam (~30 s)
    runs = [
        ("ramtorch", "ramtorch_offload.py", f"infer.bf16.{b}",
         ["--mode", "infer", "--batches", b, "--weights", "bf16"], 15, True),
        ("ramtorch", "ramtorch_offload.py", f"train.{small}.keep",
         ["--mode", "train", "--batch", str(small), "--keep", "keep"], 52, True),
        ("deepspeed", "deepspeed_zero3.py", f"train.{large}",
         ["--mode", "train", "--batch", str(large)], 95, True),
        ("ramtorch", "ramtorch_offload.py", f"train.{large}.checkpoint",
         ["--mode", "train", "--batch", str(large), "--keep", "checkpoint"], 50, True),
        ("deepspeed", "deepspeed_zero3.py", f"train.{small}",
         ["--mode", "train", "--batch", str(small)], 90, False),
        ("ramtorch", "ramtorch_offload.py", f"train.{small}.checkpoint",
         ["--mode", "train", "--batch", str(small), "--keep", "checkpoint"], 44, False),
        ("accelerate", "accelerate_offload.py", f"infer.{b}",
         ["--mode", "infer", "--batches", b], 20, False),
        ("fsdp2", "fsdp2_offload.py", f"train.{small}",
         ["--mode", "train", "--batch", str(small)], 60, False),
        ("ramtorch", "ramtorch_offload.py", f"infer.fp32-autocast.{b}",
         ["--mode", "infer", "--batches", b, "--weights", "fp32-autocast"], 22, False),
        ("ramtorch", "ramtorch_offload.py", f"train.{large}.keep",
         ["--mode", "train", "--batch", str(large), "--keep", "keep"], 48, False),
    ]  # fmt: skip
    out = []
    for peer, script, suffix, args, est, core in runs:
        out.append(
            {
                "id": f"peer.{peer}.{model}.{suffix}",
                "peer": peer,
                "script": str(PEERS_DIR / script),
                "args": args,
                "estimate_s": est,
                "core": core,
            }
        )
    return out


def peer_command(case: dict[str, Any]) -> list[str]:
    """The command line of a peer case."""
    cmd = [
        sys.executable,
        case["script"],
        *case["args"],
        "--model",
        case["model"],
        "--seq",
        str(case["seq"]),
        "--warmup",
        str(case["warmup"]),
        "--steps",
        str(case["steps"]),
    ]
    if case["tiny"]:
        cmd.append("--tiny")
    return cmd


def suite_cases(*, part: int | None = None, **options: Any) -> list[dict[str, Any]]:
    """Every case of issue 4, both models, in one priority order (``bench.py --all``).

    Part 1: floors; ramflow's main cases, the resident steps and the best peers (inference,
    4x2048, 16x2048) for the reference model; k of n resident; the CPU optimizer. Part 2:
    floors again (so that it stands alone; ``--report`` keeps the later copy), llama-3b's
    ramflow and resident cases, scaling, the trace, and the other peers. ``part=None`` runs
    both in that order (the floors once). ``options`` are ``build_cases``' keywords but
    ``model`` and ``groups``.
    """
    ref = {g: build_cases([g], model="reference", **options) for g in GROUPS}
    llama = {g: build_cases([g], model="llama-3b", **options) for g in ("ramflow", "resident")}
    core = [c for c in ref["peers"] if c.get("core")]
    other = [c for c in ref["peers"] if not c.get("core")]
    first = ref["floors"] + ref["ramflow"] + ref["resident"] + core + ref["kofn"]
    first += ref["cpu_optimizer"]
    second = llama["ramflow"] + llama["resident"] + ref["scaling"] + ref["trace"] + other
    if part == 1:
        return first
    if part == 2:
        return ref["floors"] + second
    if part is not None:
        raise ValueError(f"part must be 1 or 2, got {part}")
    return first + second
