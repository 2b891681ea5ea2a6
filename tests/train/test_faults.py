"""Nothing lost under faults (issue 49, point 2): a second process in a run folder, a
launcher killed with SIGKILL, an edited ``trainer_state.json``, a full disk, the RAM of
every rank, text that is not UTF-8, a module repeated in a ``ModuleList``, and a loss that
diverges. Each test reproduces the fault for real (real processes, a real full tmpfs in a
user namespace) and checks the one-line refusal and that nothing is lost.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

import ramflow
from ramflow.train import TrainConfig, open_checkpoint
from ramflow.train.report import read_log
from ramflow.train.run_checkpoint import find_checkpoint, list_checkpoints, state_checksum

SRC = Path(__file__).resolve().parents[2] / "src"
WAIT_S = 600  # generous: the machine may be shared; no assertion depends on it


def _tree(path: Path) -> dict[str, int]:
    """Every file under ``path`` with its size: to show that nothing changed."""
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])}


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture
def run_copy(tmp_path: Path, trained_run: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


# ---------------------------------------------------------------- 1. the run folder's lock

_HOLD = (
    "import sys, time\n"
    "from ramflow.train.run_lock import RunLock\n"
    "RunLock(sys.argv[1]).acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(3600)\n"
)


def test_a_second_run_or_resume_in_a_locked_folder_is_refused_and_deletes_nothing(
    run_copy: Path, corpus_file: Path, ramflow_cli, capsys, fast
) -> None:
    """Another live process holds the folder (as a run that is saving does): a resume and a
    new run with the same --out are refused in one line; its in-flight save survives. Once
    that process is dead (kill -9), its stale lock is taken over."""
    in_flight = run_copy / "checkpoints" / ".step-00000009.tmp-4242"
    in_flight.mkdir()
    (in_flight / "model.safetensors").write_bytes(b"being written")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_copy)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _tree(run_copy)
        assert ramflow_cli("train", "--resume", run_copy, "--steps", "9", "--no-progress") == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "in use" in line and f"pid {holder.pid}" in line
        assert ramflow_cli("train", "--data", corpus_file, "--out", run_copy, *fast) == 2
        assert "in use" in _one_error_line(capsys.readouterr().err)
        assert _tree(run_copy) == before  # the in-flight save included
    finally:
        holder.kill()
        holder.wait()
    # the holder died without unlocking: its lock is stale and taken over
    assert ramflow_cli("train", "--resume", run_copy, "--steps", "9", "--no-progress") == 0
    assert open_checkpoint(run_copy).step == 9
    assert not in_flight.exists()  # now a leftover, removed by the run that owns the folder


# ---------------------------------------------------------------- 2. ranks die with the launcher


def test_kill_9_of_the_launcher_stops_every_rank_and_saves_the_last_step(
    corpus_file: Path, tmp_path: Path
) -> None:
    """SIGKILL to ``ramflow train --nproc-per-node 2``: its ranks see their launcher gone,
    stop after the same step, save it and exit, instead of training on as orphans. Each
    rank signals itself when its watch sees the launcher gone, so the two signals come
    apart, whichever first (see ``test_a_signal_after_another_ranks_stop_is_a_first_one``)."""
    run = tmp_path / "run"
    argv = [
        "train", "--data", corpus_file, "--steps", "100000", "--save-every", "0",
        "--eval-every", "0", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
        "--no-progress", "--device", "cpu", "--out", run, "--nproc-per-node", "2",
    ]  # fmt: skip
    shm = tmp_path / "shm"
    shm.mkdir()
    output = tmp_path / "output.txt"
    with output.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "ramflow", *map(str, argv)],
            env={**_env(), "RAMFLOW_SHM_DIR": str(shm)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + WAIT_S
        log = run / "log.jsonl"
        while not (log.exists() and any(r["event"] == "step" for r in read_log(log))):
            assert launcher.poll() is None, f"the launcher ended with {launcher.returncode}"
            assert time.monotonic() < deadline, "no training step was logged"
            time.sleep(0.2)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs(ranks, timeout=WAIT_S)
        assert alive == [], "ranks outlived their launcher"
    finally:
        for p in [*ranks]:
            if p.is_running():
                p.kill()
        if launcher.poll() is None:
            launcher.kill()
    text = output.read_text()
    assert "aborted" not in text and "Traceback" not in text, text[-3000:]
    records = read_log(run / "log.jsonl")
    last = max(r["step"] for r in records if r["event"] == "step")
    end = [r for r in records if r["event"] == "end"]
    assert end and end[-1]["interrupted"] and end[-1]["step"] == last, text[-3000:]
    assert open_checkpoint(run).step == last  # complete: its checksums verify


def test_a_signal_after_another_ranks_stop_is_a_first_one() -> None:
    """The loop sets ``stop`` when another rank was signalled; this rank's own signal,
    arriving after that, asks for the same stop and save, not the abort that a second
    signal is. Only a second signal received by this process aborts."""
    import signal
    import threading

    from ramflow.train.trainer import _signals_stop

    stop, said, received = threading.Event(), [], []
    with _signals_stop(stop, said.append, received):
        stop.set()  # what ``Ranks.any`` makes the loop do: another rank was signalled
        signal.raise_signal(signal.SIGTERM)
        assert received == [signal.SIGTERM] and len(said) == 1
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)


# ---------------------------------------------------------------- 3. the state's checksum


def _edit_state(run: Path, edit, *, resign: bool = False) -> None:
    state_file = find_checkpoint(run) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    edit(state)
    if resign:
        state["state_sha256"] = state_checksum(state)
    state_file.write_text(json.dumps(state, indent=2))


@pytest.mark.parametrize(
    ("edit", "resign", "expect"),
    [
        (lambda s: s.update(step=4), False, "does not match its checksum"),
        (lambda s: s.update(data_position=10**15), False, "does not match its checksum"),
        (lambda s: s.pop("state_sha256"), False, "has no state_sha256"),
        # a forger who recomputes the checksum still meets the folder's name
        (lambda s: s.update(step=4), True, "says step 4 but its folder step-00000008"),
    ],
    ids=["step", "data position", "no checksum", "step re-signed"],
)
def test_an_edited_trainer_state_is_refused_and_nothing_is_deleted(
    run_copy: Path, ramflow_cli, capsys, edit, resign: bool, expect: str
) -> None:
    _edit_state(run_copy, edit, resign=resign)
    before = _tree(run_copy)
    assert ramflow_cli("train", "--resume", run_copy, "--steps", "12", "--no-progress") == 2
    assert expect in _one_error_line(capsys.readouterr().err)
    assert _tree(run_copy) == before


def test_a_model_loader_reads_an_unsigned_checkpoint_but_resuming_refuses_it(
    run_copy: Path,
) -> None:
    """An earlier ramflow's checkpoint has no checksum: ``generate`` still reads its
    weights (checked by the manifest), resuming does not trust its state."""
    from ramflow.train import CheckpointError

    _edit_state(run_copy, lambda s: s.pop("state_sha256"))
    assert open_checkpoint(run_copy, model_only=True).step == 8
    with pytest.raises(CheckpointError, match="has no state_sha256"):
        open_checkpoint(run_copy)
    _edit_state(run_copy, lambda s: s.update(state_sha256="0" * 64))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        open_checkpoint(run_copy, model_only=True)


# ---------------------------------------------------------------- 4. the disk

_UNSHARE = shutil.which("unshare")


def _in_small_tmpfs(size: str, script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run the shell ``script`` with ``$D`` a fresh tmpfs of ``size`` (a real full disk),
    mounted in a user and mount namespace of its own (no root needed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    return subprocess.run(
        [_UNSHARE, "-rm", "sh", "-euc", f'mount -t tmpfs -o size={size} tmpfs "$D"\n{script}'],
        env={**_env(), "D": str(mount), "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if _UNSHARE is None:
        return False
    return _in_small_tmpfs("1m", "true", tmp_path / "probe").returncode == 0


def test_a_disk_that_holds_one_checkpoint_but_not_two_is_refused_as_plan_says(
    corpus_file: Path, tmp_path: Path, fast
) -> None:
    (tmp_path / "probe").mkdir()
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs unshare -rm (user namespaces) to mount a small tmpfs")
    from ramflow.train import plan_run

    config = TrainConfig.from_options(seq_len=32, batch_size=2, device="cpu")
    one = plan_run(config).checkpoint_bytes
    size = f"{one * 3 // 2 // 1024}k"  # one checkpoint and a half
    cadence = "--steps 4 --save-every 2"
    args = f"--data {corpus_file} {cadence} --eval-every 0 {' '.join(fast)}"
    done = _in_small_tmpfs(
        size,
        f'$PY -m ramflow plan --out "$D/run" {cadence} --seq-len 32 --batch-size 2 '
        "--device cpu && echo plan=0 || echo plan=$?\n"
        f'$PY -m ramflow train {args} --out "$D/run" && echo rc=0 || echo rc=$?\n'
        'ls -A "$D"\n',
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan=1" in done.stdout, done.stdout[-3000:]
    assert "rc=2" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    line = _one_error_line(done.stderr)
    said = line.split("error: ", 1)[1]
    assert "room for 2 at once" in said and "it fits with --save-every 0" in said
    assert f"DOES NOT FIT this machine: {said}" in done.stdout  # what plan says
    assert done.stdout.strip().endswith("rc=2")  # nothing written: the tmpfs is empty


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoint_before(
    corpus_file: Path, tmp_path: Path, fast
) -> None:
    """The disk fills up (another process writes) after a checkpoint: the next save fails
    with one line and exit 2, and the checkpoint before it is complete."""
    (tmp_path / "probe").mkdir()
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs unshare -rm (user namespaces) to mount a small tmpfs")
    args = f"--data {corpus_file} --steps 100000 --save-every 2 --eval-every 0 {' '.join(fast)}"
    check = "from ramflow.train import open_checkpoint as o; import sys; print('ok', o(sys.argv[1]).step)"
    done = _in_small_tmpfs(
        "256m",
        f'$PY -m ramflow train {args} --out "$D/run" 2>"$D/err" &\n'
        "pid=$!\n"
        'while [ ! -f "$D/run/checkpoints/latest" ]; do sleep 0.1; done\n'
        # fill the disk, then free 1 MiB: room for log lines, not for a checkpoint
        'dd if=/dev/zero of="$D/fill" bs=1M 2>/dev/null || true\n'
        'truncate -s -1M "$D/fill"\n'
        "rc=0; wait $pid || rc=$?\n"
        'echo rc=$rc; cat "$D/err" >&2\n'
        f'$PY -c "{check}" "$D/run"\n',
        tmp_path,
    )
    assert "rc=2" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    line = _one_error_line(done.stderr)
    # the save's words, or those of a log write that met the full disk first
    assert "the disk is full" in line and "is kept" in line
    assert "ok " in done.stdout  # the checkpoint before the failed save verifies


def test_a_full_disk_outside_a_save_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """ENOSPC from a write that is not a checkpoint's (a log line, the loss plot) is worded
    as the save's is, naming the file: the tmpfs test above meets it when the disk fills
    between two saves. Any other error, and a message already worded, pass through."""
    import errno

    from ramflow.train.run_checkpoint import disk_full_error

    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "log.jsonl"))
    out = disk_full_error(err, tmp_path / "run" / "checkpoints")
    assert out is not None and out.errno == errno.ENOSPC
    text = str(out)
    assert text.startswith("the disk is full: writing ") and "log.jsonl" in text
    assert "no complete checkpoint was written before" in text and "--resume" in text
    assert disk_full_error(out, tmp_path) is None  # worded once
    assert disk_full_error(OSError(errno.EACCES, "Permission denied"), tmp_path) is None


# ---------------------------------------------------------------- 5. RAM of every rank


def test_train_counts_the_ram_of_every_rank_as_plan_does(corpus_file: Path, tmp_path) -> None:
    from ramflow.train import plan_run
    from ramflow.train.scale import plan_ranks
    from ramflow.train.setup import prepare_run

    config = TrainConfig.from_options(
        data=str(corpus_file), seq_len=32, batch_size=2, device="cpu", steps=2
    )
    two = prepare_run(config, None, tmp_path / "a", several_ranks=True, num_local_ranks=2)
    planned = plan_ranks(plan_run(config, num_ranks=2), num_ranks=2)
    assert two.host_ranks is not None
    assert two.host_ranks.ram_needed_bytes == planned.ram_needed_bytes
    # enough ranks that their runtimes alone pass this machine's available RAM
    many = planned.ram_available_bytes // planned.per_rank_bytes + 2
    with pytest.raises(MemoryError, match=f"{many} ranks on this host"):
        prepare_run(config, None, tmp_path / "b", several_ranks=True, num_local_ranks=many)
    assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------- 6. text that is not UTF-8


@pytest.mark.parametrize(
    ("content", "offset"),
    [(b"def caf\xe9():\n    return 1\n", 7), (b"text\n\x00\x01\x02binary", 5)],
    ids=["latin-1", "binary"],
)
def test_data_that_is_not_utf8_is_refused_naming_the_file_and_byte(
    tmp_path: Path, ramflow_cli, capsys, fast, content: bytes, offset: int
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "good.txt").write_text("def f():\n    return 2\n" * 200)
    bad = data / "bad.txt"
    bad.write_bytes(content)
    assert ramflow_cli("train", "--data", data, "--out", tmp_path / "run", *fast) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(bad) in line and f"byte {offset}" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 7. a repeated module


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.linear(x).relu())


class _Stack(nn.Module):
    """A block applied twice: the same module at positions 1 and 2 of its list."""

    def __init__(self) -> None:
        super().__init__()
        shared = _Block()
        self.layers = nn.ModuleList([_Block(), shared, shared, _Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize(
    "units",
    [None, ["layers.0", "layers.1", "layers.2", "layers.3", "head"]],
    ids=["found", "given by name"],
)
def test_a_module_repeated_in_a_module_list_shares_its_unit_and_trains_as_resident(
    units: list[str] | None,
) -> None:
    """Its names (``layers.1``, ``layers.2``) are one unit, loaded by both calls; training
    computes what the resident model computes (the first loss bit for bit in fp32, the
    later ones and the weights within the optimizers' last-bit rounding). Given
    by name, ``layers.2`` was refused as "no submodule" before."""
    torch.manual_seed(0)
    resident = _Stack()
    model = ramflow.offload(copy.deepcopy(resident), device="cpu", units=units)
    assert model.layers[1] is model.layers[2]
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(resident.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    for step in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = resident(x).square().mean()
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:  # the same weights: the same forward, bit for bit
            assert torch.equal(loss.detach(), ref.detach())
        else:  # after a step: within the optimizers' last-bit difference (below)
            torch.testing.assert_close(loss.detach(), ref.detach())
    ramflow.undo(model)
    # the host AdamW rounds its last bit unlike torch's, for any model (how often depends on
    # the CPU's instruction set: bit-equal losses after a step held on one CI machine and
    # not on the next): close, not equal; a shared unit stepped twice, or once per call,
    # would be off by a whole step (lr 1e-2), far outside assert_close's 1.3e-6
    for (name, p), q in zip(model.named_parameters(), resident.parameters()):
        torch.testing.assert_close(p, q, msg=name)


# ---------------------------------------------------------------- 8. a diverging loss


def test_a_diverging_loss_is_one_true_line(
    tmp_path: Path, corpus_file: Path, ramflow_cli, capsys, fast
) -> None:
    out = tmp_path / "run"
    rc = ramflow_cli(
        "train", "--data", corpus_file, "--lr", "1e10", "--steps", "20", "--eval-every", "0",
        "--out", out, *fast,
    )  # fmt: skip
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "the training loss became" in line and "lower --lr" in line
    assert "--precision fp32" not in line  # a CPU run is in fp32 already
    assert "no checkpoint of this run was written" in line
    assert list_checkpoints(out / "checkpoints") == []
