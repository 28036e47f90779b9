"""Checkpoint files for local parameters: each worker writes its own block.

Local parameters never exist whole on any worker, so every worker writes its
block of each, with the block's optimizer state, beside worker 0's
checkpoint, as ``<checkpoint>.<token>.block<r>of<W>``. The token is new at
every save, so the order is the commit: (1) every worker writes its block
file (temporary name, flushed, renamed); (2) if all succeeded, worker 0
renames the checkpoint, which names the token, over the old one; (3) older
tokens' files are deleted. A crash before (2) leaves the previous checkpoint
and its blocks untouched; a failed save removes the blocks it wrote.

Block files are :mod:`pyro_distributed.safe_files` files whose header names
the token, the worker and the world size, so a moved, mixed or damaged block
is refused by name; a worker that cannot read one makes every worker raise
(:mod:`pyro_distributed.shared_io`). Loading re-partitions: worker r of W'
takes its rows from whichever saved blocks overlap them, one file at a time,
and slices the optimizer state alike; at the same W it reads back exactly its
own block, bitwise. The directory must be one every worker sees.

``torch.distributed.checkpoint`` does not fit: it needs a torch.distributed
process group (Horovod has none), reshards by ``torch.chunk`` rather than
by these blocks, and overwrites files in place, which breaks all-or-nothing
saves.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import atomic_write, safe_files, shared_io
from ..engines import Engine
from ..errors import PyroDistributedError
from .registry import LocalParam

#: What a block file says it is (:mod:`pyro_distributed.safe_files`).
KIND = "block"


def new_token(engine: Engine) -> str:
    """A fresh name for one save's block files, chosen by worker 0 (a collective)."""
    token: str = engine.allgather_object(secrets.token_hex(6))[0]
    return token


def block_path(path: Path, token: str, rank: int, world_size: int) -> Path:
    return path.with_name(f"{path.name}.{token}.block{rank}of{world_size}")


def _block_pattern(path: Path) -> str:
    return rf"{re.escape(path.name)}\.([0-9a-f]+)\.block(\d+)of(\d+)"


def write_block(path: Path, token: str, rank: int, world_size: int, state: Any) -> None:
    """Write one worker's block file (a test replaces it to make a write fail)."""
    meta = {"token": token, "rank": rank, "world_size": world_size, "checkpoint": path.name}
    safe_files.write(block_path(path, token, rank, world_size), KIND, meta, state)


