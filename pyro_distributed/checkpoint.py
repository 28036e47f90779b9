"""Checkpoints that every worker can resume from, written without races.

A checkpoint holds the param store (values and constraints), the optimizer's
state (schedulers included), every worker's RNG state, the shared generator
behind sharded subsamples, and the step count.
Saving and loading are collectives, called on every worker:

* :func:`save_checkpoint` gathers the workers' RNG states to worker 0, which
  alone writes the file: to a temporary file in the same directory, flushed
  to disk, then renamed over the target. A crash mid-write leaves the previous
  checkpoint as it was. Every worker learns whether the write succeeded.
* :func:`load_checkpoint` has worker 0 read and check the file and send its
  bytes to the others, so only worker 0 needs to see the file system.

Local parameters (:mod:`pyro_distributed.local`) are the exception: each
worker writes and reads its own blocks of them, beside worker 0's file, and
they are re-partitioned when the number of workers changed
(:mod:`pyro_distributed.local.blocks`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pyro
import pyro.util
import torch

from .errors import PyroDistributedError
from .internals import replace_unconstrained
from .local import registry
from .local.blocks import (
    load_blocks,
    new_token,
    remove_blocks,
    save_blocks,
    write_atomically,
)
from .optim.distributed import DistributedOptimizer
from .seeding import block_generator, shared_generator

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "pyro_distributed.checkpoint"
# Version 2 added local parameters' blocks.
_VERSION = 2


def save_checkpoint(path: str | os.PathLike[str], optim: DistributedOptimizer) -> None:
    """Write a checkpoint of this training run to ``path`` (worker 0 writes it).

    :param path: where to write; its directory must exist on worker 0.
    :param optim: the distributed optimizer of the run.
    :raises PyroDistributedError: on every worker, if worker 0 could not write
        the file. The previous file at ``path``, if any, is left intact.

    Example::

        if step % 100 == 0:
            pyro_distributed.save_checkpoint("run.pt", optim)

    .. warning::
        Call it on every worker at the same step: it is a collective.
    """
    _check_optim(optim)
    engine = optim.engine
    target = Path(path)
    rng_states = engine.allgather_object((pyro.util.get_rng_state(), block_generator().get_state()))
    store = pyro.get_param_store()
    local = {name: p for name, p in registry.local_params().items() if name in store}
    optim_state = optim.get_state()
    token = None
    if local:
        token = new_token(engine)
        values = dict(store.named_parameters())
        save_blocks(target, token, engine, local, values, optim_state)
    failure = None
    if engine.rank == 0:
        saved_store = store.get_state()
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": engine.world_size,
            "num_steps": optim.num_steps,
            "param_store": {
                "params": _without(saved_store["params"], local),
                "constraints": saved_store["constraints"],
            },
            "optim": _without(optim_state, local),
            "rng": rng_states,
            "shared_rng": shared_generator().get_state(),
            "local": None
            if token is None
            else {
                "token": token,
                "world_size": engine.world_size,
                "params": {name: (p.plate, p.size, p.axis) for name, p in local.items()},
            },
        }
        try:
            write_atomically(target, state)
        except Exception as exc:  # reported to every worker below
            failure = f"{type(exc).__name__}: {exc}"
    failure = engine.allgather_object(failure)[0]
    if failure is not None:
        if token is not None:
            remove_blocks(target, token, only_rank=engine.rank)
        raise PyroDistributedError(
            f"worker 0 could not write the checkpoint {os.fspath(path)!r} ({failure}); "
            f"the previous file there, if any, is intact"
        )
    if engine.rank == 0:
        remove_blocks(target, keep=token)  # the previous checkpoint's, now superseded


def load_checkpoint(
    path: str | os.PathLike[str], optim: DistributedOptimizer, *, missing_ok: bool = False
) -> int:
    """Restore a checkpoint on every worker; returns the step count it was saved at.

    Afterwards every worker holds identical parameters and optimizer state.
    Each worker's RNG state is restored when the world size matches the one
    the checkpoint was written with; otherwise RNG states are left alone.

    :param path: the checkpoint; only worker 0 needs to be able to read it.
    :param optim: the distributed optimizer of the run being resumed.
    :param missing_ok: if worker 0 finds no file, change nothing and return 0
        on every worker: the one flag a restartable script needs (see below).
    :raises FileNotFoundError: on every worker, if worker 0 finds no file and
        ``missing_ok`` is false.
    :raises ValueError: on every worker, if the file is corrupt or truncated,
        is not a checkpoint, or holds parameters that contradict the ones
        already in the param store (a checkpoint of a different model).

    Example, a script that ``torchrun --max-restarts 3`` can restart at any
    time and that finishes as if it had never stopped::

        start = pyro_distributed.load_checkpoint("run.pt", optim, missing_ok=True)
        for step in range(start, num_steps):
            svi.step(data)
            if (step + 1) % 100 == 0:
                pyro_distributed.save_checkpoint("run.pt", optim)

    .. warning::
        Checkpoints are unpickled: load only files you trust. Call it on every
        worker at the same point: it is a collective.
    """
    _check_optim(optim)
    engine = optim.engine
    found: tuple[str, str] | tuple[bytes, str] | None = None
    if engine.rank == 0:
        found = _read_checked(Path(path))
    found = engine.allgather_object(found)[0]
    assert found is not None
    if isinstance(found[0], str):
        kind, message = found
        if kind == "missing" and missing_ok:
            return 0
        raise FileNotFoundError(message) if kind == "missing" else ValueError(message)
    raw, where = found
    assert isinstance(raw, bytes)
    state = _deserialize(raw)
    meta = state.get("local")
    local = {
        name: registry.LocalParam(name, *spec)
        for name, spec in (meta or {"params": {}})["params"].items()
    }
    _check_compatible(os.fspath(path), state, local)

    _restore_param_store(state["param_store"], local)
    local_state: dict[str, Any] = {}
    if meta is not None:
        # Each worker reads the blocks it needs, from where worker 0 found the checkpoint.
        values, local_state = load_blocks(Path(where), meta, local)
        _restore_local(values, local, state["param_store"]["constraints"])
    optim._forget_parameters()
    optim.set_state({**state["optim"], **local_state})
    optim.num_steps = state["num_steps"]
    shared_generator().set_state(state["shared_rng"])
    if state["world_size"] == engine.world_size:
        rng, blocks = state["rng"][engine.rank]
        pyro.util.set_rng_state(rng)
        block_generator().set_state(blocks)
    return int(state["num_steps"])


def _restore_param_store(saved: dict[str, Any], local: dict[str, Any]) -> None:
    """Put the saved values into the param store.

    Parameters that already exist are overwritten in place, not replaced:
    ``PyroModule`` and ``pyro.module`` networks hold their own tensors, and
    would silently keep training their old values if the store swapped them.
    """
    store = pyro.get_param_store()
    current = dict(store.named_parameters())
    with torch.no_grad():
        for name, value in saved["params"].items():
            if name in current:
                current[name].copy_(value)
    fresh = {name: value for name, value in saved["params"].items() if name not in current}
    constraints = {name: c for name, c in saved["constraints"].items() if name not in local}
    store.set_state({"params": fresh, "constraints": constraints})


def _restore_local(
    values: dict[str, torch.Tensor],
    local: dict[str, registry.LocalParam],
    constraints: dict[str, Any],
) -> None:
    """Install this worker's rows of each local parameter, bit for bit."""
    store = pyro.get_param_store()
    current = dict(store.named_parameters())
    registry.forget(local)
    for name, value in values.items():
        if name in current and current[name].shape == value.shape:
            with torch.no_grad():
                current[name].copy_(value)
        elif name in current:
            replace_unconstrained(name, value)  # it still held all N rows
        else:
            fresh = value.clone().requires_grad_(True)
            store.set_state({"params": {name: fresh}, "constraints": {name: constraints[name]}})
        registry.register(local[name])


