"""Data parallelism on real processes: gloo on the CPU (CI), NCCL on GPUs (the GPU box)."""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

import dist_workers as W
import ramflow
from ramflow.distributed.zero import STORE_FILE, create_store_file

LR = 1e-2  # train_offload's and reference_run's AdamW


def reference_run(
    clip: float | None = None, norms: list[float] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole global batch: the single-process truth (``norms``
    receives each step's gradient norm when clipping)."""
    model = W.reference_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    losses = []
    for x, y in W.batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _check_ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)


def _nccl(world_size: int):
    """(world_size, "nccl"), run on the GPU box when it has that many GPUs."""
    enough = pytest.mark.skipif(
        torch.cuda.device_count() < world_size, reason=f"needs {world_size} CUDA devices"
    )
    return pytest.param(world_size, "nccl", marks=[pytest.mark.gpu, enough])


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize(
    "world_size,backend",
    [(2, "gloo"), (4, "gloo"), _nccl(2)],
)
def test_zero_offload_equals_single_process(tmp_path, zero_stage, world_size, backend):
    """ZeRO-1/2 over 2 and 4 ranks computes the loss curve and final weights of one
    process on the same global batch, but for the rounding of another summation order."""
    results = W.run(
        W.train_offload,
        world_size,
        {"out": str(tmp_path), "zero_stage": zero_stage, "backend": backend},
    )
    _check_ok(results)
    _assert_matches_reference(results, backend)


@pytest.mark.parametrize("host_precision", [None, "lean"])
@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("world_size,backend", [(2, "gloo"), _nccl(2)])
def test_refresh_by_broadcast_gives_the_same_bits(
    tmp_path, monkeypatch, zero_stage, world_size, backend, host_precision
):
    """With RAMFLOW_REFRESH_BY_BROADCAST=1 each resident unit reaches the ranks that do not
    own it by a broadcast from its owner's device copy (see [Note: refresh by broadcast]):
    the same losses and weights, bit for bit, as refreshes from the host, and every rank's
    device copies hold the wire copies' bytes at the end."""
    options = {
        "zero_stage": zero_stage,
        "backend": backend,
        "host_precision": host_precision,
        "gpu_memory": "1GiB",  # room to keep every unit resident
    }
    if host_precision == "lean":
        options["wire_dtype"] = torch.bfloat16
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("RAMFLOW_REFRESH_BY_BROADCAST", flag)
        results = W.run(W.train_offload, world_size, {**options, "out": str(tmp_path / flag)})
        _check_ok(results)
        assert all(r["device_current"] for r in results)
        runs[flag] = results
    # every unit of the model is resident and trainable: all are broadcast
    assert [r["broadcast_units"] for r in runs["0"]] == [0] * world_size
    assert len({r["broadcast_units"] for r in runs["1"]}) == 1 and runs["1"][0]["broadcast_units"]
    assert runs["1"][0]["losses"] == runs["0"][0]["losses"]
    for k, v in runs["0"][0]["state"].items():
        assert torch.equal(runs["1"][0]["state"][k], v), k


def _assert_matches_reference(results: list[dict], backend: str = "gloo") -> None:
    """Every rank's loss curve and rank 0's final weights are the single process's."""
    ref_losses, ref_state = reference_run()
    # gloo: the CPU reference's arithmetic but for the order of the gradient sums (fp32,
    # about 1e-7 relative); NCCL: also the GPU's fp32 matmuls, so looser
    rtol, atol = (1e-5, 1e-6) if backend == "gloo" else (1e-4, 2e-5)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=rtol, abs=atol)
    state = results[0]["state"]
    assert state.keys() == ref_state.keys()
    # Weights: AdamW divides each gradient element by its own running RMS, so an element
    # whose gradient is near zero turns that 1e-7 of rounding into a visible move. Bound
    # it by a thousandth of one update (lr = 1e-2) per weight: 4 gloo ranks move one weight
    # by 4.5e-6 (different sums, same steps); a wrong or missing step moves it by ~lr.
    weight_atol = max(atol, 1e-3 * LR)
    for k, v in ref_state.items():
        close = torch.isclose(state[k], v, rtol=rtol, atol=weight_atol)
        assert close.all(), (k, (state[k] - v).abs().max().item())


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_simulated_hosts_train_as_one_process(tmp_path, zero_stage):
    """Two hosts of two ranks each (host names simulated by $RAMFLOW_TEST_HOST): rank 0's
    weights reach the other host, each host steps every unit once among its ranks, the
    gradients are averaged over all four; the result is the one process's, and each host
    maps exactly one copy of the masters (its leader's files, shared by its two ranks)."""
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    options = {"out": str(tmp_path), "zero_stage": zero_stage, "hosts": hosts}
    results = W.run(W.train_offload, 4, options)
    _check_ok(results)
    ref_losses, ref_state = reference_run()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        # device_optimizer's default (None) steps no unit on the CPU device, and says why
        stepped, reason = r["device_optimizer"]
        assert stepped == () and reason == "none: the device is the CPU", reason
    for k, v in ref_state.items():  # the weight tolerance of test_zero_offload_equals_...
        close = torch.isclose(results[0]["state"][k], v, rtol=1e-5, atol=1e-3 * LR)
        assert close.all(), (k, (results[0]["state"][k] - v).abs().max().item())
    files = [set(r["memory"]["files"]) for r in results]
    units = len(ramflow.offload(W.reference_model(), device="cpu")._ramflow_engine.units)
    for a, b in ((0, 1), (2, 3)):  # one copy per host: both ranks map the same files
        assert files[a] == files[b]
        assert sum(f.endswith(".master") for f in files[a]) == units
        assert all(f"-{hosts[a]}-" in f for f in files[a])
    assert not files[0] & files[2]  # and the hosts do not share theirs


