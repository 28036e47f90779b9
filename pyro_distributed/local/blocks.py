"""Checkpoint files for local parameters: each worker writes its own block.

Local parameters (:mod:`pyro_distributed.local`) never exist whole on
any worker, so :func:`~pyro_distributed.save_checkpoint` cannot have worker 0
write them. Instead every worker writes its block of every local parameter,
with the block's optimizer state, to a file of its own beside worker 0's
checkpoint, ``<checkpoint>.<token>.block<r>of<W>``. The token is new at every
save, so a save never overwrites the files of the previous one:

1. every worker writes its block file (to a temporary name, flushed, renamed);
2. if all succeeded, worker 0 writes the checkpoint itself, which names the
   token, by renaming over the old one: that rename is the commit;
3. then the files of older tokens are deleted.

A crash before step 2 completes leaves the previous checkpoint, and the block
files it names, untouched; a failed save removes the blocks it wrote.

Loading re-partitions: worker r of W' takes rows ``block_range(N)`` under W'
from whichever of the W saved blocks overlap them, reading one saved file at a
time, and slices the optimizer state (every tensor laid out like the
parameter) the same way. At the same W each worker reads back exactly its own
block, bitwise.

The checkpoint's directory must be one that every worker sees (on one
machine it is; across machines, a shared file system).

``torch.distributed.checkpoint`` was considered and not used: it needs a
torch.distributed process group (this library also runs on Horovod), its
resharding expects DTensor's ``torch.chunk`` partition rather than the
blocks that ownership uses, and saving to the same directory overwrites the
previous checkpoint's files in place, which breaks all-or-nothing saves.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..devices import checkpoint_location
from ..engines import Engine
from ..errors import PyroDistributedError
from .registry import LocalParam


def new_token(engine: Engine) -> str:
    """A fresh name for one save's block files, chosen by worker 0 (a collective)."""
    token: str = engine.allgather_object(secrets.token_hex(6))[0]
    return token


def block_path(path: Path, token: str, rank: int, world_size: int) -> Path:
    return path.with_name(f"{path.name}.{token}.block{rank}of{world_size}")


def write_atomically(path: Path, state: Any) -> None:
    """``torch.save`` to a temporary file beside ``path``, flushed, then renamed over it."""
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


def save_blocks(
    path: Path,
    token: str,
    engine: Engine,
    params: dict[str, LocalParam],
    values: dict[str, Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Every worker writes its blocks; raise on every worker if any could not."""
    mine = block_path(path, token, engine.rank, engine.world_size)
    state = {
        "rows": {name: (param.rows.start, param.rows.stop) for name, param in params.items()},
        "params": {name: values[name].detach().cpu() for name in params},
        "optim": {name: optim_state[name] for name in params if name in optim_state},
    }
    failure = None
    try:
        write_atomically(mine, state)
    except Exception as exc:  # reported to every worker below
        failure = f"{type(exc).__name__}: {exc}"
    failures = engine.allgather_object(failure)
    failed = {rank: message for rank, message in enumerate(failures) if message is not None}
    if failed:
        mine.unlink(missing_ok=True)
        shown = "; ".join(f"worker {rank}: {message}" for rank, message in failed.items())
        raise PyroDistributedError(
            f"could not write the local parameters' blocks of checkpoint "
            f"{os.fspath(path)!r} ({shown}); the previous checkpoint is intact"
        )


def remove_blocks(path: Path, keep: str | None = None, *, only_rank: int | None = None) -> None:
    """Delete the block files of ``path`` whose token is not ``keep`` (or, with
    ``only_rank``, this save's file of that worker, after a failed save).

    Only names of exactly the form ``<path name>.<hex token>.block<r>of<W>``
    count, so a save or removal of ``last.ckpt`` never touches the blocks of
    ``last.ckpt.ckpt`` or of any other checkpoint in the directory.
    """
    pattern = re.compile(rf"{re.escape(path.name)}\.([0-9a-f]+)\.block(\d+)of\d+")
    for found in path.parent.glob(f"{glob.escape(path.name)}.*"):
        match = pattern.fullmatch(found.name)
        if match is None:
            continue
        token, rank = match.group(1), int(match.group(2))
        stale = token == keep and rank == only_rank if only_rank is not None else token != keep
        if stale:
            found.unlink(missing_ok=True)


def load_blocks(
    path: Path, meta: dict[str, Any], params: dict[str, LocalParam]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This worker's rows of every local parameter, and their optimizer state,
    from the blocks saved by ``meta["world_size"]`` workers."""
    saved_workers = int(meta["world_size"])
    pieces: dict[str, list[tuple[int, Tensor]]] = {name: [] for name in params}
    states: dict[str, list[tuple[range, range, Any]]] = {name: [] for name in params}
    for saved in _overlapping_files(path, meta["token"], saved_workers, params):
        for name, param in params.items():
            old = range(*saved["rows"][name])
            new = param.rows
            start, stop = max(old.start, new.start), min(old.stop, new.stop)
            if start >= stop:
                continue
            overlap = range(start, stop)
            value = saved["params"][name].narrow(param.axis, start - old.start, len(overlap))
            # Copies, not views, so that the saved file's tensors can be freed.
            pieces[name].append((start, value.clone()))
            if name in saved["optim"]:
                part = _join_states([(old, overlap, saved["optim"][name])], param.axis)
                states[name].append((overlap, overlap, part))
        del saved  # one saved file in memory at a time
    values = {}
    for name, param in params.items():
        parts = [part for _, part in sorted(pieces[name], key=lambda item: item[0])]
        if sum(part.shape[param.axis] for part in parts) != len(param.rows):
            raise ValueError(f"the checkpoint's blocks of {name!r} do not cover this worker's rows")
        values[name] = torch.cat(parts, dim=param.axis)
    optim = {name: _join_states(states[name], params[name].axis) for name in params if states[name]}
    return values, optim


def _overlapping_files(
    path: Path, token: str, saved_workers: int, params: dict[str, LocalParam]
) -> Iterator[dict[str, Any]]:
    """The saved block files whose rows overlap this worker's, one at a time."""
    for rank in range(saved_workers):
        overlaps = False
        for param in params.values():
            start, stop = (k * param.size // saved_workers for k in (rank, rank + 1))
            overlaps |= max(start, param.rows.start) < min(stop, param.rows.stop)
        if not overlaps:
            continue
        file = block_path(path, token, rank, saved_workers)
        try:
            saved: dict[str, Any] = torch.load(
                file, map_location=checkpoint_location, weights_only=False
            )
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"the checkpoint {os.fspath(path)!r} names block file {file.name!r}, which "
                f"this worker cannot read; the checkpoint's directory must be shared by "
                f"every worker"
            ) from exc
        yield saved


def _join_states(parts: list[tuple[range, range, Any]], axis: int) -> Any:
    """One optimizer state from the overlapping parts of saved blocks' states:
    tensors laid out like the block are sliced and joined, the rest taken once."""
    first_old, _, first = parts[0]

    def join(template: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(template, dict):
            return {key: join(value, (*path, key)) for key, value in template.items()}
        if isinstance(template, list):
            return [join(value, (*path, index)) for index, value in enumerate(template)]
        if (
            isinstance(template, Tensor)
            and template.dim() >= -axis
            and template.shape[axis] == len(first_old)
        ):
            slices = []
            for old, rows, state in parts:
                tensor = _at(state, path)
                slices.append(tensor.narrow(axis, rows.start - old.start, len(rows)))
            return torch.cat(slices, dim=axis)
        return template

    return join(first, ())


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state
