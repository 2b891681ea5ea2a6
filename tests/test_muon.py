"""Muon: an offloaded model trained with ``ramflow.optim.Muon`` against a ``copy.deepcopy``
trained resident with ``torch.optim.Muon`` (the hidden matrices) and ``torch.optim.AdamW``
(the rest), through the loop ramflow learns to step during backward, under gradient
accumulation, clipping, ZeRO and a state round trip.

On the CPU every step is the reference's arithmetic op for op (the same Newton-Schulz
function, the same fused CPU AdamW, the same thread count), so weights and states are
equal bit for bit. On CUDA the reference runs its momentum, blend and AdamW in CUDA kernels
where ramflow runs them on the host, a few ulps of fp32 apart, and the bf16 iteration
magnifies that: one input element rounded the other way changes its output by about 1%
(relative Frobenius norm, measured on a 128 x 32 matrix: 0.9%), so the two runs drift
apart by a few percent of how far each matrix moved (measured on the CPU with the
reference's AdamW unfused, ulps apart: 4.6% after six steps at most). The CUDA tests bound
each parameter's distance from the reference by a tenth of its movement; a missing wait
for the device's result, a skipped or doubled step, the wrong scale or no Nesterov blend
are all larger. The iteration itself is checked bit for bit against a direct call on the
device.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dist_workers as W
import ramflow
from models import MLPStack, tiny_llama
from test_optimizers import batches, loss_of

STEPS = 6
SETTINGS = dict(lr=2e-3, momentum=0.9, weight_decay=0.1)
ADAMW = dict(adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)


def muon_groups(model: MLPStack) -> list[dict]:
    """Block matrices by Muon; the in- and output layers' matrices and every vector by
    AdamW (these without weight decay)."""
    hidden = [p for b in model.blocks for p in (b.up.weight, b.down.weight)]
    ids = {id(p) for p in hidden}
    matrices = [model.inp.weight, model.head.weight]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    assert len(hidden) + len(matrices) + len(vectors) == len(list(model.parameters()))
    assert not ids & {id(p) for p in matrices + vectors}
    return [
        {"params": hidden, "use_muon": True},
        {"params": matrices, "use_muon": False},
        {"params": vectors, "use_muon": False, "weight_decay": 0.0},
    ]


class Reference:
    """``torch.optim.Muon`` over the Muon groups and ``torch.optim.AdamW`` over the rest,
    with ramflow's settings (AdamW fused on the CPU, as ramflow steps it there)."""

    def __init__(self, model: MLPStack, device: torch.device, **muon) -> None:
        groups = muon_groups(model)
        self.muon = torch.optim.Muon(
            groups[0]["params"],
            lr=SETTINGS["lr"],
            momentum=SETTINGS["momentum"],
            weight_decay=SETTINGS["weight_decay"],
            adjust_lr_fn=muon.get("adjust_lr_fn", "match_rms_adamw"),
            nesterov=muon.get("nesterov", True),
        )
        self.adamw = torch.optim.AdamW(
            [{"params": g["params"], **{k: v for k, v in g.items() if k == "weight_decay"}}
             for g in groups[1:]],
            lr=ADAMW["adamw_lr"], betas=ADAMW["adamw_betas"], eps=ADAMW["adamw_eps"],
            weight_decay=SETTINGS["weight_decay"], fused=device.type == "cpu",
        )  # fmt: skip

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.adamw.zero_grad()


def ours(model: MLPStack, **muon) -> ramflow.optim.Muon:
    return ramflow.optim.Muon(muon_groups(model), **SETTINGS, **ADAMW, **muon)


def assert_same(model, ref, init, device) -> None:
    """Equal on the CPU; on CUDA each parameter within a tenth of its movement from
    ``init`` (see the module docstring)."""
    for (name, p), q, w in zip(model.named_parameters(), ref.parameters(), init.parameters()):
        p, q, w = p.detach(), q.detach().cpu(), w.detach()
        if device.type == "cpu":
            assert torch.equal(p, q), name
        else:
            assert (p - q).norm() <= 0.1 * (q - w).norm(), (name, (p - q).norm(), (q - w).norm())


def test_torch_has_the_reference():
    """The parity tests compare against PyTorch's own Muon (torch >= 2.9)."""
    assert hasattr(torch.optim, "Muon")


