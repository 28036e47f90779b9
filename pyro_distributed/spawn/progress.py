"""A progress bar that worker 0 reports and the launching process draws.

A bar drawn inside a worker cannot reach a notebook: a notebook's bar is a
widget of the kernel. So under :func:`~pyro_distributed.launch` worker 0 sends
its counts to the kernel, which draws them (tqdm's notebook bar where tqdm is
installed, text otherwise); outside a launch, worker 0 draws its own bar.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sized
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from ..checks import check_int
from ..runtime import is_main

T = TypeVar("T")

#: Where worker 0 of a launch sends its counts (set in the worker by the launch).
_channel: Connection | None = None
#: The fewest seconds between two counts sent.
_EVERY_S = 0.1


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterator[T]:
    """Iterate ``iterable``, showing worker 0's progress once, where the user looks.

    Under :func:`~pyro_distributed.launch` the bar appears in the notebook cell
    (or the terminal) that launched the workers; in a script run by a launcher,
    worker 0 draws it; the other workers draw nothing.

    :param iterable: what to iterate, for example ``range(num_steps)``.
    :param total: its length, if ``len()`` cannot tell.
    :param desc: a label for the bar.

    Example::

        for step in pd.progress(range(1000), desc="svi"):
            svi.step(data)
    """
    if not isinstance(iterable, Iterable):
        raise TypeError(f"progress: iterable must be iterable, got {iterable!r}")
    check_int("progress: total", total, minimum=0, optional=True)
    if not isinstance(desc, str):
        raise TypeError(f"progress: desc must be a str, got {desc!r}")
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    # Checked above, at the call: the loop below runs at the first step.
    return _iterate(iterable, total, desc)


def _iterate(iterable: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    if _channel is not None:
        yield from _reported(iterable, total, desc, _channel)
    elif is_main():
        bar = Bar(total, desc)
        try:
            for count, item in enumerate(iterable, 1):
                yield item
                bar.update(count)
        finally:
            bar.close()
    else:
        yield from iterable


def _reported(iterable: Iterable[T], total: int | None, desc: str, to: Connection) -> Iterator[T]:
    to.send(("start", total, desc))
    last = 0.0
    count = 0
    try:
        for count, item in enumerate(iterable, 1):
            yield item
            if time.monotonic() - last >= _EVERY_S:
                last = time.monotonic()
                to.send(("update", count))
    finally:
        to.send(("close", count))


class Bar:
    """tqdm's bar (its notebook widget in a kernel) where tqdm is installed, text otherwise."""

    def __init__(self, total: int | None, desc: str) -> None:
        self._total = total
        self._desc = desc
        self._shown = -1
        bar_class = _tqdm_class()
        self._tqdm = bar_class(total=total, desc=desc or None) if bar_class else None

    def update(self, count: int) -> None:
        if self._tqdm is not None:
            self._tqdm.update(count - self._tqdm.n)
            return
        tenth = count * 10 // self._total if self._total else count // 100
        if tenth != self._shown:
            self._shown = tenth
            of = f"/{self._total}" if self._total else ""
            print(f"{self._desc + ': ' if self._desc else ''}{count}{of}", flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


class Drawing:
    """The launching process's side: draws what worker 0 sends."""

    def __init__(self) -> None:
        self._bar: Bar | None = None

    def receive(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "start":
            self.close()
            self._bar = Bar(message[1], message[2])
        elif self._bar is not None:
            self._bar.update(message[1])
            if kind == "close":
                self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _tqdm_class() -> Any:
    """tqdm's notebook bar where ipywidgets can draw it, its text bar otherwise,
    ``None`` without tqdm."""
    try:
        import ipywidgets  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: F401
        from tqdm.auto import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            return None
    return tqdm
