"""The presets' seeded init (``ramflow.train.initialization.SeededInit``): values that depend
on the seed, the parameter's name and the element's position only, so one process and N
ranks (each filling its own units, any number of threads) start from the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ramflow
from ramflow.train import initialization
from ramflow.train.initialization import SeededInit
from ramflow.train.modeling import build_model, build_offloaded, meta_model
from ramflow.train.presets import get_preset

transformers = pytest.importorskip("transformers")


def _config(**changes):
    config = get_preset("tiny").to_config(vocab_size=259, pad_token_id=3)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def test_values_do_not_depend_on_threads_or_the_master_dtype(monkeypatch):
    """Chunks drawn by 1 or 3 threads give the same bits; a bf16 master gets the fp32
    values rounded to nearest; another seed or another name gives other values."""
    monkeypatch.setattr(initialization, "CHUNK_ELEMENTS", 1000)  # several chunks per weight
    model = nn.Sequential(nn.Linear(64, 100), nn.Linear(64, 100))
    one, three = SeededInit(model, seed=5, num_threads=1), SeededInit(model, seed=5, num_threads=3)
    a, b = torch.empty(100, 64), torch.empty(100, 64)
    one("0.weight", a)
    three("0.weight", b)
    assert torch.equal(a, b)
    half = torch.empty(100, 64, dtype=torch.bfloat16)
    three("0.weight", half)
    assert torch.equal(half, a.bfloat16())
    other = torch.empty(100, 64)
    SeededInit(model, seed=6)("0.weight", other)
    assert not torch.equal(other, a)
    one("1.weight", other)
    assert not torch.equal(other, a)
    # chunks are independent draws: no two chunks repeat each other
    chunks = a.view(-1)[: 6 * 1000].view(6, 1000)
    assert len({tuple(c[:4].tolist()) for c in chunks}) == 6


def test_rules_are_transformers_rules():
    """Linear and embedding weights N(0, initializer_range), the padding row zero; norm
    weights one; biases zero."""
    config = _config(initializer_range=0.05)
    model = build_model(config, seed=0)
    state = model.state_dict()
    embed = state["model.embed_tokens.weight"]
    assert embed[3].eq(0).all() and embed[4].ne(0).all()  # pad_token_id=3
    for name, t in state.items():
        if name.endswith("norm.weight"):
            assert t.eq(1).all(), name
        elif name.endswith("proj.weight") or name == "lm_head.weight":
            assert abs(t.std().item() - 0.05) < 0.005, (name, t.std().item())
            assert abs(t.mean().item()) < 0.005, name


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_offloaded_and_resident_builds_start_from_the_same_weights(rope):
    """``build_offloaded`` (meta build, drawn into the host store unit by unit) and
    ``build_model`` (resident) hold the same weights, bit for bit, and the same rotary
    frequencies as ``transformers``' own build (the Llama 3 presets' scaled rope too);
    another seed gives other weights."""
    config = _config()
    if rope == "llama3":
        config.rope_parameters = dict(get_preset("llama-8b").rope_parameters)
    resident = build_model(config, seed=7)
    offloaded = build_offloaded(config, seed=7, device="cpu")
    ref = resident.state_dict()
    got = offloaded.state_dict()
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert resident.model.rotary_emb.rope_type == rope
    assert torch.equal(resident.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert torch.equal(offloaded.model.rotary_emb.inv_freq.cpu(), hf.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(offloaded(ids).logits, resident(ids).logits)
    ramflow.undo(offloaded)
    other = build_model(config, seed=8).state_dict()
    assert not torch.equal(other["lm_head.weight"], ref["lm_head.weight"])


def test_a_module_without_a_rule_is_refused_up_front():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with pytest.raises(ValueError, match=r"no rule for 1\.gain \(Scale\).*--model DIR"):
        SeededInit(nn.Sequential(nn.Linear(4, 4), Scale()), seed=0)
    init = SeededInit(nn.Linear(4, 4), seed=0)
    with pytest.raises(KeyError, match="another model"):
        init("lm_head.weight", torch.empty(4, 4))


def test_meta_model_is_untouched_by_the_init():
    """The init reads names and module types only: a meta model stays on meta."""
    model = meta_model(_config())
    SeededInit(model, seed=0)
    assert all(p.is_meta for p in model.parameters())