def save_blocks(
    path: Path,
    token: str,
    engine: Engine,
    params: dict[str, LocalParam],
    values: dict[str, Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Every worker writes its blocks; raise on every worker if any could not.

    The writes run outside the engine's time-out (:mod:`pyro_distributed.shared_io`).
    """
    state = {
        "rows": {name: [param.rows.start, param.rows.stop] for name, param in params.items()},
        "params": {name: values[name].detach().cpu() for name in params},
        "optim": {name: optim_state[name] for name in params if name in optim_state},
    }

    def write() -> tuple[None, None]:
        write_block(path, token, engine.rank, engine.world_size, state)
        return None, None

    failed = shared_io.failures(shared_io.on_each_worker(engine, write).reports)
    if failed:
        block_path(path, token, engine.rank, engine.world_size).unlink(missing_ok=True)
        raise PyroDistributedError(
            f"could not write the local parameters' blocks of checkpoint "
            f"{os.fspath(path)!r} ({shared_io.describe(failed)}); the previous "
            f"checkpoint is intact"
        )


def remove_blocks(path: Path, keep: str | None = None, *, only_rank: int | None = None) -> None:
    """Delete the block files of ``path`` whose token is not ``keep`` (or, with
    ``only_rank``, this save's file of that worker, after a failed save).

    Only names of exactly the form ``<path name>.<hex token>.block<r>of<W>``
    count, so a save or removal of ``last.ckpt`` never touches the blocks of
    ``last.ckpt.ckpt`` or of any other checkpoint in the directory.
    """
    pattern = re.compile(_block_pattern(path))
    for found in path.parent.glob(f"{glob.escape(path.name)}.*"):
        match = pattern.fullmatch(found.name)
        if match is None:
            continue
        token, rank = match.group(1), int(match.group(2))
        stale = token == keep and rank == only_rank if only_rank is not None else token != keep
        if stale:
            found.unlink(missing_ok=True)


def remove_temporaries(path: Path) -> None:
    """Delete the temporaries that killed saves of ``path`` and its blocks left
    (worker 0, once every worker has finished writing)."""
    names = re.compile(rf"{re.escape(path.name)}|{_block_pattern(path)}")
    atomic_write.remove_temporaries(path.parent, names)


def load_blocks(
    path: Path,
    meta: dict[str, Any],
    params: dict[str, LocalParam],
    engine: Engine,
    *,
    trusted: bool = False,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This worker's rows of every local parameter, and their optimizer state,
    from the blocks saved by ``meta["world_size"]`` workers (a collective).

    :raises PyroDistributedError: on every worker, if any worker could not read
        a block it needs, naming the worker and the file.
    """
    outcome = shared_io.on_each_worker(
        engine, lambda: (_read_blocks(path, meta, params, trusted), None)
    )
    failed = shared_io.failures(outcome.reports)
    if failed:
        raise PyroDistributedError(
            f"could not read the local parameters' blocks of checkpoint "
            f"{os.fspath(path)!r}: {shared_io.describe(failed)}"
        )
    assert outcome.value is not None
    return outcome.value


def _read_blocks(
    path: Path, meta: dict[str, Any], params: dict[str, LocalParam], trusted: bool
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    saved_workers = int(meta["world_size"])
    pieces: dict[str, list[tuple[int, Tensor]]] = {name: [] for name in params}
    states: dict[str, list[tuple[range, range, Any]]] = {name: [] for name in params}
    for saved in _overlapping_files(path, meta["token"], saved_workers, params, trusted):
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
    path: Path, token: str, saved_workers: int, params: dict[str, LocalParam], trusted: bool
) -> Iterator[dict[str, Any]]:
    """The saved block files whose rows overlap this worker's, one at a time,
    each checked to be the block of that worker of that save."""
    for rank in range(saved_workers):
        expected = {
            name: [rank * param.size // saved_workers, (rank + 1) * param.size // saved_workers]
            for name, param in params.items()
        }
        if not any(
            max(start, params[name].rows.start) < min(stop, params[name].rows.stop)
            for name, (start, stop) in expected.items()
        ):
            continue
        file = block_path(path, token, rank, saved_workers)
        try:
            header, saved = safe_files.load(file, KIND, trusted=trusted)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"the checkpoint names block file {file.name!r}, which this worker cannot "
                f"read; the checkpoint's directory must be shared by every worker"
            ) from exc
        _check_block(file, header, saved, token, rank, saved_workers, expected, params)
        yield saved


def _check_block(
    file: Path,
    header: safe_files.Header,
    saved: Any,
    token: str,
    rank: int,
    saved_workers: int,
    expected: dict[str, list[int]],
    params: dict[str, LocalParam],
) -> None:
    """Refuse a block file that is not worker ``rank``'s of this save, or does not
    hold the rows it must."""
    said = (header.meta.get("token"), header.meta.get("rank"), header.meta.get("world_size"))
    if header.format_version > 3 and said != (token, rank, saved_workers):
        raise safe_files.UnreadableFile(
            f"block file {file.name!r} holds worker {said[1]} of {said[2]}'s block of the "
            f"save {said[0]!r}, not worker {rank} of {saved_workers}'s of the save "
            f"{token!r} that the checkpoint names: block files were moved or mixed"
        )
    well_formed = isinstance(saved, dict) and all(
        isinstance(saved.get(key), dict) for key in ("rows", "params", "optim")
    )
    if not well_formed:
        raise safe_files.UnreadableFile(f"block file {file.name!r} does not hold a block")
    for name, rows in expected.items():
        value = saved["params"].get(name)
        if (
            list(saved["rows"].get(name, ())) != rows
            or _length_along(value, params[name].axis) != rows[1] - rows[0]
        ):
            raise safe_files.UnreadableFile(
                f"block file {file.name!r} does not hold rows {rows[0]}..{rows[1]} of "
                f"{name!r}, as the checkpoint says it must"
            )


def _length_along(value: Any, axis: int) -> int | None:
    if not isinstance(value, Tensor) or not -value.dim() <= axis < value.dim():
        return None
    return int(value.shape[axis])


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
