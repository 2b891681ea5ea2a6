"""``ramflow.offload(model, weights=...)``: a meta-device model read into the host store unit
by unit (src/ramflow/io/loading.py)."""

from __future__ import annotations

import concurrent.futures
import copy
import io
import json
import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ramflow
from ramflow.io import loading as _loading

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _config(family: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if family == "llama":  # untied head
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    return transformers.Qwen2Config(**common, tie_word_embeddings=True)  # tied head


def _reference(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 and biases away from 0: every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)


def _save(model: nn.Module, directory: Path, *, sharded: bool) -> Path:
    # small shards: several per model, a unit's tensors spread over two files
    model.save_pretrained(directory, max_shard_size="40KB" if sharded else "1GB")
    return directory


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module) -> torch.Tensor:
    """Logits, then one AdamW step on the cross-entropy of the next token."""
    opt = ramflow.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids()
    logits = model(ids).logits
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    ramflow.synchronize(model)
    return logits.detach()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["one file", "sharded"])
def test_meta_model_loads_as_the_regular_model(tmp_path, family, layout):
    """Logits, one training step and the weights after it equal the regular model's, bit
    for bit (fp32 wire on the CPU), with the head tied where the config ties it."""
    ref = _reference(family)
    folder = _save(ref, tmp_path, sharded=layout == "sharded")
    assert (folder / "model.safetensors.index.json").is_file() == (layout == "sharded")
    model = _meta(family)
    ramflow.offload(model, device="cpu", weights=folder)
    ramflow.offload(ref, device="cpu")
    if family == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_step(model), _step(ref))
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name
    assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_rotary_buffers_are_recomputed(tmp_path):
    """Non-persistent buffers are on the meta device after a meta build and in no file:
    the model's own init computes them, as from_pretrained does."""
    ref = _reference("llama")
    model = _meta("llama")
    assert model.model.rotary_emb.inv_freq.is_meta
    ramflow.offload(model, device="cpu", weights=_save(ref, tmp_path, sharded=False))
    for name, buf in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name


def test_weights_as_a_file_or_an_index(tmp_path):
    ref = _reference("llama")
    one = _save(ref, tmp_path / "one", sharded=False) / "model.safetensors"
    index = _save(ref, tmp_path / "sharded", sharded=True) / "model.safetensors.index.json"
    expected = ref(_ids()).logits
    for path in (one, str(index)):
        model = _meta("llama")
        ramflow.offload(model, device="cpu", weights=path)
        assert torch.equal(model(_ids()).logits, expected)


def test_tied_weight_found_under_either_name(tmp_path):
    """A checkpoint that keeps the tied tensor under the head's name loads as well."""
    ref = _reference("qwen2")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, tmp_path / "model.safetensors")
    model = _meta("qwen2")
    ramflow.offload(model, device="cpu", weights=tmp_path)
    assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_weights_function(tmp_path):
    """A function writes each parameter once (a tied one under its first name), into a
    CPU tensor of its shape; buffers are computed as for a file."""
    ref = _reference("qwen2")
    state = ref.state_dict()
    names: list[str] = []

    def weights(name: str, out: torch.Tensor) -> None:
        assert out.device.type == "cpu" and out.shape == state[name].shape
        names.append(name)
        out.copy_(state[name])

    model = _meta("qwen2")
    ramflow.offload(model, device="cpu", weights=weights)
    assert sorted(names) == sorted(n for n, _ in ref.named_parameters())
    assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_checkpoint_names_are_the_models_or_converted_by_transformers(tmp_path):
    """A checkpoint under the model's own names loads as it is; one under names that
    transformers converts (GPT-NeoX's head saved as ``embed_out``) goes through its
    conversion tables."""
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = tmp_path / "own.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(own))
    converted = _save(ref, tmp_path / "pretrained", sharded=False)
    keys = set(load_file(str(converted / "model.safetensors")))
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mapper = _loading.checkpoint_key_mapper(meta, keys)
    assert mapper("embed_out.weight") == ("lm_head.weight", False)
    assert all(mapper(k)[0] in ref.state_dict() for k in keys)
    for weights in (own, converted):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        ramflow.offload(model, device="cpu", weights=weights)
        assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_a_long_load_shows_its_progress_on_a_terminal(tmp_path, monkeypatch, terminal):
    """The bar counts every parameter once (a tied one too) and is closed with the loader;
    where stderr is no terminal nothing is written."""
    ref = _reference("qwen2")
    folder = _save(ref, tmp_path, sharded=True)
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(_loading, "PROGRESS_DELAY_S", 0.0)
    model = _meta("qwen2")
    ramflow.offload(model, device="cpu", weights=folder)
    if not terminal:
        assert stderr.getvalue() == ""
        return
    n = sum(p.numel() for p in ref.parameters())
    last = stderr.getvalue().split("\r")[-1]
    assert "ramflow: loading weights: 100%" in last, last
    assert f"{n / 1e3:.1f}k/{n / 1e3:.1f}k" in last, last


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "file_dtype,out_dtype",
    [
        (torch.bfloat16, torch.bfloat16),  # read straight into the master
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),  # read into scratch, cast by waves
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_reader_gives_safe_opens_values_bit_for_bit(
    tmp_path, monkeypatch, threads, file_dtype, out_dtype
):
    """The parallel reader writes what ``out.copy_(safe_open(...).get_tensor(key))`` (the
    path before it) writes, bit for bit, in pieces small enough that tensors span several
    pieces, waves and threads (sizes not multiples of the piece)."""
    from ramflow.io import loading as _loading

    monkeypatch.setattr(_loading, "READ_PIECE_BYTES", 4096 + 64)
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (37, 61), "b": (5000,), "c": (3, 1, 7), "empty": (0, 4), "d": (4133,)}
    state = {k: torch.randn(shape, generator=g).to(file_dtype) for k, shape in shapes.items()}
    save_file(state, tmp_path / "w.safetensors")
    reader = _loading.SafetensorsReader(num_threads=threads)
    outs = {k: torch.full(shape, 7.0, dtype=out_dtype) for k, shape in shapes.items()}
    try:
        reader.read([(tmp_path / "w.safetensors", k, out) for k, out in outs.items()])
    finally:
        reader.close()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu") as f:
        for k, out in outs.items():
            expected = torch.empty(shapes[k], dtype=out_dtype)
            expected.copy_(f.get_tensor(k))
            assert torch.equal(out, expected), k


