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
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import pyro
import pyro.util
import torch

from .errors import PyroDistributedError
from .optim import DistributedOptimizer
from .seeding import shared_generator

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "pyro_distributed.checkpoint"
_VERSION = 1


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
    rng_states = engine.allgather_object(pyro.util.get_rng_state())
    failure = None
    if engine.rank == 0:
        store = pyro.get_param_store()
        state = {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": engine.world_size,
            "num_steps": optim.num_steps,
            "param_store": store.get_state(),
            "optim": optim.get_state(),
            "rng": rng_states,
            "shared_rng": shared_generator().get_state(),
        }
        try:
            _write_atomically(Path(path), state)
        except Exception as exc:  # reported to every worker below
            failure = f"{type(exc).__name__}: {exc}"
    failure = engine.allgather_object(failure)[0]
    if failure is not None:
        raise PyroDistributedError(
            f"worker 0 could not write the checkpoint {os.fspath(path)!r} ({failure}); "
            f"the previous file there, if any, is intact"
        )


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
    found: tuple[str, str] | bytes | None = None
    if engine.rank == 0:
        found = _read_checked(Path(path))
    found = engine.allgather_object(found)[0]
    if isinstance(found, tuple):
        kind, message = found
        if kind == "missing" and missing_ok:
            return 0
        raise FileNotFoundError(message) if kind == "missing" else ValueError(message)
    assert isinstance(found, bytes)
    state = _deserialize(found)
    _check_compatible(os.fspath(path), state)

    _restore_param_store(state["param_store"])
    optim._forget_parameters()
    optim.set_state(state["optim"])
    optim.num_steps = state["num_steps"]
    shared_generator().set_state(state["shared_rng"])
    if state["world_size"] == engine.world_size:
        pyro.util.set_rng_state(state["rng"][engine.rank])
    return int(state["num_steps"])


def _restore_param_store(saved: dict[str, Any]) -> None:
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
    store.set_state({"params": fresh, "constraints": saved["constraints"]})


def _check_optim(optim: object) -> None:
    if not isinstance(optim, DistributedOptimizer):
        raise TypeError(
            f"optim must be the run's DistributedOptimizer (or HorovodOptimizer), "
            f"got {type(optim).__name__}"
        )


def _write_atomically(path: Path, state: dict[str, Any]) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _deserialize(raw: bytes) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=False)
    return state


def _read_checked(path: Path) -> tuple[str, str] | bytes:
    """The file's bytes if they hold a checkpoint, else (kind, message) for every worker."""
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
    return raw


def _check_compatible(path: str, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose parameters contradict the ones already created."""
    saved = state["param_store"]["params"]
    current = dict(pyro.get_param_store().named_parameters())
    unknown = sorted(set(current) - set(saved))
    reshaped = sorted(
        name
        for name in set(current) & set(saved)
        if current[name].shape != saved[name].shape or current[name].dtype != saved[name].dtype
    )
    if unknown or reshaped:
        details = []
        if unknown:
            details.append(f"parameters {unknown} exist now but not in the checkpoint")
        if reshaped:
            shown = ", ".join(
                f"{name!r}: {list(saved[name].shape)} {saved[name].dtype} saved, "
                f"{list(current[name].shape)} {current[name].dtype} now"
                for name in reshaped
            )
            details.append(f"parameters differ in shape or dtype ({shown})")
        raise ValueError(f"the checkpoint {path!r} is of a different model: {'; '.join(details)}")
