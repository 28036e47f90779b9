"""What every checkpoint shares, whatever it holds: writing, reading, RNG states.

Saving and loading are collectives. :func:`commit` has every worker write its
blocks of local parameters (:mod:`pyro_distributed.local.blocks`), then
worker 0 alone writes the checkpoint, all or nothing, and every worker learns
whether it succeeded. :func:`read` has worker 0 read and check the file and
broadcast its bytes, so only worker 0 needs to see the file system (block
files aside) and each worker holds the file about twice at most. File work
runs outside the engine's time-out (:mod:`pyro_distributed.shared_io`), and
the files are :mod:`pyro_distributed.safe_files` files, loaded with
``weights_only=True`` and :func:`allowed_globals` unless ``trusted=True``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyro.distributions.constraints
import pyro.util
import torch
from torch import Tensor

from .. import atomic_write, safe_files, shared_io
from ..engines import Engine
from ..errors import PyroDistributedError
from ..local.blocks import new_token, remove_blocks, remove_temporaries, save_blocks
from ..local.registry import LocalParam
from ..seeding import block_generator, shared_generator

#: What a checkpoint says it is in its header (:mod:`pyro_distributed.safe_files`).
KIND = "checkpoint"
FORMAT = "pyro_distributed.checkpoint"


def allowed_globals() -> tuple[type, ...]:
    """The classes a checkpoint may name: the constraints of torch and Pyro (a
    param store holds one per parameter). Nothing else in it is an object.
    Found afresh at each call: a Pyro module imported later brings its own."""
    found: set[type] = set()
    pending = [torch.distributions.constraints.Constraint]
    while pending:
        cls = pending.pop()
        if cls.__module__.split(".")[0] in ("torch", "pyro") and cls not in found:
            found.add(cls)
            pending.extend(cls.__subclasses__())
    return tuple(sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


def gather_rng(engine: Engine) -> list[Any]:
    """Every worker's RNG states, by rank, as plain data (a collective)."""
    states: list[Any] = engine.allgather_object(
        rng_for_file((pyro.util.get_rng_state(), block_generator().get_state()))
    )
    return states


def rng_for_file(worker_state: Any) -> Any:
    """A worker's RNG states with NumPy's key array as a list of ints (plain data)."""
    rng, blocks = worker_state
    kind, keys, *rest = rng["numpy"]
    return {**rng, "numpy": (kind, np.asarray(keys).tolist(), *rest)}, blocks


def rng_from_file(worker_state: Any) -> Any:
    """The inverse of :func:`rng_for_file`."""
    rng, blocks = worker_state
    kind, keys, *rest = rng["numpy"]
    return {**rng, "numpy": (kind, np.asarray(keys, dtype=np.uint32), *rest)}, blocks


def restore_rng(state: dict[str, Any], engine: Engine) -> None:
    """Restore the shared generator, and this worker's RNG states when the world
    size is the one the checkpoint was written with."""
    shared_generator().set_state(state["shared_rng"])
    if state["world_size"] == engine.world_size:
        rng, blocks = rng_from_file(state["rng"][engine.rank])
        pyro.util.set_rng_state(rng)
        block_generator().set_state(blocks)


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Worker 0's write of the checkpoint file (a test replaces it to make it fail)."""
    safe_files.write(path, KIND, {"format": FORMAT}, state)


def commit(
    path: str | os.PathLike[str],
    engine: Engine,
    state: Callable[[dict[str, Any] | None], dict[str, Any]],
    local: dict[str, LocalParam],
    values: dict[str, Tensor],
    optim_state: dict[str, Any],
    *,
    write: Callable[[Path, dict[str, Any]], None] | None = None,
) -> None:
    """Write a checkpoint: the blocks of ``local`` (their ``values`` and
    ``optim_state``) on every worker, then ``state(local_meta)`` on worker 0,
    with ``write`` (default: :func:`write_checkpoint`).

    :raises PyroDistributedError: on every worker, if any write failed; the
        previous checkpoint is then intact (if ``write`` replaces files atomically).
    """
    write = write or write_checkpoint
    target = Path(path)
    token = None
    meta = None
    if local:
        # The blocks go beside the file worker 0 writes, where a load looks for
        # them, also when ``path`` is a link into another directory.
        target = Path(
            engine.allgather_object(_destination(target) if engine.rank == 0 else None)[0]
        )
        token = new_token(engine)
        save_blocks(target, token, engine, local, values, optim_state)
        meta = {
            "token": token,
            "world_size": engine.world_size,
            "params": {name: (p.plate, p.size, p.axis) for name, p in local.items()},
        }

    def write_file() -> tuple[None, None]:
        assert write is not None
        write(target, state(meta))
        return None, None

    outcome = shared_io.on_each_worker(engine, write_file if engine.rank == 0 else None)
    failure = shared_io.failures(outcome.reports).get(0)
    if failure is not None:
        if token is not None:
            remove_blocks(target, token, only_rank=engine.rank)
        raise PyroDistributedError(
            f"worker 0 could not write the checkpoint {os.fspath(path)!r} "
            f"({failure.message}); the previous file there, if any, is intact"
        )
    if engine.rank == 0:
        remove_blocks(target, keep=token)  # the previous checkpoint's, now superseded
        remove_temporaries(target)  # what killed saves left, and only that (atomic_write)


