"""One way to find out that workers disagree, and to say so.

Many checks have the same shape: every worker describes what it holds
(a parameter's plate, a result's digest, the checksum of its state), the
descriptions are gathered, and if they differ every worker raises the same
:class:`~pyro_distributed.PyroDistributedError`, naming the item and which
workers hold what. :func:`require_agreement` does all of it;
:func:`first_disagreement` is its second half, for callers that gathered the
views themselves; :func:`describe_workers` and :func:`describe_split` are the
one format for naming workers in any message: ``worker 1``, ``workers 0, 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from .engines import Engine
from .errors import PyroDistributedError


class _Absent:
    """What a worker holds for an item it did not describe."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Absent)

    def __hash__(self) -> int:
        return 0


#: Stands for an item missing from a worker's view.
ABSENT: Any = _Absent()


def describe_workers(ranks: Iterable[int]) -> str:
    """``"worker 1"`` or ``"workers 0, 2"``."""
    ordered = sorted(ranks)
    return ("worker " if len(ordered) == 1 else "workers ") + ", ".join(map(str, ordered))


def describe_split(values: Sequence[Hashable], describe: Callable[[Any], str] = repr) -> str:
    """Which workers hold which value, ``values`` indexed by rank: for example
    ``"workers 0, 2: size 10; worker 1: size 12"`` (in order of first holder)."""
    holders: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        holders.setdefault(value, []).append(rank)
    return "; ".join(
        f"{describe_workers(ranks)}: {describe(value)}" for value, ranks in holders.items()
    )


def first_disagreement(
    views: Sequence[Mapping[str, Hashable]],
) -> tuple[str, list[Hashable]] | None:
    """The first item, in sorted order, that not every worker describes alike,
    with every worker's value (:data:`ABSENT` where it has none); ``None`` if
    all agree."""
    for item in sorted({key for view in views for key in view}):
        values = [view.get(item, ABSENT) for view in views]
        if len(set(values)) > 1:
            return item, values
    return None


def require_agreement(
    engine: Engine,
    view: Mapping[str, Hashable],
    *,
    message: Callable[[str, str], str],
    describe: Callable[[Any], str] = repr,
) -> None:
    """Gather every worker's ``view`` (a collective) and raise on every worker if
    an item differs.

    :param view: this worker's description of each item, by name; values must
        be picklable, hashable and comparable across processes.
    :param message: makes the error's text from the item and the
        :func:`describe_split` of its values.
    :param describe: how a value is shown (:data:`ABSENT` included).
    :raises PyroDistributedError: on every worker, for the first differing item.
    """
    views: list[Mapping[str, Hashable]] = engine.allgather_object(dict(view))
    found = first_disagreement(views)
    if found is not None:
        item, values = found
        raise PyroDistributedError(message(item, describe_split(values, describe)))
