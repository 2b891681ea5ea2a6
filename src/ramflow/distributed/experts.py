"""Expert parallelism: each rank computes its share of a mixture-of-experts layer's experts,
and tokens travel to the rank that owns the expert the router chose, and back.

[Note: the token exchange]
Under expert parallelism (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al.
2021; DeepSpeed-MoE) rank r owns experts ``placement.experts_of(r)``: it alone streams their
weights through its GPU and steps their optimizer states, so a host's RAM and each GPU's PCIe
carry 1/P of the experts' bytes. Every rank runs attention and the router on its own
micro-batch; then, per MoE layer:

1. ``dispatch``: each (token, choice) pair of the router's top-k is sent to the owner of
   its expert. The ranks first exchange how many pairs each sends to each (one
   ``all_to_all_single`` of P integers), then the token activations themselves (one
   ``all_to_all_single`` of the rows, grouped by destination rank).
2. the owner runs each received row through the expert it was routed to
   (``ExpertBatch.local_expert``), in any order;
3. ``combine``: the outputs go back by the reverse exchange and are summed per token with
   the router's weights.

Both exchanges are autograd functions whose backward is the reverse exchange, so the
gradients of the expert outputs reach the owners and the gradients of the inputs come back;
the router's weights get their gradient in ``combine``'s weighted sum, on the token's own
rank. The result equals computing every expert on every rank, up to the order of summation
(``tests/test_expert_parallel.py`` checks it with gloo on the CPU). docs/moe.md has the
design around it and the predicted steps.

Shapes: T tokens, K choices per token (top-k), D hidden size, E experts, P ranks,
N rows received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns which experts: contiguous blocks of ``num_experts / world_size``.

    Attributes:
        num_experts: E, the routed experts of one MoE layer.
        world_size: P, the ranks sharing them; must divide E.

    Raises:
        ValueError: at construction, when P does not divide E or either is below 1.
    """

    num_experts: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.world_size < 1:
            raise ValueError(
                f"ExpertPlacement: num_experts ({self.num_experts}) and world_size "
                f"({self.world_size}) must be at least 1"
            )
        if self.num_experts % self.world_size:
            raise ValueError(
                f"ExpertPlacement: {self.world_size} ranks do not divide {self.num_experts} "
                "experts evenly; use a world size that divides the number of experts"
            )

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def owner(self, expert_EK: torch.Tensor) -> torch.Tensor:
        """The owning rank of each expert index (same shape, int64)."""
        return torch.div(expert_EK, self.experts_per_rank, rounding_mode="floor")

    def experts_of(self, rank: int) -> range:
        """The global expert indices rank ``rank`` owns."""
        return range(rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows_ND, send_counts, recv_counts, group):  # noqa: D102
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        out = rows_ND.new_empty((sum(recv_counts), *rows_ND.shape[1:]))
        dist.all_to_all_single(
            out,
            rows_ND.contiguous(),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=group,
        )
        return out

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: D102
        back = grad_ND.new_empty((sum(ctx.send_counts), *grad_ND.shape[1:]))
        dist.all_to_all_single(
            back,
            grad_ND.contiguous(),
            output_split_sizes=ctx.send_counts,
            input_split_sizes=ctx.recv_counts,
            group=ctx.group,
        )
        return back, None, None, None


@dataclass(frozen=True)
class ExpertBatch:
    """What ``dispatch`` hands the owner, and what ``combine`` needs to bring rows back.

    Attributes:
        rows_ND: the received token activations, (N, D), grouped by sending rank.
        local_expert_N: for each received row, the index among this rank's experts
            (0 .. experts_per_rank - 1), int64 on the rows' device.
        order_TK: the permutation that grouped this rank's (token, choice) pairs by
            destination rank (indices into the flattened T*K pairs).
        send_counts: rows this rank sent to each rank (P ints).
        recv_counts: rows this rank received from each rank (P ints).
        num_tokens: T, this rank's tokens.
    """

    rows_ND: torch.Tensor
    local_expert_N: torch.Tensor
    order_TK: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


