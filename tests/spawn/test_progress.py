"""``pd.progress`` (``spawn/progress.py``): worker 0's bar, drawn where the user looks.

Under ``pd.launch`` worker 0 sends its counts down a pipe to the launching
process, which draws them (``tests/spawn/test_notebooks.py`` sees the bar in
a kernel); here one process plays both sides of a real pipe.
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Iterator

import pytest

import pyro_distributed as pd
from pyro_distributed.spawn.progress import Drawing

#: The module, not the function that ``pyro_distributed.spawn`` exports under its name.
progress_module = importlib.import_module("pyro_distributed.spawn.progress")


def received(pipe: multiprocessing.connection.Connection) -> list[tuple[object, ...]]:
    messages = []
    while pipe.poll():
        messages.append(pipe.recv())
    return messages


def test_in_a_launch_worker_0_sends_its_counts_to_the_launching_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    monkeypatch.setattr(progress_module, "_channel", writer)  # what pd.launch sets in a worker
    assert list(pd.progress(range(5), desc="svi")) == list(range(5))
    messages = received(reader)
    assert messages[0] == ("start", 5, "svi")
    assert messages[-1] == ("close", 5)
    counts = [count for kind, count in messages[1:-1]]
    assert counts == sorted(counts) and all(1 <= count <= 5 for count in counts)


def test_a_worker_that_stops_early_still_closes_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    monkeypatch.setattr(progress_module, "_channel", writer)
    for step in pd.progress(range(10)):
        if step == 2:
            break
    messages = received(reader)
    assert messages[0] == ("start", 10, "")
    assert messages[-1] == ("close", 3)


def test_the_length_is_taken_from_the_iterable_or_given(monkeypatch: pytest.MonkeyPatch) -> None:
    def steps() -> Iterator[int]:
        yield from range(4)

    reader, writer = multiprocessing.Pipe(duplex=False)
    monkeypatch.setattr(progress_module, "_channel", writer)
    list(pd.progress(steps()))
    list(pd.progress(steps(), total=4))
    starts = [message for message in received(reader) if message[0] == "start"]
    assert starts == [("start", None, ""), ("start", 4, "")]


def test_outside_a_launch_worker_0_draws_its_own_bar(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(pd.progress(["a", "b", "c"], desc="fit")) == ["a", "b", "c"]
    drawn = capsys.readouterr().err
    assert "fit" in drawn and "3/3" in drawn


def test_the_launching_process_draws_what_worker_0_sends(
    capsys: pytest.CaptureFixture[str],
) -> None:
    drawing = Drawing()
    for message in [("start", 4, "svi"), ("update", 2), ("update", 4), ("close", 4)]:
        drawing.receive(message)
    drawn = capsys.readouterr().err
    assert "svi" in drawn and "4/4" in drawn
