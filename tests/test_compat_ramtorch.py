"""``ramflow.compat.ramtorch``: RamTorch code runs once its import lines name this module.

RamTorch's documented API (its README; signatures from its source) is checked name by
name, and a script written the RamTorch way (``from ramtorch import ...``) runs after
nothing but its import lines are rewritten. The multi-process ZeRO loop is in
``examples/ramtorch_zero.py``, run by tests/test_examples.py.
"""

from __future__ import annotations

import difflib
import inspect
import re

import pytest
import torch
from torch import nn

import ramflow
from ramflow.compat import ramtorch
from ramflow.compat.ramtorch import AdamW, Linear
from ramflow.compat.ramtorch.helpers import replace_linear_with_ramtorch
from ramflow.compat.ramtorch.zero1 import broadcast_zero_params, create_zero_param_groups
from ramflow.compat.ramtorch.zero2 import setup_grad_sharding_hooks

# A script in RamTorch's style, as a RamTorch user would have it (our own text): one layer,
# a model built from Linear, an existing model converted, RamTorch's AdamW with all of its
# arguments, and the ZeRO-1 split. Only the device line is not RamTorch's: its examples
# say "cuda", which a CPU-only machine cannot run at all.
RAMTORCH_SCRIPT = """
import torch
import torch.nn as nn
from ramtorch import Linear, AdamW
from ramtorch.helpers import replace_linear_with_ramtorch
from ramtorch.zero1 import create_zero_param_groups, broadcast_zero_params
import ramtorch.zero2

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

layer = Linear(128, 64, device=device)
single_output = layer(torch.randn(4, 128, device=device))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            Linear(32, 64), nn.ReLU(), Linear(64, 64), nn.ReLU(), Linear(64, 4)
        )

    def forward(self, x):
        return self.layers(x)

model = Net().to(device)
optimizer = AdamW(
    model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    centralization=0, chunk_size=64, dtype=torch.bfloat16, storage_device="cpu",
)
x = torch.randn(16, 32, device=device)
y = torch.randn(16, 4, device=device)
losses = []
for _ in range(10):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())

existing = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
reference = existing(x.cpu()).detach()
existing = replace_linear_with_ramtorch(existing, 0)  # RamTorch passes the rank here
existing = existing.to(device)
converted_output = existing(x)

groups = create_zero_param_groups(
    [{"params": list(existing.parameters()), "lr": 1e-3, "weight_decay": 0.01}], 2
)
zero2_hooks = ramtorch.zero2.setup_grad_sharding_hooks  # needs a process group to call
"""


def port(text: str) -> str:
    """RamTorch code -> ramflow code, by rewriting import lines only: ``from ramtorch.x
    import y`` -> ``from ramflow.compat.ramtorch.x import y``; ``import ramtorch`` and
    ``import ramtorch.x`` -> ``from ramflow.compat import ramtorch`` (which has every
    submodule, so ``ramtorch.x.y`` still resolves)."""
    lines = []
    for line in text.splitlines(keepends=True):
        indent = line[: len(line) - len(line.lstrip())]
        if re.match(r"\s*from\s+ramtorch\b", line):
            line = re.sub(r"\bramtorch\b", "ramflow.compat.ramtorch", line, count=1)
        elif re.match(r"\s*import\s+ramtorch(\.\w+)*\s*$", line):
            line = f"{indent}from ramflow.compat import ramtorch\n"
        lines.append(line)
    return "".join(lines)


