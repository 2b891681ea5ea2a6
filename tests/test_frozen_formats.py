"""Compressed frozen weights (``offload(frozen_format=...)``): the formats, parity with the
plain model over the dequantized weights, LoRA training, loading from the meta device, and
the errors. See [Note: compressed frozen weights] in ``ramflow.formats.frozen``."""

from __future__ import annotations

import concurrent.futures
import copy
import math
import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import ramflow
from models import LoRAStack, tiny_llama
from ramflow.formats import mxfp4
from ramflow.formats.frozen import (
    INT8_BLOCK,
    FrozenStore,
    int8_dequantize,
    int8_quantize,
)
from triton_interpreter import interpreted_mismatches

FORMATS = ["int8", "nf4", "mxfp4"]


def _torchao_nf4():
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4


def _dequantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference: ``w`` through the format's own quantize and dequantize (fp32)."""
    if fmt == "int8":
        codes, absmax = int8_quantize(w.reshape(-1))
        out = torch.empty(w.numel())
        int8_dequantize(codes, absmax, out)
        return out.view_as(w)
    if fmt == "mxfp4":  # blocks of 32 along the flat order (the last dimension)
        codes, scales = mxfp4.quantize(w.reshape(-1))
        out = torch.empty(w.numel())
        mxfp4.dequantize(codes, scales, out, table=mxfp4.pair_table(out.device))
        return out.view_as(w)
    # torchao's scaler block: 256 absmax, or as many as a smaller matrix has (it must divide)
    assert w.numel() % 256 == 0, "the test's matrices fill whole 256-element slots"
    flat = w.detach().float().reshape(-1)
    return _torchao_nf4()(flat, 64, math.gcd(w.numel() // 64, 256)).get_original_weight().view_as(w)


def _with_dequantized(model: nn.Module, fmt: str) -> nn.Module:
    """A deepcopy of ``model`` whose frozen matrices (not embeddings) hold their
    dequantized values: what an offloaded copy computes with."""
    ref = copy.deepcopy(model)
    embeddings = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for p in ref.parameters():
            if not p.requires_grad and p.dim() >= 2 and id(p) not in embeddings:
                p.copy_(_dequantized(p, fmt))
    return ref


def _lm_losses(ids: list[torch.Tensor], m: nn.Module, opt) -> list[float]:
    """The causal-LM losses of one step of ``opt`` per batch of ``ids`` (each (B, T))."""
    out = []
    for x in ids:
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# ------------------------------------------------------------------ the formats


def test_int8_error_is_within_half_a_step_per_block():
    torch.manual_seed(0)
    w = torch.randn(64 * 200) * torch.logspace(-3, 1, 200).repeat_interleave(64)
    w[:64] = 0  # an all-zero block stays zero
    codes, absmax = int8_quantize(w)
    out = torch.empty_like(w)
    int8_dequantize(codes, absmax, out)
    amax = absmax.float().repeat_interleave(INT8_BLOCK)
    # rounded up to bf16: every element within its block's absmax, so no code clamps
    assert (w.abs() <= amax).all()
    assert codes.abs().max() <= 127
    # half a step by construction; fp32 rounds w / scale and q * scale once each
    # (relative 2**-24), which the factor 1 + 2**-20 covers
    assert ((w - out).abs() <= amax / 254 * (1 + 2**-20)).all()
    # the stored absmax is at most 2**-7 above the true one (bf16 keeps 8 significant
    # bits), so relative to the true absmax the bound is (1 + 2**-7) / 254
    true_amax = w.view(-1, INT8_BLOCK).abs().amax(dim=1).repeat_interleave(INT8_BLOCK)
    assert (amax <= true_amax * (1 + 2**-7)).all()
    assert ((w - out).abs() <= true_amax * (1 + 2**-7) / 254 * (1 + 2**-20)).all()
    assert torch.equal(out[:64], torch.zeros(64))


def test_nf4_is_torchaos_own_dequantize_bit_for_bit():
    to_nf4 = _torchao_nf4()
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(256, 128).to(dtype)
        store = FrozenStore(
            "nf4", [nn.Parameter(w, requires_grad=False)], [w.numel()], wire_dtype=dtype,
            alloc=lambda n: torch.empty(n, dtype=torch.uint8),
        )  # fmt: skip
        store.write(0, w)
        out = torch.empty(w.numel(), dtype=dtype)
        store.dequantize(store.host, out)
        assert torch.equal(out.view_as(w), to_nf4(w, 64, 256).get_original_weight())
        # 4 bits and an int8 absmax per 64 (factors, mean and 64-byte alignment: the rest)
        assert 0.5 + 1 / 64 <= store.nbytes / w.numel() < 0.53


# ------------------------------------------------------------------ offloaded models


class Stack(nn.Module):
    def __init__(self, dim: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.Linear(dim, dim))
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_outputs_equal_the_plain_model_over_dequantized_weights(fmt):
    torch.manual_seed(0)
    model = Stack()
    model.blocks.requires_grad_(False)
    ref = _with_dequantized(model, fmt)
    ramflow.offload(model, device="cpu", frozen_format=fmt)
    x = torch.randn(4, 128)
    assert torch.equal(model(x), ref(x))
    # a frozen unit's host bytes per parameter: the matrices compressed, norms and biases not
    engine = ramflow.api._engine(model)
    u = engine.units[0]
    assert u.frozen is not None and u.master.numel() == u.kept_numel < u.numel
    per_param = (u.frozen.nbytes + u.kept_numel * 4) / sum(p.numel() for p in u.owned)
    assert per_param < {"int8": 1.2, "nf4": 0.7, "mxfp4": 0.7}[fmt]
    plan = ramflow.get_plan(model)
    assert plan.frozen_format == fmt
    assert plan.streamed_bytes_per_pass < sum(plan.unit_bytes) / 3
    assert fmt in plan.describe()


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_parameters_state_dict_load_and_undo(fmt):
    torch.manual_seed(0)
    model = Stack()
    model.blocks.requires_grad_(False)
    ref = _with_dequantized(model, fmt)
    ramflow.offload(model, device="cpu", frozen_format=fmt)
    w = model.blocks[0][0].weight
    # never silently wrong: a meta tensor, its values unreadable
    assert w.is_meta and w.shape == (128, 128)
    with pytest.raises((RuntimeError, NotImplementedError)):
        w.tolist()
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k].float(), v), k
    # load_state_dict compresses what it is given (and the device copies follow)
    other = Stack()
    other.blocks.requires_grad_(False)
    other_ref = _with_dequantized(other, fmt)
    model.load_state_dict(other.state_dict())
    x = torch.randn(2, 128)
    assert torch.equal(model(x), other_ref(x))
    ramflow.undo(model)
    assert model.blocks[0][0].weight.device.type == "cpu"
    assert model.blocks[0][0].weight is w
    assert torch.equal(model(x), other_ref(x))


