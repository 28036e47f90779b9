"""One training run of a front end, stepped, saved and loaded as the
checkpoint tests of hooks and step policies do it: SVI on the Pyro path
(``self.svi``), or a module's loop torch-native (``self.module``, ``self.x``,
``self.y``), with ``self.optim`` the distributed optimizer. A subclass makes
them in its ``__init__``."""

from __future__ import annotations

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
