"""The unit-major step order (``ramflow.engine.unit_major``): the same gradients as an
ordinary accumulation loop, each unit's gradient complete when it is announced, and the
unit calls in unit-major order."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from models import enable_hf_checkpointing  # noqa: E402
from ramflow.engine.unit_major import UnitMajorStep  # noqa: E402


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float()


def _units(model) -> list[nn.Module]:
    inner = model.model
    return [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]


def _batches(num: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(num)]


def _loss(model, num: int):
    return lambda ids: model(input_ids=ids, labels=ids).loss / num


def test_unit_major_equals_ordinary_accumulation():
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    batches = _batches(3)
    ref_losses = []
    for ids in batches:
        loss = _loss(reference, 3)(ids)
        loss.backward()
        ref_losses.append(loss.detach())

    done: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    grads_when_done: dict[str, dict[str, torch.Tensor]] = {}

    def on_done(unit):
        done.append(names[id(unit)])
        grads_when_done[names[id(unit)]] = {
            n: p.grad.clone() for n, p in unit.named_parameters() if p.grad is not None
        }

    losses = UnitMajorStep(_units(model), on_unit_done=on_done).run(_loss(model, 3), batches)

    # fp32 on the CPU, the same ops on the same values in the same order of summation
    # (micro-batch 0, 1, 2 for every parameter): bit for bit
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    ref = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n].grad), n
    # units announced once each, last first, with their gradients already complete
    expected = [names[id(u)] for u in reversed(_units(model))]
    assert done == expected
    for unit_name, grads in grads_when_done.items():
        for n, g in grads.items():
            assert torch.equal(g, ref[f"{unit_name}.{n}"].grad), (unit_name, n)


def test_every_micro_batch_passes_a_unit_before_the_next_unit_runs():
    model = _tiny_llama()
    enable_hf_checkpointing(model)  # the blocks recompute in backward
    order: list[tuple[str, int]] = []
    names = {id(m): n for n, m in model.named_modules()}
    current = threading.local()  # each micro-batch's forward runs in a thread of its own

    def record(module, args, kwargs):
        order.append((names[id(module)], getattr(current, "m", None)))

    units = _units(model)
    hooks = [u.register_forward_pre_hook(record, with_kwargs=True) for u in units]
    # a block's recompute in backward calls its children (not the block's own hooks)
    hooks += [
        layer.input_layernorm.register_forward_pre_hook(record, with_kwargs=True)
        for layer in model.model.layers
    ]
    batches = _batches(3)
    seen = iter(range(3))

    def forward(ids):
        current.m = next(seen)  # micro-batches start in order, one at a time
        return _loss(model, 3)(ids)

    try:
        UnitMajorStep(units).run(forward, batches)
    finally:
        for h in hooks:
            h.remove()
    forward_calls = [(n, m) for n, m in order if m is not None and "layernorm" not in n]
    assert forward_calls == [(names[id(u)], m) for u in units for m in range(3)]
    # backward (on the caller's thread) recomputes the blocks unit by unit too, last first
    recompute = [n for n, m in order if m is None and "layernorm" in n]
    blocks = [f"model.layers.{i}.input_layernorm" for i in range(3)]
    assert recompute == [b for b in reversed(blocks) for _ in range(3)]


def test_a_failing_micro_batch_is_named_and_leaves_no_gradient():
    model = _tiny_llama()
    batches = _batches(2)
    batches[1] = torch.full((2, 16), 999)  # out of the vocabulary: the embedding raises

    with pytest.raises(RuntimeError, match="micro-batch 1's forward raised"):
        UnitMajorStep(_units(model)).run(_loss(model, 2), batches)
    assert all(p.grad is None for p in model.parameters())


def test_units_listed_twice_are_refused():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="listed twice"):
        UnitMajorStep([model.lm_head, model.lm_head])