def _compressed_bytes(model: nn.Module) -> list[torch.Tensor]:
    """A copy of every compressed unit's host buffer (codes, absmax, scalers)."""
    units = ramflow.api._engine(model).units
    return [u.frozen.host.clone() for u in units if u.frozen is not None]


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_own_state_dict_loads_back_bit_for_bit(fmt, wire):
    # re-quantizing dequantized values is no fixed point (int8's absmax rounded up to bf16
    # gives another scale; NF4 moves on every reload from fp32), so a reload keeps the codes
    # of a weight given exactly its dequantized values; the weights below have rows of very
    # different sizes, where the re-quantized absmax moved most
    torch.manual_seed(0)
    model = Stack()
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.mul_(torch.logspace(-2, 1, p.shape[0]).view(-1, *[1] * (p.dim() - 1)))
    model.blocks.requires_grad_(False)
    ramflow.offload(model, device="cpu", wire_dtype=wire, frozen_format=fmt)
    before = _compressed_bytes(model)
    state = model.state_dict()
    x = torch.randn(2, 128)
    out = model(x)
    for _ in range(2):
        model.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(_compressed_bytes(model), before))
    assert torch.equal(model(x), out)
    # a saved copy in another dtype that holds the values exactly keeps them too
    model.load_state_dict({k: v.double() for k, v in state.items()})
    assert all(torch.equal(a, b) for a, b in zip(_compressed_bytes(model), before))
    # other values are compressed as given
    model.load_state_dict({k: v * 2 for k, v in state.items()})
    assert not torch.equal(_compressed_bytes(model)[0], before[0])


