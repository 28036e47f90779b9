"""Writing per-observation results into an ``.h5ad`` file from the workers that own them.

With owned observations (``own_local_params=True``) every per-spot summary
of the posterior is computed on the spot's owner
(:func:`~pyro_distributed.integrations.scvi.posterior.owned_posterior` with
``to="owners"`` leaves each worker its block). :func:`write_owned_obsm` puts
those blocks into one ``.h5ad`` file's ``obsm``, in the AnnData's order,
without ever joining them: worker 0 writes each worker's block as it
arrives (its own first) and drops it, so no worker holds more than its own
block and one other, however many spots there are. Reading the result back
is plain anndata::

    with owned_posterior(model, to="owners"):              # on every worker
        q50 = model.posterior_quantile(q=0.5)             # this worker's spots only
    write_owned_obsm("abundances.h5ad", {"q50_cell_abundance_w_sf": q50["w_sf"]},
                     obs_names=model.adata.obs_names)
    anndata.read_h5ad("abundances.h5ad").obsm["q50_cell_abundance_w_sf"]   # every spot

The rows arrive in datasets that have no name in the file yet, so a write
that fails or is killed part of the way leaves the previous results of
every key as they were. Once every row of every key is in, each key is
swapped in with two link operations of HDF5: the previous dataset is renamed
to a backup name, the new one linked under the key, then the backup deleted.
A process killed between those steps leaves the backup in ``obsm``, which
the next :func:`write_owned_obsm` into the file resolves first: a backup
whose key is missing is the previous result and is renamed back, one beside
its key is deleted.

.. warning::
    A collective: call it on every worker with the same keys. Each worker's
    blocks must be its rows of the observations in rank order (worker 0's
    first), which is how owned observations are laid out
    (:func:`~pyro_distributed.partition.block_range`); the rows of all
    workers together must be exactly ``obs_names``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ... import runtime
from ...checks import check_path
from ...errors import PyroDistributedError
from ...gather import stream_pieces

__all__ = ["write_owned_obsm"]

# How anndata marks a dense array in an .h5ad (its on-disk format, 0.8 and later).
_ARRAY_ENCODING = {"encoding-type": "array", "encoding-version": "0.2.0"}
# The name in obsm under which a key's previous dataset waits while the new
# one is linked in its place. It lives in obsm because anndata refuses a file
# with groups of its own at the top.
_BACKUP_SUFFIX = "~pyro_distributed_previous"


def write_owned_obsm(
    path: str | Path, blocks: Mapping[str, Any], *, obs_names: Sequence[str]
) -> None:
    """Write each worker's rows of ``blocks`` into ``obsm`` of the ``.h5ad`` at ``path``.

    :param path: an ``.h5ad`` with ``len(obs_names)`` observations, whose
        ``obsm`` gains (or has replaced) these keys; if there is no such file,
        one is made holding the observation names and these keys only. A
        key's previous values stay in the file until every row of every key
        has arrived, so a write that fails on the way leaves them as they were.
    :param blocks: this worker's rows of each result (NumPy arrays, tensors
        or anything ``numpy.asarray`` takes), observations along axis 0.
    :param obs_names: every observation's name, in the AnnData's order (the
        same on every worker; worker 0's are used).
    :raises ValueError: on every worker, if the workers' rows of a key do not
        add up to ``len(obs_names)`` (or the keys differ).
    :raises PyroDistributedError: on every worker, if worker 0 cannot open
        ``path`` for writing (not an ``.h5ad``, another number of
        observations, or open elsewhere, e.g. being read by rows).

    Example::

        with owned_posterior(model, to="owners"):
            summaries = model.sample_posterior(num_samples=100, return_sites=["w_sf"])
        write_owned_obsm(
            "results.h5ad",
            {f"{name}_w_sf": values["w_sf"] for name, values in summaries.items()},
            obs_names=model.adata.obs_names,
        )
    """
    check_path("path", path)
    if not isinstance(blocks, Mapping):
        raise TypeError(
            f"write_owned_obsm: blocks must be a mapping of names to rows, got {blocks!r}"
        )
    engine = runtime.current_engine()
    # cpu: the blocks arrive as host arrays and travel from host memory.
    pieces = {
        key: torch.as_tensor(np.asarray(value), device="cpu") for key, value in blocks.items()
    }
    target: Any = None
    verdict: str | None = None
    if engine.rank == 0:
        try:
            target = _open(Path(path), list(obs_names))
        except Exception as error:  # every worker raises it, below
            verdict = f"{type(error).__name__}: {error}"
    rows = {key: int(piece.shape[0]) if piece.dim() else -1 for key, piece in pieces.items()}
    views = engine.allgather_object((rows, len(obs_names), verdict))
    try:
        _check(path, views)
        sink = _ObsmSink(target) if target is not None else None
        stream_pieces(engine, pieces, dict.fromkeys(pieces, 0), sink)
        if sink is not None:
            sink.swap()  # only now, with every row of every key in
    finally:
        if target is not None:
            target.close()
    engine.barrier()  # the file is whole before any worker goes on to read it


def _open(path: Path, obs_names: list[str]) -> Any:
    """``path`` opened for writing, made first (observation names only) if it is not there."""
    if not path.exists():
        anndata = importlib.import_module("anndata")
        pandas = importlib.import_module("pandas")
        anndata.AnnData(obs=pandas.DataFrame(index=obs_names)).write_h5ad(path)
    h5py = importlib.import_module("h5py")
    handle = h5py.File(path, "r+")
    try:
        kind = handle.attrs.get("encoding-type")
        if kind != "anndata" or "obsm" not in handle:
            raise ValueError(f"not an .h5ad written by anndata (encoding-type {kind!r})")
        index = handle["obs"].attrs["_index"]
        n_obs = handle["obs"][index].shape[0]
        if n_obs != len(obs_names):
            raise ValueError(f"it holds {n_obs} observations, obs_names has {len(obs_names)}")
        _recover(handle["obsm"])
    except BaseException:
        handle.close()
        raise
    return handle


def _recover(obsm: Any) -> None:
    """Finish the swaps of a write that was killed between them (see the module's docstring)."""
    for backup in [name for name in obsm if name.endswith(_BACKUP_SUFFIX)]:
        key = backup[: -len(_BACKUP_SUFFIX)]
        if key in obsm:
            del obsm[backup]  # the new dataset was linked: the backup is stale
        else:
            obsm.move(backup, key)  # killed before the new one was linked


def _check(path: str | Path, views: list[tuple[dict[str, int], int, str | None]]) -> None:
    """Raise the same error on every worker, before anything travels."""
    rows, n_obs, verdict = views[0]
    if verdict is not None:
        raise PyroDistributedError(f"worker 0 cannot write results into {path}: {verdict}")
    for key in rows:
        if key.endswith(_BACKUP_SUFFIX):
            raise ValueError(
                f"write_owned_obsm: the key {key!r} ends with {_BACKUP_SUFFIX!r}, the "
                f"name under which a key's previous values wait while it is replaced; "
                f"choose another key"
            )
    for rank, (keys, _, _) in enumerate(views):
        if set(keys) != set(rows):
            raise ValueError(
                f"write_owned_obsm: worker {rank} writes the keys {sorted(keys)}, "
                f"worker 0 {sorted(rows)}: every worker must write the same keys"
            )
    for key in rows:
        counts = [keys[key] for keys, _, _ in views]
        if min(counts) < 0 or sum(counts) != n_obs:
            raise ValueError(
                f"write_owned_obsm: the workers' rows of {key!r} ({counts} by worker, "
                f"-1 for a scalar) do not add up to the {n_obs} observations of obs_names"
            )


class _ObsmSink:
    """Worker 0's end: each piece written as it arrives into a dataset of its
    key that has no name yet, every key swapped in by :meth:`swap` at the end."""

    def __init__(self, handle: Any) -> None:
        self._obsm = handle["obsm"]
        self._new: dict[str, Any] = {}

    def start(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, axis: int) -> None:
        numpy_dtype = torch.empty(0, dtype=dtype, device="cpu").numpy().dtype
        # Anonymous: no reader sees it, and if the write fails HDF5 drops it
        # when the file is closed.
        dataset = self._obsm.create_dataset(None, shape=shape, dtype=numpy_dtype)
        dataset.attrs.update(_ARRAY_ENCODING)
        self._new[name] = dataset

    def put(self, name: str, offset: int, piece: Tensor) -> None:
        self._new[name][offset : offset + piece.shape[0]] = piece.numpy()

    def shared(self, name: str, value: Tensor) -> None:  # pragma: no cover - every key is joined
        raise AssertionError(f"{name!r} was not joined along the observations")

    def swap(self) -> None:
        """Link every new dataset under its key, in place of the previous one."""
        for name, dataset in self._new.items():
            backup = name + _BACKUP_SUFFIX
            if name in self._obsm:
                self._obsm.move(name, backup)
            try:
                self._obsm[name] = dataset
            except BaseException:
                if backup in self._obsm:
                    self._obsm.move(backup, name)
                raise
            if backup in self._obsm:
                del self._obsm[backup]
