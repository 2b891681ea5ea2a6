"""Routed experts: an MoE layer's experts load by the router's choice, and nothing changes.

For each of the four tiny families (``moe_models``) and each experts implementation
(eager, batched_mm, grouped_mm): a no-grad forward and ``generate`` give bit-identical
logits and tokens with and without routed loading, while the experts a load leaves out
hold NaN (so a computation that read one would show it); the counter of expert bytes is
exactly what the router's choices ask for. LoRA over frozen experts, with units evicted
between forward and backward (and with activation checkpointing), trains bit for bit as
with every expert loaded. The CPU runs the same code with synchronous copies; the CUDA
versions (bf16, the real grouped_mm kernel) are marked ``gpu``. See [Note: experts loaded
by the router] in ``ramflow.engine.expert_loading``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ramflow
from moe_models import FAMILIES, SHAPE
from ramflow.units.experts import is_experts_module
from ramflow.units.registry import engine_of_model

IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]
# bytes of a device budget just over the smallest that works for the four-layer models in
# fp32 (three window slots of the largest unit, its gradient buffers): units are evicted and
# loaded again within a pass and between tokens
SMALL_WINDOW = {
    "qwen3_moe": 1_320_000,
    "mixtral": 2_340_000,
    "gpt_oss": 834_000,
    "deepseek_v3": 1_410_000,
    "qwen2_moe": 1_590_000,
}


def small_window(family: str, device: torch.device) -> int:
    """``SMALL_WINDOW`` for the wire dtype of ``device`` (bf16 on CUDA: a little over half,
    still three slots)."""
    return SMALL_WINDOW[family] if device.type == "cpu" else SMALL_WINDOW[family] * 11 // 20


def build(family: str, impl: str, device: torch.device):
    """A seeded tiny model of ``family`` with four layers (fp32 on the CPU, bf16 for
    CUDA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = AutoConfig.for_model(family, **{**SHAPE, "num_hidden_layers": 4}, **FAMILIES[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=impl)


def offloaded_pair(family: str, impl: str, device: torch.device, **options):
    """(routed, every expert) offloaded copies of one model; the routed one's experts left
    out of a load are NaN."""
    model = build(family, impl, device)
    routed, whole = model, copy.deepcopy(model)
    ramflow.offload(routed, device=device, **options)
    ramflow.offload(whole, device=device, routed_experts=False, **options)
    engine_of_model(routed).window.poison_unloaded_experts = True
    return routed, whole


def record_choices(model) -> dict[str, list[set[int]]]:
    """Hooks that record, per experts module, the expert ids of each of its calls."""
    seen: dict[str, list[set[int]]] = {}

    def hook(name, module, args):
        seen.setdefault(name, []).append(set(args[1].unique().tolist()))

    for name, m in model.named_modules():
        if is_experts_module(m):
            m.register_forward_pre_hook(lambda mod, args, name=name: hook(name, mod, args))
    return seen


def expert_bytes(model) -> int:
    """Bytes of one expert of one layer, over its parameters, in the wire dtype."""
    m = next(m for m in model.modules() if is_experts_module(m))
    itemsize = engine_of_model(model).wire_dtype.itemsize
    return sum(p.numel() // m.num_experts * itemsize for p in m.parameters())


def prompt(device: torch.device, length: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (1, length), generator=g).to(device)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_grad_forward_bit_identical(device, family, impl):
    routed, whole = offloaded_pair(family, impl, device)
    choices = record_choices(routed)
    x = prompt(device, length=2)  # few tokens: 4 experts of top-2 leave some unchosen
    with torch.no_grad():
        a = routed(x).logits
        b = whole(x).logits
    assert torch.equal(a, b)
    assert not a.isnan().any()
    # one call per MoE layer, each unit loaded once: exactly the chosen experts crossed
    assert all(len(calls) == 1 for calls in choices.values())
    expected = sum(len(calls[0]) for calls in choices.values()) * expert_bytes(routed)
    assert engine_of_model(routed).routed_experts.expert_bytes_loaded() == expected
    # the model loading every expert moved each MoE layer's experts at least once
    total = sum(m.num_experts for m in routed.modules() if is_experts_module(m))
    assert expected < total * expert_bytes(routed)
    assert engine_of_model(whole).routed_experts.expert_bytes_loaded() >= total * expert_bytes(
        routed
    )
    ramflow.undo(routed)
    ramflow.undo(whole)


def test_left_out_experts_are_poisoned():
    """The check above means something: after a routed forward, the experts it did not
    choose are NaN in the unit's device copy, and the chosen ones are the weights."""
    device = torch.device("cpu")
    routed, whole = offloaded_pair("qwen3_moe", "eager", device)
    engine = engine_of_model(routed)
    with torch.no_grad():
        routed(prompt(device))
    # the last MoE layer: still in the window (the next forward's prefetch reloads the first)
    u = [u for u in engine.units if u.expert_slices is not None][-1]
    group = u.expert_slices.groups[0]
    left_out = sorted(set(range(group.num_experts)) - group.loaded)
    assert group.loaded and left_out
    for lo, hi in group.runs(left_out):
        assert u.device_alias[lo:hi].isnan().all()
    for lo, hi in group.runs(sorted(group.loaded)):
        assert torch.equal(u.device_alias[lo:hi], u.wire[lo:hi])
    ramflow.undo(routed)
    ramflow.undo(whole)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_bit_identical(device, family):
    # units evicted between tokens: each token loads each layer again
    routed, whole = offloaded_pair(
        family, "eager", device, gpu_memory=small_window(family, device), prefetch_depth=1
    )
    x = prompt(device)
    kwargs = dict(
        max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    with torch.no_grad():
        a = routed.generate(x, **kwargs)
        b = whole.generate(x, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        assert torch.equal(la, lb)
    loaded = engine_of_model(routed).routed_experts.expert_bytes_loaded()
    assert 0 < loaded < engine_of_model(whole).routed_experts.expert_bytes_loaded()
    ramflow.undo(routed)
    ramflow.undo(whole)


def lora_window(model) -> int:
    """Bytes of a device budget of about three of ``model``'s largest layers (LoRA: no
    gradient buffers in the units), so four layers are evicted and loaded again."""
    layers = model.model.layers
    return int(3.5 * max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers))


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_over_frozen_experts(device, family, checkpointing):
    """LoRA on the attention output, every base weight frozen, a window of about two
    units (so backward loads units again, without their experts): the routed model
    trains as the one that loads every expert, bit for bit, and moves fewer expert bytes."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], lora_dropout=0.0)
    base = build(family, "eager", device)
    models = []
    for routed in (True, False):
        torch.manual_seed(1)  # the same adapters' initial values
        model = peft.get_peft_model(copy.deepcopy(base), config)
        ramflow.offload(
            model,
            device=device,
            routed_experts=routed,
            prefetch_depth=1,
            gpu_memory=lora_window(base),
            activation_checkpointing=checkpointing,
        )
        models.append(model)
    engine_of_model(models[0]).window.poison_unloaded_experts = True
    opts = [
        ramflow.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models
    ]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 256, (1, 3), generator=g).to(device)  # few experts chosen
        losses = []
        for model, opt in zip(models, opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
        assert not losses[0].isnan()
    for (na, pa), (nb, pb) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert na == nb
        assert torch.equal(pa.detach().cpu(), pb.detach().cpu()), na
    routed_bytes = engine_of_model(models[0]).routed_experts.expert_bytes_loaded()
    whole_bytes = engine_of_model(models[1]).routed_experts.expert_bytes_loaded()
    assert 0 < routed_bytes < whole_bytes
    for model in models:
        ramflow.undo(model)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """``benchmarks/moe/routed_experts.py --smoke``: both variants decode the same tokens,
    and each decoded token moves exactly top-k experts per layer when routed (8 layers, 2
    of 16 experts of 3 x 64 x 32 fp32 weights), every expert when not."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks/moe/routed_experts.py"), "--smoke",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "routed_experts.json").read_text())
    assert result["same_tokens"]
    whole, routed = result["variants"]
    expert = 3 * 64 * 32 * 4
    assert routed["expert_bytes_per_token"] == 8 * 2 * expert
    assert whole["expert_bytes_per_token"] == 8 * 16 * expert
    assert routed["h2d_bytes_per_token"] < whole["h2d_bytes_per_token"]
    assert routed["decode_tokens_per_s"] > 0
    assert "| routed |" in (tmp_path / "routed_experts.md").read_text()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_trained_experts_with_inference_between_steps(device, family):
    """Trained experts load whole under grad (their gradients and steps cover every
    expert) and by the router's choice in a no-grad forward between steps, which leaves
    units in the window holding some experts only: training matches the model that loads
    every expert, bit for bit."""
    routed, whole = offloaded_pair(
        family, "eager", device, gpu_memory=small_window(family, device), prefetch_depth=1
    )
    opts = [ramflow.optim.AdamW(m.parameters(), lr=1e-3) for m in (routed, whole)]
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, 256, (1, 6), generator=g).to(device)
        losses, evals = [], []
        for model, opt in zip((routed, whole), opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                evals.append(model(ids[:, :2]).logits)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
        assert torch.equal(evals[0], evals[1])
    for pa, pb in zip(routed.parameters(), whole.parameters()):
        assert torch.equal(pa.detach(), pb.detach())
    ramflow.undo(routed)
    ramflow.undo(whole)


def test_implementation_that_reads_every_expert_loads_them_all():
    """An experts implementation outside eager, batched_mm and grouped_mm may read every
    expert (this one adds 0 x the sum of all weights, NaN where one is NaN): the routed
    model loads every expert for it and matches."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    def reads_all(self, hidden_states, top_k_index, top_k_weights):
        out = batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        return out + 0 * (self.gate_up_proj.sum() + self.down_proj.sum())

    ALL_EXPERTS_FUNCTIONS["ramflow_test_reads_all"] = reads_all
    try:
        device = torch.device("cpu")
        routed, whole = offloaded_pair("qwen3_moe", "ramflow_test_reads_all", device)
        x = prompt(device, length=2)
        with torch.no_grad():
            a = routed(x).logits
            b = whole(x).logits
        assert not a.isnan().any()
        assert torch.equal(a, b)
        total = sum(m.num_experts for m in routed.modules() if is_experts_module(m))
        assert engine_of_model(routed).routed_experts.expert_bytes_loaded() == total * expert_bytes(
            routed
        )
        ramflow.undo(routed)
        ramflow.undo(whole)
    finally:
        del ALL_EXPERTS_FUNCTIONS["ramflow_test_reads_all"]


def test_routed_experts_must_be_a_bool():
    model = build("qwen3_moe", "eager", torch.device("cpu"))
    with pytest.raises(TypeError, match="routed_experts must be True or False"):
        ramflow.offload(model, device="cpu", routed_experts="yes")
