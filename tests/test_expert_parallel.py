"""Expert parallelism's token exchange (``ramflow.distributed.experts``) on real processes
with gloo: the same outputs and gradients as one process that computes every expert."""

from __future__ import annotations

import pytest
import torch

import dist_workers as W
from ramflow.distributed.experts import ExpertPlacement


def _single_process(world_size: int, moe: dict):
    """Every rank's tokens through every expert in one process: the truth."""
    router, experts, top_k, tokens, dim = W.moe_reference(**moe)
    outs, x_grads = [], []
    for rank in range(world_size):
        x = W.moe_tokens(rank, tokens, dim).requires_grad_(True)
        weight, expert = W.moe_forward(x, router, None, top_k)
        y_TKD = torch.stack(
            [torch.stack([experts[int(e)](x[t]) for e in expert[t]]) for t in range(tokens)]
        )
        out = (y_TKD * weight.unsqueeze(-1)).sum(dim=1)
        g = torch.Generator().manual_seed(2000 + rank)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad)
    expert_grads = {e: m.weight.grad for e, m in enumerate(experts)}
    return outs, x_grads, router.weight.grad, expert_grads


def test_token_exchange_equals_every_expert_in_one_process(tmp_path):
    world_size, moe = 3, {"num_experts": 6, "top_k": 3}
    results = W.run(W.expert_parallel, world_size, {"out": str(tmp_path), "moe": moe})
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)
    outs, x_grads, router_grad, expert_grads = _single_process(world_size, moe)
    # fp32 on the CPU; the sums run in another order than the reference's, so equal to
    # within a few ulps of values of order 1, not bit for bit
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out"], outs[rank], **tol)
        torch.testing.assert_close(r["x_grad"], x_grads[rank], **tol)
    # each expert's gradient is on its owner alone, summed over every rank's tokens
    owned = {e: g for r in results for e, g in r["expert_grads"].items()}
    assert sorted(owned) == list(range(len(expert_grads)))
    for e, g in expert_grads.items():
        torch.testing.assert_close(owned[e], g, **tol)
    # the router's gradient is per rank (data parallel): their sum is the single process's
    torch.testing.assert_close(sum(r["router_grad"] for r in results), router_grad, **tol)
    # tokens really travelled: every rank received rows from another rank
    for rank, r in enumerate(results):
        assert sum(r["recv_counts"]) - r["recv_counts"][rank] > 0, (rank, r["recv_counts"])


def test_placement_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="do not divide"):
        ExpertPlacement(num_experts=6, world_size=4)
    p = ExpertPlacement(num_experts=8, world_size=4)
    assert list(p.experts_of(3)) == [6, 7]
    assert p.owner(torch.tensor([[0, 7], [3, 4]])).tolist() == [[0, 3], [1, 2]]