def _check_optim(optim: object) -> None:
    if not isinstance(optim, DistributedOptimizer):
        raise TypeError(
            f"optim must be the run's DistributedOptimizer (or HorovodOptimizer), "
            f"got {type(optim).__name__}"
        )


def _without(entries: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in entries.items() if name not in names}


def _deserialize(raw: bytes) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=False)
    return state


def _read_checked(path: Path) -> tuple[str, str] | tuple[bytes, str]:
    """The file's bytes and where it is, if it holds a checkpoint, else (kind, message)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return "missing", f"no checkpoint at {os.fspath(path)!r} on worker 0"
    try:
        state = _deserialize(raw)
    except Exception as exc:
        return "corrupt", (
            f"the checkpoint {os.fspath(path)!r} is corrupt or truncated "
            f"({type(exc).__name__}: {exc})"
        )
    if not (isinstance(state, dict) and state.get("format") == _FORMAT):
        return "corrupt", f"{os.fspath(path)!r} is not a pyro_distributed checkpoint"
    if state.get("version", 0) > _VERSION:
        return "corrupt", (
            f"the checkpoint {os.fspath(path)!r} has format version {state['version']}; "
            f"this pyro_distributed reads version {_VERSION} and older"
        )
    return raw, os.fspath(path.resolve())


def _check_compatible(path: str, state: dict[str, Any], local: dict[str, Any]) -> None:
    """Refuse a checkpoint whose parameters contradict the ones already created."""
    saved = state["param_store"]["params"]
    current = dict(pyro.get_param_store().named_parameters())
    unknown = sorted(set(current) - set(saved) - set(local))
    reshaped = sorted(
        name
        for name in set(current) & set(saved)
        if current[name].shape != saved[name].shape or current[name].dtype != saved[name].dtype
    )
    reshaped += sorted(
        name
        for name in set(current) & set(local)
        if current[name].shape[local[name].axis] not in (local[name].size, len(local[name].rows))
    )
    if unknown or reshaped:
        details = []
        if unknown:
            details.append(f"parameters {unknown} exist now but not in the checkpoint")
        if reshaped:
            shown = ", ".join(
                f"{name!r}: "
                + (
                    f"{list(saved[name].shape)} {saved[name].dtype} saved"
                    if name in saved
                    else f"{local[name].size} rows along plate {local[name].plate!r} saved"
                )
                + f", {list(current[name].shape)} {current[name].dtype} now"
                for name in reshaped
            )
            details.append(f"parameters differ in shape or dtype ({shown})")
        raise ValueError(f"the checkpoint {path!r} is of a different model: {'; '.join(details)}")
