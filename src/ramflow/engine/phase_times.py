"""Wall seconds spent in named phases, for a benchmark's breakdown of a step."""

from __future__ import annotations

import time


class PhaseSeconds:
    """Seconds one thread spent in named phases, summed since this was made.

    ``add(phase, since)`` adds the time from ``since`` (a ``time.perf_counter()`` value) to
    now and returns now, so consecutive phases chain: ``t = clock.add("a", t)``. Read
    ``totals`` between steps (after ``ramflow.synchronize``) for exact figures.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - since
        return now

    def snapshot(self) -> dict[str, float]:
        """A copy of the totals (seconds per phase)."""
        return dict(self.totals)
