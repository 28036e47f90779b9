"""Counts that stay in their ``.h5ad`` file: each worker reads its own rows only.

With ``own_local_params=True`` worker r trains on its block of observations
(:mod:`pyro_distributed.integrations.scvi.anndata` cuts scvi-tools' loaders to it),
so the counts of every other block need never enter its memory. Opened with
:func:`read_h5ad_by_rows`, an AnnData keeps its annotations (``obs``,
``var``, ``obsm``, ...) in memory and its count matrices (``X`` and every
layer, CSR on disk) in the file, as :class:`RowsOnDisk`: rows are read when
a loader asks for them, and nothing else is. scvi-tools takes such a matrix
as it takes a backed one (it is registered as ``anndata.abc.CSRDataset``).

Unlike ``anndata.read_h5ad(path, backed="r")``, the matrix also answers
``sum(axis)``, streamed over blocks of rows: cell2location's constructor
reads the mean of the spots' total counts from ``X.sum(1)``, which a backed
AnnData cannot give. Row sums are computed row by row as scipy computes
them, so they equal the in-memory CSR matrix's bitwise.

What each worker reads is counted (``rows_read``, ``bytes_read``,
``row_span`` of :class:`RowsOnDisk`), apart from the rows that sums stream
past (``rows_streamed``), so that a run can show which rows it materialised.

Example::

    adata = read_h5ad_by_rows("visium_hd.h5ad")     # on every worker
    Cell2location.setup_anndata(adata, batch_key="sample")
    model = Cell2location(adata, cell_state_df=signatures, N_cells_per_location=8)
    model.train(max_epochs=..., strategy=PyroDistributedStrategy(own_local_params=True))
    # each worker read its block of spots only: adata.X.row_span == block_range(n)

.. warning::
    Every worker opens the same file, so it must be on storage that every
    host reads (or copied to each). The file must not change while it is
    open.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...checks import check_path

__all__ = ["RowsOnDisk", "read_h5ad_by_rows"]

# Rows per block when a sum streams over the matrix: a few MB of counts at
# Visium HD's density, whatever the number of rows.
STREAM_ROWS = 8192

# The annotations read into memory; X and the layers stay in the file.
_IN_MEMORY = ("obs", "var", "obsm", "varm", "obsp", "varp", "uns")


class RowsOnDisk:
    """A CSR matrix in an HDF5 file, read by rows on demand.

    Indexing reads the rows asked for (in any order, repeats allowed) and
    returns a ``scipy.sparse.csr_matrix``; ``sum(axis)`` streams over blocks
    of :data:`STREAM_ROWS` rows. Only ``indptr`` (one integer per row and
    one more) is held in memory.

    :param path: the ``.h5ad`` (or any HDF5) file.
    :param key: the group of the CSR matrix in it, ``"X"`` or
        ``"layers/<name>"``.

    Counters, since opening or :meth:`reset_counts`: ``rows_read`` (rows
    returned by indexing, repeats included), ``bytes_read`` (their values
    and column indices), ``row_span`` (``(lowest, highest + 1)`` of those
    rows, ``None`` before any), ``largest_read`` (the most rows one indexing
    returned: what a loader's batch held at once) and ``rows_streamed``
    (rows that sums read and dropped).

    Example::

        counts = RowsOnDisk("visium_hd.h5ad")
        counts[[7, 3]]          # rows 7 and 3, in that order, as CSR
        counts.sum(1).mean()    # mean total count, streamed
        counts.rows_read        # 2
    """

    format = "csr"
    backend = "hdf5"

    def __init__(self, path: str | Path, key: str = "X") -> None:
        check_path("path", path)
        if not isinstance(key, str):
            raise TypeError(f"RowsOnDisk: key must be a str, got {key!r}")
        h5py = importlib.import_module("h5py")
        # What scvi-tools and anndata take as a backed sparse matrix.
        importlib.import_module("anndata.abc").CSRDataset.register(RowsOnDisk)
        self.path, self.key = str(path), key
        self._file = h5py.File(self.path, "r")
        group = self._file[key]
        encoding = group.attrs.get("encoding-type", "array")
        if encoding != "csr_matrix":
            self._file.close()
            where = "adata.X" if key == "X" else f"adata.layers[{key.split('/', 1)[-1]!r}]"
            raise TypeError(
                f"RowsOnDisk reads CSR matrices, but {key!r} in {self.path} is stored as "
                f"{encoding!r}; write it as CSR ({where} = scipy.sparse.csr_matrix({where})) "
                f"and save the file again"
            )
        self._data, self._indices = group["data"], group["indices"]
        self._indptr = np.asarray(group["indptr"][:], dtype=np.int64)
        self.shape: tuple[int, int] = tuple(int(n) for n in group.attrs["shape"])  # type: ignore[assignment]
        self.dtype = np.dtype(self._data.dtype)
        self.rows_read = 0
        self.bytes_read = 0
        self.rows_streamed = 0
        self.largest_read = 0
        self.row_span: tuple[int, int] | None = None

    @property
    def ndim(self) -> int:
        return 2

    def reset_counts(self) -> None:
        """Start counting reads afresh (after set-up, say, before training)."""
        self.rows_read = self.bytes_read = self.rows_streamed = self.largest_read = 0
        self.row_span = None

    def __getitem__(self, index: Any) -> Any:
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.shape[0]))
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (self.shape[0],):
                raise IndexError(f"a row mask of shape {rows.shape} for {self.shape[0]} rows")
            rows = np.flatnonzero(rows)
        rows = rows.astype(np.int64).reshape(-1)
        if len(rows) and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
            raise IndexError(f"rows out of range for a matrix of {self.shape[0]} rows")
        rows = np.where(rows < 0, rows + self.shape[0], rows)
        matrix, nbytes = self._read(rows)
        self.rows_read += len(rows)
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, len(rows))
        if len(rows):
            low, high = int(rows.min()), int(rows.max()) + 1
            span = self.row_span or (low, high)
            self.row_span = (min(span[0], low), max(span[1], high))
        return matrix if _takes_all(columns) else matrix[:, columns]

    def _read(self, rows: np.ndarray) -> tuple[Any, int]:
        """The CSR matrix of ``rows`` (in their order), reading each distinct row
        once, and the bytes read from the file (values and column indices)."""
        sparse = importlib.import_module("scipy.sparse")
        distinct, inverse = np.unique(rows, return_inverse=True)
        pieces_data, pieces_indices, lengths = [], [], []
        for first, stop in _runs(distinct):
            start, end = int(self._indptr[first]), int(self._indptr[stop])
            pieces_data.append(np.asarray(self._data[start:end]))
            pieces_indices.append(np.asarray(self._indices[start:end]))
            lengths.append(np.diff(self._indptr[first : stop + 1]))
        nbytes = sum(piece.nbytes for piece in pieces_data + pieces_indices)
        data = np.concatenate(pieces_data) if pieces_data else np.zeros(0, self.dtype)
        indices = np.concatenate(pieces_indices) if pieces_indices else np.zeros(0, np.int32)
        indptr = np.concatenate([[0], np.cumsum(np.concatenate(lengths) if lengths else [])])
        shape = (len(distinct), self.shape[1])
        read = sparse.csr_matrix((data, indices, indptr.astype(np.int64)), shape=shape)
        if len(distinct) == len(rows) and np.array_equal(distinct, rows):
            return read, nbytes
        return read[inverse], nbytes

    def _blocks(self) -> Iterator[Any]:
        """Consecutive blocks of rows, streamed past: counted in ``rows_streamed``
        alone, apart from the rows that indexing (a loader) reads."""
        for start in range(0, max(self.shape[0], 1), STREAM_ROWS):  # no rows: one empty block
            stop = min(start + STREAM_ROWS, self.shape[0])
            self.rows_streamed += stop - start
            yield self._read(np.arange(start, stop))[0]

    def sum(self, axis: int | None = None, dtype: Any = None) -> Any:
        """Sums as a ``scipy.sparse.csr_matrix``'s ``sum`` gives them, streamed.

        ``axis=1`` (one total per row) equals the in-memory matrix's bitwise;
        ``axis=0`` and ``None`` add the blocks' sums, in another order than
        scipy's, so they may differ from it in the last bits.
        """
        if axis not in (None, 0, 1, -1, -2):
            raise ValueError(f"RowsOnDisk.sum: axis={axis!r}; 0, 1 or None")
        parts = [block.sum(axis=axis, dtype=dtype) for block in self._blocks()]
        if axis in (1, -1):  # scipy's own type (np.matrix), stacked without a copy in between
            return np.concatenate(parts, axis=0)
        return sum(parts[1:], parts[0])  # _blocks yields one block at least

    def to_memory(self) -> Any:
        """Every row, as one in-memory CSR matrix (counted as read)."""
        return self[:]

    def __len__(self) -> int:
        return self.shape[0]

    def __reduce__(self) -> tuple[Any, ...]:
        # A process that receives it (a spawned loader worker, say) opens the file itself.
        return (RowsOnDisk, (self.path, self.key))

    def __repr__(self) -> str:
        return f"RowsOnDisk({self.path!r}, {self.key!r}, shape={self.shape})"


def _takes_all(columns: Any) -> bool:
    return isinstance(columns, slice) and columns == slice(None)


def _runs(sorted_rows: np.ndarray) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` of each run of consecutive rows in ``sorted_rows``."""
    if not len(sorted_rows):
        return
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    for part in np.split(sorted_rows, breaks):
        yield int(part[0]), int(part[-1]) + 1


def read_h5ad_by_rows(path: str | Path) -> Any:
    """An AnnData from ``path`` whose counts stay in the file: ``X`` and every
    layer become :class:`RowsOnDisk`; ``obs``, ``var``, ``obsm``, ``varm``,
    ``obsp``, ``varp`` and ``uns`` are read into memory. ``raw`` is not opened.

    :raises TypeError: if ``X`` or a layer is not stored as CSR.

    Example::

        adata = read_h5ad_by_rows("visium_hd.h5ad")
        adata.X[:10]            # the first ten spots' counts, read now
    """
    check_path("path", path)
    anndata = importlib.import_module("anndata")
    h5py = importlib.import_module("h5py")
    read_elem: Any = importlib.import_module("anndata.io").read_elem
    annotations: dict[str, Any] = {}
    with h5py.File(str(path), "r") as file:
        for key in _IN_MEMORY:
            if key in file:
                annotations[key] = read_elem(file[key])
        layers = list(file["layers"]) if "layers" in file else []
        has_x = "X" in file
    adata = anndata.AnnData(X=RowsOnDisk(path) if has_x else None, **annotations)
    for name in layers:
        adata.layers[name] = RowsOnDisk(path, f"layers/{name}")
    return adata
