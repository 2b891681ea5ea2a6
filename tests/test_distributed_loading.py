"""Loading once per host: ``ramflow.offload(meta_model, zero_stage=..., weights=...)`` on
real processes (gloo on the CPU; NCCL on the GPU box). Each rank builds the model on the
meta device; each fills the units it owns into its host's shared copy; a failure on one
rank fails every rank and leaves nothing behind. See [Note: loading once per host] in
``ramflow.distributed.zero``."""

from __future__ import annotations

import os

import pytest
import torch

import dist_workers as W
from ramflow.distributed.zero import STORE_FILE
from ramflow.io.loading import load_resident
from ramflow.train.initialization import SeededInit

transformers = pytest.importorskip("transformers")


def _check_ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r and "exitcode" not in r and "timeout" not in r, (rank, r)


def _resident(options: dict) -> torch.nn.Module:
    """The model ``load_meta`` loads, built by one process, resident."""
    model = W.meta_model(options)
    if "folder" in options:
        return load_resident(model, options["folder"])
    return load_resident(model, SeededInit(model, seed=0, num_threads=1))


def _nccl(world_size: int):
    enough = pytest.mark.skipif(
        torch.cuda.device_count() < world_size, reason=f"needs {world_size} CUDA devices"
    )
    return pytest.param("nccl", marks=[pytest.mark.gpu, enough])


@pytest.mark.parametrize("backend", ["gloo", _nccl(2)])
def test_each_rank_draws_the_units_it_owns_into_one_host_copy(tmp_path, backend):
    """Two ranks: each draws exactly the parameters of the units it owns, every parameter
    is drawn once, both map the same files (nothing private), and the weights and outputs
    are those of the model built resident by one process, bit for bit."""
    options = {"out": str(tmp_path), "backend": backend, "all_states": True}
    results = W.run(W.load_meta, 2, options)
    _check_ok(results)
    drawn = [r["drawn"] for r in results]
    assert all(sorted(d) == sorted(r["owned"]) for d, r in zip(drawn, results))
    assert all(drawn)  # both ranks took part
    ref = _resident(options)
    assert sorted(drawn[0] + drawn[1]) == sorted(n for n, _ in ref.named_parameters())
    assert results[0]["memory"]["files"] == results[1]["memory"]["files"]
    assert all(r["memory"]["private"] == 0 for r in results), [r["memory"] for r in results]
    for r in results:
        for k, v in ref.state_dict().items():
            assert torch.equal(r["state"][k], v), k
    if backend == "gloo":  # fp32 wire on the CPU: the resident model's outputs exactly
        expected = ref(W.batches()[0][0])
        assert all(torch.equal(r["out"], expected) for r in results)


@pytest.mark.parametrize("host_precision", [None, "lean"])
def test_checkpoint_folder_loads_once_per_host(tmp_path, host_precision):
    """A ``transformers`` checkpoint in shards read by two ranks into one host copy: fp32
    masters equal the checkpoint bit for bit; lean (bf16) masters equal it rounded."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    options = {"out": str(tmp_path / "run"), "folder": str(tmp_path / "ckpt")}
    if host_precision is not None:
        options.update(host_precision=host_precision, wire_dtype=torch.bfloat16)
    results = W.run(W.load_meta, 2, options)
    _check_ok(results)
    state = results[0]["state"]
    for k, v in ref.state_dict().items():
        want = v if host_precision is None else v.bfloat16()
        assert torch.equal(state[k], want), k
    assert results[0]["memory"]["files"] == results[1]["memory"]["files"]


@pytest.mark.slow
def test_two_simulated_hosts_each_fill_their_own_copy(tmp_path):
    """Two hosts of two ranks: each host's ranks draw every parameter once between them
    into their own files; no host waits for another's weights."""
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    results = W.run(W.load_meta, 4, {"out": str(tmp_path), "hosts": hosts, "all_states": True})
    _check_ok(results)
    names = sorted(n for n, _ in _resident({}).named_parameters())
    for a, b in ((0, 1), (2, 3)):
        assert sorted(results[a]["drawn"] + results[b]["drawn"]) == names
        assert results[a]["memory"]["files"] == results[b]["memory"]["files"]
        assert all(f"-{hosts[a]}-" in f for f in results[a]["memory"]["files"])
    assert not set(results[0]["memory"]["files"]) & set(results[2]["memory"]["files"])
    for k, v in results[0]["state"].items():
        assert torch.equal(results[3]["state"][k], v), k


def _store_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if STORE_FILE.fullmatch(name))


@pytest.mark.parametrize("failure", ["weights function", "missing folder"])
def test_a_rank_that_fails_to_load_fails_every_rank(tmp_path, failure):
    """Rank 1 cannot load (its weights function raises while filling its units, or its
    folder is missing, found at the header check): rank 1 raises its own error, rank 0 a
    RuntimeError naming rank 1 and its message, at once instead of at the process group's
    timeout; both models are back on the meta device and no store file is left."""
    shm = tmp_path / "shm"
    shm.mkdir()
    options = {"out": str(tmp_path / "run"), "shm_dir": str(shm), "pg_timeout": 60}
    if failure == "weights function":
        options["fail_on"] = 1
        own = "OSError: cannot draw"
    else:
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )  # fmt: skip
        )
        ref.save_pretrained(tmp_path / "ckpt")
        options.update(folder=str(tmp_path / "ckpt"), missing_on=1)
        own = "FileNotFoundError"
    results = W.run(W.load_meta, 2, options, timeout=50)
    assert results[1]["error"].startswith(own), results[1]
    assert "RuntimeError" in results[0]["error"] and "on rank 1" in results[0]["error"]
    assert own in results[0]["error"], results[0]
    assert all(r["on_meta"] for r in results)
    assert _store_files(shm) == []


@pytest.mark.slow
def test_loading_peaks_at_the_store_plus_one_unit_per_rank(tmp_path):
    """Two ranks draw a 400 MB model (12 blocks of 34 MB, fp32 masters and wire on the
    CPU) into their host's copy. Each rank's private memory grows by less than one unit
    plus 64 MiB while it loads: the loader writes each tensor straight into the shared
    master (the seeded init draws in place), so the host holds the store (in the shared
    files, counted once) plus a bounded amount per rank: far below ramflow's promise of
    4 GiB per rank, and a rank that built a whole model first (400 MB) fails it."""
    options = {"out": str(tmp_path), "dim": 1024, "depth": 12}
    results = W.run(W.load_meta, 2, options, timeout=240)
    _check_ok(results)
    model = _resident(options)
    store = sum(-(-p.numel() // 256) * 256 * 4 for p in model.parameters())
    unit = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert store > 12 * unit
    for r in results:
        assert r["memory"]["rss"] >= 0.99 * store  # each maps the whole store (after a read)
        assert r["memory"]["private"] == 0
        assert r["memory"]["private_peak"] < unit + 64 * 2**20, (r["memory"], unit)
