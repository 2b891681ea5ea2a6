"""Experiment trackers beside ``log.jsonl``: TensorBoard, Weights & Biases and MLflow
(``ramflow train --report-to``, the name Hugging Face's ``TrainingArguments`` uses).

Each tracker gets the run's settings once (``TrainConfig.to_dict()``) and each
step's figures (``train/loss``, ``train/lr``, ...) and validation losses (``val/loss``),
keyed by optimizer step. Every package is optional and imported only when asked for; each
works without a network: TensorBoard writes event files into the run folder, W&B runs
with ``WANDB_MODE=offline`` (its files under the run folder), MLflow with a local store
(``MLFLOW_TRACKING_URI``: ``sqlite:///mlflow.db``, or a ``file:`` URI, which MLflow 3
takes only with ``MLFLOW_ALLOW_FILE_STORE=true``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..choices import TRACKERS

TENSORBOARD_DIR = "tensorboard"
# tracker -> the package it needs (the name pip installs it by)
STEP_FIGURES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
# MLflow refuses parameter values longer than this (characters)
_MLFLOW_PARAM_CHARS = 500


class Tracker(Protocol):
    """What ``RunReport`` asks of an experiment tracker."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's settings (flat keys, plain values)."""
        ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number) at optimizer step ``step``."""
        ...

    def close(self) -> None:
        """Flush and end the tracker's run."""
        ...


def check_trackers(names: Sequence[str]) -> None:
    """Refuse trackers that cannot be served, before anything is written.

    Raises:
        ValueError: a name not in ``TRACKERS``.
        ModuleNotFoundError: its package is not installed (the message says what to install;
            ``err.name`` is the package).
    """
    for name in names:
        if name not in TRACKERS:
            raise ValueError(
                f"--report-to {name!r}: choose among {', '.join(TRACKERS)} "
                "(log.jsonl is always written)"
            )
        package = TRACKERS[name]
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(
                f"--report-to {name} needs the {package} package; install it with: "
                f"pip install {package}",
                name=package,
            )


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``run_dir/tensorboard``
    (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def log_config(self, config: Mapping[str, Any]) -> None:
        lines = "\n".join(f"    {k}: {v}" for k, v in config.items())  # markdown code block
        self._writer.add_text("config", lines, 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run named after the run folder, its files under it; the project is
    ``$WANDB_PROJECT`` (default ``ramflow``). ``WANDB_MODE=offline`` needs no network."""

    def __init__(self, run_dir: Path) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ramflow"),
            name=run_dir.name,
            dir=str(run_dir),
        )

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run named after the run folder in experiment ``$MLFLOW_EXPERIMENT_NAME``
    (default ``ramflow``), through ``MlflowClient`` (no global active run is left behind);
    the store is ``$MLFLOW_TRACKING_URI`` (MLflow's default without it).

    Raises:
        ValueError: MLflow refuses the store (its message, on one line).
    """

    def __init__(self, run_dir: Path) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            self._client = MlflowClient()
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ramflow")
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(name)
            )
            run = self._client.create_run(experiment_id, run_name=run_dir.name)
        except MlflowException as err:
            raise ValueError(f"--report-to mlflow: {' '.join(str(err).split())}") from err
        self._run_id = run.info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        for key, value in config.items():
            self._client.log_param(self._run_id, key, str(value)[:_MLFLOW_PARAM_CHARS])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._client.log_metric(self._run_id, key, float(value), step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


_TRACKER_CLASSES = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def open_trackers(names: Sequence[str], run_dir: str | os.PathLike) -> list[Tracker]:
    """One tracker per name (duplicates once), in the order given.

    Raises:
        ValueError, ModuleNotFoundError: as ``check_trackers``.
    """
    check_trackers(names)
    return [_TRACKER_CLASSES[name](Path(run_dir)) for name in dict.fromkeys(names)]


def step_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The figures of a ``step`` log record that trackers plot, as ``train/<name>``."""
    return {f"train/{k}": record[k] for k in STEP_FIGURES if record.get(k) is not None}


__all__ = [
    "STEP_FIGURES",
    "TENSORBOARD_DIR",
    "MlflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "check_trackers",
    "open_trackers",
    "step_metrics",
]