def test_trainer_over_int8_weights_resumes_exactly(tmp_path):
    # a full (non-PEFT) Trainer checkpoint holds the int8 weights dequantized; loading it
    # into a fresh offload of the same initial model reproduces the codes, so the resumed
    # run matches the uninterrupted one bit for bit
    from test_hf_trainer import lm_data, trainer_args

    torch.manual_seed(0)
    initial = tiny_llama(tie=False)
    data = lm_data()

    def run(out_dir, resume=None):
        model = copy.deepcopy(initial)
        for n, p in model.named_parameters():
            p.requires_grad_("norm" in n or "lm_head" in n)  # the matrices stay frozen
        ramflow.offload(model, device="cpu", wire_dtype=torch.float32, frozen_format="int8")
        trainable = [p for p in model.parameters() if p.requires_grad]
        trainer = transformers.Trainer(
            model=model,
            args=trainer_args(torch.device("cpu"), out_dir),
            train_dataset=data,
            optimizers=(ramflow.optim.AdamW(trainable, lr=1e-3), None),
        )
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    losses, final = run(tmp_path / "ours")
    resumed_losses, resumed = run(tmp_path / "resumed", str(tmp_path / "ours" / "checkpoint-2"))
    assert resumed_losses == losses  # the checkpoint carries the first two steps' log
    assert all(torch.equal(resumed[k], v) for k, v in final.items())


def _train(model, opt, xs):
    losses = []
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_training_equals_the_plain_model_over_dequantized_weights(fmt):
    torch.manual_seed(0)
    model = LoRAStack(dim=128)
    ref = _with_dequantized(model, fmt)
    ramflow.offload(model, device="cpu", frozen_format=fmt)
    xs = [torch.randn(4, 16) for _ in range(4)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    got = _train(model, ramflow.optim.AdamW(trainable, lr=1e-2), xs)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    assert got == _train(ref, ref_opt, xs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_peft_lora_on_a_tiny_llama(fmt):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = tiny_llama(tie=False, hidden=128, intermediate=256)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    ref = _with_dequantized(model, fmt)
    ramflow.offload(model, device="cpu", frozen_format=fmt)
    ids = [torch.randint(0, 128, (2, 16)) for _ in range(3)]

    got = _lm_losses(
        ids, model, ramflow.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    )
    want = _lm_losses(
        ids, ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], fused=True)
    )
    assert got == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_peft_after_offload_over_compressed_weights(fmt):
    # PEFT makes each adapter on its base weight's device: a compressed weight's host
    # stand-in is a meta tensor, so ramflow gives the adapters values at adoption (PEFT's
    # default LoRA init, fp32, on the device); the model then trains as the plain PEFT model
    # over the dequantized base with the same adapter values
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = tiny_llama(tie=False, hidden=128, intermediate=256)
    base.requires_grad_(False)
    plain = _with_dequantized(base, fmt)
    ramflow.offload(base, device="cpu", frozen_format=fmt)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    ramflow.adopt(model)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(not p.is_meta and p.dtype == torch.float32 for p in adapters.values())
    assert all(p.abs().sum() == 0 for n, p in adapters.items() if "lora_B" in n)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    ref = peft.get_peft_model(plain, cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[n])
    ids = [torch.randint(0, 128, (2, 16)) for _ in range(3)]

    got = _lm_losses(ids, model, ramflow.optim.AdamW(list(adapters.values())))
    want = _lm_losses(
        ids, ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], fused=True)
    )
    assert got == want


# ------------------------------------------------------------------ errors (issue 16, point 7)


