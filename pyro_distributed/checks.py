"""Validating users' arguments, one way everywhere.

The rule: an argument of the wrong type raises :class:`TypeError`, one of
the right type but out of range raises :class:`ValueError`, and either
message names the argument, what it takes and what it got. ``bool`` is not
accepted where a number is meant, although Python counts it as an ``int``:
``check_every=True`` is a mistake, not 1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from typing import Any


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """``value`` must be ``True`` or ``False`` (or ``None`` if ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> None:
    """``value`` must be an int (not a bool), at least ``minimum`` if given."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
    if minimum is not None and value < minimum:
        wanted = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"at least {minimum}")
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


def check_number(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    finite: bool = True,
    below: float | None = None,
) -> None:
    """``value`` must be an int or a float (not a bool): finite unless ``finite``
    is false, greater than 0 if ``positive``, less than ``below`` if given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    wanted = [
        *(["positive"] if positive else []),
        *(["finite"] if finite else []),
        *([f"less than {below}"] if below is not None else []),
    ]
    if (
        (finite and not math.isfinite(value))
        or (positive and not value > 0)
        or (below is not None and not value < below)
    ):
        raise ValueError(f"{name} must be {' and '.join(wanted)}, got {value!r}")


def check_path(name: str, value: Any) -> None:
    """``value`` must name a file: a non-empty ``str`` or ``os.PathLike`` of one."""
    shown = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(shown, str):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {value!r}")
    if not shown:
        raise ValueError(f"{name} must be a path, got an empty one")


def check_choice(name: str, value: Any, choices: Collection[str]) -> None:
    """``value`` must be one of the strings ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {_listed(choices)}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be {_listed(choices)}, got {value!r}")


def _listed(choices: Collection[str]) -> str:
    quoted = [repr(choice) for choice in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
