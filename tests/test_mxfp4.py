"""MXFP4 frozen weights (``offload(frozen_format="mxfp4")``, issue 47): the format against
the OCP MX spec's rounding and transformers' dequantization, a gpt-oss checkpoint's packed
experts kept as they ship, and PEFT LoRA on them against the resident model. See [Note:
MXFP4 bytes and their order] in ``ramflow.formats.mxfp4``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import ramflow
from moe_models import save_gpt_oss_mxfp4_folder
from ramflow.formats import mxfp4
from ramflow.formats.frozen import FrozenStore, compressed_nbytes, mxfp4_to_values

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

GRID = torch.tensor(mxfp4.FP4_VALUES)


def _nearest_even(v: torch.Tensor) -> torch.Tensor:
    """The spec's rounding by brute force: each |v| to the nearest E2M1 magnitude, a tie
    to the even code (mantissa bit 0: codes 0, 2, 4, 6), past 6 to 6; the sign kept."""
    dist = (v.abs()[:, None] - GRID[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    even = torch.arange(8) % 2 == 0
    code = torch.where(tied & even, torch.arange(8), 99).min(dim=1).values
    code = torch.where(tied.sum(dim=1) > 1, code, dist.argmin(dim=1))
    return GRID[code] * torch.where(torch.signbit(v), -1.0, 1.0)


def _roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = mxfp4.quantize(x)
    out = torch.empty(x.numel())
    mxfp4.dequantize(codes, scales, out, table=mxfp4.pair_table(out.device))
    return out, scales


def test_quantize_is_the_specs_rounding():
    """Shared exponent floor(log2 amax) - 2, elements to the nearest E2M1 value with ties
    to even and saturation at 6: every element against a brute-force rounding, on blocks
    of random spreads, exact ties and the values past 6 that the scale leaves (up to 8)."""
    torch.manual_seed(0)
    blocks = torch.randn(300, 32) * torch.logspace(-30, 30, 300)[:, None]
    blocks[0] = 0.0
    # block 1: amax 7.5 (scale 2**0) with every tie between grid values and a value past 6
    blocks[1, :8] = torch.tensor([7.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks[1, 8:16] = -blocks[1, :8]
    blocks[1, 16:] = 6.9
    x = blocks.reshape(-1)
    out, scales = _roundtrip(x)
    amax = blocks.abs().amax(dim=1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)), -125) - 2
    assert torch.equal(scales.long() - 127, exp.clamp(-127, 127).long())
    scale = torch.pow(2.0, exp).repeat_interleave(32)
    assert torch.equal(out, _nearest_even(x / scale) * scale)
    assert out[32:40].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert torch.equal(out[:32], torch.zeros(32))
    with pytest.raises(ValueError, match="inf or NaN"):
        mxfp4.quantize(torch.tensor([float("nan")] + [0.0] * 31))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checkpoint_pairs_dequantize_as_transformers_bit_for_bit(dtype):
    """Every byte of codes and every finite E8M0 scale (0 to 254; 255 is the spec's NaN):
    the values transformers' ``convert_moe_packed_tensors`` gives, bit for bit, in each
    wire dtype (fp16 overflows and underflows the same way)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 4), generator=g, dtype=torch.uint8)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    want = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = torch.empty(3, 128, 40, dtype=dtype)
    assert mxfp4.checkpoint_shape(tuple(blocks.shape), tuple(scales.shape)) == (3, 128, 40)
    mxfp4_to_values(blocks, scales, got)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


def test_store_keeps_4_25_bits_a_weight_and_requantizes_its_own_values_exactly():
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    store = FrozenStore(
        "mxfp4", [nn.Parameter(w, requires_grad=False)], [w.numel()], wire_dtype=torch.bfloat16,
        alloc=lambda n: torch.empty(n, dtype=torch.uint8),
    )  # fmt: skip
    store.write(0, w)
    assert store.nbytes == compressed_nbytes("mxfp4", w.numel(), torch.bfloat16)
    assert store.nbytes / w.numel() == 0.5 + 1 / 32  # codes and one scale per 32, 4.25 bits
    values = store.read(0, torch.float32)
    assert torch.equal(values, _roundtrip(w.reshape(-1))[0].view_as(w).bfloat16().float())
    before = store.host.clone()
    store.write(0, values)  # the spec's scale of a quantized block is its own: a fixed point
    assert torch.equal(store.host, before)
    assert store.holds(0, values)


