"""LoRA on an offloaded model: PEFT's adapters stay on the device, the frozen base streams.

Parity with plain PEFT on a deepcopy, for ``get_peft_model`` applied before and after
``ramflow.offload``: exact on the CPU (CI), marked ``gpu`` on CUDA. See [Note: adapters on
the device] in ``ramflow.engine.adapters``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import LoRAStack, tiny_llama

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def base_model():
    # hidden 128: rank-4 LoRA on every projection is about 5% of the parameters, under the
    # automatic rule's 10%
    return tiny_llama(tie=False, hidden=128, intermediate=256)


def peft_pair(when: str, device: torch.device):
    """(offloaded PEFT model, resident PEFT reference on ``device``) with equal adapters."""
    torch.manual_seed(0)
    base = base_model()
    if when == "before":
        model = peft.get_peft_model(base, lora_config())
        ref = copy.deepcopy(model).to(device)
        ramflow.offload(model, device=device, wire_dtype=torch.float32)
    else:
        ref_base = copy.deepcopy(base)
        ramflow.offload(base, device=device, wire_dtype=torch.float32)
        model = peft.get_peft_model(base, lora_config())
        ref = peft.get_peft_model(ref_base, lora_config()).to(device)
        peft.set_peft_model_state_dict(ref, peft.get_peft_model_state_dict(model))
    return model, ref


def lora_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def batches(n: int, device):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 12), generator=g).to(device) for _ in range(n)]


def same(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> bool:
    if device.type == "cpu":
        return torch.equal(a, b)
    # cuBLAS may pick another kernel for another alignment of the same fp32 operands
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("when", ["before", "after"])
def test_peft_parity_adapters_on_device(device, when):
    model, ref = peft_pair(when, device)
    opt = ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    for step, ids in enumerate(batches(5, device)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert same(loss, ref_loss, device), (step, loss.item(), ref_loss.item())
    engine = ramflow.api._engine(model)
    adapters = lora_params(model)
    assert len(adapters) == 2 * len(TARGETS) * 3
    assert {id(p) for p in engine.adapters.params} == {id(p) for p in adapters}
    # ordinary device parameters, stepped there: no unit owns them, no host buffer holds them
    masters = {u.master.untyped_storage().data_ptr() for u in engine.units}
    for p in adapters:
        assert p.device.type == device.type
        assert engine.unit_of(p) is None
        assert p.untyped_storage().data_ptr() not in masters
        assert p in opt.state and opt.state[p]["exp_avg"].device.type == device.type
    # the host store holds no trainable bytes: every unit is frozen (the base)
    assert all(u.num_trainable == 0 and u.trainable_numel == 0 for u in engine.units)
    assert all(u.staging is None and u.host_grad is None for u in engine.units)
    # the plan counts the adapters with their gradients and AdamW states
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert engine.plan.fixed_bytes == buffers + 4 * adapter_bytes
    # undo: a plain model with the trained adapters, on the CPU
    undone = ramflow.undo(model)
    assert undone is model and not ramflow.is_offloaded(model.base_model.model)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.device.type == "cpu"
        assert same(p.detach().to(device), q.detach(), device), name
    assert not torch.equal(adapters[1].detach(), torch.zeros_like(adapters[1]))  # lora_B moved


def test_rule_streams_a_large_trainable_share():
    """LoRAStack trains about a fifth of its parameters: over the automatic share, so its
    trainable parameters stream with their units; ``trainable_on_device`` overrides."""
    torch.manual_seed(0)
    for choice, kept in ((None, False), (True, True), (False, False)):
        model = LoRAStack()
        trainable = [p for p in model.parameters() if p.requires_grad]
        ramflow.offload(model, wire_dtype=torch.float32, trainable_on_device=choice)
        engine = ramflow.api._engine(model)
        assert len(engine.adapters.params) == (len(trainable) if kept else 0)
        assert all((engine.unit_of(p) is None) == kept for p in trainable)
        ramflow.undo(model)


def test_trainable_on_device_false_streams_peft_adapters():
    torch.manual_seed(0)
    model = peft.get_peft_model(base_model(), lora_config())
    ramflow.offload(model, wire_dtype=torch.float32, trainable_on_device=False)
    engine = ramflow.api._engine(model)
    assert not engine.adapters.params
    assert all(engine.unit_of(p) is not None for p in lora_params(model))


def test_bad_trainable_on_device():
    model = base_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        ramflow.offload(model, trainable_on_device=True)
    with pytest.raises(TypeError, match="True, False or None"):
        ramflow.offload(model, trainable_on_device="yes")
    with pytest.raises(ValueError, match="zero_stage"):
        ramflow.offload(base_model(), trainable_on_device=True, zero_stage=1)
    assert not ramflow.is_offloaded(model)


def test_partly_frozen_unit_after_offload_is_refused():
    """Freezing some of a unit's parameters after offload cannot follow its host layout:
    the next forward says what to do, and changes nothing."""
    torch.manual_seed(0)
    model = base_model()
    ramflow.offload(model, wire_dtype=torch.float32)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ValueError, match="requires_grad before ramflow.offload"):
        model(input_ids=ids)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    model(input_ids=ids, labels=ids).loss.backward()  # as before


def test_adapters_on_meta_device_get_their_values():
    """A PEFT model built on the meta device and loaded with ``weights=``: the adapters
    kept on the device are written by the weights function too."""
    with torch.device("meta"):
        model = peft.get_peft_model(base_model(), lora_config())
    seen = []

    def weights(name, out):
        seen.append(name)
        out.fill_(0.01)

    inner = model.base_model.model  # the transformers model: its rotary buffers are rebuilt
    ramflow.offload(inner, wire_dtype=torch.float32, weights=weights)
    engine = ramflow.api._engine(model)
    assert engine.adapters.params
    for p in engine.adapters.params:
        assert not p.is_meta and torch.all(p == 0.01)
    assert any("lora_A" in n for n in seen)


def test_adapters_are_found_in_one_walk_of_the_model(monkeypatch):
    """The automatic rule looks the adapters up once per ``offload``, not once per
    parameter: a walk per parameter made offloading an 80-layer PEFT model take minutes."""
    from ramflow.engine import adapters as _adapters

    calls = []
    walk = _adapters._adapter_ids
    monkeypatch.setattr(_adapters, "_adapter_ids", lambda m: calls.append(1) or walk(m))
    torch.manual_seed(0)
    model = peft.get_peft_model(base_model(), lora_config())
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    assert len(calls) == 1
    assert len(ramflow.api._engine(model).adapters.params) == 2 * len(TARGETS) * 3


def test_modules_to_save_after_offload_says_to_apply_peft_first():
    """PEFT's ``modules_to_save`` deep-copies the modules it names inside
    ``get_peft_model``; an offloaded module cannot be copied, and the error says to apply
    PEFT before ``offload`` (where it works)."""
    torch.manual_seed(0)
    base = base_model()
    ramflow.offload(base, device="cpu", wire_dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(TypeError, match="modules_to_save.*get_peft_model before ramflow.offload"):
        peft.get_peft_model(base, cfg)


@pytest.mark.parametrize("frozen_format", [None, "int8"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_merge_after_undo_gives_the_adapted_model(when, frozen_format):
    """The documented way to merge: ``ramflow.undo`` gives back dense weights (under
    ``frozen_format`` the dequantized ones the device computed with), then PEFT merges the
    adapters into them. (On the offloaded model PEFT writes the base weights through
    ``.data``, which ramflow does not see: see README's LoRA section.)"""
    torch.manual_seed(0)
    base = base_model()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    if when == "before":
        model = peft.get_peft_model(base, cfg)
        ramflow.offload(model, device="cpu", wire_dtype=torch.float32, frozen_format=frozen_format)
    else:
        base.requires_grad_(False)
        ramflow.offload(base, device="cpu", wire_dtype=torch.float32, frozen_format=frozen_format)
        model = peft.get_peft_model(base, cfg)
        ramflow.adopt(model)  # over a meta stand-in the adapters get PEFT's default init: B = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    ids = torch.randint(0, 128, (2, 8))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapters change the output
    ramflow.undo(model)
    merged = model.merge_and_unload()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, adapted, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("when", ["before", "after"])
def test_merge_on_the_offloaded_model_gives_the_adapted_model(when):
    """PEFT writes the merged base weights in place through ``.data``: the unit's copies
    went stale and the merged model computed without the adapters, silently. Its tuner
    layers' merge now refreshes the unit; under frozen_format it refuses before writing."""
    torch.manual_seed(0)
    base = base_model()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    if when == "before":
        model = peft.get_peft_model(base, cfg)
        ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    else:
        ramflow.offload(base, device="cpu", wire_dtype=torch.float32)
        model = peft.get_peft_model(base, cfg)
    ids = torch.randint(0, 128, (2, 8))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        got = merged(input_ids=ids).logits
    # merging rounds W + B A once per weight: fp32 rounding of the sums, not the adapters
    torch.testing.assert_close(got, adapted, rtol=0, atol=1e-5)


def test_merge_into_compressed_weights_is_refused():
    torch.manual_seed(0)
    model = peft.get_peft_model(
        base_model(), peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)
    )
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32, frozen_format="int8")
    with pytest.raises(ValueError, match="compressed.*ramflow.undo"):
        model.merge_and_unload()


