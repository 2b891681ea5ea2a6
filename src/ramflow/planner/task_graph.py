"""The list scheduler under the step-time model (``ramflow.planner.predict``): tasks on resources.

Standard library only, as ``planner.predict`` (whose report loads both by path). A task runs on one
resource (or none: a marker), after its dependencies; each resource runs one task at a time.
See [Note: the step as a pipeline] in ``planner.predict``.
"""

from __future__ import annotations

import heapq
import itertools

RESOURCES = ("GPU compute", "PCIe H2D", "PCIe D2H", "CPU optimizer")


class Task:
    """One task of the graph: ``duration`` seconds on ``resource`` (None: a marker), after
    its ``deps``; ``run`` fills in ``ready``, ``start``, ``end`` (seconds) and ``cause`` (the
    task it waited for last). ``key`` orders the CPU's queue; ``tag`` names it in errors."""

    __slots__ = (
        "resource",
        "duration",
        "deps",
        "succ",
        "key",
        "pending",
        "ready",
        "start",
        "end",
        "cause",
        "tag",
    )

    def __init__(self, resource: str | None, duration: float, key: float, tag: str) -> None:
        self.resource = resource  # None: a marker that takes no time on any resource
        self.duration = duration
        self.deps: list[Task] = []
        self.succ: list[Task] = []
        self.key = key
        self.pending = 0
        self.ready = 0.0
        self.start = 0.0
        self.end = 0.0
        self.cause: Task | None = None
        self.tag = tag


class TaskGraph:
    """The tasks of one simulated run, in creation order (the GPU's order)."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(
        self, resource: str | None, duration: float, deps=(), *, key: float = 0.0, tag: str = ""
    ) -> Task:
        """A new task after ``deps`` (None entries are skipped); negative durations count as 0."""
        t = Task(resource, max(0.0, duration), key, tag)
        for d in deps:
            if d is not None and d not in t.deps:
                t.deps.append(d)
                d.succ.append(t)
        t.pending = len(t.deps)
        self.tasks.append(t)
        return t

    def run(self) -> None:
        """List scheduling: each resource runs one task at a time; among the tasks ready when
        it is free, the GPU takes them in creation order (its stream is in order), the links in
        the order they became ready (their streams are in issue order), the CPU by ``key``."""
        order = {t: i for i, t in enumerate(self.tasks)}
        seq = itertools.count()
        queues: dict[str, list] = {}
        busy: dict[str, Task | None] = {}
        last: dict[str, Task | None] = {}
        events: list = []
        now = 0.0

        def make_ready(t: Task, at: float) -> None:
            t.ready = at
            if t.deps:
                t.cause = max(t.deps, key=lambda d: d.end)
            if t.resource is None:
                t.start = t.end = at
                heapq.heappush(events, (at, next(seq), t))
                return
            if t.resource == "GPU compute":
                prio = (order[t],)
            elif t.resource == "CPU optimizer":
                prio = (t.key, at, order[t])
            else:
                prio = (at, order[t])
            heapq.heappush(queues.setdefault(t.resource, []), (prio, next(seq), t))

        for t in self.tasks:
            if t.pending == 0:
                make_ready(t, 0.0)
        while True:
            for res, q in queues.items():
                if q and busy.get(res) is None:
                    _, _, t = heapq.heappop(q)
                    t.start = now
                    t.end = now + t.duration
                    prev = last.get(res)
                    if prev is not None and prev.end > t.ready:
                        t.cause = prev  # waited for the resource, not for its inputs
                    busy[res] = t
                    last[res] = t
                    heapq.heappush(events, (t.end, next(seq), t))
            if not events:
                break
            now = events[0][0]
            while events and events[0][0] <= now:
                _, _, t = heapq.heappop(events)
                if t.resource is not None:
                    busy[t.resource] = None
                for s in t.succ:
                    s.pending -= 1
                    if s.pending == 0:
                        make_ready(s, now)
        stuck = [t.tag for t in self.tasks if t.pending]
        if stuck:
            raise RuntimeError(f"step-time model: tasks never became ready: {stuck[:5]}")


def critical_path(end: Task, since: float) -> dict[str, float]:
    """Walk the chain of causes back from ``end`` to time ``since``.

    Args:
        end: the last task of the step.
        since: the step's start, seconds.

    Returns:
        Per resource, the seconds it spent on the chain (a wait with no task behind it counts
        as the resource that was waited for).
    """
    out = dict.fromkeys(RESOURCES, 0.0)
    t: Task | None = end
    while t is not None and t.end > since:
        if t.resource is not None:
            out[t.resource] += t.end - max(t.start, since)
        t = t.cause
    total = sum(out.values())
    span = end.end - since
    if total < span and total > 0:  # idle gaps (none in a well-formed graph): spread evenly
        for k in out:
            out[k] *= span / total
    return out
