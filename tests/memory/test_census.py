"""The tensor census finds live tensors and names a model's; the diff finds a planted leak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ramflow.memory import census_diff, tensor_census


def test_diff_finds_a_planted_leak():
    leaked: list[torch.Tensor] = []
    before = tensor_census()
    for _ in range(7):
        leaked.append(torch.ones(123, 45, dtype=torch.float64))  # kept: the leak
        scratch = torch.ones(67, 89)  # freed at the next iteration
        del scratch
    grown = census_diff(before, tensor_census())
    leak = [g for g in grown if g.shape == (123, 45)]
    assert len(leak) == 1
    assert (leak[0].device, leak[0].dtype) == ("cpu", "torch.float64")
    assert leak[0].count == 7 and leak[0].bytes == 7 * 123 * 45 * 8
    assert not [g for g in grown if g.shape == (67, 89)]
    assert len(leaked) == 7


def test_diff_leaves_out_what_shrank():
    kept = [torch.zeros(31, 17) for _ in range(3)]
    before = tensor_census()
    del kept
    assert not [g for g in census_diff(before, tensor_census()) if g.shape == (31, 17)]


def test_names_model_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(13, 11), nn.BatchNorm1d(11))
    census = tensor_census(model)
    by_name = {g.name: g for g in census.groups}
    assert by_name["0.weight"].shape == (11, 13) and by_name["0.weight"].count == 1
    assert by_name["0.weight"].bytes == 11 * 13 * 4
    assert by_name["1.running_mean"].shape == (11,)
    assert census.total_bytes["cpu"] > 0
    assert "0.weight" in census.format(top=None)


def test_unnamed_parameter_and_no_pinned_on_cpu():
    p = nn.Parameter(torch.zeros(29, 3))
    census = tensor_census()
    assert any(g.name == "<parameter>" and g.shape == (29, 3) for g in census.groups)
    if not torch.cuda.is_available():
        assert census.pinned_bytes is None
    del p


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_are_counted_with_no_bytes():
    before = tensor_census()
    nested = [
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),  # strided: has no sizes
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
    ]
    grown = census_diff(before, tensor_census())
    # both nested tensors in one group of 0 bytes; the jagged one's values are a tensor
    # of their own, counted with their bytes
    on_cpu = {g.shape: (g.count, g.bytes) for g in grown if g.device == "cpu"}
    assert on_cpu[()] == (2, 0)
    assert on_cpu[(5,)] == (1, 5 * 4)
    assert len(nested) == 2
