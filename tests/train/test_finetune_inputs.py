"""What fine-tuners expect of ``ramflow train`` (issue 49, point 4): ``--config`` files and
run.json replay, ``--model org/name`` from the local Hugging Face cache, chat data with the
loss on the assistant's tokens (packed), ``--report-to`` trackers, validation sized to the
run and announced saves.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences,
with a ChatML-style Jinja chat template; the model a tiny Llama saved with
``save_pretrained`` into a folder laid out as the Hub's cache."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from ramflow.train import TrainConfig
from ramflow.train.chat_data import (
    IGNORE_INDEX,
    Conversation,
    build_chat_corpus,
    is_chat_data,
    pack,
    read_conversations,
    render_conversation,
)
from ramflow.train.config import MAX_EVAL_BATCHES
from ramflow.train.config_file import read_config_file
from ramflow.train.generation import resolve_model_dir
from ramflow.train.hub import resolve_hub_model
from ramflow.train.loss import chunk_lm_head, lm_loss
from ramflow.train.report import read_log
from ramflow.train.tokenizer import HFTokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same rendering, with the assistant's text marked for return_assistant_tokens_mask
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>"]
TOPICS = ["the sea", "a garden", "bread", "trains", "the moon", "rain", "chess", "bees"]


def _conversation(k: int) -> list[dict[str, str]]:
    topic = TOPICS[k % len(TOPICS)]
    messages = [
        {"role": "user", "content": f"Tell me about {topic}."},
        {"role": "assistant", "content": f"Here is a fact about {topic}: it is {k} times nice."},
    ]
    if k % 3 == 0:
        messages = [{"role": "system", "content": "Be brief."}, *messages]
    if k % 2 == 0:
        messages += [
            {"role": "user", "content": "And more?"},
            {"role": "assistant", "content": f"Also {topic} rhymes with nothing."},
        ]
    return messages


def _save_tokenizer(path: Path, template: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [m["content"] for k in range(40) for m in _conversation(k)]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", chat_template=template
    )
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    _save_tokenizer(path, CHATML)
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": _conversation(k)}) + "\n" for k in range(40)))
    return path


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A Hugging Face cache holding ``org/tiny-chat``: a tiny Llama and the chat tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = HFTokenizer(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    torch.manual_seed(0)
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--org--tiny-chat"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    LlamaForCausalLM(config).save_pretrained(str(snapshot))
    tokenizer.hf_tokenizer.save_pretrained(str(snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return cache


# ---- chat data: the assistant's tokens, packing


def _assistant_texts(hf, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of labelled tokens."""
    runs, run = [], []
    for t, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == t
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [hf.decode(r) for r in runs]


def test_labels_are_the_assistants_tokens(tokenizer_dir: Path, tmp_path: Path) -> None:
    hf = HFTokenizer(tokenizer_dir).hf_tokenizer
    _save_tokenizer(tmp_path, CHATML_GENERATION)
    hf_generation = HFTokenizer(tmp_path).hf_tokenizer
    for k in range(6):
        conversation = Conversation(f"c{k}", _conversation(k))
        ids, labels = render_conversation(hf, conversation)
        assert len(ids) == len(labels)
        assert hf.decode(ids) == hf.apply_chat_template(conversation.messages, tokenize=False)
        want = [
            m["content"] + "<|im_end|>\n" for m in conversation.messages if m["role"] == "assistant"
        ]
        assert _assistant_texts(hf, ids, labels) == want
        # the template's own {% generation %} marks give the same labels
        assert render_conversation(hf_generation, conversation) == (ids, labels)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path) -> None:
    # drops the content of every assistant turn but the last, as Qwen3's drops reasoning
    rewriting = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    _save_tokenizer(tmp_path, rewriting)
    hf = HFTokenizer(tmp_path).hf_tokenizer
    with pytest.raises(ValueError, match=r"c0: .*\{% generation %\}"):
        render_conversation(hf, Conversation("c0", _conversation(0)))


def test_packing_keeps_conversations_whole_and_their_labels() -> None:
    examples = [
        ([1, 2, 3, 4], [-100, -100, 3, 4]),
        ([5, 6, 7], [-100, 6, 7]),
        ([8, 9, 10, 11, 12, 13, 14], [-100, -100, -100, -100, -100, -100, 14]),  # cut to 6
        ([15, 16], [-100, -100]),  # nothing to learn: dropped
    ]
    packed = pack(examples, seq_len=6, pad_id=0)
    assert packed.tokens.view(-1, 6).tolist() == [[1, 2, 3, 4, 0, 0], [5, 6, 7, 0, 0, 0]]
    assert packed.labels.view(-1, 6).tolist() == [
        [-100, -100, 3, 4, -100, -100],
        [-100, 6, 7, -100, -100, -100],
    ]
    # the third is cut to 6 tokens, which leaves it no assistant token: dropped too
    assert (packed.num_truncated, packed.num_dropped) == (1, 2)
    together = pack(examples[:2], seq_len=8, pad_id=0)
    assert together.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert together.labels.tolist() == [-100, -100, 3, 4, -100, 6, 7, -100]