def test_unit_major_accumulation_of_a_frozen_base_equals_the_ordinary_loop():
    """``ramflow.accumulate`` on a LoRA model (the base offloaded and frozen, so no ramflow
    optimizer holds any of its parameters; the adapters on the device under a plain torch
    optimizer), as ``ramflow train --lora R --grad-accum M`` runs it: the adapters' gradients
    are the resident reference's ordinary accumulation, micro-batch 0, 1, 2 in order, so the
    steps agree bit for bit on the CPU (tolerance zero: a missed or reordered micro-batch
    shows). Before, it refused for want of a ramflow optimizer."""
    device = torch.device("cpu")
    model, ref = peft_pair("after", device)
    opt = torch.optim.AdamW(lora_params(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(lora_params(ref), lr=1e-2)
    for step in range(2):
        micro = batches(3, device)
        losses = ramflow.accumulate(
            model, micro, lambda ids: model(input_ids=ids, labels=ids).loss / 3
        )
        ref_losses = []
        for ids in micro:
            loss = ref(input_ids=ids, labels=ids).loss / 3
            loss.backward()
            ref_losses.append(loss.detach())
        assert [float(x) for x in losses] == [float(x) for x in ref_losses], step
        for p, q in zip(lora_params(model), lora_params(ref)):
            assert torch.equal(p.grad, q.grad), step
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(lora_params(model), lora_params(ref)):
        assert torch.equal(p.detach(), q.detach())
