"""Named model presets: shapes that ``ramflow train`` can build.

Every preset is a Hugging Face config built from the numbers below, so the model is
``transformers``' own class: ``LlamaConfig`` for the dense presets, the family's config
(``architecture``) for the mixtures of experts. The public shapes are those of Meta's
Llama 3.2-1B, Llama 3.2-3B, Llama 3.1-8B and Llama 3.1-70B, Qwen's Qwen3-30B-A3B,
OpenAI's gpt-oss-120b and DeepSeek's DeepSeek-V2-Lite ``config.json`` files; ``anchor-2.7b`` is the benchmarks'
reference model (benchmarks/reference_model.py); ``tiny`` trains on a laptop CPU in minutes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    """The shape of one model and the training defaults that suit it.

    Attributes:
        name: the preset's name on the command line.
        description: one line for ``--help`` and the run summary.
        hidden_size: width of the residual stream (elements).
        intermediate_size: width of the SwiGLU MLP (elements).
        num_layers: number of decoder blocks.
        num_heads: attention (query) heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than heads).
        vocab_size: embedding rows; None takes the tokenizer's size (the byte tokenizer's
            259 for ``tiny``).
        max_position_embeddings: longest sequence the rotary embedding is set up for (tokens).
        tie_word_embeddings: the head shares the token embedding's weight.
        rope_parameters: ``rope_parameters`` of the config (theta and scaling).
        rms_norm_eps: epsilon of the RMSNorm layers.
        head_dim: per-head width; None means ``hidden_size // num_heads``.
        batch_size: default sequences per micro-batch.
        seq_len: default tokens per sequence.
        lr: default peak learning rate of AdamW.
        steps: default number of optimizer steps.
        architecture: the ``transformers`` model type (``"llama"``: ``LlamaConfig``).
        architecture_options: the family's further config keys (experts, latent attention).
    """

    name: str
    description: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None
    batch_size: int = 4
    seq_len: int = 2048
    lr: float = 1.5e-4
    steps: int = 100
    architecture: str = "llama"
    architecture_options: Mapping[str, Any] = field(default_factory=dict)

    def num_parameters(self, *, vocab_size: int | None = None) -> int:
        """Parameter count of the model this preset builds (embedding counted once if tied).

        Raises:
            ValueError: the preset takes its vocabulary from the tokenizer and ``vocab_size``
                is None; a preset of another architecture than Llama (count its meta model:
                ``ramflow.planner.costs.parameter_counts``).
        """
        vocab = self.vocab_size if self.vocab_size is not None else vocab_size
        if vocab is None:
            raise ValueError(
                f"preset {self.name!r} takes its vocabulary size from the tokenizer; give vocab_size"
            )
        if self.architecture != "llama":
            raise ValueError(
                f"preset {self.name!r} is a {self.architecture} model; count its meta model's "
                "parameters (ramflow.planner.costs.parameter_counts)"
            )
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        attn = self.hidden_size * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embed = vocab * self.hidden_size
        head = 0 if self.tie_word_embeddings else vocab * self.hidden_size
        return self.num_layers * (attn + mlp + norms) + embed + head + self.hidden_size

    def to_config(
        self,
        *,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ):
        """The ``transformers.LlamaConfig`` of this preset.

        Args:
            vocab_size: the tokenizer's size; used when the preset has none, and checked
                against the preset's own otherwise.
            bos_token_id, eos_token_id, pad_token_id: the tokenizer's special ids, stored in
                the config so that a saved checkpoint generates with the right ones.

        Raises:
            ValueError: the tokenizer has more tokens than the preset's embedding has rows.
        """
        from transformers import LlamaConfig

        vocab = self.vocab_size
        if vocab is None:
            if vocab_size is None:
                raise ValueError(f"preset {self.name!r} needs the tokenizer's vocab_size")
            vocab = vocab_size
        elif vocab_size is not None and vocab_size > vocab:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but preset {self.name!r} has only {vocab} "
                "embedding rows; use a tokenizer that fits, or a checkpoint folder (--model DIR) "
                "with a config that matches your tokenizer"
            )
        shape = dict(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            # fused attention with is_causal: no (T, T) mask or scores (packed sequences
            # have no padding), which long sequences need
            attn_implementation="sdpa",
        )
        if self.architecture == "llama":
            return LlamaConfig(**shape)
        from transformers import AutoConfig

        for key in ("attention_bias", "mlp_bias"):  # Llama's keys
            shape.pop(key)
        shape.update(self.architecture_options)  # the family's own (its attention too)
        return AutoConfig.for_model(self.architecture, **shape)


_LLAMA3_ROPE_32 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_8 = {**_LLAMA3_ROPE_32, "factor": 8.0}

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="tiny",
            description="3.5 M parameters, 4 layers of width 256; trains on a CPU in minutes",
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            vocab_size=None,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            batch_size=16,
            seq_len=256,
            lr=2e-3,
            steps=150,
        ),
        ModelPreset(
            name="llama-1b",
            description="the shape of Llama 3.2-1B (1.24 B parameters, tied head)",
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope_parameters=_LLAMA3_ROPE_32,
        ),
        ModelPreset(
            name="llama-3b",
            description="the shape of Llama 3.2-3B (3.21 B parameters, tied head)",
            hidden_size=3072,
            intermediate_size=8192,
            num_layers=28,
            num_heads=24,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope_parameters=_LLAMA3_ROPE_32,
        ),
        ModelPreset(
            name="llama-8b",
            description="the shape of Llama 3.1-8B (8.03 B parameters)",
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rope_parameters=_LLAMA3_ROPE_8,
        ),
        ModelPreset(
            name="llama-70b",
            description="the shape of Llama 3.1-70B (70.6 B parameters); a full fine-tune "
            "needs about 4 bytes per parameter of host RAM (--host-precision lean)",
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rope_parameters=_LLAMA3_ROPE_8,
            batch_size=1,
            lr=1e-5,
        ),
        ModelPreset(
            name="anchor-2.7b",
            description="the benchmarks' reference model (2.69 B parameters, 12 layers of width 4096)",
            hidden_size=4096,
            intermediate_size=11008,
            num_layers=12,
            num_heads=32,
            num_kv_heads=32,
            vocab_size=32000,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
        ModelPreset(
            name="qwen3-30b-a3b",
            description="the shape of Qwen3-30B-A3B (30.5 B parameters, 3.35 B active per "
            "token: 8 of 128 experts in each of 48 layers)",
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            batch_size=1,
            lr=1e-5,
            architecture="qwen3_moe",
            architecture_options={
                "moe_intermediate_size": 768,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            },
        ),
        ModelPreset(
            name="gpt-oss-120b",
            description="the shape of OpenAI's gpt-oss-120b (116.8 B parameters, 5.1 B active "
            "per token besides the embedding: 4 of 128 experts in each of 36 layers; its "
            "experts ship as MXFP4, --frozen-format mxfp4 keeps them so under --lora)",
            hidden_size=2880,
            intermediate_size=2880,
            num_layers=36,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            vocab_size=201088,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            batch_size=1,
            lr=1e-5,
            architecture="gpt_oss",
            architecture_options={
                "num_local_experts": 128,
                "num_experts_per_tok": 4,
                "sliding_window": 128,
                "attention_bias": True,
                "swiglu_limit": 7.0,
                # its attention sinks: transformers' eager attention, not SDPA
                "attn_implementation": "eager",
            },
        ),
        ModelPreset(
            name="deepseek-v2-lite",
            description="the shape of DeepSeek-V2-Lite (15.7 B parameters, 2.66 B active per "
            "token: 6 of 64 routed experts and 2 shared in 26 of 27 layers; latent attention)",
            hidden_size=2048,
            intermediate_size=10944,
            num_layers=27,
            num_heads=16,
            num_kv_heads=16,
            head_dim=192,  # qk_nope_head_dim + qk_rope_head_dim
            vocab_size=102400,
            max_position_embeddings=163840,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            rms_norm_eps=1e-6,
            batch_size=1,
            lr=1e-5,
            architecture="deepseek_v2",
            architecture_options={
                "moe_intermediate_size": 1408,
                "n_routed_experts": 64,
                "n_shared_experts": 2,
                "num_experts_per_tok": 6,
                "first_k_dense_replace": 1,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "topk_method": "greedy",
                "n_group": 1,
                "topk_group": 1,
                "routed_scaling_factor": 1.0,
            },
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``. Raises ValueError, listing the presets, for an unknown name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


__all__ = ["PRESETS", "ModelPreset", "get_preset"]
