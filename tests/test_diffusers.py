"""diffusers' diffusion transformers (Flux, SD3) offloaded and trained with rectified flow
matching, against the resident model on a deepcopy (CPU in CI; marked ``gpu`` on CUDA).

On the CPU, with an fp32 wire, ramflow's AdamW step is PyTorch's fused CPU AdamW bit for bit
and each unit computes on the same weights, but not every gradient is the same sum: the
time embedding (``temb``) is read by every block, and autograd adds its gradient over those
readers in the order its ready queue runs them, which the units' hooks (nodes of their own)
change. Its unit's gradients then differ in the last bit (measured: 2e-9 on gradients of
1e-2, one fp32 ulp), and AdamW carries that into every weight at the next steps: an update
is about ``lr`` whatever the gradient's size, so the difference is best measured in ``lr``
(measured over these runs: at most 4e-5 ``lr``, in weights of about 0.02; a bias that
starts at zero has no relative scale to speak of). So losses are compared to 1e-6 relative
and every weight to 0.01 ``lr``; on CUDA, where the reference steps with CUDA's AdamW and
the host with the CPU one, losses to 1e-5 relative and weights to 0.01 ``lr`` as well. A
unit that missed its H2D wait computes on other weights, and one that missed its step is
off by about ``lr``, far past both.
"""

from __future__ import annotations

import copy

import accelerate
import pytest
import torch

import ramflow
from diffusion_models import flow_batch, flow_loss, tiny_flux, tiny_sd3
from ramflow.memory import CheckpointAll, find_blocks
from ramflow.train.initialization import SeededInit

LR = 1e-3
STEPS = 3


def ref_adamw(params, device: torch.device) -> torch.optim.AdamW:
    # fused on the CPU: ramflow's CPU step is bit-identical to it
    return torch.optim.AdamW(params, lr=LR, fused=device.type == "cpu" or None)


def train(model, opt, device, *, steps: int = STEPS, backward=None) -> list[float]:
    curve = []
    for step in range(steps):
        loss = flow_loss(model, flow_batch(step), device)
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
        curve.append(loss.item())
    return curve


def check_same(model, ref, ours: list[float], theirs: list[float], device) -> None:
    ramflow.synchronize(model)
    # fp32 rounding of a sum's order on the CPU, CUDA's AdamW on the GPU: see the docstring
    rtol = 1e-6 if device.type == "cpu" else 1e-5
    assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), rtol=rtol, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        worst = (p.detach().double() - q.detach().double().cpu()).abs().max().item()
        assert worst < 0.01 * LR, (name, worst / LR)


@pytest.mark.parametrize("checkpointing", ["none", "ramflow", "diffusers"])
def test_flux_flow_matching_matches_resident(device, checkpointing):
    """FluxTransformer2DModel (Flux-dev's guidance embed) trained offloaded, block by block,
    against its deepcopy; activation checkpointing by ramflow's wrapper or by diffusers' own
    ``enable_gradient_checkpointing`` (its recomputation calls the blocks again in backward)."""
    torch.manual_seed(0)
    model = tiny_flux(guidance=True)
    ref = copy.deepcopy(model).to(device)
    if checkpointing == "diffusers":
        ref.enable_gradient_checkpointing()
    ramflow.offload(
        model,
        device=device,
        wire_dtype=torch.float32,
        activation_checkpointing=checkpointing == "ramflow",
    )
    if checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
    names = [u.name for u in ramflow.api._engine(model).units]
    # every block of both stacks streams as a unit of its own
    for i in range(2):
        assert f"transformer_blocks.{i}" in names, names
    for i in range(3):
        assert f"single_transformer_blocks.{i}" in names, names
    ours = train(model, ramflow.optim.AdamW(model.parameters(), lr=LR), device)
    theirs = train(ref, ref_adamw(ref.parameters(), device), device)
    check_same(model, ref, ours, theirs, device)


def test_sd3_flow_matching_matches_resident(device):
    """SD3Transformer2DModel (MMDiT, with SD3.5's dual attention and a context-pre-only
    last block) on unpacked latents."""
    torch.manual_seed(0)
    model = tiny_sd3()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    assert {"transformer_blocks.0", "transformer_blocks.1"} <= {
        u.name for u in ramflow.api._engine(model).units
    }
    ours = train(model, ramflow.optim.AdamW(model.parameters(), lr=LR), device)
    theirs = train(ref, ref_adamw(ref.parameters(), device), device)
    check_same(model, ref, ours, theirs, device)


def test_flux_with_accelerate(device):
    """diffusers' training scripts run through accelerate: ``Accelerator.prepare`` of the
    offloaded model and ramflow's optimizer, ``accelerator.backward``."""
    torch.manual_seed(0)
    model = tiny_flux()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    accelerator = accelerate.Accelerator(cpu=device.type == "cpu")
    prepared, opt = accelerator.prepare(model, ramflow.optim.AdamW(model.parameters(), lr=LR))
    ours = train(prepared, opt, device, backward=accelerator.backward)
    theirs = train(ref, ref_adamw(ref.parameters(), device), device)
    check_same(model, ref, ours, theirs, device)


def test_both_flux_stacks_are_the_repeated_blocks():
    """Flux declares two block classes (diffusers' ``_repeated_blocks``): checkpointing
    policies and activation reports choose among both stacks, not only the larger one."""
    model = tiny_flux()
    blocks = [name for name, _ in find_blocks(model)]
    assert blocks == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
        "single_transformer_blocks.2",
    ]
    ramflow.offload(model, device="cpu", activation_checkpointing=CheckpointAll())
    wrapped = ramflow.api._engine(model).checkpointer.checkpointed
    assert len(wrapped) == 5
    assert all(m.__class__.__name__.startswith("Flux") for m in wrapped)


def test_flux_built_on_meta_and_filled_unit_by_unit():
    """The benchmark's path: a Flux model built on the meta device, its units drawn into
    the host store by ``SeededInit`` (no full fp32 copy), equals the same init drawn into
    a resident model, and trains as it does."""
    with torch.device("meta"):
        meta = tiny_flux(guidance=True)
    init = SeededInit(meta, seed=3)
    ref = tiny_flux(guidance=True)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            init(name, p.data)
    ramflow.offload(meta, device="cpu", wire_dtype=torch.float32, weights=init)
    for (name, p), q in zip(meta.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    device = torch.device("cpu")
    ours = train(meta, ramflow.optim.AdamW(meta.parameters(), lr=LR), device, steps=2)
    theirs = train(ref, ref_adamw(ref.parameters(), device), device, steps=2)
    check_same(meta, ref, ours, theirs, device)


def test_fused_qkv_after_offload_runs_as_resident(device):
    """diffusers' ``fuse_qkv_projections`` adds fused q/k/v layers (concatenated host
    weights) after ``offload``: they are adopted as device parameters, and the model
    computes what the fused resident model computes."""
    torch.manual_seed(0)
    model = tiny_flux()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    model.fuse_qkv_projections()
    ref.fuse_qkv_projections()
    with torch.no_grad():
        ours = flow_loss(model, flow_batch(0), device)
        theirs = flow_loss(ref, flow_batch(0), device)
    # the same weights and ops; only the fused layers' placement differs
    assert torch.allclose(ours.cpu(), theirs.cpu(), rtol=1e-6, atol=0)
