"""``ramflow train`` on several ranks: sharding, rank-0 reporting, checkpoints, faults.

Runs are real processes on gloo (CPU, CI) through both launchers: ``torchrun`` and
``ramflow train --nproc-per-node``; marked ``gpu`` variants run the same on NCCL.
See [Note: several ranks from the CLI] in ``ramflow/train/ranks.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ramflow.train.data import BatchStream, validation_batches
from ramflow.train.launch import rank_environment
from ramflow.train.ranks import Ranks, bind_to_gpu_node, check_several_ranks
from ramflow.train.report import read_log
from ramflow.train.run_checkpoint import (
    Checkpoint,
    CheckpointError,
    check_num_ranks,
    open_checkpoint,
    rank_file,
    remove_stale_temporaries,
)
from ramflow.train.scale import choose_zero_stage

SRC = Path(__file__).resolve().parents[2] / "src"
# tiny preset, T=32, 6 steps with a checkpoint after 3: seconds per run on 2 CPU cores;
# fp32 on a GPU too, so that one process and two ranks can be compared closely
RUN = (
    "--preset", "tiny", "--seq-len", "32", "--steps", "6", "--eval-every", "3",
    "--eval-batches", "2", "--warmup-steps", "1", "--save-every", "3",
    "--keep-checkpoints", "2", "--no-progress", "--precision", "fp32",
)  # fmt: skip
# gloo on the CPU (CI); NCCL on two GPUs (the GPU box)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
        ],
    ),
]
# The validation loss of 2 ranks at B against one process at 2B: the same sequences and
# steps; only the order of the fp32 gradient sums differs (the ranks' average vs one
# batch's mean), about 1e-7 relative per step, which AdamW's normalisation may lift to
# ~1e-5 in a few steps. 1e-4 is the bound and 100x below one step's change.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="session")
def shm_root():
    """A folder in /dev/shm for the runs' shared host stores (a GPU run needs a tmpfs, see
    ``ramflow.distributed.zero.check_shm_directory_pins``), removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="test-multi-rank-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _shm(root: Path) -> Path:
    """A fresh shared-memory folder under ``root``: ramflow's files of one test only."""
    return Path(tempfile.mkdtemp(dir=root))


def _env(shm: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
        "RAMFLOW_SHM_DIR": str(shm),
        **extra,
    }


