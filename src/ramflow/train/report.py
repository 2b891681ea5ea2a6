"""What a training run shows and leaves behind: progress bar, JSON-lines log, summary, plot.

The log (``log.jsonl`` in the run folder) has one JSON object per line with an ``event``
field: ``start``, ``resume``, ``step`` (step, loss, lr, grad_norm, tokens, step_s,
tokens_per_s, peak_gpu_bytes, host_rss_bytes), ``eval`` (step, val_loss), ``checkpoint``
(step, path, save_s) and ``end``. Lines are flushed as they are written, so the log of an
interrupted run is complete up to its last step.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from .._plan import format_bytes

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


class RunReport:
    """Progress bar and log of one run.

    Args:
        run_dir: the run folder (``log.jsonl`` and ``loss.png`` go there).
        total_steps: steps the run aims at (the bar's total).
        start_step: steps already done (a resumed run starts its bar there).
        keep_until: on resume, the step of the checkpoint: log records of later steps
            (from the run that was interrupted after it) are dropped, so that the log
            continues exactly where the checkpoint is.
        progress: show a tqdm progress bar on stderr.
        stream: where ``message`` prints (default stdout).
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
    ) -> None:
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
        if progress:
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
        if self._bar is not None:
            gpu = record.get("peak_gpu_bytes")
            self._bar.set_postfix_str(
                f"loss {record['loss']:.3f}, {_human_count(record['tokens_per_s'])} tok/s, "
                f"GPU {format_bytes(gpu) if gpu is not None else '-'}, "
                f"RAM {format_bytes(record['host_rss_bytes'])}",
                refresh=False,
            )
            self._bar.update(1)

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


__all__ = [
    "LOG_FILE",
    "PLOT_FILE",
    "RunReport",
    "format_duration",
    "mean_tail",
    "read_log",
    "summary_table",
]