def test_ramtorch_script_runs_with_only_its_imports_changed():
    ported = port(RAMTORCH_SCRIPT)
    changed = [
        line[1:]
        for line in difflib.unified_diff(RAMTORCH_SCRIPT.splitlines(), ported.splitlines(), n=0)
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert len(changed) == 4 and all("import" in line for line in changed), changed
    namespace: dict = {}
    exec(compile(ported, "<ramtorch script>", "exec"), namespace)
    assert namespace["zero2_hooks"] is setup_grad_sharding_hooks
    assert namespace["single_output"].shape == (4, 64)
    losses = namespace["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert isinstance(namespace["existing"][0], Linear)
    assert isinstance(namespace["existing"][2], nn.LayerNorm)  # only nn.Linear is replaced
    torch.testing.assert_close(namespace["converted_output"].cpu(), namespace["reference"])
    groups = namespace["groups"]
    assert sorted(groups) == [0, 1]
    owned = [p for r in (0, 1) for p in groups[r][0]["params"]]
    assert len(owned) == len(list(namespace["existing"].parameters()))
    assert {id(p) for p in owned} == {id(p) for p in namespace["existing"].parameters()}
    assert all(g[0]["lr"] == 1e-3 and g[0]["weight_decay"] == 0.01 for g in groups.values())


def test_names_of_ramtorch():
    """Everything RamTorch's README imports exists under the same dotted names."""
    assert issubclass(ramtorch.Linear, ramflow.Linear)
    assert issubclass(ramtorch.AdamW, ramflow.optim.AdamW)
    assert ramtorch.helpers.replace_linear_with_ramtorch is replace_linear_with_ramtorch
    assert ramtorch.zero1.create_zero_param_groups is create_zero_param_groups
    assert ramtorch.zero1.broadcast_zero_params is broadcast_zero_params
    assert ramtorch.zero2.setup_grad_sharding_hooks is setup_grad_sharding_hooks
    assert issubclass(Linear, nn.Linear)


@pytest.mark.parametrize(
    "fn,args,kwargs,bound",
    [
        # RamTorch's own signatures, with its parameter names (ramtorch/zero1.py, zero2.py):
        # each call binds its values to the parameters RamTorch's code means them for
        (create_zero_param_groups, ("g", 2), {}, {"param_groups": "g", "world_size": 2}),
        (
            create_zero_param_groups,
            (),
            {"param_groups": [], "world_size": 2},
            {"param_groups": [], "world_size": 2},
        ),
        (
            broadcast_zero_params,
            ("groups",),
            {"async_op": False},
            {"rank_param_groups": "groups", "async_op": False},
        ),
        (
            setup_grad_sharding_hooks,
            ("groups", 1),
            {},
            {"rank_param_groups": "groups", "current_rank": 1},
        ),
        (
            setup_grad_sharding_hooks,
            (),
            {"rank_param_groups": {}, "current_rank": 0},
            {"rank_param_groups": {}, "current_rank": 0},
        ),
        (replace_linear_with_ramtorch, ("model", 1), {}, {"module": "model", "device": 1}),
        (
            replace_linear_with_ramtorch,
            ("model",),
            {"device": "cuda"},
            {"module": "model", "device": "cuda"},
        ),
        (replace_linear_with_ramtorch, ("model",), {"rank": 1}, {"module": "model", "rank": 1}),
    ],
)
def test_signatures_accept_ramtorch_arguments(fn, args, kwargs, bound):
    assert inspect.signature(fn).bind(*args, **kwargs).arguments == bound


def test_signature_defaults_are_ramtorch_s():
    """What a RamTorch call that leaves them out gets: async broadcasts, CUDA layers."""
    assert inspect.signature(broadcast_zero_params).parameters["async_op"].default is True
    assert inspect.signature(replace_linear_with_ramtorch).parameters["device"].default == "cuda"


def test_linear_with_cuda_device_builds_without_cuda():
    """RamTorch's first example, ``Linear(1000, 1000, device="cuda")``, builds anywhere:
    nothing is allocated on a device before the layer attaches."""
    layer = Linear(1000, 1000, device="cuda")
    assert layer.weight.device.type == "cpu" and layer.weight.shape == (1000, 1000)
    want = "cuda" if torch.cuda.is_available() else "cpu"  # RamTorch code runs in CI
    assert f"device={want}" in repr(layer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without CUDA")
def test_linear_with_cuda_device_runs_without_cuda():
    layer = Linear(16, 16, device="cuda")
    assert layer(torch.randn(2, 16)).shape == (2, 16)


def test_replace_linear_with_ramtorch_keeps_outputs_and_the_dtype_on_the_wire():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    want = model(x)
    replace_linear_with_ramtorch(model, "cuda")  # the CPU where there is no CUDA
    assert all(isinstance(model[i], Linear) for i in (0, 2))
    assert model[0].weight.dtype == torch.float32  # fp32 masters; bf16 on the wire
    assert "wire_dtype=bfloat16" in repr(model[0])
    # on a GPU the output is on it, and its bf16 matmul may round differently: within
    # assert_close's bf16 tolerance (1.6e-2 relative, a few bf16 ulps)
    torch.testing.assert_close(model(x).cpu(), want)


def test_adamw_refuses_gradient_centralization():
    with pytest.raises(NotImplementedError, match="centralization"):
        AdamW(Linear(4, 4).parameters(), centralization=0.5)


def test_replace_linear_with_ramtorch_rank_keyword_of_the_readme():
    """``replace_linear_with_ramtorch(model, rank=0)`` converts in place onto CUDA device 0
    (the CPU without CUDA), keeping the outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    want = model(x)
    assert replace_linear_with_ramtorch(model, rank=0) is model
    assert isinstance(model[0], Linear) and isinstance(model[2], Linear)
    expected = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    assert model[0].device == expected and model[2].device == expected
    torch.testing.assert_close(model(x.to(expected)).cpu(), want)


def test_linear_positional_order_and_skip_init_of_ramtorch():
    layer = Linear(4, 4, True, torch.bfloat16, "cpu", skip_init=True)
    assert "wire_dtype=bfloat16" in repr(layer)
    assert layer.device == torch.device("cpu")
    assert not layer.weight.any()  # skip_init: nothing drawn


def test_replace_linear_with_ramtorch_takes_skip_as_its_error_says():
    """A head tied to the embeddings is refused with "leave it resident with
    skip=('lm_head',)": the compat helper now takes that argument."""
    from ramflow.compat.ramtorch.helpers import replace_linear_with_ramtorch

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.body = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    with pytest.raises(ValueError, match="skip=\\('lm_head',\\)"):
        replace_linear_with_ramtorch(Tied(), "cpu")
    model = replace_linear_with_ramtorch(Tied(), "cpu", skip=("lm_head",))
    assert isinstance(model.body, ramflow.Linear) and type(model.lm_head) is torch.nn.Linear
