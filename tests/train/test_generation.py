"""``ramflow generate``: asked lengths, batching, parity with ``transformers``, HF folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ramflow
from ramflow.train import SamplingConfig, generate, load_for_generation
from ramflow.train.modeling import load_model
from ramflow.train.precision import resolve_compute
from ramflow.train.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a tied head, saved by ``save_pretrained`` with a byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(str(path))
    ByteTokenizer().save(path)
    return path


def test_cli_generates_the_asked_length_for_a_batch(trained_run: Path, ramflow_cli, capsys) -> None:
    rc = ramflow_cli(
        "generate",
        "--device",
        "cpu",
        "--model",
        trained_run,
        "--prompt",
        "def ",
        "--prompt",
        "import json\n",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- prompt 1 (12 new tokens) ---\ndef " in out
    assert "--- prompt 2 (12 new tokens) ---\nimport json\n" in out


def test_batched_prompts_equal_single_prompts(trained_run: Path) -> None:
    model, tok, policy = load_for_generation(trained_run, device="cpu")
    try:
        sampling = SamplingConfig(max_new_tokens=10, stop_at_eos=False)
        prompts = ["def parse(self, ", "x", "import os\nimport sys\n"]
        together = generate(model, tok, prompts, sampling=sampling, policy=policy)
        alone = [generate(model, tok, [p], sampling=sampling, policy=policy)[0] for p in prompts]
    finally:
        ramflow.undo(model)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert all(len(g.token_ids) == 10 for g in together)


def test_greedy_matches_transformers_generate(hf_folder: Path) -> None:
    model, tok, policy = load_for_generation(hf_folder, device="cpu")
    reference = load_model(hf_folder)  # the same weights in a plain module
    try:
        sampling = SamplingConfig(max_new_tokens=12, stop_at_eos=False)
        ours = generate(model, tok, ["hello"], sampling=sampling, policy=policy)[0].token_ids
    finally:
        ramflow.synchronize(model)
    prompt = torch.tensor([[tok.bos_id, *tok.encode("hello")]])
    reference.generation_config.eos_token_id = None
    theirs = reference.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tok.pad_id,
        bad_words_ids=[[tok.bos_id], [tok.pad_id]],
    )
    assert ours == theirs[0, prompt.shape[1] :].tolist()


def test_sampling_is_seeded(hf_folder: Path) -> None:
    model, tok, policy = load_for_generation(hf_folder, device="cpu")
    try:
        runs = [
            generate(
                model,
                tok,
                ["a", "bc"],
                policy=policy,
                sampling=SamplingConfig(
                    max_new_tokens=8,
                    temperature=1.0,
                    top_k=50,
                    top_p=0.9,
                    seed=s,
                    stop_at_eos=False,
                ),
            )
            for s in (1, 1, 2)
        ]
    finally:
        ramflow.undo(model)
    ids = [[g.token_ids for g in r] for r in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_train_from_a_hugging_face_folder_then_generate(
    tmp_path: Path, hf_folder: Path, corpus_file: Path, ramflow_cli, fast, capsys
) -> None:
    out = tmp_path / "ft"
    assert (
        ramflow_cli(
            "train",
            "--model",
            hf_folder,
            "--data",
            corpus_file,
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--out",
            out,
            *fast,
        )
        == 0
    )
    capsys.readouterr()
    assert (
        ramflow_cli(
            "generate",
            "--device",
            "cpu",
            "--model",
            out,
            "--prompt",
            "def",
            "--max-new-tokens",
            "5",
            "--ignore-eos",
        )
        == 0
    )
    assert "(5 new tokens)" in capsys.readouterr().out


def test_generation_past_the_models_context_is_refused(
    hf_folder: Path, ramflow_cli, capsys
) -> None:
    model, tok, policy = load_for_generation(hf_folder, device="cpu")  # context: 256
    try:
        # bos + 5 bytes = 6 prompt tokens; 250 new tokens reach the context exactly
        assert len(tok.encode("hello")) == 5
        with pytest.raises(ValueError, match="--max-new-tokens 250 or less"):
            generate(
                model, tok, ["hello"], sampling=SamplingConfig(max_new_tokens=251), policy=policy
            )
        with pytest.raises(ValueError, match="shorten the prompt"):
            generate(model, tok, ["x" * 300], sampling=SamplingConfig(), policy=policy)
    finally:
        ramflow.undo(model)
    rc = ramflow_cli(
        "generate", "--device", "cpu", "--model", hf_folder, "--prompt", "hello",
        "--max-new-tokens", "300",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "context of 256 tokens" in err and "Traceback" not in err


def test_sampling_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="--top-p"):
        SamplingConfig(top_p=0.0)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="--temperature"):
            SamplingConfig(temperature=bad)
    with pytest.raises(ValueError, match="--max-new-tokens"):
        SamplingConfig(max_new_tokens=0)
    policy = resolve_compute(device="cpu", precision="fp32")
    with pytest.raises(ValueError, match="prompt"):
        generate(
            torch.nn.Linear(1, 1), ByteTokenizer(), [], sampling=SamplingConfig(), policy=policy
        )
    with pytest.raises(ValueError, match=r"^--top-k must be >= 0 \(0 keeps all tokens\), got -1$"):
        SamplingConfig(top_k=-1)


def test_a_model_path_that_holds_no_model_is_named(tmp_path: Path) -> None:
    from ramflow.train.generation import resolve_model_dir

    with pytest.raises(FileNotFoundError, match=r"^--model .*absent: no such folder$"):
        resolve_model_dir(tmp_path / "absent")
    with pytest.raises(
        FileNotFoundError, match=r"neither a model folder \(config\.json\) nor a run"
    ):
        resolve_model_dir(tmp_path)