# ------------------------------------------------------------------ gpt-oss checkpoints


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gpt_oss_mxfp4_folder(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _meta_gpt_oss(folder: Path) -> nn.Module:
    from ramflow.train.modeling import meta_model, read_config

    return meta_model(read_config(folder))


def _reference(folder: Path) -> nn.Module:
    """The resident fp32 model by transformers' own loading (its MXFP4 dequantization)."""
    from ramflow.train.modeling import load_model

    return load_model(folder)


def test_packed_experts_load_as_they_ship(gpt_oss_dir: Path):
    """Under ``frozen_format="mxfp4"`` each expert weight's host bytes are the checkpoint's
    codes and scales, only moved into the parameter's order (no value round trip), and the
    model computes with transformers' dequantized values."""
    from safetensors.torch import load_file

    files = load_file(str(gpt_oss_dir / "model.safetensors"))
    model = _meta_gpt_oss(gpt_oss_dir).requires_grad_(False)
    ramflow.offload(model, device="cpu", weights=gpt_oss_dir, frozen_format="mxfp4")
    ref = _reference(gpt_oss_dir)
    engine = ramflow.api._engine(model)
    state = model.state_dict()
    checked = 0
    for u in engine.units:
        for i, p in enumerate(u.compressed):
            name = next(n for n, q in model.named_parameters() if q is p)
            if not name.endswith(("gate_up_proj", "down_proj")):
                assert not u.frozen.columns[i]  # quantized by ramflow, blocks along rows
                continue
            numel = p.numel()
            codes = torch.empty(numel // 2, dtype=torch.uint8)
            scales = torch.empty(numel // 32, dtype=torch.uint8)
            mxfp4.from_checkpoint_layout(files[name + "_blocks"], files[name + "_scales"],
                                         codes, scales)  # fmt: skip
            assert u.frozen.columns[i]
            assert torch.equal(u.frozen._part(u.frozen.host, i, "codes")[: numel // 2], codes)
            assert torch.equal(u.frozen._part(u.frozen.host, i, "scales")[: numel // 32], scales)
            assert torch.equal(state[name], ref.state_dict()[name])
            checked += 1
    assert checked == 4  # two expert weights in each of two layers
    # the other frozen matrices were quantized by ramflow: the resident model over the same
    # values computes the same logits
    ref.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_packed_experts_load_into_other_formats_as_transformers_values(gpt_oss_dir, fmt):
    """A kept (or otherwise compressed) expert weight gets transformers' dequantized values."""
    model = _meta_gpt_oss(gpt_oss_dir).requires_grad_(fmt is None)
    options = {} if fmt is None else {"frozen_format": fmt}
    ramflow.offload(model, device="cpu", weights=gpt_oss_dir, **options)
    ref = _reference(gpt_oss_dir)
    name = "model.layers.1.mlp.experts.down_proj"
    if fmt is None:
        assert torch.equal(model.state_dict()[name], ref.state_dict()[name])
    else:
        values = ref.state_dict()[name]
        # int8 of the exact values: within half a step of each block's absmax
        err = (model.state_dict()[name] - values).abs().max()
        assert 0 < err <= values.abs().max() / 254 * (1 + 2**-7) * (1 + 2**-20)


def test_peft_lora_on_mxfp4_experts_equals_the_resident_model(gpt_oss_dir: Path):
    """PEFT LoRA (``target_parameters`` on both stacked expert weights, and attention) over
    the packed experts kept as MXFP4: three AdamW steps give the resident fp32 model's
    losses and adapters bit for bit (the CPU path computes from the same dequantized fp32
    weights with the same kernels; ramflow's CPU AdamW is PyTorch's fused one)."""
    peft = pytest.importorskip("peft")

    def config():
        return peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        )  # fmt: skip

    base = _meta_gpt_oss(gpt_oss_dir).requires_grad_(False)
    ramflow.offload(base, device="cpu", weights=gpt_oss_dir, frozen_format="mxfp4")
    ref_base = _reference(gpt_oss_dir).requires_grad_(False)
    ref_base.load_state_dict(base.state_dict())  # the same dequantized values everywhere
    torch.manual_seed(1)
    model = peft.get_peft_model(base, config())
    ramflow.adopt(model)
    ref = peft.get_peft_model(ref_base, config())
    peft.set_peft_model_state_dict(ref, peft.get_peft_model_state_dict(model))
    expert_adapters = [n for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert len(expert_adapters) == 4

    opts = [
        ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
        torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, fused=True),
    ]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    ramflow.synchronize(model)
    ours, theirs = (peft.get_peft_model_state_dict(m) for m in (model, ref))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k].cpu(), theirs[k]) for k in theirs)
    assert all(ours[n.replace(".default", "")].abs().sum() > 0 for n in expert_adapters)


def test_a_packed_pair_of_another_shape_is_refused(gpt_oss_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    folder.mkdir()
    for f in gpt_oss_dir.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(gpt_oss_dir / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    model = _meta_gpt_oss(folder).requires_grad_(False)
    with pytest.raises(ValueError, match="down_proj: MXFP4 blocks and scales"):
        ramflow.offload(model, device="cpu", weights=folder, frozen_format="mxfp4")
    assert not ramflow.is_offloaded(model)


# ------------------------------------------------------------------ the Triton dequantize


def mxfp4_kernel_mismatches(device: str) -> list[str]:
    """The MXFP4 dequantize on ``device`` as one Triton launch against the PyTorch ops on
    the CPU (the definition), for every output dtype and both block directions: every code
    byte, every E8M0 scale but the NaN (255), and a byte count that leaves part of the
    last program empty (returns what differed; empty: all bits equal)."""
    from ramflow.formats import frozen as ff

    g = torch.Generator().manual_seed(0)
    m, r, c = 1, 64, 136  # 4352 code bytes: the last of 5 programs partly spare
    n = m * r * c
    codes = torch.randint(0, 256, (n // 2,), generator=g, dtype=torch.uint8)
    codes[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (n // 32,), generator=g, dtype=torch.uint8)
    scales[:255] = torch.arange(255, dtype=torch.uint8)
    out_of = []
    for width in (1, c):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            ref = torch.empty(n, dtype=dtype)
            mxfp4.dequantize(codes, scales, ref, table=mxfp4.pair_table(ref.device), width=width)
            got = torch.full((n,), float("nan"), dtype=dtype, device=device)
            ff.mxfp4_dequantize_triton(codes.to(device), scales.to(device), got, width=width)
            if not torch.equal(ref.view(torch.uint8), got.cpu().view(torch.uint8)):
                bad = (ref.float() != got.cpu().float()).nonzero().flatten()[:5].tolist()
                out_of.append(f"width {width} {dtype}: differs at {bad}")
    return out_of


def test_interpreted_mxfp4_kernel_gives_the_pytorch_ops_bits():
    from triton_interpreter import interpreted_mismatches

    assert interpreted_mismatches("test_mxfp4", "mxfp4_kernel_mismatches") == []


@pytest.mark.gpu
def test_compiled_mxfp4_kernel_gives_the_pytorch_ops_bits_and_the_gpu_the_hosts():
    """Compiled, the kernel gives the CPU's bits; an offloaded gpt-oss-shaped layer's device
    copy is its host dequantize (the engine's path: H2D of the packed bytes, then the kernel
    on the decompression stream)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ramflow.formats import frozen as ff

    assert ff._triton_mxfp4() is not None, "Triton is not importable"
    mismatches = mxfp4_kernel_mismatches("cuda")
    assert mismatches == [], mismatches
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))).requires_grad_(False)
    plain = copy.deepcopy(model)
    ramflow.offload(model, frozen_format="mxfp4")  # bf16 wire
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    plain = plain.to("cuda", torch.bfloat16)
    for _ in range(2):
        x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(model(x), plain(x))
