"""``--config FILE`` (``ramflow.train.config_file``): what a file may hold, the words it
stands for, and the one-line refusals of what it may not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ramflow.train.config_file import Flag, config_argv, read_config_file, run_config_options

FLAGS = {
    "lr": Flag("--lr", "lr", True),
    "seq_len": Flag("--seq-len", "seq_len", True),
    "no_progress": Flag("--no-progress", "no_progress", False),
    "report_to": Flag("--report-to", "report_to", True, ("tensorboard", "wandb")),
    "device_optimizer": Flag("--device-optimizer", "device_optimizer", True, ("on", "off")),
    "resume": Flag("--resume", "resume", True),
    "config": Flag("--config", "config", True),
}


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_json_files_read_as_mappings(tmp_path: Path) -> None:
    assert read_config_file(_file(tmp_path, "a.yml", "lr: 2.0e-5\nseq-len: 64\n")) == {
        "lr": 2e-5,
        "seq-len": 64,
    }
    assert read_config_file(_file(tmp_path, "b.YAML", "# only a comment\n")) == {}
    assert read_config_file(_file(tmp_path, "c.json", "null")) == {}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.json", "{lr: 1}", r"a\.json: not valid JSON \("),
        ("a.yaml", "lr: [1, 2\n", r"a\.yaml: not valid YAML \("),
        ("a.toml", "lr = 1\n", r"a\.toml: give a \.yaml, \.yml or \.json file$"),
        ("a.yaml", "- lr\n- 1\n", r"expected a mapping of options to values .*got a list$"),
    ],
)
def test_a_file_that_holds_no_options_is_one_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as err:
        read_config_file(_file(tmp_path, name, text))
    assert "\n" not in str(err.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^--config .*nowhere\.yaml: no such file$"):
        read_config_file(tmp_path / "nowhere.yaml")


def test_run_json_gives_the_flags_of_its_config_again(tmp_path: Path) -> None:
    config = {"lr": 1e-3, "seq_len": 32, "beta1": 0.9, "eps": 1e-8, "device_optimizer": False}
    run = _file(tmp_path, "run.json", json.dumps({"config": config, "versions": {}}))
    assert read_config_file(run) == {"lr": 1e-3, "seq_len": 32, "device_optimizer": "off"}


def test_an_auto_batch_size_is_the_global_batch_it_was_fitted_to() -> None:
    config = {"auto_batch_size": True, "batch_size": 4, "grad_accum": 3, "seed": None}
    assert run_config_options(config, where="run.json") == {
        "global_batch": 12,
        "batch_size": "auto",
    }


def test_a_setting_no_flag_gives_names_the_api() -> None:
    with pytest.raises(ValueError, match=r"^run\.json: beta2 0\.99 has no command-line flag"):
        run_config_options({"beta2": 0.99}, where="run.json")


def test_options_become_the_words_of_their_flags() -> None:
    options = {
        "--lr": 2e-5,  # any spelling of a flag
        "seq-len": 64,
        "no_progress": True,
        "report_to": ["tensorboard", "wandb"],  # a list repeats the flag
        "device_optimizer": False,  # YAML reads off as false
        "resume": None,  # left to the default
    }
    assert config_argv(options, FLAGS, where="f.yaml") == [
        "--lr", "2e-05", "--seq-len", "64", "--no-progress",
        "--report-to", "tensorboard", "--report-to", "wandb", "--device-optimizer", "off",
    ]  # fmt: skip
    assert config_argv({"no_progress": False, "lr": True}, FLAGS, where="f.yaml") == [
        "--lr",
        "true",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seq_len": 8, "seq-len": 16}, r"'seq-len' and 'seq_len' give the same flag --seq-len"),
        ({"lr": {"value": 1}}, r"'lr' takes a value, not a mapping$"),
        ({"no_progress": "yes"}, r"'no_progress' is a switch: give true or false, not 'yes'$"),
        ({"config": "other.yaml"}, r"unknown key 'config'"),
    ],
)
def test_options_no_command_line_could_give_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"^--config f\.yaml: .*" + message):
        config_argv(options, FLAGS, where="f.yaml")
