"""GPU-only checks: a stress case where transfers dominate compute, and peak memory.

Wide, thin linear layers at batch 1 spend almost all their time in H2D copies, so a
consumer that does not wait for its copy's event reads a half-written slot here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import tiny_llama

pytestmark = pytest.mark.gpu


def wide_thin(depth: int = 12, width: int = 4096) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=True), nn.Tanh()]
    return nn.Sequential(*layers)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def test_stress_transfers_dominate_fp32_training():
    """fp32 wire, batch 1, 6 AdamW steps with eager overlap: equal to the resident model."""
    model = wide_thin()
    ref = copy.deepcopy(model).cuda()
    ramflow.offload(model, device="cuda", wire_dtype=torch.float32, prefetch_depth=3)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(1, 4096, generator=g).cuda()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    x = torch.randn(1, 4096, generator=g).cuda()
    with torch.no_grad():
        assert rel(model(x), ref(x)) < 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel(p, q.cpu()) < 1e-5


def test_stress_bf16_inference_bit_identical():
    """bf16 wire against the same model cast to bf16: the same kernels on the same weights."""
    model = wide_thin(depth=16)
    ref = copy.deepcopy(model).cuda().to(torch.bfloat16)
    ramflow.offload(model, device="cuda")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 4096, generator=g).cuda().to(torch.bfloat16)
            assert torch.equal(model(x), ref(x))


def _peak_step_bytes(model, ids, budget: int | None) -> tuple[int, ramflow.OffloadPlan]:
    """Peak GPU bytes over three training steps of ``model`` offloaded with ``budget``,
    counted from before ``offload`` (so ramflow's own allocations are in it)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m = ramflow.offload(copy.deepcopy(model), device="cuda", gpu_memory=budget)
    opt = ramflow.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(3):
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(m)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    plan = ramflow.get_plan(m)
    ramflow.undo(m)
    return peak, plan


def test_peak_memory_within_budget_plus_activations():
    """max_memory_allocated stays within gpu_memory plus the activations of a step, for
    the smallest budget that works and for one that keeps a few units resident.

    The activations are measured on the same code path: a run whose budget keeps every
    unit resident peaks at its planned bytes plus the activations."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8, hidden=1024, intermediate=4096)  # weights dominate
    ids = torch.randint(0, 128, (4, 256)).cuda()
    weights = sum(p.numel() * 2 for p in model.parameters())
    peak, plan = _peak_step_bytes(model, ids, 4 * weights)
    assert len(plan.resident) == len(plan.unit_names)
    activations = peak - plan.planned_bytes
    assert activations > 0
    smallest = plan.min_gpu_memory_bytes
    assert smallest < weights  # the smallest budget cannot hold the model
    for budget in (smallest, smallest + 3 * max(plan.unit_bytes)):
        peak, got = _peak_step_bytes(model, ids, budget)
        print(
            f"budget {budget} B, activations {activations} B, peak {peak} B, "
            f"resident {len(got.resident)}/{len(got.unit_names)}, weights {weights} B"
        )
        assert got.planned_bytes <= budget
        assert len(got.resident) < len(got.unit_names)  # something is streamed
        assert peak <= budget + activations + 2**20


def test_pinning_an_empty_host_tensor_is_a_no_op():
    """The shared master of a unit that owns no element (a head tied to the embedding,
    under ZeRO) is empty: nothing to page-lock, where cudaHostRegister refuses zero bytes
    (``ramflow train --nproc-per-node 2`` of a tied Llama failed on it)."""
    from ramflow.transfer.streams import pin_in_place, registered_bytes, unpin

    before = registered_bytes()
    empty = torch.empty(0)
    pin_in_place(empty, what="an empty unit")
    unpin(empty)
    assert registered_bytes() == before
