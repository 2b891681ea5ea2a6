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

GROUPS = ("floors", "ramflow", "resident", "trace", "cpu_optimizer", "scaling", "peers")
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
) -> list[dict[str, Any]]:
    """All cases of the selected groups, in priority order (GROUPS order, then as listed).

    ``checkpointing_by``: who recomputes activations in ramflow's checkpointed cases,
    ``model`` (the model's own ``torch.utils.checkpoint`` per block, as in the resident
    cases) or ``ramflow`` (``ramflow.offload(activation_checkpointing=True)``, every unit).
    """
    base = _base(model, tiny, warmup, steps)
    base["checkpointing_by"] = checkpointing_by
    seq = base["seq"]
    scale = 0.1 if tiny else 1.0
    cases: list[dict[str, Any]] = []

    def add(group: str, case_id: str, kind: str, estimate_s: float, **fields: Any) -> None:
        cases.append(
            {
                **base,
                "id": case_id,
                "group": group,
                "kind": kind,
                "estimate_s": max(5.0, estimate_s * scale),
                **fields,
            }
        )

    train = training_shapes(tiny)
    if model != "reference":  # transformers computes its own loss: no chunking
        train = [shape | {"loss_chunk_tokens": 0} for shape in train]
    batches = inference_batches(tiny)
    if "floors" in groups:
        add("floors", "floors", "floors", 25)
    if "ramflow" in groups:
        add("ramflow", _train_id("ramflow", model, train[0], seq), "ramflow_train", 55, **train[0])
        infer_id = f"ramflow.{model}.infer.{'+'.join(map(str, batches))}x{seq}"
        add("ramflow", infer_id, "ramflow_infer", 25, batches=batches)
        add("ramflow", _train_id("ramflow", model, train[1], seq), "ramflow_train", 60, **train[1])
        add("ramflow", _train_id("ramflow", model, train[2], seq), "ramflow_train", 40, **train[2])
    if "resident" in groups:
        # The compute floor of each ramflow case: the same model and step, all on the GPU.
        # 16x2048 without checkpointing is left out: about 4x the activations of the 4x2048
        # step on top of 43 GB of fp32 weights, gradients and AdamW states does not fit
        # (ANCHORS.md estimates it from 4x2048; so does the report).
        plain_small = {**train[2], "batch": train[0]["batch"]}
        for shape, est in ((train[0], 20), (plain_small, 20), (train[1], 25)):
            resident_id = _resident_id(model, shape, seq)
            add("resident", resident_id, "resident_train", est, **shape | {"cap_gib": None})
        infer_id = f"resident.{model}.infer.{'+'.join(map(str, batches))}x{seq}"
        add("resident", infer_id, "resident_infer", 15, batches=batches)
    if "trace" in groups:
        shape = train[0] | {"cap_gib": None}
        trace_id = f"trace.{model}.train.{shape['batch']}x{seq}"
        add("trace", trace_id, "trace", 45, **shape, out_dir=out_dir, trace_name=f"trace-{tag}")
    if "cpu_optimizer" in groups:
        # four blocks of the reference model (1.07 B parameters): rates are per parameter
        depth = 2 if tiny else 4
        opt_id = f"cpu_optimizer.reference.{depth}-layers"
        add("cpu_optimizer", opt_id, "cpu_optimizer", 35, model="reference", num_layers=depth)
    if "scaling" in groups:
        shape = train[0] | {"cap_gib": None}
        for depth in scaling_depths:
            scaling_id = f"scaling.{model}.train.{shape['batch']}x{seq}.{depth}-layers"
            est = 20 + 2.5 * depth
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
    runs = [
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"infer.bf16.{b}",
            ["--mode", "infer", "--batches", b, "--weights", "bf16"],
            30,
        ),
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"train.{small}.keep",
            ["--mode", "train", "--batch", str(small), "--keep", "keep"],
            40,
        ),
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"train.{small}.checkpoint",
            ["--mode", "train", "--batch", str(small), "--keep", "checkpoint"],
            40,
        ),
        (
            "deepspeed",
            "deepspeed_zero3.py",
            f"train.{small}",
            ["--mode", "train", "--batch", str(small)],
            120,
        ),
        (
            "accelerate",
            "accelerate_offload.py",
            f"infer.{b}",
            ["--mode", "infer", "--batches", b],
            35,
        ),
        (
            "fsdp2",
            "fsdp2_offload.py",
            f"train.{small}",
            ["--mode", "train", "--batch", str(small)],
            75,
        ),
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"infer.fp32-autocast.{b}",
            ["--mode", "infer", "--batches", b, "--weights", "fp32-autocast"],
            35,
        ),
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"train.{large}.checkpoint",
            ["--mode", "train", "--batch", str(large), "--keep", "checkpoint"],
            50,
        ),
        (
            "deepspeed",
            "deepspeed_zero3.py",
            f"train.{large}",
            ["--mode", "train", "--batch", str(large)],
            60,
        ),
        (
            "ramtorch",
            "ramtorch_offload.py",
            f"train.{large}.keep",
            ["--mode", "train", "--batch", str(large), "--keep", "keep"],
            50,
        ),
    ]
    out = []
    for peer, script, suffix, args, est in runs:
        out.append(
            {
                "id": f"peer.{peer}.{model}.{suffix}",
                "peer": peer,
                "script": str(PEERS_DIR / script),
                "args": args,
                "estimate_s": est,
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
