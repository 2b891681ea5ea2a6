"""Text generation with offloaded weights and a KV cache: ``ramflow generate``.

Legend: n = prompts in the batch, L = longest prompt (tokens), V = vocabulary size.

The loop is written out rather than delegated to ``transformers``' ``generate``: the
model's parameters live on the host between forward calls (``model.device`` says CPU)
while its inputs, KV cache and logits live on the compute device, and a short explicit
loop keeps every tensor where it belongs. Prompts are left-padded into one batch with an
attention mask and explicit position ids; the prompt goes through the model once
(prefill), then one token per step reuses the ``DynamicCache``.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import ramflow

from ..sizes import parse_bytes
from .hub import resolve_hub_model
from .modeling import build_model, load_offloaded, read_config
from .precision import ComputePolicy, resolve_compute
from .run_checkpoint import STATE_FILE, find_checkpoint, open_checkpoint
from .tokenizer import Tokenizer, has_tokenizer, load_tokenizer


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked.

    Attributes:
        max_new_tokens: tokens to generate per prompt (at most).
        temperature: 0 picks the most likely token (greedy); above 0 (finite) samples
            from the softmax of ``logits / temperature``.
        top_k: sample only among the ``top_k`` most likely tokens (0: all).
        top_p: sample only among the most likely tokens whose probabilities add up to
            ``top_p`` (nucleus sampling, Holtzman et al. 2020; 1.0: all).
        seed: seeds the sampling generator.
        stop_at_eos: a prompt's generation ends at the end-of-text token.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"--temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 keeps all tokens), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Generation:
    """One prompt's result.

    Attributes:
        prompt: the prompt text.
        token_ids: the generated ids (the end-of-text token, if reached, included).
        text: the generated text (special tokens dropped).
    """

    prompt: str
    token_ids: list[int]
    text: str


def _pick(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> torch.Tensor:
    """Next ids from (n, V) fp32 logits: (n,) int64."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = (
            cumulative - sorted_logits.softmax(dim=-1) >= sampling.top_p
        )  # keeps the first token always
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _check_context(config: object, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a generation longer than the model's context: positions past
    ``max_position_embeddings`` are outside what the model was trained on (and what its
    position tables or rotary caches are built for), and the output is garbage."""
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or prompt_tokens + max_new_tokens <= context:
        return
    if prompt_tokens >= context:
        raise ValueError(
            f"the prompt is {prompt_tokens} tokens, and the model's context is {context} "
            "tokens (max_position_embeddings): shorten the prompt"
        )
    raise ValueError(
        f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
        f"the model's context of {context} tokens (max_position_embeddings); give "
        f"--max-new-tokens {context - prompt_tokens} or less, or a shorter prompt"
    )


def _cache_keyword(model: nn.Module) -> str:
    """The name the model's forward gives its KV cache: ``cache`` in recent transformers,
    which deprecates ``past_key_values`` with a FutureWarning at every call."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: list[str],
    *,
    sampling: SamplingConfig,
    policy: ComputePolicy,
) -> list[Generation]:
    """Continue each prompt, all prompts in one batch.

    Args:
        model: a causal LM (offloaded or not) whose forward takes ``attention_mask``,
            ``position_ids``, ``cache`` (``past_key_values`` in older transformers) and
            ``logits_to_keep``.
        tokenizer: encodes the prompts (after its bos token, when it has one) and decodes.
        prompts: the texts to continue (at least one; each non-empty unless the
            tokenizer has a bos token).
        sampling: greedy or sampled, and how long.
        policy: the compute device and precision.

    Returns:
        One ``Generation`` per prompt, in order.

    Raises:
        ValueError: no prompts, an empty prompt with a tokenizer that has no bos token, or
            the longest prompt (in tokens, bos included) plus ``max_new_tokens`` exceeds the
            model's context (``config.max_position_embeddings``, where it has one).
    """
    from transformers import DynamicCache

    if not prompts:
        raise ValueError("give at least one --prompt")
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    encoded = [bos + tokenizer.encode(p) for p in prompts]
    if any(not ids for ids in encoded):
        raise ValueError(
            "an empty prompt cannot be continued by a model whose tokenizer has no bos token"
        )
    n, longest = len(encoded), max(len(ids) for ids in encoded)
    _check_context(getattr(model, "config", None), longest, sampling.max_new_tokens)
    dev = policy.device
    ids = torch.full((n, longest), tokenizer.pad_id, dtype=torch.long)  # (n, L)
    mask = torch.zeros((n, longest), dtype=torch.long)  # (n, L)
    for i, row in enumerate(encoded):
        ids[i, longest - len(row) :] = torch.tensor(row)
        mask[i, longest - len(row) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(dev), mask.to(dev), positions.to(dev)
    # tokens the model must not produce: rows past the tokenizer's vocabulary, padding, bos
    vocab = model.config.vocab_size
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[tokenizer.vocab_size :] = True
    for special in (
        tokenizer.bos_id,
        tokenizer.pad_id if tokenizer.pad_id != tokenizer.eos_id else None,
    ):
        if special is not None and special < vocab:
            banned[special] = True
    generator = torch.Generator().manual_seed(sampling.seed)
    cache_arg = {_cache_keyword(model): DynamicCache(config=model.config)}
    new: list[list[int]] = [[] for _ in range(n)]
    finished = torch.zeros(n, dtype=torch.bool)
    was_training = model.training
    model.eval()
    try:
        with policy.autocast():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **cache_arg,
                use_cache=True,
                logits_to_keep=1,
            )
        for t in range(sampling.max_new_tokens):
            logits = out.logits[:, -1, :].float().cpu().masked_fill(banned, float("-inf"))  # (n, V)
            nxt = _pick(logits, sampling, generator)
            for i in range(n):
                if not finished[i]:
                    new[i].append(int(nxt[i]))
            if sampling.stop_at_eos and tokenizer.eos_id is not None:
                finished |= nxt == tokenizer.eos_id
            if bool(finished.all()) or t == sampling.max_new_tokens - 1:
                break
            nxt = nxt.masked_fill(finished, tokenizer.pad_id)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
            positions = positions[:, -1:] + 1
            with policy.autocast():
                out = model(
                    input_ids=nxt[:, None].to(dev),
                    attention_mask=mask,
                    position_ids=positions,
                    **cache_arg,
                    use_cache=True,
                )
    finally:
        model.train(was_training)
    return [Generation(p, toks, tokenizer.decode(toks)) for p, toks in zip(prompts, new)]


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """The model folder meant by ``path``: a run folder gives its latest checkpoint; a
    checkpoint folder or a Hugging Face folder is itself; a Hub id ``org/name`` its
    snapshot in the local Hugging Face cache (``ramflow.train.hub``). A ramflow
    checkpoint's model files (config, weights, tokenizer) are checked against its
    manifest, as resuming does.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no model; a Hub id not in the
            cache (the message gives the ``hf download`` command).
        CheckpointError: a checkpoint's file is missing, truncated or altered.
    """
    p = resolve_hub_model(path)
    if not p.exists():
        raise FileNotFoundError(f"--model {p}: no such folder")
    if (p / "config.json").is_file():
        if (p / STATE_FILE).is_file():
            open_checkpoint(p, model_only=True)
        return p
    if (p / "checkpoints").is_dir():
        ckpt = find_checkpoint(p)
        if (ckpt / STATE_FILE).is_file():
            return open_checkpoint(ckpt, model_only=True).path
    raise FileNotFoundError(
        f"--model {p}: neither a model folder (config.json) nor a run folder with checkpoints"
    )


