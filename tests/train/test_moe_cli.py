"""``ramflow plan / train / generate --model DIR`` for mixtures of experts on the CPU and,
marked ``gpu``, on CUDA (issue 47), and the memory estimate's meta pass over the experts: it
runs them grouped whatever implementation the config names, and saves what a real grouped
run saves.

The folders are tiny Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3 and Qwen2-MoE configs
(``moe_models.py``) with random weights, written by ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_models import FAMILIES, moe_config, save_moe_folder
from ramflow.train import open_checkpoint
from ramflow.train.data import BatchStream, build_corpus, find_documents
from ramflow.train.estimate import _MetaKernelsMode, _run_experts_grouped, measure_activations
from ramflow.train.modeling import load_model, meta_model
from ramflow.train.report import read_log
from ramflow.train.tokenizer import load_tokenizer


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_moe_folder(family, tmp_path_factory.mktemp(family))


def test_plan_train_generate(
    model_dir: Path,
    device: torch.device,
    tmp_path: Path,
    corpus_file: Path,
    ramflow_cli,
    fast,
    capsys,
) -> None:
    fast = [device.type if a == "cpu" else a for a in fast]  # --device cuda on the GPU
    rc = ramflow_cli("plan", "--model", model_dir, "--device", device.type, "--seq-len", "32",
                     "--batch-size", "2")  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "2 layers" in out
    top_k, experts = 2, {"mixtral": 4, "gpt_oss": 4}.get(model_dir.name.rstrip("0123456789"), 8)
    assert f"M active per token: {top_k} of {experts} experts" in out

    run = tmp_path / "run"
    rc = ramflow_cli("train", "--model", model_dir, "--data", corpus_file, "--steps", "2",
                     "--eval-every", "2", *fast, "--out", run)  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err
    ids = torch.tensor([list(b"import os")])
    with torch.no_grad():
        trained = load_model(open_checkpoint(run).path).eval()(input_ids=ids).logits
        start = load_model(model_dir).eval()(input_ids=ids).logits
    assert torch.isfinite(trained).all()
    assert not torch.equal(trained, start)  # it trained

    rc = ramflow_cli("generate", "--model", run, "--prompt", "def ", "--max-new-tokens", "4",
                     "--ignore-eos", "--device", device.type)  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "(4 new tokens)" in out


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_first_step_loss_is_the_resident_models(
    model_dir: Path,
    device: torch.device,
    tmp_path: Path,
    corpus_file: Path,
    ramflow_cli,
    fast,
    grad_accum: int,
    monkeypatch,
) -> None:
    """The loss ``ramflow train`` logs for its first step is the resident model's
    ``labels=`` loss on the same first batch, the router's auxiliary loss included (the
    folder's config asks for it): on the CPU in fp32 to the chunked loss's fp32 rounding
    (relative 1e-6, see tests/train/test_loss.py); on CUDA the CLI trains in bf16 from a
    bf16 wire, the reference runs fp32 weights under bf16 autocast: 2e-2 relative, a few
    bf16 epsilons (2**-8) over the two layers. With ``--grad-accum 2`` the step runs its
    two micro-batches unit-major (``ramflow.accumulate``, the aux loss included) and logs
    their mean loss."""
    from transformers import AutoModelForCausalLM

    import ramflow

    accumulated = []

    def accumulate(model, micro_batches, loss_fn):  # the real one, counted
        accumulated.append(len(micro_batches))
        return real_accumulate(model, micro_batches, loss_fn)

    real_accumulate = ramflow.accumulate
    monkeypatch.setattr(ramflow, "accumulate", accumulate)
    fast = [device.type if a == "cpu" else a for a in fast]
    out = tmp_path / "run"
    rc = ramflow_cli("train", "--model", model_dir, "--data", corpus_file, "--steps", "1",
                     *fast, "--grad-accum", str(grad_accum), "--keep-checkpoints", "0",
                     "--out", out)  # fmt: skip
    assert rc == 0
    assert accumulated == ([grad_accum] if grad_accum > 1 else [])
    (first,) = [r["loss"] for r in read_log(out / "log.jsonl") if r["event"] == "step"]

    corpus = build_corpus(find_documents(corpus_file), load_tokenizer(model_dir), seq_len=32)
    stream = BatchStream(corpus.train_tokens, batch_size=2, seq_len=32, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.to(device)
    want = []
    with (
        torch.no_grad(),
        torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"),
    ):
        for _ in range(grad_accum):
            ids = stream.next_batch().to(device)
            out = model(input_ids=ids, labels=ids)
            assert out.aux_loss is not None or model.config.model_type == "deepseek_v3"
            want.append(out.loss.item())
    assert first == pytest.approx(
        sum(want) / grad_accum, rel=1e-6 if device.type == "cpu" else 2e-2
    )


def _experts(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))


def _saved_bytes(experts: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in ``experts(*inputs)``, its weights
    excluded (the estimate's count)."""
    params = {id(p) for p in experts.parameters()}
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = t if t._base is None else t._base
        storage = t.untyped_storage()
        if id(t) not in params and id(base) not in params and storage._cdata not in seen:
            seen.add(storage._cdata)
            keep.append(t)
            total += storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(*inputs)
    return total


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_meta_pass_runs_the_experts_grouped(family: str, implementation: str) -> None:
    config = moe_config(family)
    config._experts_implementation = implementation  # what the folder's config may name
    profile = measure_activations(config, batch_size=2, seq_len=16, dtype=torch.float32)
    assert profile.measured and all(b > 0 for b in profile.layer_bytes)

    # the experts' saved bytes on the meta device are a real grouped run's, on any routing
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(
        moe_config(family), dtype=torch.float32, experts_implementation="grouped_mm"
    )
    experts = _experts(real)
    tokens, top_k = 48, config.num_experts_per_tok
    x = torch.randn(tokens, config.hidden_size, requires_grad=True)
    routing = torch.stack([torch.randperm(experts.num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, requires_grad=True)
    meta = meta_model(config)
    _run_experts_grouped(meta)
    with _MetaKernelsMode():
        on_meta = _saved_bytes(_experts(meta), *(t.to("meta") for t in (x, routing, weights)))
    assert on_meta == _saved_bytes(experts, x, routing, weights)
