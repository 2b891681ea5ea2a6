"""On the GPU: the fitter stays under a real device budget, and the size-based checkpointing
policy meets its activation target.

The budget is made real with ``torch.cuda.set_per_process_memory_fraction``: past it the
caching allocator raises ``torch.OutOfMemoryError``, as a smaller GPU would. Budgets are
set from the toolkit's own measurements of the same model (``MemoryTracker`` peaks,
``activation_report``), so the tests hold on any CUDA GPU with a few GiB free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from models import MLPStack
from ramflow.memory import (
    CheckpointAll,
    CheckpointToBudget,
    MemoryTracker,
    activation_report,
    apply_checkpointing,
    find_blocks,
    fit_batch,
)

pytestmark = pytest.mark.gpu

SEQ_LEN = 512
VOCAB = 8192
GLOBAL_BATCH = 8


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            attn_implementation="sdpa",
        )
    )


def gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            attn_implementation="sdpa",
        )
    )


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            attn_implementation="sdpa",
        )
    )


def mlp_stack() -> nn.Module:
    return MLPStack(dim=512, depth=6)


def batch_loss(model: nn.Module, micro_batch: int) -> torch.Tensor:
    """The loss of one micro-batch of ``micro_batch`` sequences of ``SEQ_LEN`` tokens."""
    g = torch.Generator(device="cuda").manual_seed(micro_batch)
    if isinstance(model, MLPStack):
        x = torch.randn(micro_batch, SEQ_LEN, 16, device="cuda", generator=g)  # (B, T, 16)
        return model(x).square().mean()
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ_LEN), device="cuda", generator=g)  # (B, T)
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def micro_step(model: nn.Module, micro_batch: int, checkpointing: bool) -> None:
    """``fit_batch``'s trial: two accumulated micro-batches, the gradients dropped after.

    The second backward runs with the first one's gradients held on the device, as every
    micro-batch after the first does under gradient accumulation; one backward alone
    would leave out those bytes and let the fitter pick a micro-batch that does not fit."""
    handle = apply_checkpointing(model, CheckpointAll()) if checkpointing else None
    try:
        for _ in range(2):
            batch_loss(model, micro_batch).backward()
    finally:
        model.zero_grad(set_to_none=True)
        if handle is not None:
            handle.undo()


def tracked_peak(fn: Callable[[], None]) -> int:
    torch.cuda.synchronize()
    with MemoryTracker() as tracker:
        fn()
        torch.cuda.synchronize()
        tracker.snapshot("done")
    assert tracker.peak_bytes is not None
    return tracker.peak_bytes


@contextlib.contextmanager
def device_budget(budget_bytes: int) -> Iterator[None]:
    """The caching allocator refuses to hold more than ``budget_bytes`` in this block."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(budget_bytes / total)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("build", [llama, gpt_neox, qwen2, mlp_stack])
def test_the_fitter_stays_under_its_budget(build) -> None:
    if build is not mlp_stack:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build().cuda()
    micro_step(model, 1, False)  # warm-up: kernels' workspaces stay allocated from here on
    peak_1 = tracked_peak(lambda: micro_step(model, 1, False))
    peak_2 = tracked_peak(lambda: micro_step(model, 2, False))
    per_sequence = peak_2 - peak_1
    assert per_sequence > 0
    # a micro-batch of 2 fits with 1.5 sequences' worth to spare (allocator slack); one of
    # 4 needs a sequence and a half more than the budget, so it runs out of memory for real
    budget = peak_1 + int(2.5 * per_sequence)
    with device_budget(budget):
        fit = fit_batch(
            global_batch=GLOBAL_BATCH,
            device_budget_bytes=budget,
            trial=lambda b, ckpt: micro_step(model, b, ckpt),
        )
        assert [t.outcome for t in fit.trials] == ["out of memory (trial)"] * 2 + ["fits"]
        assert (fit.micro_batch, fit.grad_accum, fit.checkpointing) == (2, 4, False)

        def accumulated_step() -> None:
            for _ in range(fit.grad_accum):
                (batch_loss(model, fit.micro_batch) / fit.grad_accum).backward()
            model.zero_grad(set_to_none=True)

        peak = tracked_peak(accumulated_step)
    assert peak <= budget


@pytest.mark.parametrize("build", [llama, mlp_stack])
def test_the_size_policy_meets_its_activation_target(build) -> None:
    if build is not mlp_stack:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build().cuda()

    def measure():
        if isinstance(model, MLPStack):
            x = torch.randn(4, SEQ_LEN, 16, device="cuda")
            return activation_report(model, x, loss_fn=lambda out: out.square().mean())
        ids = torch.randint(0, VOCAB, (4, SEQ_LEN), device="cuda")
        return activation_report(model, input_ids=ids, labels=ids, use_cache=False)

    report = measure()
    blocks = [name for name, _ in find_blocks(model)]
    savings = [report[n].saved_bytes - report[n].input_bytes for n in blocks]
    assert all(s > 0 for s in savings)
    # a target that needs about half the blocks checkpointed
    target = report.total_saved_bytes - sum(savings) // 2
    handle = apply_checkpointing(model, CheckpointToBudget(target, report=report))
    assert 0 < len(handle.plan.blocks) < len(blocks)
    after = measure()
    assert after.total_saved_bytes <= target < report.total_saved_bytes
    handle.undo()
