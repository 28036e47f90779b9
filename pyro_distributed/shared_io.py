"""File work that every worker waits for, outside the engine's time-out, and
whose failure every worker sees.

Waiting for a save inside one collective would bound the file system by the
engine's time-out (60 s by default). Instead each worker does its part in a
thread while all take part in short rounds of
:meth:`Engine.allgather_object`, each well inside the time-out, until every
part has finished or :data:`IO_TIMEOUT` has passed; a dead worker still
fails the next round within the engine's time-out. The last round carries
every worker's report, so a failure anywhere is known to all at once
(:func:`failures`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from .engines import Engine

#: How long one worker's file work may take before it counts as failed: as
#: long as torch.distributed's own default time-out.
IO_TIMEOUT = timedelta(minutes=30)
#: How often the workers ask each other whether everyone has finished.
_ROUND_S = 0.05

T = TypeVar("T")


@dataclass(frozen=True)
class Failed:
    """A worker's file work that raised: what it was, and the message."""

    kind: str
    message: str


@dataclass
class Outcome(Generic[T]):
    """What one worker's part gave (``value``, kept here) and every worker's
    small ``reports``, by rank: what ``work`` reported, or :class:`Failed`."""

    value: T | None
    reports: list[Any]


def on_each_worker(
    engine: Engine,
    work: Callable[[], tuple[T, Any]] | None,
    *,
    classify: Callable[[BaseException], str] = lambda exc: "error",
    timeout: timedelta = IO_TIMEOUT,
) -> Outcome[T]:
    """Run ``work()`` on this worker (``None``: nothing to do here) while every
    worker waits for every other one (a collective).

    ``work`` returns ``(value, report)``: the value stays on this worker, the
    report (small and picklable) reaches every worker. If it raises, its report
    is ``Failed(classify(exc), "<Type>: <message>")``.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"], box["report"] = work() if work is not None else (None, None)
        except BaseException as exc:  # reported to every worker
            box["report"] = Failed(classify(exc), f"{type(exc).__name__}: {exc}")

    worker = threading.Thread(target=run, name="pyro-distributed-io", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        worker.join(_ROUND_S)
        if worker.is_alive() and time.monotonic() > deadline:
            box["report"] = Failed(
                "timeout", f"still busy after {timeout.total_seconds():g} s (IO_TIMEOUT)"
            )
        finished = not worker.is_alive() or "report" in box
        states = engine.allgather_object(("done", box.get("report")) if finished else None)
        if all(state is not None for state in states):
            return Outcome(box.get("value"), [state[1] for state in states])


def failures(reports: list[Any]) -> dict[int, Failed]:
    """The workers whose part failed, by rank."""
    return {rank: report for rank, report in enumerate(reports) if isinstance(report, Failed)}


def describe(failed: dict[int, Failed]) -> str:
    """``"worker 1: OSError: ..."``, for each failed worker."""
    return "; ".join(f"worker {rank}: {failure.message}" for rank, failure in failed.items())
