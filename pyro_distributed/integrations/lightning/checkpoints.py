"""Lightning checkpoints of the strategy, written and loaded: every worker's RNG states, and
local parameters' blocks.

Lightning dumps one dictionary (the module's ``state_dict``, each optimizer's
``state_dict``, loops, callbacks) and has worker 0 write it. A local parameter
(``own_local_params=True``) never exists whole on any worker, so :func:`save`
takes it out of the module's and the optimizers' state and has every worker
write its block, with its rows of the optimizer state, beside the file
(``<file>.<token>.block<r>of<W>``, :mod:`pyro_distributed.local.blocks`),
through the same commit as :func:`pyro_distributed.save_checkpoint`
(:func:`pyro_distributed.checkpoint.files.commit`):

1. every worker writes its block under a token that is new at each save; if
   any could not, every worker raises and this save's blocks are removed;
2. worker 0 writes Lightning's file, which names the token: the commit;
3. every worker learns whether it could; if not, every worker raises, and the
   previous checkpoint at that path (its file and its blocks) is intact;
4. worker 0 removes the blocks of the superseded saves of that same path.

Worker 0 writes the file itself when the Trainer uses Lightning's default
``TorchCheckpointIO`` and a local path: ``torch.save`` to a temporary file in
the same directory, flushed to disk, renamed over the target (Lightning's own
write goes through fsspec and is not flushed). A custom ``checkpoint_io``
writes it instead: blocks and failure reports stay as above, and the file is
replaced as atomically as that plugin replaces it. An asynchronous one
(``AsyncCheckpointIO``) is refused for local parameters, since the old blocks
would be removed before the new file exists. A remote path (``s3://...``)
is written by ``checkpoint_io`` on worker 0, as Lightning does, and cannot
hold local parameters.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from ... import atomic_write
from ...checkpoint import extensions, files
from ...checkpoint.modules import ModuleLocal, module_locals, state_indices, without_state
from ...engines import Engine
from ...errors import PyroDistributedError
from ...local.blocks import load_blocks, remove_blocks
from ...local.registry import LocalParam, local_params
from ...optim.front_end import FrontEnd
from ...seeding import shared_generator
from . import internals, pyro_state

# -- what both directions share, and loading

#: Where the strategy's entries live in Lightning's checkpoint dictionary.
KEY = "pyro_distributed"


@dataclass
class Resumption:
    """What loading one checkpoint carries from the file to the module and the optimizers.

    :param where: the checkpoint file, symlinks resolved (block files lie
        beside the file itself); ``None`` for a remote path.
    :param trusted: whether block files may be unpickled in full: only where
        Lightning was asked to load its own file with ``weights_only=False``.
        Block files hold data alone, so they load either way.
    :param rows: this worker's optimizer-state rows of each local parameter,
        read with the module's blocks and kept until the optimizers are restored.
    """

    where: Path | None
    trusted: bool = False
    rows: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, filepath: str | os.PathLike[str], weights_only: bool | None) -> Resumption:
        target = local_path(filepath)
        return cls(target.resolve() if target is not None else None, weights_only is False)


def module_state(
    checkpoint: Mapping[str, Any],
    resumption: Resumption | None,
    module: torch.nn.Module,
    engine: Engine,
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
    values, resumption.rows = load_blocks(
        resumption.where, local, records, engine, trusted=resumption.trusted
    )
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


#: Where the extension states of a Pyro plan's optimizer (scvi-tools') live,
#: beside those of ``configure_optimizers``' optimizers.
PYRO_OPTIM_EXTENSIONS = "pyro_optim_extensions"


def _extension_entries(checkpoint: Mapping[str, Any], index: int | None) -> dict[str, Any]:
    """The entries :mod:`pyro_distributed.checkpoint.extensions` reads, for the
    ``index``-th optimizer (``None``: the Pyro plan's)."""
    saved = checkpoint.get(KEY) or {}
    entries = {"world_size": saved.get("world_size")}
    if index is None:
        if saved.get(PYRO_OPTIM_EXTENSIONS) is not None:
            entries[extensions.KEY] = saved[PYRO_OPTIM_EXTENSIONS]
        return entries
    states = saved.get(extensions.KEY) or []
    if index < len(states) and states[index] is not None:
        entries[extensions.KEY] = states[index]
    return entries


def _distributed(optimizers: list[Any], pyro_optim: Any) -> list[tuple[int | None, FrontEnd]]:
    """The distributed optimizers by place: ``configure_optimizers``' by index,
    the Pyro plan's (``None``)."""
    found: list[tuple[int | None, FrontEnd]] = [
        (index, optimizer)
        for index, optimizer in enumerate(optimizers)
        if isinstance(optimizer, FrontEnd)
    ]
    if isinstance(pyro_optim, FrontEnd):
        found.append((None, pyro_optim))
    return found


def check_extensions(
    checkpoint: Mapping[str, Any],
    optimizers: list[Any],
    engine: Engine,
    shown: str,
    pyro_optim: Any = None,
) -> None:
    """Refuse, on every worker and before any optimizer is restored, hook or
    step policy state that an optimizer cannot take (a collective)."""

    def check() -> None:
        for index, optimizer in _distributed(optimizers, pyro_optim):
            extensions.check(_extension_entries(checkpoint, index), optimizer, engine, shown)

    files.agree(engine, check)


def restore_extensions(
    checkpoint: Mapping[str, Any],
    optimizers: list[Any],
    engine: Engine,
    shown: str,
    pyro_optim: Any = None,
) -> None:
    """Each distributed optimizer's communication hook and step policy (and,
    under a policy that lets workers step alone, this worker's own optimizer
    state), from the state this worker saved
    (:mod:`pyro_distributed.checkpoint.extensions`); afresh, with a warning,
    where the file holds none for this number of workers."""
    for index, optimizer in _distributed(optimizers, pyro_optim):
        optimizer.forget()
        extensions.restore(_extension_entries(checkpoint, index), optimizer, engine, shown)


def restore_rng(checkpoint: Mapping[str, Any], engine: Engine) -> None:
    """The shared generator, and this worker's RNG states when the checkpoint
    was written by as many workers (so that a resumed run continues bitwise)."""
    state = checkpoint.get(KEY)
    if state is not None:
        files.restore_rng(state, engine)


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


# -- writing


def save(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    *,
    engine: Engine,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    checkpoint_io: CheckpointIO,
    storage_options: Any = None,
) -> None:
    """Write Lightning's ``checkpoint`` to ``filepath``, local parameters as blocks
    (a collective: Lightning calls it on every worker).

    :raises PyroDistributedError: on every worker, if any worker could not
        write its part, naming the workers and what failed; the previous
        checkpoint at ``filepath`` is then intact.
    """
    write = _writer(checkpoint_io, storage_options)
    target = local_path(filepath)
    local = module_locals(module)
    places = {name: _places(held, optimizers) for name, held in local.items()}
    problem = None
    if local and target is not None:
        try:  # every worker writes into the directory, so every worker makes it
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    outside = sorted(set(local_params()) - {held.pyro_name for held in local.values()})
    described = sorted((name, *spec(held), places[name]) for name, held in local.items())
    signature = (described, outside)
    shared = engine.allgather_object((signature, problem))
    _refuse(filepath, shared, local, places, target, checkpoint_io)
    pyro_shared, pyro_rows = pyro_state.pyro_optimizer_state(module, local)
    pyro_optim = pyro_state.pyro_optimizer(module)
    meta = {
        "pyro_optim": pyro_shared,  # a Pyro plan's optimizer (scvi-tools'), rows in the blocks
        "pyro_optim_steps": pyro_state.pyro_optimizer_steps(module),
        "world_size": engine.world_size,
        "rng": files.gather_rng(engine),  # plain data, as weights_only=True accepts
        "shared_rng": shared_generator().get_state(),
        "num_steps": [getattr(optimizer, "num_steps", None) for optimizer in optimizers],
        # Per optimizer, every worker's state of its hook and step policy.
        extensions.KEY: [
            extensions.gather(engine, optimizer) if isinstance(optimizer, FrontEnd) else None
            for optimizer in optimizers
        ],
        PYRO_OPTIM_EXTENSIONS: (
            extensions.gather(engine, pyro_optim) if isinstance(pyro_optim, FrontEnd) else None
        ),
    }
    if target is None:  # a remote path, no local parameters: as Lightning writes it
        if engine.rank == 0:
            checkpoint_io.save_checkpoint(
                {**checkpoint, KEY: meta}, filepath, storage_options=storage_options
            )
        return
    stripped = _without_local(checkpoint, local, places)
    optimizer_rows = {}
    for name, held in local.items():
        if places[name] is not None:
            optimizer_state = optimizers[places[name][0]].state
            if held.param in optimizer_state:
                optimizer_rows[name] = dict(optimizer_state[held.param])
        elif name in pyro_rows:
            optimizer_rows[name] = pyro_rows[name]

    def state(local_meta: dict[str, Any] | None) -> dict[str, Any]:
        if local_meta is not None:
            local_meta = {**local_meta, "optimizers": places}
        return {**stripped, KEY: {**meta, "local": local_meta}}

    records = {name: held.record for name, held in local.items()}
    values = {name: held.param for name, held in local.items()}
    files.commit(target, engine, state, records, values, optimizer_rows, write=write)


def remove(filepath: str | Path, checkpoint_io: CheckpointIO) -> None:
    """Delete a checkpoint (worker 0): the file, then its block files.

    In that order, so that a crash in between leaves unused blocks, never a
    file that names missing ones. A symlink (``save_last="link"``) is removed
    alone: the blocks belong to the file it points to.
    """
    target = local_path(filepath)
    linked = target is not None and target.is_symlink()
    checkpoint_io.remove_checkpoint(filepath)
    if target is not None and not linked:
        remove_blocks(target)


# -- saving


def _writer(
    checkpoint_io: CheckpointIO, storage_options: Any
) -> Callable[[Path, dict[str, Any]], None]:
    """How worker 0 writes the file: itself, atomically, in place of Lightning's
    default plugin (refusing what that plugin refuses), or through the plugin."""
    if type(checkpoint_io) is TorchCheckpointIO:
        if storage_options is not None:
            raise TypeError(
                "trainer.save_checkpoint(..., storage_options=...) needs a CheckpointIO "
                "plugin that uses them; Lightning's TorchCheckpointIO does not"
            )
        return _write_here

    def through_plugin(path: Path, state: dict[str, Any]) -> None:
        checkpoint_io.save_checkpoint(state, path, storage_options=storage_options)

    return through_plugin


def _write_here(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A link is replaced, not written through: Lightning's last.ckpt may link
    # to the best checkpoint (save_last="link"), and saves last.ckpt again.
    atomic_write.write_with(path, lambda file: torch.save(state, file), through_links=False)


def _places(held: ModuleLocal, optimizers: list[torch.optim.Optimizer]) -> Any:
    """Where the optimizers' ``state_dict``\\s hold the parameter's state:
    ``(optimizer, index)``, ``None`` if no optimizer steps it, or every such
    place if several do (refused)."""
    found = [
        (number, indices[id(held.param)])
        for number, optimizer in enumerate(optimizers)
        if id(held.param) in (indices := state_indices(optimizer))
    ]
    return found[0] if len(found) == 1 else (found or None)


def _refuse(
    filepath: Any,
    shared: list[Any],
    local: dict[str, ModuleLocal],
    places: dict[str, Any],
    target: Path | None,
    checkpoint_io: CheckpointIO,
) -> None:
    """Raise, on every worker alike, if this save cannot be complete."""
    signatures = [signature for signature, _ in shared]
    if any(signature != signatures[0] for signature in signatures):
        shown = "; ".join(
            f"worker {rank}: {[entry[0] for entry in names] or 'none'}"
            for rank, (names, _) in enumerate(signatures)
        )
        raise PyroDistributedError(
            f"the workers disagree on which of the module's parameters are local, or "
            f"how ({shown}), so no checkpoint can hold them; every worker must build the "
            f"same module and cut the same parameters"
        )
    outside = signatures[0][1]
    if outside:
        raise PyroDistributedError(
            f"local parameters outside the LightningModule ({', '.join(outside[:3])}"
            f"{' ...' if len(outside) > 3 else ''}: in Pyro's param store, or on a module it "
            f"does not hold) are not part of a Lightning checkpoint, which holds the "
            f"module's state_dict; save them with pd.save_checkpoint(path, optim) from a "
            f"callback"
        )
    failed = {rank: problem for rank, (_, problem) in enumerate(shared) if problem is not None}
    if failed:
        shown = "; ".join(f"worker {rank}: {problem}" for rank, problem in failed.items())
        raise PyroDistributedError(
            f"could not make the directory of checkpoint {os.fspath(filepath)!r} ({shown}); "
            f"the previous checkpoint is intact"
        )
    if not local:
        return
    shared_by = sorted(name for name, place in places.items() if isinstance(place, list))
    if shared_by:
        raise ValueError(
            f"local parameter(s) {shared_by} are stepped by more than one optimizer; "
            f"a checkpoint of local parameters needs each in one optimizer"
        )
    if target is None:
        raise ValueError(
            f"a checkpoint of local parameters needs a local (or shared) file system for "
            f"the block files beside it, not {os.fspath(filepath)!r}"
        )
    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "AsyncCheckpointIO cannot write a checkpoint of local parameters: the blocks of "
            "the previous save would be removed before the new file exists"
        )


def _without_local(
    checkpoint: dict[str, Any], local: dict[str, ModuleLocal], places: dict[str, Any]
) -> dict[str, Any]:
    """Lightning's checkpoint without the local parameters, which travel as blocks."""
    stripped = {**checkpoint}
    stripped["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in local}
    if "optimizer_states" in checkpoint:
        taken: dict[int, set[int]] = {}
        for place in places.values():
            if place is not None:
                taken.setdefault(place[0], set()).add(place[1])
        stripped["optimizer_states"] = [
            without_state(saved, taken.get(number, set()))
            for number, saved in enumerate(checkpoint["optimizer_states"])
        ]
    return stripped
