"""The host store on its own (``ramflow._host_store``): layout, wire copies, staging."""

from __future__ import annotations

import torch
from torch import nn

from ramflow._host_store import HostStore
from ramflow._streams import CopyStreams
from ramflow._units import _ALIGN, UnitSpec, _Unit
from ramflow._window import DeviceWindow
from ramflow._worker import HostWorker

CPU = torch.device("cpu")


def build(wire_dtype: torch.dtype):
    """One unit: a trainable Linear(5, 3) and a frozen Linear(3, 7) (owned trainable first)."""
    torch.manual_seed(0)
    trained, frozen = nn.Linear(5, 3), nn.Linear(3, 7)
    frozen.requires_grad_(False)
    owned = [trained.weight, trained.bias, frozen.weight, frozen.bias]
    before = [p.detach().clone() for p in owned]
    (u,) = [_Unit(0, UnitSpec("u", [trained, frozen], owned=owned))]
    window = DeviceWindow(
        device=CPU, wire_dtype=wire_dtype, streams=CopyStreams(CPU), worker=HostWorker(CPU)
    )
    store = HostStore(device=CPU, wire_dtype=wire_dtype, window=window)
    store.build([u])
    return store, u, owned, before


def test_parameters_become_aligned_views_of_the_master_keeping_values():
    _, u, owned, before = build(torch.float32)
    A = _ALIGN  # every parameter here is smaller than one alignment step
    assert u.offsets == [0, A, 2 * A, 3 * A] and u.trainable_numel == 2 * A and u.numel == 4 * A
    assert u.master.dtype == torch.float32 and u.master.shape == (4 * A,)
    for p, off, b in zip(owned, u.offsets, before):
        assert p.data_ptr() == u.master[off:].data_ptr()
        assert off % _ALIGN == 0 and torch.equal(p, b)
    assert u.wire is u.master  # fp32 on the wire: one buffer
    assert torch.count_nonzero(u.master[15:64]) == 0  # padding stays defined


def test_a_bf16_wire_is_a_rounded_copy_refreshed_from_the_master():
    store, u, owned, _ = build(torch.bfloat16)
    assert u.wire is not u.master and u.wire.dtype == torch.bfloat16
    assert torch.equal(u.wire, u.master.to(torch.bfloat16))
    assert store.wire_prefix(u).shape == (u.trainable_numel,)
    with torch.no_grad():
        owned[0].add_(0.5)  # a step writes the master
    u.wire_ready.clear()
    store.refresh_wire(u)
    assert u.wire_ready.is_set()  # the window was told
    assert torch.equal(u.wire, u.master.to(torch.bfloat16))


def test_staging_is_made_once_for_the_trainable_prefix():
    store, u, _, _ = build(torch.bfloat16)
    assert u.staging is None
    staging = store.staging(u)
    assert staging.shape == (u.trainable_numel,) and staging.dtype == torch.bfloat16
    assert store.staging(u) is staging
