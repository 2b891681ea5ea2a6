"""Lean host formats under ZeRO (gloo on the CPU): the ranks of a host share one bf16 master
per unit (it is the wire copy), AdamW's 8-bit or bf16 states live on each unit's owner only,
and each rank keeps its own gradient ring."""

from __future__ import annotations

import pytest
import torch

import dist_workers as W
import ramflow

LEAN = {"wire_dtype": torch.bfloat16}


def _check_ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)


def _num_units_and_params() -> tuple[int, int]:
    model = ramflow.offload(W.reference_model(), device="cpu")
    return len(model._ramflow_engine.units), sum(1 for _ in model.parameters())


def _assert_one_bf16_copy_per_host(results: list[dict], hosts: list[str]) -> None:
    """Every rank of a host maps the same files, one ``.master`` per unit and no ``.wire``
    (a bf16 master is the wire copy); hosts map their own."""
    units, _ = _num_units_and_params()
    files = [set(r["memory"]["files"]) for r in results]
    for host in set(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        assert all(files[r] == files[ranks[0]] for r in ranks), files
        assert len(files[ranks[0]]) == units, files[ranks[0]]
        assert all(f.endswith(".master") for f in files[ranks[0]]), files[ranks[0]]
    for a in range(len(results)):
        for b in range(len(results)):
            if hosts[a] != hosts[b]:
                assert not files[a] & files[b]


@pytest.mark.parametrize(
    "zero_stage,preset",
    [(1, "lean"), (2, "lean"), (2, "bf16"), (2, "kahan")],
)
def test_lean_zero_on_two_ranks_is_one_process_bit_for_bit(tmp_path, zero_stage, preset):
    """Two ranks that each train on the whole global batch average two equal bf16
    gradients, which is exact (g/2 + g/2 = g), so they step with one process's gradients;
    the stochastic rounding is keyed by (seed, unit, step, element), not by the rank that
    steps: losses and weights equal the one process's with the same lean format, bit for
    bit. Each unit's states exist once, on its owner, in the format's dtype."""
    options = {**LEAN, "host_precision": preset}
    ref = W.run(W.train_offload, 1, {**options, "out": str(tmp_path / "one"), "zero_stage": None})
    _check_ok(ref)
    results = W.run(
        W.train_offload,
        2,
        {**options, "out": str(tmp_path / "two"), "zero_stage": zero_stage, "whole_batch": True},
    )
    _check_ok(results)
    for r in results:
        assert r["losses"] == ref[0]["losses"]
        assert r["host_precision"][0] == preset
    state, ref_state = results[0]["state"], ref[0]["state"]
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert state[k].dtype == torch.bfloat16 and torch.equal(state[k], v), k
    # ZeRO: each parameter's states on one rank only, in the lean format's dtypes
    _, num_params = _num_units_and_params()
    held = [r["states"][0] for r in results]
    assert sum(held) == num_params and all(0 < n < num_params for n in held), held
    assert results[0]["states"][1] == ref[0]["states"][1]
    expected = {"lean": "torch.uint8", "kahan": "torch.uint8", "bf16": "torch.bfloat16"}[preset]
    assert expected in ref[0]["states"][1] and "torch.float32" in ref[0]["states"][1]
    _assert_one_bf16_copy_per_host(results, ["host", "host"])


# What a rank of the test below holds beyond its plan, none of it per parameter (docs/
# design.md, "Where a rank's host memory goes"; measured at this size, 2026-11-28): the
# Python objects, threads and process groups that offload makes (7 MiB); glibc's main heap
# after the first steps (23 MiB: about 12 MiB that the CPU kernels and autograd keep, and
# the activations of 16 tokens through 12 layers, whose high-water mark the heap keeps);
# the gradient autograd hands to a parameter's hook before it is copied into the unit's
# buffer, and the step's own objects (6 MiB).
_NOT_IN_PLAN_BYTES = (7 + 23 + 6) * 2**20


@pytest.mark.slow
def test_a_ranks_private_memory_while_training_is_the_plans(tmp_path):
    """Two ranks train a Llama shape as ``ramflow train`` does on several GPUs (meta model,
    shared lean store, the recipe's two param groups, steps during backward): the peak of
    each rank's private memory while it offloads, builds the optimizer and trains, over its
    level before ``offload``, is the plan's bytes of that rank (its units' optimizer
    states, its gradient ring, and its "device" side on the CPU) plus the named costs that
    do not grow with the parameters (``_NOT_IN_PLAN_BYTES``), and no unit keeps a host
    gradient buffer. Measured: the plan plus 17 MiB (1.07x), as the plan's second device
    gradient buffer stays empty on the CPU (gloo's reduction is synchronous: 15 MiB). Two
    regressions it catches: each unit's norm at dispatch made an fp32 copy of the unit's
    gradients on the CPU (29 MiB; the plan plus 42-43 MiB, 1.18x), and before units of
    two param groups were stepped flat, each rank kept a bf16 gradient buffer of every unit
    it steps (2 bytes per parameter: 88 MiB; 30 GiB a rank on a 70B run on 4 GPUs)."""
    results = W.run(W.train_meta_private, 2, {"out": str(tmp_path), "hidden": 768, "layers": 12})
    _check_ok(results)
    for rank, r in enumerate(results):
        assert r["host_grads"] == 0, rank
        assert r["growth"] <= r["plan"] + _NOT_IN_PLAN_BYTES, (rank, r)


@pytest.mark.slow
def test_states_and_gradient_ring_are_made_before_the_first_step(tmp_path):
    """The optimizer's states and the gradient ring are made at set-up, not in the first
    step (see [Note: states made before the first step] in ``ramflow.optim.unit_states``):
    after ``ramflow.offload`` and ``AdamW(...)`` each rank holds the flat states of exactly
    the units it steps (ZeRO-2: those it owns; ``opt.state`` stays empty, as a torch
    optimizer's before its first step) and the ring's buffers; the first step adds no more
    private memory than the device's own buffers (host memory on the CPU) and a tenth of
    the states and ring. Measured: 69.7 MB beside a device side of 92.0 MB; with the
    states and ring made in the first step as before, 178-181 MB (their 155 MB more)."""
    results = W.run(
        W.first_step_private, 2, {"out": str(tmp_path), "hidden": 768, "layers": 12, "steps": 2}
    )
    _check_ok(results)
    for rank, r in enumerate(results):
        assert r["before"]["units_with_states"] == r["owned"], rank
        assert r["before"]["params_with_state"] == 0, rank
        assert r["before"]["ring"] == 4, rank  # RING_BUFFERS: each rank owns more units
        # the tenth: the autograd graph, Python objects and glibc's heap below its mmap
        # threshold, which the first step grows (later steps rose by at most 1.1 MB)
        slack = 0.1 * (r["states_bytes"] + r["ring_bytes"])
        assert r["rises"][0] <= r["device_side"] + slack, (rank, r)