def _ramflow(
    *argv: str | Path, env: dict[str, str], torchrun: int | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``ramflow ARGV`` in a child process (under ``torchrun`` with that many ranks)."""
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc-per-node={torchrun}", "-m", "ramflow"]
        if torchrun
        else [sys.executable, "-m", "ramflow"]
    )
    return subprocess.run(
        [*head, *map(str, argv)], env=env, capture_output=True, text=True, timeout=timeout
    )


def _losses(run: Path, event: str = "step") -> dict[int, float]:
    key = "loss" if event == "step" else "val_loss"
    return {r["step"]: r[key] for r in read_log(run / "log.jsonl") if r.get("event") == event}


def _shm_files(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.iterdir() if p.name.startswith("ramflow-"))


@pytest.fixture(scope="module", params=DEVICES)
def two_rank_run(
    request, tmp_path_factory, corpus_file, shm_root
) -> tuple[Path, Path, subprocess.CompletedProcess, str]:
    """6 steps on 2 ranks (torchrun) at B=2, checkpoints at steps 3 and 6: the run folder,
    the shared-memory folder, the process and the device."""
    device = request.param
    root = tmp_path_factory.mktemp(f"two-{device}")
    out = root / "run"
    shm = _shm(shm_root)
    done = _ramflow(
        "train", *RUN, "--batch-size", "2", "--data", corpus_file, "--device", device,
        "--out", out, env=_env(shm), torchrun=2,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out, shm, done, device


# ---------------------------------------------------------------- sharding and reporting


def test_batch_stream_shards_the_single_process_batch():
    """Rank r's micro-batch is rows r*B:(r+1)*B of the micro-batch one process at B x N
    draws, and the position (global) advances alike, across an epoch's end."""
    tokens = torch.arange(10 * 4, dtype=torch.int32)  # 10 sequences of T=4
    one = BatchStream(tokens, batch_size=6, seq_len=4, seed=3)
    ranks = [
        BatchStream(tokens, batch_size=2, seq_len=4, seed=3, rank=r, num_ranks=3) for r in range(3)
    ]
    for _ in range(4):  # 24 sequences: crosses two epoch boundaries
        whole = one.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(torch.cat(parts), whole)
        assert all(s.position == one.position for s in ranks)
    with pytest.raises(ValueError, match="rank 2 is not one of num_ranks 2"):
        BatchStream(tokens, batch_size=2, seq_len=4, seed=3, rank=2, num_ranks=2)


def test_validation_batches_are_split_over_the_ranks():
    """Every held-out sequence of one process's batches is evaluated by exactly one rank,
    the short last batch included."""
    tokens = torch.arange(7 * 4, dtype=torch.int32)  # 7 sequences
    whole = torch.cat(list(validation_batches(tokens, batch_size=4, seq_len=4, max_batches=2)))
    parts = [
        list(
            validation_batches(tokens, batch_size=2, seq_len=4, max_batches=2, rank=r, num_ranks=2)
        )
        for r in range(2)
    ]
    assert [b.shape[0] for b in parts[0]] == [2, 2] and [b.shape[0] for b in parts[1]] == [2, 1]
    merged = torch.cat([parts[0][0], parts[1][0], parts[0][1], parts[1][1]])
    assert torch.equal(merged, whole)


@pytest.mark.slow
def test_two_ranks_compute_one_process_at_twice_the_batch(
    two_rank_run, corpus_file, tmp_path, shm_root
):
    """2 ranks at --batch-size 2 (torchrun) give the validation and training losses of one
    process at --batch-size 4 on the same seed and data; rank 0 alone reports."""
    out, shm, done, device = two_rank_run
    one = tmp_path / "one"
    single = _ramflow(
        "train", *RUN, "--batch-size", "4", "--data", corpus_file, "--device", device,
        "--out", one, env=_env(_shm(shm_root)),
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    val, val_one = _losses(out, "eval"), _losses(one, "eval")
    assert sorted(val) == sorted(val_one) == [0, 3, 6]
    for step, loss in val_one.items():
        assert val[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    train, train_one = _losses(out), _losses(one)
    assert sorted(train) == list(range(1, 7))
    for step, loss in train_one.items():
        assert train[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    records = read_log(out / "log.jsonl")
    # one log, one summary: each step once, from rank 0, with every rank's tokens
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert steps[-1]["tokens"] == 6 * 2 * 2 * 32
    start = next(r for r in records if r["event"] == "start")
    assert (start["num_ranks"], start["zero_stage"]) == (2, 2)
    # ramflow train's allocator default reaches the ranks, or the user's setting stays
    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF"))
    assert start["cuda_alloc_conf"] == (user if user is not None else "expandable_segments:True")
    assert done.stdout.count("validation loss") == 4  # 3 evaluations + the summary row
    backend = "NCCL" if device == "cuda" else "gloo"
    assert f"2 ranks (2 on this host), ZeRO-2 over {backend}" in done.stdout
    # the header counts every rank's tokens, as the log does: 2 ranks x B=2 x T=32
    assert ": 6 steps of 128 tokens" in done.stdout and "(128 per step over 2 ranks" in done.stdout
    assert json.loads((out / "run.json").read_text())["num_ranks"] == 2
    assert _shm_files(shm) == []


@pytest.mark.slow
def test_two_ranks_with_the_device_optimizer_on_compute_what_host_steps_do(
    two_rank_run, corpus_file, tmp_path, shm_root
):
    """``--device-optimizer on`` on 2 ranks: each rank steps the units it owns on its device
    (see [Note: the device optimizer under ZeRO] in ramflow.engine.device_stepper) and the losses are the
    host steps' (the two_rank_run: no --gpu-memory, so no device step). On the
    CPU the device step is the host kernel's arithmetic, so they are equal; on CUDA fp32
    masters step with PyTorch's fused CUDA AdamW, within float rounding of the host kernel,
    which 6 steps keep within LOSS_RTOL."""
    out, _, _, device = two_rank_run
    on = tmp_path / "on"
    done = _ramflow(
        "train", *RUN, "--batch-size", "2", "--data", corpus_file, "--device", device,
        "--device-optimizer", "on", "--gpu-memory", "1GiB",  # room to keep units resident
        "--out", on, env=_env(_shm(shm_root)), torchrun=2,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0 reports its own plan: some of the units it owns step on its device
    assert re.search(r"optimizer on the device for [1-9]\d* of \d+ units", done.stdout), done.stdout
    assert "(the units rank 0 owns)" in done.stdout
    for event in ("step", "eval"):
        got, want = _losses(on, event), _losses(out, event)
        assert sorted(got) == sorted(want)
        for step, loss in want.items():
            if device == "cpu":
                assert got[step] == loss, (event, step)
            else:
                assert got[step] == pytest.approx(loss, rel=LOSS_RTOL), (event, step)


@pytest.mark.slow
def test_two_ranks_without_clipping_step_during_backward_as_they_would_after_it(
    corpus_file, tmp_path, shm_root
):
    """Without clipping, ranks step each unit during backward with only lean's gradient
    ring (``TrainConfig.steps_during_backward``); a clipping limit no gradient reaches keeps
    every step after backward with a full gradient buffer. Both apply the same updates to
    the same gradients, so the losses are the same bits."""
    run = (*RUN[:-2], "--precision", "fp32", "--host-precision", "lean")
    losses = {}
    for clip in ("0", "1e9"):
        out = tmp_path / f"clip-{clip}"
        done = _ramflow(
            "train", *run, "--clip-grad", clip, "--batch-size", "2", "--data", corpus_file,
            "--device", "cpu", "--nproc-per-node", "2", "--out", out, env=_env(_shm(shm_root)),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        losses[clip] = (_losses(out), _losses(out, "eval"))
        steps = [r for r in read_log(out / "log.jsonl") if r.get("event") == "step"]
        # after the first (whose loop pattern ramflow learns), every step ran in backward
        eager = [r["steps_in_backward"] for r in steps[1:]]
        assert eager == [clip == "0"] * len(eager), (clip, eager)
    assert losses["0"] == losses["1e9"]
    assert sorted(losses["0"][0]) == list(range(1, 7))


@pytest.mark.slow
def test_checkpoint_holds_weights_once_and_each_ranks_optimizer_shard(two_rank_run):
    out, _, _, _ = two_rank_run
    ckpt = open_checkpoint(out)
    names = {p.name for p in ckpt.path.iterdir()}
    assert "model.safetensors" in names and "optimizer.safetensors" not in names
    shards = [rank_file("optimizer.safetensors", r) for r in range(2)]
    assert set(shards) <= names and set(shards) <= set(ckpt.state["files"])
    assert ckpt.state["num_ranks"] == 2 and len(ckpt.state["optimizer_ranks"]) == 2
    from safetensors.torch import load_file

    states = [load_file(str(ckpt.path / s)) for s in shards]
    keys = [set(s) for s in states]
    # ZeRO: each unit's states on one rank, all of them on some rank
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    weights = load_file(str(ckpt.path / "model.safetensors"))
    params = {k.rpartition("::")[0] for k in keys[0] | keys[1]}
    assert params <= set(weights) and len(params) >= len(weights) - 1  # tied head: one name


@pytest.mark.slow
def test_resume_on_two_ranks_is_exact(two_rank_run, tmp_path):
    """Resuming the step-3 checkpoint on 2 ranks (ramflow's own launcher) computes steps
    4-6 bit for bit as the uninterrupted run."""
    out, shm, _, _ = two_rank_run
    full, val_full = _losses(out), _losses(out, "eval")
    ckpt3 = out / "checkpoints" / "step-00000003"
    resumed = tmp_path / "resumed"
    done = _ramflow(
        "train", "--resume", ckpt3, "--out", resumed, "--nproc-per-node", "2", "--no-progress",
        env=_env(shm),
    )  # fmt: skip
    # --out elsewhere than the checkpoint's run: a new folder, the same steps
    assert done.returncode == 0, done.stderr[-3000:]
    again = _losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert all(again[s] == full[s] for s in again), (again, full)
    assert _losses(resumed, "eval")[6] == val_full[6]


@pytest.mark.slow
def test_resume_with_another_number_of_ranks_is_refused(two_rank_run, tmp_path):
    out, shm, _, _ = two_rank_run
    done = _ramflow("train", "--resume", out, "--out", tmp_path / "x", env=_env(shm))
    assert done.returncode == 2
    assert "was written by 2 ranks, this run has 1: resume it with 2 ranks" in done.stderr
    assert "--nproc-per-node 2" in done.stderr
    assert not (tmp_path / "x").exists()


def test_check_num_ranks_names_how_to_resume(tmp_path):
    one = Checkpoint(tmp_path / "step-00000001", 1, {})
    check_num_ranks(one, 1)
    with pytest.raises(CheckpointError, match="written by 1 rank, this run has 4: resume it "
                       "with one process"):  # fmt: skip
        check_num_ranks(one, 4)


# ---------------------------------------------------------------- faults


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_and_the_run_resumes(
    two_rank_run, corpus_file, tmp_path, shm_root
):
    """Rank 1 killed (SIGKILL) at the start of step 5: rank 0 fails with ramflow's message
    naming it, the launcher exits with the killed rank's status, no store file stays, and
    the run resumes from the step-3 checkpoint bit for bit."""
    out, _, _, device = two_rank_run
    shm = _shm(shm_root)
    run = tmp_path / "run"
    args = (
        "train", *RUN, "--batch-size", "2", "--data", corpus_file, "--device", device,
        "--out", run, "--nproc-per-node", "2", "--dist-timeout", "60",
    )  # fmt: skip
    done = _ramflow(*args, env=_env(shm, RAMFLOW_TEST_FAULT="kill:step:5:1"))
    assert done.returncode == 128 + 9, done.stderr[-3000:]
    assert "ramflow train: rank 1 (PID" in done.stderr and "SIGKILL" in done.stderr
    assert "rank 1 (PID" in done.stderr and "on this host died" in done.stderr
    assert _shm_files(shm) == []
    assert open_checkpoint(run).step == 3
    again = _ramflow("train", "--resume", run, "--nproc-per-node", "2", "--no-progress",
                     env=_env(shm))  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(run) == _losses(out)
    assert _shm_files(shm) == []


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_kill_of_every_rank_during_a_save_keeps_the_previous_checkpoint(
    corpus_file, tmp_path, device, shm_root
):
    """SIGKILL of both ranks while they write their optimizer shards of the step-6 save:
    the step-3 checkpoint stays loadable and ``latest``; the next run clears the debris."""
    run = tmp_path / "run"
    shm = _shm(shm_root)
    args = (
        "train", *RUN, "--batch-size", "2", "--data", corpus_file, "--device", device,
        "--out", run, "--nproc-per-node", "2",
    )  # fmt: skip
    done = _ramflow(*args, env=_env(shm, RAMFLOW_TEST_FAULT="kill:optimizer:2"))
    assert done.returncode == 128 + 9, done.stderr[-3000:]
    ckpt = open_checkpoint(run)  # verifies every file of every rank
    assert ckpt.step == 3 and ckpt.path.name == "step-00000003"
    assert any(p.name.startswith(".step-00000006.tmp-") for p in (run / "checkpoints").iterdir())
    assert _shm_files(shm) == []
    # what the next run in the folder does first
    assert [r.startswith("removed .step-00000006.tmp-") for r in remove_stale_temporaries(
        run / "checkpoints")] == [True]  # fmt: skip
    assert open_checkpoint(run).step == 3


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_after_a_step_with_a_checkpoint(
    corpus_file, tmp_path, shm_root
):
    """A scheduler's SIGTERM to ``ramflow train --nproc-per-node 2`` reaches each rank
    once: they finish the same step, save it, and the launcher exits 143 (torchrun's agent
    would send a second signal, which aborts the save: see [Note: the launcher])."""
    run = tmp_path / "run"
    shm = _shm(shm_root)
    steps = ("--steps", "400", "--save-every", "0", "--eval-every", "0")
    argv = (
        "train", *RUN, *steps, "--batch-size", "2", "--data", corpus_file, "--device", "cpu",
        "--out", run, "--nproc-per-node", "2",
    )  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ramflow", *map(str, argv)],
        env=_env(shm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not _losses(run) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        assert _losses(run), "no step was logged"
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "interrupted (SIGTERM)" in out
    ckpt = open_checkpoint(run)
    done = max(_losses(run))
    assert 1 <= ckpt.step == done < 400
    assert _shm_files(shm) == []


# ---------------------------------------------------------------- set-up


def test_numa_binding_refuses_an_unknown_mode_and_none_binds_nothing():
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="--numa-binding 'nearest': choose one of exclusive"):
        bind_to_gpu_node(0, "nearest")
    assert bind_to_gpu_node(0, "none") is None
    assert os.sched_getaffinity(0) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_numa_binding_keeps_a_rank_on_cores_of_its_gpus_node():
    """In a child process (binding is for the whole process): "exclusive" binds to a
    subset of the CPUs it was allowed (the whole set where the GPU has its node to itself
    and nothing changes), through PyTorch's own topology reading; a thread the rank starts
    afterwards (the host worker, OpenMP's) inherits the binding."""
    code = (
        "import os, threading; from ramflow.train.ranks import bind_to_gpu_node\n"
        "allowed = os.sched_getaffinity(0)\n"
        "ex = bind_to_gpu_node(0, 'exclusive') or frozenset(allowed)\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join()\n"
        "assert ex <= allowed and seen[0] == ex, (ex, allowed, seen)\n"
        "print(len(allowed), len(ex))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(Path(tempfile.gettempdir())),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_ranks_from_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert Ranks.from_environment(env) == Ranks(3, 4, 1, 2)
    assert Ranks.from_environment({}) == Ranks()
    with pytest.raises(ValueError, match="do not fit WORLD_SIZE=2"):
        Ranks.from_environment({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="malformed"):
        Ranks.from_environment({"WORLD_SIZE": "two"})
    two = Ranks(1, 2, 1, 2)
    assert two.device("cpu") == "cpu" and two.device("cuda") == "cuda:1"
    with pytest.raises(ValueError, match="each rank takes the GPU of its LOCAL_RANK"):
        two.device("cuda:0")


@pytest.mark.parametrize(
    "refused,match",
    [
        ({"precision": "fp16"}, "--precision fp16"),
        ({"lora": True}, "--lora"),
        ({"auto_batch": True}, "--batch-size auto"),
    ],
)
def test_settings_several_ranks_refuse(refused, match):
    ok = {"precision": "bf16", "lora": False, "auto_batch": False}
    check_several_ranks(world_size=1, **{**ok, **refused})
    with pytest.raises(ValueError, match=f"2 ranks do not support {match}"):
        check_several_ranks(world_size=2, **{**ok, **refused})


def test_zero_stage_choice():
    assert choose_zero_stage(2).stage == 2
    assert choose_zero_stage(8, forced=1).stage == 1
    with pytest.raises(ValueError, match="at least 2 ranks"):
        choose_zero_stage(1)


def test_rank_environment_is_torchruns():
    env = rank_environment({"PATH": "x"}, rank=1, nproc=4, port=1234, threads=4)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "1", "1", "4", "4",
    )  # fmt: skip
    assert env["MASTER_PORT"] == "1234" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["PATH"] == "x"
