"""Every MoE family of ``moe_models.py`` trains offloaded as it does resident (issue 47,
point 1): the plain loop, Hugging Face's ``Trainer`` and PEFT LoRA on attention and the
experts, each against the same run on a ``copy.deepcopy``, with the router's auxiliary
load-balancing loss in the loss (``output_router_logits=True``, ``router_aux_loss_coef``
0.5, large enough that its gradient moves the routers).

On the CPU (fp32, CI) the runs are bit for bit equal: the same fp32 kernels run on the
same weights (a unit's device copy is its host master on the CPU path), ramflow's CPU
AdamW is PyTorch's fused CPU AdamW, and the top-k routing therefore picks the same
experts. Marked ``gpu``, the same tests run on CUDA in bf16: the resident run computes
from fp32 weights under bf16 autocast and steps with CUDA's AdamW, ramflow from the bf16
wire copy of fp32 masters stepped by its own AdamW; the tolerances below say why they hold.

DeepSeek-V3 has no auxiliary loss in transformers (V3 balances its experts by the router's
correction bias, a buffer that transformers never updates), so its ``aux_loss`` is None
on both sides; its router logits are still recorded (``output_router_logits``) by
transformers' forward hooks on the offloaded router.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ramflow
from moe_models import FAMILIES, moe_config

pytest.importorskip("transformers")

LR = 1e-3
STEPS = 3
AUX_COEF = 0.5
NO_AUX_LOSS = {"deepseek_v3"}

# bf16 wire against fp32 weights under bf16 autocast: each matmul rounds its inputs to
# bf16 (8 bits of mantissa, relative 2**-8) on both sides but from masters that CUDA's and
# ramflow's AdamW round differently, and a router may then send a near-tied token to
# another expert, which moves the loss by that token's small weight: 5 bf16 epsilons on a
# loss near 6 (with the aux loss) covers the two layers' dozen ops in sequence.
LOSS_ATOL_CUDA = 5 * 2**-8
# AdamW moves an element by at most about lr per step whatever its gradient, so runs whose
# gradients differ by rounding end within 2 * lr * steps of each other.
WEIGHT_ATOL_CUDA = 2 * LR * STEPS


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def initial(family: str) -> torch.nn.Module:
    """The family's tiny model with seeded fp32 weights, its router's auxiliary loss on
    (every test trains deepcopies of it)."""
    from transformers import AutoModelForCausalLM

    config = moe_config(family)
    config.output_router_logits = True
    config.router_aux_loss_coef = AUX_COEF
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_batches(n: int, device: torch.device) -> list[torch.Tensor]:
    """``n`` micro-batches of (2, 16) byte ids."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (2, 16), generator=g).to(device) for _ in range(n)]


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, *, device, atol: float) -> None:
    ours, theirs = ours.detach().float().cpu(), theirs.detach().float().cpu()
    if device.type == "cpu":
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


def assert_same_weights(model, ref, *, device) -> None:
    """Every entry of the state dicts (``state_dict`` of an offloaded model waits for the
    steps in flight), the routers' buffers included."""
    ours = model.state_dict()
    theirs = ref.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        try:
            assert_close(ours[name], value, device=device, atol=WEIGHT_ATOL_CUDA)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def train_both(model, ref, device, *, trainable=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``STEPS`` steps of the plain loop on offloaded ``model`` and resident ``ref``, each
    with its AdamW over its trainable parameters; (losses, aux losses) of each side,
    shape (2, STEPS), NaN where the family has no aux loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    opts = (
        ramflow.optim.AdamW(params, lr=LR),
        torch.optim.AdamW(ref_params, lr=LR, fused=device.type == "cpu" or None),
    )
    losses = torch.full((2, STEPS), float("nan"))
    aux = torch.full((2, STEPS), float("nan"))
    for step, ids in enumerate(token_batches(STEPS, device)):
        for side, (m, opt) in enumerate(zip((model, ref), opts)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses[side, step] = out.loss.item()
            if out.aux_loss is not None:
                aux[side, step] = out.aux_loss.item()
    ramflow.synchronize(model)
    return losses, aux


def assert_aux_loss(family: str, aux: torch.Tensor, device) -> None:
    if family in NO_AUX_LOSS:
        assert aux.isnan().all()
    else:
        assert not aux.isnan().any()
        assert_close(aux[0], aux[1], device=device, atol=LOSS_ATOL_CUDA)


def test_plain_loop_with_router_aux_loss(family, initial, device):
    """Full fine-tuning, every weight trained: losses, aux losses and every parameter and
    buffer after ``STEPS`` steps equal the resident model's."""
    model = copy.deepcopy(initial)
    ref = copy.deepcopy(initial).to(device)
    ramflow.offload(model, device=device)
    losses, aux = train_both(model, ref, device)
    assert_close(losses[0], losses[1], device=device, atol=LOSS_ATOL_CUDA)
    assert_aux_loss(family, aux, device)
    assert_same_weights(model, ref, device=device)
    # the run trained the routers (the aux loss and the routed outputs reach them)
    router = next(n for n, _ in initial.named_parameters() if ".gate." in n or ".router." in n)
    assert not torch.equal(model.state_dict()[router].cpu(), initial.state_dict()[router])


# ---------------------------------------------------------------------------- Trainer


def test_hf_trainer_with_router_aux_loss(family, initial, device, tmp_path):
    """Hugging Face's ``Trainer`` (gradient accumulation 2, clipping at 1.0, a linear
    schedule) on the offloaded model with ramflow's AdamW, against a plain Trainer with
    PyTorch's AdamW on a deepcopy: the logged losses and gradient norms and every weight."""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4 * STEPS):
        ids = torch.randint(0, 256, (16,), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})

    def run(m, optimizer, out: str) -> Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path / out), use_cpu=device.type == "cpu",
            bf16=device.type == "cuda", report_to=[], disable_tqdm=True,
            per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
            learning_rate=LR, lr_scheduler_type="linear", max_steps=STEPS, logging_steps=1,
            save_strategy="no", seed=0,
        )  # fmt: skip
        trainer = Trainer(model=m, args=args, train_dataset=data, optimizers=(optimizer, None))
        trainer.train()
        return trainer

    model = ramflow.offload(copy.deepcopy(initial), device=device)
    ref = copy.deepcopy(initial)
    ours = run(model, ramflow.optim.AdamW(model.parameters(), lr=LR), "ours")
    fused = device.type == "cpu" or None
    theirs = run(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=fused), "theirs")

    for key in ("loss", "grad_norm"):
        logged = [
            torch.tensor([h[key] for h in t.state.log_history if key in h]) for t in (ours, theirs)
        ]
        assert len(logged[0]) == STEPS
        assert_close(*logged, device=device, atol=LOSS_ATOL_CUDA)
    assert_same_weights(model, ref, device=device)


