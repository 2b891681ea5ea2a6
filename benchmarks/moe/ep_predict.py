"""Predicted training step of a mixture of experts under expert parallelism on one host.

Pure arithmetic from the models' public configs and the rates named below (no GPU). It
prints, per case, the parameters (total and active per token), host RAM, per-GPU PCIe and
all-to-all bytes and the time each resource needs for one optimizer step under the
one-weight-pass schedule (each unit's weights cross PCIe once per optimizer step), and the
step it predicts: the largest of the overlapped resources (GPU compute, PCIe, CPU optimizer,
host DRAM) plus the all-to-all time that compute does not hide. docs/moe.md explains it.

    python benchmarks/moe/ep_predict.py            # both cases of issue 47, point 6
    python benchmarks/moe/ep_predict.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    layers: int
    dense_layers: int  # the first layers with a dense MLP instead of experts
    hidden: int
    attn_params_per_layer: int
    dense_mlp_intermediate: int
    experts: int
    top_k: int
    shared_experts: int
    expert_intermediate: int
    vocab: int
    attn_width: int  # the width attention's scores run over (heads x head dim of q.k)


# Public configs (Hugging Face config.json of each model).
QWEN3_235B = MoEShape(
    name="Qwen3-235B-A22B", layers=94, dense_layers=0, hidden=4096,
    attn_params_per_layer=4096 * 8192 * 2 + 4096 * 512 * 2,  # q, o: 64 x 128; k, v: 4 x 128
    dense_mlp_intermediate=0, experts=128, top_k=8, shared_experts=0,
    expert_intermediate=1536, vocab=151936, attn_width=8192,
)  # fmt: skip
DEEPSEEK_V3 = MoEShape(
    name="DeepSeek-V3", layers=61, dense_layers=3, hidden=7168,
    # MLA: q_a 7168x1536, q_b 1536x(128 x 192), kv_a 7168x(512+64), kv_b 512x(128 x 256), o 16384x7168
    attn_params_per_layer=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
    + 128 * 128 * 7168,
    dense_mlp_intermediate=18432, experts=256, top_k=8, shared_experts=1,
    expert_intermediate=2048, vocab=129280, attn_width=128 * 192,
)  # fmt: skip


def counts(m: MoEShape) -> dict[str, float]:
    expert = 3 * m.hidden * m.expert_intermediate
    moe_layers = m.layers - m.dense_layers
    experts_total = moe_layers * m.experts * expert
    shared = moe_layers * m.shared_experts * expert
    dense_mlp = m.dense_layers * 3 * m.hidden * m.dense_mlp_intermediate
    attn = m.layers * m.attn_params_per_layer
    embed = 2 * m.vocab * m.hidden
    dense_total = shared + dense_mlp + attn + embed
    active = (
        dense_total - m.vocab * m.hidden + moe_layers * m.top_k * expert
    )  # input embedding: a lookup
    return {
        "total": experts_total + dense_total,
        "routed_experts": experts_total,
        "dense": dense_total,
        "active_per_token": active,
        "moe_layers": moe_layers,
    }


@dataclass(frozen=True)
class Case:
    shape: MoEShape
    gpus: int
    host_ram_gib: float
    mode: str  # "full" (lean masters and states) or "lora-nf4" (frozen NF4 experts)
    tokens_per_gpu: int  # per optimizer step
    seq_len: int
    expert_bytes_per_param: float  # host bytes per routed-expert parameter
    dense_bytes_per_param: float


# Rates: measured on the one-GPU box (shared/ANCHORS.md) unless said otherwise.
H2D_BYTES_PER_S = 54.4e9  # pinned, per GPU
MATMUL_FLOPS_PER_S = 788e12 * 0.53  # bf16 matmul rate x the fraction held-out dense shapes reach
CPU_LEAN_PARAMS_PER_S = 9.98e9  # the lean step on 16 cores
# Assumptions (not measured here: no 8-GPU host was lent): NVLink all-to-all at 300 GB/s per
# GPU each way (H100 SXM: 450 GB/s peak), host DRAM at 2 x 96 GB/s (two sockets, the box's
# copy rate each).
ALL_TO_ALL_BYTES_PER_S = 300e9
HOST_DRAM_BYTES_PER_S = 2 * 96e9


def predict(c: Case) -> dict:
    n = counts(c.shape)
    m = c.shape
    p = c.gpus
    lean = c.mode == "full"
    host_bytes = (
        n["routed_experts"] * c.expert_bytes_per_param + n["dense"] * c.dense_bytes_per_param
    )
    # PCIe per GPU and optimizer step: its own experts once, the dense parts once (every
    # GPU computes them); under LoRA with NF4 the experts' share may stay resident instead.
    expert_wire = 2.0 if lean else 0.53  # bf16, or NF4 with its block scales
    own_expert_bytes = n["routed_experts"] / p * expert_wire
    gpu_memory_bytes = 80e9 * 0.6  # what a GPU gives to resident weights beside activations
    experts_resident = (not lean) and own_expert_bytes <= gpu_memory_bytes
    h2d = (0 if experts_resident else own_expert_bytes) + n["dense"] * 2.0
    d2h = (own_expert_bytes + n["dense"] * 2.0 / p) if lean else 0.0  # gradients, ZeRO-2 dense
    # GPU compute per GPU: 8N per token with activation checkpointing for a full fine-tune
    # (forward, recompute, 2x backward), 6N for LoRA with checkpointing (no weight grads)
    # plus attention (causal: 6 x layers x seq x width per token for fwd+bwd, x4/3 recompute)
    mult = 8 if lean else 6
    attn = 6 * m.layers * c.seq_len * m.attn_width * (4 / 3)
    flops = c.tokens_per_gpu * (mult * n["active_per_token"] + attn)
    compute_s = flops / MATMUL_FLOPS_PER_S
    # all-to-all per GPU: dispatch + combine in forward, recompute and backward: 6 passes of
    # T x K x hidden bf16, (P-1)/P of it leaving the GPU
    a2a = 6 * c.tokens_per_gpu * m.top_k * m.hidden * 2 * n["moe_layers"] * (p - 1) / p
    a2a_s = a2a / ALL_TO_ALL_BYTES_PER_S
    pcie_s = max(h2d, d2h) / H2D_BYTES_PER_S
    cpu_s = (n["total"] / p) / CPU_LEAN_PARAMS_PER_S if lean else 0.0
    dram_s = p * (h2d + d2h) / HOST_DRAM_BYTES_PER_S
    overlapped = {"compute": compute_s, "pcie": pcie_s, "cpu_optimizer": cpu_s, "host_dram": dram_s}
    bound = max(overlapped, key=overlapped.get)
    # the exchange overlaps other micro-batches' compute under the one-weight-pass order,
    # but not its own layer's: count half of it as exposed
    step_s = overlapped[bound] + 0.5 * a2a_s
    return {
        "case": f"{m.name}, {c.mode}, {p} GPUs, {c.host_ram_gib:.0f} GiB RAM",
        "params_total": n["total"],
        "params_active_per_token": n["active_per_token"],
        "host_gib": host_bytes / 2**30,
        "fits_host": host_bytes / 2**30 <= c.host_ram_gib * 0.92,
        "experts_resident_on_gpus": experts_resident,
        "h2d_gb_per_gpu": h2d / 1e9,
        "all_to_all_gb_per_gpu": a2a / 1e9,
        **{f"{k}_s": v for k, v in overlapped.items()},
        "all_to_all_s": a2a_s,
        "bound": bound,
        "step_s": step_s,
        "tokens_per_s": p * c.tokens_per_gpu / step_s,
        "mfu_active": flops / step_s / 788e12,
    }


CASES = [
    # full fine-tune, lean masters and 8-bit states for the dense parts (4.03 bytes), experts
    # with 4-bit states (bf16 master 2 + 2 x 0.5 + block scales: 3.03 bytes)
    Case(QWEN3_235B, gpus=8, host_ram_gib=1024, mode="full", tokens_per_gpu=8 * 4096,
         seq_len=4096, expert_bytes_per_param=3.03, dense_bytes_per_param=4.03),
    # LoRA: frozen NF4 experts (0.53 bytes with block scales), bf16 dense parts
    Case(DEEPSEEK_V3, gpus=8, host_ram_gib=560, mode="lora-nf4", tokens_per_gpu=4 * 4096,
         seq_len=4096, expert_bytes_per_param=0.53, dense_bytes_per_param=2.0),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [predict(c) for c in CASES]
    if args.json:
        print(
            json.dumps(
                {"cases": [asdict(c) | {"shape": c.shape.name} for c in CASES], "rows": rows},
                indent=1,
            )
        )
        return
    for r in rows:
        print(r["case"])
        print(
            f"  parameters {r['params_total'] / 1e9:.1f} B total, "
            f"{r['params_active_per_token'] / 1e9:.1f} B active per token"
        )
        print(
            f"  host {r['host_gib']:.0f} GiB ({'fits' if r['fits_host'] else 'does NOT fit'}); "
            f"experts resident on the GPUs: {r['experts_resident_on_gpus']}"
        )
        print(
            f"  per GPU and step: H2D {r['h2d_gb_per_gpu']:.0f} GB, all-to-all "
            f"{r['all_to_all_gb_per_gpu']:.0f} GB"
        )
        print(
            "  seconds: "
            + ", ".join(
                f"{k} {r[k + '_s']:.2f}"
                for k in ("compute", "pcie", "cpu_optimizer", "host_dram", "all_to_all")
            )
        )
        print(
            f"  step {r['step_s']:.2f} s ({r['bound']}-bound), {r['tokens_per_s']:,.0f} tokens/s, "
            f"MFU on active parameters {r['mfu_active']:.0%}"
        )


if __name__ == "__main__":
    main()
