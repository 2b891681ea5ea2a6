"""Bit-for-bit comparison of tensors, for the kernels' tests: floats compared as their
integer bit patterns, so NaN payloads, -0.0 and subnormals count."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (4, 2 or 1 bytes)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise AssertionError naming ``what``, how many elements differ and the first one."""
    if not torch.equal(bits(actual), bits(expected)):
        differ = (bits(actual) != bits(expected)).flatten().nonzero().flatten()
        i = differ[0].item()
        raise AssertionError(
            f"{what}: {differ.numel()} of {actual.numel()} elements differ, first at {i}: "
            f"{actual.flatten()[i].item()!r} != {expected.flatten()[i].item()!r}"
        )
