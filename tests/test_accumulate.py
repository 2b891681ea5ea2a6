"""``ramflow.accumulate``: the unit-major step on an offloaded model, against plain PyTorch's
ordinary accumulation on a deepcopy (see [Note: one weight pass per optimizer step] in
``ramflow.engine.unit_major``): the same gradients and steps, each unit loaded once per
phase, each unit's gradient sent once and no full host gradient buffer."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
from torch import nn

import ramflow
from ramflow.units.registry import engine_of_model

transformers = pytest.importorskip("transformers")

from models import tiny_llama  # noqa: E402
from moe_models import FAMILIES, moe_config  # noqa: E402

M = 3  # micro-batches per step
LR = 1e-2
# the smallest gpu_memory the 8-layer tiny Llama plans with (4 window slots of its largest
# unit): most units are evicted between forward and backward, so a load per micro-batch shows
SMALL_WINDOW = 897088


def _llama_batches(steps: int, *, vocab: int = 128, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (2, 16), generator=g) for _ in range(M)] for _ in range(steps)]


def _lm_loss(model):
    def loss_fn(ids):
        out = model(input_ids=ids, labels=ids)
        return out.loss / M

    return loss_fn


def _reference_step(ref, ref_opt, batches, loss_fn) -> list[float]:
    """Plain PyTorch's ordinary accumulation: micro-batch after micro-batch, then a step."""
    losses = []
    for ids in batches:
        loss = loss_fn(ids)
        loss.backward()
        losses.append(float(loss))
    ref_opt.step()
    ref_opt.zero_grad()
    return losses


def _loads(engine, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in engine.window.num_loads.items()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_equals_plain_accumulation_and_loads_each_unit_once_per_phase(checkpointing):
    """fp32 on the CPU: every parameter's gradient sums the same M micro-batch gradients in
    the same order (micro-batch 0, 1, 2), on the same values, so the steps agree bit for bit
    (the tolerance is zero: any reordered sum or missed micro-batch shows)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8).float()
    ref = copy.deepcopy(model)
    ramflow.offload(
        model,
        device="cpu",
        wire_dtype=torch.float32,
        gpu_memory=SMALL_WINDOW,
        activation_checkpointing=checkpointing,
    )
    if checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    engine = engine_of_model(model)
    for step, batches in enumerate(_llama_batches(3)):
        before = dict(engine.window.num_loads)
        losses = ramflow.accumulate(model, batches, _lm_loss(model))
        loads = _loads(engine, before)
        assert [float(x) for x in losses] == _reference_step(ref, ref_opt, batches, _lm_loss(ref))
        # once for forward, once for backward (recompute and backward), not once per
        # micro-batch; the last units are still in the window when backward starts
        assert set(loads) == {u.name for u in engine.units}
        assert max(loads.values()) <= 2, (step, loads)
        assert loads["model.layers.0"] == 2, (step, loads)
        # from the second step on each unit steps as its gradient lands (eager)
        assert engine.stepper.policy.last_eager == (step > 0)
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_ordinary_accumulation_loads_a_unit_per_micro_batch():
    """The counter the test above reads does see the ordinary loop's loads (the
    assertion there could fail)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8).float()
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32, gpu_memory=SMALL_WINDOW)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    engine = engine_of_model(model)
    before = dict(engine.window.num_loads)
    batches = _llama_batches(1)[0]
    for m, ids in enumerate(batches):
        with opt.no_step() if m < M - 1 else contextlib.nullcontext():
            _lm_loss(model)(ids).backward()
    assert _loads(engine, before)["model.layers.0"] >= M + 1