def test_a_file_cut_after_its_check_is_named(tmp_path):
    from ramflow.io.loading import SafetensorsReader

    save_file({"a": torch.ones(1000)}, tmp_path / "w.safetensors")
    reader = SafetensorsReader(num_threads=2)
    reader._file(tmp_path / "w.safetensors")  # header read, file open
    with open(tmp_path / "w.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(ValueError, match="w.safetensors ends before its header says"):
        reader.read([(tmp_path / "w.safetensors", "a", torch.empty(1000))])
    reader.close()


@pytest.mark.parametrize("precision", ["lean", "fp32"])
def test_offloaded_masters_hold_the_files_values(tmp_path, precision):
    """bf16 files into bf16 masters (lean: read in place) and into fp32 masters (cast):
    every parameter's master is the file's tensor in the master's dtype, bit for bit,
    as the path before the parallel reader gave it."""
    ref = _reference("llama").to(torch.bfloat16)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    expected = {}
    for f in tmp_path.glob("*.safetensors"):
        expected.update(load_file(f))
    model = _meta("llama")
    ramflow.offload(model, device="cpu", weights=tmp_path, host_precision=precision)
    master_dtype = ramflow.HostPrecision.parse(precision).master_dtype
    for name, p in model.named_parameters():
        assert p.dtype == master_dtype
        assert torch.equal(p.detach(), expected[name].to(master_dtype)), name


def _all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_missing_or_misshapen_tensors_are_named_and_nothing_changes(tmp_path):
    ref = _reference("llama")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, tmp_path / "model.safetensors")
    model = _meta("llama")
    with pytest.raises(ValueError) as err:
        ramflow.offload(model, device="cpu", weights=tmp_path)
    assert "model.layers.1.mlp.up_proj.weight: missing" in str(err.value)
    assert "model.norm.weight: file (31,), model (32,)" in str(err.value)
    assert _all_meta(model) and not ramflow.is_offloaded(model)


def test_a_tensor_in_two_files_of_a_folder_without_index_is_refused(tmp_path):
    """A stale shard beside newer ones: the last file read used to win, silently."""
    ref = _reference("llama")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, tmp_path / "a.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "b.safetensors")
    model = _meta("llama")
    with pytest.raises(ValueError, match="in both .*a.safetensors and .*b.safetensors"):
        ramflow.offload(model, device="cpu", weights=tmp_path)
    assert _all_meta(model) and not ramflow.is_offloaded(model)


