"""The presets' seeded init (``ramflow.train.initialization.SeededInit``): values that depend
on the seed, the parameter's name and the element's position only, so one process and N
ranks (each filling its own units, any number of threads) start from the same weights."""

from __future__ import annotations

import hashlib
import platform

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


# [the values are part of every preset's initial weights]
# sha256 (first 16 hex digits) of the bytes SeededInit(_Pinned(), seed=11) writes, recorded
# before the fill was made parallel across a unit (2026-11-27), so that any change of how the
# chunks are drawn provably keeps the bits. torch's CPU normal_ has two builds whose last bits
# differ: its AVX2 kernel (AVX2 and AVX-512 machines), and its DEFAULT kernel (no AVX2, or
# ATEN_CPU_CAPABILITY=default), so each has its own record. Norm weights and biases are
# ones and zeros, the same in both.
_PINNED_AVX2 = {
    "embed.weight/float32": "2dd9ed8c2bf9a257", "embed.weight/bfloat16": "34ada538291ae29d",
    "proj.weight/float32": "ae3b8ded52f2c7ba", "proj.weight/bfloat16": "c1291c20a3f095b8",
    "big.weight/float32": "84d727af83f05d9a", "big.weight/bfloat16": "02df8ce7e63caa7d",
}  # fmt: skip
_PINNED_DEFAULT = {
    "embed.weight/float32": "6f42db794853679f", "embed.weight/bfloat16": "a3f171c4d9006e93",
    "proj.weight/float32": "ba1cf0e57d406fca", "proj.weight/bfloat16": "ba353135aaf127d1",
    "big.weight/float32": "7224a4289cf3699d", "big.weight/bfloat16": "bc55eb81bf7d9462",
}  # fmt: skip
_PINNED_CONSTANT = {
    "proj.bias/float32": "67042dfda5683aea", "proj.bias/bfloat16": "7a12e561363385e9",
    "norm.weight/float32": "2f20cd03c9cd392a", "norm.weight/bfloat16": "e72710531b01d91e",
    "norm.bias/float32": "5341e6b2646979a7", "norm.bias/bfloat16": "38723a2e5e8a17aa",
}  # fmt: skip


class _Pinned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64, padding_idx=3)
        self.proj = nn.Linear(64, 200)
        self.norm = nn.LayerNorm(64)
        # two chunks of CHUNK_ELEMENTS, the second 4093 elements (not a multiple of 16)
        self.big = nn.Linear(2047, 2051, bias=False)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _pinned_digests() -> dict[str, str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return {**_PINNED_AVX2, **_PINNED_CONSTANT}
    if capability == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64"):
        return {**_PINNED_DEFAULT, **_PINNED_CONSTANT}
    pytest.skip(f"digests were recorded on x86-64 only, not with {capability} kernels")


def _fill(init: SeededInit, model: nn.Module, dtype: torch.dtype, *, at_once: bool) -> dict:
    outs = {name: torch.full(p.shape, float("nan"), dtype=dtype)
            for name, p in model.named_parameters()}  # fmt: skip
    if at_once:
        init.write_many(list(outs.items()))
    else:
        for name, out in outs.items():
            init(name, out)
    return {f"{name}/{str(dtype)[6:]}": _digest(out) for name, out in outs.items()}


@pytest.mark.parametrize(
    "how", ["one tensor, 1 thread", "one tensor, 3 threads", "all at once", "PyTorch rounding"]
)
def test_values_are_pinned(how, monkeypatch):
    """The bits of a tiny model's init, fp32 and bf16 (rounded to nearest from fp32), are
    those recorded, however the chunks are drawn: a tensor at a time or all at once, on
    one thread or several, rounded natively or by PyTorch."""
    want = _pinned_digests()
    assert initialization.CHUNK_ELEMENTS == 1 << 22
    if how == "PyTorch rounding":
        monkeypatch.setattr(initialization._lean_kernels, "lean_kernel_available", lambda: False)
    model = _Pinned()
    init = SeededInit(model, seed=11, num_threads=1 if how == "one tensor, 1 thread" else 3)
    at_once = how in ("all at once", "PyTorch rounding")
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        got.update(_fill(init, model, dtype, at_once=at_once))
    assert got == want


@pytest.mark.parametrize("precision", ["fp32", "lean"])
def test_offloaded_values_are_pinned(precision):
    """``ramflow.offload(meta_model, weights=SeededInit(...))`` fills the masters (fp32, or
    lean's bf16) with the recorded bits, a unit at a time through ``write_many``."""
    want = _pinned_digests()
    with torch.device("meta"):
        model = _Pinned()
    init = SeededInit(model, seed=11, num_threads=3)
    ramflow.offload(model, device="cpu", weights=init, host_precision=precision)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    state = model.state_dict()
    assert {v.dtype for v in state.values()} == {dtype}
    got = {f"{k}/{str(dtype)[6:]}": _digest(v) for k, v in state.items()}
    assert got == {k: v for k, v in want.items() if k.endswith(str(dtype)[6:])}
    ramflow.undo(model)


def test_write_many_checks_every_name_first():
    """An unknown name raises before any tensor of the call is written; ``std`` must be a
    finite number >= 0."""
    model = nn.Linear(8, 8)
    init = SeededInit(model, seed=0, num_threads=2)
    weight = torch.full((8, 8), float("nan"))
    with pytest.raises(KeyError, match="another model"):
        init.write_many([("weight", weight), ("lm_head.weight", torch.empty(8, 8))])
    assert weight.isnan().all()
    for std in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="std must be"):
            SeededInit(model, seed=0, std=std)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_mixtures_of_experts_follow_transformers_rules(family):
    """The MoE presets (``ramflow train --preset deepseek-v2-lite``) start from the seeded
    init too: each family's fused expert matrices, router and (gpt-oss) sinks get a rule,
    the same that family's ``_init_weights`` applies: N(0, initializer_range), expert
    biases zero. A module without a rule would raise ValueError here."""
    from moe_models import moe_config

    config = moe_config(family)
    config.initializer_range = 0.05
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    init = SeededInit(model, seed=0)
    params = dict(model.named_parameters())
    experts = [n for n in params if ".experts." in n]
    assert experts, "the family's experts are fused parameters of an Experts module"
    for name, p in params.items():
        out = torch.empty(p.shape)
        init(name, out)
        kind = type(model.get_submodule(name.rpartition(".")[0])).__name__
        if kind.endswith("Experts") and name.endswith("bias"):
            assert out.eq(0).all(), name
        elif kind.endswith("Experts") or "Router" in kind or name.endswith("sinks"):
            # the sample's std within 10% of 0.05 for the large tensors; the bound widens
            # as 1e3 / numel for small ones (a router of 512, gpt-oss' 4 sinks), whose
            # sample std is too noisy for 10%
            assert abs(out.std().item() - 0.05) < 0.005 * (1 + 1e3 / out.numel()), name
