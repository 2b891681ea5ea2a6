"""Lion, Adafactor and SGD: an offloaded model trained with ramflow's optimizer against a
``copy.deepcopy`` trained resident with the reference, through the loop that ramflow
learns to step during backward (backward, step, zero_grad: the first step deferred, then
each unit stepped as its gradients land), with param groups and a state round trip.

On the CPU every step is the reference's arithmetic op for op, so the weights are equal
bit for bit. On CUDA the resident reference computes the forward and backward on the GPU
as ramflow does, but its step runs there too, in other kernels (a fused SGD, CUDA's
sign and norm reductions): a few ulps of fp32 per step, which the weights carry forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import MLPStack

STEPS = 6


class ReferenceLion(torch.optim.Optimizer):
    """lucidrains/lion-pytorch's ``Lion`` (``update_fn``, the non-Triton path), op for
    op: the reference ramflow's Lion must equal bit for bit."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in filter(lambda p: p.grad is not None, group["params"]):
                grad, lr, wd = p.grad, group["lr"], group["weight_decay"]
                beta1, beta2 = group["betas"]
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.data.mul_(1.0 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


def groups(model: torch.nn.Module, **decay) -> list[dict]:
    """Matrices with the given settings, vectors (norms, biases) without weight decay."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], **decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 16, generator=g).to(device), torch.randn(4, 8, generator=g).to(device))
        for _ in range(n)
    ]


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def assert_same_weights(model, ref, device: torch.device, *, rtol: float) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if device.type == "cpu":
            assert torch.equal(p.detach(), q.detach().cpu()), name
        else:
            torch.testing.assert_close(p.detach(), q.detach().cpu(), rtol=rtol, atol=rtol)


# (ramflow's, the reference, settings, CUDA tolerance). The CUDA tolerances: Lion's update
# is +-lr per element, so a sign flipped by one ulp of c moves a weight by 2 lr (lr 1e-3
# here); Adafactor's and SGD's differ by fp32 rounding of reductions and fused kernels.
CASES = {
    "lion": (
        ramflow.optim.Lion,
        ReferenceLion,
        dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5),
        5e-3,
    ),
    "adafactor": (
        ramflow.optim.Adafactor,
        torch.optim.Adafactor,
        dict(lr=1e-2, weight_decay=0.1),
        1e-4,
    ),
    "sgd": (
        ramflow.optim.SGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
        1e-4,
    ),
    "sgd-nesterov": (
        ramflow.optim.SGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        1e-4,
    ),
}


def reference(kind, params, settings, device):
    """The resident reference optimizer; SGD's fused CPU kernel where ramflow uses it."""
    if kind is torch.optim.SGD and device.type == "cpu":
        return kind(params, fused=True, **settings)
    return kind(params, **settings)


@pytest.mark.parametrize("case", list(CASES))
def test_trains_as_the_reference_with_eager_steps_and_a_state_round_trip(device, case):
    ours_cls, ref_cls, settings, tol = CASES[case]
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ours_cls(groups(model, **settings), **settings)
    ref_opt = reference(ref_cls, groups(ref, **settings), settings, device)
    probe = model.blocks[0].up.weight
    stepped_in_backward = []
    for i, batch in enumerate(batches(STEPS, device)):
        if i == 3:  # a fresh optimizer continues from the saved state
            saved = opt.state_dict()
            opt = ours_cls(groups(model, **settings), **settings)
            opt.load_state_dict(saved)
        before = probe.detach().clone()
        loss_of(model, batch).backward()
        ramflow.synchronize(model)
        stepped_in_backward.append(not torch.equal(probe.detach(), before))
        opt.step()
        opt.zero_grad()
        loss_of(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ramflow.synchronize(model)
    # the first step of each optimizer is deferred to step(), later ones run in backward
    assert stepped_in_backward == [False, True, True, False, True, True]
    assert_same_weights(model, ref, device, rtol=tol)
    # the states the round trip carried are the reference's
    ours_sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert ours_sd.keys() == ref_sd.keys()
    if device.type == "cpu":
        for k in ref_sd:
            for name, value in ref_sd[k].items():
                assert torch.equal(ours_sd[k][name], value), (k, name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_ranks_step_the_units_they_own_as_the_reference(tmp_path, case, zero_stage):
    """Two gloo ranks under ZeRO, each on the whole global batch (their averaged gradients
    are then one process's, bit for bit): each steps the units it owns, and the run is
    the resident reference's, bit for bit; each rank holds the states of its own units
    only."""
    import dist_workers as W

    ours_cls, ref_cls, settings, _ = CASES[case]
    results = W.run(
        W.train_offload,
        2,
        {
            "out": str(tmp_path),
            "zero_stage": zero_stage,
            "whole_batch": True,
            "optimizer": (ours_cls.__name__, settings),
        },
    )
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)
    # on one thread, as each rank runs (dist_workers): reductions round by thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = W.reference_model(seed=0)
        ref = reference(ref_cls, model.parameters(), settings, torch.device("cpu"))
        losses = []
        for x, y in W.batches():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            ref.step()
            ref.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    for r in results:
        assert r["losses"] == losses
    for k, v in model.state_dict().items():
        assert torch.equal(results[0]["state"][k], v), k
    held = [r["states"][0] for r in results]
    assert sum(held) == len(list(model.parameters())) and all(0 < n < sum(held) for n in held)


def test_adafactor_keeps_factored_statistics_of_matrices():
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.Adafactor(model.parameters())
    loss_of(model, batches(1, torch.device("cpu"))[0]).backward()
    opt.step()
    ramflow.synchronize(model)
    up = model.blocks[0].up.weight  # (128, 32)
    st = opt.state[up]
    assert st["row_var"].shape == (128, 1) and st["col_var"].shape == (1, 32)
    assert "variance" not in st and "exp_avg_sq" not in st
    assert opt.state[model.blocks[0].up.bias]["variance"].shape == (128,)
    assert opt.state_shape("row_var", up.shape) == (128, 1)
    assert opt.state_shape("col_var", up.shape) == (1, 32)


def test_lion_momentum_lives_in_the_units_flat_buffers():
    """As AdamW's moments: one contiguous host buffer per unit, so a unit's states are
    one range of memory like its master weights."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.Lion(model.parameters(), lr=1e-3)
    loss_of(model, batches(1, torch.device("cpu"))[0]).backward()
    opt.step()
    ramflow.synchronize(model)
    block = model.blocks[1]
    up, down = opt.state[block.up.weight]["exp_avg"], opt.state[block.down.weight]["exp_avg"]
    assert up.untyped_storage().data_ptr() == down.untyped_storage().data_ptr()
    assert bool(up.abs().sum() > 0)


@pytest.mark.parametrize("name", ["Adafactor", "SGD"])
def test_lean_host_formats_are_refused_at_construction(name):
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    with pytest.raises(ValueError, match=rf"{name} has no CPU step for.*AdamW or .*Lion"):
        getattr(ramflow.optim, name)(model.parameters())


@pytest.mark.parametrize(
    ("cls", "bad", "match"),
    [
        (ramflow.optim.Lion, dict(lr=-1.0), "learning rate"),
        (ramflow.optim.Lion, dict(betas=(0.9, 1.0)), "betas"),
        (ramflow.optim.Lion, dict(weight_decay=-0.1), "weight_decay"),
        (ramflow.optim.Adafactor, dict(beta2_decay=0.5), "beta2_decay"),
        (ramflow.optim.Adafactor, dict(d=0.5), "clipping threshold"),
        (ramflow.optim.Adafactor, dict(eps=(-1.0, 1e-3)), "eps1"),
        (ramflow.optim.Adafactor, dict(eps=(None, -1e-3)), "eps2"),
        (ramflow.optim.Adafactor, dict(lr=-1.0), "learning rate"),
        (ramflow.optim.Adafactor, dict(weight_decay=-0.1), "weight_decay"),
        (ramflow.optim.AdamW, dict(lr=-1.0), "learning rate"),
        (ramflow.optim.AdamW, dict(eps=-1e-8), "epsilon"),
        (ramflow.optim.AdamW, dict(betas=(0.9, 1.0)), "betas"),
        (ramflow.optim.AdamW, dict(weight_decay=-0.1), "weight_decay"),
        (ramflow.optim.SGD, dict(lr=-1.0), "learning rate"),
        (ramflow.optim.SGD, dict(momentum=-0.9), "momentum -0.9 or weight_decay"),
        (ramflow.optim.SGD, dict(nesterov=True), "Nesterov momentum requires a momentum"),
    ],
)
def test_out_of_range_settings_are_refused(cls, bad, match):
    with pytest.raises(ValueError, match=match):
        cls(MLPStack().parameters(), **bad)


def test_states_follow_a_parameter_back_after_undo():
    """After ``ramflow.undo`` the states become plain tensors of the parameter's own, and
    training goes on as the reference's."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    handle = ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = ReferenceLion(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for i, batch in enumerate(batches(4, torch.device("cpu"))):
        if i == 2:
            ramflow.synchronize(model)
            ramflow.undo(handle)
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    assert_same_weights(model, ref, torch.device("cpu"), rtol=0.0)


def test_units_planned_for_the_device_step_on_the_host_with_a_warning(device):
    """Only AdamW has a device step: with ``device_optimizer`` the units planned for it are
    stepped on the CPU instead (once their gradients are there), as the reference."""
    from test_device_optimizer import offload_two_on_device

    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    assert offload_two_on_device(model, device)
    with pytest.warns(UserWarning, match="Lion has no device step: the 2 units"):
        opt = ramflow.optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = ReferenceLion(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for batch in batches(4, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert_same_weights(model, ref, device, rtol=CASES["lion"][3])


def lean_pair(host_precision: str, **lion):
    """An MLP offloaded in lean host formats (bf16 wire) and a Lion over it."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision=host_precision)
    return model, ramflow.optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1, **lion)


@pytest.mark.parametrize("host_precision", ["bf16", "lean", "kahan"])
def test_lion_on_lean_formats_rounds_as_the_lean_step(host_precision):
    """Each step of a parameter kept in a lean format is Lion's fp32 update of the decoded
    master and momentum, the momentum stored in the format (bf16, or 8-bit block codes)
    and the master written as AdamW's lean step writes it (bf16-sr: the lean kernel's
    stochastic rounding keyed by the unit's seed, the step and the element's index in its
    unit; Kahan: with its compensation), bit for bit."""
    from ramflow.kernels.lean_kernels import stochastic_round_bf16

    model, opt = lean_pair(host_precision, overlap=False)  # deferred steps keep p.grad
    engine = ramflow.api._engine(model)
    p = model.blocks[1].down.weight  # not the first parameter of its unit: a counter offset
    unit = engine.unit_of(p)
    lo = unit.offsets[next(i for i, q in enumerate(unit.owned) if q is p)]
    assert lo > 0
    fmt = unit.precision
    for step in (1, 2, 3):
        loss_of(model, batches(3, torch.device("cpu"))[step - 1]).backward()
        ramflow.synchronize(model)
        g = p.grad.detach().reshape(-1).float()
        w = p.detach().reshape(-1).float()
        st = opt.state.get(p) or {}
        comp = st.get("master_compensation")
        if comp is not None:
            w = w + comp.reshape(-1).float()
        m = torch.zeros_like(g)
        if st:
            flat = {n: v.reshape(-1) if v.dim() else v for n, v in st.items() if n != "step"}
            m = fmt.state_format.decode("exp_avg", flat).float()
        w = w * (1.0 - 1e-3 * 0.1)
        w = w - 1e-3 * (m * 0.9 + g * (1.0 - 0.9)).sign()
        m = m * 0.99 + g * (1.0 - 0.99)
        opt.step()
        opt.zero_grad()
        ramflow.synchronize(model)
        st = opt.state[p]
        assert int(st["step"]) == step
        if fmt.master == "bf16-sr":
            want = stochastic_round_bf16(w, seed=unit.rounding_seed, step=step, counter_offset=lo)
            assert torch.equal(p.detach().reshape(-1), want)
        else:  # Kahan: the bf16 master and the rest of the fp32 value, in bf16
            high = w.to(torch.bfloat16)
            assert torch.equal(p.detach().reshape(-1), high)
            rest = (w - high.float()).to(torch.bfloat16)
            assert torch.equal(st["master_compensation"].reshape(-1), rest)
        views = {"exp_avg": torch.empty_like(st["exp_avg"].reshape(-1))}
        if "exp_avg_scale" in st:
            views["exp_avg_scale"] = torch.empty_like(st["exp_avg_scale"])
        fmt.state_format.encode("exp_avg", m, views)
        for name, value in views.items():
            assert torch.equal(st[name].reshape(-1), value), name


def test_lion_on_lean_formats_tracks_fp32_and_resumes_exactly():
    """8-bit momentum and stochastically rounded bf16 masters (with a bf16 forward) move
    each weight matrix as the fp32 run does: the two updates after 8 steps point the same
    way (cosine > 0.9; 0.97-0.99 measured, the rest is bf16's rounding of the weights and
    the forward, which flips the sign of a few small c) and have the same size within 5%.
    A state round trip in the middle gives the uninterrupted run's weights bit for bit
    (the rounding is keyed by the step, which the state carries)."""
    data = batches(8, torch.device("cpu"))
    torch.manual_seed(0)
    init = [p.detach().clone() for p in MLPStack().parameters()]  # lean_pair's

    def run(host_precision, *, reload_at=None):
        model, opt = lean_pair(host_precision)
        for i, batch in enumerate(data):
            if i == reload_at:
                saved = opt.state_dict()
                opt = ramflow.optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
                opt.load_state_dict(saved)
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(model)
        return [p.detach().float().clone() for p in model.parameters()]

    lean, resumed, exact = run("lean"), run("lean", reload_at=4), run("fp32")
    assert all(torch.equal(a, b) for a, b in zip(lean, resumed))
    for a, b, w in zip(lean, exact, init):
        if w.dim() >= 2:
            da, db = (a - w).flatten(), (b - w).flatten()
            assert torch.nn.functional.cosine_similarity(da, db, dim=0) > 0.9
            assert abs(da.norm() / db.norm() - 1) < 0.05


def test_lion_momentum_follows_a_parameter_into_a_lean_unit_and_back():
    torch.manual_seed(0)
    model = MLPStack()
    opt = ramflow.optim.Lion(model.parameters(), lr=1e-3)
    loss_of(model, batches(1, torch.device("cpu"))[0]).backward()
    opt.step()
    opt.zero_grad()
    plain = opt.state[model.blocks[0].up.weight]["exp_avg"].clone()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    opt.state_dict()  # sorts the parameters again: the momentum moves into 8-bit codes
    st = opt.state[model.blocks[0].up.weight]
    assert st["exp_avg"].dtype == torch.uint8 and "exp_avg_scale" in st
    ramflow.undo(model)
    opt.state_dict()
    back = opt.state[model.blocks[0].up.weight]
    assert back.keys() == {"exp_avg", "step"}
    # the 8-bit code keeps 4 significant bits (within 2**-4 of each element), and below its
    # normal range 2**-10 of the block's scale, under 2**-17 of the block's absmax
    torch.testing.assert_close(back["exp_avg"], plain, atol=plain.abs().max() * 2**-17, rtol=2**-4)