def _destination(path: Path) -> str:
    """The file a write to ``path`` lands in; ``path`` where the write will refuse it."""
    try:
        return os.fspath(atomic_write.writable_target(path))
    except ValueError:
        return os.fspath(path)


def agree(engine: Engine, check: Callable[[], None]) -> None:
    """Run ``check()`` on every worker, and raise its ``ValueError`` (the first
    worker's that raised one) on every worker (a collective): a file that one
    worker refuses is refused by all, before any of them changes anything."""
    problem = None
    try:
        check()
    except ValueError as exc:
        problem = str(exc)
    problems = engine.allgather_object(problem)
    if any(problems):
        raise ValueError(next(problem for problem in problems if problem))


def header(engine: Engine, num_steps: int, kind: str) -> dict[str, Any]:
    """The entries every checkpoint starts with (worker 0, after :func:`gather_rng`)."""
    return {
        "format": FORMAT,
        "kind": kind,
        "world_size": engine.world_size,
        "num_steps": num_steps,
        "shared_rng": shared_generator().get_state(),
    }


def read(
    path: str | os.PathLike[str], engine: Engine, missing_ok: bool, *, trusted: bool = False
) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint at ``path``, as worker 0 read it, on every worker, and where
    worker 0 found it; ``None`` when there is none and ``missing_ok``.

    :raises FileNotFoundError: on every worker, if there is no file.
    :raises ValueError: on every worker, if the file is no readable checkpoint.
    """
    target = Path(path)
    shown = repr(os.fspath(path))

    def read_file() -> tuple[Any, Any]:
        if not target.exists():  # said with worker 0's path on every worker
            raise FileNotFoundError(f"no checkpoint at {shown} on worker 0")
        with open(target, "rb") as file:
            found = safe_files.read_header(file, f"the checkpoint {shown}", KIND)
            payload = safe_files.read_payload(file, found, f"the checkpoint {shown}")
        return payload, (found, os.fspath(target.resolve()))

    def classify(exc: BaseException) -> str:
        if isinstance(exc, FileNotFoundError):
            return "missing"
        return "unreadable" if isinstance(exc, safe_files.UnreadableFile) else "error"

    outcome = shared_io.on_each_worker(
        engine, read_file if engine.rank == 0 else None, classify=classify
    )
    failure = shared_io.failures(outcome.reports).get(0)
    if failure is not None:
        if failure.kind == "missing":
            if missing_ok:
                return None
            raise FileNotFoundError(failure.message.split(": ", 1)[1])
        if failure.kind == "unreadable":
            raise ValueError(failure.message.split(": ", 1)[1])
        raise PyroDistributedError(
            f"worker 0 could not read the checkpoint {shown} ({failure.message})"
        )
    found, where = outcome.reports[0]
    payload = _broadcast_bytes(engine, outcome.value, found.payload_bytes)
    outcome.value = None  # the payload is held once, here
    decoded: Any = None
    problem = None
    try:
        decoded = safe_files.decode(
            payload, found, f"the checkpoint {shown}", trusted=trusted, allowed=allowed_globals()
        )
        del payload
        if not (isinstance(decoded, dict) and decoded.get("format") == FORMAT):
            raise safe_files.UnreadableFile(f"{shown} is not a pyro_distributed checkpoint")
    except Exception as exc:  # every worker decodes the same bytes; agreed on below
        problem = str(exc)
    problems = engine.allgather_object(problem)
    if any(problems):
        raise ValueError(next(problem for problem in problems if problem))
    return decoded, Path(where)


def _broadcast_bytes(engine: Engine, payload: bytearray | None, length: int) -> bytearray:
    """Worker 0's ``payload`` on every worker, sent once (a collective)."""
    if engine.world_size == 1:
        assert payload is not None
        return payload
    if engine.rank == 0:
        assert payload is not None
        buffer = payload
    else:
        buffer = bytearray(length)
    if length:
        engine.broadcast_([torch.frombuffer(buffer, dtype=torch.uint8)], src=0)
    return buffer


def mismatches(
    current: dict[str, Tensor], saved: dict[str, Tensor], local: dict[str, LocalParam]
) -> tuple[list[str], list[str]]:
    """What stops ``saved`` (and the blocks of ``local``) from loading into
    ``current``: the names that exist now but were not saved, and those whose
    shape or dtype differs (a local one may hold all its rows or a block)."""
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
    return unknown, reshaped


def local_params_of(state: dict[str, Any]) -> dict[str, LocalParam]:
    """The local parameters a checkpoint's blocks hold, by name."""
    meta = state.get("local")
    return {
        name: LocalParam(name, *spec) for name, spec in (meta or {"params": {}})["params"].items()
    }


def load_file(path: str | os.PathLike[str], *, trusted: bool = False) -> dict[str, Any]:
    """A checkpoint file's contents, read in this process alone (to inspect one)."""
    _, state = safe_files.load(Path(path), KIND, trusted=trusted, allowed=allowed_globals())
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        raise safe_files.UnreadableFile(f"{os.fspath(path)!r} is not a pyro_distributed checkpoint")
    return state
