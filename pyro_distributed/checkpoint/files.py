"""What every checkpoint shares, whatever it holds: writing, reading, RNG states.

Saving and loading are collectives, called on every worker:

* :func:`commit` has every worker write its blocks of local parameters (if
  any), then worker 0 alone writes the checkpoint: to a temporary file in the
  same directory, flushed to disk, then renamed over the target. A crash
  mid-write leaves the previous checkpoint as it was, and every worker learns
  whether the write succeeded.
* :func:`read` has worker 0 read and check the file and send its bytes to the
  others, so only worker 0 needs to see the file system (block files aside).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyro.util
import torch
from torch import Tensor

from ..devices import checkpoint_location
from ..engines import Engine
from ..errors import PyroDistributedError
from ..local.blocks import new_token, remove_blocks, save_blocks, write_atomically
from ..local.registry import LocalParam
from ..seeding import block_generator, shared_generator

FORMAT = "pyro_distributed.checkpoint"
# Version 2 added local parameters' blocks; version 3, checkpoints of modules.
VERSION = 3


def gather_rng(engine: Engine) -> list[Any]:
    """Every worker's RNG states, by rank (a collective)."""
    states: list[Any] = engine.allgather_object(
        (pyro.util.get_rng_state(), block_generator().get_state())
    )
    return states


def restore_rng(state: dict[str, Any], engine: Engine) -> None:
    """Restore the shared generator, and this worker's RNG states when the world
    size is the one the checkpoint was written with."""
    shared_generator().set_state(state["shared_rng"])
    if state["world_size"] == engine.world_size:
        rng, blocks = state["rng"][engine.rank]
        pyro.util.set_rng_state(rng)
        block_generator().set_state(blocks)


def commit(
    path: str | os.PathLike[str],
    engine: Engine,
    state: Callable[[dict[str, Any] | None], dict[str, Any]],
    local: dict[str, LocalParam],
    values: dict[str, Tensor],
    optim_state: dict[str, Any],
    *,
    write: Callable[[Path, dict[str, Any]], None] = write_atomically,
) -> None:
    """Write a checkpoint: the blocks of ``local`` (their ``values`` and
    ``optim_state``) on every worker, then ``state(local_meta)`` on worker 0,
    with ``write`` (default: to a temporary file, flushed, renamed over ``path``).

    :raises PyroDistributedError: on every worker, if any write failed; the
        previous checkpoint is then intact (if ``write`` replaces files atomically).
    """
    target = Path(path)
    token = None
    meta = None
    if local:
        token = new_token(engine)
        save_blocks(target, token, engine, local, values, optim_state)
        meta = {
            "token": token,
            "world_size": engine.world_size,
            "params": {name: (p.plate, p.size, p.axis) for name, p in local.items()},
        }
    failure = None
    if engine.rank == 0:
        try:
            write(target, state(meta))
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


def header(engine: Engine, num_steps: int, kind: str) -> dict[str, Any]:
    """The entries every checkpoint starts with (worker 0, after :func:`gather_rng`)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "world_size": engine.world_size,
        "num_steps": num_steps,
        "shared_rng": shared_generator().get_state(),
    }


def read(
    path: str | os.PathLike[str], engine: Engine, missing_ok: bool
) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint at ``path``, as worker 0 read it, on every worker, and where
    worker 0 found it; ``None`` when there is none and ``missing_ok``.

    :raises FileNotFoundError: on every worker, if there is no file.
    :raises ValueError: on every worker, if the file is no readable checkpoint.
    """
    found: tuple[str, str] | tuple[bytes, str] | None = None
    if engine.rank == 0:
        found = _read_checked(Path(path))
    found = engine.allgather_object(found)[0]
    assert found is not None
    if isinstance(found[0], str):
        kind, message = found
        if kind == "missing" and missing_ok:
            return None
        raise FileNotFoundError(message) if kind == "missing" else ValueError(message)
    raw, where = found
    assert isinstance(raw, bytes)
    return _deserialize(raw), Path(where)


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


def _deserialize(raw: bytes) -> dict[str, Any]:
    # Saved on worker 0's GPU, read by every worker onto its own (or the CPU).
    state: dict[str, Any] = torch.load(
        io.BytesIO(raw), map_location=checkpoint_location, weights_only=False
    )
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
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        return "corrupt", f"{os.fspath(path)!r} is not a pyro_distributed checkpoint"
    if state.get("version", 0) > VERSION:
        return "corrupt", (
            f"the checkpoint {os.fspath(path)!r} has format version {state['version']}; "
            f"this pyro_distributed reads version {VERSION} and older"
        )
    return raw, os.fspath(path.resolve())
