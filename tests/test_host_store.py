"""The host store on its own (``ramflow.engine.host_store``): layout, wire copies, staging."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ramflow.engine.host_store import HostStore
from ramflow.engine.window import DeviceWindow
from ramflow.engine.worker import HostWorker
from ramflow.transfer.streams import CopyStreams
from ramflow.units.unit import ALIGN, Unit, UnitSpec

CPU = torch.device("cpu")


def build(wire_dtype: torch.dtype):
    """One unit: a trainable Linear(5, 3) and a frozen Linear(3, 7) (owned trainable first)."""
    torch.manual_seed(0)
    trained, frozen = nn.Linear(5, 3), nn.Linear(3, 7)
    frozen.requires_grad_(False)
    owned = [trained.weight, trained.bias, frozen.weight, frozen.bias]
    before = [p.detach().clone() for p in owned]
    (u,) = [Unit(0, UnitSpec("u", [trained, frozen], owned=owned))]
    window = DeviceWindow(
        device=CPU, wire_dtype=wire_dtype, streams=CopyStreams(CPU), worker=HostWorker(CPU)
    )
    store = HostStore(device=CPU, wire_dtype=wire_dtype, window=window)
    store.build([u])
    return store, u, owned, before


def test_parameters_become_aligned_views_of_the_master_keeping_values():
    _, u, owned, before = build(torch.float32)
    A = ALIGN  # every parameter here is smaller than one alignment step
    assert u.offsets == [0, A, 2 * A, 3 * A] and u.trainable_numel == 2 * A and u.numel == 4 * A
    assert u.master.dtype == torch.float32 and u.master.shape == (4 * A,)
    for p, off, b in zip(owned, u.offsets, before):
        assert p.data_ptr() == u.master[off:].data_ptr()
        assert off % ALIGN == 0 and torch.equal(p, b)
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


@pytest.mark.gpu
def test_pinned_buffers_take_their_own_pages_not_a_power_of_two():
    """The wire copies are page-locked over their own size, rounded to pages only: PyTorch's
    caching host allocator would round each 3.1 MiB wire copy up to 4 MiB (see [Note:
    pinned memory of its own size] in ramflow.transfer.streams). They are unlocked by ``undo``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import mmap

    import ramflow
    from ramflow.transfer.streams import registered_bytes

    model = nn.Sequential(*[nn.Linear(1280, 1280, bias=False) for _ in range(6)])
    before, torch_before = registered_bytes(), torch.cuda.host_memory_stats()
    ramflow.offload(model, device="cuda")  # fp32 masters (pageable), bf16 wire copies (pinned)
    engine = ramflow.api._engine(model)
    page = mmap.PAGESIZE
    expected = sum(-(-u.wire.numel() * 2 // page) * page for u in engine.units)
    assert all(u.wire.is_pinned() and not u.master.is_pinned() for u in engine.units)
    assert registered_bytes() - before == expected
    torch_after = torch.cuda.host_memory_stats()
    grown = torch_after.get("allocated_bytes.current", 0) - torch_before.get(
        "allocated_bytes.current", 0
    )
    assert grown < 1280 * 1280 * 2, grown  # no wire copy came from PyTorch's allocator
    x = torch.randn(4, 1280, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).sum().backward()  # the gradient staging is pinned the same way
    ramflow.synchronize(model)
    assert registered_bytes() - before >= expected
    ramflow.undo(model)
    assert registered_bytes() == before


def test_host_ram_override_decides_whether_the_store_fits(monkeypatch):
    """``$RAMFLOW_HOST_RAM`` replaces MemAvailable in the RAM check (VMs whose RAM grows as
    it is used); too little is refused with the variable named, a bad value names it too."""
    import ramflow

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    monkeypatch.setenv("RAMFLOW_HOST_RAM", "1KiB")
    with pytest.raises(MemoryError, match="only 1.00 KiB is available.*RAMFLOW_HOST_RAM"):
        ramflow.offload(model, device="cpu")
    # nothing was lost: the refused model still holds its own parameters
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
    monkeypatch.setenv("RAMFLOW_HOST_RAM", "twelve")
    with pytest.raises(ValueError, match="RAMFLOW_HOST_RAM: cannot read 'twelve'"):
        ramflow.offload(model, device="cpu")
    monkeypatch.setenv("RAMFLOW_HOST_RAM", "1TiB")
    ramflow.offload(model, device="cpu")(torch.randn(2, 64)).sum().backward()
