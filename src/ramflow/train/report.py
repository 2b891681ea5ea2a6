"""What a training run shows and leaves behind: progress bar, JSON-lines log, summary, plot.

The log (``log.jsonl`` in the run folder) has one JSON object per line with an ``event``
field: ``start``, ``resume``, ``step`` (step, loss, lr, grad_norm, tokens, step_s,
tokens_per_s, mfu (None on the CPU or an unknown device), peak_gpu_bytes, host_rss_bytes), ``eval`` (step, val_loss), ``checkpoint``
(step, path, save_s) and ``end``. Lines are flushed as they are written, so the log of an
interrupted run is complete up to its last step.

[Note: progress on a terminal and in a file]
A tqdm bar redraws one line with carriage returns; written to a file or a pipe (``ramflow
train > run.txt 2>&1``, a CI log, a job scheduler) those redraws become fragments between
the other lines. So the bar is used only when its stream (stderr) is a terminal; otherwise
the progress is one whole line every ``line_every`` steps (and at the last step), printed
on the message stream in order with the header, validation losses and summary.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..sizes import format_bytes
from .reporting import TENSORBOARD_DIR, open_trackers, step_metrics

# the name trainer.py knows it by
from .reporting import check_trackers as check_loggers

LOG_FILE = "log.jsonl"
PLOT_FILE = "loss.png"


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl`` (an unfinished last line, from a crash, is skipped)."""
    records = []
    p = Path(path)
    if not p.is_file():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _human_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def format_duration(seconds: float) -> str:
    """``1h02m03s``, ``4m05s`` or ``6.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class SlowProgress:
    """Progress of work before training (tokenizing the corpus) that shows only when slow.

    Nothing is shown while the work takes less than ``delay_s``. Past it, on a terminal a
    tqdm bar appears on stderr; in a file or a pipe (see [Note: progress on a terminal and
    in a file]) one line on stderr says what is running, and another how long it took.
    Of several ranks (``$RANK``, set by torchrun and ``--nproc-per-node``), only rank 0 shows
    anything: every rank does the same work.

    Args:
        total: the work's size in ``unit`` (e.g. characters of text).
        desc: what is running, e.g. ``"tokenizing 1,762 documents"``.
        unit: tqdm's unit.
        delay_s: seconds before anything is shown.
        interactive: use the bar (default: whether stderr is a terminal).
    """

    def __init__(
        self,
        total: int,
        *,
        desc: str,
        unit: str = "char",
        delay_s: float = 3.0,
        interactive: bool | None = None,
    ) -> None:
        self.desc = desc
        self.delay_s = delay_s
        self._start = time.perf_counter()
        self._bar = None
        # another rank: nothing to show (as if already said, and no bar)
        self._said = os.environ.get("RANK", "0") != "0"
        if self._said:
            return
        if interactive if interactive is not None else sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=True,
                delay=delay_s,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update(self, n: int) -> None:
        """``n`` more units done."""
        if self._bar is not None:
            self._bar.update(n)
        elif not self._said and time.perf_counter() - self._start >= self.delay_s:
            self._said = True
            print(f"{self.desc} ...", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._said and os.environ.get("RANK", "0") == "0":
            elapsed = format_duration(time.perf_counter() - self._start)
            print(f"{self.desc}: done in {elapsed}", file=sys.stderr, flush=True)

    def __enter__(self) -> SlowProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunReport:
    """Progress bar and log of one run.

    Args:
        run_dir: the run folder (``log.jsonl`` and ``loss.png`` go there).
        total_steps: steps the run aims at (the bar's total).
        start_step: steps already done (a resumed run starts its bar there).
        keep_until: on resume, the step of the checkpoint: log records of later steps
            (from the run that was interrupted after it) are dropped, so that the log
            continues exactly where the checkpoint is.
        progress: show the progress: a tqdm bar on stderr when stderr is a terminal, else
            whole lines (see [Note: progress on a terminal and in a file]).
        stream: where ``message`` and the progress lines print (default stdout).
        interactive: use the tqdm bar (default: whether stderr is a terminal).
        line_every: steps between progress lines when not interactive (default: a twentieth
            of the run, at least 1).
        log_to: experiment trackers beside ``log.jsonl`` (``--report-to``):
            ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` (see ``ramflow.train.reporting``);
            they get ``run_config``, each step's figures and the validation losses.
        run_config: the run's settings for the trackers (``TrainConfig.to_dict()``).

    Raises:
        ValueError: an unknown ``log_to`` entry.
        ModuleNotFoundError: ``log_to`` names a tracker whose package is absent (the
            message says what to install).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        start_step: int = 0,
        keep_until: int | None = None,
        progress: bool = True,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        line_every: int | None = None,
        log_to: Sequence[str] = (),
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self._trackers = open_trackers(log_to, run_dir)
        for tracker in self._trackers:
            tracker.log_config(run_config or {})
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / LOG_FILE
        self.records: list[dict[str, Any]] = []
        self._stream = stream
        if keep_until is not None:
            self.records = [r for r in read_log(self.log_path) if r.get("step", 0) <= keep_until]
            tmp = self.log_path.with_name(f".{LOG_FILE}.tmp-{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.log_path)
        self._log = self.log_path.open("a")
        self._bar = None
        self._total = total_steps
        self._line_every = 0  # 0: no progress lines
        if interactive is None:
            interactive = sys.stderr.isatty()
        if progress and not interactive:
            self._line_every = line_every or max(1, math.ceil((total_steps - start_step) / 20))
        elif progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                smoothing=0.1,
            )

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the log (flushed at once)."""
        self.records.append(record)
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def step(self, record: dict[str, Any]) -> None:
        """Log a ``step`` record and advance the bar with its figures."""
        self.log({"event": "step", **record})
        for tracker in self._trackers:
            tracker.log_metrics(step_metrics(record), record["step"])
        gpu = record.get("peak_gpu_bytes")
        mfu = record.get("mfu")
        figures = (
            f"loss {record['loss']:.3f}, {_human_count(record['tokens_per_s'])} tok/s"
            + (f", MFU {mfu:.1%}" if mfu is not None else "")
            + f", GPU {format_bytes(gpu) if gpu is not None else '-'}, "
            f"RAM {format_bytes(record['host_rss_bytes'])}"
        )
        if self._bar is not None:
            self._bar.set_postfix_str(figures, refresh=False)
            self._bar.update(1)
        elif self._line_every and (
            record["step"] % self._line_every == 0 or record["step"] >= self._total
        ):
            self.message(f"step {record['step']}/{self._total}: {figures}")

    def eval(self, step: int, val_loss: float) -> None:
        """Log an ``eval`` record."""
        self.log({"event": "eval", "step": step, "val_loss": val_loss})
        for tracker in self._trackers:
            tracker.log_metrics({"val/loss": val_loss}, step)

    def message(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream or sys.stdout)
        else:
            print(text, file=self._stream or sys.stdout, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        self._log.close()

    def step_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "step"]

    def eval_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "eval"]

    def write_plot(self, *, title: str) -> Path | None:
        """Save the loss curve (training loss per step, validation loss) as ``loss.png``.

        Uses matplotlib's object API with the Agg canvas: no global backend is touched.
        Returns the path, or None when there is nothing to plot.
        """
        steps = self.step_records()
        if not steps:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        xs = [r["step"] for r in steps]
        ys = [r["loss"] for r in steps]
        fig = Figure(figsize=(8, 4.5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(xs, ys, lw=0.8, alpha=0.45, color="tab:blue", label="training loss")
        window = max(1, len(ys) // 50)
        if window > 1:
            smooth = [
                sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                for i in range(len(ys))
            ]
            ax.plot(xs, smooth, lw=1.6, color="tab:blue", label=f"training loss (mean of {window})")
        evals = self.eval_records()
        if evals:
            ax.plot(
                [r["step"] for r in evals],
                [r["val_loss"] for r in evals],
                "o-",
                color="tab:orange",
                lw=1.4,
                ms=4,
                label="validation loss",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats per token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / PLOT_FILE
        tmp = self.run_dir / f".{PLOT_FILE}.tmp-{os.getpid()}.png"
        fig.savefig(tmp)
        os.replace(tmp, path)
        return path


class QuietReport:
    """``RunReport``'s stand-in on the ranks other than 0 of a run of several: records
    are kept in memory (for the rank's own ``TrainResult``), nothing is printed or written
    (see [Note: several ranks from the CLI] in ``ranks.py``).

    Args:
        run_dir: the run folder (rank 0 writes ``log.jsonl`` there).
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / LOG_FILE
        self.records: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def step(self, record: dict[str, Any]) -> None:
        self.log({"event": "step", **record})

    def eval(self, step: int, val_loss: float) -> None:
        self.log({"event": "eval", "step": step, "val_loss": val_loss})

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def step_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "step"]

    def eval_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "eval"]

    def write_plot(self, *, title: str) -> Path | None:
        return None


def summary_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns under a rule: the end-of-run summary."""
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])


def mean_tail(values: list[float], n: int) -> float:
    """Mean of the last ``n`` values (nan for none)."""
    tail = values[-n:]
    return sum(tail) / len(tail) if tail else math.nan


# steps whose mean training loss the summary gives as the run's last
SUMMARY_TAIL_STEPS = 10


def loss_summary(steps: Sequence[dict[str, Any]]) -> tuple[float, float, str]:
    """The summary's training loss from a run's ``step`` records (in order, each with
    ``step`` and ``loss``): the first step's loss, the mean of the last
    ``SUMMARY_TAIL_STEPS`` steps (of all the steps when there are fewer), and the summary's
    text, which names the steps it averages. nan and ``"-"`` for no steps."""
    if not steps:
        return math.nan, math.nan, "-"
    first, tail = steps[0], steps[-SUMMARY_TAIL_STEPS:]
    mean = mean_tail([r["loss"] for r in tail], len(tail))
    start = f"{first['loss']:.4f} at step {first['step']}"
    if len(steps) == 1:
        return first["loss"], mean, f"{start} (one step)"
    which = f"all {len(tail)} steps" if len(tail) == len(steps) else f"the last {len(tail)} steps"
    span = f"{tail[0]['step']} to {tail[-1]['step']}"
    return first["loss"], mean, f"{start} -> {mean:.4f} (mean of {which}, {span})"


__all__ = [
    "LOG_FILE",
    "PLOT_FILE",
    "TENSORBOARD_DIR",
    "RunReport",
    "check_loggers",
    "format_duration",
    "loss_summary",
    "mean_tail",
    "read_log",
    "summary_table",
]
