"""``offload(activation_checkpointing=...)``: only the named units recompute, and a
checkpointing policy of ``ramflow.memory`` chooses the units it chooses on the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ramflow
from models import MLPStack, tiny_llama
from ramflow.memory import (
    CheckpointAll,
    CheckpointEveryKth,
    CheckpointSegments,
    CheckpointToBudget,
    SelectiveCheckpoint,
    activation_report,
    apply_checkpointing,
)
from ramflow.units.registry import engine_of_model


def _grads(model, x) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_only_the_named_units_are_wrapped_and_gradients_match() -> None:
    torch.manual_seed(0)
    model = MLPStack(depth=3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    expected = _grads(ref, x)
    ramflow.offload(
        model, device="cpu", wire_dtype=torch.float32, activation_checkpointing=["blocks.1"]
    )
    assert [m is model.blocks[1] for m in engine_of_model(model).checkpointer.checkpointed] == [
        True
    ]
    assert "forward" in model.blocks[1].__dict__ and "forward" not in model.blocks[0].__dict__
    got = _grads(model, x)
    ramflow.synchronize(model)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    ramflow.undo(model)
    assert "forward" not in model.blocks[1].__dict__


def test_an_empty_list_checkpoints_nothing() -> None:
    model = ramflow.offload(MLPStack(depth=2), device="cpu", activation_checkpointing=[])
    assert engine_of_model(model).checkpointer.checkpointed == []
    ramflow.undo(model)


def test_an_unknown_unit_is_refused_and_the_model_given_back() -> None:
    model = MLPStack(depth=2)
    with pytest.raises(ValueError, match="does not have"):
        ramflow.offload(model, device="cpu", activation_checkpointing=["blocks.7"])
    assert not ramflow.is_offloaded(model)
    ramflow.offload(model, device="cpu")  # nothing was left behind
    ramflow.undo(model)


def test_hugging_face_layers_follow_the_names() -> None:
    pytest.importorskip("transformers")
    model = tiny_llama(tie=True, layers=3)
    ramflow.offload(model, device="cpu", activation_checkpointing=["model.layers.1", "lm_head"])
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [False, True, False]
    # the head holds no Hugging Face layer: ramflow's wrapper recomputes it
    assert [type(m).__name__ for m in engine_of_model(model).checkpointer.checkpointed] == [
        "Linear"
    ]
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    ramflow.undo(model)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


# ---------------------------------------------------------------- policies of ramflow.memory
#
# ``offload(activation_checkpointing=policy)`` checkpoints the units the policy chooses, as
# ``apply_checkpointing`` does on the plain model. Which units recompute is read off the
# calls of a submodule of each block made during backward (a recomputation runs the block's
# forward past the block's own hooks, but its submodules go through theirs). On the CPU with
# an fp32 wire the offloaded model runs the same kernels on the same values as the plain one,
# and ramflow's CPU AdamW is PyTorch's fused CPU AdamW step, so losses and weights after a few
# steps are compared bit for bit.


class WidthStack(torch.nn.Module):
    """Blocks of different widths (different activation bytes) in a ModuleList."""

    def __init__(self, dim: int, hiddens: list[int]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(expand_block(dim, h) for h in hiddens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def expand_block(dim: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim)
    )


def backward_calls(probes: list[torch.nn.Module], run) -> list[int]:
    """For each probe module, its calls made during the backward of ``run()``'s loss."""
    counts = [0] * len(probes)
    in_backward = [False]

    def counter(i: int):
        def hook(module, args):
            if in_backward[0]:
                counts[i] += 1

        return hook

    handles = [p.register_forward_pre_hook(counter(i)) for i, p in enumerate(probes)]
    try:
        loss = run()
        in_backward[0] = True
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return counts