@pytest.mark.parametrize("muon", [{}, {"nesterov": False, "adjust_lr_fn": "original"}])
def test_trains_as_torch_muon_with_eager_steps_and_a_state_round_trip(device, muon):
    torch.manual_seed(0)
    model = MLPStack()
    init, ref = copy.deepcopy(model), copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ours(model, **muon)
    ref_opt = Reference(ref, device, **muon)
    probe = model.blocks[0].up.weight
    stepped_in_backward = []
    for i, batch in enumerate(batches(STEPS, device)):
        if i == 3:  # a fresh optimizer continues from the saved state
            saved = opt.state_dict()
            opt = ours(model, **muon)
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
    assert_same(model, ref, init, device)
    # states: the momentum of each Muon matrix, AdamW's moments and step of the rest
    state = opt.state_dict()["state"]
    muon_ref = ref_opt.muon.state_dict()["state"]
    adamw_ref = ref_opt.adamw.state_dict()["state"]
    assert len(state) == len(muon_ref) + len(adamw_ref)
    pairs = [(state[k], muon_ref[k]) for k in muon_ref]
    pairs += [(state[len(muon_ref) + k], adamw_ref[k]) for k in adamw_ref]
    for mine, theirs in pairs:
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            if device.type == "cpu":
                assert torch.equal(mine[name], value), name
            elif value.dim():  # the drift of the module docstring, a tenth at most
                assert (mine[name] - value.cpu()).norm() <= 0.1 * value.norm().cpu(), name
    if device.type == "cuda":  # the iteration ran on the GPU, none on the CPU
        assert [d.type for d in opt._orthogonalizers] == ["cuda"]
        assert all(o._streams is not None for o in opt._orthogonalizers.values())


