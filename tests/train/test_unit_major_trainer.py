"""``ramflow.train.UnitMajorTrainer``: Hugging Face's ``Trainer`` with each optimizer step's
micro-batches run unit-major (``ramflow.accumulate``), against the plain ``Trainer`` on a
deepcopy of the same model and data (parity tests, see STYLE.md).

On the CPU in fp32 the runs are bit for bit equal: every parameter's gradient sums the same
M micro-batch gradients in the same order (micro-batch 0, 1, ...), ramflow's CPU AdamW is
PyTorch's fused CPU AdamW, the clip reads the same fp32 host gradients, and the
unclipped norm is summed from the same per-parameter norms (see [Note: the norm from the
device gradients] in ``ramflow.engine.grad_norms``). So every tolerance below is zero.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ramflow
from ramflow.units.registry import engine_of_model

pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install accelerate)")
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from models import tiny_llama  # noqa: E402
from moe_models import moe_config  # noqa: E402
from ramflow.train import UnitMajorTrainer  # noqa: E402

LR = 1e-3
MAX_STEPS = 4
# the smallest gpu_memory the 8-layer tiny Llama plans with (4 window slots of its largest
# unit, as in tests/test_accumulate.py): most units are evicted between forward and
# backward, so a load per micro-batch would show
SMALL_WINDOW = 897088


def lm_data(n: int, *, vocab: int = 128, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    """``n`` examples of random token ids, every third with its first 4 labels masked
    (-100), so that ``num_items_in_batch`` differs from the token count."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        if i % 3 == 0:
            labels[:4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def args_for(out_dir, *, accum: int, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accum,
        max_grad_norm=1.0,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_steps=MAX_STEPS,
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def logged(trainer: Trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def assert_same_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    final = weights(ours)
    for name, value in weights(theirs).items():
        assert torch.equal(final[name], value), name


class LoadCounter(TrainerCallback):
    """Per optimizer step, how many times each unit loaded into the device window."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.engine = engine_of_model(model)
        self.per_step: list[dict[str, int]] = []
        self._before: dict[str, int] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = dict(self.engine.window.num_loads)

    def on_step_end(self, args, state, control, **kwargs):
        now = self.engine.window.num_loads
        self.per_step.append({k: v - self._before.get(k, 0) for k, v in now.items()})


def run_pair(model, tmp_path, *, accum: int, data, gpu_memory=None, weight_decay=0.0, **overrides):
    """The plain Trainer on a resident deepcopy of ``model``, and ``UnitMajorTrainer`` on
    ``model`` offloaded (fp32 wire on the CPU); returns both trainers, the deepcopy and the
    load counter of ours."""
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32, gpu_memory=gpu_memory)
    counter = LoadCounter(model)
    args = dict(accum=accum, weight_decay=weight_decay, **overrides)
    ours = UnitMajorTrainer(
        model=model,
        args=args_for(tmp_path / "ours", **args),
        train_dataset=data,
        optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
        callbacks=[counter],
    )
    ours.train()
    theirs = Trainer(
        model=ref,
        args=args_for(tmp_path / "theirs", **args),
        train_dataset=data,
        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR, "fused": True}),
    )
    theirs.train()
    return ours, theirs, ref, counter


@pytest.mark.parametrize("accum", [2, 3])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "noclip"])
def test_equals_plain_trainer_and_loads_layer_0_twice_per_step(tmp_path, accum, max_grad_norm):
    """Logged losses, grad_norm, learning rates and final weights equal the plain Trainer's
    bit for bit (with and without clipping, M = 2 and 3, weight decay on), and every unit
    loads at most twice per optimizer step, layer 0 exactly twice (the model's first
    layers are evicted before backward reaches them)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8)
    data = lm_data(2 * accum * MAX_STEPS)
    ours, theirs, ref, counter = run_pair(
        model,
        tmp_path,
        accum=accum,
        data=data,
        gpu_memory=SMALL_WINDOW,
        weight_decay=0.1,
        max_grad_norm=max_grad_norm,
    )
    assert ours.state.global_step == MAX_STEPS
    for key in ("loss", "grad_norm", "learning_rate"):
        assert len(logged(ours, key)) == MAX_STEPS, key
        assert logged(ours, key) == logged(theirs, key), key
    assert_same_weights(model, ref)
    assert len(counter.per_step) == MAX_STEPS
    for step, loads in enumerate(counter.per_step):
        assert loads["model.layers.0"] == 2, (step, loads)
        assert max(loads.values()) <= 2, (step, loads)


def test_the_plain_trainer_loads_a_unit_per_micro_batch(tmp_path):
    """The counter the test above reads does see the plain Trainer's loads on an offloaded
    model (the assertion there could fail)."""
    torch.manual_seed(0)
    model = ramflow.offload(
        tiny_llama(tie=False, layers=8),
        device="cpu",
        wire_dtype=torch.float32,
        gpu_memory=SMALL_WINDOW,
    )
    counter = LoadCounter(model)
    trainer = Trainer(
        model=model,
        args=args_for(tmp_path, accum=3, max_steps=1),
        train_dataset=lm_data(6),
        optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
        callbacks=[counter],
    )
    trainer.train()
    assert counter.per_step[0]["model.layers.0"] >= 4


def test_moe_equals_plain_trainer(tmp_path):
    """A tiny Qwen3-MoE (router auxiliary loss off; on in the next test), M = 3 with
    clipping: the same bits as the plain Trainer. Weight decay 0: an expert no token chose
    gets a zero gradient here and none in PyTorch, and AdamW leaves both alike."""
    cfg = moe_config("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    data = lm_data(2 * 3 * 2, vocab=256)
    ours, theirs, ref, counter = run_pair(model, tmp_path, accum=3, data=data, max_steps=2)
    assert logged(ours, "loss") == logged(theirs, "loss")
    assert logged(ours, "grad_norm") == logged(theirs, "grad_norm")
    assert_same_weights(model, ref)
    assert all(max(loads.values()) <= 2 for loads in counter.per_step), counter.per_step


def test_moe_router_auxiliary_loss_runs_unit_major(tmp_path):
    """With ``output_router_logits`` (the load-balancing loss) the step still runs
    unit-major (the router logits are cut out of their layers, see
    ``ramflow.engine.router_logits``): the same bits as the plain Trainer, aux loss
    included, no warning, and no unit loaded more than twice per step."""
    cfg = moe_config("qwen3_moe")
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.1
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    data = lm_data(2 * 2 * 2, vocab=256)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*UnitMajorTrainer.*")
        ours, theirs, ref, counter = run_pair(model, tmp_path, accum=2, data=data, max_steps=2)
    assert logged(ours, "loss") == logged(theirs, "loss")
    assert logged(ours, "grad_norm") == logged(theirs, "grad_norm")
    assert_same_weights(model, ref)
    assert all(max(loads.values()) <= 2 for loads in counter.per_step), counter.per_step


def test_falls_back_with_one_warning_where_it_cannot_run(tmp_path):
    """A model that is not offloaded, and an offloaded one under PyTorch's AdamW: each run
    warns once, naming why, and trains as the plain Trainer."""
    torch.manual_seed(0)
    data = lm_data(8)
    args = args_for(tmp_path, accum=2, max_steps=2)
    plain = tiny_llama(tie=False)
    with pytest.warns(UserWarning, match="not offloaded by ramflow.offload") as caught:
        UnitMajorTrainer(model=plain, args=args, train_dataset=data).train()
    assert sum("UnitMajorTrainer" in str(w.message) for w in caught) == 1
    model = ramflow.offload(tiny_llama(tie=False), device="cpu")
    with pytest.warns(UserWarning, match="not a ramflow.optim one"):
        UnitMajorTrainer(
            model=model,
            args=args,
            train_dataset=data,
            optimizers=(torch.optim.AdamW(model.parameters(), lr=LR), None),
        ).train()


def test_eval_and_resume_mid_run(tmp_path):
    """Evaluation every 2 steps gives the plain Trainer's eval loss; a fresh offloaded
    model resumed by UnitMajorTrainer from the step-2 checkpoint ends with the same
    weights and logs the same losses as the run that did not stop."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    initial = copy.deepcopy(model)
    data = lm_data(2 * 2 * MAX_STEPS)
    overrides = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    args = dict(accum=2, **overrides)
    ours = UnitMajorTrainer(
        model=model,
        args=args_for(tmp_path / "ours", **args),
        train_dataset=data,
        eval_dataset=data[:4],
        optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
    )
    ours.train()
    theirs = Trainer(
        model=ref,
        args=args_for(tmp_path / "theirs", **args),
        train_dataset=data,
        eval_dataset=data[:4],
        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR, "fused": True}),
    )
    theirs.train()
    assert len(logged(ours, "eval_loss")) == MAX_STEPS // 2
    assert logged(ours, "eval_loss") == logged(theirs, "eval_loss")
    assert logged(ours, "loss") == logged(theirs, "loss")
    assert_same_weights(model, ref)

    checkpoint = tmp_path / "ours" / "checkpoint-2"
    resumed_model = ramflow.offload(initial, device="cpu", wire_dtype=torch.float32)
    resumed = UnitMajorTrainer(
        model=resumed_model,
        args=args_for(tmp_path / "resumed", **args),
        train_dataset=data,
        eval_dataset=data[:4],
        optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == MAX_STEPS
    assert logged(resumed, "loss") == logged(ours, "loss")
    assert_same_weights(resumed_model, model)


def test_lean_keep_grads_false_never_makes_a_host_gradient_buffer(tmp_path):
    """Lean host formats with ``keep_grads=False`` and no clipping (``max_grad_norm=0``
    still logs the norm): every unit's gradient lands once per step and is stepped at
    once, the first step included, so no unit holds a host gradient buffer at any
    micro-batch's end; the losses and norms follow the plain Trainer's on an fp32 deepcopy
    (lean: bf16 wire and gradients summed in bf16 on the device, bf16 masters)."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.bfloat16, host_precision="lean")
    engine = engine_of_model(model)
    held: list[bool] = []
    eager: list[bool] = []

    class HostGrads(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            held.append(any(u.host_grad is not None for u in engine.units))

        def on_step_end(self, args, state, control, **kwargs):
            held.append(any(u.host_grad is not None for u in engine.units))
            eager.append(engine.stepper.policy.step_was_eager)

    args = dict(accum=3, max_grad_norm=0.0, bf16=True, max_steps=6)
    data = lm_data(36)
    trainer = UnitMajorTrainer(
        model=model,
        args=args_for(tmp_path / "ours", **args),
        train_dataset=data,
        optimizers=(ramflow.optim.AdamW(model.parameters(), lr=LR, keep_grads=False), None),
        callbacks=[HostGrads()],
    )
    trainer.train()
    theirs = Trainer(
        model=ref,
        args=args_for(tmp_path / "theirs", **args),
        train_dataset=data,
        optimizers=(torch.optim.AdamW(ref.parameters(), lr=LR), None),
    )
    theirs.train()
    assert len(held) == 6 * 3 and not any(held), held
    assert eager == [True] * 6, eager
    # a loss from bf16 wire weights: within bf16's rounding (8 bits of mantissa)
    for a, b in zip(logged(trainer, "loss"), logged(theirs, "loss"), strict=True):
        assert abs(a - b) / b < 2**-8, (logged(trainer, "loss"), logged(theirs, "loss"))
    # the norm of gradients from bf16 weights, summed in bf16 (3 roundings of 2**-8 each)
    for a, b in zip(logged(trainer, "grad_norm"), logged(theirs, "grad_norm"), strict=True):
        assert abs(a - b) / b < 4 * 2**-8, (
            logged(trainer, "grad_norm"),
            logged(theirs, "grad_norm"),
        )


@pytest.mark.gpu
def test_bf16_on_the_gpu_close_to_the_ramflow_trainer(tmp_path):
    """On CUDA the copies are asynchronous (a missing wait shows as a wrong number): bf16,
    UnitMajorTrainer against the ordinary Trainer on an offloaded deepcopy, M = 3 with
    clipping. The ordinary path sums the micro-batches in fp32 on the host, the unit-major
    one in bf16 on the device, so losses agree within bf16 rounding of the gradients'
    effect (1% over 4 steps) and each unit loads at most twice per step."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8)
    other = copy.deepcopy(model)
    for m in (model, other):
        # bf16 wire: half the bytes of the CPU tests' smallest window (as tests/test_accumulate.py)
        ramflow.offload(
            m, device="cuda", gpu_memory=SMALL_WINDOW // 2, activation_checkpointing=True
        )
    counter = LoadCounter(model)
    data = lm_data(2 * 3 * 2)
    runs = []
    for cls, m, callbacks in ((UnitMajorTrainer, model, [counter]), (Trainer, other, [])):
        trainer = cls(
            model=m,
            args=args_for(tmp_path / cls.__name__, accum=3, use_cpu=False, bf16=True),
            train_dataset=data,
            optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
            callbacks=callbacks,
        )
        trainer.train()
        runs.append(logged(trainer, "loss"))
    for a, b in zip(*runs):
        assert abs(a - b) / abs(b) < 1e-2, runs
    assert all(max(loads.values()) <= 2 for loads in counter.per_step), counter.per_step


def test_trl_sft_trainer_with_the_mixin_matches_plain_sft_trainer(tmp_path):
    """``UnitMajorTrainerMixin`` in front of TRL's ``SFTTrainer`` (its own loss, collator
    and ``training_step``): the same bits as a plain ``SFTTrainer`` on a deepcopy, M = 2
    with clipping, each unit loaded at most twice per step."""
    trl = pytest.importorskip("trl", reason="TRL is optional (pip install trl)")
    import datasets

    from ramflow.train import UnitMajorTrainerMixin
    from test_hf_trainer import word_tokenizer

    class UnitMajorSFT(UnitMajorTrainerMixin, trl.SFTTrainer):
        pass

    torch.manual_seed(0)
    model = tiny_llama(tie=False)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 128, (16,), generator=g).tolist() for _ in range(16)]
    data = datasets.Dataset.from_dict({"input_ids": ids})

    def config(out):
        return trl.SFTConfig(
            output_dir=str(tmp_path / out),
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_grad_norm=1.0,
            learning_rate=LR,
            max_steps=MAX_STEPS,
            logging_steps=1,
            save_strategy="no",
            seed=0,
        )

    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    counter = LoadCounter(model)
    ours = UnitMajorSFT(
        model=model,
        args=config("ours"),
        train_dataset=data,
        processing_class=word_tokenizer(),
        optimizers=(ramflow.optim.AdamW(model.parameters(), lr=LR), None),
        callbacks=[counter],
    )
    ours.train()
    theirs = trl.SFTTrainer(
        model=ref,
        args=config("theirs"),
        train_dataset=data,
        processing_class=word_tokenizer(),
        optimizers=(torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), None),
    )
    theirs.train()
    assert len(logged(ours, "loss")) == MAX_STEPS
    assert logged(ours, "loss") == logged(theirs, "loss")
    assert logged(ours, "grad_norm") == logged(theirs, "grad_norm")
    assert_same_weights(model, ref)
    assert all(max(loads.values()) <= 2 for loads in counter.per_step), counter.per_step


def test_peft_lora_matches_plain_trainer(tmp_path):
    """PEFT LoRA (adapters on the device, the frozen base streamed), M = 3 with clipping:
    the same bits as the plain Trainer on a deepcopy of the PEFT model, each unit loaded
    at most twice per step (the frozen layer 0 that the last backward left in the window
    serves the next forward: one load per step from the second on)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    # hidden 128: rank-4 LoRA is about 5% of the parameters, under the rule that keeps
    # adapters on the device (tests/test_lora.py)
    base = tiny_llama(tie=False, layers=8, hidden=128, intermediate=256)
    model = peft.get_peft_model(base, config)
    # lora_B starts at zero; a nonzero start makes every adapter's gradient nonzero
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    ref = copy.deepcopy(model)
    # the smallest budget this model plans with (4 window slots of a layer; the 8 layers
    # are twice that): layer 0 is evicted before backward reaches it
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32, gpu_memory=3416192)
    counter = LoadCounter(model)
    data = lm_data(2 * 3 * 2)
    runs = []
    for cls, m, opt_cls, callbacks in (
        (UnitMajorTrainer, model, ramflow.optim.AdamW, [counter]),
        (Trainer, ref, torch.optim.AdamW, []),
    ):
        params = [p for p in m.parameters() if p.requires_grad]
        fused = {"fused": True} if opt_cls is torch.optim.AdamW else {}
        trainer = cls(
            model=m,
            args=args_for(tmp_path / cls.__name__, accum=3, max_steps=2),
            train_dataset=data,
            optimizers=(opt_cls(params, lr=LR, **fused), None),
            callbacks=callbacks,
        )
        trainer.train()
        runs.append(trainer)
    assert logged(runs[0], "loss") == logged(runs[1], "loss")
    assert logged(runs[0], "grad_norm") == logged(runs[1], "grad_norm")
    assert_same_weights(model, ref)
    layer_0 = "base_model.model.model.layers.0"
    assert [loads[layer_0] for loads in counter.per_step] == [2, 1], counter.per_step
    assert all(max(loads.values()) <= 2 for loads in counter.per_step), counter.per_step


def test_trainer_activation_checkpointing_equals_plain_trainer(tmp_path):
    """``TrainingArguments(activation_checkpointing=True)`` (Hugging Face's own
    checkpointing in each decoder layer): each unit's recompute runs inside its backward
    phase; the same bits as the plain Trainer with the same switch, layer 0 loaded twice
    per step."""
    torch.manual_seed(0)
    model = tiny_llama(tie=False, layers=8)
    data = lm_data(2 * 2 * 2)
    ours, theirs, ref, counter = run_pair(
        model,
        tmp_path,
        accum=2,
        data=data,
        gpu_memory=SMALL_WINDOW,
        max_steps=2,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
    )
    assert model.is_activation_checkpointing  # the Trainer turned it on
    assert logged(ours, "loss") == logged(theirs, "loss")
    assert logged(ours, "grad_norm") == logged(theirs, "grad_norm")
    assert_same_weights(model, ref)
    assert [loads["model.layers.0"] for loads in counter.per_step] == [2, 2], counter.per_step


def test_a_training_step_that_skips_accelerator_backward_is_refused(tmp_path):
    """The mixin in front of a Trainer subclass whose ``training_step`` calls
    ``loss.backward()`` itself: the loss cannot be taken, and the error says what to do."""
    from ramflow.train import UnitMajorTrainerMixin

    class OwnBackward(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            inputs = self._prepare_inputs(inputs)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            loss.backward()
            return loss.detach()

    class Mixed(UnitMajorTrainerMixin, OwnBackward):
        pass

    model = ramflow.offload(tiny_llama(tie=False), device="cpu")
    trainer = Mixed(
        model=model,
        args=args_for(tmp_path, accum=2, max_steps=1),
        train_dataset=lm_data(4),
        optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": LR}),
    )
    with pytest.raises(RuntimeError, match=r"Call it in that training_step instead of loss"):
        trainer.train()
