"""Lean host formats in the engine (issue 14): bf16 masters, 8-bit states, the gradient ring.

The reference of an offloaded step in a lean format is the lean kernel applied by hand to a
copy of the same weights with the same gradients (``lean_adamw_step_``, tested against its
PyTorch twin in ``test_host_formats``): the engine must feed it exactly, whatever the path
(deferred in ``opt.step()``, fused during backward, run by run for split param groups,
accumulation). Each test runs on the CPU (CI) and, marked ``gpu``, on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import MLPStack, tiny_llama
from ramflow.engine.host_store import RING_BUFFERS, choose_precision
from ramflow.formats.states_4bit import dequantize_4bit, quantize_4bit
from ramflow.kernels.lean_kernels import lean_adamw_step_, quantize_blockwise
from ramflow.units.registry import engine_of_model
from ramflow.units.unit import Unit, find_units

PRESETS = ["bf16", "lean", "kahan", "lean4"]
LR = 2e-3


def batches(n: int, device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 16, generator=g).to(device), torch.randn(4, 8, generator=g).to(device))
        for _ in range(n)
    ]


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x.bfloat16()).float(), y)


def offloaded(model, device, preset, **kwargs):
    ramflow.offload(model, device=device, wire_dtype=torch.bfloat16, host_precision=preset)
    return ramflow.optim.AdamW(model.parameters(), lr=LR, **kwargs)


class KernelReference:
    """AdamW in ``preset``'s format applied by hand to flat copies of ``params``: the seeds
    and counters are the engine's (unit seed, offset of the parameter in its unit)."""

    def __init__(self, model, preset: str) -> None:
        engine = engine_of_model(model)
        self.precision = ramflow.HostPrecision.parse(preset)
        self.params = []
        for u in engine.units:
            for k, p in enumerate(u.owned[: u.num_trainable]):
                n = p.numel()
                int8 = self.precision.optimizer_states == "fp8"
                # 4-bit: the moments as fp32, coded and decoded around each step
                dtype = {"bf16": torch.bfloat16, "4bit": torch.float32}.get(
                    self.precision.optimizer_states
                )
                m = quantize_blockwise(torch.zeros(n), signed=True)[0] if int8 else None
                v = quantize_blockwise(torch.zeros(n), signed=False)[0] if int8 else None
                blocks = -(-n // 256)
                self.params.append(
                    dict(
                        w=p.detach().reshape(-1).clone().cpu(),
                        m=m if int8 else torch.zeros(n, dtype=dtype),
                        v=v if int8 else torch.zeros(n, dtype=dtype),
                        am=torch.zeros(blocks) if int8 else None,
                        av=torch.zeros(blocks) if int8 else None,
                        comp=torch.zeros(n, dtype=torch.bfloat16)
                        if self.precision.master == "bf16-kahan"
                        else None,
                        seed=u.rounding_seed,
                        offset=u.offsets[k],
                    )
                )

    def step(
        self, grads: list[torch.Tensor], step: int, weight_decay: float | list[float] = 1e-2
    ) -> None:
        """One step; ``weight_decay``: one for all parameters, or each parameter's."""
        decays = weight_decay if isinstance(weight_decay, list) else [weight_decay] * len(grads)
        four_bit = self.precision.optimizer_states == "4bit"
        for st, g, weight_decay in zip(self.params, grads, decays):
            lean_adamw_step_(
                st["w"], g.reshape(-1).cpu(), st["m"], st["v"], step=step, lr=LR, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=weight_decay, compensation=st["comp"],
                exp_avg_scale=st["am"], exp_avg_sq_scale=st["av"], seed=st["seed"],
                counter_offset=st["offset"],
            )  # fmt: skip
            if four_bit:  # the moments as the codes hold them
                for k, signed in (("m", True), ("v", False)):
                    codes, absmax = quantize_4bit(st[k], signed=signed)
                    st[k] = dequantize_4bit(codes, absmax, st[k].numel(), signed=signed)


@pytest.mark.parametrize("preset", PRESETS)
def test_offloaded_steps_are_the_kernels_steps(device, preset):
    """Deferred steps (overlap=False) equal the lean kernel on the same gradients, bit for bit."""
    torch.manual_seed(0)
    model = MLPStack()
    opt = offloaded(model, device, preset, overlap=False)
    ref = KernelReference(model, preset)
    for step, (x, y) in enumerate(batches(6, device), start=1):
        loss_of(model, x, y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        assert all(g.dtype == torch.bfloat16 for g in grads)  # a bf16 master's gradient
        opt.step()
        opt.zero_grad()
        ref.step(grads, step)
        ramflow.synchronize(model)
        for p, st in zip(model.parameters(), ref.params):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach().reshape(-1), st["w"]), step


@pytest.mark.parametrize("preset", PRESETS)
def test_steps_during_backward_equal_deferred_steps(device, preset):
    """The fused step from the ring's staging buffer gives the bits of the deferred step."""
    torch.manual_seed(0)
    base = tiny_llama(tie=False)
    pair = []
    for overlap in (True, False):
        m = copy.deepcopy(base)
        pair.append((m, offloaded(m, device, preset, overlap=overlap)))
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
        for m, opt in pair:
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    (m, _), (r, _) = pair
    ramflow.synchronize(m)
    ramflow.synchronize(r)
    # the overlapped run stepped during backward (the ring then keeps no full gradient)
    assert all(u.host_grad is None for u in engine_of_model(m).units if u.num_trainable)
    assert all(u.host_grad is not None for u in engine_of_model(r).units if u.num_trainable)
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("preset", ["lean", "kahan"])
def test_split_param_groups_step_as_one_group(device, preset):
    """Two groups with the same settings (flat steps run by run, ``AdamW.flat_runs``) give
    the bits of one group (flat steps over the whole unit), so offsets, blocks and rounding
    counters line up."""
    torch.manual_seed(0)
    base = MLPStack()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for m in models:
        ramflow.offload(m, device=device, wire_dtype=torch.bfloat16, host_precision=preset)
    params = list(models[1].named_parameters())
    opts = [
        ramflow.optim.AdamW(models[0].parameters(), lr=LR, overlap=False),
        ramflow.optim.AdamW(
            [
                {"params": [p for n, p in params if n.endswith("weight")]},
                {"params": [p for n, p in params if not n.endswith("weight")]},
            ],
            lr=LR,
            overlap=False,
        ),
    ]
    assert engine_of_model(models[1]).units[1].owned  # units hold both groups' parameters
    for x, y in batches(4, device):
        for m, opt in zip(models, opts):
            loss_of(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    for m in models:
        ramflow.synchronize(m)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("preset", PRESETS)
def test_resume_from_state_dicts_is_exact(device, preset):
    """Model and optimizer state dicts saved mid-run continue bit for bit in a new model, in
    every format (8-bit codes, their absmax, the Kahan compensation)."""
    torch.manual_seed(0)
    base = MLPStack()
    data = batches(8, device)
    model = copy.deepcopy(base)
    opt = offloaded(model, device, preset)

    def train(m, o, part):
        for x, y in part:
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()

    train(model, opt, data[:4])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, data[4:])

    resumed = copy.deepcopy(base)
    ropt = offloaded(resumed, device, preset)
    resumed.load_state_dict(saved_model)
    ropt.load_state_dict(saved_opt)
    names = set(ropt.state[next(resumed.parameters())])
    if preset in ("lean", "kahan"):
        assert {"exp_avg_scale", "exp_avg_sq_scale"} <= names
    if preset == "lean4":
        assert {"exp_avg_4bit", "exp_avg_4bit_scale", "exp_avg_sq_4bit_scale"} <= names
    train(resumed, ropt, data[4:])
    ramflow.synchronize(model)
    ramflow.synchronize(resumed)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_gradient_accumulation_under_the_ring(device):
    """no_step micro-batches make a full host gradient (bf16, the master's dtype); the
    final backward steps from it: equal to the same loop without overlap."""
    torch.manual_seed(0)
    base = MLPStack()
    pair = []
    for overlap in (True, False):
        m = copy.deepcopy(base)
        pair.append((m, offloaded(m, device, "lean", overlap=overlap)))
    data = batches(12, device)
    for i in range(0, 12, 3):
        for m, opt in pair:
            with opt.no_step():
                loss_of(m, *data[i]).backward()
                loss_of(m, *data[i + 1]).backward()
            loss_of(m, *data[i + 2]).backward()
            opt.step()
            opt.zero_grad()
    for m, _ in pair:
        ramflow.synchronize(m)
    for p, q in zip(pair[0][0].parameters(), pair[1][0].parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_host_bytes_of_the_lean_formats(device):
    """What the store holds: one bf16 buffer per unit (the master is the wire copy), no
    full host gradient once units step during backward, at most RING_BUFFERS staging
    buffers; and the plan's bytes per parameter meet the issue's targets."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=4)
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter
    opt = offloaded(model, device, "lean")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ramflow.synchronize(model)
    engine = engine_of_model(model)
    for u in engine.units:
        assert u.master.dtype == torch.bfloat16 and u.wire is u.master
        if u.num_trainable:
            assert u.host_grad is None  # the ring: no full gradient after an eager step
            assert u.staging is None  # given back to the ring
    assert engine.host._ring_made <= RING_BUFFERS
    plan = ramflow.get_plan(model)
    assert (
        plan.host_precision == ramflow.HostPrecision.lean() and plan.host_bytes_per_parameter <= 4.5
    )
    assert "4.03 bytes per trained parameter" in plan.describe()
    lean = ramflow.HostPrecision.lean()
    assert lean.bytes_per_parameter(trainable=False, wire_dtype=torch.bfloat16) <= 2
    assert (
        ramflow.HostPrecision.kahan().bytes_per_parameter(trainable=True, wire_dtype=torch.bfloat16)
        <= 6.5
    )
    # the 8-bit states are 1 byte per element plus one fp32 absmax per 256
    st = opt.state[model.lm_head.weight]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.uint8


def test_the_plan_counts_what_a_deferred_step_holds(device):
    """Under the ring a step not applied during backward (here the first, as the optimizer
    keeps p.grad) makes full host gradients: the plan names their bytes, exactly what the
    units hold; fp32's store counts its gradients already."""
    torch.manual_seed(0)
    model = MLPStack()
    opt = offloaded(model, device, "lean")
    x, y = batches(1, device)[0]
    loss_of(model, x, y).backward()
    engine = engine_of_model(model)
    held = sum(u.host_grad.nbytes for u in engine.units if u.host_grad is not None)
    plan = ramflow.get_plan(model)
    assert held > 0 and plan.host_deferred_bytes == held
    assert "that a step not applied during backward holds" in plan.describe()
    opt.step()
    ramflow.synchronize(model)
    exact = MLPStack()
    ramflow.offload(exact, device=device, wire_dtype=torch.bfloat16, host_precision="fp32")
    assert ramflow.get_plan(exact).host_deferred_bytes == 0


def test_no_full_gradient_ever_with_the_ring_and_keep_grads_false(device):
    """keep_grads=False promises the loop never reads gradients: under the ring, the first
    backward steps during backward too, so no full host gradient buffer is ever made (it
    would be the store's largest buffer); the steps equal deferred ones bit for bit."""
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = offloaded(a, device, "lean", keep_grads=False)
    opt_b = offloaded(b, device, "lean", overlap=False)
    engine = engine_of_model(a)
    for step, (x, y) in enumerate(batches(4, device)):
        for m, opt in ((a, opt_a), (b, opt_b)):
            loss_of(m, x, y).backward()
            if m is a:
                assert all(u.host_grad is None for u in engine.units), step
            opt.step()
            opt.zero_grad()
    ramflow.synchronize(a)
    ramflow.synchronize(b)
    assert all(u.host_grad is None for u in engine.units)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach())


def recipe_groups(model, weight_decay: float) -> list[dict]:
    """``ramflow train``'s param groups (Hugging Face's recipe): matrices with weight
    decay, vectors (biases, norm weights) without; a unit holds both."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("preset", ["lean", "kahan"])
def test_the_recipes_param_groups_step_during_backward_without_host_gradients(device, preset):
    """Units whose parameters sit in two param groups of other settings (the usual recipe)
    are stepped during backward straight from the ring's staging buffer, run by run, like
    one-group units: no full host gradient buffer is made (it cost a 70B run 2 bytes per
    parameter of every layer a rank steps, beyond the plan). The bits are the lean kernel's
    applied to each parameter with its group's weight decay."""
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opts = []
    for m, options in ((a, dict(keep_grads=False)), (b, dict(overlap=False))):
        ramflow.offload(m, device=device, wire_dtype=torch.bfloat16, host_precision=preset)
        opts.append(ramflow.optim.AdamW(recipe_groups(m, 0.1), lr=LR, **options))
    ref = KernelReference(b, preset)
    decays = [0.1 if p.dim() >= 2 else 0.0 for p in b.parameters()]
    engine = engine_of_model(a)
    assert any(len(opts[0].flat_runs(u)) == 2 for u in engine.units)  # mixed units
    for step, (x, y) in enumerate(batches(4, device), start=1):
        for m, opt in zip((a, b), opts):
            loss_of(m, x, y).backward()
            if m is a:
                assert all(u.host_grad is None for u in engine.units), step
            else:
                ref.step([p.grad.detach().clone() for p in b.parameters()], step, decays)
            opt.step()
            opt.zero_grad()
    ramflow.synchronize(a)
    ramflow.synchronize(b)
    assert all(u.host_grad is None for u in engine.units)
    for p, q, st in zip(a.parameters(), b.parameters(), ref.params):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(q.detach().reshape(-1).cpu(), st["w"])


def test_reproducible_at_any_thread_count():
    """Stochastic rounding keyed by (seed, step, element): 1 and 2 optimizer threads give
    the same bits."""
    torch.manual_seed(0)
    base = MLPStack(dim=64)
    results = []
    for threads in (1, 2):
        m = copy.deepcopy(base)
        opt = offloaded(m, "cpu", "lean", threads=threads)
        for x, y in batches(4, "cpu"):
            loss_of(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(m)
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_seed_changes_the_rounding():
    """Another HostPrecision seed rounds differently (the seed reaches the kernel)."""
    torch.manual_seed(0)
    base = MLPStack()
    results = []
    for seed in (0, 1):
        m = copy.deepcopy(base)
        ramflow.offload(
            m,
            device="cpu",
            wire_dtype=torch.bfloat16,
            host_precision=ramflow.HostPrecision(master="bf16-sr", seed=seed),
        )
        opt = ramflow.optim.AdamW(m.parameters(), lr=LR)
        for x, y in batches(3, "cpu"):
            loss_of(m, x, y).backward()
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(m)
        results.append(torch.cat([p.detach().reshape(-1).float() for p in m.parameters()]))
    assert not torch.equal(*results)


# ---------------------------------------------------------------------- bad input


def test_lean_masters_need_a_bf16_wire():
    with pytest.raises(
        ValueError,
        match=r"host_precision='lean' .*needs a bfloat16 wire dtype, got "
        r"wire_dtype=torch.float32. Leave wire_dtype out",
    ):
        ramflow.offload(MLPStack(), device="cpu", wire_dtype=torch.float32, host_precision="lean")
    custom = ramflow.HostPrecision(master="bf16-kahan", optimizer_states="bf16")
    with pytest.raises(ValueError, match=r"HostPrecision\(master='bf16-kahan', "):
        ramflow.offload(MLPStack(), device="cpu", wire_dtype=torch.float16, host_precision=custom)


@pytest.mark.parametrize("preset", ["bf16", "lean", "kahan"])
def test_lean_on_the_cpu_without_a_wire_dtype(preset):
    """The README's CPU path: without ``wire_dtype`` the wire follows the bf16 master, and
    the model trains (the loss falls) with ramflow's AdamW."""
    torch.manual_seed(0)
    model = ramflow.offload(MLPStack(), device="cpu", host_precision=preset)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    ramflow.undo(model)


def test_fp32_on_the_cpu_keeps_an_fp32_wire():
    model = ramflow.offload(MLPStack(), device="cpu", host_precision="fp32")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ramflow.undo(model)


def test_lean_states_need_adamw():
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    with pytest.raises(ValueError, match="SGD has no CPU step.*Combinations that work"):
        ramflow.optim.SGD(model.parameters(), lr=0.1)


def test_unknown_preset_and_unsupported_combinations():
    model = MLPStack()
    with pytest.raises(ValueError, match="not a preset"):
        ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="int4")
    assert engine_of_model(model) is None  # nothing was changed
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("saved,loaded", [("bf16", "lean"), ("lean", "lean4"), ("lean4", "lean")])
def test_loading_another_formats_state_is_refused(saved, loaded):
    torch.manual_seed(0)
    base = MLPStack()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = offloaded(a, "cpu", saved)
    opt_b = offloaded(b, "cpu", loaded)
    for m, opt in ((a, opt_a), (b, opt_b)):
        loss_of(m, *batches(1, "cpu")[0]).backward()
        opt.step()
    with pytest.raises(ValueError, match="same host_precision"):
        opt_b.load_state_dict(opt_a.state_dict())


def test_auto_picks_fp32_when_it_fits_else_lean_else_says_each_size():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(64)])  # 1.07 G params
    units = [Unit(i, s) for i, s in enumerate(find_units(model, None))]
    gib = 2**30
    precision, why = choose_precision(units, torch.bfloat16, 16 * gib)
    assert precision.name == "lean" and "fp32 would need" in why
    precision, why = choose_precision(units, torch.bfloat16, 256 * gib)
    assert precision.name == "fp32"
    with pytest.raises(MemoryError, match=r"fp32 needs about .* lean about"):
        choose_precision(units, torch.bfloat16, 2 * gib)
