"""Optimizer states saved in the 8-bit format before the FP8 code (``formats.legacy_states``): the
table-defined "dynamic" code with one absmax per block, as ``exp_avg_absmax`` and
``exp_avg_sq_absmax``. They load converted: decoded and coded again in the unit's format.

The old states are made here as the old code made them (the nearest of the 256 dynamic
code values to ``x / absmax``, ``torch.bucketize`` over the midpoints, its PyTorch path).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import MLPStack
from ramflow.formats.host import moments_to_plain, saved_state_shape
from ramflow.formats.legacy_states import dequantize_dynamic, dynamic_code
from ramflow.kernels.lean_kernels import dequantize_blockwise, quantize_blockwise

LR = 2e-3


def old_quantize(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The old format's codes and absmax of ``x`` (its ``quantize_blockwise``, verbatim)."""
    code = dynamic_code(signed=signed)
    mid = (code[:-1] + code[1:]) / 2
    n = x.numel()
    blocks = nn.functional.pad(x.reshape(-1), (0, -n % 256)).view(-1, 256)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, 1.0)
    q = torch.bucketize(blocks / scale[:, None], mid, right=False)
    return q.view(-1)[:n].to(torch.uint8), absmax


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(n)]


def train(model, opt, data) -> None:
    for x, y in data:
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()


def offloaded(model, preset: str):
    ramflow.offload(model, device="cpu", host_precision=preset)
    return ramflow.optim.AdamW(model.parameters(), lr=LR)


def as_old_format(state_dict: dict) -> tuple[dict, dict[tuple[int, str], torch.Tensor]]:
    """``state_dict`` (a lean optimizer's) with every 8-bit moment in the old format, and the
    values the old format holds, per (parameter index, moment)."""
    out = copy.deepcopy(state_dict)
    values = {}
    for i, st in out["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            signed = name == "exp_avg"
            x = dequantize_blockwise(st[name].reshape(-1), st.pop(name + "_scale"), signed=signed)
            q, absmax = old_quantize(x, signed=signed)
            st[name], st[name + "_absmax"] = q.view(st[name].shape), absmax
            values[i, name] = dequantize_dynamic(q, absmax, signed=signed)
    return out, values


@pytest.mark.parametrize("saved,preset", [("lean", "lean"), ("kahan", "kahan"), ("lean", "bf16")])
def test_old_8bit_states_load_converted(saved, preset):
    """A state dict written by the old code (its 8-bit moments re-made in the old format)
    loads into a model in ``preset``'s format: each moment holds what the old codes held,
    coded once more in the unit's format (8-bit, or bf16 for a model now in bf16 states);
    the old names are gone; training goes on."""
    torch.manual_seed(0)
    base = MLPStack()
    model = copy.deepcopy(base)
    opt = offloaded(model, saved)
    train(model, opt, batches(3))
    old, values = as_old_format(opt.state_dict())
    assert any(k.endswith("_absmax") for st in old["state"].values() for k in st)

    resumed = copy.deepcopy(base)
    ropt = offloaded(resumed, preset)
    resumed.load_state_dict(model.state_dict())
    ropt.load_state_dict(old)
    fmt = ramflow.HostPrecision.parse(preset).state_format
    params = list(resumed.parameters())
    for (i, name), value in values.items():
        st = ropt.state[params[i]]
        assert not any(k.endswith("_absmax") for k in st)
        if fmt.block:
            want_q, want_scale = quantize_blockwise(value, signed=name == "exp_avg")
            assert torch.equal(st[name].reshape(-1), want_q)
            assert torch.equal(st[name + "_scale"], want_scale)
        else:
            assert torch.equal(st[name].reshape(-1), value.to(st[name].dtype))
        assert st[name].data_ptr() != old["state"][i][name].data_ptr()  # in the flat buffers
    train(resumed, ropt, batches(2, seed=2))
    ramflow.synchronize(resumed)
    assert all(torch.isfinite(p.detach().float()).all() for p in resumed.parameters())


def test_old_states_in_checkpoints_and_plain_optimizers():
    """The checkpoint reader's shape check knows the old absmax (one per block); old 8-bit
    moments become plain tensors as the old code read them (``moments_to_plain``, what
    ``ramflow.undo`` does); and the conversion loses at most the FP8 code's rounding (2**-4
    relative, or 2**-9 of the block's scale near zero, sqrt(v) for the second moment)."""
    assert saved_state_shape("exp_avg_absmax", torch.Size([300, 2])) == (3,)
    assert saved_state_shape("exp_avg_sq_absmax", torch.Size([256])) == (1,)
    assert saved_state_shape("exp_avg_scale", torch.Size([300, 2])) == (3,)
    torch.manual_seed(0)
    model = MLPStack()
    opt = offloaded(model, "lean")
    train(model, opt, batches(2))
    old, values = as_old_format(opt.state_dict())
    params = list(model.parameters())
    for i, st in old["state"].items():
        plain = dict(st)
        moments_to_plain(plain, params[i], plain=False)  # fp32 on the host
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain[name].reshape(-1).float(), values[i, name])
    ropt = offloaded(copy.deepcopy(MLPStack()), "lean")
    ropt.load_state_dict(old)
    params = [p for g in ropt.param_groups for p in g["params"]]
    for (i, name), value in values.items():
        st = ropt.state[params[i]]
        scale = st[name + "_scale"]
        got = dequantize_blockwise(st[name].reshape(-1), scale, signed=name == "exp_avg")
        a, b = (value, got) if name == "exp_avg" else (value.sqrt(), got.sqrt())
        floor = scale.repeat_interleave(256)[: a.numel()] * 2.0**-9
        # 1e-6: the fp32 roundings of the square and its root in the comparison
        assert torch.all((a - b).abs() <= torch.maximum(a.abs() / 16, floor) * (1 + 1e-6))


def test_an_absmax_without_codes_is_refused():
    from ramflow.formats.legacy_states import pop_legacy_moments

    with pytest.raises(ValueError, match="exp_avg_absmax"):
        pop_legacy_moments({"exp_avg": torch.zeros(4), "exp_avg_absmax": torch.zeros(1)})
