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


def test_second_backward_after_eager_step_is_an_error():
    """Accumulating without ``no_step`` after the loop showed one backward per step."""
    model = ramflow.offload(MLPStack(), device="cpu")
    opt = ramflow.optim.AdamW(model.parameters())
    for _ in range(2):  # learn: one backward per step
        model(_x()).sum().backward()
        opt.step()
        opt.zero_grad()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="no_step"):
        model(_x()).sum().backward()


def test_clipping_after_eager_step_is_an_error():
    model = ramflow.offload(MLPStack(), device="cpu")
    opt = ramflow.optim.AdamW(model.parameters())
    for _ in range(2):
        model(_x()).sum().backward()
        opt.step()
        opt.zero_grad()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="clip"):
        ramflow.clip_grad_norm_(model.parameters(), 1.0)


def test_torch_clip_after_eager_step_is_detected():
    """torch.nn.utils.clip_grad_norm_ (routed to ramflow's) would change gradients already
    stepped: never silently skipped."""
    model = ramflow.offload(MLPStack(), device="cpu")
    opt = ramflow.optim.AdamW(model.parameters())
    for _ in range(2):
        model(_x()).sum().backward()
        opt.step()
        opt.zero_grad()
    model(_x()).sum().backward()
    with pytest.raises(RuntimeError, match="clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def test_gradients_changed_after_eager_step_are_detected():
    """A change by hand after a step ran during backward (no call into ramflow)."""
    model = ramflow.offload(MLPStack(), device="cpu")
    opt = ramflow.optim.AdamW(model.parameters())
    for _ in range(2):
        model(_x()).sum().backward()
        opt.step()
        opt.zero_grad()
    model(_x()).sum().backward()
    ramflow.synchronize(model)
    for p in model.parameters():
        p.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match="changed after backward"):
        opt.step()


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