def test_bad_input_gets_one_clear_error_each(monkeypatch):
    model = Stack(dim=64)
    with pytest.raises(ValueError, match="'int8'.*'nf4'"):
        ramflow.offload(model, device="cpu", frozen_format="int4")
    with pytest.raises(ValueError, match="never quantizes a trainable parameter"):
        ramflow.offload(model, device="cpu", frozen_format="int8")
    assert not ramflow.is_offloaded(model)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    model.blocks.requires_grad_(False)
    with pytest.raises(ImportError, match="pip install torchao"):
        ramflow.offload(model, device="cpu", frozen_format="nf4")
    assert not ramflow.is_offloaded(model)


def test_a_compressed_weight_made_trainable_raises_at_forward_and_step():
    torch.manual_seed(0)
    model = Stack(dim=64)
    model.blocks.requires_grad_(False)
    ramflow.offload(model, device="cpu", frozen_format="int8")
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 64)
    model(x).sum().backward()
    model.blocks[1][2].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="kept compressed.*requires_grad"):
        opt.step()
    with pytest.raises(RuntimeError, match="kept compressed.*requires_grad"):
        model(x)
    with torch.no_grad():  # inference never trains it: allowed
        model(x)
    model.blocks[1][2].weight.requires_grad_(False)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


# ------------------------------------------------------------------ loading (issue 16, point 4)

SHARD_BYTES = 24 << 20
# allocator rounding, Python objects, headers, first-use code pages (as in test_loading)
MARGIN_BYTES = 32 << 20


def _big_config():
    # ~200 MiB in fp32 (100 MiB in bf16) over 64 small decoder layers
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=64,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip


def _load_int8(folder: str) -> dict[str, int]:
    """In a fresh process: load the folder into a meta-built, frozen model as int8."""
    import psutil

    def peak() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    with torch.device("meta"):
        tiny = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    tiny.requires_grad_(False)
    ramflow.offload(tiny, device="cpu", weights=lambda n, o: o.zero_(), frozen_format="int8")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_big_config(), dtype=torch.float32)
    model.requires_grad_(False)
    Path("/proc/self/clear_refs").write_text("5")
    base = psutil.Process().memory_info().rss
    ramflow.offload(model, device="cpu", weights=folder, frozen_format="int8")
    loaded = peak()
    units = ramflow.api._engine(model).units
    store = sum(u.master.nbytes + (u.frozen.nbytes if u.frozen else 0) for u in units)
    largest = max(p.numel() * 4 for u in units for p in u.owned)
    return {"base": base, "loaded": loaded, "store": store, "largest": largest}


