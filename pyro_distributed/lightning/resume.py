"""Loading a Lightning checkpoint of the strategy: local parameters' blocks and RNG states.

The other half of :mod:`pyro_distributed.lightning.checkpoints`, which writes them.

Loading follows Lightning's order: every worker reads the file
(``strategy.load_checkpoint``, where :class:`Resumption` remembers where the
file really is, a symlink from ``save_last="link"`` resolved), the module is
restored after the LightningModule's ``setup()``, then the optimizers.
:func:`module_state` puts this worker's rows of every local parameter into the
``state_dict`` Lightning loads, re-partitioned for this number of workers
(:func:`~pyro_distributed.local.blocks.load_blocks`); :func:`optimizer_states`
puts their optimizer-state rows back where they were taken from. The
parameters must already be local, cut to this worker's block, when the module
is restored (the strategy's rule: create them in ``setup()``): the restore
copies into them, so the module and the optimizer keep the same tensors, and
the record of which rows are local is the one ``setup()`` made.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import files
from ..checkpoint.modules import ModuleLocal, module_locals
from ..engines import Engine
from ..errors import PyroDistributedError
from ..local.blocks import load_blocks
from ..local.registry import LocalParam
from . import internals

__all__ = [
    "KEY",
    "Resumption",
    "local_path",
    "module_state",
    "optimizer_states",
    "restore_counts",
    "restore_rng",
    "rng_for_file",
    "spec",
]

#: Where the strategy's entries live in Lightning's checkpoint dictionary.
KEY = "pyro_distributed"


@dataclass
class Resumption:
    """What loading one checkpoint carries from the file to the module and the optimizers.

    :param where: the checkpoint file, symlinks resolved (block files lie
        beside the file itself); ``None`` for a remote path.
    :param rows: this worker's optimizer-state rows of each local parameter,
        read with the module's blocks and kept until the optimizers are restored.
    """

    where: Path | None
    rows: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, filepath: str | os.PathLike[str]) -> Resumption:
        target = local_path(filepath)
        return cls(target.resolve() if target is not None else None)


def module_state(
    checkpoint: Mapping[str, Any], resumption: Resumption | None, module: torch.nn.Module
) -> dict[str, Any]:
    """The checkpoint's ``state_dict`` with this worker's rows of every local
    parameter, read from the blocks and re-partitioned for this world size."""
    state: dict[str, Any] = checkpoint["state_dict"]
    local = (checkpoint.get(KEY) or {}).get("local")
    current = module_locals(module)
    specs = local["params"] if local is not None else {}
    saved = {name: LocalParam(name, *spec) for name, spec in specs.items()}
    _check_same_locals(saved, current)
    if local is None:
        return state
    if resumption is None or resumption.where is None:
        raise PyroDistributedError(
            "this checkpoint holds local parameters as block files beside it; restore it "
            "through the Trainer (trainer.fit(..., ckpt_path=...)), which reads it with "
            "PyroDistributedStrategy.load_checkpoint and so learns where the blocks are"
        )
    records = {name: current[name].record for name in saved}
    values, resumption.rows = load_blocks(resumption.where, local, records)
    return {**state, **values}


def optimizer_states(
    checkpoint: Mapping[str, Any], resumption: Resumption | None
) -> list[dict[str, Any]]:
    """The checkpoint's optimizer states with this worker's rows of every local
    parameter's state back in place (by the index they were taken from)."""
    states = list(checkpoint["optimizer_states"])
    local = (checkpoint.get(KEY) or {}).get("local")
    if local is None or resumption is None:
        return states
    for name, place in local["optimizers"].items():
        if place is not None and name in resumption.rows:
            index, position = place
            saved = states[index]
            states[index] = {**saved, "state": {**saved["state"], position: resumption.rows[name]}}
    resumption.rows = {}
    return states


def restore_counts(checkpoint: Mapping[str, Any], optimizers: Iterable[Any]) -> None:
    """Each distributed optimizer's step count (its drift checks' schedule)."""
    counts = (checkpoint.get(KEY) or {}).get("num_steps") or []
    for optimizer, count in zip(optimizers, counts, strict=False):
        if count is not None and hasattr(optimizer, "num_steps"):
            optimizer.num_steps = count


def restore_rng(checkpoint: Mapping[str, Any], engine: Engine) -> None:
    """The shared generator, and this worker's RNG states when the checkpoint
    was written by as many workers (so that a resumed run continues bitwise)."""
    state = checkpoint.get(KEY)
    if state is not None:
        rng = [_rng_from_file(worker) for worker in state["rng"]]
        files.restore_rng({**state, "rng": rng}, engine)


def local_path(filepath: str | os.PathLike[str]) -> Path | None:
    """``filepath`` as a local path, or ``None`` for a remote URL."""
    text = os.fspath(filepath)
    if not internals.is_local_path(text):
        return None
    return Path(text.removeprefix("file://"))


def spec(held: ModuleLocal) -> tuple[str, int, int]:
    """How a local parameter is cut: its plate, the plate's size and the axis."""
    return held.record.plate, held.record.size, held.record.axis


def _check_same_locals(saved: dict[str, LocalParam], current: dict[str, ModuleLocal]) -> None:
    """Refuse a checkpoint whose local parameters are not this run's."""
    for name, param in saved.items():
        held = current.get(name)
        if held is None:
            raise PyroDistributedError(
                f"the checkpoint holds {name!r} as local blocks (plate {param.plate!r} of "
                f"size {param.size}), but in this run it is not local: resume with "
                f"PyroDistributedStrategy(own_local_params=True), and create it in the "
                f"LightningModule's setup(), inside pd.shard_subsamples(own_local_params="
                f"True, by_block=True), so that it is cut to this worker's block before "
                f"the checkpoint is restored"
            )
        if spec(held) != (param.plate, param.size, param.axis):
            raise ValueError(
                f"the checkpoint's local parameter {name!r} lies along plate "
                f"{param.plate!r} of size {param.size} (axis {param.axis}), this run's "
                f"along {held.record.plate!r} of size {held.record.size} (axis "
                f"{held.record.axis}): it is a checkpoint of a different model"
            )
    whole = sorted(set(current) - set(saved))
    if whole:
        raise PyroDistributedError(
            f"{whole} are local in this run but the checkpoint holds them whole (it was "
            f"written without own_local_params); resume it with own_local_params=False"
        )


# -- RNG states in types that torch.load(weights_only=True), Lightning's default, accepts


def rng_for_file(worker_state: Any) -> Any:
    """A worker's RNG states with NumPy's key array as a list of ints."""
    rng, blocks = worker_state
    kind, keys, *rest = rng["numpy"]
    return {**rng, "numpy": (kind, keys.tolist(), *rest)}, blocks


def _rng_from_file(worker_state: Any) -> Any:
    """The inverse of :func:`rng_for_file`."""
    rng, blocks = worker_state
    kind, keys, *rest = rng["numpy"]
    return {**rng, "numpy": (kind, np.asarray(keys, dtype=np.uint32), *rest)}, blocks
