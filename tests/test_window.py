"""The device window on its own (``ramflow.engine.window``): budget, eviction order and pins."""

from __future__ import annotations

import torch
from torch import nn

from ramflow.engine.host_store import HostStore
from ramflow.engine.window import DeviceWindow
from ramflow.engine.worker import HostWorker
from ramflow.transfer.streams import CopyStreams
from ramflow.units.unit import ALIGN, Unit, UnitSpec

CPU = torch.device("cpu")


UNIT_BYTES = 2 * ALIGN * 4  # one Linear(8, 8) unit in fp32


def make_window(n: int, *, capacity_units: int):
    """``n`` units of one Linear(8, 8) each (weight 64 and bias 8 elements, each padded to
    ``ALIGN``: ``UNIT_BYTES`` of fp32),
    host store built, device side built, a window of ``capacity_units`` units."""
    layers = [nn.Linear(8, 8) for _ in range(n)]
    specs = [
        UnitSpec(f"l{i}", [m], slots=[(m, "weight"), (m, "bias")], owned=[m.weight, m.bias])
        for i, m in enumerate(layers)
    ]
    units = [Unit(i, s) for i, s in enumerate(specs)]
    window = DeviceWindow(
        device=CPU, wire_dtype=torch.float32, streams=CopyStreams(CPU), worker=HostWorker(CPU)
    )
    HostStore(device=CPU, wire_dtype=torch.float32, window=window).build(units)
    window.build(units, specs, {id(p): u for u in units for p in u.owned})
    window.set_capacity(capacity_units * units[0].nbytes)
    return window, units, layers


def test_loads_copy_the_wire_and_count_against_the_budget():
    window, units, layers = make_window(3, capacity_units=2)
    assert units[0].numel == 2 * ALIGN and units[0].nbytes == UNIT_BYTES
    window.acquire([units[0]])
    assert units[0].allocated and window.used_bytes == UNIT_BYTES
    assert torch.equal(units[0].device_params[0], layers[0].weight)
    window.release([units[0]])
    assert units[0].allocated and window.used_bytes == UNIT_BYTES  # cached until room is needed


def test_least_recently_used_unpinned_unit_goes_first():
    window, units, _ = make_window(3, capacity_units=2)
    a, b, c = units
    for u in (a, b):
        window.acquire([u])
        window.release([u])
    window.acquire([a])  # a is used again: b is now the least recently used
    window.release([a])
    window.acquire([c])
    assert not b.allocated and a.allocated and c.allocated
    assert b.device_version == -1 and window.used_bytes == 2 * UNIT_BYTES


def test_pinned_units_are_never_evicted_a_forward_may_overflow():
    window, units, _ = make_window(3, capacity_units=2)
    a, b, c = units
    window.acquire([a, b])  # both pinned
    window.acquire([c])  # must: overflows rather than fail
    assert all(u.allocated for u in units) and window.used_bytes == 3 * UNIT_BYTES
    window.release([a, b, c])
    window.prefetch([a])  # already there: no change
    assert window.used_bytes == 3 * UNIT_BYTES


def test_prefetch_stops_where_the_window_is_full():
    window, units, _ = make_window(3, capacity_units=2)
    a, b, c = units
    window.acquire([a])  # pinned: a prefetch may not evict it
    window.prefetch([b, c])
    assert b.allocated and not c.allocated
    window.release([a])


def test_a_stale_copy_is_loaded_again_after_the_host_write():
    window, units, layers = make_window(1, capacity_units=1)
    (u,) = units
    window.acquire([u])
    window.release([u])
    window.begin_host_write([u])
    assert not u.wire_ready.is_set() and u.device_version == u.host_version - 1
    with torch.no_grad():
        layers[0].weight.add_(1.0)  # the step writes the master (= the fp32 wire)
    window.wire_refreshed(u, sent=False)  # not resident, nobody waiting: no copy yet
    assert u.device_version == u.host_version - 1
    window.acquire([u])
    assert u.device_version == u.host_version
    assert torch.equal(u.device_params[0], layers[0].weight)
    window.release([u])


def test_free_all_returns_every_byte():
    window, units, _ = make_window(3, capacity_units=2)
    units[2].resident = True
    window.load_resident(units[2])
    window.acquire([units[0]])
    assert window.used_bytes == UNIT_BYTES  # resident units are outside the window's budget
    window.free_all(units)
    assert window.used_bytes == 0 and not any(u.allocated for u in units)


def test_a_prefetch_waiting_for_a_step_may_be_evicted_and_loads_again():
    """A unit prefetched while its optimizer step still runs (its wire copy not current)
    waits for the worker's ``wire_refreshed`` to copy it. If the window evicts it meanwhile
    (it is not pinned), that copy must not go into the freed storage: CI once saw the
    worker raise writing into a storage of size 0 (on a GPU it would corrupt memory). The
    next use loads the new weights."""
    window, units, layers = make_window(3, capacity_units=2)
    a, b, c = units
    window.begin_host_write([a])  # a's step runs on the worker
    window.prefetch([a])  # allocated; its load waits for the step
    assert a.allocated and a.load_requested
    window.acquire([b])
    window.acquire([c])  # the window is full: a, unpinned, is evicted
    assert not a.allocated and not a.load_requested
    with torch.no_grad():
        layers[0].weight.add_(1.0)  # the step writes the host copy
    if a.wire is not a.master:
        a.wire.copy_(a.master)
    window.wire_refreshed(a, sent=False)  # the worker: no copy into freed storage
    assert not a.allocated
    window.release([b, c])
    window.acquire([a])
    assert torch.equal(a.device_params[0], layers[0].weight)
    window.release([a])


def test_a_write_to_one_device_parameter_leaves_the_others_version_alone():
    """Each device parameter has its own version counter on the unit's shared storage, as
    the resident model's separate parameters do: an in-place write to one (PEFT's
    ``ParamWrapper`` ``set_``s a 3-D expert weight in every forward) must not invalidate
    another that autograd saved for backward. See [Note: one version counter per device
    parameter] in ``ramflow.engine.window``."""
    window, units, _ = make_window(1, capacity_units=1)
    window.acquire(units)
    weight, bias = units[0].device_params
    assert weight.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    x = torch.randn(2, 8, requires_grad=True)
    y = x @ weight.t()  # saves weight for x's gradient
    with torch.no_grad():
        bias.add_(1.0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, weight.detach().sum(0).expand(2, 8))
