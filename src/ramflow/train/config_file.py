"""``ramflow train --config FILE``: a run's flags from a YAML or JSON file.

[Note: a config file is command-line flags]
Fine-tuning recipes (axolotl, LLaMA-Factory, torchtune) are YAML files; ramflow reads one as
the flags it stands for, so the file and the command line share one parser, one set of
checks and one set of messages: ``lr: 2e-5`` becomes ``--lr 2e-5`` (argparse converts it,
so YAML's reading of ``2e-5`` as a string does not matter), ``no_progress: true`` becomes
``--no-progress``, a list repeats its flag. The file's flags go before the command line's,
so a flag given on the command line overrides the file's (a repeated flag such as
``--report-to`` adds to it). Keys take the flag's spelling with ``-`` or ``_`` (``seq-len``,
``seq_len``, ``--seq-len``); a key that names no flag is refused with the closest one.

A run folder's ``run.json`` is read the same way: its ``config`` (the run's ``TrainConfig``)
becomes the flags that give that config again, so ``ramflow train --config runs/X/run.json``
replays the run (``--out`` and the loggers are not part of a config: give them anew).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..choices import DEVICE_OPTIMIZER

# TrainConfig fields that no flag sets: a run.json holds them at these values
_FIXED_FIELDS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
# --device-optimizer's choice for each TrainConfig value (auto is the flag left out)
_DEVICE_OPTIMIZER_FLAG = {v: k for k, v in DEVICE_OPTIMIZER.items() if v is not None} | {None: None}


class Flag(NamedTuple):
    """One option of the command, as a config file may name it.

    Attributes:
        option: the flag as typed, e.g. ``"--seq-len"``.
        dest: its attribute on the parsed namespace, e.g. ``"seq_len"``.
        takes_value: whether the flag is followed by a value (False: ``store_true``).
        choices: its allowed values, or None.
    """

    option: str
    dest: str
    takes_value: bool
    choices: tuple[str, ...] | None = None


def _key(text: str) -> str:
    return text.lstrip("-").replace("-", "_")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The options in a YAML or JSON file: a mapping of flag names to values, or a run
    folder's ``run.json`` (its ``config``, as the options that give it again).

    JSON (``.json``) needs nothing more; YAML (``.yaml``, ``.yml``) needs PyYAML (the
    ``hf`` extra).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not valid JSON/YAML, holds no mapping, its suffix is
            neither, PyYAML is missing for a YAML file, or a run.json's config holds a
            setting no flag gives.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {p}: no such file")
    suffix = p.suffix.lower()
    text = p.read_text(encoding="utf-8")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config {p}: not valid JSON ({err})") from None
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ValueError(
                f"--config {p}: reading YAML needs PyYAML; install it with: pip install "
                "'ramflow[hf]' (or pyyaml), or give the options as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(
                f"--config {p}: not valid YAML ({' '.join(str(err).split())})"
            ) from None
    else:
        raise ValueError(f"--config {p}: give a .yaml, .yml or .json file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {p}: expected a mapping of options to values (e.g. 'lr: 2e-5'), "
            f"got a {type(data).__name__}"
        )
    if isinstance(data.get("config"), dict) and "versions" in data:
        return run_config_options(data["config"], where=str(p))
    return data


def run_config_options(config: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The ``ramflow train`` options that give the ``TrainConfig`` ``config`` (a run.json's
    ``config``) again: defaults left out, ``--batch-size auto`` and ``--device-optimizer``
    spelled as their flags.

    Raises:
        ValueError: ``config`` holds a setting that no flag gives (betas or eps other than
            the defaults: a run made through the API, which the API replays).
    """
    options = dict(config)
    for name, value in _FIXED_FIELDS.items():
        if options.pop(name, value) != value:
            raise ValueError(
                f"{where}: {name} {config[name]} has no command-line flag (the run was made "
                "through the API); replay it with ramflow.train.TrainConfig(**config)"
            )
    if options.pop("auto_batch_size", False):
        # the config's batch_size is the global batch the micro-batch is fitted to
        options["global_batch"] = options.pop("batch_size") * options.pop("grad_accum", 1)
        options["batch_size"] = "auto"
    options["device_optimizer"] = _DEVICE_OPTIMIZER_FLAG[options.get("device_optimizer")]
    if "device_budget_bytes" in options:  # --gpu-memory takes a number of bytes too
        options["gpu_memory"] = options.pop("device_budget_bytes")
    return {k: v for k, v in options.items() if v is not None}


def config_argv(options: Mapping[str, Any], flags: Mapping[str, Flag], *, where: str) -> list[str]:
    """The command-line words that ``options`` stand for. See [Note: a config file is
    command-line flags].

    Args:
        options: from ``read_config_file``; keys in any of a flag's spellings.
        flags: the command's flags by ``dest`` (``Flag``).
        where: the file, for messages.

    Raises:
        ValueError: a key names no flag (the message names the closest), names one twice,
            or ``config`` itself; a value is a mapping, or a list for a flag without one.
    """
    by_name: dict[str, Flag] = {}
    for flag in flags.values():
        by_name[flag.dest] = flag
        by_name[_key(flag.option)] = flag
    argv: list[str] = []
    seen: dict[str, str] = {}
    for key, value in options.items():
        flag = by_name.get(_key(str(key)))
        if flag is None or flag.dest == "config":
            close = difflib.get_close_matches(_key(str(key)), list(by_name), n=1, cutoff=0.6)
            hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else ""
            raise ValueError(f"--config {where}: unknown key {key!r}{hint}")
        if flag.dest in seen:
            raise ValueError(
                f"--config {where}: {key!r} and {seen[flag.dest]!r} give the same flag "
                f"{flag.option}; keep one"
            )
        seen[flag.dest] = str(key)
        if value is None:
            continue
        if isinstance(value, dict):
            raise ValueError(f"--config {where}: {key!r} takes a value, not a mapping")
        if not flag.takes_value:
            if not isinstance(value, bool):
                raise ValueError(
                    f"--config {where}: {key!r} is a switch: give true or false, not {value!r}"
                )
            if value:
                argv.append(flag.option)
            continue
        for item in value if isinstance(value, list) else [value]:
            argv += [flag.option, _word(item, flag)]
    return argv


def _word(value: Any, flag: Flag) -> str:
    """A value as the command line would spell it; YAML reads ``on``/``off`` as booleans."""
    if isinstance(value, bool):
        if flag.choices is not None and "on" in flag.choices:
            return "on" if value else "off"
        return "true" if value else "false"
    return str(value)


__all__ = ["Flag", "config_argv", "read_config_file", "run_config_options"]