def test_loading_into_int8_never_holds_the_bf16_model(tmp_path, monkeypatch):
    """Peak RSS while loading a 200 MiB fp32 checkpoint into int8 stays within the
    compressed store plus one parameter in fp32 (read, then compressed) plus one shard plus
    MARGIN_BYTES, below the model's bf16 size (100 MiB)."""
    torch.manual_seed(0)
    big = transformers.AutoModelForCausalLM.from_config(_big_config(), dtype=torch.float32)
    big.save_pretrained(tmp_path, max_shard_size=SHARD_BYTES)
    del big
    shard = max(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        r = pool.submit(_load_int8, str(tmp_path)).result(timeout=600)
    assert r["store"] < 60 << 20, r  # about 1.03 bytes per matrix element
    assert r["loaded"] - r["base"] <= r["store"] + r["largest"] + shard + MARGIN_BYTES, r
    assert r["loaded"] - r["base"] < 100 << 20, r


# ------------------------------------------------------------------ on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_dequantizes_on_the_copy_stream_as_the_cpu_does(fmt):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fmt == "nf4":
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = Stack(dim=1024, depth=4)
    model.blocks.requires_grad_(False)
    plain = copy.deepcopy(model)
    ramflow.offload(model, frozen_format=fmt)  # bf16 wire
    # what the device computes with is the host's dequantize, bit for bit
    weights = {k: v.to("cuda", torch.bfloat16) for k, v in model.state_dict().items()}
    plain.load_state_dict(weights)
    plain = plain.to("cuda", torch.bfloat16)
    for _ in range(2):  # the second pass streams again through a full window
        x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(model(x), plain(x))
    engine = ramflow.api._engine(model)
    for u in engine.units:
        if u.frozen is None or not u.allocated:
            continue
        torch.cuda.synchronize()
        host = torch.empty(u.numel - u.kept_numel, dtype=torch.bfloat16)
        u.frozen.dequantize(u.frozen.host, host)
        assert torch.equal(u.device_flat[u.kept_numel :].cpu(), host)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_copies_run_ahead_of_dequantize_without_a_race(fmt):
    """The copy of the next compressed unit does not wait for this unit's dequantize (two
    streams, two staging buffers; see ramflow.transfer.streams): through a window of a few units
    and a compute long enough that copies queue up, every pass and every input gradient
    equals the plain bf16 model's over the same dequantized weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fmt == "nf4":
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    dim, depth = 2048, 24
    model = Stack(dim=dim, depth=depth)
    model.requires_grad_(False)
    plain = copy.deepcopy(model)
    unit_bytes = 2 * dim * dim * 2  # two bf16 matrices per block, on the device
    ramflow.offload(model, frozen_format=fmt, gpu_memory=8 * unit_bytes)
    plan = ramflow.get_plan(model)
    assert len(plan.resident) < depth - 4, plan.describe()  # most blocks stream
    weights = {k: v.to("cuda", torch.bfloat16) for k, v in model.state_dict().items()}
    plain.load_state_dict(weights)
    plain = plain.to("cuda", torch.bfloat16)
    for _ in range(4):
        x = torch.randn(4096, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        x_plain = x.detach().clone().requires_grad_(True)
        out, ref = model(x), plain(x_plain)
        assert torch.equal(out, ref)
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        assert torch.equal(x.grad, x_plain.grad)


# ------------------------------------------------------------------ the Triton dequantize


def dequantize_mismatches(device: str) -> list[str]:
    """The int8 dequantize on ``device``, as one Triton launch and as PyTorch ops (with
    Triton disabled), against the PyTorch ops on the CPU (the definition), for every output
    dtype: codes from int8_quantize over magnitudes from 1e-30 to 1e30 (fp16 overflows and
    underflows at the ends), a zero block, and a block count that leaves part of the last
    program empty (returns what differed; empty: all bits equal). See [Note: one
    dequantize kernel] in ramflow.formats.frozen."""
    from ramflow.formats import frozen as ff

    gen = torch.Generator().manual_seed(0)
    blocks = ff._TRITON_ROWS * 3 + 5
    scales = torch.logspace(-30, 30, blocks).repeat_interleave(INT8_BLOCK)
    w = torch.randn(blocks * INT8_BLOCK, generator=gen) * scales
    w[:INT8_BLOCK] = 0.0
    codes, absmax = int8_quantize(w)
    out_of = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ref = torch.empty(w.numel(), dtype=dtype)
        ff.int8_dequantize(codes, absmax, ref)  # on the CPU: PyTorch ops
        c, a = codes.to(device), absmax.to(device)
        triton_out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
        ff._dequantize_triton(c, a, triton_out)
        ops_out = torch.full_like(triton_out, float("nan"))
        with pytest.MonkeyPatch.context() as mp_:
            mp_.setenv("RAMFLOW_DISABLE_TRITON", "1")
            ff.int8_dequantize(c, a, ops_out)
        for name, new in (("triton", triton_out), ("ops", ops_out)):
            new = new.cpu()
            if not torch.equal(ref.view(torch.uint8), new.view(torch.uint8)):
                bad = (ref.float() != new.float()).nonzero().flatten()[:5].tolist()
                out_of.append(f"{name} {dtype}: differs at {bad}")
    return out_of


def test_interpreted_dequantize_kernel_gives_the_pytorch_ops_bits():
    assert interpreted_mismatches("test_frozen_formats", "dequantize_mismatches") == []


@pytest.mark.gpu
def test_compiled_dequantize_kernel_gives_the_pytorch_ops_bits_in_one_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ramflow.formats import frozen as ff

    assert ff._triton_dequantize() is not None, "Triton is not importable"
    mismatches = dequantize_mismatches("cuda")
    assert mismatches == [], mismatches
    codes, absmax = int8_quantize(torch.randn(1 << 20, device="cuda"))
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    int8_dequantize(codes, absmax, out)  # compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        int8_dequantize(codes, absmax, out)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["int8_dequantize_kernel"], kernels
