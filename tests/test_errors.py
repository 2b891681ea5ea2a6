"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ramflow
from models import MLPStack


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ramflow.offload(lambda x: x)


def test_no_parameters():
    with pytest.raises(ValueError, match="no parameters"):
        ramflow.offload(nn.Sequential(nn.ReLU(), nn.Tanh()))


def test_meta_parameters():
    with torch.device("meta"):
        model = MLPStack()
    with pytest.raises(ValueError, match="meta"):
        ramflow.offload(model)


def test_twice():
    model = ramflow.offload(MLPStack(), device="cpu")
    with pytest.raises(ValueError, match="already offloaded"):
        ramflow.offload(model)


def test_budget_too_small_names_the_smallest_that_works():
    model = MLPStack()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="too small") as info:
        ramflow.offload(model, device="cpu", gpu_memory="1KiB")
    smallest = int(str(info.value).split("gpu_memory >= ")[1].split(",")[0])
    # nothing lost: the model is untouched and usable
    assert not ramflow.is_offloaded(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(ValueError, match="too small"):
        ramflow.offload(model, device="cpu", gpu_memory=smallest - 1)
    ramflow.offload(model, device="cpu", gpu_memory=smallest)
    assert ramflow.get_plan(model).planned_bytes <= smallest


@pytest.mark.parametrize("bad", ["12 parsecs", "-3GiB", "lots"])
def test_budget_unreadable(bad):
    with pytest.raises(ValueError):
        ramflow.offload(MLPStack(), device="cpu", gpu_memory=bad)


def test_parse_bytes():
    assert ramflow.parse_bytes("12GiB") == 12 * 2**30
    assert ramflow.parse_bytes("1.5 GB") == 1_500_000_000
    assert ramflow.parse_bytes(4096) == 4096


def test_wire_dtype_must_be_float():
    with pytest.raises(TypeError, match="wire_dtype"):
        ramflow.offload(MLPStack(), device="cpu", wire_dtype=torch.int8)


def test_nested_units_rejected():
    model = MLPStack()
    with pytest.raises(ValueError, match="nest"):
        ramflow.offload(model, device="cpu", units=[model.blocks[0], model.blocks[0].up])


def test_undo_of_plain_model():
    with pytest.raises(ValueError, match="not offloaded"):
        ramflow.undo(MLPStack())


def _x():
    return torch.randn(4, 16)


def _stepping_during_backward(**adamw):
    """An offloaded MLPStack and its AdamW after two steps of one backward each: ramflow has
    learned the loop, and the next backward steps each unit as its gradients land."""
    model = ramflow.offload(MLPStack(), device="cpu")
    opt = ramflow.optim.AdamW(model.parameters(), **adamw)
    for _ in range(2):
        model(_x()).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_second_backward_after_eager_step_is_an_error():
    """Accumulating without ``no_step`` after the loop showed one backward per step."""
    model, opt = _stepping_during_backward()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="no_step"):
        model(_x()).sum().backward()


def test_clipping_after_eager_step_is_an_error():
    model, opt = _stepping_during_backward()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="clip"):
        ramflow.clip_grad_norm_(model.parameters(), 1.0)


def test_torch_clip_after_eager_step_is_detected():
    """torch.nn.utils.clip_grad_norm_ (routed to ramflow's) would change gradients already
    stepped: never silently skipped."""
    model, opt = _stepping_during_backward()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def test_gradients_changed_after_eager_step_are_detected():
    """A change by hand after a step ran during backward (no call into ramflow)."""
    model, opt = _stepping_during_backward()
    model(_x()).sum().backward()
    ramflow.synchronize(model)
    for p in model.parameters():
        p.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after backward"):
        opt.step()


def test_a_step_skipped_after_an_eager_backward_is_an_error():
    """A loop that skips opt.step() (a guard against non-finite gradients) after ramflow
    stepped during backward: the update is in the weights, and zero_grad says so at once
    (it used to show only at the next backward, blaming accumulation)."""
    model, opt = _stepping_during_backward()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="without an opt.step.*overlap=False"):
        opt.zero_grad()
    opt.zero_grad()  # goes on from these weights, learning the loop afresh
    model(_x()).sum().backward()
    opt.step()


