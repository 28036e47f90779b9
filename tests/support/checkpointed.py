"""One training run of a front end, stepped, saved and loaded as the
checkpoint tests of hooks and step policies do it: SVI on the Pyro path
(``self.svi``), or a module's loop torch-native (``self.module``, ``self.x``,
``self.y``), with ``self.optim`` the distributed optimizer. A subclass makes
them in its ``__init__``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyro
import torch

import pyro_distributed as pd


class CheckpointedRun:
    """Steps, saves and loads; :meth:`values` are what a resumed run must match."""

    front_end: str
    optim: Any
    svi: Any
    module: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor

    def step(self) -> None:
        if self.front_end == "pyro":
            self.svi.step(self.x, self.y)
            return
        self.optim.zero_grad()
        ((self.module(self.x) - self.y) ** 2).mean().backward()
        self.optim.step()

    def save(self, path: str) -> None:
        extra = {} if self.front_end == "pyro" else {"module": self.module}
        pd.save_checkpoint(path, self.optim, **extra)

    def load(self, path: str) -> int:
        extra = {} if self.front_end == "pyro" else {"module": self.module}
        return pd.load_checkpoint(path, self.optim, **extra)

    def values(self) -> list[torch.Tensor]:
        """The param store's values by name; the module's parameters and buffers."""
        if self.front_end == "pyro":
            return [value.detach().clone() for _, value in sorted(pyro.get_param_store().items())]
        return [t.detach().clone() for t in (*self.module.parameters(), *self.module.buffers())]


def resumed_against_straight(
    make: Callable[[], CheckpointedRun],
    path: str,
    steps: int,
    save_at: int,
    rolled_to: int,
    afresh: Callable[[CheckpointedRun], None],
) -> dict[str, Any]:
    """Whether each run ends bitwise where one straight run of ``steps`` does:
    ``"rolled back"`` (saved after ``save_at`` steps, run on to ``rolled_to``,
    loaded in the same process, run to the end), ``"resumed"`` (a new run that
    loads the file) and ``"control"`` (the same, with ``afresh`` throwing the
    extensions' state away after the load: it must differ); and ``"start"``
    (the load gave back ``save_at``) and ``"saved in sync"`` (``optim.in_sync``
    at the save)."""
    straight = make()
    for _ in range(steps):
        straight.step()
    expected = straight.values()

    rolled = make()
    saved_in_sync = None
    for step in range(rolled_to):
        rolled.step()
        if step + 1 == save_at:
            saved_in_sync = rolled.optim.in_sync
            rolled.save(path)
    start = rolled.load(path)
    for _ in range(start, steps):
        rolled.step()
    # Read now: the next run clears the param store.
    found = {"rolled back": rolled.values()}

    resumed = make()
    for _ in range(resumed.load(path), steps):
        resumed.step()
    found["resumed"] = resumed.values()

    control = make()
    control.load(path)
    afresh(control)
    for _ in range(save_at, steps):
        control.step()
    found["control"] = control.values()

    outcome = {name: all(map(torch.equal, values, expected)) for name, values in found.items()}
    return {**outcome, "start": start == save_at, "saved in sync": saved_in_sync}