def test_a_failure_while_loading_gives_the_model_back_on_meta():
    """An error in the middle (here the weights function's, after some units were built)
    leaves the model as it came: on the meta device, not offloaded, ready for a retry."""
    calls = []

    def weights(name: str, out: torch.Tensor) -> None:
        calls.append(name)
        if len(calls) == 6:
            raise OSError("disk gone")
        out.fill_(0.5)

    model = _meta("llama")
    tied_before = [id(p) for p in model.parameters()]
    with pytest.raises(OSError, match="disk gone"):
        ramflow.offload(model, device="cpu", weights=weights)
    assert _all_meta(model) and not ramflow.is_offloaded(model)
    assert [id(p) for p in model.parameters()] == tied_before
    ramflow.offload(model, device="cpu", weights=lambda name, out: out.fill_(0.5))
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_weights_misuse():
    with pytest.raises(ValueError, match="weights="):  # meta without weights
        ramflow.offload(_meta("llama"), device="cpu")
    plain = _reference("llama")
    before = copy.deepcopy(plain.state_dict())
    with pytest.raises(ValueError, match="hold data already: offload it without weights="):
        ramflow.offload(plain, device="cpu", weights=lambda name, out: None)
    assert not ramflow.is_offloaded(plain)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in before.items())
    with pytest.raises(TypeError, match="weights= takes a path"):
        ramflow.offload(_meta("llama"), device="cpu", weights=3)
    with pytest.raises(FileNotFoundError):
        ramflow.offload(_meta("llama"), device="cpu", weights="/nonexistent/folder")


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.register_buffer("shift", torch.full((4,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.shift


def test_plain_module_buffers(tmp_path):
    """Persistent buffers of a plain module come from the file; a non-persistent buffer on
    the meta device (computed in __init__, in no file) is refused with what to do."""
    torch.manual_seed(0)
    ref = nn.Sequential(_Scaled(), _Scaled())
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = nn.Sequential(_Scaled(), _Scaled())
    with pytest.raises(ValueError, match="non-persistent buffers on the meta device"):
        ramflow.offload(model, device="cpu", weights=tmp_path)
    assert _all_meta(model)
    for m in model:  # the documented way out: buffers on the CPU, parameters on meta
        m.scale = torch.full((4,), 2.0)
    ramflow.offload(model, device="cpu", weights=tmp_path)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), ref(x))


def test_state_dict_is_views_of_the_master(tmp_path):
    """With fp32 masters, ``state_dict()`` copies nothing: a checkpoint save writes from
    the host store itself (bounded shards, see the peak test below)."""
    model = _meta("llama")
    ramflow.offload(model, device="cpu", weights=lambda name, out: out.normal_())
    engine = ramflow.api._engine(model)
    masters = [(u.master.data_ptr(), u.master.data_ptr() + u.master.nbytes) for u in engine.units]
    for name, t in model.state_dict().items():
        if name in dict(model.named_parameters()):
            assert any(lo <= t.data_ptr() < hi for lo, hi in masters), name


# ------------------------------------------------------------------ peak host memory

SHARD_BYTES = 24 << 20
# Allocator rounding, Python objects, threads' stacks, safetensors headers and code pages of
# torch ops met for the first time: 8.5 to 10.6 MiB measured. 16 MiB stays clear of that
# and below what reading through mapped files cost (a shard and a unit: 30 MiB measured),
# far below a second copy of the 200 MiB model (or of its 100 MiB lean store).
MARGIN_BYTES = 16 << 20


def _big_config():
    # ~200 MiB in fp32 over 64 small decoder layers (~3 MiB each)
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=64,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip


def _load_and_save(source: str, out: str | None, precision: str) -> dict[str, int]:
    """In a fresh process: load the sharded folder ``source`` (or the seeded init, for
    ``"seeded"``) into a meta-built model, then (``out``) save its weights as the
    trainer's checkpoints do. Returns RSS figures and the byte model's in bytes."""
    import psutil
    import transformers

    from ramflow.io import loading as _loading
    from ramflow.train.initialization import CHUNK_ELEMENTS, SeededInit
    from ramflow.train.run_checkpoint import _save_sharded, _weights_to_save

    def reset_peak() -> None:
        # ru_maxrss would carry the parent's peak over fork and exec; VmHWM is this
        # process's own, and writing 5 to clear_refs resets it (Linux 4.0+)
        Path("/proc/self/clear_refs").write_text("5")

    def peak() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
        raise AssertionError("no VmHWM in /proc/self/status")

    # warm-up: the same code paths on a tiny model, so their pages count in the baseline
    with torch.device("meta"):
        tiny = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    ramflow.offload(tiny, device="cpu", weights=lambda name, out: out.zero_())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_big_config(), dtype=torch.float32)
    threads = _loading.default_num_threads()
    if source == "seeded":
        weights, scratch = SeededInit(model, seed=0), threads * CHUNK_ELEMENTS * 4
    else:
        weights, scratch = source, threads * _loading.READ_PIECE_BYTES
    reset_peak()
    base = psutil.Process().memory_info().rss
    ramflow.offload(model, device="cpu", weights=weights, host_precision=precision)
    loaded = peak()
    engine = ramflow.api._engine(model)
    parts = engine.host.precision.host_bytes(engine.units, engine.wire_dtype)
    r = {"base": base, "loaded": loaded, "load_bytes": parts.master + parts.wire,
         "scratch": scratch}  # fmt: skip
    if out is not None:
        reset_peak()
        r["before_save"] = psutil.Process().memory_info().rss
        _save_sharded(
            _weights_to_save(model), Path(out), "model.safetensors",
            "model.safetensors.index.json", max_shard_bytes=SHARD_BYTES,
        )  # fmt: skip
        r["saved"] = peak()
    return r


