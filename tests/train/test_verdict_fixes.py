"""Every "does not fit" names the change that fits, as a flag to paste, with its figure from
the same estimate: ``plan`` and ``train`` say the same (issue 49, point 3). See [Note: a
verdict names the change that fits] in ``ramflow.train.setup``."""

from __future__ import annotations

import re

import psutil
import pytest

from ramflow.train import TrainConfig, plan_run

TINY_GPU = ("--preset", "tiny", "--device", "cuda", "--seq-len", "256")


class _Memory:
    def __init__(self, available: int) -> None:
        self.available = available
        self.total = available


def _ram(monkeypatch, num_bytes: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _Memory(num_bytes))


def _ram_needed(host_precision: str, **options) -> int:
    config = TrainConfig.from_options(host_precision=host_precision, **options)
    return plan_run(config).ram_needed_bytes


def test_out_of_ram_names_lean_in_plan_and_train(
    ramflow_cli, capsys, monkeypatch, tmp_path, corpus_file, fast
) -> None:
    """RAM between lean's need and fp32's: both commands refuse fp32 and name
    ``--host-precision lean`` with lean's figure; with that flag the plan fits."""
    cpu = {"preset": "tiny", "device": "cpu", "seq_len": 32, "batch_size": 2}
    lean, fp32 = _ram_needed("lean", **cpu), _ram_needed("fp32", **cpu)
    assert lean < fp32
    _ram(monkeypatch, (lean + fp32) // 2)
    plan = ("plan", "--preset", "tiny", "--device", "cpu", "--seq-len", "32", "--batch-size", "2")
    assert ramflow_cli(*plan) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "DOES NOT FIT this machine" in first
    m = re.search(r"it fits with --host-precision lean: RAM ([\d.]+ [KMG]iB) of", first)
    assert m, first
    assert ramflow_cli(*plan, "--host-precision", "lean") == 0
    assert f"RAM {m.group(1)} of" in capsys.readouterr().out.splitlines()[0]

    out = tmp_path / "run"
    rc = ramflow_cli("train", "--data", corpus_file, "--out", out, "--steps", "1", *fast)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"It fits with --host-precision lean: RAM {m.group(1)} of" in err, err
    assert not out.exists()  # refused before anything is written


def test_no_lean_hint_where_lean_does_not_fit_either(ramflow_cli, capsys, monkeypatch) -> None:
    _ram(monkeypatch, 16 << 20)
    assert ramflow_cli("plan", *TINY_GPU, "--gpu-memory", "1GiB") == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert "DOES NOT FIT" in first and "it fits with" not in first


def test_a_disk_too_small_names_what_fits(ramflow_cli, capsys, monkeypatch, tmp_path) -> None:
    """One checkpoint over the free disk: lean's smaller checkpoint where it fits, else no
    checkpoint at all."""
    import shutil

    ckpt = {
        hp: plan_run(
            TrainConfig.from_options(
                preset="tiny", device="cuda", gpu_memory="1GiB", host_precision=hp
            )
        ).checkpoint_bytes
        for hp in ("fp32", "lean")
    }
    usage = shutil.disk_usage(tmp_path)
    for free, fix in (
        ((ckpt["fp32"] + ckpt["lean"]) // 2, "it fits with --host-precision lean: RAM "),
        (ckpt["lean"] // 2, "it fits with --keep-checkpoints 0 (no checkpoint written)"),
    ):
        monkeypatch.setattr(shutil, "disk_usage", lambda _p, f=free: usage._replace(free=f))
        rc = ramflow_cli("plan", "--preset", "tiny", "--gpu-memory", "1GiB", "--out", tmp_path)
        first = capsys.readouterr().out.splitlines()[0]
        assert rc == 1
        assert "a checkpoint takes" in first and fix in first, first


def _suggested_flags(line: str) -> list[str]:
    m = re.search(r"It fits with ((?:--[\w-]+ \w+ ?)+):", line)
    assert m, line
    return m.group(1).split()


@pytest.mark.parametrize("checkpointing", ["off", "auto"])
def test_a_budget_too_small_names_a_change_that_fits_it(
    ramflow_cli, capsys, checkpointing: str
) -> None:
    """A budget under the run's micro-batch of 8: the verdict names heavier checkpointing or
    a smaller micro-batch that fits, and the plan with those flags fits that budget."""
    small = TrainConfig.from_options(
        preset="tiny", device="cuda", gpu_memory="4GiB", seq_len=256, batch_size=1,
        checkpointing="offload",
    )  # fmt: skip
    budget = f"{plan_run(small).device_total_bytes * 1.02 / 2**20:.2f}MiB"
    argv = ("plan", *TINY_GPU, "--gpu-memory", budget, "--batch-size", "8")
    assert ramflow_cli(*argv, "--checkpointing", checkpointing) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT this budget" in out
    flags = _suggested_flags(out.splitlines()[0])
    if "--batch-size" in flags:
        assert "the same global batch of 8" in out
        assert (
            int(flags[flags.index("--grad-accum") + 1])
            * int(flags[flags.index("--batch-size") + 1])
            == 8
        )
    argv = ("plan", *TINY_GPU, "--gpu-memory", budget, "--global-batch", "8")
    rest = {"--checkpointing": checkpointing, "--batch-size": "8"}
    rest.update(dict(zip(flags[::2], flags[1::2])))
    rest.pop("--grad-accum", None)  # --global-batch keeps it
    assert ramflow_cli(*argv, *[w for kv in rest.items() for w in kv]) == 0, capsys.readouterr()
    capsys.readouterr()


def test_auto_batch_under_a_ram_refusal_says_what_it_fitted(
    ramflow_cli, capsys, monkeypatch
) -> None:
    """``--batch-size auto`` fits the device budget only: under a RAM refusal its lines say
    "fits the device budget", never a bare "fits"."""
    _ram(monkeypatch, 16 << 20)
    rc = ramflow_cli(
        "plan", *TINY_GPU, "--gpu-memory", "1GiB", "--batch-size", "auto",
        "--host-precision", "auto",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT this machine" in out.splitlines()[0]
    assert "(auto: neither fp32 nor lean fits" in out
    tried = [line for line in out.splitlines() if "tried " in line]
    assert tried and "): fits the device budget" in tried[-1]
    assert not re.search(r"\): fits\)?$", out, re.M)


def test_the_lean_hint_of_several_ranks_counts_all_of_them(
    ramflow_cli, capsys, monkeypatch
) -> None:
    """``plan --nproc-per-node 2``: the alternative must fit the RAM of both ranks, and its
    figure is theirs."""
    from ramflow.train.scale import plan_ranks

    def ranks_need(host_precision: str) -> int:
        config = TrainConfig.from_options(
            preset="tiny", device="cuda", gpu_memory="1GiB", host_precision=host_precision
        )
        return plan_ranks(plan_run(config, num_ranks=2), num_ranks=2).ram_needed_bytes

    lean, fp32 = ranks_need("lean"), ranks_need("fp32")
    _ram(monkeypatch, (lean + fp32) // 2)
    plan = ("plan", "--preset", "tiny", "--gpu-memory", "1GiB", "--nproc-per-node", "2")
    assert ramflow_cli(*plan) == 1
    first = capsys.readouterr().out.splitlines()[0]
    m = re.search(r"it fits with --host-precision lean: RAM ([\d.]+ [KMG]iB) \(2 ranks\) of", first)
    assert m, first
    assert ramflow_cli(*plan, "--host-precision", "lean") == 0
    assert f"RAM {m.group(1)} (2 ranks) of" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    ("cadence", "at_once"),
    [
        (("--steps", "4", "--save-every", "2"), 2),  # the new one beside the kept one
        (("--steps", "10", "--save-every", "2", "--keep-checkpoints", "3"), 4),
        (("--steps", "10", "--save-every", "0", "--keep-checkpoints", "3"), 1),
        (("--steps", "4", "--save-every", "2", "--keep-checkpoints", "0"), 0),
    ],
    ids=["two", "keep 3", "only at the end", "none"],
)
def test_plan_and_train_count_the_same_checkpoints_on_disk(
    ramflow_cli, capsys, monkeypatch, tmp_path, corpus_file, fast, cadence, at_once: int
) -> None:
    """``plan`` takes ``train``'s --steps, --save-every and --keep-checkpoints, and both
    count the checkpoints on disk at once in one place: the same bytes, the same verdict
    in the same words, and the same change that fits (issue 49)."""
    import shutil

    from ramflow.train.setup import prepare_run

    options = {"seq_len": 32, "batch_size": 2, "device": "cpu", "data": str(corpus_file)}
    flags = dict(zip(cadence[::2], cadence[1::2]))
    config = TrainConfig.from_options(
        **options,
        steps=int(flags["--steps"]),
        save_every=int(flags["--save-every"]),
        keep_checkpoints=int(flags.get("--keep-checkpoints", 1)),
    )
    out = tmp_path / "run"
    planned = plan_run(config, out_dir=out)
    prepared = prepare_run(config, None, out).estimate
    assert planned.disk_checkpoints == prepared.disk_checkpoints == at_once
    assert planned.disk_needed_bytes == prepared.disk_needed_bytes
    assert planned.fits_disk and prepared.fits_disk  # this machine's disk holds them

    # a disk with room for one checkpoint and a half
    one = planned.checkpoint_bytes
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage._replace(free=one * 3 // 2))
    shape = ("--seq-len", "32", "--batch-size", "2", "--device", "cpu")
    plan_rc = ramflow_cli("plan", *shape, *cadence, "--out", out)
    first = capsys.readouterr().out.splitlines()[0]
    if at_once <= 1:
        assert plan_rc == 0 and "fits this machine" in first, first
        return
    assert plan_rc == 1, first
    assert f"needs room for {at_once} at once while saving" in first, first
    assert "it fits with --save-every 0 (save only at the end)" in first, first
    train_rc = ramflow_cli(
        "train", "--data", corpus_file, "--eval-every", "0", *fast, *cadence, "--out", out
    )
    err = capsys.readouterr().err.strip()
    assert train_rc == 2 and len(err.splitlines()) == 1, err
    said = err.split("ramflow train: error: ", 1)[1]
    assert first.endswith(f"DOES NOT FIT this machine: {said}"), (first, said)
    assert not out.exists()  # refused before anything is written


def _needed(checkpointing: str, **options) -> int:
    """The smallest device budget of a micro-batch of 1 (``BudgetTooSmall``'s figure)."""
    from ramflow.memory.estimate import BudgetTooSmall

    config = TrainConfig.from_options(
        batch_size=1, checkpointing=checkpointing, gpu_memory="1KiB", **options
    )
    with pytest.raises(BudgetTooSmall) as err:
        plan_run(config)
    assert err.value.needed_bytes is not None
    return err.value.needed_bytes


@pytest.mark.parametrize("checkpointing", ["auto", "off"])
def test_auto_batch_size_that_nothing_fits_is_a_verdict_naming_what_fits(
    ramflow_cli, capsys, tmp_path, corpus_file, checkpointing: str
) -> None:
    """``--batch-size auto`` where no micro-batch fits the budget: ``plan`` says DOES NOT
    FIT (exit 1) and ``train`` refuses (exit 2) in the same words, naming the change that
    fits (heavier checkpointing, else a larger --gpu-memory); with it the plan fits."""
    shape = {"preset": "tiny", "device": "cpu", "seq_len": 64}
    if checkpointing == "auto":  # under a micro-batch of 1 with the layers' inputs offloaded
        budget, fix = 0.8 * _needed("offload", **shape), "--gpu-memory"
    else:  # between checkpointing on's need and off's
        on, off = _needed("on", **shape), _needed("off", **shape)
        assert on < off
        budget, fix = (on + off) / 2, "--checkpointing"
    argv = (
        "--preset", "tiny", "--device", "cpu", "--seq-len", "64", "--batch-size", "auto",
        "--checkpointing", checkpointing, "--gpu-memory", f"{budget / 2**20:.3f}MiB",
    )  # fmt: skip
    assert ramflow_cli("plan", *argv) == 1
    first = capsys.readouterr().out.splitlines()[0]
    m = re.search(rf"It fits with ({fix} \S+):", first)
    assert "DOES NOT FIT this budget: --batch-size auto: no micro-batch" in first and m, first
    out = tmp_path / "run"
    assert ramflow_cli("train", *argv, "--data", corpus_file, "--out", out, "--no-progress") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and first.endswith(err.split("error: ", 1)[1]), err
    assert not out.exists()
    # the change it names fits
    flag, value = m.group(1).split()
    fixed = dict(zip(argv[::2], argv[1::2])) | {flag: value}
    assert ramflow_cli("plan", *[w for kv in fixed.items() for w in kv]) == 0
    assert "fits this machine" in capsys.readouterr().out.splitlines()[0]
