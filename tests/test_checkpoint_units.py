"""``offload(activation_checkpointing=[unit names])``: only the named units recompute."""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import MLPStack, tiny_llama
from ramflow._registry import engine_of_model


def _grads(model, x) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_only_the_named_units_are_wrapped_and_gradients_match() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    expected = _grads(ref, x)
    ramflow.offload(
        model, device="cpu", wire_dtype=torch.float32, activation_checkpointing=["blocks.1"]
    )
    assert [m is model.blocks[1] for m in engine_of_model(model).schedule.checkpointed] == [True]
    assert "forward" in model.blocks[1].__dict__ and "forward" not in model.blocks[0].__dict__
    got = _grads(model, x)
    ramflow.synchronize(model)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    ramflow.undo(model)
    assert "forward" not in model.blocks[1].__dict__


def test_an_empty_list_checkpoints_nothing() -> None:
    model = ramflow.offload(MLPStack(depth=2), device="cpu", activation_checkpointing=[])
    assert engine_of_model(model).schedule.checkpointed == []
    ramflow.undo(model)


def test_an_unknown_unit_is_refused_and_the_model_given_back() -> None:
    model = MLPStack(depth=2)
    with pytest.raises(ValueError, match="does not have"):
        ramflow.offload(model, device="cpu", activation_checkpointing=["blocks.7"])
    assert not ramflow.is_offloaded(model)
    ramflow.offload(model, device="cpu")  # nothing was left behind
    ramflow.undo(model)


def test_hugging_face_layers_follow_the_names() -> None:
    pytest.importorskip("transformers")
    model = tiny_llama(tie=True, layers=3)
    ramflow.offload(model, device="cpu", activation_checkpointing=["model.layers.1", "lm_head"])
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [False, True, False]
    # the head holds no Hugging Face layer: ramflow's wrapper recomputes it
    assert [type(m).__name__ for m in engine_of_model(model).schedule.checkpointed] == ["Linear"]
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    ramflow.undo(model)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