@pytest.mark.parametrize("world_size", [2, 4])
def test_host_copy_is_shared_not_per_rank(tmp_path, world_size):
    """The master weights are one copy per host: each rank maps all of them (rss), but the
    pages are shared (proportional share pss sums to one copy, nothing private). Without
    ZeRO each process holds a private copy: its unique memory (uss) is larger by them."""
    dim = 1024  # about 8.4 M parameters: 34 MB of fp32 masters
    master_bytes = sum(p.numel() * 4 for p in W.reference_model(dim=dim).parameters())
    results = W.run(
        W.train_offload, world_size, {"out": str(tmp_path), "zero_stage": 2, "dim": dim}
    )
    _check_ok(results)
    rss = [r["memory"]["rss"] for r in results]
    pss = [r["memory"]["pss"] for r in results]
    private = [r["memory"]["private"] for r in results]
    assert all(x >= master_bytes for x in rss), (rss, master_bytes)
    assert sum(pss) <= 1.25 * max(rss), (pss, rss)  # one copy among all ranks
    assert all(p == 0 for p in private), private
    baseline = W.run(
        W.train_offload,
        world_size,
        {"out": str(tmp_path / "private"), "zero_stage": None, "dim": dim},
    )
    _check_ok(baseline)
    uss_shared = sum(r["memory"]["uss"] for r in results) / world_size
    uss_private = sum(r["memory"]["uss"] for r in baseline) / world_size
    assert uss_private - uss_shared >= 0.8 * master_bytes, (uss_private, uss_shared)


def test_dead_rank_fails_the_others_with_a_clear_error(tmp_path):
    """Rank 1 dies after the first step: rank 0 raises a ramflow error naming the cause
    within the process group's timeout, instead of hanging."""
    start = time.monotonic()
    shm = tmp_path / "shm"
    shm.mkdir()
    options = {"out": str(tmp_path), "zero_stage": 2, "die_after": 1, "pg_timeout": 20}
    results = W.run(W.train_offload, 2, {**options, "shm_dir": str(shm)}, timeout=90)
    elapsed = time.monotonic() - start
    assert results[1] == {"exitcode": 3}
    assert "error" in results[0], results[0]
    assert "rank" in results[0]["error"] and "died" in results[0]["error"], results[0]["error"]
    assert elapsed < 80
    assert _store_files(shm) == []  # nothing of the host store stays behind


def _nccl_backend():
    """ "nccl", run on the GPU box when it has 2 GPUs."""
    enough = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
    return pytest.param("nccl", marks=[pytest.mark.gpu, enough])