def _adapters_base(adapters: Path) -> tuple[Path | None, int | None]:
    """Where the base of the LoRA checkpoint ``adapters`` comes from: its model folder
    (``base_model_name_or_path``) and None, or None and the run's seed (a run on a
    preset's fresh weights).

    Raises:
        FileNotFoundError: the named base folder is not found from here.
        ValueError: no base is named and the folder is not a ramflow checkpoint.
    """
    from .lora import adapter_base

    base = adapter_base(adapters)
    if base is not None:
        try:
            return resolve_model_dir(base), None
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{adapters} holds LoRA adapters trained on the base model {base!r}, which is "
                f"not found from {os.getcwd()}: run from the folder the training ran in, or "
                "write the base's path into its adapter_config.json (base_model_name_or_path)"
            ) from err
    if not (adapters / STATE_FILE).is_file():
        raise ValueError(
            f"{adapters} holds LoRA adapters whose adapter_config.json names no base model "
            "(base_model_name_or_path): write the base's folder there"
        )
    return None, open_checkpoint(adapters, model_only=True).state["train_config"]["seed"]


def load_for_generation(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: str | None = None,
    precision: str = "auto",
    gpu_memory: str | int | None = None,
    frozen_format: str | None = None,
) -> tuple[nn.Module, Tokenizer, ComputePolicy]:
    """Load a checkpoint (see ``resolve_model_dir``) and offload it for inference.

    Args:
        path: run, checkpoint or Hugging Face model folder. A LoRA run's checkpoint (PEFT
            adapters) loads its base model (``base_model_name_or_path`` of its
            ``adapter_config.json``) and puts the adapters on it.
        tokenizer: a tokenizer folder; None: the model folder's own, else the byte tokenizer.
        device, precision: see ``resolve_compute``.
        gpu_memory: cap on what ramflow keeps on the device (weights); the KV cache and
            activations come on top.
        frozen_format: ``int8`` or ``nf4``: the weights (all frozen for inference) are
            kept compressed in host RAM (``ramflow.offload(..., frozen_format=...)``).

    Returns:
        ``(model, tokenizer, policy)``; the model is offloaded with ``ramflow.offload``.

    Raises:
        FileNotFoundError, ValueError: a missing folder (a LoRA checkpoint's base model
            included), unreadable or mismatched weights or adapters
            (another model shape), a checkpoint whose files do not match its manifest
            (``CheckpointError``), a tokenizer larger than the model's vocabulary, a
            budget too small.
    """
    from .lora import attach_adapters, frozen_format_options, is_adapter_checkpoint

    compressed = frozen_format_options(frozen_format)
    policy = resolve_compute(device=device, precision=precision)
    model_dir = resolve_model_dir(path)
    adapters = model_dir if is_adapter_checkpoint(model_dir) else None
    weights_dir, seed = (model_dir, None) if adapters is None else _adapters_base(adapters)
    tok_dir = (
        tokenizer if tokenizer is not None else (model_dir if has_tokenizer(model_dir) else None)
    )
    tok = load_tokenizer(tok_dir)
    config = read_config(weights_dir if weights_dir is not None else model_dir)
    if tok.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} tokens but the model has {config.vocab_size} embedding "
            "rows; give the model's own tokenizer with --tokenizer DIR"
        )
    gpu_memory_bytes = None if gpu_memory is None else parse_bytes(gpu_memory, what="--gpu-memory")
    options = dict(gpu_memory=gpu_memory_bytes, device=policy.device, wire_dtype=policy.wire_dtype)
    if weights_dir is None:
        model = build_model(config, seed=seed).requires_grad_(False)
        ramflow.offload(model, **options, **compressed)
    else:
        model = load_offloaded(
            weights_dir,
            config=config,
            requires_grad=not compressed and adapters is None,
            **options,
            **compressed,
        )
    if adapters is not None:
        model = attach_adapters(model, adapters)
    model.eval()
    return model, tok, policy


__all__ = ["Generation", "SamplingConfig", "generate", "load_for_generation", "resolve_model_dir"]