# ---------------------------------------------------------------------------- PEFT LoRA

# the attention's projections of each family (DeepSeek-V3's multi-head latent attention
# names its own), and the dense MLPs' linears where a family has them (DeepSeek-V3's dense
# first layer and shared experts, Qwen2-MoE's shared expert)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_MODULES = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                    "gate_proj", "up_proj", "down_proj"],
    "qwen2_moe": ATTENTION + ["gate_proj", "up_proj", "down_proj"],
}  # fmt: skip
# transformers 5 stacks each layer's routed experts in two 3-D parameters, which PEFT
# (>= 0.17) adapts through ``target_parameters`` (its ``ParamWrapper``), not modules
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def lora_config(family: str):
    import peft

    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=LORA_MODULES.get(family, ATTENTION),
        target_parameters=EXPERT_PARAMETERS,
    )  # fmt: skip


@pytest.mark.parametrize("when", ["before", "after"])
def test_peft_lora_on_attention_and_experts(family, initial, device, when):
    """PEFT LoRA on every attention projection and every layer's routed experts, applied
    before or after ``ramflow.offload``: the frozen base streams, the adapters train on
    the device (given before, with ``trainable_on_device=True``: at these tiny sizes they
    are more than the automatic rule's share, which would stream them), and losses, aux losses and every weight match resident PEFT."""
    peft = pytest.importorskip("peft")

    base = copy.deepcopy(initial)
    torch.manual_seed(1)
    if when == "before":
        model = peft.get_peft_model(base, lora_config(family))
        ref = copy.deepcopy(model).to(device)
        ramflow.offload(model, device=device, trainable_on_device=True)
    else:
        ref_base = copy.deepcopy(base).to(device)
        ramflow.offload(base, device=device)  # adapters added later go to the device
        model = peft.get_peft_model(base, lora_config(family))
        ref = peft.get_peft_model(ref_base, lora_config(family))
        peft.set_peft_model_state_dict(ref, peft.get_peft_model_state_dict(model))
    # both stacked expert weights of every sparse layer (ParamWrappers nest), and attention
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
    sparse = [n for n, _ in initial.named_modules() if n.endswith("mlp.experts")]
    assert len(wrapped) == len(EXPERT_PARAMETERS) * len(sparse), wrapped
    assert any("attn" in n and "lora_A" in n for n, _ in model.named_parameters())

    losses, aux = train_both(model, ref, device)
    assert_close(losses[0], losses[1], device=device, atol=LOSS_ATOL_CUDA)
    assert_aux_loss(family, aux, device)
    engine = ramflow.api._engine(model)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert {id(p) for p in engine.adapters.params} == {id(p) for p in adapters}
    assert all(u.num_trainable == 0 for u in engine.units)  # the base stays frozen
    assert_same_weights(model, ref, device=device)
    lora_b = [p for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert lora_b and all(p.detach().abs().sum() > 0 for p in lora_b)  # they trained