def test_chat_corpus_from_jsonl_and_from_a_datasets_folder(
    tokenizer_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    records = [json.loads(line) for line in chat_file.read_text().splitlines()]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(folder))
    assert is_chat_data(chat_file) and is_chat_data(folder)
    assert [c.messages for c in read_conversations(folder)] == [
        c.messages for c in read_conversations(chat_file)
    ]
    tokenizer = HFTokenizer(tokenizer_dir)
    a = build_chat_corpus(chat_file, tokenizer, seq_len=128, val_fraction=0.1)
    b = build_chat_corpus(folder, tokenizer, seq_len=128, val_fraction=0.1)
    assert a.fingerprint == b.fingerprint
    assert a.num_documents == 40 and "chat: 40 conversations" in a.source
    assert "cut to" not in a.source  # every conversation fits 128 tokens
    for tokens, labels in ((a.train_tokens, a.train_labels), (a.val_tokens, a.val_labels)):
        assert tokens.numel() % 128 == 0 and labels.shape == tokens.shape
        rows = labels.view(-1, 128)
        assert bool(((rows[:, 1:] != IGNORE_INDEX).sum(1) > 0).all())  # every row teaches
    # every assistant token of the 40 conversations is in one part or the other
    hf = tokenizer.hf_tokenizer
    total = sum(
        sum(t != IGNORE_INDEX for t in render_conversation(hf, c)[1])
        for c in read_conversations(chat_file)
    )
    assert (
        int((a.train_labels != IGNORE_INDEX).sum() + (a.val_labels != IGNORE_INDEX).sum()) == total
    )


def test_chat_data_needs_a_chat_template(chat_file: Path) -> None:
    from ramflow.train.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match="no chat template; give --tokenizer"):
        build_chat_corpus(chat_file, ByteTokenizer(), seq_len=64)


def test_a_bad_message_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": _conversation(1)})
        + "\n"
        + json.dumps({"messages": [{"role": "human", "content": "hi"}]})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: message 0 has role 'human'"):
        read_conversations(bad)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_loss_is_the_mean_over_labelled_positions(chunked: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (2, 12))
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX
    labels[1, 7:] = IGNORE_INDEX
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 50).float(), labels[:, 1:].reshape(-1))
    if chunked:
        chunk_lm_head(model, chunk_tokens=5)
    with torch.no_grad():
        got = lm_loss(model, ids, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- --model org/name from the cache, chat data, --config and run.json


def test_hub_id_resolves_to_the_cached_snapshot(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    folder = resolve_hub_model("org/tiny-chat")
    assert folder.parent.parent == hub_cache / "models--org--tiny-chat"
    assert (folder / "config.json").is_file()
    assert resolve_model_dir("org/tiny-chat") == folder  # generate's --model too
    with pytest.raises(FileNotFoundError, match=r"run `hf download org/missing` first"):
        resolve_hub_model("org/missing")


def test_a_model_not_in_the_cache_says_how_to_download_it(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, ramflow_cli, capsys
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert ramflow_cli("train", "--model", "org/missing", "--device", "cpu") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hf download org/missing" in err


def test_chat_fine_tune_of_a_hub_model_from_a_yaml_config_and_its_replay(
    hub_cache: Path,
    chat_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ramflow_cli,
    capsys,
) -> None:
    pytest.importorskip("yaml")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: org/tiny-chat\n"
        f"data: {chat_file}\n"
        "seq-len: 64\n"
        "batch_size: 2\n"
        "--steps: 2\n"  # the command line's 4 wins
        "lr: 1e-3\n"  # YAML reads this as a string; the flag's parser makes it a float
        "save_every: 2\n"
        "device: cpu\n"
        "no-progress: true\n"
    )
    first = tmp_path / "first"
    assert ramflow_cli("train", "--config", config, "--steps", "4", "--out", first) == 0
    out = capsys.readouterr().out
    assert "chat: 40 conversations" in out
    assert "checkpoint of step 2 saved in" in out  # the periodic save, announced
    info = json.loads((first / "run.json").read_text())
    assert info["config"]["steps"] == 4 and info["config"]["lr"] == 1e-3
    assert info["config"]["model"].startswith(str(hub_cache))
    # sized to the run: 4 steps validate once, at the end, on one micro-batch
    assert (info["config"]["eval_every"], info["config"]["eval_batches"]) == (0, 1)
    evals = [r for r in read_log(first / "log.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [4]

    second = tmp_path / "second"
    assert ramflow_cli("train", "--config", first / "run.json", "--out", second) == 0
    again = json.loads((second / "run.json").read_text())
    assert again["config"] == info["config"]
    assert again["corpus"]["fingerprint"] == info["corpus"]["fingerprint"]

    def losses(run: Path) -> list[float]:
        return [r["loss"] for r in read_log(run / "log.jsonl") if r["event"] == "step"]

    assert losses(second) == losses(first)  # the CPU replays it bit for bit


def test_an_unknown_key_names_the_closest_flag(tmp_path: Path, ramflow_cli, capsys) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"learning_rate": 1e-4, "seq_len": 32}))
    assert ramflow_cli("train", "--config", config) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        err.startswith("ramflow train: error: --config ") and "unknown key 'learning_rate'" in err
    )
    config.write_text(json.dumps({"eval_evry": 3}))
    assert ramflow_cli("train", "--config", config) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("unknown key 'eval_evry'; did you mean --eval-every?")


