"""Following a launch's workers: what they send, and which failure to report.

One loop waits on everything the workers send: worker 0's output (passed on
where the user looks), its progress (drawn here), and every worker's report,
with each worker's process sentinel and the launch's ``time_limit``. The
first failure ends the loop, and is reported as its cause: a worker often
raises because a peer vanished or failed first, so a worker that died
without a word, or an error that is not about a lost peer, is named instead
of the lost connection it caused.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import IO, Any

from ..errors import PyroDistributedError
from . import progress

#: How long a failure waits to see whether a worker that has not reported died,
#: which then is the failure reported.
DEATH_GRACE_S = 0.5
#: The longest a launch reads what worker 0 wrote once it is over (or failed).
DRAIN_S = 0.5
#: What the last line of a worker's error says when it raised because a peer
#: was lost: the engine's own words and gloo's.
LOST_PEER = ("has exited", "Connection closed by peer", "Connection reset by peer")


def follow(
    started: list[BaseProcess],
    reports: list[Connection],
    out: Connection,
    err: Connection,
    counts: Connection,
    limit: float | None,
) -> tuple[bytes, list[str]]:
    """Wait for every worker's report, passing worker 0's output and progress on;
    worker 0's return value and the saved files, or raise on the first failure
    or once ``limit`` seconds have passed."""
    deadline = None if limit is None else time.monotonic() + limit
    waiting = {reports[rank]: rank for rank in range(len(reports))}
    sentinels = {process.sentinel: rank for rank, process in enumerate(started)}
    streams: dict[Any, IO[str]] = {out: sys.stdout, err: sys.stderr}
    drawing = progress.Drawing()
    drawn = [counts]  # until worker 0 closes it
    outcome: tuple[bytes, list[str]] | None = None
    try:
        while waiting:
            if deadline is not None and time.monotonic() > deadline:
                _drain(streams)
                raise PyroDistributedError(
                    f"the launch ran past its time_limit of {limit:g} s; every worker was "
                    f"stopped (workers {sorted(set(waiting.values()))} of {len(started)} had "
                    f"not finished)"
                )
            ready = wait([*waiting, *streams, *drawn, *sentinels], timeout=1.0)
            for source in ready:
                if source in streams:
                    if not _forward(source, streams[source]):  # type: ignore[arg-type]
                        del streams[source]
                elif source is counts:
                    if not _draw(counts, drawing):
                        drawn.clear()
                elif source in waiting:
                    rank = waiting.pop(source)
                    report = _receive(source, rank, started)
                    if report[0] == "error":
                        _drain(streams)
                        _raise_if_one_died(started, waiting, rank, report[1])
                    if rank == 0:
                        outcome = (report[1], report[2])
                elif source in sentinels:
                    rank = sentinels.pop(source)
                    still = [conn for conn, r in waiting.items() if r == rank]
                    if still and not still[0].poll(1.0):
                        raise PyroDistributedError(
                            f"worker {rank} of {len(started)} died without a word (exit "
                            f"code {started[rank].exitcode}); every worker was stopped"
                            f"{_guard_hint()}"
                        )
        # Every worker has reported, and worker 0 flushed its output before it
        # did: what it wrote is in the pipes now. Read that much and no more, as
        # a process it started may hold the pipes open for as long as it lives.
        _drain(streams, wait_s=0.0)
        while drawn and counts.poll() and _draw(counts, drawing):
            pass
    finally:
        drawing.close()
    assert outcome is not None
    return outcome


def _raise_if_one_died(
    started: list[BaseProcess], waiting: dict[Connection, int], raised: int, report: str
) -> None:
    """Raise the failure to report, once a worker has raised ``report``.

    A worker often raises because a peer vanished or failed first (a closed
    connection, a peer that "has exited"): that peer's failure is the cause.
    So the workers that have not reported get a moment: one that died without
    a word is named; else the first error that is not about a lost peer."""
    errors = {raised: report}
    deadline = time.monotonic() + DEATH_GRACE_S
    for source, rank in waiting.items():
        started[rank].join(max(0.0, deadline - time.monotonic()))
        try:
            if not source.poll():
                continue
            answer = source.recv()
        except EOFError:
            raise PyroDistributedError(
                f"worker {rank} of {len(started)} died without a word (exit code "
                f"{started[rank].exitcode}), and worker {raised} raised after it; every "
                f"worker was stopped{_guard_hint()}"
            ) from None
        if answer[0] == "error":
            errors[rank] = answer[1]
    cause = next((rank for rank, text in errors.items() if not _about_a_lost_peer(text)), raised)
    raise PyroDistributedError(
        f"worker {cause} of {len(started)} raised; every worker was stopped. Its "
        f"traceback:\n{errors[cause]}"
    )


def _about_a_lost_peer(traceback: str) -> bool:
    last = traceback.strip().splitlines()[-1] if traceback.strip() else ""
    return any(sign in last for sign in LOST_PEER)


def _guard_hint() -> str:
    """For a worker that died before it ran anything: the most common cause."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None):
        return (
            "; if it died at its start, check that the script that launched it keeps "
            'its own code under `if __name__ == "__main__":`, which forkserver and '
            "spawn workers need"
        )
    return ""


def send(to: Connection, payload: bytes, rank: int, started: list[BaseProcess]) -> None:
    try:
        to.send_bytes(payload)
    except (BrokenPipeError, ConnectionResetError):
        started[rank].join(1.0)
        raise PyroDistributedError(
            f"worker {rank} of {len(started)} died before it received its function "
            f"(exit code {started[rank].exitcode}){_guard_hint()}"
        ) from None


def _receive(source: Connection, rank: int, started: list[BaseProcess]) -> tuple[Any, ...]:
    try:
        report: tuple[Any, ...] = source.recv()
    except EOFError:
        started[rank].join(1.0)
        raise PyroDistributedError(
            f"worker {rank} of {len(started)} died without a word (exit code "
            f"{started[rank].exitcode}); every worker was stopped{_guard_hint()}"
        ) from None
    return report


def _forward(source: Connection, to: IO[str]) -> bool:
    """Pass what worker 0 wrote on; ``False`` once it has closed its end."""
    try:
        data = os.read(source.fileno(), 65536)
    except OSError:
        return False
    if not data:
        return False
    to.write(data.decode(errors="replace"))
    to.flush()
    return True


def _drain(streams: dict[Any, IO[str]], wait_s: float = 0.2) -> None:
    """What worker 0 wrote, so that its last words are shown: each stream until
    nothing more arrives within ``wait_s``, and for :data:`DRAIN_S` at most, as
    a worker (or a process it started) may go on writing for ever."""
    deadline = time.monotonic() + DRAIN_S
    for source, to in list(streams.items()):
        while (
            time.monotonic() < deadline
            and source.poll(min(wait_s, max(0.0, deadline - time.monotonic())))
            and _forward(source, to)
        ):
            pass


def _draw(counts: Connection, drawing: progress.Drawing) -> bool:
    """Draw what worker 0 sent; ``False`` once it has closed its end."""
    try:
        drawing.receive(counts.recv())
    except EOFError:
        return False
    return True
