"""``torch.compile`` on an offloaded model or on its units (issue 15, point 6).

ramflow's hooks are excluded from tracing (``torch.compiler.disable``): a compiled module
calls them eagerly, between its graphs, and they move, pin and swap as they do uncompiled.
Each case runs on the CPU (CI) and, marked ``gpu``, on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import MLPStack
from test_parity import mlp_batches, mse


@pytest.mark.parametrize("what", ["model", "blocks"])
def test_compiled_offloaded_model_trains_as_uncompiled(device, what):
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        ramflow.offload(m, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ramflow.optim.AdamW(ref.parameters(), lr=1e-2)
    if what == "model":
        run = torch.compile(model)
    else:
        for block in model.blocks:
            block.compile()
        run = model
    for batch in mlp_batches(4, device):
        losses = []
        for m, o in ((run, opt), (ref, ref_opt)):
            loss = mse(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        # inductor fuses the layer norm and the residual adds, which rounds differently
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    ramflow.synchronize(model)
    ramflow.synchronize(ref)
    # AdamW turns those roundings into weight moves of at most a small part of one update
    # (lr = 1e-2 per step); a missing or stale weight on the device is off by ~lr
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-3 * 1e-2 * 4
    assert all(p.device.type == "cpu" for p in model.parameters())