def test_gradient_accumulation_steps_the_summed_gradients(device):
    """Two micro-batches per step (the first under ``no_step``): each step orthogonalizes
    the momentum of the accumulated gradient, as the reference does."""
    torch.manual_seed(0)
    model = MLPStack()
    init, ref = copy.deepcopy(model), copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ours(model)
    ref_opt = Reference(ref, device)
    data = batches(2 * 4, device)
    for step in range(4):
        first, last = data[2 * step], data[2 * step + 1]
        with opt.no_step():
            (loss_of(model, first) / 2).backward()
        (loss_of(model, last) / 2).backward()
        opt.step()
        opt.zero_grad()
        for batch in (first, last):
            (loss_of(ref, batch) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ramflow.synchronize(model)
    assert_same(model, ref, init, device)


def test_clipping_defers_and_matches(device):
    """A global-norm clip (every step deferred to ``step()``) before each step."""
    torch.manual_seed(0)
    model = MLPStack()
    init, ref = copy.deepcopy(model), copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ours(model)
    ref_opt = Reference(ref, device)
    for batch in batches(4, device):
        loss_of(model, batch).backward()
        ramflow.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        loss_of(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    ramflow.synchronize(model)
    assert_same(model, ref, init, device)


def test_groups_without_use_muon_are_split_by_shape():
    model = MLPStack()
    opt = ramflow.optim.Muon(model.parameters(), lr=1e-3, adamw_lr=5e-4)
    muon, adamw = opt.param_groups
    assert muon["use_muon"] and all(p.dim() == 2 for p in muon["params"])
    assert not adamw["use_muon"] and all(p.dim() == 1 for p in adamw["params"])
    assert (muon["lr"], adamw["lr"]) == (1e-3, 5e-4)
    assert len(muon["params"]) + len(adamw["params"]) == len(list(model.parameters()))


def test_muon_param_groups_give_embeddings_and_the_head_to_adamw():
    model = tiny_llama(tie=False)
    groups = ramflow.optim.muon_param_groups(model, weight_decay=0.05)
    by_id = {id(p): g for g in groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert not by_id[id(names["model.embed_tokens.weight"])]["use_muon"]
    assert not by_id[id(names["lm_head.weight"])]["use_muon"]
    assert by_id[id(names["model.layers.0.mlp.up_proj.weight"])]["use_muon"]
    norm = by_id[id(names["model.norm.weight"])]
    assert not norm["use_muon"] and norm["weight_decay"] == 0.0
    assert len(by_id) == len(names)
    ramflow.optim.Muon(groups)  # accepted as they are


def test_lean_host_formats_are_refused():
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    with pytest.raises(ValueError, match=r"Muon has no CPU step for.*host_precision='fp32'"):
        ramflow.optim.Muon(model.parameters())


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(momentum=1.0), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
        (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
        (dict(adamw_lr=-1.0), "adamw_lr"),
        (dict(adamw_eps=-1e-8), "adamw_eps"),
        (dict(lr=float("nan")), "learning rate"),
    ],
)
def test_out_of_range_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ramflow.optim.Muon(MLPStack().parameters(), **bad)


def test_a_vector_in_a_muon_group_is_refused():
    model = MLPStack()
    with pytest.raises(ValueError, match=r"use_muon=True param group holds .* \(32,\)"):
        ramflow.optim.Muon([{"params": [model.inp.weight, model.inp.bias], "use_muon": True}])


def test_units_planned_for_the_device_step_on_the_host_with_a_warning(device):
    """Muon has no device step: units planned for one are stepped on the host, as the
    reference."""
    from test_device_optimizer import offload_two_on_device

    torch.manual_seed(0)
    model = MLPStack()
    init, ref = copy.deepcopy(model), copy.deepcopy(model).to(device)
    assert offload_two_on_device(model, device)
    with pytest.warns(UserWarning, match="Muon has no device step: the 2 units"):
        opt = ours(model)
    ref_opt = Reference(ref, device)
    for batch in batches(4, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert_same(model, ref, init, device)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_ranks_orthogonalize_the_matrices_of_the_units_they_own(tmp_path, zero_stage):
    """Two gloo ranks, each on the whole global batch (their averaged gradients are then
    one process's bit for bit): each steps, and orthogonalizes whole, the units it owns,
    and the run is one process's ``torch.optim.Muon`` + AdamW bit for bit. The reference
    runs on one thread as the ranks do: the CPU's bf16 matmuls round by thread count, and
    Muon's iteration magnifies that (see the module docstring); so do ranks that split
    the batch (another summation order), which is why they take the whole one here."""
    results = W.run(
        W.train_offload,
        2,
        {"out": str(tmp_path), "zero_stage": zero_stage, "muon": True, "whole_batch": True},
    )
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = W.reference_model(seed=0)
        muon = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        ref = [
            torch.optim.Muon(muon, lr=1e-2, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True),
        ]
        losses = []
        for x, y in W.batches():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for o in ref:
                o.step()
                o.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    for r in results:
        assert r["losses"] == losses
    state = results[0]["state"]
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    # each rank holds the states of the units it owns only, together all of them
    held = [r["states"][0] for r in results]
    assert sum(held) == len(muon) + len(rest) and all(0 < n < sum(held) for n in held)


@pytest.mark.gpu
def test_the_device_iteration_is_torchs_on_the_device_bit_for_bit():
    """``_Orthogonalizer`` on CUDA (H2D, the iteration and D2H on three streams, an event
    the host waits on) gives ``torch.optim.Muon``'s function on the device, bit for bit,
    for several matrices in flight (a missing wait between the streams reads a half-copied
    input or result), each read as soon as it is submitted or later."""
    from ramflow.optim.muon import (
        DEFAULT_A,
        DEFAULT_B,
        DEFAULT_C,
        EPS,
        _newton_schulz,
        _Orthogonalizer,
    )

    device = torch.device("cuda")
    orth = _Orthogonalizer(device)
    gen = torch.Generator().manual_seed(0)
    shapes = [(2048, 1024), (1024, 2048), (1536, 1536)] * 2
    mats = [torch.randn(r, c, generator=gen).bfloat16() for r, c in shapes]
    jobs = []
    for k, x in enumerate(mats):  # half from pinned blend buffers, as the optimizer's
        src = orth.blend_buffer(x.shape) if k % 2 else torch.empty_like(x)
        assert src.is_pinned() == bool(k % 2)
        jobs.append(orth.submit(src.copy_(x), ns_steps=5))
    jobs.append(orth.submit(mats[0].clone(), ns_steps=5).result())  # read at once
    for x, job in zip([*mats, mats[0]], jobs):
        got = job if isinstance(job, torch.Tensor) else job.result()
        want = _newton_schulz(x.to(device), (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS)
        assert got.device.type == "cpu" and got.shape == x.shape
        assert torch.equal(got, want.cpu())
