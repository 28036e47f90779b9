"""What a launch's workers trained, carried into the launching process and into the next launch.

Forked workers train in their own memory, so when the function returns they
save what they trained with the library's own checkpoints, one per
:class:`DistributedOptimizer` the function made, in the order made (or the
param store alone, with none). The launching process loads the first at one
worker, joining the local blocks in order
(:mod:`pyro_distributed.local.blocks`), and copies values into the tensors it
already has, so a guide or ``PyroModule`` made in the kernel holds them too.
``resume=`` loads the k-th checkpoint into the k-th optimizer the function
makes, as it is made, so two launches of n steps end bitwise where one of 2n
does.
"""

from __future__ import annotations

import shutil
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import files, load_checkpoint, param_store, save_checkpoint
from ..engines.local import LocalEngine
from ..local.blocks import load_blocks
from ..local.registry import LocalParam
from ..optim.distributed import DistributedOptimizer, watch_created
from ..runtime import current_engine

#: The file that carries the param store when the function made no optimizer.
STORE_ONLY = "store.pt"


@dataclass
class TrainedState:
    """The checkpoints a launch's workers left, in a directory of its own.

    :param directory: where they are; removed once nothing refers to this state.
    :param files: one per optimizer the function made, in order, or :data:`STORE_ONLY`.
    :param world_size: how many workers wrote them.
    """

    directory: Path
    files: list[str] = field(default_factory=list)
    world_size: int = 0

    def __post_init__(self) -> None:
        weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)


class Collector:
    """In a worker: records the optimizers the function makes, resuming each
    from ``resume``'s checkpoint of the same place in the order."""

    def __init__(self, resume: TrainedState | None) -> None:
        self.made: list[DistributedOptimizer] = []
        self._resume = resume
        self._stop = watch_created(self._on_created)

    def _on_created(self, optim: DistributedOptimizer) -> None:
        self.made.append(optim)
        files = self._resume.files if self._resume is not None else []
        if self._resume is not None and len(self.made) <= len(files):
            name = files[len(self.made) - 1]
            if name != STORE_ONLY:
                load_checkpoint(self._resume.directory / name, optim)

    def save(self, directory: Path) -> list[str]:
        """Save what was trained (a collective); the files' names."""
        self._stop()
        if not self.made:
            param_store.save_store(directory / STORE_ONLY, current_engine())
            return [STORE_ONLY]
        names = [f"optimizer{number}.pt" for number in range(len(self.made))]
        for optim, name in zip(self.made, names, strict=True):
            save_checkpoint(directory / name, optim)
        return names


def local_bytes(state: TrainedState) -> int:
    """The size of the owned local rows' block files of the first checkpoint."""
    first = state.directory / state.files[0]
    return sum(block.stat().st_size for block in state.directory.glob(f"{first.name}.*.block*"))


def load_here(state: TrainedState, *, with_local: bool) -> None:
    """Load the first checkpoint into this process's param store, at one worker:
    values copied into the tensors that exist, local rows joined in order."""
    param_store.load_store_here(state.directory / state.files[0], with_local=with_local)


def read_rows(state: TrainedState, name: str) -> torch.Tensor:
    """All rows of owned local parameter ``name``, joined from the block files."""
    path = state.directory / state.files[0]
    saved = files.load_file(path)["local"] or {"params": {}}
    if name not in saved["params"]:
        raise KeyError(
            f"{name!r} is not an owned local parameter of this launch; "
            f"its owned local parameters are {sorted(saved['params'])}"
        )
    plate, size, axis = saved["params"][name]
    whole = LocalParam(name, plate, size, axis)
    values, _ = load_blocks(path, saved, {name: whole}, LocalEngine())
    return values[name]