def _exchange_counts(send_counts: torch.Tensor, group) -> list[int]:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv.tolist()


def dispatch(
    x_TD: torch.Tensor,
    expert_TK: torch.Tensor,
    placement: ExpertPlacement,
    group: dist.ProcessGroup | None = None,
) -> ExpertBatch:
    """Send each (token, choice) pair's activation to the rank that owns its expert.

    Args:
        x_TD: this rank's token activations, (T, D), any float dtype, on the device the
            process group communicates from (CPU for gloo, the rank's GPU for NCCL).
        expert_TK: the router's chosen global expert indices, (T, K), int64, same device.
        placement: which rank owns which experts (``ExpertPlacement``).
        group: the process group of the P ranks (default: the world).

    Returns:
        ``ExpertBatch``: the rows this rank must run through its own experts, and the
        bookkeeping ``combine`` needs. Differentiable in ``x_TD``.

    Raises:
        ValueError: ``expert_TK`` is not (T, K) for ``x_TD``'s T, or names an expert
            outside 0 .. E-1; the group's size is not ``placement.world_size``.
    """
    world = dist.get_world_size(group)
    if world != placement.world_size:
        raise ValueError(
            f"dispatch: the process group has {world} ranks, the placement {placement.world_size}"
        )
    if expert_TK.dim() != 2 or expert_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"dispatch: expert_TK must be (T, K) with T = {x_TD.shape[0]}, got "
            f"{tuple(expert_TK.shape)}"
        )
    if expert_TK.numel() and (
        int(expert_TK.min()) < 0 or int(expert_TK.max()) >= placement.num_experts
    ):
        raise ValueError(f"dispatch: expert indices must lie in 0..{placement.num_experts - 1}")
    num_tokens, k = expert_TK.shape
    flat_expert = expert_TK.reshape(-1)
    owner = placement.owner(flat_expert)
    order = torch.argsort(owner, stable=True)  # grouped by destination, token order kept
    send = torch.bincount(owner, minlength=world)
    send_counts = send.tolist()
    recv_counts = _exchange_counts(send, group)
    token_of_pair = torch.div(order, k, rounding_mode="floor")
    rows = _AllToAll.apply(x_TD[token_of_pair], send_counts, recv_counts, group)
    local = (flat_expert[order] - owner[order] * placement.experts_per_rank).contiguous()
    local_expert = torch.empty(sum(recv_counts), dtype=local.dtype, device=local.device)
    dist.all_to_all_single(
        local_expert,
        local,
        output_split_sizes=recv_counts,
        input_split_sizes=send_counts,
        group=group,
    )
    return ExpertBatch(rows, local_expert, order, send_counts, recv_counts, num_tokens)


def combine(
    y_ND: torch.Tensor,
    batch: ExpertBatch,
    weight_TK: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Bring the experts' outputs back to their tokens and sum them with the router weights.

    Args:
        y_ND: the owner's outputs for ``batch.rows_ND``, row for row, (N, D').
        batch: what ``dispatch`` returned on this rank.
        weight_TK: the router's weight of each choice, (T, K), on this rank's tokens.
        group: the same process group as ``dispatch``'s.

    Returns:
        (T, D'): for each token, the sum over its K choices of weight * expert output, in
        ``y_ND``'s dtype. Differentiable in ``y_ND`` and ``weight_TK``.

    Raises:
        ValueError: ``y_ND`` has not the N rows ``batch`` received.
    """
    if y_ND.shape[0] != batch.rows_ND.shape[0]:
        raise ValueError(
            f"combine: y_ND must have the {batch.rows_ND.shape[0]} rows dispatch received, "
            f"got {y_ND.shape[0]}"
        )
    back = _AllToAll.apply(y_ND, batch.recv_counts, batch.send_counts, group)
    k = weight_TK.shape[1]
    pair_out = torch.empty_like(back)
    pair_out = pair_out.index_copy(0, batch.order_TK, back)  # back to (token, choice) order
    pair_out = pair_out.view(batch.num_tokens, k, -1)
    return (pair_out * weight_TK.unsqueeze(-1).to(pair_out.dtype)).sum(dim=1)