@pytest.mark.parametrize("backend", ["gloo", _nccl_backend()])
@pytest.mark.parametrize("where", ["backward", "step"])
def test_rank_killed_mid_step_fails_the_others_with_ramflow_error(
    tmp_path, request, where, backend
):
    """Rank 1 is SIGKILLed in its second step: in backward (some units' gradients reduced,
    not all), or right after ``opt.step()`` returned (its steps and the barrier running on
    its worker). Rank 0 raises ramflow's error, naming rank 1 as dead and saying what to do,
    long before the process group's timeout would end a hang (NCCL: its collective never
    completes, ramflow notices the dead process; see [Note: a rank that dies]); no file of
    the shared host store stays behind."""
    # memory-backed, as a GPU run's shared host store must be (check_shm_directory_pins)
    shm = Path(tempfile.mkdtemp(prefix="ramflow-test-", dir="/dev/shm"))
    request.addfinalizer(lambda: shutil.rmtree(shm, ignore_errors=True))
    options = {"out": str(tmp_path), "zero_stage": 2, "kill": (where, 1), "backend": backend}
    start = time.monotonic()
    # pg_timeout: ramflow's error must come first; W.run's timeout: a hang fails the test
    results = W.run(W.train_offload, 2, {**options, "shm_dir": str(shm), "pg_timeout": 300})
    elapsed = time.monotonic() - start
    assert results[1] == {"exitcode": -9}, results[1]
    error = results[0].get("error", "")
    assert error.startswith("RuntimeError: ramflow"), results[0]
    assert "rank 1 (PID" in error and "died" in error and "restart" in error, error
    assert elapsed < 300
    assert os.listdir(shm) == []


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_slow_owner_is_waited_for(tmp_path, zero_stage):
    """Rank 1's host steps start 0.2 s late. The other ranks wait for the units it owns
    (behind the barrier after the step) before they use them again, so the run is still the
    single process's: a rank that refreshed a unit before its owner wrote it would step
    from stale weights and drift from the reference."""
    results = W.run(
        W.train_offload,
        4,
        {"out": str(tmp_path), "zero_stage": zero_stage, "slow_owner": 1},
    )
    _check_ok(results)
    _assert_matches_reference(results)


@pytest.mark.parametrize("zero_stage,norm_piece", [(1, None), (2, None), (2, 64)])
def test_zero_clipping_uses_the_global_norm(tmp_path, zero_stage, norm_piece):
    """ramflow.clip_grad_norm_ clips by the norm of all gradients, also when each rank
    holds only its share of them (ZeRO-2): the run still equals one process. ``norm_piece``
    64: each host gradient's norm is summed in pieces of 64 elements (see [Note: norms in
    pieces on the CPU] in ``ramflow.engine.clip``), as a large model's are."""
    options = {"out": str(tmp_path), "zero_stage": zero_stage, "clip": 0.05}
    results = W.run(W.train_offload, 2, {**options, "norm_piece": norm_piece})
    _check_ok(results)
    ref_losses, ref_state = reference_run(clip=0.05)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    # The clip factor comes from a norm summed in another order (over ranks, in float64
    # under ZeRO-2); AdamW's per-element normalisation of the small clipped gradients turns
    # that ~1e-7 relative difference into up to ~1e-5 in the weights after four steps.
    for k, v in ref_state.items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-4, atol=2e-5, msg=k)


@pytest.mark.parametrize("zero_stage,norm_piece", [(1, None), (2, None), (2, 64)])
def test_zero_norm_only_steps_during_backward(tmp_path, zero_stage, norm_piece):
    """Reading the norm alone (``max_norm=inf``) under ZeRO keeps the steps during
    backward from the second step on (with ``keep_grads=False`` the units a rank steps
    then leave no ``p.grad``, where the deferred first step filled them) and gives the norm
    of the reduced gradients of one process on the global batch. ``norm_piece`` 64: each
    unit's norm at dispatch is taken in pieces of 64 elements, as a large unit's is on the
    CPU."""
    options = {
        "out": str(tmp_path), "zero_stage": zero_stage, "clip": math.inf, "norm_piece": norm_piece
    }  # fmt: skip
    results = W.run(W.train_offload, 2, {**options, "keep_grads": False})
    _check_ok(results)
    ref_norms: list[float] = []
    ref_losses, _ = reference_run(clip=math.inf, norms=ref_norms)
    for r in results:
        first, *later = r["grads_left"]  # parameters with a gradient before the step
        assert all(n < first for n in later), r["grads_left"]
        # per-unit device norms summed over ranks against PyTorch's per-tensor sum
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


# ------------------------------------------------------------ the shared host store's files


def _store_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if STORE_FILE.fullmatch(name))


def test_set_up_that_fails_unlinks_its_shared_memory_files(tmp_path):
    """The leader's set-up raises after it created its files: none is left behind."""
    shm = tmp_path / "shm"
    shm.mkdir()
    options = {"out": str(tmp_path / "run"), "shm_dir": str(shm), "fail": "raise"}
    results = W.run(W.offload_failing_in_set_up, 1, options)
    assert "injected by the test" in results[0].get("error", ""), results[0]
    assert os.listdir(shm) == []