def _in_a_fresh_process(monkeypatch, *args) -> dict[str, int]:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # RSS counts live memory: see test_reliability
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_load_and_save, *args).result(timeout=600)


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    big = transformers.AutoModelForCausalLM.from_config(_big_config(), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("big")
    big.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    return folder


def test_loading_peaks_at_the_store_and_saving_at_one_shard(big_folder, tmp_path, monkeypatch):
    """Peak RSS while loading a 200 MiB model from 24 MiB shards into fp32 masters grows by
    the store the byte model gives (``HostPrecision.host_bytes``: master and wire) plus
    MARGIN_BYTES (measured: 8.7 MiB over a 209 MiB store): the files are read into the
    masters, never mapped, and no tensor is held beside its master (reading through
    mapped files peaked at the store plus a unit plus a shard: 30 MiB over). Saving it back in bounded
    shards adds at most one shard (measured: 1.4 MiB, as safetensors writes from the
    tensors' memory)."""
    (tmp_path / "out").mkdir()
    r = _in_a_fresh_process(monkeypatch, str(big_folder), str(tmp_path / "out"), "fp32")
    assert r["load_bytes"] > 190 << 20
    assert r["loaded"] - r["base"] <= r["load_bytes"] + MARGIN_BYTES, r
    assert r["saved"] - r["before_save"] <= SHARD_BYTES + MARGIN_BYTES, r
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    first = load_file(tmp_path / "out" / files[0])
    assert all(t.dtype == torch.float32 for t in first.values())


@pytest.mark.parametrize("source", ["files", "seeded"])
def test_lean_loading_peaks_at_the_store_plus_the_readers_scratch(big_folder, monkeypatch, source):
    """Into lean's bf16 masters, from fp32 files (read into each thread's scratch piece and
    cast) or drawn by the seeded init (in fp32, a chunk per thread, then rounded), peak RSS
    grows by the byte model's store (100 MiB) plus that scratch (threads x 16 MiB) plus
    MARGIN_BYTES; an fp32 copy of a unit beside it, or of the model, would pass it."""
    folder = str(big_folder) if source == "files" else "seeded"
    r = _in_a_fresh_process(monkeypatch, folder, None, "lean")
    assert r["load_bytes"] > 95 << 20
    assert r["loaded"] - r["base"] <= r["load_bytes"] + r["scratch"] + MARGIN_BYTES, r


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["lean", "fp32"])
def test_masters_are_locked_after_the_fill_with_the_files_values(tmp_path, precision):
    """On CUDA the buffers the DMA reads (lean's bf16 masters, fp32's bf16 wire copies)
    are page-locked after the fill (see [Note: filling the host store]) and hold the
    files' values; logits equal those of the model loaded on the CPU."""
    from ramflow.transfer import streams as _streams

    ref = _reference("llama")
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    before = _streams.registered_bytes()
    model = _meta("llama")
    ramflow.offload(model, device="cuda", weights=tmp_path, host_precision=precision)
    engine = ramflow.api._engine(model)
    for u in engine.units:
        if u.wire.numel():
            assert u.wire.is_pinned(), u.name
    locked = sum(u.wire.untyped_storage().nbytes() for u in engine.units if u.wire.numel())
    assert _streams.registered_bytes() - before >= locked
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    master_dtype = ramflow.HostPrecision.parse(precision).master_dtype
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), expected[name].to(master_dtype)), name
    ramflow.undo(model)
    assert _streams.registered_bytes() == before


def test_a_folder_without_safetensors_weights_is_named(tmp_path):
    """``weight_files``' refusals: each says which file or folder, and why."""
    weight_files = _loading.weight_files
    with pytest.raises(FileNotFoundError, match=r"absent does not exist$"):
        weight_files(tmp_path / "absent")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(
        FileNotFoundError, match=r"holds no safetensors weights \(only pickled \.bin"
    ):
        weight_files(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"\.bin is neither a \.safetensors file nor a "):
        weight_files(tmp_path / "pytorch_model.bin")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"the index lists weight files that are missing: "):
        weight_files(tmp_path)
    index.write_text(json.dumps({"weights": {}}))
    with pytest.raises(ValueError, match=r"index\.json is not a valid safetensors index: "):
        weight_files(index)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match=r"broken\.safetensors is not a readable safetensors file"):
        _loading.open_safetensors(broken)