def test_a_skipping_loop_without_overlap_is_exact():
    """What the error above points to: overlap=False never steps before step()."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), overlap=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    for step in range(5):
        x = _x()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).sum().backward()
            if step != 3:  # the loop's guard skips one step
                o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_settings_changed_between_backward_and_step_after_eager_steps():
    """The learning rate set after backward, once ramflow steps during backward: that step
    already used the old rate, so step() refuses instead of ignoring the new one."""
    model, opt = _stepping_during_backward(lr=1e-3)
    model(_x()).sum().backward()
    opt.param_groups[0]["lr"] = 5e-4
    with pytest.raises(RuntimeError, match="settings.*changed between backward and opt.step"):
        opt.step()


def test_settings_set_between_backward_and_step_from_the_first_step_are_exact():
    """A loop that sets the rate after backward from its first step on (a warm-up written
    just before step()): ramflow learns it and never steps during backward."""
    torch.manual_seed(0)
    model = MLPStack()
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    opt = ramflow.optim.AdamW(model.parameters(), lr=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1.0, fused=True)
    for step in range(5):
        x = _x()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).sum().backward()
            for group in o.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            o.step()
            o.zero_grad()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_step_with_gradients_set_by_hand():
    """Gradients assigned by the user (no backward) are stepped like torch.optim.AdamW."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    ramflow.offload(model, device="cpu")
    for m in (model, ref):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    opt = ramflow.optim.AdamW(model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    opt.step()
    ref_opt.step()
    ramflow.synchronize(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_exit_with_a_step_in_flight_is_clean():
    """A script that ends right after opt.step() (steps still on the worker) exits 0."""
    import subprocess
    import sys

    code = (
        "import torch, ramflow\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])\n"
        "ramflow.offload(m, device='cpu')\n"
        "opt = ramflow.optim.AdamW(m.parameters())\n"
        "m(torch.randn(4, 512)).sum().backward()\n"
        "opt.step()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


@pytest.mark.parametrize("how", ["new-parameter", "assign-load", "data"])
@pytest.mark.parametrize("precision", ["fp32", "lean"])
def test_a_parameter_replaced_after_offload_is_refused(how, precision):
    """The engine streams the parameters it offloaded: a slot given another Parameter was
    put back at the next forward, and a parameter whose data was replaced kept training
    its old values, both without a word."""
    torch.manual_seed(0)
    model = MLPStack()
    wire = torch.float32 if precision == "fp32" else torch.bfloat16
    ramflow.offload(model, device="cpu", wire_dtype=wire, host_precision=precision)
    x = torch.randn(4, 16)
    model(x)
    head = model.head
    new = torch.zeros_like(head.weight)
    if how == "new-parameter":
        head.weight = nn.Parameter(new)
    elif how == "assign-load":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    else:
        head.weight.data = new
    with pytest.raises(RuntimeError, match="replaced after ramflow.offload.*copy_"):
        model(x)


def test_values_copied_into_a_parameter_after_offload_are_used():
    """The way the error above points to: copy_ into the offloaded parameter."""
    torch.manual_seed(0)
    model = MLPStack()
    ramflow.offload(model, device="cpu", wire_dtype=torch.float32)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert torch.equal(model(x), torch.zeros(4, 8))


def test_double_backward_is_refused():
    """create_graph=True (a gradient penalty) crashed the process (SIGSEGV) once a unit's
    device weights were freed under the gradients' graph."""
    model = ramflow.offload(MLPStack(), device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    opt = ramflow.optim.AdamW(model.parameters())
    opt.zero_grad()  # a refused pass leaves nothing behind
    model(_x()).sum().backward()
    opt.step()


def test_second_backward_through_a_retained_graph_is_refused():
    """backward(retain_graph=True) and a second backward failed deep in autograd
    ("setStorage ... out of bounds for storage of size 0")."""
    model = ramflow.offload(MLPStack(), device="cpu")
    loss = model(_x()).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True.*forward again"):
        loss.backward()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    model = MLPStack()
    with pytest.raises(ValueError, match="no CUDA device.*leave device out"):
        ramflow.offload(model, device="cuda")
    assert not ramflow.is_offloaded(model)


def test_is_offloaded_sees_the_offloaded_model_inside_a_wrapper():
    """As get_plan, adopt and undo do (a PEFT model wraps the one that was offloaded)."""
    inner = ramflow.offload(MLPStack(), device="cpu")
    wrapper = nn.Sequential(inner, nn.ReLU())
    assert ramflow.is_offloaded(wrapper) and ramflow.get_plan(wrapper) is not None
    ramflow.undo(wrapper)
    assert not ramflow.is_offloaded(wrapper) and not ramflow.is_offloaded(inner)


def test_the_float64_cast_error_says_what_to_do():
    model = ramflow.offload(MLPStack(), device="cpu")
    with pytest.raises(ValueError, match="for float64, call ramflow.undo.*resident"):
        model.double()


def test_pickling_an_offloaded_model_says_what_to_do():
    """torch.save(model) raised "Can't pickle local object 'weak_method.<locals>.call'"."""
    import io
    import pickle

    model = ramflow.offload(MLPStack(), device="cpu")
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match="state_dict.*ramflow.undo"):
            save(model)
    torch.save(model.state_dict(), io.BytesIO())
    ramflow.undo(model)
    pickle.dumps(model)


def test_a_model_holding_another_offloaded_model_is_refused():
    inner = ramflow.offload(MLPStack(), device="cpu")
    with pytest.raises(ValueError, match=r"^some parameters already belong to another offloaded"):
        ramflow.offload(nn.Sequential(inner, nn.Linear(16, 16)), device="cpu")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(device="meta"), ValueError, r"^device meta is not supported; use a CUDA device or"),
        (dict(zero_stage=3), ValueError, r"^zero_stage must be 1, 2 or None, got 3$"),
        (dict(device_optimizer="on"), TypeError, r"^device_optimizer must be None, True or False"),
    ],
)
def test_settings_offload_cannot_take_are_refused_and_the_model_is_untouched(
    options, error, message
):
    model = MLPStack()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=message):
        ramflow.offload(model, **{"device": "cpu", **options})
    assert not ramflow.is_offloaded(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_units_that_are_not_the_models_modules_are_refused():
    model = MLPStack()
    for units, error, message in (
        (
            [model.blocks[0], model.blocks[0]],
            ValueError,
            r"^units: the same module is given twice$",
        ),
        (["blocks.0", "blocks.9"], ValueError, r"^units: the model has no submodule named 'blocks"),
        ([model.blocks[0], 3], TypeError, r"^units: expected modules or module names, got int$"),
        ([nn.Linear(2, 2)], ValueError, r"^units: Linear is not a submodule of the model$"),
    ):
        with pytest.raises(error, match=message):
            ramflow.offload(model, device="cpu", units=units)
        assert not ramflow.is_offloaded(model)


def test_integer_parameters_are_refused():
    model = MLPStack()
    model.blocks[0].register_parameter(
        "counts", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    )
    with pytest.raises(ValueError, match=r"^parameter 'counts' of .* is torch\.int64; ramflow"):
        ramflow.offload(model, device="cpu")


def test_functions_of_an_offloaded_model_refuse_other_objects():
    with pytest.raises(TypeError, match=r"^expected an nn\.Module, got int$"):
        ramflow.undo(3)
    with pytest.raises(TypeError, match=r"^expected an nn\.Module, got str$"):
        ramflow.synchronize("model")
    with pytest.raises(ValueError, match=r"^this model has no parameters managed by ramflow"):
        ramflow.refresh(MLPStack())