def train_both(model, policy, batches, loss_fn, *, lr=1e-2):
    """``policy`` on a deepcopy (``apply_checkpointing``) and on ``model`` offloaded; a few
    AdamW steps of each; returns both loss curves and the plain model."""
    plain = copy.deepcopy(model)
    apply_checkpointing(plain, policy)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32, activation_checkpointing=policy)
    opt = ramflow.optim.AdamW(model.parameters(), lr=lr)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr, fused=True)
    curves: tuple[list[float], list[float]] = ([], [])
    for batch in batches:
        for m, o, curve in ((model, opt, curves[0]), (plain, plain_opt, curves[1])):
            loss = loss_fn(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            curve.append(loss.item())
    ramflow.synchronize(model)
    return curves, plain


def assert_same_weights(model, plain) -> None:
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def mlp_loss(m, x):
    return m(x).square().mean()


@pytest.mark.parametrize(
    "policy,expected",
    [
        (CheckpointAll(), [0, 1, 2, 3, 4, 5]),
        (CheckpointEveryKth(2), [0, 2, 4]),
        (CheckpointEveryKth(4), [0, 4]),
        (SelectiveCheckpoint(), [0, 1, 2, 3, 4, 5]),
        (SelectiveCheckpoint(within=CheckpointEveryKth(3)), [0, 3]),
    ],
    ids=["all", "every-2nd", "every-4th", "selective", "selective-every-3rd"],
)
def test_a_policy_checkpoints_its_units_and_trains_as_on_the_plain_model(policy, expected):
    torch.manual_seed(0)
    model = MLPStack(dim=16, depth=6)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=g) for _ in range(4)]
    (ours, theirs), plain = train_both(model, policy, batches, mlp_loss)
    assert ours == theirs
    assert_same_weights(model, plain)

    wrapped = engine_of_model(model).checkpointer.checkpointed
    assert [m for m in wrapped] == [model.blocks[i] for i in expected]
    want = [1 if i in expected else 0 for i in range(6)]
    x = batches[0]
    assert backward_calls([b.norm for b in model.blocks], lambda: mlp_loss(model, x)) == want
    assert backward_calls([b.norm for b in plain.blocks], lambda: mlp_loss(plain, x)) == want
    ramflow.undo(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_the_budget_policy_checkpoints_the_units_that_save_most():
    torch.manual_seed(0)
    batch, dim, hiddens = 4, 8, [8, 64, 16, 32]
    model = WidthStack(dim, hiddens)
    x = torch.randn(batch, dim)
    report = activation_report(model, x)
    # checkpointing a block keeps its input and drops its hidden activation (4 * B * hidden
    # bytes): blocks 1 and 3 save the most, and together they meet this budget
    policy = CheckpointToBudget(report.total_saved_bytes - 4 * batch * (64 + 32), report=report)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(batch, dim, generator=g) for _ in range(4)]
    (ours, theirs), plain = train_both(model, policy, batches, mlp_loss)
    assert ours == theirs
    assert_same_weights(model, plain)
    probes = [b[0] for b in model.blocks]
    assert backward_calls(probes, lambda: mlp_loss(model, x)) == [0, 1, 0, 1]
    assert backward_calls([b[0] for b in plain.blocks], lambda: mlp_loss(plain, x)) == [0, 1, 0, 1]
    ramflow.undo(model)


def test_segments_checkpoint_runs_of_units():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(expand_block(8, 16) for _ in range(7)))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]
    # 7 // 3 = 2 units a segment: (0, 1), (2, 3) checkpointed, the last (4-6) is not
    (ours, theirs), plain = train_both(model, CheckpointSegments(3), batches, mlp_loss)
    assert ours == theirs
    assert_same_weights(model, plain)
    assert engine_of_model(model).checkpointer.checkpointed == [model]  # the nn.Sequential
    want = [1, 1, 1, 1, 0, 0, 0]
    x = batches[0]
    assert backward_calls([b[0] for b in model], lambda: mlp_loss(model, x)) == want
    assert backward_calls([b[0] for b in plain], lambda: mlp_loss(plain, x)) == want
    # the recomputation gave back what it loaded: nothing is pinned between steps
    assert all(u.pins == 0 and u.swaps == 0 for u in engine_of_model(model).units)
    ramflow.undo(model)
    assert "forward" not in model.__dict__
    assert all(p.device.type == "cpu" for p in model.parameters())