def test_lean_no_full_host_gradient_buffer_first_step_included():
    """A lean store with keep_grads=False (the gradient ring): every unit's gradient lands
    once per step and is stepped at once, from the first step on, so no unit ever holds a
    host gradient buffer; the loss curve stays close to plain PyTorch's fp32 one (lean:
    bf16 wire and gradients summed in bf16 on the device, a lean master)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=3).float()
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, keep_grads=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    engine = engine_of_model(model)
    ours, theirs = [], []
    for batches in _llama_batches(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = ramflow.accumulate(model, batches, _lm_loss(model))
        assert engine.stepper.policy.last_eager
        assert all(u.host_grad is None for u in engine.units)
        opt.step()
        opt.zero_grad()
        ours.append(sum(float(x) for x in losses))
        theirs.append(sum(_reference_step(ref, ref_opt, batches, _lm_loss(ref))))
    ramflow.synchronize(model)
    assert all(u.host_grad is None for u in engine.units)
    assert ours[-1] < ours[0]  # it trains
    for a, b in zip(ours, theirs):
        assert abs(a - b) / abs(b) < 2e-2, (ours, theirs)


def test_moe():
    """A tiny Qwen3-MoE (no auxiliary loss: see the next test for it). fp32, bit for bit as
    above. Weight decay 0: an expert no token chose gets a zero gradient here and none in
    PyTorch, and AdamW leaves both alike."""
    cfg = moe_config("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, fused=True)
    engine = engine_of_model(model)
    for step, batches in enumerate(_llama_batches(2, vocab=256)):
        before = dict(engine.window.num_loads)
        losses = ramflow.accumulate(model, batches, _lm_loss(model))
        assert max(_loads(engine, before).values()) <= 2
        ref_losses = []
        for ids in batches:
            loss = _lm_loss(ref)(ids)
            loss.backward()
            ref_losses.append(float(loss))
        assert [float(x) for x in losses] == ref_losses
        if step == 0:  # the first step is deferred: the host gradients are there to compare
            ramflow.synchronize(model)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                expected = torch.zeros_like(q) if q.grad is None else q.grad
                assert torch.equal(p.grad, expected), name
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def _smallest_gpu_memory(model: nn.Module, device: str = "cpu") -> int:
    """The smallest ``gpu_memory`` that ``model`` plans with (4 window slots of its largest
    unit), from the refusal of a smaller one: most units are evicted between forward and
    backward, so a load per micro-batch would show."""
    with pytest.raises(ValueError, match="too small") as refusal:
        ramflow.offload(copy.deepcopy(model), device=device, wire_dtype=torch.float32, gpu_memory=1)
    return int(re.search(r"gpu_memory >= (\d+)", str(refusal.value)).group(1))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_router_auxiliary_loss(family, checkpointing):
    """The router's load-balancing loss on (``output_router_logits``, coefficient 0.5, large
    enough that its gradient moves the routers), each family of ``moe_models.py`` with 6
    layers and the smallest window: losses, every gradient of the first step and every
    weight after two equal plain PyTorch's ordinary accumulation bit for bit in fp32 (the
    tolerance is zero: the aux loss's gradient reaches each router's weight in the layer's
    own pass, added to the layer's other contribution, and two floating-point terms sum
    alike in either order; the micro-batches sum in the same order). The layers load at
    most twice per step, the first twice (once per phase). DeepSeek-V3 records its router
    logits but has no aux loss. Weight decay 0: see ``test_moe``."""
    cfg = moe_config(family, num_hidden_layers=6)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ref = copy.deepcopy(model)
    ramflow.offload(
        model,
        device="cpu",
        wire_dtype=torch.float32,
        gpu_memory=_smallest_gpu_memory(model),
        activation_checkpointing=checkpointing,
    )
    if checkpointing:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, fused=True)
    engine = engine_of_model(model)
    aux = []

    def loss_fn(ids):
        out = model(input_ids=ids, labels=ids)
        aux.append(out.aux_loss)
        return out.loss / M

    for step, batches in enumerate(_llama_batches(2, vocab=256)):
        before = dict(engine.window.num_loads)
        losses = ramflow.accumulate(model, batches, loss_fn)
        loads = _loads(engine, before)
        assert max(loads.values()) <= 2, loads
        assert loads["model.layers.0"] == 2, loads
        ref_losses = []
        for ids in batches:
            loss = _lm_loss(ref)(ids)
            loss.backward()
            ref_losses.append(float(loss))
        assert [float(x) for x in losses] == ref_losses
        if step == 0:  # the first step is deferred: the host gradients are there to compare
            ramflow.synchronize(model)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                expected = torch.zeros_like(q) if q.grad is None else q.grad
                assert torch.equal(p.grad, expected), name
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    assert all(a is None for a in aux) == (family == "deepseek_v3")
    ramflow.synchronize(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def _aux_model():
    cfg = moe_config("qwen3_moe")
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def test_moe_router_auxiliary_loss_cut_in_the_last_unit_call():
    """Units that end at an MoE layer (the embedding, final norm and head are left to the
    rest unit): the last layer's router logits are cut in the last unit call, so their
    leaf's gradient comes from the same loss whose backward runs that call; the first
    step's gradients still equal plain PyTorch's bit for bit."""
    model = _aux_model()
    ref = copy.deepcopy(model)
    ramflow.offload(
        model, device="cpu", wire_dtype=torch.float32, units=["model.layers.0", "model.layers.1"]
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    batches = _llama_batches(1, vocab=256)[0]
    ramflow.accumulate(model, batches, _lm_loss(model))
    for ids in batches:
        _lm_loss(ref)(ids).backward()
    ramflow.synchronize(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    opt.zero_grad()


def test_router_logits_changed_past_the_routers_are_refused_clearly():
    """A hook that changes the recorded router logits after the routers (here a user's
    forward hook on the base model that scales them) leaves tensors the step cannot cut
    out of their layers: refused at the forward, naming the model class, no gradient
    left behind, and an ordinary loop goes on."""
    model = _aux_model()
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)

    def scale(module, args, output):
        output.router_logits = tuple(t * 2.0 for t in output.router_logits)

    model.model.register_forward_hook(scale)
    with pytest.raises(RuntimeError, match="Qwen3MoeModel's router_logits .* ordinary loop"):
        ramflow.accumulate(model, _llama_batches(1, vocab=256)[0], _lm_loss(model))
    assert all(p.grad is None for p in model.parameters())
    _lm_loss(model)(_llama_batches(1, vocab=256)[0][0]).backward()
    opt.step()
    opt.zero_grad()


class _Depth(nn.Module):
    """Blocks of which a micro-batch runs the first ``depth`` (a model whose micro-batches
    make different unit calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for block in self.blocks[:depth]:
            x = block(x)
        return x


def test_what_it_cannot_do_is_refused_clearly():
    model = ramflow.offload(_Depth(), device="cpu", units=["blocks.0", "blocks.1", "blocks.2"])
    x = torch.randn(2, 8)
    batches = [(x, 3), (x, 2)]

    def loss_fn(batch):
        return model(*batch).square().mean()

    with pytest.raises(TypeError, match="needs a ramflow optimizer"):
        ramflow.accumulate(model, batches, loss_fn)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match="micro-batch 1 called other units"):
        ramflow.accumulate(model, batches, loss_fn)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="scalar loss"):
        ramflow.accumulate(model, [(x, 3), (x, 3)], lambda b: model(*b))
    with pytest.raises(ValueError, match="at least one micro-batch"):
        ramflow.accumulate(model, [], loss_fn)
    with pytest.raises(ValueError, match="not offloaded"):
        ramflow.accumulate(nn.Linear(2, 2), [x], loss_fn)
    # after the refusals the model trains as before
    ramflow.accumulate(model, [(x, 3), (x, 3)], loss_fn)
    opt.step()
    opt.zero_grad()


