"""Tiny mixture-of-experts configs of five families, with their parameter counts by hand.

Each family is built by ``transformers``' own classes (``AutoConfig.for_model``); the sizes
are small enough that a CPU trains them in a second. ``HAND_COUNTS`` gives, from the numbers
below alone, the parameters of one model in total and those a token's forward reads (the
routed experts it is sent to, the shared experts, the dense layers, the router).
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(
    vocab_size=272,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)
FAMILIES = {
    # every layer sparse: 8 experts of width 32, 2 per token
    "qwen3_moe": dict(
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        head_dim=16,
    ),
    # 4 experts of width 128 (intermediate_size), 2 per token
    "mixtral": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    # 4 experts of width 32 with biases, 2 per token; sliding-window layers between full ones
    "gpt_oss": dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # the first layer dense (width 128), then 8 routed experts of width 32 (2 per token) and
    # a shared one; multi-head latent attention
    "deepseek_v3": dict(
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=2,
        topk_group=1,
    ),
    # the fifth, for what the four lack: a shared expert (width 64) whose output a sigmoid
    # gate (Linear(d, 1)) scales per token, routed weights not renormalised over the top 2
    # (norm_topk_prob False), biased q/k/v projections; 8 routed experts of width 32
    "qwen2_moe": dict(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2,
    ),
}  # fmt: skip


def moe_config(family: str, **overrides):
    """The tiny config of ``family`` (a key of ``FAMILIES``), with ``overrides`` of
    ``SHAPE`` (``num_hidden_layers=6``: the config's per-layer lists follow)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**SHAPE, **overrides}, **FAMILIES[family])


ROUTER_AUX_LOSS_COEF = 0.5  # large enough that the aux loss's gradient moves the routers


def save_moe_folder(family: str, path: Path) -> Path:
    """A Hugging Face folder of ``family`` with seeded random fp32 weights and the byte
    tokenizer's Hugging Face files, as ``ramflow train --model`` reads it. Its config asks
    for the router's auxiliary loss (``output_router_logits``, ``ROUTER_AUX_LOSS_COEF``)."""
    from transformers import AutoModelForCausalLM

    from ramflow.train.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer

    config = moe_config(family)
    config.output_router_logits = True
    config.router_aux_loss_coef = ROUTER_AUX_LOSS_COEF
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    ByteTokenizer().save(path)
    (path / BYTE_TOKENIZER_FILE).unlink()  # only the Hugging Face files: AutoTokenizer reads them
    return path


def save_gpt_oss_mxfp4_folder(path: Path) -> Path:
    """``save_moe_folder("gpt_oss", path)`` with its experts as a gpt-oss checkpoint ships
    them: each stacked weight ``X`` (E, R, C) replaced by ``X_blocks`` (E, C, R/32, 16) and
    ``X_scales`` (E, C, R/32), uint8, and ``quantization_config`` ``mxfp4`` in its config.
    The codes are seeded random bytes; the scales 2**-9 to 2**-5 (weights up to 6 x 2**-5,
    as an initialisation's spread)."""
    import json

    from safetensors.torch import load_file, save_file

    save_moe_folder("gpt_oss", path)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, r, c = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(
            0, 256, (e, c, r // 32, 16), generator=g, dtype=torch.uint8
        )
        tensors[name + "_scales"] = torch.randint(
            127 - 9, 127 - 4, (e, c, r // 32), generator=g, dtype=torch.uint8
        )
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _hand_counts() -> dict[str, tuple[int, int]]:
    """(total, active) parameters of each family, from ``SHAPE`` and ``FAMILIES`` by hand."""
    d, v, n_layers = 64, 272, 2
    embed_head = 2 * v * d + d  # untied embedding and head, final norm
    gqa = d * 64 + 2 * d * 32 + 64 * d  # q (4 x 16), k and v (2 x 16), o
    out = {}

    # qwen3_moe: q/k norms of head_dim, router 8 x d, experts 3 x d x 32 each
    expert = 3 * d * 32
    layer = gqa + 2 * 16 + 8 * d + 2 * d
    out["qwen3_moe"] = (
        embed_head + n_layers * (layer + 8 * expert),
        embed_head + n_layers * (layer + 2 * expert),
    )
    # mixtral: router 4 x d, experts 3 x d x 128 each
    expert = 3 * d * 128
    layer = gqa + 4 * d + 2 * d
    out["mixtral"] = (
        embed_head + n_layers * (layer + 4 * expert),
        embed_head + n_layers * (layer + 2 * expert),
    )
    # gpt_oss: biased q/k/v/o, sinks per head, biased router; experts: gate-up d x 64 + 64,
    # down 32 x d + d
    attn = gqa + 64 + 32 + 32 + d + 4
    expert = d * 64 + 64 + 32 * d + d
    layer = attn + 4 * d + 4 + 2 * d
    out["gpt_oss"] = (
        embed_head + n_layers * (layer + 4 * expert),
        embed_head + n_layers * (layer + 2 * expert),
    )
    # deepseek_v3: MLA: q_a d x 24, its norm, q_b 24 x (4 x 16), kv_a d x (16 + 8), its norm
    # (16), kv_b 16 x 4 x (8 + 16), o (4 x 16) x d
    mla = d * 24 + 24 + 24 * 64 + d * 24 + 16 + 16 * 4 * 24 + 64 * d
    dense = mla + 3 * d * 128 + 2 * d
    expert = 3 * d * 32
    sparse = mla + 8 * d + expert + 2 * d  # router (its correction bias a buffer), shared expert
    out["deepseek_v3"] = (
        embed_head + dense + sparse + 8 * expert,
        embed_head + dense + sparse + 2 * expert,
    )
    # qwen2_moe: biased q/k/v, router 8 x d, the shared expert (3 x d x 64) and its gate
    # (1 x d), experts 3 x d x 32 each
    expert = 3 * d * 32
    layer = gqa + 64 + 32 + 32 + 8 * d + 3 * d * 64 + d + 2 * d
    out["qwen2_moe"] = (
        embed_head + n_layers * (layer + 8 * expert),
        embed_head + n_layers * (layer + 2 * expert),
    )
    return out


HAND_COUNTS = _hand_counts()