def test_files_of_a_leader_that_died_go_at_the_next_offload(tmp_path):
    """A leader killed during set-up (no Python runs) leaves its files, named with its PID;
    the next offload on the host removes them, and nothing else: not a live process's
    files, not another host's, not a file of another name."""
    shm = tmp_path / "shm"
    shm.mkdir()
    options = {"out": str(tmp_path / "died"), "shm_dir": str(shm), "fail": "exit"}
    assert W.run(W.offload_failing_in_set_up, 1, options) == [{"exitcode": 3}]
    left = _store_files(shm)
    assert {name.rsplit(".", 1)[1] for name in left} == {"master", "wire"}, left
    dead = int(STORE_FILE.fullmatch(left[0])["pid"])
    assert not psutil.pid_exists(dead)
    token, host = "0" * 32, socket.gethostname()
    keep = [
        f"ramflow-{os.getpid()}-{token}-{host}-0.master",  # a live process's
        f"ramflow-{dead}-{token}-not-{host}-0.master",  # another host's, same tmpfs
        f"ramflow-{dead}-notes.txt",  # not the store's naming
    ]
    for name in keep:
        (shm / name).write_bytes(b"not ramflow's to remove")
    options = {"out": str(tmp_path / "next"), "shm_dir": str(shm), "zero_stage": 2}
    _check_ok(W.run(W.train_offload, 1, options))
    assert sorted(os.listdir(shm)) == sorted(keep)
    assert all((shm / name).read_bytes() == b"not ramflow's to remove" for name in keep)


def test_a_plain_offload_removes_store_files_of_dead_processes(tmp_path, monkeypatch):
    """Any offload cleans up after ranks that died, not only a data-parallel one."""
    dead = psutil.Popen(["true"])
    dead.wait()
    host, token = socket.gethostname(), "0" * 32
    stale = tmp_path / f"ramflow-{dead.pid}-{token}-{host}-0.master"
    live = tmp_path / f"ramflow-{os.getpid()}-{token}-{host}-0.master"
    for path in (stale, live):
        path.write_bytes(b"x")
    monkeypatch.setenv("RAMFLOW_SHM_DIR", str(tmp_path))
    ramflow.offload(W.reference_model(seed=0), device="cpu")
    assert not stale.exists() and live.exists()


def test_store_file_is_created_exclusively(tmp_path):
    """O_EXCL: an existing file of the same name is refused and left as it was."""
    path = tmp_path / f"ramflow-1-{'0' * 32}-{socket.gethostname()}-0.master"
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        create_store_file(str(path), 4, torch.float32)
    assert path.read_bytes() == b"someone else's"
    fresh = create_store_file(str(tmp_path / "fresh"), 4, torch.bfloat16)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (4,) and not fresh.any()
    assert (tmp_path / "fresh").stat().st_size == 8
    fresh.fill_(1.0)  # shared: the file holds what the tensor holds
    assert torch.equal(
        torch.from_file(str(tmp_path / "fresh"), size=4, dtype=torch.bfloat16), fresh
    )


def test_shared_store_directory_must_be_memory_backed_on_a_gpu(tmp_path):
    """Linux does not page-lock a disk file's pages: a GPU run's shared host store must be
    on a tmpfs, and a directory elsewhere is refused up front with what to use instead."""
    from ramflow.distributed.zero import check_shm_directory_pins, filesystem_type

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "overlay / overlay rw 0 0\n"
        "tmpfs /ramflow-test-mem tmpfs rw 0 0\n"
        "/dev/sda1 /ramflow-test\\040disk ext4 rw 0 0\n"
    )
    assert filesystem_type("/ramflow-test-mem/x", mounts=str(mounts)) == "tmpfs"
    assert filesystem_type("/ramflow-test disk/store", mounts=str(mounts)) == "ext4"
    assert filesystem_type("/ramflow-test-other", mounts=str(mounts)) == "overlay"
    check_shm_directory_pins("/ramflow-test-mem/x", mounts=str(mounts))
    with pytest.raises(ValueError, match="ext4 filesystem.*Use /dev/shm"):
        check_shm_directory_pins("/ramflow-test disk/store", mounts=str(mounts))
    check_shm_directory_pins("/x", mounts=str(tmp_path / "missing"))  # unknown: allowed


@pytest.mark.parametrize("what", ["zero_stage", "shapes"])
def test_ranks_that_disagree_are_refused_at_offload(tmp_path, what):
    """Ranks with other zero_stage values hung in mismatched collectives until the process
    group's timeout; models with the same unit sizes but other shapes trained, averaging
    gradients of different tensors."""
    results = W.run(W.offload_mismatched, 2, {"out": str(tmp_path), "what": what})
    expect = "different zero_stage" if what == "zero_stage" else "parameter shapes"
    for r in results:
        assert expect in r.get("error", ""), r