@pytest.mark.gpu
def test_bf16_on_the_gpu_close_to_ordinary_accumulation():
    """On CUDA the copies are asynchronous (a missing wait shows as a wrong number): bf16
    wire, the unit-major step against ramflow's ordinary accumulation of a deepcopy (which
    sums the micro-batches in fp32 on the host; here they sum in bf16 on the device, hence
    the tolerance), each unit loaded at most twice per step."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8).float()
    other = copy.deepcopy(model)
    opts = []
    for m in (model, other):
        ramflow.offload(
            m,
            device="cuda",
            wire_dtype=torch.bfloat16,
            gpu_memory=SMALL_WINDOW // 2,
            activation_checkpointing=True,
        )
        opts.append(ramflow.optim.AdamW(m.parameters(), lr=LR))
    engine = engine_of_model(model)
    ours, theirs = [], []
    for batches in _llama_batches(4):
        batches = [ids.cuda() for ids in batches]
        before = dict(engine.window.num_loads)
        losses = ramflow.accumulate(model, batches, _lm_loss(model))
        assert max(_loads(engine, before).values()) <= 2
        opts[0].step()
        opts[0].zero_grad()
        ours.append(sum(float(x) for x in losses))
        total = 0.0
        for i, ids in enumerate(batches):
            with opts[1].no_step() if i < M - 1 else contextlib.nullcontext():
                loss = _lm_loss(other)(ids)
                loss.backward()
            total += float(loss)
        opts[1].step()
        opts[1].zero_grad()
        theirs.append(total)
    ramflow.synchronize(model)
    ramflow.synchronize(other)
    for a, b in zip(ours, theirs):
        assert abs(a - b) / abs(b) < 1e-2, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_router_auxiliary_loss_on_the_gpu(family):
    """On CUDA (asynchronous copies, the smallest window: a missing wait shows as a wrong
    number), fp32 wire, the router's aux loss on: the unit-major step against plain
    PyTorch's ordinary accumulation of a deepcopy on the same GPU. Losses to 1e-5 relative
    (the same fp32 kernels on the same weights at the first step; CUDA's atomics in the
    experts' backward may add in another order, and the two AdamWs round differently, a
    few 1e-7 relative on the later steps' weights); weights within 2 * lr * steps,
    AdamW's bound on how far two runs whose gradients differ by rounding can drift
    apart."""
    cfg = moe_config(family, num_hidden_layers=6)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ref = copy.deepcopy(model).cuda()
    small = _smallest_gpu_memory(model, "cuda")
    ramflow.offload(model, device="cuda", wire_dtype=torch.float32, gpu_memory=small)
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    engine = engine_of_model(model)
    steps = 3
    for batches in _llama_batches(steps, vocab=256):
        batches = [ids.cuda() for ids in batches]
        before = dict(engine.window.num_loads)
        losses = ramflow.accumulate(model, batches, _lm_loss(model))
        assert max(_loads(engine, before).values()) <= 2
        ref_losses = _reference_step(ref, ref_opt, batches, _lm_loss(ref))
        torch.testing.assert_close(
            torch.tensor([float(x) for x in losses]), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().cpu(), q.detach().cpu(), rtol=0, atol=2 * LR * steps, msg=name
        )


def _offload_run(model, policy, batches, device, monkeypatch=None, *, on_host=None):
    """Two unit-major steps of ``model`` offloaded with checkpointing ``policy`` and
    ``boundaries_on_host=on_host``: (losses, weights after them, boundaries packed per
    step, peak device bytes during a step)."""
    from ramflow.activations.boundary_offload import BoundaryOffloader

    packs = [0]
    if monkeypatch is not None:
        real = BoundaryOffloader._pack

        def counting(self, tensor):  # the real pack, counted
            packs[0] += tensor.numel() > 0
            return real(self, tensor)

        monkeypatch.setattr(BoundaryOffloader, "_pack", counting)
    wire = torch.float32 if device == "cpu" else torch.bfloat16
    ramflow.offload(
        model, device=device, wire_dtype=wire, gpu_memory=None, activation_checkpointing=policy
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=LR)
    losses, per_step, peak = [], [], 0
    for step_batches in batches:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = packs[0]
        out = ramflow.accumulate(
            model,
            step_batches,
            lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss / M,
            boundaries_on_host=on_host,
        )
        if device == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
        per_step.append(packs[0] - before)
        losses += [float(x) for x in out]
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    return losses, weights, per_step, peak


@pytest.mark.parametrize(
    "policy", [True, False, ramflow.memory.CheckpointOffload()], ids=["on", "off", "offload"]
)
def test_boundaries_in_host_memory(monkeypatch, policy):
    """``boundaries_on_host=True`` (on the CPU the copies are synchronous and the buffers
    plain, so this runs the CUDA path's bookkeeping): each unit call's input of every
    micro-batch that the unit's graph saves goes to host memory (a checkpoint's input, a
    norm's or the head's input; with ``CheckpointOffload`` its own offloader takes the
    layers') and comes back for its backward; losses and weights
    equal on-device boundaries' bit for bit (fp32; the tolerance is zero)."""
    torch.manual_seed(0)
    base = tiny_llama(tie=False, layers=4).float()
    batches = _llama_batches(2)
    ours = _offload_run(copy.deepcopy(base), policy, batches, "cpu", monkeypatch, on_host=True)
    theirs = _offload_run(copy.deepcopy(base), policy, batches, "cpu", on_host=False)
    # per micro-batch: the 4 layers' inputs (twice without checkpointing: the first norm
    # saves its fp32 input for two operations), the final norm's input twice (it is not
    # checkpointed) and the head's input once
    assert ours[2] == [M * (4 * (2 if policy is False else 1) + 2 + 1)] * 2
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "policy", [True, ramflow.memory.CheckpointOffload()], ids=["on", "offload"]
)
def test_boundaries_in_pinned_host_memory_on_the_gpu(policy):
    """On CUDA, bf16 wire, checkpointing: the unit-major step keeps the M micro-batches'
    layer inputs in pinned host memory (D2H on a side stream as each is saved, H2D back
    one layer ahead of its recomputation, each copy with an event), by default or through
    ``CheckpointOffload``: losses and weights equal the on-device boundaries' bit for bit
    (the same kernels on the same values), and the step's peak device memory is lower by
    at least half of the boundaries it no longer holds (M x 8 layers of (16, 64, 64) bf16,
    128 KiB each; half: backward brings back about M + 1 of them at a time, and the
    allocator rounds)."""
    torch.manual_seed(0)
    base = tiny_llama(tie=False, layers=8)
    g = torch.Generator().manual_seed(1)
    batches = [
        [torch.randint(0, 128, (16, 64), generator=g).cuda() for _ in range(M)] for _ in range(2)
    ]
    ours = _offload_run(copy.deepcopy(base), policy, batches, "cuda")  # the default: on host
    theirs = _offload_run(copy.deepcopy(base), True, batches, "cuda", on_host=False)
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b)
    boundary_bytes = 16 * 64 * 64 * 2
    assert ours[3] < theirs[3] - M * 8 * boundary_bytes // 2, (ours[3], theirs[3])