class OpCounter(TorchDispatchMode):
    """Counts the aten operators that run (selective checkpointing answers the saved ones
    from its cache, below this mode, so they are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(model_fn, loss_fn, policy) -> dict[str, int]:
    torch.manual_seed(0)
    model = model_fn()
    ramflow.offload(
        model, device="cpu", wire_dtype=torch.float32, activation_checkpointing=policy or False
    )
    loss = loss_fn(model)
    with OpCounter() as counter:
        loss.backward()
    ramflow.synchronize(model)
    ramflow.undo(model)
    return counter.counts


MATMULS = ("mm", "addmm", "bmm")


def matmuls(ops: dict[str, int]) -> int:
    return sum(ops.get(n, 0) for n in MATMULS)


def test_selective_policy_saves_matmuls_of_offloaded_units():
    def loss_fn(m):
        return mlp_loss(m, torch.randn(4, 16))

    plain, full, selective = (
        backward_ops(lambda: MLPStack(dim=16, depth=3), loss_fn, p)
        for p in (None, CheckpointAll(), SelectiveCheckpoint())
    )
    # full recomputation runs each block's first Linear again (its second Linear's output
    # is saved by nothing, so non-reentrant checkpoint stops before it); selective takes
    # the saved matmul outputs from its cache
    assert matmuls(full) == matmuls(plain) + 3
    assert matmuls(selective) == matmuls(plain)
    # both recompute the pointwise ops (ReLU), which a plain backward never runs
    assert plain.get("relu", 0) == 0
    assert full["relu"] == selective["relu"] == 3


def test_hugging_face_layers_follow_a_policy():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=4)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 12), generator=g) for _ in range(3)]

    def lm_loss(m, ids):
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    (ours, theirs), plain = train_both(model, CheckpointEveryKth(2), batches, lm_loss, lr=3e-3)
    assert ours == theirs
    assert_same_weights(model, plain)
    # Hugging Face's own switch recomputes the chosen layers
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [
        True,
        False,
        True,
        False,
    ]
    ids = batches[0]
    probes = [layer.input_layernorm for layer in model.model.layers]
    assert backward_calls(probes, lambda: lm_loss(model, ids)) == [1, 0, 1, 0]
    ramflow.undo(model)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_hugging_face_layers_take_the_selective_policy():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))

    def loss_fn(m):
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    plain, full, selective = (
        backward_ops(lambda: tiny_llama(tie=False, layers=2), loss_fn, p)
        for p in (None, CheckpointAll(), SelectiveCheckpoint())
    )
    assert matmuls(full) > matmuls(plain)
    assert matmuls(selective) == matmuls(plain)  # the context_fn reached the layers
    assert selective.get("silu", 0) == full.get("silu", 0) > plain.get("silu", 0)


@pytest.mark.parametrize(
    "make,policy,message",
    [
        (lambda: MLPStack(depth=4), CheckpointSegments(2), "nn.Sequential"),
        (lambda: torch.nn.Linear(4, 4), CheckpointAll(), "no unit to checkpoint"),
        (
            lambda: MLPStack(depth=2),
            CheckpointToBudget(
                0, report=activation_report(torch.nn.Linear(2, 2), torch.ones(1, 2))
            ),
            "no row",
        ),
    ],
    ids=["segments-of-a-module-list", "one-unit", "report-of-another-model"],
)
def test_a_policy_that_cannot_apply_is_refused_and_the_model_given_back(make, policy, message):
    model = make()
    with pytest.raises(ValueError, match=message):
        ramflow.offload(model, device="cpu", activation_checkpointing=policy)
    assert not ramflow.is_offloaded(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    ramflow.offload(model, device="cpu")  # nothing was left behind
    ramflow.undo(model)


def test_other_values_are_refused_before_anything_changes():
    model = MLPStack(depth=2)
    with pytest.raises(TypeError, match="CheckpointEveryKth"):
        ramflow.offload(model, device="cpu", activation_checkpointing=2)
    assert not ramflow.is_offloaded(model)
    # a generator of names is read once
    ramflow.offload(
        model, device="cpu", activation_checkpointing=(f"blocks.{i}" for i in range(1, 2))
    )
    assert engine_of_model(model).checkpointer.checkpointed == [model.blocks[1]]
    ramflow.undo(model)