def test_json_needs_no_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now fails
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"seq-len": 32, "no_progress": True}))
    assert read_config_file(as_json) == {"seq-len": 32, "no_progress": True}
    as_yaml = tmp_path / "run.yaml"
    as_yaml.write_text("seq-len: 32\n")
    with pytest.raises(ValueError, match=r"needs PyYAML; install it with: pip install"):
        read_config_file(as_yaml)


# ---- validation sized to the run


def test_validation_is_sized_to_the_run() -> None:
    short = TrainConfig.from_options(steps=5)
    assert (short.eval_every, short.eval_batches) == (0, 1)
    long = TrainConfig.from_options(steps=150)  # 6 validations within 37 micro-batches
    assert (long.eval_every, long.eval_batches) == (30, 6)
    longest = TrainConfig.from_options(steps=5000)
    assert longest.eval_batches == MAX_EVAL_BATCHES
    given = TrainConfig.from_options(steps=5, eval_every=1, eval_batches=3)
    assert (given.eval_every, given.eval_batches) == (1, 3)


# ---- --report-to


def _tiny_run(tmp_path: Path, corpus_file: Path, fast, *report_to: str) -> list[str]:
    argv = ["train", "--data", str(corpus_file), "--steps", "2", "--eval-every", "0"]
    argv += [*fast, "--out", str(tmp_path / "run")]
    for name in report_to:
        argv += ["--report-to", name]
    return argv


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_report_to_wandb_offline(
    tmp_path: Path, corpus_file: Path, fast, ramflow_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert ramflow_cli(*_tiny_run(tmp_path, corpus_file, fast, "wandb")) == 0
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_report_to_mlflow_with_a_file_store(
    tmp_path: Path, corpus_file: Path, fast, ramflow_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    assert ramflow_cli(*_tiny_run(tmp_path, corpus_file, fast, "mlflow")) == 0
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("ramflow")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2]
    assert run.data.params["steps"] == "2"
    assert "val/loss" in run.data.metrics


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_report_to_without_the_package_says_how_to_install_it(
    name: str, tmp_path: Path, corpus_file: Path, fast, ramflow_cli, capsys, monkeypatch
) -> None:
    # absent as on a machine without it: a None entry in sys.modules makes find_spec
    # answer None and an import raise, whether or not the dev extra installed it here
    monkeypatch.setitem(sys.modules, name, None)
    assert ramflow_cli(*_tiny_run(tmp_path, corpus_file, fast, name)) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        f"--report-to {name} needs the {name} package; install it with: pip install {name}"
    )
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed"
)
def test_report_to_tensorboard_gets_the_config(
    tmp_path: Path, corpus_file: Path, fast, ramflow_cli
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert ramflow_cli(*_tiny_run(tmp_path, corpus_file, fast, "tensorboard")) == 0
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.step for e in events.Scalars("val/loss")] == [2]
    assert "config/text_summary" in events.Tags()["tensors"]


# ---- the loss the trainer takes on chat data is the resident model's, masked


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_first_step_loss_is_the_resident_models_on_the_assistants_tokens(
    device: str,
    hub_cache: Path,
    chat_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ramflow_cli,
) -> None:
    from transformers import AutoModelForCausalLM

    from ramflow.train.data import BatchStream

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    out = tmp_path / "run"
    argv = ["train", "--model", "org/tiny-chat", "--data", str(chat_file), "--seq-len", "64"]
    argv += ["--batch-size", "2", "--steps", "1", "--device", device, "--no-progress"]
    assert ramflow_cli(*argv, "--keep-checkpoints", "0", "--out", str(out)) == 0
    (first,) = [r["loss"] for r in read_log(out / "log.jsonl") if r["event"] == "step"]

    snapshot = resolve_hub_model("org/tiny-chat")
    corpus = build_chat_corpus(chat_file, HFTokenizer(snapshot), seq_len=64)
    stream = BatchStream(
        corpus.train_tokens, batch_size=2, seq_len=64, seed=0, labels=corpus.train_labels
    )
    ids, labels = stream.next_labeled_batch()
    assert bool((labels == IGNORE_INDEX).any()) and bool((labels != IGNORE_INDEX).any())
    model = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32).to(device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        want = lm_loss(model, ids.to(device), labels.to(device)).item()
    # the CPU computes in fp32 as the resident model does; the GPU with a bf16 wire
    assert first == pytest.approx(want, rel=1e-5 if device == "cpu" else 2e-2)
