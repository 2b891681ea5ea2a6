"""4-bit AdamW states (``host_precision="lean4"``, issue 47 point 5).

The codes are torchao's (``AdamW4bit``'s maps and (de)quantization, Li et al. 2023); the
step is the lean kernel's between a decode and an encode, cut in chunks. The engine's steps
against that reference, resume and ``undo`` are in ``test_lean_store`` and
``test_optimizer_lifecycle`` with the other lean formats.
"""

from __future__ import annotations

import pytest
import torch

import ramflow
from models import MLPStack, tiny_llama
from ramflow import HostPrecision
from ramflow.formats.host import check_optimizer_formats
from ramflow.formats.states_4bit import (
    BLOCK_4BIT,
    STEP_CHUNK,
    _thresholds,
    dequantize_4bit,
    quantize_4bit,
    zero_code,
)
from ramflow.formats.steps import LEAN, AdamWSettings
from ramflow.kernels.lean_kernels import lean_adamw_step_
from ramflow.units.registry import engine_of_model

LEAN4 = HostPrecision.lean4()


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_torchaos(signed):
    """Values read back from the codes are those of torchao's ``OptimState4bit`` holding
    the same tensor, bit for bit (its maps, block of 128, rounding to nearest): the first
    moment itself, the second's square root (then squared)."""
    from torchao.optim.subclass_4bit import OptimState4bit

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK_4BIT, generator=g) * torch.logspace(-6, 0, 4 * BLOCK_4BIT)
    # the values at and beside each rounding threshold of the map, in a block of absmax 1
    edges = torch.tensor([float(t) for t in _thresholds(signed)])
    edges = torch.cat(
        [edges, edges.nextafter(torch.tensor(-2.0)), edges.nextafter(torch.tensor(2.0))]
    )
    x[: edges.numel()] = edges
    x[edges.numel()] = 1.0
    if not signed:
        x = x.square()  # what is coded is sqrt(x): the edges again, about
    ours = dequantize_4bit(*quantize_4bit(x, signed=signed), x.numel(), signed=signed)
    coded = x if signed else x.double().sqrt().float()
    theirs = OptimState4bit.zeros(x.shape, signed=signed, block_size=BLOCK_4BIT)
    theirs.copy_(coded)
    want = theirs.dequantize()
    assert torch.equal(ours, want if signed else want * want)
    # 4 bits: each coded value within half the widest gap of the map of itself, in units
    # of its block's absmax (the dynamic map: 0.225 between 0.2125 and 0.4375, and -1 is
    # not in it; the linear one: 1/16 between 0 and its smallest value, 1/32 elsewhere)
    read = ours if signed else ours.sqrt()
    absmax = coded.view(-1, BLOCK_4BIT).abs().amax(1, keepdim=True)
    err = (read - coded).view(-1, BLOCK_4BIT).abs() / absmax
    assert err.max() <= (0.1125 if signed else 1 / 16) + 1e-6  # + fp32 rounding


def test_second_moment_never_reads_zero_and_new_states_read_zero():
    """The second moment's map has no zero (a tiny ``v`` beside a large one in its block
    reads as (1/16)**2 of the block's largest, not 0, which would blow up ``m /
    sqrt(v)``); a new state (codes of zero, absmax 0) reads as zeros."""
    x = torch.zeros(BLOCK_4BIT)
    x[0] = 1.0
    x[1] = 1e-12
    v = dequantize_4bit(*quantize_4bit(x, signed=False), x.numel(), signed=False)
    assert v[0] == 1.0 and v[1] == 1 / 256 and v[2:].min() == 1 / 256
    n = 3 * BLOCK_4BIT + 5
    fmt = LEAN4.state_format
    for moment in ("exp_avg", "exp_avg_sq"):
        codes, scale = (fmt.new(name, n) for name in fmt.moment_names(moment))
        assert codes.numel() == 4 * BLOCK_4BIT // 2 and scale.numel() == 4
        decoded = dequantize_4bit(codes, scale, n, signed=moment == "exp_avg")
        assert torch.equal(decoded, torch.zeros(n))
    # the first moment's zero is a code of its own; the second's zeros are its smallest
    assert zero_code(signed=True) == 0x77 and zero_code(signed=False) == 0


def test_a_step_in_chunks_gives_the_bits_of_one_piece():
    """``LEAN.piece`` steps a 4-bit unit ``STEP_CHUNK`` elements at a time; the bits equal
    one lean kernel call over the whole range between a decode and an encode (each
    element's rounding counter and each block are the whole range's)."""
    n = STEP_CHUNK + 3 * 256 + 5  # two chunks, the last block partial
    g = torch.Generator().manual_seed(0)
    master = (torch.randn(n, generator=g) * 0.1).bfloat16()
    fmt = LEAN4.state_format
    states = {}
    for moment, value in (("exp_avg", torch.randn(n, generator=g) * 1e-3),
                          ("exp_avg_sq", torch.rand(n, generator=g) * 1e-6)):  # fmt: skip
        views = {name: fmt.new(name, n) for name in fmt.moment_names(moment)}
        fmt.encode(moment, value, views)
        states.update(views)
    grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    ref_master = master.clone()
    ref = {name: t.clone() for name, t in states.items()}
    settings = AdamWSettings(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    LEAN.piece(LEAN4, master, grad, states, 0, n, settings=settings, step=3,
               wire_out=None, seed=7, threads=None)  # fmt: skip
    moments = fmt.kernel_moments(ref, n)
    lean_adamw_step_(ref_master, grad, moments["exp_avg"], moments["exp_avg_sq"], step=3,
                     lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, seed=7)  # fmt: skip
    fmt.store_moments(ref, moments)
    assert torch.equal(master, ref_master)
    for name in states:
        assert torch.equal(states[name], ref[name]), name
    assert not torch.equal(master, (torch.randn(n, generator=g) * 0.1).bfloat16())


def test_the_plan_counts_the_bytes_the_store_and_the_optimizer_hold():
    """The byte model of lean4 (the plan's, the estimate's, the checkpoint's) is what the
    store and the optimizer allocate on a tiny model: 2 bytes of bf16 master and 1.0625
    of 4-bit states per trained element, so 3.06 bytes per trained parameter."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=2)
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean4")
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    ramflow.synchronize(model)
    engine = engine_of_model(model)
    held_states = sum(t.nbytes for u in opt.unit_states for t in opt.unit_states[u].values())
    held_masters = sum(u.master.nbytes for u in engine.units)
    parts = LEAN4.host_bytes(engine.units, torch.bfloat16)
    assert parts.states == held_states
    assert parts.master == held_masters
    plan = ramflow.get_plan(model)
    assert plan.host_precision == LEAN4
    assert plan.host_bytes_per_parameter == pytest.approx(2 + 2 * (0.5 + 4 / 128))
    assert "3.06 bytes per trained parameter" in plan.describe()
    trainable = sum(u.trainable_numel for u in engine.units)
    assert held_states == trainable * (2 * (0.5 + 4 / 128))


def test_lean4_needs_adamw():
    """Lion's step reads its momentum as the 8-bit and bf16 formats hold it: refused with
    a message that names what works."""
    check_optimizer_formats(LEAN4, "AdamW")
    with pytest.raises(ValueError, match="Lion has no CPU step for optimizer_states='4bit'"):
        check_optimizer_formats(LEAN4, "Lion")
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean4")
    with pytest.raises(ValueError, match="ramflow.optim.AdamW"):
        ramflow.optim.Lion(model.parameters(), lr=1e-3).step()
